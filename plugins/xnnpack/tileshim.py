"""The pthreadpool shim (tileshim.c, built and loaded before XNNPack by tileshim_build.py),
verified to be in XNNPack's call path. It lets kselect set the column tile (``tile_n``) of one
operator's parallel loop (the work split across threads) and whether the pools' workers spin.

``KSELECT_XNN_TILESHIM=0`` disables it (the ``tile_n`` dimension then disappears).
"""

from __future__ import annotations

import numpy as np

from kselect.plugins.xnnpack import tileshim_build
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.tileshim_build import Shim, ShimUnavailable

_VERIFY_FAILURE: str | None = None  # why the loaded shim is not in the call path


def verify() -> None:
    """Checks that XNNPack's parallel loops reach the shim (a tiny fully connected op run on the
    calling thread must show up as a recorded 2-D tiled call with its own shapes)."""
    global _VERIFY_FAILURE
    loaded = tileshim_build.loaded()
    if loaded is None or loaded.verified or _VERIFY_FAILURE is not None:
        return
    try:
        op = xa.FullyConnected(np.ones((24, 8), np.float32))
        x = np.ones((3, 8), np.float32)
        before = loaded.calls()
        loaded.reset_last()
        op.run(x)
        last = loaded.last()
        op.close()
        if loaded.calls() == before or last is None or last["range"][-1] != 24 or last["range"][0] != 3:
            raise ShimUnavailable(f"XNNPack's pthreadpool calls do not reach the shim (last call seen: {last})")
        loaded.verified = True
    except Exception as exc:  # the shim is optional: never take XNNPack down with it
        _VERIFY_FAILURE = f"{type(exc).__name__}: {exc}"


def shim() -> Shim | None:
    """The loaded and verified shim, or None (``status()`` says why)."""
    try:
        xa.lib()
    except xa.XNNPackUnavailable:
        return None
    verify()
    loaded = tileshim_build.loaded()
    return loaded if loaded is not None and loaded.verified and _VERIFY_FAILURE is None else None


def status() -> tuple[bool, str]:
    verified = shim()
    if verified is not None:
        return True, f"verified ({verified.path.name})"
    return False, _VERIFY_FAILURE or tileshim_build.load_reason()
