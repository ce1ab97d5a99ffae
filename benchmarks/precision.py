"""Precision per op against the peers a user picks instead, per model: ONNX Runtime's fp32 default
and its static INT8, OpenVINO's default (bf16 on a CPU with AVX512_BF16 or AMX), OpenVINO in f32,
and OpenVINO INT8 (NNCF post-training quantization on the same calibration feeds); kselect's kept
plan at each ``--budgets`` cosine-drop (top-1 agreement for classifiers), tuned with
``--precision all`` for each of ``--tunes`` (``--library`` values separated by ";": by default
MLAS and oneDNN across libraries, and OpenVINO alone, whose per-op bf16 / f32 choice answers
its default's uniform bf16; records shared between the budgets, so only the first tune of each
measures kernels). The word ``openvino`` among the budgets adds OpenVINO default's own drop on the
model where that is looser than the tightest number: kselect is then compared with OpenVINO's
default at the accuracy OpenVINO's default gives up.

Every side is timed with the rounds protocol: alone in a fresh process per round, sides taking
turns (``kselect.core.whole_model.alone.timed_alone``); per-round speedups over ONNX Runtime's fp32
default with distribution-free bounds. Accuracy: each side's metric on the held-out feeds against
the fp32 model as ONNX Runtime runs it. Weights: bytes of the weight tensors as each side runs
them (OpenVINO's default converts f32 weights to bf16 when it compiles). Tune s: kselect's wall
time per tune.

The built-in zoo has no data: its calibration and held-out feeds are seeded random inputs, and the
table says SYNTHETIC. A real model (``kselect models``) is calibrated and checked on the pinned
sample pictures, preprocessed as its package does. Prints a table per model, writes JSON (models of
an earlier run on this device are kept unless run again; a results file of another device is
refused before measuring: each machine has its own ``--json`` and ``--markdown``).

Benchmark-only dependencies: ``pip install -e .[bench]`` (NNCF, pinned).

    .venv/bin/python benchmarks/precision.py --models resnet18,mobilenetv2
    .venv/bin/python benchmarks/precision.py --models yolov8n-nudenet-320 --budgets 0.0005,0.01
    .venv/bin/python benchmarks/precision.py --models resnet18 --budgets 0.0005,0.01,openvino --budget 1
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
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
from kselect.core.whole_model.alone import median_bounds, paired_speedups, side_figures, timed_alone
from model_names import tunable_model_names  # benchmarks/model_names.py: the script's folder is on sys.path
from results_file import earlier_results  # benchmarks/results_file.py

console = Console(width=None if sys.stdout.isatty() else 10_000)  # a pipe gets whole lines
OPENVINO = "kselect.plugins.openvino.baselines:runner"
COLUMNS = ("side", "precisions", "ms (median)", "speedup over ORT fp32", "per-round bounds", "metric", "drop",
           "weights MB", "tune s")


def weight_bytes(path: Path) -> int:
    """Bytes of an ONNX model's initializers as stored."""
    total = 0
    for tensor in onnx.load(str(path)).graph.initializer:
        total += (math.prod(tensor.dims) if tensor.dims else 1) * onnx.helper.tensor_dtype_to_np_dtype(
            tensor.data_type).itemsize
    return total


def nncf_int8(model, calibration: Calibration, path: Path) -> Path:
    """What a user of OpenVINO runs for INT8: NNCF's post-training quantization of the converted
    model on the calibration feeds (its defaults: mixed preset, 300 subset samples at most)."""
    from kselect.plugins.openvino.runtime import openvino

    ov = openvino()  # before nncf, which imports openvino
    import nncf

    ov_model = ov.convert_model(model.source if Path(model.source).is_file() else _saved(model, path.parent))
    ov_model.reshape({name: shape for name, shape in model.input_shapes.items()})
    quantized = nncf.quantize(ov_model, nncf.Dataset(calibration.calibrate), subset_size=len(calibration.calibrate))
    ov.save_model(quantized, str(path), compress_to_fp16=False)
    return path


def _saved(model, folder: Path) -> str:
    path = folder / f"{model.name}.onnx"
    onnx.save(model.proto, str(path))
    return str(path)


