"""XNNPack int8 twins of ops followed by a LeakyRelu, on the real library: the 8-bit conv / fc
writing the pre-activation grid, then XNNPack's 8-bit leaky relu (a lookup table; qu8 only in
this build, so such an op's only variant is qu8), measured against the float reference through
the core; and a small conv + LeakyRelu model (waifu2x's shape) run by the executor with every
conv in int8, its LeakyRelus in 8 bits too, against ONNX Runtime's QDQ model of the same ranges."""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from test_xnnpack_int8_activations import _plans, conv_task, fc_task, tolerance

from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.model import model_from_proto
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.quant import dequantize, on_grid, quant_params
from kselect.plugins.mlas.int8 import quantized_model
from kselect.plugins.xnnpack import configured, int8, kernels
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.int8_leaky_relu_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)


def leaky(alpha: float) -> list:
    return [["LeakyRelu", ["x"], {"alpha": alpha}]]


@pytest.fixture(scope="module")
def lib() -> XnnpackLibrary:
    return XnnpackLibrary()


def test_a_leaky_relu_twin_is_qu8_only(lib):
    """The slopes the 8-bit operator takes (0 < alpha <= 1) give a twin whose space holds qu8
    alone, with only the qu8 family's micro-kernels; other slopes give none."""
    device = this_device()
    task = conv_task(leaky(0.1))
    assert int8.activation_after(task.epilogue) == "leaky_relu"
    assert lib.supports(task)
    configs = list(lib.space(task, device).enumerate())
    assert {c["variant"] for c in configs} == {"qu8"}
    if kernels.int8_override_status()[0]:
        assert {kernels.int8_family(c["ukernel"]) for c in configs} == {"qu8"}
    assert lib.default_config(task, device)["variant"] == "qu8"
    with pytest.raises(configured.ConfigError, match="qc8"):
        int8.config_variant({"variant": "qc8"}, task)
    for alpha in (0.0, 1.5):
        assert int8.activation_after(leaky(alpha)) is None
        assert not lib.supports(conv_task(leaky(alpha)))


@pytest.mark.parametrize("group", [1, 32])
@pytest.mark.parametrize("alpha", [0.1, 0.01])
def test_conv_with_leaky_relu_matches_float_reference(lib, alpha, group):
    task = conv_task(leaky(alpha), group)
    config = lib.default_config(task, this_device())
    result = measure_in_this_process(lib, task, config, QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= tolerance(task)


def test_fc_with_leaky_relu_matches_float_reference(lib):
    task = fc_task(leaky(0.2))
    result = measure_in_this_process(lib, task, lib.default_config(task, this_device()), QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= tolerance(task)


def test_the_candidate_runs_the_kernel_and_the_leaky_relu_in_8_bits(lib):
    """One timed run is the 8-bit conv, then the 8-bit leaky relu: the conv writes the
    pre-activation grid, and the leaky relu's output is, within one step, the leaky relu of that
    rounded onto the output grid (its lookup table is exact)."""
    task = conv_task(leaky(0.1))
    inputs = task_inputs(task)
    inputs["quant"] = params = quant_params(task, inputs, reference_output(task, inputs))
    assert params.pre_scale is not None
    candidate = lib.prepare(task, lib.default_config(task, this_device()), inputs)
    try:
        built = candidate.built
        assert [type(op) for op in built.after] == [xa.QLeakyRelu]
        assert [handle for _, handle, _ in built.steps] == [op.handle for op in [built.op, *built.after]]
        candidate.run()
        pre_q, y_q = built.between[0], built.y
        assert pre_q.dtype == y_q.dtype == np.uint8
        pre = dequantize(pre_q, params.pre_scale, params.pre_zero_point).astype(np.float64)
        y = dequantize(y_q, params.y_scale, params.y_zero_point).astype(np.float64)
        expected = on_grid(np.where(pre >= 0, pre, 0.1 * pre), params.y_scale, params.y_zero_point)
        assert np.max(np.abs(y - expected)) <= params.y_scale * 1.001
        assert np.array_equal(candidate.output(), y.transpose(0, 3, 1, 2).astype(np.float32))
    finally:
        candidate.close()


# -- whole model ------------------------------------------------------------------------------
def _leaky_model(seed: int = 0) -> onnx.ModelProto:
    """x -> conv -> LeakyRelu(0.1) -> conv -> LeakyRelu(0.1) -> conv -> y, as waifu2x's models."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(name, x, cin, cout):
        w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.out"], name=name,
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        return f"{name}.out"

    a = conv("conv1", "x", 3, 16)
    nodes.append(helper.make_node("LeakyRelu", [a], ["l1"], name="leaky1", alpha=0.1))
    b = conv("conv2", "l1", 16, 16)
    nodes.append(helper.make_node("LeakyRelu", [b], ["l2"], name="leaky2", alpha=0.1))
    conv("conv3", "l2", 16, 3)
    return graphs.model(nodes, inits, (1, 3, 12, 12), outputs=["conv3.out"], output_shapes=[[1, 3, 12, 12]], opset=13,
                        name="leaky")


OUTPUT_STEPS = 4


def test_int8_plan_runs_leaky_relu_in_8_bits_and_matches_onnxruntime_qdq():
    """Every conv in int8 (qu8): the executor runs each LeakyRelu on XNNPack's 8-bit leaky relu
    (no float leaky relu, no tensor between the convs dequantized); on held-out feeds the output
    is within 4 output steps of ONNX Runtime's QDQ model of the same int8 nodes and ranges, and
    close to the float model."""
    library = XnnpackLibrary()
    model = model_from_proto("leaky", _leaky_model())
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(12)]
    calibration = calibration_for(model, feeds)
    ranges = compute_ranges(model, calibration)
    _, plan = _plans(model, library, ranges, "qu8")
    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    qdq = ort.InferenceSession(quantized_model(model, plan).SerializeToString(), providers=["CPUExecutionProvider"])
    references = [session.run(None, feed)[0] for feed in calibration.held_out]
    step = (max(max(r.max() for r in references), 0.0) - min(min(r.min() for r in references), 0.0)) / 255.0
    runner = library.model_runner(model, plan)
    try:
        assert runner.int8_nodes == {"conv1", "conv2", "conv3"}
        assert set(runner.int8_activations) == {"leaky1", "leaky2"}
        kinds = [type(op) for op in runner._ops]
        assert kinds.count(xa.QLeakyRelu) == 2 and xa.Unary not in kinds
        for tensor in ("conv1.out", "l1", "conv2.out", "l2"):
            assert runner.tensors[tensor].array is None, f"{tensor} was dequantized"
        for feed in calibration.held_out:
            ours, theirs, reference = runner(feed)[0], qdq.run(None, feed)[0], session.run(None, feed)[0]
            assert np.max(np.abs(ours - theirs)) <= OUTPUT_STEPS * step
            a, b = ours.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.995
    finally:
        runner.close()
