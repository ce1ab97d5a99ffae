"""Half precision (bf16, fp16) twins as the core measures them: rounding to the formats, the
tolerance derived from the format on a conv and an fc, and candidates judged by it in the
measuring code (real MLAS kernels fed data rounded to a format: an exact implementation of that
format, accepted for it and rejected for a finer one)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import feeds_folder, run_kselect

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.models.tasks import Task, task_key
from kselect.core.precision.half import UNIT_ROUNDOFF, half_tolerance, round_to, round_to_bf16, round_to_fp16
from kselect.plugins.mlas.library import MlasLibrary

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.02, timeout_s=60)


def conv_task(cin=16, cout=24, k=3, h=10, w=12) -> Task:
    attrs = {"kernel": [k, k], "strides": [1, 1], "pads": [k // 2] * 4, "dilations": [1, 1], "group": 1}
    signature = {"kind": "conv", "input": [1, cin, h, w], "weight": [cout, cin, k, k], "output": [1, cout, h, w],
                 "attrs": attrs, "bias": True}
    return Task("C", task_key(signature), "conv", [1, cin, h, w], [cout, cin, k, k], [1, cout, h, w], attrs, True,
                ["c"], [["Relu", ["x"], {}]])


def fc_task(m=4, k=256, n=40) -> Task:
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": True}
    return Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, True, ["f"], [])


def test_bf16_rounding_keeps_the_top_16_bits_rounding_to_nearest_even():
    one = np.float32(1.0)
    step = np.float32(2.0 ** -7)  # bf16's spacing at 1
    values = np.array([1.0, 1 + step / 2, 1 + 3 * step / 2, 1 + step / 2 + 2.0 ** -20, -(1 + 3 * step / 2),
                       np.inf, -np.inf], np.float32)
    rounded = round_to_bf16(values)
    assert rounded.dtype == np.float32
    assert rounded[0] == one
    assert rounded[1] == one  # a tie goes to the even neighbour
    assert rounded[2] == one + 2 * step  # a tie goes to the even neighbour, here the upper one
    assert rounded[3] == one + step  # past the tie: up
    assert rounded[4] == -(one + 2 * step)
    assert np.isinf(rounded[5]) and rounded[5] > 0 and np.isinf(rounded[6]) and rounded[6] < 0
    assert np.isnan(round_to_bf16(np.array([np.nan], np.float32)))[0]

    random = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32) * 100
    rounded = round_to_bf16(random)
    assert rounded.shape == random.shape
    assert not np.any(rounded.view(np.uint32) & 0xFFFF)  # only the top 16 bits are set
    assert np.all(np.abs(rounded - random) <= np.abs(random) * 2.0 ** -8)
    ml_dtypes = pytest.importorskip("ml_dtypes")  # an independent implementation of the format
    np.testing.assert_array_equal(rounded, random.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_fp16_rounding_is_ieee_half_precision():
    values = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 70000.0], np.float32)
    assert list(round_to_fp16(values)[:2]) == [1.0, 1 + 2.0 ** -9]
    assert np.isinf(round_to_fp16(values)[2])


@pytest.mark.parametrize("make", [conv_task, fc_task], ids=["conv", "fc"])
def test_the_tolerance_is_what_rounding_to_the_format_costs_plus_one_output_unit(make):
    task = make()
    for precision in ("bf16", "fp16"):
        twin = task.at_precision(precision)
        inputs = task_inputs(twin)
        reference = reference_output(twin, inputs)
        tolerance = half_tolerance(twin, inputs, reference, precision)
        # rounding 8 (11) significant bits of the inputs costs more than one output unit on
        # sums of dozens of products, and less than a few units times the reduction length
        unit = UNIT_ROUNDOFF[precision]
        assert 2 * unit < tolerance < 2 * unit * (1 + 8)
        rounded = {**inputs, **{name: round_to(precision, inputs[name]) for name in ("x", "w", "b")}}
        exact = reference_output(twin, rounded)
        scale = np.max(np.abs(reference))
        assert tolerance == pytest.approx(2 * (np.max(np.abs(exact - reference)) / scale + unit))
    bf16_inputs = task_inputs(task.at_precision("bf16"))
    bf16 = half_tolerance(task, bf16_inputs, reference_output(task, bf16_inputs), "bf16")
    fp16 = half_tolerance(task, bf16_inputs, reference_output(task, bf16_inputs), "fp16")
    assert bf16 > 4 * fp16  # three more significant bits


def truncated_to_4_bits(values: np.ndarray) -> np.ndarray:
    """float32 with all but its top 12 bits cleared: 4 significant bits, truncated (a conversion
    that drops bits where it should round to bf16)."""
    return (np.ascontiguousarray(values, np.float32).view(np.uint32) & np.uint32(0xFFF00000)).view(np.float32)


class RoundedInputs(MlasLibrary):
    """Real MLAS fp32 kernels fed input, weights and bias through ``rounding``: with a format's
    rounding, an exact implementation of that format with fp32 accumulation. The measuring code
    builds it here, in this process: the twin runs on MLAS's fp32 kernels (not on ONNX Runtime's own
    float16 ones, where it has them), accumulating in fp32."""

    accumulates_in_half = frozenset()

    def __init__(self, rounding):
        super().__init__()
        self.rounding = rounding

    def default_config(self, task, device):
        return super().default_config(task.at_precision("fp32"), device)

    def prepare(self, task, config, inputs):
        rounded = {name: self.rounding(value) if name in ("x", "w", "b") else value for name, value in inputs.items()}
        return super().prepare(task.at_precision("fp32"), config, rounded)


@pytest.mark.parametrize("make", [conv_task, fc_task], ids=["conv", "fc"])
def test_an_exact_half_precision_candidate_passes_and_a_wrong_one_is_rejected(make):
    plugins.get_library("mlas")  # the plugins registered (op kinds included)
    device = this_device()
    for precision in ("bf16", "fp16"):
        twin = make().at_precision(precision)
        exact = RoundedInputs(lambda values, precision=precision: round_to(precision, values))
        result = measure_in_this_process(exact, twin, exact.default_config(twin, device), QUICK, {})
        assert result.status == "ok", result.reason
        assert result.error > 0
        wrong = RoundedInputs(truncated_to_4_bits)
        result = measure_in_this_process(wrong, twin, wrong.default_config(twin, device), QUICK, {})
        assert result.status == "invalid" and "differs from reference" in result.reason


def test_a_tune_asking_for_a_precision_no_chosen_library_has_is_refused_in_one_line_before_measuring(tmp_path):
    """MLAS has no bf16 kernels in kselect: a tune asking it for bf16 says why, and which library's
    plans hold bf16 ops, and writes nothing, rather than tuning fp32 without a word."""
    db, plan = tmp_path / "records.db", tmp_path / "resnet18.plan.json"
    result = run_kselect("tune", "resnet18", "--library", "mlas", "--precision", "fp32,bf16", "--db", db, "-o", plan)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert f"mlas has none of them; bf16: {MlasLibrary().missing_precisions()['bf16']}" in result.stderr
    assert not db.exists() and not plan.exists()


def test_precision_all_names_each_precision_the_libraries_lack_and_tunes_the_others(tmp_path, small_model_path):
    """``--precision all`` on MLAS: bf16 and fp16 are named with MLAS's reason (in the JSON and in
    one line each on stderr) and the tune goes on with int8; its front walks int8 only."""
    folder = feeds_folder(tmp_path / "calibration", 8)
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--precision", "all", "--calibration", folder,
                         "--metric", "cosine", "--budget", "1", "--min-time", "0.01", "--no-verify",
                         "--db", tmp_path / "r.db", "-o", tmp_path / "plan.json", "--json")
    assert result.returncode == 0, result.stderr
    tuned = json.loads(result.stdout)
    missing = MlasLibrary().missing_precisions()
    assert tuned["precisions_left_out"] == {precision: f"mlas: {why}" for precision, why in missing.items()}
    assert f"--precision all: no bf16 here (mlas: {missing['bf16']})" in result.stderr
    front = tuned["libraries"][0]["precision"]["front"]
    assert front[1]["name"] == "int8" and set(front[1]["ops_by_precision"]) == {"int8"}
