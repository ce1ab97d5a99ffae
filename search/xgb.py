"""The XGBoost cost-model loop of the ACLTuner paper.

First ``initial`` random configs, then rounds of ``batch`` (5): the cost model's ``top`` (3)
best predicted unmeasured configs plus ``batch - top`` (2) random ones, retraining after every
round. The model is XGBoost regression with the paper's hyperparameters (``PAPER_PARAMS``).

Features per sample: the op's shape (input W, H, C, the weights' N, W, H, pads, strides, groups;
also batch, an fc flag and log2 of the MACs, which let one model span tasks of very different
size) followed by the config's encoding from the core schema (``Space.encode``). The target is
log(time / MACs): within a task this orders configs exactly as the time does, and across tasks
it is a quantity trees can share.

Transfer: the ``prior`` (results of other tasks on the same device and library build, which
the tuner passes) is added to the training data (the task's own results weigh ``own_weight``
times more), so the model guides the search from the start and far fewer random configs are
needed (``initial_with_prior``, default 0).

Options (``TuneOptions.searcher_options`` / keyword arguments): ``initial`` (default: 50, but at
most 5% of the space and at least ``batch``), ``initial_with_prior`` (default 0), ``batch`` (5),
``top`` (3), ``rounds`` (boosting rounds, 100), ``transfer`` (True), ``min_prior`` (rows needed
to use the prior, 20), ``max_prior`` (a seeded random subset of larger priors, 5000),
``own_weight`` (10), ``pool`` (most unmeasured configs scored per round, 20000).
"""

from __future__ import annotations

import math
import random as _random

import numpy as np

from kselect.core.contract.hookspecs import hookimpl
from kselect.core.contract.space import Space, config_key
from kselect.core.models.tasks import Task
from kselect.search import Searcher

# ACLTuner's XGBoost hyperparameters (native parameter names).
PAPER_PARAMS = {
    "objective": "reg:squarederror",
    "eta": 0.2,  # learning rate
    "max_depth": 9,
    "min_child_weight": 2,
    "gamma": 0,
    "alpha": 1,
    "subsample": 0.53,
    "colsample_bytree": 0.8,
    "eval_metric": "rmse",
}
ROUNDS = 100

TASK_FEATURES = ("fc", "deconv", "batch", "in_w", "in_h", "in_c", "w_n", "w_w", "w_h",
                 "pad_top", "pad_left", "pad_bottom", "pad_right", "stride_h", "stride_w", "groups", "log2_macs")


def task_features(task: Task) -> list[float]:
    """The op's shape as numbers (``TASK_FEATURES``); a fully connected layer is a 1x1 conv
    on a 1x1 image with the batch as M."""
    log_macs = math.log2(max(task.macs, 1))
    if task.kind in ("conv", "deconv"):
        n, c, h, w = task.input_shape
        kh, kw = task.attrs["kernel"]
        a = task.attrs
        return [0.0, float(task.kind == "deconv"), n, w, h, c, task.output_shape[1], kw, kh, *a["pads"], *a["strides"],
                a["group"], log_macs]
    m, k = task.input_shape
    out_n = task.weight_shape[0]
    return [1.0, 0.0, m, 1, 1, k, out_n, 1, 1, 0, 0, 0, 0, 1, 1, 1, log_macs]


def feature_names(space: Space) -> list[str]:
    return list(TASK_FEATURES) + space.feature_names()


