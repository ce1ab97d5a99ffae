"""MLAS's int8 kernels as ONNX Runtime reaches them: QDQ graphs (DequantizeLinear -> Conv or Gemm
-> QuantizeLinear), which ONNX Runtime's QDQ transformers fuse into QLinearConv and QGemm on
MLAS's integer GEMMs. Per int8 task a candidate is one such op on already-quantized data (the
timed work is the int8 kernel alone, or, with an activation that does not fold into the output
clamp, the kernel and the activation as the quantizer writes them: QLinearSigmoid and QLinearMul
for SiLU, say); Q and DQ at a boundary with float ops are the conversions
of the label "mlas:int8"; a whole model is quantized with onnxruntime.quantization (int8.py in
core's terms: ``quantized_model``), so the exported plan is the QDQ model a user would write
with ONNX Runtime's own tools."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kselect.core.measuring.measure import task_model
from kselect.core.models.activations import clamp_range
from kselect.core.plans.plan import int8_nodes
from kselect.core.precision.calibration import nodes_to_quantize, quantize_qdq
from kselect.core.precision.quant import QuantParams, dequantize, folds_into_output, quantize

ACTIVATION_TYPES = ("u8", "s8")
WEIGHT_GRANULARITY = ("per-channel", "per-tensor")


def _zero_point(zero_point_u8: int, activations: str) -> tuple[int, int]:
    """(zero point, ONNX element type) of an asymmetric uint8 quantization in ``activations``."""
    if activations == "s8":
        return zero_point_u8 - 128, TensorProto.INT8
    return zero_point_u8, TensorProto.UINT8


def quantize_activation(x: np.ndarray, scale: float, zero_point_u8: int, activations: str) -> np.ndarray:
    return quantize(x, scale, zero_point_u8, signed=activations == "s8")


def dequantize_activation(q: np.ndarray, scale: float, zero_point_u8: int, activations: str) -> np.ndarray:
    return dequantize(q, scale, zero_point_u8, signed=activations == "s8")


def single_op_model(task, inputs: dict, config: dict):
    """The task as x_q -> DequantizeLinear -> op (weights and bias through DequantizeLinear) ->
    its activation -> QuantizeLinear -> y_q, on the parameters in ``inputs["quant"]``; ONNX
    Runtime removes a Relu or Clip there (QDQ activation removal: the clamp is the output grid's).
    Other activations: ``quantized_by_onnxruntime``."""
    if not folds_into_output(task.epilogue):
        return quantized_by_onnxruntime(task, inputs, config)
    params: QuantParams = inputs["quant"]
    activations, per_channel = config["activations"], config["weights"] == "per-channel"
    x_zp, element = _zero_point(params.x_zero_point, activations)
    y_zp, _ = _zero_point(params.y_zero_point, activations)
    w = inputs["w"]
    w_scales = params.w_scales if per_channel else np.array(params.w_scale_per_tensor, np.float32)
    initializers = [
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [params.x_scale]),
        helper.make_tensor("x_zp", element, [], [x_zp]),
        helper.make_tensor("y_scale", TensorProto.FLOAT, [], [params.y_scale]),
        helper.make_tensor("y_zp", element, [], [y_zp]),
        numpy_helper.from_array(params.quantized_weights(w, per_channel), "w_q"),
        numpy_helper.from_array(w_scales.astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(w_scales.shape, np.int8), "w_zp"),
    ]
    axis = {"axis": 0} if per_channel else {}
    nodes = [helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], **axis)]
    op_inputs = ["x", "w"]
    if "b" in inputs:
        bias_scale = (params.x_scale * (params.w_scales if per_channel else np.full(w.shape[0], w_scales))).astype(np.float32)
        b = inputs["b"] * (task.attrs["beta"] if task.kind == "fc" else 1.0)
        initializers += [numpy_helper.from_array(np.round(b / bias_scale).astype(np.int32), "b_q"),
                         numpy_helper.from_array(bias_scale, "b_scale"),
                         numpy_helper.from_array(np.zeros(w.shape[0], np.int32), "b_zp")]
        nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b"], axis=0))
        op_inputs.append("b")
    a = task.attrs
    if task.kind == "conv":
        nodes.append(helper.make_node("Conv", op_inputs, ["y"], kernel_shape=a["kernel"], strides=a["strides"],
                                      pads=a["pads"], dilations=a["dilations"], group=a["group"]))
    else:
        nodes.append(helper.make_node("Gemm", op_inputs, ["y"], transB=1, alpha=a["alpha"]))
    last = "y"
    for step in task.epilogue:  # Relu or Clip (folds_into_output)
        extra = []
        if step[0] == "Clip":
            low, high = clamp_range([step])
            limit = float(np.finfo(np.float32).max)
            initializers += [helper.make_tensor("clip_min", TensorProto.FLOAT, [], [max(low, -limit)]),
                             helper.make_tensor("clip_max", TensorProto.FLOAT, [], [min(high, limit)])]
            extra = ["clip_min", "clip_max"]
        nodes.append(helper.make_node(step[0], [last, *extra], ["y_act"]))
        last = "y_act"
    nodes.append(helper.make_node("QuantizeLinear", [last, "y_scale", "y_zp"], ["y_q"]))
    graph = helper.make_graph(nodes, "int8_op", [helper.make_tensor_value_info("x_q", element, task.input_shape)],
                              [helper.make_tensor_value_info("y_q", element, task.output_shape)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def quantized_by_onnxruntime(task, inputs: dict, config: dict):
    """The op with an activation that does not fold into its output clamp (SiLU, HardSwish,
    LeakyRelu...) as onnxruntime.quantization.quantize_static writes it inside a whole QDQ model:
    the op requantized onto its output's range, then the activation's nodes with Q/DQ where the
    quantizer puts them (ONNX Runtime fuses DQ -> Sigmoid -> Q into QLinearSigmoid, DQ -> Mul -> Q
    into QLinearMul; nodes it does not quantize run in float between DQ and Q), min-max calibrated
    on the task's input. Cut at the input's QuantizeLinear and the output's DequantizeLinear, it
    reads x_q and writes y_q on the core's grids, as every int8 candidate does."""
    import tempfile
    from pathlib import Path

    import onnx


    params: QuantParams = inputs["quant"]
    activations = config["activations"]
    with tempfile.TemporaryDirectory(prefix="kselect-int8-op-") as tmp:
        path = Path(tmp) / "op.int8.onnx"
        quantize_qdq(task_model(task, inputs), path, [{"x": inputs["x"]}],
                     per_channel=config["weights"] == "per-channel", signed_activations=activations == "s8")
        model = onnx.load(str(path))
    graph = model.graph
    enter = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    x_scales, x_quantized = tuple(enter.input[1:3]), enter.output[0]
    graph.node.remove(enter)
    _rename(graph, x_quantized, "x_q")
    leave = next((n for n in graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "y"), None)
    if leave is None:  # the activation's last node stays float (a Div): the next int8 op quantizes its output
        scales = ("kselect_y_scale", "kselect_y_zp")
        graph.node.append(helper.make_node("QuantizeLinear", ["y", *scales], ["y_q"]))
    else:
        scales, y_quantized = tuple(leave.input[1:3]), leave.input[0]
        graph.node.remove(leave)
        _rename(graph, y_quantized, "y_q")
    x_zp, element = _zero_point(params.x_zero_point, activations)
    y_zp, _ = _zero_point(params.y_zero_point, activations)
    kept = [t for t in graph.initializer if t.name not in (*x_scales, *scales)]
    del graph.initializer[:]
    graph.initializer.extend(kept + [
        helper.make_tensor(x_scales[0], TensorProto.FLOAT, [], [params.x_scale]),
        helper.make_tensor(x_scales[1], element, [], [x_zp]),
        helper.make_tensor(scales[0], TensorProto.FLOAT, [], [params.y_scale]),
        helper.make_tensor(scales[1], element, [], [y_zp])])
    del graph.input[:], graph.output[:]
    graph.input.append(helper.make_tensor_value_info("x_q", element, task.input_shape))
    graph.output.append(helper.make_tensor_value_info("y_q", element, task.output_shape))
    return model


def _rename(graph, old: str, new: str) -> None:
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name == old:
                node.input[position] = new
        for position, name in enumerate(node.output):
            if name == old:
                node.output[position] = new


# ONNX Runtime's NHWC transformer runs a QLinearConv with uint8 activations in NHWC on x86 and
# Arm, between Transposes that cancel from one int8 conv to the next inside a model: an int8 op
# is timed reading and writing NHWC, and the transposes are charged where a tensor enters or
# leaves int8 (``boundary_model``).
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def boundary_model(shape, direction: str, scale: float, zero_point_u8: int, activations: str = "u8"):
    """A QuantizeLinear ("in": float -> int8, entering an int8 op) or DequantizeLinear ("out");
    for a 4-D tensor with the transpose into or out of NHWC, where ONNX Runtime runs its int8
    convs (``TO_NHWC``): "in" writes NHWC, "out" reads it."""
    zero_point, element = _zero_point(zero_point_u8, activations)
    source, target = (TensorProto.FLOAT, element) if direction == "in" else (element, TensorProto.FLOAT)
    op = "QuantizeLinear" if direction == "in" else "DequantizeLinear"
    nodes = [helper.make_node(op, ["x", "scale", "zp"], ["y"])]
    x_shape, y_shape = list(shape), list(shape)
    if len(shape) == 4:
        if direction == "in":
            nodes = [helper.make_node(op, ["x", "scale", "zp"], ["q"]), helper.make_node("Transpose", ["q"], ["y"], perm=TO_NHWC)]
            y_shape = [shape[i] for i in TO_NHWC]
        else:
            nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=TO_NCHW), helper.make_node(op, ["t", "scale", "zp"], ["y"])]
            x_shape = [shape[i] for i in TO_NHWC]
    graph = helper.make_graph(
        nodes, "boundary", [helper.make_tensor_value_info("x", source, x_shape)],
        [helper.make_tensor_value_info("y", target, y_shape)],
        [helper.make_tensor("scale", TensorProto.FLOAT, [], [scale]), helper.make_tensor("zp", element, [], [zero_point])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def runs_channels_last(model, options) -> bool:
    """Whether ONNX Runtime's optimised form of a single-op model puts Transposes around it
    (its NHWC transformer took the op)."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="kselect-int8-layout-") as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    return any(node.op_type == "Transpose" for node in optimized.graph.node)


def channels_last(model):
    """The single-op model reading x_q and writing y_q in NHWC: a Transpose to NCHW before it and
    back after it, which ONNX Runtime cancels against the ones its NHWC transformer inserts."""
    graph = model.graph
    x, y = graph.input[0], graph.output[0]
    element = x.type.tensor_type.elem_type
    x_shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    y_shape = [d.dim_value for d in y.type.tensor_type.shape.dim]
    _rename(graph, x.name, "x_nchw")
    _rename(graph, y.name, "y_nchw")
    graph.node.insert(0, helper.make_node("Transpose", ["x_q"], ["x_nchw"], perm=TO_NCHW))
    graph.node.append(helper.make_node("Transpose", ["y_nchw"], ["y_q"], perm=TO_NHWC))
    del graph.input[:], graph.output[:]
    graph.input.append(helper.make_tensor_value_info("x_q", element, [x_shape[i] for i in TO_NHWC]))
    graph.output.append(helper.make_tensor_value_info("y_q", element, [y_shape[i] for i in TO_NHWC]))
    return model


def has_int8_form(task) -> bool:
    """Whether ONNX Runtime runs the op on MLAS's integer kernels once quantized: a 2-D conv
    (QLinearConv) or a fully connected layer (QGemm / MatMulInteger). It runs a quantized
    ConvTranspose or Conv1d in float between a DequantizeLinear and a QuantizeLinear."""
    return task.kind == "fc" or (task.kind == "conv" and not task.conv1d)


def quantized_model(model, plan):
    """The QDQ model of a plan with int8 nodes, written by onnxruntime.quantization.quantize_static
    as a user would call it (QDQ format), from the plan's calibration ranges (its calibration
    cache), with the plan's activation type and weight granularity, quantizing the nodes
    ``nodes_to_quantize`` names (every node when the whole model is int8), with its float convs
    and Gemms kept float (``float_ops_kept_float``)."""
    import json
    import tempfile
    from pathlib import Path

    import onnx


    settings = plan.library_settings.get("mlas", plan.plan_level)
    quantized = nodes_to_quantize(model, int8_nodes(plan))
    with tempfile.TemporaryDirectory(prefix="kselect-int8-") as tmp:
        cache, output = Path(tmp) / "ranges.json", Path(tmp) / "model.int8.onnx"
        cache.write_text(json.dumps(plan.extra["precision"]["ranges"]))
        quantize_qdq(model.proto, output, cache=cache,
                     method=plan.extra["precision"].get("calibration", {}).get("method", "minmax"),
                     per_channel=settings.get("weights", "per-channel") == "per-channel",
                     signed_activations=settings.get("activations") == "s8",
                     nodes_to_quantize=quantized)
        return float_ops_kept_float(onnx.load(str(output)), quantized)


WEIGHT_REQUANTIZED_OPS = ("Conv", "ConvTranspose", "Gemm")


def float_ops_kept_float(proto, quantized: list[str] | None):
    """The QDQ model with each float Conv, ConvTranspose or Gemm that reads a per-tensor
    DequantizeLinear's output reading a per-channel one instead (the same scale and zero point on
    every channel: the same values). ONNX Runtime's WeightBiasQuantization transformer quantizes
    the float weights of an op after a per-tensor DequantizeLinear (to int8, per tensor), and its
    QDQ fusions then run it on integer kernels: an op the plan keeps in fp32 after an int8 op
    would run in int8 with coarser weights than any int8 candidate. It leaves an op after a
    per-channel DequantizeLinear alone. A per-tensor DequantizeLinear nothing reads any more is
    removed: ONNX Runtime would still run it."""
    if quantized is None:
        return proto
    graph = proto.graph
    writer = {output: node for node in graph.node for output in node.output}
    weights = {tensor.name: tensor for tensor in graph.initializer}
    nodes, bypassed = [], set()
    for node in graph.node:
        dequantize = writer.get(node.input[0]) if node.op_type in WEIGHT_REQUANTIZED_OPS else None
        channels = _input_channels(node, weights) if dequantize is not None else None
        if (channels and node.name not in quantized and dequantize.op_type == "DequantizeLinear"
                and dequantize.input[1] in weights and numpy_helper.to_array(weights[dequantize.input[1]]).size == 1):
            params = [numpy_helper.to_array(weights[name]).reshape(()) for name in dequantize.input[1:] if name]
            names = [f"{node.name}_float_input_{kind}" for kind in ("scale", "zero_point")[:len(params)]]
            graph.initializer.extend(numpy_helper.from_array(np.full(channels, value, value.dtype), name)
                                     for value, name in zip(params, names))
            per_channel = f"{node.name}_float_input"
            nodes.append(helper.make_node("DequantizeLinear", [dequantize.input[0], *names], [per_channel],
                                          name=f"{node.name}_float_input_DequantizeLinear", axis=1))
            node.input[0] = per_channel
            bypassed.add(dequantize.output[0])
        nodes.append(node)
    unread = bypassed - {name for node in nodes for name in node.input} - {value.name for value in graph.output}
    del graph.node[:]
    graph.node.extend(node for node in nodes if not (node.op_type == "DequantizeLinear" and node.output[0] in unread))
    return proto


def _input_channels(node, weights) -> int | None:
    """The size of axis 1 of the op's data input, from its weight, or None."""
    weight = weights.get(node.input[1]) if len(node.input) > 1 else None
    if weight is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        return weight.dims[1] * attrs.get("group", 1)
    if node.op_type == "ConvTranspose":
        return weight.dims[0]
    if node.op_type == "Gemm" and not attrs.get("transA", 0):
        return weight.dims[1] if attrs.get("transB", 0) else weight.dims[0]
    return None
