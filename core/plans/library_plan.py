"""A library's plan from its records: the plan variants a tune builds (tuned, plan-level
settings only, library default), ONNX Runtime's own configuration as a plan, and the variant a
tune keeps after the end-to-end check against the library default."""

from __future__ import annotations

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.cross_library.plan import plan_across
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TaskOutcome, library_defaults, library_tasks, stored_outcomes
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import plan_variants
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.selection import verified_plan


def library_plan_variants(model: Model, library: Library, device: Device, db: RecordDB, tasks: list[Task],
                          outcomes: list[TaskOutcome], settings: MeasureSettings | None = None) -> list:
    """[(name, plan)], most tuned first (core/plans/plan.plan_variants). For a library that plans
    layouts per op the tuned plan comes from core/cross_library/plan.py, with the layout changes it
    implies measured now (``settings``) unless stored."""
    records = stored_outcomes(tasks, library, device, db)
    variants = plan_variants(model, device, library, library.version(), tasks, records,
                             {o.task.key: o.default_config for o in outcomes})
    if not variants:
        unmeasured = [o for o in outcomes if not any(r.result.status == "ok" for r in records[o.task.key])]
        ids = ", ".join(o.task.id for o in unmeasured)
        if any(o.out_of_time and o.samples == 0 for o in unmeasured):
            raise KselectError(f"no plan: the time budget (--time-budget) ran out before a config of {ids} was "
                               "measured; give it more time (every record stored so far is kept)")
        why = next((o.default.reason for o in unmeasured if o.default is not None and o.default.reason), "")
        if not unmeasured:  # every task has a valid config, but no one plan-level setting has one of each
            failed = [o for o in outcomes if o.default is not None and o.default.status != "ok"]
            example = f" (e.g. {failed[0].task.id}'s default failed: {failed[0].default.reason})" if failed else ""
            raise KselectError(f"no plan: no one setting of {', '.join(library.plan_level_dims)} has a measured config "
                               f"of every task{example}; tune with a larger --budget")
        raise KselectError(f"no plan: no config of {ids} was measured without failing" + (f" (e.g. {why})" if why else ""))
    if library.plans_layouts_per_op:
        planned = plan_across(model, device, db, {library.name: library}, {library.name: variants[0][1]},
                              settings or MeasureSettings())
        variants = [("tuned", planned)] + [(name, plan) for name, plan in variants if name != "tuned"]
    return variants


def onnxruntime_default_plan(model: Model, device: Device, db: RecordDB):
    """ONNX Runtime's default session as a plan: MLAS with every op at the library default (the
    original model and ORT's default session options), or None without those records. A
    cross-library tune keeps it when nothing it built beats that session end to end."""
    try:
        baseline = plugins.baseline_library()
        tasks = library_tasks(model, baseline)
    except KselectError:  # no ONNX Runtime here, or no op it tunes
        return None
    defaults = library_defaults(tasks, baseline, device)
    variants = dict(plan_variants(model, device, baseline, baseline.version(), tasks,
                                  stored_outcomes(tasks, baseline, device, db), defaults))
    return variants.get("library default")


def verified_library_plan(model: Model, library: Library, device: Device, db: RecordDB, tasks: list[Task],
                          outcomes: list[TaskOutcome], verify: bool = True, on_result=None,
                          settings: MeasureSettings | None = None):
    """What ``kselect tune`` writes after tuning one library: the most tuned plan variant that is
    not slower than the library default end to end (``verify``), else the tuned one."""
    variants = library_plan_variants(model, library, device, db, tasks, outcomes, settings)
    return verified_plan(library, model, variants, on_result=on_result) if verify else variants[0][1]
