"""The tuning flow, top-down, behind the calls the CLI, the benchmarks and Python users make::

    import kselect
    result = kselect.tune("resnet18", libraries="mlas", budget=8)
    result.plan.save("resnet18.mlas.plan.json")
    print(kselect.bench("resnet18", "resnet18.mlas.plan.json", alone=True)["per_round_speedup"])

``tune``: model -> tasks -> for each library: tune its tasks (core/measuring/tuning_loop.py), build its plan
variants and keep the one verified end to end against the library default (core/plans/library_plan.py)
-> with several libraries: plan per op across them, conversions counted (core/cross_library/plan.py), and
keep what is shown faster than ONNX Runtime's default session, each alone in fresh processes
(core/whole_model/selection.verified_across). Everything the flow learns on the way reaches ``events`` (a
``TuneEvents``), which is how the CLI draws its progress bars and tables; the result carries the
same figures for scripts.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.contract.space import config_key
from kselect.core.errors import KselectError, one_line
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import Reporter, TaskOutcome, TuneOptions
from kselect.core.models.model import Model, load_model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.plans.plan import Plan, int8_nodes
from kselect.core.records.fleet import DEFAULT_LEASE_S, FleetReport
from kselect.core.records.store import DEFAULT_DB, RecordDB

if TYPE_CHECKING:
    from kselect.core.precision.calibration import Calibration, ImagePreprocess
    from kselect.core.precision.mixed import PrecisionSearch


@dataclass
class LibraryTuning:
    """One library's part of a tune: its tasks, what tuning each found, the plan kept for it."""

    library: Library
    tasks: list[Task]
    outcomes: list[TaskOutcome]
    plan: Plan  # verified end to end against the library default, unless the tune ran with verify=False
    tune_s: float  # wall time of tuning and verifying
    precision: "PrecisionSearch | None" = None  # with int8: the front and the point chosen (core/precision/mixed.py)

    def to_json(self) -> dict:
        return {"library": self.library.name, "version": self.library.version(), "emulated": self.library.emulated,
                "tune_s": round(self.tune_s, 1), "samples": sum(o.samples for o in self.outcomes),
                "measured_now": sum(o.measured_now for o in self.outcomes),
                "kept": self.plan.extra.get("verified", {}).get("chosen"),
                **({"precision": {k: v for k, v in self.plan.extra.get("precision", {}).items() if k != "ranges"}}
                   if self.precision else {}),
                "tasks": [{"task": o.task.id, "key": o.task.key, "space_size": o.space_size, "samples": o.samples,
                           "failed": o.failed, "invalid": o.invalid, "default_config": o.default_config,
                           "default_us": o.default.median_us if o.default and o.default.status == "ok" else None,
                           "best_config": o.best_config, "best_us": o.best.median_us if o.best else None}
                          for o in self.outcomes]}


@dataclass
class TuneResult:
    """What ``tune`` returns: the plan to ship and the evidence it was chosen on."""

    model: Model
    device: Device
    plan: Plan | None  # the plan kept; None when another worker of the fleet finishes last and plans
    tunings: dict[str, LibraryTuning]  # library name -> its part
    cross_plan: Plan | None = None  # several libraries: the plan across them, before the end-to-end check
    checks: list[dict] = field(default_factory=list)  # several libraries: each plan's whole-model check
    fleet: FleetReport | None = None  # what this worker did among the tunes sharing the database
    left_out: dict[str, str] = field(default_factory=dict)  # several libraries: library -> why it has no plan

    @property
    def kept(self) -> str | None:
        return self.plan.extra.get("verified", {}).get("chosen", "tuned") if self.plan else None

    def to_json(self) -> dict:
        return {"model": self.model.name, "device": self.device.summary(), "kept": self.kept,
                "fleet": self.fleet.to_json() if self.fleet else None,
                "libraries": [tuning.to_json() for tuning in self.tunings.values()],
                "left_out": self.left_out,
                "cross_library": (self.cross_plan.extra.get("cross_library") if self.cross_plan else None),
                "checks": [{k: v for k, v in check.items() if k not in ("process_ms", "default_process_ms")}
                           for check in self.checks]}


