"""Tune zoo models on ACL and compare the plan with ACL's defaults, whole model, in the runner's
engine. On a non-aarch64 host everything runs under qemu: every figure is EMULATED (labelled so
in the table and the JSON) and is not Arm performance.

Per model: ACL default and plan latency (kselect bench: interleaved, wall time around each call),
the same two measured inside the runner (``times_us``, no IPC), the sum of the isolated per-op
medians (default vs plan), tuning wall time, samples, and the tasks whose config changed.

    .venv/bin/python benchmarks/acl_zoo.py --models mobilenetv2 --size 64 --budget 6
    .venv/bin/python benchmarks/acl_zoo.py --models resnet18 --size 224 --budget 4 --min-repeats 3

``--size`` rebuilds the model with a smaller input (the zoo's global-average-pool heads make that
possible for every model but alexnet and vgg16); under emulation full-size models take seconds per
inference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import onnx
from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.cross_library.assembly import planned_conversions
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions, library_tasks, stored_outcomes, tune_tasks
from kselect.core.models.model import load_model
from kselect.core.models.zoo import INPUT_SHAPE, build_model
from kselect.core.plans.library_plan import verified_library_plan
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.bench import bench_in_process, random_feeds

console = Console()


def zoo_model(name: str, size: int, folder: Path):
    if size == INPUT_SHAPE[2]:
        return load_model(name)
    proto = build_model(name, 0)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = size
    del proto.graph.value_info[:]
    path = folder / f"{name}{size}.onnx"
    onnx.save(proto, path)
    return load_model(str(path))


def inside_runner_ms(runner, feeds, repeats: int) -> float:
    runner.run(feeds, warmup=1, min_repeats=repeats)
    return statistics.median(runner.last["times_us"]) / 1000.0


def run_model(name: str, size: int, library, db: RecordDB, options: TuneOptions, args, folder: Path) -> dict:
    device = this_device()
    model = zoo_model(name, size, folder)
    tasks = library_tasks(model, library)
    start = time.perf_counter()
    outcomes = tune_tasks(tasks, library, device, db, options)
    tune_s = time.perf_counter() - start
    records = stored_outcomes(tasks, library, device, db)
    # the tuned plan (layouts planned per op, permutes measured), without the end-to-end check:
    # under emulation that would run the model dozens of times
    plan = verified_library_plan(model, library, device, db, tasks, outcomes, verify=False, settings=options.settings)
    layouts = {}
    for entry in plan.nodes.values():
        layouts[entry["label"]] = layouts.get(entry["label"], 0) + 1
    default_runner, plan_runner = library.model_runner(model, None), library.model_runner(model, plan)
    try:
        result = bench_in_process(default_runner, plan_runner, model, rounds=args.rounds, runs_per_round=args.runs_per_round)
        feeds = random_feeds(model)
        inside = {"default_inside_ms": round(inside_runner_ms(default_runner, feeds, args.inside_repeats), 3),
                  "plan_inside_ms": round(inside_runner_ms(plan_runner, feeds, args.inside_repeats), 3)}
        engine = {"permutes": plan_runner.load_info["permutes"], "copies": plan_runner.load_info["copies"],
                  "schedules": plan_runner.load_info["schedules"]}
    finally:
        default_runner.close()
        plan_runner.close()
    changed = [t["id"] for t in plan.tasks if t["config"] != t["default_config"]]
    default_sum = sum(t["default_us"] * len(t["nodes"]) for t in plan.tasks if t["default_us"])
    plan_sum = sum(t["time_us"] * len(t["nodes"]) for t in plan.tasks if t["default_us"])
    return {"model": name, "input": [1, 3, size, size], "emulated": library.emulated, "tasks": len(tasks),
            "ops": sum(len(t.nodes) for t in tasks), "samples": sum(len(r) for r in records.values()),
            "measured_now": sum(o.measured_now for o in outcomes), "tune_s": round(tune_s, 1),
            "plan_level": plan.plan_level, "tasks_changed": changed, "layouts": layouts,
            "planned_permutes_ms": round(plan.extra["cross_library"]["predicted"]["conversions_us"] / 1000, 3),
            "planned_permutes": len(planned_conversions(plan)),
            "op_sum_default_ms": round(default_sum / 1000, 3), "op_sum_plan_ms": round(plan_sum / 1000, 3),
            "plan_configs": {t["id"]: t["config"] for t in plan.tasks}, **engine, **inside, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mobilenetv2")
    parser.add_argument("--size", type=int, default=64, help="input height and width (default 64; 224 = the zoo's own)")
    parser.add_argument("--budget", type=int, default=6)
    parser.add_argument("--search", default="random")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs-per-round", type=int, default=1)
    parser.add_argument("--inside-repeats", type=int, default=3)
    parser.add_argument("--db", default="benchmarks/results/acl_zoo.db")
    parser.add_argument("--json", default="benchmarks/results/acl_zoo.json")
    args = parser.parse_args()

    library = plugins.get_library("acl")
    label = " [EMULATED: qemu user-mode, not Arm performance]" if library.emulated else ""
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    db = RecordDB(args.db)
    settings = MeasureSettings(warmup=1, min_repeats=args.min_repeats, min_time_s=args.min_time,
                               max_time_s=15 * args.min_time, timeout_s=600)
    options = TuneOptions(args.search, args.budget, settings=settings)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            console.print(f"[bold]{name}[/] at {args.size}x{args.size}: tuning and benchmarking{label}")
            rows.append(run_model(name, args.size, library, db, options, args, Path(folder)))
            console.print({k: v for k, v in rows[-1].items() if k != "plan_configs"})

    table = Table(title=f"ACL: default vs plan, whole model ({library.version()}){label}")
    for column in ("model", "tasks", "default ms", "plan ms", "ratio", "in runner d/p", "op sum d/p", "tune s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(f"{r['model']}@{r['input'][2]}", str(r["tasks"]), f"{r['default_ms']:.1f}", f"{r['plan_ms']:.1f}",
                      f"{r['speedup']:.3f}", f"{r['default_inside_ms']:.0f}/{r['plan_inside_ms']:.0f}",
                      f"{r['op_sum_default_ms']:.0f}/{r['op_sum_plan_ms']:.0f}", f"{r['tune_s']:.0f}")
    console.print(table)
    Path(args.json).write_text(json.dumps({"emulated": library.emulated, "device": this_device().to_json(),
                                           "library": library.version(), "search": args.search, "budget": args.budget,
                                           "settings": vars(args), "models": rows}, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
