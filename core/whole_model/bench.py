"""Whole-model latency in this process: the library's default against a plan, interleaved
(default, plan, default, plan, ...) so machine noise hits both alike, and the output comparison
every whole-model check uses. Timing each runner alone in fresh processes is core/whole_model/alone.py;
choosing among plans on those timings is core/whole_model/selection.py."""

from __future__ import annotations

import statistics
import time

import numpy as np

from kselect.core.models.model import Model
from kselect.core.plans.runtime import library_runner


def random_feeds(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs of each input's element type: standard normal floats, integers in
    [0, 255] (image bytes)."""
    import onnx

    rng = np.random.default_rng(seed)
    types = {i.name: i.type.tensor_type.elem_type for i in model.proto.graph.input}
    feeds = {}
    for name, shape in model.input_shapes.items():
        dtype = onnx.helper.tensor_dtype_to_np_dtype(types.get(name, onnx.TensorProto.FLOAT))
        if dtype == np.float32:
            feeds[name] = rng.standard_normal(shape, dtype=np.float32)
        elif np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[name] = rng.integers(0, 256, shape).astype(dtype)
    return feeds


# XNNPack's pool spins for tens of milliseconds after its last parallel loop: one run of a small
# model is not enough to outlast the spinning (measured cases: docs/tuning-protocol.md).
SETTLE_S = 0.1


def interleaved(runners: dict[str, callable], feeds: dict, rounds: int = 10, runs_per_round: int = 5,
                warmup: int = 3, settle: int = 1, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Milliseconds per run for each runner, alternating runners every few runs. After each
    switch the runner runs untimed (at least ``settle`` runs and ``settle_s`` seconds): the
    previous runner's worker threads may still be spinning on the cores (ONNX Runtime's and
    XNNPack's pools spin a while after their work), which would bill one runner for another's
    threads."""
    for run in runners.values():
        for _ in range(warmup):
            run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            settle_start, settled = time.perf_counter(), 0
            while settled < settle or time.perf_counter() - settle_start < settle_s:
                runners[name](feeds)
                settled += 1
            for _ in range(runs_per_round):
                start = time.perf_counter()
                runners[name](feeds)
                times[name].append((time.perf_counter() - start) * 1000.0)
    return times


# A run where some runner's relative interquartile range is above this was taken while the
# machine stalled threads (VMs do so for minutes at a time): the checks that choose a plan
# repeat it (measured cases: docs/tuning-protocol.md).
STEADY_SPREAD = 0.3


def steady_interleaved(runners: dict[str, callable], feeds: dict, rounds: int, runs_per_round: int,
                       attempts: int = 3) -> tuple[dict[str, list[float]], int]:
    """``interleaved``, repeated while some runner's spread is above STEADY_SPREAD (at most
    ``attempts`` runs); returns the steadiest run's times and how many runs were made."""
    best, best_spread = None, float("inf")
    for attempt in range(1, attempts + 1):
        times = interleaved(runners, feeds, rounds, runs_per_round)
        spread = max(relative_iqr(values) for values in times.values())
        if spread < best_spread:
            best, best_spread = times, spread
        if spread <= STEADY_SPREAD:
            break
    return best, attempt


# An output whose values are all tiny on random inputs (a detector's probability map, every
# sigmoid saturated near 0) is compared as if its largest magnitude were this: float32 rounding
# alone reaches 1e-2 of such an output, while a wrong plan's errors are of the values' own size.
MAGNITUDE_FLOOR = 1e-3


def compare_outputs(reference: list, candidate: list) -> float:
    """Largest error of any output relative to that output's largest magnitude (at least
    ``MAGNITUDE_FLOOR``); infinite when the outputs differ in number or shape or either holds a
    value that is not finite (``max`` would pass a NaN over as no error)."""
    if len(reference) != len(candidate):
        return float("inf")
    worst = 0.0
    for ref, out in zip(reference, candidate):
        ref, out = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
        if ref.shape != out.shape:
            return float("inf")
        if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(out))):
            return float("inf")
        if ref.size == 0:
            continue
        scale = max(float(np.max(np.abs(ref))), MAGNITUDE_FLOOR)
        worst = max(worst, float(np.max(np.abs(ref - out))) / scale)
    return worst


def bench_in_process(default_runner, plan_runner, model: Model, rounds: int = 10, runs_per_round: int = 5,
          attempts: int = 1) -> dict:
    """Default against plan. A runner, or a list of runners built separately (fresh sessions of
    one config can settle at different speeds): round r uses instance r modulo their number.
    With ``attempts`` > 1 an unsteady measurement is repeated (``steady_interleaved``)."""
    defaults = default_runner if isinstance(default_runner, list) else [default_runner]
    plans = plan_runner if isinstance(plan_runner, list) else [plan_runner]
    feeds = random_feeds(model)
    error = compare_outputs(defaults[0](feeds), plans[0](feeds))
    times: dict[str, list[float]] = {"default": [], "plan": []}
    instances = max(len(defaults), len(plans))
    for instance in range(instances):
        instance_rounds = rounds // instances + (instance < rounds % instances)
        if instance_rounds == 0:
            continue
        part, _ = steady_interleaved({"default": defaults[instance % len(defaults)], "plan": plans[instance % len(plans)]},
                                     feeds, instance_rounds, runs_per_round, attempts)
        for name in times:
            times[name] += part[name]
    default_ms, plan_ms = statistics.median(times["default"]), statistics.median(times["plan"])
    return {
        "default_ms": round(default_ms, 4),
        "plan_ms": round(plan_ms, 4),
        "speedup": round(default_ms / plan_ms, 4),
        "runs": len(times["plan"]),
        "instances": instances,
        "default_spread": round(relative_iqr(times["default"]), 4),
        "plan_spread": round(relative_iqr(times["plan"]), 4),
        "max_relative_output_error": error,
    }


def fresh_runners(library, model: Model, plan) -> list:
    """As many separately built runners as the library times fresh instances of a candidate
    (``runtime.library_runner``: nodes the library cannot run go to ONNX Runtime)."""
    return [library_runner(library, model, plan) for _ in range(library.fresh_instances)]


def relative_iqr(samples: list[float]) -> float:
    q1, q3 = np.percentile(samples, [25, 75])
    return float((q3 - q1) / statistics.median(samples))


