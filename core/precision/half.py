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

Some kernels accumulate in the format itself, rounding the running sum to it after every
multiply-add (XNNPack's f16 kernels; FP16 arithmetic on Arm): a library says so for a precision
in ``Library.accumulates_in_half``, and its candidates are also allowed what that rounding makes on
this data (``accumulation_error``), which grows with the square root of the reduction.
"""

from __future__ import annotations

import dataclasses
import math

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


def half_tolerance(task, inputs: dict[str, np.ndarray], reference: np.ndarray, precision: str,
                   accumulates_in_format: bool = False) -> float:
    """Relative error (of the reference's largest magnitude) allowed for a ``precision`` candidate
    of ``task`` on ``inputs``, whose float64 reference output is ``reference``;
    ``accumulates_in_format``: its kernels round the running sum to the format after every
    multiply-add, and what that makes on this data is allowed too."""
    rounded = dict(inputs)
    for name in ("x", "w", "b"):
        if name in inputs:
            rounded[name] = round_to(precision, inputs[name])
    exact = activations.reference(task.epilogue, op_kind(task.kind).reference(task, rounded))
    scale = max(float(np.max(np.abs(reference))), 1e-12)
    if not np.all(np.isfinite(exact)):  # the data overflows the format (fp16's range ends at 65504)
        return 0.0
    input_rounding = float(np.max(np.abs(exact - reference))) / scale
    accumulation = accumulation_error(task, rounded, precision) / scale if accumulates_in_format else 0.0
    return SAFETY_FACTOR * (input_rounding + accumulation + UNIT_ROUNDOFF[precision])


def accumulation_error(task, inputs: dict[str, np.ndarray], precision: str) -> float:
    """The largest error, over the op's outputs, that rounding each output's running sum to
    ``precision`` after every multiply-add makes on ``inputs`` (already in the format), as
    expected (``expected_largest``).

    One output's sum starts at its bias b and adds its K products in some order; a rounding
    moves the running sum s by half an ulp at most, evenly spread, so by a variance of
    u^2 s^2 / (8 ln 2) on average over a binade (u: the unit roundoff), independently of the
    others. With the products in a random order, given their sum m and the sum q of their
    squares (the op on the squared input and weights), the running sums' squares add up to
    K b^2 + (K+1) b m + (K+1)(2K+1) m^2 / (6K) + K (K+1) v / 6 in expectation, v = q / K - (m / K)^2
    their spread (the sums of a random walk tied to its end). An fc's alpha and beta are folded
    into its weights and bias first, as a kernel sums them. Measured on XNNPack's f16 kernels
    (3x3 and 1x1 convolutions, K = 144 to 4608, 1568 to 25088 outputs): each output's error is
    within 2% of that standard deviation on average (root mean square), and the largest one 0.8
    to 1.0 times this level."""
    kind = op_kind(task.kind)
    task, inputs = _folded(task, inputs)
    x, w = (np.asarray(inputs[name], np.float64) for name in ("x", "w"))
    sums = kind.reference(task, {"x": x, "w": w})
    bias = kind.reference(task, {"x": x, "w": w, "b": inputs["b"]}) - sums if "b" in inputs else 0.0
    squares = kind.reference(task, {"x": x * x, "w": w * w})
    count = np.rint(kind.reference(task, {"x": np.ones_like(x), "w": np.ones_like(w)}))
    terms = np.maximum(count, 1)
    spread = np.maximum(squares / terms - (sums / terms) ** 2, 0.0)
    walked = (count * bias ** 2 + (count + 1) * bias * sums + (count + 1) * (2 * count + 1) * sums ** 2 / (6 * terms)
              + count * (count + 1) * spread / 6)
    variance = np.where(count > 0, UNIT_ROUNDOFF[precision] ** 2 * np.maximum(walked, 0.0) / (8 * math.log(2)), 0.0)
    return expected_largest(np.sqrt(variance))


def _folded(task, inputs: dict[str, np.ndarray]):
    """The task and inputs with an fc's alpha and beta folded into its weights and bias."""
    if "alpha" not in task.attrs:
        return task, inputs
    folded = {**inputs, "w": np.asarray(inputs["w"], np.float64) * task.attrs["alpha"]}
    if "b" in inputs:
        folded["b"] = np.asarray(inputs["b"], np.float64) * task.attrs.get("beta", 1.0)
    return dataclasses.replace(task, attrs={**task.attrs, "alpha": 1.0, "beta": 1.0}), folded


def expected_largest(deviations: np.ndarray) -> float:
    """The largest of independent centred normal errors of these standard deviations, as
    expected: the level t at which the Gaussian tail bound puts half an error beyond it,
    sum(exp(-t^2 / (2 s^2))) = 1/2 (found by bisection; s sqrt(2 ln 2) for one error)."""
    s = np.asarray(deviations, np.float64).ravel()
    s = s[s > 0]
    if not s.size:
        return 0.0
    low, high = 0.0, float(s.max()) * math.sqrt(2 * math.log(2 * s.size + 1))
    for _ in range(50):
        level = (low + high) / 2
        if np.sum(np.exp(-level * level / (2 * s * s))) > 0.5:
            low = level
        else:
            high = level
    return high
