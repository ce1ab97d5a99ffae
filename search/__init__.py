"""Search backends: one small ask/tell interface, one module per strategy.

The tuner first ``tell``s a searcher every stored result of the task (so a resumed tune picks
up where it stopped), then alternates ``ask`` (a config not measured yet, or None when the
searcher has nothing more to propose) and ``tell`` (its time in microseconds, or None when the
candidate was invalid or failed). A searcher never proposes a config it has been told about.
``prior`` holds results of other tasks on the same device and library build, for searchers
that transfer what they learnt; ``options`` are backend-specific (``--storage`` for tpe).
"""

from __future__ import annotations

import inspect

from kselect.core.contract.space import Space, config_key
from kselect.core.errors import KselectError
from kselect.core.models.tasks import Task


class Searcher:
    name = ""

    def __init__(self, space: Space, task: Task | None = None, seed: int = 0,
                 prior: list[tuple[Task, dict, float]] | None = None, **options):
        self.space = space
        self.task = task
        self.seed = seed
        self.prior = prior or []  # (task, config, time_us) measured on other tasks, same device and library
        type(self).check_options(options)
        self.history: dict[str, tuple[dict, float | None]] = {}

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Refuses options no ``__init__`` of this class or its bases names: an unknown option
        is a mistake to report, not a setting to ignore."""
        known = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                known |= {p.name for p in inspect.signature(init).parameters.values()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        known -= {"self", "space", "task", "seed", "prior"}
        unknown = sorted(set(options) - known)
        if unknown:
            name = cls.name or cls.__name__
            raise KselectError(f"search {name!r} takes no option {', '.join(map(repr, unknown))} "
                               f"(its options: {', '.join(sorted(known)) or 'none'})")

    def measured(self, config: dict) -> bool:
        return config_key(config) in self.history

    def tell(self, config: dict, cost_us: float | None) -> None:
        self.history[config_key(config)] = (config, cost_us)

    def ask(self) -> dict | None:
        raise NotImplementedError

    def unmeasured(self) -> list[dict]:
        return [c for c in self.space.enumerate() if not self.measured(c)]

    def pop_unmeasured(self, queue: list[dict]) -> dict | None:
        """Take configs from the end of ``queue`` until one not measured yet."""
        while queue:
            config = queue.pop()
            if not self.measured(config):
                return config
        return None
