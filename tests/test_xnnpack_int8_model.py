"""Whole models with int8 nodes through XNNPack's executor, on the real library: plans built as
core/precision/mixed.py builds them (the fp32 plan with some nodes run by their int8 tasks' entries, the
calibration cache in ``plan.extra["precision"]["ranges"]``) on the zoo's MobileNetV2 and
ResNet-18, against ONNX Runtime running MLAS's QDQ model of the same int8 nodes and ranges and
against the float model; 8-bit tensors kept 8-bit between int8 ops (a top-bit flip between
signed and unsigned variants); a plan with no int8 node built exactly as before; the quantize /
dequantize conversions of the label ``xnnpack:int8``; and ``kselect.tune --precision fp32,int8``
end to end."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import kselect
from kselect.core.cross_library.conversions import conversion_task
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import load_model
from kselect.core.plans.plan import Plan, plan_node, plan_task
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.mixed import mixed_plan
from kselect.plugins.mlas.int8 import quantized_model
from kselect.plugins.xnnpack import int8, kernels
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.executor import Executor
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.int8_availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

MODELS = ("mobilenetv2", "resnet18")
FEEDS = 3  # held-out feeds compared per model
OUTPUT_STEPS = 4  # allowed distance from ONNX Runtime's QDQ model, in its output quantization steps


class Setup:
    """A zoo model, its synthetic calibration (as ``kselect tune`` makes it for the zoo), the
    fp32 plan of XNNPack's defaults and its int8 tasks."""

    def __init__(self, name: str):
        self.model = load_model(name)
        self.library = XnnpackLibrary()
        self.device = this_device()
        self.calibration = calibration_for(self.model, None)
        self.ranges = compute_ranges(self.model, self.calibration)
        tasks = library_tasks(self.model, self.library, ("fp32", "int8"))
        self.fp32_tasks = [t for t in tasks if t.precision == "fp32"]
        self.int8_tasks = [t for t in tasks if t.precision == "int8"]
        entries, nodes = [], {}
        for task in self.fp32_tasks:
            config = self.library.default_config(task, self.device)
            entries.append(plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False))
            nodes.update({node: plan_node(task, "xnnpack", config) for node in task.nodes})
        level = {k: v for t in self.fp32_tasks for k, v in self.library.default_config(t, self.device).items()
                 if k in self.library.plan_level_dims}
        self.fp32_plan = Plan(model={"name": name}, device=self.device.to_json(),
                              libraries={"xnnpack": self.library.version()}, emulated=False, plan_level=level,
                              tasks=entries, nodes=nodes)
        self.feeds = self.calibration.held_out[:FEEDS]

    def int8_plan(self, nodes=None, config_of=None) -> Plan:
        """The fp32 plan with ``nodes`` (default: every node with an int8 twin) run in int8, each
        int8 task with ``config_of(task, index)`` (default: XNNPack's own int8 config)."""
        entries = {}
        for index, task in enumerate(self.int8_tasks):
            config = self.library.default_config(task, self.device)
            if config_of is not None:
                config = config_of(task, index, config)
            entries[task.key] = plan_task(task, task.nodes, "xnnpack", config, 1.0, config, 1.0, 1, False)
        if nodes is None:
            nodes = {node for task in self.int8_tasks for node in task.nodes}
        return mixed_plan(self.fp32_plan, {"int8": entries}, dict(self.fp32_plan.plan_level), dict.fromkeys(nodes, "int8"),
                          {"ranges": self.ranges, "metric": "cosine", "max_drop": 0.01})

    def run(self, plan) -> list[np.ndarray]:
        runner = self.library.model_runner(self.model, plan)
        try:
            return [runner(feed)[0] for feed in self.feeds]
        finally:
            runner.close()

    def onnxruntime(self, proto) -> list[np.ndarray]:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return [session.run(None, feed)[0] for feed in self.feeds]


_SETUPS: dict[str, Setup] = {}


def setup_of(name: str) -> Setup:
    if name not in _SETUPS:
        _SETUPS[name] = Setup(name)
    return _SETUPS[name]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def output_step(qdq: onnx.ModelProto) -> float:
    """The quantization step of the QDQ model's output: the scale of the DequantizeLinear that
    writes it, or of the one feeding the float op that does (a Softmax: ONNX Runtime quantizes
    its output to [0, 1])."""
    graph = qdq.graph
    producer = {out: node for node in graph.node for out in node.output}
    inits = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    node = producer[graph.output[0].name]
    while node.op_type != "DequantizeLinear":
        node = producer[node.input[0]]
    return float(inits[node.input[1]])


