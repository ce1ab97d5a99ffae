"""Replay: answer measurements from a recorded table instead of running kernels (like Kernel
Tuner's simulation mode), so search backends can be compared repeatably, fast, and in CI.

A table is JSON (``format: kselect-replay/1``) written after an exhaustive tune: the device
description (with its fingerprint), library and library version, the measuring settings, and per
task its JSON, its configuration space (dimensions only), the library default and *every* config
with its status and median time. Constraints cannot be stored (they are code), so a replayed
space is the stored dimensions restricted to the recorded configs: a searcher on a replayed task
sees exactly the space the device had when the table was recorded, on any machine.

    table = ReplayTable.load("benchmarks/tables/mlas-<fingerprint>.json")
    task = table.tasks[0]
    trajectory = run_searcher("xgb", task, budget=100, seed=1, prior=table.prior(task.key))
    trajectory.best          # best-so-far time after each sample
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kselect.core.contract import plugins
from kselect.core.contract.runner import Runner
from kselect.core.contract.space import Categorical, Integer, Space, WorkloadSplit, config_key
from kselect.core.errors import KselectError
from kselect.core.measuring.measure import Result
from kselect.core.measuring.tuning_loop import search_task
from kselect.core.models.tasks import Task

TABLE_FORMAT = "kselect-replay/1"

# Backends shipped with kselect, importable even before they are registered as plugins.
BUILTIN_SEARCHERS = {
    "random": ("kselect.search.random", "RandomSearcher"),
    "exhaustive": ("kselect.search.exhaustive", "ExhaustiveSearcher"),
    "xgb": ("kselect.search.xgb", "XGBSearcher"),
    "tpe": ("kselect.search.tpe", "TPESearcher"),
}


class ReplayError(KselectError):
    """A searcher broke the ask/tell contract on a replayed task, or a table is unusable."""


# -- spaces as JSON ------------------------------------------------------------------------
def _tuple_values(value):
    return tuple(_tuple_values(v) for v in value) if isinstance(value, list) else value


def space_to_json(space: Space) -> list[dict]:
    """The space's dimensions (exactly, unlike ``Space.describe``); constraints are not stored."""
    dims = []
    for dim in space.dims:
        data = {"kind": type(dim).__name__, **asdict(dim)}
        dims.append(json.loads(json.dumps(data)))
    return dims


def space_from_json(dims: list[dict]) -> Space:
    kinds = {"Categorical": Categorical, "Integer": Integer, "WorkloadSplit": WorkloadSplit}
    space = Space()
    for data in dims:
        data = dict(data)
        kind = kinds[data.pop("kind")]
        if "choices" in data:
            data["choices"] = tuple(_tuple_values(c) for c in data["choices"])
        if data.get("default") is not None:
            data["default"] = _tuple_values(data["default"])
        space.add(kind(**data))
    return space


# -- tables ---------------------------------------------------------------------------------
@dataclass
class ReplayTask:
    """One task of a table: its space restricted to the recorded configs, and their results."""

    task: Task
    space: Space
    default_config: dict | None
    results: dict[str, Result]  # config key -> recorded result
    configs: dict[str, dict]  # config key -> config (the space's values)
    models: dict[str, str] = field(default_factory=dict)  # model name -> task id in that model

    @property
    def key(self) -> str:
        return self.task.key

    def measure(self, config: dict) -> Result:
        return self.results.get(config_key(config)) or Result("failed", reason="not in the replay table")

    @property
    def optimum_us(self) -> float | None:
        times = [r.median_us for r in self.results.values() if r.status == "ok" and r.median_us]
        return min(times) if times else None

    @property
    def size(self) -> int:
        return len(self.results)

    @property
    def name(self) -> str:
        """``model:id`` of the first model the task comes from (its key if none)."""
        return next((f"{model}:{task_id}" for model, task_id in self.models.items()), self.key)


