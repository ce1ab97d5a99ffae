"""From a model's ops to tuning tasks: ops with identical input, output and weight shapes and
attributes share one task, measured once."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import onnx

from kselect.core import activations
from kselect.core.errors import KselectError
from kselect.core.model import Model

TUNABLE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass
class Op:
    """One tunable node, described by what a kernel needs to know."""

    node: str
    kind: str  # "conv", "deconv" (ConvTranspose) or "fc"
    input_shape: list[int]
    weight_shape: list[int]  # conv: OIHW; deconv: ONNX's [C_in, C_out / group, kH, kW]; fc: [N, K]
    output_shape: list[int]
    attrs: dict
    has_bias: bool
    epilogue: list = field(default_factory=list)  # the activation after it (core/activations.py)

    def signature(self) -> dict:
        signature = {"kind": self.kind, "input": self.input_shape, "weight": self.weight_shape,
                     "output": self.output_shape, "attrs": self.attrs, "bias": self.has_bias}
        if self.epilogue:
            signature["activation"] = self.epilogue
        return signature

    @property
    def macs(self) -> int:
        if self.kind == "conv":
            n, cout, oh, ow = self.output_shape
            _, cin_per_group, kh, kw = self.weight_shape
            return n * cout * oh * ow * cin_per_group * kh * kw
        if self.kind == "deconv":  # every input pixel scatters a kernel-sized patch per output channel
            n, cin, h, w = self.input_shape
            _, cout_per_group, kh, kw = self.weight_shape
            return n * cin * h * w * cout_per_group * kh * kw
        m = self.input_shape[0]
        n, k = self.weight_shape
        return m * n * k


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

    @property
    def activation(self) -> str:
        return activations.name(self.epilogue)

    @property
    def macs(self) -> int:  # per op
        return Op("", self.kind, self.input_shape, self.weight_shape, self.output_shape, self.attrs, self.has_bias).macs

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
        a = self.attrs
        suffix = f" +{self.activation}" if self.epilogue else ""
        if self.kind == "fc":
            return suffix.lstrip()
        if a.get("conv1d"):
            pads = a["pads"][1] if a["pads"][1] == a["pads"][3] else f"{a['pads'][1]},{a['pads'][3]}"
            text = f"1-D k{a['kernel'][1]} s{a['strides'][1]} p{pads}"
            text += f" d{a['dilations'][1]}" if a["dilations"][1] != 1 else ""
            return text + (f" g{a['group']}" if a["group"] > 1 else "") + suffix
        pads = a["pads"]
        pad_text = str(pads[0]) if len(set(pads)) == 1 else ",".join(map(str, pads))
        stride_text = str(a["strides"][0]) if a["strides"][0] == a["strides"][1] else f"{a['strides'][0]}x{a['strides'][1]}"
        text = f"k{a['kernel'][0]}x{a['kernel'][1]} s{stride_text} p{pad_text}"
        if a["dilations"] != [1, 1]:
            text += f" d{a['dilations'][0]}x{a['dilations'][1]}"
        if a["group"] > 1:
            text += f" g{a['group']}"
        if any(a.get("output_padding", [0, 0])):
            text += f" op{a['output_padding'][0]}x{a['output_padding'][1]}"
        return text + suffix

    def to_json(self) -> dict:
        data = {"id": self.id, "key": self.key, "kind": self.kind, "input": self.input_shape,
                "weight": self.weight_shape, "output": self.output_shape, "attrs": self.attrs,
                "bias": self.has_bias, "nodes": self.nodes}
        if self.epilogue:
            data["activation"] = self.epilogue
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        return cls(data["id"], data["key"], data["kind"], data["input"], data["weight"], data["output"],
                   data["attrs"], data["bias"], list(data.get("nodes", [])), list(data.get("activation", [])))


def _attr(node: onnx.NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def explicit_pads(node, input_shape, kernel, strides, dilations) -> list[int]:
    """A conv's or pool's explicit [top, left, bottom, right] pads, auto_pad resolved (``kernel``:
    the two spatial kernel sizes)."""
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("NOTSET", ""):
        pads = list(_attr(node, "pads", [0, 0, 0, 0]))
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


def _shape(model: Model, name: str, node: onnx.NodeProto) -> list[int]:
    if name not in model.shapes:
        raise KselectError(f"could not infer the shape of {name!r} (input of {node.op_type} node {node.name!r})")
    return model.shapes[name]


def _conv_attrs(node, x: list[int], kernel: list[int]) -> dict:
    strides = list(_attr(node, "strides", [1, 1]))
    dilations = list(_attr(node, "dilations", [1, 1]))
    return {"kernel": kernel, "strides": strides, "pads": explicit_pads(node, x, kernel, strides, dilations),
            "dilations": dilations, "group": int(_attr(node, "group", 1))}


def _as_2d(x: list[int], w: list[int], y: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A 1-D conv's shapes as a 2-D conv's of height 1 (the task's form; attrs["conv1d"] says so)."""
    return [x[0], x[1], 1, x[2]], [w[0], w[1], 1, w[2]], [y[0], y[1], 1, y[2]]


