"""Tune every zoo model on MLAS and compare the plan with ONNX Runtime's default session.

Prints a table and writes JSON (default benchmarks/results/mlas_zoo.json): per model the ORT
default latency, the plan latency (same run, interleaved, medians), their ratio, tuning wall time
and samples; and the geometric mean of the ratios.

    .venv/bin/python benchmarks/mlas_zoo.py [--models resnet18,mobilenetv2] [--budget 16] [--search exhaustive]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions, library_tasks, stored_outcomes, tune_tasks
from kselect.core.models.model import load_model
from kselect.core.plans.library_plan import verified_library_plan
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.bench import bench_in_process, fresh_runners

console = Console()


def run_model(name: str, library, db: RecordDB, options: TuneOptions, rounds: int) -> dict:
    device = this_device()
    model = load_model(name)
    tasks = library_tasks(model, library)
    start = time.perf_counter()
    outcomes = tune_tasks(tasks, library, device, db, options)
    records = stored_outcomes(tasks, library, device, db)
    plan = verified_library_plan(model, library, device, db, tasks, outcomes)  # what `kselect tune` writes
    tune_s = time.perf_counter() - start
    # the figure reported: a fresh interleaved run, separate from the check that chose the plan
    result = bench_in_process(fresh_runners(library, model, None), fresh_runners(library, model, plan), model, rounds=rounds)
    changed = [t["id"] for t in plan.tasks if t["config"] != t["default_config"]]
    return {"model": name, "tasks": len(tasks), "ops": sum(len(t.nodes) for t in tasks),
            "samples": sum(len(r) for r in records.values()), "measured_now": sum(o.measured_now for o in outcomes),
            "tune_s": round(tune_s, 1), "plan_level": plan.plan_level, "tasks_changed": changed,
            "plan_variant": plan.extra["verified"]["chosen"], **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(plugins.models()))
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--search", default="xgb")
    parser.add_argument("--min-time", type=float, default=0.1, help="minimum measured seconds per candidate instance")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--db", default="benchmarks/results/mlas_zoo.db")
    parser.add_argument("--json", default="benchmarks/results/mlas_zoo.json")
    args = parser.parse_args()

    library = plugins.get_library("mlas")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    db = RecordDB(args.db)
    options = TuneOptions(args.search, args.budget, settings=MeasureSettings(min_time_s=args.min_time))
    rows = []
    for name in args.models.split(","):
        console.print(f"[bold]{name}[/]: tuning and benchmarking")
        rows.append(run_model(name, library, db, options, args.rounds))
        console.print(rows[-1])
    ratios = [r["speedup"] for r in rows]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    table = Table(title=f"MLAS: ONNX Runtime default vs kselect plan ({this_device().summary()}, {library.version()})")
    for column in ("model", "tasks", "ORT default ms", "plan ms", "ratio", "tune s", "samples", "plan"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(r["model"], str(r["tasks"]), f"{r['default_ms']:.2f}", f"{r['plan_ms']:.2f}", f"{r['speedup']:.3f}",
                      f"{r['tune_s']:.0f}", str(r["samples"]), f"{r['plan_variant']}, {len(r['tasks_changed'])} tasks changed")
    table.add_row("geomean", "", "", "", f"{geomean:.3f}", "", "", "")
    console.print(table)
    load = os.getloadavg()
    console.print(f"load average while measuring (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    Path(args.json).write_text(json.dumps({"device": this_device().to_json(), "library": library.version(),
                                           "load_average": load,
                                           "search": args.search, "budget": args.budget, "models": rows,
                                           "geomean_speedup": round(geomean, 4)}, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