@pytest.mark.parametrize("name", MODELS)
def test_int8_plan_matches_onnxruntime_qdq_model(name):
    """Every conv / fc in int8 (XNNPack's default int8 configs: qc8 convs, qs8 fc): within a few
    output quantization steps of ONNX Runtime's QDQ model of the same nodes and ranges, and as
    close to the float model as that QDQ model is."""
    s = setup_of(name)
    plan = s.int8_plan()
    assert len(Executor(s.library, s.model, plan).int8_nodes) == sum(len(t.nodes) for t in s.int8_tasks) > 10
    ours = s.run(plan)
    qdq = quantized_model(s.model, plan)
    theirs = s.onnxruntime(qdq)
    fp32 = s.run(None)
    step = output_step(qdq)
    for a, q, f in zip(ours, theirs, fp32):
        assert np.all(np.isfinite(a))
        assert np.max(np.abs(a - q)) <= OUTPUT_STEPS * step, (np.max(np.abs(a - q)), step)
        assert cosine(a, f) > 0.98
        assert cosine(a, f) >= cosine(q, f) - 0.01
    assert np.mean([cosine(a, f) for a, f in zip(ours, fp32)]) > 0.99


@pytest.mark.parametrize("name", MODELS)
def test_int8_tensors_stay_int8_between_int8_ops(name):
    """A tensor an int8 op writes and only 8-bit readers read is never dequantized (MobileNetV2's
    expand -> depthwise -> project chains, ResNet-18's conv -> conv in a block, the residual Adds,
    the pools, a Flatten's view); a tensor an int8 op writes is dequantized once when a float op
    (the graph output here) reads it; a float tensor int8 ops read is quantized once."""
    s = setup_of(name)
    runner = s.library.model_runner(s.model, s.int8_plan())
    graph = s.model.proto.graph
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node.name)
    outputs = {o.name for o in graph.output}
    written = {name for name, t in runner.tensors.items() if t.int8_output}
    read_by_int8 = {n.input[0] for n in graph.node if n.name in runner.int8_nodes}
    eight_bit = runner.int8_nodes | set(runner.int8_ops) | set(runner.int8_activations)
    eight_bit |= {n.name for n in graph.node if n.output and n.output[0] in written}  # views of 8-bit tensors
    int8_only = {t for t in written if t not in outputs and all(r in eight_bit for r in readers[t])}
    assert int8_only, "no int8 -> int8 edge in the model"
    assert {"Add", "GlobalAveragePool"} <= {n.op_type for n in graph.node if n.name in runner.int8_ops}
    for tensor in int8_only:
        assert runner.tensors[tensor].array is None, f"{tensor} was dequantized though only int8 ops read it"
    converts = [op for op in runner._ops if isinstance(op, xa.QuantizeConvert)]
    dequantizes = [op for op in converts if op.target == np.float32]
    assert len(dequantizes) == len(written - int8_only)
    assert len(converts) - len(dequantizes) == len(read_by_int8 - written)  # all signed here: one grid each
    assert all(runner.tensors[t].array is not None for t in written - int8_only)
    runner.close()


