"""The measuring protocol shared by every library.

Each candidate runs in a child process (a crash, abort or hang there is recorded as a failed
candidate, and a fresh child takes over), on seeded random data, after a warm-up, repeated until
a minimum time has passed and the median is stable. Its output is checked against a numpy
reference; a wrong output makes the candidate invalid, never selectable.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.contract.opkind import op_kind
from kselect.core.errors import one_line
from kselect.core.models import activations
from kselect.core.models.tasks import Task
from kselect.core.precision.half import HALF_PRECISIONS, half_tolerance
from kselect.core.precision.quant import int8_tolerance, quant_params


@dataclass
class MeasureSettings:
    warmup: int = 2
    min_repeats: int = 10
    min_time_s: float = 0.1
    max_time_s: float = 1.5
    max_repeats: int = 2000
    stable_within: float = 0.03  # median of the first half vs the second half
    preempted_retries: int = 2  # timings taken again when most runs were preempted (time_candidate)
    timeout_s: float = 120.0  # per candidate, in the child
    # what a candidate may allocate beyond what the measuring child holds before building it
    # (core/measuring/worker.memory_cap); None: three quarters of the memory available when the child starts
    candidate_memory_mb: int | None = None


# -- data and reference -------------------------------------------------------------------
def task_inputs(task: Task) -> dict[str, np.ndarray]:
    """Seeded random data in the task's canonical layouts (its op kind's ``inputs``: conv x NCHW,
    w OIHW; fc x (M, K), w (N, K)), the same in every process."""
    rng = np.random.default_rng(int(task.key, 16) % (2**32))
    return op_kind(task.kind).inputs(task, rng)


def reference_output(task: Task, inputs: dict[str, np.ndarray]) -> np.ndarray:
    y = op_kind(task.kind).reference(task, inputs)
    return activations.reference(task.epilogue, y)


def task_model(task: Task, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The task as a one-op ONNX model (Conv, ConvTranspose, or Gemm with transB, then its
    epilogue) on the task's weights: for a library whose runner takes graphs. Node "op" reads "x",
    writes "y"; a 1-D conv's "x", "y" and weights are 3-D, as in the model."""
    out = "op_out" if task.epilogue else "y"
    node, x_shape, y_shape, weights = op_kind(task.kind).onnx_op(task, inputs, out)
    initializers = [numpy_helper.from_array(weights, "w")]
    if "b" in inputs:
        initializers.append(numpy_helper.from_array(inputs["b"], "b"))
    nodes, constants = activations.onnx_nodes(task.epilogue, out, "y")
    graph = helper.make_graph([node, *nodes], "op", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializers + constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    if output is None or output.shape != reference.shape:
        return float("inf")
    if not np.all(np.isfinite(output)):
        return float("inf")
    scale = max(float(np.max(np.abs(reference))), 1e-12)
    return float(np.max(np.abs(output.astype(np.float64) - reference))) / scale


# -- timing -------------------------------------------------------------------------------
def time_candidate(run, settings: MeasureSettings, before_each=None) -> list[float]:
    """Sample times in microseconds of ``run()``, after warm-up, until enough and stable.
    ``before_each()``, if given, runs untimed before every timed run (e.g. a cache flush).

    Samples taken while another process held a core this one's threads needed are not the
    candidate's: a thread of a parallel loop waits for its turn on the scheduler, and on a
    machine with a 125 Hz tick a 1 ms two-thread convolution reads 8 ms, every run alike. So
    when most runs were preempted (this process switched out involuntarily during them), the
    timing is taken again after a pause, up to ``settings.preempted_retries`` times, and the
    least preempted attempt is kept."""
    best: tuple[float, list[float]] | None = None
    for attempt in range(settings.preempted_retries + 1):
        if attempt:
            time.sleep(PREEMPTED_PAUSE_S)
        samples, preempted = _samples(run, settings, before_each)
        if best is None or preempted < best[0]:
            best = (preempted, samples)
        if preempted <= PREEMPTED_LIMIT:
            break
    return best[1]


# A timing is taken again when more than this share of its runs were preempted.
PREEMPTED_LIMIT = 0.5
PREEMPTED_PAUSE_S = 0.05


def _involuntary_switches() -> int:
    """Involuntary context switches of this process so far, all its threads together."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def _samples(run, settings: MeasureSettings, before_each) -> tuple[list[float], float]:
    """One timing (``time_candidate``): its samples, and the share of runs that were preempted."""
    for _ in range(settings.warmup):
        run()
    samples: list[float] = []
    preempted = 0
    start = time.perf_counter()
    while True:
        if before_each is not None:
            before_each()
        switches = _involuntary_switches()
        t0 = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
        preempted += _involuntary_switches() > switches
        elapsed = time.perf_counter() - start
        if len(samples) < max(settings.min_repeats, 2) or elapsed < settings.min_time_s:
            continue  # (two at least: the stability check compares two halves)
        if elapsed >= settings.max_time_s or len(samples) >= settings.max_repeats:
            break
        half = len(samples) // 2
        first, second = statistics.median(samples[:half]), statistics.median(samples[half:])
        if abs(first - second) <= settings.stable_within * statistics.median(samples):
            break
    return samples, preempted / len(samples)


def summarise(times_per_instance: list[list[float]]) -> dict:
    """Median of the per-instance medians; spread = the larger of the pooled interquartile
    range and the range of instance medians, both relative to the median."""
    medians = [statistics.median(times) for times in times_per_instance]
    median = statistics.median(medians)
    pooled = sorted(t for times in times_per_instance for t in times)
    q1, q3 = np.percentile(pooled, [25, 75])
    if median <= 0:  # work that costs nothing (a conversion the runner skips)
        return {"median_us": 0.0, "spread": 0.0, "count": len(pooled)}
    spread = max((q3 - q1) / median, (max(medians) - min(medians)) / median)
    return {"median_us": median, "spread": float(spread), "count": len(pooled)}


@dataclass
class Result:
    status: str  # "ok", "invalid" (wrong output), "failed" (error, crash, time-out)
    median_us: float | None = None
    spread: float | None = None
    count: int = 0
    error: float | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def measure_in_this_process(library, task: Task, config: dict, settings: MeasureSettings, cache: dict,
                            limits=contextlib.nullcontext) -> Result:
    """Measure one candidate here; ``limits()`` is entered around the candidate alone (not the
    task's data and reference, shared by its candidates)."""
    if task.key not in cache:
        cache.clear()  # keep one task's data at a time
        inputs = task_inputs(task)
        reference = reference_output(task, inputs)
        tolerance = None
        if task.precision == "int8":
            inputs["quant"] = quant_params(task, inputs, reference)
            tolerance = int8_tolerance(task, inputs, reference, inputs["quant"])
        elif task.precision in HALF_PRECISIONS:
            tolerance = half_tolerance(task, inputs, reference, task.precision,
                                       accumulates_in_format=task.precision in library.accumulates_in_half)
        cache[task.key] = (inputs, reference, tolerance)
    inputs, reference, precision_allowed = cache[task.key]
    try:
        with limits():
            measured = op_kind(task.kind).measure(library, task, config, inputs, settings)
    except MemoryError:
        return Result("failed", reason="out of memory: the candidate allocated past its memory cap")
    except Exception as exc:
        return Result("failed", reason=one_line(exc)[:300])
    error = relative_error(measured["output"], reference)
    summary = summarise(measured["times_us"])
    tolerance = op_kind(task.kind).tolerance(task)
    computes_in = library.computes_in(task, config)
    if tolerance is None and computes_in != task.precision and computes_in in HALF_PRECISIONS:
        tolerance = half_tolerance(task, inputs, reference, computes_in,
                                   accumulates_in_format=computes_in in library.accumulates_in_half)
    if tolerance is None:
        tolerance = precision_allowed if precision_allowed is not None else library.tolerance(task, config)
    if not error <= tolerance:
        return Result("invalid", error=error, reason=f"output differs from reference: error {error:.2e} > {tolerance:.2e}", **summary)
    return Result("ok", error=error, **summary)
