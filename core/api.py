"""The tuning flow, top-down, behind the calls the CLI, the benchmarks and Python users make::

    import kselect
    result = kselect.tune("resnet18", libraries="mlas", budget=8)
    result.plan.save("resnet18.mlas.plan.json")
    print(kselect.bench("resnet18", "resnet18.mlas.plan.json", alone=True)["per_round_speedup"])

``tune``: model -> tasks -> for each library: tune its tasks (core/tune.py), build its plan
variants and keep the one verified end to end against the library default (core/library_plan.py)
-> with several libraries: plan per op across them, conversions counted (core/crossplan.py), and
keep what is shown faster than ONNX Runtime's default session, each alone in fresh processes
(core/selection.verified_across). Everything the flow learns on the way reaches ``events`` (a
``TuneEvents``), which is how the CLI draws its progress bars and tables; the result carries the
same figures for scripts.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from kselect.core import plugins
from kselect.core.device import Device, this_device
from kselect.core.errors import KselectError
from kselect.core.library import Library
from kselect.core.measure import MeasureSettings
from kselect.core.model import Model, load_model
from kselect.core.plan import Plan
from kselect.core.records import DEFAULT_DB, RecordDB
from kselect.core.tasks import Task, extract_tasks
from kselect.core.tune import Reporter, TaskOutcome, TuneOptions


@dataclass
class LibraryTuning:
    """One library's part of a tune: its tasks, what tuning each found, the plan kept for it."""

    library: Library
    tasks: list[Task]
    outcomes: list[TaskOutcome]
    plan: Plan  # verified end to end against the library default, unless the tune ran with verify=False
    tune_s: float  # wall time of tuning and verifying

    def to_json(self) -> dict:
        return {"library": self.library.name, "version": self.library.version(), "emulated": self.library.emulated,
                "tune_s": round(self.tune_s, 1), "samples": sum(o.samples for o in self.outcomes),
                "measured_now": sum(o.measured_now for o in self.outcomes),
                "kept": self.plan.extra.get("verified", {}).get("chosen"),
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
    plan: Plan  # the plan kept
    tunings: dict[str, LibraryTuning]  # library name -> its part
    cross_plan: Plan | None = None  # several libraries: the plan across them, before the end-to-end check
    checks: list[dict] = field(default_factory=list)  # several libraries: each plan's whole-model check

    @property
    def kept(self) -> str:
        return self.plan.extra.get("verified", {}).get("chosen", "tuned")

    def to_json(self) -> dict:
        return {"model": self.model.name, "device": self.device.summary(), "kept": self.kept,
                "libraries": [tuning.to_json() for tuning in self.tunings.values()],
                "cross_library": (self.cross_plan.extra.get("cross_library") if self.cross_plan else None),
                "checks": [{k: v for k, v in check.items() if k not in ("process_ms", "default_process_ms")}
                           for check in self.checks]}


class TuneEvents(Reporter):
    """What the flow tells a user interface while it runs; every method may be left out. The
    task-level calls (``task_started``, ``measured``, ``task_finished``) come from core/tune.py."""

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

    def cross_planned(self, plan: Plan) -> None:
        """The plan across libraries, before its end-to-end check (``plan.extra["cross_library"]``)."""

    def cross_checked(self, chosen: Plan, results: list[dict]) -> None: ...


def tune(model: Model | str, libraries: str | list = "mlas", *, search: str = "xgb", budget: int = 16,
         time_budget_s: float | None = None, seed: int = 0, early_stop: int | None = None, storage: str | None = None,
         db: RecordDB | str | Path | None = None, settings: MeasureSettings | None = None, verify: bool = True,
         remeasure: bool = True, check_rounds: int = 4, check_max_rounds: int = 10,
         input_shape: list[str] | tuple = (), events: TuneEvents | None = None) -> TuneResult:
    """Tunes ``model`` (a Model, an ONNX file, a built-in or real model's name; ``input_shape`` as
    ``["name=1,3,224,224"]``) on ``libraries`` (a ``--library`` spec such as "mlas",
    "mlas,xnnpack" or "all", or a list of names or Library objects) and returns the plan kept.
    ``budget`` configs per task, ``time_budget_s`` for the whole tune; ``storage``: an Optuna RDB
    URL for ``search="tpe"``. Records go to ``db`` (default ~/.cache/kselect/records.db) as they
    are made, so the same call again resumes. Bad arguments raise ``KselectError`` before anything
    is measured."""
    from kselect.core.lock import measuring_lock

    events = events or TuneEvents()
    chosen = _libraries(libraries)
    searcher = plugins.get_searcher(search)
    if storage:
        searcher.check_options({"storage": storage})
    if not isinstance(model, Model):
        model = load_model(str(model), list(input_shape))
    extract_tasks(model)  # a model with nothing to tune is refused before the record database is opened
    device = this_device()
    db = db if isinstance(db, RecordDB) else RecordDB(db or DEFAULT_DB)
    settings = settings or MeasureSettings()
    with measuring_lock(device.fingerprint, on_wait=events.waiting_for_lock):
        tunings = {}
        for library in chosen:
            searcher_options = {}
            if storage:  # one Optuna study per device, library build and task
                searcher_options = {"storage": storage,
                                    "study_prefix": f"{device.fingerprint}-{library.name}-{library.version()}-"}
            options = TuneOptions(search, budget, time_budget_s, seed, early_stop, searcher_options, settings)
            tunings[library.name] = tune_library(model, library, device, db, options, verify, events)
        result = TuneResult(model, device, next(iter(tunings.values())).plan, tunings)
        if len(chosen) > 1:
            _plan_across(result, db, settings, verify, remeasure, check_rounds, check_max_rounds, events)
    return result


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


def tune_library(model: Model, library: Library, device: Device, db: RecordDB, options: TuneOptions,
                 verify: bool = True, events: TuneEvents | None = None) -> LibraryTuning:
    """Tunes one library's tasks and keeps its plan: the most tuned variant not slower than the
    library default end to end (``verify``), else the tuned one."""
    from kselect.core.library_plan import verified_library_plan
    from kselect.core.tune import library_tasks, tune as tune_tasks

    events = events or TuneEvents()
    start = time.perf_counter()
    tasks = library_tasks(model, library)
    events.library_started(model, library, tasks, options, device, db)
    outcomes = tune_tasks(tasks, library, device, db, options, events)
    with events.working(f"checking the {library.name} plan end to end against the library default"):
        plan = verified_library_plan(model, library, device, db, tasks, outcomes, verify, settings=options.settings,
                                     on_result=lambda name, result: events.whole_model_checked(library, name, result))
    tuning = LibraryTuning(library, tasks, outcomes, plan, time.perf_counter() - start)
    events.library_tuned(tuning)
    return tuning


def _plan_across(result: TuneResult, db: RecordDB, settings: MeasureSettings, verify: bool, remeasure: bool,
                 check_rounds: int, check_max_rounds: int, events: TuneEvents) -> None:
    """Per op across the tuned libraries, conversions counted; then ONNX Runtime's default
    session, each library's plan and the cross-library plan, each alone in fresh processes: what
    is shown faster than the default is kept, else ONNX Runtime's own configuration (when MLAS,
    its library, was tuned)."""
    from kselect.core.selection import verified_across
    from kselect.core.crossplan import plan_across
    from kselect.core.spinning import spinning_variants
    from kselect.core.library_plan import onnxruntime_default_plan

    model, device, tunings = result.model, result.device, result.tunings
    doing = ("re-timing the configs and conversions the plan chooses among, then planning across libraries"
             if remeasure else "measuring layout conversions and library switches, planning across libraries")
    with events.working(doing):
        plan = plan_across(model, device, db, {name: t.library for name, t in tunings.items()},
                           {name: t.plan for name, t in tunings.items()}, settings, remeasure=remeasure)
    result.cross_plan = result.plan = plan
    events.cross_planned(plan)
    if not verify:
        return
    candidates = [(f"{name} plan", t.plan) for name, t in tunings.items()] + spinning_variants(plan)
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
    from kselect.core.plan import check_plan, load_plan_file, validate_plan

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
    from kselect.core.alone import bench_alone
    from kselect.core.bench import bench as interleaved_bench, fresh_runners
    from kselect.core.runtime import load_plan

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
        result = interleaved_bench(default_runners, plan_runners, model, rounds, runs_per_round)
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
