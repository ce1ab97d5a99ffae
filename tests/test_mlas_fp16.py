"""MLAS's fp16: ONNX Runtime's float16 kernels as candidates where it has them (arm64 with FP16
arithmetic: in the arm64 root, ``make test-arm64``), and named missing with why where it has
none (x86_64: ONNX Runtime wraps a float16 Conv in casts to the fp32 kernel). The rewrite that
puts a plan's fp16 ops in float16 runs on every machine."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import (
    assert_fp16_default_within_half_tolerance,
    default_plan_in,
    kselect_json,
    plan_and_onnxruntime_outputs,
    tune_resnet18_in_every_precision,
    twin_conv,
    twin_task,
)
from onnx import TensorProto, helper, numpy_helper

from kselect.core.measuring.measure import MeasureSettings
from kselect.core.models.model import load_model
from kselect.core.precision.half import UNIT_ROUNDOFF
from kselect.plugins.mlas import half
from kselect.plugins.mlas.library import MlasLibrary

FP16_HERE, FP16_WHY = half.available()
needs_fp16 = pytest.mark.skipif(not FP16_HERE, reason=f"no fp16 here: {FP16_WHY}")
RNG = np.random.default_rng(0)
QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=120)


def _conv_relu_conv_add() -> onnx.ModelProto:
    """x -> conv a -> relu -> conv b -> add(relu's output) -> y: the second conv's input is read by a
    float op too."""
    w = lambda name: numpy_helper.from_array((RNG.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32), name)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu_a"),
             helper.make_node("Conv", ["r", "wb"], ["b"], name="conv_b", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["b", "r"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [w("wa"), w("wb")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_to_half_casts_only_at_the_edges_of_the_fp16_region():
    """conv_a and its Relu in float16: x cast in once, their weights stored in half, the Relu's output
    cast back once for the float conv and add that read it; the model computes the fp32 output up to
    half precision, on any CPU (ONNX Runtime adds its own casts where it has no fp16 kernel)."""
    proto = _conv_relu_conv_add()
    halved = half.to_half(proto, {"conv_a", "relu_a"})
    onnx.checker.check_model(halved)
    casts = [(n.input[0], n.output[0]) for n in halved.graph.node if n.op_type == "Cast"]
    assert casts == [("x", "x.fp16"), ("r.fp16", "r")]
    types = {t.name: t.data_type for t in halved.graph.initializer}
    assert types["wa.fp16"] == TensorProto.FLOAT16 and types["wb"] == TensorProto.FLOAT
    conv_a = next(n for n in halved.graph.node if n.name == "conv_a")
    assert list(conv_a.input) == ["x.fp16", "wa.fp16"] and list(conv_a.output) == ["a.fp16"]

    x = RNG.standard_normal((1, 8, 12, 12)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    exact, reduced = run(proto), run(halved)
    error = float(np.max(np.abs(reduced - exact)) / np.max(np.abs(exact)))
    assert 1e-5 < error < 16 * UNIT_ROUNDOFF["fp16"]


@pytest.mark.skipif(FP16_HERE, reason="ONNX Runtime has fp16 kernels here")
def test_space_names_why_mlas_has_no_fp16_here(tmp_path):
    """On x86_64 ONNX Runtime runs a float16 conv through casts to fp32: `kselect space` says so and
    the library offers no fp16 twin."""
    listed = kselect_json("space", "resnet18", "--input-shape", "input=1,3,32,32", "--library", "mlas")
    why = listed["missing_precisions"]["fp16"]
    assert "Cast + fp32 Conv" in why and "\n" not in why
    assert "bf16" in listed["missing_precisions"]
    library = MlasLibrary()
    assert "fp16" not in library.precisions
    assert not library.supports(twin_conv("fp16", [1, 16, 8, 8], [24, 16, 3, 3], [1, 24, 8, 8], 3))


@needs_fp16
@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_fp16_candidates_within_the_half_tolerance(kind):
    """The fp16 twin of a 3x3 conv with its Relu and of an fc on ONNX Runtime's float16 kernels (no cast
    inserted): measured ok against the float64 reference, off by more than fp32's rounding (it
    computes in half) and within the half tolerance of kernels that accumulate in half."""
    if kind not in half.kinds_with_kernels():
        pytest.skip(f"ONNX Runtime has no fp16 {kind} kernel here")
    if kind == "conv":
        task = twin_conv("fp16", [1, 16, 8, 8], [24, 16, 3, 3], [1, 24, 8, 8], 3, epilogue=[["Relu", ["x"], {}]])
    else:
        task = twin_task("fp16", "fc", [4, 64], [20, 64], [4, 20], {"alpha": 1.0, "beta": 1.0, "transB": 1})
    assert_fp16_default_within_half_tolerance(MlasLibrary(), task, QUICK)


@needs_fp16
def test_resnet18_plan_in_fp16_runs_through_load_plan_and_its_export(tmp_path):
    """A plan of resnet18 (1x3x32x32) with every task ONNX Runtime runs in float16 as an fp16 twin:
    kselect.load_plan runs it, the output is ONNX Runtime's fp32 one up to half precision (not
    equal to it: fp16 did run), and its export, loaded by plain ONNX Runtime, holds those convs in
    float16 and gives the same output."""
    from kselect.plugins.mlas.apply import load_session

    model = load_model("resnet18", ["input=1,3,32,32"])
    library = MlasLibrary()
    plan = default_plan_in(library, model, lambda task: "fp16" if library.supports(task.at_precision("fp16"))
                           else "fp32")
    fp16_nodes = {node for t in plan.tasks if t.get("precision") == "fp16" for node in t["nodes"]}
    assert fp16_nodes
    x = RNG.standard_normal((1, 3, 32, 32), dtype=np.float32)
    output, reference = plan_and_onnxruntime_outputs(plan, model, {"input": x})
    error = float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference)))
    cosine = float(output.ravel() @ reference.ravel() / (np.linalg.norm(output) * np.linalg.norm(reference)))
    assert 1e-5 < error < 0.05 and cosine > 0.999

    model_path, options_path = library.apply(plan, model, tmp_path, "resnet18")
    exported = onnx.load(model_path)
    in_half = {n.name for n in exported.graph.node
               if n.name in fp16_nodes and all(name.endswith(half.HALF_SUFFIX) for name in n.input if name)}
    assert in_half == fp16_nodes
    session = load_session(model_path, options_path)
    np.testing.assert_allclose(session.run(None, {"input": x})[0], output, rtol=0, atol=1e-6)


@needs_fp16
@pytest.mark.slow
def test_resnet18_tunes_every_precision_and_its_plan_runs(tmp_path):
    """`kselect tune resnet18 --library mlas --precision all` (1x3x32x32, synthetic feeds, cosine
    budget 0.01) where ONNX Runtime has fp16 kernels: every conv / fc task's fp16 and int8 twins are
    measured (bf16 named missing); the plan stores each op's precision as the chosen front point
    says and runs through kselect.load_plan within the budget of ONNX Runtime's fp32 output. Slow
    (minutes emulated): in the arm64 subset and `make test-all`."""
    _, chosen, out = tune_resnet18_in_every_precision("mlas", tmp_path, {"fp16", "int8"})
    plan = json.loads(out.read_text())
    planned = {node: t.get("precision", "fp32") for t in plan["tasks"] for node in t["nodes"]}
    assert {node: p for node, p in planned.items() if p != "fp32"} == chosen["precisions"]
    model = load_model("resnet18", ["input=1,3,32,32"])
    x = RNG.standard_normal((1, 3, 32, 32), dtype=np.float32)
    output, reference = plan_and_onnxruntime_outputs(out, model, {"input": x})
    cosine = float(output.ravel() @ reference.ravel() / (np.linalg.norm(output) * np.linalg.norm(reference)))
    assert cosine >= 1 - 0.01
