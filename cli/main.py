"""The ``kselect`` command."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import warnings

from kselect.cli.output import err_console, styled
from kselect.core.errors import KselectError, KselectNote, KselectWarning


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option told in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        err_console.print(styled(("error:", "bold red"), f" {self.prog}: {message} (see {self.prog} --help)"),
                          highlight=False, soft_wrap=True)
        sys.exit(2)


def _number(kind, low, inclusive: bool):
    """An argparse type: ``kind`` (int or float) above ``low`` (at least it, with ``inclusive``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'at least' if inclusive else 'above'} {low}")
        return value
    return parse


POSITIVE_INT = _number(int, 1, True)
POSITIVE_FLOAT = _number(float, 0.0, False)


def _fraction(text: str) -> float:
    value = _number(float, 0.0, True)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be below 1 (0.01: one point of top-1 agreement)")
    return value


def _scale(text: str) -> float:
    """A positive number, or a fraction such as 1/255."""
    top, _, bottom = text.partition("/")
    try:
        value = float(top) / float(bottom) if bottom else float(top)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a fraction such as 1/255") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def _per_channel(text: str) -> tuple[float, ...]:
    """One number per channel: 0.485,0.456,0.406 (or one, for grayscale)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not numbers such as 0.485,0.456,0.406") from None
    if len(values) not in (1, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give one number per channel (three, or one for GRAY)")
    return values


def _storage_url(text: str) -> str:
    """An Optuna (SQLAlchemy) storage URL: a scheme SQLAlchemy knows, then ``://``."""
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme.split("+", 1)[0] not in ("sqlite", "postgresql", "mysql", "oracle", "mssql"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a database URL (e.g. sqlite:///optuna.db)")
    return text


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an ONNX file or a built-in model name (see `kselect models`)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                        help="resolve a dynamic input's dims (repeatable)")


def _add_json_file_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json`` alone (or ``--json -``) prints JSON instead of the table; ``--json OUT.json`` writes it beside the
    table, as before (``make demo`` does). Put a bare ``--json`` after the model: it would take the model as OUT.json."""
    parser.add_argument("--json", nargs="?", const="-", metavar="OUT.json",
                        help=f"print {what} as JSON instead of the table (bare --json, or -), or write the "
                             "JSON to OUT.json as well as showing the table")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kselect", description="Select the best native kernel configuration per op by measuring on this device.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("models", help="list the built-in models with parameters and MACs")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("tasks", help="list a model's tuning tasks")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("space", help="show a task's configuration space for a library")
    _add_model_args(p)
    p.add_argument("--library", required=True)
    p.add_argument("--task", help="task id, or its twin at a reduced precision (T02.int8, T02.bf16); default: every task, summarised")
    p.add_argument("--json", action="store_true", help="print JSON (with --task: every valid config)")

    p = commands.add_parser("plugins", help="list plugins with version and status")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("tune", help="measure configurations per task and write a plan")
    _add_model_args(p)
    p.add_argument("--library", required=True,
                   help="a library, several joined by commas (planned per op across them), or all")
    p.add_argument("--search", default="xgb", help="search backend: xgb (default), tpe, random, exhaustive, or a plugin's")
    p.add_argument("--budget", type=POSITIVE_INT, default=16, help="configs measured per task, the default included (default 16)")
    p.add_argument("--time-budget", type=POSITIVE_FLOAT, metavar="SECONDS", help="stop measuring after this long")
    p.add_argument("--db", default=None, help="record database: a file (default ~/.cache/kselect/records.db, or "
                   "$KSELECT_DB) or a postgresql:// URL shared by several devices, which then split the tasks")
    p.add_argument("-o", "--output", default=None, help="plan file (default MODEL.LIBRARY.plan.json)")
    p.add_argument("--lease", type=POSITIVE_FLOAT, default=60.0, metavar="SECONDS",
                   help="tunes sharing --db: a task claimed by a worker that stopped renewing it is taken over after "
                        "this long (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress goes to stderr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-stop", type=POSITIVE_INT, metavar="N", help="stop a task after N samples without improvement")
    p.add_argument("--storage", type=_storage_url,
                   help="search-backend storage URL (tpe: an Optuna storage, e.g. sqlite:///optuna.db)")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, default=120.0, help="seconds a candidate may take before it is killed")
    p.add_argument("--min-time", type=POSITIVE_FLOAT, default=0.1, help="minimum measured seconds per candidate instance")
    p.add_argument("--min-repeats", type=POSITIVE_INT, default=10, help="minimum timed runs per candidate instance")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the end-to-end check that falls back to a simpler plan when the tuned one is slower")
    p.add_argument("--no-remeasure", dest="remeasure", action="store_false",
                   help="with several libraries: plan on the stored records as they are, without first re-timing "
                        "the configs and conversions the plan chooses among")
    p.add_argument("--check-rounds", type=POSITIVE_INT, default=4, metavar="N",
                   help="with several libraries or reduced precisions: rounds of the end-to-end check before a verdict (default 4)")
    p.add_argument("--check-max-rounds", type=POSITIVE_INT, default=10, metavar="N",
                   help="with several libraries or reduced precisions: rounds a plan still undecided may run, at most (default 10)")
    p.add_argument("--precision", default="fp32", metavar="LIST",
                   help="precisions per op: fp32 (default), or fp32 with any of int8, bf16, fp16 (e.g. fp32,bf16,int8), "
                        "or all: each op's precision chosen under --max-accuracy-drop")
    p.add_argument("--calibration", metavar="FOLDER",
                   help="reduced precisions: a folder of .npz/.npy feeds or images (docs/mixed-precision.md); half calibrate, half "
                        "are held out to measure accuracy. 'samples': for a real model, pinned sample pictures "
                        "preprocessed as its package does (not its own data). The built-in zoo may go without: "
                        "synthetic feeds")
    p.add_argument("--calibration-method", default="minmax", choices=("minmax", "percentile", "entropy"),
                   help="int8: onnxruntime.quantization's calibrator (default minmax)")
    p.add_argument("--image-channels", choices=("RGB", "BGR", "GRAY"), default=None,
                   help="int8, pictures: the channel order the model takes, or GRAY for one channel (default: a real "
                        "model's package's, else RGB, or GRAY for a one-channel input)")
    p.add_argument("--image-scale", type=_scale, default=None, metavar="X",
                   help="int8, pictures: each 0..255 value times X, e.g. 1/255 (default: a real model's package's, "
                        "else 1/255)")
    p.add_argument("--image-mean", type=_per_channel, default=None, metavar="A,B,C",
                   help="int8, pictures: subtracted per channel after the scale, in --image-channels order "
                        "(default: a real model's package's, else ImageNet's 0.485,0.456,0.406; GRAY: 0)")
    p.add_argument("--image-std", type=_per_channel, default=None, metavar="A,B,C",
                   help="int8, pictures: divided per channel after the mean (default: a real model's package's, "
                        "else ImageNet's 0.229,0.224,0.225; GRAY: 1)")
    p.add_argument("--max-accuracy-drop", type=_fraction, default=0.01, metavar="X",
                   help="reduced precisions: largest drop of the metric from the fp32 model's (default 0.01)")
    p.add_argument("--metric", default=None,
                   help="reduced precisions: top1, top5, cosine, sqnr or a plugin's (default: top1 for a classifier, else cosine)")

    p = commands.add_parser("predict", help="per-op latency predicted by the cost model, without measuring")
    _add_model_args(p)
    p.add_argument("--library", required=True)
    p.add_argument("--db", default=None, help="record database the cost model learns from")
    _add_json_file_arg(p, "the prediction")
    p.add_argument("--seed", type=int, default=0)

    p = commands.add_parser("plan", help="show or apply a plan")
    plan_commands = p.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    q = plan_commands.add_parser("show", help="the plan as a table")
    q.add_argument("plan")
    q.add_argument("--json", action="store_true", help="print JSON")
    q = plan_commands.add_parser("apply", help="write the deployable artifacts of a plan")
    q.add_argument("plan")
    _add_model_args(q)
    q.add_argument("-o", "--output-dir", default=".")
    q.add_argument("--force", action="store_true", help="apply a plan made for another device or library build")
    q.add_argument("--json", action="store_true", help="print the files written as JSON")

    p = commands.add_parser("bench", help="whole-model latency: library default vs plan, interleaved")
    _add_model_args(p)
    p.add_argument("--plan", required=True)
    _add_json_file_arg(p, "the results")
    p.add_argument("--rounds", type=POSITIVE_INT, default=10)
    p.add_argument("--runs-per-round", type=POSITIVE_INT, default=5)
    p.add_argument("--alone", action="store_true",
                   help="time each side alone in a fresh process per round, as an app runs it (as the cross-library "
                        "check does); --rounds processes per side, at least --runs-per-round runs each")
    p.add_argument("--force", action="store_true", help="run a plan made for another device or library build")

    p = commands.add_parser("report", help="one self-contained HTML page about a plan: per-op choices, where the "
                                           "time goes, tuning curves, the whole-model check")
    p.add_argument("plan", help="a plan file (kselect tune -o)")
    p.add_argument("--db", default=None, help="record database the plan was tuned with, for the tuning curves: a "
                                              "file (default ~/.cache/kselect/records.db, or $KSELECT_DB) or a "
                                              "postgresql:// URL")
    p.add_argument("-o", "--output", default=None, help="HTML file (default: beside the plan, NAME.report.html)")
    p.add_argument("--model", default=None, help="the plan's model (ONNX file or name): checked against the plan, "
                                                 "and the page names each node's ONNX op")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                   help="with --model: resolve a dynamic input's dims (repeatable)")
    p.add_argument("--json", action="store_true", help="print {report, charts} as JSON")
    return parser


class Terminated(BaseException):
    """SIGTERM, handled as Ctrl-C is: every finished measurement is already stored."""


def _terminate(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    shown_before = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return _run(args)
    finally:
        warnings.showwarning = shown_before
        if previous is signal.SIG_DFL:  # a caller embedding main() gets SIGTERM back as it had it
            signal.signal(signal.SIGTERM, previous)


_python_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """kselect's own warnings (a bad record row passed over) as one line on stderr, its notes (a
    static dim overridden) as one line with the command's output."""
    if issubclass(category, KselectNote):
        from kselect.cli import commands  # imported by _run already; here for the warning hook

        commands.console.print(styled(("note:", "cyan"), f" {message}"), highlight=False, soft_wrap=True)
    elif issubclass(category, KselectWarning):
        err_console.print(styled(("warning:", "yellow"), f" {message}"), highlight=False, soft_wrap=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


def _after_a_stop(args) -> str:
    """What a stopped command leaves: a tune resumes from its stored records; the others start over."""
    if args.command == "tune":
        return ": every finished measurement is stored; run the same command to resume"
    return f": kselect {args.command} stopped before it finished; run it again to start over"


def _run(args) -> int:
    # here, not at the top: the commands import onnx, onnxruntime and every plugin, which
    # `kselect --help` and a bad option's one-line error do not need (0.07 s instead of 0.22 s)
    from kselect.cli import commands

    handler = getattr(commands, "cmd_" + args.command + (f"_{args.plan_command}" if args.command == "plan" else ""))
    try:
        with commands.json_output(args):  # under --json, stdout holds the JSON document alone
            return handler(args) or 0
    except KselectError as exc:
        err_console.print(styled(("error:", "bold red"), f" {exc}"), highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print(styled(("interrupted", "yellow"), _after_a_stop(args)))
        return 130
    except Terminated:
        err_console.print(styled(("terminated (SIGTERM)", "yellow"), _after_a_stop(args)))
        return 143
    except Exception as exc:  # a bug: one line by default, the traceback with KSELECT_DEBUG=1
        if os.environ.get("KSELECT_DEBUG"):
            raise
        err_console.print(styled(("internal error:", "bold red"), f" {type(exc).__name__}: {exc} (KSELECT_DEBUG=1 shows "
                                 "the traceback)"), highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
