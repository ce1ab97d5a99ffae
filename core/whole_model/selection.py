"""Choosing among plans on whole-model timings: the single-library check against the library
default (interleaved, core/whole_model/bench.py) and the check that replaces ONNX Runtime's default session
only with a plan shown faster round by round (core/whole_model/alone.py)."""

from __future__ import annotations

import copy
import math
import statistics

from kselect.core.contract import plugins
from kselect.core.errors import KselectError
from kselect.core.models.model import Model
from kselect.core.plans.plan import LIBRARY_DEFAULT, PREDICTED_BASIS, PREDICTED_US, reduced_nodes, runs_as
from kselect.core.plans.spinning import spin_dims
from kselect.core.whole_model.alone import family_confidence, median_bounds, paired_speedups, timed_alone
from kselect.core.whole_model.bench import bench_in_process, compare_outputs, fresh_runners, relative_iqr
from kselect.core.whole_model.context import IN_CONTEXT
from kselect.core.whole_model.prediction import prediction

# The largest error the race trusts a whole-model prediction in context to have: a plan predicted
# slower than the race's fastest prediction by more than this is a certain loss, not raced.
PREDICTION_BOUND = 0.25


def verified_plan(library, model: Model, variants: list, min_speedup: float = 0.99, rounds: int = 6,
                  runs_per_round: int = 3, on_result=None, max_error: float = 1e-3):
    """The first plan of ``variants`` ([(name, plan)], best first) whose outputs match the library
    default's (``compare_outputs`` at most ``max_error``) and that is not slower than it end to end
    (whole model, interleaved), or, if its threads sleep between parallel loops, faster by the
    margin (``switching_margin``); the last matching variant if none is. A variant computing
    something else is never taken; none matching is an error. The measurements are kept in
    ``plan.extra["verified"]``."""
    default_runners = fresh_runners(library, model, None)
    tried, matching = [], []
    # the library default's plan, when built, is each variant's reference for its predicted time
    reference = next((plan for _, plan in variants if plan.extra.get(LIBRARY_DEFAULT)), None)

    def chosen(name, plan):
        plan.extra["verified"] = {"chosen": name, "min_speedup": min_speedup, "emulated": library.emulated,
                                  "tried": tried}
        return plan

    for name, plan in variants:
        result = bench_in_process(default_runners, fresh_runners(library, model, plan), model, rounds, runs_per_round, attempts=3)
        if reference is not None and plan is not reference:
            result["prediction"] = prediction(plan, "library default", reference, result["default_ms"],
                                              result["plan_ms"])
        tried.append({"variant": name, **result})
        if on_result:
            on_result(name, result)
        if not result["max_relative_output_error"] <= plan_max_error(plan, max_error):
            continue
        matching.append((name, plan))
        needed = 1 + switching_margin(result) if sleeping_threads(plan) else min_speedup
        if result["speedup"] >= needed:
            return chosen(name, plan)
    if not variants:
        raise ValueError("no plan variants to verify")
    if not matching:
        smallest = min(t["max_relative_output_error"] for t in tried)
        raise KselectError(f"no plan of {library.name} computes what its default does on {model.name} "
                           f"(smallest output error {smallest:.1e} > {max_error:g})")
    return chosen(*matching[-1])


def plan_max_error(plan, max_error: float) -> float:
    """``max_error``, or the loosest bound of the plan's libraries for settings that lower its
    precision (``Library.plan_error_bound``: MLAS's bf16 fast-math GEMM)."""
    bounds = [max_error]
    for name in plan.libraries:
        bound = plugins.get_library(name).plan_error_bound(dict(plan.library_settings.get(name, {})))
        if bound is not None:
            bounds.append(bound)
    return max(bounds)


BASELINE = "onnxruntime default"
# why a candidate that is the baseline's session itself is not raced
RUNS_AS_BASELINE = "runs as ONNX Runtime's default session, the race's baseline, does: not raced"


