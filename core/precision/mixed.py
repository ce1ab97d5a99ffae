"""Mixed precision: which ops of a library's plan run in int8, under an accuracy budget.

The flow (NNCF's accuracy-controlled quantization is the anchor):

1. Each op's int8 time comes from the int8 twins' records (tuned like any task), its float time
   from the fp32 plan; the quantize / dequantize a tensor pays between a float and an int8 op
   is measured like a layout conversion (the label ``<library>:int8``) and counted.
2. Every op with a measured int8 config is a candidate, faster alone or not: an op slower in int8
   by itself can still save the quantize / dequantize around it. Each alone in int8 gives its
   sensitivity: the drop of the metric (core/precision/accuracy.py) on the first SENSITIVITY_FEEDS
   held-out feeds, and the output SQNR.
3. All candidates in int8 first; while the drop exceeds the budget, the most sensitive candidate
   (ties, common with a coarse metric such as top-1 on few feeds, broken by the lowest output
   SQNR) goes back to float, and the metric is measured again on the whole model (a large model's
   candidates go back in groups); once within the budget, the ops sent back return to int8 one
   at a time, least sensitive first, each kept while the budget holds. Every step is a
   point of the front (predicted latency, metric, weight bytes): the fp32 plan, full int8, and
   the mixed plans between.
   Plan-level settings that change the arithmetic (per-tensor weights, int8 activations) get a
   front of their own where the op times favour them over the library's own (``precision_defaults``).
4. The chosen plan is the fastest predicted point within the budget; ``core.api`` then times the
   points within the budget end to end with the rounds protocol and keeps the fastest measured
   one if it is shown faster than the fp32 plan.
5. With several libraries, the plan across them (made per op in fp32) also races with each
   library's chosen int8 ops put in (``with_int8_ops``), and planned again with those ops free to
   run in int8 on any library or in fp32, per op (core/cross_library/plan.plan_across ``int8_nodes``),
   each once its metric on the held-out feeds is measured within the budget (``score_plan``).

A plan's int8 ops are entries of their int8 tasks (``Task.precision``); ``plan.extra["precision"]``
holds the calibration ranges the library's runner quantizes with, the metric, the budget and
the front.
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
from kselect.core.plans.plan import Plan, choose, int8_nodes, plan_node, plan_task
from kselect.core.plans.runtime import library_runner
from kselect.core.precision.accuracy import Metric, default_metric, get_metric, run_outputs, sqnr
from kselect.core.precision.calibration import Calibration
from kselect.core.records.store import RecordDB

MAX_BACKOFF_STEPS = 24  # more candidates than this go back to float in groups
# Sensitivities only order the ops (ties broken by SQNR, which is continuous): a share of the
# held-out feeds does; every point of the front is measured on all of them.
SENSITIVITY_FEEDS = 16


@dataclass
class FrontPoint:
    name: str
    int8_nodes: list[str]
    predicted_us: float
    score: float
    drop: float
    weight_bytes: int
    within_budget: bool = False
    measured_ms: float | None = None  # end to end, when timed
    failed: str | None = None  # the plan could not be built or run: why (never chosen)

    def to_json(self) -> dict:
        data = {"name": self.name, "int8_ops": len(self.int8_nodes), "predicted_us": round(self.predicted_us, 1),
                "score": None if self.failed else round(self.score, 6),
                "drop": None if self.failed else round(self.drop, 6), "weight_bytes": self.weight_bytes,
                "within_budget": self.within_budget}
        if self.failed:
            data["failed"] = self.failed
        if self.measured_ms is not None:
            data["measured_ms"] = round(self.measured_ms, 4)
        return data


@dataclass
class PrecisionSearch:
    front: list[FrontPoint]
    chosen: FrontPoint
    plan: Plan  # the chosen point's plan
    sensitivity: dict[str, float] = field(default_factory=dict)  # node -> drop alone in int8
    plans: dict[str, Plan] = field(default_factory=dict)  # front point name -> its plan
    metric_name: str = ""


def int8_choices(model: Model, library: Library, device, db: RecordDB, fp32_plan: Plan,
                 int8_tasks: list[Task], fixed: dict | None = None) -> tuple[dict, dict[str, dict]]:
    """The int8 plan-level settings and, per int8 task key, its chosen entry, from the records:
    within the fp32 plan's session-wide settings (one session runs both precisions) and ``fixed``."""
    records = stored_outcomes(int8_tasks, library, device, db)
    shared = {**fp32_plan.plan_level, **(fixed or {})}
    records = {key: [r for r in rs if all(r.config.get(k, v) == v for k, v in shared.items())]
               for key, rs in records.items()}
    defaults = library_defaults(int8_tasks, library, device)
    defaults = {key: {**config, **{k: v for k, v in shared.items() if k in config}} for key, config in defaults.items()}
    measured = [t for t in int8_tasks if any(r.result.status == "ok" for r in records.get(t.key, []))]
    if not measured:
        return {}, {}
    assignment, choices = choose(measured, records, defaults, library.plan_level_dims)
    entries = {c.task.key: plan_task(c.task, c.task.nodes, library.name, c.config, c.time_us, c.default_config,
                                     c.default_us, c.samples, c.emulated) for c in choices}
    return {**shared, **assignment}, entries


