"""The run directory ``{output.root}/{mission}/{output.run_name}/``: where it is, the names in it,
and ``run.json``. Its life (the checks, the lock, the start) is ``run_owner.RunDir``'s."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from .. import __version__
from ..artifacts import rollouts_name
from ..stageb.errors import InputError
from ..stageb.inputs import first_lone_surrogate
from .fileio import json_document
from .run_format import FORMAT_VERSION

REPLACED = ".replaced-"  # the old run of an --overwrite, until the new one has started
CANNOT_PREPARE = "cannot prepare the run directory (output.root)"
NAME_MAX_BYTES = 200  # a directory name's bytes; Linux allows 255, the margin is for our own suffixes
ESCAPE = "%"

# engine.info() keys that describe one worker rather than the run (would differ between
# worker counts or reruns); they never reach run.json's provenance.
_WORKER_ONLY_INFO = {"rank", "pid", "index", "threads", "hostname", "load_s", "load_seconds",
                     "elapsed_s", "started_at", "visible_devices", "device_index"}


def safe_name(text: str) -> str:
    """The mission (ticket data, so anything) as one directory name that stays where it is put:
    escaped as ``%XX``, cut with a hash suffix (docs/usage.md, "Run directory names")."""
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
    """Why ``output.run_name`` (the user's, so refused, not escaped) is not a plain name, or None."""
    if name in (".", "..") or "/" in name or "\\" in name:
        return "must be a plain directory name (no '/', '\\', '.' or '..')"
    if not name.isprintable():
        return "must be printable text (no control characters)"
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        return f"must be at most {NAME_MAX_BYTES} bytes"
    return None


def run_dir_path(config, mission: str) -> Path:
    return Path(config.output.root) / safe_name(mission) / config.output.run_name


def check_inside(path: Path, root: str | Path) -> None:
    """Refuse a run directory that resolves (through symbolic links) outside ``output.root``."""
    resolved, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if resolved != top and top not in resolved.parents:
        raise InputError(f"the run directory resolves to {resolved}, outside output.root {top} "
                         "(a symbolic link?)", str(path))


def run_dir_exists(path: Path) -> bool:
    """For ``check``: whether the run directory exists; InputError if it could not be made."""
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
    except OSError as err:
        raise InputError(f"{CANNOT_PREPARE}: {err.strerror or err}", str(path)) from None
    if not existing.is_dir():
        raise InputError(f"{CANNOT_PREPARE}: {existing} is not a folder", str(path))
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{CANNOT_PREPARE}: {existing} is not writable", str(path))
    return existing == path


class RunJson(NamedTuple):
    """``run.json``'s facts known before the workers start (docs/artifacts.md, ``run.json``)."""

    config: Any
    devices: list
    debug: bool
    started_at: str
    argv: list[str] | None
    model_path: str
    chunk_size: int
    profile_hash: str
    tickets_hash: str

    def document(self, worker_info: dict | None = None) -> dict:
        """run.json's content with rank 0's ``engine.info()`` (None: before the workers start).
        Undecodable bytes of ``argv`` (lone surrogates to Python) are shown as U+FFFD."""
        devices = self.devices
        argv = [arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                for arg in (sys.argv if self.argv is None else self.argv)]
        return {
            "tool": {"name": "stageb_pool", "version": __version__, "format": FORMAT_VERSION},
            "config": msgspec.to_builtins(self.config),
            "provenance": self.provenance(worker_info),
            "invocation": {
                "gpus": gpus_spec(devices),
                "workers": len(devices),
                "gpus_per_worker": devices[0].group_size if devices else 1,
                "layout": [{"rank": d.rank, "device": d.name, "gpus": list(d.gpus)} for d in devices],
                "threads": devices[0].threads if devices else None,
                "debug": self.debug,
                "argv": argv,
                "started_at": self.started_at,
            },
        }

    def provenance(self, worker_info: dict | None) -> dict:
        """What produced the results; nothing in it depends on the worker count."""
        # enc_hook=str: plain JSON values even for str subclasses such as torch's TorchVersion
        info = msgspec.to_builtins(worker_info or {}, enc_hook=str)
        info = {k: v for k, v in info.items() if k not in _WORKER_ONLY_INFO}
        return {
            "torch": info.pop("torch", None) or _package_version("torch"),
            "transformers": info.pop("transformers", None) or _package_version("transformers"),
            "python": platform.python_version(),
            "model_path": self.model_path,
            "chunk_size": self.chunk_size,
            "profile_hash": self.profile_hash,
            "tickets_hash": self.tickets_hash,
            "engine": info,
        }


def utc_now() -> str:
    """ISO 8601 UTC timestamp with seconds, e.g. ``2026-11-22T18:03:00Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_timestamp() -> str:
    """Fixed-width UTC time with microseconds for rows' ``timestamp``: a row's byte length never
    depends on the clock."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _package_version(name: str) -> str | None:
    # importlib.metadata reads the installed version without importing the package
    # (the parent must not import torch).
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus_spec(devices) -> str:
    """The ``--gpus`` spec of these devices: ``"cpu:3"``, or every GPU of every group (``"0,1,2,3"``)."""
    if devices and devices[0].kind == "cpu":
        return f"cpu:{len(devices)}"
    return ",".join(str(gpu) for d in devices for gpu in d.gpus)


def encoded(doc, name: str) -> bytes:
    """The bytes of a JSON document the run will write, or an InputError naming the value that is
    not UTF-8: encoded before the run directory is made, so bad input never leaves half of one."""
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
    return Path(run_dir) / rollouts_name(rollout_id)
