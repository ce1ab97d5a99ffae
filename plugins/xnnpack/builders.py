"""How the XNNPack executor builds each ONNX op: ``BUILDERS``, op type -> builder, is the one
table the executor builds from and ``XnnpackLibrary.runs_op`` reads (an op type not in it is not
run by XNNPack). A builder ``(ex, node, i, out_name, act)`` creates the op's XNNPack operators
on the buffers of the executor ``ex`` (executor.py) and sets them up: ``i`` is the node's index,
``out_name`` the tensor it writes (that of a Relu / Clip folded into it) and ``act`` the
(low, high) output range of that Relu / Clip (graph_prep.py). The int8 variants go through the
same builders: a plan's int8 Conv / ConvTranspose / Gemm / MatMul, the Sigmoid, Mul and LeakyRelu
after one, and an Add, GlobalAveragePool or ReduceMean of 8-bit tensors are built in
int8_builders.py; the 8-bit MaxPool and the Flatten of an 8-bit tensor (a view) here. A plan's
fp16 conv / deconv / fc is its f16 operator between two conversions (half.py), on the same float
buffers as an fp32 one.
"""

from __future__ import annotations

import math

import numpy as np

from kselect.core.errors import KselectError, UnsupportedOp
from kselect.core.models.tasks import explicit_pads
from kselect.plugins.xnnpack import configured, half, int8_builders
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.graph_prep import NO_CLAMP, activation_range, attr
from kselect.plugins.xnnpack.tensor import Tensor

NHWC_AXIS = {0: 0, 1: 3, 2: 1, 3: 2}  # NCHW axis -> NHWC axis


def _copy_step(destination, source) -> int:
    np.copyto(destination, source)
    return 0


def _build_configured(ex, node, i, out_name, act, w, b, x: Tensor, y_shape):
    if node.name in ex.int8_nodes:
        int8_builders.conv_or_fc(ex, node, i, out_name, act, w, b, x, y_shape)
        return
    x = ex.as_float(x, i)
    y = ex.new_tensor(out_name, y_shape, i)
    y.threads = _build_operator(ex, node, act, w, b, x.array, y.array)


def _build_operator(ex, node, act, w, b, x_array, y_array) -> int:
    """The conv / fc operator as the node's config says, on these buffers (an fp16 node's f16
    operator between the conversions of its input and output, half.py); its thread count."""
    config = ex.config(node)
    task = ex.graph.tasks[node.name]
    if node.name in ex.fp16_nodes:
        built = half.build(task.at_precision("fp16"), config, w, b, x_array, y_array, act[0], act[1])
    else:
        built = configured.build(configured.OpSpec(task), config, w, b, x_array, y_array, act[0], act[1],
                                 unsafe=ex.unsafe, check_kernels=True)
    ex.add_built(built)
    return int(config.get("threads", ex.default_threads))


def conv(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    w = ex.const(node.input[1])
    b = ex.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if node.name in ex.int8_nodes and not x.nhwc:
        raise KselectError(f"xnnpack executor: {node.op_type} {node.name!r} has no int8 operator here "
                           "(2-D conv, deconv and fully connected only)")
    if node.op_type == "Conv" and len(x.shape) == 3:
        return _conv1d(ex, node, i, out_name, act, ex.as_float(x, i), w, b)
    if not x.nhwc:
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} needs a 4-D input", node.name)
    _build_configured(ex, node, i, out_name, act, w, b, x, ex.shape(node.output[0]))


def _conv1d(ex, node, i, out_name, act, x: Tensor, w, b):
    """A 1-D conv as XNNPack's 2-D one of height 1: its [N, C, W] input is copied into an NHWC
    buffer of height 1 and the result copied back to [N, C, W] (XNNPack has no 1-D conv)."""
    n, c, width = x.shape
    y_shape = ex.shape(node.output[0])
    x_nhwc, y_nhwc = configured.buffer((n, 1, width, c)), configured.buffer((n, 1, y_shape[2], y_shape[1]))
    ex.keep_alive(x_nhwc)  # kept alive while the operator reads and writes them
    ex.keep_alive(y_nhwc)
    ex.steps.append((_copy_step, x_nhwc[:, 0], x.array.transpose(0, 2, 1)))
    y = ex.new_tensor(out_name, y_shape, i)
    y.threads = _build_operator(ex, node, act, w[:, :, None, :], b, x_nhwc, y_nhwc)
    ex.steps.append((_copy_step, y.array, y_nhwc[:, 0].transpose(0, 2, 1)))