@dataclass
class ReplayTable:
    device: dict
    library: str
    library_version: str
    tasks: list[ReplayTask]
    emulated: bool = False
    meta: dict = field(default_factory=dict)  # settings, when recorded, how long it took, models
    source: str = ""

    @property
    def fingerprint(self) -> str:
        return self.device.get("fingerprint", "")

    def task(self, name: str) -> ReplayTask:
        """A task by key, or by ``model:id`` (``mobilenetv2:T05``), or by id in the first model
        that has it."""
        model, _, task_id = name.rpartition(":")
        for replay_task in self.tasks:
            if name == replay_task.key or (model and replay_task.models.get(model) == task_id):
                return replay_task
        for replay_task in self.tasks:
            if not model and (name == replay_task.task.id or name in replay_task.models.values()):
                return replay_task
        raise KeyError(name)

    def prior(self, exclude_key: str | None = None) -> list[tuple[Task, dict, float]]:
        """Results of every other task (``ok`` only), in the form ``Searcher(prior=...)`` takes:
        what the tuner passes for transfer from earlier tasks on the same device and library."""
        return [(t.task, config, result.median_us)
                for t in self.tasks if t.key != exclude_key
                for key, config in t.configs.items()
                for result in [t.results[key]] if result.status == "ok"]

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "ReplayTable":
        if data.get("format") != TABLE_FORMAT:
            raise ReplayError(f"{source or 'table'}: format {data.get('format')!r}, expected {TABLE_FORMAT!r}")
        tasks = []
        for entry in data["tasks"]:
            task = Task.from_json(entry["task"])
            base = space_from_json(entry["space"])
            configs = {}
            results = {}
            for row in entry["configs"]:
                config = base.normalise(row["config"])
                key = config_key(config)
                configs[key] = config
                results[key] = Result(row["status"], row.get("median_us"), row.get("spread"), row.get("count", 0),
                                      row.get("error"), row.get("reason", ""))
            recorded = frozenset(configs)
            base.constrain("recorded in the replay table", lambda c, recorded=recorded: config_key(c) in recorded)
            default = base.normalise(entry["default"]) if entry.get("default") is not None else None
            tasks.append(ReplayTask(task, base, default, results, configs, dict(entry.get("models", {}))))
        meta = {k: v for k, v in data.items() if k not in ("format", "device", "library", "library_version", "tasks", "emulated")}
        return cls(data["device"], data["library"], data["library_version"], tasks, bool(data.get("emulated")), meta, source)

    @classmethod
    def load(cls, path: str | Path) -> "ReplayTable":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ReplayError(f"cannot read replay table {path}: {exc}") from None
        return cls.from_json(data, str(path))


def load_tables(directory: str | Path) -> list[ReplayTable]:
    return [ReplayTable.load(p) for p in sorted(Path(directory).glob("*.json"))]


class ReplayWorker(Runner):
    """Answers ``measure(task, config)`` from tables: the simulation ``Runner``
    (core/contract/runner.py), so ``kselect.core.measuring.tuning_loop.tune_tasks`` runs on a table instead of on kernels."""

    def __init__(self, *tables: ReplayTable):
        self.tasks = {t.key: t for table in tables for t in table.tasks}
        self.count = 0

    def measure(self, task: Task, config: dict) -> Result:
        self.count += 1
        replay_task = self.tasks.get(task.key)
        if replay_task is None:
            return Result("failed", reason="task not in the replay table")
        return replay_task.measure(config)


# -- running a searcher on a table ----------------------------------------------------------
def resolve_searcher(name_or_class):
    if not isinstance(name_or_class, str):
        return name_or_class
    if name_or_class in BUILTIN_SEARCHERS:
        import importlib

        module, attribute = BUILTIN_SEARCHERS[name_or_class]
        return getattr(importlib.import_module(module), attribute)

    return plugins.get_searcher(name_or_class)


