"""Whole-model latency: the library's default against a plan, measured in the same run,
interleaved (default, plan, default, plan, ...) so machine noise hits both alike; and the checks
that choose among plans of several libraries, which time each candidate alone in processes of its
own, taking turns (``timed_alone``)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kselect.core import plugins
from kselect.core.errors import KselectError, one_line
from kselect.core.model import Model
from kselect.core.worker import die_with_parent, signal_name


def random_feeds(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs of each input's element type: standard normal floats, integers in
    [0, 255] (image bytes)."""
    import onnx

    rng = np.random.default_rng(seed)
    types = {i.name: i.type.tensor_type.elem_type for i in model.proto.graph.input}
    feeds = {}
    for name, shape in model.input_shapes.items():
        dtype = onnx.helper.tensor_dtype_to_np_dtype(types.get(name, onnx.TensorProto.FLOAT))
        if dtype == np.float32:
            feeds[name] = rng.standard_normal(shape, dtype=np.float32)
        elif np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[name] = rng.integers(0, 256, shape).astype(dtype)
    return feeds


# XNNPack's pool spins for tens of milliseconds after its last parallel loop. On mobilenetv2 ONNX
# Runtime's default ran 15.3 ms (median) when timed one settle run after an XNNPack runner,
# 8.2 ms after itself and 7.7 ms after 0.1 s of settle runs: one run of a small model is not
# enough to outlast the spinning.
SETTLE_S = 0.1


def interleaved(runners: dict[str, callable], feeds: dict, rounds: int = 10, runs_per_round: int = 5,
                warmup: int = 3, settle: int = 1, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Milliseconds per run for each runner, alternating runners every few runs. After each
    switch the runner runs untimed (at least ``settle`` runs and ``settle_s`` seconds): the
    previous runner's worker threads may still be spinning on the cores (ONNX Runtime's and
    XNNPack's pools spin a while after their work), which would bill one runner for another's
    threads."""
    for run in runners.values():
        for _ in range(warmup):
            run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            settle_start, settled = time.perf_counter(), 0
            while settled < settle or time.perf_counter() - settle_start < settle_s:
                runners[name](feeds)
                settled += 1
            for _ in range(runs_per_round):
                start = time.perf_counter()
                runners[name](feeds)
                times[name].append((time.perf_counter() - start) * 1000.0)
    return times


# A run where some runner's relative interquartile range is above this was taken while the
# machine stalled threads (this VM does so for minutes at a time): the checks that choose a plan
# repeat it. mobilenetv2's choice among plans was once made on a run with spreads of 0.35-0.8, in
# which ONNX Runtime's default read 17.2 ms (10.3 ms in the next run) and a plan that then ran
# 60% slower looked fastest. Steady runs here have spreads of 0.02-0.2.
STEADY_SPREAD = 0.3


def steady_interleaved(runners: dict[str, callable], feeds: dict, rounds: int, runs_per_round: int,
                       attempts: int = 3) -> tuple[dict[str, list[float]], int]:
    """``interleaved``, repeated while some runner's spread is above STEADY_SPREAD (at most
    ``attempts`` runs); returns the steadiest run's times and how many runs were made."""
    best, best_spread = None, float("inf")
    for attempt in range(1, attempts + 1):
        times = interleaved(runners, feeds, rounds, runs_per_round)
        spread = max(_relative_iqr(values) for values in times.values())
        if spread < best_spread:
            best, best_spread = times, spread
        if spread <= STEADY_SPREAD:
            break
    return best, attempt


# An output whose values are all tiny on random inputs (a detector's probability map, every
# sigmoid saturated near 0) is compared as if its largest magnitude were this: float32 rounding
# alone reaches 1e-2 of such an output, while a wrong plan's errors are of the values' own size.
MAGNITUDE_FLOOR = 1e-3


def compare_outputs(reference: list, candidate: list) -> float:
    """Largest error of any output relative to that output's largest magnitude (at least
    ``MAGNITUDE_FLOOR``); infinite when the outputs differ in number or shape or either holds a
    value that is not finite (``max`` would pass a NaN over as no error)."""
    if len(reference) != len(candidate):
        return float("inf")
    worst = 0.0
    for ref, out in zip(reference, candidate):
        ref, out = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
        if ref.shape != out.shape:
            return float("inf")
        if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(out))):
            return float("inf")
        if ref.size == 0:
            continue
        scale = max(float(np.max(np.abs(ref))), MAGNITUDE_FLOOR)
        worst = max(worst, float(np.max(np.abs(ref - out))) / scale)
    return worst