def gemm(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    if attr(node, "transA", 0):
        raise UnsupportedOp(f"xnnpack executor: Gemm {node.name!r} with transA is not supported", node.name)
    w = ex.const(node.input[1])
    if w is None or w.ndim != 2:
        raise UnsupportedOp(f"xnnpack executor: Gemm {node.name!r} needs constant 2-D weights", node.name)
    if not attr(node, "transB", 0):
        w = w.T
    w = np.ascontiguousarray(w * np.float32(attr(node, "alpha", 1.0)))
    b = None
    if len(node.input) > 2 and node.input[2]:
        c = ex.const(node.input[2])
        if c is None or c.size not in (1, w.shape[0]):
            raise UnsupportedOp(f"xnnpack executor: Gemm {node.name!r} needs a constant per-column bias", node.name)
        b = np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (w.shape[0],)) * np.float32(attr(node, "beta", 1.0)))
    _fc(ex, node, i, out_name, act, x, w, b)


def matmul(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    w = ex.const(node.input[1])
    if w is None or w.ndim != 2:
        raise UnsupportedOp(f"xnnpack executor: MatMul {node.name!r} needs constant 2-D weights", node.name)
    _fc(ex, node, i, out_name, act, x, np.ascontiguousarray(w.T), None)


def _fc(ex, node, i, out_name, act, x: Tensor, w, b):
    if len(x.stored_shape) != 2:
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} needs a 2-D input", node.name)
    if x.perm is not None:  # input is an NHWC tensor flattened in NHWC order: permute W's columns
        c, h, wd = x.perm
        w = np.ascontiguousarray(w.reshape(w.shape[0], c, h, wd).transpose(0, 2, 3, 1).reshape(w.shape[0], -1))
    _build_configured(ex, node, i, out_name, act, w, b, x, ex.shape(node.output[0]))


def relu(ex, node, i, out_name, act):
    _clamp(ex, node, i, out_name, (0.0, math.inf))


def clip(ex, node, i, out_name, act):
    rng = activation_range(ex.model, node)
    if rng is None:
        raise UnsupportedOp(f"xnnpack executor: Clip {node.name!r} needs constant bounds", node.name)
    _clamp(ex, node, i, out_name, rng)


def _clamp(ex, node, i, out_name, rng):
    _unary(ex, node, i, out_name, lambda channels: xa.Clamp(channels, rng[0], rng[1]))


def _pool(ex, node, i, out_name, kind):
    x = ex.input(node, as_float=False)
    if not x.nhwc:
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} needs a 4-D input", node.name)
    kernel = list(attr(node, "kernel_shape"))
    strides = list(attr(node, "strides", [1, 1]))
    dilations = list(attr(node, "dilations", [1, 1]))
    pads = explicit_pads(node, x.shape, kernel, strides, dilations)
    y_shape = ex.shape(node.output[0])
    if kernel == [1, 1]:  # XNNPack rejects 1x1 pooling windows; unstrided, unpadded it is an identity
        if strides == [1, 1] and not any(pads):
            ex.alias(out_name, ex.as_float(x, i), y_shape, i)
            return
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} with a 1x1 window and stride "
                            f"{strides} is not supported", node.name)
    channels = x.shape[1]
    # max pooling of an 8-bit tensor: on its grid (the operator takes no quantization)
    quantized = int8_builders.eight_bit_inputs(ex, node, 1) if kind == "max" else None
    if quantized is not None:
        key, xq = quantized[0][1:]
        op = xa.QMaxPooling2D("qs8" if key[0] else "qu8", channels, kernel, stride=strides, dilation=dilations,
                              padding=pads)
    elif kind == "max":
        x = ex.as_float(x, i)
        op = xa.MaxPooling2D(channels, kernel, stride=strides, dilation=dilations, padding=pads)
    else:
        if dilations != [1, 1]:
            raise UnsupportedOp(f"xnnpack executor: dilated AveragePool {node.name!r} is not supported", node.name)
        if attr(node, "count_include_pad", 0) and any(pads):
            raise UnsupportedOp(f"xnnpack executor: AveragePool {node.name!r} with count_include_pad=1 and "
                                "padding is not supported (XNNPack divides by the valid pixels)", node.name)
        x = ex.as_float(x, i)
        op = xa.AveragePooling2D(channels, kernel, stride=strides, padding=pads)
    expected = op.output_shape((x.shape[0], x.shape[2], x.shape[3], channels))
    if tuple(expected) != (y_shape[0], y_shape[2], y_shape[3], y_shape[1]):
        op.close()
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} output {y_shape} needs ceil_mode, "
                            "which is not supported", node.name)
    if quantized is not None:
        yq = ex.int8_buffer(expected, key[0])
        op.setup(xq, yq)
        ex.add_op(op, ex.threads_of(x))
        ex.int8_tensor(out_name, node, yq, key, x)
        ex.grids[out_name] = key[1:]
        ex.int8_ops[node.name] = op.variant
        return
    y = ex.new_tensor(out_name, y_shape, i)
    op.setup(x.array, y.array)
    y.threads = ex.threads_of(x)
    ex.add_op(op, y.threads)