class TuneEvents(Reporter):
    """What the flow tells a user interface while it runs; every method may be left out. The
    task-level calls (``task_started``, ``measured``, ``task_finished``) come from core/measuring/tuning_loop.py."""

    def working(self, text: str):
        """A context manager around a step with no progress of its own (a spinner in the CLI)."""
        return contextlib.nullcontext()

    def waiting_for_lock(self, holder: str) -> None:
        """Another process is measuring on this device; the tune waits for it."""

    def library_started(self, model: Model, library: Library, tasks: list[Task], options: TuneOptions,
                        device: Device, db: RecordDB) -> None: ...

    def whole_model_checked(self, library: Library, variant: str, result: dict) -> None:
        """One plan variant of ``library`` timed against its default on the whole model."""

    def library_tuned(self, tuning: LibraryTuning) -> None: ...

    def library_left_out(self, library: Library, why: str) -> None:
        """A tune of several libraries could not plan ``library`` (no valid config of some op):
        the others are planned without it."""

    def cross_planned(self, plan: Plan) -> None:
        """The plan across libraries, before its end-to-end check (``plan.extra["cross_library"]``)."""

    def cross_checked(self, chosen: Plan, results: list[dict]) -> None: ...

    def cross_int8_scored(self, variant: str, score: float | None, drop: float | None, max_drop: float,
                          failed: str = "") -> None:
        """A plan across libraries with int8 ops (``variant`` names it), its metric on the held-out
        feeds (``failed``: why it could not be made or run); it races only within ``max_drop``."""

    def precision_searched(self, library: Library, search: "PrecisionSearch", check: dict | None) -> None:
        """The latency / accuracy front of a tune with int8 (core/precision/mixed.py), the point kept, and
        ``check``: the chosen mixed plan timed against the fp32 plan end to end (None: not timed)."""