class CostModel:
    """XGBoost regression of log(time / MACs) from task and config features, with the configs
    encoded in one target space's schema (results of other tasks are encoded in it too: their
    dimensions this space lacks are left out)."""

    def __init__(self, space: Space, seed: int = 0, params: dict | None = None, rounds: int = ROUNDS,
                 threads: int = 1):
        self.space = space
        self.params = {**PAPER_PARAMS, **(params or {}), "seed": seed, "nthread": threads, "verbosity": 0}
        self.rounds = rounds
        self.booster = None

    def features(self, task: Task, configs: list[dict]) -> np.ndarray:
        head = task_features(task)
        return np.array([head + self.space.encode(self.space.normalise(c)) for c in configs], dtype=np.float64)

    @staticmethod
    def target(task: Task, time_us: float) -> float:
        return math.log(time_us) - math.log(max(task.macs, 1))

    def matrix(self, rows: list[tuple[Task, dict, float]]) -> tuple[np.ndarray, np.ndarray]:
        """(features, targets) of (task, config, time_us) rows."""
        by_task: dict[str, tuple[Task, list[int]]] = {}
        for index, (task, _, _) in enumerate(rows):
            by_task.setdefault(task.key, (task, []))[1].append(index)
        x = np.zeros((len(rows), len(TASK_FEATURES) + len(self.space.feature_names())))
        for task, indices in by_task.values():
            x[indices] = self.features(task, [rows[i][1] for i in indices])
        y = np.array([self.target(task, time_us) for task, _, time_us in rows], dtype=np.float64)
        return x, y

    def fit_matrix(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> "CostModel":
        import xgboost

        matrix = xgboost.DMatrix(x, label=y, weight=weights)
        self.booster = xgboost.train(self.params, matrix, num_boost_round=self.rounds)
        return self

    def fit(self, rows: list[tuple[Task, dict, float]], weights: list[float] | None = None) -> "CostModel":
        """Train on (task, config, time_us) rows."""
        x, y = self.matrix(rows)
        return self.fit_matrix(x, y, None if weights is None else np.asarray(weights, dtype=np.float64))

    def predict_matrix(self, task: Task, x: np.ndarray) -> np.ndarray:
        import xgboost

        log_per_mac = self.booster.predict(xgboost.DMatrix(x))
        return np.exp(log_per_mac.astype(np.float64) + math.log(max(task.macs, 1)))

    def predict(self, task: Task, configs: list[dict]) -> np.ndarray:
        """Predicted times in microseconds."""
        if not configs:
            return np.zeros(0)
        return self.predict_matrix(task, self.features(task, configs))


class XGBSearcher(Searcher):
    name = "xgb"

    def __init__(self, space: Space, task: Task | None = None, seed: int = 0, prior=None, initial: int | None = None,
                 initial_with_prior: int = 0, batch: int = 5, top: int = 3, rounds: int = ROUNDS,
                 transfer: bool = True, min_prior: int = 20, max_prior: int = 5000, own_weight: float = 10.0,
                 pool: int = 20000, **options):
        super().__init__(space, task=task, seed=seed, prior=prior, **options)
        if not 0 <= top <= batch or batch < 1:
            raise ValueError("xgb needs batch >= 1 and 0 <= top <= batch")
        self.task = task or Task("T00", "0" * 16, "conv", [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1],
                                 {"kernel": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1],
                                  "group": 1}, False)
        self.batch, self.top, self.pool, self.own_weight = batch, top, pool, own_weight
        self.rng = _random.Random(seed)
        self.model = CostModel(space, seed=seed, rounds=rounds)
        usable_prior = [(t, c, us) for t, c, us in self.prior if us and t.key != self.task.key] if transfer else []
        if len(usable_prior) > max_prior:
            usable_prior = self.rng.sample(usable_prior, max_prior)
        self.prior_rows = usable_prior if len(usable_prior) >= min_prior else []
        self._prior_xy = self.model.matrix(self.prior_rows) if self.prior_rows else None
        if initial is None:
            initial = min(50, max(batch, math.ceil(0.05 * len(space))))
        self.initial = initial_with_prior if self.prior_rows else initial
        self.queue: list[dict] = []
        self.rounds_trained = 0
        self._all = space.enumerate()
        self._x: np.ndarray | None = None  # features of every config, computed once
        self._index = {config_key(c): i for i, c in enumerate(self._all)}
        self._done = np.zeros(len(self._all), dtype=bool)  # measured (told) configs

    def tell(self, config: dict, cost_us: float | None) -> None:
        super().tell(config, cost_us)
        index = self._index.get(config_key(config))
        if index is not None:
            self._done[index] = True

    # -- proposals --------------------------------------------------------------------------
    def _random_unmeasured(self, count: int, exclude: set[int] = frozenset()) -> list[dict]:
        if count <= 0:
            return []
        candidates = [i for i in np.flatnonzero(~self._done).tolist() if i not in exclude]
        return [self._all[i] for i in self.rng.sample(candidates, min(count, len(candidates)))]

    def _features(self) -> np.ndarray:
        if self._x is None:
            self._x = self.model.features(self.task, self._all)
        return self._x

    def _training_matrix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        ok = [(config, cost) for config, cost in self.history.values() if cost is not None and cost > 0]
        rows = [(config, cost) for config, cost in ok]
        if rows:
            # A failed or invalid config teaches the model to stay away from its neighbours:
            # it is given twice the slowest time seen on this task.
            penalty = 2 * max(cost for _, cost in ok)
            rows += [(config, penalty) for config, cost in self.history.values() if cost is None]
        if not rows and self._prior_xy is None:
            return None
        x_all = self._features()
        x = np.array([x_all[self._index[k]] if (k := config_key(c)) in self._index
                      else self.model.features(self.task, [c])[0] for c, _ in rows]).reshape(len(rows), x_all.shape[1])
        y = np.array([self.model.target(self.task, cost) for _, cost in rows], dtype=np.float64)
        if self._prior_xy is None:
            return x, y, None
        weights = np.concatenate([np.full(len(rows), self.own_weight), np.ones(len(self._prior_xy[1]))])
        return np.vstack([x, self._prior_xy[0]]), np.concatenate([y, self._prior_xy[1]]), weights

    def _model_round(self) -> list[dict]:
        training = self._training_matrix()
        if training is None:
            return self._random_unmeasured(self.batch)
        self.model.fit_matrix(*training)
        self.rounds_trained += 1
        unmeasured = np.flatnonzero(~self._done).tolist()
        if len(unmeasured) > self.pool:
            unmeasured = self.rng.sample(unmeasured, self.pool)
        self.rng.shuffle(unmeasured)  # equal predictions are taken in random order
        predicted = self.model.predict_matrix(self.task, self._features()[unmeasured])
        order = np.argsort(predicted, kind="stable")
        best = [unmeasured[i] for i in order[: self.top]]
        return [self._all[i] for i in best] + self._random_unmeasured(self.batch - len(best), set(best))

    def ask(self) -> dict | None:
        config = self.pop_unmeasured(self.queue)
        if config is not None:
            return config
        if len(self.history) < self.initial:
            round_ = self._random_unmeasured(min(self.batch, self.initial - len(self.history)))
        else:
            round_ = self._model_round()
        self.queue = list(reversed(round_))  # pop() takes from the end: best predicted first
        return self.pop_unmeasured(self.queue)


@hookimpl
def register_searchers(register):
    register("xgb", XGBSearcher)
