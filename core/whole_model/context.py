"""Op costs in context: per-node times of whole runs, and the corrections the planner learns from them.

An op timed alone runs with cold caches, its own thread wake-up and no neighbours to fuse with;
in the model it runs warm, fused, sometimes in a layout the runtime chose. Summed isolated times
therefore mispredict whole models, and not by one factor: the int8 ops of a small classifier may
gain more in context than its fp32 ops, its quantize / dequantize steps cost what no isolated
conversion shows.

A library's runner times each node of a whole run of a plan (``Library.node_times``: ONNX
Runtime's profiler for MLAS, the XNNPack and oneDNN executors' steps timed in place).
``in_context`` maps those times onto the model: each tuned node with the nodes of its activation
(fused or not) and the dequantize of its output; the quantize / dequantize nodes of other tensors
as conversions; the rest of the whole run (untuned nodes, reorders the runtime inserted, the time
between nodes) as untuned.

``ContextCorrection`` is what a precision front learns from two such runs, the fp32 plan and the
plan with every op in its least precise form: per op and precision, the ratio of its time in
context to its isolated time; the untuned nodes' time in both runs; and the ratio of the reduced
run's conversions to those the planner counts for it. A point of the front is then predicted as
the untuned time (moving from the fp32 run's toward the reduced run's with its share of reduced
ops), plus each op's isolated time in its precision times its ratio (an op in a precision neither
run used takes its fp32 ratio), plus the planner's conversions times their ratio: both runs are
reproduced, and the points between them are predictions. ``core/whole_model/prediction.py``
predicts a whole model measured end to end from a plan measured in the same race plus the
difference of two such figures.

``op_ratios`` is what a plan across libraries learns from each library's own plan run whole: per
tuned node, its time in that run over its isolated time. The planner scales every option of that
library on that node by it before choosing, so that a library whose runner fuses and overlaps
(OpenVINO: its isolated ops summed to 1.7x its whole run on resnet18) is not ranked by the times
its ops take alone.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field

from kselect.core.models.tasks import find_ops

IN_CONTEXT = "ops and conversions, corrected in context"  # a plan's PREDICTED_BASIS (core/plans/plan.py)
CONTEXT_RUNS = 20  # whole runs timed per node for a correction, each plan in a fresh process

# What runtimes append to a node's name when they rewrite it (ONNX Runtime: the NCHWc transformer,
# the QDQ fusions, generated names), stripped one at a time until a name of the model is found.
_SUFFIXES = re.compile(r"(_nchwc|_quant|_fused|_token_\d+|_\d+|_QuantizeLinear|_DequantizeLinear)$")
# A quantize or dequantize node a quantizer or runtime inserted (onnxruntime.quantization names
# them after their tensor).
_CONVERSION = re.compile(r"(QuantizeLinear|DequantizeLinear)")


@dataclass
class InContext:
    whole_us: float  # the median whole run
    ops_us: dict[str, float] = field(default_factory=dict)  # tuned node -> its time, its activation included
    conversions_us: float = 0.0  # quantize / dequantize nodes the runtime runs between ops
    untuned_us: float = 0.0  # the rest of the run: untuned nodes, inserted reorders, the time between nodes

    def to_json(self) -> dict:
        return {"whole_us": round(self.whole_us, 1), "ops_us": {n: round(us, 1) for n, us in self.ops_us.items()},
                "conversions_us": round(self.conversions_us, 1), "untuned_us": round(self.untuned_us, 1)}


def owners(model, ops: list | None = None) -> dict[str, str]:
    """Every name that stands for a tuned node or a node of its activation (node names and
    output tensor names) -> that tuned node; every other node's names -> that node. ``ops``: the
    model's tunable ops (core/models/tasks.find_ops), when the caller has them."""
    found: dict[str, str] = {}
    by_name = {node.name: node for node in model.proto.graph.node}
    for op in find_ops(model) if ops is None else ops:
        for name in [op.node, *op.epilogue_nodes]:
            found[name] = op.node
            for output in by_name[name].output if name in by_name else ():
                found[output] = op.node
    for node in model.proto.graph.node:
        found.setdefault(node.name, node.name)
        for output in node.output:
            found.setdefault(output, node.name)
    return found


def resolve(runtime_name: str, names: dict[str, str]) -> str | None:
    """The model's node a runtime's node name stands for (``owners``), stripping the suffixes
    runtimes append; None for a node the runtime made up (a reorder, an inserted quantize)."""
    name = runtime_name
    while True:
        if name in names:
            return names[name]
        shorter = _SUFFIXES.sub("", name)
        if shorter == name:
            return None
        name = shorter


