"""Where oneDNN's kernels beat ONNX Runtime's (MLAS) per op, on this machine.

For each model, tunes MLAS and oneDNN (``kselect.tune`` per library, records reused from
``--db``) and compares, per task, each library's default and best measured config as isolated
ops (each op timed alone, inputs already in the layout it reads; conversions between ops are not
included: the cross-library planner counts those). A task is a oneDNN win when oneDNN's best is
faster than MLAS's best by more than ``--margin``. The per-op ceiling is the model's op time
with every op on the faster of the two bests, against MLAS's defaults (ONNX Runtime's default
session). Prints a table per model and writes JSON and markdown.

    .venv/bin/python benchmarks/onednn_vs_mlas.py --models resnet18,resnetxy,mobilenetv2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings

console = Console(width=None if sys.stdout.isatty() else 10_000)  # a pipe gets whole lines
COLUMNS = ("task", "op", "input", "ops", "MLAS default", "MLAS best", "oneDNN default", "oneDNN best",
           "MLAS best / oneDNN best", "oneDNN best config")


def _us(outcome, which: str) -> float | None:
    result = getattr(outcome, which)
    return result.median_us if result is not None and result.status == "ok" else None


def compare(model: str, budget: int, db: str, settings: MeasureSettings) -> dict:
    config = kselect.TuneConfig(budget=budget, db=db, settings=settings, verify=False)
    tuned = {name: kselect.tune(model, name, config).tunings[name] for name in ("mlas", "onednn")}
    by_task = {name: {o.task.key: o for o in tuning.outcomes} for name, tuning in tuned.items()}
    rows = []
    for outcome in tuned["mlas"].outcomes:
        task, other = outcome.task, by_task["onednn"].get(outcome.task.key)
        row = {"task": task.id, "op": f"{task.kind} {task.describe_attrs()}".strip(),
               "input": "x".join(map(str, task.input_shape)), "ops": len(task.nodes),
               "mlas_default_us": _us(outcome, "default"), "mlas_best_us": _us(outcome, "best"),
               "mlas_best": outcome.best_config,
               "onednn_default_us": _us(other, "default") if other else None,
               "onednn_best_us": _us(other, "best") if other else None,
               "onednn_best": other.best_config if other else None}
        rows.append(row)
    return {"model": model, "tasks": rows}


def cells(row: dict) -> list[str]:
    """A task's row as printed, in COLUMNS order."""
    def us(value):
        return "-" if value is None else f"{value:,.1f}"

    ratio = row.get("onednn_over_mlas")
    config = ", ".join(f"{k}={v}" for k, v in (row["onednn_best"] or {}).items())
    return [row["task"], row["op"], row["input"], str(row["ops"]), us(row["mlas_default_us"]), us(row["mlas_best_us"]),
            us(row["onednn_default_us"]), us(row["onednn_best_us"]), "-" if ratio is None else f"{ratio:.2f}x", config]


def summarise(result: dict, margin: float) -> dict:
    wins, ops_default, ops_mlas, ops_ceiling = [], 0.0, 0.0, 0.0
    for row in result["tasks"]:
        mlas, onednn, n = row["mlas_best_us"], row["onednn_best_us"], row["ops"]
        if mlas is None or row["mlas_default_us"] is None:
            continue
        ops_default += row["mlas_default_us"] * n
        ops_mlas += mlas * n
        best = min(mlas, onednn) if onednn is not None else mlas
        ops_ceiling += best * n
        row["onednn_over_mlas"] = round(mlas / onednn, 3) if onednn else None
        if onednn is not None and mlas / onednn > 1 + margin:
            wins.append(row["task"])
    return {"onednn_wins": wins, "tasks": len(result["tasks"]),
            "ops_ms": {"mlas_default": round(ops_default / 1000, 3), "mlas_best": round(ops_mlas / 1000, 3),
                       "best_of_both": round(ops_ceiling / 1000, 3)},
            "ceiling_over_ort_default": round(ops_default / ops_ceiling, 3) if ops_ceiling else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,resnetxy,mobilenetv2")
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--min-time", type=float, default=0.1)
    parser.add_argument("--margin", type=float, default=0.02, help="a oneDNN win beats MLAS's best by more than this")
    parser.add_argument("--db", default="benchmarks/results/onednn_vs_mlas.db")
    parser.add_argument("--json", default="benchmarks/results/onednn_vs_mlas.json")
    parser.add_argument("--markdown", default="docs/onednn-vs-mlas.md")
    args = parser.parse_args()
    settings = MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time)
    device = this_device()
    results = []
    for model in args.models.split(","):
        result = compare(model, args.budget, args.db, settings)
        result["summary"] = summarise(result, args.margin)  # also adds each row's ratio
        results.append(result)
        table = Table(title=f"{model}: isolated ops, us (MLAS = ONNX Runtime's kernels; best of {args.budget} configs)")
        for column in COLUMNS:
            table.add_column(column, justify="left" if column in ("task", "op", "input", "oneDNN best config") else "right")
        for row in result["tasks"]:
            table.add_row(*cells(row))
        console.print(table)
        s = result["summary"]
        console.print(f"{model}: oneDNN's best beats MLAS's best by > {args.margin:.0%} on {len(s['onednn_wins'])} of "
                      f"{s['tasks']} tasks; op sums: MLAS default {s['ops_ms']['mlas_default']} ms, MLAS best "
                      f"{s['ops_ms']['mlas_best']} ms, best of both {s['ops_ms']['best_of_both']} ms "
                      f"({s['ceiling_over_ort_default']}x over ONNX Runtime's default ops)")
    header = {"device": device.summary(), "device_fingerprint": device.fingerprint, "budget": args.budget,
              "min_time_s": args.min_time, "margin": args.margin,
              "libraries": {name: plugins.get_library(name).version() for name in ("mlas", "onednn")}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**header, "models": results}, indent=2) + "\n")
    lines = ["# oneDNN against MLAS, per op", "",
             f"`benchmarks/onednn_vs_mlas.py` on {header['device']}: {header['libraries']['mlas']} against "
             f"{header['libraries']['onednn']}, best of {args.budget} configs per task and library (the default "
             "included), isolated ops (conversions between ops not included). A oneDNN win beats MLAS's best by "
             f"more than {args.margin:.0%}.", "",
             "| model | tasks | oneDNN wins | MLAS default ops ms | MLAS best ops ms | best of both ops ms | per-op ceiling |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        s = result["summary"]
        lines.append(f"| {result['model']} | {s['tasks']} | {len(s['onednn_wins'])} | {s['ops_ms']['mlas_default']} | "
                     f"{s['ops_ms']['mlas_best']} | {s['ops_ms']['best_of_both']} | {s['ceiling_over_ort_default']}x |")
    lines += ["", "Per task (us):", ""]
    for result in results:
        lines += [f"## {result['model']}", "", "| " + " | ".join(COLUMNS) + " |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += ["| " + " | ".join(cells(row)) + " |" for row in result["tasks"]]
        lines.append("")
    Path(args.markdown).write_text("\n".join(lines))
    console.print(f"wrote {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
