"""The ACL library plugin (kselect.plugins.acl.library): spaces from ACL's validate(), ACL's own
choice as the default, every method and every listed arm_gemm kernel verified against the numpy
reference through the plugin's measure(), the workload split, and crash containment.

On x86_64 everything runs under qemu (``emulated``); shapes are small so the file stays fast.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kselect.core.contract import plugins
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.models.tasks import Task, task_key
from kselect.plugins.acl import build
from kselect.plugins.acl.client import AclRunner
from kselect.plugins.acl.library import AclLibrary, armnn_threads, cluster_cpus, runner_config

pytestmark = [pytest.mark.emulated] if build.is_emulated() else []

FAST = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=120)
# every arm_gemm fp32 kernel the spaces of the tasks below list, by release (each names its own)
LISTED_KERNELS = {
    "v20.08": {"sgemm_12x8_1d", "sgemm_12x8_2d", "hybrid_fp32_mla_16x4", "hybrid_fp32_mla_4x8_normal",
               "smallK_hybrid_fp32_mla_4x6", "smallK_hybrid_fp32_mla_4x8", "sgemv_pretransposed"},
    "v24.11": {"a64_sgemm_8x12", "a64_hybrid_fp32_mla_6x16", "a64_hybrid_fp32_mla_4x24", "a64_hybrid_fp32_mla_8x4",
               "a64_sgemm_8x6", "a64_smallK_hybrid_fp32_mla_8x4", "a64_smallK_hybrid_fp32_mla_6x4"},
}


# What differs between the two ACL releases the plugin runs on, as these tests meet it: the kernel
# an fc of one row lists (20.08 has a one-row kernel), whether a 5x5 Winograd needs fast math,
# the name of ACL's arm_gemm wrapper kernel, and whether CPUInfo takes a CPU model hint.
RELEASES = {
    "v20.08": dict(one_row_fc="sgemv_pretransposed", winograd_5x5_needs_fast_math=True,
                   gemm_wrapper="NEGEMMAssemblyWrapperKernel", cpu_model_hint=True),
    "v24.11": dict(one_row_fc="a64_hybrid_fp32_mla_8x4", winograd_5x5_needs_fast_math=False,
                   gemm_wrapper="CpuGemmAssemblyWrapperKernel", cpu_model_hint=False),
}


def release_of(acl) -> dict:
    return {"name": acl._runner_info()["acl_version"], **RELEASES[acl._runner_info()["acl_version"]]}


def conv_task(c, o, hw, k, stride=1, pad=None, group=1, bias=True, dilation=1) -> Task:
    pad = k // 2 if pad is None else pad
    pads = pad if isinstance(pad, list) else [pad] * 4
    oh = (hw + pads[0] + pads[2] - dilation * (k - 1) - 1) // stride + 1
    ow = (hw + pads[1] + pads[3] - dilation * (k - 1) - 1) // stride + 1
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": pads, "dilations": [dilation, dilation], "group": group}
    signature = {"kind": "conv", "input": [1, c, hw, hw], "weight": [o, c // group, k, k], "output": [1, o, oh, ow],
                 "attrs": attrs, "bias": bias}
    return Task("T", task_key(signature), "conv", [1, c, hw, hw], [o, c // group, k, k], [1, o, oh, ow], attrs, bias, ["n"])


def deconv_task(c, o, hw, k, stride, pad, bias=True, group=1) -> Task:
    out = stride * (hw - 1) + k - 2 * pad
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": [pad] * 4, "dilations": [1, 1], "group": group,
             "output_padding": [0, 0]}
    signature = {"kind": "deconv", "input": [1, c, hw, hw], "weight": [c, o // group, k, k], "output": [1, o, out, out],
                 "attrs": attrs, "bias": bias}
    return Task("D", task_key(signature), "deconv", [1, c, hw, hw], [c, o // group, k, k], [1, o, out, out], attrs, bias, ["d"])


def fc_task(m, k, n, bias=True) -> Task:
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": bias}
    return Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, bias, ["f"])


@pytest.fixture(scope="module")
def device():
    return this_device()


def measure(acl, task, config, cache={}):  # noqa: B006 - one task's data at a time, shared on purpose
    return measure_in_this_process(acl, task, config, FAST, cache)


# -- identity, cheap checks -------------------------------------------------------------------------

def test_registered_with_emulated_flag_and_package_version():
    library = plugins.libraries()["acl"]
    assert isinstance(library, AclLibrary)
    assert library.emulated == build.is_emulated() == (not build.is_native() or build.RUNS_EMULATED)
    ok, _ = library.availability()
    if ok:  # the Debian package of the ACL release found: 20.08 (Debian 12) or 24.11 (Debian 13)
        release = build.acl_version(build._find_libdir(build._toolchain()[2]))
        assert library.version().startswith(f"arm-compute {release}")
        assert "emulated" not in library.version()


def test_availability_is_cheap_and_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("KSELECT_ACL_CXX", "no-such-compiler-kselect")
    ok, reason = AclLibrary().availability()
    assert not ok and "no-such-compiler-kselect" in reason and "\n" not in reason


def test_armnn_thread_rule_and_cluster_pinning():
    one = Device("aarch64", "x", [], 4, [[0, 1, 2, 3]])
    big_little = Device("aarch64", "x", [], 6, [[4, 5], [0, 1, 2, 3]])
    assert armnn_threads(one) == 4 and armnn_threads(big_little) == 2
    assert cluster_cpus(one, 2) is None  # one cluster: no pinning
    assert cluster_cpus(big_little, 3) == [4, 5, 0]  # big cores first
    config = {"method": "GEMM", "layout": "NHWC", "gemm_kernel": "sgemm_12x8_1d", "cpu_model": "A53", "threads": 3,
              "scheduler": "kselect", "split": (0.5, 0.25, 0.25)}
    assert runner_config(config, big_little) == {"method": "GEMM", "layout": "NHWC", "gemm_kernel": "sgemm_12x8_1d",
                                                 "cpu_model": "A53", "threads": 3, "scheduler": "split",
                                                 "split_ratios": [0.5, 0.25, 0.25], "pin_threads": [4, 5, 0]}
    assert runner_config({"method": "DIRECT", "layout": "NCHW", "threads": 2, "scheduler": "acl"}, one)["scheduler"] == "default"


# -- spaces and defaults ------------------------------------------------------------------------------

def test_space_of_a_3x3_conv_follows_validate(acl, device):
    task = conv_task(16, 16, 14, 3)
    space = acl.space(task, device)
    names = [d.name for d in space.dims]
    assert names[:3] == ["method", "fast_math", "layout"]
    assert set(space.dim("method").choices) == {"GEMM", "WINOGRAD", "DIRECT", "FFT"}
    assert space.dim("fast_math").choices == (False,)  # 3x3 Winograd needs no fast math
    release = release_of(acl)
    general = LISTED_KERNELS[release["name"]] - {release["one_row_fc"], "a64_smallK_hybrid_fp32_mla_8x4",
                                                 "a64_smallK_hybrid_fp32_mla_6x4", "smallK_hybrid_fp32_mla_4x6",
                                                 "smallK_hybrid_fp32_mla_4x8"}
    assert general <= set(space.dim("gemm_kernel").choices)
    configs = space.enumerate()
    assert configs and all(c["layout"] in ("NCHW", "NHWC") for c in configs)
    assert not any("gemm_kernel" in c for c in configs if c["method"] in ("DIRECT", "FFT"))
    if release["one_row_fc"] == "sgemv_pretransposed":
        assert not any(c.get("gemm_kernel") == "sgemv_pretransposed" for c in configs)  # M = 196, not 1
    if device.cores > 1:
        splits = {c["split"] for c in configs if c.get("scheduler") == "kselect"}
        assert (0.5,) * device.cores in splits and all(abs(sum(s) - 1) < 1e-6 for s in splits)
    assert acl.default_config(task, device) in space


def test_fast_math_is_offered_where_it_unlocks_winograd(acl, device):
    """20.08's Winograd takes a 5x5 conv only with fast math, which is then its only value and
    not ACL's pick; 24.11's takes it without, so fast math is not offered there."""
    space = acl.space(conv_task(8, 8, 12, 5), device)
    if release_of(acl)["winograd_5x5_needs_fast_math"]:
        assert space.dim("fast_math").choices == (True,)
        assert all(c["fast_math"] for c in space.enumerate() if c["method"] == "WINOGRAD")
        assert acl.default_config(conv_task(8, 8, 12, 5), device)["method"] == "GEMM"  # ACL's pick without fast math
    else:
        assert space.dim("fast_math").choices == (False,)
        assert any(c["method"] == "WINOGRAD" and not c["fast_math"] for c in space.enumerate())


def test_depthwise_and_grouped_and_fc(acl, device):
    dw = conv_task(16, 16, 10, 3, group=16)
    assert acl.supports(dw)
    assert acl.space(dw, device).dim("method").choices == ("DEPTHWISE",)
    assert not acl.supports(conv_task(16, 16, 10, 3, group=4))  # ACL 20.08 NEON: depthwise only
    fc = acl.space(fc_task(1, 64, 10), device)
    assert release_of(acl)["one_row_fc"] in fc.dim("gemm_kernel").choices
    assert "method" not in [d.name for d in fc.dims]


@pytest.mark.parametrize("task, expected", [
    (conv_task(16, 16, 14, 3), "WINOGRAD"),
    (conv_task(16, 32, 14, 1), "GEMM"),
    (conv_task(16, 16, 14, 3, stride=2), "GEMM"),
    (conv_task(8, 8, 10, 3, dilation=2, pad=2), "GEMM"),
    (conv_task(16, 16, 10, 3, group=16), "DEPTHWISE"),
])
def test_default_is_what_acl_reports_it_would_pick(acl, device, task, expected):
    default = acl.default_config(task, device)
    assert default["method"] == acl.acl_pick(task) == expected
    assert default["layout"] == "NCHW" and default["threads"] == armnn_threads(device)
    assert default.get("gemm_kernel", "default") == "default" and default.get("cpu_model", "detected") == "detected"
    assert default.get("scheduler", "acl") == "acl"
    # NEConvolutionLayer itself (method AUTO) runs the same method
    with AclRunner() as runner:
        result = runner.request({"action": "run", "op": "conv", **acl.op_spec(task), "config": {"method": "AUTO", "threads": 1},
                                 "warmup": 0, "min_repeats": 1})
    assert result["ok"] and result["effective_method"] == expected


# -- measuring: every method, every kernel, the split ---------------------------------------------------

def test_every_method_and_layout_gives_a_correct_result(acl, device):
    seen = set()
    for task in (conv_task(16, 16, 14, 3), conv_task(8, 8, 12, 5), conv_task(16, 16, 10, 3, group=16)):
        space = acl.space(task, device)
        for config in space.enumerate():
            if config.get("gemm_kernel", "default") != "default" or config.get("cpu_model", "detected") != "detected":
                continue
            if config["threads"] != 1 and config.get("scheduler") != "kselect":
                continue
            if config.get("split", (0.5,)) not in ((0.5, 0.5), (0.5,)):
                continue
            result = measure(acl, task, config)
            assert result.status == "ok", (config, result)
            assert result.error <= acl.tolerance(task, config) and result.count >= FAST.min_repeats
            assert acl.last_result["emulated"] == acl.emulated
            seen.add((config["method"], config.get("fast_math", False), config["layout"]))
    assert {m for m, _, _ in seen} == {"GEMM", "WINOGRAD", "DIRECT", "FFT", "DEPTHWISE"}
    assert ("WINOGRAD", False, "NCHW") in seen
    if release_of(acl)["winograd_5x5_needs_fast_math"]:
        assert ("WINOGRAD", True, "NHWC") in seen


def test_a_transposed_convolution_runs_as_ne_deconvolution_layer_in_every_layout(acl, device):
    """waifu2x's 4x4/s2 deconvolution to 3 channels and the 2x2/s2 one of CenterFace and the
    PP-OCR detectors; a grouped one is not ACL's (20.08 has no grouped deconvolution)."""
    assert not acl.supports(deconv_task(8, 8, 6, 2, 2, 0, group=2))
    for task in (deconv_task(16, 3, 10, 4, 2, 3), deconv_task(8, 8, 6, 2, 2, 0, bias=False)):
        assert acl.supports(task)
        assert acl.default_config(task, device) == {"layout": "NCHW", "threads": armnn_threads(device),
                                                    **({"scheduler": "acl"} if armnn_threads(device) > 1 else {})}
        layouts = set()
        for config in acl.space(task, device).enumerate():
            if config.get("split", (0.5,)) not in ((0.5, 0.5), (0.5,)):
                continue
            result = measure(acl, task, config)
            assert result.status == "ok" and result.error < 1e-4, (config, result)
            layouts.add(config["layout"])
        assert layouts == {"NCHW", "NHWC"}


