"""XNNPack int8 twins of ops followed by a SiLU or a Sigmoid, on the real library: the 8-bit
conv / fc writing the pre-activation grid, then XNNPack's 8-bit sigmoid and (SiLU) multiply,
measured against the float reference through the core for every variant; an output read on the
wrong grid found invalid; and a small conv + SiLU / Sigmoid model run by the executor with every
conv in int8, its activations in 8 bits too, against ONNX Runtime."""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from test_xnnpack_int8 import assert_matches_float_reference, variant_config

from kselect.core.contract.opkind import op_kind
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import Task, task_key
from kselect.core.plans.plan import Plan, plan_node, plan_task
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.mixed import mixed_plan
from kselect.core.precision.quant import dequantize, int8_tolerance, on_grid, quant_params, quantize
from kselect.plugins.mlas.int8 import quantized_model
from kselect.plugins.xnnpack import int8
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.int8_activation_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
SIGMOID = [["Sigmoid", ["x"], {}]]
SILU = [["Sigmoid", ["x"], {}], ["Mul", ["x", "t0"], {}]]
SILU_SWAPPED = [["Sigmoid", ["x"], {}], ["Mul", ["t0", "x"], {}]]
ACTIVATIONS = {"silu": SILU, "silu-swapped": SILU_SWAPPED, "sigmoid": SIGMOID}


