"""oneDNN's bf16 kernels as candidates (on a CPU with AVX512_BF16 or AMX): bf16 conv, depthwise,
deconv and inner product twins measured against the float64 reference within the format's
tolerance on real bf16 kernels; a candidate computing wrongly in half precision rejected; a plan
with bf16 and fp32 ops run end to end through kselect.load_plan; a tune with --precision fp32,bf16
on a real model choosing bf16 ops under the budget, its plan reproducing the front's metric; a
tune across MLAS and oneDNN holding int8, bf16 and fp32 ops in one plan; ``kselect space`` naming,
per op kind, why the f32 primitives' bf16 fp-math mode is not offered."""

from __future__ import annotations

import ctypes
import functools
import platform

import graphs
import numpy as np
import onnxruntime as ort
import pytest
from helpers import RELU, SILU, default_plan_in, feeds_folder, kselect_json, truncated_weights, twin_conv, twin_task

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.model import model_from_proto
from kselect.core.precision.half import half_tolerance
from kselect.plugins.onednn import dnnl
from kselect.plugins.onednn import primitives as prim
from kselect.plugins.onednn.library import OnednnLibrary, fpmath_bf16_change

_OK, _REASON = dnnl.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)
needs_bf16 = pytest.mark.skipif(not _OK or prim.bf16_missing() is not None,
                                reason=_OK and f"oneDNN has no bf16 kernels here: {prim.bf16_missing()}")

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
TUNE_QUICK = MeasureSettings(min_repeats=3, min_time_s=0.01, max_time_s=0.2, timeout_s=60)


_task, _conv = functools.partial(twin_task, "bf16"), functools.partial(twin_conv, "bf16")


BF16_TASKS = {
    "conv 3x3 relu": _conv([1, 32, 14, 14], [64, 32, 3, 3], [1, 64, 14, 14], 3, epilogue=RELU),
    "depthwise silu": _conv([1, 64, 14, 14], [64, 1, 3, 3], [1, 64, 7, 7], 3, stride=2, group=64, epilogue=SILU),
    "deconv 2x2": _task("deconv", [1, 32, 7, 9], [32, 16, 2, 2], [1, 16, 14, 18],
                        {"kernel": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0], "dilations": [1, 1],
                         "group": 1, "output_padding": [0, 0]}),
    "fc": _task("fc", [4, 512], [100, 512], [4, 100], {"alpha": 1.0, "beta": 1.0, "transB": 1}),
}


@pytest.fixture(scope="module")
def onednn():
    return plugins.get_library("onednn")


def test_bf16_is_listed_exactly_where_onednn_has_bf16_kernels(onednn):
    ok, status = onednn.availability()
    assert ok
    missing = prim.bf16_missing()
    assert ("bf16" in onednn.precisions) == (missing is None)
    assert onednn.plan_precisions == onednn.precisions
    assert "fp16" not in onednn.precisions
    # fp16: what the build was probed to have, by its version (2.6.3 on x86 has no f16 conv at all)
    major, minor, patch = dnnl.version()
    fp16 = onednn.missing_precisions()["fp16"]
    assert fp16 == prim.fp16_missing() and f"oneDNN {major}.{minor}.{patch} on {dnnl.effective_isa()}" in fp16
    assert f"fp16: {fp16}" in status
    if missing is not None:  # a CPU without AVX512_BF16 / AMX: the status says why
        assert f"bf16: {missing}" in status
        assert not onednn.supports(BF16_TASKS["fc"])


@needs_bf16
@pytest.mark.parametrize("name", list(BF16_TASKS))
def test_bf16_kernels_match_the_reference_within_the_formats_tolerance(onednn, name):
    task = BF16_TASKS[name]
    assert onednn.supports(task)
    default = onednn.default_config(task, this_device())
    assert "bf16" in default["impl"]  # oneDNN's own pick is a bf16 kernel (jit / brgemm on avx512_core_bf16)
    inputs = task_inputs(task)
    tolerance = half_tolerance(task, inputs, reference_output(task, inputs), "bf16")
    bf16_kernels = [c for c in onednn.space(task, this_device()).enumerate() if "bf16" in c["impl"]]
    assert bf16_kernels
    for config in bf16_kernels:
        result = measure_in_this_process(onednn, task, config, QUICK, {})
        assert result.status == "ok", (config, result.reason)
        # bf16 arithmetic, not f32: well above f32's rounding, within the format's tolerance
        assert 1e-4 < result.error <= tolerance