def test_every_listed_gemm_kernel_gives_a_correct_result(acl, device):
    """Each kernel on a conv (or fc) where arm_gemm accepts it: K=144 for the general kernels,
    K=8 / K=16 with N%4==0 for the smallK ones, M=1 for sgemv (20.08). Forced through the function
    the release picks a kernel with (20.08: get_gemm_method; 24.11: gemm() itself), each is the
    kernel ACL used for every GEMM of the op, and its output is right."""
    tested = set()
    for task in (conv_task(16, 16, 14, 3), conv_task(8, 16, 14, 1), conv_task(16, 16, 14, 1), fc_task(1, 64, 16)):
        space = acl.space(task, device)
        kernels = [k for k in space.dim("gemm_kernel").choices if k != "default"]
        hint = {"cpu_model": "detected"} if "cpu_model" in [d.name for d in space.dims] else {}  # 20.08 only
        for kernel in kernels:
            config = {"gemm_kernel": kernel, **hint, "threads": 1}
            if task.kind == "conv":
                config = {"method": "GEMM", "layout": "NHWC", **config}
            if config not in space:
                continue  # not eligible for this shape (the constraint removed it)
            result = measure(acl, task, config)
            assert result.status == "ok", (task.input_shape, kernel, result)
            gemms = acl.last_result["gemm"]["gemms"]
            assert gemms and all(g["used"] == kernel and g["forced"] for g in gemms)
            tested.add(kernel)
    assert tested >= LISTED_KERNELS[acl._runner_info()["acl_version"]]


