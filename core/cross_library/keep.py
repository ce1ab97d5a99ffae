"""The cross-library step of a tune: per op across the tuned libraries, conversions counted
(core/cross_library/plan.py), then each candidate plan and ONNX Runtime's default session timed
alone in fresh processes; what is shown faster than the default is kept."""

from __future__ import annotations

import copy
from functools import partial
from typing import TYPE_CHECKING

from kselect.core.contract import plugins
from kselect.core.cross_library.by_difference import NodeCosts, figure_by_difference
from kselect.core.cross_library.plan import attach_in_context, isolated_figure, plan_across
from kselect.core.errors import one_line
from kselect.core.models.model import Model
from kselect.core.plans.library_plan import onnxruntime_default_plan
from kselect.core.plans.plan import PREDICTED_BASIS, PREDICTED_US, Plan, reduced_nodes, same_ops
from kselect.core.plans.spinning import spinning_variants
from kselect.core.precision.mixed import score_plan, with_reduced_ops
from kselect.core.precision.quant import PRECISIONS
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.context import IN_CONTEXT
from kselect.core.whole_model.selection import verified_across

if TYPE_CHECKING:
    from kselect.core.config import TuneConfig
    from kselect.core.precision.choice import PrecisionRequest


def plan_and_keep_across(result, db: RecordDB, config: "TuneConfig", events,
                         reduced: "PrecisionRequest | None" = None) -> None:
    """Per op across the tuned libraries, conversions counted; then ONNX Runtime's default
    session, each library's plan, the cross-library plan and (with reduced precisions) the
    cross-library plans with the libraries' reduced-precision ops, when within the accuracy
    budget, each alone in fresh processes: what is shown faster than the default is kept, else
    ONNX Runtime's own configuration (when MLAS, its library, was tuned)."""
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
    fallback = onnxruntime_default_plan(model, device, db) if plugins.baseline_library().name in tunings else None
    # the race's reference and each library's plan get figures in context from the runs the planner
    # made, or none of them does; a library's mixed plan (reduced precisions) at its fp32 plan's
    # run times what its front predicts it over its fp32 plan. A plan without one is predicted
    # from sums.
    in_context = plan.extra["cross_library"].get("in_context")
    own_plans = {name: t.plan for name, t in tunings.items()}
    figure_of_combined = None
    if not attach_in_context(own_plans, fallback, in_context, relative=over_fp32_plan(tunings)):
        isolated_figure(plan)
    elif reduced is not None:
        # the combined plans of a reduced race: by difference from the plan across libraries or a
        # library's fp32 plan, the plans whose whole runs the planner timed
        bases = [plan] + [_with_figure(fp32_plans[name], us) for name, us in in_context["whole_us"].items()
                          if name in fp32_plans]
        figure_of_combined = partial(figure_by_difference, bases=bases, costs=NodeCosts.of_race(in_context, tunings))
    candidates = [(f"{name} plan", t.plan) for name, t in tunings.items()] + spinning_variants(plan)
    if reduced is not None:
        # each library in its mixed plans' session-wide settings (which hold its fp32 ones): the
        # chosen point's when it runs reduced-precision ops (its front may be the one at other
        # settings, e.g. per-tensor weights), else its first such point's
        def reduced_settings_plan(tuning) -> Plan:
            search = tuning.precision
            if search is None:
                return fp32_plans[tuning.library.name]
            if reduced_nodes(search.plan):
                return search.plan
            return next((p for point, p in search.plans.items() if point != "fp32"), fp32_plans[tuning.library.name])

        with_reduced = {name: reduced_settings_plan(t) for name, t in tunings.items()}

        def plan_per_op(allowed: dict[str, frozenset], precision_of: dict) -> Plan:
            with events.working("planning across libraries with each op's precision chosen per op"):
                planned = plan_across(model, device, db, {name: t.library for name, t in tunings.items()}, with_reduced,
                                      settings, remeasure=remeasure, reduced_nodes=allowed)
            planned.extra["precision"] = {**copy.deepcopy(precision_of), "reduced_from": "per op"}
            return planned

        candidates += cross_with_reduced_ops(model, plan, tunings, reduced, events, plan_per_op, figure_of_combined)
    with events.working("checking the plans end to end against ONNX Runtime's default session"):
        result.plan, result.checks = verified_across(model, candidates, rounds=check_rounds, fallback=fallback,
                                                     max_rounds=max(check_rounds, check_max_rounds))
    events.cross_checked(result.plan, result.checks)