def _conv1d_attrs(node, x: list[int], w: list[int]) -> dict:
    """A 1-D conv's attributes in the 2-D form of height 1."""
    kernel, strides, dilations = [1, w[2]], [1, *_attr(node, "strides", [1])], [1, *_attr(node, "dilations", [1])]
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) in ("NOTSET", ""):
        begin, end = _attr(node, "pads", [0, 0])
        pads = [0, begin, 0, end]
    else:
        pads = explicit_pads(node, [x[0], x[1], 1, x[2]], kernel, strides, dilations)
    return {"kernel": kernel, "strides": strides, "pads": pads, "dilations": dilations,
            "group": int(_attr(node, "group", 1)), "conv1d": True}


def deconv_attrs(node, x: list[int], w: list[int], y: list[int]) -> tuple[dict | None, str]:
    """A ConvTranspose's attributes with its pads explicit, or (None, why). Where its output size
    comes from auto_pad or output_shape, the pads are what ONNX Runtime crops to reach it: the
    odd one at the end for SAME_UPPER, at the start otherwise (checked against ONNX Runtime in
    tests/test_import.py)."""
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    attrs = {"kernel": w[2:], "strides": list(_attr(node, "strides", [1, 1])),
             "pads": list(_attr(node, "pads", [0, 0, 0, 0])), "dilations": list(_attr(node, "dilations", [1, 1])),
             "group": int(_attr(node, "group", 1)), "output_padding": list(_attr(node, "output_padding", [0, 0]))}
    derived = auto_pad not in ("NOTSET", "", "VALID") or _attr(node, "output_shape") is not None
    if auto_pad == "VALID":
        attrs["pads"] = [0, 0, 0, 0]
    for axis in range(2):
        span = (attrs["kernel"][axis] - 1) * attrs["dilations"][axis] + 1
        full = attrs["strides"][axis] * (x[2 + axis] - 1) + attrs["output_padding"][axis] + span
        if derived:
            total = full - y[2 + axis]
            if total < 0:
                return None, f"ConvTranspose output {y} is larger than its input and kernel give"
            start = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            attrs["pads"][axis], attrs["pads"][2 + axis] = start, total - start
        elif full - attrs["pads"][axis] - attrs["pads"][2 + axis] != y[2 + axis]:
            return None, f"ConvTranspose output {y} does not follow from its attributes"
    return attrs, ""


