"""The ``stageb-pool`` command: run, check, diff, report and import-config (``--help`` and
docs/usage.md show their options, upstream's launcher flags among them).

Exit codes: 0 done, 1 run failed (a worker error; for diff: the runs differ), 2 bad input
(config, tickets, guidance, arguments), 130 interrupted. Errors are one line on stderr, at
most ``errors.MAX_ERROR_CHARS`` long.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import re
import shlex
import signal
import sys

from .. import __version__
from ..search.fileio import OutputError
from ..search.run_owner import WaitStopped
from ..stageb.errors import InputError, UsageError, capped
from .stop_signals import Terminated, stop_signals_raise_terminated

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
_NUMBER = re.compile(r"[-+]?[0-9.]+(?:e[-+]?[0-9]+)?")  # a number argparse would take for --wait's SECONDS
COMMANDS = ("run", "check", "diff", "report", "import-config")
LOG_LEVELS = ("debug", "info", "warning", "error")
UPSTREAM_LOG_LEVELS = {"logging": "info"}  # upstream's launcher spells info "logging"
log = logging.getLogger("stageb_pool")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the default prints the usage block too)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one config key (value read as YAML); repeatable")


def _add_config(p: argparse.ArgumentParser, *, audit: bool = True) -> None:
    p.add_argument("config", metavar="CONFIG", nargs="?", help="YAML config file (ours or an upstream Stage-B config)")
    p.add_argument("--config", dest="config_flag", metavar="CONFIG", help="the same as CONFIG (upstream's flag)")
    p.add_argument("--upstream-root", metavar="DIR",
                   help="for an upstream Stage-B config: the directory its relative paths are relative to "
                        "(default: the current directory, as upstream's launcher: its repository root)")
    if audit:
        p.add_argument("--audit", "--jump-reflection", dest="audit", action="store_true",
                       help="baseline audit only (same as mode: audit; --jump-reflection is upstream's name)")


def _add_group_size(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus-per-worker", type=int, metavar="N",
                   help="GPUs each worker shards its model over (a judge larger than one GPU): one worker per "
                        "group of N GPUs, contiguous in --gpus order; the GPU count must be a multiple of N "
                        "(default: model.gpus_per_worker, 1)")


def _log_level(text: str) -> str:
    level = text.lower()
    return UPSTREAM_LOG_LEVELS.get(level, level)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stageb-pool", description="Stage-B rule search and audit on N GPUs.",
                     epilog="The word 'run' may be left out: stageb-pool --gpus 0-7 config.yaml")
    parser.add_argument("--version", action="version", version=f"stageb-pool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,check,diff,report,import-config}", parser_class=_Parser)

    run = sub.add_parser("run", help="run the rule search (or the baseline audit with --audit)")
    _add_config(run)
    run.add_argument("--gpus", required=True, metavar="SPEC",
                     help="devices: 0-7, 0,2,5, 0, cpu (one CPU worker) or cpu:N")
    _add_group_size(run)
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run directory from its last completed iteration")
    again.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    run.add_argument("--wait", nargs="?", const=math.inf, default=False, type=_wait_bound, metavar="SECONDS",
                     help="when another run holds the run directory, wait (at most SECONDS) instead of exit 2")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--debug", action="store_true",
                       help="one worker, inline in this process (breakpoints work); upstream's --debug, "
                            "the log level alone, is --log-level debug")
    where.add_argument("--ray", metavar="ADDRESS",
                       help="run the workers as Ray actors across a cluster: auto (the cluster `ray start` "
                            "started), local (a new one on this machine) or HOST:PORT; --gpus is then a GPU count")
    run.add_argument("--log-level", default="info", type=_log_level, choices=LOG_LEVELS,
                     help="logging verbosity on stderr (default: info; debug adds worker tracebacks; "
                          "upstream's 'logging' means info)")
    run.add_argument("--step", choices=["all"], help="accepted for upstream's launcher: its only step, all")
    _add_set(run)

    check = sub.add_parser("check", help="validate a config and its inputs and show what a run would do (no model)")
    _add_config(check)
    check.add_argument("--gpus", metavar="SPEC",
                       help="the devices the run would use: check then prints its workers and their GPU groups "
                            "and whether the model fits one group's GPU memory (nothing touches CUDA)")
    _add_group_size(check)
    check.add_argument("--ray", metavar="ADDRESS",
                       help="as for run: --gpus is then a GPU count (check does not connect to the cluster)")
    _add_set(check)

    imp = sub.add_parser("import-config", help="write an upstream Stage-B config as a stageb-pool config")
    _add_config(imp, audit=False)
    imp.add_argument("-o", "--output", metavar="FILE",
                     help="write to FILE (a new file; relative paths written relative to its folder) instead of "
                          "stdout (absolute paths)")

    diff = sub.add_parser("diff", help="compare two run directories, ignoring the volatile fields")
    diff.add_argument("run_a", metavar="RUN_A")
    diff.add_argument("run_b", metavar="RUN_B")
    diff.add_argument("--max", type=int, default=10, metavar="N", help="differences to show (default 10)")

    report = sub.add_parser("report", help="(re)build a run's report.html from its files")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("-o", "--output", metavar="FILE",
                        help="write to FILE, a new file or a previous report (default: RUN_DIR/report.html; - for stdout)")
    return parser


def _wait_bound(text: str) -> float:
    """``--wait``'s SECONDS, a number above 0; ``""``, a bare ``--wait`` (``_with_default_command``): no bound."""
    seconds = math.inf if text == "" else float(text) if _NUMBER.fullmatch(text) else math.nan
    if not (0 < seconds < math.inf or text == ""):
        raise argparse.ArgumentTypeError(f"SECONDS must be a number above 0, got {text!r}")
    return seconds


