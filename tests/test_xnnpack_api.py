"""XNNPack ctypes binding: every operator against a numpy reference, at 1 and 2 threads."""
from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from kselect.plugins.xnnpack import xnnpack_api as xa

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

RTOL, ATOL = 1e-4, 1e-4


# ------------------------------------------------------------------ numpy references

def ref_conv_nhwc(x, w_oihw, b, stride=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0), groups=1):
    """x NHWC, w OIHW, pads (top, left, bottom, right) -> NHWC (float64 accumulate)."""
    t, l, bo, r = pads
    x = np.pad(x.astype(np.float64), ((0, 0), (t, bo), (l, r), (0, 0)))
    n, h, wd, c = x.shape
    o, ig, kh, kw = w_oihw.shape
    sh, sw = stride
    dh, dw = dilation
    oh = (h - ((kh - 1) * dh + 1)) // sh + 1
    ow = (wd - ((kw - 1) * dw + 1)) // sw + 1
    og = o // groups
    out = np.zeros((n, oh, ow, o))
    for g in range(groups):
        wg = w_oihw[g * og:(g + 1) * og].astype(np.float64)  # og, ig, kh, kw
        for ky in range(kh):
            for kx in range(kw):
                patch = x[:, ky * dh: ky * dh + (oh - 1) * sh + 1: sh,
                          kx * dw: kx * dw + (ow - 1) * sw + 1: sw, g * ig:(g + 1) * ig]
                out[..., g * og:(g + 1) * og] += patch @ wg[:, :, ky, kx].T
    if b is not None:
        out += b
    return out.astype(np.float32)


def ref_pool(x, k, s, pads, mode, dilation=(1, 1)):
    t, l, bo, r = pads
    n, h, w, c = x.shape
    fill = -np.inf if mode == "max" else 0.0
    xp = np.pad(x.astype(np.float64), ((0, 0), (t, bo), (l, r), (0, 0)), constant_values=fill)
    valid = np.pad(np.ones((h, w)), ((t, bo), (l, r)))
    kh, kw = k
    dh, dw = dilation
    oh = (h + t + bo - ((kh - 1) * dh + 1)) // s[0] + 1
    ow = (w + l + r - ((kw - 1) * dw + 1)) // s[1] + 1
    acc = np.full((n, oh, ow, c), -np.inf) if mode == "max" else np.zeros((n, oh, ow, c))
    cnt = np.zeros((oh, ow))
    for ky in range(kh):
        for kx in range(kw):
            sl = (slice(ky * dh, ky * dh + (oh - 1) * s[0] + 1, s[0]),
                  slice(kx * dw, kx * dw + (ow - 1) * s[1] + 1, s[1]))
            patch = xp[:, sl[0], sl[1], :]
            if mode == "max":
                acc = np.maximum(acc, patch)
            else:
                acc += patch
                cnt += valid[sl[0], sl[1]]
    if mode == "avg":
        acc /= cnt[None, :, :, None]  # count_include_pad = 0
    return acc.astype(np.float32)


