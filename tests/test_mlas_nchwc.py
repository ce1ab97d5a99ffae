"""Tests for kselect's writer of ORT com.microsoft.nchwc nodes (kselect.plugins.mlas: layout,
rewrite, single_op and ort_session).

Those modules import no other kselect module, so these tests depend on no other kselect module.
All graphs are built here with onnx.helper and compared against the original model in ORT.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from kselect.plugins.mlas.layout import conv_takes_blocked_input, from_blocked, nchwc_block_size, nchwc_feed, to_blocked
from kselect.plugins.mlas.ort_session import (
    CONFIG_KEYS,
    DISABLE_OPTIMIZERS_KEY,
    NCHWC_DOMAIN,
    NCHWC_TRANSFORMER,
    ort_optimized,
    session_options,
)
from kselect.plugins.mlas.rewrite import anchor_inputs, rewrite_model
from kselect.plugins.mlas.single_op import reorder_model, single_conv_model

RTOL = 1e-4
ATOL = 1e-4

BLOCK = nchwc_block_size()
pytestmark = pytest.mark.skipif(BLOCK <= 1, reason="no MLAS NCHWc kernels on this CPU")


# ------------------------------------------------------------------------------------------------
# graph building
# ------------------------------------------------------------------------------------------------


class G:
    """Tiny graph builder: convs get deterministic random weights scaled to keep values O(1)."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self.n = 0

    def _name(self, p):
        self.n += 1
        return f"{p}{self.n}"

    def init(self, arr, p="w"):
        name = self._name(p)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(self, op, inputs, name=None, **attrs):
        name = name or self._name(op.lower())
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv(self, x, cin, cout, k=3, name=None, group=1, bias=True, **attrs):
        kh, kw = (k, k) if isinstance(k, int) else k
        fan_in = cin // group * kh * kw
        w = (self.rng.standard_normal((cout, cin // group, kh, kw)) / np.sqrt(fan_in)).astype(np.float32)
        ins = [x, self.init(w)]
        if bias:
            ins.append(self.init(self.rng.standard_normal(cout).astype(np.float32) * 0.1, "b"))
        if "pads" not in attrs and "auto_pad" not in attrs:
            attrs["pads"] = [kh // 2, kw // 2, (kh - 1) // 2, (kw - 1) // 2]
        if group != 1:
            attrs["group"] = group
        return self.node("Conv", ins, name=name, **attrs)

    def model(self, x_shape, outputs, opset=17):
        m = onnx.shape_inference.infer_shapes(graphs.model(self.nodes, self.inits, x_shape, outputs=outputs, opset=opset))
        onnx.checker.check_model(m)
        return m


def chain_model(c1=24, c2=51, c3=77, seed=0, n_cls=10, hw=16):
    """conv->relu->conv(stride 2)->maxpool->dwconv->conv 4x4 asym pads->add(residual)->relu->
    two 1x1 branches->concat->conv->clip->globalavgpool->flatten->gemm."""
    g = G(seed)
    t = g.conv("x", 3, c1, name="conv_a")  # first conv: 3 input channels
    t = g.node("Relu", [t], name="relu_a")
    t = g.conv(t, c1, c2, name="conv_b", strides=[2, 2])  # strided
    t = g.node("MaxPool", [t], name="pool_b", kernel_shape=[2, 2], strides=[2, 2])
    res = t
    t = g.conv(t, c2, c2, name="conv_dw", group=c2)  # depthwise
    t = g.conv(t, c2, c2, k=4, name="conv_asym", pads=[1, 1, 2, 2])  # 4x4, asymmetric pads
    t = g.node("Add", [t, res], name="add_res")
    t = g.node("Relu", [t], name="relu_res")
    br1 = g.conv(t, c2, c3, k=1, name="conv_br1")
    br2 = g.conv(t, c2, c3, k=1, name="conv_br2")
    t = g.node("Concat", [br1, br2], name="concat", axis=1)
    t = g.conv(t, 2 * c3, c3, k=3, name="conv_c")
    lo, hi = g.init(np.array(0, np.float32), "lo"), g.init(np.array(6, np.float32), "hi")
    t = g.node("Clip", [t, lo, hi], name="clip_c")
    t = g.node("GlobalAveragePool", [t], name="gap")
    t = g.node("Flatten", [t], name="flat")
    wg = g.init((g.rng.standard_normal((n_cls, c3)) / np.sqrt(c3)).astype(np.float32), "wg")
    bg = g.init(np.zeros(n_cls, np.float32), "bg")
    t = g.node("Gemm", [t, wg, bg], name="gemm", transB=1)
    return g.model((1, 3, hw, hw), [t])


CHAIN_CONVS = ["conv_a", "conv_b", "conv_dw", "conv_asym", "conv_br1", "conv_br2", "conv_c"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def run(model, feeds, rewritten=True, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if rewritten:
        session_options(so, level=level)
    else:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def ops(model):
    return [(n.domain, n.op_type) for n in model.graph.node]


def count(model, op, domain=NCHWC_DOMAIN):
    return sum(1 for n in model.graph.node if n.op_type == op and n.domain == domain)


def blocked_tensors(model):
    """Tensors of a rewritten graph that are in NCHWc layout: outputs of nchwc-domain nodes other
    than ReorderOutput, and of standard nodes reading a blocked first input (except Pad)."""
    blocked = set()
    for n in model.graph.node:
        if n.domain == NCHWC_DOMAIN:
            if n.op_type != "ReorderOutput":
                blocked.update(n.output)
        elif n.input and n.input[0] in blocked and n.op_type != "Pad":
            blocked.update(n.output)
    return blocked


def check_reorder_invariants(model):
    """No tensor is reordered twice in the same direction; no reorder undoes another one; every
    reorder reads a tensor of the layout it converts from."""
    producers = {o: n for n in model.graph.node for o in n.output}
    blocked = blocked_tensors(model)
    seen = set()
    for n in model.graph.node:
        if n.domain == NCHWC_DOMAIN and n.op_type in ("ReorderInput", "ReorderOutput"):
            key = (n.op_type, n.input[0])
            assert key not in seen, f"duplicate reorder {key}"
            seen.add(key)
            src = producers.get(n.input[0])
            if src is not None and src.op_type == "Pad":
                src = producers.get(src.input[0])
            if src is not None:
                other = "ReorderOutput" if n.op_type == "ReorderInput" else "ReorderInput"
                assert not (src.domain == NCHWC_DOMAIN and src.op_type == other), \
                    f"{src.name} -> {n.name} cancels out"
            # ReorderInput reads NCHW, ReorderOutput reads NCHWc
            assert (n.input[0] in blocked) == (n.op_type == "ReorderOutput"), n.name


def layout_changes(rewritten):
    """Independent count of layout changes in a rewritten graph: tensors read (or output) in the
    other layout than the one they are produced in, ignoring the reorder nodes themselves."""
    blocked = blocked_tensors(rewritten)
    reorder_src = {}
    for n in rewritten.graph.node:
        if n.domain == NCHWC_DOMAIN and n.op_type in ("ReorderInput", "ReorderOutput"):
            reorder_src[n.output[0]] = n.input[0]
    producers = {o: n for n in rewritten.graph.node for o in n.output}

    def origin(t):  # follow reorders/pads back to the tensor that changes layout
        while True:
            if t in reorder_src:
                t = reorder_src[t]
            elif t in producers and producers[t].op_type == "Pad" and producers[t].name.endswith(".pad_c"):
                t = producers[t].input[0]
            else:
                return t

    changed = set()
    for n in rewritten.graph.node:
        if n.domain == NCHWC_DOMAIN and n.op_type in ("ReorderInput", "ReorderOutput"):
            continue
        if n.op_type == "Pad" and n.name.endswith(".pad_c"):
            continue
        for i in n.input:
            if i and origin(i) != i:
                changed.add((origin(i), i in blocked))
    for o in rewritten.graph.output:
        if origin(o.name) != o.name:
            changed.add((origin(o.name), False))
    return len(changed)


def feeds_for(model, seed=1):
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def assert_same(model, layouts, **kw):
    info = {}
    rewritten = rewrite_model(model, layouts, BLOCK, info=info)
    onnx.checker.check_model(rewritten)
    feeds = feeds_for(model)
    ref = run(model, feeds, rewritten=False)
    got = run(rewritten, feeds)
    for r, o in zip(ref, got):
        np.testing.assert_allclose(o, r, rtol=RTOL, atol=ATOL)
    check_reorder_invariants(rewritten)
    return rewritten, info


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


def test_block_size_is_16_or_8_and_cached():
    assert BLOCK in (8, 16)
    assert nchwc_block_size() == BLOCK


def test_disable_key_really_disables_nchwc_transformer(tmp_path):
    m = chain_model(c1=32, c2=32, c3=32)
    so = session_options()
    so.optimized_model_filepath = str(tmp_path / "o.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(so.optimized_model_filepath)
    assert not any(n.domain == NCHWC_DOMAIN for n in opt.graph.node)


@pytest.mark.parametrize("chans", [(24, 51, 77), (32, 48, 64), (16, 16, 16), (8, 20, 36)])
@pytest.mark.parametrize("pattern", ["all_nchwc", "all_nchw", "alternate", "alternate_odd"])
def test_chain_matches_original(chans, pattern):
    model = chain_model(*chans)
    if pattern == "all_nchwc":
        layouts = {c: "NCHWc" for c in CHAIN_CONVS}
    elif pattern == "all_nchw":
        layouts = {c: "NCHW" for c in CHAIN_CONVS}
    else:
        start = 0 if pattern == "alternate" else 1
        layouts = {c: ("NCHWc" if i % 2 == start else "NCHW") for i, c in enumerate(CHAIN_CONVS)}
    rewritten, info = assert_same(model, layouts)
    assert not info["fallback"], info["fallback"]
    wanted = sorted(c for c, v in layouts.items() if v == "NCHWc")
    assert sorted(info["nchwc_convs"]) == wanted
    if pattern == "all_nchw":
        assert rewritten.SerializeToString() == rewrite_model(model, {}, BLOCK).SerializeToString()
        assert not any(n.domain == NCHWC_DOMAIN for n in rewritten.graph.node)
    reorders = count(rewritten, "ReorderInput") + count(rewritten, "ReorderOutput")
    assert reorders == layout_changes(rewritten)
    assert reorders == len(info["reorder_inputs"]) + len(info["reorder_outputs"])
    assert len(set(info["reorder_inputs"])) == len(info["reorder_inputs"])
    assert len(set(info["reorder_outputs"])) == len(info["reorder_outputs"])


@pytest.mark.parametrize("chans", [(24, 51, 77), (32, 48, 64)])
def test_all_nchwc_chain_has_only_the_final_reorder(chans):
    model = chain_model(*chans)
    rewritten, info = assert_same(model, {c: "NCHWc" for c in CHAIN_CONVS})
    # first conv reads the 3-channel NCHW input directly (OIHWBo), nothing else changes layout
    # until GlobalAveragePool's output goes to Flatten/Gemm -- except that a Concat of branches
    # whose channels are not block multiples must run NCHW (out, out, then in again).
    if chans[2] % BLOCK == 0:
        assert count(rewritten, "ReorderInput") == 0
        assert count(rewritten, "ReorderOutput") == 1
        assert info["reorder_outputs"] == ["gap_out"]
    else:
        assert info["reorder_inputs"] == ["concat_out"]
        assert info["reorder_outputs"] == ["conv_br1_out", "conv_br2_out", "gap_out"]
        assert info["channel_pads"] == (["concat_out"] if (2 * chans[2]) % 4 else [])
    first = next(n for n in rewritten.graph.node if n.name == "conv_a")
    assert first.domain == NCHWC_DOMAIN and first.input[0] == "x"
    # pools propagated
    assert count(rewritten, "MaxPool") == 1 and count(rewritten, "GlobalAveragePool") == 1
    # relu_a fused as activation, add_res fused as Sum input, relu_res fused after the Sum
    conv_a = {a.name: helper.get_attribute_value(a) for a in first.attribute}
    assert conv_a["activation"] == b"Relu"
    asym = next(n for n in rewritten.graph.node if n.name == "conv_asym")
    assert len(asym.input) == 4 and asym.input[3].startswith("pool_b")
    assert helper.get_attribute_value(next(a for a in asym.attribute if a.name == "activation")) == b"Relu"
    conv_c = next(n for n in rewritten.graph.node if n.name == "conv_c")
    attrs = {a.name: helper.get_attribute_value(a) for a in conv_c.attribute}
    assert attrs["activation"] == b"Clip" and list(attrs["activation_params"]) == [0.0, 6.0]
    assert info["fused"] == {"conv_a": ["relu_a"], "conv_asym": ["add_res", "relu_res"], "conv_c": ["clip_c"]}
    std_ops = {op for d, op in ops(rewritten) if d == ""}
    assert std_ops == {"Concat", "Flatten", "Gemm"} | ({"Pad"} if info["channel_pads"] else set())
    concat = next(n for n in rewritten.graph.node if n.op_type == "Concat")
    # Concat runs blocked only when every branch's channel count is a block multiple
    assert concat.input[0].endswith(".nchwc") == (chans[2] % BLOCK == 0)


def test_weight_formats_and_padding():
    model = chain_model(24, 51, 77)
    rewritten = rewrite_model(model, {c: "NCHWc" for c in CHAIN_CONVS}, BLOCK)
    inits = {t.name: t for t in rewritten.graph.initializer}
    nodes = {n.name: n for n in rewritten.graph.node}
    pad = lambda c: -(-c // BLOCK) * BLOCK  # noqa: E731
    # first conv: OIHWBo, input channels 3 kept, outputs padded
    assert list(inits[nodes["conv_a"].input[1]].dims) == [pad(24), 3, 3, 3]
    # next conv reads the padded 24-channel tensor: OIHWBiBo with padded input channels
    assert list(inits[nodes["conv_b"].input[1]].dims) == [pad(51), pad(24), 3, 3]
    assert list(inits[nodes["conv_b"].input[2]].dims) == [pad(51)]
    # depthwise: OIHWBo, group = padded channels
    dw = nodes["conv_dw"]
    assert list(inits[dw.input[1]].dims) == [pad(51), 1, 3, 3]
    assert helper.get_attribute_value(next(a for a in dw.attribute if a.name == "group")) == pad(51)
    # original (unpacked) weights and the fused Clip's bounds are gone; a bias whose channels
    # need no padding (24 with AVX2's block of 8) is used as it is
    kept = {"b2"} if 24 % BLOCK == 0 else set()
    assert all(n.endswith(".nchwc") or n.startswith(("wg", "bg")) or n.endswith("_pads") or n in kept
               for n in inits), inits


def test_packed_weights_equal_ort_own_reorder(tmp_path):
    """Our packed weights are bit-identical to what ORT's NchwcTransformer writes."""
    g = G(3)
    g.conv("x", 3, 40, name="c0")  # first conv: OIHWBo, padded output channels
    t = g.conv("x", 3, 2 * BLOCK, name="c2", bias=False)
    t2 = g.conv(t, 2 * BLOCK, 3 * BLOCK, name="c3")  # OIHWBiBo
    t3 = g.conv(t2, 3 * BLOCK, 3 * BLOCK, name="c4", group=3 * BLOCK)  # depthwise: OIHWBo
    model = g.model((1, 3, 8, 8), [t3, "c0_out"])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    theirs = onnx.load(so.optimized_model_filepath)
    ours = rewrite_model(model, {c: "NCHWc" for c in ("c0", "c2", "c3", "c4")}, BLOCK)
    t_inits = {t.name: numpy_helper.to_array(t) for t in theirs.graph.initializer}
    o_inits = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    theirs_w = [t_inits[n.input[1]] for n in theirs.graph.node
                if n.domain == NCHWC_DOMAIN and n.op_type == "Conv"]
    ours_convs = [n for n in ours.graph.node if n.domain == NCHWC_DOMAIN and n.op_type == "Conv"]
    assert len(ours_convs) == 4
    for n in ours_convs:
        w = o_inits[n.input[1]]
        assert any(t.shape == w.shape and np.array_equal(t, w) for t in theirs_w), n.name


def test_mixed_layout_counts_exactly():
    """Alternating layouts on a simple conv chain: one reorder per layout change."""
    g = G(5)
    t = "x"
    names = []
    for i in range(6):
        t = g.conv(t, 32, 32, name=f"c{i}")
        t = g.node("Relu", [t], name=f"r{i}")
        names.append(f"c{i}")
    model = g.model((1, 32, 12, 12), [t])
    # c0 NCHWc, c1 NCHW, c2 NCHWc, c3 NCHWc, c4 NCHW, c5 NCHW
    layouts = dict(zip(names, ["NCHWc", "NCHW", "NCHWc", "NCHWc", "NCHW", "NCHW"]))
    rewritten, info = assert_same(model, layouts)
    # x -> in (c0), r0 -> out (c1), r1 -> in (c2), r3 -> out (c4)
    assert count(rewritten, "ReorderInput") == 2
    assert count(rewritten, "ReorderOutput") == 2
    assert info["reorder_inputs"] == ["x", "r1_out"]
    assert info["reorder_outputs"] == ["r0_out", "r3_out"]
    # all NCHWc: one in, one out (graph output)
    rewritten, info = assert_same(model, {n: "NCHWc" for n in names})
    assert (count(rewritten, "ReorderInput"), count(rewritten, "ReorderOutput")) == (1, 1)


def test_shared_reorders_for_fanout():
    """A blocked tensor read by two NCHW consumers gets one ReorderOutput; an NCHW tensor read by
    two NCHWc convs gets one ReorderInput; a tensor that is also a graph output is reordered once."""
    g = G(7)
    a = g.conv("x", 32, 32, name="ca")
    b1 = g.conv(a, 32, 32, name="cb1")
    b2 = g.conv(a, 32, 32, name="cb2")
    s = g.node("Add", [b1, b2], name="add")
    model = g.model((1, 32, 10, 10), [s, a])
    rewritten, info = assert_same(model, {"ca": "NCHWc"})
    assert info["reorder_outputs"] == ["ca_out"] and count(rewritten, "ReorderOutput") == 1
    rewritten, info = assert_same(model, {"cb1": "NCHWc", "cb2": "NCHWc"})
    assert info["reorder_inputs"] == ["ca_out"] and count(rewritten, "ReorderInput") == 1
    # the Add of two blocked conv outputs is fused into one conv as its Sum input
    assert info["fused"] == {"cb2": ["add"]} or info["fused"] == {"cb1": ["add"]}
    assert count(rewritten, "ReorderOutput") == 1


def test_residual_sum_reading_its_own_input():
    """conv(a) + a: the Sum input is also the conv's X (must not be overwritten in place)."""
    g = G(8)
    a = g.conv("x", 3, 32, name="c0")
    c = g.conv(a, 32, 32, name="c1")
    s = g.node("Add", [c, a], name="add")
    r = g.node("Relu", [s], name="relu")
    model = g.model((1, 3, 9, 9), [r])
    rewritten, info = assert_same(model, {"c0": "NCHWc", "c1": "NCHWc"})
    assert info["fused"] == {"c1": ["add", "relu"]}


@pytest.mark.parametrize("cin", [3, 6, 51, 77, 20])
def test_reorder_of_unaligned_channels(cin):
    """Tensors with C % 4 != 0 get a channel Pad before ReorderInput; results still match."""
    g = G(9)
    t = g.conv("x", cin, cin, name="c_nchw")  # stays NCHW
    t = g.conv(t, cin, cin, name="c_blk", group=cin)  # depthwise NCHWc: needs a blocked input
    t = g.conv(t, cin, 24, name="c_blk2")
    model = g.model((1, cin, 7, 7), [t])
    rewritten, info = assert_same(model, {"c_blk": "NCHWc", "c_blk2": "NCHWc"})
    assert info["channel_pads"] == (["c_nchw_out"] if cin % 4 else [])
    assert info["reorder_inputs"] == ["c_nchw_out"]


def test_grouped_and_unsupported_fall_back():
    g = G(10)
    t = g.conv("x", 32, 32, name="grp_ok", group=2)  # 16 in / 16 out per group
    t = g.conv(t, 32, 48, name="grp_bad", group=4)  # 8 in / 12 out per group
    t = g.conv(t, 48, 96, name="dw_mult", group=48)  # depthwise with multiplier 2
    model = g.model((1, 32, 8, 8), [t])
    rewritten, info = assert_same(model, {"grp_ok": "NCHWc", "grp_bad": "NCHWc", "dw_mult": "NCHWc"})
    assert info["nchwc_convs"] == ["grp_ok"]
    assert set(info["fallback"]) == {"grp_bad", "dw_mult"}
    with pytest.raises(ValueError):
        rewrite_model(model, {"grp_bad": "NCHWc"}, BLOCK, strict=True)


def test_ops_not_propagated_and_broadcast_add():
    """Broadcast Add, Mul with a vector and a Sigmoid/LeakyRelu unfused path."""
    g = G(11)
    a = g.conv("x", 16, 32, name="c0")
    s = g.node("Sigmoid", [a], name="sig")  # fusable (single use): activation Sigmoid
    c = g.conv(s, 32, 32, name="c1")
    lr = g.node("LeakyRelu", [c], name="lrelu", alpha=0.2)
    side = g.node("Tanh", [c], name="tanh")  # c has 2 readers: no fusion, elementwise blocked
    m = g.node("Mul", [lr, side], name="mul")  # same shape: blocked Mul
    bias = g.init(np.full((1, 32, 1, 1), 0.5, np.float32), "bb")
    ba = g.node("Add", [m, bias], name="badd")  # broadcast: NCHW
    p = g.node("AveragePool", [ba], name="ap", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    model = g.model((1, 16, 8, 8), [p])
    rewritten, info = assert_same(model, {"c0": "NCHWc", "c1": "NCHWc"})
    assert info["fused"] == {"c0": ["sig"]}
    assert set(info["blocked_ops"]) == {"lrelu", "tanh", "mul"}
    assert info["reorder_outputs"] == ["mul_out"]
    assert count(rewritten, "AveragePool") == 0  # input is NCHW: pool stays NCHW


@pytest.mark.parametrize(
    "cin,cout,k,attrs",
    [
        (3, 24, 3, {"pads": [1, 1, 1, 1]}),  # first conv, NCHW input
        (24, 51, 3, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
        (32, 32, 1, {}),  # pointwise
        (51, 51, 3, {"pads": [1, 1, 1, 1], "group": 51}),  # depthwise, unaligned
        (48, 48, 5, {"pads": [2, 2, 2, 2], "group": 48, "strides": [2, 2]}),
        (32, 77, 4, {"pads": [1, 1, 2, 2]}),  # asymmetric pads
        (16, 32, 3, {"auto_pad": "SAME_UPPER"}),
        (16, 32, 3, {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
        (64, 64, 3, {"pads": [1, 1, 1, 1], "group": 2}),
    ],
)
@pytest.mark.parametrize("activation", [None, "Relu"])
def test_single_conv_model_matches_reference(cin, cout, k, attrs, activation):
    rng = np.random.default_rng(cin * 1000 + cout)
    group = attrs.get("group", 1)
    w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((1, cin, 11, 13)).astype(np.float32)
    ref_model, in_ref, out_ref = single_conv_model(attrs, x.shape, w, b, "NCHW", BLOCK,
                                                         activation=activation)
    onnx.checker.check_model(ref_model)
    (ref,) = run(ref_model, {"x": x})
    assert ref.shape == out_ref and in_ref == x.shape
    model, in_shape, out_shape = single_conv_model(attrs, x.shape, w, b, "NCHWc", BLOCK,
                                                         activation=activation)
    onnx.checker.check_model(model)
    assert all(n.domain == NCHWC_DOMAIN for n in model.graph.node)
    blocked_in = conv_takes_blocked_input(cin, group, BLOCK)
    feed = nchwc_feed(x, BLOCK) if blocked_in else x
    assert feed.shape == in_shape
    if blocked_in:
        np.testing.assert_array_equal(feed, to_blocked(x, BLOCK).reshape(in_shape))
    (y,) = run(model, {"x": feed})
    assert y.shape == out_shape and out_shape[1] % BLOCK == 0
    np.testing.assert_allclose(from_blocked(y, cout, BLOCK), ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(from_blocked(y.reshape(out_shape[0], -1, *out_shape[2:], BLOCK), cout),
                               ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shape", [(1, 32, 5, 7), (2, 24, 3, 3), (1, 51, 4, 4), (1, 3, 6, 6)])
def test_reorder_model_roundtrip(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    m_in, s_in, s_out = reorder_model(shape, "NCHW->NCHWc", BLOCK)
    onnx.checker.check_model(m_in)
    assert s_in == shape
    (yb,) = run(m_in, {"x": x})
    assert yb.shape == s_out
    np.testing.assert_array_equal(yb, nchwc_feed(x, BLOCK))
    m_out, s_in2, s_out2 = reorder_model(shape, "NCHWc->NCHW", BLOCK)
    onnx.checker.check_model(m_out)
    assert s_in2 == s_out and s_out2 == shape
    (back,) = run(m_out, {"x": yb})
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(from_blocked(to_blocked(x, BLOCK), shape[1]), x)


def test_config_keys_exist_in_binary():
    so_path = Path(ort.__file__).parent / "capi"
    blobs = list(so_path.glob("onnxruntime_pybind11_state*.so")) + list(so_path.glob("libonnxruntime.so*"))
    data = b"".join(p.read_bytes() for p in blobs)
    for key in itertools.chain(CONFIG_KEYS, [DISABLE_OPTIMIZERS_KEY]):
        assert key.encode() in data, key
    assert NCHWC_TRANSFORMER.encode() in data


@pytest.mark.parametrize("level", ["BASIC", "EXTENDED"])
def test_rewrite_of_ort_preoptimized_model(tmp_path, level):
    """Conv+BN folded by ORT (BASIC), or Conv+BN+Relu -> FusedConv (EXTENDED), then rewritten."""
    g = G(12)

    def bn(x, c, name):
        rng = g.rng
        ins = [g.init((rng.random(c) + 0.5).astype(np.float32)), g.init(rng.random(c).astype(np.float32)),
               g.init(rng.random(c).astype(np.float32)), g.init((rng.random(c) + 0.5).astype(np.float32))]
        return g.node("BatchNormalization", [x] + ins, name=name)

    a = g.node("Relu", [bn(g.conv("x", 3, 32, name="c0", bias=False), 32, "bn0")], name="r0")
    b = bn(g.conv(a, 32, 32, name="c1", bias=False), 32, "bn1")
    b = g.node("Relu", [g.node("Add", [b, a], name="add")], name="r1")
    model = g.model((1, 3, 10, 10), [b])
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level}")
    so.optimized_model_filepath = str(tmp_path / "pre.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    pre = onnx.load(so.optimized_model_filepath)
    info = {}
    rewritten = rewrite_model(pre, {"c0": "NCHWc", "c1": "NCHWc"}, BLOCK, info=info)
    onnx.checker.check_model(rewritten)
    assert [n.op_type for n in rewritten.graph.node] == ["Conv", "Conv", "ReorderOutput"]
    assert info["fused"]["c1"] == ["add", "r1"]
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(rewritten, feeds)[0], run(model, feeds, rewritten=False)[0],
                               rtol=RTOL, atol=ATOL)


def segment_like_model():
    """What a plan across libraries hands ONNX Runtime after another library's segment: the
    residual branch arrives as a graph input, read by a conv and by the Add after it."""
    g = G(11)
    c = g.conv("x", 32, 32, name="c1")
    s = g.node("Add", [c, "x"], name="add")
    r = g.node("Relu", [s], name="relu")
    return g.model((1, 32, 9, 9), [r])


def test_a_residual_branch_arriving_as_a_graph_input_stays_blocked_in_onnxruntimes_own_transformer():
    model = segment_like_model()
    plain, anchored = ort_optimized(model), ort_optimized(anchor_inputs(model, BLOCK))
    assert ("", "Add") in ops(plain)  # ORT alone leaves the Add in NCHW, with reorders around it
    assert ("", "Add") not in ops(anchored) and ops(anchored).count((NCHWC_DOMAIN, "Conv")) == 1
    assert sum(op == "ReorderInput" for _, op in ops(anchored)) == 1
    feeds = feeds_for(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(anchor_inputs(model, BLOCK).SerializeToString(), so,
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=RTOL, atol=ATOL)


def test_the_rewriter_blocks_graph_inputs_that_an_add_reads_when_asked():
    model = segment_like_model()
    info = {}
    rewrite_model(model, {"c1": "NCHWc"}, BLOCK, info=info)
    assert info["fused"] == {}
    blocked_info = {}
    rewritten = rewrite_model(model, {"c1": "NCHWc"}, BLOCK, info=blocked_info, block_inputs=True)
    assert blocked_info["fused"] == {"c1": ["add", "relu"]} and blocked_info["reorder_inputs"] == ["x"]
    feeds = feeds_for(model)
    np.testing.assert_allclose(run(rewritten, feeds)[0], run(model, feeds, rewritten=False)[0], rtol=RTOL, atol=ATOL)
    check_reorder_invariants(rewritten)
