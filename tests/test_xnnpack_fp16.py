"""XNNPack's f16 operators as fp16 candidates, on the real library (where the CPU has its f16
kernels: AVX2 and F16C on x86): fp16 twins of a conv, a depthwise conv with SiLU, a deconv and
an fc measured against the float64 reference within the half tolerance, which allows for the f16
kernels rounding their running sums to half; a candidate computing wrongly rejected; fp16 listed
exactly where the f16 operators run, bf16 named missing, in the status and in ``kselect space``;
a plan with fp16 and fp32 ops run end to end through kselect.load_plan; and a tune with
``--precision fp32,fp16`` whose plan runs within its metric, each op's fp16 twin measured and
either on the front or left out of its ladder with the reason."""

from __future__ import annotations

import functools
import json
import warnings

import graphs
import numpy as np
import onnxruntime as ort
import pytest
from helpers import RELU, SILU, kselect_json, truncated_weights, twin_conv, twin_task

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import Plan, load_plan_file, plan_node, plan_task
from kselect.core.precision.half import UNIT_ROUNDOFF, half_tolerance
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)
_F16_OK, _F16_REASON = xa.f16_availability() if _OK else (False, _REASON)
needs_f16 = pytest.mark.skipif(not _F16_OK, reason=f"no fp16 here: {_F16_REASON}")

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
U = UNIT_ROUNDOFF["fp16"]


_task, _conv = functools.partial(twin_task, "fp16"), functools.partial(twin_conv, "fp16")


FP16_TASKS = {
    "conv 3x3 relu": _conv([1, 64, 12, 12], [64, 64, 3, 3], [1, 64, 12, 12], 3, epilogue=RELU),
    "depthwise silu": _conv([1, 64, 14, 14], [64, 1, 3, 3], [1, 64, 7, 7], 3, stride=2, group=64, epilogue=SILU),
    "deconv 3x3 s2": _task("deconv", [1, 32, 7, 9], [32, 16, 3, 3], [1, 16, 13, 17],
                           {"kernel": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1],
                            "group": 1, "output_padding": [0, 0]}),
    "fc alpha beta": _task("fc", [4, 512], [100, 512], [4, 100], {"alpha": -0.5, "beta": 2.0, "transB": 1}),
}


@pytest.fixture(scope="module")
def xnnpack() -> XnnpackLibrary:
    return plugins.get_library("xnnpack")


def test_fp16_is_listed_exactly_where_the_f16_operators_run_and_bf16_is_named_missing(xnnpack):
    ok, status = xnnpack.availability()
    assert ok
    assert ("fp16" in xnnpack.precisions) == _F16_OK
    assert xnnpack.plan_precisions == xnnpack.precisions
    assert xnnpack.missing_precisions()["bf16"] == "XNNPack has no bf16 operators in this build"
    assert "bf16: XNNPack has no bf16 operators in this build" in status
    assert xnnpack.capabilities().accumulates_in_half == frozenset({"fp16"})
    if _F16_OK:
        assert "fp16: f16 conv / deconv / fc operators (one f16 GEMM and one depthwise kernel per tap count" in status
        assert xnnpack.supports(FP16_TASKS["fc alpha beta"])
    else:  # a CPU without what XNNPack's f16 kernels need: the status and the missing precisions say so
        assert f"fp16: {_F16_REASON}" in status and xnnpack.missing_precisions()["fp16"] == _F16_REASON
        assert not xnnpack.supports(FP16_TASKS["fc alpha beta"])


@needs_f16
@pytest.mark.parametrize("name", list(FP16_TASKS))
def test_fp16_ops_match_the_reference_within_the_half_tolerance(xnnpack, name):
    """Every config of the fp16 space (threads, spinning) of a conv with its folded Relu, a
    depthwise conv with SiLU run in float32 after the conversion, a strided deconv and an fc with
    alpha and beta measures ok: f16 arithmetic (well above float32's rounding), within the
    tolerance for f16 kernels."""
    task, device = FP16_TASKS[name], this_device()
    assert xnnpack.supports(task)
    space = xnnpack.space(task, device)
    assert space.normalise(xnnpack.default_config(task, device)) in space
    assert {dim.name for dim in space.dims} <= {"threads", "spinning"}  # no micro-kernel choice in f16
    inputs = task_inputs(task)
    tolerance = half_tolerance(task, inputs, reference_output(task, inputs), "fp16", accumulates_in_format=True)
    for config in space.enumerate():
        result = measure_in_this_process(xnnpack, task, config, QUICK, {})
        assert result.status == "ok", (config, result.reason)
        assert U / 4 < result.error <= tolerance, config


class TruncatingWeights(XnnpackLibrary):
    """Real XNNPack f16 operators given weights truncated to 4 significant bits (a conversion that
    drops bits where it should round): they run and compute the wrong thing. The measuring code
    builds it here, in this process."""

    def prepare(self, task, config, inputs):
        return super().prepare(task, config, truncated_weights(inputs))


