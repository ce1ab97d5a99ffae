"""The XNNPack whole-model executor: every op type it runs against a numpy reference, whole
models with XNNPack's defaults and with plans (forced kernels, NCHW path, per-op threads, work
split) against ONNX Runtime on the same ONNX, and the Python-side overhead per inference."""

from __future__ import annotations

import random
import time

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import small_cnn
from onnx import helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks
from kselect.plugins.ops.conv import conv_reference
from kselect.plugins.xnnpack import profiling
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.executor import Executor
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)


class _Plan:
    """The part of a plan the executor reads: node -> config."""

    def __init__(self, configs: dict[str, dict], plan_level: dict | None = None):
        self.nodes = {name: {"config": config} for name, config in configs.items()}
        self.plan_level = plan_level or {}
        self.tasks = []  # fp32: no task of precision int8


def _model(tmp_path, nodes, inits, input_shape, name="m"):
    initializers = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
    return load_model(str(graphs.saved(graphs.model(nodes, initializers, input_shape, name=name), tmp_path / f"{name}.onnx")))


def _run(model, plan=None, x=None):
    x = np.random.default_rng(1).standard_normal(model.input_shapes["x"], dtype=np.float32) if x is None else x
    executor = Executor(XnnpackLibrary(), model, plan)
    try:
        return x, executor({"x": x})[0]
    finally:
        executor.close()


def _close(out, ref, tol=1e-4):
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = float(np.max(np.abs(out - ref))) / max(float(np.max(np.abs(ref))), 1e-12)
    assert err < tol, err


rng = np.random.default_rng(0)


def _w(*shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- each op type against numpy ---------------------------------------------------------------
CONVS = [  # (cin, cout, k, stride, pads, group, dilation, activation)
    (8, 16, 3, 1, [1, 1, 1, 1], 1, 1, "relu"),
    (8, 12, 3, 2, [0, 1, 1, 0], 1, 1, None),
    (8, 8, 3, 1, [2, 2, 2, 2], 1, 2, "clip"),
    (16, 16, 3, 1, [1, 1, 1, 1], 16, 1, "clip"),      # depthwise (dwconv)
    (16, 16, 3, 2, [0, 0, 1, 1], 16, 1, None),        # depthwise, TF-SAME pads
    (16, 32, 3, 1, [1, 1, 1, 1], 16, 1, None),        # depthwise multiplier 2 (grouped igemm)
    (16, 16, 7, 1, [3, 3, 3, 3], 16, 1, None),        # depthwise 7x7 (no dwconv tile: igemm)
    (16, 24, 1, 1, [0, 0, 0, 0], 1, 1, "relu"),       # gemm
    (16, 16, 1, 1, [0, 0, 0, 0], 16, 1, None),        # 1x1 depthwise (vmulcaddc)
    (12, 24, 3, 1, [1, 1, 1, 1], 3, 1, None),         # grouped
]


@pytest.mark.parametrize("case", CONVS, ids=lambda c: f"c{c[0]}o{c[1]}k{c[2]}s{c[3]}g{c[5]}d{c[6]}{c[7] or ''}")
def test_conv(tmp_path, case):
    cin, cout, k, stride, pads, group, dilation, act = case
    w, b = _w(cout, cin // group, k, k), _w(cout)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if act else "y"], name="conv", kernel_shape=[k, k],
                              strides=[stride, stride], pads=pads, group=group, dilations=[dilation, dilation])]
    inits = {"w": w, "b": b}
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="act"))
    elif act == "clip":
        inits.update(lo=np.array(0.0), hi=np.array(0.5))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="act"))
    model = _model(tmp_path, nodes, inits, [2, cin, 11, 10])
    x, out = _run(model)
    ref = conv_reference(x, w, b, [stride, stride], pads, [dilation, dilation], group)
    ref = np.maximum(ref, 0) if act == "relu" else np.clip(ref, 0, 0.5) if act == "clip" else ref
    _close(out, ref)


@pytest.mark.parametrize("trans_b,alpha,beta,relu", [(1, 1.0, 1.0, False), (0, 0.5, 2.0, True)])
def test_gemm(tmp_path, trans_b, alpha, beta, relu):
    w, b = _w(24, 40) if trans_b else _w(40, 24), _w(24)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g" if relu else "y"], name="fc", transB=trans_b,
                              alpha=alpha, beta=beta)]
    if relu:
        nodes.append(helper.make_node("Relu", ["g"], ["y"], name="relu"))
    x, out = _run(_model(tmp_path, nodes, {"w": w, "b": b}, [3, 40]))
    ref = alpha * (x.astype(np.float64) @ (w.T if trans_b else w)) + beta * b
    _close(out, np.maximum(ref, 0) if relu else ref)


