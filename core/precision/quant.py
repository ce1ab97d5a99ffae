"""INT8 as kselect measures it per op: the quantization every int8 candidate of a task is given,
and how far its output may be from the float reference.

A task of precision "int8" (``Task.precision``) is measured on the same kind of seeded data as
its fp32 twin. The core derives the quantization parameters from that data, as min-max
calibration would (``QuantParams``): activations asymmetric uint8 (a library running signed int8
activations uses the same scale with zero point minus 128), weights symmetric int8 per output
channel (a per-tensor candidate takes the largest channel scale), the output's range from the
reference (after the activation). An activation that does not fold into the output's clamp (SiLU,
HardSwish, LeakyRelu: anything but Relu and Clip) runs after the integer kernel on the op's
pre-activation output, requantized onto its own range (``pre_scale``), as QDQ graphs do. A
candidate reads them from ``inputs["quant"]``.

Its output is compared with the float64 reference, as every candidate's is, within a tolerance
derived from these steps (``int8_tolerance``): the error an exact implementation of this
quantization makes on this data, per-tensor weights included, plus two output steps for rounding
and fixed-point requantization; with an activation after the requantized kernel, plus twice what
one step of the pre-activation grid, or rounding each of the activation's intermediate tensors
onto its own range, moves the output. An int8 candidate beyond that is invalid, never selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kselect.core.contract.opkind import op_kind
from kselect.core.models import activations
from kselect.core.models.activations import clamp_range

PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # half precision: core/precision/half.py
TWIN_KINDS = ("conv", "deconv", "fc")  # op kinds with reduced-precision (bf16, fp16, int8) twins
INT8_KINDS = TWIN_KINDS
OUTPUT_STEPS = 2.0  # output quantization steps allowed beyond the exact implementation's error


@dataclass
class QuantParams:
    x_scale: float
    x_zero_point: int  # uint8
    w_scales: np.ndarray  # per output channel (symmetric int8, zero point 0; weight_scales_of)
    y_scale: float
    y_zero_point: int  # uint8
    # the op's output before an activation that does not fold into the output clamp (folds_into_output)
    pre_scale: float | None = None
    pre_zero_point: int | None = None  # uint8

    @property
    def w_scale_per_tensor(self) -> float:
        return float(self.w_scales.max())

    def weight_scales(self, w: np.ndarray, per_channel: bool = True):
        """The scales of ``w`` (output channels first), shaped to broadcast against it."""
        return self.w_scales.reshape([-1] + [1] * (w.ndim - 1)) if per_channel else self.w_scale_per_tensor

    def quantized_weights(self, w: np.ndarray, per_channel: bool = True) -> np.ndarray:
        return np.clip(np.round(w / self.weight_scales(w, per_channel)), -127, 127).astype(np.int8)


def weight_scales_of(kind: str, w: np.ndarray, groups: int = 1) -> np.ndarray:
    """Symmetric int8 scales of float weights, one per output channel: conv OIHW and fc (N, K)
    hold them first; a deconv's ONNX weights (C_in, C_out / groups, kH, kW) hold them second,
    within each group."""
    if kind == "deconv":
        cin, cout_g = w.shape[:2]
        largest = np.abs(w).reshape(groups, cin // groups, cout_g, -1).max(axis=(1, 3)).reshape(-1)
    else:
        largest = np.abs(w).reshape(w.shape[0], -1).max(axis=1)
    return (np.maximum(largest, 1e-12) / 127.0).astype(np.float32)


def weight_granularities(kind: str) -> tuple[bool, ...]:
    """Per output channel (True) and per tensor (False) for conv and fc; per tensor only for a
    deconv, whose output channels are not its weights' first axis (``weight_scales`` scales
    along that axis)."""
    return (False,) if kind == "deconv" else (True, False)


def asymmetric_u8(low: float, high: float) -> tuple[float, int]:
    """(scale, zero point) mapping [low, high] (widened to include 0) onto uint8."""
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    scale = (high - low) / 255.0 or 1.0
    return scale, int(np.clip(round(-low / scale), 0, 255))


def quantize(x: np.ndarray, scale: float, zero_point_u8: int, signed: bool = False) -> np.ndarray:
    """``x`` on the uint8 grid of (``scale``, ``zero_point_u8``); ``signed``: the same grid held as
    int8 (zero point minus 128), as libraries with signed activations take it."""
    q = np.clip(np.round(x / scale) + zero_point_u8, 0, 255)
    return (q - 128).astype(np.int8) if signed else q.astype(np.uint8)


def dequantize(q: np.ndarray, scale, zero_point_u8: int = 0, signed: bool = False) -> np.ndarray:
    zero_point = zero_point_u8 - 128 if signed else zero_point_u8
    return ((q.astype(np.float32) - np.float32(zero_point)) * np.float32(scale)).astype(np.float32)


def on_grid(x: np.ndarray, scale: float, zero_point_u8: int) -> np.ndarray:
    """``x`` rounded onto a uint8 grid and back, in float64."""
    return (np.clip(np.round(x / scale) + zero_point_u8, 0, 255) - zero_point_u8) * scale


def on_own_grid(x: np.ndarray) -> np.ndarray:
    """``x`` rounded onto the uint8 grid of its own range (min-max calibration of that tensor)."""
    return on_grid(x, *asymmetric_u8(x.min(), x.max()))


def folds_into_output(epilogue: list) -> bool:
    """Whether an op's activation is a clamp of its output grid (none, one Relu or one Clip), so
    that the int8 op is one integer kernel with nothing after it."""
    return not epilogue or clamp_range(epilogue) is not None


def quant_params(task, inputs: dict[str, np.ndarray], reference: np.ndarray) -> QuantParams:
    x_scale, x_zero_point = asymmetric_u8(inputs["x"].min(), inputs["x"].max())
    w_scales = weight_scales_of(task.kind, inputs["w"], int(task.attrs.get("group", 1)))
    y_scale, y_zero_point = asymmetric_u8(reference.min(), reference.max())
    params = QuantParams(float(x_scale), x_zero_point, w_scales, float(y_scale), y_zero_point)
    if not folds_into_output(task.epilogue):
        pre = op_kind(task.kind).reference(task, inputs)
        pre_scale, params.pre_zero_point = asymmetric_u8(pre.min(), pre.max())
        params.pre_scale = float(pre_scale)
    return params


def int8_tolerance(task, inputs: dict[str, np.ndarray], reference: np.ndarray, params: QuantParams) -> float:
    """Relative error (of the reference's largest magnitude) allowed for an int8 candidate."""
    kind = op_kind(task.kind)
    x = dequantize(quantize(inputs["x"], params.x_scale, params.x_zero_point), params.x_scale, params.x_zero_point)
    worst = rounding = 0.0
    for per_channel in weight_granularities(task.kind):
        w = params.quantized_weights(inputs["w"], per_channel) * params.weight_scales(inputs["w"], per_channel)
        pre = kind.reference(task, {**inputs, "x": x, "w": w})
        if params.pre_scale is None:
            exact = activations.reference(task.epilogue, pre)
            worst = max(worst, float(np.max(np.abs(exact - reference))))
            continue
        # the activation runs on the requantized kernel output
        pre = on_grid(pre, params.pre_scale, params.pre_zero_point)
        exact = activations.reference(task.epilogue, pre)
        one_step = activations.reference(task.epilogue, pre + params.pre_scale)
        each_rounded = activations.reference(task.epilogue, pre, on_own_grid)
        worst = max(worst, float(np.max(np.abs(exact - reference))), float(np.max(np.abs(each_rounded - reference))))
        rounding = max(rounding, float(np.max(np.abs(one_step - exact))), float(np.max(np.abs(each_rounded - exact))))
    scale = max(float(np.max(np.abs(reference))), 1e-12)
    return (worst + OUTPUT_STEPS * (params.y_scale + rounding)) / scale
