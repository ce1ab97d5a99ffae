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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kselect.core.config import TuneConfig
from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.cross_library.keep import plan_and_keep_across
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.lock import measuring_lock
from kselect.core.measuring.tuning_loop import Reporter, TaskOutcome, TuneOptions, library_tasks, tune_tasks
from kselect.core.models.model import Model, load_model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.paths import check_output
from kselect.core.plans.library_plan import verified_library_plan
from kselect.core.plans.plan import Plan, artifact_stem, check_plan, load_plan_file, validate_plan
from kselect.core.plans.runtime import load_plan
from kselect.core.precision.choice import PrecisionRequest, choose_precision, precision_request, precisions_left_out
from kselect.core.records.fleet import Fleet, FleetReport, tune_id
from kselect.core.records.store import RecordDB, database_location
from kselect.core.whole_model.alone import bench_alone
from kselect.core.whole_model.bench import bench_in_process, fresh_runners

if TYPE_CHECKING:
    from kselect.core.precision.mixed import PrecisionSearch


@dataclass
class LibraryTuning:
    """One library's part of a tune: its tasks, what tuning each found, the plan kept for it."""

    library: Library
    tasks: list[Task]
    outcomes: list[TaskOutcome]
    plan: Plan  # verified end to end against the library default, unless the tune ran with verify=False
    tune_s: float  # wall time of tuning and verifying
    precision: "PrecisionSearch | None" = None  # with reduced precisions: the front and the point chosen (core/precision/mixed.py)

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
    precisions_left_out: dict[str, str] = field(default_factory=dict)  # --precision all: precision -> why not here

    @property
    def kept(self) -> str | None:
        return self.plan.extra.get("verified", {}).get("chosen", "tuned") if self.plan else None

    def predictions(self) -> list[dict]:
        """Every plan this tune timed end to end with a predicted time: the libraries' plan
        variants against their defaults, precision front points against the fp32 plan, and the
        plans across libraries against ONNX Runtime's default session (core/whole_model/prediction.py)."""
        found = []
        for name, tuning in self.tunings.items():
            fp32_plan = tuning.precision.plans.get("fp32") if tuning.precision else None
            verified = tuning.plan.extra.get("verified") or (fp32_plan.extra.get("verified") if fp32_plan else None)
            for tried in (verified or {}).get("tried", []):
                if "prediction" in tried:
                    found.append({"library": name, "plan": tried["variant"], **tried["prediction"]})
            for point in (tuning.precision.front if tuning.precision else []):
                if point.prediction is not None:
                    found.append({"library": name, "plan": point.name, **point.prediction})
        for check in self.checks:
            if "prediction" in check:
                found.append({"library": "+".join(sorted(self.tunings)), "plan": check["variant"], **check["prediction"]})
        return found

    def to_json(self) -> dict:
        return {"model": self.model.name, "device": self.device.summary(), "kept": self.kept,
                "fleet": self.fleet.to_json() if self.fleet else None,
                "libraries": [tuning.to_json() for tuning in self.tunings.values()],
                "left_out": self.left_out, "precisions_left_out": self.precisions_left_out,
                "cross_library": (self.cross_plan.extra.get("cross_library") if self.cross_plan else None),
                "checks": [{k: v for k, v in check.items() if k not in ("process_ms", "default_process_ms")}
                           for check in self.checks],
                "predictions": self.predictions()}


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

    def precisions_left_out(self, left_out: dict[str, str]) -> None:
        """``--precision all``: the reduced precisions none of the libraries has here, and why."""

    def library_left_out(self, library: Library, why: str) -> None:
        """A tune of several libraries could not plan ``library`` (no valid config of some op):
        the others are planned without it."""

    def cross_planned(self, plan: Plan) -> None:
        """The plan across libraries, before its end-to-end check (``plan.extra["cross_library"]``)."""

    def cross_checked(self, chosen: Plan, results: list[dict]) -> None: ...

    def cross_int8_scored(self, variant: str, score: float | None, drop: float | None, max_drop: float,
                          failed: str = "") -> None:
        """A plan across libraries with reduced-precision ops (``variant`` names it), its metric on the held-out
        feeds (``failed``: why it could not be made or run); it races only within ``max_drop``."""

    def precision_searched(self, library: Library, search: "PrecisionSearch", check: dict | None) -> None:
        """The latency / accuracy front of a tune with reduced precisions (core/precision/mixed.py), the point kept, and
        ``check``: the chosen mixed plan timed against the fp32 plan end to end (None: not timed)."""


