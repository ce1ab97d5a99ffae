"""The oneDNN plugin (Debian's libdnnl2 through ctypes, registered by entry point): every
implementation oneDNN offers for a task is correct against the float64 reference, epilogues map
to post-ops, layout conversions keep values, the whole-model executor matches ONNX Runtime (alone
and with ONNX Runtime segments for the ops it lacks), and tune / bench run end to end."""

from __future__ import annotations

import json
from importlib import metadata

import graphs
import numpy as np
import onnxruntime as ort
import pytest
from graphs import small_cnn
from helpers import default_plan_in, kselect_json, run_kselect
from onnx import helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.errors import UnsupportedOp
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model, model_from_proto
from kselect.core.models.tasks import Task, task_key
from kselect.core.plans.runtime import library_runner
from kselect.plugins.onednn import dnnl
from kselect.plugins.onednn import primitives as prim

_OK, _REASON = dnnl.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.001, max_time_s=0.05)


@pytest.fixture(scope="module")
def onednn():
    return plugins.get_library("onednn")


def _task(name, kind, x, w, y, attrs, bias=True, epilogue=()):
    signature = {"name": name, "kind": kind, "x": x, "w": w, "attrs": attrs, "epilogue": list(epilogue)}
    return Task(name, task_key(signature), kind, x, w, y, attrs, bias, [name], list(epilogue))


def _conv(name, x, w, y, k, stride=1, pads=(0, 0, 0, 0), group=1, dilation=1, epilogue=(), bias=True):
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": list(pads), "dilations": [dilation, dilation],
             "group": group}
    return _task(name, "conv", x, w, y, attrs, bias, epilogue)


RELU = [["Relu", ["x"], {}]]
RELU6 = [["Clip", ["x", 0.0, 6.0], {}]]
SHAPES = [
    _conv("3x3 relu", [1, 16, 14, 14], [32, 16, 3, 3], [1, 32, 14, 14], 3, pads=(1, 1, 1, 1), epilogue=RELU),
    _conv("1x1", [1, 32, 7, 7], [24, 32, 1, 1], [1, 24, 7, 7], 1),
    _conv("depthwise relu6", [1, 32, 14, 14], [32, 1, 3, 3], [1, 32, 7, 7], 3, stride=2, pads=(1, 1, 1, 1),
          group=32, epilogue=RELU6),
]


# -- the plugin as a user sees it ------------------------------------------------------------
def test_registered_through_the_entry_point_and_available(onednn):
    entry_points = {ep.name: ep.value for ep in metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)}
    assert entry_points.get("onednn") == "kselect.plugins.onednn"
    assert "onednn" not in plugins.LIBRARY_PLUGINS  # core knows nothing of it
    ok, status = onednn.availability()
    assert ok and "omp_set_num_threads" in status
    assert "2.6" in onednn.version() or "oneDNN 2." in onednn.version()
    listed = {p["name"]: p for p in kselect_json("plugins")}
    assert listed["onednn"]["status"].startswith("available") and listed["onednn"]["kind"] == "library"


@pytest.mark.parametrize("task", SHAPES, ids=lambda t: t.id)
def test_space_offers_what_the_iterator_yields_and_the_default_is_onednns_own(onednn, task):
    device = this_device()
    space, default = onednn.space(task, device), onednn.default_config(task, device)
    assert default in space and default["threads"] == device.cores
    own_impl, own_layout = prim.own_choice(task)
    assert (default["impl"], default["layout"]) == (own_impl, own_layout)
    assert space.dim("impl").choices[0] == default["impl"]
    offered = prim.offered(task)
    for config in space.enumerate():
        assert config["impl"] in {name for name, _ in offered[config["layout"]]}
    assert any(name.startswith("ref:") for name in space.dim("impl").choices)  # every implementation, ref too


@pytest.mark.parametrize("task", SHAPES, ids=lambda t: t.id)
def test_every_implementation_matches_the_reference(onednn, task):
    """Through the core's measuring path (seeded data, float64 reference, the plugin's tolerance):
    every (implementation, layout) oneDNN offers, on all cores and on one."""
    device, cache = this_device(), {}
    configs = [c for c in onednn.space(task, device).enumerate() if c["threads"] in (1, device.cores)]
    assert len(configs) >= 6
    for config in configs:
        result = measure_in_this_process(onednn, task, config, QUICK, cache)
        assert result.status == "ok", (config, result.reason)
        assert result.error < 1e-5, (config, result.error)


