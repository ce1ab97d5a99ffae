"""Whole models with int8 nodes in the ACL engine: plans built as core/precision/mixed.py builds them (the
fp32 plan with some nodes run by their int8 tasks' entries, the calibration cache in
``plan.extra["precision"]["ranges"]``) run quantized conv / depthwise conv / fc functions, with
NEQuantizationLayer / NEDequantizationLayer steps where a tensor passes between a float and an
int8 op; the quantize / dequantize conversions of the label ``acl:int8``; and a mixed-precision
``kselect.tune`` with ACL ending with a plan that ``kselect bench`` and ``kselect.load_plan`` run.

On x86_64 everything runs under qemu (``emulated``): the model is the tests' small CNN.
"""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import small_cnn
from helpers import kselect_json
from onnx import helper, numpy_helper

import kselect
from kselect.core.contract.labels import Label
from kselect.core.cross_library.conversions import conversion_task
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.plugins.ops.convert import INT8_CONVERSION_TOLERANCE
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import Plan, load_plan_file, plan_node, plan_task
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.mixed import mixed_plan
from kselect.plugins.acl import build, int8

pytestmark = [pytest.mark.emulated] if build.is_emulated() else []

FAST = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=60)
FEEDS = 2  # held-out feeds compared
# int8 through the small CNN's seven quantized layers: a few output steps of each (measured: 0.008)
INT8_TOLERANCE = 0.04
FLOAT_ROUNDING = 1e-5  # the fp32 plan's distance from ONNX Runtime is ~2e-7


