"""Latency prediction without measuring: the xgb cost model, trained on every record of the
device and library build, predicts each config's time for a model's tasks; the plan rule of
``core/plans/plan.py`` (best per task, plan-level dims shared, default kept unless clearly slower) is
then applied to the predictions, giving per-op and summed latencies of the predicted plan and of
the library default.

    from kselect.search.predict import predict_model
    prediction = predict_model(model, library, device, db)      # a ModelPrediction
    prediction.total_us, prediction.default_total_us, prediction.ops[0].predicted_us

Times are of the tunable ops alone, each in isolation (what kselect measures), summed over
the model's nodes: not a whole-model latency with the other ops and the data movement between
them. ``exclude_own=True`` leaves each task's own records out of its training data (to check how
well the model predicts tasks it has never seen; ``evaluate`` does that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kselect.core.contract.space import config_key
from kselect.core.errors import KselectError
from kselect.core.measuring.measure import Result
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import choose
from kselect.core.records.store import Record
from kselect.search.xgb import CostModel

MAX_SCORED = 50000  # configs scored per task (a random subset of larger spaces, seeded)


@dataclass
class OpPrediction:
    task: Task
    config: dict  # the predicted plan's config
    predicted_us: float
    default_config: dict
    default_predicted_us: float
    measured_us: float | None = None  # stored time of ``config`` if it was measured
    default_measured_us: float | None = None
    own_records: int = 0  # records of this task in the training data

    @property
    def nodes(self) -> int:
        return len(self.task.nodes)

    def to_json(self) -> dict:
        return {"task": self.task.id, "key": self.task.key, "nodes": self.task.nodes, "config": self.config,
                "predicted_us": round(self.predicted_us, 3), "default_config": self.default_config,
                "default_predicted_us": round(self.default_predicted_us, 3), "measured_us": self.measured_us,
                "default_measured_us": self.default_measured_us, "own_records": self.own_records}


@dataclass
class ModelPrediction:
    model: str
    library: str
    library_version: str
    device: str  # fingerprint
    ops: list[OpPrediction]
    plan_level: dict = field(default_factory=dict)
    training_rows: int = 0
    training_tasks: int = 0

    @property
    def total_us(self) -> float:
        return sum(op.predicted_us * op.nodes for op in self.ops)

    @property
    def default_total_us(self) -> float:
        return sum(op.default_predicted_us * op.nodes for op in self.ops)

    def to_json(self) -> dict:
        return {"model": self.model, "library": self.library, "library_version": self.library_version,
                "device": self.device, "plan_level": self.plan_level, "training_rows": self.training_rows,
                "training_tasks": self.training_tasks, "total_us": round(self.total_us, 3),
                "default_total_us": round(self.default_total_us, 3), "ops": [op.to_json() for op in self.ops],
                "note": "predicted by the cost model, not measured; tunable ops in isolation, summed over nodes"}


def training_rows(db, device_fingerprint: str, library_name: str, version: str) -> list[tuple[Task, dict, float]]:
    rows = []
    for task_json, record in db.all_records(device_fingerprint, library_name, version):
        if record.result.status == "ok" and record.result.median_us:
            rows.append((Task.from_json(task_json), record.config, record.result.median_us))
    return rows


def predicted_records(tasks: list[Task], library, device, rows: list[tuple[Task, dict, float]],
                      defaults: dict[str, dict], seed: int = 0, exclude_own: bool = False) -> tuple[dict, dict]:
    """Per task key, one predicted ``Record`` per config of its space (a seeded random subset of
    ``MAX_SCORED`` for larger spaces, the default always in), from a cost model trained on
    ``rows`` (task, config, time_us); what ``core/plans/plan.choose`` and ``build_plan`` take. Also
    returns how many training rows each task had of its own."""
    if not rows:
        raise KselectError("no measurements to learn from for this device and library build: tune a model first")
    import random

    rng = random.Random(seed)
    predicted: dict[str, list[Record]] = {}
    own_counts = {}
    for task in tasks:
        space = library.space(task, device)
        train = [r for r in rows if not (exclude_own and r[0].key == task.key)]
        own_counts[task.key] = sum(r[0].key == task.key for r in train)
        if not train:
            raise KselectError(f"no measurements of other tasks to predict {task.id} from")
        model = CostModel(space, seed=seed).fit(train)
        configs = list(space.enumerate())
        if len(configs) > MAX_SCORED:
            configs = rng.sample(configs, MAX_SCORED)
        default = space.normalise(defaults[task.key])
        if config_key(default) not in {config_key(c) for c in configs}:
            configs.append(default)
        times = model.predict(task, configs)
        predicted[task.key] = [
            Record(task.key, c, config_key(c), Result("ok", float(t), 0.0, 0), False, config_key(c) == config_key(default))
            for c, t in zip(configs, times)]
    return predicted, own_counts


def predict_tasks(tasks: list[Task], library, device, rows: list[tuple[Task, dict, float]],
                  defaults: dict[str, dict], seed: int = 0, exclude_own: bool = False,
                  stored: dict[str, dict[str, float]] | None = None) -> tuple[dict, list[OpPrediction]]:
    """Predictions for ``tasks`` from training ``rows`` (task, config, time_us); returns the
    plan-level assignment and one ``OpPrediction`` per task."""
    predicted, own_counts = predicted_records(tasks, library, device, rows, defaults, seed, exclude_own)
    assignment, choices = choose(tasks, predicted, {t.key: library.space(t, device).normalise(defaults[t.key])
                                                    for t in tasks}, library.plan_level_dims)
    ops = []
    for choice in choices:
        task = choice.task
        measured = (stored or {}).get(task.key, {})
        ops.append(OpPrediction(task, choice.config, choice.time_us, choice.default_config, choice.default_us,
                                measured.get(config_key(choice.config)), measured.get(config_key(choice.default_config)),
                                own_counts[task.key]))
    return assignment, ops


def predict_model(model, library, device, db, seed: int = 0, exclude_own: bool = False) -> ModelPrediction:
    """Per-op and summed latency of ``model`` on ``library``, predicted from the records in
    ``db`` (a ``RecordDB``) for this device and library build, without measuring anything."""
    version = library.version()
    tasks = library_tasks(model, library)
    rows = training_rows(db, device.fingerprint, library.name, version)
    defaults = {t.key: library.default_config(t, device) for t in tasks}
    stored = {t.key: {r.config_key: r.result.median_us for r in db.records(device.fingerprint, library.name, version, t.key)
                      if r.result.status == "ok"} for t in tasks}
    assignment, ops = predict_tasks(tasks, library, device, rows, defaults, seed, exclude_own, stored)
    return ModelPrediction(model.name, library.name, version, device.fingerprint, ops, assignment, len(rows),
                           len({r[0].key for r in rows}))


def evaluate(table, seed: int = 0) -> dict:
    """Leave-one-task-out accuracy of the cost model on a replay table: for each task, train on
    the other tasks' results and predict all of its configs. Returns the median and mean absolute
    relative error of the predicted times, and the share of tasks whose predicted-best config is
    within 2% of the task's measured best."""
    errors, hits, count = [], 0, 0
    for replay_task in table.tasks:
        others = table.prior(exclude_key=replay_task.key)
        own = [(replay_task.configs[k], r.median_us) for k, r in replay_task.results.items() if r.status == "ok"]
        if not others or not own:
            continue
        count += 1
        model = CostModel(replay_task.space, seed=seed).fit(others)
        predicted = model.predict(replay_task.task, [c for c, _ in own])
        actual = np.array([t for _, t in own])
        errors += list(np.abs(predicted - actual) / actual)
        hits += bool(actual[int(np.argmin(predicted))] <= actual.min() * 1.02)
    return {"tasks": count, "median_abs_error": float(np.median(errors)) if errors else math.nan,
            "mean_abs_error": float(np.mean(errors)) if errors else math.nan,
            "predicted_best_within_2pct": hits / max(count, 1)}
