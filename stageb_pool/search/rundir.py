"""The run directory ``{output.root}/{mission}/{output.run_name}/`` and ``run.json``.

A run never silently deletes an earlier run: an existing directory is refused unless the
user asked to ``--overwrite`` it (replaced) or to ``--resume`` it (kept; the caller checks
that the config and tickets still match). The refusal happens before anything on disk is
touched, and the caller holds the directory's lock (``rundir_lock``) while it prepares it.

``--overwrite`` is all or nothing: the old directory is renamed aside to a hidden sibling
(``.{run_name}.replaced-XXXXXXXX``, same folder, so the rename is atomic), the new one is
made, and the old one is deleted only once the new run's first files are written
(``RunDirStart.commit``). If the rename or the new folder fails, the old run is where it
was; if only the final deletion fails, the new run goes on and a warning names the leftover.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import msgspec

from .. import __version__
from ..artifacts import RUN, RUN_FOLDERS, rollouts_name
from ..stageb.errors import InputError
from ..stageb.inputs import first_lone_surrogate
from .fileio import TMP_SUFFIX, json_document, remove
from .run_format import FORMAT_VERSION

REPLACED = ".replaced-"  # the old run of an --overwrite, until the new one has started

log = logging.getLogger("stageb_pool")

# engine.info() keys that describe one worker rather than the run (would differ between
# worker counts or reruns); they never reach run.json's provenance.
_WORKER_ONLY_INFO = {"rank", "pid", "index", "threads", "hostname", "load_s", "load_seconds",
                     "elapsed_s", "started_at", "visible_devices", "device_index"}


NAME_MAX_BYTES = 200  # a directory name's bytes; Linux allows 255, the margin is for our own suffixes
ESCAPE = "%"


def safe_name(text: str) -> str:
    """``text`` as one directory name that stays where it is put (docs/usage.md).

    The mission comes from ticket data, so it may hold anything: ``/``, ``\\``, ``%``,
    control characters and every other non-printable character are escaped as ``%XX`` per
    UTF-8 byte; ``.`` and ``..`` become ``%2E`` and ``%2E%2E``; a name over
    ``NAME_MAX_BYTES`` bytes is cut at a character boundary and ends in ``~`` plus 12 hex
    digits of the sha256 of ``text``, so two long missions never share a directory.
    Printable text (Chinese included) is kept as it is; an empty text is ``%``."""
    if not text:
        return ESCAPE
    pieces = [ch if ch.isprintable() and ch not in "/\\" + ESCAPE else _escaped(ch) for ch in text]
    name = "".join(pieces)
    if name in (".", ".."):
        return _escaped(".") * len(name)
    if len(name.encode("utf-8")) <= NAME_MAX_BYTES:
        return name
    suffix = "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    kept, size = [], len(suffix)
    for piece in pieces:
        size += len(piece.encode("utf-8"))
        if size > NAME_MAX_BYTES:
            break
        kept.append(piece)
    return "".join(kept) + suffix


def _escaped(ch: str) -> str:
    return "".join(f"{ESCAPE}{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def run_name_problem(name: str) -> str | None:
    """Why ``output.run_name`` (chosen by the user, so refused rather than escaped) is not a
    plain directory name, or None."""
    if name in (".", "..") or "/" in name or "\\" in name:
        return "must be a plain directory name (no '/', '\\', '.' or '..')"
    if not name.isprintable():
        return "must be printable text (no control characters)"
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        return f"must be at most {NAME_MAX_BYTES} bytes"
    return None


def run_dir_path(config, mission: str) -> Path:
    """``{output.root}/{safe_name(mission)}/{output.run_name}``"""
    return Path(config.output.root) / safe_name(mission) / config.output.run_name


def check_inside(path: Path, root: str | Path) -> None:
    """Refuse a run directory that resolves (through symbolic links) outside ``output.root``."""
    resolved, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if resolved != top and top not in resolved.parents:
        raise InputError(f"the run directory resolves to {resolved}, outside output.root {top} "
                         "(a symbolic link?)", str(path))


def check_folders(run_dir: Path) -> None:
    """Refuse (InputError, located at the folder) a folder the run writes into (``snapshots``,
    ``rollouts``, ``reflection_cache``) that is a symbolic link or not a folder: its files
    would be written, and snapshots pruned, outside the run. Refused rather than replaced:
    what the link points to may be someone's data, and the user knows where it should go."""
    for name in RUN_FOLDERS:
        folder = Path(run_dir) / name
        if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
            what = "a symbolic link" if folder.is_symlink() else "not a folder"
            raise InputError(f"{name} in the run directory is {what}: a run writes only into real folders "
                             "inside it (replace it by a folder holding its files)", str(folder))


