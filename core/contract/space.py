"""The configuration-space schema every library plugin describes its op spaces with.

A ``Space`` is an ordered list of dimensions. A dimension may apply only when earlier ones
have given values (``when={"method": ["GEMM"]}``), and constraints remove configurations that
a kernel cannot run (``space.constrain("K <= 8 and N % 4 == 0", lambda c: ...)``). A config is a
plain ``dict`` holding only its active dimensions; ``config_key`` makes it a stable string, and
``Space.encode`` turns it into numbers for cost models.

Dimension kinds (``Categorical.role`` says what a categorical dim selects: algorithm,
micro-kernel, memory arrangement, layout, or a library knob):
- ``Categorical``: unordered choices;
- ``Integer``: ordered whole numbers (threads);
- ``WorkloadSplit``: shares of work per thread or per core cluster, in steps of 1/granularity.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

ROLES = ("algorithm", "micro-kernel", "memory", "layout", "precision", "knob")


def config_key(config: dict) -> str:
    """A stable text key: the config as canonical JSON."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _applies(when: dict | None, partial: dict) -> bool:
    if not when:
        return True
    return all(partial.get(name) in allowed for name, allowed in when.items())


@dataclass(frozen=True)
class Categorical:
    name: str
    choices: tuple
    role: str = "knob"
    when: dict | None = None
    default: Any = None

    def values(self, partial: dict) -> list:
        return list(self.choices)

    def describe(self) -> str:
        return ", ".join(str(c) for c in self.choices)

    def width(self) -> int:
        return len(self.choices)

    def encode(self, value) -> list[float]:
        return [1.0 if value == choice else 0.0 for choice in self.choices]


@dataclass(frozen=True)
class Integer:
    name: str
    low: int
    high: int
    step: int = 1
    when: dict | None = None
    default: Any = None
    role: str = "knob"

    def values(self, partial: dict) -> list:
        return list(range(self.low, self.high + 1, self.step))

    def describe(self) -> str:
        return f"{self.low}..{self.high}" + (f" step {self.step}" if self.step != 1 else "")

    def width(self) -> int:
        return 1

    def encode(self, value) -> list[float]:
        return [float(value)]


@dataclass(frozen=True)
class WorkloadSplit:
    """Shares of each kernel's work, one per part; parts come from a fixed number or from the
    value of another dimension (``parts_from="threads"``). Shares are whole multiples of
    1/granularity and sum to 1; the even split is always offered."""

    name: str
    granularity: int = 8
    parts: int | None = None
    parts_from: str | None = None
    max_parts: int = 8
    when: dict | None = None
    default: Any = None
    role: str = "knob"

    def _parts(self, partial: dict) -> int:
        return int(partial[self.parts_from]) if self.parts_from else int(self.parts)

    def values(self, partial: dict) -> list:
        parts = self._parts(partial)
        if parts == 1:
            return [(1.0,)]
        splits = {tuple(round(1.0 / parts, 6) for _ in range(parts))}
        g = self.granularity
        for cut in itertools.combinations(range(1, g), parts - 1):
            bounds = (0,) + cut + (g,)
            splits.add(tuple(round((b - a) / g, 6) for a, b in zip(bounds, bounds[1:])))
        return sorted(splits)

    def describe(self) -> str:
        source = f"parts = {self.parts_from}" if self.parts_from else f"{self.parts} parts"
        return f"shares in steps of 1/{self.granularity}, {source}"

    def width(self) -> int:
        return self.max_parts

    def encode(self, value) -> list[float]:
        shares = list(value)[: self.max_parts]
        return shares + [0.0] * (self.max_parts - len(shares))


Dimension = Categorical | Integer | WorkloadSplit


@dataclass
class Constraint:
    text: str
    predicate: Callable[[dict], bool]


@dataclass
class Space:
    dims: list = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    _cache: list | None = field(default=None, repr=False, compare=False)

    def add(self, dim) -> "Space":
        for earlier in [dim.when or {}, {dim.parts_from: None} if getattr(dim, "parts_from", None) else {}]:
            for name in earlier:
                if name not in {d.name for d in self.dims}:
                    raise ValueError(f"dimension {dim.name!r} depends on {name!r}, which must come first")
        self.dims.append(dim)
        self._cache = None
        return self

    def constrain(self, text: str, predicate: Callable[[dict], bool]) -> "Space":
        self.constraints.append(Constraint(text, predicate))
        self._cache = None
        return self

    def dim(self, name: str):
        return next(d for d in self.dims if d.name == name)

    # -- enumeration, counting, sampling -------------------------------------------------
    def _expand(self, index: int, partial: dict) -> Iterator[dict]:
        if index == len(self.dims):
            yield dict(partial)
            return
        dim = self.dims[index]
        if not _applies(dim.when, partial):
            yield from self._expand(index + 1, partial)
            return
        for value in dim.values(partial):
            partial[dim.name] = value
            yield from self._expand(index + 1, partial)
            del partial[dim.name]

    def is_valid(self, config: dict) -> bool:
        return all(c.predicate(config) for c in self.constraints)

    def enumerate(self) -> list[dict]:
        if self._cache is None:
            self._cache = [c for c in self._expand(0, {}) if self.is_valid(c)]
        return self._cache

    def __len__(self) -> int:
        return len(self.enumerate())

    def __contains__(self, config: dict) -> bool:
        return config_key(config) in {config_key(c) for c in self.enumerate()}

    def sample(self, rng: random.Random, count: int = 1) -> list[dict]:
        """Uniform samples over valid configurations (with replacement)."""
        configs = self.enumerate()
        return [dict(rng.choice(configs)) for _ in range(count)] if configs else []

    # -- cost-model features --------------------------------------------------------------
    def feature_names(self) -> list[str]:
        names = []
        for dim in self.dims:
            if isinstance(dim, Categorical):
                names += [f"{dim.name}={c}" for c in dim.choices]
            elif isinstance(dim, WorkloadSplit):
                names += [f"{dim.name}[{i}]" for i in range(dim.max_parts)]
            else:
                names.append(dim.name)
        return names

    def encode(self, config: dict) -> list[float]:
        """Numbers for a cost model: one-hot categoricals, integers as they are, split shares
        padded; an inactive dimension encodes as zeros (integers as -1)."""
        features: list[float] = []
        for dim in self.dims:
            if dim.name in config:
                features += dim.encode(config[dim.name])
            elif isinstance(dim, Integer):
                features.append(-1.0)
            else:
                features += [0.0] * dim.width()
        return features

    def normalise(self, config: dict) -> dict:
        """A config as stored in JSON (tuples become lists) turned back into the space's values."""
        out = {}
        for dim in self.dims:
            if dim.name in config:
                value = config[dim.name]
                out[dim.name] = tuple(value) if isinstance(dim, WorkloadSplit) else value
        return out

    def describe(self) -> list[dict]:
        rows = []
        for dim in self.dims:
            rows.append({
                "name": dim.name,
                "kind": type(dim).__name__,
                "role": dim.role,
                "values": dim.describe(),
                "when": dim.when or {},
            })
        return rows

