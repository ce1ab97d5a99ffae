"""Half precision (bf16, fp16) as kselect measures it per op: how far a candidate's output may be
from the float64 reference.

A task of precision "bf16" or "fp16" (``Task.precision``) is the twin of an fp32 task, measured on
the same seeded data. A candidate reads the fp32 data and may round its input, weights and bias to
the format, multiply and accumulate (in fp32 or wider), and write its output in the format or in
fp32. Its tolerance (``half_tolerance``) is what an exact implementation of that makes on this
data: the op's float64 reference on the rounded input, weights and bias, its largest error
relative to the reference's largest magnitude, plus one unit of output rounding, times a safety
factor for accumulation order and activations computed in the format. The tolerance grows with
the format's unit and with the op's reduction only as far as the data makes it. A candidate
beyond it is invalid, never selected.
"""

from __future__ import annotations

import numpy as np

from kselect.core.contract.opkind import op_kind
from kselect.core.models import activations

HALF_PRECISIONS = ("bf16", "fp16")
# the unit roundoff of each format: half the distance from 1 to the next number (8 and 11
# significant bits)
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
SAFETY_FACTOR = 2.0


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16 (the top 16 bits of float32, round to nearest, ties to
    even), returned as float32. Infinities and NaNs stay what they are."""
    x = np.ascontiguousarray(values, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    lowest_kept = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lowest_kept) >> 16 << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).reshape(np.shape(values))


def round_to_fp16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to IEEE half precision (round to nearest, ties to even), as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float32).astype(np.float16).astype(np.float32)


def round_to(precision: str, values: np.ndarray) -> np.ndarray:
    if precision == "bf16":
        return round_to_bf16(values)
    if precision == "fp16":
        return round_to_fp16(values)
    raise ValueError(f"{precision!r} is not a half precision ({', '.join(HALF_PRECISIONS)})")


def half_tolerance(task, inputs: dict[str, np.ndarray], reference: np.ndarray, precision: str) -> float:
    """Relative error (of the reference's largest magnitude) allowed for a ``precision`` candidate
    of ``task`` on ``inputs``, whose float64 reference output is ``reference``."""
    rounded = dict(inputs)
    for name in ("x", "w", "b"):
        if name in inputs:
            rounded[name] = round_to(precision, inputs[name])
    exact = activations.reference(task.epilogue, op_kind(task.kind).reference(task, rounded))
    scale = max(float(np.max(np.abs(reference))), 1e-12)
    if not np.all(np.isfinite(exact)):  # the data overflows the format (fp16's range ends at 65504)
        return 0.0
    input_rounding = float(np.max(np.abs(exact - reference))) / scale
    return SAFETY_FACTOR * (input_rounding + UNIT_ROUNDOFF[precision])