def max_pool(ex, node, i, out_name, act):
    if len(node.output) > 1 and node.output[1]:
        raise UnsupportedOp(f"xnnpack executor: MaxPool {node.name!r} with indices is not supported", node.name)
    _pool(ex, node, i, out_name, "max")


def average_pool(ex, node, i, out_name, act):
    _pool(ex, node, i, out_name, "avg")


def global_average_pool(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    if not x.nhwc:
        raise UnsupportedOp(f"xnnpack executor: GlobalAveragePool {node.name!r} needs a 4-D input", node.name)
    _global_average(ex, node, i, out_name, x)


def _global_average(ex, node, i, out_name, x: Tensor) -> None:
    if int8_builders.global_average(ex, node, out_name, x):
        return
    x = ex.as_float(x, i)
    y = ex.new_tensor(out_name, ex.shape(node.output[0]), i)
    op = xa.GlobalAveragePooling(x.shape[1])
    op.setup(x.array, y.array.reshape(x.shape[0], x.shape[1]))
    y.threads = ex.threads_of(x)
    ex.add_op(op, y.threads)


def _operand(ex, node, k):
    """Input ``k`` of an elementwise node: a tensor this executor computed, or a constant."""
    name = node.input[k]
    if name in ex.tensors:
        return ex.as_float(ex.tensors[name], ex.index)
    c = ex.const(name)
    if c is None:
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r}: unknown input {name!r}", node.name)
    return c


def _binary(ex, node, i, out_name, act, kind, operands=None):
    operands = operands or [_operand(ex, node, k) for k in range(2)]
    y_shape = ex.shape(node.output[0])
    tensors = [o for o in operands if isinstance(o, Tensor)]
    nhwc = len(y_shape) == 4
    if not tensors or any(t.nhwc != nhwc or t.perm is not None or len(t.shape) != len(y_shape) for t in tensors):
        raise UnsupportedOp(f"xnnpack executor: {node.op_type} {node.name!r} mixes layouts or ranks", node.name)
    y = ex.new_tensor(out_name, y_shape, i)
    arrays = [o.array if isinstance(o, Tensor) else ex.keep_const(o, nhwc) for o in operands]
    # an activation folds only into the ops that clamp their output (the fusion pass above)
    op = xa.Binary(kind) if kind in ("maximum", "minimum") else xa.Binary(kind, output_min=act[0], output_max=act[1])
    op.setup(arrays[0], arrays[1], y.array)
    y.threads = ex.threads_of(tensors[0])
    ex.add_op(op, y.threads)


def add(ex, node, i, out_name, act):
    if not int8_builders.add(ex, node, out_name, act):
        _binary(ex, node, i, out_name, act, "add")


def mul(ex, node, i, out_name, act):
    if node.name in ex.int8_activations:
        int8_builders.multiply(ex, node, out_name, act)
        return
    _binary(ex, node, i, out_name, act, "multiply")


def sub(ex, node, i, out_name, act):
    _binary(ex, node, i, out_name, act, "subtract")


def div(ex, node, i, out_name, act):
    _binary(ex, node, i, out_name, act, "divide")


def maximum(ex, node, i, out_name, act):
    if len(node.input) != 2:
        raise UnsupportedOp(f"xnnpack executor: Max {node.name!r} with {len(node.input)} inputs", node.name)
    _binary(ex, node, i, out_name, act, "maximum")


def minimum(ex, node, i, out_name, act):
    if len(node.input) != 2:
        raise UnsupportedOp(f"xnnpack executor: Min {node.name!r} with {len(node.input)} inputs", node.name)
    _binary(ex, node, i, out_name, act, "minimum")