def in_process_outputs(candidate, model, feeds: list) -> list:
    """The outputs of a side on ``feeds``, built in this process as timed_alone builds it."""
    from kselect.core.plans.runtime import library_runner, load_plan
    from kselect.plugins.openvino.baselines import runner as openvino_runner

    if isinstance(candidate, str):
        runner = library_runner(plugins.get_library(candidate), model)
    elif isinstance(candidate, dict) and "factory" in candidate:
        runner = openvino_runner(model, **candidate.get("args", {}))
    elif isinstance(candidate, dict):
        runner = library_runner(plugins.get_library(candidate["library"]), load_model(candidate["model"]))
    else:
        runner = load_plan(candidate, model)
    try:
        return run_outputs(runner, feeds)
    finally:
        getattr(runner, "close", lambda: None)()


def run_model(name: str, args, settings: MeasureSettings, work: Path) -> dict:
    model = load_model(name)
    if model.source == "builtin":
        feeds = synthetic_feeds(model, args.calibration_feeds + args.held_out, seed=1)
        calibration = Calibration(feeds[:args.calibration_feeds], feeds[args.calibration_feeds:], "synthetic", True)
    else:
        calibration = calibration_for(model, "samples")
    reference = in_process_outputs("mlas", model, calibration.held_out)
    metric_name = args.metric or default_metric(reference)
    metric = get_metric(metric_name)
    fp32_score = metric(reference, reference, calibration.held_out)
    fp32_bytes = weight_bytes(Path(_saved(model, work)))

    ort_int8 = work / f"{name}.ort_int8.onnx"
    quantize_qdq(model.proto, ort_int8, calibration.calibrate, method=calibration.method)
    openvino_int8 = nncf_int8(model, calibration, work / f"{name}.nncf_int8.xml")
    candidates = {
        "ORT fp32 default": "mlas",
        "ORT static INT8 (quantize_static)": {"library": "mlas", "model": str(ort_int8)},
        "OpenVINO default": {"factory": OPENVINO, "args": {}},
        "OpenVINO f32 (INFERENCE_PRECISION_HINT=f32)": {"factory": OPENVINO,
                                                        "args": {"properties": {"INFERENCE_PRECISION_HINT": "f32"}}},
        "OpenVINO INT8 (NNCF PTQ)": {"factory": OPENVINO, "args": {"ir_path": str(openvino_int8)}},
    }
    from kselect.plugins.openvino.baselines import runner as openvino_runner
    default_precision = openvino_runner(model).inference_precision()
    sides = {
        "ORT fp32 default": {"precisions": "fp32", "weight_bytes": fp32_bytes},
        "ORT static INT8 (quantize_static)": {"precisions": "int8", "weight_bytes": weight_bytes(ort_int8)},
        "OpenVINO default": {"precisions": default_precision,
                             "weight_bytes": fp32_bytes // (2 if default_precision in ("bf16", "f16") else 1)},
        "OpenVINO f32 (INFERENCE_PRECISION_HINT=f32)": {"precisions": "f32", "weight_bytes": fp32_bytes},
        "OpenVINO INT8 (NNCF PTQ)": {"precisions": "int8", "weight_bytes": openvino_int8.with_suffix(".bin").stat().st_size},
    }
    for side, candidate in candidates.items():
        outputs = in_process_outputs(candidate, model, calibration.held_out)
        sides[side].update({"score": metric(outputs, reference, calibration.held_out), "tune_s": None})
        sides[side]["drop"] = fp32_score - sides[side]["score"]

    budgets = model_budgets(args.budgets, sides["OpenVINO default"]["drop"])
    for libraries, budget in ((libraries, budget) for libraries in args.tunes.split(";") for budget in budgets):
        start = time.perf_counter()
        config = kselect.TuneConfig(precision="all", calibration=calibration, metric=metric_name,
                                    max_accuracy_drop=budget, budget=args.budget, db=args.db, settings=settings,
                                    check_rounds=args.check_rounds)
        result = kselect.tune(model, libraries, config)
        side = f"kselect {libraries}, drop <= {budget}"
        plan = result.plan
        candidates[side] = plan
        reduced = {}
        for entry in plan.tasks:
            precision = entry.get("precision", "fp32")
            reduced[precision] = reduced.get(precision, 0) + len([n for n in entry["nodes"] if n in plan.nodes])
        outputs = in_process_outputs(plan, model, calibration.held_out)
        score = metric(outputs, reference, calibration.held_out)
        wbytes = _plan_weight_bytes(model, plan)
        sides[side] = {"precisions": ", ".join(f"{p} {n}" for p, n in sorted(reduced.items())), "tune": libraries,
                       "libraries": sorted(plan.libraries), "kept": result.kept, "score": score,
                       "drop": fp32_score - score, "weight_bytes": wbytes,
                       "tune_s": round(time.perf_counter() - start, 1),
                       "implementations": other_implementations(plan),
                       "precision_search": precision_search(plan)}

    timed = timed_alone(model, candidates, rounds=args.rounds, runs_per_process=args.runs)
    baseline = timed["ORT fp32 default"]["process_ms"]
    for side, figures in sides.items():
        figures.update(side_figures(baseline, timed[side]))
    return {"model": name, "command": command_line(),
            "tunes": args.tunes, "budgets": budgets, "configs_per_task": args.budget, "metric": metric_name,
            "synthetic": calibration.synthetic,
            "data": "SYNTHETIC random inputs" if calibration.synthetic else
            f"{calibration.source}" + (f", {calibration.caveat}" if calibration.caveat else ""),
            "held_out": len(calibration.held_out), "calibration_feeds": len(calibration.calibrate), "sides": sides}


def precision_search(plan) -> dict:
    """What the tune's budgeted search saw and why it kept what it kept: its front (each point's
    ops per precision, predicted and measured time, drop), the point chosen and the end-to-end
    check against the fp32 plan, without the per-op precisions and calibration ranges."""
    search = plan.extra.get("precision") or {}
    return {"chosen": search.get("chosen"), "check": search.get("check"),
            "front": [{k: v for k, v in point.items() if k != "precisions"} for point in search.get("front", [])]}


def to_6_places(drop: float, rounding=math.ceil) -> float:
    """``drop`` rounded to 6 places, up by default (``round`` first, so that 0.0045 stays 0.0045
    rather than becoming 0.004501 through 4500.000000000001)."""
    return rounding(round(drop * 1e6, 3)) / 1e6


def within(drop: float, budget: float) -> bool:
    """Whether a side that loses ``drop`` is within ``budget`` to 6 places: OpenVINO's default is
    within the budget of its own drop, however that budget was rounded (pages made before the
    budget was rounded up hold it rounded down: centerface's drop 0.0045193, budget 0.004519)."""
    return to_6_places(drop, math.floor) <= budget


def model_budgets(requested: list, openvino_drop: float) -> list[float]:
    """The accuracy budgets a model's plans are tuned under: the numbers asked for, and for the
    word ``openvino`` OpenVINO default's own drop on this model where it is looser than the
    tightest number and not one of them. That drop is rounded up to 6 places, so that OpenVINO's
    own uniform bf16 is within it and kselect may lose less than 1e-6 more."""
    numbers = [b for b in requested if b != "openvino"]
    own = to_6_places(openvino_drop)
    if "openvino" not in requested or own in numbers or own <= min(numbers, default=0.0):
        return numbers
    return sorted(numbers + [own])


def other_implementations(plan) -> dict[str, dict]:
    """Each planned node whose kernel is not its library's own pick for the op (an OpenVINO
    ``primitives_priority`` hint taken): node -> the chosen implementation, the library's own and
    the precision."""
    found = {}
    for entry in plan.tasks:
        chosen, own = entry["config"].get("impl"), (entry.get("default_config") or {}).get("impl")
        if chosen and own and chosen != own:
            for node in entry["nodes"]:
                if node in plan.nodes:
                    found[node] = {"library": entry["library"], "chosen": chosen, "own": own,
                                   "precision": entry["config"].get("precision")}
    return found


def _plan_weight_bytes(model, plan) -> int:
    from kselect.core.plans.plan import reduced_nodes
    from kselect.core.precision.mixed import weight_bytes as by_precision

    return by_precision(model, reduced_nodes(plan))


def row(side: str, f: dict) -> list[str]:
    if "failed" in f:
        return [side, f["precisions"], "failed: " + f["failed"], "", "", "", "", "", ""]
    return [side, f["precisions"], f"{f['ms']:.3f}", f"{f['speedup']:.3f}x", f"{f['bounds'][0]:.3f}-{f['bounds'][1]:.3f}",
            f"{f['score']:.4f}", f"{f['drop']:.4f}", f"{f['weight_bytes'] / 1e6:.2f}",
            "" if f["tune_s"] is None else f"{f['tune_s']:.0f}"]


def kselect_best(result: dict, budget: float) -> dict:
    """The fastest of kselect's kept plans (over the tunes) at ``budget``, with its side name."""
    sides = [(name, f) for name, f in result["sides"].items()
             if name.startswith("kselect ") and name.endswith(f", drop <= {budget}") and "speedup" in f]
    if not sides:
        return {}
    name, figures = max(sides, key=lambda item: item[1]["speedup"])
    return {"side": name, **figures}


def summary(results: list[dict], budgets: list) -> dict:
    """Per numeric budget, the geomean speedup over ORT fp32 of kselect's fastest kept plan per
    model; per model, whether its plan at the loosest budget no looser than OpenVINO default's own
    drop is at least as fast as OpenVINO's default: by the median of the per-round speedups of the
    one over the other (``versus``; both timed in the same rounds), with its bounds, not by the two
    sides' speedups over ONNX Runtime's default, which carry that default's noise as well."""
    out = {"geomean": {}, "against_openvino_default": {}}
    for budget in [b for b in budgets if b != "openvino"]:
        ratios = [kselect_best(r, budget).get("speedup") for r in results]
        if ratios and all(ratios):
            out["geomean"][str(budget)] = round(math.exp(sum(math.log(x) for x in ratios) / len(ratios)), 3)
    for r in results:
        openvino = r["sides"]["OpenVINO default"]
        tuned = _tuned_budgets(r, budgets)
        fair = max([b for b in tuned if b <= to_6_places(max(openvino.get("drop", 0.0), 0.0))] or [min(tuned)])
        best = kselect_best(r, fair)
        if best and "speedup" in openvino:
            paired = versus(openvino, best) if "process_ms" in openvino and "process_ms" in best else None
            out["against_openvino_default"][r["model"]] = {
                "budget": fair, "openvino_drop": round(openvino["drop"], 6), "kselect_side": best["side"],
                "kselect_drop": round(best["drop"], 6), "kselect_speedup": best["speedup"],
                "openvino_speedup": openvino["speedup"], "versus_openvino": paired,
                "as_fast": (paired["speedup"] if paired else best["speedup"] / openvino["speedup"]) >= 1.0}
    out["against_defaults"] = against_defaults(results, budgets)
    return out


def _as_fast(item: dict) -> str:
    paired = item.get("versus_openvino")
    if item["as_fast"]:
        return "yes"
    return "within bounds" if paired and not paired["shown_slower"] else "no"


def _tuned_budgets(result: dict, budgets: list) -> list[float]:
    """The budgets a model's run tuned under (a run before they were recorded: the numeric ones)."""
    return result.get("budgets") or [b for b in budgets if b != "openvino"]


def versus(peer: dict, side: dict) -> dict:
    """``side`` against ``peer`` timed in the same rounds: the median of the per-round speedups of
    side over peer with its bounds; shown slower when the upper bound is below 1."""
    low, median, high = median_bounds(paired_speedups(peer["process_ms"], side["process_ms"]))
    return {"speedup": round(median, 4), "bounds": [round(low, 4), round(high, 4)], "shown_slower": high < 1.0}


def against_defaults(results: list[dict], budgets: list) -> list[dict]:
    """Per model and budget, kselect's OpenVINO plan against OpenVINO's default, and its plan
    across every library (``--library all``) against the faster of ONNX Runtime's and OpenVINO's
    defaults; a default whose own drop exceeds the budget is not a peer at that budget."""
    rows = []
    for r in results:
        sides = r["sides"]
        for budget in _tuned_budgets(r, budgets):
            peers = [name for name in ("ORT fp32 default", "OpenVINO default")
                     if "process_ms" in sides.get(name, {}) and within(sides[name]["drop"], budget)]
            for tune, wanted in (("openvino", ["OpenVINO default"]), ("all", peers)):
                side = sides.get(f"kselect {tune}, drop <= {budget}", {})
                candidates = [name for name in wanted if name in peers]
                if "process_ms" not in side or not candidates:
                    continue
                peer = max(candidates, key=lambda name: sides[name]["speedup"])
                rows.append({"model": r["model"], "budget": budget, "kselect": f"--library {tune}", "peer": peer,
                             "kselect_drop": round(side["drop"], 6), "peer_drop": round(sides[peer]["drop"], 6),
                             **versus(sides[peer], side)})
    return rows


TITLE = "Precision per op: kselect against ONNX Runtime and OpenVINO"


def command_line() -> str:
    """This run's command as a shell reads it back (``--tunes 'mlas,onednn;openvino'`` quoted)."""
    return shlex.join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


NOTES = "## What the figures say"  # the page's hand-written reading of the tables, kept across runs


def write_markdown(document: dict, path: Path, command: str, title: str = TITLE) -> None:
    """The results page: how it was run, one table per model, the summary against the targets,
    then the page's own ``NOTES`` section as it stood (written by hand, not by this script). A page
    that exists keeps its own title (a machine's page, docs/precision-benchmark-xeon-amx.md, is
    named by hand too)."""
    notes = ""
    if path.is_file():
        page = path.read_text()
        if f"\n{NOTES}\n" in page:
            notes = NOTES + "\n" + page.split(f"\n{NOTES}\n", 1)[1]
        if page.startswith("# "):
            title = page.splitlines()[0].removeprefix("# ")
    lines = [f"# {title}", "",
             f"Each model's run is named under its heading (the last: `{command}`), on {document['device']} (libraries: "
             + ", ".join(f"{name} {version}" for name, version in document["libraries"].items())
             + f"; {document['openvino']}): per model, each side alone in a fresh process per round, "
             f"{document['rounds']} rounds taking turns, {document['runs_per_process']} timed runs per process; "
             "speedup = per-round median of ONNX Runtime's fp32 default / side, with distribution-free bounds. "
             "Accuracy: the metric on held-out feeds against the fp32 model as ONNX Runtime runs it (top-1 "
             "agreement for classifiers, else cosine). kselect's sides are the plans `kselect tune --precision all` "
             "keeps for that `--library` at that accuracy budget, after its own end-to-end checks. **The zoo has no "
             "data: its calibration and held-out feeds are SYNTHETIC (seeded random inputs).** Real models: the "
             "pinned sample pictures, preprocessed as their packages do (pictures, not the models' own data).", ""]
    for result in document["models"]:
        lines += [f"## {result['model']} ({result['metric']}; {result['data']}, {result['calibration_feeds']} "
                  f"calibrate, {result['held_out']} held out)", "",
                  *([f"Run: `{result['command']}`" + (f" ({result['configs_per_task']} config{'s' * (result['configs_per_task'] != 1)} measured per task)"
                                                       if "configs_per_task" in result else "") + ".", ""]
                    if "command" in result else []),
                  "| " + " | ".join(COLUMNS) + " |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(row(side, f)) + " |" for side, f in result["sides"].items()]
        lines.append("")
        for side, f in result["sides"].items():
            if f.get("implementations"):
                chosen = "; ".join(f"{node}: {i['chosen']} ({i['precision']}, own pick {i['own']})"
                                   for node, i in sorted(f["implementations"].items()))
                lines += [f"{side}: {len(f['implementations'])} nodes on another implementation than their library's "
                          f"own pick: {chosen}.", ""]
            elif "implementations" in f and "openvino" in f.get("libraries", ()):
                lines += [f"{side}: every node on OpenVINO's own pick of implementation for its precision (no "
                          "`primitives_priority` hint measured faster).", ""]
    summary_ = document.get("summary", {})
    lines += ["## Against the targets", "",
              "Geomean speedup over ONNX Runtime's fp32 default of kselect's fastest kept plan per model, per "
              "budget: " + ", ".join(f"drop <= {b}: {g}x" for b, g in summary_.get("geomean", {}).items()) + ".", "",
              "As fast: yes where the median of per-round speedups of kselect's plan over OpenVINO's default (the "
              "two timed in the same rounds) is at least 1; within bounds where it is below 1 and its upper bound "
              "is not; no where kselect's plan is shown slower.", "",
              "| model | OpenVINO default's drop | kselect at budget | kselect plan | its drop | kselect | OpenVINO default "
              "| kselect over OpenVINO default | bounds | as fast |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for model, item in summary_.get("against_openvino_default", {}).items():
        paired = item.get("versus_openvino")
        lines.append(f"| {model} | {item['openvino_drop']:.4f} | {item['budget']} | {item['kselect_side']} | "
                     f"{item.get('kselect_drop', 0):.4f} | {item['kselect_speedup']:.3f}x | "
                     f"{item['openvino_speedup']:.3f}x | "
                     + (f"{paired['speedup']:.3f}x | {paired['bounds'][0]:.3f}-{paired['bounds'][1]:.3f}" if paired else " | ")
                     + f" | {_as_fast(item)} |")
    lines.append("")
    versus_rows = summary_.get("against_defaults", [])
    if versus_rows:
        lines += ["kselect's OpenVINO plan against OpenVINO's default, and its plan across every library "
                  "(`--library all`, OpenVINO in it) against the faster of ONNX Runtime's and OpenVINO's "
                  "defaults within the same budget: the median of per-round speedups of kselect's side over "
                  "the peer, with bounds; shown slower when the upper bound is below 1.", "",
                  "| model | budget | kselect | peer | kselect drop | peer drop | speedup over peer | bounds | shown slower |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for item in versus_rows:
            lines.append(f"| {item['model']} | {item['budget']} | {item['kselect']} | {item['peer']} | "
                         f"{item['kselect_drop']:.4f} | {item['peer_drop']:.4f} | {item['speedup']:.3f}x | "
                         f"{item['bounds'][0]:.3f}-{item['bounds'][1]:.3f} | {'yes' if item['shown_slower'] else 'no'} |")
        lines.append("")
    path.write_text("\n".join(lines) + ("\n" + notes if notes else ""))


def main(defaults: dict | None = None, title: str = TITLE, description: str = __doc__) -> None:
    """``defaults``: argument defaults other than this script's (benchmarks/openvino.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,mobilenetv2,resnet50")
    parser.add_argument("--budgets", default="0.0005,0.01", help="metric drops kselect's plans are chosen under")
    parser.add_argument("--tunes", default="mlas,onednn;openvino",
                        help="kselect tunes, each a --library value, separated by ';' (each with --precision all)")
    parser.add_argument("--metric", default=None, help="default: top1 for classifiers, else cosine")
    parser.add_argument("--budget", type=int, default=4, help="configs measured per task")
    parser.add_argument("--min-time", type=float, default=0.05)
    parser.add_argument("--calibration-feeds", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check-rounds", type=int, default=4, help="kselect tune's end-to-end check rounds")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per process")
    parser.add_argument("--db", default="benchmarks/results/precision.db")
    parser.add_argument("--json", default="benchmarks/results/precision.json")
    parser.add_argument("--markdown", default="docs/precision-benchmark.md")
    parser.set_defaults(**(defaults or {}))
    args = parser.parse_args()
    tunable_model_names(args.models)  # one line and exit 2 before measuring, not a traceback later
    try:
        args.budgets = [b if b == "openvino" else float(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets: numbers or the word openvino, not {args.budgets!r}")
    settings = MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time)
    device = this_device()
    previous = earlier_results(args.json, args.markdown, device, args.models.split(","))
    earlier = previous["models"]
    earlier_libraries = previous.get("libraries", {})  # the models kept were tuned with these
    results = []
    header = {"device": device.summary(), "device_fingerprint": device.fingerprint,
              "libraries": {**earlier_libraries, **{lib.name: lib.version() for tune in args.tunes.split(";")
                                                    for lib in plugins.select_libraries(tune)}},
              "openvino": plugins.get_library("openvino").version(),
              "min_time_s": args.min_time, "rounds": args.rounds, "runs_per_process": args.runs}
    with tempfile.TemporaryDirectory(prefix="kselect-precision-") as work:
        for name in args.models.split(","):
            result = run_model(name, args, settings, Path(work))
            results.append(result)
            table = Table(title=f"{name}: {result['metric']} on {result['held_out']} held-out feeds ({result['data']}), "
                                f"{args.rounds} rounds, each side alone in fresh processes")
            for column in COLUMNS:
                table.add_column(column, justify="left" if column in ("side", "precisions") else "right")
            for side, figures in result["sides"].items():
                table.add_row(*row(side, figures))
            console.print(table)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            everything = earlier + results
            Path(args.json).write_text(json.dumps({**header, "models": everything,
                                                   "summary": summary(everything, args.budgets)}, indent=2) + "\n")
    document = json.loads(Path(args.json).read_text())
    write_markdown(document, Path(args.markdown), command_line(), title)
    console.print(f"summary: {json.dumps(summary(earlier + results, args.budgets))}; wrote {args.json} and "
                  f"{args.markdown}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