def test_candidates_measure_in_the_worker_child(onednn):
    task, device = SHAPES[0], this_device()
    configs = [onednn.default_config(task, device),
               {"impl": "ref:any", "layout": "nchw", "threads": 1},
               {"impl": "no-such-impl", "layout": "nhwc", "threads": 1}]
    with MeasureWorker("onednn", QUICK) as worker:
        results = [worker.measure(task, config) for config in configs]
    assert [r.status for r in results] == ["ok", "ok", "failed"]
    assert "not offered" in results[2].reason


def test_other_conv_kinds_and_fc(onednn):
    device, cache = this_device(), {}
    deconv_attrs = {"kernel": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1,
                    "output_padding": [1, 1]}
    conv1d = _task("conv1d", "conv", [1, 8, 1, 20], [16, 8, 1, 3], [1, 16, 1, 20],
                   {"kernel": [1, 3], "strides": [1, 1], "pads": [0, 1, 0, 1], "dilations": [1, 1], "group": 1,
                    "conv1d": True})
    tasks = [
        _conv("stem", [1, 3, 32, 32], [16, 3, 7, 7], [1, 16, 16, 16], 7, stride=2, pads=(3, 3, 3, 3),
              epilogue=[["Sigmoid", ["x"], {}], ["Mul", ["x", "t0"], {}]]),
        _conv("dilated", [1, 8, 12, 12], [8, 8, 3, 3], [1, 8, 8, 8], 3, dilation=2, bias=False),
        _conv("grouped", [1, 8, 10, 10], [12, 4, 3, 3], [1, 12, 10, 10], 3, pads=(1, 1, 1, 1), group=2),
        _task("deconv", "deconv", [1, 8, 5, 5], [8, 4, 3, 3], [1, 4, 10, 10], deconv_attrs),
        conv1d,
        _task("fc", "fc", [2, 40], [10, 40], [2, 10], {"alpha": 0.5, "beta": 2.0, "transB": 1},
              epilogue=[["HardSigmoid", ["x"], {"alpha": 0.2, "beta": 0.5}]]),
    ]
    for task in tasks:
        assert onednn.supports(task), task.id
        space = onednn.space(task, device)
        for config in space.enumerate():
            if config["threads"] != device.cores:
                continue
            result = measure_in_this_process(onednn, task, config, QUICK, cache)
            assert result.status == "ok", (task.id, config, result.reason)


# -- epilogues as post-ops --------------------------------------------------------------------
LCNET_V3 = [["Mul", [2.0, "x"], {}], ["Add", ["t0", 0.5], {}], ["Add", ["t1", 3.0], {}], ["Clip", ["t2", 0.0, 6.0], {}],
            ["Mul", ["t1", "t3"], {}], ["Div", ["t4", 6.0], {}]]


@pytest.mark.parametrize("epilogue, expected", [
    (RELU, [("relu", 0.0, 0.0)]),
    (RELU6, [("clip_v2", 0.0, 6.0)]),
    ([["LeakyRelu", ["x"], {"alpha": 0.1}]], [("relu", 0.1, 0.0)]),
    ([["Sigmoid", ["x"], {}], ["Mul", ["t0", "x"], {}]], [("swish", 1.0, 0.0)]),
    ([["HardSigmoid", ["x"], {"alpha": 1 / 6, "beta": 0.5}], ["Mul", ["x", "t0"], {}]], [("hardswish", 0.0, 0.0)]),
    ([["Add", ["x", 3.0], {}], ["Clip", ["t0", 0.0, 6.0], {}], ["Mul", ["x", "t1"], {}], ["Div", ["t2", 6.0], {}]],
     [("hardswish", 0.0, 0.0)]),
    ([["Relu", ["x"], {}], ["Mul", ["t0", 2.0], {}]], [("relu", 0.0, 0.0), ("linear", 2.0, 0.0)]),
    ([["PRelu", ["x", {"slope": [8, 1, 1]}], {}]], None),
    ([["Sigmoid", ["x"], {}], ["Add", ["x", "t0"], {}]], None),  # reads the op's output twice
    # PP-LCNetV3's learnable affine before its HardSwish: two linear steps composed into one
    (LCNET_V3, [("linear", 2.0, 0.5), ("hardswish", 0.0, 0.0)]),
    # an algorithm twice in one chain: oneDNN 2.6 computes it wrongly, so it is no post-op chain
    ([["Mul", ["x", 2.0], {}], ["Relu", ["t0"], {}], ["Add", ["t1", 1.0], {}]], None),
    ([["LeakyRelu", ["x"], {"alpha": 0.1}], ["LeakyRelu", ["t0"], {"alpha": 0.5}]], None),
])
def test_epilogues_map_to_post_ops(epilogue, expected):
    assert prim.post_ops(epilogue) == expected


