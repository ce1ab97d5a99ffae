"""Transposed convolutions (ONNX ConvTranspose, deconv tasks) in int8 on XNNPack's 8-bit
deconvolution operators, on the real library: the int8 twin of the shapes real models carry
(waifu2x's 4x4/s2 to 3 channels, the PP-OCR detectors' 2x2/s2 with a Relu, a grouped one with
output_padding) within the core's int8 tolerance in both variants this build has (qs8, qu8; no
per-channel qc8), and a whole model whose ConvTranspose runs in int8 between int8 convs, its
tensors kept 8-bit, close to the float model."""

from __future__ import annotations

import graphs
import numpy as np
import pytest
from onnx import helper, numpy_helper
from test_xnnpack_int8_activations import _plans

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task, task_key
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.quant import int8_tolerance, quant_params
from kselect.plugins.xnnpack import configured, int8
from kselect.plugins.xnnpack import xnnpack_api as xa

_OK, _REASON = xa.int8_deconvolution_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
RELU = [["Relu", ["x"], {}]]


def deconv_task(cin, cout, hw, k, stride, pad, group=1, output_padding=(0, 0), epilogue=None) -> Task:
    out = [(hw - 1) * stride - 2 * pad + k + output_padding[axis] for axis in (0, 1)]
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": [pad] * 4, "dilations": [1, 1], "group": group,
             "output_padding": list(output_padding)}
    weight = [cin, cout // group, k, k]
    signature = {"kind": "deconv", "input": [1, cin, hw, hw], "weight": weight, "output": [1, cout, *out],
                 "attrs": attrs, "bias": True, "activation": epilogue or []}
    return Task("D", task_key(signature), "deconv", [1, cin, hw, hw], weight, [1, cout, *out], attrs, True, ["d"],
                list(epilogue or [])).at_precision("int8")


OPS = {
    "waifu2x-4x4-s2-to-3": deconv_task(16, 3, 10, 4, 2, 3),
    "ppocr-2x2-s2-relu": deconv_task(16, 16, 8, 2, 2, 0, epilogue=RELU),
    "grouped-3x3-s2-output-padding": deconv_task(8, 12, 7, 3, 2, 1, group=2, output_padding=(1, 1)),
}


@pytest.fixture(scope="module")
def lib():
    return plugins.get_library("xnnpack")


def tolerance(task) -> float:
    inputs = task_inputs(task)
    reference = reference_output(task, inputs)
    return int8_tolerance(task, inputs, reference, quant_params(task, inputs, reference))


@pytest.mark.parametrize("variant", xa.INT8_DECONV_VARIANTS)
@pytest.mark.parametrize("name", list(OPS))
def test_int8_deconvolution_matches_float_reference(lib, name, variant):
    task = OPS[name]
    assert lib.supports(task)
    config = dict(lib.default_config(task, this_device()), variant=variant)
    assert config in lib.space(task, this_device())
    result = measure_in_this_process(lib, task, config, QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= tolerance(task)
    assert result.median_us > 0


def test_the_space_holds_only_the_variants_this_build_has(lib):
    """No per-channel (qc8) deconvolution in this snapshot, and, as in float, no micro-kernel
    choice: qs8 (XNNPack's own for an int8 TransposeConv) and qu8, threads, spinning."""
    task = OPS["waifu2x-4x4-s2-to-3"]
    device = this_device()
    configs = list(lib.space(task, device).enumerate())
    assert {c["variant"] for c in configs} == {"qs8", "qu8"}
    assert not any("ukernel" in c for c in configs)
    assert lib.default_config(task, device)["variant"] == "qs8"
    with pytest.raises(configured.ConfigError, match="qc8"):
        int8.config_variant({"variant": "qc8"}, task)


def test_onnxruntime_has_no_int8_deconvolution_so_mlas_offers_none():
    """ONNX Runtime runs a QDQ ConvTranspose in float: MLAS gives a deconv no int8 twin."""
    assert not plugins.get_library("mlas").supports(OPS["ppocr-2x2-s2-relu"])


def upsampler(path) -> None:
    """conv 3 -> 8 (Relu), ConvTranspose 8 -> 8 4x4/s2 (Relu), conv 8 -> 3: a small super-resolution
    shape, as waifu2x's upconv models run it."""
    rng = np.random.default_rng(7)
    weights = {"w1": rng.normal(0, 0.3, (8, 3, 3, 3)), "b1": rng.normal(0, 0.1, 8),
               "wt": rng.normal(0, 0.15, (8, 8, 4, 4)), "bt": rng.normal(0, 0.1, 8),
               "w2": rng.normal(0, 0.2, (3, 8, 3, 3)), "b2": rng.normal(0, 0.1, 3)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("ConvTranspose", ["r1", "wt", "bt"], ["d"], name="deconv", strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["d"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    graphs.saved(graphs.model(nodes, inits, (1, 3, 16, 16), output_shapes=[[1, 3, 32, 32]], opset=13, name="upsampler"),
                 path)


def test_a_model_runs_its_convtranspose_in_int8_between_int8_convs(tmp_path):
    path = tmp_path / "upsampler.onnx"
    upsampler(path)
    model = load_model(str(path))
    library = plugins.get_library("xnnpack")
    rng = np.random.default_rng(0)
    calibration = calibration_for(model, [{"x": rng.random((1, 3, 16, 16), dtype=np.float32)} for _ in range(8)])
    ranges = compute_ranges(model, calibration)
    # every twin (conv1, deconv, conv2) in int8 at its default config
    _, plan = _plans(model, library, ranges, twin_kinds=("conv", "conv", "deconv"))

    float_runner, int8_runner = library.model_runner(model, None), library.model_runner(model, plan)
    try:
        assert int8_runner.int8_nodes == {"conv1", "deconv", "conv2"}
        assert int8_runner.configs["deconv"]["variant"] == "qs8"
        # the deconvolution (its Relu folded in) reads conv1's 8-bit output and writes an 8-bit
        # tensor only conv2 reads: neither is ever dequantized
        assert int8_runner.tensors["r2"].int8_output and int8_runner.tensors["r2"].array is None
        assert int8_runner.tensors["r1"].array is None
        references = [float_runner(feed)[0] for feed in calibration.held_out]
        y_scale = (max(r.max() for r in references) - min(min(r.min() for r in references), 0.0)) / 255.0
        for feed, expected in zip(calibration.held_out, references):
            got = int8_runner(feed)[0]
            a, b = expected.astype(np.float64).ravel(), got.astype(np.float64).ravel()
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.995
            # three 8-bit layers of rounding; held-out values past the calibrated ranges clip
            assert np.mean(np.abs(got - expected)) < 2 * y_scale
    finally:
        float_runner.close()
        int8_runner.close()
