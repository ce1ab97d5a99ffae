"""The ``kselect`` command."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from kselect.core.errors import KselectError

console = Console()
err_console = Console(stderr=True)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an ONNX file or a built-in model name (see `kselect models`)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                        help="resolve a dynamic input's dims (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kselect", description="Select the best native kernel configuration per op by measuring on this device.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("models", help="list the built-in models with parameters and MACs")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("tasks", help="list a model's tuning tasks")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("space", help="show a task's configuration space for a library")
    _add_model_args(p)
    p.add_argument("--library", required=True)
    p.add_argument("--task", help="task id (default: every task, summarised)")

    p = commands.add_parser("plugins", help="list plugins with version and status")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = commands.add_parser("tune", help="measure configurations per task and write a plan")
    _add_model_args(p)
    p.add_argument("--library", required=True,
                   help="a library, several joined by commas (planned per op across them), or all")
    p.add_argument("--search", default="xgb", help="search backend: xgb (default), tpe, random, exhaustive, or a plugin's")
    p.add_argument("--budget", type=int, default=16, help="configs measured per task, the default included (default 16)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help="stop measuring after this long")
    p.add_argument("--db", default=None, help="record database (default ~/.cache/kselect/records.db, or $KSELECT_DB)")
    p.add_argument("-o", "--output", default=None, help="plan file (default MODEL.LIBRARY.plan.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-stop", type=int, metavar="N", help="stop a task after N samples without improvement")
    p.add_argument("--storage", help="search-backend storage URL (tpe: an Optuna storage, e.g. sqlite:///optuna.db)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a candidate may take before it is killed")
    p.add_argument("--min-time", type=float, default=0.1, help="minimum measured seconds per candidate instance")
    p.add_argument("--min-repeats", type=int, default=10, help="minimum timed runs per candidate instance")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the end-to-end check that falls back to a simpler plan when the tuned one is slower")
    p.add_argument("--no-remeasure", dest="remeasure", action="store_false",
                   help="with several libraries: plan on the stored records as they are, without first re-timing "
                        "the configs and conversions the plan chooses among")
    p.add_argument("--check-rounds", type=int, default=4, metavar="N",
                   help="with several libraries: rounds of the end-to-end check before a verdict (default 4)")
    p.add_argument("--check-max-rounds", type=int, default=10, metavar="N",
                   help="with several libraries: rounds a plan still undecided may run, at most (default 10)")

    p = commands.add_parser("predict", help="per-op latency predicted by the cost model, without measuring")
    _add_model_args(p)
    p.add_argument("--library", required=True)
    p.add_argument("--db", default=None, help="record database the cost model learns from")
    p.add_argument("--json", dest="json_out", metavar="OUT.json", help="also write the prediction as JSON")
    p.add_argument("--seed", type=int, default=0)

    p = commands.add_parser("plan", help="show or apply a plan")
    plan_commands = p.add_subparsers(dest="plan_command", required=True, metavar="ACTION")
    q = plan_commands.add_parser("show", help="the plan as a table")
    q.add_argument("plan")
    q = plan_commands.add_parser("apply", help="write the deployable artifacts of a plan")
    q.add_argument("plan")
    _add_model_args(q)
    q.add_argument("-o", "--output-dir", default=".")
    q.add_argument("--force", action="store_true", help="apply a plan made for another device or library build")

    p = commands.add_parser("bench", help="whole-model latency: library default vs plan, interleaved")
    _add_model_args(p)
    p.add_argument("--plan", required=True)
    p.add_argument("--json", dest="json_out", metavar="OUT.json", help="also write the results as JSON")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--runs-per-round", type=int, default=5)
    p.add_argument("--alone", action="store_true",
                   help="time each side alone in a fresh process per round, as an app runs it (as the cross-library "
                        "check does); --rounds processes per side, at least --runs-per-round runs each")
    p.add_argument("--force", action="store_true", help="run a plan made for another device or library build")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kselect.cli import commands

    handler = getattr(commands, "cmd_" + args.command + (f"_{args.plan_command}" if args.command == "plan" else ""))
    try:
        return handler(args) or 0
    except KselectError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]: every finished measurement is stored; run the same command to resume")
        return 130
    except Exception as exc:  # a bug: one line by default, the traceback with KSELECT_DEBUG=1
        if os.environ.get("KSELECT_DEBUG"):
            raise
        err_console.print(f"[bold red]internal error:[/] {type(exc).__name__}: {exc} (KSELECT_DEBUG=1 shows the traceback)",
                          highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
