"""The int8 variants of the XNNPack executor's builders (builders.py hands them over): a plan's
int8 conv / deconv / fc node on its configured 8-bit operator between 8-bit copies of its input
and output; the Sigmoid, SiLU Mul or LeakyRelu after such a node on XNNPack's 8-bit operator; an
Add or GlobalAveragePool of 8-bit tensors int8 ops wrote on the 8-bit operator (``add`` and
``global_average`` return False when the operator cannot take them, and on the 2024 API, which
has no such 8-bit add and pooling operators (``xa.int8_graph_availability``): they then run in float).
The grids and 8-bit buffers are the executor's (executor.py ``grid``, ``quantized``)."""

from __future__ import annotations

import numpy as np

from kselect.core.errors import KselectError
from kselect.core.precision.quant import QuantParams, weight_scales_of
from kselect.plugins.xnnpack import configured, int8
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.graph_prep import NO_CLAMP, attr
from kselect.plugins.xnnpack.tensor import Tensor


def conv_or_fc(ex, node, i, out_name, act, w, b, x: Tensor, y_shape) -> None:
    """The node's int8 plan entry: its 8-bit operator between 8-bit copies of its input and output."""
    task = ex.graph.tasks[node.name]
    if task.kind not in ("conv", "deconv", "fc") or task.conv1d:
        raise KselectError(f"xnnpack executor: {node.op_type} {node.name!r} has no int8 operator here "
                           "(2-D conv, deconv and fully connected only)")
    config = ex.config(node)
    variant = int8.config_variant(config, task)
    signed = variant != "qu8"
    x_scale, x_zero_point = ex.grid(x.name, node)
    y_scale, y_zero_point = ex.grid(out_name, node)
    w_scales = weight_scales_of(task.kind, w, int(task.attrs.get("group", 1)))
    params = QuantParams(float(x_scale), x_zero_point, w_scales, float(y_scale), y_zero_point)
    threads = int(config.get("threads", ex.default_threads))
    op, pool, notes = int8.create_operator(task, config, w, b, params, act, folded=True)
    try:
        xq = ex.quantized(x, signed, x_scale, x_zero_point, threads, i)
        shape = [int(d) for d in y_shape]
        y = Tensor(out_name, shape, None, None, len(shape) == 4)
        yq = ex.int8_buffer((shape[0], shape[2], shape[3], shape[1]) if y.nhwc else shape, signed)
        y.q[(signed, y_scale, y_zero_point)] = yq
        y.int8_output = True
        if task.kind == "fc" and variant == "qc8":  # a 1x1 convolution on (M, 1, 1, K)
            op.setup(xq.reshape(xq.shape[0], 1, 1, -1), yq.reshape(yq.shape[0], 1, 1, -1))
        else:
            op.setup(xq, yq)
    except BaseException:
        op.close()
        raise
    built = configured.Built(op, [(ex.run_operator, op.handle, None if pool is None else pool.handle)], xq, yq, notes)
    ex.add_built(built)
    ex.configs[node.name] = config
    y.threads = threads
    ex.tensors[out_name] = y
    if int8.activation_after(ex.graph.epilogues.get(node.name, [])) is not None:
        for reader in ex.graph.consumers.get(node.output[0], []):  # the epilogue's Sigmoid and, for SiLU, Mul
            ex.int8_activations[ex.graph.nodes[reader].name] = variant


def sigmoid(ex, node, out_name) -> None:
    """The Sigmoid after an int8 node: XNNPack's 8-bit sigmoid, onto its fixed output grid."""
    variant = ex.int8_activations[node.name]
    x = ex.tensors[node.input[0]]
    (signed, scale, zero_point), xq = next(iter(x.q.items()))  # the grid the int8 node wrote
    channels = xq.shape[-1] if xq.ndim else 1
    op = int8.sigmoid_operator(variant, channels, scale, zero_point)
    yq = ex.int8_buffer(xq.shape, signed)
    op.setup(xq.reshape(-1, channels), yq.reshape(-1, channels))
    ex.add_op(op, ex.threads_of(x))
    ex.int8_tensor(out_name, node, yq, (signed, *int8.SIGMOID_GRID), x)


def leaky_relu(ex, node, out_name) -> None:
    """The LeakyRelu after an int8 node: XNNPack's 8-bit leaky relu (qu8 only), onto the
    calibrated range of its output."""
    variant = ex.int8_activations[node.name]
    x = ex.tensors[node.input[0]]
    (signed, scale, zero_point), xq = next(iter(x.q.items()))  # the grid the int8 node wrote
    y_scale, y_zero_point = ex.grid(out_name, node)
    channels = xq.shape[-1] if xq.ndim else 1
    try:
        op = int8.leaky_relu_operator(variant, channels, float(attr(node, "alpha", 0.01)), (scale, zero_point),
                                      (float(y_scale), y_zero_point))
    except configured.ConfigError as exc:
        raise KselectError(f"xnnpack executor: LeakyRelu {node.name!r} after an int8 node: {exc}") from None
    yq = ex.int8_buffer(xq.shape, signed)
    op.setup(xq.reshape(-1, channels), yq.reshape(-1, channels))
    ex.add_op(op, ex.threads_of(x))
    ex.int8_tensor(out_name, node, yq, (signed, float(y_scale), y_zero_point), x)


