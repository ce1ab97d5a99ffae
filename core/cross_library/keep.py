"""The cross-library step of a tune: per op across the tuned libraries, conversions counted
(core/cross_library/plan.py), then each candidate plan and ONNX Runtime's default session timed
alone in fresh processes; what is shown faster than the default is kept."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.cross_library.plan import plan_across
from kselect.core.errors import one_line
from kselect.core.models.model import Model
from kselect.core.plans.library_plan import onnxruntime_default_plan
from kselect.core.plans.plan import Plan, int8_nodes
from kselect.core.plans.spinning import spinning_variants
from kselect.core.precision.mixed import score_plan, with_int8_ops
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.selection import verified_across

if TYPE_CHECKING:
    from kselect.core.config import TuneConfig
    from kselect.core.precision.choice import Int8Request


def plan_and_keep_across(result, db: RecordDB, config: "TuneConfig", events, int8: "Int8Request | None" = None) -> None:
    """Per op across the tuned libraries, conversions counted; then ONNX Runtime's default
    session, each library's plan, the cross-library plan and (with int8) the cross-library plan
    with each library's int8 ops put in, when within the accuracy budget, each alone in fresh
    processes: what is shown faster than the default is kept, else ONNX Runtime's own
    configuration (when MLAS, its library, was tuned)."""
    settings, verify, remeasure = config.settings, config.verify, config.remeasure
    check_rounds, check_max_rounds = config.check_rounds, config.check_max_rounds
    model, device, tunings = result.model, result.device, result.tunings
    # per op across libraries in fp32; a library's mixed-precision plan (within the accuracy budget)
    # races as it is, beside the plan across them
    fp32_plans = {name: t.precision.plans["fp32"] if t.precision else t.plan for name, t in tunings.items()}
    doing = ("re-timing the configs and conversions the plan chooses among, then planning across libraries"
             if remeasure else "measuring layout conversions and library switches, planning across libraries")
    with events.working(doing):
        plan = plan_across(model, device, db, {name: t.library for name, t in tunings.items()}, fp32_plans, settings,
                           remeasure=remeasure)
    # as planned: the race below marks the plan it keeps, which may be this one
    result.cross_plan, result.plan = copy.deepcopy(plan), plan
    events.cross_planned(plan)
    if not verify:
        return
    candidates = [(f"{name} plan", t.plan) for name, t in tunings.items()] + spinning_variants(plan)
    if int8 is not None:
        # each library in its int8 plans' session-wide settings (which hold its fp32 ones): the
        # chosen point's when it runs int8 ops (its front may be the one at other settings, e.g.
        # per-tensor weights), else its first int8 point's
        def int8_settings_plan(tuning) -> Plan:
            search = tuning.precision
            if search is None:
                return fp32_plans[tuning.library.name]
            if int8_nodes(search.plan):
                return search.plan
            return next((p for point, p in search.plans.items() if point != "fp32"), fp32_plans[tuning.library.name])

        with_int8 = {name: int8_settings_plan(t) for name, t in tunings.items()}

        def plan_int8_per_op(mixed: Plan) -> Plan:
            with events.working("planning across libraries with int8 per op"):
                planned = plan_across(model, device, db, {name: t.library for name, t in tunings.items()}, with_int8,
                                      settings, remeasure=remeasure, int8_nodes=frozenset(int8_nodes(mixed)))
            planned.extra["precision"] = {**copy.deepcopy(mixed.extra["precision"]), "int8_from": "per op"}
            return planned

        candidates += cross_with_int8_ops(model, plan, tunings, int8, events, plan_int8_per_op)
    fallback = onnxruntime_default_plan(model, device, db) if plugins.baseline_library().name in tunings else None
    with events.working("checking the plans end to end against ONNX Runtime's default session"):
        result.plan, result.checks = verified_across(model, candidates, rounds=check_rounds, fallback=fallback,
                                                     max_rounds=max(check_rounds, check_max_rounds))
    events.cross_checked(result.plan, result.checks)


def cross_with_int8_ops(model: Model, cross: Plan, tunings: dict, int8: "Int8Request", events,
                        plan_int8_per_op=None) -> list:
    """Race candidates with int8 ops across libraries, those whose metric on the held-out feeds
    stays within the budget: per library that chose int8 ops, the plan across libraries with them
    put in on that library (core/precision/mixed.py, ``with_int8_ops``) and, with ``plan_int8_per_op`` (the
    library's mixed plan -> plan), the plan across libraries made with its int8 ops free to run in int8 on any
    library that measured them, or in fp32, per op (core/cross_library/plan.py)."""
    candidates, made = [], []
    for name, tuning in tunings.items():
        search = tuning.precision
        if search is None or not int8_nodes(search.plan):
            continue
        options = [(f"cross-library plan with {name}'s int8 ops", lambda: with_int8_ops(cross, search.plan))]
        if plan_int8_per_op is not None:
            options.append((f"cross-library plan, int8 per op among {name}'s int8 ops",
                            lambda: plan_int8_per_op(search.plan)))
        for variant, make in options:
            try:
                combined = make()
            except Exception as exc:  # a plan that cannot be made or built is not raced
                events.cross_int8_scored(variant, None, None, int8.max_drop, one_line(exc))
                continue
            if combined is None or not int8_nodes(combined) or any(same_ops(combined, other) for other in made):
                continue
            made.append(combined)
            with events.working(f"measuring the accuracy of the {variant}"):
                try:
                    score, drop = score_plan(model, combined, int8.calibration, int8.metric, search.metric_name)
                except Exception as exc:  # a combination a runner cannot build is not raced
                    events.cross_int8_scored(variant, None, None, int8.max_drop, one_line(exc))
                    continue
            events.cross_int8_scored(variant, score, drop, int8.max_drop)
            combined.extra["precision"]["cross_score"] = {"score": round(score, 6), "drop": round(drop, 6)}
            if drop <= int8.max_drop:
                candidates.append((variant, combined))
    return candidates


def same_ops(a: Plan, b: Plan) -> bool:
    """Whether two plans run every node on the same library, task and config."""
    def ops(plan):
        return {node: (e["library"], e["task"], config_key(e["config"])) for node, e in plan.nodes.items()}
    return ops(a) == ops(b)