def tune(model: Model | str, libraries: str | list = "mlas", *, search: str = "xgb", budget: int = 16,
         time_budget_s: float | None = None, seed: int = 0, early_stop: int | None = None, storage: str | None = None,
         db: RecordDB | str | Path | None = None, settings: MeasureSettings | None = None, verify: bool = True,
         remeasure: bool = True, check_rounds: int = 4, check_max_rounds: int = 10,
         input_shape: list[str] | tuple = (), precision: str | tuple = ("fp32",), calibration=None,
         calibration_method: str = "minmax", max_accuracy_drop: float = 0.01, metric=None,
         image_preprocess: "ImagePreprocess | None" = None, lease_s: float = DEFAULT_LEASE_S,
         events: TuneEvents | None = None) -> TuneResult:
    """Tunes ``model`` (a Model, an ONNX file, a built-in or real model's name; ``input_shape`` as
    ``["name=1,3,224,224"]``) on ``libraries`` (a ``--library`` spec such as "mlas",
    "mlas,xnnpack" or "all", or a list of names or Library objects) and returns the plan kept.
    ``budget`` configs per task, ``time_budget_s`` for the whole tune; ``storage``: an Optuna RDB
    URL for ``search="tpe"``. Records go to ``db`` (default ~/.cache/kselect/records.db, or a
    ``postgresql://`` URL) as they are made, so the same call again resumes. Bad arguments raise
    ``KselectError`` before anything is measured.

    Tunes of the same model and options sharing ``db`` (devices of one kind on one PostgreSQL
    server) split its tasks (core/records/fleet.py): a task claimed by a worker that died is taken over
    once its lease of ``lease_s`` seconds runs out. The worker finishing last plans and returns
    the plan; the others return ``plan=None`` with what they did in ``fleet``.

    ``precision="fp32,int8"`` adds each op's int8 kernels (core/precision/quant.py) and chooses which ops run
    in int8 under ``max_accuracy_drop`` of ``metric`` (a name from core/precision/accuracy.py, or a callable
    ``evaluate(outputs, feeds) -> float``), measured on held-out feeds of ``calibration`` (a
    folder, "samples", or an iterable of feeds; the built-in zoo alone may go without: synthetic
    feeds; pictures become inputs as ``image_preprocess`` says, default the model's own:
    core/precision/calibration.image_preprocess) (core/precision/mixed.py); the plan stores the front, the metric and
    the budget."""
    from kselect.core.measuring.tuning_loop import library_tasks, tune_tasks
    from kselect.core.records.fleet import Fleet, tune_id

    events = events or TuneEvents()
    chosen = _libraries(libraries)
    searcher = plugins.get_searcher(search)
    if storage:
        searcher.check_options({"storage": storage})
    if not isinstance(model, Model):
        model = load_model(str(model), list(input_shape))
    extract_tasks(model)  # a model with nothing to tune is refused before the record database is opened
    int8 = _int8_request(model, chosen, precision, calibration, calibration_method, max_accuracy_drop, metric,
                         image_preprocess)
    device = this_device()
    db = db if isinstance(db, RecordDB) else RecordDB(db or DEFAULT_DB)
    settings = settings or MeasureSettings()
    work = []
    for library in chosen:
        searcher_options = {}
        if storage:  # one Optuna study per device, library build and task
            searcher_options = {"storage": storage,
                                "study_prefix": f"{device.fingerprint}-{library.name}-{library.version()}-"}
        options = TuneOptions(search, budget, time_budget_s, seed, early_stop, searcher_options, settings)
        work.append((library, library_tasks(model, library, ("fp32", "int8") if _int8_plans(library, int8) else ("fp32",)),
                     options))

    # Tasks first, shared with the other tunes of this model on the database (core/records/fleet.py); each
    # task is measured holding the device's measuring lock.
    lock = _MeasuringLock(device, events)
    library_task_pairs = [(lib, task) for lib, tasks, _ in work for task in tasks]
    fleet_tune = tune_id(device.fingerprint, [(lib.name, lib.version(), task.key) for lib, task in library_task_pairs],
                         {"search": search, "budget": budget, "seed": seed, "early_stop": early_stop})
    tuned = []
    # a read-only database can only be replayed from, alone
    fleet = None if db.read_only else Fleet(db, fleet_tune, [(lib.name, task.key) for lib, task in library_task_pairs],
                                            lease_s)
    with fleet or contextlib.nullcontext():
        for library, tasks, options in work:
            start = time.perf_counter()
            events.library_started(model, library, tasks, options, device, db)
            with contextlib.nullcontext() if fleet else lock():
                outcomes = tune_tasks(tasks, library, device, db, options, events, fleet=fleet, measuring=lock)
            tuned.append((library, tasks, outcomes, options, time.perf_counter() - start))
        if fleet and not fleet.finish():
            return TuneResult(model, device, None, {}, fleet=fleet.report)

    # The last worker of the tune plans, checks and keeps; every whole-model timing holds the lock.
    with lock():
        tunings, left_out = {}, {}
        for library, tasks, outcomes, options, tune_s in tuned:
            try:
                tunings[library.name] = plan_library(model, library, device, db, options, tasks, outcomes, tune_s,
                                                     verify, events, int8 if _int8_plans(library, int8) else None,
                                                     check_rounds, check_max_rounds)
            except KselectError as exc:  # with several libraries, one that cannot plan is left out
                if len(tuned) == 1:
                    raise
                last_error = exc
                left_out[library.name] = str(exc)
                events.library_left_out(library, str(exc))
        if not tunings:
            raise last_error
        result = TuneResult(model, device, next(iter(tunings.values())).plan, tunings,
                            fleet=fleet.report if fleet else None, left_out=left_out)
        if len(tunings) > 1:
            _plan_across(result, db, settings, verify, remeasure, check_rounds, check_max_rounds, events, int8)
    return result


