"""The "convert" op kind: one side of a tensor's change of form between two ops of a plan (a
layout, a library's runner boundary, or float <-> int8), measured like a kernel so the planners
can count it (core/cross_library/conversions.py makes the tasks; ``Library.conversion`` and
``Library.measure_conversion`` are how a library runs one).

A conversion never computes: its reference is its input, and what it may change is rounding
(float) or the 8-bit grid (an int8 label), whatever library runs it.
"""

from __future__ import annotations

import numpy as np

from kselect.core.contract.labels import Label
from kselect.core.contract.opkind import OpKind
from kselect.core.errors import KselectError

# A conversion moves values, it never computes: anything beyond float rounding noise is wrong.
CONVERSION_TOLERANCE = 1e-6
# Into or out of int8 (the label "<library>:int8") a tensor is rounded to its uint8 grid: at most
# half a step of its range, i.e. 1/255 of its largest magnitude.
INT8_CONVERSION_TOLERANCE = 1.01 / 255


class ConvertKind(OpKind):
    """Tasks made by ``conversion_task(label, direction, shape)``: ``attrs`` holds the label and
    the direction ("in": NCHW into the label's form, "out": back to NCHW)."""

    name = "convert"
    onnx_ops = ()  # never read from a graph: the planners make these tasks between ops

    def read(self, model, node):
        return "a conversion is made by the planner, not read from the graph"

    def macs(self, op) -> int:
        return 0

    def inputs(self, task, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal(task.input_shape, dtype=np.float32)}

    def reference(self, task, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return inputs["x"].astype(np.float64)

    def onnx_op(self, task, inputs, output):
        raise KselectError("a conversion is measured through its library's measure_conversion, not as an ONNX op")

    def describe(self, task) -> str:
        return f"{task.attrs['direction']} {task.attrs['label']}"

    def tolerance(self, task) -> float:
        return INT8_CONVERSION_TOLERANCE if Label(task.attrs["label"]).is_int8 else CONVERSION_TOLERANCE

    def measure(self, library, task, config: dict, inputs: dict[str, np.ndarray], settings) -> dict:
        return library.measure_conversion(task.attrs["label"], task.attrs["direction"], inputs["x"], settings)
