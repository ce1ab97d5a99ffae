"""The whole-model engine's Python half: an ONNX model (shape-inferred, see ``core.models.model``) becomes
the graph description the runner's ``model_load`` action executes with ACL functions
(PROTOCOL.md, "Whole models"), and ``AclModelRunner`` runs it for ``kselect bench``.

Lowering: Conv -> ``conv`` (per-node config: method, layout, GEMM kernel, CPU model, threads,
scheduler; a conv kselect does not tune on ACL runs with ACL's own choice), ConvTranspose ->
``deconv`` (NEDeconvolutionLayer: square kernels, no groups, dilation or output padding; config:
layout and schedule), Gemm / MatMul with constant weights -> ``fc`` (alpha and beta folded into the weights
and bias), a Relu / Clip / LeakyRelu / Sigmoid / Tanh that is the only consumer of a conv or fc is
fused into it (as ArmNN does), MaxPool / AveragePool / GlobalAveragePool / GlobalMaxPool -> ``pool``,
Add, Concat (channels), Flatten (and a Reshape that flattens), Softmax (2-D, last axis), other
activations -> ``activation``; Identity and Dropout are aliases. Anything else is refused with the
op's name: the engine runs what ACL 20.08 can run, not a general ONNX runtime.

int8: a conv / fc node whose config carries ``"int8": {"activations", "weights"}`` (a plan's int8
entry, ``AclLibrary.node_configs``) is lowered with a ``quant`` object and integer weight files, as
the single-op path quantizes (int8.quantized_weights): input and output on the uint8 grids of
their calibrated ranges (``ranges``, the plan's ``extra["precision"]["ranges"]``; core/precision/quant.py
``asymmetric_u8``, QASYMM8_SIGNED with zero points minus 128), weights symmetric per output
channel or per tensor, S32 bias. The runner converts tensors between float and int8 ops.
"""

from __future__ import annotations

import json
import math
import tempfile
import weakref
from pathlib import Path

import numpy as np
from onnx import numpy_helper

from kselect.core.errors import KselectError, UnsupportedOp
from kselect.core.models.model import Model
from kselect.core.models.tasks import explicit_pads, node_attr
from kselect.core.precision.quant import QuantParams, asymmetric_u8, weight_scales_of
from kselect.plugins.acl import int8
from kselect.plugins.acl.client import AclRunner, RunnerError
from kselect.plugins.ops.conv import deconv_attrs

ACTIVATIONS = ("Relu", "Clip", "LeakyRelu", "Sigmoid", "Tanh")
FLOAT_MAX = 3.4028234e38
# weight and bias files by element type (the runner reads them as its tensors' types)
WEIGHT_SUFFIXES = {np.dtype(np.float32): "f32", np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8",
                   np.dtype(np.int32): "i32"}


def weight_files(folder: Path) -> list[Path]:
    return [path for suffix in WEIGHT_SUFFIXES.values() for path in Path(folder).glob(f"*.{suffix}")]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def runner_activation(op: str, alpha: float = 0.01, low: float = -math.inf, high: float = math.inf) -> dict | None:
    """The runner's fused activation ("act") for an ONNX activation: ``op`` one of ACTIVATIONS,
    ``alpha`` LeakyRelu's slope, ``low`` / ``high`` Clip's bounds. None: nothing to do (a Clip
    without bounds)."""
    if op == "Relu":
        return {"fn": "RELU"}
    if op == "LeakyRelu":
        return {"fn": "LEAKY_RELU", "a": alpha}
    if op == "Sigmoid":
        return {"fn": "LOGISTIC"}
    if op == "Tanh":
        return {"fn": "TANH", "a": 1.0, "b": 1.0}
    if op == "Clip":
        if low == -math.inf and high == math.inf:
            return None
        if low == 0.0 and high == math.inf:
            return {"fn": "RELU"}
        return {"fn": "LU_BOUNDED_RELU", "a": min(high, FLOAT_MAX), "b": max(low, -FLOAT_MAX)}
    raise ValueError(f"no ACL activation for {op}")


