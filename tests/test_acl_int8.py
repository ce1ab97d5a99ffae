"""INT8 in the ACL plugin: int8 twins of conv and fc tasks run in ACL 20.08's quantized forms
(QASYMM8 / QASYMM8_SIGNED activations, QSYMM8_PER_CHANNEL or per-tensor weights, S32 bias) by the
real runner, verified against the float reference through the core's measuring protocol.

On x86_64 everything runs under qemu (``emulated``); shapes are small so the file stays fast.
"""

from __future__ import annotations

import dataclasses

import pytest

from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.models.tasks import Task, task_key
from kselect.plugins.acl import build, int8
from kselect.plugins.acl.library import AclLibrary, armnn_threads

pytestmark = [pytest.mark.emulated] if build.is_emulated() else []

FAST = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=60)
RELU = [["Relu", ["x"], {}]]
RELU6 = [["Clip", ["x", 0.0, 6.0], {}]]
CLIP = [["Clip", ["x", -0.5, 0.7], {}]]
LEAKY = [["LeakyRelu", ["x"], {"alpha": 0.1}]]
SIGMOID = [["Sigmoid", ["x"], {}]]


def conv_task(c, o, hw, k, stride=1, pad=None, group=1, bias=True, dilation=1, epilogue=None) -> Task:
    """The int8 twin of a conv task (``epilogue``: the activation measured with it)."""
    pad = k // 2 if pad is None else pad
    out = (hw + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": [pad] * 4, "dilations": [dilation, dilation],
             "group": group}
    signature = {"kind": "conv", "input": [1, c, hw, hw], "weight": [o, c // group, k, k], "output": [1, o, out, out],
                 "attrs": attrs, "bias": bias}
    task = Task("T", task_key(signature), "conv", [1, c, hw, hw], [o, c // group, k, k], [1, o, out, out], attrs, bias,
                ["n"], list(epilogue or []))
    return task.at_precision("int8")


def fc_task(m, k, n, bias=True, alpha=1.0, beta=1.0, epilogue=None) -> Task:
    attrs = {"alpha": alpha, "beta": beta, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": bias}
    task = Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, bias, ["f"], list(epilogue or []))
    return task.at_precision("int8")


DENSE = conv_task(8, 16, 8, 3, epilogue=RELU)
DEPTHWISE = conv_task(16, 16, 8, 3, group=16, epilogue=RELU6)
FC = fc_task(2, 64, 10, epilogue=RELU)


@pytest.fixture(scope="module")
def device():
    return this_device()


def distinct_choices(space, keys=("activations", "weights", "method", "layout")) -> list[dict]:
    """One single-thread config per distinct (activations, weights, method, layout) of the space."""
    seen, configs = set(), []
    for config in space.enumerate():
        key = tuple(config.get(k) for k in keys)
        if config["threads"] == 1 and key not in seen:
            seen.add(key)
            configs.append(config)
    return configs


# -- what is offered --------------------------------------------------------------------------------

def test_int8_is_a_precision_and_twins_have_their_own_key():
    assert AclLibrary.precisions == ("fp32", "int8")
    assert DENSE.precision == "int8" and DENSE.id == "T.int8"
    assert DENSE.key != DENSE.at_precision("fp32").key and DENSE.at_precision("fp32").precision == "fp32"


def test_int8_twins_where_acl_fuses_the_activation(acl):
    for task in (DENSE, DEPTHWISE, FC, conv_task(8, 8, 6, 1, epilogue=RELU6), conv_task(8, 8, 6, 3, epilogue=CLIP),
                 fc_task(1, 32, 8, epilogue=RELU6), conv_task(8, 8, 6, 3)):
        assert acl.supports(task), task
    # ACL would run these activations as a step of their own (not in the quantized output stage)
    assert not acl.supports(conv_task(8, 8, 6, 3, epilogue=LEAKY))
    assert not acl.supports(conv_task(8, 8, 6, 3, epilogue=SIGMOID))
    assert not acl.supports(conv_task(8, 8, 6, 3, group=2))  # grouped, not depthwise: no NEON conv in 20.08
    fp32_leaky = conv_task(8, 8, 6, 3, epilogue=LEAKY).at_precision("fp32")
    assert acl.supports(fp32_leaky)  # the fp32 task is unchanged


def test_int8_spaces_follow_validate(acl, device):
    dense = acl.space(DENSE, device)
    names = [d.name for d in dense.dims]
    assert names[:4] == ["activations", "weights", "method", "layout"]
    assert "gemm_kernel" not in names and "cpu_model" not in names and "fast_math" not in names
    assert set(dense.dim("activations").choices) == {"QASYMM8", "QASYMM8_SIGNED"}
    signed_right = acl._runner_info()["acl_version"] == "v24.11"
    assert set(dense.dim("weights").choices) == {"per-channel", "per-tensor"} | ({int8.SIGNED_WEIGHTS} if signed_right else set())
    # signed per-tensor weights go with unsigned activations only (with signed ones they are "per-tensor")
    assert {c["activations"] for c in dense.enumerate() if c["weights"] == int8.SIGNED_WEIGHTS} <= {"QASYMM8"}
    assert (f"weights:{int8.SIGNED_WEIGHTS}" in acl.missing_dims()) == (not signed_right)
    # 20.08 runs quantized dense convs through GEMM only (Direct, Winograd, FFT: F16/F32)
    assert dense.dim("method").choices == ("GEMM",)
    assert set(dense.dim("layout").choices) == {"NCHW", "NHWC"}
    assert acl.space(DEPTHWISE, device).dim("method").choices == ("DEPTHWISE",)
    fc = acl.space(FC, device)
    assert fc.dim("weights").choices == ("per-tensor",)  # NEFullyConnectedLayer takes no QSYMM8_PER_CHANNEL
    assert "method" not in [d.name for d in fc.dims]
    answers = acl.validation(FC, device)["int8"]
    reason = next(c["reason"] for c in answers["QASYMM8_SIGNED/per-channel"]["candidates"])
    assert "different data types" in reason
    assert answers["QASYMM8_SIGNED/per-tensor"]["data_type"] == "QASYMM8_SIGNED"


def test_int8_defaults_are_what_arm_nn_gives_acl(acl, device):
    threads = armnn_threads(device)
    schedule = {"threads": threads, **({"scheduler": "acl"} if threads > 1 else {})}
    assert acl.default_config(DENSE, device) == {"activations": "QASYMM8_SIGNED", "weights": "per-channel",
                                                 "method": "GEMM", "layout": "NCHW", **schedule}
    assert acl.default_config(DEPTHWISE, device)["method"] == "DEPTHWISE"
    assert acl.default_config(FC, device) == {"activations": "QASYMM8_SIGNED", "weights": "per-tensor", **schedule}
    for task in (DENSE, DEPTHWISE, FC):
        assert acl.default_config(task, device) in acl.space(task, device)


# -- measured against the float reference ------------------------------------------------------------

@pytest.mark.parametrize("task", [
    DENSE,
    conv_task(16, 8, 7, 1, stride=2, bias=False),  # pointwise, stride 2, no bias
    conv_task(4, 8, 9, 3, dilation=2, pad=2, epilogue=CLIP),  # dilated, Clip with a negative lower bound
    DEPTHWISE,
    conv_task(8, 16, 9, 3, stride=2, group=8),  # depth multiplier 2
    FC,
    fc_task(3, 32, 12, alpha=-0.5, beta=2.0),  # alpha and beta folded into the quantized weights and bias
], ids=["dense3x3-relu", "pointwise-s2", "dilated-clip", "depthwise-relu6", "depthwise-m2-s2", "fc-relu", "fc-alpha-beta"])
def test_every_int8_choice_matches_the_float_reference(acl, device, task):
    configs = distinct_choices(acl.space(task, device))
    combos = {(c["activations"], c["weights"]) for c in configs}
    assert ("QASYMM8_SIGNED", "per-tensor") in combos and ("QASYMM8", "per-tensor") in combos
    if task.kind == "conv":
        assert ("QASYMM8_SIGNED", "per-channel") in combos and ("QASYMM8", "per-channel") in combos
    dense = task.kind == "conv" and task.attrs["group"] == 1
    if dense and acl._runner_info()["acl_version"] == "v24.11":  # ONNX Runtime's U8S8 pairing
        assert ("QASYMM8", int8.SIGNED_WEIGHTS) in combos
    else:  # 20.08 computes the mix wrong; a depthwise conv and an fc refuse it
        assert all(w != int8.SIGNED_WEIGHTS for _, w in combos)
    cache: dict = {}
    for config in configs + [acl.default_config(task, device)]:
        result = measure_in_this_process(acl, task, config, FAST, cache)
        assert result.status == "ok", (config, result)
        assert result.error <= cache[task.key][2] and result.median_us > 0
        assert acl.last_result["data_type"] == config["activations"]
        assert acl.last_result["weights_type"] == int8.weight_type(config["activations"], config["weights"])


def test_split_scheduler_runs_every_thread_of_a_quantized_gemm(acl, device):
    """arm_gemm's quantized_wrapper waits on a barrier for every configured thread: a share that
    rounds to nothing hung the runner before the split scheduler gave each thread an iteration."""
    if device.cores < 2:
        pytest.skip("needs 2 cores")
    task = conv_task(8, 16, 8, 3, stride=2, epilogue=RELU6)  # its GEMM window has 2 iterations
    config = {**acl.default_config(task, device), "threads": 2, "scheduler": "kselect", "split": (0.125, 0.875)}
    assert config in acl.space(task, device)
    result = measure_in_this_process(acl, task, config, dataclasses.replace(FAST, timeout_s=30), {})
    assert result.status == "ok", result
    kernels = acl.last_result["scheduler"]["kernels"]
    wrapper = next((k for k in kernels if "quantized_wrapper" in k["kernel"]), None)
    if acl._runner_info()["acl_version"] == "v20.08":  # 24.11 runs arm_gemm's requantizing kernels here
        assert wrapper is not None
    if wrapper is not None:
        assert all(end > begin for begin, end in wrapper["parts"])


# -- wrong quantization is caught --------------------------------------------------------------------

def test_a_wrong_output_quantization_is_invalid(acl, device):
    config = acl.default_config(DENSE, device)
    cache: dict = {}
    assert measure_in_this_process(acl, DENSE, config, FAST, cache).status == "ok"
    inputs, reference, tolerance = cache[DENSE.key]
    narrow = dataclasses.replace(inputs["quant"], y_scale=inputs["quant"].y_scale / 8)  # the output saturates
    cache[DENSE.key] = ({**inputs, "quant": narrow}, reference, tolerance)
    result = measure_in_this_process(acl, DENSE, config, FAST, cache)
    assert result.status == "invalid" and result.error > tolerance and "differs from reference" in result.reason


class MixedTypesAcl(AclLibrary):
    """Per-tensor weights of the other 8-bit type than the activations (QASYMM8 input,
    QASYMM8_SIGNED weights and the reverse): ACL 20.08's GEMM convolution validates these."""

    @staticmethod
    def int8_weight_type(activations: str, weights: str) -> str:
        if weights == "per-channel":
            return "QSYMM8_PER_CHANNEL"
        return "QASYMM8_SIGNED" if activations == "QASYMM8" else "QASYMM8"


def test_mixed_signedness_validates_and_each_release_computes_it_wrong_right_or_refuses_it(acl, device):
    """ACL validates activations and per-tensor weights of different signedness, so the plugin pairs
    them itself (int8_weight_type): 20.08 computes both mixes wrong; 24.11 computes unsigned
    activations with signed weights right and refuses the other mix when configuring it."""
    runner = acl._query_runner()
    expected = {"v20.08": {"QASYMM8": "invalid", "QASYMM8_SIGNED": "invalid"},
                "v24.11": {"QASYMM8": "ok", "QASYMM8_SIGNED": "failed"}}[acl._runner_info()["acl_version"]]
    spec = AclLibrary.op_spec(DENSE)
    answer = runner.request({"action": "validate", "op": "conv", **spec,
                             "quant": {"input": "QASYMM8", "weights": "QASYMM8_SIGNED"}})
    assert any(c["ok"] and c["method"] == "GEMM" for c in answer["candidates"])
    mixed = MixedTypesAcl()
    try:
        for activations in ("QASYMM8", "QASYMM8_SIGNED"):
            config = {"activations": activations, "weights": "per-tensor", "method": "GEMM", "layout": "NCHW", "threads": 1}
            result = measure_in_this_process(mixed, DENSE, config, FAST, {})
            assert result.status == expected[activations], (activations, result)
            if result.status != "failed":
                assert mixed.last_result["weights_type"] != activations
    finally:
        mixed.close()


# -- labels and protocol -------------------------------------------------------------------------------

def test_int8_results_are_labelled_emulated(acl, device):
    result = measure_in_this_process(acl, FC, acl.default_config(FC, device), FAST, {})
    assert result.status == "ok"
    assert acl.emulated == build.is_emulated() == acl.last_result["emulated"]


def test_runner_quant_requests(acl):
    runner = acl._query_runner()
    assert runner.info()["precisions"] == ["fp32", "int8"]
    conv = {"action": "validate", "op": "conv", "input": [1, 4, 6, 6], "weights": [8, 4, 3, 3], "pads": [1, 1, 1, 1]}
    plain = runner.request(conv)
    assert plain["ok"] and "data_type" not in plain  # fp32 answers are unchanged
    quant = runner.request({**conv, "quant": {"input": "QASYMM8", "weights": "QSYMM8_PER_CHANNEL"}})
    assert (quant["data_type"], quant["weights_type"], quant["bias_type"]) == ("QASYMM8", "QSYMM8_PER_CHANNEL", "S32")
    assert {c["method"] for c in quant["candidates"] if c["ok"]} == {"GEMM", "AUTO"}
    assert quant["acl_pick"]["NCHW"]["fast_math_false"] == "GEMM"
    bad = [{"input": "QASYMM8_SIGNED", "x_zero_point": 200},  # outside int8
           {"input": "QASYMM8", "weights": "QSYMM8_PER_CHANNEL", "w_scales": [0.1]},  # one scale, 8 channels
           {"input": "QASYMM8", "weights": "QSYMM8_PER_CHANNEL", "w_zero_point": 3},
           {"input": "S8"}]
    for q in bad:
        answer = runner.request({**conv, "quant": q})
        assert not answer["ok"] and answer["error_kind"] == "bad_request", (q, answer)
    forced = runner.request({**conv, "action": "run", "quant": {"input": "QASYMM8"}, "min_repeats": 1,
                             "config": {"method": "GEMM", "gemm_kernel": "sgemm_12x8_1d", "threads": 1}})
    assert not forced["ok"] and forced["error_kind"] == "unsupported" and "fp32" in forced["error"]
    # random quantized data when no files are given: a timing-only run
    timed = runner.request({**conv, "action": "run", "quant": {"input": "QASYMM8_SIGNED", "weights": "QASYMM8_SIGNED"},
                            "min_repeats": 2, "config": {"method": "AUTO", "layout": "NHWC", "threads": 1}})
    assert timed["ok"] and timed["effective_method"] == "GEMM" and len(timed["times_us"]) >= 2