def test_matmul(tmp_path):
    w = _w(40, 24)
    x, out = _run(_model(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"w": w}, [2, 40]))
    _close(out, x.astype(np.float64) @ w)


def _pool_ref(x, k, s, pads, mode):
    n, c, h, w = x.shape
    t, l, bo, r = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (t, bo), (l, r)), constant_values=-np.inf if mode == "max" else 0)
    valid = np.pad(np.ones((h, w)), ((t, bo), (l, r)))
    oh, ow = (h + t + bo - k) // s + 1, (w + l + r - k) // s + 1
    out = np.empty((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            window = xp[:, :, i * s:i * s + k, j * s:j * s + k]
            out[:, :, i, j] = window.max(axis=(2, 3)) if mode == "max" else \
                window.sum(axis=(2, 3)) / valid[i * s:i * s + k, j * s:j * s + k].sum()
    return out


@pytest.mark.parametrize("op,k,s,pads", [("MaxPool", 3, 2, [1, 1, 1, 1]), ("MaxPool", 2, 2, [0, 0, 0, 0]),
                                         ("AveragePool", 3, 1, [1, 1, 1, 1]), ("AveragePool", 3, 2, [0, 0, 1, 1])])
def test_pooling(tmp_path, op, k, s, pads):
    node = helper.make_node(op, ["x"], ["y"], name="pool", kernel_shape=[k, k], strides=[s, s], pads=pads)
    x, out = _run(_model(tmp_path, [node], {}, [2, 6, 9, 8]))
    _close(out, _pool_ref(x, k, s, pads, "max" if op == "MaxPool" else "avg"))


def test_global_average_pool_flatten_softmax(tmp_path):
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat", axis=1),
             helper.make_node("Softmax", ["f"], ["y"], name="sm", axis=1)]
    x, out = _run(_model(tmp_path, nodes, {}, [2, 10, 5, 6]))
    mean = x.astype(np.float64).mean(axis=(2, 3))
    e = np.exp(mean - mean.max(axis=1, keepdims=True))
    _close(out, e / e.sum(axis=1, keepdims=True))


def test_add_relu_clip_and_a_broadcast_constant(tmp_path):
    bias = _w(1, 6, 1, 1)
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[1, 1]),
             helper.make_node("Add", ["p", "x"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),  # folds into the add
             helper.make_node("Add", ["r", "bias"], ["a2"], name="add2"),
             helper.make_node("Clip", ["a2", "lo", "hi"], ["y"], name="clip")]
    model = _model(tmp_path, nodes, {"bias": bias, "lo": np.array(-0.1), "hi": np.array(0.7)}, [2, 6, 5, 4])
    x, out = _run(model)
    _close(out, np.clip(np.maximum(2 * x, 0) + bias, -0.1, 0.7))


def test_standalone_relu_and_clip(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Clip", ["r"], ["y"], name="clip",
                                                                                   )]
    x, out = _run(_model(tmp_path, nodes, {}, [2, 6, 5, 4]))
    _close(out, np.maximum(x, 0))


def test_concat_channels(tmp_path):
    w1, w2 = _w(4, 6, 1, 1), _w(8, 6, 3, 3)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["a", "x", "b"], ["y"], name="cat", axis=1)]
    x, out = _run(_model(tmp_path, nodes, {"w1": w1, "w2": w2}, [1, 6, 7, 5]))
    ref = np.concatenate([conv_reference(x, w1, None, [1, 1], [0] * 4, [1, 1], 1), x,
                          conv_reference(x, w2, None, [1, 1], [1] * 4, [1, 1], 1)], axis=1)
    _close(out, ref)


def test_flatten_of_a_feature_map_into_gemm_and_into_an_output(tmp_path):
    w, b = _w(10, 6 * 4 * 3), _w(10)
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], name="fc", transB=1)]
    x, out = _run(_model(tmp_path, nodes, {"w": w, "b": b}, [2, 6, 4, 3]))  # weights permuted to NHWC order
    _close(out, x.reshape(2, -1).astype(np.float64) @ w.T + b)
    x, out = _run(_model(tmp_path, [helper.make_node("Flatten", ["x"], ["y"], name="flat")], {}, [2, 6, 4, 3], "f2"))
    np.testing.assert_array_equal(out, x.reshape(2, -1))  # a transpose back to NCHW order


