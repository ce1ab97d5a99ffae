"""The rounds protocol: each runner of a whole model alone in a fresh process, rounds in which
the runners take turns, and per-round speedups with distribution-free bounds of their median.
Whole-model results are decided and reported with it (``python -m kselect.core.whole_model.alone`` is the
child each runner runs in)."""

from __future__ import annotations

import importlib
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

from kselect.core.contract import plugins
from kselect.core.errors import KselectError, one_line
from kselect.core.measuring.measure import MeasureSettings, time_candidate
from kselect.core.measuring.worker import die_with_parent, signal_name
from kselect.core.models.model import Model, load_model
from kselect.core.plans.plan import load_plan_file
from kselect.core.plans.runtime import library_runner, load_plan, segment_plan, sub_model
from kselect.core.whole_model.bench import compare_outputs, random_feeds, relative_iqr
from kselect.core.whole_model.context import timed_runs

# An app holds one plan, so the checks that choose among plans time each candidate as the app
# runs it: alone in a process of its own, started afresh in every round, candidates taking turns.
# A plan that crashes or hangs end to end is then set aside with its reason, and no runner is
# billed for another's spinning threads (measured cases: docs/tuning-protocol.md).
PROCESS_WARMUP_S = 0.3


def timed_alone(model: Model, candidates: dict, rounds: int = 4, runs_per_process: int = 8,
                min_time_s: float = 0.5, timeout_s: float = 600.0, max_rounds: int | None = None,
                more=None) -> dict[str, dict]:
    """Times each candidate on the whole model in processes of its own. ``candidates``: name ->
    a Plan (run through core/plans/runtime.py), a library name (that library's defaults), or
    ``{"library": name, "model": path}`` (its defaults on another ONNX file with the same inputs,
    e.g. ONNX Runtime's own quantized model), or ``{"factory": "module:function", "args": {...}}``
    (the runner ``function(model, **args)`` returns, e.g. OpenVINO as its users run it:
    kselect/plugins/openvino/baselines.py). In each of
    ``rounds`` rounds every candidate gets a fresh ``python -m kselect.core.whole_model.alone`` process
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
            if isinstance(candidate, dict):  # {"library": name, "model": path} or {"factory": ..., "args": ...}
                runner = dict(candidate)
            elif not isinstance(candidate, str):
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
    process = subprocess.Popen([sys.executable, "-m", "kselect.core.whole_model.alone", json.dumps(job)],
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


def node_times_alone(model: Model, library_name: str, plan, runs: int, timeout_s: float = 600.0):
    """``Library.node_times`` of ``plan`` (one library's; None: the library's defaults) in a fresh
    process of its own, as the rounds protocol runs a plan: no other runner's threads in it, and a
    plan that crashes or hangs takes only that process down. (whole-run us, node -> us), or None
    when the library's runner cannot time its nodes; raises KselectError when the process fails."""
    with tempfile.TemporaryDirectory(prefix="kselect-alone-") as work:
        plan_path, model_path = Path(work) / "plan.json", Path(work) / "model.onnx"
        if plan is not None:
            plan.save(plan_path)
        model_path.write_bytes(model.proto.SerializeToString())
        done = _run_alone({"model": str(model_path), "inputs": model.input_shapes, "result": str(Path(work) / "result.json"),
                           "node_times": {"library": library_name, "plan": None if plan is None else str(plan_path),
                                          "runs": runs}}, timeout_s)
    if "failed" in done:
        raise KselectError(f"timing {library_name}'s plan per node failed: {done['failed']}")
    return None if done["nodes"] is None else (done["whole_us"], done["nodes"])


def segmented_node_times(library, model: Model, plan, feeds: list[dict], runs: int):
    """``Library.node_times`` of a plan, also where the library's runner does not run every op of
    the model and the plan runs in segments (core/plans/runtime.py): the whole run timed as the
    plan runs it, the library's own segments timed per node by its runner on their sub-models,
    fed what the whole run hands them, and every other segment timed whole under the name
    ``segment N (library)`` (untuned time, for core/whole_model/context.py). None when the runner
    cannot time its nodes."""
    if all(library.runs_op(node.op_type) for node in model.proto.graph.node):
        return library.node_times(model, plan, feeds, runs)
    runner = load_plan(plan, model) if plan is not None else library_runner(library, model)
    try:
        if len(runner.segments) == 1:
            return library.node_times(model, plan, feeds, runs)
        whole = timed_runs(runner, feeds, runs)
        values, given = dict(feeds[0]), []
        for segment, run_segment in zip(runner.segments, runner.runners):
            given.append({name: values[name] for name in segment.inputs})
            values.update(zip(segment.outputs, run_segment(given[-1])))
        per_node = {}
        for index, (segment, run_segment) in enumerate(zip(runner.segments, runner.runners)):
            if segment.library == library.name:
                own_plan = segment_plan(plan, segment) if plan is not None else None
                timed = library.node_times(sub_model(model, segment, index), own_plan, [given[index]], runs)
                if timed is None:
                    return None
                per_node.update(timed[1])
            else:
                times = timed_runs(run_segment, [given[index]], runs)
                per_node[f"segment {index + 1} ({segment.library})"] = statistics.median(times)
        return statistics.median(whole), per_node
    finally:
        runner.close()


