"""Plans across libraries: per op, the library and config that minimise the whole model's time,
layout and library changes included. The steps, one module each:

1. core/cross_library/problem.py: options per tuned node from each library's records, and data edges;
2. here: re-time the contenders, scale each library's op times by what its ops take in a whole
   run of its own plan (core/whole_model/context.op_ratios), and measure the conversions, switch
   and sleep costs the problem needs (``plan_across``);
3. core/cross_library/labelling.py: the cheapest labelling (core/cross_library/planner.py solves it exactly);
4. core/cross_library/assembly.py: the Plan, with the evidence.
"""

from __future__ import annotations

import statistics

from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.cross_library.assembly import build_cross_plan
from kselect.core.cross_library.conversions import measure_conversions
from kselect.core.cross_library.problem import Choice, CrossProblem, cross_problem
from kselect.core.cross_library.switches import measure_sleep_costs, measure_switch_costs
from kselect.core.errors import KselectError
from kselect.core.measuring.tuning_loop import library_defaults, library_tasks, stored_outcomes
from kselect.core.measuring.tuning_loop import remeasure as remeasure_configs
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.plans.plan import (
    ISOLATED_US,
    LIBRARY_DEFAULT,
    LIBRARY_DEFAULT_PARTS,
    PREDICTED_BASIS,
    PREDICTED_US,
    Plan,
)
from kselect.core.precision.quant import TWIN_KINDS
from kselect.core.whole_model.alone import node_times_alone
from kselect.core.whole_model.context import CONTEXT_RUNS, IN_CONTEXT, InContext, in_context, op_ratios

BASELINE_DEFAULT = "baseline default"  # context_runs' key for the baseline library's default run
REMEASURE_ROUNDS = 3  # a re-timed pick can lose its place to another stored record; re-time that one too


def plan_across(model: Model, device, db, libraries: dict, single_plans: dict, settings, on_measured=None,
                remeasure: bool = False, reduced_nodes: dict[str, frozenset] | None = None) -> Plan:
    """The cross-library plan from stored records: each library keeps the plan-level settings of
    its own plan (``single_plans``); conversions not yet stored are measured now. With
    ``remeasure``, every config the planner chooses among (and each library default) and every
    conversion it needs is timed again first, so that the choice and the prediction rest on
    timings from one period, not on records from hours apart. What switching between each pair of
    natively running libraries costs is measured now (core/cross_library/switches.py) and charged on every edge
    between them. ``reduced_nodes``: precision (int8, bf16, fp16) -> the ops that may also run in
    it, on any library whose plans hold it and that measured their twins in it (precision then
    chosen per op with the library; the accuracy is the caller's to check: core/precision/mixed.py).
    With several libraries and fp32 only, each library's ops are first scaled by their ratios in
    context (``context_runs``) and the labelling is chosen on those times; the plan's figure is
    then a whole-model time in context (``in_context_figures``). (Precision fronts learn
    corrections of their own, core/precision/mixed.py.)"""
    reduced_nodes = {p: frozenset(nodes) for p, nodes in (reduced_nodes or {}).items() if nodes}
    task_lists, defaults, plan_level = {}, {}, {}
    for name, library in libraries.items():
        twins = tuple(p for p in reduced_nodes if p in library.plan_precisions)
        task_lists[name] = library_tasks(model, library, ("fp32",) + twins)
        defaults[name] = library_defaults(task_lists[name], library, device)
        plan_level[name] = dict(single_plans[name].plan_level)
    tasks = extract_tasks(model)
    tasks += [t.at_precision(precision) for precision, nodes in reduced_nodes.items()
              for t in list(tasks) if t.kind in TWIN_KINDS and t.precision == "fp32" and nodes & set(t.nodes)]

    def current() -> tuple[dict, CrossProblem]:
        records = {name: stored_outcomes(task_lists[name], library, device, db) for name, library in libraries.items()}
        return records, cross_problem(model, libraries, tasks, records, defaults, plan_level, reduced_nodes)

    records, problem = current()
    remeasured: set = set()
    for _ in range(REMEASURE_ROUNDS if remeasure else 0):
        contenders = _contenders(problem, libraries, defaults, single_plans, task_lists)
        wanted = {key: entry for key, entry in contenders.items() if key not in remeasured}
        if not wanted:
            break
        remeasure_configs(list(wanted.values()), defaults, device, db, settings, on_measured)
        remeasured |= set(wanted)
        records, problem = current()
    runs = context_runs(model, libraries, single_plans) if len(libraries) > 1 and not reduced_nodes else {}
    ratios = {name: found for name, run in runs.items()
              if name in libraries and (found := op_ratios(run, isolated_times(single_plans[name])))}
    scale_ops(problem, ratios)
    table = measure_conversions(problem.sides(), libraries, device, db, settings, on_measured, again=remeasure)
    if len(libraries) > 1:
        native = [name for name, library in libraries.items() if not library.emulated]
        table.switch_us = measure_switch_costs(native)
        table.sleep_us = measure_sleep_costs(native)
    missing: set = set()
    plan = build_cross_plan(model, device, libraries, problem, table, plan_level, defaults, missing)
    if missing:  # reentries of tensors no edge could convert
        table.times_us.update(measure_conversions(missing, libraries, device, db, settings, on_measured).times_us)
        plan = build_cross_plan(model, device, libraries, problem, table, plan_level, defaults)
    # A library whose race kept its own default run (MLAS: ONNX Runtime's transformer, not kselect's
    # NCHWc rewrite, which ran pplcnet 0.77x in a plan of MLAS ops alone) runs its part of this plan
    # so too where its ops keep their default configs: its ratios in context come from that run.
    parts = sorted(name for name in plan.libraries if single_plans[name].extra.get(LIBRARY_DEFAULT))
    if parts:
        plan.extra[LIBRARY_DEFAULT_PARTS] = parts
    summary = plan.extra["cross_library"]
    if ratios:
        summary["in_context"] = in_context_figures(plan, ratios, runs)
    fp32 = [task for task in tasks if task.precision == "fp32"]
    summary["default_ops_us"] = {name: _default_ops_us(fp32, records[name], defaults[name]) for name in libraries}
    if remeasure:
        summary["remeasured"] = {"configs": len(remeasured), "conversions": len(problem.sides())}
    return plan