def _unary(ex, node, i, out_name, op_for_channels):
    x = ex.input(node)
    y = ex.new_tensor(out_name, x.shape, i)
    y.array = y.array.reshape(x.array.shape)
    channels = x.array.shape[-1] if x.array.ndim else 1
    op = op_for_channels(channels)
    op.setup(x.array.reshape(-1, channels), y.array.reshape(-1, channels))
    y.threads = ex.threads_of(x)
    y.perm = x.perm
    ex.add_op(op, y.threads)


def sigmoid(ex, node, i, out_name, act):
    if node.name in ex.int8_activations:
        int8_builders.sigmoid(ex, node, out_name)
        return
    _unary(ex, node, i, out_name, lambda c: xa.Unary("sigmoid", c))


def hard_swish(ex, node, i, out_name, act):
    _unary(ex, node, i, out_name, lambda c: xa.Unary("hardswish", c))


def leaky_relu(ex, node, i, out_name, act):
    if node.name in ex.int8_activations:
        int8_builders.leaky_relu(ex, node, out_name)
        return
    _unary(ex, node, i, out_name, lambda c: xa.Unary("leaky_relu", c, float(attr(node, "alpha", 0.01))))


def elu(ex, node, i, out_name, act):
    _unary(ex, node, i, out_name, lambda c: xa.Unary("elu", c, float(attr(node, "alpha", 1.0))))


def hard_sigmoid(ex, node, i, out_name, act):
    """max(0, min(1, alpha * x + beta)): a multiply, then an add clamped to [0, 1]."""
    x = ex.input(node)
    alpha = np.array(attr(node, "alpha", 0.2), np.float32)
    beta = np.array(attr(node, "beta", 0.5), np.float32)
    _binary(ex, node, i, out_name, NO_CLAMP, "multiply", [x, alpha])
    y = ex.tensors[out_name]
    op = xa.Binary("add", output_min=0.0, output_max=1.0)
    op.setup(y.array, ex.keep_const(beta, y.nhwc), y.array)
    ex.add_op(op, y.threads)


def prelu(ex, node, i, out_name, act):
    x = ex.input(node)
    slope = ex.const(node.input[1])
    channels = x.array.shape[-1] if x.array.ndim else 1
    if slope is None or slope.size not in (1, channels) or (slope.size > 1 and not x.nhwc and len(x.shape) != 2):
        raise UnsupportedOp(f"xnnpack executor: PRelu {node.name!r} needs a constant scalar or per-channel slope",
                            node.name)
    slopes = np.broadcast_to(slope.reshape(-1), (channels,)).copy()
    _unary(ex, node, i, out_name, lambda c: xa.PReLU(slopes))


def reduce_mean(ex, node, i, out_name, act):
    """Over the spatial axes of a 4-D tensor: a global average pooling."""
    x = ex.input(node, as_float=False)
    axes = attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        const = ex.const(node.input[1])
        axes = None if const is None else [int(a) for a in const.reshape(-1)]
    if not x.nhwc or axes is None or sorted(a % 4 for a in axes) != [2, 3]:
        raise UnsupportedOp(f"xnnpack executor: ReduceMean {node.name!r} over axes {axes} is not supported", node.name)
    _global_average(ex, node, i, out_name, x)


def _copies(ex, node, x: Tensor, axis: int, pieces: list[tuple[str, int, int]], index: int) -> None:
    """Each (output name, start, length) along ``axis`` of ``x`` as a strided XNNPack copy."""
    stored_axis = NHWC_AXIS[axis] if x.nhwc else axis
    stored = x.array.shape
    outer = int(np.prod(stored[:stored_axis], dtype=np.int64))
    inner = int(np.prod(stored[stored_axis + 1:], dtype=np.int64))
    row = stored[stored_axis] * inner
    threads = ex.threads_of(x)
    pool = configured.pool_for(threads)
    for out_name, start, length in pieces:
        y = ex.new_tensor(out_name, ex.shape(out_name), index)
        copy = xa._CopyNC(length * inner, row, length * inner)
        copy.setup_raw(outer, xa._ptr(x.array) + 4 * start * inner, xa._ptr(y.array), pool)
        ex.add_op(copy, threads)
        y.threads = threads


