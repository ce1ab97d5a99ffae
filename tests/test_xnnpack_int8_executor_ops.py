"""XNNPack's executor running the ops between int8 conv / fc nodes in 8 bits, on the real library:
small models with every conv / fc in int8 (plans as core/precision/mixed.py builds them), where a MaxPool,
a residual Add (with and without a folded Relu) and a GlobalAveragePool (or a spatial ReduceMean)
read only 8-bit tensors int8 ops wrote. Each such node is XNNPack's 8-bit operator, nothing before
it is dequantized, and the outputs match ONNX Runtime's QDQ model of the same plan and its float
model; an Add of a signed and an unsigned branch stays float; the plan's int8 nodes are still only
the conv / fc ones."""

from __future__ import annotations

import graphs
import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from test_xnnpack_int8 import variant_config
from test_xnnpack_int8_model import output_step

from kselect.core.measuring.device import this_device
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import model_from_proto
from kselect.core.plans.plan import Plan, int8_nodes, plan_node, plan_task
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.mixed import mixed_plan
from kselect.plugins.mlas.int8 import quantized_model
from kselect.plugins.xnnpack import int8
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.int8_graph_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

# Allowed distances, in steps of the output's grid (the scale of the QDQ model's output DequantizeLinear).
# From ONNX Runtime's QDQ model of the plan: qc8 quantizes weights per channel as that model does (its
# outputs matched it exactly here), qs8 / qu8 take one weight scale, the largest channel's (2-3 steps
# apart here; 4 as in test_xnnpack_int8_model.py).
QDQ_STEPS = {"qc8": 1, "qs8": 4, "qu8": 4}
# From the float model, on the feeds the ranges were calibrated on: each grid on the way rounds once
# (up to 3.4 steps measured here), and never more than 1 step farther than the QDQ model is.
FLOAT_STEPS = 4