@dataclass
class Trajectory:
    searcher: str
    task: str
    seed: int
    configs: list[dict] = field(default_factory=list)  # in the order measured
    times: list[float | None] = field(default_factory=list)  # None: failed or invalid
    best: list[float | None] = field(default_factory=list)  # best-so-far after each sample
    stopped_early: bool = False
    exhausted: bool = False  # the searcher had nothing more to propose
    elapsed_s: float = 0.0  # time spent in the searcher (ask and tell), not measuring

    @property
    def samples(self) -> int:
        return len(self.configs)

    def best_at(self, budget: int) -> float | None:
        """Best time after ``budget`` samples (all of them if the search stopped sooner)."""
        if not self.best:
            return None
        return self.best[min(budget, len(self.best)) - 1]

    def samples_to_within(self, optimum_us: float, tolerance: float = 0.02) -> int | None:
        """Samples needed until the best-so-far is within ``tolerance`` of ``optimum_us``."""
        for index, best in enumerate(self.best):
            if best is not None and best <= optimum_us * (1 + tolerance):
                return index + 1
        return None


class _ReplaySearcher:
    """The searcher as the loop sees it: times its ``ask`` and ``tell`` (searcher time, not
    measuring time) and, with ``check``, refuses a proposal it was told about or outside the space."""

    def __init__(self, searcher, name: str, space: Space, trajectory: Trajectory, check: bool):
        self.searcher, self.name, self.trajectory, self.check = searcher, name, trajectory, check
        self.in_space = {config_key(c) for c in space.enumerate()} if check else set()
        self.told: set[str] = set()

    def ask(self) -> dict | None:
        start = time.perf_counter()
        config = self.searcher.ask()
        self.trajectory.elapsed_s += time.perf_counter() - start
        if config is not None and self.check:
            key = config_key(config)
            if key in self.told:
                raise ReplayError(f"{self.name} proposed a config it was told about: {key}")
            if key not in self.in_space:
                raise ReplayError(f"{self.name} proposed a config outside the space: {key}")
        return config

    def tell(self, config: dict, time_us: float | None) -> None:
        self.told.add(config_key(config))
        start = time.perf_counter()
        self.searcher.tell(config, time_us)
        self.trajectory.elapsed_s += time.perf_counter() - start


def run_searcher(searcher, replay_task: ReplayTask, budget: int, seed: int = 0,
                 prior: list[tuple[Task, dict, float]] | None = None, early_stop: int | None = None,
                 include_default: bool = False, told: list[dict] | None = None, options: dict | None = None,
                 check: bool = True) -> Trajectory:
    """Run ``searcher`` (a name or a ``Searcher`` class) on one replayed task through the tuning
    loop's own search loop (``kselect.core.measuring.tuning_loop.search_task``) and a ``ReplayWorker``: first tell
    it ``told`` (results already stored, not counted as samples), then, if ``include_default``,
    measure the library default, then ask/tell until ``budget`` samples, the searcher has nothing
    more, or ``early_stop`` samples went by without a better time.

    With ``check`` a searcher that proposes a config it was told about, or one outside the space
    (conditions and constraints), raises ``ReplayError``."""
    searcher_class = resolve_searcher(searcher)
    name = getattr(searcher_class, "name", "") or searcher_class.__name__
    trajectory = Trajectory(name, replay_task.key, seed)
    instance = searcher_class(replay_task.space, task=replay_task.task, seed=seed, prior=prior, **(options or {}))
    wrapped = _ReplaySearcher(instance, name, replay_task.space, trajectory, check)
    runner = ReplayWorker()
    runner.tasks[replay_task.key] = replay_task
    for config in told or []:
        config = replay_task.space.normalise(config)
        result = runner.measure(replay_task.task, config)
        wrapped.tell(config, result.median_us if result.status == "ok" else None)

    def measure(config: dict, is_default: bool) -> Result:
        result = runner.measure(replay_task.task, config)
        time_us = result.median_us if result.status == "ok" else None
        best = trajectory.best[-1] if trajectory.best else None
        trajectory.configs.append(config)
        trajectory.times.append(time_us)
        trajectory.best.append(time_us if time_us is not None and (best is None or time_us < best) else best)
        return result

    default = replay_task.default_config
    if not include_default or default is None or config_key(default) in wrapped.told:
        default = None
    end = search_task(wrapped, measure, budget, default=default, early_stop=early_stop)
    trajectory.stopped_early, trajectory.exhausted = end.stopped_early, end.exhausted
    return trajectory


