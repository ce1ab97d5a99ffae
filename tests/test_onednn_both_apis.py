"""oneDNN through whichever C API generation is installed: Debian 12's 2.6.3 (``libdnnl.so.2``, the
2.x API) on x86_64, Debian 13's 3.7.2 (``libdnnl.so.3.6``, the 3.x API) in the arm64 root. Every
implementation oneDNN offers for a conv, a deconv and a fully connected op against numpy, the
executor's other ops against ONNX Runtime, the plugin's availability, version and bf16 reason on
the build, and a tune and whole-model run of resnet18 with its outputs checked against ONNX
Runtime. Part of ``make test-arm64``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import conv_reference, kselect_json, run_kselect
from test_onednn import _ops_model, _ort, _relative

from kselect.core.contract import plugins
from kselect.core.measuring import device
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task
from kselect.plugins.onednn import dnnl
from kselect.plugins.onednn import primitives as prim

_OK, _REASON = dnnl.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def onednn():
    return plugins.get_library("onednn")


def _rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)



def _every_implementation(onednn, task: Task, inputs: dict, expected: np.ndarray) -> list[str]:
    """Runs each (implementation, layout) oneDNN offers for ``task`` on all cores; returns their names."""
    offered = prim.offered(task)
    assert any(offered.values()), offered
    tried = []
    for layout, impls in offered.items():
        for name, _ in impls:
            config = {"impl": name, "threads": this_device().cores, **({"layout": layout} if layout else {})}
            candidate = onednn.prepare(task, config, inputs)
            try:
                candidate.run()
                out = candidate.output()
            finally:
                candidate.close()
            assert _relative(out, expected) < 1e-5, (config, _relative(out, expected))
            tried.append(name)
    return tried


def test_the_api_follows_the_loaded_build(onednn):
    """libdnnl.so.2 is the 2.x API, a libdnnl.so.3.x the 3.x one; `kselect plugins --json` names the
    Debian package and oneDNN's release, and labels the timings as this process runs."""
    major, minor, patch = dnnl.version()
    assert dnnl.api().__name__.endswith(f"dnnl{major}")
    assert dnnl.soname() == "libdnnl.so.2" if major == 2 else dnnl.soname().startswith("libdnnl.so.3")
    assert dnnl.debian_package() == "libdnnl" + dnnl.soname().removeprefix("libdnnl.so.")
    listed = run_kselect("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    entry = {p["name"]: p for p in json.loads(listed.stdout)}["onednn"]
    assert entry["status"].startswith("available"), entry
    assert ("(emulated)" in entry["status"]) == device.RUNS_EMULATED == entry["capabilities"]["emulated"]
    assert entry["version"].startswith(f"{dnnl.debian_package()} {major}.{minor}.{patch}")
    assert entry["version"].endswith(f"({dnnl.effective_isa()})")
    if dnnl.on_arm():  # oneDNN's own ISA query names x86 ISAs only
        assert dnnl.effective_isa() == "asimd" or dnnl.effective_isa().startswith("sve")


def test_bf16_is_offered_only_with_bf16_kernels(onednn):
    reason = prim.bf16_missing()
    assert ("bf16" in onednn.precisions) == (reason is None)
    assert onednn.missing_precisions().get("bf16") == reason
    if dnnl.on_arm() and "bf16" not in this_device().features:  # the root's default Neoverse-N1
        assert "BF16 extension" in reason


ACTIVATIONS = {"Relu": lambda y: np.maximum(y, 0), "HardSwish": lambda y: y * np.clip(y / 6 + 0.5, 0, 1)}


@pytest.mark.parametrize("groups, stride, pads, activation", [(1, 1, (1, 1, 1, 1), "Relu"),
                                                              (1, 2, (0, 1, 1, 0), "HardSwish"),
                                                              (8, 1, (1, 1, 1, 1), "Relu")])
def test_every_conv_implementation_matches_numpy(onednn, groups, stride, pads, activation):
    """Each with its activation fused as a post-op (HardSwish's parameters differ between the APIs)."""
    x, w, b = _rand(1, 8, 9, 7), _rand(16 if groups == 1 else 8, 8 // groups, 3, 3), _rand(16 if groups == 1 else 8)
    expected = ACTIVATIONS[activation](conv_reference(x, w, b, stride, pads, groups))
    attrs = {"kernel": [3, 3], "strides": [stride, stride], "pads": list(pads), "dilations": [1, 1], "group": groups}
    task = Task("conv", "0123456789abcdef", "conv", list(x.shape), list(w.shape), list(expected.shape), attrs, True,
                ["conv"], [[activation, ["x"], {}]])
    names = _every_implementation(onednn, task, {"x": x, "w": w, "b": b}, expected)
    assert any(name.startswith("ref:") for name in names)


def test_every_deconv_and_fc_implementation_matches_numpy(onednn):
    """ConvTranspose stride 2 as the convolution of the zero-stuffed input with the flipped kernel;
    Gemm (alpha, beta, transB) as numpy's product."""
    x, w, b = _rand(1, 4, 5, 6), _rand(4, 3, 3, 3), _rand(3)
    stuffed = np.zeros((1, 4, 9, 11), np.float32)
    stuffed[:, :, ::2, ::2] = x
    flipped = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    expected = conv_reference(stuffed, flipped, b, 1, (1, 1, 1, 1), 1)  # ONNX pads 1: crop 1 of the full 2
    attrs = {"kernel": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1,
             "output_padding": [0, 0]}
    deconv = Task("deconv", "0123456789abcdef", "deconv", list(x.shape), list(w.shape), list(expected.shape), attrs,
                  True, ["deconv"], [])
    _every_implementation(onednn, deconv, {"x": x, "w": w, "b": b}, expected)
    x, w, b = _rand(3, 20), _rand(7, 20), _rand(7)
    fc = Task("fc", "0123456789abcdef", "fc", [3, 20], [7, 20], [3, 7], {"alpha": 0.5, "beta": 2.0, "transB": 1},
              True, ["fc"], [])
    _every_implementation(onednn, fc, {"x": x, "w": w, "b": b}, 0.5 * (x.astype(np.float64) @ w.T) + 2.0 * b)


def test_the_executor_runs_every_op_type_like_onnx_runtime(onednn):
    """Pooling, eltwise, binary, concat, softmax, reorders and views, beside the convs and fc."""
    model = _ops_model()
    x = np.random.default_rng(0).standard_normal(model.input_shapes["x"], dtype=np.float32)
    runner = onednn.model_runner(model, None)
    try:
        out = runner({"x": x})[0]
        np.testing.assert_array_equal(out, runner({"x": x})[0])
    finally:
        runner.close()
    assert _relative(out, _ort(model, {"x": x})[0]) < 1e-4


def test_resnet18_tunes_and_its_plan_runs_with_outputs_checked(tmp_path):
    """`kselect tune resnet18 --library onednn` (a small input: emulated runs are slow), then
    `kselect bench` of the plan: its outputs match ONNX Runtime's."""
    plan_path, bench_path = tmp_path / "resnet18.onednn.plan.json", tmp_path / "bench.json"
    tuned = kselect_json("tune", "resnet18", "--input-shape", "input=1,3,64,64", "--library", "onednn",
                         "--budget", "2", "--min-time", "0.01", "--no-verify",
                         "--db", tmp_path / "records.db", "-o", plan_path, timeout=2400)
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "onednn" and tuning["tasks"]
    assert all(t["best_us"] > 0 for t in tuning["tasks"])
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) == {"onednn"}
    assert all(node["library"] == "onednn" for node in plan["nodes"].values())
    benched = run_kselect("bench", "resnet18", "--input-shape", "input=1,3,64,64", "--plan", plan_path,
                          "--rounds", "1", "--runs-per-round", "1", "--json", bench_path, timeout=1800)
    assert benched.returncode == 0, benched.stderr
    result = json.loads(bench_path.read_text())
    assert result["library"] == "onednn" and result["max_relative_output_error"] < 1e-3
    assert not math.isnan(result["plan_ms"]) and result["plan_ms"] > 0


def test_resnet18_whole_model_matches_onnxruntime(onednn):
    model = load_model("resnet18", ["input=1,3,64,64"])
    x = RNG.standard_normal((1, 3, 64, 64), dtype=np.float32)
    run = onednn.model_runner(model, None)
    try:
        out = run({"input": x})[0]
    finally:
        run.close()
    assert _relative(out, _ort(model, {"input": x})[0]) < 1e-4
