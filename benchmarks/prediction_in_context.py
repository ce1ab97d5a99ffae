"""How well a tune predicts the whole-model time of the plans it races (core/whole_model/prediction.py,
core/whole_model/context.py), per model and per ``--library`` value.

Each tune runs as a user runs it (``kselect.tune`` with its end-to-end checks), so every plan it
times end to end, each alone in fresh processes with the rounds protocol (the libraries' plan
variants against their defaults, the precision front's points against the fp32 plan, the plans
across libraries against ONNX Runtime's default session), has a predicted and a measured time.
For front points whose costs were corrected in context, the prediction from the isolated sums
alone is given beside it (``isolated error``): what the correction changed, from the same run.

The zoo has no data: its calibration and held-out feeds are seeded random inputs. A real model
(``kselect models``) is calibrated on the pinned sample pictures.

    .venv/bin/python benchmarks/prediction_in_context.py --models pplcnet-doc-orientation,mobilenetv2
    .venv/bin/python benchmarks/prediction_in_context.py --models resnet18 --tunes "mlas;mlas,xnnpack"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import kselect
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.models.model import load_model
from kselect.core.precision.calibration import Calibration, calibration_for, synthetic_feeds
from model_names import tunable_model_names  # benchmarks/model_names.py: the script's folder is on sys.path

console = Console(width=None if sys.stdout.isatty() else 10_000)  # a pipe gets whole lines
WITHIN = 0.10


def calibration_of(model, feeds: int, held_out: int) -> Calibration:
    if model.source == "builtin":
        made = synthetic_feeds(model, feeds + held_out, seed=1)
        return Calibration(made[:feeds], made[feeds:], "synthetic", True)
    return calibration_for(model, "samples")


def share_within(errors: list[float]) -> float | None:
    return round(sum(abs(e) <= WITHIN for e in errors) / len(errors), 3) if errors else None


def largest(errors: list[float]) -> float | None:
    return round(max(errors, key=abs), 4) if errors else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="pplcnet-doc-orientation,mobilenetv2")
    parser.add_argument("--tunes", default="mlas;onednn;xnnpack",
                        help="kselect tunes, each a --library value, separated by ';'")
    parser.add_argument("--precision", default="fp32,int8")
    parser.add_argument("--max-accuracy-drop", type=float, default=0.01)
    parser.add_argument("--metric", default="cosine")
    parser.add_argument("--budget", type=int, default=2, help="configs measured per task")
    parser.add_argument("--min-time", type=float, default=0.05)
    parser.add_argument("--check-rounds", type=int, default=4)
    parser.add_argument("--calibration-feeds", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--db", default="benchmarks/results/prediction_in_context.db")
    parser.add_argument("--json", default="benchmarks/results/prediction_in_context.json")
    args = parser.parse_args()
    tunable_model_names(args.models)  # one line and exit 2 before measuring, not a traceback later
    settings = MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time)
    rows = []
    for name in args.models.split(","):
        model = load_model(name)
        calibration = calibration_of(model, args.calibration_feeds, args.held_out)
        for libraries in args.tunes.split(";"):
            start = time.perf_counter()
            config = kselect.TuneConfig(precision=args.precision, calibration=calibration, metric=args.metric,
                                        max_accuracy_drop=args.max_accuracy_drop, budget=args.budget, db=args.db,
                                        settings=settings, check_rounds=args.check_rounds)
            result = kselect.tune(model, libraries, config)
            tune_s = round(time.perf_counter() - start, 1)
            emulated = any(tuning.library.emulated for tuning in result.tunings.values())  # ACL under qemu
            for figure in result.predictions():
                rows.append({"model": name, "tune": libraries, "tune_s": tune_s, "emulated": emulated, **figure})
            console.print(f"{name} --library {libraries}: {len(result.predictions())} plans timed end to end, "
                          f"tune {tune_s:.0f} s, kept {result.kept}")
    table = Table(title=f"predicted against measured whole-model time ({this_device().summary()})")
    for column in ("model", "tune", "plan", "reference", "predicted ms", "measured ms", "error", "isolated error",
                   "predicted from"):
        table.add_column(column, justify="left" if column in ("model", "tune", "plan", "reference", "predicted from")
                         else "right")
    for row in rows:
        table.add_row(row["model"], row["tune"], f"{row['library']}: {row['plan']}"
                      + (" [EMULATED]" if row.get("emulated") else ""), row["reference"],
                      f"{row['predicted_ms']:.3f}", f"{row['measured_ms']:.3f}", f"{row['error']:+.1%}",
                      f"{row['isolated_error']:+.1%}" if "isolated_error" in row else "", row["summed_covers"])
    console.print(table)
    errors = [row["error"] for row in rows]
    in_context = [row for row in rows if "isolated_error" in row]
    summary = {"plans": len(rows), "share_within_10pct": share_within(errors), "largest_error": largest(errors),
               "corrected_in_context": {"plans": len(in_context),
                                        "share_within_10pct": share_within([r["error"] for r in in_context]),
                                        "largest_error": largest([r["error"] for r in in_context]),
                                        "isolated_share_within_10pct":
                                            share_within([r["isolated_error"] for r in in_context]),
                                        "isolated_largest_error": largest([r["isolated_error"] for r in in_context])}}
    console.print(f"summary: {json.dumps(summary)}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": this_device().summary(), "command": " ".join(sys.argv[1:]),
                                           "rows": rows, "summary": summary}, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