# -- recording tables -----------------------------------------------------------------------
def table_from_records(db, device, library, tasks: list[Task], defaults: dict[str, dict] | None = None,
                       model: str | None = None, version: str | None = None, settings=None) -> dict:
    """A replay table (JSON-ready dict) of ``tasks`` from a ``RecordDB``, after an exhaustive
    tune: for each task its space (from ``library.space(task, device)``), the default and every
    stored record of this device and library build that is a config of that space (a record of
    another spelling, e.g. an older default with a knob its layout ignores, is left out). Warns
    (``incomplete`` per task) when a task lacks records for some configs of its space."""
    version = version or library.version()
    device_json = device.to_json() if hasattr(device, "to_json") else dict(device)
    entries = []
    for task in tasks:
        space = library.space(task, device)
        in_space = {config_key(c) for c in space.enumerate()}
        records = [r for r in db.records(device_json["fingerprint"], library.name, version, task.key)
                   if r.config_key in in_space]
        rows = [{"config": r.config, "status": r.result.status,
                 "median_us": None if r.result.median_us is None else round(r.result.median_us, 3),
                 "spread": None if r.result.spread is None else round(r.result.spread, 4),
                 "count": r.result.count, **({"reason": r.result.reason} if r.result.reason else {})}
                for r in records]
        recorded = {r.config_key for r in records}
        missing = sum(config_key(c) not in recorded for c in space.enumerate())
        default = (defaults or {}).get(task.key)
        entries.append({"task": task.to_json(), "models": {model: task.id} if model else {},
                        "space": space_to_json(space), "space_size": len(space),
                        "default": default, "incomplete": missing, "configs": rows})
    return {"format": TABLE_FORMAT, "device": device_json, "library": library.name, "library_version": version,
            "emulated": bool(getattr(library, "emulated", False)),
            "settings": asdict(settings) if settings is not None else None, "tasks": entries}


def merge_tables(first: dict, second: dict) -> dict:
    """Tasks of both tables (same device and library build), each task once: a task in both has
    the second table's (newer) results and lists the models of both."""
    for key in ("library", "library_version"):
        if first[key] != second[key]:
            raise ReplayError(f"cannot merge tables of different {key}: {first[key]!r} vs {second[key]!r}")
    if first["device"].get("fingerprint") != second["device"].get("fingerprint"):
        raise ReplayError("cannot merge tables of different devices")
    merged = dict(first)
    by_key = {entry["task"]["key"]: dict(entry) for entry in first["tasks"]}
    for entry in second["tasks"]:
        key = entry["task"]["key"]
        models = by_key[key]["models"] if key in by_key else {}
        by_key[key] = {**entry, "models": {**models, **entry["models"]}}
    merged["tasks"] = list(by_key.values())
    return merged


