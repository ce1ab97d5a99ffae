"""Every real model (core/models/realmodels.py) end to end, as a user runs it: per model, in one run,

1. ``kselect tune MODEL --library mlas``, ``--library xnnpack`` and ``--library all`` (records of
   the first two are reused by the third), each timed (tune wall time) and each exit code kept;
2. the whole model, each runner alone in fresh processes taking turns (core/whole_model/alone.timed_alone,
   the rounds protocol): ONNX Runtime's default session, XNNPack's default (ONNX Runtime runs what
   XNNPack's runner has not), the MLAS plan, the XNNPack plan, and the plan ``--library all`` kept.

Columns: milliseconds (median of all runs) and the per-round speedup over ONNX Runtime's default
(median with its distribution-free bounds), the largest output error against ONNX Runtime's, the
segments each runner was cut into, the tune wall times, and whether every step ran. Where the
plan kept is ONNX Runtime's default session itself, its column is that session timed a second
time beside the first (an A/A reading: the protocol's own noise), shown as such.
Prints a table, writes JSON (benchmarks/results/real_models.json) and markdown (docs/real-models.md).

    .venv/bin/python benchmarks/real_models.py [--models ppocr-v4-det,nudenet-320n] [--budget 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.cli.main import main as kselect
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model
from kselect.core.models.realmodels import REAL_MODELS
from kselect.core.plans.plan import load_plan_file
from kselect.core.whole_model.alone import median_bounds, paired_speedups, timed_alone
from kselect.core.whole_model.bench import compare_outputs
from kselect.core.whole_model.selection import BASELINE
from model_names import tunable_model_names  # benchmarks/model_names.py: the script's folder is on sys.path

console = Console(width=220)
TUNES = ("mlas", "xnnpack", "all")


def run_model(name: str, work: Path, db: Path, budget: int, min_time: float, rounds: int) -> dict:
    row: dict = {"model": name, "tune_s": {}, "tune_exit": {}, "ms": {}, "per_round": {}, "bounds": {},
                 "max_error": {}, "segments": {}, "failed": {}}
    plans = {}
    for library in TUNES:
        path = work / f"{name}.{library}.plan.json"
        start = time.perf_counter()
        code = kselect(["tune", name, "--library", library, "--budget", str(budget), "--min-time", str(min_time),
                        "--db", str(db), "-o", str(path)])
        if code in (130, 143):  # Ctrl-C or SIGTERM: stop the benchmark, not just this tune
            raise SystemExit(code)
        row["tune_s"][library] = round(time.perf_counter() - start, 1)
        row["tune_exit"][library] = code
        if code == 0:
            plans[library] = load_plan_file(path)
    kept = plans.get("all")
    row["kept"] = kept.extra.get("verified", {}).get("chosen") if kept else None
    model = load_model(name)
    candidates = {"onnxruntime default": "mlas", "xnnpack default": "xnnpack"}
    candidates.update({f"{library} plan": plan for library, plan in plans.items() if library != "all"})
    if kept is not None:
        candidates["kept (--library all)"] = kept
    alone = timed_alone(model, candidates, rounds=rounds, runs_per_process=5, min_time_s=0.3)
    baseline = alone["onnxruntime default"]
    for label, measured in alone.items():
        if measured["failed"]:
            row["failed"][label] = measured["failed"]
            continue
        row["ms"][label] = round(statistics.median(measured["times"]), 3)
        row["segments"][label] = measured["segments"]
        if baseline["failed"]:
            continue
        low, median, high = median_bounds(paired_speedups(baseline["process_ms"], measured["process_ms"]))
        row["per_round"][label] = round(median, 4)
        row["bounds"][label] = [round(low, 4), round(high, 4)]
        row["max_error"][label] = compare_outputs(baseline["outputs"], measured["outputs"])
    row["ran_everywhere"] = (not row["failed"] and all(code == 0 for code in row["tune_exit"].values()))
    return row


KEPT = "kept (--library all)"
COLUMNS = ("onnxruntime default", "xnnpack default", "mlas plan", "xnnpack plan", KEPT)


def markdown(rows: list[dict], device: str, budget: int, rounds: int) -> str:
    lines = [f"# Real models end to end on {device}", "",
             f"`benchmarks/real_models.py`, `kselect tune --budget {budget}` per library; whole models each alone in "
             f"fresh processes, {rounds} rounds taking turns (ms: median of all runs; x: median per-round speedup over "
             "ONNX Runtime's default, with its distribution-free bounds).", "",
             "| model | " + " | ".join(COLUMNS) + " | kept | tune s (mlas / xnnpack / all) | max error | all ran |",
             "| --- | " + " | ".join("---:" for _ in COLUMNS) + " | --- | --- | ---: | --- |"]
    for row in rows:
        cells = []
        for label in COLUMNS:
            if label in row["failed"]:
                cells.append("failed")
            elif label in row["ms"]:
                low, high = row["bounds"].get(label, [None, None])
                ratio = f" ({row['per_round'][label]:.3f}x, {low:.2f}-{high:.2f})" if label in row["per_round"] else ""
                aa = "A/A: " if label == KEPT and row["kept"] == BASELINE else ""
                cells.append(f"{aa}{row['ms'][label]:.2f}{ratio}")
            else:
                cells.append("-")
        errors = [e for e in row["max_error"].values() if e is not None]
        tunes = " / ".join(str(row["tune_s"].get(lib, "-")) + ("" if row["tune_exit"].get(lib) == 0 else " (exit "
                           f"{row['tune_exit'].get(lib)})") for lib in TUNES)
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {row['kept']} | {tunes} | "
                     f"{max(errors):.1e} | {'yes' if row['ran_everywhere'] else 'no'} |")
    return "\n".join(lines + [""] + kept_summary(rows)) + "\n"


def kept_summary(rows: list[dict]) -> list[str]:
    """The target's lines: what the plans kept over ONNX Runtime's default read, and the A/A
    readings of the models that kept the default itself (its ratio is 1 by identity)."""
    def reading(row):
        low, high = row["bounds"][KEPT]
        return f"{row['model']} {row['per_round'][KEPT]:.3f}x ({low:.2f}-{high:.2f})"

    timed = [row for row in rows if KEPT in row["per_round"]]
    other = [row for row in timed if row["kept"] != BASELINE]
    same = [row for row in timed if row["kept"] == BASELINE]
    lines = []
    if other:
        lowest = min(other, key=lambda row: row["per_round"][KEPT])
        lines.append(f"- Kept plans other than ONNX Runtime's default ({len(other)} models): lowest {reading(lowest)}.")
    if same:
        lines.append(f"- ONNX Runtime's default kept ({len(same)} models): the baseline itself, 1.000x by identity; "
                     "timed again beside itself (A/A): " + ", ".join(reading(row) for row in same) + ".")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(REAL_MODELS))
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--min-time", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db", default="benchmarks/results/real_models.db")
    parser.add_argument("--work", default="benchmarks/results/real_models_plans")
    parser.add_argument("--json", default="benchmarks/results/real_models.json")
    parser.add_argument("--markdown", default="docs/real-models.md")
    args = parser.parse_args()
    tunable_model_names(args.models)  # one line and exit 2 before measuring, not a traceback later
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = this_device()
    rows = []
    for name in args.models.split(","):
        console.rule(name)
        rows.append(run_model(name, work, Path(args.db), args.budget, args.min_time, args.rounds))
        Path(args.json).write_text(json.dumps({"device": device.to_json(), "budget": args.budget,
                                               "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    table = Table(title="real models: ms (per-round speedup over ONNX Runtime's default)")
    for column in ("model", *COLUMNS, "kept", "all ran"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["model"], *[("failed" if c in row["failed"] else
                                       f"{row['ms'][c]:.2f} ({row['per_round'].get(c, 0):.3f}x)" if c in row["ms"] else "-")
                                      for c in COLUMNS], str(row["kept"]), "yes" if row["ran_everywhere"] else "no")
    console.print(table)
    Path(args.markdown).write_text(markdown(rows, device.summary(), args.budget, args.rounds))
    console.print(f"wrote {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
