"""OpenVINO's int8 kernels as its users reach them from ONNX: QuantizeLinear / DequantizeLinear
(QDQ) in the model, which OpenVINO's ONNX frontend reads as quantization and its low-precision
transformations run on integer kernels (the runtime model's precision ``u8`` or ``i8``, primitive
``..._I8``, e.g. ``brgconv_avx512_I8``). Per int8 task a candidate is the op between a dequantize of
its uint8 input and a quantize of its output, on kselect's quantization of the task
(``inputs["quant"]``: asymmetric uint8 activations, symmetric int8 weights per output channel); a
plan's int8 nodes run as the QDQ model onnxruntime.quantization writes from the plan's
calibration ranges, the model OpenVINO's own documentation has users feed it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.measuring.measure import task_model
from kselect.core.plans.plan import int8_nodes
from kselect.core.precision.calibration import nodes_to_quantize, quantize_qdq
from kselect.core.precision.quant import QuantParams, asymmetric_u8, dequantize, quantize

INT8_KINDS = ("conv", "fc")  # OpenVINO runs a quantized ConvTranspose's work in float
COMPUTE_OP_TYPES = ("Conv", "Gemm", "MatMul")  # the ONNX ops of the int8 tasks


def has_int8_form(task) -> bool:
    return task.kind in INT8_KINDS


def single_op_model(task, inputs: dict) -> onnx.ModelProto:
    """The task's one-op model (``task_model``) as x_q (uint8) -> DequantizeLinear -> op, its
    weights int8 per output channel through a DequantizeLinear, -> its activation ->
    QuantizeLinear -> y_q (uint8)."""
    params: QuantParams = inputs["quant"]
    proto = task_model(task, inputs)
    graph = proto.graph
    weights = next(tensor for tensor in graph.initializer if tensor.name == "w")
    w = numpy_helper.to_array(weights)
    graph.initializer.remove(weights)
    graph.initializer.extend([
        numpy_helper.from_array(params.quantized_weights(w), "w_q"),
        numpy_helper.from_array(params.w_scales.astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(len(params.w_scales), np.int8), "w_zero_point"),
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [params.x_scale]),
        helper.make_tensor("x_zero_point", TensorProto.UINT8, [], [params.x_zero_point]),
        helper.make_tensor("y_scale", TensorProto.FLOAT, [], [params.y_scale]),
        helper.make_tensor("y_zero_point", TensorProto.UINT8, [], [params.y_zero_point]),
    ])
    graph.input[0].name = "x_q"
    graph.input[0].type.tensor_type.elem_type = TensorProto.UINT8
    graph.output[0].name = "y_q"
    graph.output[0].type.tensor_type.elem_type = TensorProto.UINT8
    graph.node.insert(0, helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero_point"], ["x"], name="x_dq"))
    graph.node.insert(1, helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero_point"], ["w"], name="w_dq",
                                          axis=0))
    graph.node.append(helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero_point"], ["y_q"], name="y_q"))
    return proto


def quantized_input(inputs: dict) -> np.ndarray:
    params: QuantParams = inputs["quant"]
    return quantize(inputs["x"], params.x_scale, params.x_zero_point)


def dequantized_output(y_q: np.ndarray, params: QuantParams) -> np.ndarray:
    return dequantize(y_q, params.y_scale, params.y_zero_point)


def quantized_model(model, plan, int8_passes: frozenset[str]) -> onnx.ModelProto:
    """The model with the plan's int8 nodes (and the untuned ops between them,
    ``nodes_to_quantize``) in QDQ form, written by onnxruntime.quantization.quantize_static from
    the plan's calibration ranges: uint8 activations, int8 weights per output channel. Only
    convolutions, matrix products and the ops OpenVINO runs on u8 between int8 ops
    (``int8_passes``) are quantized: a quantize after an activation (a SiLU's Sigmoid and Mul)
    keeps the CPU plugin from fusing the activation into the int8 convolution and runs as a
    node of its own, where an activation left in float is fused and its output quantized by the
    convolution itself, as in NNCF's models. For the same reason a convolution's or matrix
    product's own output is not quantized: the quantize comes after the activation that follows
    it (Conv -> Clip -> Q, as NNCF writes it), not before and after it (Conv -> Q/DQ -> Clip ->
    Q/DQ), which rounds the tensor twice and gives the convolution extra post-ops."""
    with tempfile.TemporaryDirectory(prefix="kselect-openvino-int8-") as folder:
        cache, output = Path(folder) / "ranges.json", Path(folder) / "model.int8.onnx"
        cache.write_text(json.dumps(plan.extra["precision"]["ranges"]))
        quantize_qdq(model.proto, output, cache=cache,
                     method=plan.extra["precision"].get("calibration", {}).get("method", "minmax"),
                     nodes_to_quantize=nodes_to_quantize(model, int8_nodes(plan)),
                     op_types=sorted({*COMPUTE_OP_TYPES, *int8_passes}),
                     unquantized_outputs=COMPUTE_OP_TYPES)
        return onnx.load(str(output))


def conversion_model(x: np.ndarray, direction: str) -> tuple[onnx.ModelProto, float, int]:
    """A tensor's side between float and int8 ops as OpenVINO runs it: "in", float -> uint8
    (QuantizeLinear); "out", uint8 -> float (DequantizeLinear); on the tensor's range.
    Returns the model, the scale and the zero point."""
    scale, zero_point = asymmetric_u8(float(x.min()), float(x.max()))
    float_type = helper.make_tensor_value_info
    shape = list(x.shape)
    node = helper.make_node("QuantizeLinear" if direction == "in" else "DequantizeLinear", ["a", "scale", "zero_point"],
                            ["b"], name="side")
    a_type, b_type = (TensorProto.FLOAT, TensorProto.UINT8) if direction == "in" else (TensorProto.UINT8, TensorProto.FLOAT)
    graph = helper.make_graph([node], "side", [float_type("a", a_type, shape)], [float_type("b", b_type, shape)],
                              [helper.make_tensor("scale", TensorProto.FLOAT, [], [float(scale)]),
                               helper.make_tensor("zero_point", TensorProto.UINT8, [], [int(zero_point)])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), float(scale), int(zero_point)