def rnd(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ fixtures

@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def pool(request):
    if request.param == 1:
        yield None
    else:
        with xa.Threadpool(request.param) as tp:
            assert tp.threads_count == request.param
            yield tp


# ------------------------------------------------------------------ library / errors

def test_availability_and_version():
    ok, reason = xa.availability()
    assert ok and "libxnnpack0" in reason
    v = xa.library_version()
    assert v and "20220216" in v


def test_status_is_translated():
    with pytest.raises(xa.XNNPackError) as ei:
        xa.Clamp(8, 1.0, 0.0)  # min >= max
    assert ei.value.status_name == "xnn_status_invalid_parameter"
    assert "xnn_create_clamp_nc_f32" in str(ei.value)


def test_close_is_idempotent_and_context_manager():
    with xa.Clamp(4, 0.0, 6.0) as op:
        assert op.run(np.ones((2, 4), np.float32)).shape == (2, 4)
    op.close()
    with pytest.raises(ValueError):
        op.run(np.ones((2, 4), np.float32))
    op2 = xa.Softmax(3)
    del op2
    gc.collect()


def test_input_validation():
    op = xa.Clamp(4, 0.0, 1.0)
    with pytest.raises(TypeError):
        op.run(np.ones((2, 4), np.float64))
    with pytest.raises(ValueError):
        op.run(np.ones((4, 2), np.float32)[:, :1])


# ------------------------------------------------------------------ convolution NHWC

CONV_CASES = [
    # (cin, cout, k, stride, dilation, pads(t,l,b,r), groups, H, W)
    (8, 16, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1, 9, 11),
    (8, 16, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 1, 10, 9),
    (4, 6, (3, 3), (2, 2), (1, 1), (0, 1, 1, 0), 1, 9, 8),      # asymmetric pads
    (16, 24, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 1, 7, 7),     # GEMM path
    (16, 8, (1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 1, 8, 8),      # 1x1 stride 2 -> IGEMM
    (3, 8, (7, 7), (2, 2), (1, 1), (3, 3, 3, 3), 1, 16, 16),     # ResNet stem shape
    (8, 8, (3, 5), (1, 2), (2, 1), (2, 0, 1, 3), 1, 12, 13),     # dilation + odd everything
    (8, 12, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 4, 6, 6),      # grouped
    (32, 32, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 32, 10, 10),  # depthwise
    (32, 32, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 32, 11, 11),  # depthwise stride 2
    (24, 24, (3, 3), (2, 2), (1, 1), (0, 0, 1, 1), 24, 10, 10),  # depthwise asym pads (TF SAME)
    (20, 20, (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), 20, 9, 9),    # depthwise 5x5
    (16, 32, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 16, 6, 6),    # depthwise multiplier 2
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"c{c[0]}o{c[1]}k{c[2][0]}{c[2][1]}s{c[3][0]}{c[3][1]}g{c[6]}p{''.join(map(str, c[5]))}")
def test_conv_nhwc(case, pool):
    cin, cout, k, s, d, pads, g, h, w = case
    wt = rnd(cout, cin // g, *k, seed=1) * 0.2
    b = rnd(cout, seed=2)
    x = rnd(2, h, w, cin, seed=3)
    with xa.Convolution2DNHWC(wt, b, stride=s, dilation=d, padding=pads, groups=g,
                              threadpool=pool) as op:
        y = op.run(x)
        ref = ref_conv_nhwc(x, wt, b, s, d, pads, g)
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=RTOL, atol=ATOL)
        # reuse with a caller-provided output and a different batch
        out = np.empty(op.output_shape((1, h, w, cin)), np.float32)
        y1 = op.run(np.ascontiguousarray(x[1:]), out=out)
        assert y1 is out
        np.testing.assert_allclose(y1, ref[1:], rtol=RTOL, atol=ATOL)


def test_conv_nhwc_ohwi_layout_clamp_and_depthwise_flag(pool):
    wt = rnd(8, 4, 3, 3, seed=4)
    b = rnd(8, seed=5)
    x = rnd(1, 7, 7, 4, seed=6)
    ref = np.clip(ref_conv_nhwc(x, wt, b, pads=(1, 1, 1, 1)), 0.0, 6.0)
    op = xa.Convolution2DNHWC(np.ascontiguousarray(wt.transpose(0, 2, 3, 1)), b, padding=1,
                              weight_layout="OHWI", output_min=0.0, output_max=6.0, threadpool=pool)
    np.testing.assert_allclose(op.run(x), ref, rtol=RTOL, atol=ATOL)
    op.close()
    wd = rnd(16, 1, 3, 3, seed=7)
    xd = rnd(1, 8, 8, 16, seed=8)
    op = xa.Convolution2DNHWC(wd, None, padding=1, groups=16, depthwise_flag=True, threadpool=pool)
    np.testing.assert_allclose(op.run(xd), ref_conv_nhwc(xd, wd, None, pads=(1, 1, 1, 1), groups=16),
                               rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ convolution NCHW

NCHW_OK = [
    # (cin, cout, k, stride, pads, groups, input_nhwc, path)
    (16, 24, (1, 1), (1, 1), (0, 0, 0, 0), 1, False, "spmm"),
    (3, 16, (3, 3), (2, 2), (1, 1, 1, 1), 1, True, "conv2d_hwc2chw"),
    (16, 16, (3, 3), (1, 1), (1, 1, 1, 1), 16, False, "dwconv2d_chw_3x3"),
    (16, 16, (3, 3), (2, 2), (1, 1, 1, 1), 16, False, "dwconv2d_chw_3x3s2"),
    (16, 16, (3, 3), (2, 2), (0, 1, 1, 1), 16, False, "dwconv2d_chw_3x3s2"),
    (8, 8, (5, 5), (1, 1), (2, 2, 2, 2), 8, False, "dwconv2d_chw_5x5"),
    (8, 8, (5, 5), (2, 2), (1, 2, 2, 2), 8, False, "dwconv2d_chw_5x5s2"),
]


@pytest.mark.parametrize("case", NCHW_OK, ids=lambda c: c[7] + ("_top0" if c[4][0] in (0,) and c[2][0] == 3 and c[3][0] == 2 else "") + ("_top1" if c[2][0] == 5 and c[3][0] == 2 else ""))
def test_conv_nchw_supported(case, pool):
    cin, cout, k, s, pads, g, nhwc, path = case
    wt = rnd(cout, cin // g, *k, seed=9) * 0.2
    b = rnd(cout, seed=10)
    h, w = 13, 14
    x_nhwc = rnd(2, h, w, cin, seed=11)
    op = xa.Convolution2DNCHW(wt, b, stride=s, padding=pads, groups=g, input_nhwc=nhwc,
                              threadpool=pool)
    assert op.path == path
    x = x_nhwc if nhwc else np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))
    y = op.run(x)
    ref = ref_conv_nhwc(x_nhwc, wt, b, s, (1, 1), pads, g).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=ATOL)
    op.close()


def test_conv_nchw_sparse_weights(pool):
    rng = np.random.default_rng(0)
    wt = rnd(32, 16, 1, 1, seed=12)
    wt[rng.random(wt.shape) < 0.8] = 0.0
    x = rnd(1, 16, 9, 9, seed=13)
    op = xa.Convolution2DNCHW(wt, None, threadpool=pool)
    ref = ref_conv_nhwc(x.transpose(0, 2, 3, 1).copy(), wt, None).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(op.run(x), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kw", [
    dict(cin=16, cout=16, k=3, s=1, pads=1, g=1),            # dense 3x3
    dict(cin=16, cout=16, k=3, s=1, pads=(0, 1, 1, 1), g=16),  # dw 3x3 s1 top pad 0
    dict(cin=16, cout=16, k=3, s=2, pads=(2, 1, 1, 1), g=16),  # dw 3x3 s2 top pad 2
    dict(cin=16, cout=16, k=7, s=1, pads=3, g=16),           # dw 7x7
    dict(cin=16, cout=32, k=1, s=2, pads=0, g=1),            # 1x1 stride 2
    dict(cin=16, cout=32, k=1, s=1, pads=0, g=2),            # grouped 1x1
])
def test_conv_nchw_unsupported_is_clean(kw):
    ok, why = xa.nchw_convolution_supported(kw["k"], kw["s"], 1, kw["pads"], kw["g"], kw["cin"], kw["cout"])
    assert not ok and "unsupported" in why
    wt = rnd(kw["cout"], kw["cin"] // kw["g"], kw["k"], kw["k"], seed=14)
    with pytest.raises(xa.XNNPackError) as ei:
        xa.Convolution2DNCHW(wt, None, stride=kw["s"], padding=kw["pads"], groups=kw["g"])
    assert ei.value.status_name == "xnn_status_unsupported_parameter"


# ------------------------------------------------------------------ fully connected

@pytest.mark.parametrize("batch", [1, 5])
def test_fully_connected(batch, pool):
    w = rnd(10, 64, seed=15)
    b = rnd(10, seed=16)
    x = rnd(batch, 64, seed=17)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    with xa.FullyConnected(w, b, threadpool=pool) as op:
        np.testing.assert_allclose(op.run(x), ref, rtol=RTOL, atol=ATOL)
    with xa.FullyConnected(np.ascontiguousarray(w.T), None, transpose_weights=True,
                           output_min=0.0, threadpool=pool) as op:
        np.testing.assert_allclose(op.run(x), np.maximum(ref - b, 0), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ pooling

@pytest.mark.parametrize("k,s,pads,dil", [
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),   # ResNet max pool
    ((2, 2), (2, 2), (0, 0, 0, 0), (1, 1)),
    ((3, 3), (1, 1), (0, 1, 2, 1), (1, 1)),   # asymmetric
    ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),   # dilated
    ((5, 5), (1, 1), (2, 2, 2, 2), (1, 1)),   # multipass (25 > 9)
])
def test_max_pooling(k, s, pads, dil, pool):
    x = rnd(2, 11, 12, 20, seed=18)
    op = xa.MaxPooling2D(20, k, stride=s, padding=pads, dilation=dil, threadpool=pool)
    np.testing.assert_array_equal(op.run(x), ref_pool(x, k, s, pads, "max", dil))


