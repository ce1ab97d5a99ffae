"""XNNPack's public operator API on whichever build is installed: Debian 12's (``libXNNPACK.so.0``,
the 2022 API) on x86_64, Debian 13's (``libXNNPACK.so.0.20241108``, the 2024 API: reshape before
setup) in the arm64 root. Every f32 operator the plugin creates against numpy; fp16 candidates
(the f16 operators between their conversions) within the core's half tolerance and int8 ones
(qc8 / qs8 / qu8) within its int8 tolerance; the plugin's availability, precisions and space on
the build; a tune and whole-model run of resnet18 with its outputs checked against ONNX Runtime,
and (slow: the arm64 subset) a tune of resnet18 with every precision whose plan runs. Part of
``make test-arm64``."""

from __future__ import annotations

import json
import math
import platform

import numpy as np
import pytest
from helpers import (
    assert_fp16_default_within_half_tolerance,
    conv_reference,
    kselect_json,
    plan_and_onnxruntime_outputs,
    run_kselect,
    tune_resnet18_in_every_precision,
    twin_conv,
    twin_task,
)

import kselect
from kselect.core.measuring import device
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.plans.plan import Plan, load_plan_file, plan_node, plan_task
from kselect.core.precision.quant import int8_tolerance, quant_params
from kselect.plugins.xnnpack import int8, kernels
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

RNG = np.random.default_rng(0)


def _rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)



def _close(actual, expected, tolerance=1e-4):
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    assert float(np.max(np.abs(np.asarray(actual, np.float64) - expected))) / scale < tolerance


