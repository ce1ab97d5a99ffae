"""Optuna's TPE sampler over a kselect space.

Mapping: a ``Categorical`` dim becomes a categorical distribution (choices that are not plain
scalars are given as JSON text), an ``Integer`` an int distribution (low, high, step), a
``WorkloadSplit`` a categorical over its splits, one parameter per number of parts
(``shares@4``), since its choices depend on an earlier dimension. Conditional dims are suggested
only when their condition holds, in the space's order (Optuna's ``group`` decomposition handles
the resulting dynamic space). A config that breaks a constraint, or whose measurement failed, is
told to Optuna as infeasible (a constraint value of 1), so TPE learns to avoid it.

Optuna re-proposes points in discrete spaces: a proposal that was measured already (or breaks a
constraint) is recorded in the study (a FAIL trial with ``user_attrs["duplicate"]``, or an
infeasible one) and asked again; after ``retries`` such proposals in a row, an unmeasured config
is enqueued instead (``user_attrs["proposed_by"]`` says so): by default one nearest one of the
three best configs measured so far. So the searcher never proposes a config it has been told about.

Once a few good configs are known, TPE's argmax of l(x)/g(x) over a discrete space is nearly
always one of them again (its categorical kernels put most mass on the observed values), so on
spaces of a few hundred configs most samples come from this fallback: it has to be a good local
search. Stepping from one of the three best configs (to a neighbour differing in the fewest dims)
is; stepping from TPE's last, repeated proposal (any of the top ~10% of configs) wanders, and
missed the 2% target in 16% of runs on the XNNPack table; stepping from the best config only is
greedy and stalls in local optima (4% of runs).

Options: ``storage`` (an Optuna storage URL such as ``sqlite:///optuna.db``, or the fleet's
``postgresql://`` database: the study is kept
there, resumes, and can be inspected with Optuna's own tools, e.g. optuna-dashboard),
``study_name`` (default ``kselect-<task key>-<space digest>``), ``startup`` (random configs before
TPE takes over, default 10 as in Optuna), ``retries`` (5), ``multivariate`` (True),
``fallback`` (after ``retries`` repeats, the unmeasured config "best": nearest one of the three
best configs measured, the default; "nearest": nearest TPE's last proposal; "random"), ``uniform_start``
(False: Optuna's start, which gives each branch of a conditional dim the same chance; True: the
start configs uniform over the valid configs, better where small branches are bad, e.g. MLAS's
NCHW branch next to NCHWc with five channel batches).
"""

from __future__ import annotations

import hashlib
import json
import random as _random
import warnings

from kselect.core.contract.hookspecs import hookimpl
from kselect.core.contract.space import Integer, Space, WorkloadSplit, _applies, config_key
from kselect.core.models.tasks import Task
from kselect.search import Searcher

PENALTY = 1e30  # the value of an infeasible trial; it is ranked by its constraint, not by this


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _choice(value):
    return value if _plain(value) else json.dumps(value)


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class SpaceMapping:
    """A kselect space as Optuna parameters and distributions, both ways."""

    def __init__(self, space: Space):
        self.space = space

    def param_name(self, dim, partial: dict) -> str:
        if isinstance(dim, WorkloadSplit):
            return f"{dim.name}@{dim._parts(partial)}"
        return dim.name

    def distribution(self, dim, partial: dict):
        from optuna.distributions import CategoricalDistribution, IntDistribution

        if isinstance(dim, Integer):
            return IntDistribution(dim.low, dim.high, step=dim.step)
        return CategoricalDistribution([_choice(v) for v in dim.values(partial)])

    def decode(self, dim, value):
        if isinstance(dim, Integer):
            return int(value)
        if isinstance(dim, WorkloadSplit):
            return _tuples(json.loads(value))
        return value if any(value == c and type(value) is type(c) for c in dim.choices) \
            else _tuples(json.loads(value))

    def suggest(self, trial) -> dict:
        """Suggest a config on an Optuna trial, dimension by dimension."""
        config: dict = {}
        for dim in self.space.dims:
            if not _applies(dim.when, config):
                continue
            name = self.param_name(dim, config)
            if isinstance(dim, Integer):
                value = trial.suggest_int(name, dim.low, dim.high, step=dim.step)
            else:
                value = trial.suggest_categorical(name, [_choice(v) for v in dim.values(config)])
            config[dim.name] = self.decode(dim, value)
        return config

    def params(self, config: dict) -> tuple[dict, dict]:
        """(params, distributions) of a config, for ``optuna.trial.create_trial`` or
        ``enqueue_trial``."""
        params, distributions, partial = {}, {}, {}
        for dim in self.space.dims:
            if dim.name not in config or not _applies(dim.when, partial):
                continue
            value = config[dim.name]
            name = self.param_name(dim, partial)
            params[name] = int(value) if isinstance(dim, Integer) else _choice(value)
            distributions[name] = self.distribution(dim, partial)
            partial[dim.name] = value
        return params, distributions


