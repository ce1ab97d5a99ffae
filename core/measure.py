"""The measuring protocol shared by every library.

Each candidate runs in a child process (a crash, abort or hang there is recorded as a failed
candidate, and a fresh child takes over), on seeded random data, after a warm-up, repeated until
a minimum time has passed and the median is stable. Its output is checked against a numpy
reference; a wrong output makes the candidate invalid, never selectable.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core import activations
from kselect.core.errors import one_line
from kselect.core.tasks import Task


# A conversion moves values, it never computes: anything beyond float rounding noise is wrong.
CONVERSION_TOLERANCE = 1e-6


@dataclass
class MeasureSettings:
    warmup: int = 2
    min_repeats: int = 10
    min_time_s: float = 0.1
    max_time_s: float = 1.5
    max_repeats: int = 2000
    stable_within: float = 0.03  # median of the first half vs the second half
    timeout_s: float = 120.0  # per candidate, in the child
    # what a candidate may allocate beyond what the measuring child holds before building it
    # (core/worker.memory_cap); None: three quarters of the memory available when the child starts
    candidate_memory_mb: int | None = None


# -- data and reference -------------------------------------------------------------------
def task_inputs(task: Task) -> dict[str, np.ndarray]:
    """Seeded random data in the task's canonical layouts: conv x NCHW, w OIHW; fc x (M, K),
    w (N, K). Random values matter: some kernels run faster on zeros."""
    rng = np.random.default_rng(int(task.key, 16) % (2**32))
    if task.kind == "convert":  # a layout conversion: the tensor alone
        return {"x": rng.standard_normal(task.input_shape, dtype=np.float32)}
    weight_shape = task.weight_shape
    fan_in = int(np.prod(weight_shape[1:]))
    if task.kind == "deconv":  # an output pixel sums over C_in / stride^2 of the kernel's taps
        fan_in = max(1, int(np.prod(weight_shape)) // output_channels(task) // int(np.prod(task.attrs["strides"])))
    inputs = {
        "x": rng.standard_normal(task.input_shape, dtype=np.float32),
        "w": (rng.standard_normal(weight_shape, dtype=np.float32) * np.sqrt(2.0 / fan_in)).astype(np.float32),
    }
    if task.has_bias:
        inputs["b"] = (rng.standard_normal(output_channels(task), dtype=np.float32) * 0.1).astype(np.float32)
    return inputs


def output_channels(task: Task) -> int:
    if task.kind == "deconv":
        return task.weight_shape[1] * task.attrs["group"]
    return task.weight_shape[0]


def conv_reference(x, w, b, strides, pads, dilations, group) -> np.ndarray:
    """Direct convolution in float64 (NCHW, OIHW, pads [top, left, bottom, right])."""
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span_h, span_w = (kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1
    windows = np.lib.stride_tricks.sliding_window_view(x, (span_h, span_w), axis=(2, 3))
    windows = windows[:, :, :: strides[0], :: strides[1], :: dilations[0], :: dilations[1]]
    oh, ow = windows.shape[2], windows.shape[3]
    windows = windows.reshape(n, group, cg, oh, ow, kh, kw)
    weights = w.astype(np.float64).reshape(group, o // group, cg, kh, kw)
    y = np.einsum("ngchwij,gocij->ngohw", windows, weights, optimize=True).reshape(n, o, oh, ow)
    if b is not None:
        y += b.astype(np.float64).reshape(1, -1, 1, 1)
    return y


def deconv_reference(x, w, b, strides, pads, dilations, group, output_padding) -> np.ndarray:
    """Transposed convolution in float64 (NCHW; weights [C_in, C_out / group, kH, kW] as ONNX
    has them): each input pixel adds its kernel-sized patch, then the pads are cropped."""
    n, cin, h, wd = x.shape
    _, cog, kh, kw = w.shape
    full_h = (h - 1) * strides[0] + (kh - 1) * dilations[0] + 1 + output_padding[0]
    full_w = (wd - 1) * strides[1] + (kw - 1) * dilations[1] + 1 + output_padding[1]
    full = np.zeros((n, group, cog, full_h, full_w))
    xg = x.astype(np.float64).reshape(n, group, cin // group, h, wd)
    wg = w.astype(np.float64).reshape(group, cin // group, cog, kh, kw)
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilations[0], j * dilations[1]
            rows = slice(top, top + (h - 1) * strides[0] + 1, strides[0])
            columns = slice(left, left + (wd - 1) * strides[1] + 1, strides[1])
            full[:, :, :, rows, columns] += np.einsum("ngchw,gco->ngohw", xg, wg[:, :, :, i, j], optimize=True)
    y = full.reshape(n, group * cog, full_h, full_w)[:, :, pads[0]:full_h - pads[2], pads[1]:full_w - pads[3]]
    if b is not None:
        y = y + b.astype(np.float64).reshape(1, -1, 1, 1)
    return y


def reference_output(task: Task, inputs: dict[str, np.ndarray]) -> np.ndarray:
    if task.kind == "convert":  # a conversion changes the layout, never the values
        return inputs["x"].astype(np.float64)
    if task.kind == "conv":
        a = task.attrs
        y = conv_reference(inputs["x"], inputs["w"], inputs.get("b"), a["strides"], a["pads"], a["dilations"], a["group"])
    elif task.kind == "deconv":
        a = task.attrs
        y = deconv_reference(inputs["x"], inputs["w"], inputs.get("b"), a["strides"], a["pads"], a["dilations"],
                             a["group"], a["output_padding"])
    else:
        y = task.attrs["alpha"] * (inputs["x"].astype(np.float64) @ inputs["w"].astype(np.float64).T)
        if "b" in inputs:
            y += task.attrs["beta"] * inputs["b"].astype(np.float64)
    return activations.reference(task.epilogue, y)


def task_model(task: Task, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The task as a one-op ONNX model (Conv, ConvTranspose, or Gemm with transB, then its
    epilogue) on the task's weights: for a library whose runner takes graphs. Node "op" reads "x",
    writes "y"; a 1-D conv's "x", "y" and weights are 3-D, as in the model."""
    a = task.attrs
    x_shape, y_shape, weights = task.input_shape, task.output_shape, inputs["w"]
    node_inputs = ["x", "w"] + (["b"] if "b" in inputs else [])
    out = "op_out" if task.epilogue else "y"
    if task.conv1d:
        x_shape, y_shape, weights = as_conv1d(x_shape), as_conv1d(y_shape), weights[:, :, 0, :]
        node = helper.make_node("Conv", node_inputs, [out], name="op", kernel_shape=a["kernel"][1:],
                                strides=a["strides"][1:], pads=[a["pads"][1], a["pads"][3]],
                                dilations=a["dilations"][1:], group=a["group"])
    elif task.kind == "conv":
        node = helper.make_node("Conv", node_inputs, [out], name="op", kernel_shape=a["kernel"], strides=a["strides"],
                                pads=a["pads"], dilations=a["dilations"], group=a["group"])
    elif task.kind == "deconv":
        node = helper.make_node("ConvTranspose", node_inputs, [out], name="op", kernel_shape=a["kernel"],
                                strides=a["strides"], pads=a["pads"], dilations=a["dilations"], group=a["group"],
                                output_padding=a["output_padding"])
    else:
        node = helper.make_node("Gemm", node_inputs, [out], name="op", transB=1, alpha=a["alpha"], beta=a["beta"])
    initializers = [numpy_helper.from_array(weights, "w")]
    if "b" in inputs:
        initializers.append(numpy_helper.from_array(inputs["b"], "b"))
    nodes, constants = activations.onnx_nodes(task.epilogue, out, "y")
    graph = helper.make_graph([node, *nodes], "op", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializers + constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def as_conv1d(shape: list[int]) -> list[int]:
    """A 1-D conv's tensor shape from its task's height-1 form: [N, C, 1, W] -> [N, C, W]."""
    return [shape[0], shape[1], shape[3]]


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
    ``before_each()``, if given, runs untimed before every timed run (e.g. a cache flush)."""
    for _ in range(settings.warmup):
        run()
    samples: list[float] = []
    start = time.perf_counter()
    while True:
        if before_each is not None:
            before_each()
        t0 = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
        elapsed = time.perf_counter() - start
        if len(samples) < settings.min_repeats or elapsed < settings.min_time_s:
            continue
        if elapsed >= settings.max_time_s or len(samples) >= settings.max_repeats:
            break
        half = len(samples) // 2
        first, second = statistics.median(samples[:half]), statistics.median(samples[half:])
        if abs(first - second) <= settings.stable_within * statistics.median(samples):
            break
    return samples


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
        cache[task.key] = (inputs, reference_output(task, inputs))
    inputs, reference = cache[task.key]
    try:
        with limits():
            if task.kind == "convert":  # one side of a layout conversion (core/conversions.py)
                measured = library.measure_conversion(task.attrs["label"], task.attrs["direction"], inputs["x"],
                                                      settings)
            else:
                measured = library.measure(task, config, inputs, settings)
    except MemoryError:
        return Result("failed", reason="out of memory: the candidate allocated past its memory cap")
    except Exception as exc:
        return Result("failed", reason=one_line(exc)[:300])
    error = relative_error(measured["output"], reference)
    summary = summarise(measured["times_us"])
    tolerance = CONVERSION_TOLERANCE if task.kind == "convert" else library.tolerance(task, config)
    if not error <= tolerance:
        return Result("invalid", error=error, reason=f"output differs from reference: error {error:.2e} > {tolerance:.0e}", **summary)
    return Result("ok", error=error, **summary)