def multiply(ex, node, out_name, act) -> None:
    """A SiLU's Mul after an int8 node: XNNPack's 8-bit multiply of the node's output and its
    sigmoid, onto the calibrated range of the Mul's output."""
    if act != NO_CLAMP:  # a clamp after it would have made the epilogue more than SiLU
        raise KselectError(f"xnnpack executor: Mul {node.name!r} after an int8 node has a clamp folded in")
    variant = ex.int8_activations[node.name]
    a, b = (ex.tensors[name] for name in node.input[:2])
    ((signed, a_scale, a_zero_point), aq), ((_, b_scale, b_zero_point), bq) = \
        next(iter(a.q.items())), next(iter(b.q.items()))
    y_scale, y_zero_point = ex.grid(out_name, node)
    op = int8.multiply_operator(variant, (a_scale, a_zero_point), (b_scale, b_zero_point),
                                (float(y_scale), y_zero_point))
    yq = ex.int8_buffer(aq.shape, signed)
    op.setup(aq, bq, yq)
    ex.add_op(op, ex.threads_of(a))
    ex.int8_tensor(out_name, node, yq, (signed, float(y_scale), y_zero_point), a)


def eight_bit_inputs(ex, node, count: int) -> list | None:
    """(tensor, grid key, 8-bit array) of each of the node's first ``count`` inputs, on the grid
    it was written on, when every one is an 8-bit tensor int8 ops wrote: the node can run on an
    8-bit operator without dequantizing anything. Inputs of the other signedness than the first
    come with their top bit flipped (the same grid). Otherwise None."""
    if not ex.int8_nodes or len(node.input) < count or not xa.int8_graph_availability()[0]:
        return None
    inputs = []
    for name in node.input[:count]:
        tensor = ex.tensors.get(name)
        if tensor is None or not tensor.int8_output or not tensor.q:
            return None
        key, q = next(iter(tensor.q.items()))  # the first copy is the one written
        inputs.append((tensor, key, q))
    signed = inputs[0][1][0]
    for k, (tensor, key, q) in enumerate(inputs):
        if key[0] != signed:
            flipped = (signed, *key[1:])
            inputs[k] = (tensor, flipped, ex.quantized(tensor, *flipped, ex.threads_of(tensor), None))
    return inputs


def add(ex, node, out_name, act) -> bool:
    """A residual Add of two 8-bit tensors: XNNPack's 8-bit add from both inputs' grids onto the
    calibrated range of its output (after a folded Relu / Clip, which becomes its clamp).
    False (the Add runs in float) when the operator cannot take it."""
    inputs = eight_bit_inputs(ex, node, 2)
    y_grid = ex.calibrated(out_name)
    if inputs is None or y_grid is None:
        return False
    (a, a_key, aq), (b, b_key, bq) = inputs
    if aq.shape != bq.shape or a.nhwc != b.nhwc or a.perm is not None or b.perm is not None \
            or list(ex.shape(node.output[0])) != a.shape:
        return False
    signed, y_scale, y_zero_point = a_key[0], float(y_grid[0]), y_grid[1]
    low, high = xa.ADD_SCALE_RATIO
    if not all(low <= np.float32(key[1]) / np.float32(y_scale) < high for key in (a_key, b_key)):
        return False
    variant = "qs8" if signed else "qu8"
    grid = QuantParams(y_scale, y_zero_point, np.ones(1), y_scale, y_zero_point)  # only the output grid is read
    out_min, out_max = int8.clamp_in_integers(act, grid, variant)
    if out_min >= out_max:
        return False
    shift = 128 if signed else 0
    op = xa.QAdd(variant, a_key[2] - shift, a_key[1], b_key[2] - shift, b_key[1], y_zero_point - shift, y_scale,
                 out_min, out_max)
    yq = ex.int8_buffer(aq.shape, signed)
    op.setup(aq, bq, yq)
    ex.add_op(op, ex.threads_of(a))
    ex.int8_tensor(out_name, node, yq, (signed, y_scale, y_zero_point), a)
    ex.int8_ops[node.name] = variant
    return True


def global_average(ex, node, out_name, x: Tensor) -> bool:
    """A global average pooling of an 8-bit tensor: XNNPack's 8-bit one from its grid onto the
    calibrated range of its output. False (it runs in float) when the operator cannot take it."""
    inputs = eight_bit_inputs(ex, node, 1)
    y_grid = ex.calibrated(out_name)
    if inputs is None or y_grid is None:
        return False
    _, (signed, x_scale, x_zero_point), xq = inputs[0]
    y_scale, y_zero_point = float(y_grid[0]), y_grid[1]
    ratio = np.float32(x_scale) / np.float32(y_scale)
    low, high = xa.GLOBAL_AVERAGE_SCALE_RATIO
    # at setup XNNPack asserts ratio / pixels >= 2**-32 (params-init.c), an abort otherwise
    if not low <= ratio < high or ratio / (x.shape[2] * x.shape[3]) < 2.0 ** -32:
        return False
    variant, shift = ("qs8", 128) if signed else ("qu8", 0)
    n, c = x.shape[:2]
    op = xa.QGlobalAveragePooling(variant, c, x_zero_point - shift, x_scale, y_zero_point - shift, y_scale)
    y_shape = [int(d) for d in ex.shape(node.output[0])]
    yq = ex.int8_buffer((n, 1, 1, c) if len(y_shape) == 4 else y_shape, signed)
    op.setup(xq, yq.reshape(n, c))
    ex.add_op(op, ex.threads_of(x))
    ex.int8_tensor(out_name, node, yq, (signed, y_scale, y_zero_point), x)
    ex.int8_ops[node.name] = variant
    return True