class Graph:
    """A small onnx.helper model under construction: convs with random weights, other nodes."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []

    def conv(self, name, x, cin, cout, k, relu=False, stride=1):
        w = (self.rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = (0.1 * self.rng.standard_normal(cout)).astype(np.float32)
        self.inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")]
        self.nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.out"], name=name,
                                           kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride]))
        if not relu:
            return f"{name}.out"
        self.nodes.append(helper.make_node("Relu", [f"{name}.out"], [f"{name}.relu"], name=f"{name}.relu"))
        return f"{name}.relu"

    def gemm(self, name, x, cin, cout):
        w = (self.rng.standard_normal((cout, cin)) / np.sqrt(cin)).astype(np.float32)
        b = (0.1 * self.rng.standard_normal(cout)).astype(np.float32)
        self.inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")]
        self.nodes.append(helper.make_node("Gemm", [x, f"{name}.w", f"{name}.b"], [f"{name}.out"], name=name,
                                           transB=1))
        return f"{name}.out"

    def node(self, op_type, inputs, name, **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [f"{name}.out"], name=name, **attrs))
        return f"{name}.out"

    def model(self, name, x_shape, y, y_shape):
        return model_from_proto(name, graphs.model(self.nodes, self.inits, x_shape, outputs=[y], output_shapes=[y_shape],
                                                   opset=13, name=name))


def maxpool_model():
    """conv + Relu -> MaxPool 3x3/s2 -> conv."""
    g = Graph(0)
    a = g.conv("conv1", "x", 8, 16, 3, relu=True)
    p = g.node("MaxPool", [a], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    y = g.conv("conv2", p, 16, 8, 3)
    return g.model("maxpool", [1, 8, 12, 12], y, [1, 8, 6, 6]), "pool"


def add_model(relu: bool):
    """Two conv branches of one input -> Add (-> Relu) -> conv."""
    g = Graph(1)
    a = g.conv("conv_a", "x", 8, 16, 3)
    b = g.conv("conv_b", "x", 8, 16, 1)
    s = g.node("Add", [a, b], "add")
    if relu:
        s = g.node("Relu", [s], "add.relu")
    y = g.conv("conv_c", s, 16, 8, 3)
    return g.model("add", [1, 8, 10, 10], y, [1, 8, 10, 10]), "add"


def pooled_model(head: str):
    """conv + Relu -> GlobalAveragePool -> Flatten -> Gemm, -> 1x1 conv, or a ReduceMean over H and W
    (keepdims 0) -> Gemm."""
    g = Graph(2)
    a = g.conv("conv1", "x", 8, 32, 3, relu=True, stride=2)
    if head == "reducemean":
        p = g.node("ReduceMean", [a], "pool", axes=[2, 3], keepdims=0)
        return g.model("reducemean", [1, 8, 14, 14], g.gemm("fc", p, 32, 10), [1, 10]), "pool"
    p = g.node("GlobalAveragePool", [a], "pool")
    if head == "conv":
        return g.model("gap_conv", [1, 8, 14, 14], g.conv("conv2", p, 32, 10, 1), [1, 10, 1, 1]), "pool"
    f = g.node("Flatten", [p], "flatten", axis=1)
    return g.model("gap_fc", [1, 8, 14, 14], g.gemm("fc", f, 32, 10), [1, 10]), "pool"


class Setup:
    """A model, calibrated on random feeds, its fp32 plan of XNNPack's defaults and that plan with
    every conv / fc in int8 at ``variants`` (one per int8 task in graph order, cycled)."""

    def __init__(self, model, variants, seed: int = 3):
        self.model = model
        self.library = XnnpackLibrary()
        rng = np.random.default_rng(seed)
        shape = list(model.input_shapes["x"])
        feeds = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(12)]
        self.calibration = calibration_for(model, feeds)
        ranges = compute_ranges(model, self.calibration)
        device = this_device()
        tasks = library_tasks(model, self.library, ("fp32", "int8"))
        fp32 = [t for t in tasks if t.precision == "fp32"]
        twins = [t for t in tasks if t.precision == "int8"]
        assert len(twins) == len(fp32) > 0
        entries, nodes = [], {}
        for task in fp32:
            config = self.library.default_config(task, device)
            entries.append(plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False))
            nodes.update({node: plan_node(task, "xnnpack", config) for node in task.nodes})
        level = {k: v for t in fp32 for k, v in self.library.default_config(t, device).items()
                 if k in self.library.plan_level_dims}
        self.fp32_plan = Plan(model={"name": model.name}, device=device.to_json(),
                              libraries={"xnnpack": self.library.version()}, emulated=False, plan_level=level,
                              tasks=entries, nodes=nodes)
        order = {node.name: k for k, node in enumerate(model.proto.graph.node)}
        twins.sort(key=lambda t: order[t.nodes[0]])
        int8_entries = {}
        for k, task in enumerate(twins):
            config = variant_config(self.library, task, variants[k % len(variants)])
            int8_entries[task.key] = plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False)
        self.int8_tasks = twins
        self.plan = mixed_plan(self.fp32_plan, {"int8": int8_entries}, dict(level), {n: "int8" for t in twins for n in t.nodes},
                               {"ranges": ranges, "metric": "cosine", "max_drop": 0.01})

    def session(self, proto) -> ort.InferenceSession:
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def operators_of(runner, node: str) -> list:
    """The operators the executor runs for ``node``, in order."""
    by_handle = {op.handle: op for op in runner._ops if hasattr(op, "handle")}
    return [by_handle.get(a) for (fn, a, _), (name, _) in zip(runner.steps, runner.step_nodes)
            if name == node and fn is runner.run_operator]


def dequantized(runner) -> list:
    return [op for op in runner._ops if isinstance(op, xa.QuantizeConvert) and op.target == np.float32]


def check_outputs(s: Setup, runner, variant: str) -> None:
    """Within QDQ_STEPS of ONNX Runtime's QDQ model of the plan on every feed; on the calibration
    feeds within FLOAT_STEPS of ONNX Runtime's float model and at most 1 step farther from it than
    the QDQ model (held-out feeds may leave the ranges and clip, as in any static quantization)."""
    qdq = quantized_model(s.model, s.plan)
    step = output_step(qdq)
    reference, quantized = s.session(s.model.proto), s.session(qdq)
    for feed in s.calibration.calibrate + s.calibration.held_out:
        ours = runner(feed)[0]
        assert np.all(np.isfinite(ours))
        assert np.max(np.abs(ours - quantized.run(None, feed)[0])) <= QDQ_STEPS[variant] * step * 1.001
    ours, theirs = 0.0, 0.0
    for feed in s.calibration.calibrate:
        expected = reference.run(None, feed)[0]
        ours = max(ours, np.max(np.abs(runner(feed)[0] - expected)))
        theirs = max(theirs, np.max(np.abs(quantized.run(None, feed)[0] - expected)))
    assert 0 < ours <= FLOAT_STEPS * step
    assert ours <= theirs + step


def datatype(variant: str) -> str:
    return "qu8" if variant == "qu8" else "qs8"


@pytest.mark.parametrize("kind", ["qs8", "qu8"])
def test_8_bit_operators_against_numpy(kind):
    """The bindings on their own, grids with different scales and zero points: the add and the global
    average pooling within one step of the exact result on the output grid, the max pooling (3x3,
    stride 2, padded: padding never wins) exact."""
    rng = np.random.default_rng(5)
    dtype = xa.int8_dtype(kind)
    low, high = (-128, 127) if kind == "qs8" else (0, 255)
    a, b = (rng.integers(low, high + 1, (2, 5, 6, 16)).astype(dtype) for _ in range(2))
    shift = 128 if kind == "qs8" else 0
    (za, sa), (zb, sb), (zy, sy) = (131 - shift, 0.05), (121 - shift, 0.03), (129 - shift, 0.07)

    def on_output_grid(real):
        return np.clip(np.round(real / sy) + zy, low, high)
    with xa.QAdd(kind, za, sa, zb, sb, zy, sy, low, high) as op:
        out = np.empty_like(a)
        op.setup(a, b, out)
        op.execute()
    exact = on_output_grid((a.astype(np.float64) - za) * sa + (b.astype(np.float64) - zb) * sb)
    assert np.max(np.abs(out - exact)) <= 1
    with xa.QGlobalAveragePooling(kind, 16, za, sa, zy, sy) as op:
        out = np.empty((2, 16), dtype)
        op.setup(a, out)
        op.execute()
    assert np.max(np.abs(out - on_output_grid(((a.astype(np.float64) - za) * sa).mean(axis=(1, 2))))) <= 1
    with xa.QMaxPooling2D(kind, 16, (3, 3), stride=(2, 2), padding=(1, 1, 1, 1)) as op:
        out = np.empty(op.output_shape(a.shape), dtype)
        op.setup(a, out)
        op.execute()
    padded = np.full((2, 7, 8, 16), low - 1, np.int64)
    padded[:, 1:6, 1:7] = a
    exact = np.array([[padded[:, 2 * y:2 * y + 3, 2 * x:2 * x + 3].max(axis=(1, 2)) for x in range(out.shape[2])]
                      for y in range(out.shape[1])]).transpose(2, 0, 1, 3)
    np.testing.assert_array_equal(out, exact)


@pytest.mark.parametrize("variant", int8.VARIANTS)
def test_maxpool_between_int8_convs_runs_in_8_bits(variant):
    """The MaxPool is XNNPack's 8-bit max pooling on the conv's output grid (no quantization of its
    own); the next conv reads its output on that grid, with no conversion in between."""
    model, pool = maxpool_model()
    s = Setup(model, [variant])
    runner = s.library.model_runner(model, s.plan)
    try:
        assert runner.int8_nodes == int8_nodes(s.plan) == {"conv1", "conv2"}
        assert runner.int8_ops == {pool: datatype(variant)}
        assert [type(op) for op in operators_of(runner, pool)] == [xa.QMaxPooling2D]
        assert runner.tensors["conv1.relu"].array is None and runner.tensors["pool.out"].array is None
        written = next(iter(runner.tensors["conv1.relu"].q))
        assert next(iter(runner.tensors["pool.out"].q)) == written  # max pooling keeps the grid
        assert [op.target for op in runner._ops if isinstance(op, xa.QuantizeConvert)] == \
            [xa.int8_dtype(variant), np.float32]  # the model's input quantized, its output dequantized
        check_outputs(s, runner, variant)
    finally:
        runner.close()


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("relu", [False, True])
def test_residual_add_of_int8_branches_runs_in_8_bits(variant, relu):
    """The Add of two int8 conv branches is XNNPack's 8-bit add from both branches' grids onto its
    output's calibrated range (a following Relu folded into its clamp), read by the next int8 conv
    without conversion."""
    model, add = add_model(relu)
    s = Setup(model, [variant])
    runner = s.library.model_runner(model, s.plan)
    try:
        assert runner.int8_nodes == int8_nodes(s.plan) == {"conv_a", "conv_b", "conv_c"}
        assert runner.int8_ops == {add: datatype(variant)}
        assert [type(op) for op in operators_of(runner, add)] == [xa.QAdd]
        out = "add.relu.out" if relu else "add.out"
        for tensor in ("conv_a.out", "conv_b.out", out):
            assert runner.tensors[tensor].array is None, f"{tensor} was dequantized"
        scale, zero_point = runner.calibrated(out)
        signed = variant != "qu8"
        assert next(iter(runner.tensors[out].q)) == (signed, scale, zero_point)
        assert len(dequantized(runner)) == 1  # the model's output
        assert "add.relu" not in {name for name, _ in runner.step_nodes}  # folded: no operator of its own
        check_outputs(s, runner, variant)
    finally:
        runner.close()


def test_add_of_a_signed_and_an_unsigned_branch_flips_the_top_bit():
    """qs8 and qu8 branches share their grids 128 apart: the Add reads the unsigned one with its
    top bit flipped and runs on the first input's signedness, dequantizing nothing."""
    model, add = add_model(relu=True)
    s = Setup(model, ["qs8", "qu8", "qs8"])
    assert [s.plan.nodes[t.nodes[0]]["config"]["variant"] for t in s.int8_tasks] == ["qs8", "qu8", "qs8"]
    runner = s.library.model_runner(model, s.plan)
    try:
        assert runner.int8_ops == {add: "qs8"}
        assert [type(op) for op in operators_of(runner, add)] == [xa.QAdd]
        assert len(dequantized(runner)) == 1  # the model's output only
        check_outputs(s, runner, "qs8")
    finally:
        runner.close()