def bench(default_runner, plan_runner, model: Model, rounds: int = 10, runs_per_round: int = 5,
          attempts: int = 1) -> dict:
    """Default against plan. A runner, or a list of runners built separately (fresh sessions of
    one config can settle at different speeds): round r uses instance r modulo their number.
    With ``attempts`` > 1 an unsteady measurement is repeated (``steady_interleaved``)."""
    defaults = default_runner if isinstance(default_runner, list) else [default_runner]
    plans = plan_runner if isinstance(plan_runner, list) else [plan_runner]
    feeds = random_feeds(model)
    error = compare_outputs(defaults[0](feeds), plans[0](feeds))
    times: dict[str, list[float]] = {"default": [], "plan": []}
    instances = max(len(defaults), len(plans))
    for instance in range(instances):
        instance_rounds = rounds // instances + (instance < rounds % instances)
        if instance_rounds == 0:
            continue
        part, _ = steady_interleaved({"default": defaults[instance % len(defaults)], "plan": plans[instance % len(plans)]},
                                     feeds, instance_rounds, runs_per_round, attempts)
        for name in times:
            times[name] += part[name]
    default_ms, plan_ms = statistics.median(times["default"]), statistics.median(times["plan"])
    return {
        "default_ms": round(default_ms, 4),
        "plan_ms": round(plan_ms, 4),
        "speedup": round(default_ms / plan_ms, 4),
        "runs": len(times["plan"]),
        "instances": instances,
        "default_spread": round(_relative_iqr(times["default"]), 4),
        "plan_spread": round(_relative_iqr(times["plan"]), 4),
        "max_relative_output_error": error,
    }


# An app holds one plan, so the checks that choose among plans time each candidate as the app
# runs it: alone in a process of its own, started afresh in every round, candidates taking turns.
# A plan that crashes or hangs end to end is then set aside with its reason, and no runner is
# billed for another's spinning threads. (Sharing one process with XNNPack's runner cost ONNX
# Runtime's default about 1% on the EPYC machine, benchmarks/process_context.py; the host's own
# drift there, 20% within a minute, is what a few rounds cannot average out.)
PROCESS_WARMUP_S = 0.3


def timed_alone(model: Model, candidates: dict, rounds: int = 4, runs_per_process: int = 8,
                min_time_s: float = 0.5, timeout_s: float = 600.0, max_rounds: int | None = None,
                more=None) -> dict[str, dict]:
    """Times each candidate on the whole model in processes of its own. ``candidates``: name ->
    a Plan (run through core/runtime.py), or a library name (that library's defaults). In each of
    ``rounds`` rounds every candidate gets a fresh ``python -m kselect.core.bench`` process
    (order reversed every other round) that builds it, warms it up and times at least
    ``runs_per_process`` runs and ``min_time_s``. Returns, per candidate: ``times`` (ms of every
    timed run), ``process_times`` (those, per process), ``process_ms`` (each process's median),
    ``segments``, ``outputs`` (the first process's, on ``random_feeds``) and ``failed`` (the
    reason a process failed, crashed or timed out; the candidate is not run again). With
    ``more`` (results -> the names that need another round), rounds go on after ``rounds`` up to
    ``max_rounds`` for those names only, so each candidate runs in a prefix of the rounds and its
    processes pair with the first ones of any candidate that ran at least as long."""
    with tempfile.TemporaryDirectory(prefix="kselect-alone-") as work:
        work = Path(work)
        if os.path.isfile(model.source):
            model_path = model.source
        else:
            model_path = str(work / "model.onnx")
            Path(model_path).write_bytes(model.proto.SerializeToString())
        jobs = {}
        for index, (name, candidate) in enumerate(candidates.items()):
            runner = {"library": candidate}
            if not isinstance(candidate, str):
                runner = {"plan": str(work / f"plan{index}.json")}
                candidate.save(runner["plan"])
            jobs[name] = {"model": model_path, "inputs": model.input_shapes, "runner": runner,
                          "runs": runs_per_process, "min_time_s": min_time_s, "warmup_s": PROCESS_WARMUP_S,
                          "result": str(work / f"result{index}.json"), "outputs": str(work / f"outputs{index}.npz")}
        results = {name: {"times": [], "process_times": [], "process_ms": [], "segments": 1, "outputs": None,
                          "failed": None} for name in candidates}
        names, round_index = list(candidates), 0
        while names:
            for name in names if round_index % 2 == 0 else names[::-1]:
                result = results[name]
                if result["failed"]:
                    continue
                job = {**jobs[name], "outputs": jobs[name]["outputs"] if round_index == 0 else None}
                done = _run_alone(job, timeout_s)
                if "failed" in done:
                    result["failed"] = done["failed"]
                    continue
                result["times"] += done["times"]
                result["process_times"].append(done["times"])
                result["process_ms"].append(round(statistics.median(done["times"]), 4))
                result["segments"] = done["segments"]
                if job["outputs"]:
                    with np.load(job["outputs"]) as saved:
                        result["outputs"] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
            round_index += 1
            if round_index < rounds:
                continue
            wanted = more(results) if more is not None and round_index < (max_rounds or rounds) else set()
            names = [name for name in names if name in wanted and not results[name]["failed"]]
        return results