@needs_f16
def test_the_tolerance_allows_for_sums_rounded_to_half_and_rejects_a_wrong_candidate(xnnpack):
    """A 3x3 conv over 64 channels (576 products per output): XNNPack's f16 kernels round each
    running sum to half, which costs more than a kernel accumulating in float32 is allowed; the
    allowance for it still rejects weights truncated to 4 significant bits."""
    task, device = FP16_TASKS["conv 3x3 relu"], this_device()
    inputs = task_inputs(task)
    reference = reference_output(task, inputs)
    result = measure_in_this_process(xnnpack, task, xnnpack.default_config(task, device), QUICK, {})
    assert result.status == "ok"
    assert result.error > half_tolerance(task, inputs, reference, "fp16")  # float32 accumulation's allowance
    wrong = TruncatingWeights()
    result = measure_in_this_process(wrong, task, wrong.default_config(task, device), QUICK, {})
    assert result.status == "invalid" and "differs from reference" in result.reason


@needs_f16
def test_a_plan_with_fp16_and_fp32_ops_runs_through_load_plan(xnnpack):
    """small_cnn with its block's first conv, the strided conv, the depthwise conv and the Gemm in
    fp16 (entries of their fp16 twins) and the rest in fp32: the executor runs those nodes on the
    f16 operators, and the output is within a few half units per fp16 op of ONNX Runtime's fp32
    output (not equal to it: f16 did run)."""
    model = model_from_proto("small", graphs.small_cnn())
    device = this_device()
    in_fp16 = {"block.conv1", "down", "dw", "fc"}
    tasks, nodes = [], {}
    for task in extract_tasks(model):
        twin = task.at_precision("fp16" if set(task.nodes) & in_fp16 else "fp32")
        config = xnnpack.default_config(twin, device)
        tasks.append(plan_task(twin, twin.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False))
        nodes.update({node: plan_node(twin, "xnnpack", config) for node in twin.nodes})
    plan_level = {"spinning": 1} if any("spinning" in n["config"] for n in nodes.values()) else {}
    plan = Plan(model={}, device={}, libraries={"xnnpack": xnnpack.version()}, emulated=False, plan_level=plan_level,
                tasks=tasks, nodes=nodes)
    x = np.random.default_rng(4).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = kselect.load_plan(plan, model)
    try:
        output = runner.run({"input": x})[0]
        assert runner.runners[0].fp16_nodes == in_fp16
    finally:
        runner.close()
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = session.run(None, {"input": x})[0]
    error = float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference)))
    assert 1e-5 < error < 16 * U * len(in_fp16)


def test_kselect_space_lists_fp16_where_it_runs_and_names_bf16_missing():
    space = kselect_json("space", "resnet18", "--library", "xnnpack")
    assert ("fp16" in space["precisions"]) == _F16_OK and "int8" in space["precisions"]
    assert space["missing_precisions"]["bf16"] == "XNNPack has no bf16 operators in this build"
    assert set(space["missing_precisions"]) == {"bf16"} | (set() if _F16_OK else {"fp16"})


@needs_f16
def test_a_fp16_tune_reports_each_ops_fp16_twin_and_its_plan_runs_within_the_metric(tmp_path):
    """``kselect tune resnet18 --precision fp32,fp16`` on XNNPack (32x32 input, synthetic feeds,
    cosine budget 0.01): every op's fp16 twin is measured; each op is either run in fp16 on a point
    of the front or named in ``left_out`` with why (here, where float32 runs on AVX-512 and f16 on
    AVX2 with its sums rounded to half, usually "slower than fp32"); the plan stores each op's
    precision and runs through kselect.load_plan within the budget of the fp32 model's output."""
    out = tmp_path / "resnet18.plan.json"
    shape = ("--input-shape", "input=1,3,32,32")
    tuned = kselect_json("tune", "resnet18", *shape, "--library", "xnnpack", "--precision", "fp32,fp16",
                         "--metric", "cosine", "--max-accuracy-drop", "0.01", "--budget", "1", "--min-time", "0.01",
                         "--min-repeats", "3", "--no-verify", "--db", tmp_path / "r.db", "-o", out)
    library = tuned["libraries"][0]
    fp32_tasks = [t for t in library["tasks"] if "." not in t["task"]]
    fp16_tasks = {t["task"]: t for t in library["tasks"] if t["task"].endswith(".fp16")}
    assert {f"{t['task']}.fp16" for t in fp32_tasks} == set(fp16_tasks)
    assert all(t["best_us"] for t in fp16_tasks.values())  # each measured ok
    precision = library["precision"]
    assert precision["front"][0]["name"] == "fp32"
    on_front = {node for point in precision["front"] for node, p in point["precisions"].items() if p == "fp16"}
    left_out = {node for node, why in precision.get("left_out", {}).items() if "fp16" in why}
    plan = load_plan_file(out)
    assert on_front | left_out == set(plan.nodes)
    assert all(why["fp16"].startswith(("slower than fp32", "failed in the whole model"))
               for why in precision.get("left_out", {}).values())
    chosen = next(point for point in precision["front"] if point["name"] == precision["chosen"])
    assert chosen["within_budget"]
    planned = {node: t.get("precision", "fp32") for t in plan.tasks for node in t["nodes"]}
    assert {node for node, p in planned.items() if p == "fp16"} == set(chosen["precisions"])

    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that the plan's input shape overrides the zoo model's 224x224
        runner = kselect.load_plan(out, "resnet18")
    try:
        output = runner.run({"input": x})[0]
    finally:
        runner.close()
    reference = ort.InferenceSession(runner.model.proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    cosine = float(output.ravel() @ reference.ravel() / (np.linalg.norm(output) * np.linalg.norm(reference)))
    assert cosine >= 1 - 0.01
    assert json.loads(out.read_text())["extra"]["precision"]["metric"] == "cosine"