def split(ex, node, i, out_name, act):
    x = ex.input(node)
    rank = len(x.shape)
    axis = int(attr(node, "axis", 0)) % rank
    sizes = attr(node, "split", None)
    if sizes is None and len(node.input) > 1 and node.input[1]:
        const = ex.const(node.input[1])
        sizes = None if const is None else [int(v) for v in const.reshape(-1)]
    if sizes is None:
        sizes = [ex.shape(o)[axis] for o in node.output]
    if x.perm is not None or len(sizes) != len(node.output) or sum(sizes) != x.shape[axis]:
        raise UnsupportedOp(f"xnnpack executor: Split {node.name!r} is not supported", node.name)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    _copies(ex, node, x, axis, [(o, s, n) for o, s, n in zip(node.output, starts, sizes)], i)


def slice_on_one_axis(ex, node, i, out_name, act):
    """A slice along one axis with step 1 (constant starts, ends, axes)."""
    x = ex.input(node)
    rank = len(x.shape)
    consts = [ex.const(node.input[k]) if len(node.input) > k and node.input[k] else None for k in range(1, 5)]
    starts, ends, axes, steps = consts
    if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and axes is None) \
            or (len(node.input) > 4 and node.input[4] and steps is None) or x.perm is not None:
        raise UnsupportedOp(f"xnnpack executor: Slice {node.name!r} needs constant starts, ends and axes", node.name)
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes.reshape(-1)]
    steps = [1] * len(axes) if steps is None else [int(v) for v in steps.reshape(-1)]
    y_shape = ex.shape(node.output[0])
    changed = [k for k, a in enumerate(axes) if y_shape[a] != x.shape[a]]
    if len(changed) > 1 or any(s != 1 for s in steps):
        raise UnsupportedOp(f"xnnpack executor: Slice {node.name!r} over several axes or with steps", node.name)
    if not changed:
        ex.alias(out_name, x, y_shape, i)
        return
    k = changed[0]
    axis, size = axes[k], x.shape[axes[k]]
    start = int(starts.reshape(-1)[k])
    start = min(max(start + size if start < 0 else start, 0), size)
    _copies(ex, node, x, axis, [(out_name, start, y_shape[axis])], i)


def resize(ex, node, i, out_name, act):
    """Bilinear resizing of the spatial dims (mode linear, no antialiasing)."""
    x = ex.input(node)
    mode = attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    transform = attr(node, "coordinate_transformation_mode", b"half_pixel")
    transform = transform.decode() if isinstance(transform, bytes) else transform
    y_shape = ex.shape(node.output[0])
    flags = {"half_pixel": {}, "pytorch_half_pixel": {}, "align_corners": {"align_corners": True},
             "asymmetric": {"legacy": True}}
    if (mode != "linear" or not x.nhwc or y_shape[:2] != x.shape[:2] or transform not in flags
            or (transform == "pytorch_half_pixel" and min(y_shape[2:]) == 1) or attr(node, "antialias", 0)):
        raise UnsupportedOp(f"xnnpack executor: Resize {node.name!r} ({mode}, {transform}) is not supported", node.name)
    y = ex.new_tensor(out_name, y_shape, i)
    op = xa.ResizeBilinear(x.shape[1], (y_shape[2], y_shape[3]), **flags[transform])
    op.setup(x.array, y.array)
    y.threads = ex.threads_of(x)
    ex.add_op(op, y.threads)


def concat(ex, node, i, out_name, act):
    xs = [ex.input(node, k) for k in range(len(node.input))]
    rank = len(xs[0].shape)
    axis = int(attr(node, "axis", 1))
    axis = axis + rank if axis < 0 else axis
    if any(x.nhwc != xs[0].nhwc or x.perm is not None for x in xs):
        raise UnsupportedOp(f"xnnpack executor: Concat {node.name!r} mixes layouts", node.name)
    stored_axis = NHWC_AXIS[axis] if xs[0].nhwc else axis
    y = ex.new_tensor(out_name, ex.shape(node.output[0]), i)
    concat = xa.Concatenate([x.array.shape for x in xs], stored_axis)
    threads = ex.threads_of(xs[0])
    pool = configured.pool_for(threads)
    concat.run([x.array for x in xs], y.array, threadpool=pool)  # sets up each copy on its slice
    for copy in concat._ops:
        ex.add_op(copy, threads)
    ex.keep_alive(concat)
    y.threads = threads


