"""Runs a whole ONNX model through XNNPack operators, each conv / fully connected op built as a
plan says (configured.py), every other op with XNNPack's defaults.

Built once: operators are created with their weights, every tensor gets a preallocated buffer
(buffers are reused once a tensor is dead), and every operator is set up once on its buffers, so
an inference is the input layout conversion, one ``xnn_run_operator`` per operator and the output
copies. Activations stay NHWC between operators: the model's NCHW inputs are converted once at
the start and 4-D outputs converted back at the end (both part of the measured latency).

Modules: graph_prep.py reads the graph (readers, last uses, tasks, the rewrites: a Relu / Clip
folded into the operator before it, a Flatten of NHWC folded into the FC weights); builders.py
holds ``BUILDERS``, the one table of op type -> builder that both building and
``XnnpackLibrary.runs_op`` read, with int8_builders.py for the 8-bit operators; profiling.py times
a built model step by step; this module holds the tensors and their buffers and runs the steps.

Threads: without a plan every operator runs on one pthreadpool of all cores (XNNPack's default).
With a plan, a conv / fc op uses the pool of its planned thread count (1 = the calling thread);
ops without a config (pooling, add, concat, softmax, ...) take the thread count of the op that
produces their first input. The plan-level ``spinning`` says whether the pools' workers spin or
sleep between parallel loops (set on the shim at the start of every inference). In a plan that
mixes libraries (``release_at_end``) spinning pools are put to sleep when the segment ends, so
that the next library's threads are not left one core short.

int8 (a plan whose int8 nodes are entries of int8 tasks, ``task["precision"] == "int8"``): such a
conv / deconv / fc runs its configured 8-bit operator (int8.py: variant qc8 / qs8 / qu8, micro-kernel,
threads), its weights quantized from the model's float weights (per output channel for qc8, one
scale otherwise; bias int32 at input scale x weight scale), its input quantized with the
calibrated range of its input tensor and its output with that of its output tensor (after the
folded Relu / Clip), as asymmetric uint8 (core/precision/quant.py ``asymmetric_u8``; signed variants take
zero point - 128). The ranges are ``plan.extra["precision"]["ranges"]``, onnxruntime.quantization's
calibration cache. An 8-bit tensor stays 8-bit between two int8 ops (the output's range is the next
op's input range); between a signed and an unsigned variant it is converted by flipping the top
bit (same scale, zero points 128 apart). An Add, MaxPool or GlobalAveragePool whose data inputs are
all 8-bit tensors int8 ops wrote, of one signedness, runs on XNNPack's 8-bit operator (``int8_ops``):
the add and the global average pooling from their inputs' grids onto their output's calibrated range,
the max pooling on its input's grid (it takes no quantization; ``grids``), as does a Flatten of an
8-bit tensor (a view). A float consumer (any other op, or one of these the 8-bit operator cannot
take) gets an 8-bit tensor dequantized once (``xnn_create_convert_nc_q*8_f32``), and a float tensor
read by int8 ops is quantized once per signedness (``xnn_create_convert_nc_f32_q*8``). The plan's
int8 nodes are only its conv / deconv / fc ones. A plan with no int8 nodes builds no 8-bit
operator. An int8 node whose activation is a Sigmoid, a SiLU or a LeakyRelu (its
task's epilogue, int8.activation_after) runs it in 8 bits too, as its int8 twin was measured: the
node writes its output tensor's grid (the pre-activation range), the Sigmoid node is XNNPack's
8-bit sigmoid (output on its fixed grid, scale 1/256), the SiLU's Mul node the 8-bit multiply
onto the Mul output's calibrated range, and the LeakyRelu node the 8-bit (qu8) leaky relu onto
its output's calibrated range.

fp16 (a plan whose fp16 nodes are entries of fp16 tasks, ``task["precision"] == "fp16"``): such a
conv / deconv / fc runs XNNPack's f16 operator (half.py) with its plan config (threads), between
the conversion of its float32 input to half and of its half output back to float32, both steps of
the node: it reads and writes float32 NHWC tensors like every other node, so nothing else
changes around it. A Relu / Clip folded into it is the f16 operator's clamp; any other activation
after it runs in float32 as after an fp32 node.
"""

from __future__ import annotations

import numpy as np

from kselect.core.errors import KselectError, UnsupportedOp
from kselect.core.measuring.device import this_device
from kselect.core.plans.plan import int8_nodes, reduced_nodes
from kselect.core.precision.calibration import plan_ranges
from kselect.core.precision.quant import asymmetric_u8
from kselect.plugins.xnnpack import configured, int8, tileshim
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.builders import BUILDERS
from kselect.plugins.xnnpack.graph_prep import NO_CLAMP, activation_range, constant, prepare
from kselect.plugins.xnnpack.tensor import Tensor