def _cross_with_int8_ops(model: Model, cross: Plan, tunings: dict, int8: "Int8Request", events: TuneEvents,
                         plan_int8_per_op=None) -> list:
    """Race candidates with int8 ops across libraries, those whose metric on the held-out feeds
    stays within the budget: per library that chose int8 ops, the plan across libraries with them
    put in on that library (core/precision/mixed.py, ``with_int8_ops``) and, with ``plan_int8_per_op`` (the
    library's mixed plan -> plan), the plan across libraries made with its int8 ops free to run in int8 on any
    library that measured them, or in fp32, per op (core/cross_library/plan.py)."""
    from kselect.core.precision.mixed import score_plan, with_int8_ops

    candidates, made = [], []
    for name, tuning in tunings.items():
        search = tuning.precision
        if search is None or not int8_nodes(search.plan):
            continue
        options = [(f"cross-library plan with {name}'s int8 ops", lambda: with_int8_ops(cross, search.plan))]
        if plan_int8_per_op is not None:
            options.append((f"cross-library plan, int8 per op among {name}'s int8 ops",
                            lambda: plan_int8_per_op(search.plan)))
        for variant, make in options:
            try:
                combined = make()
            except Exception as exc:  # a plan that cannot be made or built is not raced
                events.cross_int8_scored(variant, None, None, int8.max_drop, one_line(exc))
                continue
            if combined is None or not int8_nodes(combined) or any(_same_ops(combined, other) for other in made):
                continue
            made.append(combined)
            with events.working(f"measuring the accuracy of the {variant}"):
                try:
                    score, drop = score_plan(model, combined, int8.calibration, int8.metric, search.metric_name)
                except Exception as exc:  # a combination a runner cannot build is not raced
                    events.cross_int8_scored(variant, None, None, int8.max_drop, one_line(exc))
                    continue
            events.cross_int8_scored(variant, score, drop, int8.max_drop)
            combined.extra["precision"]["cross_score"] = {"score": round(score, 6), "drop": round(drop, 6)}
            if drop <= int8.max_drop:
                candidates.append((variant, combined))
    return candidates


def _same_ops(a: Plan, b: Plan) -> bool:
    """Whether two plans run every node on the same library, task and config."""
    def ops(plan):
        return {node: (e["library"], e["task"], config_key(e["config"])) for node, e in plan.nodes.items()}
    return ops(a) == ops(b)


def _int8_plans(library: Library, int8: "Int8Request | None") -> bool:
    """Whether this tune gives ``library`` int8 ops: int8 asked for, and its plans can hold them."""
    return int8 is not None and "int8" in library.plan_precisions


class _MeasuringLock:
    """The device's measuring lock (core/measuring/lock.py) as a context manager factory, telling ``events``
    once that another process holds it."""

    def __init__(self, device: Device, events: "TuneEvents"):
        self.device, self.events, self.told = device, events, False

    def _waiting(self, holder: str) -> None:
        if not self.told:
            self.told = True
            self.events.waiting_for_lock(holder)

    def __call__(self):
        from kselect.core.measuring.lock import measuring_lock

        return measuring_lock(self.device.fingerprint, on_wait=self._waiting)


def _libraries(libraries) -> list[Library]:
    """The libraries of a ``--library`` spec, or of a list of names and Library objects (an
    object given is the one measured, registered or not)."""
    if isinstance(libraries, str):
        return plugins.select_libraries(libraries)
    given = {lib.name: lib for lib in libraries if isinstance(lib, Library)}
    if given and len(libraries) == 1:
        return list(given.values())
    chosen = plugins.select_libraries(",".join(lib if isinstance(lib, str) else lib.name for lib in libraries))
    return [given.get(lib.name, lib) for lib in chosen]


