"""Which ops of one library's plan run in a reduced precision (int8, bf16, fp16): the request a tune
with reduced precisions makes (refused up front when it cannot be honoured, calibrated), and the
choice among the latency / accuracy front (core/precision/mixed.py), timed end to end against the
fp32 plan."""

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
from kselect.core.precision.mixed import search_precision
from kselect.core.precision.quant import PRECISIONS
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.alone import family_confidence, median_bounds, paired_speedups, timed_alone
from kselect.core.whole_model.prediction import prediction
from kselect.core.whole_model.selection import race_verdict

if TYPE_CHECKING:
    from kselect.core.config import TuneConfig
    from kselect.core.precision.calibration import Calibration


@dataclass
class PrecisionRequest:
    """What a tune with reduced precisions asks: the precisions beside fp32, the held-out data
    (and, for int8, the calibration ranges), the metric and its budget."""
    precisions: tuple[str, ...]  # the reduced precisions asked for, among int8, bf16, fp16
    calibration: "Calibration"
    metric: object  # core.accuracy.Metric, or None: chosen from the model's outputs
    metric_name: str | None
    max_drop: float

    def for_library(self, library: Library) -> tuple[str, ...]:
        """The reduced precisions this tune gives ``library``'s plans: those asked for that its
        plans can hold."""
        return tuple(p for p in self.precisions if p in library.plan_precisions)


def wanted_precisions(precision) -> list[str]:
    """The precisions of a ``--precision`` value: a comma-separated list, or "all"."""
    wanted = [p.strip() for p in precision.split(",")] if isinstance(precision, str) else list(precision)
    return list(PRECISIONS) if wanted == ["all"] else wanted


def precisions_left_out(libraries: list[Library], config: "TuneConfig") -> dict[str, str]:
    """With ``--precision all``: each reduced precision none of ``libraries`` has plans in here,
    and why (e.g. no bf16 kernels on this CPU); the tune goes on with the others, or in fp32."""
    if wanted_precisions(config.precision) != list(PRECISIONS):
        return {}
    left_out = {}
    for precision in PRECISIONS[1:]:
        if not any(precision in lib.plan_precisions for lib in libraries):
            reasons = [f"{lib.name}: {lib.missing_precisions().get(precision) or 'no ' + precision + ' plans'}"
                       for lib in libraries]
            left_out[precision] = "; ".join(reasons)
    return left_out


def precision_request(model: Model, libraries: list[Library], config: "TuneConfig") -> PrecisionRequest | None:
    """Refuses, before anything is measured, what a tune with reduced precisions cannot do; calibrates.
    ``--precision all`` asks for what the libraries have here (``precisions_left_out`` names the rest)."""
    precision, calibration, method = config.precision, config.calibration, config.calibration_method
    max_drop, metric, preprocess = config.max_accuracy_drop, config.metric, config.image_preprocess

    wanted = wanted_precisions(precision)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown or "fp32" not in wanted:
        raise KselectError(f"--precision {','.join(wanted)}: give fp32 and any of {', '.join(PRECISIONS[1:])} "
                           f"(e.g. fp32,int8 or fp32,bf16,int8), or all")
    everything = wanted == list(PRECISIONS)
    reduced = tuple(p for p in PRECISIONS if p in wanted and p != "fp32")
    if everything:  # what some library's plans hold here (precisions_left_out names the rest)
        reduced = tuple(p for p in reduced if any(p in lib.plan_precisions for lib in libraries))
    if not reduced:
        if not everything and (calibration is not None or preprocess is not None):
            raise KselectError("--calibration is for reduced precisions: add --precision fp32,int8 (or bf16, fp16)")
        return None
    if not any(p in lib.plan_precisions for lib in libraries for p in reduced):
        # with several libraries, those without any of them are tuned in fp32
        raise KselectError(_none_offered(libraries[0], reduced))
    if not 0 <= max_drop < 1:
        raise KselectError(f"--max-accuracy-drop {max_drop}: give a drop between 0 and 1 (0.01: one point of top-1 "
                           f"agreement, or of cosine similarity)")
    if callable(metric):
        chosen_metric, name = user_metric(metric), getattr(metric, "__name__", "user metric")
    else:
        chosen_metric, name = (get_metric(metric), metric) if metric else (None, None)
    offered = tuple(p for p in reduced if any(p in lib.plan_precisions for lib in libraries))
    data = calibration_for(model, calibration, method, preprocess, offered)
    if "int8" in reduced:
        compute_ranges(model, data)
    return PrecisionRequest(reduced, data, chosen_metric, name, max_drop)


def _none_offered(library: Library, reduced: tuple[str, ...]) -> str:
    """Why ``library`` can give none of the ``reduced`` precisions, in one line, naming the
    libraries whose plans can."""
    reasons = []
    for precision in reduced:
        runs = ", ".join(n for n, lib in plugins.libraries().items() if precision in lib.plan_precisions) or "none here"
        if precision in library.precisions:
            why = f"it measures {precision} kernels per op but its whole-model runner has no {precision} path yet"
        else:
            why = library.missing_precisions().get(precision) or f"it has no {precision} kernels in kselect"
        reasons.append(f"{precision}: {why} ({precision} plans: {runs})")
    return f"--precision {','.join(('fp32',) + reduced)}: {library.name} has none of them; " + "; ".join(reasons)


