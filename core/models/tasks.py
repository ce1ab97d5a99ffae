"""From a model's ops to tuning tasks: ops with identical input, output and weight shapes and
attributes share one task, measured once. Which ONNX nodes are ops, and how each is read, is up
to the registered op kinds (core/contract/opkind.py; conv, deconv and fc are built in)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

import onnx

from kselect.core.contract.opkind import kinds_by_onnx_op, op_kind
from kselect.core.errors import KselectError
from kselect.core.models import activations
from kselect.core.models.model import Model


@dataclass
class Op:
    """One tunable node, described by what a kernel needs to know."""

    node: str
    kind: str  # an op kind's name (core/contract/opkind.py): "conv", "deconv" (ConvTranspose), "fc", ...
    input_shape: list[int]
    weight_shape: list[int]  # conv: OIHW; deconv: ONNX's [C_in, C_out / group, kH, kW]; fc: [N, K]
    output_shape: list[int]
    attrs: dict
    has_bias: bool
    epilogue: list = field(default_factory=list)  # the activation after it (core/models/activations.py)
    epilogue_nodes: list[str] = field(default_factory=list)  # the graph nodes of that activation

    def signature(self) -> dict:
        signature = {"kind": self.kind, "input": self.input_shape, "weight": self.weight_shape,
                     "output": self.output_shape, "attrs": self.attrs, "bias": self.has_bias}
        if self.epilogue:
            signature["activation"] = self.epilogue
        return signature

    @property
    def macs(self) -> int:
        return op_kind(self.kind).macs(self)


@dataclass
class Task:
    id: str
    key: str
    kind: str
    input_shape: list[int]
    weight_shape: list[int]
    output_shape: list[int]
    attrs: dict
    has_bias: bool
    nodes: list[str] = field(default_factory=list)
    epilogue: list = field(default_factory=list)  # the activation measured with the op
    precision: str = "fp32"  # "int8": the op on int8 data (core/precision/quant.py), a task of its own

    @property
    def activation(self) -> str:
        return activations.name(self.epilogue)

    @property
    def macs(self) -> int:  # per op

        return op_kind(self.kind).macs(self)

    @property
    def conv1d(self) -> bool:
        """A 1-D conv, held as a 2-D conv of height 1 (shapes [N, C, 1, W])."""
        return bool(self.attrs.get("conv1d"))

    @property
    def is_depthwise(self) -> bool:
        return self.kind == "conv" and self.attrs["group"] > 1 and self.attrs["group"] == self.input_shape[1] \
            and self.weight_shape[1] == 1

    @property
    def is_pointwise(self) -> bool:
        return self.kind == "conv" and self.attrs["kernel"] == [1, 1] and self.attrs["group"] == 1

    def describe_attrs(self) -> str:
        suffix = f" +{self.activation}" if self.epilogue else ""
        return (op_kind(self.kind).describe(self) + suffix).strip()

    def to_json(self) -> dict:
        data = {"id": self.id, "key": self.key, "kind": self.kind, "input": self.input_shape,
                "weight": self.weight_shape, "output": self.output_shape, "attrs": self.attrs,
                "bias": self.has_bias, "nodes": self.nodes}
        if self.epilogue:
            data["activation"] = self.epilogue
        if self.precision != "fp32":
            data["precision"] = self.precision
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        return cls(data["id"], data["key"], data["kind"], data["input"], data["weight"], data["output"],
                   data["attrs"], data["bias"], list(data.get("nodes", [])), list(data.get("activation", [])),
                   data.get("precision", "fp32"))

    def at_precision(self, precision: str) -> "Task":
        """This task's twin at ``precision``: the same ops, a key and records of its own."""
        if precision == self.precision:
            return self
        signature = {"kind": self.kind, "input": self.input_shape, "weight": self.weight_shape,
                     "output": self.output_shape, "attrs": self.attrs, "bias": self.has_bias}
        if self.epilogue:
            signature["activation"] = self.epilogue
        if precision != "fp32":
            signature["precision"] = precision
        base_id = self.id.split(".")[0]
        return Task(base_id if precision == "fp32" else f"{base_id}.{precision}", task_key(signature), self.kind,
                    self.input_shape, self.weight_shape, self.output_shape, self.attrs, self.has_bias,
                    list(self.nodes), list(self.epilogue), precision)