@dataclass
class Int8Request:
    calibration: "Calibration"
    metric: object  # core.precision.accuracy.Metric, or None: chosen from the model's outputs
    metric_name: str | None
    max_drop: float


def _int8_request(model: Model, libraries: list[Library], precision, calibration, method: str, max_drop: float,
                  metric, preprocess=None) -> Int8Request | None:
    """Refuses, before anything is measured, what an int8 tune cannot do; calibrates."""
    from kselect.core.precision.accuracy import get_metric, user_metric
    from kselect.core.precision.calibration import calibration_for, compute_ranges
    from kselect.core.precision.quant import PRECISIONS

    wanted = [p.strip() for p in precision.split(",")] if isinstance(precision, str) else list(precision)
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown or "fp32" not in wanted:
        raise KselectError(f"--precision {','.join(wanted)}: give fp32 or fp32,int8 (known: {', '.join(PRECISIONS)})")
    if "int8" not in wanted:
        if calibration is not None or preprocess is not None:
            raise KselectError("--calibration is for int8: add --precision fp32,int8")
        return None
    lacking = [lib for lib in libraries if "int8" not in lib.plan_precisions]
    if len(lacking) == len(libraries):  # with several libraries, those without int8 plans are tuned in fp32
        runs = ", ".join(n for n, lib in plugins.libraries().items() if "int8" in lib.plan_precisions)
        if "int8" in lacking[0].precisions:
            raise KselectError(f"{lacking[0].name} measures int8 kernels per op but its whole-model runner has no int8 "
                               f"path yet, so no int8 plan of it can be checked or shipped (int8 plans: {runs})")
        raise KselectError(f"{lacking[0].name} has no int8 kernels in kselect (int8 plans: {runs})")
    if not 0 <= max_drop < 1:
        raise KselectError(f"--max-accuracy-drop {max_drop}: give a drop between 0 and 1 (0.01: one point of top-1 "
                           f"agreement, or of cosine similarity)")
    if callable(metric):
        chosen_metric, name = user_metric(metric), getattr(metric, "__name__", "user metric")
    else:
        chosen_metric, name = (get_metric(metric), metric) if metric else (None, None)
    data = calibration_for(model, calibration, method, preprocess)
    compute_ranges(model, data)
    return Int8Request(data, chosen_metric, name, max_drop)


def plan_library(model: Model, library: Library, device: Device, db: RecordDB, options: TuneOptions,
                 tasks: list[Task], outcomes: list[TaskOutcome], tune_s: float, verify: bool = True,
                 events: TuneEvents | None = None, int8: Int8Request | None = None, check_rounds: int = 4,
                 check_max_rounds: int = 10) -> LibraryTuning:
    """Keeps one library's plan from its tuned tasks: the most tuned variant not slower than the
    library default end to end (``verify``), else the tuned one. With ``int8`` (the int8 twins
    among ``tasks``), the mixed-precision plan under the budget replaces it when it is shown
    faster end to end (``_choose_precision``)."""
    from kselect.core.plans.library_plan import verified_library_plan

    events = events or TuneEvents()
    start = time.perf_counter()
    fp32 = [(t, o) for t, o in zip(tasks, outcomes) if t.precision == "fp32"]
    with events.working(f"checking the {library.name} plan end to end against the library default"):
        plan = verified_library_plan(model, library, device, db, [t for t, _ in fp32], [o for _, o in fp32], verify,
                                     settings=options.settings,
                                     on_result=lambda name, result: events.whole_model_checked(library, name, result))
    search = None
    if int8:
        int8_tasks = [t for t in tasks if t.precision == "int8"]
        plan, search = _choose_precision(model, library, device, db, options.settings, plan, int8_tasks, int8,
                                         verify, check_rounds, check_max_rounds, events)
    tuning = LibraryTuning(library, tasks, outcomes, plan, tune_s + time.perf_counter() - start, search)
    events.library_tuned(tuning)
    return tuning