def _node_times_main(job: dict, model: Model) -> dict:
    spec = job["node_times"]
    library = plugins.get_library(spec["library"])
    plan = None if spec["plan"] is None else load_plan_file(spec["plan"])
    timed = segmented_node_times(library, model, plan, [random_feeds(model)], spec["runs"])
    return {"whole_us": None, "nodes": None} if timed is None else {"whole_us": timed[0], "nodes": timed[1]}


def _alone_main(job: dict) -> None:
    """One candidate, alone in this process: build, warm up, time; write the result file."""
    try:
        shapes = [f"{k}={','.join(map(str, v))}" for k, v in job["inputs"].items()]
        if "node_times" in job:
            result = _node_times_main(job, load_model(job["model"], shapes))
            Path(job["result"]).write_text(json.dumps(result))
            return
        spec = job["runner"]
        model = load_model(spec.get("model", job["model"]), shapes)
        if "plan" in spec:
            runner = load_plan(spec["plan"], model)
        elif "factory" in spec:  # "module:function"(model, **args), e.g. a library as its users run it
            module, _, function = spec["factory"].partition(":")
            runner = getattr(importlib.import_module(module), function)(model, **spec.get("args", {}))
        else:
            runner = library_runner(plugins.get_library(spec["library"]), model)
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


def side_figures(baseline_process_ms: list[float], measured: dict) -> dict:
    """One side of a ``timed_alone`` run against the baseline timed in the same rounds: its median
    process ms, the median of the per-round speedups with its distribution-free bounds; or the
    reason it failed."""
    if measured["failed"]:
        return {"failed": measured["failed"]}
    low, median, high = median_bounds(paired_speedups(baseline_process_ms, measured["process_ms"]))
    return {"ms": round(statistics.median(measured["process_ms"]), 4), "speedup": round(median, 4),
            "bounds": [round(low, 4), round(high, 4)], "process_ms": measured["process_ms"]}


def bench_alone(model: Model, library_name: str, plan, rounds: int = 10, runs_per_process: int = 5,
                users_default: dict | None = None) -> dict:
    """``bench``'s figures, each side timed alone in fresh processes (``timed_alone``): the
    library's defaults against ``plan``; with ``users_default`` (``Library.users_default``), the
    library as its users run it by default too, as a third side (``users_default``: its ms,
    the plan's per-round speedup over it with bounds, and the largest output difference)."""
    sides = {"default": library_name, "plan": plan, **({"users default": users_default} if users_default else {})}
    alone = timed_alone(model, sides, rounds, runs_per_process)
    for side, measured in alone.items():
        if measured["failed"]:
            raise KselectError(f"the {side} side failed: {measured['failed']}")
    default, planned = alone["default"]["times"], alone["plan"]["times"]
    default_ms, plan_ms = statistics.median(default), statistics.median(planned)
    low, median, high = median_bounds(paired_speedups(alone["default"]["process_ms"], alone["plan"]["process_ms"]))
    return {"default_ms": round(default_ms, 4), "plan_ms": round(plan_ms, 4), "speedup": round(default_ms / plan_ms, 4),
            "per_round_speedup": round(median, 4), "per_round_bounds": [round(low, 4), round(high, 4)],
            "runs": len(planned), "processes": rounds, "default_process_ms": alone["default"]["process_ms"],
            "plan_process_ms": alone["plan"]["process_ms"], "default_spread": round(relative_iqr(default), 4),
            "plan_spread": round(relative_iqr(planned), 4),
            "max_relative_output_error": compare_outputs(alone["default"]["outputs"], alone["plan"]["outputs"]),
            **({"users_default": _against(alone["users default"], alone["plan"])} if users_default else {})}


def _against(other: dict, plan: dict) -> dict:
    low, median, high = median_bounds(paired_speedups(other["process_ms"], plan["process_ms"]))
    return {"ms": round(statistics.median(other["times"]), 4), "process_ms": other["process_ms"],
            "per_round_speedup": round(median, 4), "per_round_bounds": [round(low, 4), round(high, 4)],
            "max_relative_output_error": compare_outputs(other["outputs"], plan["outputs"])}


CONFIDENCE = 0.875


def family_confidence(comparisons: int) -> float:
    """The confidence of each of ``comparisons`` bounds for all of them to hold at CONFIDENCE
    together (Bonferroni): racing several plans against one baseline and keeping the best would
    otherwise keep a plan that only looked faster more often than 1 - CONFIDENCE."""
    return 1 - (1 - CONFIDENCE) / max(1, comparisons)


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


if __name__ == "__main__":
    _alone_main(json.loads(sys.argv[1]))