def tune(model: Model | str, libraries: str | list = "mlas", config: TuneConfig | None = None, *,
         events: TuneEvents | None = None, **options) -> TuneResult:
    """Tunes ``model`` (a Model, an ONNX file, a built-in or real model's name) on ``libraries`` (a
    ``--library`` spec such as "mlas", "mlas,xnnpack" or "all", or a list of names or Library
    objects) as ``config`` says (a ``TuneConfig``: core/config.py; or its fields as keywords,
    ``budget=8``), and returns the plan kept. Records go to ``config.db`` as they are made, so the
    same call again resumes. Bad arguments raise ``KselectError`` before anything is measured.

    Tunes of the same model and options sharing the database (devices of one kind on one
    PostgreSQL server) split its tasks (core/records/fleet.py): a task claimed by a worker that
    died is taken over once its lease of ``lease_s`` seconds runs out. The worker finishing last
    plans and returns the plan; the others return ``plan=None`` with what they did in ``fleet``.

    ``precision="fp32,int8"`` (or bf16, fp16; "all") adds each op's kernels in those precisions
    (core/precision/quant.py, core/precision/half.py) and chooses which ops run in which under
    ``max_accuracy_drop`` of ``metric``, measured on held-out feeds of
    ``calibration`` (core/precision/choice.py); the plan stores the front, the metric and the budget."""
    if config is None:
        config = TuneConfig.from_options(**options)
    elif options:
        raise KselectError(f"kselect.tune takes a config or its options, not both (got config and "
                           f"{', '.join(sorted(options))}): use config.but({next(iter(sorted(options)))}=...)")
    elif not isinstance(config, TuneConfig):
        raise KselectError(f"config {config!r}: give a kselect.TuneConfig")
    events = events or TuneEvents()
    chosen = _libraries(libraries)
    searcher = plugins.get_searcher(config.search)
    if config.storage:
        searcher.check_options({"storage": config.storage})
    if not isinstance(model, Model):
        model = load_model(str(model), list(config.input_shape))
    extract_tasks(model)  # a model with nothing to tune is refused before the record database is opened
    missing_precisions = precisions_left_out(chosen, config)
    events.precisions_left_out(missing_precisions)
    reduced = precision_request(model, chosen, config)
    device = this_device()
    db = config.db if isinstance(config.db, RecordDB) else RecordDB(database_location(config.db))
    work = []
    for library in chosen:
        searcher_options = {}
        if config.storage:  # one Optuna study per device, library build and task
            searcher_options = {"storage": config.storage,
                                "study_prefix": f"{device.fingerprint}-{library.name}-{library.version()}-"}
        options = TuneOptions(config.search, config.budget, config.time_budget_s, config.seed, config.early_stop,
                              searcher_options, config.settings)
        work.append((library, library_tasks(model, library, ("fp32",) + _reduced(library, reduced)), options))

    # Tasks first, shared with the other tunes of this model on the database (core/records/fleet.py); each
    # task is measured holding the device's measuring lock.
    lock = _MeasuringLock(device, events)
    library_task_pairs = [(lib, task) for lib, tasks, _ in work for task in tasks]
    fleet_tune = tune_id(device.fingerprint, [(lib.name, lib.version(), task.key) for lib, task in library_task_pairs],
                         {"search": config.search, "budget": config.budget, "seed": config.seed,
                          "early_stop": config.early_stop})
    tuned = []
    # a read-only database can only be replayed from, alone
    fleet = None if db.read_only else Fleet(db, fleet_tune, [(lib.name, task.key) for lib, task in library_task_pairs],
                                            config.lease_s)
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
                tunings[library.name] = plan_library(model, library, device, db, config, tasks, outcomes, tune_s,
                                                     events, reduced if _reduced(library, reduced) else None)
            except KselectError as exc:  # with several libraries, one that cannot plan is left out
                if len(tuned) == 1:
                    raise
                last_error = exc
                left_out[library.name] = str(exc)
                events.library_left_out(library, str(exc))
        if not tunings:
            raise last_error
        result = TuneResult(model, device, next(iter(tunings.values())).plan, tunings,
                            fleet=fleet.report if fleet else None, left_out=left_out,
                            precisions_left_out=missing_precisions)
        if len(tunings) > 1:
            plan_and_keep_across(result, db, config, events, reduced)
    return result