def precision_defaults(library: Library, device, int8_tasks: list[Task]) -> dict:
    """The library's own values of its plan-level dims that change the arithmetic (role
    "precision": MLAS's activation type and weight granularity), as its quantizer writes them."""
    found = {}
    for task in int8_tasks:
        default = library.default_config(task, device)
        for dim in library.space(task, device).dims:
            if dim.role == "precision" and dim.name in library.plan_level_dims and dim.name in default:
                found.setdefault(dim.name, default[dim.name])
    return found


def mixed_plan(fp32_plan: Plan, int8_entries: dict[str, dict], int8_settings: dict, nodes: set[str],
               precision: dict) -> Plan:
    """``fp32_plan`` with ``nodes`` run by their int8 tasks."""
    plan = copy.deepcopy(fp32_plan)
    if not nodes:
        return plan
    # a plan with layouts per op labels every node; an int8 op's layout is the library's int8
    labelled = any("label" in entry for entry in fp32_plan.nodes.values())
    tasks = []
    for entry in plan.tasks:
        kept = [node for node in entry["nodes"] if node not in nodes]
        if kept:
            tasks.append({**entry, "nodes": kept})
    for entry in int8_entries.values():
        chosen = [node for node in entry["nodes"] if node in nodes]
        if chosen:
            tasks.append({**entry, "nodes": chosen})
            task = Task.from_json(entry)
            layout = {"label": f"{entry['library']}:int8"} if labelled else {}
            for node in chosen:
                plan.nodes[node] = plan_node(task, entry["library"], entry["config"], **layout)
    plan.tasks = tasks
    plan.plan_level = dict(int8_settings)
    plan.library_settings = {plan.library: dict(int8_settings)}
    plan.extra["precision"] = precision
    return plan


def with_int8_ops(cross: Plan, mixed: Plan) -> Plan | None:
    """The plan across libraries with one library's int8 ops put in: each node ``mixed`` (that
    library's mixed-precision plan) runs in int8 runs so here, on that library, with its config
    and its int8 settings and calibration ranges; every other node stays as ``cross`` planned it.
    None when ``mixed`` has no int8 node, or ``cross`` runs on that library alone (``mixed``
    itself is then the plan to race)."""
    library, int8 = mixed.library, int8_nodes(mixed)
    if not int8 or set(cross.libraries) == {library}:
        return None
    plan = copy.deepcopy(cross)
    tasks = []
    for entry in plan.tasks:
        kept = [node for node in entry["nodes"] if node not in int8]
        if kept:
            tasks.append({**entry, "nodes": kept})
    for entry in mixed.tasks:
        chosen = [node for node in entry["nodes"] if node in int8]
        if entry.get("precision") == "int8" and chosen:
            tasks.append({**copy.deepcopy(entry), "nodes": chosen})
    plan.tasks = tasks
    for node in int8:
        plan.nodes[node] = copy.deepcopy(mixed.nodes[node])
    used = {entry["library"] for entry in plan.nodes.values()}
    versions = {**plan.libraries, library: mixed.libraries[library]}
    plan.libraries = {name: version for name, version in versions.items() if name in used}
    # the cross plan's settings for the library (its one-spinner policy) stand; the int8 ones join them
    settings = {**plan.library_settings, library: {**mixed.plan_level, **plan.library_settings.get(library, {})}}
    plan.library_settings = {name: value for name, value in settings.items() if name in used}
    plan.plan_level = {} if len(used) > 1 else dict(plan.library_settings[library])
    plan.extra["precision"] = {**copy.deepcopy(mixed.extra["precision"]), "int8_from": library}
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