def conv_task(epilogue, group=1) -> Task:
    x, w, y = [1, 32, 12, 12], [32, 32 // group, 3, 3], [1, 32, 12, 12]
    attrs = {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": group}
    signature = {"kind": "conv", "input": x, "weight": w, "output": y, "attrs": attrs, "bias": True,
                 "activation": epilogue}
    return Task("C", task_key(signature), "conv", x, w, y, attrs, True, ["c"], epilogue).at_precision("int8")


def fc_task(epilogue) -> Task:
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    signature = {"kind": "fc", "input": [4, 48], "weight": [24, 48], "output": [4, 24], "attrs": attrs, "bias": True,
                 "activation": epilogue}
    return Task("F", task_key(signature), "fc", [4, 48], [24, 48], [4, 24], attrs, True, ["f"],
                epilogue).at_precision("int8")


@pytest.fixture(scope="module")
def lib() -> XnnpackLibrary:
    return XnnpackLibrary()


def tolerance(task) -> float:
    inputs = task_inputs(task)
    reference = reference_output(task, inputs)
    return int8_tolerance(task, inputs, reference, quant_params(task, inputs, reference))


def test_which_activations_have_twins(lib):
    assert int8.activation_after(SILU) == int8.activation_after(SILU_SWAPPED) == "silu"
    assert int8.activation_after(SIGMOID) == "sigmoid"
    for epilogue in ACTIVATIONS.values():
        assert lib.supports(conv_task(epilogue)) and lib.supports(fc_task(epilogue))
    others = [[["HardSwish", ["x"], {}]], [["Sigmoid", ["x"], {}], ["Mul", ["x", "x"], {}]],
              [["Sigmoid", ["x"], {}], ["Mul", ["x", 2.0], {}]], [["Sigmoid", ["x"], {}], ["Add", ["x", "t0"], {}]],
              SILU + [["Relu", ["t1"], {}]]]
    for epilogue in others:
        assert int8.activation_after(epilogue) is None
        assert not lib.supports(conv_task(epilogue))


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("group", [1, 32])
def test_conv_with_activation_matches_float_reference(lib, name, variant, group):
    assert_matches_float_reference(lib, conv_task(ACTIVATIONS[name], group), variant)


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_fc_with_activation_matches_float_reference(lib, name, variant):
    task = fc_task(ACTIVATIONS[name])
    result = measure_in_this_process(lib, task, variant_config(lib, task, variant), QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= tolerance(task)


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_the_candidate_runs_the_kernel_and_the_activation_in_8_bits(lib, name, variant):
    """One timed run is the 8-bit conv, the 8-bit sigmoid and, for SiLU, the 8-bit multiply, each
    checked on its own grid: the conv's output within one step of the exact integer conv on the
    pre-activation grid, the sigmoid's within one step of the sigmoid of that on [0, 1) in steps of
    1/256, the multiply's within one step of their product on the output grid."""
    task = conv_task(ACTIVATIONS[name])
    inputs = task_inputs(task)
    inputs["quant"] = params = quant_params(task, inputs, reference_output(task, inputs))
    assert params.pre_scale is not None
    signed = variant != "qu8"
    candidate = lib.prepare(task, variant_config(lib, task, variant), inputs)
    try:
        built = candidate.built
        expected = [xa.QSigmoid] + ([xa.QMultiply] if name == "silu" else [])
        assert [type(op) for op in built.after] == expected
        assert [handle for _, handle, _ in built.steps] == [op.handle for op in [built.op, *built.after]]
        candidate.run()
        stages = [*built.between, built.y]
        assert all(stage.dtype == xa.int8_dtype(variant) for stage in stages)
        x = dequantize(quantize(inputs["x"], params.x_scale, params.x_zero_point), params.x_scale, params.x_zero_point)
        per_channel = variant == "qc8"
        w = params.quantized_weights(inputs["w"], per_channel) * params.weight_scales(inputs["w"], per_channel)
        exact = op_kind("conv").reference(task, {**inputs, "x": x, "w": w}).transpose(0, 2, 3, 1)
        pre = dequantize(stages[0], params.pre_scale, params.pre_zero_point, signed).astype(np.float64)
        assert np.max(np.abs(pre - on_grid(exact, params.pre_scale, params.pre_zero_point))) <= params.pre_scale * 1.001
        sigmoid = dequantize(stages[1], 1 / 256, 0, signed).astype(np.float64)
        assert np.max(np.abs(sigmoid - on_grid(1 / (1 + np.exp(-pre)), 1 / 256, 0))) <= 1 / 256
        if name == "silu":
            y = dequantize(stages[2], params.y_scale, params.y_zero_point, signed).astype(np.float64)
            product = on_grid(pre * sigmoid, params.y_scale, params.y_zero_point)
            assert np.max(np.abs(y - product)) <= params.y_scale * 1.001
        else:
            assert np.array_equal(candidate.output(), sigmoid.transpose(0, 3, 1, 2).astype(np.float32))
    finally:
        candidate.close()


@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_output_read_with_a_wrong_zero_point_is_invalid(lib, name):
    """The same operators, the result read with a zero point 16 steps off: the core's int8
    tolerance finds it invalid, so it could never be selected."""

    class WrongZeroPoint(XnnpackLibrary):
        def prepare(self, task, config, inputs):
            candidate = int8.prepare(task, config, inputs)
            candidate.y_zero_point += np.float32(16)
            return candidate

    task = conv_task(ACTIVATIONS[name])
    for variant in int8.VARIANTS:
        config = variant_config(lib, task, variant)
        assert measure_in_this_process(lib, task, config, QUICK, {}).status == "ok"
        result = measure_in_this_process(WrongZeroPoint(), task, config, QUICK, {})
        assert result.status == "invalid", (variant, result)
        assert result.error > tolerance(task)


# -- whole model ------------------------------------------------------------------------------
def _silu_model(seed: int = 0) -> onnx.ModelProto:
    """x -> conv -> SiLU -> conv -> SiLU (Mul operands swapped) -> 1x1 conv -> Sigmoid -> y."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(name, x, cin, cout, k):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.out"], name=name,
                                      kernel_shape=[k, k], pads=[k // 2] * 4))
        return f"{name}.out"

    a = conv("conv1", "x", 8, 16, 3)
    nodes += [helper.make_node("Sigmoid", [a], ["s1"], name="sig1"),
              helper.make_node("Mul", [a, "s1"], ["m1"], name="mul1")]
    b = conv("conv2", "m1", 16, 16, 3)
    nodes += [helper.make_node("Sigmoid", [b], ["s2"], name="sig2"),
              helper.make_node("Mul", ["s2", b], ["m2"], name="mul2")]
    c = conv("conv3", "m2", 16, 8, 1)
    nodes.append(helper.make_node("Sigmoid", [c], ["y"], name="sig3"))
    return graphs.model(nodes, inits, (1, 8, 10, 10), output_shapes=[[1, 8, 10, 10]], opset=13, name="silu")


def _plans(model, library, ranges, variant: str | None = None,
           twin_kinds: tuple = ("conv", "conv", "conv")) -> tuple[Plan, Plan]:
    """(fp32 plan of XNNPack's defaults, that plan with every int8 twin in int8 at ``variant``, or
    at the twin's own default config when None), as core/precision/mixed.py builds them. ``twin_kinds``: the
    kinds of the twins the model must have, one per fp32 task."""
    device = this_device()
    tasks = library_tasks(model, library, ("fp32", "int8"))
    fp32 = [t for t in tasks if t.precision == "fp32"]
    twins = [t for t in tasks if t.precision == "int8"]
    assert sorted(t.kind for t in twins) == sorted(twin_kinds) and len(fp32) == len(twin_kinds)
    entries, nodes = [], {}
    for task in fp32:
        config = library.default_config(task, device)
        entries.append(plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False))
        nodes.update({node: plan_node(task, "xnnpack", config) for node in task.nodes})
    level = {k: v for t in fp32 for k, v in library.default_config(t, device).items() if k in library.plan_level_dims}
    fp32_plan = Plan(model={"name": model.name}, device=device.to_json(), libraries={"xnnpack": library.version()},
                     emulated=False, plan_level=level, tasks=entries, nodes=nodes)
    int8_entries = {}
    for task in twins:
        config = library.default_config(task, device) if variant is None else variant_config(library, task, variant)
        int8_entries[task.key] = plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False)
    plan = mixed_plan(fp32_plan, {"int8": int8_entries}, dict(level), {n: "int8" for t in twins for n in t.nodes},
                      {"ranges": ranges, "metric": "cosine", "max_drop": 0.01})
    return fp32_plan, plan


SIGMOID_STEP = 1 / 256  # the 8-bit sigmoid's output step: the model output's grid
OUTPUT_STEPS = 4


@pytest.mark.parametrize("variant", int8.VARIANTS)
def test_int8_plan_runs_silu_and_sigmoid_in_8_bits_and_matches_onnxruntime(variant):
    """Every conv in int8: the executor runs each SiLU / Sigmoid after it on XNNPack's 8-bit
    operators (no float sigmoid or multiply, no tensor between them dequantized). On the feeds
    the ranges were calibrated on, the output is within 4 output steps of ONNX Runtime's float
    output; on held-out feeds (values past the calibrated ranges clip, as in any static
    quantization) within 4 steps of ONNX Runtime's QDQ model of the same int8 nodes and ranges,
    and no farther from the float output than that model is, give or take 2 steps."""
    library = XnnpackLibrary()
    model = model_from_proto("silu", _silu_model())
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 8, 10, 10)).astype(np.float32)} for _ in range(12)]
    calibration = calibration_for(model, feeds)
    ranges = compute_ranges(model, calibration)
    fp32_plan, plan = _plans(model, library, ranges, variant)  # SiLU, SiLU and Sigmoid: each conv has its twin
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    qdq = ort.InferenceSession(quantized_model(model, plan).SerializeToString(), providers=["CPUExecutionProvider"])
    runner = library.model_runner(model, plan)
    try:
        assert runner.int8_nodes == {"conv1", "conv2", "conv3"}
        assert set(runner.int8_activations) == {"sig1", "mul1", "sig2", "mul2", "sig3"}
        kinds = [type(op) for op in runner._ops]
        assert kinds.count(xa.QSigmoid) == 3 and kinds.count(xa.QMultiply) == 2
        assert xa.Unary not in kinds and xa.Binary not in kinds
        for tensor in ("conv1.out", "s1", "m1", "conv2.out", "s2", "m2", "conv3.out"):
            assert runner.tensors[tensor].array is None, f"{tensor} was dequantized"
        for feed in calibration.calibrate:
            error = np.max(np.abs(runner(feed)[0] - session.run(None, feed)[0]))
            assert 0 < error <= OUTPUT_STEPS * SIGMOID_STEP, error
        for feed in calibration.held_out:
            ours, theirs, reference = runner(feed)[0], qdq.run(None, feed)[0], session.run(None, feed)[0]
            assert np.max(np.abs(ours - theirs)) <= OUTPUT_STEPS * SIGMOID_STEP
            assert np.max(np.abs(ours - reference)) <= np.max(np.abs(theirs - reference)) + 2 * SIGMOID_STEP
    finally:
        runner.close()
    fp32_runner = library.model_runner(model, fp32_plan)  # the same model in float: ONNX Runtime's output
    try:
        feed = calibration.held_out[0]
        np.testing.assert_allclose(fp32_runner(feed)[0], session.run(None, feed)[0], atol=1e-5)
    finally:
        fp32_runner.close()