class RunDirStart:
    """A prepared run directory; after an ``--overwrite``, the old run moved aside (``aside``)
    until ``commit`` (the new run's first files are written) or ``roll_back`` (they could not
    be)."""

    def __init__(self, path: Path, aside: Path | None = None):
        self.path = path
        self.aside = aside

    def commit(self) -> Path | None:
        """Delete the replaced run; returns the leftover folder (and logs a warning naming it)
        when that fails: the new run goes on, the leftover is the user's to delete."""
        aside, self.aside = self.aside, None
        if aside is None:
            return None
        try:
            shutil.rmtree(aside)
        except OSError as err:
            log.warning("--overwrite: the new run is in place, but the old run could not be deleted completely "
                        "(%s): what is left of it is in %s; delete it by hand", err.strerror or err, aside)
            return aside
        return None

    def roll_back(self) -> bool:
        """Put the replaced run back (the new run's start failed); returns whether it is back.
        Logs where the old run is either way."""
        aside, self.aside = self.aside, None
        if aside is None:
            return False
        try:
            shutil.rmtree(self.path, ignore_errors=True)
            os.rename(aside, self.path)
        except OSError as err:
            log.error("--overwrite failed: the old run could not be put back (%s); it is intact in %s",
                      err.strerror or err, aside)
            return False
        log.error("--overwrite failed: the old run is back, unchanged, in %s", self.path)
        return True


def prepare_run_dir(path: str | Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Create a fresh run directory, or (when asked) replace or keep an existing one; the
    old run of an ``--overwrite`` is deleted at once (``start_run_dir`` keeps it until the
    caller commits)."""
    start = start_run_dir(path, overwrite=overwrite, resume=resume)
    start.commit()
    return start.path


def start_run_dir(path: str | Path, *, overwrite: bool = False, resume: bool = False) -> RunDirStart:
    """Create a fresh run directory, or (when asked) replace or keep an existing one.

    Raises InputError, before touching anything, when the directory exists and neither
    ``overwrite`` nor ``resume`` is set, when both are set, when there is nothing to resume,
    or when ``overwrite`` would delete a directory that is not a stageb-pool run; and, located
    at the path, when the file system refuses (permissions, a name over the OS limit, a file
    where a folder should be), saying whether an old run was changed (never)."""
    path = Path(path)
    check_preparable(path, overwrite=overwrite, resume=resume)
    if resume:
        return RunDirStart(path)
    where = "cannot prepare the run directory (output.root)"
    if not path.is_dir():
        try:
            path.mkdir(parents=True)
        except OSError as err:
            raise InputError(f"{where}: {err.strerror or err}", str(path)) from None
        return RunDirStart(path)
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}{REPLACED}", dir=path.parent))
    except OSError as err:
        raise InputError(f"{where}: cannot make room to move the old run aside ({err.strerror or err}); "
                         "the old run is unchanged", str(path)) from None
    try:
        os.rename(path, aside)  # a directory renames onto an empty one: atomic, same folder
    except OSError as err:
        os.rmdir(aside)
        raise InputError(f"{where}: cannot move the old run aside ({err.strerror or err}); the old run is "
                         "unchanged", str(path)) from None
    try:
        path.mkdir()
    except OSError as err:
        os.rename(aside, path)
        raise InputError(f"{where}: cannot make the new run directory ({err.strerror or err}); the old run is "
                         "back, unchanged", str(path)) from None
    return RunDirStart(path, aside)


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files (``.<name>.<random>.tmp``) an atomic write leaves when the
    process is killed in the middle of it; a resumed run is then file for file the same as an
    uninterrupted one."""
    stale = sorted(p for p in Path(run_dir).rglob(f".*{TMP_SUFFIX}") if p.is_file())
    for p in stale:
        remove(p)
    return stale


def run_dir_exists(path: Path) -> bool:
    """For ``check``: whether the run directory exists, after making sure it could be made
    (InputError, located at the path, when the file system would refuse it)."""
    where = "cannot prepare the run directory (output.root)"
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
    except OSError as err:
        raise InputError(f"{where}: {err.strerror or err}", str(path)) from None
    if not existing.is_dir():
        raise InputError(f"{where}: {existing} is not a folder", str(path))
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{where}: {existing} is not writable", str(path))
    return existing == path


def check_preparable(path: Path, *, overwrite: bool, resume: bool) -> None:
    """``start_run_dir``'s refusals, touching nothing: called before the lock is taken (so
    a refused run leaves no lock file behind) and again under it."""
    if overwrite and resume:
        raise InputError("--overwrite and --resume exclude each other: choose one", str(path))
    try:
        _check(path, overwrite=overwrite, resume=resume)
    except OSError as err:
        raise InputError(f"cannot prepare the run directory (output.root): {err.strerror or err}", str(path)) from None


def _check(path: Path, *, overwrite: bool, resume: bool) -> None:
    if path.exists() and not path.is_dir():
        raise InputError("the run directory path exists and is not a directory", str(path))
    exists = path.is_dir()
    if resume:
        if not exists:
            raise InputError("nothing to resume: the run directory does not exist (drop --resume to start it)", str(path))
        return
    if exists:
        if not overwrite:
            raise InputError(
                "the run directory already exists: pass --overwrite to replace it or --resume to continue it",
                str(path),
            )
        if any(path.iterdir()) and not (path / RUN.name).exists():
            raise InputError(
                f"refusing to --overwrite a non-empty directory without {RUN.name}: it does not look like a stageb-pool run",
                str(path),
            )


def utc_now() -> str:
    """ISO 8601 UTC timestamp with seconds, e.g. ``2026-11-22T18:03:00Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_timestamp() -> str:
    """Fixed-width UTC time with microseconds for artifact rows' ``timestamp`` (the same
    format as the rule search's rows; a row's byte length never depends on the clock)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _package_version(name: str) -> str | None:
    # importlib.metadata reads the installed version without importing the package
    # (the parent must not import torch).
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(*, worker_info: dict | None, model_path: str, chunk_size: int,
               profile_hash: str, tickets_hash: str) -> dict:
    """What produced the results: library versions, the model, the device kind and dtype
    (from rank 0's ``engine.info()``), chunk size and input hashes. Nothing in it depends
    on the worker count."""
    # enc_hook=str: plain JSON values even for str subclasses such as torch's TorchVersion
    info = msgspec.to_builtins(worker_info or {}, enc_hook=str)
    info = {k: v for k, v in info.items() if k not in _WORKER_ONLY_INFO}
    return {
        "torch": info.pop("torch", None) or _package_version("torch"),
        "transformers": info.pop("transformers", None) or _package_version("transformers"),
        "python": platform.python_version(),
        "model_path": model_path,
        "chunk_size": chunk_size,
        "profile_hash": profile_hash,
        "tickets_hash": tickets_hash,
        "engine": info,
    }


