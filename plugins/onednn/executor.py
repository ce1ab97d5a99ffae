"""Runs an ONNX model (or a segment of one) with oneDNN primitives: each Conv, ConvTranspose,
Gemm and MatMul as the plan's config says (the implementation, the layout it writes, its thread
count), every other op with oneDNN's defaults.

Built once: every primitive is created with its memories, weights reordered into the format
their implementation chose, so an inference is the input copies, one ``dnnl_primitive_execute``
per step and the output reorders. A 4-D tensor stays in the format its producer wrote (blocked
nChw16c, nhwc, ...); where a consumer reads another format, a reorder step converts it (once per
format, shared by the consumers). The model's inputs and outputs are NCHW numpy arrays.

Fused (the same with and without a plan): the activation epilogue of a conv / fc op
(core/models/activations.py), when every step maps to an eltwise post-op (primitives.post_ops), and a
Relu / Clip after an Add, Sub, Mul or Div (a post-op of the binary primitive).

Each op is built by the Executor method ``BUILDERS`` (the table at the end) maps its type to;
``OnednnLibrary.runs_op`` reads the same table.

Threads: a conv / fc op runs on its config's thread count (without a plan: all cores, oneDNN's
default); every other op on that of the op producing its first input.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from kselect.core.errors import KselectError, UnsupportedOp
from kselect.core.measuring.device import this_device
from kselect.core.models.tasks import Task, explicit_pads, find_ops
from kselect.plugins.onednn import dnnl
from kselect.plugins.onednn import primitives as prim

TUNED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
# The formats a 4-D tensor may hold whose constant operand is laid out the same (_constant_like).
BROADCAST_FORMATS = ("nChw16c", "nChw8c", "nhwc", "nchw")
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Max": "max", "Min": "min"}
COMMUTATIVE = ("add", "mul", "max", "min")
# ops whose builder writes a memory of their own (no view of another tensor's): a residual Add may
# write its sum over what they wrote (Executor._residual_adds)
OWN_OUTPUT_POOLS = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


class _Tensor:
    """An activation as the executor holds it: ``memory`` in the format its producer wrote."""

    def __init__(self, name: str, shape, memory: dnnl.Memory, threads: int):
        self.name = name
        self.shape = [int(d) for d in shape]
        self.memory = memory
        self.threads = threads

    @property
    def plain(self) -> bool:
        return dnnl.equal(self.memory.md, dnnl.plain_desc(self.shape))


def _source_type(task: Task, source: dnnl.Memory) -> int:
    """What the op reads its input as: a bf16 op reads a bf16 tensor as it is, anything else f32
    (a bf16 op converting an f32 input within itself)."""
    return dnnl.BF16 if task.precision == "bf16" and source.md.data_type == dnnl.BF16 else dnnl.F32


def _last_fused(fused: dict[int, int]) -> dict[int, int]:
    """node index -> the index of the last node fused into it (``fused``: fused node -> the node
    it is fused into), whose output is the tensor its builder writes."""
    last: dict[int, int] = {}
    for j, i in fused.items():
        last[i] = max(j, last.get(i, j))
    return last


def _execute(step: tuple, threads_now: int | None) -> int:
    """Runs one executor step ``(threads, primitive call, *args)`` on its thread count (set only
    when it differs from ``threads_now``); returns the thread count now set."""
    threads, fn, *args = step
    if threads != threads_now:
        dnnl.set_threads(threads)
    status = fn(*args)
    if status:
        raise dnnl.DnnlError(status, "dnnl_primitive_execute")
    return threads


class Executor:
    """``Executor(library, model, plan)(feeds) -> [outputs]``; ``plan`` None = oneDNN's defaults."""

    def __init__(self, library, model, plan=None):
        self.library = library
        self.model = model
        self.plan = plan
        self.device = this_device()
        self.default_threads = self.device.cores
        self.steps: list[tuple] = []  # (threads, fn, *args): one dnnl_primitive_execute each
        self.step_nodes: list[str] = []
        self.configs: dict[str, dict] = {}  # tuned node -> the config it was built with
        self.impls: dict[str, str] = {}  # node -> oneDNN implementation of its main primitive
        self._primitives: list[dnnl.Primitive] = []
        self._memories: list[dnnl.Memory] = []
        self._built: list[prim.Built] = []
        self._fed: dict[tuple, dnnl.Memory] = {}  # (tensor memory, format) -> its reordered copy
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------
    def _memory(self, md, buffer: np.ndarray | None = None) -> dnnl.Memory:
        memory = dnnl.Memory(md, buffer)
        self._memories.append(memory)
        return memory

    def _add(self, node_name: str, primitive: dnnl.Primitive, threads: int) -> None:
        self._primitives.append(primitive)
        self.steps.append((threads, *primitive.step))
        self.step_nodes.append(node_name)

    def _create(self, node_name: str, pd: dnnl.PrimitiveDesc, args: dict, threads: int) -> dnnl.Primitive:
        try:
            primitive = dnnl.Primitive(pd, args)
        finally:
            pd.close()
        self._add(node_name, primitive, threads)
        self.impls.setdefault(node_name, primitive.impl)
        return primitive

    def _build(self) -> None:
        graph = self.model.proto.graph
        nodes = list(graph.node)
        self.graph_outputs = [o.name for o in graph.output]
        consumers: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            for name in node.input:
                if name:
                    consumers.setdefault(name, []).append(i)
        self._nodes, self._consumers = nodes, consumers
        self.tensors: dict[str, _Tensor] = {}
        self.inputs: list[_Tensor] = []
        for name, shape in self.model.input_shapes.items():
            tensor = _Tensor(name, shape, self._memory(dnnl.plain_desc(shape)), self.default_threads)
            self.tensors[name] = tensor
            self.inputs.append(tensor)

        self._tasks: dict[str, Task] = {}
        fused: dict[int, int] = {}  # activation node index -> index of the node it is fused into
        by_name = {node.name: i for i, node in enumerate(nodes)}
        precision_of = self._planned_precisions()
        for op in find_ops(self.model):
            task = Task(op.node, "", op.kind, op.input_shape, op.weight_shape, op.output_shape, op.attrs,
                        op.has_bias, [op.node], op.epilogue, precision_of.get(op.node, "fp32"))
            if prim.post_ops(task.epilogue) is None:
                task.epilogue = []  # its activation runs as ops of its own
            self._tasks[op.node] = task
            for j in self._epilogue_nodes(nodes, by_name[op.node], len(task.epilogue)):
                fused[j] = by_name[op.node]
        for i, node in enumerate(nodes):
            if node.op_type in BINARY and i not in fused and len(node.output) == 1:
                uses = consumers.get(node.output[0], [])
                if (len(uses) == 1 and node.output[0] not in self.graph_outputs
                        and self._activation(nodes[uses[0]]) is not None):
                    fused[uses[0]] = i
        self._residuals = self._residual_adds(nodes, consumers, fused)
        fused_last = _last_fused(fused)

        for i, node in enumerate(nodes):
            if i in fused:
                continue
            out_name = nodes[fused_last[i]].output[0] if i in fused_last else (node.output[0] if node.output else "")
            builder = BUILDERS.get(node.op_type)
            if builder is None:
                raise UnsupportedOp(f"onednn executor: {node.op_type} (node {node.name!r}) is not supported", node.name)
            post = self._activation(nodes[fused_last[i]]) if i in fused_last and node.op_type in BINARY else []
            builder(self, node, out_name, post)
        self.outputs: list[tuple[_Tensor, dnnl.Primitive | None, dnnl.Memory]] = []
        for name in self.graph_outputs:
            if name not in self.tensors:
                raise KselectError(f"onednn executor: graph output {name!r} was not computed")
            tensor = self.tensors[name]
            if tensor.plain:
                self.outputs.append((tensor, None, tensor.memory))
            else:
                plain = self._memory(dnnl.plain_desc(tensor.shape))
                reorder = dnnl.reorder(tensor.memory, plain)
                self._primitives.append(reorder)
                self.outputs.append((tensor, reorder, plain))

    def _residual_adds(self, nodes, consumers: dict[str, list[int]], fused: dict[int, int]) -> dict[str, tuple]:
        """The residual Adds fused into the conv before them, as oneDNN's sum post-op: an Add of
        two activations of one shape, one written by a conv (after its epilogue) that nothing
        else reads, the other (the shortcut) written before that conv runs, by a node of this
        executor, and read otherwise only by convs and fcs that run before it. The conv then adds
        its result to the shortcut in the shortcut's own memory, in f32 as the Add computes it:
        the Add's two reads and its write are gone. The Add, and the activation fused into it,
        become part of the conv (``fused`` is updated). conv node name -> (Add node index, the
        conv's own output, the shortcut tensor, the activation's post-ops)."""
        owner: dict[str, int] = {}  # tensor -> index of the node whose builder writes it
        last = _last_fused(fused)
        for i, node in enumerate(nodes):
            if i not in fused and node.output:
                owner[nodes[last.get(i, i)].output[0]] = i
        residuals: dict[str, tuple] = {}
        for i, node in enumerate(nodes):
            if node.op_type != "Add" or i in fused or len(node.input) != 2 or len(node.output) != 1:
                continue
            shape = self.model.shapes.get(node.output[0])
            for a, shortcut in (node.input, reversed(node.input)):
                p = owner.get(a)
                task = self._tasks.get(nodes[p].name) if p is not None else None
                if (task is None or task.kind != "conv" or task.conv1d or nodes[p].name in residuals
                        or consumers.get(a) != [i] or a in self.graph_outputs or shortcut in self.graph_outputs
                        or self.model.shapes.get(a) != shape or self.model.shapes.get(shortcut) != shape
                        or owner.get(shortcut, len(nodes)) >= p):
                    continue
                writer = nodes[owner[shortcut]]
                if (self._tasks[writer.name].conv1d if writer.name in self._tasks
                        else writer.op_type not in (*BINARY, *OWN_OUTPUT_POOLS)):
                    continue  # a reshape, an identity or a 1-D conv's output may share its memory
                others = [r for r in consumers.get(shortcut, []) if r != i]
                if not all(nodes[r].name in self._tasks and fused.get(r, r) < p for r in others):
                    continue  # a later or viewing reader would see the sum written over the shortcut
                activation = [j for j, into in fused.items() if into == i]
                post = self._activation(nodes[activation[0]]) if activation else []
                for j in [i, *activation]:
                    fused[j] = p
                residuals[nodes[p].name] = (i, a, shortcut, post)
                break
        return residuals

    def _bf16_readers_only(self, tensor: str) -> bool:
        """Whether every node reading ``tensor`` is a 2-D conv, deconv or fc that the plan runs in
        bf16 (and the tensor is no graph output): those read bf16 as they compute."""
        readers = self._consumers.get(tensor, [])
        if not readers or tensor in self.graph_outputs:
            return False
        for index in readers:
            task = self._tasks.get(self._nodes[index].name)
            if task is None or task.precision != "bf16" or task.conv1d or self._nodes[index].input[0] != tensor:
                return False
        return True

    @staticmethod
    def _epilogue_nodes(nodes, index: int, count: int) -> list[int]:
        """The indices of the ``count`` epilogue steps after node ``index``: the nodes that read
        the op's output or an earlier step's, in graph order (as core/models/activations.find_epilogue
        takes them)."""
        refs, taken = {nodes[index].output[0]}, []
        for j in range(index + 1, len(nodes)):
            if len(taken) == count:
                break
            if any(name in refs for name in nodes[j].input):
                taken.append(j)
                refs.add(nodes[j].output[0])
        return taken

    def _const(self, name: str) -> np.ndarray | None:
        if name in self.model.initializers:
            return numpy_helper.to_array(self.model.initializers[name]).astype(np.float32)
        return None

    def _activation(self, node) -> list[tuple[str, float, float]] | None:
        """A Relu or Clip (constant bounds) node as post-ops, else None."""
        if node.op_type == "Relu":
            return [("relu", 0.0, 0.0)]
        if node.op_type != "Clip":
            return None
        low, high = _attr(node, "min"), _attr(node, "max")
        for k, bound in ((1, "low"), (2, "high")):
            if len(node.input) > k and node.input[k]:
                value = self._const(node.input[k])
                if value is None or value.size != 1:
                    return None
                low, high = (float(value), high) if bound == "low" else (low, float(value))
        return [("clip_v2", prim.clip_bound(low, -math.inf), prim.clip_bound(high, math.inf))]

    def _shape(self, name: str) -> list[int]:
        if name not in self.model.shapes:
            raise KselectError(f"onednn executor: unknown shape of tensor {name!r}")
        return [int(d) for d in self.model.shapes[name]]

    def _input(self, node, k: int = 0) -> _Tensor:
        name = node.input[k]
        if name not in self.tensors:
            raise UnsupportedOp(f"onednn executor: input {name!r} of {node.op_type} {node.name!r} is not an activation "
                                "this executor computed", node.name)
        return self.tensors[name]

    def _feed(self, node_name: str, memory: dnnl.Memory, md, threads: int) -> dnnl.Memory:
        """``memory``'s data in the format ``md``: itself, or a copy a reorder step writes (one per
        tensor and format, whichever consumers read it)."""
        if dnnl.equal(memory.md, md):
            return memory
        key = (id(memory), dnnl.md_key(md))
        if key not in self._fed:
            copy = self._memory(md)
            dnnl.set_threads(threads)
            self._add(node_name, dnnl.reorder(memory, copy), threads)
            self._fed[key] = copy
        return self._fed[key]

    def _plain(self, node_name: str, tensor: _Tensor) -> dnnl.Memory:
        """The tensor in ONNX's element order: itself, a view where the format has that order (a
        4-D tensor of 1x1 spatial size in nhwc, or blocked with whole blocks), else a reordered copy."""
        plain_md = dnnl.plain_desc(tensor.shape)
        if dnnl.equal(tensor.memory.md, plain_md):
            return tensor.memory
        if len(tensor.shape) == 4 and tensor.shape[2] * tensor.shape[3] == 1:
            channels = tensor.shape[1]
            same_order = dnnl.format_name(tensor.memory.md, ("nhwc",)) is not None or any(
                channels % block == 0 and dnnl.format_name(tensor.memory.md, (fmt,)) is not None
                for fmt, block in (("nChw8c", 8), ("nChw16c", 16), ("nChw4c", 4)))
            if same_order:
                return self._memory(plain_md, tensor.memory.buffer)
        return self._feed(node_name, tensor.memory, plain_md, tensor.threads)

    def _set(self, name: str, shape, memory: dnnl.Memory, threads: int) -> _Tensor:
        tensor = _Tensor(name, shape, memory, threads)
        self.tensors[name] = tensor
        return tensor

    # -- conv / fc ops ------------------------------------------------------------------------
    def _config(self, node, task: Task) -> dict:
        if self.plan is not None and node.name in self.plan.nodes:
            config = dict(self.plan.nodes[node.name]["config"])
        else:
            if not self.library.supports(task):
                raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} ({task.describe_attrs()}) has no "
                                    "oneDNN implementation", node.name)
            config = dict(self.library.default_config(task, self.device))
        self.configs[node.name] = config
        return config

    def _planned_precisions(self) -> dict[str, str]:
        """node -> the precision the plan runs it in (a bf16 op reads and writes f32 tensors, its
        input converted to bf16 within the op: prim.Built; bf16 ones between two bf16 ops:
        ``_built_for``)."""
        if self.plan is None:
            return {}
        tasks = getattr(self.plan, "tasks", [])  # a plan of configs alone runs in fp32
        return {node: entry.get("precision", "fp32") for entry in tasks if isinstance(entry, dict)
                for node in entry.get("nodes", []) if node in self.plan.nodes}

    def _task(self, node) -> Task:
        task = self._tasks.get(node.name)
        if task is None:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} is not a conv / fc op with constant "
                                "float weights", node.name)
        return task

    def _conv(self, node, out_name, post):
        task = self._task(node)
        x = self._input(node)
        w = self._const(node.input[1])
        b = self._const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if task.kind == "fc":
            raise UnsupportedOp(f"onednn executor: {node.name!r} is not a conv", node.name)
        if task.conv1d:
            w = w[:, :, None, :]
        config = self._config(node, task)
        threads = int(config.get("threads", self.default_threads))
        source = x.memory if not task.conv1d else self._memory(dnnl.plain_desc(task.input_shape), x.memory.buffer)
        if node.name in self._residuals:
            add_index, own_output, shortcut, post = self._residuals.pop(node.name)
            built = self._conv_with_residual(node, task, config, w, b, source, out_name, shortcut, post)
            if built is not None:  # the sum is written over the shortcut: copies made of it before are stale
                self._fed = {key: copy for key, copy in self._fed.items() if key[0] != id(built.dst)}
                self._set(out_name, self._shape(out_name), built.dst, threads)
            else:  # the conv writes its own output, and the Add runs as an op of its own
                self._conv(node, own_output, [])
                self._binary(self._nodes[add_index], out_name, post)
            return
        try:
            built = self._built_for(task, config, w, b, source, node.name, out_name)
        except dnnl.DnnlError as exc:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r}: {exc}", node.name) from exc
        output = built.dst
        out_shape = self._shape(out_name)
        if task.conv1d:  # 3-D tensors are kept as ONNX has them
            output = self._memory(dnnl.plain_desc(out_shape), self._feed(node.name, built.dst,
                                                                         dnnl.plain_desc(task.output_shape),
                                                                         threads).buffer)
        self._set(out_name, out_shape, output, threads)

    def _conv_with_residual(self, node, task: Task, config: dict, w, b, source: dnnl.Memory, out_name: str,
                            shortcut_name: str, post: list) -> prim.Built | None:
        """The conv with its residual Add fused (``_residual_adds``), writing the sum over the
        shortcut, or None where that cannot be built: the shortcut is not in f32 in the format
        the conv writes, or the implementation takes no such post-op (the conv and the Add are
        then built apart)."""
        shortcut = self.tensors.get(shortcut_name)
        layout = config.get("layout")
        if shortcut is None or layout is None or not dnnl.equal(shortcut.memory.md, dnnl.desc(task.output_shape, layout)):
            return None
        threads = int(config.get("threads", self.default_threads))
        feed = lambda md: self._feed(node.name, source, md, threads)  # noqa: E731
        try:
            built = prim.Built(task, config, w, b, feed=feed, source_type=_source_type(task, source),
                               sum_into=shortcut.memory,
                               after_sum=post)
        except dnnl.DnnlError:
            return None
        self._adopt(built, node.name)
        return built

    def _adopt(self, built: prim.Built, node_name: str) -> None:
        """The built op's primitives become steps of ``node_name``, on its thread count."""
        self._built.append(built)
        for primitive in built.steps:
            self._add(node_name, primitive, built.threads)
        self.impls[node_name] = built.impl

    def _built_for(self, task: Task, config: dict, w, b, source: dnnl.Memory, node_name: str,
                   out_name: str) -> prim.Built:
        """The configured primitive reading ``source`` (reordered first into the format its
        implementation reads, where that differs). A bf16 op reads a bf16 ``source`` as it is and
        writes bf16 where every reader of its output is a bf16 op too (``_bf16_readers_only``),
        so that no tensor between two bf16 ops is written and read back in f32; elsewhere it
        reads and writes f32, converting its input within the op."""
        threads = int(config.get("threads", self.default_threads))
        feed = lambda md: self._feed(node_name, source, md, threads)  # noqa: E731
        source_type = _source_type(task, source)
        built = None
        if task.precision == "bf16" and self._bf16_readers_only(out_name):
            try:
                built = prim.Built(task, config, w, b, feed=feed, source_type=source_type, dst_type=dnnl.BF16)
            except dnnl.DnnlError:  # the implementation writes no bf16 for this op: it writes f32
                built = None
        if built is None:
            built = prim.Built(task, config, w, b, feed=feed, source_type=source_type)
        self._adopt(built, node_name)
        return built

    def _gemm(self, node, out_name, post):
        task = self._task(node)
        x = self._input(node)
        w = self._const(node.input[1])
        if not _attr(node, "transB", 0):
            w = w.T
        b = None
        if task.has_bias:
            c = self._const(node.input[2])
            if c is None or c.size not in (1, w.shape[0]):
                raise UnsupportedOp(f"onednn executor: Gemm {node.name!r} needs a constant per-column bias", node.name)
            b = np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (w.shape[0],)))
        self._fc(node, task, x, np.ascontiguousarray(w), b, out_name)

    def _matmul(self, node, out_name, post):
        task = self._task(node)
        self._fc(node, task, self._input(node), np.ascontiguousarray(self._const(node.input[1]).T), None, out_name)

    def _fc(self, node, task: Task, x: _Tensor, w, b, out_name):
        if len(x.shape) != 2:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} needs a 2-D input", node.name)
        config = self._config(node, task)
        try:
            built = self._built_for(task, config, w, b, x.memory, node.name, out_name)
        except dnnl.DnnlError as exc:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r}: {exc}", node.name) from exc
        self._set(out_name, self._shape(out_name), built.dst, built.threads)

    # -- elementwise ----------------------------------------------------------------------------
    def _eltwise(self, node, out_name, chain: list[tuple[str, float, float]]):
        """Unary ops as eltwise primitives: the first writes a new tensor, the rest run in place."""
        x = self._input(node)
        dnnl.set_threads(x.threads)
        y = self._memory(x.memory.md)
        source = x.memory
        for algorithm, alpha, beta in chain:
            pd = dnnl.primitive_desc(dnnl.eltwise(algorithm, source.md, alpha, beta))
            self._create(node.name, pd, {dnnl.ARG_SRC: source, dnnl.ARG_DST: y}, x.threads)
            source = y
        self._set(out_name, x.shape, y, x.threads)

    def _relu(self, node, out_name, post):
        self._eltwise(node, out_name, [("relu", 0.0, 0.0)])

    def _leaky_relu(self, node, out_name, post):
        self._eltwise(node, out_name, [("relu", float(_attr(node, "alpha", 0.01)), 0.0)])

    def _clip(self, node, out_name, post):
        chain = self._activation(node)
        if chain is None:
            raise UnsupportedOp(f"onednn executor: Clip {node.name!r} needs constant scalar bounds", node.name)
        self._eltwise(node, out_name, chain)

    def _sigmoid(self, node, out_name, post):
        self._eltwise(node, out_name, [("logistic", 0.0, 0.0)])

    def _tanh(self, node, out_name, post):
        self._eltwise(node, out_name, [("tanh", 0.0, 0.0)])

    def _elu(self, node, out_name, post):
        self._eltwise(node, out_name, [("elu", float(_attr(node, "alpha", 1.0)), 0.0)])

    def _hard_swish(self, node, out_name, post):
        self._eltwise(node, out_name, [("hardswish", 0.0, 0.0)])

    def _hard_sigmoid(self, node, out_name, post):
        alpha, beta = float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))
        self._eltwise(node, out_name, [("linear", alpha, beta), ("clip_v2", 0.0, 1.0)])

    def _operand(self, node, k: int, rank: int) -> _Tensor | np.ndarray:
        name = node.input[k]
        if name in self.tensors:
            return self.tensors[name]
        value = self._const(name)
        if value is None:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r}: unknown input {name!r}", node.name)
        return value.reshape((1,) * (rank - value.ndim) + value.shape)

    def _binary(self, node, out_name, post):
        algorithm = BINARY[node.op_type]
        y_shape = self._shape(node.output[0])
        a, b = (self._operand(node, k, len(y_shape)) for k in range(2))
        shape = lambda v: list(v.shape)  # noqa: E731
        if shape(a) != y_shape or not isinstance(a, _Tensor):
            if algorithm in COMMUTATIVE and isinstance(b, _Tensor) and shape(b) == y_shape:
                a, b = b, a
            else:
                raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} with a constant or broadcast "
                                    "first operand is not supported", node.name)
        if len(shape(b)) != len(y_shape):
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} mixes ranks", node.name)
        threads = a.threads
        if isinstance(b, np.ndarray):
            second = self._constant_like(b, a.memory.md)
        elif shape(b) == y_shape:
            second = self._feed(node.name, b.memory, a.memory.md, threads)  # same format as the first
        else:
            second = b.memory
        dnnl.set_threads(threads)
        attr = dnnl.Attr(post)
        try:
            pd = dnnl.primitive_desc(dnnl.binary(algorithm, a.memory.md, second.md, dnnl.desc(y_shape, "any")), attr)
        except dnnl.DnnlError as exc:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r}: {exc}", node.name) from exc
        finally:
            attr.close()
        y = self._memory(pd.dst)
        self._create(node.name, pd, {dnnl.ARG_SRC: a.memory, dnnl.ARG_SRC_1: second, dnnl.ARG_DST: y}, threads)
        self._set(out_name, y_shape, y, threads)

    def _constant_like(self, value: np.ndarray, tensor_md) -> dnnl.Memory:
        """A constant operand (a per-channel bias broadcast over a 4-D tensor) in the format of the
        tensor it meets: oneDNN 2.6 runs a binary op whose tensor is blocked (nChw16c) and whose
        constant is plain on its reference implementation, some 300 times slower (286 ms against
        well under 1 ms for a 24-channel 368x368 bias Add); in the tensor's own format it takes its
        jit one."""
        plain = self._memory(dnnl.plain_desc(list(value.shape)))
        plain.plain_view()[...] = value
        tag = dnnl.format_name(tensor_md, BROADCAST_FORMATS) if value.ndim == 4 else None
        if tag is None or tag == "nchw":
            return plain
        shaped = self._memory(dnnl.desc(list(value.shape), tag))
        dnnl.reorder_now(plain, shaped)
        return shaped

    # -- pooling ------------------------------------------------------------------------------
    def _pool(self, node, out_name, algorithm: str, kernel, strides, dilations, pads):
        x = self._input(node)
        y_shape = self._shape(out_name)
        if len(x.shape) != 4:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} needs a 4-D input", node.name)
        pads_end = list(pads[2:])
        for axis in range(2):  # ceil_mode: more padding at the end, which pooling never reads as values
            needed = (y_shape[2 + axis] - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] + 1 \
                - x.shape[2 + axis] - pads[axis]
            if needed > pads_end[axis] and algorithm == "avg_include_padding":
                raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} with ceil_mode and "
                                    "count_include_pad is not supported", node.name)
            pads_end[axis] = needed
        dnnl.set_threads(x.threads)
        try:
            pd = dnnl.primitive_desc(dnnl.pooling(algorithm, x.memory.md, dnnl.desc(y_shape, "any"), strides, kernel,
                                                  dilations, pads[:2], pads_end))
        except dnnl.DnnlError as exc:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r}: {exc}", node.name) from exc
        y = self._memory(pd.dst)
        self._create(node.name, pd, {dnnl.ARG_SRC: x.memory, dnnl.ARG_DST: y}, x.threads)
        self._set(out_name, y_shape, y, x.threads)

    def _window(self, node):
        x = self._input(node)
        kernel = list(_attr(node, "kernel_shape"))
        if len(kernel) != 2 or len(x.shape) != 4:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} is not a 2-D pooling", node.name)
        strides = list(_attr(node, "strides", [1, 1]))
        dilations = list(_attr(node, "dilations", [1, 1]))
        return kernel, strides, dilations, explicit_pads(node, x.shape, kernel, strides, dilations)

    def _max_pool(self, node, out_name, post):
        if len(node.output) > 1 and node.output[1]:
            raise UnsupportedOp(f"onednn executor: MaxPool {node.name!r} with indices is not supported", node.name)
        if _attr(node, "storage_order", 0):
            raise UnsupportedOp(f"onednn executor: MaxPool {node.name!r} with storage_order 1", node.name)
        self._pool(node, out_name, "max", *self._window(node))

    def _average_pool(self, node, out_name, post):
        algorithm = "avg_include_padding" if _attr(node, "count_include_pad", 0) else "avg_exclude_padding"
        self._pool(node, out_name, algorithm, *self._window(node))

    def _global(self, node, out_name, algorithm):
        x = self._input(node)
        if len(x.shape) != 4:
            raise UnsupportedOp(f"onednn executor: {node.op_type} {node.name!r} needs a 4-D input", node.name)
        window = x.shape[2:]
        self._pool(node, out_name, algorithm, window, [1, 1], [1, 1], [0, 0, 0, 0])

    def _global_average_pool(self, node, out_name, post):
        self._global(node, out_name, "avg_exclude_padding")

    def _global_max_pool(self, node, out_name, post):
        self._global(node, out_name, "max")

    # -- data movement --------------------------------------------------------------------------
    def _concat(self, node, out_name, post):
        xs = [self._input(node, k) for k in range(len(node.input))]
        rank = len(xs[0].shape)
        axis = int(_attr(node, "axis", 1)) % rank
        threads = xs[0].threads
        dnnl.set_threads(threads)
        try:
            pd = dnnl.concat_desc(None, axis, [x.memory.md for x in xs])
        except dnnl.DnnlError as exc:
            raise UnsupportedOp(f"onednn executor: Concat {node.name!r}: {exc}", node.name) from exc
        y = self._memory(pd.dst)
        args = {dnnl.ARG_MULTIPLE_SRC + k: x.memory for k, x in enumerate(xs)}
        args[dnnl.ARG_DST] = y
        self._create(node.name, pd, args, threads)
        self._set(out_name, self._shape(out_name), y, threads)

    def _reshaped(self, node, out_name, x: _Tensor):
        """A view of the tensor's data in ONNX order (reordered first where its format has another)."""
        y_shape = self._shape(out_name)
        plain = self._plain(node.name, x)
        self._set(out_name, y_shape, self._memory(dnnl.plain_desc(y_shape), plain.buffer), x.threads)

    def _flatten(self, node, out_name, post):
        self._reshaped(node, out_name, self._input(node))

    def _reshape(self, node, out_name, post):
        self._reshaped(node, out_name, self._input(node))

    def _identity(self, node, out_name, post):
        x = self._input(node)
        self._set(out_name, x.shape, x.memory, x.threads)

    def _softmax(self, node, out_name, post):
        x = self._input(node)
        rank = len(x.shape)
        opset = next((o.version for o in self.model.proto.opset_import if o.domain in ("", "ai.onnx")), 13)
        axis = int(_attr(node, "axis", -1 if opset >= 13 else 1)) % rank
        if axis != rank - 1 or (opset < 13 and rank != 2):
            raise UnsupportedOp(f"onednn executor: Softmax {node.name!r} over axis {axis} of {x.shape} is not "
                                "supported", node.name)
        source = self._plain(node.name, x)
        dnnl.set_threads(x.threads)
        pd = dnnl.primitive_desc(dnnl.softmax(source.md, axis))
        y = self._memory(pd.dst)
        self._create(node.name, pd, {dnnl.ARG_SRC: source, dnnl.ARG_DST: y}, x.threads)
        self._set(out_name, x.shape, y, x.threads)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, feeds: dict) -> list[np.ndarray]:
        self.load_inputs(feeds)
        self.run_loaded()
        return self.read_outputs()

    def load_inputs(self, feeds: dict) -> None:
        for tensor in self.inputs:
            np.copyto(tensor.memory.plain_view(), np.asarray(feeds[tensor.name], np.float32).reshape(tensor.shape))

    def run_loaded(self) -> None:
        """One inference on the inputs loaded last, outputs left where their producers wrote them."""
        current = None
        for step in self.steps:
            current = _execute(step, current)
        dnnl.wait()

    def _run_timed(self, spent: dict[str, int]) -> None:
        """``run_loaded`` with each step timed in place (a primitive runs to its end before
        ``dnnl_primitive_execute`` returns on the CPU engine's OpenMP runtime), ns added per node:
        a loop of its own, so that every inference of a plan does not pay for the clock."""
        current = None
        clock = time.perf_counter_ns
        for step, node in zip(self.steps, self.step_nodes):
            step_start = clock()
            current = _execute(step, current)
            spent[node] = spent.get(node, 0) + clock() - step_start
        dnnl.wait()

    def node_times(self, feeds: list[dict], runs: int) -> tuple[float, dict[str, float]]:
        """``runs`` inferences on ``feeds`` in turn, each step timed in place (``_run_timed``):
        (median whole run with its input and output copies, us; node -> median us of its steps)."""
        clock = time.perf_counter_ns
        whole: list[float] = []
        per_node: dict[str, list[float]] = {}
        for index in range(len(feeds) + runs):  # one warm-up run per feed first
            start = clock()
            self.load_inputs(feeds[index % len(feeds)])
            spent: dict[str, int] = {}
            self._run_timed(spent)
            self.read_outputs()
            if index >= len(feeds):
                whole.append((clock() - start) / 1000)
                for node, ns in spent.items():
                    per_node.setdefault(node, []).append(ns / 1000)
        return statistics.median(whole), {node: statistics.median(us) for node, us in per_node.items()}

    def read_outputs(self) -> list[np.ndarray]:
        results = []
        for tensor, reorder, plain in self.outputs:
            if reorder is not None:
                reorder.execute()
                dnnl.wait()
            results.append(plain.plain_view().copy())
        return results

    def close(self) -> None:
        for primitive in self._primitives:
            primitive.close()
        for built in self._built:
            built.close()
        for memory in self._memories:
            memory.close()
        self._primitives, self._built, self._memories, self.steps = [], [], [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# op type -> builder (an Executor method): the one table the executor builds from and
# OnednnLibrary.runs_op reads (an op type not in it is not run by oneDNN)
BUILDERS: dict[str, Callable] = {
    "Conv": Executor._conv,
    "ConvTranspose": Executor._conv,  # the task (find_ops) says which primitive it is
    "Gemm": Executor._gemm,
    "MatMul": Executor._matmul,
    "Relu": Executor._relu,
    "LeakyRelu": Executor._leaky_relu,
    "Clip": Executor._clip,
    "Sigmoid": Executor._sigmoid,
    "Tanh": Executor._tanh,
    "Elu": Executor._elu,
    "HardSwish": Executor._hard_swish,
    "HardSigmoid": Executor._hard_sigmoid,
    "Add": Executor._binary,
    "Sub": Executor._binary,
    "Mul": Executor._binary,
    "Div": Executor._binary,
    "Max": Executor._binary,
    "Min": Executor._binary,
    "MaxPool": Executor._max_pool,
    "AveragePool": Executor._average_pool,
    "GlobalAveragePool": Executor._global_average_pool,
    "GlobalMaxPool": Executor._global_max_pool,
    "Concat": Executor._concat,
    "Flatten": Executor._flatten,
    "Reshape": Executor._reshape,
    "Identity": Executor._identity,
    "Dropout": Executor._identity,
    "Softmax": Executor._softmax,
}
