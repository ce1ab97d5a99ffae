"""Mixed precision against ONNX Runtime's fp32 default and its own static INT8, per model.

For each model and each of ``--libraries`` (MLAS, ONNX Runtime's kernels, by default; XNNPack
too): ``kselect.tune(..., precision="fp32,int8")`` at each ``--budgets`` drop (``ort``: the drop of
ONNX Runtime's static INT8 on that model, so the two compare at equal accuracy) (records shared, so
only the first tune measures), and what a user
would do instead: ``onnxruntime.quantization.quantize_static`` on the whole model (QDQ,
per-channel int8 weights, uint8 activations, the same calibration feeds and calibrator). Then
every side is timed with the rounds protocol: alone in a fresh process per round, sides taking
turns (``kselect.core.whole_model.alone.timed_alone``), per-round speedups over ONNX Runtime's fp32 default
session with their bounds. Accuracy is each side's metric on the held-out feeds against the
fp32 model (top-1 agreement for classifiers); weights are the bytes of the weight tensors as
each side stores them.

The built-in zoo has no data: its calibration and held-out feeds are seeded random inputs, and
the table says SYNTHETIC. A real model (``kselect models``) is calibrated and checked on
``--calibration`` (default ``samples``: the pinned sample pictures, preprocessed as its package
does; pictures, but not the model's own data, and the table says so). Prints a table, writes
JSON and markdown.

    .venv/bin/python benchmarks/mixed_precision.py --models resnet18,mobilenetv2,resnet50
    .venv/bin/python benchmarks/mixed_precision.py --models yolov8n-nudenet-320,pplcnet-doc-orientation
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import onnx
from rich.console import Console
from rich.table import Table

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.models.model import load_model
from kselect.core.precision.accuracy import default_metric, get_metric, run_outputs
from kselect.core.precision.calibration import Calibration, calibration_for, quantize_qdq, synthetic_feeds
from kselect.core.whole_model.alone import side_figures, timed_alone
from model_names import tunable_model_names  # benchmarks/model_names.py: the script's folder is on sys.path
from results_file import earlier_results  # benchmarks/results_file.py

console = Console(width=None if sys.stdout.isatty() else 10_000)  # a pipe gets whole lines
ORT_DROP = "ort"  # a budget: ONNX Runtime's static INT8's own drop on the model
COLUMNS = ("side", "int8 ops", "ms (median)", "speedup over ORT fp32", "per-round bounds", "metric", "drop",
           "weights MB", "tune s")


def ort_static_int8(model, calibration: Calibration, path: Path) -> Path:
    """What a user of ONNX Runtime would run instead: its static quantization of the whole model
    (quantize_static, QDQ, per-channel int8 weights, uint8 activations), calibrated afresh."""
    quantize_qdq(model.proto, path, calibration.calibrate, method=calibration.method)
    return path


def stored_weight_bytes(path: Path) -> int:
    """Bytes of the initializers as stored (int8 weights 1, int32 biases 4, floats 4)."""
    model = onnx.load(str(path))
    total = 0
    for tensor in model.graph.initializer:
        count = math.prod(tensor.dims) if tensor.dims else 1
        total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def run_model(name: str, budgets: list[float | str], args, settings: MeasureSettings, work: Path) -> dict:
    model = load_model(name)
    if model.source == "builtin":
        feeds = synthetic_feeds(model, args.calibration_feeds + args.held_out, seed=1)
        calibration = Calibration(feeds[:args.calibration_feeds], feeds[args.calibration_feeds:], "synthetic", True)
    else:
        calibration = calibration_for(model, args.calibration)
    library = plugins.get_library("mlas")
    reference = run_outputs(library.model_runner(model, None), calibration.held_out)
    metric_name = args.metric or default_metric(reference)
    metric = get_metric(metric_name)
    fp32_score = metric(reference, reference, calibration.held_out)

    int8_path = ort_static_int8(model, calibration, work / f"{name}.ort_int8.onnx")
    ort_int8 = load_model(str(int8_path))
    outputs = run_outputs(library.model_runner(ort_int8, None), calibration.held_out)
    ort_score = metric(outputs, reference, calibration.held_out)

    sides: dict[str, dict] = {}
    plans: dict[str, object] = {}
    for library_name in args.libraries.split(","):
        fp32_plan, mixed = None, {}
        for budget in budgets:
            start = time.perf_counter()
            # "ort": the drop of ONNX Runtime's own static INT8 on this model, to compare at equal accuracy
            drop = math.ceil((fp32_score - ort_score) * 1e6) / 1e6 if budget == ORT_DROP else budget
            config = kselect.TuneConfig(precision="fp32,int8", calibration=calibration, metric=metric_name,
                                        max_accuracy_drop=max(drop, 0.0), budget=args.budget, db=args.db,
                                        settings=settings, verify=args.verify)
            result = kselect.tune(model, library_name, config)
            search = result.tunings[library_name].precision
            fp32_plan = fp32_plan or search.plans["fp32"]
            kept = result.plan.extra["precision"]["chosen"]  # what kselect tune keeps, after its end-to-end check
            point = next(p for p in search.front if p.name == kept)
            side = f"kselect {library_name} mixed, drop <= " + (f"{drop:g} (ORT INT8's)" if budget == ORT_DROP else f"{budget}")
            mixed[side] = {"int8_ops": len(point.int8_nodes), "score": point.score, "drop": point.drop,
                           "weight_bytes": point.weight_bytes, "tune_s": round(time.perf_counter() - start, 1),
                           "front": [p.to_json() for p in search.front]}
            plans[side] = result.plan
        side = f"kselect {library_name} fp32 plan"
        sides[side] = {"int8_ops": 0, "score": fp32_score, "drop": 0.0, "weight_bytes": search.front[0].weight_bytes,
                       "tune_s": None}
        plans[side] = fp32_plan
        sides.update(mixed)

    sides = {"ORT fp32 default": {"int8_ops": 0, "score": fp32_score, "drop": 0.0,
                                  "weight_bytes": search.front[0].weight_bytes, "tune_s": None},
             "ORT static int8 (quantize_static)": {
                 "int8_ops": sum(n.op_type in ("Conv", "Gemm", "MatMul") for n in ort_int8.proto.graph.node),
                 "score": ort_score, "drop": fp32_score - ort_score, "weight_bytes": stored_weight_bytes(int8_path),
                 "tune_s": None}, **sides}

    candidates = {"ORT fp32 default": "mlas", "ORT static int8 (quantize_static)": {"library": "mlas",
                                                                                    "model": str(int8_path)}}
    unique = {}
    for side, plan in plans.items():  # budgets choosing the same plan are timed once
        key = json.dumps(plan.nodes, sort_keys=True)
        unique.setdefault(key, side)
        if unique[key] == side:
            candidates[side] = plan
    timed = timed_alone(model, candidates, rounds=args.rounds, runs_per_process=args.runs)
    baseline = timed["ORT fp32 default"]["process_ms"]
    for side, figures in sides.items():
        source = timed[unique.get(json.dumps(plans[side].nodes, sort_keys=True), side)] if side in plans else timed[side]
        figures.update(side_figures(baseline, source))
    return {"model": name, "metric": metric_name, "synthetic": calibration.synthetic,
            "data": _data(calibration), "held_out": len(calibration.held_out),
            "calibration_feeds": len(calibration.calibrate), "sides": sides}


def _data(calibration: Calibration) -> str:
    return "SYNTHETIC random inputs" if calibration.synthetic else (
        f"{calibration.source}" + (f", {calibration.caveat}" if calibration.caveat else ""))


def row(side: str, f: dict) -> list[str]:
    if "failed" in f:
        return [side, str(f["int8_ops"]), "failed: " + f["failed"], "", "", "", "", "", ""]
    return [side, str(f["int8_ops"]), f"{f['ms']:.3f}", f"{f['speedup']:.3f}x",
            f"{f['bounds'][0]:.3f}-{f['bounds'][1]:.3f}", f"{f['score']:.4f}", f"{f['drop']:.4f}",
            f"{f['weight_bytes'] / 1e6:.2f}", "" if f["tune_s"] is None else f"{f['tune_s']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,mobilenetv2,resnet50")
    parser.add_argument("--budgets", default="0.01,0.03,ort",
                        help="accuracy drops the mixed plans are chosen under; ort: ONNX Runtime's static INT8's drop on "
                             "the model (the issue's target: as fast as it at equal or better accuracy)")
    parser.add_argument("--libraries", default="mlas", help="libraries tuned, each in fp32 and int8 (mlas, xnnpack)")
    parser.add_argument("--metric", default=None, help="default: top1 for classifiers, else cosine")
    parser.add_argument("--budget", type=int, default=8, help="configs measured per task")
    parser.add_argument("--min-time", type=float, default=0.1)
    parser.add_argument("--calibration-feeds", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--calibration", default="samples",
                        help="a real model's data: a folder (as kselect tune --calibration), default the sample pictures")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=10, help="timed runs per process")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip each tune's end-to-end checks (the fp32 plan against the library default, the "
                             "front against the fp32 plan): faster, but the plans are not what kselect tune keeps")
    parser.add_argument("--db", default="benchmarks/results/mixed_precision.db")
    parser.add_argument("--json", default="benchmarks/results/mixed_precision.json")
    parser.add_argument("--markdown", default="docs/mixed-precision-benchmark.md")
    args = parser.parse_args()
    tunable_model_names(args.models)  # one line and exit 2 before measuring, not a traceback later
    settings = MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time)
    budgets = [ORT_DROP if b == ORT_DROP else float(b) for b in args.budgets.split(",")]
    device = this_device()
    results = []
    # models of an earlier run on this device, kept unless run again (one run per model)
    earlier = earlier_results(args.json, args.markdown, device, args.models.split(","))["models"]
    with tempfile.TemporaryDirectory(prefix="kselect-mixed-") as work:
        for name in args.models.split(","):
            result = run_model(name, budgets, args, settings, Path(work))
            results.append(result)
            table = Table(title=f"{name}: {result['metric']} on {result['held_out']} held-out feeds ({result['data']}), "
                                f"{args.rounds} rounds each side alone")
            for column in COLUMNS:
                table.add_column(column, justify="left" if column == "side" else "right")
            for side, figures in result["sides"].items():
                table.add_row(*row(side, figures))
            console.print(table)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            header = {"device": device.summary(), "device_fingerprint": device.fingerprint,
                      "onnxruntime": plugins.get_library("mlas").version(), "budget": args.budget,
                      "min_time_s": args.min_time, "rounds": args.rounds, "runs_per_process": args.runs}
            Path(args.json).write_text(json.dumps({**header, "models": earlier + results}, indent=2) + "\n")
    results = earlier + results
    geomean = {}
    zoo = [r for r in results if r.get("synthetic", True)]  # the target is over the zoo CNNs
    for budget in (b for b in budgets if b != ORT_DROP):  # ORT's drop differs per model
        for library in args.libraries.split(","):
            ratios = [r["sides"].get(f"kselect {library} mixed, drop <= {budget}", {}).get("speedup") for r in zoo]
            if ratios and all(ratios):
                geomean[f"{library}, drop <= {budget}"] = round(math.exp(sum(math.log(x) for x in ratios) / len(ratios)), 3)
    lines = ["# Mixed precision: kselect against ONNX Runtime fp32 and ONNX Runtime's static INT8", "",
             f"`benchmarks/mixed_precision.py` on {header['device']} ({header['onnxruntime']}): per model, each side "
             f"alone in a fresh process per round, {args.rounds} rounds taking turns, {args.runs} timed runs per "
             "process; speedup = per-round median of ORT fp32 default / side, with distribution-free bounds. "
             "Accuracy on held-out feeds against the fp32 model. **The zoo has no data: calibration and held-out "
             f"feeds are SYNTHETIC (seeded random inputs), {args.calibration_feeds} calibrate, {args.held_out} held "
             "out.** Real models: the data each section names.", ""]
    for result in results:
        lines += [f"## {result['model']} ({result['metric']}; {result.get('data', 'SYNTHETIC random inputs')}, "
                  f"{result['calibration_feeds']} calibrate, {result['held_out']} held out)", "",
                  "| " + " | ".join(COLUMNS) + " |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(row(side, f)) + " |" for side, f in result["sides"].items()]
        lines.append("")
    lines += ["Geomean speedup over ORT fp32 of the mixed plan on the zoo models, per budget: "
              + ", ".join(f"{b}: {g}x" for b, g in geomean.items()), ""]
    Path(args.markdown).write_text("\n".join(lines))
    console.print(f"geomean per budget: {geomean}; wrote {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
