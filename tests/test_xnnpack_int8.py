"""XNNPack's 8-bit operators as int8 candidates, on the real library: every variant (qc8
per-channel, qs8 and qu8 per-tensor) of dense, depthwise and grouped convs and fully connected
ops against the float reference through the core's measuring; the folded Relu / Clip; every
8-bit micro-kernel of the catalog; a kernel given the wrong quantization found invalid by the
core; and the int8 twins of a zoo model."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task, task_key
from kselect.core.precision.quant import int8_tolerance, quant_params
from kselect.plugins.xnnpack import configured, int8, kernels
from kselect.plugins.xnnpack import ukernel_table
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.int8_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)
RELU = [["Relu", ["x"], {}]]
RELU6 = [["Clip", ["x", 0.0, 6.0], {}]]

needs_override = pytest.mark.skipif(not (_OK and kernels.int8_override_status()[0]),
                                    reason="8-bit micro-kernel override unavailable here")


def conv_task(cin, cout, k, stride=1, group=1, h=9, w=11, epilogue=None, bias=True, dilation=1) -> Task:
    pads = [k // 2 * dilation] * 4
    oh = (h + 2 * pads[0] - ((k - 1) * dilation + 1)) // stride + 1
    ow = (w + 2 * pads[1] - ((k - 1) * dilation + 1)) // stride + 1
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": pads, "dilations": [dilation, dilation],
             "group": group}
    signature = {"kind": "conv", "input": [1, cin, h, w], "weight": [cout, cin // group, k, k],
                 "output": [1, cout, oh, ow], "attrs": attrs, "bias": bias, "activation": epilogue or []}
    return Task("C", task_key(signature), "conv", [1, cin, h, w], [cout, cin // group, k, k], [1, cout, oh, ow],
                attrs, bias, ["n"], list(epilogue or [])).at_precision("int8")


def fc_task(m, k, n, alpha=1.0, beta=1.0, epilogue=None) -> Task:
    attrs = {"alpha": alpha, "beta": beta, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": True,
                 "activation": epilogue or []}
    return Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, True, ["f"],
                list(epilogue or [])).at_precision("int8")


@pytest.fixture(scope="module")
def lib() -> XnnpackLibrary:
    return plugins.get_library("xnnpack")


def tolerance(task) -> float:
    inputs = task_inputs(task)
    reference = reference_output(task, inputs)
    return int8_tolerance(task, inputs, reference, quant_params(task, inputs, reference))


def variant_config(lib, task, variant: str) -> dict:
    """The default config with another variant (and that family's own kernel)."""
    config = dict(lib.default_config(task, this_device()), variant=variant)
    if "ukernel" in config:
        config["ukernel"] = kernels.int8_default_kernel(variant, int8.op_class(task), kernels.gemm_rows(task),
                                                        int8._taps(task))
    return config


OPS = {
    "dense3x3": conv_task(16, 24, 3),
    "dense3x3-s2-relu": conv_task(16, 24, 3, stride=2, epilogue=RELU),
    "pointwise-relu6": conv_task(24, 40, 1, epilogue=RELU6),
    "depthwise3x3-relu6": conv_task(32, 32, 3, group=32, epilogue=RELU6),
    "depthwise5x5-s2": conv_task(24, 24, 5, stride=2, group=24, h=13, w=12),
    "depthwise3x3-dilated": conv_task(16, 16, 3, group=16, dilation=2),
    "grouped3x3": conv_task(16, 32, 3, group=4),
    "depthwise-multiplier2": conv_task(8, 16, 3, group=8),
    "fc": fc_task(5, 64, 20),
    "fc-one-row-relu": fc_task(1, 96, 40, epilogue=RELU),
    "fc-alpha-beta": fc_task(3, 32, 12, alpha=-0.5, beta=2.0),
}


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("name", list(OPS))
def test_variant_matches_float_reference(lib, name, variant):
    assert_matches_float_reference(lib, OPS[name], variant)


def assert_matches_float_reference(lib, task, variant: str) -> None:
    """The variant's candidate is offered, measures, and is within the core's int8 tolerance."""
    assert lib.supports(task)
    config = variant_config(lib, task, variant)
    assert config in lib.space(task, this_device())
    result = measure_in_this_process(lib, task, config, QUICK, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error <= tolerance(task)
    assert result.median_us > 0


def test_default_is_what_xnnpack_picks_for_a_tflite_model(lib):
    device = this_device()
    conv, fc = OPS["dense3x3"], OPS["fc"]
    assert lib.default_config(conv, device)["variant"] == "qc8"  # per-channel weights
    assert lib.default_config(fc, device)["variant"] == "qs8"  # no per-channel fully connected operator
    for task in (conv, fc):
        config = lib.default_config(task, device)
        assert config["threads"] == device.cores
        if kernels.int8_override_status()[0]:
            # the kernel XNNPack's initialisation put in the family's table: no override applied,
            # and the operator is checked to hold it
            assert int8.choice_for(task, config) is None
            built = int8.build(task, config, _inputs(task))
            try:
                assert config["ukernel"] in built.notes["kernels"]
            finally:
                built.close()


def _inputs(task) -> dict:
    inputs = task_inputs(task)
    inputs["quant"] = quant_params(task, inputs, reference_output(task, inputs))
    return inputs


def test_activation_folding(lib):
    """Relu and Clip become the output clamp; activations other than those and Sigmoid / SiLU
    (tests/test_xnnpack_int8_activations.py) make the int8 twin unsupported."""
    assert lib.supports(conv_task(8, 8, 3, epilogue=RELU))
    assert lib.supports(conv_task(8, 8, 3, epilogue=RELU6))
    assert not lib.supports(conv_task(8, 8, 3, epilogue=[["HardSwish", ["x"], {}]]))
    assert not lib.supports(conv_task(8, 8, 3, epilogue=[["Relu", ["x"], {}], ["Sigmoid", ["x"], {}]]))
    task = OPS["depthwise3x3-relu6"]
    inputs = _inputs(task)
    params = inputs["quant"]
    low, high = int8.output_range(task.epilogue, params, "qs8")
    assert low == params.y_zero_point - 128  # 0.0 quantized
    assert high == min(255, round(6.0 / params.y_scale) + params.y_zero_point) - 128
    candidate = lib.prepare(task, variant_config(lib, task, "qs8"), inputs)
    try:
        candidate.run()
        y = candidate.output()
    finally:
        candidate.close()
    assert y.min() >= 0.0 and y.max() <= 6.0 + params.y_scale


def test_wrong_zero_point_is_invalid(lib):
    """A kernel told the wrong input zero point (the data quantized with the right one): the core
    finds its output beyond the int8 tolerance."""

    class WrongZeroPoint(XnnpackLibrary):
        def prepare(self, task, config, inputs):
            params = inputs["quant"]
            wrong = dataclasses.replace(params, x_zero_point=(params.x_zero_point + 40) % 256)
            return int8.prepare(task, config, inputs, kernel_quant=wrong)

    wrong = WrongZeroPoint()
    for task in (OPS["dense3x3"], OPS["fc"]):
        for variant in int8.VARIANTS:
            config = variant_config(lib, task, variant)
            assert measure_in_this_process(lib, task, config, QUICK, {}).status == "ok"
            result = measure_in_this_process(wrong, task, config, QUICK, {})
            assert result.status == "invalid", (variant, result)
            assert result.error > tolerance(task)


@needs_override
def test_every_8bit_kernel_runs_correctly(lib):
    """Every kernel of every family in the space, forced through the table override, computes
    the op within the int8 tolerance, and the table is XNNPack's own again afterwards."""
    device = this_device()
    seen = set()
    for name in ("dense3x3", "pointwise-relu6", "depthwise3x3-relu6", "depthwise5x5-s2", "fc", "fc-one-row-relu"):
        task = OPS[name]
        space = lib.space(task, device)
        configs = [c for c in space.enumerate() if c["threads"] == 1]
        assert {c["variant"] for c in configs} == set(int8.VARIANTS)
        cache: dict = {}
        for config in configs:
            result = measure_in_this_process(lib, task, config, QUICK, cache)
            assert result.status == "ok", (name, config, result.reason)
            seen.add(config["ukernel"])
        configured.check_table_pristine()
    cat = kernels.int8_catalog()
    gemm_like = {kernels.short(c.name) for family in cat.values() for cls in ("gemm", "igemm") for c in family[cls]}
    dwconv = {kernels.short(c.name) for family in cat.values() for c in family["dwconv"]}
    assert gemm_like <= seen
    assert dwconv <= seen


@needs_override
def test_override_reaches_the_operator_and_is_undone(lib):
    task = OPS["dense3x3"]
    before = ctypes.string_at(ctypes.addressof(ukernel_table.verify_build().table.qs8.gemm), ctypes.sizeof(ukernel_table.GemmParams))
    other = [n for n in int8.kernel_options(task, "qs8") if n != kernels.int8_default_kernel("qs8", "igemm", 99)]
    assert other
    config = dict(variant_config(lib, task, "qs8"), ukernel=other[-1])
    built = int8.build(task, config, _inputs(task))
    try:
        assert other[-1] in built.notes["kernels"]
        assert kernels.int8_default_kernel("qs8", "igemm", 99) not in built.notes["kernels"]
    finally:
        built.close()
    after = ctypes.string_at(ctypes.addressof(ukernel_table.verify_build().table.qs8.gemm), ctypes.sizeof(ukernel_table.GemmParams))
    assert before == after
    with pytest.raises(configured.ConfigError):  # a kernel of another family than the variant
        int8.build(task, dict(config, variant="qc8"), _inputs(task))


def test_mobilenetv2_lists_int8_twins(lib):
    model = load_model("mobilenetv2")
    tasks = library_tasks(model, lib, ("fp32", "int8"))
    fp32 = [t for t in tasks if t.precision == "fp32"]
    twins = [t for t in tasks if t.precision == "int8"]
    # every conv and the classifier: no activation or Relu6 (Clip), all folded into the clamp
    assert len(twins) == len([t for t in fp32 if t.kind in ("conv", "fc")]) == 31
    assert all(t.id.endswith(".int8") for t in twins)
    assert {t.key for t in twins}.isdisjoint({t.key for t in fp32})
    device = this_device()
    for task in twins:
        space = lib.space(task, device)
        default = space.normalise(lib.default_config(task, device))
        assert default in space
        assert default["variant"] == ("qs8" if task.kind == "fc" else "qc8")
    assert library_tasks(model, lib, ("fp32",)) == fp32


@needs_override
def test_measured_in_the_worker_child(lib):
    """The path a tune takes: the core's measuring child builds the int8 candidate (catalog from
    the disk cache there), a forced kernel included."""
    from kselect.core.measuring.worker import MeasureWorker

    task = OPS["depthwise3x3-relu6"]
    configs = [variant_config(lib, task, "qc8")]
    configs.append(dict(configs[0], ukernel=int8.kernel_options(task, "qc8")[-1]))
    with MeasureWorker(lib, QUICK) as worker:
        for config in configs:
            result = worker.measure(task, config)
            assert result.status == "ok", result.reason


def test_float_builder_refuses_8bit_configs(lib):
    """An int8 config reaching the float operator builder is refused, never run as fp32 (the
    executor builds its int8 nodes through int8.create_operator)."""
    task = OPS["dense3x3"]
    config = lib.default_config(task, this_device())
    x = configured.buffer((1, 9, 11, 16))
    y = configured.buffer((1, 9, 11, 24))
    w = np.zeros((24, 16, 3, 3), np.float32)
    with pytest.raises(configured.ConfigError, match="8-bit"):
        configured.build(configured.OpSpec(task), config, w, None, x, y)
