"""ONNX Runtime's float16 kernels as MLAS's fp16 candidates (core/precision/half.py), and the
rewrite that runs a plan's fp16 ops in float16.

ONNX Runtime runs a float16 Conv, ConvTranspose, Gemm or MatMul on kernels of its own only where
MLAS has half-precision kernels for the CPU (arm64 with FP16 arithmetic, Armv8.2-A: MLAS's
``MlasFp16AccelerationSupported``). Elsewhere (x86_64) its InsertCastTransformer wraps the node
in Casts to float and runs the fp32 kernel: that is no half-precision candidate, only fp32 with
two conversions. So whether an op has fp16 kernels here is read from what ONNX Runtime makes of
the op alone in float16 (``runs_in_half``): a Cast it inserted means it has none.

An fp16 op reads and writes float32 tensors like its neighbours: ``to_half`` casts what it reads
to float16 once per tensor and casts what it writes back where a float op or the graph reads it;
two fp16 ops in a row pass float16 between them. Its activation steps (the task's epilogue) run
in float16 with it, as ONNX Runtime fuses them into the conv. MLAS's half-precision GEMM
accumulates in float16 (``fmla`` on ``.8h`` vectors), so its candidates get the error of rounding
the running sum (``Library.accumulates_in_half``).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.measuring.measure import task_inputs, task_model
from kselect.core.models.activations import consumers_by_index, find_epilogue
from kselect.core.models.tasks import Task
from kselect.plugins.mlas.ort_session import ort_optimized

HALF_SUFFIX = ".fp16"
# one-node float16 models asked about per op kind (fc: both forms ONNX Runtime runs a layer in)
PROBE_OPS = {"conv": ("Conv",), "deconv": ("ConvTranspose",), "fc": ("Gemm", "MatMul")}


def to_half(proto: onnx.ModelProto, nodes: set[str]) -> onnx.ModelProto:
    """A copy of the model in which ``nodes`` compute in float16: their float initializers stored
    in half, each float tensor they read from outside the set cast to half once (before its first
    reader there), each tensor they write cast back to float where anything outside the set, or
    the graph's output, reads it."""
    model = copy.deepcopy(proto)
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    in_half = [node for node in graph.node if node.name in nodes]
    written_in_half = {name for node in in_half for name in node.output}
    read_in_float = {name for node in graph.node if node.name not in nodes for name in node.input}
    read_in_float |= {output.name for output in graph.output}
    half_initializers: dict[str, onnx.TensorProto] = {}
    cast_in: set[str] = set()
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.name not in nodes:
            rebuilt.append(node)
            continue
        for k, name in enumerate(node.input):
            if not name:
                continue
            if name in initializers:
                if initializers[name].data_type != TensorProto.FLOAT:
                    continue  # shapes, axes: not data
                if name + HALF_SUFFIX not in half_initializers:
                    values = numpy_helper.to_array(initializers[name]).astype(np.float16)
                    half_initializers[name + HALF_SUFFIX] = numpy_helper.from_array(values, name + HALF_SUFFIX)
            elif name not in written_in_half and name not in cast_in:
                cast_in.add(name)
                rebuilt.append(helper.make_node("Cast", [name], [name + HALF_SUFFIX], name=f"{name}.to_fp16",
                                                to=TensorProto.FLOAT16))
            node.input[k] = name + HALF_SUFFIX
        outputs = list(node.output)
        for k, name in enumerate(outputs):
            node.output[k] = name + HALF_SUFFIX
        rebuilt.append(node)
        rebuilt += [helper.make_node("Cast", [name + HALF_SUFFIX], [name], name=f"{name}.to_fp32", to=TensorProto.FLOAT)
                    for name in outputs if name in read_in_float]
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(half_initializers.values())
    # value_info of a tensor that now only lives in half would name a tensor nothing writes
    gone = written_in_half - read_in_float
    kept = [info for info in graph.value_info if info.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return model


def inserted_casts(proto: onnx.ModelProto) -> int:
    """How many Cast nodes ONNX Runtime's session adds to the model (its InsertCastTransformer
    wraps a float16 node it has no kernel for), read from the graph it optimises at the basic
    level."""
    count = lambda graph: sum(node.op_type == "Cast" for node in graph.node)  # noqa: E731
    return count(ort_optimized(proto, "ORT_ENABLE_BASIC").graph) - count(proto.graph)


def _probe(op_type: str) -> onnx.ModelProto:
    """One small float16 node of ``op_type``, float16 in and out."""
    if op_type in ("Conv", "ConvTranspose"):
        x_shape, w = [1, 16, 8, 8], np.full((16, 16, 3, 3), 0.01, np.float16)
        node = helper.make_node(op_type, ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    else:
        x_shape, w = [4, 32], np.full((32, 16), 0.01, np.float16)
        node = helper.make_node(op_type, ["x", "w"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@functools.cache
def kinds_with_kernels() -> frozenset[str]:
    """The op kinds (conv, deconv, fc) ONNX Runtime runs in float16 on kernels of its own here."""
    return frozenset(kind for kind, op_types in PROBE_OPS.items()
                     if all(inserted_casts(_probe(op_type)) == 0 for op_type in op_types))


def available() -> tuple[bool, str]:
    """Whether ONNX Runtime has float16 kernels here, and for which op kinds; else why not."""
    kinds = kinds_with_kernels()
    if not kinds:
        return False, ("ONNX Runtime has no fp16 conv / deconv / fc kernels on this CPU: it runs a float16 Conv as "
                       "Cast + fp32 Conv + Cast (its fp16 kernels are MLAS's for arm64 with FP16 arithmetic)")
    return True, "ONNX Runtime's fp16 kernels for " + ", ".join(sorted(kinds))


def single_op_model(task: Task, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The task alone (its op and activation steps) in float16, between the cast of its float32
    input to half and of its output back, both timed as part of the op, as in a whole model."""
    proto = task_model(task, inputs)
    return to_half(proto, {node.name for node in proto.graph.node})


_RUNS_IN_HALF: dict[str, bool] = {}  # task key -> answer, asked once per process


def runs_in_half(task: Task) -> bool:
    """Whether ONNX Runtime runs this task's op and activation in float16 without adding casts
    (a grouped conv or an activation may have no float16 kernel where a plain conv has one)."""
    if task.kind not in kinds_with_kernels() or task.conv1d:
        return False
    if task.key not in _RUNS_IN_HALF:
        _RUNS_IN_HALF[task.key] = inserted_casts(single_op_model(task, task_inputs(task))) == 0
    return _RUNS_IN_HALF[task.key]


def half_region(model, nodes: set[str]) -> set[str]:
    """The plan's fp16 op nodes and the activation steps after each (core/models/activations), which
    run in float16 with it."""
    graph_nodes = model.proto.graph.node
    consumers = consumers_by_index(model.proto.graph)
    region = set(nodes)
    for index, node in enumerate(graph_nodes):
        if node.name in nodes:
            _, taken = find_epilogue(model, index, consumers)
            region |= {graph_nodes[i].name for i in taken}
    return region
