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

``ContextCorrection`` is what a precision front learns from such runs: the fp32 plan, the plan
with every op in its least precise form, and, where that one mixes int8 with a half precision,
the plan with every op in the half precision too: per op and precision, the ratio of its time
in context to its isolated time; the untuned nodes' time in each run; and the ratio of the
reduced run's conversions to those the planner counts for it. A point of the front is then
predicted as the untuned time (moving from the fp32 run's with the point's shares of int8 ops
and of half-precision ops, at the rates the runs show), plus each op's isolated time in its
precision times its ratio (an op in a precision no run used takes its fp32 ratio), plus the
planner's conversions times their ratio: the runs are reproduced, and the points between them
are predictions. The half run is needed where a library runs a half precision through the
whole graph: OpenVINO's bf16 ops and untuned ops in context are far faster than their isolated
times, which a ratio learned from an int8 run, or the fp32 ratio, does not know.
``core/whole_model/prediction.py`` predicts a whole model measured end to end from a plan
measured in the same race plus the difference of two such figures.

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
# Fresh processes per plan for a precision front's correction, the plans taking turns: one
# process's 20 runs read one period of a noisy machine (a plan's whole run can differ by a third
# between two processes), the median over rounds does not.
CONTEXT_ROUNDS = 3

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


def median_run(runs: list[InContext]) -> InContext:
    """Per field and per node, the median over runs of one plan (each in its own process)."""
    nodes = dict.fromkeys(node for run in runs for node in run.ops_us)
    return InContext(statistics.median(r.whole_us for r in runs),
                     {node: statistics.median(r.ops_us[node] for r in runs if node in r.ops_us) for node in nodes},
                     statistics.median(r.conversions_us for r in runs), statistics.median(r.untuned_us for r in runs))


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
    """What a front learns from its fp32 run, its least precise run and its half run (module docstring)."""

    ratios: dict[tuple[str, str], float]  # (node, precision) -> time in context / isolated time
    untuned_us: tuple[float, float]  # the untuned nodes' time in the fp32 run and in the reduced run
    conversion_ratio: float  # the reduced run's conversions / the planner's conversions for it
    runs: dict[str, dict] = field(default_factory=dict)  # the runs, as measured (JSON)
    # the untuned time's change per share of ops in a half precision and per share in int8 (us):
    # None, one rate for any reduced op (the reduced run's change over its share)
    untuned_rates: tuple[float, float] | None = None
    untuned_bounds: tuple[float, float] = (float("-inf"), float("inf"))  # the runs' least and most
    # (node, half precision) -> its ratio in the half run, where the reduced run has one too: a
    # point's ratio moves from this one to the reduced run's with its share of int8 ops
    half_ratios: dict[tuple[str, str], float] = field(default_factory=dict)
    reduced_int8_share: float = 0.0

    @classmethod
    def learn(cls, fp32_run: InContext, reduced_run: InContext, isolated: dict[tuple[str, str], float],
              reduced_precisions: dict[str, str], reduced_conversions_us: float,
              half: tuple[InContext, dict[str, str]] | None = None) -> "ContextCorrection":
        """``isolated``: (node, precision) -> the op's isolated time; ``reduced_precisions``: each
        reduced node's precision in the reduced run; ``reduced_conversions_us``: the conversions
        the planner counts for it; ``half``: the run with every op in a half precision and each
        node's precision in it. A runner that times no conversion of its own (it counts them in
        the ops they feed) leaves the planner's conversions out (ratio 0)."""
        def ratios_in(run: InContext, precisions: dict[str, str]) -> dict[tuple[str, str], float]:
            keys = {node: (node, precisions.get(node, "fp32")) for node in run.ops_us}
            return {key: run.ops_us[node] / isolated[key] for node, key in keys.items() if isolated.get(key)}

        ratios = {**ratios_in(fp32_run, {}), **ratios_in(reduced_run, reduced_precisions)}
        in_half_run = ratios_in(half[0], half[1]) if half else {}
        half_ratios = {key: r for key, r in in_half_run.items() if key[1] != "fp32" and key in ratios}
        ratios = {**in_half_run, **ratios}
        conversion_ratio = reduced_run.conversions_us / reduced_conversions_us if reduced_conversions_us > 0 else 0.0
        measured = {"fp32": fp32_run.to_json(), "reduced": reduced_run.to_json()}
        correction = cls(ratios, (fp32_run.untuned_us, reduced_run.untuned_us), conversion_ratio, measured)
        if half:
            half_run, half_precisions = half
            measured["half"] = half_run.to_json()
            nodes = len({node for node, _ in isolated}) or 1  # the planner's tuned ops
            half_share = len(half_precisions) / nodes
            in_half, in_int8 = shares(reduced_precisions, nodes)
            if half_share > 0:
                per_half = (half_run.untuned_us - fp32_run.untuned_us) / half_share
                per_int8 = ((reduced_run.untuned_us - fp32_run.untuned_us - per_half * in_half) / in_int8
                            if in_int8 > 0 else per_half)
                correction.untuned_rates = (per_half, per_int8)
                untuned = (fp32_run.untuned_us, reduced_run.untuned_us, half_run.untuned_us)
                correction.untuned_bounds = (min(untuned), max(untuned))
            if in_int8 > 0:
                correction.half_ratios, correction.reduced_int8_share = half_ratios, in_int8
        return correction

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
        whether they run 8-bit or float); learned with a half run too, at the rates the runs show
        per share of half-precision ops and of int8 ops, within the runs' least and most, and a
        half-precision op's ratio moves from its half run's to its reduced run's with the share
        of int8 ops (its neighbours in int8 or in the half precision)."""
        in_half, in_int8 = shares({node: p for node, (p, _) in ops.items()}, max(len(ops), 1))
        if self.untuned_rates is None:
            untuned = self.untuned_us[0] + (in_half + in_int8) * (self.untuned_us[1] - self.untuned_us[0])
        else:
            untuned = self.untuned_us[0] + in_half * self.untuned_rates[0] + in_int8 * self.untuned_rates[1]
            untuned = min(max(untuned, self.untuned_bounds[0]), self.untuned_bounds[1])  # no run read beyond
        toward_reduced = min(1.0, in_int8 / self.reduced_int8_share) if self.reduced_int8_share else 1.0

        def ratio(node: str, precision: str) -> float:
            reduced = self.ratio(node, precision)
            half = self.half_ratios.get((node, precision), reduced)
            return half + toward_reduced * (reduced - half)
        return (untuned + sum(ratio(node, precision) * us for node, (precision, us) in ops.items())
                + self.conversion_ratio * conversions_us)

    def to_json(self) -> dict:
        rates = {} if self.untuned_rates is None else {
            "untuned_us_per_share": {"half": round(self.untuned_rates[0], 1), "int8": round(self.untuned_rates[1], 1)}}
        return {"untuned_us": [round(us, 1) for us in self.untuned_us], **rates,
                "conversion_ratio": round(self.conversion_ratio, 4),
                "op_ratio_median": round(statistics.median(self.ratios.values()), 4) if self.ratios else None,
                "runs": self.runs}


def shares(precisions: dict[str, str], nodes: int) -> tuple[float, float]:
    """The shares of ``nodes`` tuned ops in a half precision and in int8 (``precisions``: node ->
    precision; fp32 nodes may be left out)."""
    half = sum(p not in ("fp32", "int8") for p in precisions.values())
    return half / nodes, sum(p == "int8" for p in precisions.values()) / nodes


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