FRONT_POINTS_TIMED = 6


def points_to_time(front: list, chosen) -> list:
    """The front points timed end to end, at most FRONT_POINTS_TIMED: the fp32 plan, the point
    chosen on predicted latency, the other points within the budget (fastest predicted first),
    and full int8 for reference."""
    usable = [p for p in front if not p.failed]
    picked = [p for p in (front[0], chosen) if not p.failed]
    within = sorted((p for p in usable if p.within_budget and p not in picked), key=lambda p: p.predicted_us)
    picked += within[:max(0, FRONT_POINTS_TIMED - len(picked) - 1)]
    full = next((p for p in usable if p.name == "int8"), None)
    if full is not None and full not in picked:
        picked.append(full)
    return [p for p in front if p in picked]


def _choose_precision(model: Model, library: Library, device: Device, db: RecordDB, settings: MeasureSettings,
                      fp32_plan: Plan, int8_tasks: list[Task], int8: Int8Request, verify: bool, check_rounds: int,
                      check_max_rounds: int, events: TuneEvents):
    """The front under the budget (core/precision/mixed.py); with ``verify`` the points within the budget
    (``points_to_time``) are timed alone in fresh processes with the fp32 plan, rounds taking
    turns; the fastest measured one is kept when the race (core/whole_model/selection.race_verdict, the rule
    that replaces ONNX Runtime's default) shows it faster than the fp32 plan, rounds going on up
    to ``check_max_rounds`` while undecided; else the fp32 plan."""
    from kselect.core.precision.mixed import search_precision
    from kselect.core.whole_model.alone import family_confidence, median_bounds, paired_speedups, timed_alone
    from kselect.core.whole_model.selection import race_verdict

    with events.working(f"choosing which ops run in int8 ({int8.metric_name or 'metric'} drop <= {int8.max_drop}, "
                        f"{int8.calibration.describe()})"):
        search = search_precision(model, library, device, db, settings, fp32_plan, int8_tasks, int8.calibration,
                                  int8.metric, int8.metric_name, int8.max_drop)
    name = search.metric_name
    check = None
    chosen = search.plan
    if verify and any(p.within_budget and p.int8_nodes for p in search.front):
        within = {p.name for p in search.front if p.within_budget and p.int8_nodes}
        timed_points = points_to_time(search.front, search.chosen)
        # the fastest of the points timed within the budget races the fp32 plan: one comparison each
        comparisons = sum(p.name in within for p in timed_points)
        confidence = family_confidence(comparisons)

        def fastest(results: dict) -> str | None:
            times = {name: statistics.median(r["process_ms"]) for name, r in results.items()
                     if name in within and r["process_ms"] and not r["failed"]}
            return min(times, key=times.get) if times else None

        def undecided(results: dict) -> set:  # the race goes on while the fastest is neither shown faster nor not
            best = fastest(results)
            if best is None or results["fp32"]["failed"]:
                return set()
            speedups = paired_speedups(results["fp32"]["process_ms"], results[best]["process_ms"])
            return {"fp32", best} if race_verdict(speedups, comparisons=comparisons) == "undecided" else set()

        with events.working("timing the front end to end, each plan alone in fresh processes"):
            timed = timed_alone(model, {point.name: search.plans[point.name] for point in timed_points},
                                rounds=check_rounds, max_rounds=max(check_rounds, check_max_rounds), more=undecided)
        for point in search.front:
            if timed.get(point.name, {}).get("process_ms") and not timed[point.name]["failed"]:
                point.measured_ms = statistics.median(timed[point.name]["process_ms"])
        best = fastest(timed)
        if best is not None:  # the measured latency decides among the points within the budget
            search.chosen = next(p for p in search.front if p.name == best)
            search.plan = chosen = search.plans[best]
        if timed["fp32"]["failed"] or best is None:
            reason = timed["fp32"]["failed"] or "no point within the budget ran end to end"
            check = {"against": "fp32 plan", "failed": reason, "kept": "fp32"}
        else:
            speedups = paired_speedups(timed["fp32"]["process_ms"], timed[best]["process_ms"])
            low, median, high = median_bounds(speedups, confidence)
            verdict = race_verdict(speedups, comparisons=comparisons)
            check = {"against": "fp32 plan", "rounds": len(speedups), "per_round_speedup": round(median, 4),
                     "bounds": [round(low, 4), round(high, 4)], "confidence": round(confidence, 4),
                     "verdict": verdict,
                     "kept": best if verdict == "faster" else "fp32"}
        if check["kept"] == "fp32":
            chosen = search.plans["fp32"]
    front = [point.to_json() for point in search.front]
    for plan in {id(p): p for p in [chosen, *search.plans.values()]}.values():
        if "precision" in plan.extra or plan is chosen:
            plan.extra["precision"] = {**plan.extra.get("precision", {}), "metric": name, "max_drop": int8.max_drop,
                                       "calibration": int8.calibration.to_json(), "front": front,
                                       "chosen": check["kept"] if check else search.chosen.name,
                                       **({"check": check} if check else {})}
    events.precision_searched(library, search, check)
    return chosen, search


