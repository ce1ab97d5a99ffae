"""``TuneConfig``: every option of a tune, in one frozen value that ``kselect.tune``, ``kselect tune``
and the benchmarks build, checked once when it is made.

    from kselect import TuneConfig
    config = TuneConfig(budget=8, precision="fp32,int8", max_accuracy_drop=0.02)
    result = kselect.tune("resnet18", "mlas", config=config)

A value the tune could not honour (a budget of -3 or 2.5, a time budget of nan, a minimum timing of
1e12 seconds, a metric without int8) is a ``KselectError`` naming the option, before any file is
opened or anything measured. The CLI's options map one to one onto the fields
(``--time-budget`` -> ``time_budget_s``, ``--min-time`` -> ``settings.min_time_s``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from kselect.core.errors import KselectError
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.records.fleet import DEFAULT_LEASE_S
from kselect.core.records.store import database_location

# Upper limits past which a tune cannot finish on any machine (every candidate would time out, or
# a round would never end): refused rather than run for days.
MAX_BUDGET = 1_000_000
MAX_ROUNDS = 1_000
MAX_MIN_TIME_S = 60.0
MAX_MIN_REPEATS = 100_000
MAX_SECONDS = 7 * 24 * 3600.0  # a candidate time-out, a lease, a time budget
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, option: str, value, low: int, high: int) -> None:
    if not _is_int(value):
        raise KselectError(f"{option} {value!r}: give an integer ({name})")
    if not low <= value <= high:
        raise KselectError(f"{option} {value}: must be between {low} and {high:,} ({name})")


def check_seconds(name: str, option: str, value, high: float = MAX_SECONDS) -> None:
    """A finite number of seconds above 0 and at most ``high``."""
    if not _is_number(value):
        raise KselectError(f"{option} {value!r}: give a number of seconds ({name})")
    if not math.isfinite(value) or not 0 < value <= high:
        raise KselectError(f"{option} {value}: must be above 0 and at most {high:g} seconds ({name})")


@dataclass(frozen=True)
class TuneConfig:
    """How a tune runs (every field has the CLI's default):

    - ``search``, ``budget`` (configs measured per task, the default included), ``time_budget_s``
      (the whole tune), ``seed``, ``early_stop`` (stop a task after this many samples without a
      better time), ``storage`` (an Optuna RDB URL for ``search="tpe"``);
    - ``db``: the record database (a file, a ``postgresql://`` URL, or an open ``RecordDB``; None:
      ~/.cache/kselect/records.db or $KSELECT_DB); ``lease_s``: a task claimed by a worker of a
      fleet that stopped renewing it is taken over after this long;
    - ``settings``: how each candidate is timed (``MeasureSettings``);
    - ``verify``: check plans end to end and fall back to simpler ones when slower;
      ``remeasure``: with several libraries, re-time the configs the plan chooses among first;
      ``check_rounds`` and ``check_max_rounds``: rounds of those checks;
    - ``input_shape``: ``["name=1,3,224,224"]`` for a model given by name or file;
    - ``precision`` ("fp32"; "fp32,int8", "fp32,bf16", "fp32,bf16,int8", ... or "all") and, with a
      reduced precision, ``calibration``, ``calibration_method``,
      ``max_accuracy_drop``, ``metric`` (a name or ``evaluate(outputs, feeds) -> float``) and
      ``image_preprocess``.
    """

    search: str = "xgb"
    budget: int = 16
    time_budget_s: float | None = None
    seed: int = 0
    early_stop: int | None = None
    storage: str | None = None
    db: object = None  # RecordDB | str | Path | None
    settings: MeasureSettings = field(default_factory=MeasureSettings)
    verify: bool = True
    remeasure: bool = True
    check_rounds: int = 4
    check_max_rounds: int = 10
    input_shape: tuple = ()
    precision: str | tuple = ("fp32",)
    calibration: object = None  # a folder, "samples", or an iterable of feeds
    calibration_method: str = "minmax"
    max_accuracy_drop: float = 0.01
    metric: object = None  # a metric's name, or a callable
    image_preprocess: object = None  # core/models/preprocess.ImagePreprocess
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self):
        if isinstance(self.input_shape, list):
            object.__setattr__(self, "input_shape", tuple(self.input_shape))
        self.validate()

    @classmethod
    def from_options(cls, **options) -> "TuneConfig":
        """The config of ``kselect.tune``'s keywords; an unknown keyword is refused, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise KselectError(f"kselect.tune takes no option {unknown[0]!r} (its options: {', '.join(sorted(known))})")
        return cls(**options)

    def but(self, **changes) -> "TuneConfig":
        """This config with ``changes`` (checked again)."""
        return replace(self, **changes)

    @property
    def wants_reduced(self) -> bool:
        """Whether a precision beside fp32 (int8, bf16, fp16, or "all") is asked for."""
        wanted = [p.strip() for p in self.precision.split(",")] if isinstance(self.precision, str) else list(self.precision)
        return any(p != "fp32" for p in wanted)

    def validate(self) -> None:
        """Every option on its own (what needs the model or the libraries is checked by ``tune``)."""
        if not isinstance(self.search, str) or not self.search:
            raise KselectError(f"--search {self.search!r}: give a search backend's name (search)")
        check_int("budget", "--budget", self.budget, 1, MAX_BUDGET)
        if self.time_budget_s is not None:
            check_seconds("time_budget_s", "--time-budget", self.time_budget_s)
        if not _is_int(self.seed):
            raise KselectError(f"--seed {self.seed!r}: give an integer (seed)")
        if self.early_stop is not None:
            check_int("early_stop", "--early-stop", self.early_stop, 1, MAX_BUDGET)
        if self.storage is not None:
            check_storage(self.storage)
        if isinstance(self.db, (str, Path)):
            database_location(self.db)  # an empty location or an unknown URL scheme is refused here
        if self.db is not None and not isinstance(self.db, (str, Path)) and not hasattr(self.db, "records"):
            raise KselectError(f"db {self.db!r}: give a database file, a postgresql:// URL or a RecordDB (db)")
        if not isinstance(self.settings, MeasureSettings):
            raise KselectError(f"settings {self.settings!r}: give a MeasureSettings (settings)")
        check_settings(self.settings)
        for name in ("verify", "remeasure"):
            if not isinstance(getattr(self, name), bool):
                raise KselectError(f"{name} {getattr(self, name)!r}: give True or False ({name})")
        check_int("check_rounds", "--check-rounds", self.check_rounds, 1, MAX_ROUNDS)
        check_int("check_max_rounds", "--check-max-rounds", self.check_max_rounds, 1, MAX_ROUNDS)
        if not all(isinstance(shape, str) for shape in self.input_shape):
            raise KselectError(f"--input-shape {self.input_shape!r}: give strings such as 'input=1,3,224,224' (input_shape)")
        if not isinstance(self.precision, (str, tuple, list)) or not all(
                isinstance(p, str) for p in ([self.precision] if isinstance(self.precision, str) else self.precision)):
            raise KselectError(f"--precision {self.precision!r}: give fp32, fp32,int8, fp32,bf16,int8 or all (precision)")
        if self.calibration_method not in CALIBRATION_METHODS:
            raise KselectError(f"--calibration-method {self.calibration_method!r}: choose from "
                               f"{', '.join(CALIBRATION_METHODS)} (calibration_method)")
        drop = self.max_accuracy_drop
        if not _is_number(drop) or not math.isfinite(drop) or not 0 <= drop < 1:
            raise KselectError(f"--max-accuracy-drop {drop!r}: give a drop between 0 and 1 (0.01: one point of top-1 "
                               f"agreement, or of cosine similarity) (max_accuracy_drop)")
        if self.metric is not None and not (isinstance(self.metric, str) or callable(self.metric)):
            raise KselectError(f"--metric {self.metric!r}: give a metric's name or a callable (metric)")
        if self.metric is not None and not self.wants_reduced:
            raise KselectError("--metric is for reduced precisions (their accuracy budget): add --precision fp32,int8 "
                               "(or bf16, fp16) or leave --metric out")
        check_seconds("lease_s", "--lease", self.lease_s)


def check_settings(settings: MeasureSettings) -> None:
    """How candidates are timed: finite, and within what a tune can finish."""
    check_seconds("settings.min_time_s", "--min-time", settings.min_time_s, MAX_MIN_TIME_S)
    check_seconds("settings.max_time_s", "settings.max_time_s", settings.max_time_s, MAX_SECONDS)
    check_seconds("settings.timeout_s", "--timeout", settings.timeout_s)
    check_int("settings.min_repeats", "--min-repeats", settings.min_repeats, 1, MAX_MIN_REPEATS)
    check_int("settings.warmup", "settings.warmup", settings.warmup, 0, MAX_MIN_REPEATS)
    check_int("settings.max_repeats", "settings.max_repeats", settings.max_repeats, 1, 100 * MAX_MIN_REPEATS)


def check_storage(url) -> None:
    """An Optuna storage URL: a database SQLAlchemy knows; a SQLite file's folder must exist."""
    if not isinstance(url, str) or "://" not in url:
        raise KselectError(f"--storage {url!r} is not a database URL (e.g. sqlite:///optuna.db)")
    scheme, rest = url.split("://", 1)
    if scheme.split("+", 1)[0] not in ("sqlite", "postgresql", "mysql", "oracle", "mssql"):
        raise KselectError(f"--storage {url!r} is not a database URL (e.g. sqlite:///optuna.db)")
    if scheme.startswith("sqlite") and rest.startswith("/") and rest != "/:memory:":
        folder = Path(rest[1:] or ".").expanduser().parent
        if not folder.is_dir():
            raise KselectError(f"--storage {url}: folder {folder} does not exist")