class TruncatingWeights(OnednnLibrary):
    """Real oneDNN bf16 kernels given weights truncated to 4 significant bits (a conversion that
    drops bits where it should round): they run and compute the wrong thing. The measuring code
    builds it here, in this process."""

    def prepare(self, task, config, inputs):
        return super().prepare(task, config, truncated_weights(inputs))


@needs_bf16
@pytest.mark.parametrize("name", ["conv 3x3 relu", "fc"])
def test_a_bf16_candidate_computing_wrongly_is_rejected(name):
    wrong, task = TruncatingWeights(), BF16_TASKS[name]
    result = measure_in_this_process(wrong, task, wrong.default_config(task, this_device()), QUICK, {})
    assert result.status == "invalid" and "differs from reference" in result.reason


@needs_bf16
def test_a_plan_with_bf16_and_fp32_ops_runs_through_load_plan(onednn):
    """small_cnn with its block's first conv, the strided conv, the depthwise conv and the Gemm in
    bf16 and the rest in fp32: bf16 kernels run those nodes, and the output is within a bf16
    budget of ONNX Runtime's fp32 output (not equal to it: bf16 did run)."""
    model = model_from_proto("small", graphs.small_cnn())
    in_bf16 = {"block.conv1", "down", "dw", "fc"}
    plan = default_plan_in(onednn, model, lambda task: "bf16" if set(task.nodes) & in_bf16 else "fp32")
    x = np.random.default_rng(4).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = kselect.load_plan(plan, model)
    try:
        output = runner.run({"input": x})[0]
        impls = runner.runners[0].impls
    finally:
        runner.close()
    assert {node for node, impl in impls.items() if "bf16" in impl} == in_bf16
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = session.run(None, {"input": x})[0]
    error = float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference)))
    assert 1e-5 < error < 4 * 2.0 ** -8 * len(in_bf16)  # a few bf16 units per bf16 op at most


def test_kselect_space_names_each_precision_a_library_offers_and_why_the_others_are_missing(onednn):
    """``kselect space --json``: oneDNN offers bf16 exactly where this CPU has the kernels, else it says
    why; MLAS names bf16 and fp16 as precisions it has no candidates for."""
    space = kselect_json("space", "resnet18", "--library", "onednn")
    reason = prim.bf16_missing()
    assert ("bf16" in space["precisions"]) == (reason is None)
    assert set(space["missing_precisions"]) == {"fp16", "int8"} | ({"bf16"} if reason else set())
    if reason:
        assert space["missing_precisions"]["bf16"] == reason
    mlas = kselect_json("space", "resnet18", "--library", "mlas")
    assert mlas["precisions"] == ["fp32", "int8"] and set(mlas["missing_precisions"]) == {"bf16", "fp16"}


def test_kselect_space_says_per_op_kind_why_the_bf16_fp_math_form_is_not_offered(onednn):
    """The f32 primitives' bf16 fp-math mode would be the bf16 twins' second form; oneDNN 2.6.3's x64
    kernels ignore it (the same implementations, bit-identical output), so it is offered for no op
    kind and ``kselect space --json`` says why, one reason per kind."""
    attr = dnnl.Attr([], "bf16")  # the probe's attribute really carries the mode
    mode = ctypes.c_int(-1)
    dnnl.call("dnnl_primitive_attr_get_fpmath_mode", ctypes.c_void_p(attr.handle), ctypes.byref(mode))
    attr.close()
    assert mode.value == dnnl.FPMATH_MODES["bf16"]
    space = kselect_json("space", "resnet18", "--library", "onednn")
    for kind, what in prim.KIND_NAMES.items():
        change = fpmath_bf16_change(kind)
        if dnnl.version()[:2] == (2, 6) and platform.machine() == "x86_64":
            assert change is None
        reason = space["missing_dims"][f"fpmath_bf16:{kind}"]
        assert (f"f32 {what} with fpmath_mode bf16 runs as strict f32" in reason) == (change is None)
        assert change is None or change in reason
    assert not any("form" in task["dimensions"] for task in space["tasks"])