def _reduced(library: Library, request: "PrecisionRequest | None") -> tuple[str, ...]:
    """The reduced precisions this tune gives ``library`` ops in: those asked for that its plans can hold."""
    return request.for_library(library) if request is not None else ()


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
        return measuring_lock(self.device.fingerprint, on_wait=self._waiting)


def _libraries(libraries) -> list[Library]:
    """The libraries of a ``--library`` spec, or of a list of names and Library objects (an
    object given is the one measured, registered or not)."""
    if isinstance(libraries, Library):
        libraries = [libraries]
    if not isinstance(libraries, (str, list, tuple)) or not all(isinstance(lib, (str, Library)) for lib in libraries):
        raise KselectError(f"libraries {libraries!r}: give a --library spec such as 'mlas' or 'mlas,xnnpack', "
                           "or a list of library names")
    if isinstance(libraries, str):
        return plugins.select_libraries(libraries)
    given = {lib.name: lib for lib in libraries if isinstance(lib, Library)}
    if given and len(libraries) == 1:
        return list(given.values())
    chosen = plugins.select_libraries(",".join(lib if isinstance(lib, str) else lib.name for lib in libraries))
    return [given.get(lib.name, lib) for lib in chosen]


def plan_library(model: Model, library: Library, device: Device, db: RecordDB, config: TuneConfig,
                 tasks: list[Task], outcomes: list[TaskOutcome], tune_s: float, events: TuneEvents | None = None,
                 reduced: PrecisionRequest | None = None) -> LibraryTuning:
    """Keeps one library's plan from its tuned tasks: the most tuned variant not slower than the
    library default end to end (``config.verify``), else the tuned one. With ``reduced`` (the
    reduced-precision twins among ``tasks``), the mixed-precision plan under the budget replaces it when it is shown
    faster end to end (core/precision/choice.py)."""
    events = events or TuneEvents()
    start = time.perf_counter()
    fp32 = [(t, o) for t, o in zip(tasks, outcomes) if t.precision == "fp32"]
    with events.working(f"checking the {library.name} plan end to end against the library default"):
        plan = verified_library_plan(model, library, device, db, [t for t, _ in fp32], [o for _, o in fp32],
                                     config.verify, settings=config.settings,
                                     on_result=lambda name, result: events.whole_model_checked(library, name, result))
    search = None
    if reduced:
        twins = [t for t in tasks if t.precision != "fp32"]
        plan, search = choose_precision(model, library, device, db, plan, twins, reduced, config, events)
    tuning = LibraryTuning(library, tasks, outcomes, plan, tune_s + time.perf_counter() - start, search)
    events.library_tuned(tuning)
    return tuning


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
    return library.apply(result.plan, result.model, path.parent, artifact_stem(path))


def checked_plan(plan: Plan | str | Path, model: Model, force: bool = False, on_warning=None) -> Plan:
    """A plan file (or Plan) checked against ``model`` and this device: made for another device
    or library build, it is refused unless ``force`` (then each problem goes to ``on_warning``)."""
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
    if not isinstance(model, Model):
        model = load_model(str(model), list(input_shape))
    plan = checked_plan(plan, model, force, on_warning)
    library = plugins.baseline_library() if plan.cross_library else plugins.get_library(plan.library)
    baseline = "onnxruntime default" if plan.cross_library else f"{library.name} default"
    if alone:
        result = bench_alone(model, library.name, plan, rounds, runs_per_round, library.users_default)
    else:
        default_runners = fresh_runners(library, model, None)
        plan_runners = [load_plan(plan, model)] if plan.cross_library else fresh_runners(library, model, plan)
        result = bench_in_process(default_runners, plan_runners, model, rounds, runs_per_round)
    return {"model": model.name, "library": "+".join(plan.libraries), "library_versions": plan.libraries,
            "baseline": baseline, "emulated": plan.emulated, "device": this_device().summary(), "alone": alone,
            **result}


def check_plan_path(path, model: Model | None = None, db=None) -> Path:
    """Refuses, before anything is measured, a plan path that cannot be written or would destroy
    what the tune reads (the model, the record database)."""
    reads = {"the model": model.source if model is not None else None,
             "the record database": None if isinstance(db, RecordDB) else database_location(db)}
    return check_output(path, "-o", "the plan", reads, kind="a plan file")