def _with_default_command(argv: list[str]) -> list[str]:
    """``stageb-pool --gpus 0 cfg.yaml`` means ``stageb-pool run --gpus 0 cfg.yaml``; a ``--wait`` not
    followed by a number is ``--wait=`` (no bound: the config after it is not its SECONDS)."""
    argv = ["--wait=" if arg == "--wait" and not (i + 1 < len(argv) and _NUMBER.fullmatch(argv[i + 1])) else arg
            for i, arg in enumerate(argv)]
    if not argv or argv[0] in COMMANDS or argv[0] in ("-h", "--help", "--version"):
        return argv
    first = argv[0]
    if not first.startswith("-") and not first.endswith((".yaml", ".yml")) and not os.path.exists(first):
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"commands: {', '.join(COMMANDS)}, or a config file"
        raise UsageError(f"unknown command {first!r}: {hint}", "stageb-pool")
    return ["run", *argv]


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


def config_path(args) -> str:
    """CONFIG, given as the positional argument or with upstream's ``--config``."""
    if args.config and args.config_flag:
        raise UsageError("give the config once: as CONFIG or with --config", f"stageb-pool {args.command}")
    path = args.config or args.config_flag
    if not path:
        raise UsageError("a CONFIG file is needed", f"stageb-pool {args.command}")
    return path