def node_attr(node: onnx.NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def explicit_pads(node, input_shape, kernel, strides, dilations) -> list[int]:
    """A conv's or pool's explicit [top, left, bottom, right] pads, auto_pad resolved (``kernel``:
    the two spatial kernel sizes)."""
    auto_pad = node_attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("NOTSET", ""):
        pads = list(node_attr(node, "pads", [0, 0, 0, 0]))
        return [pads[0], pads[1], pads[2], pads[3]]
    if auto_pad == "VALID":
        return [0, 0, 0, 0]
    begin, end = [], []
    for axis in range(2):
        size = input_shape[2 + axis]
        out = -(-size // strides[axis])
        span = (kernel[axis] - 1) * dilations[axis] + 1
        total = max(0, (out - 1) * strides[axis] + span - size)
        small, large = total // 2, total - total // 2
        begin.append(large if auto_pad == "SAME_LOWER" else small)
        end.append(small if auto_pad == "SAME_LOWER" else large)
    return [begin[0], begin[1], end[0], end[1]]


def tensor_shape(model: Model, name: str, node: onnx.NodeProto) -> list[int]:
    if name not in model.shapes:
        raise KselectError(f"could not infer the shape of {name!r} (input of {node.op_type} node {node.name!r})")
    return model.shapes[name]


def constant_float_weights(model: Model, node: onnx.NodeProto, name: str,
                           computed: str = "weights computed at run time: no fixed kernel to select") -> list[int] | str:
    """The shape of a node's weights when they are a float32 initializer, else why the node is
    left untuned (``computed`` when they are computed at run time)."""
    if name not in model.initializers:
        return computed
    if model.proto.ir_version >= 4 and name in {i.name for i in model.proto.graph.input}:
        return f"its weight {name!r} is also a graph input, which a feed may replace: no fixed kernel to select"
    weights = model.initializers[name]
    if weights.data_type != onnx.TensorProto.FLOAT:
        return f"{onnx.helper.tensor_dtype_to_np_dtype(weights.data_type).name} weights: only float32 ops are tuned"
    return list(weights.dims)


def find_ops(model: Model, untuned: list | None = None) -> list[Op]:
    """The model's tunable ops; ``untuned``, if given, receives (node, op type, why) for every
    conv-like or matrix op that is left untuned, so that nothing is dropped without a word."""
    ops = []

    def skip(node, why: str) -> None:
        if untuned is not None:
            untuned.append((node.name, node.op_type, why))

    consumers = activations.consumers_by_index(model.proto.graph)


    kinds = kinds_by_onnx_op()
    for index, node in enumerate(model.proto.graph.node):
        if node.op_type not in kinds:
            continue
        op = kinds[node.op_type].read(model, node)
        if isinstance(op, str):
            skip(node, op)
            continue
        op.epilogue, taken = activations.find_epilogue(model, index, consumers)
        op.epilogue_nodes = [model.proto.graph.node[i].name for i in taken]
        ops.append(op)
    return ops


# ops of a model quantized before kselect saw it (dynamic or static, QOperator or QDQ)
QUANTIZED_OPS = ("ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear",
                 "DequantizeLinear", "QGemm", "DynamicQuantizeLSTM")


def task_key(signature: dict) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def extract_tasks(model: Model) -> list[Task]:
    """Group the model's tunable ops into tasks, in order of first appearance."""
    tasks: dict[str, Task] = {}
    for op in find_ops(model):
        key = task_key(op.signature())
        if key not in tasks:
            tasks[key] = Task(f"T{len(tasks) + 1:02d}", key, op.kind, op.input_shape, op.weight_shape,
                              op.output_shape, op.attrs, op.has_bias, epilogue=op.epilogue)
        tasks[key].nodes.append(op.node)
    if not tasks:
        quantized = Counter(node.op_type for node in model.proto.graph.node if node.op_type in QUANTIZED_OPS)
        if quantized:
            found = ", ".join(f"{count} {op_type}" for op_type, count in quantized.most_common(3))
            raise KselectError(f"{model.name} is already quantized ({found}): kselect tunes the float model and "
                               f"chooses which ops run in int8 itself (--precision fp32,int8)")
        untuned: list = []
        find_ops(model, untuned)
        why = f"; untuned: {untuned[0][1]} {untuned[0][0]!r} ({untuned[0][2]})" if untuned else ""
        if untuned and all("also a graph input" in reason for _, _, reason in untuned):
            # an exporter's keep_initializers_as_inputs (CenterFace): ONNX Runtime ships the tool that undoes it
            why += ("; if nothing feeds the weights, `python -m onnxruntime.tools.remove_initializer_from_input "
                    "--input MODEL.onnx --output FIXED.onnx` makes them constants")
        raise KselectError(f"{model.name} has nothing to tune (no {', '.join(kinds_by_onnx_op())} with constant "
                           f"weights){why}")
    return list(tasks.values())


def untuned_ops(model: Model) -> list[tuple[str, str, str]]:
    """(node, op type, why) for every conv-like or matrix op kselect leaves untuned."""
    untuned: list = []
    find_ops(model, untuned)
    kinds = kinds_by_onnx_op()

    def in_subgraphs(node: onnx.NodeProto) -> None:
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for graph in graphs:
                for inner in graph.node:
                    if inner.op_type in kinds:
                        untuned.append((inner.name, inner.op_type, f"inside the {attr.name} sub-graph of "
                                        f"{node.op_type} {node.name!r}: only ops of the main graph are tuned"))
                    in_subgraphs(inner)

    for node in model.proto.graph.node:
        in_subgraphs(node)
    return untuned


def model_stats(model: Model) -> tuple[int, int]:
    """(parameters, multiply-accumulates of the tunable ops)."""
    params = sum(_prod(t.dims) for t in model.proto.graph.initializer)
    macs = sum(op.macs for op in find_ops(model))
    return params, macs


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out
