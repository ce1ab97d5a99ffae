"""Mixed precision: which ops of a library's plan run in a reduced precision (int8, bf16, fp16),
under an accuracy budget.

The flow (NNCF's accuracy-controlled quantization is the anchor):

1. Each op's time in a reduced precision comes from its twins' records (tuned like any task), its
   float time from the fp32 plan. The quantize / dequantize a tensor pays between a float and an
   int8 op is measured like a layout conversion (the label ``<library>:int8``) and counted; a half
   precision op reads and writes float tensors in its layout (oneDNN's bf16 kernels convert within
   the op), so only a change of layout is counted for it.
2. Each op has a ladder: the reduced precisions it has measured configs in, from the least
   precise toward fp32 (``LADDER``: int8, bf16, fp16), e.g. int8 -> bf16 -> fp32. A half-precision
   rung slower than the op's fp32 config is left out (it could only lose; the plan's
   ``extra["precision"]["left_out"]`` says so per op); an int8 rung is kept even so, since an op
   slower in int8 by itself can still save the quantize / dequantize around it.
   Each op alone at each rung gives its sensitivity there: the drop of the metric
   (core/precision/accuracy.py) on the first SENSITIVITY_FEEDS held-out feeds, and the output SQNR.
3. Every op on its ladder's first rung first; while the drop exceeds the budget, the op whose
   current rung is the most sensitive (ties, common with a coarse metric such as top-1 on few
   feeds, broken by the lowest output SQNR) climbs one rung (int8 -> bf16, or to fp32), and the
   metric is measured again on the whole model (a large model's ops climb in groups); once within
   the budget, the climbs are undone one at a time, the last first, each kept while the budget
   holds. Every step is a point of the front (predicted latency, metric, weight bytes): the fp32
   plan, every op at its first rung, and the mixed plans between; and per half precision the
   whole graph in it (``uniform_points``: "all-bf16"), which op times summed cannot predict.
   Plan-level settings that change the arithmetic (per-tensor weights, int8 activations) get a
   front of their own where the op times favour them over the library's own (``precision_defaults``).
4. The chosen plan is the fastest predicted point within the budget; ``core.api`` then times the
   points within the budget end to end with the rounds protocol and keeps the fastest measured
   one if it is shown faster than the fp32 plan.
5. With several libraries, the plan across them (made per op in fp32) also races with each
   library's chosen reduced-precision ops put in (``with_reduced_ops``), and planned again with
   every library's chosen ops free to run in their precision on any library that measured it, or in
   fp32, per op (core/cross_library/plan.plan_across ``reduced_nodes``), each once its metric on
   the held-out feeds is measured within the budget (``score_plan``).

A plan's reduced-precision ops are entries of their twin tasks (``Task.precision``);
``plan.extra["precision"]`` holds the calibration ranges an int8 runner quantizes with, the metric,
the budget and the front.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.cross_library.conversions import ConversionTable, measure_conversions
from kselect.core.cross_library.planner import Option
from kselect.core.cross_library.problem import CrossProblem, connect
from kselect.core.errors import KselectError, one_line
from kselect.core.measuring.tuning_loop import library_defaults, stored_outcomes
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import (ISOLATED_US, LIBRARY_DEFAULT, PREDICTED_BASIS, PREDICTED_US, Plan, choose, plan_node,
                                     plan_task, reduced_nodes)
from kselect.core.plans.runtime import library_runner
from kselect.core.precision.accuracy import Metric, default_metric, get_metric, run_outputs, sqnr
from kselect.core.precision.calibration import Calibration
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.alone import node_times_alone
from kselect.core.whole_model.context import (CONTEXT_ROUNDS, CONTEXT_RUNS, IN_CONTEXT, ContextCorrection, in_context,
                                              median_run)

# The rungs an op climbs toward fp32, least precise first: int8 (8 bits), bf16 (8 significant
# bits, fp32's range), fp16 (11 significant bits, a narrower range).
LADDER = ("int8", "bf16", "fp16")
WEIGHT_BYTES = {"int8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
MAX_BACKOFF_STEPS = 24  # more climbs than this are made in groups
# Sensitivities only order the ops (ties broken by SQNR, which is continuous): a share of the
# held-out feeds does; every point of the front is measured on all of them.
SENSITIVITY_FEEDS = 16


@dataclass
class FrontPoint:
    name: str
    precisions: dict[str, str]  # node -> its reduced precision; a node not named runs in fp32
    predicted_us: float
    score: float
    drop: float
    weight_bytes: int
    within_budget: bool = False
    measured_ms: float | None = None  # end to end, when timed
    failed: str | None = None  # the plan could not be built or run: why (never chosen)
    prediction: dict | None = None  # predicted against measured whole-model time (core/whole_model/prediction.py)
    uniform: bool = False  # every op measured in one half precision runs in it ("all-bf16"; ``uniform_points``)

    @property
    def int8_nodes(self) -> list[str]:
        return sorted(node for node, precision in self.precisions.items() if precision == "int8")

    def op_counts(self) -> dict[str, int]:
        """Ops per reduced precision, in ``LADDER`` order."""
        counts = {p: sum(1 for q in self.precisions.values() if q == p) for p in LADDER}
        return {p: n for p, n in counts.items() if n}

    def describe_ops(self) -> str:
        """E.g. "int8 12, bf16 3"; "-" for the fp32 plan."""
        return ", ".join(f"{p} {n}" for p, n in self.op_counts().items()) or "-"

    def to_json(self) -> dict:
        data = {"name": self.name, "int8_ops": len(self.int8_nodes), "ops_by_precision": self.op_counts(),
                "precisions": dict(sorted(self.precisions.items())), "predicted_us": round(self.predicted_us, 1),
                "score": None if self.failed else round(self.score, 6),
                "drop": None if self.failed else round(self.drop, 6), "weight_bytes": self.weight_bytes,
                "within_budget": self.within_budget}
        if self.failed:
            data["failed"] = self.failed
        if self.measured_ms is not None:
            data["measured_ms"] = round(self.measured_ms, 4)
        if self.prediction is not None:
            data["prediction"] = self.prediction
        if self.uniform:
            data["uniform"] = True
        return data


@dataclass
class PrecisionSearch:
    front: list[FrontPoint]
    chosen: FrontPoint
    plan: Plan  # the chosen point's plan
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> precision -> drop alone
    plans: dict[str, Plan] = field(default_factory=dict)  # front point name -> its plan
    metric_name: str = ""
    context: list[dict] = field(default_factory=list)  # per front, its costs in context (core/whole_model/context.py)
    correction: ContextCorrection | None = None  # the first front's, the one of the fp32 point's scale
    # node -> precision -> why a measured rung is not on its ladder (slower than fp32, or failed in the model)
    left_out: dict[str, dict[str, str]] = field(default_factory=dict)


def precision_choices(model: Model, library: Library, device, db: RecordDB, fp32_plan: Plan,
                      twin_tasks: list[Task], fixed: dict | None = None) -> tuple[dict, dict[str, dict]]:
    """The plan-level settings and, per twin task key, its chosen entry, from the records of
    ``twin_tasks`` (tasks of one reduced precision): within the fp32 plan's session-wide settings
    (one session runs every precision) and ``fixed``."""
    records = stored_outcomes(twin_tasks, library, device, db)
    shared = {**fp32_plan.plan_level, **(fixed or {})}
    records = {key: [r for r in rs if all(r.config.get(k, v) == v for k, v in shared.items())]
               for key, rs in records.items()}
    defaults = library_defaults(twin_tasks, library, device)
    defaults = {key: {**config, **{k: v for k, v in shared.items() if k in config}} for key, config in defaults.items()}
    measured = [t for t in twin_tasks if any(r.result.status == "ok" for r in records.get(t.key, []))]
    if not measured:
        return {}, {}
    assignment, choices = choose(measured, records, defaults, library.plan_level_dims)
    entries = {c.task.key: plan_task(c.task, c.task.nodes, library.name, c.config, c.time_us, c.default_config,
                                     c.default_us, c.samples, c.emulated) for c in choices}
    return {**shared, **assignment}, entries


def precision_defaults(library: Library, device, twin_tasks: list[Task]) -> dict:
    """The library's own values of its plan-level dims that change the arithmetic (role
    "precision": MLAS's activation type and weight granularity), as its quantizer writes them."""
    found = {}
    for task in twin_tasks:
        default = library.default_config(task, device)
        for dim in library.space(task, device).dims:
            if dim.role == "precision" and dim.name in library.plan_level_dims and dim.name in default:
                found.setdefault(dim.name, default[dim.name])
    return found