YOLO = ("yolov8n-nudenet-320", "--input-shape", "images=1,3,128,128")
QUICK_TUNE = ("--budget", "1", "--min-time", "0.01", "--min-repeats", "3")


@needs_bf16
def test_a_bf16_tune_of_a_real_model_holds_the_budget_in_bf16_and_its_plan_scores_as_its_front(tmp_path):
    """YOLOv8n (64 convs with SiLU) on oneDNN with --precision fp32,bf16 and a cosine budget of
    0.0005 on the sample pictures: the front's first reduced point runs every op whose bf16 kernel
    is faster in bf16, "all-bf16" every op that has one and holds the budget, the chosen point is
    within the budget, the plan stores each op's precision, and the plan run through
    kselect.load_plan scores on the held-out feeds what the front says."""
    from kselect.core.models.model import load_model
    from kselect.core.plans.plan import load_plan_file, reduced_nodes
    from kselect.core.precision.calibration import calibration_for
    from kselect.core.precision.mixed import score_plan

    out = tmp_path / "yolo.plan.json"
    tuned = kselect_json("tune", *YOLO, "--library", "onednn", "--precision", "fp32,bf16", "--calibration", "samples",
                         "--metric", "cosine", "--max-accuracy-drop", "0.0005", "--no-verify", *QUICK_TUNE,
                         "--db", tmp_path / "r.db", "-o", out)
    precision = tuned["libraries"][0]["precision"]
    front = {point["name"]: point for point in precision["front"]}
    assert list(front)[0] == "fp32" and front["fp32"]["ops_by_precision"] == {}
    # "all-bf16": every op with a bf16 kernel (the 64 convs) in bf16; the "bf16" point (the
    # back-off's first, right after fp32): those of them not slower in bf16 than in fp32 alone. How
    # many are depends on the CPU (with AVX512_BF16 but no AMX, from none to a dozen in runs here),
    # so where none is faster, there is no back-off and no "bf16" point
    every_bf16 = front["all-bf16"]["precisions"] if "all-bf16" in front else front["bf16"]["precisions"]
    slower = {node for node, why in precision.get("left_out", {}).items() if why.get("bf16", "").startswith("slower")}
    assert len(every_bf16) >= 64 and set(every_bf16.values()) == {"bf16"}
    faster = set(every_bf16) - slower
    assert (list(front)[1] == "bf16" and set(front["bf16"]["precisions"]) == faster) if faster else "bf16" not in front
    uniform = front.get("all-bf16", front.get("bf16"))
    assert uniform["weight_bytes"] < front["fp32"]["weight_bytes"]
    # bf16 through the whole graph holds the budget; which point is kept is a matter of measured
    # speed, so only its budget is asserted, and its precisions are what the plan stores
    assert uniform["within_budget"] and uniform["drop"] <= 0.0005
    chosen = front[precision["chosen"]]
    assert chosen["within_budget"] and chosen["drop"] <= 0.0005

    plan = load_plan_file(out)
    assert reduced_nodes(plan) == chosen["precisions"]
    assert {t["precision"] for t in plan.tasks if t["nodes"][0] in chosen["precisions"]} <= {"bf16"}
    model = load_model(YOLO[0], [YOLO[2]])
    score, drop = score_plan(model, plan, calibration_for(model, "samples"), None, "cosine")
    assert score == pytest.approx(chosen["score"], abs=1e-4) and drop <= 0.0005 + 1e-4


