"""Where kselect keeps what it can make again: ``$KSELECT_CACHE``, by default ``~/.cache/kselect``
(real models, measuring locks, XNNPack's kernel catalog and shim)."""

from __future__ import annotations

import os
from pathlib import Path

from kselect.core.errors import KselectError


def cache_root() -> Path:
    return Path(os.environ.get("KSELECT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kselect"))


def check_can_create(path: Path, what: str, hint: str = "", is_folder: bool = False) -> None:
    """Refuses, in one line, a file that could not be written at ``path`` (checked before any work
    whose result would be lost): a file is created and removed in its folder, or in the nearest
    existing parent (``is_folder``: in ``path`` itself when it is a folder). ``what`` reads
    "cannot write {what} {path}"."""
    import tempfile


    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    if is_folder and path.is_dir():
        folder = path
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kselect-write-check-"):
            pass
    except OSError as exc:
        raise KselectError(f"cannot write {what} {path}: {folder} is not writable ({exc.strerror}){hint}") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


# The files the running command reads (its model, record database, plan, calibration data), as
# check_output was told: nothing the command writes may replace one, whatever name a library gives
# its artifacts (plans.plan.write_atomically asks ``refuse_inputs`` before every write).
_inputs_of_this_command: dict[Path, str] = {}


def protect_inputs(reads: dict) -> None:
    """Remember ``reads`` (what it is -> its path) as files this command must never write over."""
    for what, source in reads.items():
        if source is not None and Path(str(source)).expanduser().is_file():
            _inputs_of_this_command[Path(str(source)).expanduser()] = what


def refuse_inputs(path: Path, what: str) -> None:
    """A one-line error if ``path`` is a file this command reads (``protect_inputs``)."""
    if not path.exists():
        return
    for source, source_what in _inputs_of_this_command.items():
        if _same_file(path, source):
            raise KselectError(f"{path} is {source_what} this command reads: writing {what} there would destroy it; "
                               f"give another path")


def check_output(path, option: str, what: str, reads: dict | None = None, kind: str = "a file") -> Path:
    """The one check of a file a command will write, made before any work whose result would be
    lost: a name is given; it is not a file the same command reads (``reads``: what it is ->
    its path, such as ``{"the model": ..., "the record database": ...}``; names that are no
    file, a built-in model or a URL, are passed over); it is a regular file or nothing yet (not
    a folder, a device node, a FIFO); and its folder is writable. Returns it as a Path."""
    if path is None or not str(path).strip():
        raise KselectError(f"{option} '': give a file name for {what}")
    path = Path(path).expanduser()
    protect_inputs(reads or {})
    for source_what, source in (reads or {}).items():
        if source is not None and Path(str(source)).expanduser().is_file() and path.exists() and \
                _same_file(path, Path(str(source)).expanduser()):
            raise KselectError(f"{option} {path} is {source_what} this command reads: writing {what} there would "
                               "destroy it; give another path")
    if path.is_dir():
        raise KselectError(f"{option} {path} is a directory, not {kind}")
    if path.exists() and not path.is_file():
        raise KselectError(f"{option} {path} is not a regular file (a device, FIFO or socket): kselect writes "
                           f"{what} only to a regular file")
    check_can_create(path, f"{what} to")
    return path


def check_output_folder(path, option: str, what: str) -> Path:
    """A folder a command will write files into: a folder or nothing yet, in a writable place."""
    if path is None or not str(path).strip():
        raise KselectError(f"{option} '': give a folder for {what}")
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise KselectError(f"{option} {path} is not a folder: give the folder to write {what} into")
    check_can_create(path, f"{what} to", is_folder=True)
    return path