def space_digest(space: Space) -> str:
    text = json.dumps([[type(d).__name__, repr(d)] for d in space.dims])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _sqlalchemy_url(storage: str | None) -> str | None:
    """A PostgreSQL URL as given to ``--db`` names SQLAlchemy's psycopg 2 driver; kselect's is psycopg 3."""
    for scheme in ("postgresql://", "postgres://"):
        if storage and storage.startswith(scheme):
            return "postgresql+psycopg://" + storage[len(scheme):]
    return storage


class TPESearcher(Searcher):
    name = "tpe"

    def __init__(self, space: Space, task: Task | None = None, seed: int = 0, prior=None, storage: str | None = None,
                 study_name: str | None = None, study_prefix: str = "", startup: int | None = None, retries: int = 5,
                 multivariate: bool = True, fallback: str = "best", uniform_start: bool = False,
                 **options):
        super().__init__(space, task=task, seed=seed, prior=prior, **options)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.mapping = SpaceMapping(space)
        self.retries = retries
        if fallback not in ("best", "nearest", "random"):
            raise ValueError(f"tpe: fallback must be 'best', 'nearest' or 'random', not {fallback!r}")
        self.fallback = fallback
        self.uniform_start = uniform_start
        self.rng = _random.Random(seed)
        self.pending: dict[str, object] = {}  # config key -> the Optuna trial it was proposed on
        self._all: list[dict] | None = None  # the space's configs, their keys and codes (for fallbacks)
        self._value_index: dict[str, dict] = {}
        self.startup = startup = 10 if startup is None else startup
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate and group are marked experimental
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=multivariate,
                                                 group=multivariate)
        task_key = task.key if task is not None else "task"
        self.study_name = study_name or f"kselect-{study_prefix}{task_key}-{space_digest(space)}"
        self.study = optuna.create_study(storage=_sqlalchemy_url(storage), study_name=self.study_name, sampler=sampler,
                                         direction="minimize", load_if_exists=True)
        # Configs with a result in the study already (a resumed tune with the same storage).
        self.in_study = {t.user_attrs.get("config_key") for t in self.study.get_trials(deepcopy=False)
                         if t.state.is_finished() and t.user_attrs.get("config_key")
                         and not t.user_attrs.get("duplicate")}

    # -- telling ----------------------------------------------------------------------------
    def _finish(self, trial, key: str, cost_us: float | None) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("config_key", key)
        trial.set_constraint("valid", 0.0 if cost_us is not None else 1.0)
        if cost_us is None and "infeasible" not in trial.user_attrs:
            trial.set_user_attr("infeasible", "failed or invalid when measured")
        self.study.tell(trial, cost_us if cost_us is not None else PENALTY, state=TrialState.COMPLETE)
        self.in_study.add(key)

    def tell(self, config: dict, cost_us: float | None) -> None:
        super().tell(config, cost_us)
        key = config_key(config)
        trial = self.pending.pop(key, None)
        if trial is not None:
            self._finish(trial, key, cost_us)
        elif key not in self.in_study:
            import optuna

            params, distributions = self.mapping.params(config)
            try:
                trial = optuna.trial.create_trial(
                    params=params, distributions=distributions, value=cost_us if cost_us is not None else PENALTY,
                    user_attrs={"config_key": key, "told": True},
                    system_attrs={"constraints:valid": 0.0 if cost_us is not None else 1.0})
            except ValueError:  # a stored config outside today's space: remembered, not shown to TPE
                return
            self.study.add_trial(trial)
            self.in_study.add(key)

    # -- asking -----------------------------------------------------------------------------
    def _reject(self, trial, reason: str, key: str) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr(reason, True)
        trial.set_user_attr("config_key", key)
        self.study.tell(trial, state=TrialState.FAIL)

    def _codes(self, config: dict) -> list[float]:
        """Numbers per dim for distances: a value's index (an integer dim: its value scaled to
        0..1), -1 where the dim is inactive."""
        codes = []
        for dim in self.space.dims:
            value = config.get(dim.name)
            if value is None:
                codes.append(-1.0)
            elif isinstance(dim, Integer):
                codes.append((value - dim.low) / max(dim.high - dim.low, 1))
            else:
                codes.append(float(self._value_index.setdefault(dim.name, {}).setdefault(_choice(value), len(self._value_index[dim.name]))))
        return codes

    def _nearest_unmeasured(self, last: dict | None) -> dict | None:
        import numpy as np

        if self._all is None:
            self._all = self.space.enumerate()
            self._keys = [config_key(c) for c in self._all]
            self._matrix = np.array([self._codes(c) for c in self._all]).reshape(len(self._all), len(self.space.dims))
            self._integer = np.array([isinstance(d, Integer) for d in self.space.dims])
        free = np.array([k not in self.history and k not in self.pending for k in self._keys], dtype=bool)
        candidates = np.flatnonzero(free)
        if candidates.size == 0:
            return None
        if last is None:
            return self._all[int(self.rng.choice(candidates.tolist()))]
        target = np.array(self._codes(last))
        rows = self._matrix[candidates]
        integer_part = np.where((rows >= 0) & (target >= 0), np.abs(rows - target), (rows != target).astype(float))
        distance = np.where(self._integer, integer_part, (rows != target).astype(float)).sum(axis=1)
        nearest = candidates[distance == distance.min()].tolist()
        return self._all[self.rng.choice(nearest)]

    def _enqueue(self, config: dict, why: str) -> dict:
        params, _ = self.mapping.params(config)
        self.study.enqueue_trial(params, user_attrs={"proposed_by": why}, skip_if_exists=False)
        trial = self.study.ask()
        config = self.mapping.suggest(trial)  # the enqueued params
        self.pending[config_key(config)] = trial
        return config

    def ask(self) -> dict | None:
        # Unfinished proposals (asked, never told) stay open in the study; they are not re-asked.
        if self.uniform_start and len(self.in_study) < self.startup:
            # Optuna's own start samples each parameter independently: every branch of a
            # conditional dim (e.g. each algorithm) is equally likely, however few configs it has.
            # This start is uniform over valid configs instead.
            config = self._nearest_unmeasured(None)
            return None if config is None else self._enqueue(config, "uniform start")
        last = None
        for _ in range(self.retries):
            trial = self.study.ask()
            config = self.mapping.suggest(trial)
            key = config_key(config)
            if self.measured(config) or key in self.pending:
                self._reject(trial, "duplicate", key)
                last = config
            elif not self.space.is_valid(config):
                trial.set_user_attr("infeasible", "breaks a constraint")
                self._finish(trial, key, None)
                last = config
            else:
                self.pending[key] = trial
                return config
        # TPE keeps proposing measured points: take an unmeasured config nearest one of the three
        # best configs measured so far (or nearest TPE's last proposal, or a random one).
        if self.fallback == "best":
            ranked = sorted(((cost, c) for c, cost in self.history.values() if cost is not None),
                            key=lambda item: item[0])
            last = self.rng.choice(ranked[:3])[1] if ranked else last
        config = self._nearest_unmeasured(None if self.fallback == "random" else last)
        return None if config is None else self._enqueue(config, f"{self.fallback} unmeasured after {self.retries} repeats")


@hookimpl
def register_searchers(register):
    register("tpe", TPESearcher)