@needs_bf16
def test_a_plan_across_mlas_and_onednn_holds_int8_bf16_and_fp32_ops_and_runs(tmp_path):
    """small_cnn tuned across MLAS and oneDNN with precision "all": MLAS's front starts with every
    op in int8, oneDNN's has a point in bf16. MLAS's plan with all but two ops in int8, and one of
    oneDNN's bf16 ops put in on one of those two (the kind of candidate the cross-library race
    gets: the ladder's middle rung across libraries), holds all three precisions, scores within a
    cosine of 0.95 on the held-out feeds, and runs through kselect.load_plan close to ONNX
    Runtime's fp32."""
    import onnx

    from kselect.core.plans.plan import reduced_nodes
    from kselect.core.precision.calibration import calibration_for
    from kselect.core.precision.mixed import mixed_plan, score_plan, with_reduced_ops

    model_path = tmp_path / "small.onnx"
    onnx.save(graphs.small_cnn(), model_path)
    folder = feeds_folder(tmp_path / "calibration")
    result = kselect.tune(str(model_path), "mlas,onednn", precision="all", calibration=folder, metric="cosine",
                          max_accuracy_drop=0.05, budget=1, settings=TUNE_QUICK, db=tmp_path / "r.db", verify=False)
    mlas, onednn = result.tunings["mlas"].precision, result.tunings["onednn"].precision
    assert mlas.front[1].name == "int8" and set(mlas.front[1].op_counts()) == {"int8"}
    # oneDNN's "bf16" point holds the ops faster in bf16 alone; on a CPU with AVX512_BF16 but no
    # AMX none may be, and then "all-bf16" (every op with a bf16 kernel) is its first bf16 point
    bf16_point = next(p for p in onednn.front if p.name in ("bf16", "all-bf16"))
    assert set(bf16_point.op_counts()) == {"bf16"}

    full_int8, all_bf16 = mlas.plans["int8"], onednn.plans[bf16_point.name]
    in_bf16 = sorted(reduced_nodes(all_bf16))[0]  # one op of oneDNN's bf16 point
    stays_fp32 = next(node for node in sorted(reduced_nodes(full_int8)) if node != in_bf16)
    entries = {t["key"]: t for t in full_int8.tasks if t.get("precision") == "int8"}
    int8 = {node: "int8" for node in reduced_nodes(full_int8) if node not in (in_bf16, stays_fp32)}
    partly_int8 = mixed_plan(mlas.plans["fp32"], {"int8": entries}, full_int8.plan_level, int8,
                             full_int8.extra["precision"])
    combined = with_reduced_ops(partly_int8, all_bf16, {in_bf16})
    precisions = reduced_nodes(combined)
    assert set(precisions.values()) == {"int8", "bf16"} and stays_fp32 not in precisions
    assert {combined.nodes[n]["library"] for n, p in precisions.items() if p == "bf16"} == {"onednn"}
    assert {combined.nodes[n]["library"] for n, p in precisions.items() if p == "int8"} == {"mlas"}
    score, drop = score_plan(result.model, combined, calibration_for(result.model, folder), None, "cosine")
    assert 0.95 < score <= 1.0 + 1e-6

    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32), dtype=np.float32)
    runner = kselect.load_plan(combined, result.model)
    try:
        output = runner.run({"input": x})[0]
    finally:
        runner.close()
    reference = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    cosine = float(output.ravel() @ reference.ravel() / (np.linalg.norm(output) * np.linalg.norm(reference)))
    assert 0.95 < cosine < 1.0 - 1e-7  # int8 and bf16 did run


@needs_bf16
def test_a_tensor_between_two_bf16_ops_is_held_in_bf16_and_every_other_in_f32(onednn):
    """small_cnn with every conv and the Gemm in bf16: a tensor that only bf16 convs read is written
    in bf16 by its producer and read as it is (no f32 copy written and read back between them); a
    tensor that an f32 op (the residual Add, the pooling) or the graph's output reads stays f32.
    The output is what writing f32 and converting it in the reader gives: within a bf16 budget of
    ONNX Runtime's fp32 output."""
    model = model_from_proto("small", graphs.small_cnn())
    plan = default_plan_in(onednn, model, lambda task: "bf16")
    x = np.random.default_rng(5).standard_normal(model.input_shapes["input"], dtype=np.float32)
    runner = kselect.load_plan(plan, model)
    try:
        output = runner.run({"input": x})[0]
        executor = runner.runners[0]
        in_bf16 = {name for name, tensor in executor.tensors.items() if tensor.memory.md.data_type == dnnl.BF16}
    finally:
        runner.close()
    # block.conv1 -> block.conv2, down -> dw, dw -> pw; stem.r is also read by the residual Add
    assert in_bf16 == {"block.conv1.r", "down.r", "dw.r"}
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = session.run(None, {"input": x})[0]
    error = float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference)))
    assert 1e-5 < error < 4 * 2.0 ** -8 * len(plan.tasks)
