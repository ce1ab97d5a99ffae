"""Where a whole model's time goes, per library, measured in place: ONNX Runtime's default session
with its own profiler (per node kernel times) and XNNPack's executor at its defaults with every
step timed on its own (plugins/xnnpack/profiling.py), grouped by op type, beside the sum of the tuned ops
timed in isolation (kselect's protocol, as the planner adds them). The difference between a
library's whole model and its isolated op sum is the "rest" that table2's prediction calibrates;
this shows which ops and which overheads it is made of.

    .venv/bin/python benchmarks/where_time_goes.py [--models resnet18,mobilenetv2] [--runs 40]
        [--json benchmarks/results/where_time_goes.json]

Runs in this process, one library after the other (ORT first), each warmed up for a second: a
diagnostic, not a tuner. ORT's profiler and the per-step clock each add a little per node; the
whole-model figures are taken without them, on the same runner, just before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from cache_residency import default_ops_us  # noqa: E402 (a sibling script: benchmarks/ is on sys.path)
from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, time_candidate
from kselect.core.models.model import load_model
from kselect.core.whole_model.bench import random_feeds

console = Console(width=160)
WARMUP_S = 1.0


def warm(run, feeds) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < WARMUP_S:
        run(feeds)


def whole_ms(run, feeds, runs: int) -> float:
    return statistics.median(time_candidate(lambda: run(feeds), MeasureSettings(min_repeats=runs, min_time_s=0.5,
                                                                              max_time_s=4.0))) / 1000


def isolated_ops_ms(model, library) -> float:
    """The tuned ops at the library's default configs, each timed alone (hot caches), summed."""
    return sum(us * len(task.nodes) for task, (us,) in default_ops_us(model, library)) / 1000


def onnxruntime_profile(model, feeds, runs: int) -> dict:
    """ONNX Runtime's default session (core/whole_model/bench's baseline) with profiling on: per op type, the
    median over runs of the summed kernel times; ``runs_us``: its own model_run durations."""
    import onnxruntime as ort

    from kselect.plugins.mlas.apply import original_model

    options = ort.SessionOptions()
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as work:
        options.profile_file_prefix = os.path.join(work, "ort")
        session = ort.InferenceSession(original_model(model, False).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        run = lambda f: session.run(names, f)  # noqa: E731
        warm(run, feeds)
        for _ in range(runs):
            run(feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    model_runs = model_runs[-runs:]
    first = model_runs[0]["ts"]
    per_run: list[dict[str, float]] = [{} for _ in model_runs]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time") or event["ts"] < first:
            continue
        index = next(i for i, r in enumerate(model_runs) if r["ts"] <= event["ts"] <= r["ts"] + r["dur"])
        op_type = event["args"].get("op_name", "?")
        per_run[index][op_type] = per_run[index].get(op_type, 0.0) + event["dur"]
    op_types = {t for r in per_run for t in r}
    return {"by_op_type_ms": {t: statistics.median(r.get(t, 0.0) for r in per_run) / 1000 for t in sorted(op_types)},
            "profiled_run_ms": statistics.median(r["dur"] for r in model_runs) / 1000}


def xnnpack_profile(model, feeds, runs: int) -> dict:
    from kselect.plugins.xnnpack.executor import Executor
    from kselect.plugins.xnnpack.profiling import profile

    executor = Executor(plugins.get_library("xnnpack"), model, None)
    try:
        warm(executor, feeds)
        profiled = profile(executor, feeds, runs)
    finally:
        executor.close()
    by_type: dict[str, float] = {}
    for op_type, us in profiled["nodes"].values():
        by_type[op_type] = by_type.get(op_type, 0.0) + us / 1000
    return {"by_op_type_ms": dict(sorted(by_type.items())), "profiled_run_ms": profiled["whole_us"] / 1000,
            "input_output_layout_ms": profiled["edges_us"] / 1000}


def measure_model(name: str, runs: int) -> dict:
    model = load_model(name)
    feeds = random_feeds(model)
    row = {"model": name, "libraries": {}}
    for library_name, profile in (("mlas", onnxruntime_profile), ("xnnpack", xnnpack_profile)):
        library = plugins.get_library(library_name)
        runner = library.model_runner(model, None)
        warm(runner, feeds)
        whole = whole_ms(runner, feeds, runs)
        getattr(runner, "close", lambda: None)()
        profiled = profile(model, feeds, runs)
        isolated = isolated_ops_ms(model, library)
        in_place = sum(profiled["by_op_type_ms"].values())
        row["libraries"][library_name] = {
            "whole_ms": round(whole, 3), "isolated_tuned_ops_ms": round(isolated, 3),
            "rest_ms": round(whole - isolated, 3), "profiled_run_ms": round(profiled["profiled_run_ms"], 3),
            "in_place_ops_ms": round(in_place, 3),
            "outside_ops_ms": round(profiled["profiled_run_ms"] - in_place, 3),
            "input_output_layout_ms": round(profiled.get("input_output_layout_ms", 0.0), 3),
            "by_op_type_ms": {t: round(v, 3) for t, v in profiled["by_op_type_ms"].items()}}
        console.print(f"{name} {library_name}: whole {whole:.2f} ms, isolated tuned ops {isolated:.2f} ms, "
                      f"in place {', '.join(f'{t} {v:.2f}' for t, v in profiled['by_op_type_ms'].items())}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,mobilenetv2")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", default="benchmarks/results/where_time_goes.json")
    args = parser.parse_args()
    rows = [measure_model(name, args.runs) for name in args.models.split(",")]

    table = Table(title=f"where the time goes, library defaults, in place ({this_device().summary()})")
    for column in ("model", "library", "whole ms", "isolated tuned ops ms", "rest ms", "profiled run ms",
                   "in place, by op type (ms)", "outside ops ms"):
        table.add_column(column, justify="left" if column in ("model", "library", "in place, by op type (ms)")
                         else "right")
    for row in rows:
        for library, r in row["libraries"].items():
            kinds = ", ".join(f"{t} {v:.2f}" for t, v in sorted(r["by_op_type_ms"].items(), key=lambda kv: -kv[1]))
            table.add_row(row["model"], library, f"{r['whole_ms']:.2f}", f"{r['isolated_tuned_ops_ms']:.2f}",
                          f"{r['rest_ms']:+.2f}", f"{r['profiled_run_ms']:.2f}", kinds, f"{r['outside_ops_ms']:.2f}")
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": this_device().summary(), "runs": args.runs, "models": rows},
                                          indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