def weight_bytes(model: Model, int8_nodes: set[str]) -> int:
    """Bytes of the weights: 1 per weight of an int8 op (its bias stays 32-bit), 4 otherwise."""
    quantized = {node.input[1] for node in model.proto.graph.node if node.name in int8_nodes}
    total = 0
    for name, tensor in model.initializers.items():
        count = 1
        for d in tensor.dims:
            count *= d
        itemsize = 1 if name in quantized else 4
        total += count * itemsize
    return total


class _Predictor:
    """Summed op times of a labelling of the nodes in fp32 / int8, with the quantize and
    dequantize of every tensor that changes precision on the way (measured conversions), each
    tensor's counted once: the one-library case of core/cross_library/problem.py."""

    def __init__(self, model, library, device, db, settings, fp32_plan, int8_entries):
        self.int8_us = {node: entry["time_us"] for entry in int8_entries.values() for node in entry["nodes"]}
        self.options = {}
        for entry in fp32_plan.tasks:
            for node in entry["nodes"]:
                self.options[node] = {False: Option(f"{library.name}:NCHW", entry["time_us"])}
                if node in self.int8_us:
                    self.options[node][True] = Option(f"{library.name}:int8", self.int8_us[node])
        self.problem = CrossProblem(options={node: list(by_precision.values()) for node, by_precision in self.options.items()})
        connect(self.problem, model, {library.name: library})
        self.table: ConversionTable = measure_conversions(self.problem.sides(), {library.name: library}, device, db,
                                                          settings)

    def __call__(self, int8_nodes: set[str]) -> float:
        assignment = {node: options[0] for node, options in self.problem.options.items()}
        assignment.update({node: by_precision[node in int8_nodes] for node, by_precision in self.options.items()})
        return self.problem.total_us(self.table, assignment)