def test_cpu_model_hint_reaches_the_runner(acl, device):
    if not release_of(acl)["cpu_model_hint"]:
        pytest.skip("no CPUInfo::set_cpu_model after ACL 20.08: kselect space names cpu_model missing (test_arm64.py)")
    task = conv_task(16, 16, 14, 3)
    result = measure(acl, task, {"method": "GEMM", "layout": "NCHW", "gemm_kernel": "default", "cpu_model": "A53", "threads": 1})
    assert result.status == "ok" and set(acl.last_result["cpu_models"]) == {"A53"}


@pytest.mark.skipif(this_device().cores < 2, reason="needs two cores")
def test_workload_split_changes_which_thread_does_what_and_stays_correct(acl, device):
    task = conv_task(16, 16, 14, 3)
    release = release_of(acl)
    hint = {"cpu_model": "detected"} if release["cpu_model_hint"] else {}
    parts = {}
    for split in ((0.25, 0.75), (0.75, 0.25)):
        config = {"method": "GEMM", "layout": "NHWC", "gemm_kernel": "default", **hint, "threads": 2,
                  "scheduler": "kselect", "split": split}
        assert config in acl.space(task, device)
        result = measure(acl, task, config)
        assert result.status == "ok", result
        sched = acl.last_result["scheduler"]
        assert sched["mode"] == "split" and sched["split_ratios"] == list(split)
        gemm = next(k for k in sched["kernels"] if k["kernel"].startswith(release["gemm_wrapper"]))
        (b0, e0), (b1, e1) = gemm["parts"]
        assert b0 == 0 and e0 == b1 == round(split[0] * gemm["iterations"]) and e1 == gemm["iterations"]
        parts[split] = e0 - b0
    assert parts[(0.25, 0.75)] < parts[(0.75, 0.25)]