def resume_command(argv: list[str]) -> str:
    """The same arguments with ``--resume``; ``--overwrite`` dropped (it would start again)."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["stageb-pool", *args])


def cmd_run(args) -> int:
    from . import job
    from .plan import plan_command

    with stop_signals_raise_terminated():
        plan = plan_command(config_path(args), args.overrides, audit=args.audit, upstream_root=args.upstream_root,
                            devices=device_request(args), check_prompts=True)
        return job.run_plan(plan, resume=args.resume, overwrite=args.overwrite, wait=args.wait)


def device_request(args):
    from .plan import DeviceRequest

    if args.gpus is None:
        return None
    return DeviceRequest(args.gpus, args.gpus_per_worker, args.ray, debug=getattr(args, "debug", False),
                         command=f"stageb-pool {args.command}")


def cmd_check(args) -> int:
    from .describe import describe
    from .plan import plan_command

    if args.gpus is None and (args.gpus_per_worker is not None or args.ray is not None):
        raise UsageError("--gpus-per-worker and --ray describe the workers of a --gpus spec: give --gpus too",
                         "stageb-pool check")
    path = config_path(args)
    print(describe(plan_command(path, args.overrides, audit=args.audit, upstream_root=args.upstream_root,
                                devices=device_request(args))))
    return EXIT_OK


def cmd_import_config(args) -> int:
    from .config import load_config
    from .config.load import read_config
    from .config_yaml import native_yaml

    source = config_path(args)
    where, _, translation = read_config(source, upstream_root=args.upstream_root)
    if translation is None:
        raise InputError("not an upstream Stage-B config (it has no model.model_name_or_path): it is already "
                         "a stageb-pool config", where)
    load_config(source, upstream_root=args.upstream_root, check_files=False, announce=False)  # a run's checks
    if args.output is None:
        sys.stdout.write(native_yaml(translation, where))
        return EXIT_OK
    out = os.path.abspath(args.output)
    if os.path.lexists(out):
        raise InputError("exists; import-config writes a new file (remove it first)", out)
    return _write_output(out, native_yaml(translation, where, out_dir=os.path.dirname(out)).encode(), "it")


def cmd_diff(args) -> int:
    from .diff import diff_runs, format_differences

    differences = diff_runs(args.run_a, args.run_b, limit=max(1, args.max))
    if not differences:
        print(f"identical (volatile fields aside): {args.run_a} {args.run_b}")
        return EXIT_OK
    print(format_differences(differences, args.run_a, args.run_b))
    return EXIT_FAILED


def cmd_report(args) -> int:
    """To RUN_DIR/report.html, the -o FILE (checked before anything is written: report/output.py) or stdout."""
    from ..artifacts import REPORT
    from ..report import ReportError, check_target, render_report

    out = args.output or os.path.join(args.run_dir, REPORT.name)
    try:
        if out != "-":
            check_target(out, args.run_dir)  # before the page is built: a refusal is quick
        page = render_report(args.run_dir).encode("utf-8")
    except ReportError as err:
        raise InputError(err.message, err.location) from None
    if out == "-":
        sys.stdout.buffer.write(page)
        sys.stdout.flush()
        return EXIT_OK
    return _write_output(os.path.abspath(out), page, "the report")


def _write_output(out: str, data: bytes, what: str) -> int:
    """Write a command's output file, saying so on stderr; one that cannot be written is bad input."""
    from ..search.fileio import atomic_write_bytes

    try:
        atomic_write_bytes(out, data)
    except OSError as err:
        raise InputError(f"cannot write {what}: {err.strerror or err}", out) from None
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    level, command = "info", None
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 must print, not crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        parser = build_parser()
        args = parser.parse_args(_with_default_command(argv))
        if args.command is None:
            parser.print_usage(sys.stderr)
            print("stageb-pool: error: a command or a config is needed (see stageb-pool --help)", file=sys.stderr)
            return EXIT_INPUT
        level, command = getattr(args, "log_level", "info"), args.command
        setup_logging(level)
        commands = {"run": cmd_run, "check": cmd_check, "diff": cmd_diff, "report": cmd_report,
                    "import-config": cmd_import_config}
        return commands[args.command](args)
    except UsageError as err:
        print(capped(str(err)), file=sys.stderr)
        return EXIT_INPUT
    except InputError as err:
        print(capped(f"stageb-pool: error: {err}"), file=sys.stderr)
        return EXIT_INPUT
    except WaitStopped as stop:  # before the run started: nothing to continue (Ctrl-C: no signum, SIGINT)
        print(f"stageb-pool: stopped by {signal.Signals(stop.signum or signal.SIGINT).name} while waiting for pid "
              f"{stop.holder} (--wait): nothing was started", file=sys.stderr)
        return 128 + (stop.signum or signal.SIGINT)
    except KeyboardInterrupt as stop:  # Ctrl-C, or a stop signal (Terminated, or Ray's stand-in for it)
        signum = stop.signum if isinstance(stop, Terminated) else Terminated.received
        if signum is None:
            print("stageb-pool: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        name = signal.Signals(signum).name
        print(f"stageb-pool: stopped by {name}; the workers are stopped; continue with: {resume_command(argv)}",
              file=sys.stderr)
        return 128 + signum  # the shell's convention for a death by that signal
    except OutputError as err:  # disk full, a file size limit: the run directory stays resumable
        print(f"stageb-pool: run failed: {err} (the run can be continued with --resume once fixed)",
              file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError as err:
        # `stageb-pool diff a b | head`: the reader left, nobody wants a message; a run says what broke
        if command not in ("diff", "check", "import-config", "report"):
            print(f"stageb-pool: run failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, exit 1
        return _report_failure(err, level)


def _report_failure(err: Exception, level: str) -> int:
    from ..pool import PoolError

    if isinstance(err, PoolError):
        # args[0] is the one-line "worker R (device) in method(): cause"; the remote traceback only with debug
        first = str(err.args[0] if err.args else err).strip().splitlines()
        print(f"stageb-pool: run failed: {first[0] if first else type(err).__name__}", file=sys.stderr)
        remote = getattr(err, "remote_traceback", None)
        if level == "debug" and remote:
            print(remote.rstrip(), file=sys.stderr)
        elif remote:
            print("stageb-pool: (the worker's traceback is shown with --log-level debug)", file=sys.stderr)
        return EXIT_FAILED
    # A bug, not bad input: the traceback is what a bug report needs.
    log.exception("internal error")
    print(f"stageb-pool: internal error: {type(err).__name__}: {err}", file=sys.stderr)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