def mixed_plan(fp32_plan: Plan, entries: dict[str, dict[str, dict]], settings: dict, precisions: dict[str, str],
               precision: dict) -> Plan:
    """``fp32_plan`` with each node of ``precisions`` run by its twin task in that precision
    (``entries[precision][task key]``)."""
    plan = copy.deepcopy(fp32_plan)
    if not precisions:
        return plan
    # a plan with layouts per op labels every node: an int8 op's is the library's int8 label, a
    # half-precision op's the layout its config reads and writes float tensors in
    labelled = any("label" in entry for entry in fp32_plan.nodes.values())
    tasks = []
    for entry in plan.tasks:
        kept = [node for node in entry["nodes"] if node not in precisions]
        if kept:
            tasks.append({**entry, "nodes": kept})
    for reduced, by_key in entries.items():
        for entry in by_key.values():
            chosen = [node for node in entry["nodes"] if precisions.get(node) == reduced]
            if not chosen:
                continue
            tasks.append({**entry, "nodes": chosen})
            task = Task.from_json(entry)
            layout = {"label": _label(entry["library"], reduced, entry["config"])} if labelled else {}
            for node in chosen:
                plan.nodes[node] = plan_node(task, entry["library"], entry["config"], **layout)
    plan.tasks = tasks
    plan.plan_level = dict(settings)
    plan.library_settings = {plan.library: dict(settings)}
    plan.extra["precision"] = precision
    return plan


