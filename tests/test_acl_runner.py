"""Tests of the ACL measurement runner (kselect.plugins.acl): protocol, correctness vs numpy.

On x86_64 the runner runs under qemu (marked ``emulated``); shapes are small so that the whole
file takes well under a minute. Skipped when the cross toolchain / ACL package is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kselect.plugins.acl import build
from kselect.plugins.acl.client import AclRunner

EMULATED = build.is_emulated()
runs_runner = [pytest.mark.emulated] if EMULATED else []

CONV = dict(input=[1, 16, 14, 14], weights=[16, 16, 3, 3], stride=[1, 1], pads=[1, 1, 1, 1],
            dilation=[1, 1], group=1, bias=True, relu=False)
ALL_METHODS = {"GEMM", "WINOGRAD", "DIRECT", "FFT", "DEPTHWISE", "AUTO"}
# Winograd transforms (and FFT) lose a little precision; direct/GEMM are near-exact.
TOL = {"GEMM": 1e-4, "DIRECT": 1e-4, "DEPTHWISE": 1e-4, "FFT": 1e-3, "WINOGRAD": 1e-3, "AUTO": 1e-3}


def ref_conv(x, w, b, stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), group=1, relu=False):
    """Naive NCHW/OIHW convolution in float64 (pads: top, left, bottom, right)."""
    n, c, h, wd = x.shape
    o, ci, kh, kw = w.shape
    pt, pl, pb, pr = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + pl + pr - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        xs = xp[:, g * ci:(g + 1) * ci]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dilation[0]: i * dilation[0] + stride[0] * (oh - 1) + 1: stride[0],
                           j * dilation[1]: j * dilation[1] + stride[1] * (ow - 1) + 1: stride[1]]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    if b is not None:
        out += b[None, :, None, None]
    if relu:
        out = np.maximum(out, 0)
    return out.astype(np.float32)


def make_arrays(spec, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"input": rng.uniform(-1, 1, spec["input"]).astype(np.float32),
              "weights": rng.uniform(-1, 1, spec["weights"]).astype(np.float32)}
    if spec.get("bias", True):
        arrays["bias"] = rng.uniform(-1, 1, spec["weights"][0]).astype(np.float32)
    return arrays


def reference(spec, arrays):
    return ref_conv(arrays["input"], arrays["weights"], arrays.get("bias"), spec.get("stride", (1, 1)),
                    spec.get("pads", (0, 0, 0, 0)), spec.get("dilation", (1, 1)), spec.get("group", 1),
                    spec.get("relu", False))


@pytest.fixture(scope="module")
def runner():
    try:
        argv = build.runner_argv()
    except build.AclUnavailable as e:
        pytest.skip(str(e))
    r = AclRunner(argv, timeout_s=120)
    yield r
    r.close()


@pytest.fixture(scope="module")
def validated(runner):
    return runner.validate_conv(CONV)


def run_conv(runner, spec, arrays, **config):
    cfg = {"threads": 1, "layout": "NCHW", **config}
    res, out = runner.run_op("conv", spec, cfg, arrays, want_output=True, warmup=1, min_repeats=2)
    assert res["ok"], res
    return res, out


# -- build / launch (no emulation needed) -----------------------------------------------------

def test_missing_compiler_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KSELECT_ACL_CXX", "no-such-compiler-kselect")
    with pytest.raises(build.AclUnavailable) as e:
        build.build_command(tmp_path / "x")
    assert "no-such-compiler-kselect" in str(e.value) and "\n" not in str(e.value)


def test_missing_headers_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KSELECT_ACL_CXX", "sh")  # any existing program: get past the compiler check
    monkeypatch.setenv("KSELECT_ACL_INCLUDE", str(tmp_path))
    with pytest.raises(build.AclUnavailable) as e:
        build.build_command(tmp_path / "x")
    assert "headers" in str(e.value) and "\n" not in str(e.value)


def test_runner_command_native_vs_emulated(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(build, "RUNS_EMULATED", False)  # an Arm board, not an arm64 root under qemu
    assert build.runner_command() == []
    assert not build.is_emulated()
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    if build.shutil.which("qemu-aarch64-static"):
        cmd = build.runner_command()
        assert cmd[0].endswith("qemu-aarch64-static") and cmd[1:] == ["-L", "/"]


# -- runner -------------------------------------------------------------------------------------

def _emulated(fn):
    """Mark a test that executes the aarch64 runner: under qemu it is 'emulated'."""
    for m in runs_runner:
        fn = m(fn)
    return fn


@_emulated
def test_info(runner):
    info = runner.info()
    assert info["ok"] and info["protocol"] == 1
    # the release build.py read from the library and compiled for: 20.08 (Debian 12) or 24.11 (Debian 13)
    assert info["acl_version"] == f"v{build.acl_version(build._find_libdir(build._toolchain()[2]))}"
    assert set(info["methods"]) == ALL_METHODS
    assert info["emulated"] == EMULATED


@_emulated
def test_f16_support_is_what_acl_validates(runner):
    """info's ``f16_support``: ACL's own validate() of an F16 conv, depthwise conv, fc and the
    F32 -> F16 cast. Debian's builds (20.08 and 24.11) are compiled for plain Armv8-a with no F16
    kernels: both refuse all four, on x86_64 under qemu and in the arm64 root's emulated
    Neoverse-N1 alike, although CPUInfo::has_fp16 is true on both."""
    info = runner.info()
    support = info["f16_support"]
    assert set(support) == {"conv", "depthwise", "fc", "cast"}
    assert all(isinstance(answer, str) and answer for answer in support.values())
    if "'arch': 'arm64-v8a'" in info["build_information"] and "'multi_isa': '1'" not in info["build_information"]:
        for op, answer in support.items():
            assert "does not support F16" in answer, (op, answer)


@_emulated
def test_validate_lists_methods(validated):
    assert validated["ok"] and validated["output"] == [1, 16, 14, 14]
    cands = validated["candidates"]
    assert {c["method"] for c in cands} == ALL_METHODS
    assert {c["layout"] for c in cands} == {"NCHW", "NHWC"}
    ok = {(c["method"], c["layout"]) for c in cands if c["ok"]}
    for m in ("GEMM", "WINOGRAD", "DIRECT", "AUTO"):
        assert (m, "NCHW") in ok and (m, "NHWC") in ok
    dw = [c for c in cands if c["method"] == "DEPTHWISE"]
    assert dw and not any(c["ok"] for c in dw) and all(c["reason"] for c in dw)
    for layout in ("NCHW", "NHWC"):
        assert validated["acl_pick"][layout]["fast_math_false"] in {"GEMM", "WINOGRAD", "DIRECT", "FFT"}


@_emulated
def test_each_valid_method_matches_numpy(runner, validated):
    arrays = make_arrays(CONV)
    ref = reference(CONV, arrays)
    tried = 0
    for c in validated["candidates"]:
        if not c["ok"] or c["layout"] != "NCHW":
            continue
        res, out = run_conv(runner, CONV, arrays, method=c["method"], fast_math=c["fast_math"])
        assert res["emulated"] == EMULATED
        assert len(res["times_us"]) >= 2 and all(t > 0 for t in res["times_us"])
        assert out.shape == ref.shape
        err = np.abs(out - ref).max()
        assert err < TOL[c["method"]], (c, err)
        tried += 1
    assert tried >= 5  # GEMM, WINOGRAD (x2 fast_math), DIRECT, FFT, AUTO (x2)


@_emulated
@pytest.mark.parametrize("method", ["GEMM", "WINOGRAD", "DIRECT"])
def test_nhwc_and_nchw_agree(runner, method):
    spec = dict(CONV, relu=True)
    arrays = make_arrays(spec, seed=1)
    _, a = run_conv(runner, spec, arrays, method=method, layout="NCHW")
    _, b = run_conv(runner, spec, arrays, method=method, layout="NHWC")
    assert np.abs(a - b).max() < TOL[method]
    assert np.abs(a - reference(spec, arrays)).max() < TOL[method]


@_emulated
@pytest.mark.parametrize("method", ["GEMM", "AUTO"])
def test_threads_1_and_2_agree(runner, method):
    arrays = make_arrays(CONV, seed=2)
    r1, a = run_conv(runner, CONV, arrays, method=method, threads=1)
    r2, b = run_conv(runner, CONV, arrays, method=method, threads=2)
    assert r1["threads"] == 1 and r2["threads"] == 2
    assert np.abs(a - b).max() < TOL[method]


@_emulated
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_depthwise_with_multiplier_and_asymmetric_pads(runner, layout):
    spec = dict(input=[1, 8, 15, 13], weights=[16, 1, 3, 3], stride=[2, 2], pads=[0, 1, 1, 0], group=8, relu=True)
    v = runner.validate_conv(spec)
    assert v["acl_pick"][layout]["fast_math_false"] == "DEPTHWISE"
    assert not any(c["ok"] for c in v["candidates"] if c["method"] in ("WINOGRAD", "DIRECT", "FFT"))
    arrays = make_arrays(spec, seed=3)
    res, out = run_conv(runner, spec, arrays, method="DEPTHWISE", layout=layout, threads=2)
    assert res["output"] == [1, 16, 7, 6]
    assert np.abs(out - reference(spec, arrays)).max() < 1e-4


@_emulated
def test_a_depthwise_conv_split_all_to_one_thread_is_still_whole(runner):
    """With every share on thread 1, each kernel of a depthwise conv still writes all of its output:
    20.08's kernels run the window given to them (thread 0 gets none of it); 24.11's assembly
    depthwise kernel divides its work by thread id itself, so the runner runs it on both threads
    with the whole window and says so (own_split)."""
    spec = dict(input=[1, 16, 14, 14], weights=[16, 1, 3, 3], stride=[1, 1], pads=[1, 1, 1, 1], group=16)
    arrays = make_arrays(spec, seed=4)
    res, out = run_conv(runner, spec, arrays, method="DEPTHWISE", layout="NHWC", threads=2, scheduler="split",
                        split_ratios=[0.0, 1.0])
    splitting_themselves = set(runner.info()["extensions"]["kernels_splitting_by_thread_id"])
    assert np.abs(out - reference(spec, arrays)).max() < 1e-4
    kernels = res["scheduler"]["kernels"]
    # an assembly wrapper names its arm_conv kernel after a slash
    assert kernels and all(k["own_split"] == (k["kernel"].split("/")[0] in splitting_themselves) for k in kernels)


@_emulated
def test_strided_asymmetric_and_dilated_gemm(runner):
    for spec in (dict(input=[1, 8, 11, 9], weights=[12, 8, 3, 3], stride=[2, 1], pads=[0, 1, 2, 1], relu=True),
                 dict(input=[1, 8, 10, 10], weights=[8, 8, 3, 3], pads=[2, 2, 2, 2], dilation=[2, 2], bias=False)):
        arrays = make_arrays(spec, seed=4)
        for layout in ("NCHW", "NHWC"):
            _, out = run_conv(runner, spec, arrays, method="GEMM", layout=layout)
            assert np.abs(out - reference(spec, arrays)).max() < 1e-4


@_emulated
def test_batch_2_all_valid_methods(runner):
    spec = dict(input=[2, 8, 10, 10], weights=[8, 8, 3, 3], pads=[1, 1, 1, 1])
    arrays = make_arrays(spec, seed=11)
    ref = reference(spec, arrays)
    v = runner.validate_conv(spec)
    fft = [c for c in v["candidates"] if c["method"] == "FFT"]
    assert fft and not any(c["ok"] for c in fft)  # ACL 20.08 FFT fails for batch > 1: refused up front
    for c in v["candidates"]:
        if c["ok"] and c["layout"] == "NHWC":
            _, out = run_conv(runner, spec, arrays, method=c["method"], layout="NHWC", fast_math=c["fast_math"])
            assert np.abs(out - ref).max() < TOL[c["method"]], c


@_emulated
def test_fc_matches_numpy(runner):
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (3, 40)).astype(np.float32)
    w = rng.uniform(-1, 1, (10, 40)).astype(np.float32)
    b = rng.uniform(-1, 1, 10).astype(np.float32)
    ref = x @ w.T + b
    for threads in (1, 2):
        res, out = runner.run_op("fc", dict(input=[3, 40], weights=[10, 40]), dict(threads=threads),
                                 dict(input=x, weights=w, bias=b), want_output=True, min_repeats=2)
        assert res["ok"] and res["threads"] == threads, res
        assert np.abs(out - ref).max() < 1e-4


@_emulated
def test_errors_are_reported_not_fatal(runner):
    bad = runner.request({"action": "run", "op": "conv", "input": [1, 2, 3, 3]})
    assert not bad["ok"] and bad["error_kind"] == "bad_request"
    refused = runner.request({"action": "run", "op": "conv", "input": [1, 16, 8, 8], "weights": [16, 16, 1, 1],
                              "config": {"method": "WINOGRAD"}})
    assert not refused["ok"] and refused["error_kind"] == "unsupported"
    not_an_object = runner.request({"action": "run", "op": "conv", "input": [1, 16, 8, 8], "weights": [16, 16, 1, 1],
                                    "config": "WINOGRAD"})
    assert not not_an_object["ok"] and not_an_object["error_kind"] == "bad_request"
    assert "'config' must be an object" in not_an_object["error"], not_an_object
    assert runner.info()["ok"]  # the process survived


# -- phase 2: arm_gemm micro-kernel forcing, per-kernel scheduling ------------------------------

# arm_gemm's fp32 kernels by role, as each release names them: an interleaved and a hybrid kernel
# eligible for any GEMM, the kernel the split scheduler test forces (20.08: the 2-D interleaved one;
# 24.11 has none), a kernel only for one-row GEMMs (20.08: M == 1; 24.11: M == 1 over several
# batches), one for a one-row fc besides the hybrid one, and one a conv's GEMM (K = 144) is not
# eligible for.
KERNELS = {
    "v20.08": dict(interleaved="sgemm_12x8_1d", for_split="sgemm_12x8_2d", hybrid="hybrid_fp32_mla_16x4",
                   one_row="sgemv_pretransposed", one_row_batches=1, fc_one_row="sgemv_pretransposed",
                   not_for_conv="sgemv_pretransposed"),
    "v24.11": dict(interleaved="a64_sgemm_8x12", for_split="a64_sgemm_8x12", hybrid="a64_hybrid_fp32_mla_6x16",
                   one_row="gemv_batched", one_row_batches=2, fc_one_row="a64_hybrid_fp32_mla_8x4",
                   not_for_conv="a64_smallK_hybrid_fp32_mla_8x4"),
}


@pytest.fixture(scope="module")
def gemm_forcing(runner):
    ext = runner.info()["extensions"]
    if not ext["gemm_forcing"]:
        pytest.skip(f"arm_gemm forcing unavailable: {ext['gemm_forcing_reason']}")
    return ext


@pytest.fixture(scope="module")
def kernels(runner):
    return KERNELS[runner.info()["acl_version"]]


@_emulated
def test_gemm_kernels_lists_candidates(runner, gemm_forcing, kernels):
    res = runner.request({"action": "gemm_kernels", "M": 196, "N": 16, "K": 144})
    assert res["ok"], res
    names = {k["name"] for k in res["kernels"]}
    assert {kernels["interleaved"], kernels["for_split"], kernels["hybrid"]} <= names
    assert res["default"] in names and kernels["one_row"] not in names
    one_row = runner.request({"action": "gemm_kernels", "M": 1, "N": 10, "K": 64, "batches": kernels["one_row_batches"]})
    assert kernels["one_row"] in {k["name"] for k in one_row["kernels"]}


@_emulated
def test_every_compatible_gemm_kernel_can_be_forced_and_is_correct(runner, gemm_forcing):
    arrays = make_arrays(CONV, seed=6)
    ref = reference(CONV, arrays)
    base, _ = run_conv(runner, CONV, arrays, method="GEMM", layout="NHWC")
    (g,) = base["gemm"]["gemms"]
    assert (g["M"], g["N"], g["K"]) == (196, 16, 144) and g["used"] == g["default"]
    assert len(g["compatible"]) >= 3
    for name in g["compatible"]:
        res, out = run_conv(runner, CONV, arrays, method="GEMM", layout="NHWC", gemm_kernel=name, threads=2)
        (used,) = res["gemm"]["gemms"]
        assert used["forced"] and used["used"] == name
        assert np.abs(out - ref).max() < 1e-4, name


@_emulated
def test_forcing_reaches_winograd_and_fc_gemms(runner, gemm_forcing, kernels):
    arrays = make_arrays(CONV, seed=7)
    res, out = run_conv(runner, CONV, arrays, method="WINOGRAD", layout="NHWC", gemm_kernel=kernels["interleaved"])
    assert res["gemm"]["gemms"][0]["multis"] > 1 and res["gemm"]["gemms"][0]["used"] == kernels["interleaved"]
    assert np.abs(out - reference(CONV, arrays)).max() < 1e-3
    rng = np.random.default_rng(8)
    x = rng.uniform(-1, 1, (1, 64)).astype(np.float32)
    w = rng.uniform(-1, 1, (10, 64)).astype(np.float32)
    for name in (kernels["fc_one_row"], kernels["hybrid"]):
        res, out = runner.run_op("fc", dict(input=[1, 64], weights=[10, 64], bias=False), dict(threads=1, gemm_kernel=name),
                                 dict(input=x, weights=w), want_output=True, min_repeats=2)
        assert res["ok"] and res["gemm"]["gemms"][0]["used"] == name, res
        assert np.abs(out - x @ w.T).max() < 1e-4


@_emulated
def test_ineligible_or_absent_gemm_kernel_is_refused(runner, gemm_forcing, kernels):
    spec = dict(CONV)
    r1 = runner.request({"action": "run", "op": "conv", **spec, "config": {"method": "GEMM", "gemm_kernel": kernels["not_for_conv"]}})
    assert not r1["ok"] and r1["error_kind"] == "unsupported" and r1["gemm"]["gemms"]
    r2 = runner.request({"action": "run", "op": "conv", **spec, "config": {"method": "DIRECT", "gemm_kernel": kernels["interleaved"]}})
    assert not r2["ok"] and r2["error_kind"] == "unsupported"
    assert runner.info()["ok"]


@_emulated
@pytest.mark.parametrize("method,layout,kernel", [("GEMM", "NCHW", ""), ("GEMM", "NHWC", "for_split"),
                                                  ("DIRECT", "NCHW", ""), ("WINOGRAD", "NHWC", "")])
def test_split_scheduler_uneven_ratios_are_correct(runner, method, layout, kernel):
    if kernel and not runner.info()["extensions"]["gemm_forcing"]:
        pytest.skip(f"arm_gemm forcing unavailable: {runner.info()['extensions']['gemm_forcing_reason']}")
    kernel = KERNELS[runner.info()["acl_version"]][kernel] if kernel else ""
    splitting_themselves = set(runner.info()["extensions"]["kernels_splitting_by_thread_id"])
    arrays = make_arrays(CONV, seed=9)
    ref = reference(CONV, arrays)
    for ratios in ([0.8, 0.2], [0.0, 1.0]):
        cfg = dict(method=method, layout=layout, threads=2, scheduler="split", split_ratios=ratios)
        if kernel:
            cfg["gemm_kernel"] = kernel
        res, out = run_conv(runner, CONV, arrays, **cfg)
        assert np.abs(out - ref).max() < TOL[method], (method, ratios)
        sched = res["scheduler"]
        assert sched["mode"] == "split" and sched["split_ratios"] == ratios and sched["kernels"]
        for k in sched["kernels"]:
            (b0, e0), (b1, e1) = k["parts"]
            # 24.11's Winograd transforms divide their work by thread id: every thread runs, whole window
            assert k["own_split"] == (k["kernel"].split("/")[0] in splitting_themselves), k
            if k["own_split"]:
                assert (b0, e0) == (b1, e1) == (0, k["iterations"]) and min(k["thread_median_us"]) > 0, k
                continue
            if k["iterations"] < 2:
                continue
            assert b0 == 0 and e0 == b1 and e1 == k["iterations"]
            expect0 = round(ratios[0] * k["iterations"])
            assert e0 == expect0, k
            if ratios[0] == 0.0:
                assert k["thread_median_us"][0] == 0.0


@_emulated
def test_record_scheduler_names_kernels_then_default_again(runner):
    arrays = make_arrays(CONV, seed=10)
    res, out = run_conv(runner, CONV, arrays, method="GEMM", layout="NCHW", threads=2, scheduler="record")
    names = [k["kernel"] for k in res["scheduler"]["kernels"]]
    # 20.08 names its kernels NE...; 24.11 runs operators' kernels named Cpu...
    assert {"NEIm2ColKernel", "CpuIm2ColKernel"} & set(names)
    assert any(n.startswith(("NEGEMMAssemblyWrapperKernel", "CpuGemmAssemblyWrapperKernel")) for n in names)
    assert all(k["calls"] == len(res["times_us"]) for k in res["scheduler"]["kernels"])
    res2, out2 = run_conv(runner, CONV, arrays, method="GEMM", layout="NCHW", threads=1)
    assert "scheduler" not in res2 and res2["threads"] == 1
    assert np.abs(out - out2).max() < 1e-4


def test_permute_changes_the_layout_and_keeps_the_values(runner):
    """The NEPermute the engine inserts between layouts, timed on its own: its output, read back
    in logical NCHW, is the input whichever way it goes."""
    x = np.random.default_rng(3).standard_normal((1, 5, 7, 9)).astype(np.float32)
    for source, target in (("NCHW", "NHWC"), ("NHWC", "NCHW")):
        res, out = runner.run_op("permute", {"input": list(x.shape)}, {"from": source, "layout": target, "threads": 2},
                                 {"input": x}, want_output=True, warmup=1, min_repeats=3)
        assert res["ok"] and res["from"] == source and res["layout"] == target and len(res["times_us"]) >= 3
        assert np.array_equal(out, x)
    same = runner.request({"action": "run", "op": "permute", "input": [1, 2, 3, 4], "config": {"from": "NHWC", "layout": "NHWC"}})
    assert not same["ok"] and same["error_kind"] == "bad_request"
    flat = runner.request({"action": "run", "op": "permute", "input": [1, 2, 3], "config": {}})
    assert not flat["ok"] and "4 integers" in flat["error"]
