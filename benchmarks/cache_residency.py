"""How much isolated per-op timings undercount an op's cost in the model, per library: each tuned
op at the library's default config timed as kselect's protocol does (the same weights and input
run after run, so they stay in the last-level cache) and with that cache flushed before every
timed run (as TVM's ``enable_cpu_cache_flush`` does), summed over the model's ops, beside the
whole model's latency on the library's defaults (each runner alone in fresh processes,
core/whole_model/alone.timed_alone). The planner adds isolated times; if one library's ops lose more to a
cold cache than another's, the sums favour it wrongly.

    .venv/bin/python benchmarks/cache_residency.py [--models resnet18,resnet50,mobilenetv2]
        [--libraries mlas,xnnpack] [--json benchmarks/results/cache_residency.json]

Runs in this process, not in kselect's measuring child: a diagnostic, not a tuner.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, task_inputs, time_candidate
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import load_model
from kselect.core.whole_model.alone import timed_alone

console = Console(width=160)
FLUSH_BYTES = 96 * 1024 * 1024  # three times this machine's 32 MiB L3
SETTINGS = MeasureSettings(min_repeats=15, min_time_s=0.4, max_time_s=2.0)


def median_us(run, flush=None) -> float:
    return statistics.median(time_candidate(run, SETTINGS, flush))


def default_ops_us(model, library, before_each=(None,)) -> list[tuple]:
    """Each tuned op of the model at the library's default config, timed alone once per entry of
    ``before_each`` (None: back to back, hot): [(task, [median us per entry])]."""
    library.prepare_model(model)
    timed = []
    for task in library_tasks(model, library):
        candidate = library.prepare(task, library.default_config(task, this_device()), task_inputs(task))
        try:
            timed.append((task, [median_us(candidate.run, before) for before in before_each]))
        finally:
            candidate.close()
    return timed


def measure_model(name: str, library_names: list[str], rounds: int) -> dict:
    model = load_model(name)
    buffer = np.zeros(FLUSH_BYTES // 4, np.float32)

    def flush():
        buffer[:] += 1.0

    row = {"model": name, "libraries": {}}
    whole = timed_alone(model, {library: library for library in library_names}, rounds=rounds)
    for library_name in library_names:
        hot_us = cold_us = 0.0
        per_task = []
        for task, (hot, cold) in default_ops_us(model, plugins.get_library(library_name), (None, flush)):
            hot_us += hot * len(task.nodes)
            cold_us += cold * len(task.nodes)
            per_task.append({"task": task.id, "nodes": len(task.nodes), "hot_us": round(hot, 1), "cold_us": round(cold, 1)})
        if whole[library_name]["failed"]:
            raise RuntimeError(f"{name} on {library_name}: {whole[library_name]['failed']}")
        model_ms = statistics.median(whole[library_name]["times"])
        row["libraries"][library_name] = {
            "ops_hot_ms": round(hot_us / 1000, 3), "ops_cold_ms": round(cold_us / 1000, 3),
            "model_ms": round(model_ms, 3), "rest_hot_ms": round(model_ms - hot_us / 1000, 3),
            "rest_cold_ms": round(model_ms - cold_us / 1000, 3), "model_process_ms": whole[library_name]["process_ms"],
            "tasks": per_task}
        console.print(f"{name} {library_name}: ops hot {hot_us / 1000:.2f} ms, flushed {cold_us / 1000:.2f} ms, "
                      f"whole model {model_ms:.2f} ms")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,resnet50,mobilenetv2")
    parser.add_argument("--libraries", default="mlas,xnnpack")
    parser.add_argument("--rounds", type=int, default=4, help="fresh processes per library for the whole model")
    parser.add_argument("--json", default="benchmarks/results/cache_residency.json")
    args = parser.parse_args()
    libraries = args.libraries.split(",")
    rows = [measure_model(name, libraries, args.rounds) for name in args.models.split(",")]

    table = Table(title=f"default configs: isolated op sums with hot and flushed caches vs whole model ({this_device().summary()})")
    for column in ("model", "library", "ops hot ms", "ops flushed ms", "flushed / hot", "whole model ms",
                   "rest (hot) ms", "rest (flushed) ms"):
        table.add_column(column, justify="left" if column in ("model", "library") else "right")
    for row in rows:
        for library, r in row["libraries"].items():
            table.add_row(row["model"], library, f"{r['ops_hot_ms']:.2f}", f"{r['ops_cold_ms']:.2f}",
                          f"{r['ops_cold_ms'] / r['ops_hot_ms']:.3f}", f"{r['model_ms']:.2f}",
                          f"{r['rest_hot_ms']:+.2f}", f"{r['rest_cold_ms']:+.2f}")
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": this_device().summary(), "flush_bytes": FLUSH_BYTES,
                                           "models": rows}, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