def _label(library_name: str, precision: str, config: dict) -> str:
    if precision == "int8":
        return f"{library_name}:int8"
    return str(plugins.get_library(library_name).layout_label(config))


def with_reduced_ops(cross: Plan, mixed: Plan, only: set[str] | None = None) -> Plan | None:
    """The plan across libraries with one library's reduced-precision ops put in: each node
    ``mixed`` (that library's mixed-precision plan) runs in int8, bf16 or fp16 (of ``only``, when
    given) runs so here, on that library, with its config, its plan-level settings and its
    calibration ranges; every other node stays as ``cross`` planned it. None when there is no
    such node, or ``cross`` runs on that library alone (``mixed`` itself is then the plan to race)."""
    library, reduced = mixed.library, reduced_nodes(mixed)
    if only is not None:
        reduced = {node: precision for node, precision in reduced.items() if node in only}
    if not reduced or set(cross.libraries) == {library}:
        return None
    plan = copy.deepcopy(cross)
    tasks = []
    for entry in plan.tasks:
        kept = [node for node in entry["nodes"] if node not in reduced]
        if kept:
            tasks.append({**entry, "nodes": kept})
    for entry in mixed.tasks:
        chosen = [node for node in entry["nodes"] if node in reduced]
        if entry.get("precision", "fp32") != "fp32" and chosen:
            tasks.append({**copy.deepcopy(entry), "nodes": chosen})
    plan.tasks = tasks
    for node in reduced:
        plan.nodes[node] = copy.deepcopy(mixed.nodes[node])
    used = {entry["library"] for entry in plan.nodes.values()}
    versions = {**plan.libraries, library: mixed.libraries[library]}
    plan.libraries = {name: version for name, version in versions.items() if name in used}
    # the cross plan's settings for the library (its one-spinner policy) stand; the mixed plan's join them
    settings = {**plan.library_settings, library: {**mixed.plan_level, **plan.library_settings.get(library, {})}}
    plan.library_settings = {name: value for name, value in settings.items() if name in used}
    plan.plan_level = {} if len(used) > 1 else dict(plan.library_settings[library])
    plan.extra["precision"] = {**copy.deepcopy(cross.extra.get("precision") or mixed.extra["precision"]),
                               "reduced_from": library}
    # what kept ``cross`` alone says nothing of this plan; no planner summed its ops and conversions
    for key in (LIBRARY_DEFAULT, "verified", PREDICTED_US, PREDICTED_BASIS, ISOLATED_US):
        plan.extra.pop(key, None)
    return plan