def gpus_spec(devices) -> str:
    """The ``--gpus`` spec that gives these devices, e.g. ``"cpu:3"`` or ``"0,2,5"`` (every
    GPU of every group: ``"0,1,2,3"`` for two workers of two GPUs)."""
    if devices and devices[0].kind == "cpu":
        return f"cpu:{len(devices)}"
    return ",".join(str(gpu) for d in devices for gpu in d.gpus)


def worker_layout(devices) -> list[dict]:
    """Each worker's rank and the GPUs it holds (its group; [] on CPU), for run.json and
    ``check``: ``[{"rank": 0, "device": "cuda:0,1", "gpus": [0, 1]}, ...]``."""
    return [{"rank": d.rank, "device": d.name, "gpus": list(d.gpus)} for d in devices]


def run_json_document(*, config, provenance: dict, devices, workers: int, debug: bool, started_at: str,
                      argv: list[str] | None = None) -> dict:
    """``run.json``'s content. ``invocation`` is volatile (differs between worker counts and
    reruns); ``config`` is the resolved config; undecodable bytes of ``argv`` (Python keeps
    them as lone surrogates) are shown as U+FFFD."""
    argv = [arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            for arg in (sys.argv if argv is None else argv)]
    return {
        "tool": {"name": "stageb_pool", "version": __version__, "format": FORMAT_VERSION},
        "config": msgspec.to_builtins(config),
        "provenance": provenance,
        "invocation": {
            "gpus": gpus_spec(devices),
            "workers": workers,
            "gpus_per_worker": devices[0].group_size if devices else 1,
            "layout": worker_layout(devices),
            "threads": devices[0].threads if devices else None,
            "debug": debug,
            "argv": argv,
            "started_at": started_at,
        },
    }


def encoded(doc, name: str) -> bytes:
    """The bytes of a JSON document the run is about to write, or an InputError naming it when
    a value cannot be written (text with a lone surrogate is not UTF-8): encoded before the
    run directory is created, so bad input never leaves a half-made directory behind."""
    try:
        return json_document(doc)
    except (UnicodeEncodeError, msgspec.EncodeError) as err:
        found = first_lone_surrogate(doc)
        if found is None:
            raise InputError(f"cannot be written: a value is not valid text ({err})", name) from None
        path, text = found
        key = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".") or "the document"
        raise InputError(f"cannot be written: {key} is not valid text ({text!r}: a lone surrogate, e.g. a path "
                         "whose bytes are not UTF-8)", name) from None


def rollouts_path(run_dir: str | Path, rollout_id: str) -> Path:
    """``rollouts/<rollout_id>.jsonl`` (``artifacts.rollouts_name``) in the run directory."""
    return Path(run_dir) / rollouts_name(rollout_id)