@pytest.mark.parametrize("variant", int8.VARIANTS)
@pytest.mark.parametrize("head", ["flatten-gemm", "conv", "reducemean"])
def test_global_average_pool_after_int8_conv_runs_in_8_bits(variant, head):
    """The GlobalAveragePool (or spatial ReduceMean) is XNNPack's 8-bit global average pooling from
    the conv's grid onto its output's calibrated range; a Flatten after it moves no data and keeps
    that grid, so the int8 fc (or 1x1 conv) reads it without conversion."""
    model, pool = pooled_model(head)
    s = Setup(model, [variant])
    runner = s.library.model_runner(model, s.plan)
    try:
        head_node = "conv2" if head == "conv" else "fc"
        assert runner.int8_nodes == int8_nodes(s.plan) == {"conv1", head_node}
        assert runner.int8_ops == {pool: datatype(variant)}
        assert [type(op) for op in operators_of(runner, pool)] == [xa.QGlobalAveragePooling]
        read = ["conv1.relu", "pool.out"] + (["flatten.out"] if head == "flatten-gemm" else [])
        for tensor in read:
            assert runner.tensors[tensor].array is None, f"{tensor} was dequantized"
        signed = variant != "qu8"
        assert next(iter(runner.tensors["pool.out"].q)) == (signed, *runner.calibrated("pool.out"))
        assert [op.target for op in runner._ops if isinstance(op, xa.QuantizeConvert)] == \
            [xa.int8_dtype(variant), np.float32]
        check_outputs(s, runner, variant)
    finally:
        runner.close()