def test_fc_alpha_beta_are_folded(acl, device):
    task = fc_task(2, 24, 8)
    task.attrs.update(alpha=0.5, beta=2.0)
    result = measure(acl, task, acl.default_config(task, device), {})
    assert result.status == "ok" and result.error < 1e-4


# -- crash containment -----------------------------------------------------------------------------------

def test_a_runner_crash_is_a_failed_candidate_and_the_next_one_restarts_it(acl, device, tmp_path):
    flag = tmp_path / "crashed-once"
    script = tmp_path / "runner.sh"
    real = " ".join(build.runner_argv())
    script.write_text(f"#!/bin/sh\nif [ ! -e {flag} ]; then touch {flag}; kill -SEGV $$; fi\nexec {real}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    library = AclLibrary()
    library._measurer = AclRunner([str(script)], timeout_s=60)
    task = conv_task(8, 8, 8, 3)
    config = library.default_config(task, device)
    cache: dict = {}
    first = measure_in_this_process(library, task, config, FAST, cache)
    assert first.status == "failed" and "runner" in first.reason
    second = measure_in_this_process(library, task, config, FAST, cache)
    assert second.status == "ok" and os.path.exists(flag)
    library.close()


def test_an_unsupported_config_fails_with_the_runners_reason(acl, device):
    task = conv_task(16, 16, 14, 3)
    result = measure(acl, task, {"method": "GEMM", "layout": "NCHW", "gemm_kernel": "sgemv_pretransposed", "threads": 1})
    assert result.status == "failed" and "unsupported" in result.reason
    assert np.isfinite(measure(acl, task, acl.default_config(task, device)).median_us)  # the runner survived


def test_without_kernel_forcing_the_space_falls_back_to_acls_default_kernels(monkeypatch, device):
    """When the runner's arm_gemm ABI check fails (simulated), there is no gemm_kernel dim and every
    GEMM runs ACL's own kernel; the rest of the space is unchanged."""
    monkeypatch.setenv("KSELECT_ACL_NO_GEMM_FORCING", "1")
    library = AclLibrary()
    if not library.availability()[0]:
        pytest.skip("ACL unavailable")
    try:
        info = library._query_runner().info()["extensions"]
        assert not info["gemm_forcing"] and "KSELECT_ACL_NO_GEMM_FORCING" in info["gemm_forcing_reason"]
        task = conv_task(16, 16, 14, 3)
        space = library.space(task, device)
        names = [d.name for d in space.dims]
        assert "gemm_kernel" not in names and ("cpu_model" in names) == release_of(library)["cpu_model_hint"]
        default = library.default_config(task, device)
        assert "gemm_kernel" not in default and default in space
        result = measure_in_this_process(library, task, default, FAST, {})
        assert result.status == "ok", result
    finally:
        library.close()
