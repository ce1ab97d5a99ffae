"""INT8 in ACL's quantized forms (20.08 and 24.11): a conv (NEGEMMConvolutionLayer /
NEConvolutionLayer, or NEDepthwiseConvolutionLayer) or fc (NEFullyConnectedLayer) on quantized tensors.

Activations (input and output) are QASYMM8 or QASYMM8_SIGNED, weights QSYMM8_PER_CHANNEL (one
scale per output channel) or, per tensor, of the activations' own type (QASYMM8 weights carry
zero point 128, QASYMM8_SIGNED zero point 0) or, on 24.11 under QASYMM8 activations, per-tensor
QASYMM8_SIGNED (``per-tensor-signed``), bias S32 at scale x_scale * w_scale. The
parameters come from the measuring core (``inputs["quant"]``, core/precision/quant.py: uint8 asymmetric
activations, symmetric int8 weights); QASYMM8_SIGNED uses the same scales with zero points minus
128. Data are quantized here, outside the timed work, and sent to the runner as raw integer
files; the runner answers with the quantized output, dequantized here.

What ACL 20.08's validate() accepts (measured, README.md "int8"): dense convs through the GEMM
method only (Direct, Winograd and FFT take F16/F32 only; NEConvolutionLayer picks GEMM), both
layouts, both activation types, per-channel or per-tensor weights; depthwise convs with
per-channel weights or per-tensor weights of the activations' type; fc with per-tensor weights of
the activations' type only (NEFullyConnectedLayer refuses QSYMM8_PER_CHANNEL: "Tensors have
different data types"). Fused activations: RELU, BOUNDED_RELU, LU_BOUNDED_RELU (the output
stage's clamp); ACL would run others as a separate float-range activation step, so such twins
are not ACL int8 tasks.
"""

from __future__ import annotations

import numpy as np

from kselect.core.precision.quant import QuantParams, dequantize, quantize

ACTIVATION_TYPES = ("QASYMM8_SIGNED", "QASYMM8")  # the data type of the input and the output
WEIGHT_GRANULARITY = ("per-channel", "per-tensor")
# Per-tensor QASYMM8_SIGNED weights under QASYMM8 activations: ONNX Runtime's default int8 pairing
# (U8S8). 20.08's GEMM convolution validates the mix and computes it wrong (255 output steps off);
# 24.11 computes it right and refuses the reverse mix in configure(). Offered where ACL computes it.
SIGNED_WEIGHTS = "per-tensor-signed"
SIGNED_WEIGHTS_RIGHT = {"v20.08": False, "v24.11": True}
SIGNED_WEIGHTS_WRONG_IN_2008 = ("ACL 20.08's GEMM convolution validates QASYMM8 activations with per-tensor "
                                "QASYMM8_SIGNED weights and computes them wrong (255 output steps off): not offered")
# ACL's activations a quantized conv / fc applies in its output stage (a clamp in the integer domain)
FUSED = ("RELU", "BOUNDED_RELU", "LU_BOUNDED_RELU")
DEFAULT_ACTIVATIONS = "QASYMM8_SIGNED"  # what Arm NN gives ACL for a TFLite int8 model
DEFAULT_WEIGHTS = "per-channel"


def weight_granularities(acl_version: str) -> tuple[str, ...]:
    """The weights choices of this ACL release (``per-tensor-signed`` where it computes the mix)."""
    return WEIGHT_GRANULARITY + ((SIGNED_WEIGHTS,) if SIGNED_WEIGHTS_RIGHT.get(acl_version, False) else ())


def combos(acl_version: str) -> list[tuple[str, str]]:
    """Every (activation type, weights choice) to validate: signed weights with unsigned
    activations only (with QASYMM8_SIGNED activations they are plain ``per-tensor``)."""
    return [(a, w) for a in ACTIVATION_TYPES for w in weight_granularities(acl_version)
            if not (w == SIGNED_WEIGHTS and a != "QASYMM8")]


def weight_type(activations: str, weights: str) -> str:
    """ACL's data type of the weights for an (activation type, weights choice)."""
    if weights == "per-channel":
        return "QSYMM8_PER_CHANNEL"
    return "QASYMM8_SIGNED" if weights == SIGNED_WEIGHTS else activations