def over_fp32_plan(tunings: dict) -> dict[str, float]:
    """Library -> its kept plan's predicted time over its fp32 plan's, both figures from its
    precision front (one scale: core/precision/mixed.py); libraries without a front are left out."""
    found = {}
    for name, tuning in tunings.items():
        search = tuning.precision
        if search is None or tuning.plan is search.plans.get("fp32"):
            continue
        kept_us = tuning.plan.extra.get(PREDICTED_US)
        fp32_us = search.plans["fp32"].extra.get(PREDICTED_US) if "fp32" in search.plans else None
        if kept_us and fp32_us:
            found[name] = kept_us / fp32_us
    return found


def _with_figure(plan: Plan, whole_us: float) -> Plan:
    """A copy of a library's fp32 plan with its whole run in the planner's runs as its figure."""
    copied = copy.deepcopy(plan)
    copied.extra.update({PREDICTED_US: whole_us, PREDICTED_BASIS: IN_CONTEXT})
    return copied


def cross_with_reduced_ops(model: Model, cross: Plan, tunings: dict, request: "PrecisionRequest", events,
                           plan_per_op=None, figure=None) -> list:
    """Race candidates with reduced-precision ops across libraries, those whose metric on the
    held-out feeds stays within the budget: per library that chose such ops, the plan across
    libraries with them put in on that library (core/precision/mixed.py, ``with_reduced_ops``);
    and, with ``plan_per_op`` ((precision -> nodes, a mixed plan's precision record) -> plan), the
    plan across libraries made with every library's chosen ops free to run in their precision on
    any library that measured it, or in fp32, per op (core/cross_library/plan.py): where one
    library chose int8 ops and another bf16 ops, a plan of all three precisions. ``figure(plan)``
    makes a raced plan's predicted figure (core/cross_library/by_difference.py)."""
    options = []
    chosen: dict[str, set] = {}
    precision_of = None
    mixed = {name: t.precision.plan for name, t in tunings.items() if t.precision and reduced_nodes(t.precision.plan)}
    for name, plan in mixed.items():
        options.append((f"cross-library plan with {name}'s {_precisions(plan)} ops",
                        lambda plan=plan: with_reduced_ops(cross, plan)))
        for node, precision in reduced_nodes(plan).items():
            chosen.setdefault(precision, set()).add(node)
        precision_of = precision_of or plan.extra["precision"]
    # one library's mixed plan, with another's reduced-precision ops on the nodes it keeps in fp32
    # (e.g. int8 where int8 holds, bf16 where only bf16 does): the ladder's middle rung across libraries
    for name, plan in mixed.items():
        in_fp32 = set(plan.nodes) - set(reduced_nodes(plan))
        for other, other_plan in mixed.items():
            if other != name and in_fp32 & set(reduced_nodes(other_plan)):
                options.append((f"{name}'s mixed plan with {other}'s {_precisions(other_plan)} ops where it runs fp32",
                                lambda plan=plan, other_plan=other_plan, in_fp32=in_fp32:
                                with_reduced_ops(plan, other_plan, in_fp32)))
    if plan_per_op is not None and chosen:
        allowed = {precision: frozenset(nodes) for precision, nodes in chosen.items()}
        options.append((f"cross-library plan, precision per op among the libraries' "
                        f"{'/'.join(p for p in PRECISIONS if p in allowed)} ops",
                        lambda: plan_per_op(allowed, precision_of)))
    candidates, made = [], []
    for variant, make in options:
        try:
            combined = make()
        except Exception as exc:  # a plan that cannot be made or built is not raced
            events.cross_int8_scored(variant, None, None, request.max_drop, one_line(exc))
            continue
        if combined is None or not reduced_nodes(combined) or any(same_ops(combined, other) for other in made):
            continue
        made.append(combined)
        with events.working(f"measuring the accuracy of the {variant}"):
            try:
                score, drop = score_plan(model, combined, request.calibration, request.metric,
                                         combined.extra["precision"].get("metric"))
            except Exception as exc:  # a combination a runner cannot build is not raced
                events.cross_int8_scored(variant, None, None, request.max_drop, one_line(exc))
                continue
        events.cross_int8_scored(variant, score, drop, request.max_drop)
        combined.extra["precision"]["cross_score"] = {"score": round(score, 6), "drop": round(drop, 6)}
        if drop <= request.max_drop:
            if figure is not None:
                figure(combined)
            candidates.append((variant, combined))
    return candidates


def _precisions(plan: Plan) -> str:
    """The reduced precisions of a plan's ops, e.g. "int8" or "bf16/int8"."""
    found = set(reduced_nodes(plan).values())
    return "/".join(p for p in PRECISIONS if p in found)