@pytest.mark.parametrize("epilogue", [
    [["LeakyRelu", ["x"], {"alpha": 0.1}]],
    [["Tanh", ["x"], {}]],
    [["HardSwish", ["x"], {}]],
    [["Add", ["x", 3.0], {}], ["Clip", ["t0", 0.0, 6.0], {}], ["Mul", ["x", "t1"], {}], ["Div", ["t2", 6.0], {}]],
    LCNET_V3,
], ids=["leaky", "tanh", "hardswish", "paddle-hardswish", "affine-hardswish"])
def test_fused_epilogues_match_the_reference(onednn, epilogue):
    task = _conv("epilogue", [1, 16, 8, 8], [16, 16, 3, 3], [1, 16, 8, 8], 3, pads=(1, 1, 1, 1), epilogue=epilogue)
    assert onednn.supports(task)
    result = measure_in_this_process(onednn, task, onednn.default_config(task, this_device()), QUICK, {})
    assert result.status == "ok", result.reason


def test_an_epilogue_without_post_ops_is_not_supported(onednn):
    prelu = _conv("prelu", [1, 8, 8, 8], [8, 8, 3, 3], [1, 8, 8, 8], 3, pads=(1, 1, 1, 1),
                  epilogue=[["PRelu", ["x", {"slope": [8, 1, 1]}], {}]])
    assert not onednn.supports(prelu)


# -- layouts across libraries ---------------------------------------------------------------
def test_labels_and_conversions_keep_values(onednn):
    x = np.random.default_rng(3).standard_normal((1, 20, 5, 7), dtype=np.float32)
    assert onednn.layout_label({"impl": "jit:avx512_core", "layout": "nChw16c", "threads": 1}) == "onednn:nChw16c"
    assert onednn.layout_label({"impl": "x", "layout": "nchw", "threads": 1}) == "onednn:NCHW"
    assert onednn.layout_label({"impl": "brgemm", "threads": 1}) == "onednn:flat"
    for label in ("onednn:NCHW", "onednn:NHWC", "onednn:nChw8c", "onednn:nChw16c"):
        for direction in ("in", "out"):
            candidate = onednn.conversion(label, direction, x)
            candidate.run()
            np.testing.assert_array_equal(candidate.output(), x)
            candidate.close()
    flat = x.reshape(4, -1)
    candidate = onednn.conversion("onednn:flat", "out", flat)
    candidate.run()
    np.testing.assert_array_equal(candidate.output(), flat)
    stem = _conv("stem", [1, 3, 14, 14], [32, 3, 3, 3], [1, 32, 14, 14], 3, pads=(1, 1, 1, 1))
    blocked = next(f"onednn:{prim.LABELS[layout]}" for layout in ("nChw16c", "nChw8c") if prim.offered(stem)[layout])
    assert onednn.input_label(stem, blocked) == "onednn:NCHW"  # a conv on 3 channels reads them plain


# -- whole models -------------------------------------------------------------------------------
def _ort(model, feeds):
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _relative(out, ref):
    return float(np.max(np.abs(out - ref))) / max(float(np.max(np.abs(ref))), 1e-12)


