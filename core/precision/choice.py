"""Which ops of one library's plan run in int8: the request an int8 tune makes (refused up front when
it cannot be honoured, calibrated), and the choice among the latency / accuracy front
(core/precision/mixed.py), timed end to end against the fp32 plan."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import Plan
from kselect.core.precision.accuracy import get_metric, user_metric
from kselect.core.precision.calibration import calibration_for, compute_ranges
from kselect.core.precision.half import HALF_PRECISIONS
from kselect.core.precision.mixed import search_precision
from kselect.core.precision.quant import PRECISIONS
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.alone import family_confidence, median_bounds, paired_speedups, timed_alone
from kselect.core.whole_model.selection import race_verdict

if TYPE_CHECKING:
    from kselect.core.config import TuneConfig
    from kselect.core.precision.calibration import Calibration


@dataclass
class Int8Request:
    calibration: "Calibration"
    metric: object  # core.accuracy.Metric, or None: chosen from the model's outputs
    metric_name: str | None
    max_drop: float


def int8_request(model: Model, libraries: list[Library], config: "TuneConfig") -> Int8Request | None:
    """Refuses, before anything is measured, what an int8 tune cannot do; calibrates."""
    precision, calibration, method = config.precision, config.calibration, config.calibration_method
    max_drop, metric, preprocess = config.max_accuracy_drop, config.metric, config.image_preprocess

    wanted = [p.strip() for p in precision.split(",")] if isinstance(precision, str) else list(precision)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown or "fp32" not in wanted:
        raise KselectError(f"--precision {','.join(wanted)}: give fp32 or fp32,int8 (known: {', '.join(PRECISIONS)})")
    half = [p for p in wanted if p in HALF_PRECISIONS]
    if half:
        # bf16 / fp16 twins are measured per op (oneDNN's bf16 kernels, core/precision/half.py), but the
        # budgeted search below walks between int8 and fp32 only
        raise KselectError(f"--precision {','.join(wanted)}: {' and '.join(half)} kernels are measured per op, but the "
                           f"accuracy-budgeted choice is between fp32 and int8 so far: give fp32 or fp32,int8")
    if "int8" not in wanted:
        if calibration is not None or preprocess is not None:
            raise KselectError("--calibration is for int8: add --precision fp32,int8")
        return None
    lacking = [lib for lib in libraries if "int8" not in lib.plan_precisions]
    if len(lacking) == len(libraries):  # with several libraries, those without int8 plans are tuned in fp32
        runs = ", ".join(n for n, lib in plugins.libraries().items() if "int8" in lib.plan_precisions)
        if "int8" in lacking[0].precisions:
            raise KselectError(f"{lacking[0].name} measures int8 kernels per op but its whole-model runner has no int8 "
                               f"path yet, so no int8 plan of it can be checked or shipped (int8 plans: {runs})")
        raise KselectError(f"{lacking[0].name} has no int8 kernels in kselect (int8 plans: {runs})")
    if not 0 <= max_drop < 1:
        raise KselectError(f"--max-accuracy-drop {max_drop}: give a drop between 0 and 1 (0.01: one point of top-1 "
                           f"agreement, or of cosine similarity)")
    if callable(metric):
        chosen_metric, name = user_metric(metric), getattr(metric, "__name__", "user metric")
    else:
        chosen_metric, name = (get_metric(metric), metric) if metric else (None, None)
    data = calibration_for(model, calibration, method, preprocess)
    compute_ranges(model, data)
    return Int8Request(data, chosen_metric, name, max_drop)


FRONT_POINTS_TIMED = 6


def points_to_time(front: list, chosen) -> list:
    """The front points timed end to end, at most FRONT_POINTS_TIMED: the fp32 plan, the point
    chosen on predicted latency, the other points within the budget (fastest predicted first),
    and full int8 for reference."""
    usable = [p for p in front if not p.failed]
    picked = [p for p in (front[0], chosen) if not p.failed]
    within = sorted((p for p in usable if p.within_budget and p not in picked), key=lambda p: p.predicted_us)
    picked += within[:max(0, FRONT_POINTS_TIMED - len(picked) - 1)]
    full = next((p for p in usable if p.name == "int8"), None)
    if full is not None and full not in picked:
        picked.append(full)
    return [p for p in front if p in picked]


def choose_precision(model: Model, library: Library, device: Device, db: RecordDB, fp32_plan: Plan,
                     int8_tasks: list[Task], int8: Int8Request, config: "TuneConfig", events):
    """The front under the budget (core/precision/mixed.py); with ``verify`` the points within the budget
    (``points_to_time``) are timed alone in fresh processes with the fp32 plan, rounds taking
    turns; the fastest measured one is kept when the race (core/selection.race_verdict, the rule
    that replaces ONNX Runtime's default) shows it faster than the fp32 plan, rounds going on up
    to ``check_max_rounds`` while undecided; else the fp32 plan."""
    settings, verify = config.settings, config.verify
    check_rounds, check_max_rounds = config.check_rounds, config.check_max_rounds
    with events.working(f"choosing which ops run in int8 ({int8.metric_name or 'metric'} drop <= {int8.max_drop}, "
                        f"{int8.calibration.describe()})"):
        search = search_precision(model, library, device, db, settings, fp32_plan, int8_tasks, int8.calibration,
                                  int8.metric, int8.metric_name, int8.max_drop)
    name = search.metric_name
    check = None
    chosen = search.plan
    if verify and any(p.within_budget and p.int8_nodes for p in search.front):
        within = {p.name for p in search.front if p.within_budget and p.int8_nodes}
        timed_points = points_to_time(search.front, search.chosen)
        # the fastest of the points timed within the budget races the fp32 plan: one comparison each
        comparisons = sum(p.name in within for p in timed_points)
        confidence = family_confidence(comparisons)

        def fastest(results: dict) -> str | None:
            times = {name: statistics.median(r["process_ms"]) for name, r in results.items()
                     if name in within and r["process_ms"] and not r["failed"]}
            return min(times, key=times.get) if times else None

        def undecided(results: dict) -> set:  # the race goes on while the fastest is neither shown faster nor not
            best = fastest(results)
            if best is None or results["fp32"]["failed"]:
                return set()
            speedups = paired_speedups(results["fp32"]["process_ms"], results[best]["process_ms"])
            return {"fp32", best} if race_verdict(speedups, comparisons=comparisons) == "undecided" else set()

        with events.working("timing the front end to end, each plan alone in fresh processes"):
            timed = timed_alone(model, {point.name: search.plans[point.name] for point in timed_points},
                                rounds=check_rounds, max_rounds=max(check_rounds, check_max_rounds), more=undecided)
        for point in search.front:
            if timed.get(point.name, {}).get("process_ms") and not timed[point.name]["failed"]:
                point.measured_ms = statistics.median(timed[point.name]["process_ms"])
        best = fastest(timed)
        if best is not None:  # the measured latency decides among the points within the budget
            search.chosen = next(p for p in search.front if p.name == best)
            search.plan = chosen = search.plans[best]
        if timed["fp32"]["failed"] or best is None:
            reason = timed["fp32"]["failed"] or "no point within the budget ran end to end"
            check = {"against": "fp32 plan", "failed": reason, "kept": "fp32"}
        else:
            speedups = paired_speedups(timed["fp32"]["process_ms"], timed[best]["process_ms"])
            low, median, high = median_bounds(speedups, confidence)
            verdict = race_verdict(speedups, comparisons=comparisons)
            check = {"against": "fp32 plan", "rounds": len(speedups), "per_round_speedup": round(median, 4),
                     "bounds": [round(low, 4), round(high, 4)], "confidence": round(confidence, 4),
                     "verdict": verdict,
                     "kept": best if verdict == "faster" else "fp32"}
        if check["kept"] == "fp32":
            chosen = search.plans["fp32"]
    front = [point.to_json() for point in search.front]
    for plan in {id(p): p for p in [chosen, *search.plans.values()]}.values():
        if "precision" in plan.extra or plan is chosen:
            plan.extra["precision"] = {**plan.extra.get("precision", {}), "metric": name, "max_drop": int8.max_drop,
                                       "calibration": int8.calibration.to_json(), "front": front,
                                       "chosen": check["kept"] if check else search.chosen.name,
                                       **({"check": check} if check else {})}
    events.precision_searched(library, search, check)
    return chosen, search