def flatten(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    axis = int(attr(node, "axis", 1))
    axis = axis + len(x.shape) if axis < 0 else axis
    if axis != 1:
        raise UnsupportedOp(f"xnnpack executor: Flatten {node.name!r} with axis {axis} is not supported", node.name)
    _flatten_to_2d(ex, node, i, out_name, x, ex.shape(node.output[0]))


def _flatten_to_2d(ex, node, i, out_name, x: Tensor, y_shape):
    if not x.nhwc:
        _view(ex, out_name, x, y_shape, i, x.perm)
        return
    n, c, h, w = x.shape
    if h * w == 1:
        _view(ex, out_name, x, y_shape, i)
        return
    if ex.graph.folds_into_fc(out_name):  # the FC weights' columns are permuted instead (_fc)
        _view(ex, out_name, x, y_shape, i, (c, h, w))
        return
    x = ex.as_float(x, i)
    y = ex.new_tensor(out_name, y_shape, i)
    src = x.array.transpose(0, 3, 1, 2)
    dst = y.array.reshape(n, c, h, w)
    ex.steps.append((lambda d, s: np.copyto(d, s), dst, src))
    y.threads = x.threads


def _view(ex, out_name, x: Tensor, y_shape, i, perm=None) -> None:
    """``x`` reshaped to ``y_shape`` in its stored order, no data moved; when int8 ops wrote ``x``,
    its 8-bit copies too, and the result stays on ``x``'s grid."""
    if x.array is not None:
        y = ex.alias(out_name, x, y_shape, i, array=x.array.reshape(y_shape), perm=perm)
    else:
        y = Tensor(out_name, y_shape, None, None, False, perm)
        y.threads = x.threads
        ex.tensors[out_name] = y
    if x.int8_output:
        y.q = {key: q.reshape(y_shape) for key, q in x.q.items()}
        y.int8_output = True
        ex.grids[out_name] = next(iter(x.q))[1:]


def reshape(ex, node, i, out_name, act):
    x = ex.input(node, as_float=False)
    y_shape = ex.shape(node.output[0])
    if len(y_shape) == 2 and y_shape[0] == x.shape[0]:
        _flatten_to_2d(ex, node, i, out_name, x, y_shape)
        return
    if not x.nhwc and len(y_shape) != 4:
        _view(ex, out_name, x, y_shape, i)
        return
    raise UnsupportedOp(f"xnnpack executor: Reshape {node.name!r} to {y_shape} is not supported", node.name)


def identity(ex, node, i, out_name, act):
    x = ex.input(node)
    ex.alias(out_name, x, x.shape, i)


def softmax(ex, node, i, out_name, act):
    x = ex.input(node)
    rank = len(x.shape)
    opset = next((o.version for o in ex.model.proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    axis = int(attr(node, "axis", -1 if opset >= 13 else 1))
    axis = axis + rank if axis < 0 else axis
    if x.nhwc and axis == 1 and (opset >= 13 or (x.shape[2] * x.shape[3] == 1)):
        channels = x.shape[1]
    elif not x.nhwc and axis == rank - 1 and x.perm is None:
        channels = x.shape[-1]
    else:
        raise UnsupportedOp(f"xnnpack executor: Softmax {node.name!r} over axis {axis} of {x.shape} is not supported", node.name)
    y = ex.new_tensor(out_name, ex.shape(node.output[0]), i)
    op = xa.Softmax(channels)
    op.setup(x.array.reshape(-1, channels), y.array.reshape(-1, channels))
    y.threads = ex.threads_of(x)
    ex.add_op(op, y.threads)


BUILDERS = {
    "Conv": conv,
    "ConvTranspose": conv,  # the task (find_ops) says which operator it is
    "Gemm": gemm,
    "MatMul": matmul,
    "Relu": relu,
    "Clip": clip,
    "MaxPool": max_pool,
    "AveragePool": average_pool,
    "GlobalAveragePool": global_average_pool,
    "ReduceMean": reduce_mean,
    "Add": add,
    "Mul": mul,
    "Sub": sub,
    "Div": div,
    "Max": maximum,
    "Min": minimum,
    "Sigmoid": sigmoid,
    "HardSwish": hard_swish,
    "LeakyRelu": leaky_relu,
    "Elu": elu,
    "HardSigmoid": hard_sigmoid,
    "PRelu": prelu,
    "Split": split,
    "Slice": slice_on_one_axis,
    "Resize": resize,
    "Concat": concat,
    "Flatten": flatten,
    "Reshape": reshape,
    "Identity": identity,
    "Dropout": identity,
    "Softmax": softmax,
}
