"""Plans mixing libraries run end to end (core/plans/runtime.py), on real MLAS and XNNPack kernels: the
graph is cut exactly where the library changes, and the outputs are ONNX Runtime's."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import graphs
import numpy as np
import onnx
import pytest
from graphs import small_cnn
from onnx import helper, numpy_helper

import kselect
from kselect.core.contract import plugins
from kselect.core.cross_library.switches import defaults_plan as make_plan
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model, model_from_proto
from kselect.core.plans.runtime import load_plan
from kselect.core.whole_model.bench import compare_outputs, random_feeds
from kselect.plugins.mlas.apply import default_session
from kselect.plugins.xnnpack import xnnpack_api as xa

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)


def tunable(model) -> list[str]:
    return [node.name for node in model.proto.graph.node if node.op_type in ("Conv", "Gemm")]


def assert_matches_onnxruntime(runner, model):
    feeds = random_feeds(model)
    assert compare_outputs(default_session(model).run(None, feeds), runner(feeds)) < 1e-4


def assert_cut_where_the_library_changes(runner, plan):
    segments = runner.segments
    assert all(a.library != b.library for a, b in zip(segments, segments[1:]))
    run_in = {node: s.library for s in segments for node in s.nodes}
    assert sorted(run_in) == sorted(n.name for n in runner.model.proto.graph.node)
    assert all(run_in[node] == entry["library"] for node, entry in plan.nodes.items())


def layout(runner) -> list[tuple[str, list[str]]]:
    return [(s.library, s.nodes) for s in runner.segments]


@pytest.fixture(scope="module")
def small():
    return model_from_proto("small_cnn", small_cnn())


@pytest.fixture(scope="module")
def googlenet():
    return load_model("googlenet", ["input=1,3,64,64"])


@pytest.mark.parametrize("library", ["mlas", "xnnpack"])
def test_a_one_library_plan_is_one_segment_on_the_whole_model(small, library):
    plan = make_plan(small, {node: library for node in tunable(small)})
    runner = load_plan(plan, small)
    try:
        assert layout(runner) == [(library, [n.name for n in small.proto.graph.node])]
        assert runner.segments[0].inputs == ["input"] and runner.segments[0].outputs == ["output"]
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()


def test_one_xnnpack_conv_in_a_chain_makes_three_segments(small):
    plan = make_plan(small, {node: "xnnpack" if node == "down" else "mlas" for node in tunable(small)})
    runner = load_plan(plan, small)
    try:
        assert layout(runner) == [
            ("mlas", ["stem", "stem.relu", "block.conv1", "block.conv1.relu", "block.conv2", "block.add"]),
            ("xnnpack", ["down", "down.relu"]),  # the Relu goes with the conv feeding it
            ("mlas", ["dw", "dw.relu", "pw", "pw.relu", "gap", "flatten", "fc"])]
        assert (runner.segments[1].inputs, runner.segments[1].outputs) == (["block.sum"], ["down.r"])
        assert len(runner.describe()) == 3
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()


def test_alternating_convs_cut_at_every_change_and_match_onnxruntime(small):
    plan = make_plan(small, {node: ("mlas", "xnnpack")[i % 2] for i, node in enumerate(tunable(small))})
    runner = load_plan(plan, small)
    try:
        assert layout(runner) == [
            ("mlas", ["stem", "stem.relu"]),
            ("xnnpack", ["block.conv1", "block.conv1.relu"]),
            ("mlas", ["block.conv2", "block.add"]),
            ("xnnpack", ["down", "down.relu"]),
            ("mlas", ["dw", "dw.relu"]),
            ("xnnpack", ["pw", "pw.relu", "gap", "flatten"]),
            ("mlas", ["fc"])]
        assert runner.segments[2].inputs == ["block.conv1.r", "stem.r"]  # the residual crosses two boundaries
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()


def cpu_ms_while_idle(runner, feeds, idle_s: float = 0.2) -> float:
    """Median CPU time the process spends while its caller sleeps right after ``runner`` returns:
    threads still spinning for more work."""
    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    spent = []
    for _ in range(5):
        runner(feeds)
        start = cpu()
        time.sleep(idle_s)
        spent.append((cpu() - start) * 1000.0)
    return float(np.median(spent))


@pytest.mark.skipif(this_device().cores < 2, reason="no thread pools on one core")
def test_a_mixed_plan_leaves_no_thread_spinning_when_it_returns(small):
    """Each library's threads stop spinning at the end of its segment: spinning threads of one
    library hold cores the next segment's threads need (resnet101 with two XNNPack ops: 251 ms
    with them spinning, 150 ms without, MLAS alone 128 ms, one interleaved run)."""
    feeds = random_feeds(small)
    alone = plugins.get_library("xnnpack").model_runner(small, None)  # XNNPack's pool spins after its work
    try:
        assert cpu_ms_while_idle(alone, feeds) > 2.0
    finally:
        alone.close()
    plan = make_plan(small, {node: ("mlas", "xnnpack")[i % 2] for i, node in enumerate(tunable(small))})
    assert all(settings.get("spinning") == 1 for settings in plan.library_settings.values())  # both spin while they work
    runner = load_plan(plan, small)
    try:
        assert cpu_ms_while_idle(runner, feeds) < 2.0
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()


def test_inception_branches_in_another_library_make_one_segment(googlenet):
    xnnpack_nodes = {"inception3a.branch1", "inception3a.branch3.1"}
    plan = make_plan(googlenet, {node: "xnnpack" if node in xnnpack_nodes else "mlas" for node in tunable(googlenet)})
    runner = load_plan(plan, googlenet)
    try:
        assert [s.library for s in runner.segments] == ["mlas", "xnnpack", "mlas"]
        # the untuned concat and the next block's pool follow the op feeding them
        assert runner.segments[1].nodes == ["inception3a.branch1", "inception3a.branch1.relu", "inception3a.branch3.1",
                                            "inception3a.branch3.1.relu", "inception3a.concat",
                                            "inception3b.branch4.pool"]
        assert_cut_where_the_library_changes(runner, plan)
        assert_matches_onnxruntime(runner, googlenet)
    finally:
        runner.close()


def test_mobilenetv2_with_alternating_libraries_matches_onnxruntime():
    model = load_model("mobilenetv2", ["input=1,3,64,64"])
    plan = make_plan(model, {node: ("mlas", "xnnpack")[i % 2] for i, node in enumerate(tunable(model))})
    runner = load_plan(plan, model)
    try:
        assert len(runner.segments) == len(tunable(model))  # every conv (and the fc) changes library
        assert_cut_where_the_library_changes(runner, plan)
        assert_matches_onnxruntime(runner, model)
    finally:
        runner.close()


def test_a_node_fed_only_by_graph_inputs_goes_with_the_first_tuned_node_after_it(tmp_path):
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Erf", ["c"], ["y"], name="erf")]  # not an XNNPack executor op
    weights = [numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w")]
    model = model_from_proto("g", graphs.model(nodes, weights, (1, 8, 16, 16)))
    plan = make_plan(model, {"conv": "xnnpack"})
    runner = load_plan(plan, model)
    try:
        assert layout(runner) == [("xnnpack", ["pool", "conv"]), ("mlas", ["erf"])]  # mlas: its defaults
        assert_matches_onnxruntime(runner, model)
    finally:
        runner.close()


def test_a_saved_plan_runs_through_kselect_load_plan(small, googlenet, tmp_path):
    small_path = tmp_path / "small.onnx"
    onnx.save(small_cnn(), small_path)
    plan_path = tmp_path / "small.plan.json"
    make_plan(small, {node: ("xnnpack", "mlas")[i % 2] for i, node in enumerate(tunable(small))}).save(plan_path)
    runner = kselect.load_plan(plan_path, str(small_path))
    try:
        assert len(runner.segments) == 7
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()

    plan_path = tmp_path / "googlenet.plan.json"
    make_plan(googlenet, {node: "xnnpack" if node.startswith("inception4") else "mlas"
                          for node in tunable(googlenet)}).save(plan_path)
    runner = kselect.load_plan(str(plan_path), "googlenet")  # a zoo name: loaded at the plan's input shape
    try:
        assert runner.model.input_shapes == {"input": [1, 3, 64, 64]}
        assert [s.library for s in runner.segments] == ["mlas", "xnnpack", "mlas"]
        assert_matches_onnxruntime(runner, googlenet)
    finally:
        runner.close()


def test_import_kselect_stays_cheap():
    code = "import sys, kselect; print(sorted({'onnx', 'onnxruntime', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_acl_segments_run_between_mlas_segments(small, acl):
    plan = make_plan(small, {node: ("acl", "mlas")[i % 2] for i, node in enumerate(tunable(small))})
    runner = load_plan(plan, small)
    try:
        assert [s.library for s in runner.segments] == ["acl", "mlas"] * 3 + ["acl"]
        assert_matches_onnxruntime(runner, small)
    finally:
        runner.close()