def _contenders(problem: CrossProblem, libraries: dict, defaults: dict, single_plans: dict, task_lists: dict) -> dict:
    """(library, task, config) of every option the planner chooses among, of each library's
    default for those tasks and of each library's own plan, keyed by (library, task key, config key)."""
    wanted = {}
    for options in problem.options.values():
        for option in options:
            choice: Choice | None = option.payload
            if choice is None:
                continue
            for config in (choice.record.config, defaults[choice.library][choice.task.key]):
                wanted[(choice.library, choice.task.key, config_key(config))] = (libraries[choice.library], choice.task, config)
    for name, plan in single_plans.items():
        task_of = {task.key: task for task in task_lists[name]}
        for entry in plan.tasks:
            if entry["key"] in task_of:
                wanted[(name, entry["key"], config_key(entry["config"]))] = (libraries[name], task_of[entry["key"]], entry["config"])
    return wanted


def _default_ops_us(tasks: list[Task], records: dict, defaults: dict) -> float | None:
    """The summed time of every tuned op with the library's own configs (None if one is missing)."""
    total = 0.0
    for task in tasks:
        if task.key not in defaults:
            return None
        key = config_key(defaults[task.key])
        record = next((r for r in records.get(task.key, []) if r.config_key == key and r.result.status == "ok"), None)
        if record is None:
            return None
        total += record.result.median_us * len(task.nodes)
    return round(total, 3)


def context_runs(model: Model, libraries: dict, single_plans: dict) -> dict[str, InContext]:
    """Each natively timed library's own plan run whole in a fresh process, timed per node
    (``Library.node_times``), and, under the key ``BASELINE_DEFAULT``, the baseline library's
    default run (ONNX Runtime's default session, the race's reference) when it is among
    ``libraries``. A library whose runner cannot time its nodes, or whose run fails, has none."""
    runs = {}
    baseline = plugins.baseline_library().name
    jobs = [(name, name, single_plans.get(name)) for name in libraries]
    jobs += [(BASELINE_DEFAULT, baseline, None)] if baseline in libraries else []
    for key, name, plan in jobs:
        if libraries[name].emulated or (key == name and (plan is None or not plan.nodes)):
            continue
        try:
            timed = node_times_alone(model, name, plan, CONTEXT_RUNS)
        except KselectError:
            continue
        if timed is not None:
            runs[key] = in_context(model, *timed)
    return runs


