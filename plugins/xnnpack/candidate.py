"""The tuning candidate of one conv / fc op built by configured.build (float, and int8.py's
8-bit ones): its pool's worker behaviour set while it runs, its output read back in NCHW."""

from __future__ import annotations

import numpy as np

from kselect.core.contract.library import Candidate
from kselect.plugins.xnnpack import configured, tileshim


class XnnCandidate(Candidate):
    def __init__(self, built: configured.Built, nhwc: bool, flags: int = 0):
        self.built = built
        self.nhwc = nhwc
        self.flags = flags
        shim = tileshim.shim()
        if shim is not None:
            shim.set_flags(flags)  # the pool's worker behaviour while this candidate runs
        self.run = built.run  # no extra Python frame in the timed call

    def output(self) -> np.ndarray:
        y = getattr(self.built, "y_nchw", None)
        if y is not None:
            return y.copy()
        if self.nhwc:
            return np.ascontiguousarray(self.built.y.transpose(0, 3, 1, 2))
        return self.built.y.copy()

    def close(self) -> None:
        self.built.close()
        shim = tileshim.shim()
        if shim is not None:
            shim.set_flags(0)