def score_plan(model: Model, plan: Plan, calibration: Calibration, metric: Metric | None,
               metric_name: str | None) -> tuple[float, float]:
    """(score, drop) of a plan of any libraries on the held-out feeds, against ONNX Runtime's
    default session in fp32."""
    baseline = plugins.baseline_library()
    reference = _library_outputs(baseline, model, None, calibration.held_out)
    metric = metric or get_metric(metric_name or default_metric(reference))
    outputs = _library_outputs(baseline, model, plan, calibration.held_out)  # a plan runs on its own libraries
    score = metric(outputs, reference, calibration.held_out)
    return score, metric(reference, reference, calibration.held_out) - score


def _library_outputs(library: Library, model: Model, plan: Plan | None, feeds: list) -> list:
    """The model's outputs on ``feeds``, run by the library (its defaults when ``plan`` is None)
    with the ops it lacks in ONNX Runtime segments, as its plans run (core/plans/runtime.library_runner)."""
    runner = library_runner(library, model, plan)
    try:
        return run_outputs(runner.run, feeds)
    finally:
        runner.close()


def weight_bytes(model: Model, precisions: dict[str, str]) -> int:
    """Bytes of the weights: per weight of an op, 1 in int8, 2 in bf16 or fp16, 4 in fp32 (a
    bias stays 32-bit)."""
    weight_of = {node.input[1]: precisions[node.name] for node in model.proto.graph.node
                 if node.name in precisions and len(node.input) > 1}
    total = 0
    for name, tensor in model.initializers.items():
        count = 1
        for d in tensor.dims:
            count *= d
        total += count * WEIGHT_BYTES[weight_of.get(name, "fp32")]
    return total


