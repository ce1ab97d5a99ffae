"""Latency prediction without measuring (`kselect predict`), checked against measurements.

For each zoo model, the xgb cost model is trained on this device's records of every task that is
*not* one of the model's (leave-one-model-out: the model is predicted as if it had never been
measured; resnet101 shares most tasks with resnet50, and those are left out too), predicts every
config of the model's tasks, and the plan rule (core/plans/plan.choose) picks the predicted plan. Then,
against measurements on this device:

- per op: |predicted / measured - 1| for the predicted plan's config and for the library default
  (the measured time is the stored record, which benchmarks/record_tables.py makes for every
  config; a config with no record is measured now);
- the plan: the measured op sum of the predicted plan against the measured op sum of the best
  recorded config of each task (what an exhaustive tune picks): what predicting costs;
- whole model: the predicted plan and the library default each run alone in fresh processes
  (core/whole_model/alone.timed_alone, as an app runs them); the predicted op sum against the measured
  latency, raw, and calibrated by the median ratio of whole-model latency to measured op sum of
  the *other* models (the ops the cost model does not cover and the data movement between ops).

    .venv/bin/python benchmarks/prediction.py --library mlas [--models resnet18,mobilenetv2]
        [--db benchmarks/results/record_tables.db] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model
from kselect.core.models.zoo import BUILTIN_MODELS
from kselect.core.plans.plan import build_plan
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.alone import median_bounds, paired_speedups, timed_alone
from kselect.search.predict import predicted_records, training_rows
from model_names import tunable_model_names  # benchmarks/model_names.py: the script's folder is on sys.path

console = Console(width=None if sys.stdout.isatty() else 200)
RESULTS = Path(__file__).resolve().parent / "results"


class MeasuredTimes:
    """Measured isolated time of a task's config: its stored record, else measured now."""

    def __init__(self, db: RecordDB, device, library, settings: MeasureSettings):
        self.db, self.device, self.library, self.settings = db, device, library, settings
        self.worker = None
        self.measured_now = 0

    def stored(self, task) -> dict[str, float]:
        return {r.config_key: r.result.median_us
                for r in self.db.records(self.device.fingerprint, self.library.name, self.library.version(), task.key)
                if r.result.status == "ok"}

    def recorded(self, task) -> int:
        """Configs of ``task`` with a record, failed ones included."""
        return len(self.db.records(self.device.fingerprint, self.library.name, self.library.version(), task.key))

    def of(self, task, config: dict, is_default: bool = False) -> float | None:
        found = self.stored(task).get(config_key(config))
        if found is not None:
            return found
        if self.worker is None:
            self.worker = MeasureWorker(self.library.name, self.settings).__enter__()
        result = self.worker.measure(task, config)
        self.measured_now += 1
        if result.status != "ok":
            return None
        self.db.add(self.device.fingerprint, self.library.name, self.library.version(), task.to_json(),
                    config_key(config), result, self.library.emulated, is_default)
        return result.median_us

    def close(self) -> None:
        if self.worker is not None:
            self.worker.__exit__(None, None, None)


def relative_error(predicted: float, measured: float | None) -> float | None:
    return None if not measured else predicted / measured - 1


def run_model(name: str, library, device, db: RecordDB, all_rows: list, times: MeasuredTimes, seed: int,
              rounds: int, runs: int) -> dict:
    model = load_model(name)
    tasks = library_tasks(model, library)
    own_keys = {t.key for t in tasks}
    rows = [row for row in all_rows if row[0].key not in own_keys]
    defaults = {t.key: library.default_config(t, device) for t in tasks}
    predicted, _ = predicted_records(tasks, library, device, rows, defaults, seed)
    plan = build_plan(model, device, library, library.version(), tasks, predicted, defaults)
    by_key = {t.key: t for t in tasks}
    ops, exhaustive = [], True
    for entry in plan.tasks:
        task = by_key[entry["key"]]
        stored = times.stored(task)
        exhaustive &= times.recorded(task) >= len(library.space(task, device))
        ops.append({"task": task.id, "nodes": len(task.nodes), "config": entry["config"],
                    "predicted_us": entry["time_us"], "measured_us": times.of(task, entry["config"]),
                    "default_predicted_us": entry["default_us"], "default_measured_us": times.of(task, entry["default_config"], True),
                    "best_measured_us": min(stored.values()) if stored else None})
    for op in ops:
        op["error"] = relative_error(op["predicted_us"], op["measured_us"])
        op["default_error"] = relative_error(op["default_predicted_us"], op["default_measured_us"])

    def total(field: str) -> float | None:
        values = [op[field] for op in ops]
        return None if None in values else sum(v * op["nodes"] for v, op in zip(values, ops))

    alone = timed_alone(model, {"default": library.name, "predicted plan": plan}, rounds, runs)
    failed = {side: a["failed"] for side, a in alone.items() if a["failed"]}
    whole = {side: round(statistics.median(a["times"]), 4) for side, a in alone.items() if not a["failed"]}
    speedup = None
    if not failed:
        low, median, high = median_bounds(paired_speedups(alone["default"]["process_ms"], alone["predicted plan"]["process_ms"]))
        speedup = {"median": round(median, 4), "bounds": [round(low, 4), round(high, 4)]}
    errors = [abs(op["error"]) for op in ops if op["error"] is not None]
    default_errors = [abs(op["default_error"]) for op in ops if op["default_error"] is not None]
    return {"model": name, "tasks": len(tasks), "training_rows": len(rows),
            "training_tasks": len({row[0].key for row in rows}), "exhaustive_records": exhaustive,
            "op_error_median": round(statistics.median(errors), 4) if errors else None,
            "op_error_mean": round(statistics.mean(errors), 4) if errors else None,
            "default_op_error_median": round(statistics.median(default_errors), 4) if default_errors else None,
            "predicted_sum_us": round(total("predicted_us"), 1), "measured_sum_us": total("measured_us"),
            "best_sum_us": total("best_measured_us") if exhaustive else None,
            "default_predicted_sum_us": round(total("default_predicted_us"), 1),
            "default_measured_sum_us": total("default_measured_us"),
            "whole_ms": whole, "failed": failed, "plan_over_default_per_round": speedup,
            "process_ms": {side: a["process_ms"] for side, a in alone.items()}, "ops": ops}


