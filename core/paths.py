"""Where kselect keeps what it can make again: ``$KSELECT_CACHE``, by default ``~/.cache/kselect``
(real models, measuring locks, XNNPack's kernel catalog and shim)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KSELECT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kselect"))


def check_can_create(path: Path, what: str, hint: str = "") -> None:
    """Refuses, in one line, a file that could not be written at ``path`` (checked before any work
    whose result would be lost): a file is created and removed in its folder, or in the nearest
    existing parent. ``what`` reads "cannot write {what} {path}"."""
    import tempfile

    from kselect.core.errors import KselectError

    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kselect-write-check-"):
            pass
    except OSError as exc:
        raise KselectError(f"cannot write {what} {path}: {folder} is not writable ({exc.strerror}){hint}") from None