class _Predictor:
    """Summed op times of an assignment of precisions to the nodes, with the quantize and
    dequantize of every tensor that changes between float and int8 on the way, and the layout
    changes around a half-precision op (measured conversions), each tensor's counted once: the
    one-library case of core/cross_library/problem.py."""

    def __init__(self, model, library, device, db, settings, fp32_plan, entries: dict[str, dict[str, dict]]):
        labelled = any("label" in entry for entry in fp32_plan.nodes.values())
        self.reduced_us = {precision: {node: entry["time_us"] for entry in by_key.values() for node in entry["nodes"]}
                           for precision, by_key in entries.items()}
        self.options: dict[str, dict[str, Option]] = {}
        for entry in fp32_plan.tasks:
            for node in entry["nodes"]:
                fp32_label = fp32_plan.nodes[node].get("label") if labelled else None
                self.options[node] = {"fp32": Option(fp32_label or f"{library.name}:NCHW", entry["time_us"])}
        for precision, by_key in entries.items():
            for entry in by_key.values():
                label = _label(library.name, precision, entry["config"]) if labelled or precision == "int8" \
                    else f"{library.name}:NCHW"
                for node in entry["nodes"]:
                    if node in self.options:
                        self.options[node][precision] = Option(label, entry["time_us"])
        self.problem = CrossProblem(options={node: list(by_precision.values())
                                             for node, by_precision in self.options.items()})
        connect(self.problem, model, {library.name: library})
        self.table: ConversionTable = measure_conversions(self.problem.sides(), {library.name: library}, device, db,
                                                          settings)

    def ladder(self, node: str) -> list[str]:
        """The node's rungs toward fp32 (``LADDER`` order): every measured reduced precision but
        those ``left_out``."""
        left_out = self.left_out(node)
        return [p for p in LADDER if p in self.options.get(node, {}) and p not in left_out]

    def left_out(self, node: str) -> dict[str, str]:
        """The node's measured half-precision rungs slower than its fp32 config on the same layout,
        which could only lose, each with why."""
        options = self.options.get(node, {})
        fp32 = options.get("fp32")
        slower = {}
        for precision in LADDER:
            option = options.get(precision)
            if precision != "int8" and option is not None and fp32 is not None and option.label == fp32.label \
                    and option.time_us >= fp32.time_us:
                slower[precision] = f"slower than fp32 ({option.time_us:.1f} us, fp32 {fp32.time_us:.1f} us)"
        return slower

    correction: ContextCorrection | None = None  # set by ``learn_in_context``
    # Corrected figures are multiplied by this: a second front (other plan-level int8 settings)
    # learns from whole runs of its own, whose fp32 run may read another speed of the machine
    # than the first front's did; scaled to the first front's fp32 figure, both fronts' points
    # rank on one scale and are predicted against the one fp32 plan.
    scale: float = 1.0

    def _assignment(self, precisions: dict[str, str]) -> dict:
        assignment = {node: options[0] for node, options in self.problem.options.items()}
        assignment.update({node: by_precision[precisions.get(node, "fp32")]
                           for node, by_precision in self.options.items()})
        return assignment

    def ops_and_conversions(self, precisions: dict[str, str]) -> tuple[dict[str, tuple[str, float]], float]:
        """Each tuned node's (precision, isolated us), and the conversions the planner counts."""
        assignment = self._assignment(precisions)
        ops = {node: (precisions.get(node, "fp32"), assignment[node].time_us) for node in self.options}
        return ops, self.problem.total_us(self.table, assignment) - sum(o.time_us for o in assignment.values())

    def isolated_us(self, precisions: dict[str, str]) -> float:
        """Summed isolated times of ops and conversions."""
        return self.problem.total_us(self.table, self._assignment(precisions))

    def stamp(self, plan: Plan, precisions: dict[str, str], predicted_us: float) -> None:
        """Writes into ``plan`` the figure it was chosen on (core/whole_model/prediction.py reads
        it), and, once corrected in context, what that covers and the isolated sum beside it."""
        plan.extra[PREDICTED_US] = round(predicted_us, 3)
        if self.correction is not None:
            plan.extra[PREDICTED_BASIS] = IN_CONTEXT
            plan.extra[ISOLATED_US] = round(self.isolated_us(precisions), 3)

    def __call__(self, precisions: dict[str, str]) -> float:
        """``isolated_us``; once ``learn_in_context`` has run, the time predicted with the costs
        corrected in context."""
        if self.correction is None:
            return self.isolated_us(precisions)
        return self.scale * self.correction.predicted_us(*self.ops_and_conversions(precisions))

    def learn_in_context(self, library, model, fp32_plan: Plan, reduced_plan: Plan, reduced: dict[str, str],
                         half_plan: Plan | None = None, half: dict[str, str] | None = None) -> ContextCorrection | None:
        """The corrections of core/whole_model/context.py, from whole runs of the fp32 plan, of
        ``reduced_plan`` (every op in ``reduced``'s precision) and of ``half_plan`` if any (every
        op in ``half``'s) timed per node by the library's runner, each in a fresh process, the
        plans taking turns for ``CONTEXT_ROUNDS`` rounds (their medians); None (and isolated sums
        kept) when the runner cannot time its nodes."""
        plans = (fp32_plan, reduced_plan) + ((half_plan,) if half_plan is not None else ())
        rounds: list[list] = [[] for _ in plans]
        for _ in range(CONTEXT_ROUNDS):
            for index, plan in enumerate(plans):
                timed = node_times_alone(model, library.name, plan, CONTEXT_RUNS)
                if timed is None:
                    return None
                rounds[index].append(in_context(model, *timed))
        runs = [median_run(of_plan) for of_plan in rounds]
        isolated = {(node, precision): option.time_us for node, by_precision in self.options.items()
                    for precision, option in by_precision.items()}
        self.correction = ContextCorrection.learn(runs[0], runs[1], isolated, reduced,
                                                  self.ops_and_conversions(reduced)[1],
                                                  half=(runs[2], half) if half_plan is not None else None)
        return self.correction