def search_precision(model: Model, library: Library, device, db: RecordDB, settings, fp32_plan: Plan,
                     int8_tasks: list[Task], calibration: Calibration, metric: Metric | None, metric_name: str | None,
                     max_drop: float, on_step: Callable[[str], None] | None = None) -> PrecisionSearch:
    """Steps 1-3 of the module docstring; returns the front and the chosen point's plan. ``metric``
    None: the default for the model's outputs (core/precision/accuracy.default_metric).

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
    sensitivity: dict[str, float] = {}

    def search_front(int8_settings: dict, int8_entries: dict, suffix: str) -> list[FrontPoint]:
        """One front at one set of int8 plan-level settings; the fp32 point with the first."""
        predict = None
        candidates: list[str] = []
        if int8_entries:
            say("measuring quantize / dequantize conversions")
            predict = _Predictor(model, library, device, db, settings, fp32_plan, int8_entries)
            candidates = [node for node in fp32_plan.nodes if node in predict.int8_us]

        def point(name: str, nodes: set[str]) -> FrontPoint:
            name = name if name == "fp32" else name + suffix
            plan = mixed_plan(fp32_plan, int8_entries, int8_settings, nodes, precision)
            predicted = predict(nodes) if predict else fp32_plan.estimated_us()
            score = fp32_score
            try:
                if nodes:
                    score = metric(_library_outputs(library, model, plan, calibration.held_out), reference,
                                   calibration.held_out)
            except Exception as exc:  # a plan the library cannot build or run is a failed point, never chosen
                return FrontPoint(name, sorted(nodes), predicted, float("nan"), float("inf"),
                                  weight_bytes(model, nodes), failed=one_line(exc)[:300])
            plans[name] = plan
            drop = fp32_score - score
            return FrontPoint(name, sorted(nodes), predicted, score, drop, weight_bytes(model, nodes), drop <= max_drop)

        front = [] if "fp32" in plans else [point("fp32", set())]
        noise: dict[str, float] = {}  # SQNR of the outputs, dB: orders ops the metric cannot tell apart
        drops: dict[str, float] = {}
        if candidates:
            say(f"sensitivity of {len(candidates)} ops, each alone in int8")
            feeds, expected = calibration.held_out[:SENSITIVITY_FEEDS], reference[:SENSITIVITY_FEEDS]
            fp32_on_feeds = metric(expected, expected, feeds)
            for node in list(candidates):
                plan = mixed_plan(fp32_plan, int8_entries, int8_settings, {node}, precision)
                try:
                    outputs = _library_outputs(library, model, plan, feeds)
                except Exception as exc:  # this op cannot run in int8 in the whole model: it stays float
                    say(f"{node} in int8 failed ({one_line(exc)[:200]}): it stays fp32")
                    candidates.remove(node)
                    continue
                drops[node] = fp32_on_feeds - metric(outputs, expected, feeds)
                noise[node] = sqnr(outputs, expected, feeds)
            if candidates:
                say("all candidates in int8, then backing off the most sensitive")
                front += back_off(candidates, drops, noise, point)
        for node, drop in drops.items():
            sensitivity.setdefault(node, drop)
        return front

    own = precision_defaults(library, device, int8_tasks)
    choices = [int8_choices(model, library, device, db, fp32_plan, int8_tasks, own)]
    fastest = int8_choices(model, library, device, db, fp32_plan, int8_tasks)
    differs = {k: v for k, v in fastest[0].items() if k in own and own[k] != v}
    if differs and fastest[1]:
        choices.append(fastest)
    front: list[FrontPoint] = []
    for index, (int8_settings, int8_entries) in enumerate(choices):
        suffix = "" if index == 0 else " (" + ", ".join(f"{k} {v}" for k, v in differs.items()) + ")"
        if suffix:
            say(f"again with {suffix[2:-1]}, which its op times favour")
        front += search_front(int8_settings, int8_entries, suffix)
    chosen = fastest_within_budget(front)
    return PrecisionSearch(front, chosen, plans[chosen.name], sensitivity, plans, metric_name)


def back_off(candidates: list[str], sensitivity: dict[str, float], noise: dict[str, float],
             point: Callable[[str, set[str]], FrontPoint]) -> list[FrontPoint]:
    """All ``candidates`` in int8 ("int8"), then the most sensitive going back to float, one at a
    time (in groups past MAX_BACKOFF_STEPS candidates), each step measured by ``point(name,
    int8 nodes)``, until a point is within the budget or none is left in int8. Sensitivities are
    each op's alone, and a group goes back whole, so some ops may have gone back without need:
    once within the budget, the ops sent back return to int8 one at a time, the least sensitive
    first (at most MAX_BACKOFF_STEPS tries), each kept if the budget still holds ("mixed-3+1",
    ...)."""
    current = set(candidates)
    front = [point("int8", current)]
    order = sorted(candidates, key=lambda n: (-sensitivity[n], noise.get(n, 0.0)))
    group = max(1, -(-len(order) // MAX_BACKOFF_STEPS))
    step, sent_back = 0, []
    while not front[-1].within_budget and order:
        back, order = order[:group], order[group:]
        current -= set(back)
        sent_back += back
        step += 1
        if current:
            front.append(point(f"mixed-{step}", set(current)))
    if current and front[-1].within_budget:
        measured, tries = {frozenset(p.int8_nodes) for p in front}, 0
        for node in reversed(sent_back):
            if tries == MAX_BACKOFF_STEPS:
                break
            if frozenset(current | {node}) in measured:  # e.g. the point before the last step
                continue
            tries += 1
            trial = point(f"mixed-{step}+{tries}", current | {node})
            front.append(trial)
            if trial.within_budget:
                current.add(node)
    return front


def fastest_within_budget(front: list[FrontPoint]) -> FrontPoint:
    within = [p for p in front if p.within_budget]
    if not within:
        raise KselectError("no plan met the accuracy budget")  # the fp32 point always does
    return min(within, key=lambda p: p.predicted_us)
