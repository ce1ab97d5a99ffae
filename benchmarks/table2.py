"""The ACLTuner Table 2 analogue on this machine: per zoo model, ONNX Runtime's default session,
XNNPack's default, each library's tuned plan, the cross-library plan, tuning cost, the speedup
ceiling per-op selection allows, and the whole-model prediction against the measurement.

Per model: tune each library (records reused), build the cross-library plan and its spinning
variants, let one end-to-end check choose the plan kselect keeps (as `kselect tune --library
mlas,xnnpack` does), then report whole-model latencies from a second, fresh run of all runners,
so the figures are not the ones the choice was made on. Both time every runner as an app runs
it, alone in a process of its own: ``--rounds`` fresh processes per runner, taking turns, medians
of all their runs (core/whole_model/alone.timed_alone). Prints a table, writes JSON (default
benchmarks/results/table2.json) and markdown (default docs/table2.md).

    .venv/bin/python benchmarks/table2.py [--models resnet18,mobilenetv2] [--budget 6]

Ceiling: the speedup over ONNX Runtime's default that choosing the library per op allows, from
the same run's isolated per-op minima, conversions not counted: default / (default - sum over
tuned ops of (fastest MLAS option - fastest option of any library)). (Per-node minima, not the
default configs' records: one slow outlier among those would inflate it.) MLAS's own config
headroom shows in the MLAS plan column. No plan reaches it where the fastest ops sit in different
layouts, so beside it stands the ceiling with conversions: the same formula with the saving the
exact planner found, every layout change and library switch paid (MLAS plan's isolated total minus
the best of the cross-library and single-library totals).

Before planning, every config and conversion the planner chooses among (and each library plan's
configs) is re-timed, as `kselect tune` does, so the plan, the ceiling and the prediction use
timings from the minutes before the end-to-end runs (`--no-remeasure`: the stored records as they are).

Prediction check (cross-library plan): its tuned ops and conversions as measured in isolation,
plus the time of everything else (untuned ops, runner calls), calibrated per library on that
library's own plan in the same run (its whole-model latency minus its tuned-op sum) and shared
by the untuned nodes each library runs in the cross-library plan.
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

from kselect.core.api import tune
from kselect.core.config import TuneConfig
from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions
from kselect.core.models.model import load_model
from kselect.core.plans.runtime import plan_segments
from kselect.core.plans.spinning import spinning_variants
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.alone import timed_alone
from kselect.core.whole_model.bench import compare_outputs

console = Console(width=200)
LIBRARIES = "mlas,xnnpack"  # the default --libraries; "mlas,xnnpack,onednn" adds oneDNN's columns
LABELS = {"mlas": "MLAS", "xnnpack": "XNNPack", "onednn": "oneDNN", "acl": "ACL"}


def default_columns(row: dict) -> list[str]:
    """The runner labels of a row's columns, in table order: defaults of the libraries other
    than MLAS (ONNX Runtime's default is the baseline column), each library's plan, the cross plan."""
    libraries = [name for name in row["tuning"] if name != "cross"]
    return ([f"{n} default" for n in libraries if n != "mlas"] + [f"{n} plan" for n in libraries]
            + ["cross-library plan"])


def column_title(label: str) -> str:
    name, _, kind = label.partition(" ")
    return f"{LABELS.get(name, name)} {kind}" if name in LABELS else label.replace("cross-library plan", "cross-library")


def untuned_nodes(plan, model) -> dict[str, int]:
    """How many untuned nodes each library runs in the plan's segments (core/plans/runtime.py)."""
    chosen = {node: entry["library"] for node, entry in plan.nodes.items()}
    counts: dict[str, int] = {}
    for segment in plan_segments(model, chosen, lambda name, op_type: plugins.get_library(name).runs_op(op_type)):
        counts[segment.library] = counts.get(segment.library, 0) + sum(n not in plan.nodes for n in segment.nodes)
    return counts


def ops_us_now(plan, library, device, db: RecordDB) -> float:
    """A single-library plan's tuned-op sum from the records as stored now (re-timed by
    plan_across), not as they were when the plan was built."""
    stored = {(r.task, r.config_key): r.result.median_us
              for r in db.records(device.fingerprint, library.name, library.version()) if r.result.status == "ok"}
    return sum(stored.get((t["key"], config_key(t["config"])), t["time_us"]) * len(t["nodes"]) for t in plan.tasks)


def per_round_speedups(baseline_ms: list[float], runner_ms: list[float]) -> list[float]:
    """ONNX Runtime default / runner, round by round (the two processes of a round ran minutes
    apart at most), sorted: how far one run of a few processes can be trusted."""
    return sorted(round(b / r, 3) for b, r in zip(baseline_ms, runner_ms))


def derive(row: dict) -> dict:
    """Ceiling, share of it, the prediction check and the per-round speedups, from a row's
    measured fields."""
    ms, sums = row["ms"], row["isolated_sums_us"]
    ort_ms = ms["onnxruntime default"]
    saving_us = sums["ops_ceiling_by_library_us"]["mlas"] - sums["ops_ceiling_us"]
    ceiling = ort_ms / (ort_ms - saving_us / 1000.0)
    alone_us = {name: total["total_us"] for name, total in sums["single_library"].items()}
    saving_with_conversions_us = alone_us["mlas"] - min([sums["cross"]["total_us"], *alone_us.values()])
    ceiling_with_conversions = ort_ms / (ort_ms - saving_with_conversions_us / 1000.0)
    rest_us = {name: ms[f"{name} plan"] * 1000 - ops for name, ops in row["single_plan_ops_us"].items()}
    counts = row["cross_untuned_nodes"]
    rest = sum(rest_us[name] * count for name, count in counts.items()) / max(1, sum(counts.values()))
    predicted_ms = (sums["cross"]["total_us"] + rest) / 1000.0
    measured_ms = ms["cross-library plan"]
    rounds = {}
    if "process_ms" in row:  # older result files timed the runners in one process: no per-round figures
        rounds = {label: per_round_speedups(row["process_ms"]["onnxruntime default"], values)
                  for label, values in row["process_ms"].items() if label != "onnxruntime default"}
    kept_rounds = rounds.get(row["kept"])
    return {"per_round_speedups": rounds,
            "speedup_kept_per_round": (round(statistics.median(kept_rounds), 4) if kept_rounds
                                       else 1.0 if row["kept"] == "onnxruntime default" and rounds else None),
            "ceiling": round(ceiling, 4), "share_of_ceiling": round(row["speedup_kept"] / ceiling, 4),
            "ceiling_with_conversions": round(ceiling_with_conversions, 4),
            "share_of_ceiling_with_conversions": round(row["speedup_kept"] / ceiling_with_conversions, 4),
            "prediction": {"predicted_ms": round(predicted_ms, 3), "measured_ms": measured_ms,
                           "error": round(predicted_ms / measured_ms - 1, 4),
                           "rest_ms": {k: round(v / 1000, 3) for k, v in rest_us.items()}}}


def run_model(name: str, libraries: dict, db: RecordDB, options: TuneOptions, rounds: int, runs: int,
              remeasure: bool = True) -> dict:
    device = this_device()
    model = load_model(name)
    # what `kselect tune --library mlas,xnnpack` does, through the same call: one end-to-end run picks the plan kept
    start = time.perf_counter()
    config = TuneConfig(search=options.search, budget=options.budget, time_budget_s=options.time_budget_s,
                        seed=options.seed, early_stop=options.early_stop, db=db, settings=options.settings,
                        remeasure=remeasure)
    result = tune(model, list(libraries.values()), config)
    single = {name: tuning.plan for name, tuning in result.tunings.items()}
    tuning = {name: {"tune_s": round(t.tune_s, 1), "samples": sum(o.samples for o in t.outcomes),
                     "measured_now": sum(o.measured_now for o in t.outcomes), "plan_variant": t.plan.extra["verified"]["chosen"]}
              for name, t in result.tunings.items()}
    tuning["cross"] = {"plan_and_check_s": round(time.perf_counter() - start - sum(t.tune_s for t in result.tunings.values()), 1)}
    selection = result.checks
    cross_name, cross = min(((n, p) for n, p in spinning_variants(result.cross_plan)), key=lambda v: next(
        r.get("plan_ms", float("inf")) for r in selection if r["variant"] == v[0]))
    kept = result.kept
    kept = kept if not kept.startswith("cross-library plan") else "cross-library plan"

    # the figures reported: a second, fresh run, each runner alone in processes of its own
    plans = {f"{n} plan": p for n, p in single.items()}
    plans["cross-library plan"] = cross
    defaults = {f"{n} default": n for n in libraries if n != "mlas"}
    alone = timed_alone(model, {"onnxruntime default": "mlas", **defaults, **plans}, rounds, runs)
    failed = {label: result["failed"] for label, result in alone.items() if result["failed"]}
    if failed:
        raise RuntimeError(f"{name}: " + "; ".join(f"{label} failed: {reason}" for label, reason in failed.items()))
    times = {label: result["times"] for label, result in alone.items()}
    ms = {label: statistics.median(values) for label, values in times.items()}
    reference = alone["onnxruntime default"]["outputs"]
    errors = {label: compare_outputs(reference, result["outputs"]) for label, result in alone.items()}

    ort_ms = ms["onnxruntime default"]
    best_single = min((label for label in plans if label != "cross-library plan"), key=ms.get)
    summary = cross.extra["cross_library"]
    ops_by_library = {}
    for entry in cross.nodes.values():
        ops_by_library[entry["library"]] = ops_by_library.get(entry["library"], 0) + 1
    most_ops = max(ops_by_library, key=ops_by_library.get)
    segments = alone["cross-library plan"]["segments"]
    untuned = untuned_nodes(cross, model)
    row = {
        "model": name, "ms": {k: round(v, 3) for k, v in ms.items()},
        "spread": {k: round((lambda q: (q[1] - q[0]) / statistics.median(v))(statistics.quantiles(v, n=4)[::2]), 4)
                   for k, v in times.items()},
        "process_ms": {label: result["process_ms"] for label, result in alone.items()},
        "max_relative_output_error": errors, "best_single": best_single, "kept": kept,
        "speedup_kept": round(ort_ms / ms[kept], 4), "speedup_cross": round(ort_ms / ms["cross-library plan"], 4),
        "speedup_best_single": round(ort_ms / ms[best_single], 4), "tuning": tuning,
        "cross_variant": cross_name, "selection_run": selection,
        "cross_ops_by_library": ops_by_library, "cross_segments": segments, "cross_untuned_nodes": untuned,
        "cross_nodes_off_main": {node: entry["library"] for node, entry in cross.nodes.items()
                                 if entry["library"] != most_ops},
        "cross_method": summary["method"],
        "isolated_sums_us": {"cross": summary["predicted"], "greedy": summary["greedy"],
                             "single_library": summary["single_library"], "ops_ceiling_us": summary["ops_ceiling_us"],
                             "ops_ceiling_by_library_us": summary["ops_ceiling_by_library_us"],
                             "default_ops_us": summary["default_ops_us"]},
        "switch_us": summary.get("switch_us"), "switches": summary.get("switches"), "sleep_us": summary.get("sleep_us"),
        "reentries": {k: v for k, v in summary.get("reentries", {}).items() if k != "tensors"},
        "single_plan_ops_us": {n: round(ops_us_now(p, libraries[n], device, db), 3) for n, p in single.items()},
        "remeasured": summary.get("remeasured"),
    }
    return {**row, **derive(row)}


def _figure(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _sleeping(row: dict) -> str:
    """What the ops of the libraries that do not spin were charged (absent from older result files)."""
    if not row.get("sleep_us"):
        return ""
    costs = ", ".join(f"{name} {us:.0f} us" for name, us in row["sleep_us"].items())
    return (f" + {row['isolated_sums_us']['cross']['sleeping_us'] / 1000:.2f} ms for workers asleep "
            f"(per op: {costs})")


def _switches(row: dict) -> str:
    if not row.get("switch_us"):
        return ""
    costs = ", ".join(f"{pair} {us:.0f} us" for pair, us in row["switch_us"].items())
    reentries = row.get("reentries") or {}
    reentered = f", {reentries['us'] / 1000:.2f} ms for tensors re-entering their library" if reentries.get("us") else ""
    return f" (of which {row['switches']['us'] / 1000:.2f} ms for {row['switches']['edges']} switches{reentered}; {costs})"


NOTES = """
## Reading it

- *kept* is what `kselect tune --library mlas,xnnpack` keeps: each library's plan and the
  cross-library plan's spinning variants, each timed alone in fresh processes, ONNX Runtime's
  default in the same rounds; a plan replaces the default only when the median of its per-round
  speedups reaches 1.02 and the 87.5% distribution-free lower bound of that median 1.0 (a plan
  still undecided after 4 rounds runs more with the default, up to 10; `core/whole_model/selection.race_verdict`).
  Among plans shown faster, one with more library switches, or whose threads sleep
  between parallel loops where the others' spin, must beat a calmer one by max(2%, half the spread
  of its per-round speedups) (`core/whole_model/selection.choose_result`). The figures above come from a second, fresh run, so *kept* can read
  slower than another column there; *per-round* is the median of the kept runner's per-round
  speedups in that run. When ONNX Runtime's default is kept, it is its own configuration (the MLAS
  plan with every op at the library default: the original model and default session options), and
  *kept* reads "onnxruntime default", 1.000.
- *ceiling*: ONNX Runtime default / (default - sum over tuned ops of (fastest MLAS option - fastest
  option of any library)), from the isolated per-op measurements, conversions not counted.
- *ceiling w/ conv.*: the same with the saving the exact planner found once conversions, switches
  and reentries are paid (MLAS plan's isolated total minus the best plan's): what per-op selection
  allows when each op's input must be in its kernel's layout. The two differ where the fastest ops
  sit in different layouts (mobilenetv2: XNNPack's NHWC depthwise and 1x1 convs between MLAS's
  NCHWc ones).
- *prediction error*: the cross-library plan's isolated op and conversion sums plus the untuned ops'
  time calibrated on each library's own plan in the same run, against its measured latency. The
  isolated times are re-timed just before planning (the JSON's `remeasured` counts them), so they
  and the whole-model runs come from the same minutes.
- This machine has 2 vCPUs that sometimes stall a thread for milliseconds at a time, for
  minutes on end (plugins/xnnpack/README.md, "Measuring on a shared machine"). Isolated op times
  recorded in such a period are inflated; a plan built on them loses end to end and is not kept,
  and its ceiling and prediction are meaningless. Spreads are in the JSON.
- Each ONNX Runtime segment of a mixed plan gets its residual branches as graph inputs, which
  ORT's own NCHWc transformer left in NCHW (unfused Adds and reorders down to the next
  downsampling conv); plugins/mlas/README.md describes the fix.
- Mixing libraries needs exactly one library spinning: ONNX Runtime's and XNNPack's worker
  threads otherwise take the cores from each other between segments, and with none spinning a
  plan's speed depends on the period (wake-up latency).
- Every whole-model figure (the check that chooses and the reported run) times each
  runner alone in fresh processes, one per round, runners taking turns (core/whole_model/alone.timed_alone),
  as an app runs a plan. Sharing one process cost ONNX Runtime's default about 1% (resnet50 1.011x,
  googlenet 1.013x, benchmarks/process_context.py); what makes one run unable to rank plans a few
  percent apart is the host's speed drifting by 20% and more within a minute (the per-round
  ranges above; history/table2-runs.md).
- *tune s* is the time of this invocation's tuning step: when the records were already stored
  (a rerun on the same database) it is the time of planning and checking only.
  `benchmarks/results/table2_fresh.json` holds a run that tuned everything from scratch.
"""


def _geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geomeans(rows: list[dict]) -> dict:
    return {"geomean_kept": _geomean([r["speedup_kept"] for r in rows]),
            "geomean_cross": _geomean([r["speedup_cross"] for r in rows]),
            "geomean_best_single": _geomean([r["speedup_best_single"] for r in rows]),
            "geomean_ceiling": _geomean([r["ceiling"] for r in rows]),
            "geomean_ceiling_with_conversions": _geomean([r["ceiling_with_conversions"] for r in rows])}


def write_markdown(path: Path, rows: list[dict], header: dict) -> None:
    lines = [
        "# Table 2 analogue: kselect on this machine",
        "",
        f"Measured by `benchmarks/table2.py` on {header['device']}, {header['threads']} cores, "
        f"search `{header['search']}`, budget {header['budget']} configs per task per library; "
        f"load average during the run {header['load_average'][0]:.2f} / {header['load_average'][1]:.2f} / "
        f"{header['load_average'][2]:.2f}. Latencies are medians of one run per model "
        "(all columns of a row measured in one run, each runner alone in fresh processes taking turns); "
        "ratios are ONNX Runtime default / column.",
        "",
    ]
    columns = default_columns(rows[0])
    libraries = [name for name in rows[0]["tuning"] if name != "cross"]
    lines += [
        "| model | ORT default ms | " + " | ".join(f"{column_title(c)} ms" for c in columns)
        + " | kept | speedup kept | per-round | ceiling | share of ceiling | ceiling w/ conv. | share of it "
        f"| tune s ({' / '.join(libraries)}) | samples | prediction error (cross) |",
        "| --- | ---: | " + " | ".join("---:" for _ in columns)
        + " | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, t = r["ms"], r["tuning"]
        tunes = " / ".join(f"{t[n]['tune_s']:.0f}" for n in libraries)
        lines.append(
            f"| {r['model']} | {m['onnxruntime default']:.2f} | " + " | ".join(f"{m[c]:.2f}" for c in columns)
            + f" | {r['kept']} | {r['speedup_kept']:.3f} | {_figure(r.get('speedup_kept_per_round'))} "
            f"| {r['ceiling']:.3f} | {r['share_of_ceiling']:.3f} | {r['ceiling_with_conversions']:.3f} "
            f"| {r['share_of_ceiling_with_conversions']:.3f} | {tunes} "
            f"| {sum(t[n]['samples'] for n in libraries)} | {r['prediction']['error']:+.1%} |")
    cells = ["geomean", "", *("" for _ in columns), "", f"{header['geomean_kept']:.3f}", "",
             f"{header['geomean_ceiling']:.3f}", "", f"{header['geomean_ceiling_with_conversions']:.3f}", "", "", "", ""]
    lines.append("|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|")
    lines += ["", "Where the time goes (cross-library plan, isolated sums): ", ""]
    for r in rows:
        s = r["isolated_sums_us"]
        alone = ", ".join(f"{k} alone {v['total_us'] / 1000:.2f} ms" for k, v in s["single_library"].items())
        lines.append(f"- {r['model']}: ops on {r['cross_ops_by_library']}, {r['cross_segments']} segments; "
                     f"planned {s['cross']['ops_us'] / 1000:.2f} ms ops + {s['cross']['conversions_us'] / 1000:.2f} ms "
                     f"conversions{_switches(r)}{_sleeping(r)}; greedy per op {s['greedy']['total_us'] / 1000:.2f} ms; "
                     f"{alone}.")
    if any("verdict" in c for r in rows for c in r["selection_run"]):
        lines += ["", "The check that chose *kept* (its own processes, before the reported run): per candidate, "
                  "rounds, median per-round speedup over ONNX Runtime's default [87.5% bounds], verdict.", ""]
        for r in rows:
            checked = "; ".join(f"{c['variant']} {c['processes']}: {c['speedup']:.3f} [{c['speedup_bounds'][0]:.3f}-"
                                f"{c['speedup_bounds'][1]:.3f}] {c['verdict']}" if "verdict" in c
                                else f"{c['variant']}: failed" for c in r["selection_run"])
            lines.append(f"- {r['model']}: {checked}.")
    if any(r.get("per_round_speedups") for r in rows):
        lines += ["", "How far one run can be trusted: ONNX Runtime default / each runner, round by round (each "
                  "round one fresh process per runner), lowest to highest; the table's ratios are of the pooled "
                  "medians. The check that chose *kept* ran before, on its own processes.", ""]
        for r in rows:
            ranges = "; ".join(f"{label} {values[0]:.3f}-{values[-1]:.3f}"
                               for label, values in r.get("per_round_speedups", {}).items())
            lines.append(f"- {r['model']}: {ranges}.")
    lines.append(NOTES)
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(plugins.models()))
    parser.add_argument("--libraries", default=LIBRARIES, help="libraries tuned, MLAS first (default mlas,xnnpack)")
    parser.add_argument("--budget", type=int, default=6)
    parser.add_argument("--search", default="xgb")
    parser.add_argument("--min-time", type=float, default=0.1, help="minimum measured seconds per candidate instance")
    parser.add_argument("--rounds", type=int, default=6, help="fresh processes per runner in the reported run")
    parser.add_argument("--runs-per-process", type=int, default=8)
    parser.add_argument("--db", default="benchmarks/results/table2.db")
    parser.add_argument("--json", default="benchmarks/results/table2.json")
    parser.add_argument("--markdown", default="docs/table2.md")
    parser.add_argument("--update", action="store_true",
                        help="replace only these models' rows in an existing JSON (e.g. after re-measuring them)")
    parser.add_argument("--render", action="store_true",
                        help="only recompute the derived figures (ceilings, prediction) and rewrite the markdown from the JSON")
    parser.add_argument("--no-remeasure", dest="remeasure", action="store_false",
                        help="plan on the stored records as they are (`kselect tune --no-remeasure`)")
    args = parser.parse_args()
    if args.render:
        data = json.loads(Path(args.json).read_text())
        data["models"] = [{**row, **derive(row)} for row in data["models"]]
        data.update(geomeans(data["models"]))
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        write_markdown(Path(args.markdown), data["models"], data)
        console.print(f"wrote {args.json} (derived figures) and {args.markdown}")
        return

    libraries = {name: plugins.get_library(name) for name in args.libraries.split(",")}
    db = RecordDB(args.db)
    options = TuneOptions(args.search, args.budget, settings=MeasureSettings(min_time_s=args.min_time))
    rows = []
    for name in args.models.split(","):
        console.print(f"[bold]{name}[/]: tuning {args.libraries}, planning across them, benchmarking")
        rows.append(run_model(name, libraries, db, options, args.rounds, args.runs_per_process, args.remeasure))
        console.print(rows[-1]["ms"], f"kept {rows[-1]['kept']}", f"ceiling {rows[-1]['ceiling']}")
        partial = Path(args.json).with_suffix(".partial.json")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"partial": True, "models": rows}, indent=2) + "\n")

    if args.update and Path(args.json).exists():
        rerun = {r["model"] for r in rows}
        earlier = [r for r in json.loads(Path(args.json).read_text()).get("models", []) if r["model"] not in rerun]
        order = list(plugins.models())
        rows = sorted(earlier + rows, key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    device = this_device()
    header = {"device": device.summary(), "threads": device.cores, "search": args.search, "budget": args.budget,
              "libraries": {n: lib.version() for n, lib in libraries.items()}, "load_average": os.getloadavg(),
              **geomeans(rows)}

    table = Table(title=f"kselect vs ONNX Runtime default ({header['device']}); ms are medians of one run, each runner alone in fresh processes")
    columns = default_columns(rows[0])
    for column in ("model", "ORT default", *map(column_title, columns), "kept", "speedup", "ceiling", "of ceiling",
                   "ceiling w/ conv.", "of it", "tune s", "samples", "pred. err"):
        table.add_column(column, justify="left" if column in ("model", "kept") else "right")
    for r in rows:
        m, t = r["ms"], r["tuning"]
        tuned = [name for name in t if name != "cross"]
        table.add_row(r["model"], f"{m['onnxruntime default']:.2f}", *(f"{m[c]:.2f}" for c in columns), r["kept"],
                      f"{r['speedup_kept']:.3f}", f"{r['ceiling']:.3f}", f"{r['share_of_ceiling']:.3f}",
                      f"{r['ceiling_with_conversions']:.3f}", f"{r['share_of_ceiling_with_conversions']:.3f}",
                      f"{sum(t[n]['tune_s'] for n in tuned):.0f}", str(sum(t[n]["samples"] for n in tuned)),
                      f"{r['prediction']['error']:+.1%}")
    table.add_row("geomean", "", *("" for _ in columns), "", f"{header['geomean_kept']:.3f}",
                  f"{header['geomean_ceiling']:.3f}", "", f"{header['geomean_ceiling_with_conversions']:.3f}", "", "",
                  "", "")
    console.print(table)
    Path(args.json).write_text(json.dumps({**header, "models": rows}, indent=2) + "\n")
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    write_markdown(Path(args.markdown), rows, header)
    console.print(f"wrote {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