def search_precision(model: Model, library: Library, device, db: RecordDB, settings, fp32_plan: Plan,
                     twin_tasks: list[Task], calibration: Calibration, metric: Metric | None, metric_name: str | None,
                     max_drop: float, on_step: Callable[[str], None] | None = None) -> PrecisionSearch:
    """Steps 1-3 of the module docstring over the reduced-precision twins ``twin_tasks``; returns
    the front and the chosen point's plan. ``metric`` None: the default for the model's outputs
    (core/precision/accuracy.default_metric).

    The plan-level settings that change the arithmetic (``precision_defaults``: per-tensor
    weights, int8 activations) are not chosen on speed alone: the front is searched at the
    library's own (its quantizer's) values, and, where the op times favour other values, again
    at those (points named with them, e.g. "int8 (weights per-tensor)"); the fastest point within
    the budget on either front is chosen."""
    say = on_step or (lambda text: None)
    reference = _library_outputs(library, model, None, calibration.held_out)
    if metric is None:
        metric_name = default_metric(reference)
        metric = get_metric(metric_name)
    precision = {"calibration": calibration.to_json(), "ranges": calibration.ranges, "metric": metric_name,
                 "max_drop": max_drop}
    fp32_score = metric(reference, reference, calibration.held_out)
    plans: dict[str, Plan] = {}
    sensitivity: dict[str, dict[str, float]] = {}
    left_out: dict[str, dict[str, str]] = {}

    def search_front(settings_of_front: dict, entries: dict[str, dict[str, dict]], suffix: str) -> list[FrontPoint]:
        """One front at one set of plan-level settings; the fp32 point with the first."""
        predict = None
        ladders: dict[str, list[str]] = {}
        if any(entries.values()):
            say("measuring the conversions between precisions")
            predict = _Predictor(model, library, device, db, settings, fp32_plan, entries)
            ladders = {node: predict.ladder(node) for node in fp32_plan.nodes}
            ladders = {node: rungs for node, rungs in ladders.items() if rungs}
            for node in fp32_plan.nodes:
                for reduced, why in predict.left_out(node).items():
                    left_out.setdefault(node, {})[reduced] = why

        def point(name: str, precisions: dict[str, str]) -> FrontPoint:
            name = name if name == "fp32" else name + suffix
            plan = mixed_plan(fp32_plan, entries, settings_of_front, precisions, precision)
            predicted = predict(precisions) if predict else fp32_plan.estimated_us()
            score = fp32_score
            try:
                if precisions:
                    score = metric(_library_outputs(library, model, plan, calibration.held_out), reference,
                                   calibration.held_out)
            except Exception as exc:  # a plan the library cannot build or run is a failed point, never chosen
                return FrontPoint(name, dict(precisions), predicted, float("nan"), float("inf"),
                                  weight_bytes(model, precisions), failed=one_line(exc)[:300])
            if predict is not None:
                predict.stamp(plan, precisions, predicted)
            else:
                plan.extra[PREDICTED_US] = round(predicted, 3)
            plans[name] = plan
            drop = fp32_score - score
            return FrontPoint(name, dict(precisions), predicted, score, drop, weight_bytes(model, precisions),
                              drop <= max_drop)

        front = [] if "fp32" in plans else [point("fp32", {})]
        noise: dict[tuple[str, str], float] = {}  # SQNR of the outputs, dB: orders ops the metric cannot tell apart
        drops: dict[tuple[str, str], float] = {}
        failed: set[tuple[str, str]] = set()  # (node, precision) that could not run so in the whole model
        if ladders:
            rungs = sum(len(r) for r in ladders.values())
            say(f"sensitivity of {len(ladders)} ops, each alone in each of its reduced precisions ({rungs} runs)")
            feeds, expected = calibration.held_out[:SENSITIVITY_FEEDS], reference[:SENSITIVITY_FEEDS]
            fp32_on_feeds = metric(expected, expected, feeds)
            for node in list(ladders):
                for reduced in list(ladders[node]):
                    plan = mixed_plan(fp32_plan, entries, settings_of_front, {node: reduced}, precision)
                    try:
                        outputs = _library_outputs(library, model, plan, feeds)
                    except Exception as exc:  # this op cannot run so in the whole model: that rung is gone
                        say(f"{node} in {reduced} failed ({one_line(exc)[:200]}): not a candidate in {reduced}")
                        ladders[node].remove(reduced)
                        failed.add((node, reduced))
                        left_out.setdefault(node, {})[reduced] = f"failed in the whole model: {one_line(exc)[:200]}"
                        continue
                    drops[(node, reduced)] = fp32_on_feeds - metric(outputs, expected, feeds)
                    noise[(node, reduced)] = sqnr(outputs, expected, feeds)
            ladders = {node: rungs for node, rungs in ladders.items() if rungs}
            if ladders:
                learn_in_context(predict, ladders, failed, settings_of_front, entries, suffix, front)
                say("every op in its least precise form, then climbing toward fp32 from the most sensitive")
                front += back_off(ladders, drops, noise, point)
        if predict is not None and not suffix:  # the whole graph in one precision does not hang on the int8 settings
            front += uniform_points(predict.options, failed, front, point)
        for (node, reduced), drop in drops.items():
            sensitivity.setdefault(node, {}).setdefault(reduced, drop)
        return front

    def learn_in_context(predict: _Predictor, ladders: dict[str, list[str]], failed: set[tuple[str, str]],
                         settings_of_front: dict, entries: dict, suffix: str, front: list[FrontPoint]) -> None:
        """The front's costs corrected in context (core/whole_model/context.py) from its fp32 plan,
        its plan with every op on its first rung and, where that one has int8 ops and a half
        precision was measured, the plan of the first such precision's uniform point ("all-bf16":
        every op measured in it, also those left off the ladders), before the back-off predicts
        any point; the fp32 point, already made, predicted again."""
        start = {node: rungs[0] for node, rungs in ladders.items()}
        halves = [p for p in LADDER[1:] if any(p in options for options in predict.options.values())]
        half = uniform_assignment(predict.options, failed, halves[0]) if halves and "int8" in start.values() else {}
        half_plan = mixed_plan(fp32_plan, entries, settings_of_front, half, precision) if half else None
        say("timing the fp32 plan and the least precise plan" + (" and the half-precision plan" if half else "")
            + " per node in whole runs (costs in context)")
        try:
            correction = predict.learn_in_context(library, model, plans["fp32"],
                                                  mixed_plan(fp32_plan, entries, settings_of_front, start, precision),
                                                  start, half_plan, half)
        except Exception as exc:  # a runner that cannot time a run per node: the isolated sums stand
            say(f"costs in context not learned ({one_line(exc)[:200]}): isolated sums are used")
            return
        if correction is None:
            return
        fp32_points = [p for p in front if p.name == "fp32"]
        if not fp32_points:  # a second front: on the first front's scale (_Predictor.scale)
            predict.scale = plans["fp32"].extra[PREDICTED_US] / predict({})
        corrections.append(correction)
        context.append({"front": suffix.strip(" ()") or "default", **correction.to_json(),
                        "scale": round(predict.scale, 4)})
        for fp32_point in fp32_points:
            fp32_point.predicted_us = predict({})
            predict.stamp(plans["fp32"], {}, fp32_point.predicted_us)

    context: list[dict] = []
    corrections: list[ContextCorrection] = []
    int8_tasks = [t for t in twin_tasks if t.precision == "int8"]
    half = {}  # half-precision entries and settings do not depend on the int8 arithmetic settings
    half_settings: dict = {}
    for reduced in LADDER[1:]:
        tasks = [t for t in twin_tasks if t.precision == reduced]
        if tasks:
            found_settings, half[reduced] = precision_choices(model, library, device, db, fp32_plan, tasks)
            half_settings.update(found_settings)
    own = precision_defaults(library, device, int8_tasks)
    choices = [precision_choices(model, library, device, db, fp32_plan, int8_tasks, own)] if int8_tasks else [({}, {})]
    differs = {}
    if int8_tasks:
        fastest = precision_choices(model, library, device, db, fp32_plan, int8_tasks)
        differs = {k: v for k, v in fastest[0].items() if k in own and own[k] != v}
        if differs and fastest[1]:
            choices.append(fastest)
    front: list[FrontPoint] = []
    for index, (int8_settings, int8_entries) in enumerate(choices):
        suffix = "" if index == 0 else " (" + ", ".join(f"{k} {v}" for k, v in differs.items()) + ")"
        if suffix:
            say(f"again with {suffix[2:-1]}, which its op times favour")
        entries = {**({"int8": int8_entries} if int8_entries else {}), **{p: e for p, e in half.items() if e}}
        front += search_front({**half_settings, **int8_settings} or dict(fp32_plan.plan_level), entries, suffix)
    chosen = fastest_within_budget(front)
    return PrecisionSearch(front, chosen, plans[chosen.name], sensitivity, plans, metric_name, context=context,
                           correction=corrections[0] if corrections else None, left_out=left_out)