def shift(activations: str) -> int:
    """What QASYMM8_SIGNED subtracts from core/precision/quant.py's uint8 zero points."""
    return -128 if activations == "QASYMM8_SIGNED" else 0


def placeholder_quant(activations: str, weights: str) -> dict:
    """The runner's "quant" for validate(): types only (scales 1, zero points 0; validate() does
    not depend on their values)."""
    return {"input": activations, "weights": weight_type(activations, weights)}


def quantize_activation(x: np.ndarray, scale: float, zero_point_u8: int, activations: str) -> np.ndarray:
    return quantize(x, scale, zero_point_u8, signed=activations == "QASYMM8_SIGNED")


def dequantize_output(q: np.ndarray, params: QuantParams, activations: str) -> np.ndarray:
    return dequantize(q, params.y_scale, params.y_zero_point, signed=activations == "QASYMM8_SIGNED")


def quantized_weights(w: np.ndarray, b: np.ndarray | None, params: QuantParams, activations: str,
                      weights: str, w_type: str | None = None, alpha: float = 1.0,
                      beta: float = 1.0) -> tuple[dict, dict[str, np.ndarray]]:
    """(the runner's "quant" object, the weights and bias as integers) for a conv or fc of float
    weights ``w`` (OIHW, or (N, K) for an fc) and bias ``b`` on ``params``. An fc's ``alpha``
    scales the weights' scales (its sign flips the quantized weights) and its ``beta`` the bias, as
    the fp32 path folds them. ``w_type`` overrides ACL's weights type of a per-tensor choice
    (``weight_type``), e.g. to try the mixed QASYMM8 / QASYMM8_SIGNED pairs 20.08's GEMM convolution
    validates (and computes wrongly)."""
    per_channel = weights == "per-channel"
    channels = w.shape[0]
    w_q = params.quantized_weights(w, per_channel).astype(np.int16)
    if alpha < 0:
        w_q = -w_q
    channel_scales = (params.w_scales if per_channel else np.full(channels, params.w_scale_per_tensor)).astype(np.float64)
    channel_scales = channel_scales * abs(alpha)
    w_type = w_type or weight_type(activations, weights)
    w_zero_point = 128 if w_type == "QASYMM8" else 0
    arrays = {"weights": (w_q + w_zero_point).astype(np.uint8 if w_type == "QASYMM8" else np.int8)}
    if b is not None:
        bias_scale = np.float64(np.float32(params.x_scale)) * channel_scales.astype(np.float32)
        limit = np.iinfo(np.int32)
        arrays["bias"] = np.clip(np.round(b.astype(np.float64) * beta / bias_scale), limit.min, limit.max).astype(np.int32)
    quant = {"input": activations, "weights": w_type,
             "x_scale": float(params.x_scale), "x_zero_point": int(params.x_zero_point) + shift(activations),
             "w_scales": [float(s) for s in (channel_scales if per_channel else channel_scales[:1])],
             "w_zero_point": w_zero_point,
             "y_scale": float(params.y_scale), "y_zero_point": int(params.y_zero_point) + shift(activations)}
    return quant, arrays


def quantized_op(task, inputs: dict, activations: str, weights: str,
                 w_type: str | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(the runner's "quant" object, the arrays to send: input, weights, bias as integers) for the
    task on the core's data and parameters (``quantized_weights``; an fc's alpha and beta from
    its attributes)."""
    params: QuantParams = inputs["quant"]
    fc = task.kind == "fc"
    quant, arrays = quantized_weights(inputs["w"], inputs.get("b"), params, activations, weights, w_type,
                                      alpha=float(task.attrs.get("alpha", 1.0)) if fc else 1.0,
                                      beta=float(task.attrs.get("beta", 1.0)) if fc else 1.0)
    arrays["input"] = quantize_activation(inputs["x"], params.x_scale, params.x_zero_point, activations)
    return quant, arrays


def activation_quant(activations: str, scale: float, zero_point_u8: int) -> dict:
    """The runner's "quant" of a quantize / dequantize step: a tensor of type ``activations``
    on the uint8 grid (``scale``, ``zero_point_u8``)."""
    return {"input": activations, "x_scale": float(scale), "x_zero_point": int(zero_point_u8) + shift(activations)}
