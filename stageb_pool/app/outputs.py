"""Where a run may write, checked before anything is written: never onto an input. A run writes
inside its run directory, plus the distillation file ``stage_b_distillation.log_chatml_path``
may put elsewhere (docs/usage.md, that key). Every input is resolved (symbolic and hard links):
one inside the run directory (which ``--overwrite`` deletes) is refused, and so is a
distillation file that is an input, a folder or a file the run writes itself (an existing one
is ``run_owner.RunDir``'s to refuse)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import artifacts
from ..stageb.errors import InputError
from ..stageb.prompts import PROFILES_DIR
from .config import input_files

# What a run writes inside its run directory besides the distillation file: files, and folders (all below them).
RUN_FILES = tuple(a.name for a in artifacts.ARTIFACTS if a is not artifacts.DISTILL)


def input_paths(config, config_path: str | None = None) -> list[tuple[str, str]]:
    """``(key, path)`` of every input file or folder of the run."""
    found = input_files(config)
    profile = config.prompt.profile
    found.append(("prompt.profile", profile if os.path.isabs(profile) else str(Path(PROFILES_DIR) / profile)))
    if config_path is not None:
        found.append(("the config file", os.path.abspath(config_path)))
    return found


def check_outputs(config, run_dir: Path, *, config_path: str | None = None) -> None:
    """Refuse (InputError) a run whose outputs could overwrite or delete an input."""
    inputs = input_paths(config, config_path)
    run_real = _real(run_dir)
    for key, path in inputs:
        if _inside(_real(path), run_real):
            raise InputError(f"the input {path} ({key}) lies inside the run directory {run_dir}, which the run "
                             "writes (and --overwrite deletes): move the input or choose another output.root/run_name",
                             str(path))
    chatml = config.stage_b_distillation.log_chatml_path
    if chatml is None:
        return
    where = "stage_b_distillation.log_chatml_path"
    real = _real(chatml)
    if os.path.isdir(real):
        raise InputError(f"{chatml} is a directory, not a file", where)
    # the run creates these: checked before they exist, so the export is refused now, not at the end
    if real == run_real:
        raise InputError(f"{chatml} is the run directory, not a file", where)
    if _inside(run_real, real):
        raise InputError(f"{chatml} is a folder that holds the run directory, not a file", where)
    for key, path in inputs:
        if _same(real, path) or (os.path.isdir(path) and _inside(real, _real(path))):
            raise InputError(f"{chatml} is the input {path} ({key}): the export would overwrite it", where)
    if _inside(real, run_real):
        relative = os.path.relpath(real, run_real)
        first = relative.split(os.sep)[0]
        if relative != artifacts.DISTILL.name and (relative in RUN_FILES or first in artifacts.RUN_FOLDERS):
            raise InputError(f"{chatml} is a file the run itself writes ({relative})", where)


def distillation_file(config) -> str | None:
    """The export's file outside the run directory, or None (no export, or its default file inside)."""
    dist = config.stage_b_distillation
    return dist.log_chatml_path if dist.enabled and dist.distill_size else None


def _real(path) -> str:
    return os.path.realpath(os.fspath(path))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _same(real: str, other: str) -> bool:
    """The same file, also through a hard link (samefile compares device and inode)."""
    if real == _real(other):
        return True
    try:
        return os.path.samefile(real, other)
    except OSError:  # one of them does not exist (yet)
        return False