def back_off(ladders: dict[str, list[str]], sensitivity: dict[tuple[str, str], float],
             noise: dict[tuple[str, str], float], point: Callable[[str, dict[str, str]], FrontPoint]) -> list[FrontPoint]:
    """Every op of ``ladders`` (node -> its rungs, least precise first) on its first rung (the
    point named by those precisions, e.g. "int8" or "int8+bf16"), then the op whose current rung
    is the most sensitive (``sensitivity[(node, precision)]``: its drop alone there; ties broken by
    the lowest SQNR, ``noise``) climbing one rung toward fp32, one op at a time (in groups past
    MAX_BACKOFF_STEPS climbs), each step measured by ``point(name, node -> precision)``, until a
    point is within the budget or every op is in fp32. Sensitivities are each op's alone, and a
    group climbs whole, so some climbs may not have been needed: once within the budget, they are
    undone one at a time, the last first (at most MAX_BACKOFF_STEPS tries), each kept if the
    budget still holds ("mixed-3+1", ...)."""
    current = {node: rungs[0] for node, rungs in ladders.items()}
    start = "+".join(p for p in LADDER if p in current.values())
    front = [point(start, dict(current))]
    group = max(1, -(-sum(len(r) for r in ladders.values()) // MAX_BACKOFF_STEPS))
    step, climbs = 0, []  # climbs: (node, the precision it left)

    def climb(node: str) -> None:
        rungs = ladders[node]
        climbs.append((node, current[node]))
        higher = rungs.index(current[node]) + 1
        if higher < len(rungs):
            current[node] = rungs[higher]
        else:
            del current[node]

    while not front[-1].within_budget and current:
        ranked = sorted(current, key=lambda n: (-sensitivity[(n, current[n])], noise.get((n, current[n]), 0.0)))
        for node in ranked[:group]:
            climb(node)
        step += 1
        if current:
            front.append(point(f"mixed-{step}", dict(current)))
    if current and front[-1].within_budget:
        measured, tries = {frozenset(p.precisions.items()) for p in front}, 0
        for node, left in reversed(climbs):
            if tries == MAX_BACKOFF_STEPS:
                break
            rungs = ladders[node]
            above = rungs[rungs.index(left) + 1] if rungs.index(left) + 1 < len(rungs) else "fp32"
            if current.get(node, "fp32") != above:  # a later climb of it stands: this one cannot be undone alone
                continue
            trial_precisions = {**current, node: left}
            if frozenset(trial_precisions.items()) in measured:  # e.g. the point before the last step
                continue
            tries += 1
            trial = point(f"mixed-{step}+{tries}", trial_precisions)
            front.append(trial)
            measured.add(frozenset(trial_precisions.items()))
            if trial.within_budget:
                current[node] = left
    return front


def uniform_assignment(measured: dict[str, dict[str, Option]], failed: set[tuple[str, str]],
                       precision: str) -> dict[str, str]:
    """Every op with a config measured in ``precision`` that did not fail in it in the whole model,
    in it: the assignment of the point "all-<precision>"."""
    return {node: precision for node, options in measured.items()
            if precision in options and (node, precision) not in failed}


def uniform_points(measured: dict[str, dict[str, Option]], failed: set[tuple[str, str]], front: list[FrontPoint],
                   point: Callable[[str, dict[str, str]], FrontPoint]) -> list[FrontPoint]:
    """One point per half precision ("all-bf16", "all-fp16") that runs every op in it which has
    a config measured in that precision (``measured``: node -> precision -> option), including
    ops left off the ladders as slower than fp32 alone, and leaves fp32 only the ops that failed
    in it in the whole model (``failed``).

    Op times summed cannot see what one precision through the whole graph saves: no conversion
    between neighbours, and the library's own whole-graph fusions in that precision (OpenVINO's
    CPU plugin runs its default in bf16 where the CPU has it). So the point is always on the
    front, and the race (core/precision/choice.py) times it. A precision whose assignment the
    front already holds gets no point."""
    seen = {frozenset(p.precisions.items()) for p in front}
    points = []
    for precision in LADDER[1:]:
        precisions = uniform_assignment(measured, failed, precision)
        if not precisions or frozenset(precisions.items()) in seen:
            continue
        seen.add(frozenset(precisions.items()))
        uniform = point(f"all-{precision}", precisions)
        uniform.uniform = True
        points.append(uniform)
    return points


def fastest_within_budget(front: list[FrontPoint]) -> FrontPoint:
    within = [p for p in front if p.within_budget]
    if not within:
        raise KselectError("no plan met the accuracy budget")  # the fp32 point always does
    return min(within, key=lambda p: p.predicted_us)
