"""Building and loading the pthreadpool shim (tileshim.c): compiled with the system C compiler on
first use and loaded (RTLD_GLOBAL) before libpthreadpool and libXNNPACK, so that XNNPack's
parallel loops bind to it (xnnpack_api.py calls ``preload``). Whether it is in the call path is
checked by tileshim.py, which is what the rest of the plugin asks for the shim.

``KSELECT_XNN_TILESHIM=0`` disables it (the ``tile_n`` dimension then disappears).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kselect.core.paths import cache_root

SOURCE = Path(__file__).with_name("tileshim.c")
ENV_DISABLE = "KSELECT_XNN_TILESHIM"


class ShimUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return cache_root() / "xnnpack"


def shim_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"tileshim-{digest}.so"


def build() -> Path:
    """The compiled shim, compiling it first when missing."""
    target = shim_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise ShimUnavailable("no C compiler (gcc/cc) to build the pthreadpool shim")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise ShimUnavailable(f"building the pthreadpool shim failed: {out.stderr.strip()[-300:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ShimUnavailable(f"building the pthreadpool shim failed: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Shim:
    """The loaded shim's control functions."""

    def __init__(self, cdll: ctypes.CDLL, path: Path):
        self.path = path
        self.lib = cdll
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        cdll.kselect_shim_version.restype = ctypes.c_int
        cdll.kselect_shim_calls.restype = ctypes.c_ulonglong
        cdll.kselect_shim_overridden.restype = ctypes.c_ulonglong
        cdll.kselect_shim_last.argtypes = [ctypes.POINTER(u64)]
        cdll.kselect_shim_last.restype = None
        cdll.kselect_shim_reset_last.restype = None
        cdll.kselect_shim_set.argtypes = [vp, vp, sz, sz, sz, sz, ctypes.c_int]
        cdll.kselect_shim_set.restype = ctypes.c_int
        cdll.kselect_shim_remove.argtypes = [vp]
        cdll.kselect_shim_remove.restype = None
        cdll.kselect_shim_clear.restype = None
        cdll.kselect_shim_rules.restype = ctypes.c_int
        cdll.kselect_shim_set_flags.argtypes = [ctypes.c_uint32]
        cdll.kselect_shim_set_flags.restype = None
        cdll.kselect_shim_flags.restype = ctypes.c_uint32
        self.set_flags = cdll.kselect_shim_set_flags  # direct: called once per inference
        cdll.kselect_shim_release.argtypes = [vp]
        cdll.kselect_shim_release.restype = ctypes.c_int
        self.release = cdll.kselect_shim_release  # (pool handle): its workers sleep instead of spinning
        self.verified = False

    def calls(self) -> int:
        return int(self.lib.kselect_shim_calls())

    def overridden(self) -> int:
        return int(self.lib.kselect_shim_overridden())

    def reset_last(self) -> None:
        self.lib.kselect_shim_reset_last()

    def last(self) -> dict | None:
        """The last parallel call with a 2-D tile: dims, task, context, ranges, tiles."""
        out = (ctypes.c_uint64 * 12)()
        self.lib.kselect_shim_last(out)
        dims = int(out[0])
        if dims == 0:
            return None
        return {"dims": dims, "task": int(out[1]), "context": int(out[2]),
                "range": [int(v) for v in out[3:3 + dims]], "tile": [int(out[9]), int(out[10])],
                "tile_used": int(out[11])}

    def set_tile(self, call: dict, tile_new: int, swap: bool = False) -> None:
        """From now on, this operator's parallel call (as recorded in ``call``) runs with column
        tile ``tile_new``, and with the last two tiled dimensions swapped (columns outer) if
        ``swap``."""
        if call["dims"] > 4 and swap:
            raise ValueError("only 2-D to 4-D tiled loops can be reordered")
        if self.lib.kselect_shim_set(call["context"], call["task"], call["range"][-1], call["tile"][0],
                                     call["tile"][1], int(tile_new), int(bool(swap))) != 0:
            raise RuntimeError("pthreadpool shim rule table is full")

    def remove(self, context: int) -> None:
        self.lib.kselect_shim_remove(context)

    def clear(self) -> None:
        self.lib.kselect_shim_clear()

    def rules(self) -> int:
        return int(self.lib.kselect_shim_rules())


_LOADED: Shim | None = None
_REASON = "not loaded"


def preload() -> None:
    """Build and load the shim (RTLD_GLOBAL); called before libpthreadpool / libXNNPACK are
    loaded. Never raises: the reason for a missing shim is kept for ``load_reason``."""
    global _LOADED, _REASON
    if _LOADED is not None:
        return
    if os.environ.get(ENV_DISABLE, "1") == "0":
        _REASON = f"disabled ({ENV_DISABLE}=0)"
        return
    try:
        path = build()
        cdll = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _LOADED = Shim(cdll, path)
        _REASON = "loaded, not verified"
    except (ShimUnavailable, OSError) as exc:
        _REASON = str(exc)


def loaded() -> Shim | None:
    """The shim ``preload`` loaded, verified or not; None when it could not be (``load_reason``)."""
    return _LOADED


def load_reason() -> str:
    return _REASON