def find_ops(model: Model, untuned: list | None = None) -> list[Op]:
    """The model's tunable ops; ``untuned``, if given, receives (node, op type, why) for every
    conv-like or matrix op that is left untuned, so that nothing is dropped without a word."""
    ops = []

    def skip(node, why: str) -> None:
        if untuned is not None:
            untuned.append((node.name, node.op_type, why))

    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(model.proto.graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(index)

    def epilogue(index: int) -> list:
        return activations.find_epilogue(model, index, consumers)

    for index, node in enumerate(model.proto.graph.node):
        if node.op_type not in TUNABLE_OPS:
            continue
        name = node.name
        if node.op_type in ("Conv", "ConvTranspose"):
            if node.input[1] not in model.initializers:
                skip(node, "weights computed at run time: no fixed kernel to select")
                continue
            x = _shape(model, node.input[0], node)
            w = list(model.initializers[node.input[1]].dims)
            if model.initializers[node.input[1]].data_type != onnx.TensorProto.FLOAT:
                kind = onnx.helper.tensor_dtype_to_np_dtype(model.initializers[node.input[1]].data_type).name
                skip(node, f"{kind} weights: only float32 ops are tuned")
                continue
            y = _shape(model, node.output[0], node)
            has_bias = len(node.input) > 2 and node.input[2] != ""
            if node.op_type == "Conv" and len(x) == 3:
                ops.append(Op(name, "conv", *_as_2d(x, w, y), _conv1d_attrs(node, x, w), has_bias, epilogue(index)))
                continue
            if len(x) != 4:
                skip(node, f"{len(x) - 2}-D {node.op_type}: only 1-D and 2-D convolutions and 2-D transposed "
                           "convolutions are tuned")
                continue
            if node.op_type == "Conv":
                ops.append(Op(name, "conv", x, w, y, _conv_attrs(node, x, w[2:]), has_bias, epilogue(index)))
                continue
            attrs, why = deconv_attrs(node, x, w, y)
            if attrs is None:
                skip(node, why)
                continue
            ops.append(Op(name, "deconv", x, w, y, attrs, has_bias, epilogue(index)))
        else:
            weight_name = node.input[1]
            if weight_name not in model.initializers:
                skip(node, "both operands computed at run time: no fixed weights")
                continue
            a = _shape(model, node.input[0], node)
            w = list(model.initializers[weight_name].dims)
            if model.initializers[weight_name].data_type != onnx.TensorProto.FLOAT:
                kind = onnx.helper.tensor_dtype_to_np_dtype(model.initializers[weight_name].data_type).name
                skip(node, f"{kind} weights: only float32 ops are tuned")
                continue
            if len(a) != 2 or len(w) != 2:
                skip(node, f"{len(a)}-D input: only fully connected layers (2-D) are tuned")
                continue
            if node.op_type == "Gemm":
                if _attr(node, "transA", 0):
                    skip(node, "Gemm with transA: not a fully connected layer")
                    continue
                n_k = w if _attr(node, "transB", 0) else [w[1], w[0]]
                has_bias = len(node.input) > 2 and node.input[2] != ""
                attrs = {"alpha": float(_attr(node, "alpha", 1.0)), "beta": float(_attr(node, "beta", 1.0)) if has_bias else 1.0,
                         "transB": int(_attr(node, "transB", 0))}
            else:
                n_k, has_bias, attrs = [w[1], w[0]], False, {"alpha": 1.0, "beta": 1.0, "transB": 0}
            y = _shape(model, node.output[0], node)
            ops.append(Op(name, "fc", a, n_k, y, attrs, has_bias, epilogue(index)))
    return ops


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
        untuned: list = []
        find_ops(model, untuned)
        why = f"; untuned: {untuned[0][1]} {untuned[0][0]!r} ({untuned[0][2]})" if untuned else ""
        raise KselectError(f"{model.name} has nothing to tune (no 2-D Conv, ConvTranspose, Gemm or MatMul with "
                           f"constant weights){why}")
    return list(tasks.values())


def untuned_ops(model: Model) -> list[tuple[str, str, str]]:
    """(node, op type, why) for every conv-like or matrix op kselect leaves untuned."""
    untuned: list = []
    find_ops(model, untuned)
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