def relative(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def calibration_feeds(count=8, shape=(1, 3, 32, 32), seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


class Setup:
    """The small CNN, its calibration ranges, the fp32 plan of ACL's defaults, its int8 tasks and
    ONNX Runtime's fp32 outputs on the held-out feeds."""

    def __init__(self, acl, folder):
        path = folder / "small.onnx"
        onnx.save(small_cnn(), path)
        self.path = path
        self.model = load_model(str(path))
        self.acl = acl
        self.device = this_device()
        self.calibration = calibration_for(self.model, calibration_feeds())
        self.ranges = compute_ranges(self.model, self.calibration)
        self.fp32_tasks = extract_tasks(self.model)
        self.int8_tasks = [t.at_precision("int8") for t in self.fp32_tasks if acl.supports(t.at_precision("int8"))]
        entries, nodes = [], {}
        for task in self.fp32_tasks:
            config = acl.default_config(task, self.device)
            entries.append(plan_task(task, task.nodes, "acl", config, 1.0, config, 1.0, 1, acl.emulated))
            nodes.update({node: plan_node(task, "acl", config) for node in task.nodes})
        self.fp32_plan = Plan(model={"name": "small"}, device=self.device.to_json(), libraries={"acl": acl.version()},
                              emulated=acl.emulated, plan_level={}, tasks=entries, nodes=nodes)
        self.feeds = self.calibration.held_out[:FEEDS]
        session = ort.InferenceSession(self.model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
        self.reference = [session.run(None, feed)[0] for feed in self.feeds]
        self.fp32 = self.run(self.fp32_plan)[0]

    @property
    def int8_nodes(self) -> set[str]:
        return {node for task in self.int8_tasks for node in task.nodes}

    def int8_plan(self, nodes=None, config_of=None) -> Plan:
        """The fp32 plan with ``nodes`` (default: every node with an int8 twin) run in int8, each
        int8 task with ``config_of(task, index, config)`` (default: ACL's own int8 config)."""
        entries = {}
        for index, task in enumerate(self.int8_tasks):
            config = self.acl.default_config(task, self.device)
            if config_of is not None:
                config = config_of(task, index, config)
            assert config in self.acl.space(task, self.device), config
            entries[task.key] = plan_task(task, task.nodes, "acl", config, 1.0, config, 1.0, 1, self.acl.emulated)
        chosen = self.int8_nodes if nodes is None else set(nodes)
        return mixed_plan(self.fp32_plan, {"int8": entries}, {}, dict.fromkeys(chosen, "int8"),
                          {"ranges": self.ranges, "metric": "cosine", "max_drop": 0.05})

    def run(self, plan) -> tuple[list[np.ndarray], dict]:
        runner = self.acl.model_runner(self.model, plan)
        try:
            return [runner(feed)[0] for feed in self.feeds], runner.load_info
        finally:
            runner.close()


@pytest.fixture(scope="module")
def setup(acl, tmp_path_factory):
    return Setup(acl, tmp_path_factory.mktemp("acl-int8-model"))


def check_close_and_quantized(setup, outputs):
    """Within int8's tolerance of ONNX Runtime's fp32 output, and further from ACL's fp32 plan than
    float rounding: the int8 functions ran."""
    for ours, reference, fp32 in zip(outputs, setup.reference, setup.fp32):
        assert np.all(np.isfinite(ours))
        assert relative(ours, reference) <= INT8_TOLERANCE
        assert relative(ours, fp32) > FLOAT_ROUNDING
    assert relative(setup.fp32[0], setup.reference[0]) < FLOAT_ROUNDING


def chosen_weights(task, weights) -> str:
    """An fc takes per-tensor weights only; signed weights under unsigned activations are dense
    convs' alone (a depthwise conv refuses the mix): those take plain per-tensor ones."""
    if task.kind == "fc" or (weights == int8.SIGNED_WEIGHTS and task.attrs["group"] > 1):
        return "per-tensor"
    return weights


def with_choice(activations, weights, layout):
    def config_of(task, index, config):
        config = {**config, "activations": activations, "weights": chosen_weights(task, weights)}
        if task.kind == "conv":
            config.update(layout=layout)
        return config
    return config_of


@pytest.mark.parametrize("activations,weights,layout", [
    ("QASYMM8_SIGNED", "per-channel", "NCHW"), ("QASYMM8", "per-channel", "NCHW"),
    ("QASYMM8_SIGNED", "per-tensor", "NHWC"), ("QASYMM8", "per-tensor", "NHWC"),
    ("QASYMM8", int8.SIGNED_WEIGHTS, "NCHW")])
def test_every_conv_and_fc_in_int8_matches_onnxruntime(setup, activations, weights, layout):
    """Dense, strided, depthwise and pointwise convs and the fc all in int8: each runs quantized
    as its config says; a tensor int8 ops write and read passes between them quantized (the conv
    chains), and only the tensors float ops write are quantized (the input, the Add's sum, the
    Flatten's output) and only those float ops read are dequantized (the two Add inputs, the
    pooled conv's output, the graph output)."""
    if weights == int8.SIGNED_WEIGHTS and setup.acl._runner_info()["acl_version"] != "v24.11":
        pytest.skip("signed weights under unsigned activations: ACL 24.11's (20.08 computes them wrong)")
    outputs, info = setup.run(setup.int8_plan(config_of=with_choice(activations, weights, layout)))
    check_close_and_quantized(setup, outputs)
    reports = {n["node"]: n for n in info["nodes"]}
    assert set(reports) == setup.int8_nodes == {"stem", "block.conv1", "block.conv2", "down", "dw", "pw", "fc"}
    for node, report in reports.items():
        fc = node == "fc"
        assert report["data_type"] == activations and report["bias_type"] == "S32"
        plain = fc or (node == "dw" and weights == int8.SIGNED_WEIGHTS)  # chosen_weights: per-tensor there
        assert report["weights_type"] == int8.weight_type(activations, "per-tensor" if plain else weights)
        if not fc:
            assert report["layout"] == layout
            assert report["effective_method"] == ("DEPTHWISE" if node == "dw" else "GEMM")
    assert (info["quantizes"], info["dequantizes"]) == (3, 4)
    assert info["permutes"] == (1 if layout == "NHWC" else 0)  # the float input, before it is quantized
    assert info["emulated"] == setup.acl.emulated


def test_each_node_alone_in_int8_is_quantized_between_float_ops(setup):
    """A mixed plan with one int8 op: its input quantized and its output dequantized around it
    (the conversions of the label acl:int8), and the model's output moved by its quantization."""
    for node in sorted(setup.int8_nodes):
        outputs, info = setup.run(setup.int8_plan({node}))
        check_close_and_quantized(setup, outputs)
        assert [n["node"] for n in info["nodes"] if "data_type" in n] == [node]
        assert (info["quantizes"], info["dequantizes"]) == (1, 1), node  # stem's float output serves both readers


def test_a_mixed_plan_converts_where_precision_changes(setup):
    """Every other int8-able node in int8: quantize / dequantize steps run where a tensor crosses
    between float and int8 ops (profiled), and the output stays within int8's tolerance."""
    nodes = {"stem", "block.conv2", "dw", "fc"}
    plan = setup.int8_plan(nodes)
    runner = setup.acl.model_runner(setup.model, plan)
    try:
        output = runner.run(setup.feeds[0], profile=True)[0]
        steps = [(step["node"], step["op"]) for step in runner.last["profile"]]
    finally:
        runner.close()
    check_close_and_quantized(setup, [output])
    assert ("quantize:input:QASYMM8_SIGNED", "quantize") in steps
    assert ("dequantize:stem.r", "dequantize") in steps  # block.conv1 and the Add read it in float
    assert ("quantize:down.r:QASYMM8_SIGNED", "quantize") in steps and ("dequantize:output", "dequantize") in steps
    assert sum(op == "quantize" for _, op in steps) == 4 and sum(op == "dequantize" for _, op in steps) == 4


def test_neighbours_of_both_activation_types_requantize_without_float(setup):
    """QASYMM8 and QASYMM8_SIGNED neighbours (in alternating layouts too) share a tensor's grid 128
    apart: an NEQuantizationLayer requantizes it, after an 8-bit NEPermute where the layout changes
    (no dequantize), and the outputs are the all-signed plan's."""
    def alternate(task, index, config):
        config = {**config, "activations": int8.ACTIVATION_TYPES[index % 2]}
        if task.kind == "conv":
            config["layout"] = ("NCHW", "NHWC")[index % 2]
        return config
    outputs, info = setup.run(setup.int8_plan(config_of=alternate))
    signed, _ = setup.run(setup.int8_plan())
    assert info["dequantizes"] == 4 and info["quantizes"] > 3 and info["permutes"] > 0
    for a, b in zip(outputs, signed):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [[1, 16, 8, 8], [2, 24]])
@pytest.mark.parametrize("direction", ["in", "out"])
def test_acl_int8_conversions_are_measured_round_trips(acl, shape, direction):
    """The label acl:int8: NEQuantizationLayer ("in") or NEDequantizationLayer ("out") timed in the
    runner, the output the tensor quantized on its own range and back, checked by the core."""
    task = conversion_task("acl:int8", direction, shape)
    result = measure_in_this_process(acl, task, {}, FAST, {})
    assert result.status == "ok", result
    assert result.median_us > 0 and result.error <= INT8_CONVERSION_TOLERANCE
    answer = acl.last_result
    assert answer["op"] == ("quantize" if direction == "in" else "dequantize")
    assert answer["data_type"] == int8.DEFAULT_ACTIVATIONS and answer["emulated"] == acl.emulated
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    y = acl.measure_conversion("acl:int8", direction, x, FAST)["output"]
    step = (x.max() - x.min()) / 255
    assert 0 < np.max(np.abs(y - x)) <= step / 2 * 1.01  # quantized: not the tensor itself, within half a step
    assert len(np.unique(y)) <= 256


def test_int8_entries_acl_cannot_run_are_refused(acl, setup, tmp_path):
    """An int8 entry for a conv whose activation ACL's quantized output stage does not clamp
    (Sigmoid), or a plan without a calibrated range for a tensor an int8 op reads, is refused by
    name rather than run in float."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid")]
    graphs.saved(graphs.model(nodes, [w], (1, 3, 8, 8), output_shapes=[[1, 8, 8, 8]]), tmp_path / "s.onnx")
    model = load_model(str(tmp_path / "s.onnx"))
    task = extract_tasks(model)[0]
    entry = {"task": task.at_precision("int8").id, "library": "acl",
             "config": {"activations": "QASYMM8_SIGNED", "weights": "per-channel", "threads": 1}}
    plan = Plan(model={}, device={}, libraries={"acl": ""}, emulated=True, plan_level={}, tasks=[], nodes={"conv": entry})
    with pytest.raises(KselectError, match="no int8 form of node 'conv'"):
        acl.node_configs(model, plan)
    plan = setup.int8_plan({"stem"})
    plan.extra["precision"]["ranges"] = {}
    with pytest.raises(KselectError, match="no range for tensor 'input'"):
        acl.model_runner(setup.model, plan)


def test_a_mixed_precision_tune_with_acl_ends_with_a_plan_bench_and_load_plan_run(setup, tmp_path):
    """kselect tune --library acl --precision fp32,int8 (tiny budget, no end-to-end race): the front
    is searched with ACL's int8 ops and measured conversions, the plan kept is within the budget,
    and ``kselect bench`` and ``kselect.load_plan`` run it."""
    folder = tmp_path / "calibration"
    folder.mkdir()
    for i, feed in enumerate(calibration_feeds(8, seed=3)):
        np.savez(folder / f"feed{i}.npz", **feed)
    plan_path = tmp_path / "small.plan.json"
    tuned = kselect_json("tune", setup.path, "--library", "acl", "--precision", "fp32,int8", "--calibration", folder,
                         "--metric", "cosine", "--max-accuracy-drop", "0.05", "--budget", "2", "--min-time", "0.01",
                         "--no-verify", "--db", tmp_path / "r.db", "-o", plan_path)
    assert tuned["libraries"][0]["emulated"]
    plan = load_plan_file(plan_path)
    assert "cross_library" in plan.extra  # layouts planned per op, int8 ones among them
    assert any(Label(entry["label"]).is_int8 for entry in plan.nodes.values())
    precision = plan.extra["precision"]
    assert [p["name"] for p in precision["front"]][:2] == ["fp32", "int8"]
    assert precision["front"][1]["int8_ops"] and "failed" not in precision["front"][1]
    chosen = next(p for p in precision["front"] if p["name"] == precision["chosen"])
    assert chosen["within_budget"] and chosen["drop"] <= 0.05 and plan.emulated
    runner = kselect.load_plan(plan_path, str(setup.path))
    try:
        output = runner.run(setup.feeds[0])[0]
    finally:
        runner.close()
    assert relative(output, setup.reference[0]) <= INT8_TOLERANCE
    bench = kselect_json("bench", setup.path, "--plan", plan_path, "--rounds", "1", "--runs-per-round", "1")
    assert bench["emulated"] and bench["library"] == "acl"