@pytest.mark.parametrize("variant", ["qc8", "qu8"])
def test_flatten_of_an_int8_feature_map_feeds_int8_fc_without_conversion(variant):
    """conv -> Flatten of a 3x3 map -> Gemm: the Flatten is a view of the conv's 8-bit output in its
    NHWC order (the fc's weight columns permuted), on the conv's grid: no operator, no conversion."""
    g = Graph(4)
    a = g.conv("conv1", "x", 8, 6, 3, relu=True, stride=2)
    f = g.node("Flatten", [a], "flatten", axis=1)
    model = g.model("flatten_fc", [1, 8, 6, 6], g.gemm("fc", f, 6 * 3 * 3, 10), [1, 10])
    s = Setup(model, [variant])
    runner = s.library.model_runner(model, s.plan)
    try:
        assert runner.int8_nodes == {"conv1", "fc"} and runner.int8_ops == {}
        assert "flatten" not in {name for name, _ in runner.step_nodes}
        flat = runner.tensors["flatten.out"]
        assert flat.array is None and flat.perm == (6, 3, 3)
        assert next(iter(flat.q)) == next(iter(runner.tensors["conv1.relu"].q))
        assert [op.target for op in runner._ops if isinstance(op, xa.QuantizeConvert)] == \
            [xa.int8_dtype(variant), np.float32]
        check_outputs(s, runner, variant)
    finally:
        runner.close()


@pytest.mark.parametrize("build", [maxpool_model, lambda: add_model(True), lambda: pooled_model("flatten-gemm")])
def test_fp32_plan_builds_no_8_bit_operator(build):
    """The same models with no int8 node: float operators only, no 8-bit op, as before."""
    model, node = build()
    s = Setup(model, ["qs8"])
    runner = s.library.model_runner(model, s.fp32_plan)
    try:
        assert not runner.int8_nodes and not runner.int8_ops and not runner.grids
        assert not any(isinstance(op, (xa.QuantizeConvert, xa.QAdd, xa.QMaxPooling2D, xa.QGlobalAveragePooling))
                       for op in runner._ops)
        feed = s.calibration.held_out[0]
        np.testing.assert_allclose(runner(feed)[0], s.session(model.proto).run(None, feed)[0], atol=1e-5)
    finally:
        runner.close()