def _ops_model(extra_nodes=(), extra_inits=()):
    """Every op type the executor runs, in the layouts oneDNN's defaults give: strided conv with
    asymmetric pads, ceil-mode max pooling, average pooling with and without padding counted, a
    squeeze-excite block (per-channel Mul of an activation), constants on either side of Add and
    Mul, Concat of differently laid out branches, HardSigmoid, LeakyRelu, Sigmoid, Tanh, Elu,
    HardSwish, ConvTranspose, a 1-D conv, Flatten, Gemm (transB=0, alpha, beta), MatMul, Softmax."""
    rng = np.random.default_rng(7)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    inits = {"c1.w": w(16, 3, 3, 3), "c1.b": w(16), "c2.w": w(24, 16, 3, 3), "dw.w": w(24, 1, 3, 3),
             "se1.w": w(8, 24, 1, 1), "se2.w": w(24, 8, 1, 1), "scale": w(1, 24, 1, 1), "shift": w(24, 1, 1),
             "pw.w": w(24, 24, 1, 1), "up.w": w(72, 2, 2, 2), "c1d.w": w(8, 8, 3), "fc.w": w(360, 12),
             "fc.b": w(12), "mm.w": w(12, 10), "three": np.array(3.0, np.float32)}
    node = helper.make_node
    nodes = [
        node("Conv", ["x", "c1.w", "c1.b"], ["c1"], name="c1", kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0]),
        node("LeakyRelu", ["c1"], ["c1.a"], name="c1.act", alpha=0.1),
        node("MaxPool", ["c1.a"], ["p1"], name="pool1", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        node("Conv", ["p1", "c2.w"], ["c2"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        node("Relu", ["c2"], ["c2.r"], name="c2.relu"),
        node("Conv", ["c2.r", "dw.w"], ["dw"], name="dw", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=24),
        node("HardSigmoid", ["dw"], ["dw.a"], name="dw.act", alpha=0.25, beta=0.4),
        node("GlobalAveragePool", ["dw.a"], ["se.gap"], name="se.gap"),
        node("Conv", ["se.gap", "se1.w"], ["se1"], name="se1", kernel_shape=[1, 1]),
        node("Relu", ["se1"], ["se1.r"], name="se1.relu"),
        node("Conv", ["se1.r", "se2.w"], ["se2"], name="se2", kernel_shape=[1, 1]),
        node("Sigmoid", ["se2"], ["se2.s"], name="se2.sigmoid"),
        node("Mul", ["dw.a", "se2.s"], ["se"], name="se.mul"),
        node("Mul", ["scale", "se"], ["scaled"], name="scale"),
        node("Add", ["scaled", "shift"], ["shifted"], name="shift"),
        node("Tanh", ["shifted"], ["t"], name="tanh"),
        node("Conv", ["t", "pw.w"], ["pw"], name="pw", kernel_shape=[1, 1]),
        node("Elu", ["pw"], ["pw.e"], name="elu", alpha=0.5),
        node("AveragePool", ["pw.e"], ["ap1"], name="ap1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        node("AveragePool", ["pw.e"], ["ap2"], name="ap2", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
             count_include_pad=1),
        node("Add", ["ap1", "three"], ["ap1.s"], name="plus3"),
        node("HardSwish", ["ap2"], ["ap2.h"], name="hswish"),
        node("Concat", ["ap1.s", "ap2.h", "c2.r"], ["cat"], name="cat", axis=1),
        node("ConvTranspose", ["cat", "up.w"], ["up"], name="up", kernel_shape=[2, 2], strides=[2, 2], group=9),
        node("Relu", ["up"], ["up.r"], name="up.relu"),
        node("MaxPool", ["up.r"], ["p2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]),
        node("Reshape", ["p2", "shape3"], ["seq"], name="to_seq"),
        node("Conv", ["seq", "c1d.w"], ["c1d"], name="c1d", kernel_shape=[3], pads=[1, 1]),
        node("Flatten", ["c1d"], ["flat"], name="flatten"),
        node("Gemm", ["flat", "fc.w", "fc.b"], ["fc"], name="fc", alpha=0.5, beta=2.0),
        node("Relu", ["fc"], ["fc.r"], name="fc.relu"),
        node("MatMul", ["fc.r", "mm.w"], ["mm"], name="mm"),
        node("Softmax", ["mm"], ["y"], name="softmax"),
        *extra_nodes,
    ]
    initializers = [numpy_helper.from_array(np.asarray(v, np.float32), k)
                    for k, v in {**inits, **dict(extra_inits)}.items()]
    initializers.append(numpy_helper.from_array(np.array([1, 8, 45], np.int64), "shape3"))
    output = extra_nodes[-1].output[0] if extra_nodes else "y"
    return model_from_proto("ops", graphs.model(nodes, initializers, (1, 3, 23, 19), outputs=[output], name="ops"))


def test_the_executor_runs_every_op_type_like_onnx_runtime(onednn):
    model = _ops_model()
    x = np.random.default_rng(0).standard_normal(model.input_shapes["x"], dtype=np.float32)
    runner = onednn.model_runner(model, None)
    try:
        out = runner({"x": x})[0]
        assert _relative(out, _ort(model, {"x": x})[0]) < 1e-4
        assert {"c1", "c2", "dw", "pw", "up", "c1d", "fc", "mm"} <= set(runner.configs)
    finally:
        runner.close()


def test_ops_the_runner_lacks_or_refuses_run_on_onnx_runtime(onednn):
    """Neg is no op of the runner's; a Sub whose first operand is the broadcast constant is one
    it refuses: both run in ONNX Runtime segments, the rest on oneDNN."""
    extra = [helper.make_node("Neg", ["y"], ["neg"], name="neg"),
             helper.make_node("Sub", ["row", "neg"], ["out"], name="sub_from_constant")]
    model = _ops_model(extra, {"row": np.ones((1, 10), np.float32)})
    assert not onednn.runs_op("Neg") and onednn.runs_op("Conv")
    x = np.random.default_rng(1).standard_normal(model.input_shapes["x"], dtype=np.float32)
    runner = library_runner(onednn, model)
    try:
        libraries = [segment.library for segment in runner.segments]
        assert libraries[0] == "onednn" and "mlas" in libraries
        assert runner.refused == []  # Neg was never given to oneDNN; the Sub follows it to ONNX Runtime
        assert _relative(runner({"x": x})[0], _ort(model, {"x": x})[0]) < 1e-4
    finally:
        runner.close()
    with pytest.raises(UnsupportedOp) as refused:
        onednn.model_runner(_ops_model([helper.make_node("Sub", ["row", "y"], ["out"], name="sub_from_constant")],
                                       {"row": np.ones((1, 10), np.float32)}), None)
    assert refused.value.node == "sub_from_constant"


@pytest.mark.parametrize("name", ["resnet18", pytest.param("mobilenetv2", marks=pytest.mark.slow),
                                  pytest.param("googlenet", marks=pytest.mark.slow)])
def test_zoo_model_matches_onnx_runtime(onednn, name):
    model = load_model(name)
    x = np.random.default_rng(2).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = library_runner(onednn, model)
    try:
        assert [segment.library for segment in runner.segments] == ["onednn"]
        assert _relative(runner({"input": x})[0], _ort(model, {"input": x})[0]) < 1e-3
    finally:
        runner.close()


def test_a_plan_with_other_implementations_layouts_and_threads_runs_correctly(onednn):
    """Each conv forced to a non-default implementation in another layout (reorders between
    them), on one thread: the same output as ONNX Runtime."""
    model = model_from_proto("small", small_cnn())
    from kselect.core.models.tasks import find_ops

    nodes = {}
    for op in find_ops(model):
        task = Task(op.node, "", op.kind, op.input_shape, op.weight_shape, op.output_shape, op.attrs, op.has_bias,
                    [op.node], op.epilogue)
        space = onednn.space(task, this_device())
        default = onednn.default_config(task, this_device())
        other = next((c for c in space.enumerate() if c.get("layout") != default.get("layout") and c["threads"] == 1),
                     next(c for c in space.enumerate() if c != default))
        nodes[op.node] = {"config": other, "library": "onednn"}

    class _Plan:
        pass

    plan = _Plan()
    plan.nodes = nodes
    x = np.random.default_rng(4).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = onednn.model_runner(model, plan)
    try:
        assert runner.configs == {node: entry["config"] for node, entry in nodes.items()}
        assert _relative(runner({"input": x})[0], _ort(model, {"input": x})[0]) < 1e-4
    finally:
        runner.close()


# -- the CLI end to end -------------------------------------------------------------------------
def test_tune_and_bench_on_the_cli(small_model_path, tmp_path):
    plan_path, bench_path = tmp_path / "small.onednn.plan.json", tmp_path / "bench.json"
    tuned = kselect_json("tune", small_model_path, "--library", "onednn", "--budget", "3", "--min-time", "0.01",
                         "--no-verify", "--db", tmp_path / "records.db", "-o", plan_path)
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "onednn"
    assert tuning["tasks"] and all(t["default_us"] > 0 and t["best_us"] > 0 for t in tuning["tasks"])  # default vs best
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) == {"onednn"} and len(plan["nodes"]) == 7
    benched = run_kselect("bench", small_model_path, "--plan", plan_path, "--rounds", "1", "--runs-per-round", "3",
                          "--json", bench_path)
    assert benched.returncode == 0, benched.stderr
    assert json.loads(bench_path.read_text())["max_relative_output_error"] < 1e-3


@pytest.mark.slow
def test_tune_and_bench_resnet18_on_the_cli(tmp_path):
    plan_path, bench_path = tmp_path / "r18.onednn.plan.json", tmp_path / "bench.json"
    tuned = run_kselect("tune", "resnet18", "--library", "onednn", "--budget", "3", "--min-time", "0.02",
                        "--no-verify", "--db", tmp_path / "records.db", "-o", plan_path)
    assert tuned.returncode == 0, tuned.stderr
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) == {"onednn"}
    configs = [entry["config"] for entry in plan["nodes"].values()]
    assert len(configs) == 21 and all("impl" in c and "threads" in c for c in configs)
    benched = run_kselect("bench", "resnet18", "--plan", plan_path, "--rounds", "1", "--runs-per-round", "3",
                          "--json", bench_path)
    assert benched.returncode == 0, benched.stderr
    result = json.loads(bench_path.read_text())
    assert result["max_relative_output_error"] < 1e-3 and result["plan_ms"] > 0


@pytest.mark.slow
def test_a_cross_library_plan_with_mlas(small_model_path, tmp_path):
    plan_path, bench_path = tmp_path / "small.mixed.plan.json", tmp_path / "bench.json"
    tuned = run_kselect("tune", small_model_path, "--library", "mlas,onednn", "--budget", "3", "--min-time", "0.01",
                        "--db", tmp_path / "records.db", "-o", plan_path)
    assert tuned.returncode == 0, tuned.stderr
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) <= {"mlas", "onednn"}
    benched = run_kselect("bench", small_model_path, "--plan", plan_path, "--rounds", "1", "--runs-per-round", "3",
                          "--json", bench_path)
    assert benched.returncode == 0, benched.stderr
    assert json.loads(bench_path.read_text())["max_relative_output_error"] < 1e-3


def test_a_bias_add_after_a_blocked_deconv_runs_on_a_jit_kernel(onednn):
    """A per-channel constant added to a deconv's output (a bias Add left unfused, as in
    PP-OCRv4's detector head) is laid out in the format the deconv wrote: with a plain constant
    against a blocked tensor oneDNN 2.6 takes its reference binary kernel, some 300 times slower."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["c"], name="up", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Add", ["c", "bias"], ["y"], name="bias_add")]
    initializers = [numpy_helper.from_array(rng.standard_normal((24, 24, 2, 2)).astype(np.float32), "w"),
                    numpy_helper.from_array(rng.standard_normal((1, 24, 1, 1)).astype(np.float32), "bias")]
    model = model_from_proto("bias_add", graphs.model(nodes, initializers, (1, 24, 40, 40), name="bias_add"))
    x = rng.standard_normal(model.input_shapes["x"], dtype=np.float32)
    runner = onednn.model_runner(model, None)
    try:
        assert not runner.impls["bias_add"].startswith("ref"), runner.impls
        assert _relative(runner({"x": x})[0], _ort(model, {"x": x})[0]) < 1e-4
    finally:
        runner.close()


def test_a_plan_in_segments_is_timed_per_node_in_context(onednn):
    """A model with an op oneDNN's runner lacks runs in segments; timed per node for the costs in
    context (core/whole_model/context.py), oneDNN's nodes come from its executor and ONNX Runtime's
    segment counts whole, as untuned time."""
    from kselect.core.whole_model.alone import segmented_node_times
    from kselect.core.whole_model.context import in_context

    model = _ops_model([helper.make_node("Neg", ["y"], ["out"], name="neg")])
    feeds = [{"x": np.random.default_rng(5).standard_normal(model.input_shapes["x"], dtype=np.float32)}]
    whole_us, per_node = segmented_node_times(onednn, model, None, feeds, 3)
    assert whole_us > 0
    assert [name for name in per_node if name.startswith("segment")] == ["segment 2 (mlas)"]
    run = in_context(model, whole_us, per_node)
    assert {"c1", "c2", "dw", "pw", "up", "fc"} <= set(run.ops_us)
    assert per_node["segment 2 (mlas)"] > 0 and "segment 2 (mlas)" not in run.ops_us


def _residual_model(shortcut_read_later: bool):
    """x -> a (3x3 conv + relu) -> c (3x3 conv + relu) -> b (3x3 conv) -> Add(b, a) -> relu -> out;
    with ``shortcut_read_later`` a 1x1 conv also reads ``a`` after the Add, and its output is added in."""
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    a = graphs.conv(nodes, inits, rng, "a", "x", 16, 16, 3)
    c = graphs.conv(nodes, inits, rng, "c", a, 16, 16, 3)
    b = graphs.conv(nodes, inits, rng, "b", c, 16, 16, 3, relu=False)
    nodes += [helper.make_node("Add", [b, a], ["sum"], name="add"),
              helper.make_node("Relu", ["sum"], ["summed"], name="add.relu")]
    out = "summed"
    if shortcut_read_later:
        late = graphs.conv(nodes, inits, rng, "late", a, 16, 16, 1, relu=False)
        nodes.append(helper.make_node("Add", ["summed", late], ["both"], name="add2"))
        out = "both"
    return model_from_proto("residual", graphs.model(nodes, inits, [1, 16, 12, 12], outputs=[out], input_name="x"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_residual_add_runs_inside_the_conv_before_it_and_gives_the_same_output(onednn, precision):
    """small_cnn's residual Add (block.conv2's output plus the stem's) runs as oneDNN's sum post-op
    of block.conv2: no step of its own, the sum written over the stem's output, which only
    block.conv1 read before; the output is ONNX Runtime's (fp32), or within bf16's budget."""
    if precision == "bf16" and prim.bf16_missing():
        pytest.skip(prim.bf16_missing())
    model = model_from_proto("small", small_cnn())
    plan = default_plan_in(onednn, model, lambda task: "bf16") if precision == "bf16" else None
    x = np.random.default_rng(8).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = onednn.model_runner(model, plan)
    try:
        out = runner({"input": x})[0]
        assert "block.add" not in runner.step_nodes and "block.conv2" in runner.step_nodes
        assert runner.tensors["block.sum"].memory is runner.tensors["stem.r"].memory
    finally:
        runner.close()
    assert _relative(out, _ort(model, {"input": x})[0]) < (1e-5 if precision == "fp32" else 0.05)


@pytest.mark.parametrize("shortcut_read_later", [False, True], ids=["fused", "shortcut read after the add"])
def test_a_residual_add_whose_shortcut_is_read_later_runs_as_an_op_of_its_own(onednn, shortcut_read_later):
    """The sum is written over the shortcut, so a shortcut that a node reads after the Add keeps
    the Add apart (its own step; the second Add, whose shortcut nothing reads later, is fused),
    and every output is ONNX Runtime's."""
    model = _residual_model(shortcut_read_later)
    x = np.random.default_rng(9).standard_normal(model.input_shapes["x"], dtype=np.float32)
    runner = onednn.model_runner(model, None)
    try:
        out = runner({"x": x})[0]
        assert ("add" in runner.step_nodes) == shortcut_read_later
        assert "add2" not in runner.step_nodes
    finally:
        runner.close()
    assert _relative(out, _ort(model, {"x": x})[0]) < 1e-5
