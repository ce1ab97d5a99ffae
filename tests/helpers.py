"""Running the ``kselect`` command as a user does, and reading the JSON it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def run_kselect(*args, env=None, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """Runs the installed ``kselect`` command as a user would (in ``cwd``, default this one)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kselect.cli.main", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


def kselect_json(*args, env=None, timeout=600):
    """Runs ``kselect ARGS --json``, which must succeed, and returns the JSON document it prints
    (stdout holds it alone; progress and warnings go to stderr)."""
    result = run_kselect(*args, "--json", env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def feeds_folder(folder: Path, count: int = 16, shape=(1, 3, 32, 32), seed=0) -> Path:
    """A calibration folder as ``--calibration`` takes it: ``count`` seeded random feeds of the
    input named ``input``, one .npz each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.savez(folder / f"feed{i:02d}.npz", input=rng.standard_normal(shape).astype(np.float32))
    return folder


RELU = [["Relu", ["x"], {}]]
SILU = [["Sigmoid", ["x"], {}], ["Mul", ["x", "t0"], {}]]


def twin_task(precision: str, kind: str, x, w, y, attrs: dict, epilogue=()):
    """A task of one op (with its bias and ``epilogue``) in a reduced ``precision``, as the tuner
    makes a twin: for the half-precision kernel checks of the libraries."""
    from kselect.core.models.tasks import Task, task_key

    signature = {"kind": kind, "x": x, "w": w, "y": y, "attrs": attrs, "epilogue": list(epilogue)}
    return Task(kind, task_key(signature), kind, x, w, y, attrs, True, [kind], list(epilogue)).at_precision(precision)


def twin_conv(precision: str, x, w, y, k: int, stride: int = 1, group: int = 1, epilogue=()):
    """A k x k conv with "same" padding as ``twin_task``."""
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": [k // 2] * 4, "dilations": [1, 1], "group": group}
    return twin_task(precision, "conv", x, w, y, attrs, epilogue)


def default_plan_in(library, model, precision_of) -> "Plan":
    """A plan of ``library``'s default config for every task of ``model``, each task's twin in
    ``precision_of(task)`` ("fp32", "bf16", ...): what a tune would keep with every op at its
    default, for running a library's reduced-precision kernels in a whole model."""
    from kselect.core.measuring.device import this_device
    from kselect.core.models.tasks import extract_tasks
    from kselect.core.plans.plan import Plan

    tasks, nodes = [], {}
    for task in extract_tasks(model):
        twin = task.at_precision(precision_of(task))
        config = library.default_config(twin, this_device())
        tasks.append({**twin.to_json(), "library": library.name, "config": config})
        nodes.update({node: {"task": twin.id, "library": library.name, "config": config} for node in twin.nodes})
    return Plan(model={}, device={}, libraries={library.name: library.version()}, emulated=False, plan_level={},
                tasks=tasks, nodes=nodes)


def assert_fp16_default_within_half_tolerance(library, task, settings) -> None:
    """The library's default config of an fp16 twin measures ok against the float64 reference, off
    by more than fp32's rounding (it computes in half) and within the core's half tolerance for
    kernels that accumulate in half."""
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import measure_in_this_process, reference_output, task_inputs
    from kselect.core.precision.half import UNIT_ROUNDOFF, half_tolerance

    assert library.supports(task)
    inputs = task_inputs(task)
    tolerance = half_tolerance(task, inputs, reference_output(task, inputs), "fp16", accumulates_in_format=True)
    result = measure_in_this_process(library, task, library.default_config(task, this_device()), settings, {})
    assert result.status == "ok", result.reason
    assert UNIT_ROUNDOFF["fp16"] / 4 < result.error <= tolerance


def tune_resnet18_in_every_precision(library: str, tmp_path, twins: set[str]) -> tuple[dict, dict, "Path"]:
    """`kselect tune resnet18 --library LIBRARY --precision all` (1x3x32x32, synthetic feeds, cosine
    budget 0.01), checked: every conv / fc task's twin in each of ``twins`` is measured, none in
    bf16 (the libraries this checks have no bf16 kernels there), and the chosen front point is
    within the budget. Returns the library's tune JSON, the chosen point and the plan's path."""
    out = tmp_path / "resnet18.plan.json"
    tuned = kselect_json("tune", "resnet18", "--input-shape", "input=1,3,32,32", "--library", library,
                         "--precision", "all", "--metric", "cosine", "--max-accuracy-drop", "0.01", "--budget", "1",
                         "--min-time", "0.01", "--min-repeats", "3", "--no-verify", "--db", tmp_path / "r.db",
                         "-o", out, timeout=3600)
    (tuned_library,) = tuned["libraries"]
    fp32_tasks = {t["task"] for t in tuned_library["tasks"] if "." not in t["task"]}
    for precision in twins:
        measured = {t["task"]: t for t in tuned_library["tasks"] if t["task"].endswith(f".{precision}")}
        assert set(measured) == {f"{task}.{precision}" for task in fp32_tasks}
        assert all(t["best_us"] > 0 for t in measured.values())
    assert not any(t["task"].endswith(".bf16") for t in tuned_library["tasks"])
    precision = tuned_library["precision"]
    assert precision["front"][0]["name"] == "fp32"
    chosen = next(point for point in precision["front"] if point["name"] == precision["chosen"])
    assert chosen["within_budget"]
    return tuned_library, chosen, out


def truncated_weights(inputs: dict) -> dict:
    """A candidate's inputs with its weights truncated to 4 significant bits (a conversion that
    drops bits where it should round): the real kernels then run and compute the wrong thing."""
    w = inputs["w"]
    return {**inputs, "w": (np.ascontiguousarray(w, np.float32).view(np.uint32) & np.uint32(0xFFF00000)).view(np.float32)}


def conv_reference(x_nchw, w_oihw, bias, stride, pads, groups):
    """Direct convolution in float64 (NCHW in, OIHW weights, NCHW out); pads (top, left, bottom, right)."""
    n, c, h, w = x_nchw.shape
    o, ig, kh, kw = w_oihw.shape
    t, l, b, r = pads
    xp = np.pad(x_nchw.astype(np.float64), ((0, 0), (0, 0), (t, b), (l, r)))
    oh, ow = (h + t + b - kh) // stride + 1, (w + l + r - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * ig:(g + 1) * ig, i:i + stride * oh:stride, j:j + stride * ow:stride]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w_oihw[g * og:(g + 1) * og, :, i, j])
    return out + bias.reshape(1, -1, 1, 1)


def plan_and_onnxruntime_outputs(plan, model, feeds: dict) -> tuple[np.ndarray, np.ndarray]:
    """The first output of ``plan`` (a Plan or a plan file) run through ``kselect.load_plan`` on
    ``feeds``, and of ONNX Runtime's default session on the same model."""
    import onnxruntime as ort

    import kselect

    runner = kselect.load_plan(plan, model)
    try:
        output = runner.run(feeds)[0]
    finally:
        runner.close()
    reference = ort.InferenceSession(model.proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return output, reference