@pytest.mark.parametrize("k,s,pads", [
    ((3, 3), (2, 2), (1, 1, 1, 1)),
    ((2, 2), (2, 2), (0, 0, 0, 0)),
    ((3, 3), (1, 1), (0, 1, 2, 1)),
    ((5, 5), (2, 2), (2, 2, 2, 2)),   # multipass, with padding (pixelwise divisor)
    ((4, 4), (1, 1), (0, 0, 0, 0)),   # multipass without padding
])
def test_average_pooling(k, s, pads, pool):
    x = rnd(2, 11, 12, 20, seed=19)
    op = xa.AveragePooling2D(20, k, stride=s, padding=pads, threadpool=pool)
    np.testing.assert_allclose(op.run(x), ref_pool(x, k, s, pads, "avg"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shape", [(2, 7, 7, 48), (1, 5, 33), (3, 1, 1, 10)])
def test_global_average_pooling(shape, pool):
    x = rnd(*shape, seed=20)
    op = xa.GlobalAveragePooling(shape[-1], threadpool=pool)
    ref = x.reshape(shape[0], -1, shape[-1]).astype(np.float64).mean(axis=1)
    np.testing.assert_allclose(op.run(x), ref, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ elementwise

@pytest.mark.parametrize("sa,sb", [
    ((2, 5, 6, 16), (2, 5, 6, 16)),
    ((2, 5, 6, 16), (16,)),
    ((2, 1, 6, 1), (1, 5, 1, 4)),
    ((3,), (2, 3)),
])
def test_add(sa, sb, pool):
    a, b = rnd(*sa, seed=21), rnd(*sb, seed=22)
    with xa.Add(threadpool=pool) as op:
        np.testing.assert_allclose(op.run(a, b), a + b, rtol=1e-6, atol=1e-6)
    with xa.Add(output_min=0.0, threadpool=pool) as op:  # fused relu
        np.testing.assert_allclose(op.run(a, b), np.maximum(a + b, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lo,hi", [(0.0, math.inf), (0.0, 6.0), (-1.0, 0.5)])
def test_clamp(lo, hi, pool):
    x = rnd(4, 9, 37, seed=23) * 4
    op = xa.Clamp(37, lo, hi, threadpool=pool)
    np.testing.assert_array_equal(op.run(x), np.clip(x, lo, hi))


@pytest.mark.parametrize("shape", [(1, 1000), (7, 10), (2, 3, 33)])
def test_softmax(shape, pool):
    x = rnd(*shape, seed=24) * 5
    op = xa.Softmax(shape[-1], threadpool=pool)
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(op.run(x), e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ concatenation

@pytest.mark.parametrize("shapes,axis", [
    ([(2, 5, 6, 8), (2, 5, 6, 16), (2, 5, 6, 3)], -1),  # NHWC channel concat
    ([(2, 8, 5, 6), (2, 4, 5, 6)], 1),                  # NCHW channel concat
    ([(3, 4), (2, 4)], 0),
    ([(2, 3, 4), (2, 1, 4), (2, 5, 4)], 1),
])
def test_concatenate(shapes, axis, pool):
    xs = [rnd(*s, seed=25 + i) for i, s in enumerate(shapes)]
    with xa.Concatenate(shapes, axis, threadpool=pool) as op:
        np.testing.assert_array_equal(op.run(xs), np.concatenate(xs, axis=axis))
        out = np.zeros(op.output_shape, np.float32)
        assert op.run(xs, out=out) is out
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=axis))


# ------------------------------------------------------------------ micro-kernel override

from kselect.plugins.xnnpack import ukernel_catalog, ukernel_forcing, ukernel_probes, ukernel_table  # noqa: E402

_UK_OK, _UK_REASON = ukernel_table.availability() if _OK else (False, _REASON)
uk_only = pytest.mark.skipif(not _UK_OK, reason=f"micro-kernel override unavailable: {_UK_REASON}")


@uk_only
def test_ukernels_table_located_and_consistent():
    b = ukernel_table.verify_build()
    assert b.params_addr - b.base == 0xE89A0
    snap = ukernel_table.snapshot(b)
    # XNNPack's own pick for the CPU: 7x16 avx512f, else 5x16 fma3 (4x16s4 on Zen 1), else avx
    isa = ukernel_catalog.tier_isa("default", ukernel_probes.cpu_flags())
    assert snap["gemm"]["names"]["igemm"].startswith("xnn_f32_igemm_minmax_ukernel_")
    assert snap["gemm"]["names"]["igemm"].split("__")[1].split("_")[0] == isa
    assert [d["primary_tile"] for d in snap["dwconv"]] == [3, 4, 9, 25]


def test_ukernels_refused_in_process():
    with pytest.raises(ukernel_table.OverrideRefused):
        ukernel_forcing.forced_kernels(None, None)


@uk_only
def test_ukernels_forced_in_child_match_numpy():
    cat = ukernel_catalog.catalog()
    names = {c.id for kind in cat.values() for c in kind}
    for n in ("xnn_f32_igemm_minmax_ukernel_5x16__fma3_broadcast",
              "xnn_f32_igemm_minmax_ukernel_4x16s4__fma3_broadcast",
              "xnn_f32_gemm_minmax_ukernel_4x8__sse_load1",
              "xnn_f32_dwconv_minmax_ukernel_up8x9__sse"):
        assert n in names
    pick = {c.id: c for kind in cat.values() for c in kind}
    conv = {"op": "conv", "cin": 16, "cout": 24, "k": 3, "pad": 1, "stride": 2, "h": 15, "w": 13}
    r = ukernel_forcing.run_candidate(conv, pick["xnn_f32_igemm_minmax_ukernel_4x16s4__fma3_broadcast"], reps=2)
    assert r["ok"], r
    assert "xnn_f32_igemm_minmax_ukernel_4x16s4__fma3_broadcast" in r["kernels_in_operator"]
    dw = {"op": "conv", "cin": 24, "cout": 24, "k": 3, "pad": 1, "groups": 24, "h": 9, "w": 9}
    r = ukernel_forcing.run_candidate(dw, pick["xnn_f32_dwconv_minmax_ukernel_up8x9__sse"], threads=2, reps=2)
    assert r["ok"] and r["kernels_in_operator"] == ["xnn_f32_dwconv_minmax_ukernel_up8x9__sse"], r


@pytest.mark.parametrize("patch,expect", [
    ("xa.LIBXNNPACK = 'libXNNPACK_missing.so.0'", "libxnnpack0 not installed"),
    ("xa.REQUIRED_SYMBOLS.append('xnn_no_such_symbol')", "xnn_no_such_symbol"),
])
def test_availability_reasons(patch, expect):
    import subprocess
    import sys
    code = ("from kselect.plugins.xnnpack import xnnpack_api as xa\n" + patch + "\n"
            "ok, why = xa.availability()\nassert not ok, why\nprint(why)\n"
            "try:\n    xa.Clamp(4)\nexcept xa.XNNPackUnavailable as e:\n    print('raised', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expect in out.stdout and "raised" in out.stdout
    if "missing" in patch:
        assert "apt-get install libxnnpack-dev" in out.stdout
