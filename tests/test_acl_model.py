"""The ACL whole-model engine (runner actions model_load / model_run, plugins/acl/engine.py):
whole models run with the library defaults and with per-op plans, compared with ONNX Runtime on
the same ONNX; `kselect tune` / `kselect bench` with --library acl end to end.

On x86_64 this is emulated (qemu): models are small or at a reduced input size.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import small_cnn
from helpers import kselect_json, run_kselect
from onnx import helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks
from kselect.core.models.zoo import build_model
from kselect.core.plans.plan import load_plan_file
from kselect.core.plans.runtime import library_runner, load_plan
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.bench import bench_in_process, compare_outputs, random_feeds
from kselect.plugins.acl import build

pytestmark = [pytest.mark.emulated] if build.is_emulated() else []
TOLERANCE = 1e-4


def ort_outputs(model, feeds):
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def saved(tmp_path, proto, name="m.onnx"):
    return load_model(str(graphs.saved(proto, tmp_path / name)))


def zoo_at(tmp_path, name: str, size: int):
    """A built-in model with a smaller input (the zoo's GAP heads make it size-independent)."""
    proto = build_model(name, 0)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = size
    del proto.graph.value_info[:]
    return saved(tmp_path, proto, f"{name}{size}.onnx")


def random_plan(acl, model, seed: int, exclude_methods=("FFT",)):
    """Per node, a random config from its task's space (FFT excluded: ACL 20.08's FFT is wrong for
    some shapes, which measuring marks invalid and a plan never contains)."""
    rng, device, nodes = random.Random(seed), this_device(), {}
    for task in extract_tasks(model):
        configs = [c for c in acl.space(task, device).enumerate() if c.get("method") not in exclude_methods]
        for node in task.nodes:
            nodes[node] = {"config": rng.choice(configs)}
    return SimpleNamespace(nodes=nodes)


def test_small_model_default_matches_onnxruntime(acl, tmp_path):
    model = saved(tmp_path, small_cnn())
    feeds = random_feeds(model)
    runner = acl.model_runner(model, None)
    try:
        info = runner.load_info
        assert info["ok"] and info["permutes"] == 0 and info["schedules"] == 1 and info["emulated"] == acl.emulated
        convs = {n["node"]: n for n in info["nodes"]}
        for task in extract_tasks(model):
            if task.kind == "conv":
                for node in task.nodes:
                    assert convs[node]["effective_method"] == acl.acl_pick(task)  # ACL's own choice
        assert convs["stem"]["fused_activation"]  # Conv+Relu fused as ArmNN does
        outputs = runner(feeds)
        assert compare_outputs(ort_outputs(model, feeds), outputs) < TOLERANCE
        assert len(runner.last["times_us"]) == 1 and runner.last["emulated"] == acl.emulated
        again = runner.run(feeds, min_repeats=2, profile=True)  # input reused, network kept configured
        assert compare_outputs(outputs, again) == 0.0
        assert {p["node"] for p in runner.last["profile"]} >= {"stem", "dw", "pw", "fc", "block.add"}
    finally:
        runner.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_small_model_with_a_mixed_plan_matches_onnxruntime(acl, tmp_path, seed):
    """Per-op methods, layouts (NEPermute between them), kernels, CPU models, threads and splits."""
    model = saved(tmp_path, small_cnn())
    feeds = random_feeds(model)
    plan = random_plan(acl, model, seed)
    runner = acl.model_runner(model, plan)
    try:
        assert runner.load_info["schedules"] >= 2
        assert compare_outputs(ort_outputs(model, feeds), runner(feeds)) < 1e-3
    finally:
        runner.close()


def test_gemm_nhwc_output_padded_by_a_later_consumer_gets_a_private_tensor(acl, tmp_path):
    """A GEMM conv in NHWC writes its (W,H) plane as GEMM rows; a Direct NHWC consumer configured
    later pads that tensor. The engine detects it and gives the GEMM a private output + NECopy."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((16, 8, 1, 1)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((8, 16, 3, 3)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="pw", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["a", "w2"], ["y"], name="direct", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    model = saved(tmp_path, graphs.model(nodes, inits, (1, 8, 12, 12)))
    plan = SimpleNamespace(nodes={
        "pw": {"config": {"method": "GEMM", "layout": "NHWC", "threads": 1}},
        "direct": {"config": {"method": "DIRECT", "layout": "NHWC", "threads": 1}}})
    feeds = random_feeds(model)
    runner = acl.model_runner(model, plan)
    try:
        # 20.08's Direct NHWC conv pads its input tensor; 24.11's does not, and no copy is needed
        padded_by_direct = acl._runner_info()["acl_version"] == "v20.08"
        assert (runner.load_info["copies"] >= 1) == padded_by_direct and runner.load_info["builds"] == (2 if padded_by_direct else 1)
        assert compare_outputs(ort_outputs(model, feeds), runner(feeds)) < TOLERANCE
    finally:
        runner.close()


def test_mobilenetv2_reduced_input_default_and_plan_match_onnxruntime(acl, tmp_path):
    """A zoo model (depthwise, ReLU6 as Clip, residual adds, GAP, Gemm, Softmax) at 1x3x32x32, with
    the defaults and with a per-op plan."""
    model = zoo_at(tmp_path, "mobilenetv2", 32)
    feeds = random_feeds(model)
    reference = ort_outputs(model, feeds)
    for plan in (None, random_plan(acl, model, 6)):
        runner = acl.model_runner(model, plan)
        try:
            assert runner.load_info["ops"]["conv"] == 52
            assert compare_outputs(reference, runner(feeds)) < (TOLERANCE if plan is None else 1e-3)
        finally:
            runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("name, seed", [("resnet18", 3), ("googlenet", 4), ("mobilenetv2", 5)])
def test_zoo_models_reduced_input_random_plans_match_onnxruntime(acl, tmp_path, name, seed):
    model = zoo_at(tmp_path, name, 64)
    feeds = random_feeds(model)
    reference = ort_outputs(model, feeds)
    for plan in (None, random_plan(acl, model, seed)):
        runner = acl.model_runner(model, plan)
        try:
            assert compare_outputs(reference, runner(feeds)) < 1e-3
        finally:
            runner.close()


def test_unsupported_ops_are_refused_by_name(acl, tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "r"], ["y"], name="square")]
    model = saved(tmp_path, graphs.model(nodes, [], (1, 4, 6, 6)))
    with pytest.raises(KselectError, match="Mul node 'square'"):
        acl.model_runner(model, None)


def test_bench_compares_default_and_plan(acl, tmp_path):
    model = saved(tmp_path, small_cnn())
    default, plan = acl.model_runner(model, None), acl.model_runner(model, random_plan(acl, model, 7))
    try:
        result = bench_in_process(default, plan, model, rounds=1, runs_per_round=1)
        assert result["runs"] == 1 and result["default_ms"] > 0 and result["plan_ms"] > 0
        assert result["max_relative_output_error"] < 1e-3
    finally:
        default.close()
        plan.close()


def test_cli_tune_and_bench_under_emulation(acl, tmp_path):
    model_path = tmp_path / "small.onnx"
    onnx.save(small_cnn(), model_path)
    plan_path, db = tmp_path / "small.acl.plan.json", tmp_path / "records.db"
    tuned = kselect_json("tune", model_path, "--library", "acl", "--budget", "3", "--min-time", "0.005", "--db", db,
                         "-o", plan_path, "--no-verify")
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "acl" and tuning["emulated"] == acl.emulated
    assert tuning["tasks"] and all(t["default_us"] > 0 and t["best_us"] > 0 for t in tuning["tasks"])  # default vs best
    plan = load_plan_file(plan_path)
    assert plan.emulated == acl.emulated and plan.libraries == {"acl": acl.version()}
    assert all(t["emulated"] == acl.emulated for t in plan.tasks) and plan.plan_level == {}
    assert plan.extra["cross_library"]["predicted"]["total_us"] > 0  # layouts planned per op
    # layouts per op, a measured NEPermute wherever a conv takes a tensor of the other layout
    labels = {node: entry["label"] for node, entry in plan.nodes.items()}
    assert set(labels.values()) <= {"acl:NCHW", "acl:NHWC"}
    for node, entry in plan.nodes.items():
        assert entry["label"] == f"acl:{entry['config'].get('layout', 'NCHW')}"
        for change in entry["conversions"]:
            assert change["from_label"] != change["to_label"] == entry["label"] and change["time_us"] > 0
    model = load_model(model_path)
    producer = {out: n for n in model.proto.graph.node for out in n.output}

    def tuned_source(tensor):  # through single-input untuned ops (ReLU), which run in their producer's layout
        node = producer.get(tensor)
        while node is not None and node.name not in labels and len(node.input) == 1:
            node = producer.get(node.input[0])
        return node.name if node is not None and node.name in labels else None

    edges = [(n.name, tuned_source(n.input[0])) for n in model.proto.graph.node if n.op_type == "Conv"]
    edges = [(node, source) for node, source in edges if source]
    assert edges
    for node, source in edges:  # a change exactly where the layouts differ
        assert bool(plan.nodes[node]["conversions"]) == (labels[node] != labels[source])
    records = RecordDB(db).records(this_device().fingerprint, "acl/convert", acl.version())
    assert records and all(r.emulated == acl.emulated and r.result.status == "ok" for r in records)
    assert any(r.result.median_us > 0 for r in records)  # NHWC sides are real NEPermute runs
    result = kselect_json("bench", model_path, "--plan", plan_path, "--rounds", "1", "--runs-per-round", "1")
    assert result["library"] == "acl" and result["emulated"] == acl.emulated
    assert result["max_relative_output_error"] < 1e-3


def test_an_op_acl_does_not_tune_between_tuned_ones_runs_with_acls_own_choice(acl, tmp_path):
    """A ConvTranspose followed by a Relu is no ACL task (NEDeconvolutionLayer fuses no
    activation): the tune plans the convs around it, and its plan runs it in the runner as
    NEDeconvolutionLayer, the Relu as a step of its own, matching ONNX Runtime."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n)
             for n, s in (("w", (8, 3, 3, 3)), ("wt", (8, 4, 2, 2)), ("w2", (3, 4, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("ConvTranspose", ["r", "wt"], ["d"], name="deconv", strides=[2, 2]),
             helper.make_node("Relu", ["d"], ["e"], name="relu2"),
             helper.make_node("Conv", ["e", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    model_path = graphs.saved(graphs.model(nodes, inits, (1, 3, 16, 16)), tmp_path / "deconv.onnx")
    plan_path = tmp_path / "deconv.acl.plan.json"
    tuned = run_kselect("tune", model_path, "--library", "acl", "--budget", "1", "--min-time", "0.005",
                        "--db", tmp_path / "records.db", "-o", plan_path, "--no-verify")
    assert tuned.returncode == 0, tuned.stderr
    plan = load_plan_file(plan_path)
    assert set(plan.nodes) == {"conv", "conv2"}
    model = load_model(model_path)
    runner = load_plan(plan, model)
    try:
        assert [s.library for s in runner.segments] == ["acl"]
        feeds = random_feeds(model)
        reference = library_runner(plugins.get_library("mlas"), model)(feeds)
        assert compare_outputs(reference, runner(feeds)) < 1e-4
    finally:
        runner.close()


def test_applied_bundle_runs_in_the_runner(acl, tmp_path):
    model = saved(tmp_path, small_cnn())
    plan = random_plan(acl, model, 9)
    plan.model, plan.libraries, plan.emulated = {"name": "small"}, {"acl": acl.version()}, acl.emulated
    (graph_path,) = acl.apply(plan, model, tmp_path / "out")
    graph = json.loads(graph_path.read_text())
    assert graph["kselect"]["emulated"] == acl.emulated
    assert all(not n.get("weights_path", "x").startswith("/") for n in graph["nodes"])  # relocatable
    feeds = random_feeds(model)
    feeds["input"].tofile(tmp_path / "x.f32")
    from kselect.plugins.acl.client import AclRunner

    with AclRunner() as runner:
        loaded = runner.request({"action": "model_load", "model_id": "b", "graph_path": str(graph_path)})
        assert loaded["ok"], loaded
        ran = runner.request({"action": "model_run", "model_id": "b", "input_paths": {"input": str(tmp_path / "x.f32")},
                              "output_paths": {"output": str(tmp_path / "y.f32")}})
        assert ran["ok"] and ran["emulated"] == acl.emulated
        assert runner.request({"action": "model_free", "model_id": "b"})["freed"]
    output = np.fromfile(tmp_path / "y.f32", dtype=np.float32).reshape(ran["outputs"]["output"])
    assert compare_outputs(ort_outputs(model, feeds), [output]) < 1e-3


def test_kselect_space_names_why_acl_offers_no_fp16(tmp_path):
    """``kselect space --json`` for ACL: fp32 and int8, and fp16 left out with ACL's own answer
    (the runner's F16 validate(): Debian's 20.08 and 24.11 builds have no F16 kernels)."""
    model_path = graphs.saved(small_cnn(), tmp_path / "small.onnx")
    space = kselect_json("space", str(model_path), "--library", "acl", "--task", "T01")
    assert space["precisions"] == ["fp32", "int8"]
    assert set(space["missing_precisions"]) == {"bf16", "fp16"}
    acl = plugins.get_library("acl")
    try:
        info = acl._runner_info()
    finally:
        acl.close()
    why = space["missing_precisions"]["fp16"]
    assert why.startswith(f"ACL {info['acl_version']} ")
    if "'arch': 'arm64-v8a'" in info["build_information"]:
        assert "refuses F16 here" in why and "does not support F16" in why
        if info["has_fp16"]:
            assert "although the CPU has FP16 arithmetic" in why and "arch=arm64-v8a" in why
