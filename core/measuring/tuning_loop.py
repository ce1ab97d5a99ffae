"""The tuning loop: for each task, measure the library's default config (the baseline), then
let a searcher propose configs until the budget is spent, storing every result as it is made.
Stored results are reused, never re-measured: running the same tune again resumes it."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.contract.runner import Runner
from kselect.core.contract.space import config_key
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device
from kselect.core.measuring.measure import MeasureSettings, Result
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.precision.quant import TWIN_KINDS
from kselect.core.records.store import Record, RecordDB

if TYPE_CHECKING:
    from kselect.core.records.fleet import Fleet


def library_tasks(model: Model, library: Library, precisions: tuple[str, ...] = ("fp32",)) -> list[Task]:
    """The model's tasks this library can tune, with the library told about the model; with
    "bf16", "fp16" or "int8" in ``precisions``, also the twins at those precisions
    (core/precision/) the library lists and supports."""
    library.prepare_model(model)
    fp32 = extract_tasks(model)
    tasks = [t for t in fp32 if library.supports(t)] if "fp32" in precisions else []
    for precision in precisions:
        if precision != "fp32" and precision in library.precisions:
            tasks += [twin for t in fp32 if t.kind in TWIN_KINDS
                      for twin in [t.at_precision(precision)] if library.supports(twin)]
    if not tasks:
        raise KselectError(f"{library.name} supports none of {model.name}'s tunable ops")
    return tasks


@dataclass
class TaskOutcome:
    task: Task
    space_size: int
    default_config: dict
    default: Result | None = None
    best_config: dict | None = None
    best: Result | None = None
    samples: int = 0  # configs with a stored result, the default included
    measured_now: int = 0
    failed: int = 0
    invalid: int = 0
    stopped_early: bool = False
    out_of_time: bool = False  # the search ended on the time budget, before its own end

    @property
    def speedup(self) -> float | None:
        if self.default and self.best and self.default.median_us and self.best.median_us:
            return self.default.median_us / self.best.median_us
        return None


class Reporter:
    """What the tuner tells its user interface; the CLI shows it with rich."""

    def task_started(self, task: Task, outcome: TaskOutcome, budget: int) -> None: ...
    def measured(self, task: Task, config: dict, result: Result, outcome: TaskOutcome) -> None: ...
    def task_finished(self, task: Task, outcome: TaskOutcome) -> None: ...
    def waiting_for_workers(self, held: list[tuple[str, str]]) -> None:
        """Every task left is held by other workers of the fleet: (task key, worker); called once per library."""


@dataclass
class TuneOptions:
    search: str = "xgb"
    budget: int = 16  # configs per task, the default included
    time_budget_s: float | None = None  # whole tune
    seed: int = 0
    early_stop: int | None = None  # stop a task after this many samples without a better time
    searcher_options: dict = field(default_factory=dict)  # e.g. {"storage": "sqlite:///optuna.db"}
    settings: MeasureSettings = field(default_factory=MeasureSettings)


# A measure callback is called with every result the runner returns, as it returns it
# (MetaSchedule's MeasureCallback): ``callback(task, config, result, is_default)``.
MeasureCallback = Callable[[Task, dict, Result, bool], None]


class StoreRecords:
    """The measure callback that writes each result to the record database as it is made, keyed
    by device and library build, with the search backend that proposed it; the write also
    releases the claim taken before measuring."""

    def __init__(self, db: RecordDB, device: Device, library: Library, search: str = ""):
        self.db, self.device, self.library, self.version, self.search = db, device, library, library.version(), search

    def __call__(self, task: Task, config: dict, result: Result, is_default: bool) -> None:
        self.db.add(self.device.fingerprint, self.library.name, self.version, task.to_json(), config_key(config),
                    result, self.library.emulated, is_default, self.search)


@dataclass
class SearchEnd:
    samples: int  # samples counted at the end, those counted before the search included
    stopped_early: bool = False
    exhausted: bool = False  # the searcher had nothing more to propose


def search_task(searcher, measure: Callable[[dict, bool], Result], budget: int, *, samples: int = 0,
                best_us: float | None = None, default: dict | None = None, early_stop: int | None = None,
                time_left: Callable[[], bool] = lambda: True) -> SearchEnd:
    """The search loop of one task, shared by live tuning and replay: measure ``default`` first
    when given, then ask the searcher and tell it each result until ``budget`` samples (counting
    the ``samples`` already known), the searcher has nothing more, ``early_stop`` samples went
    by without a time better than any before (``best_us``: the best known before the search),
    or ``time_left()`` says no. ``measure(config, is_default)`` returns the result; failed and
    invalid results are told to the searcher as None."""
    best = best_us

    def sample(config: dict, is_default: bool) -> bool:
        nonlocal best, samples
        result = measure(config, is_default)
        samples += 1
        time_us = result.median_us if result.status == "ok" else None
        searcher.tell(config, time_us)
        improved = time_us is not None and (best is None or time_us < best)
        if improved:
            best = time_us
        return improved

    if default is not None and time_left():
        sample(default, True)
    since_improvement = 0
    while samples < budget and time_left():
        if early_stop is not None and since_improvement >= early_stop:
            return SearchEnd(samples, stopped_early=True)
        config = searcher.ask()
        if config is None:
            return SearchEnd(samples, exhausted=True)
        since_improvement = 0 if sample(config, False) else since_improvement + 1
    return SearchEnd(samples)


def _update_best(outcome: TaskOutcome, config: dict, result: Result) -> None:
    if result.status == "ok" and (outcome.best is None or result.median_us < outcome.best.median_us):
        outcome.best, outcome.best_config = result, config


def tune_tasks(tasks: list[Task], library: Library, device: Device, db: RecordDB, options: TuneOptions,
         reporter: Reporter | None = None, runner: Runner | None = None,
         callbacks: list[MeasureCallback] | None = None, fleet: "Fleet | None" = None,
         measuring=contextlib.nullcontext) -> list[TaskOutcome]:
    """Tunes ``tasks`` one after the other, measuring through ``runner`` (default: the live
    ``MeasureWorker`` on ``library``'s kernels; a ``ReplayWorker`` answers from recorded tables)
    and handing every result to ``callbacks`` (default: ``StoreRecords`` into ``db``). ``db`` is
    also read: what it holds for this device and library build is never measured again.

    With a ``fleet`` (core/records/fleet.py), only the tasks this worker claims are tuned here, each inside
    ``measuring()`` (the device's measuring lock); the others' outcomes are read from the records
    their workers stored, once every task is finished."""
    if callbacks is None:
        callbacks = [StoreRecords(db, device, library, options.search)]
    tuner = _Tuner(library, device, db, options, reporter or Reporter(), plugins.get_searcher(options.search),
                   callbacks)
    try:
        with runner or MeasureWorker(library, options.settings) as tuner.worker:
            if fleet is None:
                return [tuner.tune_task(task) for task in tasks]
            return tuner.tune_claimed(tasks, fleet, measuring)
    finally:
        db.release_claims()


class _Tuner:
    def __init__(self, library: Library, device: Device, db: RecordDB, options: TuneOptions, reporter: Reporter,
                 searcher_class, callbacks: list[MeasureCallback]):
        self.library, self.device, self.db, self.options, self.reporter = library, device, db, options, reporter
        self.searcher_class, self.callbacks = searcher_class, callbacks
        self.version = library.version()
        self.deadline = time.monotonic() + options.time_budget_s if options.time_budget_s else None
        self.started = time.time()
        self.worker: Runner | None = None
        db.add_device(device.fingerprint, device.to_json())

    def time_left(self) -> bool:
        return self.deadline is None or time.monotonic() < self.deadline

    def measure(self, task: Task, config: dict, outcome: TaskOutcome, is_default: bool = False) -> Result:
        self.db.check_writable()  # nothing is measured that could not be stored
        stale_after_s = 2 * self.options.settings.timeout_s + 30  # a claim outlives no measurement
        result = self.db.claim(self.device.fingerprint, self.library.name, self.version, task.key, config_key(config),
                               stale_after_s, newer_than=self.started)
        if result is None:  # not measured meanwhile by another tune sharing the database
            result = self.worker.measure(task, config)
            for callback in self.callbacks:
                callback(task, config, result, is_default)
            outcome.measured_now += 1
        self.count(outcome, config, result)
        self.reporter.measured(task, config, result, outcome)
        return result

    @staticmethod
    def count(outcome: TaskOutcome, config: dict, result: Result) -> None:
        outcome.samples += 1
        outcome.failed += result.status == "failed"
        outcome.invalid += result.status == "invalid"
        _update_best(outcome, config, result)

    def tune_claimed(self, tasks: list[Task], fleet: "Fleet", measuring) -> list[TaskOutcome]:
        by_key = {task.key: task for task in tasks}
        outcomes: dict[str, TaskOutcome] = {}
        told_waiting = False
        while True:
            claim = fleet.claim(self.library.name) if self.time_left() else None
            if claim is not None:
                task = by_key[claim.task]
                if claim.taken_from:  # its worker's lease ran out: the configs it had claimed are free
                    self.db.drop_claims(self.device.fingerprint, self.library.name, self.version, task.key)
                with measuring():
                    outcome = outcomes[task.key] = self.tune_task(task)
                fleet.finished_task(claim, outcome.measured_now, complete=not outcome.out_of_time)
                continue
            held = fleet.held_elsewhere(self.library.name)
            if not held or not self.time_left():
                break
            if not told_waiting:
                self.reporter.waiting_for_workers(held)
                told_waiting = True
            fleet.wait()
        for task in tasks:
            if task.key not in outcomes:
                outcome = outcomes[task.key] = self.tune_task(task, search=False)  # another worker tuned it
                # or none did: the time budget ran out before this worker could claim it
                outcome.out_of_time = not self.time_left() and outcome.samples < self.options.budget
        return [outcomes[task.key] for task in tasks]

    def tune_task(self, task: Task, search: bool = True) -> TaskOutcome:
        """Resumes ``task`` from its records and searches on to the budget (``search``), or only
        reads what the records hold."""
        fingerprint, name = self.device.fingerprint, self.library.name
        space = self.library.space(task, self.device)
        default = space.normalise(self.library.default_config(task, self.device))
        outcome = TaskOutcome(task, len(space), default)
        records = self.db.records(fingerprint, name, self.version, task.key)
        if not search:
            for record in records:
                self.count(outcome, space.normalise(record.config), record.result)
            outcome.default = next((r.result for r in records if r.config_key == config_key(default)), None)
            self.reporter.task_started(task, outcome, self.options.budget)
            self.reporter.task_finished(task, outcome)
            return outcome
        prior = [(Task.from_json(task_json), record.config, record.result.median_us)
                 for task_json, record in self.db.all_records(fingerprint, name, self.version)
                 if record.task != task.key and record.result.status == "ok"]
        searcher = self.searcher_class(space, task=task, seed=self.options.seed, prior=prior,
                                       **self.options.searcher_options)

        # Resume: what is stored is never measured again, except a failure (a crash, a time-out),
        # which says something about the settings it ran under: it is measured again in this run.
        stored = {r.config_key: r for r in records if r.result.status != "failed"}
        for record in stored.values():
            config = space.normalise(record.config)
            searcher.tell(config, record.result.median_us if record.result.status == "ok" else None)
            self.count(outcome, config, record.result)
        self.reporter.task_started(task, outcome, self.options.budget)
        if config_key(default) in stored:
            outcome.default = stored[config_key(default)].result

        def measure(config: dict, is_default: bool) -> Result:
            result = self.measure(task, config, outcome, is_default)
            if is_default:
                outcome.default = result
            return result

        end = search_task(searcher, measure, self.options.budget, samples=outcome.samples,
                          best_us=outcome.best.median_us if outcome.best else None, default=None if outcome.default else default, early_stop=self.options.early_stop,
                          time_left=self.time_left)
        outcome.stopped_early = end.stopped_early
        outcome.out_of_time = end.samples < self.options.budget and not (end.stopped_early or end.exhausted)
        self.reporter.task_finished(task, outcome)
        return outcome


def stored_outcomes(tasks: list[Task], library: Library, device: Device, db: RecordDB) -> dict[str, list[Record]]:
    """Every stored record per task key, for this device and library build."""
    version = library.version()
    return {task.key: db.records(device.fingerprint, library.name, version, task.key) for task in tasks}


def library_defaults(tasks: list[Task], library: Library, device: Device) -> dict[str, dict]:
    """The library's own config per task key, normalised to its space (as records store it)."""
    return {t.key: library.space(t, device).normalise(library.default_config(t, device)) for t in tasks}


STALL_RATIO = 1.3  # a re-timing this much slower than its library's re-timings drifted is taken again
STALL_RETRIES = 2


def remeasure(candidates: list[tuple[Library, Task, dict]], defaults: dict[str, dict[str, dict]], device: Device, db: RecordDB,
              settings: MeasureSettings, on_measured=None) -> int:
    """Measures stored configs again and replaces their records, task by task with the libraries
    alternating, so the configs a plan compares carry timings from one period (this VM's speed
    drifts by up to 1.5x over hours). A result that is not ok keeps the stored record.
    ``defaults[library][task key]`` marks the library defaults' records. Returns the number of
    records replaced.

    A thread stalled during a re-timing inflates it and never deflates it (googlenet's conv3 once
    re-timed at 12.0 ms against 4.1 ms), so a re-timing that grew by more than ``STALL_RATIO``
    times the median growth of its library's re-timings is taken again, up to ``STALL_RETRIES``
    times, and the fastest take is kept."""
    from contextlib import ExitStack

    by_task: dict[str, list[tuple[Library, Task, dict]]] = {}
    for library, task, config in candidates:
        by_task.setdefault(task.key, []).append((library, task, config))
    stored: dict[tuple[str, str, str], float] = {}
    for name, version in {(library.name, library.version()) for library, _, _ in candidates}:
        for record in db.records(device.fingerprint, name, version):
            if record.result.status == "ok":
                stored[(name, record.task, record.config_key)] = record.result.median_us
    growth: dict[tuple, float] = {}
    taken: dict[tuple, tuple[Library, Task, dict, Result]] = {}
    with ExitStack() as stack:
        workers: dict[str, MeasureWorker] = {}
        stores: dict[str, StoreRecords] = {}

        def take(library: Library, task: Task, config: dict) -> None:
            if library.name not in workers:
                workers[library.name] = stack.enter_context(MeasureWorker(library, settings))
                stores[library.name] = StoreRecords(db, device, library)
            result = workers[library.name].measure(task, config)
            if on_measured:
                on_measured(task, result)
            key = (library.name, task.key, config_key(config))
            if result.status != "ok" or (key in taken and taken[key][3].median_us <= result.median_us):
                return
            is_default = config_key(config) == config_key(defaults[library.name][task.key])
            stores[library.name](task, config, result, is_default)
            taken[key] = (library, task, config, result)
            if key in stored and stored[key] > 0:
                growth[key] = result.median_us / stored[key]

        for entries in by_task.values():
            for library, task, config in entries:
                take(library, task, config)
        for _ in range(STALL_RETRIES):
            by_library: dict[str, list[float]] = {}
            for key, ratio in growth.items():
                by_library.setdefault(key[0], []).append(ratio)
            typical = {name: statistics.median(ratios) for name, ratios in by_library.items() if len(ratios) >= 3}
            for key in [k for k, ratio in growth.items() if k[0] in typical and ratio > STALL_RATIO * typical[k[0]]]:
                take(*taken[key][:3])
    return len(taken)