def test_an_unsupported_op_is_a_clear_error_naming_the_node(tmp_path):
    """The executor refuses it by name; core/plans/runtime.py then gives that node to ONNX Runtime."""
    from kselect.core.errors import UnsupportedOp

    model = _model(tmp_path, [helper.make_node("Erf", ["x"], ["y"], name="erf")], {}, [1, 4, 3, 3])
    with pytest.raises(UnsupportedOp, match="Erf") as refused:
        Executor(XnnpackLibrary(), model, None)
    assert refused.value.node == "erf"


# -- whole models against ONNX Runtime ----------------------------------------------------------
def _ort(model, feeds):
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _random_plan(model, seed=0, prefer_non_default=True):
    """A plan giving every node a config sampled from its space (non-default where possible),
    workers sleeping between loops (spinning=0) on odd seeds."""
    lib, device = XnnpackLibrary(), this_device()
    sampler, configs = random.Random(seed), {}
    for task in extract_tasks(model):
        space, default = lib.space(task, device), lib.default_config(task, device)
        options = [c for c in space.enumerate() if c != default] if prefer_non_default else space.enumerate()
        config = sampler.choice(options or [default])
        for node in task.nodes:
            configs[node] = config
    return _Plan(configs, {"spinning": 0} if seed % 2 else {})


def _relative(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b))) / max(float(np.max(np.abs(b))), 1e-12)


def test_small_model_default_and_random_plans_match_onnxruntime(tmp_path):
    path = tmp_path / "small.onnx"
    onnx.save(small_cnn(), path)
    model = load_model(str(path))
    x = np.random.default_rng(3).standard_normal(model.input_shapes["input"], dtype=np.float32)
    ref = _ort(model, {"input": x})[0]
    lib = XnnpackLibrary()
    from kselect.plugins.xnnpack import tileshim

    for plan in [None] + [_random_plan(model, seed) for seed in range(4)]:
        executor = Executor(lib, model, plan)
        try:
            out = executor({"input": x})[0]
            if tileshim.shim() is not None:  # the plan's spinning is in force while it runs
                expected = 0 if plan is None or plan.plan_level.get("spinning", 1) else 2
                assert tileshim.shim().lib.kselect_shim_flags() == expected
        finally:
            executor.close()
        assert _relative(out, ref) < 1e-4, plan and plan.nodes


@pytest.mark.parametrize("name", ["mobilenetv2", "googlenet"])
def test_zoo_models_with_a_plan_match_onnxruntime(name):
    model = load_model(name)
    x = np.random.default_rng(0).standard_normal(model.input_shapes["input"], dtype=np.float32)
    ref = _ort(model, {"input": x})[0]
    lib = plugins.get_library("xnnpack")
    for plan in (None, _random_plan(model, 1)):
        run = lib.model_runner(model, plan)
        try:
            out = run({"input": x})[0]
            assert _relative(out, ref) < 1e-4
            out2 = run({"input": x})[0]  # buffers are reused between runs
            np.testing.assert_array_equal(out, out2)
        finally:
            run.close()


def test_python_side_overhead_is_small_against_resnet18_latency():
    model = load_model("resnet18")
    run = XnnpackLibrary().model_runner(model, None)
    try:
        feeds = {"input": np.zeros(model.input_shapes["input"], np.float32)}
        run(feeds)
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            run(feeds)
            samples.append((time.perf_counter() - start) * 1e6)
        overhead = profiling.dispatch_overhead_us(run, repeats=50)
        assert overhead["native_calls"] >= 20
        assert overhead["dispatch_us"] / overhead["native_calls"] < 20  # microseconds per operator call
        assert overhead["dispatch_us"] < 0.03 * min(samples)
    finally:
        run.close()


def test_a_profile_times_every_node_in_place_and_adds_up_to_the_run():
    """profiling.profile (benchmarks/where_time_goes.py): each node that runs XNNPack steps gets an
    in-place time under its op type, and those times, with the layout conversions at the edges,
    fit within the whole run's time."""
    model = load_model("resnet18", ["input=1,3,64,64"])
    run = XnnpackLibrary().model_runner(model, None)
    try:
        feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 64, 64), dtype=np.float32)}
        profile = profiling.profile(run, feeds, runs=5)
        op_types = {node.name: node.op_type for node in model.proto.graph.node}
        convs = [name for name, kind in op_types.items() if kind == "Conv"]
        assert set(convs) <= set(profile["nodes"])
        assert all(op_types[node] == kind and us > 0 for node, (kind, us) in profile["nodes"].items())
        in_place = sum(us for _, us in profile["nodes"].values())
        assert 0 < profile["edges_us"] and in_place + profile["edges_us"] <= profile["whole_us"] * 1.1
    finally:
        run.close()