def _plan_across(result: TuneResult, db: RecordDB, settings: MeasureSettings, verify: bool, remeasure: bool,
                 check_rounds: int, check_max_rounds: int, events: TuneEvents, int8: "Int8Request | None" = None) -> None:
    """Per op across the tuned libraries, conversions counted; then ONNX Runtime's default
    session, each library's plan, the cross-library plan and (with int8) the cross-library plan
    with each library's int8 ops put in, when within the accuracy budget, each alone in fresh
    processes: what is shown faster than the default is kept, else ONNX Runtime's own
    configuration (when MLAS, its library, was tuned)."""
    from kselect.core.cross_library.plan import plan_across
    from kselect.core.plans.library_plan import onnxruntime_default_plan
    from kselect.core.plans.spinning import spinning_variants
    from kselect.core.whole_model.selection import verified_across

    model, device, tunings = result.model, result.device, result.tunings
    # per op across libraries in fp32; a library's mixed-precision plan (within the accuracy budget)
    # races as it is, beside the plan across them
    fp32_plans = {name: t.precision.plans["fp32"] if t.precision else t.plan for name, t in tunings.items()}
    doing = ("re-timing the configs and conversions the plan chooses among, then planning across libraries"
             if remeasure else "measuring layout conversions and library switches, planning across libraries")
    with events.working(doing):
        plan = plan_across(model, device, db, {name: t.library for name, t in tunings.items()}, fp32_plans, settings,
                           remeasure=remeasure)
    # as planned: the race below marks the plan it keeps, which may be this one
    result.cross_plan, result.plan = copy.deepcopy(plan), plan
    events.cross_planned(plan)
    if not verify:
        return
    candidates = [(f"{name} plan", t.plan) for name, t in tunings.items()] + spinning_variants(plan)
    if int8 is not None:
        # each library in its int8 plans' session-wide settings (which hold its fp32 ones): the
        # chosen point's when it runs int8 ops (its front may be the one at other settings, e.g.
        # per-tensor weights), else its first int8 point's
        def int8_settings_plan(tuning) -> Plan:
            search = tuning.precision
            if search is None:
                return fp32_plans[tuning.library.name]
            if int8_nodes(search.plan):
                return search.plan
            return next((p for point, p in search.plans.items() if point != "fp32"), fp32_plans[tuning.library.name])

        with_int8 = {name: int8_settings_plan(t) for name, t in tunings.items()}

        def plan_int8_per_op(mixed: Plan) -> Plan:
            with events.working("planning across libraries with int8 per op"):
                planned = plan_across(model, device, db, {name: t.library for name, t in tunings.items()}, with_int8,
                                      settings, remeasure=remeasure, int8_nodes=frozenset(int8_nodes(mixed)))
            planned.extra["precision"] = {**copy.deepcopy(mixed.extra["precision"]), "int8_from": "per op"}
            return planned

        candidates += _cross_with_int8_ops(model, plan, tunings, int8, events, plan_int8_per_op)
    fallback = onnxruntime_default_plan(model, device, db) if plugins.baseline_library().name in tunings else None
    with events.working("checking the plans end to end against ONNX Runtime's default session"):
        result.plan, result.checks = verified_across(model, candidates, rounds=check_rounds, fallback=fallback,
                                                     max_rounds=max(check_rounds, check_max_rounds))
    events.cross_checked(result.plan, result.checks)