def test_signed_and_unsigned_neighbours_flip_the_top_bit():
    """qs8 and qu8 run the same integer arithmetic on grids 128 apart: a plan alternating them
    between neighbours gives the all-qs8 plan's outputs, converting between them by a top-bit flip
    rather than a dequantize / quantize."""
    s = setup_of("mobilenetv2")

    def variant(which):
        return lambda task, index, config: {**{k: v for k, v in config.items() if k != "ukernel"},
                                            "variant": which(index)}
    all_qs8 = s.int8_plan(config_of=variant(lambda index: "qs8"))
    mixed = s.int8_plan(config_of=variant(lambda index: ("qs8", "qu8")[index % 2]))
    runner = s.library.model_runner(s.model, mixed)
    flips = [step for step in runner.steps if getattr(step[0], "__name__", "") == "_flip_step"]
    assert flips
    outputs = [runner(feed)[0] for feed in s.feeds]
    runner.close()
    for a, b in zip(outputs, s.run(all_qs8)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_tuned_int8_configs_run_in_the_model():
    """Non-default int8 configs as per-op tuning may choose them: other variants, other
    micro-kernels of the variant's family, one thread; the outputs stay close to the float model."""
    s = setup_of("mobilenetv2")
    override = kernels.int8_override_status()[0]

    def config_of(task, index, config):
        variant = "qc8" if task.kind == "fc" else int8.VARIANTS[index % 3]  # a qc8 fc: a 1x1 qc8 convolution
        config = {**{k: v for k, v in config.items() if k != "ukernel"}, "variant": variant, "threads": 1 + index % 2}
        if override:
            options = int8.kernel_options(task, variant)
            config["ukernel"] = options[index % len(options)]
        return config
    plan = s.int8_plan(config_of=config_of)
    runner = s.library.model_runner(s.model, plan)
    variants = {runner.configs[n]["variant"] for n in runner.int8_nodes}
    assert variants == set(int8.VARIANTS)
    outputs = [runner(feed)[0] for feed in s.feeds]
    runner.close()
    for a, f in zip(outputs, s.run(None)):
        assert cosine(a, f) > 0.98


@pytest.mark.parametrize("name", MODELS)
def test_plan_without_int8_nodes_runs_as_before(name):
    """Calibration ranges but no int8 node: the same operators, steps and outputs as the fp32 plan."""
    s = setup_of(name)
    with_ranges = s.int8_plan(nodes=set())
    with_ranges.extra["precision"] = {"ranges": s.ranges}
    before = s.library.model_runner(s.model, s.fp32_plan)
    after = s.library.model_runner(s.model, with_ranges)
    assert not after.int8_nodes and not after.ranges
    assert [type(op) for op in before._ops] == [type(op) for op in after._ops]
    assert after.step_nodes == before.step_nodes
    for feed in s.feeds:
        np.testing.assert_array_equal(before(feed)[0], after(feed)[0])
    before.close()
    after.close()


@pytest.mark.parametrize("direction", ["in", "out"])
def test_int8_conversions_are_measured(direction):
    """The label ``xnnpack:int8``: the executor's quantize ("in") and dequantize ("out"), within
    half a step of the values; the float side ``xnnpack:NCHW`` costs nothing more."""
    library = XnnpackLibrary()
    settings = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.0, max_time_s=0.05)
    task = conversion_task("xnnpack:int8", direction, (1, 24, 28, 28))
    result = measure_in_this_process(library, task, {}, settings, {})
    assert result.status == "ok", result.reason
    assert result.median_us > 0
    nchw = conversion_task("xnnpack:NCHW", direction, (1, 24, 28, 28))
    result = measure_in_this_process(library, nchw, {}, settings, {})
    assert result.status == "ok" and result.median_us == 0


def test_unknown_tensor_range_is_refused():
    s = setup_of("resnet18")
    plan = s.int8_plan()
    plan.extra["precision"] = {"ranges": {"data": {}}}
    with pytest.raises(KselectError, match="no range for tensor"):
        s.library.model_runner(s.model, plan)


@pytest.mark.slow
def test_kselect_tune_fp32_int8_end_to_end(tmp_path):
    """``kselect.tune(..., precision="fp32,int8")`` on XNNPack: every plan of the front runs in the
    executor; the all-int8 point matches ONNX Runtime's QDQ model of its nodes and the fp32 model."""
    s = setup_of("resnet18")
    result = kselect.tune(s.model, "xnnpack", precision="fp32,int8", budget=2, verify=False, db=tmp_path / "r.db",
                          settings=MeasureSettings(min_time_s=0.02, max_time_s=0.2, min_repeats=3))
    search = result.tunings["xnnpack"].precision
    assert "fp32" in search.plans and "int8" in search.plans
    plan = search.plans["int8"]
    nodes = {n for t in plan.tasks if t.get("precision") == "int8" for n in t["nodes"]}
    assert nodes
    ours = s.run(plan)
    qdq = quantized_model(s.model, plan)
    step = output_step(qdq)
    for a, q, f in zip(ours, s.onnxruntime(qdq), s.run(None)):
        assert np.max(np.abs(a - q)) <= OUTPUT_STEPS * step
        assert cosine(a, f) > 0.98
    for name, other in search.plans.items():
        outputs = s.run(other)
        assert all(np.all(np.isfinite(o)) for o in outputs), name
