"""Does a runner's whole-model latency depend on what else its process holds? ONNX Runtime's
default session timed two ways, alternating round by round so host noise hits both alike:
alone in a fresh process (core/whole_model/alone.timed_alone, how `kselect tune` checks plans)
and interleaved with XNNPack's default runner in this one process (core/whole_model/bench.interleaved).

    .venv/bin/python benchmarks/process_context.py [--models resnet50,googlenet] [--rounds 6]
        [--json benchmarks/results/process_context.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.models.model import load_model
from kselect.core.whole_model.alone import timed_alone
from kselect.core.whole_model.bench import interleaved, random_feeds

console = Console(width=160)


def measure_model(name: str, rounds: int) -> dict:
    model = load_model(name)
    shared = {"onnxruntime default": plugins.get_library("mlas").model_runner(model, None),
              "xnnpack default": plugins.get_library("xnnpack").model_runner(model, None)}
    feeds = random_feeds(model)
    alone_ms, shared_ms = [], []
    for _ in range(rounds):
        measured = timed_alone(model, {"onnxruntime default": "mlas"}, rounds=1)["onnxruntime default"]
        if measured["failed"]:
            raise RuntimeError(f"{name}: {measured['failed']}")
        alone_ms.append(statistics.median(measured["times"]))
        times = interleaved(shared, feeds, rounds=3, runs_per_round=3)
        shared_ms.append(statistics.median(times["onnxruntime default"]))
    for runner in shared.values():
        getattr(runner, "close", lambda: None)()
    ratios = sorted(round(s / a, 3) for s, a in zip(shared_ms, alone_ms))
    row = {"model": name, "alone_ms": [round(v, 3) for v in alone_ms], "shared_ms": [round(v, 3) for v in shared_ms],
           "median_alone_ms": round(statistics.median(alone_ms), 3),
           "median_shared_ms": round(statistics.median(shared_ms), 3), "shared_over_alone_per_round": ratios}
    console.print(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,googlenet")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default="benchmarks/results/process_context.json")
    args = parser.parse_args()
    rows = [measure_model(name, args.rounds) for name in args.models.split(",")]
    table = Table(title=f"ONNX Runtime default: alone in a fresh process vs sharing one with XNNPack's runner "
                        f"({this_device().summary()}; medians of per-round medians)")
    for column in ("model", "alone ms", "shared ms", "shared / alone", "per round"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(r["model"], f"{r['median_alone_ms']:.2f}", f"{r['median_shared_ms']:.2f}",
                      f"{r['median_shared_ms'] / r['median_alone_ms']:.3f}",
                      f"{r['shared_over_alone_per_round'][0]:.3f}-{r['shared_over_alone_per_round'][-1]:.3f}")
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": this_device().summary(), "rounds": args.rounds,
                                           "models": rows}, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