def save(result: TuneResult, path: str | Path) -> list[Path]:
    """Writes the plan kept to ``path`` and, for a single-library plan, what its library needs
    beside it (``Library.apply``: an ONNX model for MLAS). Returns the files written besides the plan."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result.plan.save(path)
    if len(result.plan.libraries) > 1:
        return []
    tuning = result.tunings.get(result.plan.library)
    library = tuning.library if tuning else plugins.get_library(result.plan.library)
    return library.apply(result.plan, result.model, path.parent)


def checked_plan(plan: Plan | str | Path, model: Model, force: bool = False, on_warning=None) -> Plan:
    """A plan file (or Plan) checked against ``model`` and this device: made for another device
    or library build, it is refused unless ``force`` (then each problem goes to ``on_warning``)."""
    from kselect.core.plans.plan import check_plan, load_plan_file, validate_plan

    if not isinstance(plan, Plan):
        plan = load_plan_file(plan)
    versions = {}
    for name in plan.libraries:
        library = plugins.libraries().get(name)
        if library is not None and library.availability()[0]:
            versions[name] = library.version()
    for problem in check_plan(plan, model, this_device(), versions, force=force):
        if on_warning:
            on_warning(problem)
    validate_plan(plan, model, this_device())
    return plan


def bench(model: Model | str, plan: Plan | str | Path, *, alone: bool = False, rounds: int = 10,
          runs_per_round: int = 5, force: bool = False, input_shape: list[str] | tuple = (),
          on_warning=None) -> dict:
    """Times the whole model with ``plan`` against its baseline (the library default; ONNX
    Runtime's default session for a plan mixing libraries). ``alone``: each side alone in fresh
    processes, rounds taking turns, with per-round speedups and their bounds (the protocol whole-
    model results are decided with); otherwise interleaved in this process. Returns the figures,
    the largest output error against the baseline included."""
    from kselect.core.plans.runtime import load_plan
    from kselect.core.whole_model.alone import bench_alone
    from kselect.core.whole_model.bench import bench_in_process, fresh_runners

    if not isinstance(model, Model):
        model = load_model(str(model), list(input_shape))
    plan = checked_plan(plan, model, force, on_warning)
    library = plugins.baseline_library() if plan.cross_library else plugins.get_library(plan.library)
    baseline = "onnxruntime default" if plan.cross_library else f"{library.name} default"
    if alone:
        result = bench_alone(model, library.name, plan, rounds, runs_per_round)
    else:
        default_runners = fresh_runners(library, model, None)
        plan_runners = [load_plan(plan, model)] if plan.cross_library else fresh_runners(library, model, plan)
        result = bench_in_process(default_runners, plan_runners, model, rounds, runs_per_round)
    return {"model": model.name, "library": "+".join(plan.libraries), "library_versions": plan.libraries,
            "baseline": baseline, "emulated": plan.emulated, "device": this_device().summary(), "alone": alone,
            **result}


def check_plan_path(path: Path) -> Path:
    """Refuses a plan path that cannot be written, before anything is measured."""
    from kselect.core.paths import check_can_create

    path = Path(path)
    if path.is_dir():
        raise KselectError(f"-o {path} is a directory, not a plan file")
    check_can_create(path, "the plan to")
    return path