class _Lowering:
    def __init__(self, model: Model, configs: dict[str, dict], weights_dir: Path,
                 ranges: dict[str, tuple[float, float]] | None = None):
        self.model = model
        self.configs = configs
        self.weights_dir = weights_dir
        self.ranges = ranges or {}
        self.alias: dict[str, str] = {}
        self.nodes: list[dict] = []
        self.fused: set[int] = set()
        graph = model.proto.graph
        self.graph_outputs = [o.name for o in graph.output]
        self.consumers: dict[str, list[int]] = {}
        for index, node in enumerate(graph.node):
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(index)
        self._arrays: dict[str, np.ndarray] = {}
        self._files = 0

    # -- helpers ------------------------------------------------------------------------------
    def name(self, tensor: str) -> str:
        while tensor in self.alias:
            tensor = self.alias[tensor]
        return tensor

    def shape(self, tensor: str, node) -> list[int]:
        if tensor not in self.model.shapes:
            raise KselectError(f"ACL engine: the shape of {tensor!r} (node {node.name!r}) is unknown")
        return list(self.model.shapes[tensor])

    def constant(self, tensor: str) -> np.ndarray | None:
        if tensor not in self.model.initializers:
            return None
        if tensor not in self._arrays:
            self._arrays[tensor] = numpy_helper.to_array(self.model.initializers[tensor]).astype(np.float32)
        return self._arrays[tensor]

    def write(self, key: str, array: np.ndarray) -> str:
        """A weight file: float32, or the integers of an int8 node's weights and bias."""
        self._files += 1
        if array.dtype not in WEIGHT_SUFFIXES:
            array = array.astype(np.float32)
        name = f"{self._files:04d}.{key}.{WEIGHT_SUFFIXES[array.dtype]}"
        np.ascontiguousarray(array).tofile(self.weights_dir / name)
        return name  # the runner resolves it against the graph file's folder

    def refuse(self, node, why: str):
        raise UnsupportedOp(f"ACL engine cannot run {node.op_type} node {node.name!r}: {why}", node.name)

    def activation(self, node) -> dict | None:
        """The runner's activation for an activation node; None for a Clip without bounds."""
        low, high = node_attr(node, "min", -math.inf), node_attr(node, "max", math.inf)
        if node.op_type == "Clip":
            for position in (1, 2):
                if len(node.input) > position and node.input[position]:
                    value = self.constant(node.input[position])
                    if value is None:
                        self.refuse(node, "Clip bounds computed at run time")
                    if position == 1:
                        low = float(value)
                    else:
                        high = float(value)
        return runner_activation(node.op_type, float(node_attr(node, "alpha", 0.01)), low, high)

    def fusable_activation(self, index: int, output: str):
        """The activation node that is the only consumer of ``output`` (not a graph output)."""
        users = self.consumers.get(output, [])
        if len(users) != 1 or output in self.graph_outputs:
            return None
        node = self.model.proto.graph.node[users[0]]
        if node.op_type not in ACTIVATIONS or node.input[0] != output:
            return None
        act = self.activation(node)
        if act is None:
            return None
        return users[0], node, act

    def config(self, node) -> tuple[dict, dict | None]:
        """The node's runner config and, for an int8 node, its {"activations", "weights"}; no config
        for an op ACL does not tune (its activation is not one ACL fuses): ACL's own choice then, on
        the graph's default schedule."""
        config = dict(self.configs.get(node.name, {}))
        return config, config.pop("int8", None)

    def grid(self, tensor: str, node) -> tuple[float, int]:
        """(scale, uint8 zero point) of a tensor from its calibrated range, as the other libraries
        quantize a plan's int8 nodes."""
        for name in (tensor, self.name(tensor)):
            if name in self.ranges:
                scale, zero_point = asymmetric_u8(*self.ranges[name])
                return float(scale), zero_point
        raise KselectError(f"ACL engine: int8 node {node.name!r}: the plan's calibration has no range for tensor {tensor!r}")

    # -- ops ------------------------------------------------------------------------------------
    def lower(self) -> dict:
        graph = self.model.proto.graph
        for index, node in enumerate(graph.node):
            if index in self.fused:
                continue
            handler = getattr(self, "op_" + node.op_type, None)
            if handler is None:
                self.refuse(node, "op not supported by the ACL engine")
            handler(index, node)
        inputs = [{"name": name, "shape": shape} for name, shape in self.model.input_shapes.items()]
        for entry in inputs:
            if len(entry["shape"]) not in (2, 4):
                raise KselectError(f"ACL engine: input {entry['name']!r} has rank {len(entry['shape'])} (2 or 4 supported)")
        return {"inputs": inputs, "outputs": [self.name(o) for o in self.graph_outputs], "nodes": self.nodes}

    def _emit(self, node, op: str, inputs: list[str], output: str, **fields) -> None:
        entry = {"name": node.name, "op": op, "inputs": [self.name(i) for i in inputs], "output": output}
        if output in self.model.shapes:
            entry["shape"] = self.model.shapes[output]
        entry.update(fields)
        self.nodes.append(entry)

    def _output_with_activation(self, index: int, node) -> tuple[str, dict | None]:
        fused = self.fusable_activation(index, node.output[0])
        if fused is None:
            return node.output[0], None
        act_index, act_node, act = fused
        self.fused.add(act_index)
        return act_node.output[0], act

    def _emit_weighted(self, index, node, op: str, x: str, weights: np.ndarray, bias: np.ndarray | None,
                       alpha: float = 1.0, beta: float = 1.0, **fields):
        """A conv / deconv / fc node: its weight files, its config and the activation fused into it;
        an fc's ``alpha`` and ``beta`` folded into the weights and bias (into the weights' scales
        for an int8 node)."""
        output, act = self._output_with_activation(index, node)
        config, precision = self.config(node)
        fields.update(weights=list(weights.shape), bias=bias is not None, config=config)
        if precision is None:
            fields["weights_path"] = self.write("w", weights * np.float32(alpha) if op == "fc" else weights)
            if bias is not None:
                fields["bias_path"] = self.write("b", bias * np.float32(beta) if op == "fc" else bias)
        else:
            if act is not None and act["fn"] not in int8.FUSED:
                raise KselectError(f"ACL engine: int8 node {node.name!r}: the quantized output stage clamps "
                                   f"({', '.join(int8.FUSED)}), it does not run {act['fn']}")
            x_scale, x_zero_point = self.grid(x, node)
            y_scale, y_zero_point = self.grid(output, node)
            params = QuantParams(x_scale, x_zero_point, weight_scales_of(op, weights), y_scale, y_zero_point)
            quant, arrays = int8.quantized_weights(weights, bias, params, precision["activations"],
                                                   precision["weights"], alpha=alpha, beta=beta)
            fields.update(quant=quant, weights_path=self.write("w", arrays["weights"]))
            if bias is not None:
                fields["bias_path"] = self.write("b", arrays["bias"])
        if act:
            fields["act"] = act
        self._emit(node, op, [x], output, **fields)

    def op_Conv(self, index, node):
        x, w_name = node.input[0], node.input[1]
        w = self.constant(w_name)
        if w is None:
            self.refuse(node, "weights computed at run time")
        x_shape = self.shape(x, node)
        if len(x_shape) != 4:
            self.refuse(node, "only 2-D convolutions")
        strides = list(node_attr(node, "strides", [1, 1]))
        dilations = list(node_attr(node, "dilations", [1, 1]))
        pads = explicit_pads(node, x_shape, list(w.shape)[2:], strides, dilations)
        group = int(node_attr(node, "group", 1))
        b = self.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if len(node.input) > 2 and node.input[2] and b is None:
            self.refuse(node, "bias computed at run time")
        self._emit_weighted(index, node, "conv", x, w, b, input=x_shape, stride=strides, pads=pads, dilation=dilations,
                            group=group)

    def op_ConvTranspose(self, index, node):
        x, w = node.input[0], self.constant(node.input[1])
        if w is None:
            self.refuse(node, "weights computed at run time")
        x_shape = self.shape(x, node)
        if len(x_shape) != 4 or w.shape[2] != w.shape[3]:
            self.refuse(node, "NEDeconvolutionLayer takes 2-D transposed convolutions with square kernels")
        attrs, why = deconv_attrs(node, x_shape, list(w.shape), self.shape(node.output[0], node))
        if attrs is None:
            self.refuse(node, why)
        if attrs["group"] != 1 or attrs["dilations"] != [1, 1] or any(attrs["output_padding"]):
            self.refuse(node, "NEDeconvolutionLayer has no groups, dilation or output padding")
        b = self.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if len(node.input) > 2 and node.input[2] and b is None:
            self.refuse(node, "bias computed at run time")
        weights = np.ascontiguousarray(w.transpose(1, 0, 2, 3))  # ONNX's [C_in, C_out, ..] -> ACL's [OFM, IFM, ..]
        self._emit_weighted(index, node, "deconv", x, weights, b, input=x_shape, stride=attrs["strides"],
                            pads=attrs["pads"])

    def _fc(self, index, node, a: str, weights_nk: np.ndarray, bias: np.ndarray | None, alpha: float = 1.0,
            beta: float = 1.0):
        a_shape = self.shape(a, node)
        if len(a_shape) != 2:
            self.refuse(node, "only 2-D inputs (fully connected)")
        self._emit_weighted(index, node, "fc", a, weights_nk, bias, alpha, beta, input=a_shape)

    def op_Gemm(self, index, node):
        if node_attr(node, "transA", 0):
            self.refuse(node, "transA=1")
        b = self.constant(node.input[1])
        if b is None:
            self.refuse(node, "weights computed at run time")
        w = b if node_attr(node, "transB", 0) else b.T
        bias = None
        if len(node.input) > 2 and node.input[2]:
            c = self.constant(node.input[2])
            if c is None:
                self.refuse(node, "bias computed at run time")
            if c.size not in (1, w.shape[0]) or (c.ndim == 2 and c.shape[0] != 1):
                self.refuse(node, f"bias of shape {list(c.shape)}")
            bias = np.broadcast_to(c.reshape(-1), (w.shape[0],))
        self._fc(index, node, node.input[0], np.ascontiguousarray(w), bias, float(node_attr(node, "alpha", 1.0)),
                 float(node_attr(node, "beta", 1.0)))

    def op_MatMul(self, index, node):
        b = self.constant(node.input[1])
        if b is None or b.ndim != 2:
            self.refuse(node, "only a 2-D constant right-hand side (fully connected)")
        self._fc(index, node, node.input[0], b.T, None)

    def _pool(self, node, kind: str):
        if node_attr(node, "ceil_mode", 0):
            self.refuse(node, "ceil_mode=1")
        if any(d != 1 for d in node_attr(node, "dilations", [1, 1])):
            self.refuse(node, "dilated pooling")
        auto_pad = _text(node_attr(node, "auto_pad", "NOTSET"))
        kernel = list(node_attr(node, "kernel_shape"))
        if auto_pad not in ("NOTSET", "VALID", ""):
            self.refuse(node, f"auto_pad={auto_pad}")
        if len(kernel) != 2:
            self.refuse(node, "only 2-D pooling")
        pads = [0, 0, 0, 0] if auto_pad == "VALID" else list(node_attr(node, "pads", [0, 0, 0, 0]))
        self._emit(node, "pool", [node.input[0]], node.output[0], type=kind, kernel=kernel,
                   stride=list(node_attr(node, "strides", [1, 1])), pads=pads,
                   count_include_pad=bool(node_attr(node, "count_include_pad", 0)))

    def op_MaxPool(self, index, node):
        if len(node.output) > 1 and node.output[1]:
            self.refuse(node, "MaxPool indices output")
        self._pool(node, "MAX")

    def op_AveragePool(self, index, node):
        self._pool(node, "AVG")

    def op_GlobalAveragePool(self, index, node):
        self._emit(node, "global_pool", [node.input[0]], node.output[0], type="AVG")

    def op_GlobalMaxPool(self, index, node):
        self._emit(node, "global_pool", [node.input[0]], node.output[0], type="MAX")

    def op_Add(self, index, node):
        a, b = node.input
        if self.constant(a) is not None or self.constant(b) is not None:
            self.refuse(node, "adding a constant")
        if self.shape(a, node) != self.shape(b, node):
            self.refuse(node, "broadcasting")
        self._emit(node, "add", [a, b], node.output[0])

    def op_Concat(self, index, node):
        rank = len(self.shape(node.input[0], node))
        axis = int(node_attr(node, "axis", 1))
        if rank != 4 or axis % 4 != 1:
            self.refuse(node, "only channel concatenation of 4-D tensors")
        self._emit(node, "concat", list(node.input), node.output[0], axis=1)

    def _flatten_like(self, node):
        x = node.input[0]
        shape, out = self.shape(x, node), self.shape(node.output[0], node)
        if shape == out:
            self.alias[node.output[0]] = self.name(x)
            return
        if len(shape) == 4 and out == [shape[0], int(np.prod(shape[1:]))]:
            self._emit(node, "flatten", [x], node.output[0])
            return
        self.refuse(node, f"reshape {shape} -> {out}")

    def op_Flatten(self, index, node):
        if int(node_attr(node, "axis", 1)) != 1:
            self.refuse(node, "axis != 1")
        self._flatten_like(node)

    def op_Reshape(self, index, node):
        self._flatten_like(node)

    def op_Softmax(self, index, node):
        shape = self.shape(node.input[0], node)
        if len(shape) != 2 or int(node_attr(node, "axis", -1)) not in (1, -1):
            self.refuse(node, "only over the last axis of a 2-D tensor")
        self._emit(node, "softmax", [node.input[0]], node.output[0])

    def _activation_node(self, index, node):
        act = self.activation(node)
        if act is None:
            self.alias[node.output[0]] = self.name(node.input[0])
            return
        self._emit(node, "activation", [node.input[0]], node.output[0], act=act)

    op_Relu = op_Clip = op_LeakyRelu = op_Sigmoid = op_Tanh = _activation_node

    def op_Identity(self, index, node):
        self.alias[node.output[0]] = self.name(node.input[0])

    def op_Dropout(self, index, node):
        if len(node.output) > 1 and node.output[1] and node.output[1] in self.consumers:
            self.refuse(node, "the mask output is used")
        self.alias[node.output[0]] = self.name(node.input[0])