# A plan that switches libraries more often must be clearly faster than one that switches less
# to be kept: its speed depends on how fast each library's threads take the cores over at every
# switch, which varies between runs more than one library's speed does. The same holds for a
# plan whose threads sleep between parallel loops (plan-level ``spinning`` 0) against one whose
# threads spin, as the libraries' defaults do: every loop then waits for threads to wake, which
# costs microseconds in some periods and milliseconds in others. The margin is the larger of
# MIXED_MARGIN and half the faster plan's relative interquartile range in that run.
# ONNX Runtime's default session (the baseline) is the calmest choice of all, as the library
# default is for a single op: a plan replaces it only when shown faster round by round
# (race_verdict, below), since a margin over pooled medians did not hold. Measured cases behind
# each rule: docs/tuning-protocol.md.
MIXED_MARGIN = 0.02


def switching_margin(result: dict) -> float:
    return max(MIXED_MARGIN, result["plan_spread"] / 2)


def sleeping_threads(plan) -> bool:
    """Whether a plan run by one library lets its threads sleep between parallel loops. (In a
    plan that mixes libraries all but one library's threads sleep by design; its segments count.)"""
    if len(plan.library_settings) != 1:
        return False
    name, settings = next(iter(plan.library_settings.items()))
    return any(settings.get(dim) == 0 for dim in spin_dims(name))


def _risk(result: dict) -> int:
    return result["segments"] + int(result.get("sleeps", False))


def choose_result(results: list[dict]) -> dict:
    """The fastest result, unless a less risky result (fewer segments, or threads that spin:
    results have ``segments`` and ``sleeps``) is within the margin of it: then the least risky of
    those, fastest among equals. Results have ``plan_ms`` and ``plan_spread``."""
    fastest = min(results, key=lambda r: r["plan_ms"])
    margin = switching_margin(fastest)
    calmer = [r for r in results if _risk(r) < _risk(fastest) and r["plan_ms"] <= fastest["plan_ms"] * (1 + margin)]
    return min(calmer, key=lambda r: (_risk(r), r["plan_ms"])) if calmer else fastest


# The check that replaces ONNX Runtime's default session compares them round by round: in a round
# the two run in fresh processes seconds apart, and the ratio of their medians is what the host's
# drift disturbs least; pooled medians over rounds minutes apart mix periods. So a plan replaces the default
# only when the median of its per-round speedups reaches 1 + MIXED_MARGIN and the lower
# confidence bound of that median SLOWER_LIMIT (not slower, at that confidence); a plan still
# undecided after the first rounds runs more (with the default), up to the check's maximum, as
# racing (F-race, irace) does when choosing among configurations under noise, and one undecided at
# the end is not kept. The limit was 0.98 until a plan kept at a lower bound of 0.9996 read 0.977x
# in a later run (docs/tuning-protocol.md). When several plans race against one baseline, each
# bound is taken at the family's confidence (``family_confidence``), so that the best of many
# is not kept for having been lucky.
SLOWER_LIMIT = 1.0


def race_verdict(speedups: list[float], margin: float = MIXED_MARGIN, rounds_before_verdict: int = 4,
                 comparisons: int = 1) -> str:
    """"faster" (median >= 1 + margin, lower bound >= SLOWER_LIMIT), "not faster" (upper bound
    below 1 + margin), else "undecided"; "undecided" before ``rounds_before_verdict`` rounds. The
    bounds hold at CONFIDENCE across ``comparisons`` plans raced against the same baseline."""
    if len(speedups) < rounds_before_verdict:
        return "undecided"
    low, median, high = median_bounds(speedups, family_confidence(comparisons))
    if median >= 1 + margin and low >= SLOWER_LIMIT:
        return "faster"
    return "not faster" if high < 1 + margin else "undecided"


def _predict_from_one(results: list[dict], candidates: list, fallback, baseline: dict) -> None:
    """Each timed candidate's predicted whole-model time (``result["prediction"]``), through one
    reference of the same race: ONNX Runtime's default session (``fallback``, its configuration
    as a plan of recorded op times), else the first candidate that ran, which is then not
    predicted itself."""
    ran = [(result, plan) for result, (_, plan) in zip(results, candidates) if "failed" not in result]
    if fallback is not None:
        reference, reference_plan, reference_ms = BASELINE, fallback, statistics.median(baseline["process_ms"])
    elif ran:
        first, reference_plan = ran[0]
        reference, reference_ms = first["variant"], statistics.median(first["process_ms"])
    else:
        return
    for result, plan in ran:
        if plan is not reference_plan:
            result["prediction"] = prediction(plan, reference, reference_plan, reference_ms,
                                              statistics.median(result["process_ms"]))