def calibrate(rows: list[dict]) -> None:
    """Whole-model prediction: the predicted op sum times the median ratio of whole-model
    latency to measured op sum over the *other* models (leave-one-model-out)."""
    ratios = {r["model"]: r["whole_ms"]["predicted plan"] * 1000 / r["measured_sum_us"]
              for r in rows if "predicted plan" in r["whole_ms"] and r["measured_sum_us"]}
    for row in rows:
        measured = row["whole_ms"].get("predicted plan")
        others = [ratio for model, ratio in ratios.items() if model != row["model"]]
        row["whole_prediction"] = None
        if measured is None:
            continue
        raw_ms = row["predicted_sum_us"] / 1000
        factor = statistics.median(others) if others else None
        row["whole_prediction"] = {
            "raw_ms": round(raw_ms, 3), "raw_error": round(raw_ms / measured - 1, 4),
            "rest_factor_of_others": round(factor, 4) if factor else None,
            "calibrated_ms": round(raw_ms * factor, 3) if factor else None,
            "calibrated_error": round(raw_ms * factor / measured - 1, 4) if factor else None}
        if row["measured_sum_us"] and row["best_sum_us"]:
            row["plan_cost_of_predicting"] = round(row["measured_sum_us"] / row["best_sum_us"] - 1, 4)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def show(rows: list[dict], library, emulated: str) -> None:
    table = Table(title=f"{library.name}: predicted without measuring the model (leave-one-model-out) vs measured{emulated}")
    for column in ("model", "tasks", "trained on", "op error (median |e|)", "default op error", "plan ops vs best",
                   "predicted ops ms", "whole ms", "raw error", "calibrated error", "plan vs default (per round)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        w = r["whole_prediction"] or {}
        speed = r["plan_over_default_per_round"]
        table.add_row(r["model"], str(r["tasks"]), f"{r['training_rows']} rows / {r['training_tasks']} tasks",
                      "-" if r["op_error_median"] is None else f"{r['op_error_median']:.1%}",
                      "-" if r["default_op_error_median"] is None else f"{r['default_op_error_median']:.1%}",
                      pct(r.get("plan_cost_of_predicting")), f"{r['predicted_sum_us'] / 1000:.2f}",
                      f"{r['whole_ms'].get('predicted plan', float('nan')):.2f}", pct(w.get("raw_error")),
                      pct(w.get("calibrated_error")),
                      f"{speed['median']:.3f} [{speed['bounds'][0]:.3f}-{speed['bounds'][1]:.3f}]" if speed
                      else "failed: " + "; ".join(r["failed"].values()))
    console.print(table)
    errors = [abs(r["whole_prediction"]["calibrated_error"]) for r in rows
              if r["whole_prediction"] and r["whole_prediction"]["calibrated_error"] is not None]
    if errors:
        console.print(f"whole model, calibrated: median |error| {statistics.median(errors):.1%}, "
                      f"within 5% on {sum(e <= 0.05 for e in errors)} of {len(errors)} models")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", default="mlas")
    parser.add_argument("--models", default=",".join(BUILTIN_MODELS))
    parser.add_argument("--db", default="benchmarks/results/record_tables.db", help="records of this device")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side for the whole model")
    parser.add_argument("--runs", type=int, default=8, help="timed runs per process")
    parser.add_argument("--min-time", type=float, default=0.05, help="per candidate, for configs measured now")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    tunable_model_names(args.models)  # one line and exit 2 before measuring, not a traceback later

    library, device = plugins.get_library(args.library), this_device()
    db = RecordDB(args.db)
    all_rows = training_rows(db, device.fingerprint, library.name, library.version())
    emulated = " [EMULATED: not Arm performance]" if library.emulated else ""
    console.print(f"{len(all_rows)} records of {library.name} ({library.version()}) on {device.summary()} "
                  f"[{device.fingerprint}] in {args.db}{emulated}")
    times = MeasuredTimes(db, device, library, MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time))
    rows = []
    try:
        for name in args.models.split(","):
            with console.status(f"{name}: predicting, then running the predicted plan and the default"):
                rows.append(run_model(name, library, device, db, all_rows, times, args.seed, args.rounds, args.runs))
            console.print(f"{name}: done ({times.measured_now} configs measured now so far)")
    finally:
        times.close()
    calibrate(rows)
    show(rows, library, emulated)
    out = Path(args.json_out or RESULTS / f"prediction_{library.name}_{device.fingerprint}.json")
    out.write_text(json.dumps({"library": library.name, "library_version": library.version(), "device": device.to_json(),
                               "emulated": library.emulated, "db": args.db, "seed": args.seed, "rounds": args.rounds,
                               "note": __doc__.split("\n\n    ")[0], "models": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