def test_the_api_follows_the_loaded_build():
    """Debian 12's soname is the 2022 API, Debian 13's the 2024 one; `kselect plugins --json` names
    the package and labels the timings as this process runs."""
    loaded = xa.lib()
    assert (loaded.soname, loaded.package, loaded.api) in {
        (xa.LIBXNNPACK, xa.DEBIAN_PACKAGE, xa.API_2022), (xa.LIBXNNPACK_2024, xa.DEBIAN_PACKAGE_2024, xa.API_2024)}
    listed = run_kselect("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    entry = {p["name"]: p for p in json.loads(listed.stdout)}["xnnpack"]
    assert entry["status"].startswith("available"), entry
    assert entry["version"].startswith(f"{loaded.package} ")
    assert entry["capabilities"]["emulated"] == device.RUNS_EMULATED
    assert ("(emulated)" in entry["status"]) == device.RUNS_EMULATED


@pytest.mark.parametrize("groups, stride, pads", [(1, 1, (1, 1, 1, 1)), (1, 2, (0, 1, 1, 0)), (8, 1, (1, 1, 1, 1))])
def test_convolution_nhwc(groups, stride, pads):
    x, w, bias = _rand(2, 8, 9, 7), _rand(16 if groups == 1 else 8, 8 // groups, 3, 3), _rand(16 if groups == 1 else 8)
    expected = np.maximum(conv_reference(x, w, bias, stride, pads, groups), 0)
    with xa.Convolution2DNHWC(w, bias, stride=stride, padding=pads, groups=groups, depthwise_flag=groups > 1,
                              output_min=0.0) as conv:
        out = conv.run(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
        out_again = conv.run(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))  # bound anew to new arrays
    _close(out.transpose(0, 3, 1, 2), expected)
    np.testing.assert_array_equal(out, out_again)


def test_convolution_nchw_depthwise():
    x, w, bias = _rand(1, 8, 10, 10), _rand(8, 1, 3, 3), _rand(8)
    with xa.Convolution2DNCHW(w, bias, padding=1, groups=8, depthwise_flag=True) as conv:
        _close(conv.run(x), conv_reference(x, w, bias, 1, (1, 1, 1, 1), 8))


def test_deconvolution():
    """ConvTranspose stride 2 as the convolution of the zero-stuffed input with the flipped kernel."""
    x, w, bias = _rand(1, 4, 5, 6), _rand(4, 3, 3, 3), _rand(3)
    stuffed = np.zeros((1, 4, 9, 11), np.float32)
    stuffed[:, :, ::2, ::2] = x
    flipped = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    expected = conv_reference(stuffed, flipped, bias, 1, (1, 1, 1, 1), 1)  # ONNX pads 1: crop 1 of the full 2
    with xa.Deconvolution2DNHWC(w, bias, stride=2, padding=1) as deconv:
        out = deconv.run(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    _close(out.transpose(0, 3, 1, 2), expected)


def test_fully_connected():
    x, w, bias = _rand(3, 20), _rand(7, 20), _rand(7)
    with xa.FullyConnected(w, bias, output_max=1.0) as fc:
        _close(fc.run(x), np.minimum(x.astype(np.float64) @ w.T + bias, 1.0))


def test_pooling():
    x = _rand(2, 7, 9, 5)  # NHWC
    with xa.MaxPooling2D(5, 3, stride=2, padding=1) as pool:
        padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
        expected = np.stack([np.stack([padded[:, i:i + 3, j:j + 3].max(axis=(1, 2)) for j in range(0, 9, 2)], 1)
                             for i in range(0, 7, 2)], 1)
        _close(pool.run(x), expected)
    with xa.AveragePooling2D(5, 2, stride=2) as pool:
        _close(pool.run(x), x[:, :6, :8].reshape(2, 3, 2, 4, 2, 5).mean(axis=(2, 4)))
    with xa.GlobalAveragePooling(5) as pool:
        _close(pool.run(x), x.astype(np.float64).mean(axis=(1, 2)))
        one_pixel = x[:, :1, :1].copy()  # a window of one pixel, then a wider one again
        _close(pool.run(one_pixel), one_pixel[:, 0, 0])
        _close(pool.run(x[:, :3].copy()), x[:, :3].astype(np.float64).mean(axis=(1, 2)))


def test_elementwise():
    a, b = _rand(2, 3, 4, 6), _rand(6)
    with xa.Binary("add", output_min=0.0, output_max=1.0) as add:
        _close(add.run(a, b), np.clip(a.astype(np.float64) + b, 0.0, 1.0))
    for kind, expected in (("multiply", a * b), ("maximum", np.maximum(a, b)), ("subtract", a - b)):
        with xa.Binary(kind) as op:
            _close(op.run(a, b), expected)
    with xa.Clamp(6, 0.0, 6.0) as clamp:
        _close(clamp.run(a * 4), np.clip(a * 4, 0.0, 6.0))
    unary = {"sigmoid": (None, 1 / (1 + np.exp(-a.astype(np.float64)))),
             "hardswish": (None, a * np.clip(a + 3, 0, 6) / 6),
             "leaky_relu": (0.1, np.where(a < 0, 0.1 * a, a)),
             "elu": (1.0, np.where(a < 0, np.expm1(a.astype(np.float64)), a))}
    for kind, (param, expected) in unary.items():
        with xa.Unary(kind, 6, param) as op:
            _close(op.run(a), expected, 1e-3)
    with xa.Softmax(6) as softmax:
        e = np.exp(a.astype(np.float64) - a.max(axis=-1, keepdims=True))
        _close(softmax.run(a), e / e.sum(axis=-1, keepdims=True))
    with xa.PReLU(b) as prelu:
        _close(prelu.run(a), np.where(a < 0, a * b, a))


def test_resize_and_concatenate():
    x = _rand(1, 4, 5, 3)
    with xa.ResizeBilinear(3, (8, 10), align_corners=True) as resize:
        out = resize.run(x)
    assert out.shape == (1, 8, 10, 3)
    np.testing.assert_allclose(out[0, [0, -1]][:, [0, -1]], x[0, [0, -1]][:, [0, -1]], rtol=1e-5, atol=1e-6)
    parts = [_rand(2, 3, 4), _rand(2, 5, 4)]
    with xa.Concatenate([p.shape for p in parts], 1) as concat:
        np.testing.assert_array_equal(concat.run(parts), np.concatenate(parts, 1))


def test_micro_kernel_choice_only_on_the_known_build_and_precisions_as_bound():
    """The micro-kernel choice is offered on the described builds (Debian 12's amd64 one, f32 GEMM /
    IGEMM on Debian 13's arm64 one); any other build keeps the public API (threads, the NCHW path)
    with its one-line notice."""
    lib = XnnpackLibrary()
    ok, status = lib.availability()
    assert ok and "\n" not in status
    task = Task("T", "0123456789abcdef", "conv", [1, 16, 9, 9], [16, 16, 3, 3], [1, 16, 9, 9],
                {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}, True,
                ["n"])
    dims = [d.name for d in lib.space(task, this_device()).dims]
    assert "threads" in dims
    if "override off" in status:
        assert "public API only" in status and "ukernel" not in dims
    assert "int8" in lib.precisions and ("fp16" in lib.precisions) == xa.f16_availability()[0]
    if xa.api() == xa.API_2024:  # its 8-bit operators between float ones; the add and pooling ops in float
        assert "int8: qc8 / qs8 / qu8 operators" in status
        if "override off" not in status:  # the arm64 build: f32 GEMM / IGEMM kernels only
            assert platform.machine() == "aarch64" and "ukernel" in dims
            assert "no 8-bit micro-kernel override (described for the 2022 amd64 build only)" in status
        assert lib.int8_passes == frozenset({"Flatten"})


QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
_CONV3X3 = ([1, 16, 8, 8], [24, 16, 3, 3], [1, 24, 8, 8], 3)
_FC = ([4, 64], [20, 64], [4, 20], {"alpha": 1.0, "beta": 1.0, "transB": 1})


@pytest.mark.skipif(not xa.f16_availability()[0], reason=f"no fp16 here: {xa.f16_availability()[1]}")
@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_fp16_candidates_within_the_half_tolerance(kind):
    """The fp16 twin of a 3x3 conv and of an fc, on the build's f16 operator between the f32 -> f16
    and f16 -> f32 conversions: measured ok against the float64 reference, off by more than
    float32's rounding (it computes in half) and within the core's half tolerance for kernels
    that round their sums to half."""
    task = twin_conv("fp16", *_CONV3X3) if kind == "conv" else twin_task("fp16", "fc", *_FC)
    assert_fp16_default_within_half_tolerance(XnnpackLibrary(), task, QUICK)


@pytest.mark.parametrize("kind, variant", [("conv", "qc8"), ("conv", "qs8"), ("conv", "qu8"), ("fc", "qs8"),
                                           ("fc", "qu8")])
def test_int8_candidates_within_the_int8_tolerance(kind, variant):
    """The int8 twin of a 3x3 conv (qc8: per-channel int8 weights; qs8; qu8) and of an fc (qs8,
    qu8) on the build's 8-bit operators, its input quantized as the core says: measured ok
    against the float64 reference within the core's int8 tolerance."""
    task = twin_conv("int8", *_CONV3X3) if kind == "conv" else twin_task("int8", "fc", *_FC)
    lib = XnnpackLibrary()
    assert lib.supports(task) and variant in int8.variants(task)
    inputs = task_inputs(task)
    reference = reference_output(task, inputs)
    config = dict(lib.default_config(task, this_device()), variant=variant)
    if "ukernel" in config:  # the micro-kernel choice (the 2022 amd64 build): the variant's own default
        config["ukernel"] = kernels.int8_default_kernel(variant, int8.op_class(task), kernels.gemm_rows(task),
                                                        int8._taps(task))
    assert config in lib.space(task, this_device())
    result = measure_in_this_process(lib, task, config, QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= int8_tolerance(task, inputs, reference, quant_params(task, inputs, reference))


def test_resnet18_tunes_and_its_plan_runs_with_outputs_checked(tmp_path):
    """`kselect tune resnet18 --library xnnpack` (a small input: emulated runs are slow), then
    `kselect bench` of the plan: its outputs match ONNX Runtime's."""
    plan_path, bench_path = tmp_path / "resnet18.xnnpack.plan.json", tmp_path / "bench.json"
    tuned = kselect_json("tune", "resnet18", "--input-shape", "input=1,3,64,64", "--library", "xnnpack",
                         "--budget", "2", "--min-time", "0.01", "--no-verify",
                         "--db", tmp_path / "records.db", "-o", plan_path, timeout=1800)
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "xnnpack" and tuning["tasks"]
    assert all(t["best_us"] > 0 for t in tuning["tasks"])
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) == {"xnnpack"}
    benched = run_kselect("bench", "resnet18", "--input-shape", "input=1,3,64,64", "--plan", plan_path,
                          "--rounds", "1", "--runs-per-round", "1", "--json", bench_path, timeout=1800)
    assert benched.returncode == 0, benched.stderr
    result = json.loads(bench_path.read_text())
    assert result["library"] == "xnnpack" and result["max_relative_output_error"] < 1e-3
    assert not math.isnan(result["plan_ms"]) and result["plan_ms"] > 0


def test_resnet18_whole_model_matches_onnxruntime():
    import onnxruntime as ort

    model = load_model("resnet18", ["input=1,3,64,64"])
    x = RNG.standard_normal((1, 3, 64, 64), dtype=np.float32)
    expected = ort.InferenceSession(model.proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    run = XnnpackLibrary().model_runner(model, None)
    try:
        out = run({"input": x})[0]
        np.testing.assert_array_equal(out, run({"input": x})[0])  # buffers reused between runs
    finally:
        run.close()
    _close(out, expected, 1e-4)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.skipif(not xa.f16_availability()[0], reason=f"no fp16 here: {xa.f16_availability()[1]}")
def test_resnet18_plan_in_fp16_runs_in_the_whole_model():
    """A plan of resnet18 (1x3x32x32) with every conv and the fc in fp16: the whole-model runner
    runs them on the f16 operators between their conversions, and the output is ONNX Runtime's
    fp32 one up to half precision (not equal to it: f16 did run)."""
    import onnxruntime as ort

    model = load_model("resnet18", ["input=1,3,32,32"])
    lib, here = XnnpackLibrary(), this_device()
    tasks, nodes = [], {}
    for task in extract_tasks(model):
        twin = task.at_precision("fp16")
        config = lib.default_config(twin, here)
        tasks.append(plan_task(twin, twin.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False))
        nodes.update({node: plan_node(twin, "xnnpack", config) for node in twin.nodes})
    plan_level = {"spinning": 1} if any("spinning" in n["config"] for n in nodes.values()) else {}
    plan = Plan(model={}, device={}, libraries={"xnnpack": lib.version()}, emulated=lib.emulated,
                plan_level=plan_level, tasks=tasks, nodes=nodes)
    x = RNG.standard_normal((1, 3, 32, 32), dtype=np.float32)
    runner = kselect.load_plan(plan, model)
    try:
        output = runner.run({"input": x})[0]
        assert runner.runners[0].fp16_nodes == set(nodes)
    finally:
        runner.close()
    reference = ort.InferenceSession(model.proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    error = float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference)))
    assert 1e-5 < error < 0.05 and _cosine(output, reference) > 0.999


@pytest.mark.slow
def test_resnet18_tunes_every_precision_and_its_plan_runs(tmp_path):
    """`kselect tune resnet18 --precision all` (1x3x32x32, synthetic feeds, cosine budget 0.01):
    every conv / fc task's int8 twin is measured, and its fp16 twin where XNNPack has f16 kernels
    here (bf16 named missing); the precision search measures its front in the whole model and
    chooses a point within the budget; the plan stores each op's precision and runs through
    kselect.load_plan, its output within the budget of ONNX Runtime's fp32 one. Slow (minutes
    emulated): in the arm64 subset and `make test-all`."""
    twins = {"int8"} | ({"fp16"} if xa.f16_availability()[0] else set())
    _, chosen, out = tune_resnet18_in_every_precision("xnnpack", tmp_path, twins)
    plan = load_plan_file(out)
    planned = {node: t.get("precision", "fp32") for t in plan.tasks for node in t["nodes"]}
    assert {node: p for node, p in planned.items() if p != "fp32"} == chosen["precisions"]

    model = load_model("resnet18", ["input=1,3,32,32"])
    x = RNG.standard_normal((1, 3, 32, 32), dtype=np.float32)
    output, reference = plan_and_onnxruntime_outputs(out, model, {"input": x})
    assert _cosine(output, reference) >= 1 - 0.01