def lower(model: Model, configs: dict[str, dict], default_config: dict, weights_dir: Path,
          ranges: dict[str, tuple[float, float]] | None = None) -> dict:
    """The runner's graph description of ``model``: ``configs`` maps conv / fc node names to runner
    configs (PROTOCOL.md; an int8 node's with ``"int8"``); ``default_config`` schedules every other
    op; ``ranges``: the calibrated ranges int8 nodes quantize with. Weights are written as raw
    float32 files (an int8 node's as integers) into ``weights_dir``, named relative to it: the
    graph file belongs there."""
    graph = _Lowering(model, configs, Path(weights_dir), ranges).lower()
    graph["default_config"] = default_config
    return graph


class WorkDir:
    """A temporary directory for one model runner's graph, weights, inputs and outputs."""

    def __init__(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="kselect-acl-model-")
        self.path = Path(self._tmp.name)

    def cleanup(self) -> None:
        self._tmp.cleanup()


class AclModelRunner:
    """A loaded whole model in a persistent runner process: ``runner(feeds)`` runs one inference and
    returns the outputs (graph order, logical NCHW / 2-D). ``last`` is the runner's last answer
    (``times_us`` inside the runner, emulated under qemu); ``load_info`` says what was configured.
    The weight files are deleted once the runner has loaded them."""

    def __init__(self, graph: dict, work_dir: "WorkDir", timeout_s: float = 1800.0, runner=None):
        self._work = work_dir
        self.work_dir = work_dir.path
        self.graph_path = self.work_dir / "graph.json"
        self.graph_path.write_text(json.dumps(graph))
        self.inputs = {i["name"]: i["shape"] for i in graph["inputs"]}
        self.outputs = list(graph["outputs"])
        self.runner = runner or AclRunner(timeout_s=timeout_s)
        self.emulated = self.runner.emulated
        self._finalizer = weakref.finalize(self, _close, self.runner, work_dir)
        try:
            self.load_info = self.runner.request({"action": "model_load", "model_id": "m", "graph_path": str(self.graph_path)})
        except RunnerError as exc:
            self.close()
            raise KselectError(f"ACL engine: the runner failed while loading the model: {exc}") from None
        if not self.load_info.get("ok"):
            self.close()
            message = f"ACL engine: {self.load_info.get('error_kind')}: {self.load_info.get('error')}"
            node = str(self.load_info.get("error", "")).split(": ", 1)[0]
            if self.load_info.get("error_kind") == "unsupported" and node in {n["name"] for n in graph["nodes"]}:
                raise UnsupportedOp(message, node)  # ACL's validate() refused it: ONNX Runtime runs it
            raise KselectError(message)
        for path in weight_files(self.work_dir):
            path.unlink()  # the runner holds the weights now
        self._fed: dict[str, np.ndarray] = {}
        self.last: dict = {}

    def _write_inputs(self, feeds: dict) -> dict:
        paths = {}
        for name, shape in self.inputs.items():
            if name not in feeds:
                raise KselectError(f"ACL engine: no value fed for input {name!r}")
            array = np.ascontiguousarray(feeds[name], dtype=np.float32)
            if list(array.shape) != list(shape):
                raise KselectError(f"ACL engine: input {name!r} has shape {list(array.shape)}, the model wants {shape}")
            if name in self._fed and np.array_equal(self._fed[name], array):
                continue  # the runner still holds it
            path = self.work_dir / f"input.{len(self._fed)}.{abs(hash(name))}.f32"
            array.tofile(path)
            paths[name] = str(path)
            self._fed[name] = array.copy()
        return paths

    def run(self, feeds: dict, **timing) -> list[np.ndarray]:
        """One request: ``timing`` may ask for warmup / min_repeats / min_time_ms / profile."""
        paths = self._write_inputs(feeds)
        outputs = {name: str(self.work_dir / f"output.{i}.f32") for i, name in enumerate(self.outputs)}
        request = {"action": "model_run", "model_id": "m", "input_paths": paths, "reuse_input": True,
                   "output_paths": outputs, **timing}
        try:
            result = self.runner.request(request)
        except Exception:
            self._fed.clear()
            raise
        if not result.get("ok"):
            self._fed.clear()
            raise KselectError(f"ACL engine: {result.get('error_kind')}: {result.get('error')}")
        self.last = result
        return [np.fromfile(outputs[name], dtype=np.float32).reshape(result["outputs"][name]) for name in self.outputs]

    def __call__(self, feeds: dict) -> list[np.ndarray]:
        return self.run(feeds)

    def close(self) -> None:
        self._finalizer()


def _close(runner, work_dir: WorkDir) -> None:
    runner.close()
    work_dir.cleanup()