FRONT_POINTS_TIMED = 6
# A front whose costs were corrected in context predicts its points' whole-model times within about
# this (docs/tuning-protocol.md, "Predicted against measured"): a point predicted slower than the
# fp32 plan by more is a certain loss, and is not raced.
PREDICTION_MARGIN = 0.10


def predicted_losers(search) -> list:
    """The points within the budget predicted slower than the fp32 plan by more than
    PREDICTION_MARGIN, when the front's costs were corrected in context (else none: isolated
    sums are no ground to skip a race on). A uniform point (every op in one half precision) is
    never one: what it saves is what op times cannot predict (core/precision/mixed.uniform_points)."""
    fp32 = next((p for p in search.front if p.name == "fp32"), None)
    if not search.context or fp32 is None:
        return []
    return [p for p in search.front if p.within_budget and p.precisions and not p.failed and not p.uniform
            and p.predicted_us > fp32.predicted_us * (1 + PREDICTION_MARGIN)]


def points_to_time(front: list, chosen) -> list:
    """The front points timed end to end, at most FRONT_POINTS_TIMED: the fp32 plan, the point
    chosen on predicted latency, every uniform point within the budget (the whole graph in one
    half precision), the other points within the budget (fastest predicted first), and every op
    in its least precise form (the front's second point) for reference."""
    usable = [p for p in front if not p.failed]
    picked = [p for p in (front[0], chosen) if not p.failed]
    picked += [p for p in usable if p.uniform and p.within_budget and p not in picked]
    within = sorted((p for p in usable if p.within_budget and p not in picked), key=lambda p: p.predicted_us)
    picked += within[:max(0, FRONT_POINTS_TIMED - len(picked) - 1)]
    full = next((p for p in usable if p.name != "fp32"), None)
    if full is not None and full not in picked:
        picked.append(full)
    return [p for p in front if p in picked]


def choose_precision(model: Model, library: Library, device: Device, db: RecordDB, fp32_plan: Plan,
                     twin_tasks: list[Task], request: PrecisionRequest, config: "TuneConfig", events):
    """The front under the budget (core/precision/mixed.py); with ``verify`` the points within the budget
    (``points_to_time``) are timed alone in fresh processes with the fp32 plan, rounds taking
    turns; the fastest measured one is kept when the race (core/selection.race_verdict, the rule
    that replaces ONNX Runtime's default) shows it faster than the fp32 plan, rounds going on up
    to ``check_max_rounds`` while undecided; else the fp32 plan."""
    settings, verify = config.settings, config.verify
    check_rounds, check_max_rounds = config.check_rounds, config.check_max_rounds
    reduced = sorted({t.precision for t in twin_tasks}, key=PRECISIONS.index)
    with events.working(f"choosing which ops run in {' or '.join(reduced)} ({request.metric_name or 'metric'} drop <= "
                        f"{request.max_drop}, {request.calibration.describe()})"):
        search = search_precision(model, library, device, db, settings, fp32_plan, twin_tasks, request.calibration,
                                  request.metric, request.metric_name, request.max_drop)
    name = search.metric_name
    check = None
    chosen = search.plan
    fp32_point = next(p for p in search.front if p.name == "fp32")
    losers = predicted_losers(search) if verify else []
    if losers and all(p in losers for p in search.front if p.within_budget and p.precisions and not p.failed):
        check = {"against": "fp32 plan", "kept": "fp32", "skipped": {
            "reason": f"every point within the budget is predicted slower than the fp32 plan by more than "
                      f"{PREDICTION_MARGIN:.0%} (costs in context)",
            "predicted_slower": {p.name: round(p.predicted_us / fp32_point.predicted_us - 1, 4) for p in losers}}}
        chosen = search.plans["fp32"]
    elif verify and any(p.within_budget and p.precisions for p in search.front):
        within = {p.name for p in search.front if p.within_budget and p.precisions and p not in losers}
        timed_points = [p for p in points_to_time(search.front, search.chosen) if p not in losers]
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
        if fp32_point.measured_ms is not None:  # each point predicted through the fp32 plan measured with it
            for point in search.front:
                if point.measured_ms is not None and point is not fp32_point:
                    point.prediction = prediction(search.plans[point.name], "fp32 plan", search.plans["fp32"],
                                                  fp32_point.measured_ms, point.measured_ms)
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
            plan.extra["precision"] = {**plan.extra.get("precision", {}), "metric": name, "max_drop": request.max_drop,
                                       "calibration": request.calibration.to_json(), "front": front,
                                       "chosen": check["kept"] if check else search.chosen.name,
                                       **({"check": check} if check else {}),
                                       **({"context": search.context} if search.context else {}),
                                       **({"left_out": search.left_out} if search.left_out else {})}
    events.precision_searched(library, search, check)
    return chosen, search