def write_table(table: dict, path: str | Path) -> Path:
    """JSON with one line per task header and per config row (diffable, compact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compact = lambda value: json.dumps(value, separators=(", ", ": "))  # noqa: E731
    lines = ["{"]
    for key, value in table.items():
        if key != "tasks":
            lines.append(f" {json.dumps(key)}: {compact(value)},")
    lines.append(' "tasks": [')
    for i, entry in enumerate(table["tasks"]):
        header = {k: v for k, v in entry.items() if k != "configs"}
        lines.append(f"  {compact(header)[:-1]}, \"configs\": [")
        rows = [f"   {compact(row)}" for row in entry["configs"]]
        lines.append(",\n".join(rows))
        lines.append("  ]}" + ("," if i < len(table["tasks"]) - 1 else ""))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    json.loads(text)  # never write a table that does not read back
    path.write_text(text)
    return path


def gap(best_us: float | None, optimum_us: float) -> float:
    """Relative gap of a best-so-far time to the optimum (inf when nothing valid was found)."""
    return math.inf if best_us is None else best_us / optimum_us - 1.0


# -- synthetic tables (NOT measurements) ----------------------------------------------------
SYNTHETIC_NOTE = ("SYNTHETIC: a recorded table's tasks with made-up extra dimensions; each time is the recorded "
                  "time of the base config times a made-up smooth factor of the extra dimensions (plus 1% "
                  "hash noise). For exercising search backends on large spaces, never a measurement.")


def _synthetic_factor(task: Task, config: dict) -> float:
    """A made-up, smooth, task-dependent cost factor of the synthetic dims (>= 1 at the optimum
    of each term). Labelled synthetic everywhere it is used."""
    import hashlib

    channels = task.weight_shape[0]
    best_tile = min(5.0, max(0.0, math.log2(channels) / 2))  # bigger ops like bigger tiles
    kernel = task.attrs.get("kernel", [1, 1])[0] if task.kind == "conv" else 1
    best_unroll = {1: 4, 3: 3, 5: 2, 7: 2}.get(kernel, 2)
    threads = config.get("threads", 1)
    factor = 1.0 + 0.18 * (math.log2(config["tile"]) - best_tile + 0.5 * (threads - 1)) ** 2
    factor *= 1.0 + 0.08 * (config["unroll"] - best_unroll) ** 2 / best_unroll
    factor *= {"static": 1.0, "dynamic": 1.12, "guided": 1.05, "chunked": 1.0}[config["schedule"]]
    if config["schedule"] == "chunked":
        factor *= {16: 1.09, 64: 0.96, 256: 1.03}[config["chunk"]]
    factor *= 1.0 + 0.03 * abs(config["prefetch"] - (2 if channels >= 128 else 1))
    digest = hashlib.sha256((task.key + config_key(config)).encode()).digest()
    return factor * (1.0 + 0.01 * (digest[0] / 255.0 - 0.5))


def synthetic_table(base: ReplayTable, tasks: int | None = None) -> ReplayTable:
    """A SYNTHETIC table for exercising searchers on large spaces (see ``SYNTHETIC_NOTE``): each
    of the first ``tasks`` tasks of ``base`` gets extra dims (tile, unroll with the constraint
    tile * unroll <= 64, schedule, a chunk that applies only to the chunked schedule, prefetch)."""
    replay_tasks = []
    for source in base.tasks[:tasks]:
        space = space_from_json(space_to_json(source.space))
        space.add(Categorical("tile", (1, 2, 4, 8, 16, 32), role="micro-kernel"))
        space.add(Integer("unroll", 1, 8))
        space.add(Categorical("schedule", ("static", "dynamic", "guided", "chunked")))
        space.add(Categorical("chunk", (16, 64, 256), when={"schedule": ["chunked"]}))
        space.add(Categorical("prefetch", (0, 1, 2, 3), role="memory"))
        space.constrain("tile * unroll <= 64", lambda c: c["tile"] * c["unroll"] <= 64)
        base_keys = frozenset(source.configs)
        space.constrain("base config recorded", lambda c, keys=base_keys: config_key(
            {k: v for k, v in c.items() if k not in ("tile", "unroll", "schedule", "chunk", "prefetch")}) in keys)
        results, configs = {}, {}
        for config in space.enumerate():
            key = config_key(config)
            base_config = {k: v for k, v in config.items() if k not in ("tile", "unroll", "schedule", "chunk", "prefetch")}
            recorded = source.results[config_key(base_config)]
            if recorded.status == "ok":
                time_us = recorded.median_us * _synthetic_factor(source.task, config)
                results[key] = Result("ok", round(time_us, 3), recorded.spread, reason="synthetic")
            else:
                results[key] = recorded
            configs[key] = config
        default = None
        if source.default_config is not None:
            default = {**source.default_config, "tile": 1, "unroll": 1, "schedule": "static", "prefetch": 0}
        replay_tasks.append(ReplayTask(source.task, space, default, results, configs, dict(source.models)))
    meta = {**base.meta, "synthetic": SYNTHETIC_NOTE, "base_source": base.source}
    return ReplayTable(base.device, base.library + "+synthetic", base.library_version, replay_tasks, base.emulated,
                       meta, base.source + " [synthetic]")
