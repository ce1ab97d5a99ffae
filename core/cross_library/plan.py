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

from kselect.core.contract.space import config_key
import statistics

from kselect.core.cross_library.assembly import build_cross_plan
from kselect.core.cross_library.conversions import measure_conversions
from kselect.core.cross_library.problem import Choice, CrossProblem, cross_problem
from kselect.core.cross_library.switches import measure_sleep_costs, measure_switch_costs
from kselect.core.measuring.tuning_loop import library_defaults, library_tasks, stored_outcomes
from kselect.core.measuring.tuning_loop import remeasure as remeasure_configs
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.errors import KselectError
from kselect.core.plans.plan import PREDICTED_US, Plan
from kselect.core.whole_model.alone import node_times_alone
from kselect.core.whole_model.context import CONTEXT_RUNS, in_context, op_ratios
from kselect.core.precision.quant import TWIN_KINDS

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
    With several libraries and fp32 only, each library's ops are first scaled by their in-context
    ratios (``context_ratios``): the labelling is chosen on those times, while the plan's summed
    figure stays the isolated one the race's predictions are made from. (Precision fronts learn
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
    ratios = context_ratios(model, libraries, single_plans) if len(libraries) > 1 and not reduced_nodes else {}
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
    summary = plan.extra["cross_library"]
    if ratios:
        summary["in_context"] = unscale_plan(plan, ratios)
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


def context_ratios(model: Model, libraries: dict, single_plans: dict) -> dict[str, dict[str, float]]:
    """Per natively timed library whose runner times its nodes (``Library.node_times``): its own
    plan run whole in a fresh process, and per tuned node the ratio of its time there to its
    isolated time; every other node of the model gets the median ratio (``ratio_of``). A library
    whose plan cannot be timed so keeps its isolated times."""
    ratios = {}
    for name, library in libraries.items():
        plan = single_plans.get(name)
        if library.emulated or plan is None or not plan.nodes:
            continue
        try:
            timed = node_times_alone(model, name, plan, CONTEXT_RUNS)
        except KselectError:
            continue
        if timed is None:
            continue
        isolated = {node: entry["time_us"] for entry in plan.tasks if entry.get("time_us") for node in entry["nodes"]}
        found = op_ratios(in_context(model, *timed), isolated)
        if found:
            ratios[name] = found
    return ratios


def ratio_of(ratios: dict[str, dict[str, float]], library: str, node: str) -> float:
    found = ratios.get(library)
    if not found:
        return 1.0
    return found.get(node, statistics.median(found.values()))


def scale_ops(problem: CrossProblem, ratios: dict[str, dict[str, float]]) -> None:
    for node, options in problem.options.items():
        for option in options:
            if option.payload is not None and option.payload.library in ratios:
                option.time_us *= ratio_of(ratios, option.payload.library, node)


def unscale_plan(plan: Plan, ratios: dict[str, dict[str, float]]) -> dict:
    """Puts the plan's node times and summed figure back to isolated times (the race predicts from
    those: core/whole_model/prediction.py); returns what the context changed, for the plan's
    evidence."""
    in_context_us = plan.extra[PREDICTED_US]
    for node, entry in plan.nodes.items():
        isolated = entry["time_us"] / ratio_of(ratios, entry["library"], node)
        plan.extra[PREDICTED_US] -= entry["time_us"] - isolated
        entry["time_us"] = round(isolated, 3)
    plan.extra[PREDICTED_US] = round(plan.extra[PREDICTED_US], 3)
    return {"ratio_median": {name: round(statistics.median(found.values()), 4) for name, found in ratios.items()},
            "ratios": {name: {node: round(r, 4) for node, r in found.items()} for name, found in ratios.items()},
            "predicted_us": round(in_context_us, 3),
            "note": "the labelling was chosen on op times scaled by these ratios (each library's own plan "
                    "run whole, per node over isolated); predicted, greedy and single_library are in those "
                    "times; the plan's summed figure is isolated"}