def isolated_times(plan: Plan) -> dict[str, float]:
    """Each planned node's isolated time, us, as its plan task records it."""
    return {node: entry["time_us"] for entry in plan.tasks if entry.get("time_us") for node in entry["nodes"]}


def ratio_of(ratios: dict[str, dict[str, float]], library: str, node: str) -> float:
    """The node's ratio on that library; the library's median for a node its run did not time; 1
    for a library without ratios."""
    found = ratios.get(library)
    if not found:
        return 1.0
    return found.get(node, statistics.median(found.values()))


def scale_ops(problem: CrossProblem, ratios: dict[str, dict[str, float]]) -> None:
    for node, options in problem.options.items():
        for option in options:
            if option.payload is not None and option.payload.library in ratios:
                option.time_us *= ratio_of(ratios, option.payload.library, node)


def in_context_figures(plan: Plan, ratios: dict[str, dict[str, float]], runs: dict[str, InContext]) -> dict:
    """Puts the plan's node times back to isolated ones and, when every library it uses has a run,
    makes its figure a whole-model time in context: the ops in context, the conversions as
    measured, and the untuned nodes' time of each library's run weighted by its share of the
    plan's ops (the isolated sum kept beside it, ``ISOLATED_US``). Returns the evidence."""
    scaled_us = plan.extra[PREDICTED_US]
    isolated_us = scaled_us
    for node, entry in plan.nodes.items():
        isolated = entry["time_us"] / ratio_of(ratios, entry["library"], node)
        isolated_us -= entry["time_us"] - isolated
        entry["time_us"] = round(isolated, 3)
    evidence = {"ratio_median": {name: round(statistics.median(found.values()), 4) for name, found in ratios.items()},
                "ratios": {name: {node: round(r, 4) for node, r in found.items()} for name, found in ratios.items()},
                "whole_us": {name: round(run.whole_us, 1) for name, run in runs.items()},
                "untuned_us": {name: round(run.untuned_us, 1) for name, run in runs.items()}}
    used = [entry["library"] for entry in plan.nodes.values()]
    if used and all(name in runs for name in used):
        untuned_us = sum(runs[name].untuned_us for name in used) / len(used)
        plan.extra[PREDICTED_US] = round(scaled_us + untuned_us, 3)
        plan.extra[PREDICTED_BASIS] = IN_CONTEXT
        plan.extra[ISOLATED_US] = round(isolated_us, 3)
    else:
        plan.extra[PREDICTED_US] = round(isolated_us, 3)
    return evidence


def attach_in_context(plans: dict[str, Plan], reference: Plan | None, evidence: dict | None,
                      relative: dict[str, float] | None = None) -> bool:
    """Gives each library's own plan (``plans``: library -> plan) and the race's reference (ONNX
    Runtime's default, None when not raced) their whole-model figures in context from the runs
    ``in_context_figures`` recorded, so that every plan of the race is predicted through the
    same kind of figure; only when all of them have one (False: nothing changed).
    ``relative``: library -> the plan's figure over its library's fp32 plan's, both from one
    precision front (a mixed plan): the plan is predicted at the fp32 plan's run times that, so
    that figures taken in another set of runs, at another speed of the machine, do not meet in
    one race."""
    if not evidence:
        return False
    whole = evidence["whole_us"]
    if any(name not in whole for name in plans) or (reference is not None and BASELINE_DEFAULT not in whole):
        return False
    relative = relative or {}
    for name, plan in [*plans.items(), *([(BASELINE_DEFAULT, reference)] if reference is not None else [])]:
        if not (plan.extra.get(PREDICTED_BASIS) == IN_CONTEXT and ISOLATED_US in plan.extra):
            plan.extra[ISOLATED_US] = round(plan.extra.get(PREDICTED_US, plan.estimated_us()), 3)
        plan.extra[PREDICTED_US] = round(whole[name] * relative.get(name, 1.0), 3)
        plan.extra[PREDICTED_BASIS] = IN_CONTEXT
    return True


def isolated_figure(plan: Plan) -> None:
    """The plan's figure back to its isolated sum, where ``in_context_figures`` made it one in context."""
    if plan.extra.get(PREDICTED_BASIS) == IN_CONTEXT and ISOLATED_US in plan.extra:
        plan.extra[PREDICTED_US] = plan.extra.pop(ISOLATED_US)
        del plan.extra[PREDICTED_BASIS]
