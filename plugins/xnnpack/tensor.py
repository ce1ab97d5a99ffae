"""A tensor as the XNNPack executor holds it (executor.py), shared by its builders."""

from __future__ import annotations

import numpy as np


class Tensor:
    """A tensor as the executor stores it: NHWC for 4-D activations, else as in ONNX."""

    def __init__(self, name, shape, array, storage, nhwc: bool, perm=None):
        self.name = name
        self.shape = list(shape)  # ONNX (NCHW) shape
        self.array = array  # stored array (NHWC when nhwc)
        self.storage = storage
        self.nhwc = nhwc
        self.perm = perm  # (C, H, W) when this 2-D tensor is an NHWC tensor flattened in NHWC order
        self.threads = None  # thread count of the op that wrote it
        # 8-bit copies: (signed, scale, uint8 zero point) -> int8 / uint8 array in the stored layout.
        # A tensor an int8 op wrote has one here and no float array until a float op reads it.
        self.q: dict[tuple, np.ndarray] = {}
        self.int8_output = False  # written by an int8 op

    @property
    def stored_shape(self) -> tuple:
        return self.array.shape if self.array is not None else next(iter(self.q.values())).shape
