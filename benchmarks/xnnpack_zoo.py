"""Tune every zoo model on XNNPack and compare the plan with XNNPack's defaults end to end.

Per model: XNNPack default latency and tuned-plan latency (whole model through kselect's XNNPack
executor, same run, interleaved, medians), their ratio, tuning wall time, samples, the plan's
largest output error against ONNX Runtime on the same ONNX, and the executor's Python-side
dispatch overhead per inference. The plan is the one ``kselect tune`` writes (checked end to end,
falling back to the library default when it loses). Then, per op, every task where a non-default
micro-kernel, path, thread count or work split won in the tuned plan, and by how much (isolated-op
times). ``--cores 1`` compares single-threaded (no thread-pool scheduling noise).

Prints tables and writes JSON (default benchmarks/results/xnnpack_zoo.json).

    .venv/bin/python benchmarks/xnnpack_zoo.py [--models resnet18,mobilenetv2] [--budget 32] [--search exhaustive] [--cores 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions, library_tasks, stored_outcomes, tune_tasks
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task
from kselect.core.plans.library_plan import library_plan_variants
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.bench import bench_in_process, compare_outputs, random_feeds
from kselect.core.whole_model.selection import verified_plan
from kselect.plugins.xnnpack.profiling import dispatch_overhead_us

console = Console()


def _ort_outputs(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _changes(entry: dict) -> dict:
    default, chosen = entry["default_config"], entry["config"]
    return {k: [default.get(k), chosen.get(k)] for k in sorted(set(default) | set(chosen)) if default.get(k) != chosen.get(k)}


def run_model(name: str, library, db: RecordDB, options: TuneOptions, rounds: int) -> dict:
    device = this_device()
    model = load_model(name)
    tasks = library_tasks(model, library)
    start = time.perf_counter()
    outcomes = tune_tasks(tasks, library, device, db, options)
    tune_s = time.perf_counter() - start
    records = stored_outcomes(tasks, library, device, db)
    variants = library_plan_variants(model, library, device, db, tasks, outcomes, options.settings)
    start = time.perf_counter()
    plan = verified_plan(library, model, variants)
    verify_s = time.perf_counter() - start
    default_runner, plan_runner = library.model_runner(model, None), library.model_runner(model, plan)
    result = bench_in_process(default_runner, plan_runner, model, rounds=rounds)
    feeds = random_feeds(model, seed=1)
    reference = _ort_outputs(model, feeds)
    error_plan = compare_outputs(reference, plan_runner(feeds))
    error_default = compare_outputs(reference, default_runner(feeds))
    overhead = dispatch_overhead_us(plan_runner)
    wins = []  # from the tuned plan (the final plan keeps them only if the tuned variant won end to end)
    for entry in variants[0][1].tasks:
        changes = _changes(entry)
        if changes and entry.get("default_us"):
            task = Task.from_json(entry)
            wins.append({"task": entry["id"], "op": f"{entry['kind']} {'x'.join(map(str, entry['input']))} "
                         f"{task.describe_attrs()}".strip(), "nodes": len(entry["nodes"]), "changes": changes,
                         "default_us": entry["default_us"], "plan_us": entry["time_us"],
                         "gain": round(entry["default_us"] / entry["time_us"], 3)})
    verified = plan.extra.get("verified", {})
    row = {"model": name, "tasks": len(tasks), "ops": sum(len(t.nodes) for t in tasks),
           "samples": sum(len(r) for r in records.values()), "measured_now": sum(o.measured_now for o in outcomes),
           "failed": sum(o.failed for o in outcomes), "invalid": sum(o.invalid for o in outcomes),
           "tune_s": round(tune_s, 1), "verify_s": round(verify_s, 1), "plan_variant": verified.get("chosen"),
           "plan_level": plan.plan_level,
           "variants_tried": [{k: t[k] for k in ("variant", "default_ms", "plan_ms", "speedup")} for t in verified.get("tried", [])],
           "tasks_changed": [t["id"] for t in plan.tasks if _changes(t)],
           "tuned_tasks_changed": [w["task"] for w in wins],
           "tuned_estimate_ms": {"default": round(sum((t["default_us"] or 0) * len(t["nodes"]) for t in variants[0][1].tasks) / 1000, 3),
                                 "tuned": round(variants[0][1].estimated_us() / 1000, 3)},
           **result,
           "error_vs_onnxruntime": {"plan": error_plan, "default": error_default},
           "executor_overhead": {**overhead, "dispatch_pct_of_plan": round(100 * overhead.get("dispatch_us", 0) / 1000 / result["plan_ms"], 3),
                                 "edge_pct_of_plan": round(100 * overhead.get("edge_conversion_us", 0) / 1000 / result["plan_ms"], 3)},
           "wins": wins, "load_average": list(os.getloadavg())}
    plan_runner.close()
    default_runner.close()
    return row


def _limit_cores(cores: int) -> None:
    """Every part (tuning spaces and defaults, the executor's default pool) sees a device with
    ``cores`` cores; its fingerprint differs, so its records are kept apart."""
    import dataclasses

    import kselect.core.measuring.device as device_module
    import kselect.plugins.xnnpack.executor as executor_module

    real = device_module.this_device()
    limited = dataclasses.replace(real, cores=cores, clusters=[real.clusters[0][:cores]] if real.clusters else [],
                                  extra={**real.extra, "cores_limited_by": "benchmarks/xnnpack_zoo.py --cores"})
    for module in (device_module, executor_module, sys.modules[__name__]):
        module.this_device = lambda: limited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(plugins.models()))
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--search", default="exhaustive")
    parser.add_argument("--min-time", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--db", default="benchmarks/results/xnnpack_zoo.db")
    parser.add_argument("--json", default="benchmarks/results/xnnpack_zoo.json")
    parser.add_argument("--cores", type=int, help="act as a device with this many cores (threads 1..N, default N): "
                        "--cores 1 compares kernels, tiles and loop order without thread-pool scheduling noise")
    args = parser.parse_args()
    if args.cores:
        _limit_cores(args.cores)

    library = plugins.get_library("xnnpack")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    db = RecordDB(args.db)
    options = TuneOptions(args.search, args.budget,
                          settings=MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time))
    rows = []
    for name in args.models.split(","):
        console.print(f"[bold]{name}[/]: tuning and benchmarking")
        rows.append(run_model(name, library, db, options, args.rounds))
        r = rows[-1]
        console.print(f"  default {r['default_ms']:.2f} ms, plan {r['plan_ms']:.2f} ms ({r['speedup']:.3f}x, "
                      f"{r['plan_variant']} plan), tuned in {r['tune_s']:.0f} s, {r['samples']} samples")
    ratios = [r["speedup"] for r in rows]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    device = this_device()
    table = Table(title=f"XNNPack: default vs kselect plan ({device.summary()}, {library.version()})")
    for column in ("model", "tasks", "default ms", "plan ms", "ratio", "plan", "tune s", "samples", "changed",
                   "err vs ORT", "dispatch %"):
        table.add_column(column, justify="left" if column in ("model", "plan") else "right")
    for r in rows:
        table.add_row(r["model"], str(r["tasks"]), f"{r['default_ms']:.2f}", f"{r['plan_ms']:.2f}", f"{r['speedup']:.3f}",
                      str(r["plan_variant"]), f"{r['tune_s']:.0f}", str(r["samples"]), str(len(r["tasks_changed"])),
                      f"{r['error_vs_onnxruntime']['plan']:.1e}", f"{r['executor_overhead']['dispatch_pct_of_plan']:.2f}")
    table.add_row("geomean", "", "", "", f"{geomean:.3f}", "", "", "", "", "", "")
    console.print(table)

    wins = Table(title="Per op: where a non-default config won in the tuned plan (isolated-op medians; the final "
                       "plan keeps them only where its variant is 'tuned')")
    for column in ("model", "task", "op", "nodes", "default -> chosen", "default us", "tuned us", "gain"):
        wins.add_column(column, justify="right" if column in ("nodes", "default us", "plan us", "gain") else "left")
    for r in rows:
        for w in r["wins"]:
            changes = "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in w["changes"].items())
            wins.add_row(r["model"], w["task"], w["op"], str(w["nodes"]), changes, f"{w['default_us']:,.1f}",
                         f"{w['plan_us']:,.1f}", f"{w['gain']:.2f}x")
    console.print(wins)
    Path(args.json).write_text(json.dumps({"device": device.to_json(), "library": library.version(),
                                           "availability": library.availability()[1], "search": args.search,
                                           "budget": args.budget, "min_time_s": args.min_time, "models": rows,
                                           "geomean_speedup": round(geomean, 4)}, indent=2, default=float) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