def certain_losses(candidates: list, fallback) -> dict[str, str]:
    """The candidates ([(name, plan)]) predicted slower than the race's fastest prediction (theirs
    and ``fallback``'s, ONNX Runtime's default) by more than ``PREDICTION_BOUND``, each with why,
    but for the candidate predicted fastest; none unless every plan of the race has a whole-model
    figure in context (core/cross_library/plan.in_context_figures)."""
    plans = [plan for _, plan in candidates] + ([fallback] if fallback is not None else [])
    if not all(plan.extra.get(PREDICTED_BASIS) == IN_CONTEXT for plan in plans):
        return {}
    best = min(plan.extra[PREDICTED_US] for plan in plans)
    # the candidate predicted fastest is raced whatever its prediction, so that a race is run
    raced = min(candidates, key=lambda item: item[1].extra[PREDICTED_US])[0] if candidates else None
    return {name: (f"predicted {plan.extra[PREDICTED_US] / best:.2f}x the race's fastest prediction, beyond the "
                   f"{PREDICTION_BOUND:.0%} a prediction in context is trusted to be off: not raced")
            for name, plan in candidates if name != raced and plan.extra[PREDICTED_US] > (1 + PREDICTION_BOUND) * best}


def verified_across(model: Model, candidates: list, rounds: int = 4, runs_per_process: int = 8,
                    max_error: float = 1e-3, fallback=None, min_speedup: float | None = None,
                    max_rounds: int = 10) -> tuple:
    """Runs ONNX Runtime's default session (the baseline) and each candidate plan ([(name,
    plan)]) on the whole model, each alone in fresh processes taking turns (``timed_alone``);
    returns (the plan kept, one result per candidate). A candidate whose outputs match the
    baseline's and whose per-round speedups show it faster (``race_verdict``; undecided ones run
    more rounds, up to ``max_rounds``) may replace the baseline; among those, the fastest by
    median per-round speedup is kept, or a plan with fewer segments within a margin of it
    (``choose_result``). If none is shown faster, ``fallback`` (the baseline's own configuration,
    core/plans/library_plan.onnxruntime_default_plan) is kept, or without one the fastest candidate.
    ``min_speedup`` replaces that test by a fixed median speedup to reach, in ``rounds`` rounds. A
    cross-library plan runs through core/plans/runtime.py. A candidate whose process fails, crashes or
    hangs is reported with its reason and not kept. A candidate whose loss is certain by the
    predictions in context (``certain_losses``) is reported as skipped and not timed."""

    skipped = certain_losses(candidates, fallback) if min_speedup is None else {}
    # a library's plan that is ONNX Runtime's default session itself (MLAS kept its library default)
    # is the baseline run again: racing it only spends rounds
    skipped.update({name: RUNS_AS_BASELINE for name, plan in candidates if fallback is not None and runs_as(plan, fallback)})
    skipped_results = [{"variant": name, "skipped": why} for name, why in skipped.items()]
    candidates = [(name, plan) for name, plan in candidates if name not in skipped]
    plans = dict(candidates)
    comparisons = len(candidates)
    confidence = family_confidence(comparisons)
    if not candidates and fallback is not None:  # nothing left that could beat the baseline: it is kept, untimed
        kept = copy.deepcopy(fallback)
        kept.extra["verified"] = _verified(BASELINE, BASELINE, [], 0, min_speedup, confidence, 0, skipped_results)
        return kept, skipped_results

    def acceptable(error: float, plan) -> bool:
        # a plan with reduced-precision ops was held to its accuracy budget on held-out feeds
        # (core/precision/mixed.py): of it, only finite outputs are asked here
        return math.isfinite(error) if reduced_nodes(plan) else error <= plan_max_error(plan, max_error)

    def matches(name: str, measured: dict, reference: dict) -> bool:
        return acceptable(compare_outputs(reference["outputs"], measured["outputs"]), plans[name])

    def undecided(alone: dict) -> set:
        baseline = alone[BASELINE]
        if baseline["failed"]:
            return set()
        names = {name for name, _ in candidates if not alone[name]["failed"] and matches(name, alone[name], baseline)
                 and race_verdict(paired_speedups(baseline["process_ms"], alone[name]["process_ms"]),
                                  rounds_before_verdict=rounds, comparisons=comparisons) == "undecided"}
        return names | {BASELINE} if names else set()

    alone = timed_alone(model, {BASELINE: plugins.baseline_library().name, **dict(candidates)}, rounds, runs_per_process,
                        max_rounds=max_rounds, more=undecided if min_speedup is None else None)
    baseline = alone[BASELINE]
    if baseline["failed"]:
        raise ValueError(f"ONNX Runtime's default session failed: {baseline['failed']}")
    results = []
    for name, plan in candidates:
        measured = alone[name]
        if measured["failed"]:
            results.append({"variant": name, "failed": measured["failed"]})
            continue
        processes = len(measured["process_ms"])
        baseline_times = [t for ms in baseline["process_times"][:processes] for t in ms]
        speedups = paired_speedups(baseline["process_ms"], measured["process_ms"])
        low, median, high = median_bounds(speedups, confidence)
        baseline_ms, plan_ms = statistics.median(baseline_times), statistics.median(measured["times"])
        results.append({"variant": name, "default_ms": round(baseline_ms, 4), "plan_ms": round(plan_ms, 4),
                        "speedup": round(median, 4), "speedup_bounds": [round(low, 4), round(high, 4)],
                        "verdict": race_verdict(speedups, rounds_before_verdict=1, comparisons=comparisons),
                        "round_speedups": [round(x, 4) for x in speedups],
                        "pooled_speedup": round(baseline_ms / plan_ms, 4), "runs": len(measured["times"]),
                        "processes": processes, "process_ms": measured["process_ms"],
                        "default_process_ms": baseline["process_ms"][:processes],
                        "segments": measured["segments"], "sleeps": sleeping_threads(plan),
                        "plan_spread": round(relative_iqr(measured["times"]), 4),
                        "default_spread": round(relative_iqr(baseline_times), 4),
                        "speedup_spread": round(relative_iqr(speedups), 4),
                        "max_relative_output_error": compare_outputs(baseline["outputs"], measured["outputs"])})
    _predict_from_one(results, candidates, fallback, baseline)
    valid = [(result, plan) for result, (_, plan) in zip(results, candidates)
             if "failed" not in result and acceptable(result["max_relative_output_error"], plan)]
    if not valid:
        reasons = "; ".join(f"{r['variant']}: {r.get('failed') or 'outputs differ'}" for r in results)
        raise ValueError(f"no plan ran with outputs matching ONNX Runtime's ({reasons})")
    fastest = max((result for result, _ in valid), key=lambda r: r["speedup"])
    if min_speedup is not None:
        shown_faster = [(r, p) for r, p in valid if r["speedup"] >= min_speedup]
    else:
        shown_faster = [(r, p) for r, p in valid if r["verdict"] == "faster"]
    pool = shown_faster or (valid if fallback is None else [])
    # plan_ms as the baseline's median over each plan's median per-round speedup, so plans are
    # compared on the same footing; the margin between them is max(2%, half the speedups' spread)
    comparable = [{**r, "plan_ms": r["default_ms"] / r["speedup"], "plan_spread": r["speedup_spread"]} for r, _ in pool]
    if comparable:
        best = choose_result(comparable)
        chosen, best_plan = best["variant"], next(p for r, p in pool if r["variant"] == best["variant"])
    else:
        chosen, best_plan = BASELINE, fallback
    # a copy: a library's own plan kept here keeps its own record (its variants' check) for its tuning
    best_plan = copy.deepcopy(best_plan)
    best_plan.extra["verified"] = _verified(chosen, fastest["variant"], [r["variant"] for r, _ in shown_faster],
                                            len(baseline["process_ms"]), min_speedup, confidence, comparisons,
                                            results + skipped_results)
    return best_plan, results + skipped_results


def _verified(chosen: str, fastest: str, shown_faster: list[str], rounds: int, min_speedup: float | None,
              confidence: float, comparisons: int, tried: list[dict]) -> dict:
    """The kept plan's record of the race (``extra.verified``)."""
    return {"chosen": chosen, "baseline": BASELINE, "min_speedup": min_speedup, "fastest": fastest,
            "shown_faster": shown_faster, "margin": MIXED_MARGIN, "slower_limit": SLOWER_LIMIT,
            "confidence": confidence, "comparisons": comparisons, "rounds": rounds,
            "protocol": "each alone in a fresh process, taking turns; per-round speedups, more rounds while undecided",
            "tried": tried}
