"""Reading a model: an ONNX file or a built-in name, with dynamic input dims resolved and every
tensor's shape inferred."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import onnx
from onnx import shape_inference

from kselect.core.errors import KselectError


@dataclass
class Model:
    name: str
    proto: onnx.ModelProto
    source: str  # file path, "builtin" or "in memory"
    input_shapes: dict[str, list[int]]
    shapes: dict[str, list[int]] = field(default_factory=dict)  # every tensor's static shape
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Identifies the graph (ops, names, shapes, attributes), not the weight values."""
        parts = []
        for node in self.proto.graph.node:
            attrs = {a.name: str(onnx.helper.get_attribute_value(a)) for a in node.attribute}
            parts.append([node.op_type, node.name, list(node.input), list(node.output), attrs,
                          [self.shapes.get(i) for i in node.input]])
        text = json.dumps([self.input_shapes, parts], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_input_shape(text: str) -> tuple[str, list[int]]:
    """``NAME=1,3,640,640`` -> ("NAME", [1, 3, 640, 640])."""
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        values = [int(d) for d in dims.split(",")]
        if any(v <= 0 for v in values):
            raise ValueError
    except ValueError:
        raise KselectError(f"bad --input-shape {text!r}: expected NAME=D1,D2,... with positive integers") from None
    return name, values


def _read(spec: str) -> tuple[str, onnx.ModelProto, str]:
    from kselect.core import plugins

    zoo = plugins.models()
    if spec in zoo and not os.path.exists(spec):
        _, build = zoo[spec]
        return spec, build(0), "builtin"
    if not os.path.exists(spec):
        raise KselectError(f"no such model file or built-in model: {spec!r} (built-ins: {', '.join(zoo)})")
    if os.path.isdir(spec):
        raise KselectError(f"{spec} is a directory, not an ONNX model")
    try:
        proto = onnx.load(spec)
    except Exception as exc:
        raise KselectError(f"{spec} is not a readable ONNX model ({type(exc).__name__})") from None
    if not proto.graph.node:
        raise KselectError(f"{spec} is not an ONNX model (no graph nodes)")
    return os.path.splitext(os.path.basename(spec))[0], proto, os.path.abspath(spec)


def _known(dim) -> bool:
    return dim.HasField("dim_value") and dim.dim_value > 0


def _graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializer_names = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in initializer_names]


def load_model(spec: str, input_shapes: list[str] | None = None) -> Model:
    name, proto, source = _read(spec)
    overrides = dict(parse_input_shape(text) for text in input_shapes or [])
    graph_inputs = _graph_inputs(proto)
    known = {i.name for i in graph_inputs}
    for unknown in set(overrides) - known:
        raise KselectError(f"--input-shape names {unknown!r}, but the model's inputs are: {', '.join(sorted(known))}")

    for graph_input in graph_inputs:
        dims = graph_input.type.tensor_type.shape.dim
        if graph_input.name in overrides:
            wanted = overrides[graph_input.name]
            if len(wanted) != len(dims):
                raise KselectError(
                    f"--input-shape {graph_input.name} has {len(wanted)} dims, the model's input has {len(dims)}")
            for dim, value in zip(dims, wanted):  # static dims may be overridden too (e.g. a smaller image)
                dim.Clear()
                dim.dim_value = value
        for index, dim in enumerate(dims):
            if not _known(dim):
                label = f" ({dim.dim_param!r})" if dim.dim_param else ""
                raise KselectError(
                    f"input {graph_input.name!r} dim {index}{label} is unknown: "
                    f"pass --input-shape {graph_input.name}=" + ",".join(
                        str(d.dim_value) if d.dim_value > 0 else "N" for d in dims))
    return model_from_proto(name, proto, source)


def model_from_proto(name: str, proto: onnx.ModelProto, source: str = "in memory") -> Model:
    """A Model of an ONNX graph whose inputs all have static shapes: unnamed nodes get names (in
    ``proto`` itself: plans address nodes by name) and every tensor's shape is inferred."""
    resolved: dict[str, list[int]] = {}
    for graph_input in _graph_inputs(proto):
        dims = graph_input.type.tensor_type.shape.dim
        if not all(_known(dim) for dim in dims):
            raise KselectError(f"{name}: input {graph_input.name!r} has unknown dims")
        resolved[graph_input.name] = [dim.dim_value for dim in dims]

    used = {node.name for node in proto.graph.node}
    for index, node in enumerate(proto.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{index}"
            while candidate in used:
                candidate += "_"
            node.name = candidate
            used.add(candidate)

    try:
        inferred = shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as exc:
        raise KselectError(f"shape inference failed on {name}: {str(exc).splitlines()[0]}") from None
    shapes = dict(resolved)
    for value in list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = [d.dim_value for d in dims]
    initializers = {t.name: t for t in inferred.graph.initializer}
    for tensor in initializers.values():
        shapes[tensor.name] = list(tensor.dims)
    return Model(name, inferred, source, resolved, shapes, initializers)
