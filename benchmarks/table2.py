"""The ACLTuner Table 2 analogue on this machine: per zoo model, ONNX Runtime's default session,
XNNPack's default, each library's tuned plan, the cross-library plan, tuning cost, the speedup
ceiling per-op selection allows, and the whole-model prediction against the measurement.

Everything of one model is measured in one run: the whole-model latencies are medians of one
interleaved run of all runners. Prints a table, writes JSON (default
benchmarks/results/table2.json) and markdown (default docs/table2.md).

    .venv/bin/python benchmarks/table2.py [--models resnet18,mobilenetv2] [--budget 6]

Ceiling: ONNX Runtime's default latency minus what the tuned ops would save if each ran its
fastest measured option (any library, any config), conversions not counted; ceiling speedup =
default / that. Prediction of a plan: its tuned ops and conversions as measured in isolation,
plus the time of everything else (untuned ops, runner overhead), taken per library as its
default whole-model latency minus its default tuned-op sum, shared by the untuned nodes each
library runs in the plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.core import plugins
from kselect.core.bench import compare_outputs, interleaved, random_feeds
from kselect.core.crossplan import plan_across
from kselect.core.device import this_device
from kselect.core.measure import MeasureSettings
from kselect.core.model import load_model
from kselect.core.records import RecordDB
from kselect.core.runtime import load_plan
from kselect.core.tune import TuneOptions, library_tasks, tune, verified_library_plan

console = Console()
LIBRARIES = ("mlas", "xnnpack")


def predicted_ms(plan, runner, rest_us: dict[str, float]) -> float:
    """Tuned ops and conversions of the plan, plus each library's untuned-op time in proportion
    to the untuned nodes it runs here."""
    cross = plan.extra.get("cross_library")
    measured = cross["predicted"]["total_us"] if cross else plan.estimated_us()
    tuned = set(plan.nodes)
    untuned: dict[str, int] = {}
    for segment in runner.segments:
        untuned[segment.library] = untuned.get(segment.library, 0) + sum(n not in tuned for n in segment.nodes)
    total = sum(untuned.values()) or 1
    rest = sum(rest_us[name] * count / total for name, count in untuned.items())
    return (measured + rest) / 1000.0


def run_model(name: str, libraries: dict, db: RecordDB, options: TuneOptions, rounds: int, runs: int) -> dict:
    device = this_device()
    model = load_model(name)
    single, tuning = {}, {}
    for library_name, library in libraries.items():
        start = time.perf_counter()
        tasks = library_tasks(model, library)
        outcomes = tune(tasks, library, device, db, options)
        single[library_name] = verified_library_plan(model, library, device, db, tasks, outcomes)
        tuning[library_name] = {"tune_s": round(time.perf_counter() - start, 1),
                                "samples": sum(o.samples for o in outcomes),
                                "measured_now": sum(o.measured_now for o in outcomes),
                                "plan_variant": single[library_name].extra["verified"]["chosen"]}
    start = time.perf_counter()
    cross = plan_across(model, device, db, libraries, single, options.settings)
    tuning["cross"] = {"plan_s": round(time.perf_counter() - start, 1)}

    runners = {"onnxruntime default": libraries["mlas"].model_runner(model, None),
               "xnnpack default": libraries["xnnpack"].model_runner(model, None)}
    plans = {f"{n} plan": p for n, p in single.items()}
    plans["cross-library plan"] = cross
    for label, plan in plans.items():
        runners[label] = load_plan(plan, model)
    feeds = random_feeds(model)
    reference = runners["onnxruntime default"](feeds)
    errors = {label: compare_outputs(reference, runner(feeds)) for label, runner in runners.items()}
    times = interleaved(runners, feeds, rounds, runs)
    ms = {label: statistics.median(values) for label, values in times.items()}

    ort_ms = ms["onnxruntime default"]
    best_single = min((label for label in plans if label != "cross-library plan"), key=ms.get)
    kept = min((best_single, "cross-library plan"), key=ms.get)  # what `kselect tune --library mlas,xnnpack` keeps
    summary = cross.extra["cross_library"]
    default_ops = summary["default_ops_us"]
    saving_us = default_ops["mlas"] - summary["ops_ceiling_us"]
    ceiling = ort_ms / (ort_ms - saving_us / 1000.0)
    rest_us = {"mlas": ort_ms * 1000 - default_ops["mlas"], "xnnpack": ms["xnnpack default"] * 1000 - default_ops["xnnpack"]}
    prediction = {}
    for label, plan in plans.items():
        predicted = predicted_ms(plan, runners[label], rest_us)
        prediction[label] = {"predicted_ms": round(predicted, 3), "measured_ms": round(ms[label], 3),
                             "error": round(predicted / ms[label] - 1, 4)}
    ops_by_library = {}
    for entry in cross.nodes.values():
        ops_by_library[entry["library"]] = ops_by_library.get(entry["library"], 0) + 1
    segments = len(runners["cross-library plan"].segments)
    for runner in runners.values():
        getattr(runner, "close", lambda: None)()
    return {
        "model": name, "ms": {k: round(v, 3) for k, v in ms.items()},
        "spread": {k: round((lambda q: (q[1] - q[0]) / statistics.median(v))(statistics.quantiles(v, n=4)[::2]), 4)
                   for k, v in times.items()},
        "max_relative_output_error": errors, "best_single": best_single, "kept": kept,
        "speedup_kept": round(ort_ms / ms[kept], 4), "speedup_cross": round(ort_ms / ms["cross-library plan"], 4),
        "speedup_best_single": round(ort_ms / ms[best_single], 4), "ceiling": round(ceiling, 4),
        "share_of_ceiling": round((ort_ms / ms[kept]) / ceiling, 4), "tuning": tuning,
        "cross_ops_by_library": ops_by_library, "cross_segments": segments,
        "isolated_sums_us": {"cross": summary["predicted"], "greedy": summary["greedy"],
                             "single_library": summary["single_library"], "ops_ceiling_us": summary["ops_ceiling_us"],
                             "default_ops_us": default_ops},
        "prediction": prediction,
    }


def _geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def write_markdown(path: Path, rows: list[dict], header: dict) -> None:
    lines = [
        "# Table 2 analogue: kselect on this machine",
        "",
        f"Measured by `benchmarks/table2.py` on {header['device']}, {header['threads']} cores, "
        f"search `{header['search']}`, budget {header['budget']} configs per task per library; "
        f"load average during the run {header['load_average'][0]:.2f} / {header['load_average'][1]:.2f} / "
        f"{header['load_average'][2]:.2f}. Latencies are medians of one interleaved run per model "
        "(all columns of a row measured together); ratios are ONNX Runtime default / column.",
        "",
        "| model | ORT default ms | XNNPack default ms | MLAS plan ms | XNNPack plan ms | cross-library ms "
        "| kept | speedup kept | ceiling | share of ceiling | tune s (mlas / xnnpack) | samples | prediction error (cross) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, t = r["ms"], r["tuning"]
        lines.append(
            f"| {r['model']} | {m['onnxruntime default']:.2f} | {m['xnnpack default']:.2f} | {m['mlas plan']:.2f} "
            f"| {m['xnnpack plan']:.2f} | {m['cross-library plan']:.2f} | {r['kept']} | {r['speedup_kept']:.3f} "
            f"| {r['ceiling']:.3f} | {r['share_of_ceiling']:.3f} | {t['mlas']['tune_s']:.0f} / {t['xnnpack']['tune_s']:.0f} "
            f"| {t['mlas']['samples'] + t['xnnpack']['samples']} | {r['prediction']['cross-library plan']['error']:+.1%} |")
    lines.append(f"| geomean | | | | | | | {header['geomean_kept']:.3f} | {header['geomean_ceiling']:.3f} | | | | |")
    lines += ["", "Where the time goes (cross-library plan, isolated sums): ", ""]
    for r in rows:
        s = r["isolated_sums_us"]
        alone = ", ".join(f"{k} alone {v['total_us'] / 1000:.2f} ms" for k, v in s["single_library"].items())
        lines.append(f"- {r['model']}: ops on {r['cross_ops_by_library']}, {r['cross_segments']} segments; "
                     f"planned {s['cross']['ops_us'] / 1000:.2f} ms ops + {s['cross']['conversions_us'] / 1000:.2f} ms "
                     f"conversions; greedy per op {s['greedy']['total_us'] / 1000:.2f} ms; {alone}.")
    lines.append("")
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(plugins.models()))
    parser.add_argument("--budget", type=int, default=6)
    parser.add_argument("--search", default="xgb")
    parser.add_argument("--min-time", type=float, default=0.1, help="minimum measured seconds per candidate instance")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs-per-round", type=int, default=3)
    parser.add_argument("--db", default="benchmarks/results/table2.db")
    parser.add_argument("--json", default="benchmarks/results/table2.json")
    parser.add_argument("--markdown", default="docs/table2.md")
    args = parser.parse_args()

    libraries = {name: plugins.get_library(name) for name in LIBRARIES}
    db = RecordDB(args.db)
    options = TuneOptions(args.search, args.budget, settings=MeasureSettings(min_time_s=args.min_time))
    rows = []
    for name in args.models.split(","):
        console.print(f"[bold]{name}[/]: tuning mlas and xnnpack, planning across them, benchmarking")
        rows.append(run_model(name, libraries, db, options, args.rounds, args.runs_per_round))
        console.print(rows[-1]["ms"], f"kept {rows[-1]['kept']}", f"ceiling {rows[-1]['ceiling']}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"partial": True, "models": rows}, indent=2) + "\n")

    device = this_device()
    header = {"device": device.summary(), "threads": device.cores, "search": args.search, "budget": args.budget,
              "libraries": {n: lib.version() for n, lib in libraries.items()}, "load_average": os.getloadavg(),
              "geomean_kept": _geomean([r["speedup_kept"] for r in rows]),
              "geomean_cross": _geomean([r["speedup_cross"] for r in rows]),
              "geomean_best_single": _geomean([r["speedup_best_single"] for r in rows]),
              "geomean_ceiling": _geomean([r["ceiling"] for r in rows])}

    table = Table(title=f"kselect vs ONNX Runtime default ({header['device']}); ms are medians of one interleaved run")
    for column in ("model", "ORT default", "XNNPack default", "MLAS plan", "XNNPack plan", "cross plan", "kept",
                   "speedup", "ceiling", "of ceiling", "tune s", "samples", "pred. err"):
        table.add_column(column, justify="left" if column in ("model", "kept") else "right")
    for r in rows:
        m, t = r["ms"], r["tuning"]
        table.add_row(r["model"], f"{m['onnxruntime default']:.2f}", f"{m['xnnpack default']:.2f}", f"{m['mlas plan']:.2f}",
                      f"{m['xnnpack plan']:.2f}", f"{m['cross-library plan']:.2f}", r["kept"], f"{r['speedup_kept']:.3f}",
                      f"{r['ceiling']:.3f}", f"{r['share_of_ceiling']:.3f}",
                      f"{t['mlas']['tune_s'] + t['xnnpack']['tune_s']:.0f}",
                      str(t["mlas"]["samples"] + t["xnnpack"]["samples"]),
                      f"{r['prediction']['cross-library plan']['error']:+.1%}")
    table.add_row("geomean", "", "", "", "", "", "", f"{header['geomean_kept']:.3f}", f"{header['geomean_ceiling']:.3f}",
                  "", "", "", "")
    console.print(table)
    Path(args.json).write_text(json.dumps({**header, "models": rows}, indent=2) + "\n")
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    write_markdown(Path(args.markdown), rows, header)
    console.print(f"wrote {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