def in_context(model, whole_us: float, per_node: dict[str, float]) -> InContext:
    """A runner's per-node times of one whole run (runtime node name -> us) mapped onto the
    model (``owners``): a tuned node's own, its activation's and its output's dequantize go to
    it; the quantize / dequantize of other tensors are conversions; the rest is untuned."""
    ops = find_ops(model)
    names, tuned = owners(model, ops), {op.node for op in ops}
    run = InContext(whole_us)
    for runtime_name, us in per_node.items():
        node = resolve(runtime_name, names)
        if node in tuned:
            run.ops_us[node] = run.ops_us.get(node, 0.0) + us
        elif _CONVERSION.search(runtime_name):
            run.conversions_us += us
    # what the nodes' times leave of the whole run (negative where a profiler's nodes read longer
    # than the plain run they stand for)
    run.untuned_us = whole_us - sum(run.ops_us.values()) - run.conversions_us
    return run


@dataclass
class ContextCorrection:
    """What a front learns from its fp32 run and its least precise run (module docstring)."""

    ratios: dict[tuple[str, str], float]  # (node, precision) -> time in context / isolated time
    untuned_us: tuple[float, float]  # the untuned nodes' time in the fp32 run and in the reduced run
    conversion_ratio: float  # the reduced run's conversions / the planner's conversions for it
    runs: dict[str, dict] = field(default_factory=dict)  # the two runs, as measured (JSON)

    @classmethod
    def learn(cls, fp32_run: InContext, reduced_run: InContext, isolated: dict[tuple[str, str], float],
              reduced_precisions: dict[str, str], reduced_conversions_us: float) -> "ContextCorrection":
        """``isolated``: (node, precision) -> the op's isolated time; ``reduced_precisions``: each
        reduced node's precision in the reduced run; ``reduced_conversions_us``: the conversions
        the planner counts for it. A runner that times no conversion of its own (it counts them in
        the ops they feed) leaves the planner's conversions out (ratio 0)."""
        ratios = {}
        for run, precisions in ((fp32_run, {}), (reduced_run, reduced_precisions)):
            for node, us in run.ops_us.items():
                key = (node, precisions.get(node, "fp32"))
                if isolated.get(key):
                    ratios[key] = us / isolated[key]
        conversion_ratio = reduced_run.conversions_us / reduced_conversions_us if reduced_conversions_us > 0 else 0.0
        return cls(ratios, (fp32_run.untuned_us, reduced_run.untuned_us), conversion_ratio,
                   {"fp32": fp32_run.to_json(), "reduced": reduced_run.to_json()})

    def ratio(self, node: str, precision: str) -> float:
        """The op's ratio in that precision; else its fp32 ratio; else the median fp32 ratio."""
        if (node, precision) in self.ratios:
            return self.ratios[(node, precision)]
        if (node, "fp32") in self.ratios:
            return self.ratios[(node, "fp32")]
        fp32 = [r for (_, p), r in self.ratios.items() if p == "fp32"]
        return statistics.median(fp32) if fp32 else 1.0

    def predicted_us(self, ops: dict[str, tuple[str, float]], conversions_us: float) -> float:
        """A plan's time in context: ``ops`` node -> (precision, isolated us), ``conversions_us``
        the planner's conversions for it. The untuned nodes' time moves from the fp32 run's to the
        reduced run's with the share of ops in a reduced precision (their neighbours decide
        whether they run 8-bit or float)."""
        reduced_share = sum(precision != "fp32" for precision, _ in ops.values()) / max(len(ops), 1)
        untuned = self.untuned_us[0] + reduced_share * (self.untuned_us[1] - self.untuned_us[0])
        return (untuned + sum(self.ratio(node, precision) * us for node, (precision, us) in ops.items())
                + self.conversion_ratio * conversions_us)

    def to_json(self) -> dict:
        return {"untuned_us": [round(us, 1) for us in self.untuned_us],
                "conversion_ratio": round(self.conversion_ratio, 4),
                "op_ratio_median": round(statistics.median(self.ratios.values()), 4) if self.ratios else None,
                "runs": self.runs}


def op_ratios(run: InContext, isolated_us: dict[str, float]) -> dict[str, float]:
    """Per tuned node of ``run`` with an isolated time (``isolated_us``: node -> us of the config
    the run used), its time in the run over that isolated time."""
    return {node: us / isolated_us[node] for node, us in run.ops_us.items() if isolated_us.get(node)}


def timed_runs(runner, feeds: list[dict], runs: int) -> list[float]:
    """One warm-up run of each feed, then ``runs`` timed runs (us) on the feeds in turn: how a
    runner's whole run is timed beside its per-node times (``Library.node_times``)."""
    for feed in feeds:
        runner(feed)
    times = []
    for index in range(runs):
        start = time.perf_counter()
        runner(feeds[index % len(feeds)])
        times.append((time.perf_counter() - start) * 1e6)
    return times