def _run_alone(job: dict, timeout_s: float) -> dict:
    Path(job["result"]).unlink(missing_ok=True)
    process = subprocess.Popen([sys.executable, "-m", "kselect.core.bench", json.dumps(job)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True, preexec_fn=die_with_parent)
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return {"failed": f"timed out after {timeout_s:g} s (killed)"}
    except BaseException:  # Ctrl-C: the child is in a session of its own and would run on
        process.kill()
        raise
    if Path(job["result"]).is_file():
        return json.loads(Path(job["result"]).read_text())
    if process.returncode < 0:
        return {"failed": f"crashed ({signal_name(process.returncode)})"}
    last = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    return {"failed": f"exit code {process.returncode}: {last}"}


def _alone_main(job: dict) -> None:
    """One candidate, alone in this process: build, warm up, time; write the result file."""
    from kselect.core import plugins
    from kselect.core.measure import MeasureSettings, time_candidate
    from kselect.core.model import load_model
    from kselect.core.runtime import library_runner, load_plan

    try:
        model = load_model(job["model"], [f"{k}={','.join(map(str, v))}" for k, v in job["inputs"].items()])
        spec = job["runner"]
        runner = (load_plan(spec["plan"], model) if "plan" in spec
                  else library_runner(plugins.get_library(spec["library"]), model))
        feeds = random_feeds(model)
        outputs = runner(feeds)
        start, warmups = time.perf_counter(), 0
        while warmups < 2 or time.perf_counter() - start < job["warmup_s"]:
            runner(feeds)
            warmups += 1
        settings = MeasureSettings(warmup=0, min_repeats=job["runs"], min_time_s=job["min_time_s"],
                                   max_time_s=2 * job["min_time_s"])
        times = [us / 1000.0 for us in time_candidate(lambda: runner(feeds), settings)]
        if job["outputs"]:
            np.savez(job["outputs"], *[np.asarray(o) for o in outputs])
        result = {"times": times, "segments": len(getattr(runner, "segments", [None]))}
        getattr(runner, "close", lambda: None)()
    except Exception as exc:  # the parent reports it; a crash it sees from the exit status
        result = {"failed": one_line(exc)}
    Path(job["result"]).write_text(json.dumps(result))


def bench_alone(model: Model, library_name: str, plan, rounds: int = 10, runs_per_process: int = 5) -> dict:
    """``bench``'s figures, each side timed alone in fresh processes (``timed_alone``): the
    library's defaults against ``plan``."""
    alone = timed_alone(model, {"default": library_name, "plan": plan}, rounds, runs_per_process)
    for side, measured in alone.items():
        if measured["failed"]:
            raise KselectError(f"the {side} side failed: {measured['failed']}")
    default, planned = alone["default"]["times"], alone["plan"]["times"]
    default_ms, plan_ms = statistics.median(default), statistics.median(planned)
    low, median, high = median_bounds(paired_speedups(alone["default"]["process_ms"], alone["plan"]["process_ms"]))
    return {"default_ms": round(default_ms, 4), "plan_ms": round(plan_ms, 4), "speedup": round(default_ms / plan_ms, 4),
            "per_round_speedup": round(median, 4), "per_round_bounds": [round(low, 4), round(high, 4)],
            "runs": len(planned), "processes": rounds, "default_process_ms": alone["default"]["process_ms"],
            "plan_process_ms": alone["plan"]["process_ms"], "default_spread": round(_relative_iqr(default), 4),
            "plan_spread": round(_relative_iqr(planned), 4),
            "max_relative_output_error": compare_outputs(alone["default"]["outputs"], alone["plan"]["outputs"])}


def fresh_runners(library, model: Model, plan) -> list:
    """As many separately built runners as the library times fresh instances of a candidate
    (``runtime.library_runner``: nodes the library cannot run go to ONNX Runtime)."""
    from kselect.core.runtime import library_runner

    return [library_runner(library, model, plan) for _ in range(library.fresh_instances)]


def _relative_iqr(samples: list[float]) -> float:
    q1, q3 = np.percentile(samples, [25, 75])
    return float((q3 - q1) / statistics.median(samples))


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

    def chosen(name, plan):
        plan.extra["verified"] = {"chosen": name, "min_speedup": min_speedup, "emulated": library.emulated,
                                  "tried": tried}
        return plan

    for name, plan in variants:
        result = bench(default_runners, fresh_runners(library, model, plan), model, rounds, runs_per_round, attempts=3)
        tried.append({"variant": name, **result})
        if on_result:
            on_result(name, result)
        if not result["max_relative_output_error"] <= max_error:
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


BASELINE = "onnxruntime default"


# A plan that switches libraries more often must be clearly faster than one that switches less
# to be kept: its speed depends on how fast each library's threads take the cores over at every
# switch, which varies between runs more than one library's speed does. In table2 (stop 10)
# resnet50's mixed plan read 5% faster than the MLAS plan in the run that chose it and 8% slower
# than ONNX Runtime's default in the next; googlenet's was kept for 0.3%. The same holds for a
# plan whose threads sleep between parallel loops (plan-level ``spinning`` 0) against one whose
# threads spin, as the libraries' defaults do: every loop then waits for threads to wake, which on
# this VM costs microseconds in some periods and milliseconds in others. vgg16's MLAS plan with
# spinning 0 read 1.07x and 1.015x ONNX Runtime's default in the runs that chose it and 0.79x in
# the next runs; interleaved later, spinning-0 variants ran 1.24-1.63x slower than the default,
# the spinning-1 one 1.08-1.28x. The margin is the larger of MIXED_MARGIN and half the faster
# plan's relative interquartile range in that run.
# ONNX Runtime's default session (the baseline) is the calmest choice of all, as the library
# default is for a single op: a plan replaces it only when shown faster round by round
# (race_verdict, below). A margin over pooled medians did not hold: on the EPYC machine (table2,
# stop 16) resnet101's XNNPack plan read 1.051x the default in the run that chose it, with
# spreads of 0.18-0.22, and 0.956x in the next run.
MIXED_MARGIN = 0.02


def switching_margin(result: dict) -> float:
    return max(MIXED_MARGIN, result["plan_spread"] / 2)


def sleeping_threads(plan) -> bool:
    """Whether a plan run by one library lets its threads sleep between parallel loops. (In a
    plan that mixes libraries all but one library's threads sleep by design; its segments count.)"""
    settings = plan.library_settings
    return len(settings) == 1 and next(iter(settings.values())).get("spinning") == 0


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
# drift (20% within a minute on the EPYC machine) disturbs least. Pooled medians over rounds
# minutes apart mixed periods: resnet101's MLAS plan read 1.046x pooled in the check that kept it
# and 0.907-1.091 round by round in the next run (table2, stop 17). So a plan replaces the default
# only when the median of its per-round speedups reaches 1 + MIXED_MARGIN and the lower
# confidence bound of that median SLOWER_LIMIT; a plan still undecided after the first rounds runs
# more (with the default), up to the check's maximum, as racing (F-race, irace) does when
# choosing among configurations under noise, and one undecided at the end is not kept.
CONFIDENCE = 0.875
SLOWER_LIMIT = 0.98


def paired_speedups(baseline_ms: list[float], plan_ms: list[float]) -> list[float]:
    """Baseline over plan, round by round (each round's processes ran one after the other)."""
    return [b / p for b, p in zip(baseline_ms, plan_ms)]


def median_bounds(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(lower bound, median, upper bound): distribution-free (sign test) bounds on the median, the
    k-th smallest and k-th largest values for the largest k whose coverage, 1 - 2 P(Binomial(n,
    1/2) < k), still reaches ``confidence`` (k = 1, the extremes, if none does)."""
    ordered, n = sorted(values), len(values)
    k, below = 1, 0.0
    while k < n:
        below += math.comb(n, k - 1) / 2 ** n  # P(Binomial(n, 1/2) < k)
        if 1 - 2 * (below + math.comb(n, k) / 2 ** n) < confidence:
            break
        k += 1
    return ordered[k - 1], statistics.median(ordered), ordered[n - k]


def race_verdict(speedups: list[float], margin: float = MIXED_MARGIN, rounds_before_verdict: int = 4) -> str:
    """"faster" (median >= 1 + margin, lower bound >= SLOWER_LIMIT), "not faster" (upper bound
    below 1 + margin), else "undecided"; "undecided" before ``rounds_before_verdict`` rounds."""
    if len(speedups) < rounds_before_verdict:
        return "undecided"
    low, median, high = median_bounds(speedups)
    if median >= 1 + margin and low >= SLOWER_LIMIT:
        return "faster"
    return "not faster" if high < 1 + margin else "undecided"


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
    core/tune.onnxruntime_default_plan) is kept, or without one the fastest candidate.
    ``min_speedup`` replaces that test by a fixed median speedup to reach, in ``rounds`` rounds. A
    cross-library plan runs through core/runtime.py. A candidate whose process fails, crashes or
    hangs is reported with its reason and not kept."""

    def matches(measured: dict, reference: dict) -> bool:
        return compare_outputs(reference["outputs"], measured["outputs"]) <= max_error

    def undecided(alone: dict) -> set:
        baseline = alone[BASELINE]
        if baseline["failed"]:
            return set()
        names = {name for name, _ in candidates if not alone[name]["failed"] and matches(alone[name], baseline)
                 and race_verdict(paired_speedups(baseline["process_ms"], alone[name]["process_ms"]),
                                  rounds_before_verdict=rounds) == "undecided"}
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
        low, median, high = median_bounds(speedups)
        baseline_ms, plan_ms = statistics.median(baseline_times), statistics.median(measured["times"])
        results.append({"variant": name, "default_ms": round(baseline_ms, 4), "plan_ms": round(plan_ms, 4),
                        "speedup": round(median, 4), "speedup_bounds": [round(low, 4), round(high, 4)],
                        "verdict": race_verdict(speedups, rounds_before_verdict=1),
                        "round_speedups": [round(x, 4) for x in speedups],
                        "pooled_speedup": round(baseline_ms / plan_ms, 4), "runs": len(measured["times"]),
                        "processes": processes, "process_ms": measured["process_ms"],
                        "default_process_ms": baseline["process_ms"][:processes],
                        "segments": measured["segments"], "sleeps": sleeping_threads(plan),
                        "plan_spread": round(_relative_iqr(measured["times"]), 4),
                        "default_spread": round(_relative_iqr(baseline_times), 4),
                        "speedup_spread": round(_relative_iqr(speedups), 4),
                        "max_relative_output_error": compare_outputs(baseline["outputs"], measured["outputs"])})
    valid = [(result, plan) for result, (_, plan) in zip(results, candidates)
             if "failed" not in result and result["max_relative_output_error"] <= max_error]
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
    best_plan.extra["verified"] = {"chosen": chosen, "baseline": BASELINE, "min_speedup": min_speedup,
                                   "fastest": fastest["variant"], "shown_faster": [r["variant"] for r, _ in shown_faster],
                                   "margin": MIXED_MARGIN, "slower_limit": SLOWER_LIMIT, "confidence": CONFIDENCE,
                                   "rounds": len(baseline["process_ms"]),
                                   "protocol": "each alone in a fresh process, taking turns; per-round speedups, "
                                               "more rounds while undecided", "tried": results}
    return best_plan, results

if __name__ == "__main__":
    _alone_main(json.loads(sys.argv[1]))