_TOP_BIT = np.uint8(0x80)


def _flip_step(destination, source) -> int:
    """int8 <-> uint8 on the same scale (zero points 128 apart): the top bit flipped."""
    np.bitwise_xor(source, _TOP_BIT, out=destination)
    return 0


class _Storage:
    def __init__(self, size):
        self.data = configured.buffer((max(int(size), 1),))  # aligned, with slack after the end
        self.until = -1  # last node index using it
        self.pinned = False


class Executor:
    """``Executor(library, model, plan)(feeds) -> [outputs]``; ``plan`` None = XNNPack defaults."""

    def __init__(self, library, model, plan=None, release_at_end: bool = False, unsafe: bool = False):
        self.model = model
        self.unsafe = unsafe  # overrides that can abort allowed (only in the measuring child)
        self.library = library
        self.plan = plan
        self.device = this_device()
        self.default_threads = self.device.cores
        self._built: list = []
        self._ops: list = []
        self.steps: list[tuple] = []
        self.step_nodes: list[tuple[str, str]] = []  # (node name, op type) of each step
        self.configs: dict[str, dict] = {}  # node -> config used (conv / fc)
        self._free: list[_Storage] = []
        self._kept: list = []  # constant operands and buffers, kept alive while operators read them
        self.int8_nodes = int8_nodes(plan) if plan is not None else set()
        # conv / deconv / fc nodes run on XNNPack's f16 operators, between their conversions (half.py)
        self.fp16_nodes = {node for node, precision in reduced_nodes(plan).items()
                           if precision == "fp16"} if plan is not None else set()
        self.int8_activations: dict[str, str] = {}  # Sigmoid / Mul node after an int8 node -> its variant
        # Add / MaxPool / GlobalAveragePool (ReduceMean) nodes run on 8-bit operators -> "qs8" / "qu8"
        self.int8_ops: dict[str, str] = {}
        # tensors an op wrote on its input's grid (8-bit max pooling, Flatten): (scale, uint8 zero point)
        self.grids: dict[str, tuple[float, int]] = {}
        self.ranges = plan_ranges(plan) if self.int8_nodes else {}
        plan_level = getattr(plan, "plan_level", None) or {}
        self.flags = configured.pool_flags(plan_level)  # spinning: one setting for the whole model
        shim = tileshim.shim()
        self._set_flags = shim.set_flags if shim is not None else None
        self.run_operator = xa.lib().xnn.xnn_run_operator
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        pools = {pool for fn, _, pool in self.steps if fn is self.run_operator and pool is not None}
        spinning = self.flags == 0  # a pool that yields after every loop needs no release
        self._release = [(shim.release, pool) for pool in pools] if release_at_end and spinning and shim else []

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        self.graph = prepare(self.model)
        self.graph_outputs = self.graph.graph_outputs
        self.last_use = self.graph.last_use
        self.index = -1  # the node being built
        self.tensors: dict[str, Tensor] = {}
        self.inputs: list[tuple[str, Tensor]] = []
        for name, shape in self.model.input_shapes.items():
            tensor = self.new_tensor(name, shape, -1)
            tensor.storage.pinned = True
            self.inputs.append((name, tensor))
        nodes = self.graph.nodes
        for i, node in enumerate(nodes):
            if i in self.graph.fused_into:
                continue
            act = NO_CLAMP
            out_name = node.output[0] if node.output else None
            if i in self.graph.fused_activation:
                act_node = nodes[self.graph.fused_activation[i]]
                act = activation_range(self.model, act_node)
                out_name = act_node.output[0]
                self.last_use.setdefault(node.output[0], i)
            builder = BUILDERS.get(node.op_type)
            if builder is None:
                raise UnsupportedOp(f"xnnpack executor: {node.op_type} (node {node.name!r}) is not supported", node.name)
            steps_before = len(self.steps)
            self.index = i
            builder(self, node, i, out_name, act)
            self.step_nodes += [(node.name, node.op_type)] * (len(self.steps) - steps_before)
            # release storages whose tensors are all dead after this node
            for name in node.input:
                tensor = self.tensors.get(name)
                if tensor is not None and tensor.storage is not None and tensor.storage.until <= i \
                        and not tensor.storage.pinned and tensor.storage not in self._free:
                    self._free.append(tensor.storage)
        self.outputs = []
        for o in self.model.proto.graph.output:
            if o.name not in self.tensors:
                raise KselectError(f"xnnpack executor: graph output {o.name!r} was not computed")
            self.outputs.append(self.as_float(self.tensors[o.name], len(nodes)))

    def _alloc(self, size: int) -> _Storage:
        best = None
        for s in self._free:
            if s.data.size >= size and s.data.size <= 2 * size + 1024 and (best is None or s.data.size < best.data.size):
                best = s
        if best is not None:
            self._free.remove(best)
            best.until = -1
            return best
        return _Storage(size)

    def new_tensor(self, name, shape, index) -> Tensor:
        """A float tensor in a (reused) buffer of its own, NHWC when 4-D."""
        shape = [int(d) for d in shape]
        nhwc = len(shape) == 4
        stored = (shape[0], shape[2], shape[3], shape[1]) if nhwc else tuple(shape)
        size = int(np.prod(stored)) if stored else 1
        storage = self._alloc(size)
        storage.until = max(storage.until, self.last_use.get(name, index))
        if name in self.graph_outputs:
            storage.pinned = True
        array = storage.data[:size].reshape(stored)
        tensor = Tensor(name, shape, array, storage, nhwc)
        self.tensors[name] = tensor
        return tensor

    def alias(self, name, source: Tensor, shape, index, array=None, perm=None) -> Tensor:
        """A tensor on ``source``'s buffer (``array``: a view of it in another shape)."""
        tensor = Tensor(name, shape, source.array if array is None else array, source.storage, False, perm)
        tensor.nhwc = array is None and source.nhwc
        tensor.threads = source.threads
        source.storage.until = max(source.storage.until, self.last_use.get(name, index))
        if name in self.graph_outputs:
            source.storage.pinned = True
        self.tensors[name] = tensor
        return tensor

    def int8_tensor(self, name, node, q: np.ndarray, key: tuple, source: Tensor) -> Tensor:
        """The 8-bit output ``q`` (grid ``key``) of an 8-bit operator reading ``source``."""
        shape = [int(d) for d in self.shape(node.output[0])]
        tensor = Tensor(name, shape, None, None, len(shape) == 4, source.perm)
        tensor.q[key] = q
        tensor.int8_output = True
        tensor.threads = source.threads
        self.tensors[name] = tensor
        return tensor

    def const(self, name) -> np.ndarray | None:
        return constant(self.model, name)

    def shape(self, name):
        if name not in self.model.shapes:
            raise KselectError(f"xnnpack executor: unknown shape of tensor {name!r}")
        return self.model.shapes[name]

    def threads_of(self, tensor: Tensor | None) -> int:
        """The thread count of the op that wrote ``tensor`` (an op without a config takes it)."""
        if self.plan is None or tensor is None or tensor.threads is None:
            return self.default_threads
        return tensor.threads

    def add_op(self, op, threads: int) -> None:
        """A set-up operator, run by ``xnn_run_operator`` on the pool of ``threads``."""
        pool = configured.pool_for(threads)
        self._ops.append(op)
        self.steps += [(self.run_operator, handle, None if pool is None else pool.handle) for handle in op.handles]

    def add_built(self, built: configured.Built) -> None:
        self._built.append(built)
        self.steps.extend(built.steps)

    def keep_alive(self, value) -> None:
        self._kept.append(value)

    def keep_const(self, const: np.ndarray, nhwc: bool) -> np.ndarray:
        """A constant operand as XNNPack reads it (NHWC against a 4-D tensor), kept alive."""
        if nhwc:
            c4 = const.reshape((1,) * (4 - const.ndim) + const.shape)
            const = np.ascontiguousarray(c4.transpose(0, 2, 3, 1))
        else:
            const = np.ascontiguousarray(const, dtype=np.float32)
        padded = configured.buffer(const.shape)
        np.copyto(padded, const)
        self.keep_alive(padded)
        return padded

    def input(self, node, k=0, as_float: bool = True) -> Tensor:
        """Input ``k`` of ``node``; ``as_float``: with its float array (dequantized here, once, when
        an int8 op wrote it), which every op but an int8 conv / fc reads."""
        name = node.input[k]
        if name not in self.tensors:
            raise UnsupportedOp(f"xnnpack executor: input {name!r} of {node.op_type} {node.name!r} is not an activation "
                                "this executor computed (constant inputs are supported only as weights)", node.name)
        tensor = self.tensors[name]
        return self.as_float(tensor, self.index) if as_float else tensor

    def config(self, node) -> dict:
        """The plan's config of a conv / fc node, else the library's default; recorded in ``configs``."""
        task = self.graph.tasks.get(node.name)
        if task is None:
            raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} is not a conv / fc op with constant "
                                "weights", node.name)
        if self.plan is not None and node.name in self.plan.nodes:
            config = dict(self.plan.nodes[node.name]["config"])
        else:
            config = dict(self.library.default_config(task, self.device))
        self.configs[node.name] = config
        return config

    # -- 8-bit tensors ----------------------------------------------------------------------
    def grid(self, tensor: str, node) -> tuple[float, int]:
        """(scale, uint8 zero point) of a tensor from its calibrated range, as onnxruntime's
        quantizer derives them (asymmetric uint8, the range widened to include 0); for a tensor an
        8-bit max pooling or a Flatten wrote, its input's grid (as onnxruntime's quantizer gives
        those ops their input's quantization)."""
        if tensor in self.grids:
            return self.grids[tensor]
        if tensor not in self.ranges:
            raise KselectError(f"xnnpack executor: int8 node {node.name!r}: the plan's calibration has no range for "
                               f"tensor {tensor!r}")
        return asymmetric_u8(*self.ranges[tensor])

    def calibrated(self, tensor: str) -> tuple[float, int] | None:
        return asymmetric_u8(*self.ranges[tensor]) if tensor in self.ranges else None

    def int8_buffer(self, shape, signed: bool) -> np.ndarray:
        array = int8.buffer(tuple(shape), np.int8 if signed else np.uint8)  # with the slack XNNPack may read
        self.keep_alive(array)
        return array

    def as_float(self, tensor: Tensor, index: int) -> Tensor:
        """``tensor`` with its float array: an 8-bit tensor is dequantized into a float buffer, once,
        by a step placed before its first float reader."""
        if tensor.array is not None:
            return tensor
        (signed, scale, zero_point), q = next(iter(tensor.q.items()))
        size = int(np.prod(q.shape))
        storage = self._alloc(size)
        storage.until = max(storage.until, self.last_use.get(tensor.name, index))
        if tensor.name in self.graph_outputs:
            storage.pinned = True
        tensor.storage, tensor.array = storage, storage.data[:size].reshape(q.shape)
        channels = q.shape[-1] if q.ndim else 1
        op = xa.QuantizeConvert("f32", channels, scale, zero_point - (128 if signed else 0),
                                variant="qs8" if signed else "qu8")
        op.setup(q.reshape(-1, channels), tensor.array.reshape(-1, channels))
        self.add_op(op, self.threads_of(tensor))
        return tensor

    def quantized(self, tensor: Tensor, signed: bool, scale: float, zero_point: int, threads: int,
                  index: int) -> np.ndarray:
        """``tensor`` as 8-bit integers on this grid: the copy an int8 op wrote or an earlier step
        made, the other signedness of the same grid with its top bit flipped, else quantized from
        the float array (dequantized first when only another grid exists)."""
        key = (signed, scale, zero_point)
        if key in tensor.q:
            return tensor.q[key]
        q = self.int8_buffer(tensor.stored_shape, signed)
        other = tensor.q.get((not signed, scale, zero_point))
        if other is not None:
            self.steps.append((_flip_step, q.view(np.uint8), other.view(np.uint8)))
        else:
            self.as_float(tensor, index)
            channels = q.shape[-1] if q.ndim else 1
            op = xa.QuantizeConvert("qs8" if signed else "qu8", channels, scale, zero_point - (128 if signed else 0))
            op.setup(tensor.array.reshape(-1, channels), q.reshape(-1, channels))
            self.add_op(op, threads)
        tensor.q[key] = q
        return q

    # -- running ----------------------------------------------------------------------------
    def __call__(self, feeds: dict) -> list[np.ndarray]:
        self.load_inputs(feeds)
        self.run_loaded()
        return self.read_outputs()

    def run_loaded(self) -> None:
        """One inference on the inputs loaded last, outputs left in place (a measured op)."""
        for fn, a, b in self.steps:
            status = fn(a, b)
            if status:
                raise xa.XNNPackError(status, "xnn_run_operator")
        self.release_pools()

    def release_pools(self) -> None:
        """In a plan across libraries, the spinning pools' workers put to sleep at the segment's end."""
        for release, pool in self._release:
            release(pool)

    def load_inputs(self, feeds: dict) -> None:
        if self._set_flags is not None:
            self._set_flags(self.flags)
        for name, tensor in self.inputs:
            np.copyto(tensor.array, feeds[name].transpose(0, 2, 3, 1) if tensor.nhwc else feeds[name])

    def read_outputs(self) -> list[np.ndarray]:
        return [np.ascontiguousarray(t.array.transpose(0, 3, 1, 2)) if t.nhwc else t.array.copy()
                for t in self.outputs]

    def close(self) -> None:
        for built in self._built:
            built.close()
        for op in self._ops:
            op.close()
        self._built, self._ops, self.steps = [], [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
