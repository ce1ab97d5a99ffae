"""Mixed precision (issue 27): int8 candidates verified against the float reference, calibration
input refused in one line, the accuracy budget honoured, and an int8 plan's export reproducing
its measured metric in plain onnxruntime."""

import itertools
import json

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import small_cnn
from helpers import feeds_folder, kselect_json, run_kselect

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks
from kselect.core.precision.mixed import FrontPoint, back_off, fastest_within_budget
from kselect.plugins.mlas.library import MlasLibrary
from kselect.plugins.mlas.ort_session import ort_optimized

FAST = MeasureSettings(min_repeats=5, min_time_s=0.02, max_time_s=0.3, timeout_s=60)


@pytest.fixture(scope="module")
def int8_tasks(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "small.onnx"
    onnx.save(small_cnn(), path)
    library = MlasLibrary()
    library.prepare_model(load_model(str(path)))
    return library, [t.at_precision("int8") for t in extract_tasks(load_model(str(path)))]


@pytest.mark.parametrize("weights", ["per-channel", "per-tensor"])
@pytest.mark.parametrize("kind", ["dense", "depthwise", "fc"])
def test_an_int8_op_on_mlas_matches_the_float_reference_within_its_quantization_step(int8_tasks, kind, weights):
    library, tasks = int8_tasks
    pick = {"dense": lambda t: t.kind == "conv" and t.attrs["group"] == 1 and t.attrs["kernel"] == [3, 3],
            "depthwise": lambda t: t.is_depthwise, "fc": lambda t: t.kind == "fc"}[kind]
    task = next(t for t in tasks if pick(t))
    assert library.supports(task)
    config = {**library.default_config(task, this_device()), "weights": weights}
    assert config in library.space(task, this_device())
    result = measure_in_this_process(library, task, config, FAST, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error < 0.05  # int8 is not exact, and not far off


SILU = [["Sigmoid", ["x"], {}], ["Mul", ["x", "t0"], {}]]
PADDLE_HARDSWISH = [["Add", ["x", 3.0], {}], ["Clip", ["t0", 0.0, 6.0], {}], ["Mul", ["x", "t1"], {}],
                    ["Div", ["t2", 6.0], {}]]
ACTIVATIONS_AFTER_THE_KERNEL = {
    "silu": SILU,
    "paddle-hardswish": PADDLE_HARDSWISH,
    "hardsigmoid-mul": [["HardSigmoid", ["x"], {"alpha": 1 / 6, "beta": 0.5}], ["Mul", ["x", "t0"], {}]],
    "leaky-relu": [["LeakyRelu", ["x"], {"alpha": 0.1}]],
    "affine-hardswish": [["Mul", [1.5, "x"], {}], ["Add", ["t0", 0.25], {}], ["HardSwish", ["t1"], {}]],
}


def _conv_task(epilogue, group=1):
    from kselect.core.models.tasks import Task, task_key

    x, w, y = [1, 32, 20, 20], [32, 32 // group, 3, 3], [1, 32, 20, 20]
    attrs = {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": group}
    signature = {"kind": "conv", "x": x, "w": w, "attrs": attrs, "epilogue": epilogue}
    return Task("c", task_key(signature), "conv", x, w, y, attrs, True, ["c"], epilogue).at_precision("int8")


@pytest.mark.parametrize("activations", ["u8", "s8"])
@pytest.mark.parametrize("name", list(ACTIVATIONS_AFTER_THE_KERNEL))
def test_an_int8_op_with_an_activation_after_its_kernel_matches_the_float_reference_on_mlas(name, activations):
    """SiLU, HardSwish and the like do not fold into the output clamp: MLAS's candidate is the op
    as onnxruntime.quantization writes it in a QDQ model (the kernel requantized, then the
    activation), checked against the float reference within the tolerance its grids allow."""
    library = MlasLibrary()
    task = _conv_task(ACTIVATIONS_AFTER_THE_KERNEL[name], group=1 if activations == "u8" else 32)
    assert library.supports(task)
    config = {**library.default_config(task, this_device()), "activations": activations}
    result = measure_in_this_process(library, task, config, FAST, {})
    assert result.status == "ok", result.reason
    assert 0 < result.error < 0.05


def test_a_silu_op_in_int8_is_what_onnx_runtime_fuses_from_the_quantizers_qdq_graph():
    """The candidate of a conv + SiLU is read and written in int8 on the core's grids, and ONNX
    Runtime runs it as QLinearConv, QLinearSigmoid and QLinearMul: what the exported QDQ model runs."""
    from kselect.core.measuring.measure import reference_output, task_inputs
    from kselect.core.precision.quant import quant_params
    from kselect.plugins.mlas.int8 import single_op_model

    task = _conv_task(SILU)
    inputs = task_inputs(task)
    inputs["quant"] = params = quant_params(task, inputs, reference_output(task, inputs))
    assert params.pre_scale is not None  # the kernel's output is requantized before the activation
    model = single_op_model(task, inputs, {"activations": "u8", "weights": "per-channel"})
    assert [i.type.tensor_type.elem_type for i in (*model.graph.input, *model.graph.output)] == [onnx.TensorProto.UINT8] * 2
    fused = [node.op_type for node in ort_optimized(model).graph.node]
    assert {"QLinearConv", "QLinearSigmoid", "QLinearMul"} <= set(fused)
    assert not {"Conv", "Sigmoid", "Mul", "QuantizeLinear", "DequantizeLinear"} & set(fused)


@pytest.mark.parametrize("epilogue", [[["Clip", ["x", 0.0, 6.0], {}]], SILU], ids=["relu6", "silu"])
@pytest.mark.parametrize("group", [1, 32], ids=["dense", "depthwise"])
def test_an_int8_conv_on_mlas_is_timed_in_nhwc_as_inside_a_whole_int8_model(tmp_path, epilogue, group):
    """ONNX Runtime runs a uint8 QLinearConv in NHWC between Transposes that cancel from one int8
    conv to the next in a whole model. A single op read and written in NCHW would time those two
    transposes with the kernel (mobilenetv2's 96x112x112 depthwise conv: 512 us against 71 us), so
    the candidate reads and writes NHWC: ONNX Runtime's optimised graph then has no Transpose, and
    the output still matches the float reference. Entering and leaving int8 (the conversions of
    the label mlas:int8) carry the transposes instead, checked like every conversion."""

    from kselect.core.cross_library.conversions import conversion_task
    from kselect.core.measuring.measure import reference_output, task_inputs
    from kselect.core.precision.quant import quant_params
    from kselect.plugins.mlas import int8
    from kselect.plugins.mlas.session_config import session_options

    library, task = MlasLibrary(), _conv_task(epilogue, group)
    inputs = task_inputs(task)
    inputs["quant"] = quant_params(task, inputs, reference_output(task, inputs))
    config = library.default_config(task, this_device())
    assert int8.runs_channels_last(int8.single_op_model(task, inputs, config), session_options(config))
    assert not int8.runs_channels_last(int8.channels_last(int8.single_op_model(task, inputs, config)),
                                       session_options(config))
    result = measure_in_this_process(library, task, config, FAST, {})
    assert result.status == "ok" and 0 < result.error < 0.05, result.reason
    for direction in ("in", "out"):
        converted = measure_in_this_process(library, conversion_task("mlas:int8", direction, task.input_shape), {}, FAST, {})
        assert converted.status == "ok", converted.reason


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_an_int8_candidate_quantizing_wrongly_is_invalid(int8_tasks, activation):
    """The kernel writes its output with a zero point 16 steps off the one its result is read
    with: the core's quantization-derived tolerance catches it, so it could never be selected."""
    from kselect.core.precision.quant import QuantParams
    from kselect.plugins.mlas.int8 import dequantize_activation

    class WrongScale(MlasLibrary):
        def prepare(self, task, config, inputs):
            p = inputs["quant"]
            shifted = p.y_zero_point + (16 if p.y_zero_point < 128 else -16)
            wrong = QuantParams(p.x_scale, p.x_zero_point, p.w_scales, p.y_scale, shifted)
            candidate = super().prepare(task, config, {**inputs, "quant": wrong})
            candidate.unblock = lambda y: dequantize_activation(y, p.y_scale, p.y_zero_point, config["activations"])
            return candidate

    _, tasks = int8_tasks
    task = next(t for t in tasks if t.kind == "conv" and t.attrs["group"] == 1) if activation == "none" else _conv_task(SILU)
    library = WrongScale()
    result = measure_in_this_process(library, task, library.default_config(task, this_device()), FAST, {})
    assert result.status == "invalid" and "differs from reference" in result.reason


def _int8_only(drop: dict) -> dict:
    """Each op's ladder with one rung, int8 (an int8-only library: MLAS, XNNPack, ACL)."""
    return {node: ["int8"] for node in drop}


def _per_rung(values: dict, precision: str = "int8") -> dict:
    return {(node, precision): value for node, value in values.items()}


def test_the_budget_is_honoured_on_a_synthetic_sensitivity_table():
    """SYNTHETIC (made-up drops and times, not measurements): each op adds its own drop in int8
    and saves its own time; the search backs off the most sensitive first and keeps the fastest
    point within the budget."""
    drop = {"a": 0.004, "b": 0.0, "c": 0.012, "d": 0.001, "e": 0.0}
    saves = {"a": 30.0, "b": 10.0, "c": 50.0, "d": 5.0, "e": 1.0}
    noise = {"b": 40.0, "e": 30.0}  # the metric ties b and e: the noisier (lower SQNR) e goes back first

    def point(name, precisions, drop=drop):
        total = sum(drop[n] for n in precisions)
        return FrontPoint(name, dict(precisions), 100.0 - sum(saves[n] for n in precisions), 1 - total, total, 0,
                          total <= 0.006)

    front = [point("fp32", {})] + back_off(_int8_only(drop), _per_rung(drop), _per_rung(noise), point)
    assert [p.name for p in front] == ["fp32", "int8", "mixed-1"]
    assert front[1].int8_nodes == ["a", "b", "c", "d", "e"] and not front[1].within_budget
    assert front[2].int8_nodes == ["a", "b", "d", "e"] and front[2].drop == pytest.approx(0.005)
    assert fastest_within_budget(front) is front[2]

    tight = {n: d + 0.003 for n, d in drop.items()}
    front = [point("fp32", {})] + back_off(_int8_only(drop), _per_rung(tight), _per_rung(noise), point)
    chosen = fastest_within_budget(front)
    assert chosen.within_budget and chosen.drop <= 0.006
    order = [set(p.int8_nodes) for p in front[1:] if "+" not in p.name]
    assert all(later < earlier for earlier, later in zip(order, order[1:]))  # one op back per step


def test_the_back_off_walks_int8_then_half_precision_then_fp32_per_op():
    """SYNTHETIC (made-up drops and times, not measurements): three ops with int8 and bf16 kernels,
    one with bf16 only. Each op climbs one rung at a time, the most sensitive rung first: an op
    breaking the budget in int8 goes to bf16 first, and on to fp32 only if bf16 still breaks it;
    the point kept has all three precisions."""
    ladders = {"a": ["int8", "bf16"], "b": ["int8", "bf16"], "c": ["int8", "bf16"], "d": ["bf16"]}
    drop = {("a", "int8"): 0.03, ("a", "bf16"): 0.0002,  # a: int8 hurts, bf16 holds
            ("b", "int8"): 0.0001, ("b", "bf16"): 0.0,  # b: int8 holds
            ("c", "int8"): 0.05, ("c", "bf16"): 0.02,  # c: neither holds: fp32
            ("d", "bf16"): 0.0001}
    saves = {"int8": 30.0, "bf16": 20.0}

    def point(name, precisions):
        total = sum(drop[(n, p)] for n, p in precisions.items())
        return FrontPoint(name, dict(precisions), 400.0 - sum(saves[p] for p in precisions.values()), 1 - total,
                          total, 0, total <= 0.001)

    front = back_off(ladders, drop, {}, point)
    assert front[0].name == "int8+bf16" and front[0].precisions == {"a": "int8", "b": "int8", "c": "int8", "d": "bf16"}
    steps = [p.precisions for p in front]
    assert steps[1] == {"a": "int8", "b": "int8", "c": "bf16", "d": "bf16"}  # c first: the most sensitive rung
    assert steps[2] == {"a": "bf16", "b": "int8", "c": "bf16", "d": "bf16"}  # then a, one rung
    assert steps[3] == {"a": "bf16", "b": "int8", "d": "bf16"}  # c's bf16 rung still breaks it: c to fp32
    for earlier, later in zip(steps, steps[1:4]):  # one op one rung per step
        changed = [n for n in ladders if earlier.get(n, "fp32") != later.get(n, "fp32")]
        assert len(changed) == 1
    chosen = fastest_within_budget(front)
    assert chosen.precisions == {"a": "bf16", "b": "int8", "d": "bf16"} and chosen.within_budget
    assert set(chosen.precisions.values()) | {"fp32"} == {"int8", "bf16", "fp32"}
    assert chosen.to_json()["ops_by_precision"] == {"int8": 1, "bf16": 2}


def test_ops_sent_back_to_float_without_need_return_to_int8():
    """SYNTHETIC (made-up drops and times): 50 candidates go back to float three at a time; one
    op alone breaks the budget, so after its group goes back the two others return to int8, one
    at a time, and the fastest point within the budget has only that op in float. With one at a
    time, an op whose going back did not help returns too."""
    drop = {f"op{i}": 0.0001 for i in range(49)} | {"hot": 0.05}
    noise = {node: 30.0 for node in drop}

    def point(name, precisions, drop=drop, budget=0.01):
        total = sum(drop[n] for n in precisions)
        return FrontPoint(name, dict(precisions), 100.0 - len(precisions), 1 - total, total, 0, total <= budget)

    front = back_off(_int8_only(drop), _per_rung(drop), _per_rung(noise), point)
    assert [p.name for p in front] == ["int8", "mixed-1", "mixed-1+1", "mixed-1+2"]
    assert len(front[1].int8_nodes) == 47 and front[1].within_budget
    chosen = fastest_within_budget(front)
    assert chosen is front[-1] and set(drop) - set(chosen.int8_nodes) == {"hot"}

    drop["op1"] = 0.02  # a second op breaks it: it goes back with "hot", op0 returns, op1 and "hot" do not
    front = back_off(_int8_only(drop), _per_rung(drop), _per_rung(noise), point)
    assert [p.name for p in front] == ["int8", "mixed-1", "mixed-1+1", "mixed-1+2", "mixed-1+3"]
    assert [p.within_budget for p in front[2:]] == [True, False, False]
    assert set(drop) - set(fastest_within_budget(front).int8_nodes) == {"hot", "op1"}

    # one at a time: a alone looks worst, but in the model only b's drop counts (a's is masked)
    actual = {"a": 0.0, "b": 0.02, "c": 0.0}
    front = back_off(_int8_only(actual), _per_rung({"a": 0.03, "b": 0.02, "c": 0.0}), {},
                     lambda name, precisions: point(name, precisions, actual))
    assert [p.name for p in front] == ["int8", "mixed-1", "mixed-2", "mixed-2+1"]
    assert set(fastest_within_budget(front).int8_nodes) == {"a", "c"}


@pytest.mark.parametrize("case", ["empty folder", "wrong shape", "unreadable image", "no folder", "no int8",
                                  "calibration without int8", "bad drop", "two means", "one mean for RGB", "zero scale",
                                  "preprocessing without pictures"])
def test_bad_calibration_input_is_one_line_before_measuring(tmp_path, small_model_path, case):
    folder = tmp_path / "calibration"
    args = ["--precision", "fp32,int8", "--calibration", folder]
    if case == "empty folder":
        folder.mkdir()
        says = "has no .npy, .npz or image files"
    elif case == "wrong shape":
        feeds_folder(folder, 2, shape=(1, 3, 16, 16))
        says = "has shape [1, 3, 16, 16], the model takes [1, 3, 32, 32]"
    elif case == "unreadable image":
        folder.mkdir()
        (folder / "cat.jpg").write_bytes(b"not a jpeg at all")
        says = "cannot read image cat.jpg"
    elif case == "no folder":
        says = "is not a folder"
    elif case == "no int8":
        args = ["--precision", "fp32,int8"]
        says = "needs calibration data"
    elif case == "calibration without int8":
        feeds_folder(folder, 2)
        args = ["--calibration", folder]
        says = "--calibration is for reduced precisions"
    elif case == "two means":
        args += ["--image-mean", "0.5,0.5"]
        says = "give one number per channel (three, or one for GRAY)"
    elif case == "one mean for RGB":
        args += ["--image-mean", "0.5"]
        says = "--image-mean: give three values, one per channel for --image-channels RGB"
    elif case == "zero scale":
        args += ["--image-scale", "0/255"]
        says = "must be above 0"
    elif case == "preprocessing without pictures":
        args = ["--precision", "fp32,int8", "--image-channels", "BGR"]
        says = "are for --calibration with pictures"
    else:
        feeds_folder(folder, 2)
        args += ["--max-accuracy-drop", "1.5"]
        says = "must be below 1"
    db = tmp_path / "records.db"
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--db", db, *args)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not db.exists()  # refused before anything was measured


def assert_predictions_reported(result) -> None:
    """Every plan a tune timed end to end has its predicted whole-model time beside the measured
    one: a front point through the fp32 plan of its race (its measured time times the ratio of
    their costs corrected in context: MLAS and XNNPack time whole runs per node), a plan across
    libraries through ONNX Runtime's default session; the tune's JSON lists them all."""
    from kselect.core.whole_model.context import IN_CONTEXT
    from kselect.core.whole_model.selection import BASELINE, RUNS_AS_BASELINE

    predictions = result.predictions()
    for name, tuning in result.tunings.items():
        assert tuning.precision.context  # learned from the fp32 and the all-int8 runs, timed per node
        assert tuning.precision.context[0]["runs"]["reduced"]["ops_us"]
        front = {point.name: point for point in tuning.precision.front}
        fp32 = front["fp32"]
        if not any(p.within_budget and p.precisions for p in front.values()):
            continue  # nothing to race the fp32 plan
        if "skipped" in tuning.plan.extra["precision"].get("check", {}):
            continue  # every point within the budget predicted a certain loss: nothing raced
        assert fp32.measured_ms is not None and fp32.prediction is None  # the reference is not predicted
        timed = [p for p in front.values() if p.measured_ms is not None and p is not fp32]
        assert timed  # the points within the budget raced the fp32 plan
        for point in timed:
            expected = fp32.measured_ms * point.predicted_us / fp32.predicted_us
            assert point.prediction["reference"] == "fp32 plan" and point.prediction["summed_covers"] == IN_CONTEXT
            assert "isolated_error" in point.prediction  # what the isolated sums alone would have predicted
            assert point.prediction["predicted_ms"] == pytest.approx(expected, abs=2e-3)
            assert point.prediction["measured_ms"] == pytest.approx(point.measured_ms, abs=1e-3)
            assert {"library": name, "plan": point.name, **point.prediction} in predictions
    for check in result.checks:
        if "skipped" in check:  # its loss certain by the predictions in context, or the baseline itself: not timed
            assert check["skipped"].startswith("predicted ") or check["skipped"] == RUNS_AS_BASELINE, check
            continue
        prediction = check["prediction"]
        assert prediction["reference"] == BASELINE and prediction["measured_ms"] > 0
        assert prediction["error"] == pytest.approx(prediction["predicted_ms"] / prediction["measured_ms"] - 1, abs=2e-3)
    assert result.to_json()["predictions"] == predictions


def test_kselect_tune_with_int8_stores_the_front_metric_and_budget_in_the_plan(tmp_path, small_model_path):
    folder = feeds_folder(tmp_path / "calibration", 16)
    plan_path = tmp_path / "small.plan.json"
    tuned = kselect_json("tune", small_model_path, "--library", "mlas", "--precision", "fp32,int8", "--calibration",
                         folder, "--max-accuracy-drop", "0.02", "--metric", "cosine", "--budget", "3", "--min-time",
                         "0.02", "--no-verify", "--db", tmp_path / "r.db", "-o", plan_path)
    precision = json.loads(plan_path.read_text())["extra"]["precision"]
    assert tuned["libraries"][0]["precision"] == {k: v for k, v in precision.items() if k != "ranges"}  # the front
    assert precision["metric"] == "cosine" and precision["max_drop"] == 0.02
    assert precision["calibration"] == {"source": str(folder), "synthetic": False, "sample_pictures": False,
                                        "caveat": "", "method": "minmax", "preprocess": None,
                                        "calibration_feeds": 8, "held_out_feeds": 8}
    assert [p["name"] for p in precision["front"]][:2] == ["fp32", "int8"]
    chosen = next(p for p in precision["front"] if p["name"] == precision["chosen"])
    assert chosen["within_budget"] and chosen["drop"] <= 0.02


def test_an_int8_plan_exports_a_qdq_model_that_plain_onnxruntime_runs_at_the_plans_metric(tmp_path, small_model_path):
    """The full-int8 point of the front, exported by the MLAS plugin: a QDQ ONNX model plain
    onnxruntime loads, whose outputs on the held-out feeds score what the front says."""
    import kselect
    from kselect.core.contract import plugins

    folder = feeds_folder(tmp_path / "calibration", 16)
    result = kselect.tune(str(small_model_path), "mlas", precision="fp32,int8", calibration=folder, metric="cosine",
                          max_accuracy_drop=0.02, budget=2, verify=False, settings=FAST, db=tmp_path / "r.db")
    search = result.tunings["mlas"].precision
    point = next(p for p in search.front if p.name == "int8")
    assert point.int8_nodes
    written = plugins.get_library("mlas").apply(search.plans["int8"], result.model, tmp_path / "out")
    exported = onnx.load(str(written[0]))
    assert sum(node.op_type == "QuantizeLinear" for node in exported.graph.node) >= len(point.int8_nodes)
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(small_model_path), providers=["CPUExecutionProvider"])
    cosines = []
    for path in sorted(folder.iterdir())[8:]:
        feed = {"input": np.load(path)["input"]}
        a, b = session.run(None, feed)[0].ravel(), reference.run(None, feed)[0].ravel()
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    assert np.mean(cosines) == pytest.approx(point.score, abs=1e-6)


def test_calibration_images_are_resized_normalised_and_laid_out_as_the_input(tmp_path):
    """A folder of images feeds a one-input model: RGB, resized to the input, ImageNet mean/std,
    NCHW (or NHWC when the input's last dim is 3)."""
    from PIL import Image

    from kselect.core.models.model import Model
    from kselect.core.models.preprocess import IMAGENET_MEAN, IMAGENET_STD
    from kselect.core.precision.calibration import load_feeds

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (64, 48), (255, 0, 128)).save(folder / "a.png")
    Image.new("L", (10, 10), 0).save(folder / "b.jpg")  # greyscale, any size
    for shape in ([1, 3, 32, 40], [1, 32, 40, 3]):
        model = Model("m", onnx.ModelProto(), "in memory", {"image": shape})
        feeds = load_feeds(folder, model)
        assert [list(f["image"].shape) for f in feeds] == [shape, shape]
        first = feeds[0]["image"][0]
        pixel = first[:, 5, 5] if shape[1] == 3 else first[5, 5, :]
        expected = (np.array([1.0, 0.0, 128 / 255]) - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
        assert np.allclose(pixel, expected, atol=1e-5)
        black = feeds[1]["image"][0]
        assert np.allclose(black[:, 0, 0] if shape[1] == 3 else black[0, 0, :],
                           -np.array(IMAGENET_MEAN) / np.array(IMAGENET_STD), atol=1e-5)


def test_calibration_images_feed_a_one_channel_input_as_grayscale(tmp_path):
    """A one-channel image input (an OCR recogniser's, ddddocr's) takes pictures as luma (PIL's
    "L"), in [0, 1] unless told otherwise (one mean, one std), NCHW or NHWC."""
    from PIL import Image

    from kselect.core.errors import KselectError
    from kselect.core.models.model import Model
    from kselect.core.precision.calibration import calibration_for, image_preprocess, load_feeds

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (64, 48), (255, 0, 128)).save(folder / "a.png")
    Image.new("L", (10, 10), 200).save(folder / "b.png")
    luma = Image.new("RGB", (1, 1), (255, 0, 128)).convert("L").getpixel((0, 0))
    for shape in ([1, 1, 32, 40], [1, 32, 40, 1]):
        model = Model("m", onnx.ModelProto(), "in memory", {"image": shape})
        feeds = load_feeds(folder, model)
        assert [list(f["image"].shape) for f in feeds] == [shape, shape]
        assert np.allclose(feeds[0]["image"], luma / 255, atol=1e-6)
        assert np.allclose(feeds[1]["image"], 200 / 255, atol=1e-6)
    model = Model("m", onnx.ModelProto(), "in memory", {"image": [1, 1, 8, 8]})
    preprocess = image_preprocess(model, mean=(0.5,), std=(0.5,))  # PaddleOCR's (x / 255 - 0.5) / 0.5
    calibration = calibration_for(model, folder, preprocess=preprocess)
    assert np.allclose(calibration.held_out[0]["image"], (200 / 255 - 0.5) / 0.5, atol=1e-6)
    assert calibration.to_json()["preprocess"] == {"channels": "GRAY", "scale": 1 / 255, "mean": [0.5], "std": [0.5]}
    rgb = Model("m", onnx.ModelProto(), "in memory", {"image": [1, 3, 8, 8]})
    with pytest.raises(KselectError, match="need an NCHW or NHWC input with 1 channel"):
        load_feeds(folder, rgb, image_preprocess(rgb, channels="GRAY"))


def test_calibration_pictures_take_the_preprocessing_given(tmp_path):
    """--image-channels / --image-scale / --image-mean / --image-std replace the default
    preprocessing (here as YOLO-style exporters feed: BGR, 0..1, no mean or std), and the
    calibration records what it used."""
    from PIL import Image

    from kselect.core.models.model import Model
    from kselect.core.precision.calibration import calibration_for, image_preprocess

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (16, 16), (255, 0, 128)).save(folder / f"{i}.png")
    model = Model("m", onnx.ModelProto(), "in memory", {"image": [1, 3, 8, 8]})
    preprocess = image_preprocess(model, channels="BGR", scale=1 / 255, mean=(0, 0, 0), std=(1, 1, 1))
    calibration = calibration_for(model, folder, preprocess=preprocess)
    assert np.allclose(calibration.calibrate[0]["image"][0][:, 3, 3], [128 / 255, 0.0, 1.0], atol=1e-6)
    assert calibration.to_json()["preprocess"] == {"channels": "BGR", "scale": 1 / 255, "mean": [0, 0, 0],
                                                   "std": [1, 1, 1]}
    partly = image_preprocess(model, scale=1.0)  # the rest stays ImageNet's (no real model here)
    assert partly.channels == "RGB" and partly.scale == 1.0 and partly.mean == (0.485, 0.456, 0.406)


def test_a_plan_calibrated_with_percentile_runs_with_its_ranges(tmp_path, small_model_path):
    """The plan's calibration cache says which calibrator made it; the MLAS runner quantizes with
    the same one (onnxruntime.quantization refuses a cache read under another method)."""
    import kselect

    folder = feeds_folder(tmp_path / "calibration", 8)
    result = kselect.tune(str(small_model_path), "mlas", precision="fp32,int8", calibration=folder, metric="cosine",
                          calibration_method="percentile", max_accuracy_drop=0.02, budget=1, verify=False,
                          settings=FAST, db=tmp_path / "r.db")
    search = result.tunings["mlas"].precision
    full = next(p for p in search.front if p.name == "int8")
    assert full.int8_nodes and not full.failed
    assert search.plans["int8"].extra["precision"]["calibration"]["method"] == "percentile"


def test_weight_granularity_and_activation_type_are_chosen_on_the_front_not_on_speed_alone(tmp_path, small_model_path):
    """MLAS's per-tensor weights or int8 activations can be faster per op and lose accuracy: the
    front is searched at quantize_static's own settings (per-channel, uint8) and, only where the
    op times favour others, again at those, its points named with them; the chosen point is the
    fastest within the budget on either front."""
    import kselect

    folder = feeds_folder(tmp_path / "calibration", 16)
    result = kselect.tune(str(small_model_path), "mlas", precision="fp32,int8", calibration=folder, metric="cosine",
                          max_accuracy_drop=0.02, budget=4, verify=False, settings=FAST, db=tmp_path / "r.db")
    search = result.tunings["mlas"].precision
    assert search.front[0].name == "fp32" and [p.name for p in search.front].count("fp32") == 1
    assert {k: search.plans["int8"].plan_level[k] for k in ("weights", "activations")} == \
        {"weights": "per-channel", "activations": "u8"}
    for point in search.front[1:]:
        plan_level = search.plans[point.name].plan_level if point.name in search.plans else None
        if plan_level is None:
            continue
        other = {k: v for k, v in plan_level.items() if k in ("weights", "activations")
                 and v != {"weights": "per-channel", "activations": "u8"}[k]}
        assert point.name.endswith(")") == bool(other)
        assert all(f"{k} {v}" in point.name for k, v in other.items())
    within = [p for p in search.front if p.within_budget]
    assert search.chosen.predicted_us == min(p.predicted_us for p in within)


@pytest.mark.slow  # per-op int8 across libraries runs by default (test_int8_per_op_across_libraries_picks_each_ops_library_and_precision_and_runs)
def test_int8_across_libraries_races_each_librarys_mixed_plan_beside_the_plan_across_them(tmp_path, small_model_path):
    """`--library mlas,xnnpack --precision fp32,int8`: each library chooses its int8 ops under the
    budget; the plan across libraries is made in fp32; ONNX Runtime's default, each library's
    kept plan, the plan across them and that plan with a library's int8 ops put in (within the
    budget) race end to end. An int8 plan, held to its accuracy budget, is not refused for
    differing from ONNX Runtime's fp32 outputs."""
    import kselect
    from kselect.core.plans.plan import int8_nodes
    from kselect.core.whole_model.context import IN_CONTEXT
    from kselect.core.whole_model.selection import verified_across

    folder = feeds_folder(tmp_path / "calibration", 16)
    result = kselect.tune(str(small_model_path), "mlas,xnnpack", precision="fp32,int8", calibration=folder,
                          metric="cosine", max_accuracy_drop=0.02, budget=2, settings=FAST, db=tmp_path / "r.db",
                          check_rounds=2, check_max_rounds=2, remeasure=False)
    for name in ("mlas", "xnnpack"):
        search = result.tunings[name].precision
        assert search is not None and search.chosen.within_budget and int8_nodes(search.plans["int8"])
    assert not int8_nodes(result.cross_plan)  # planned per op in fp32
    tried = {check["variant"]: check for check in result.checks}
    assert {"mlas plan", "xnnpack plan"} <= set(tried) and not any("failed" in c for c in tried.values())
    assert_predictions_reported(result)
    # each library's mixed plan is predicted on the scale of the runs the plan across libraries was
    # predicted from: its library's fp32 run there, times its front's figure over its fp32 plan's
    whole_us = result.cross_plan.extra["cross_library"]["in_context"]["whole_us"]
    for name in ("mlas", "xnnpack"):
        plan, front = result.tunings[name].plan, {point.name: point for point in result.tunings[name].precision.front}
        kept = front[plan.extra["precision"]["chosen"]]
        assert plan.extra["predicted_us"] == pytest.approx(whole_us[name] * kept.predicted_us / front["fp32"].predicted_us,
                                                           rel=1e-3)
        assert plan.extra["predicted_basis"] == IN_CONTEXT and plan.extra["isolated_us"] > 0
    # and every plan raced beside them, combined ones too (by difference from a plan run whole)
    for variant, check in tried.items():
        assert "skipped" in check or check["prediction"]["summed_covers"] == IN_CONTEXT, variant
    if int8_nodes(result.plan):  # kept a mixed plan: one of the libraries', within its budget
        precision = result.plan.extra["precision"]
        assert next(p for p in precision["front"] if p["name"] == precision["chosen"])["drop"] <= 0.02

    # one library's int8 op put into the plan across them: it runs on that library, the rest as planned
    from kselect.core.precision.calibration import calibration_for
    from kselect.core.precision.mixed import mixed_plan, score_plan, with_reduced_ops

    cross = result.cross_plan
    name = next(n for n in ("mlas", "xnnpack") if set(cross.libraries) != {n})
    search = result.tunings[name].precision
    full = search.plans["int8"]
    entries = {t["key"]: t for t in full.tasks if t.get("precision") == "int8"}
    node = sorted(int8_nodes(full))[0]
    partial = mixed_plan(search.plans["fp32"], {"int8": entries}, full.plan_level, {node: "int8"},
                         full.extra["precision"])
    combined = with_reduced_ops(cross, partial)
    assert int8_nodes(combined) == {node} and combined.nodes[node]["library"] == name
    assert {n: e for n, e in combined.nodes.items() if n != node} == {n: e for n, e in cross.nodes.items() if n != node}
    assert combined.extra["precision"]["ranges"] and name in combined.libraries
    score, drop = score_plan(result.model, combined, calibration_for(result.model, folder), None, "cosine")
    assert 0.9 < score <= 1.0 + 1e-6 and drop < 0.1
    raced = [c for variant, c in tried.items() if "int8 ops" in variant]
    assert not any("failed" in c for c in raced)

    full_int8 = result.tunings["mlas"].precision.plans["int8"]  # error ~1e-2 against fp32: still a candidate
    kept, (check,) = verified_across(result.model, [("mlas int8", full_int8)], rounds=2, max_rounds=2)
    assert kept.extra["verified"]["chosen"] == "mlas int8" and kept.nodes == full_int8.nodes
    assert check["max_relative_output_error"] > 1e-3


def test_int8_per_op_across_libraries_picks_each_ops_library_and_precision_and_runs(tmp_path, small_model_path):
    """Planned across MLAS and XNNPack with the ops MLAS chose for int8 free to run in int8 on
    either library (their measured int8 kernels) or in fp32: only those ops are offered int8, each
    int8 op runs on a library that measured it, and the plan runs through kselect.load_plan close
    to the float model."""
    import kselect
    from kselect.core.cross_library.plan import plan_across
    from kselect.core.cross_library.problem import cross_problem
    from kselect.core.measuring.tuning_loop import library_defaults, library_tasks, stored_outcomes
    from kselect.core.models.tasks import extract_tasks
    from kselect.core.plans.plan import int8_nodes
    from kselect.core.precision.calibration import calibration_for
    from kselect.core.precision.mixed import score_plan
    from kselect.core.records.store import RecordDB

    folder = feeds_folder(tmp_path / "calibration", 16)
    result = kselect.tune(str(small_model_path), "mlas,xnnpack", precision="fp32,int8", calibration=folder,
                          metric="cosine", max_accuracy_drop=0.02, budget=2, settings=FAST, db=tmp_path / "r.db",
                          verify=False)
    db = RecordDB(tmp_path / "r.db")
    libraries = {name: t.library for name, t in result.tunings.items()}
    with_int8 = {name: t.precision.plans["int8"] for name, t in result.tunings.items()}
    candidates = int8_nodes(with_int8["mlas"])
    one = frozenset(sorted(candidates)[:1])

    # only the allowed op gets int8 options, from each library that measured its int8 twin
    model, device = result.model, result.device
    tasks = extract_tasks(model)
    tasks += [t.at_precision("int8") for t in tasks if t.kind in ("conv", "deconv", "fc")]
    lists = {n: library_tasks(model, lib, ("fp32", "int8")) for n, lib in libraries.items()}
    records = {n: stored_outcomes(lists[n], lib, device, db) for n, lib in libraries.items()}
    defaults = {n: library_defaults(lists[n], lib, device) for n, lib in libraries.items()}
    problem = cross_problem(model, libraries, tasks, records, defaults,
                            {n: p.plan_level for n, p in with_int8.items()}, {"int8": one})
    int8_labels = {node: {o.label for o in options if o.label.endswith(":int8")} for node, options in problem.options.items()}
    assert int8_labels[next(iter(one))] == {"mlas:int8", "xnnpack:int8"}
    assert not any(labels for node, labels in int8_labels.items() if node not in one)

    planned = plan_across(model, device, db, libraries, with_int8, FAST, reduced_nodes={"int8": frozenset(candidates)})
    fp32 = plan_across(model, device, db, libraries, with_int8, FAST)
    assert int8_nodes(planned) <= candidates and not int8_nodes(fp32)
    for node in int8_nodes(planned):
        assert planned.nodes[node]["label"] == f"{planned.nodes[node]['library']}:int8"
    if int8_nodes(planned):
        planned.extra["precision"] = {**with_int8["mlas"].extra["precision"], "int8_from": "per op"}
        score, drop = score_plan(model, planned, calibration_for(model, folder), None, "cosine")
        assert 0.98 < score <= 1.0 + 1e-6


def test_an_opset_8_model_whose_weights_are_not_graph_inputs_quantizes(tmp_path):
    """Exporters of the opset-8 era (waifu2x's) keep weights as initializers only; onnx's version
    converter calls them undefined unless they are graph inputs too. The QDQ model comes out at
    opset 13 with only the model's own input, and runs close to the float model."""
    from onnx import helper, numpy_helper

    from kselect.core.precision.calibration import quantize_qdq

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1)]
    model = graphs.model(nodes, [weight], (1, 3, 16, 16), output_shapes=[[1, 8, 16, 16]], opset=8, name="opset8",
                         ir_version=3)
    feeds = [{"x": rng.random((1, 3, 16, 16), dtype=np.float32)} for _ in range(4)]
    quantize_qdq(model, tmp_path / "qdq.onnx", feeds)

    quantized = onnx.load(tmp_path / "qdq.onnx")
    assert next(o.version for o in quantized.opset_import if o.domain in ("", "ai.onnx")) >= 13
    assert [value.name for value in quantized.graph.input] == ["x"]
    assert "DequantizeLinear" in {node.op_type for node in quantized.graph.node}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds[0])[0]
    got = ort.InferenceSession(str(tmp_path / "qdq.onnx")).run(None, feeds[0])[0]
    step = (expected.max() - min(expected.min(), 0.0)) / 255.0
    assert np.max(np.abs(got - expected)) < 4 * step


def _output_cosines(model: onnx.ModelProto, exported: onnx.ModelProto, feed: dict) -> list[float]:
    """The cosine of each output of ``exported`` against the same output of ``model`` on ``feed``,
    both run by plain onnxruntime."""
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    return [float(np.dot(expected.ravel(), got.ravel()) / np.linalg.norm(expected) / np.linalg.norm(got))
            for expected, got in zip(reference.run(None, feed), session.run(None, feed))]


def _chain_with_float_and_int8_ops_between():
    """x -> conv a -> Tanh -> conv b -> MaxPool -> conv c -> y, on an 8 x 16 x 16 map."""
    from onnx import helper, numpy_helper

    from kselect.core.models.model import model_from_proto

    rng = np.random.default_rng(0)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("Tanh", ["ta"], ["th"], name="tanh"),
             helper.make_node("Conv", ["th", "wb"], ["tb"], name="b", **conv),
             helper.make_node("MaxPool", ["tb"], ["tp"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["tp", "wc"], ["y"], name="c", **conv)]
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32), f"w{n}") for n in "abc"]
    return model_from_proto("chain", graphs.model(nodes, weights, (1, 8, 16, 16), output_shapes=[[1, 8, 8, 8]]))


def test_int8_neighbours_through_an_op_run_in_float_pay_a_dequantize_and_a_quantize(tmp_path):
    """a -> Tanh -> b -> MaxPool -> c, all three in int8: ONNX Runtime runs the QDQ model an MLAS
    plan exports with the Tanh in float (between DequantizeLinear and QuantizeLinear) and the max
    pooling on 8-bit data, so the planners charge a dequantize of a's output and a quantize of b's
    input between a and b, and nothing between b and c. XNNPack's executor pools in 8 bits too;
    ACL's engine runs both ops in float."""
    from kselect.core.contract import plugins
    from kselect.core.cross_library.conversions import ConversionTable
    from kselect.core.cross_library.problem import CrossProblem, data_edges, requantized_sides, untuned_paths
    from kselect.core.precision.calibration import quantize_qdq
    from kselect.core.precision.calibration import nodes_to_quantize

    model = _chain_with_float_and_int8_ops_between()
    tuned = {"a", "b", "c"}
    edges = data_edges(model, tuned)
    via = untuned_paths(model, tuned, edges)
    a_to_b = next(e for e in edges if (e.producer, e.consumer) == ("a", "b"))
    b_to_c = next(e for e in edges if (e.producer, e.consumer) == ("b", "c"))
    assert via[a_to_b] == (("Tanh", "ta", (1, 8, 16, 16)),) and via[b_to_c] == (("MaxPool", "tb", (1, 8, 16, 16)),)
    for name, pools_in_int8 in (("mlas", True), ("xnnpack", True), ("acl", False)):
        label, passes = f"{name}:int8", plugins.libraries()[name].int8_passes
        assert requantized_sides(label, a_to_b, via[a_to_b], passes) == [("ta", (label, "out", (1, 8, 16, 16))),
                                                                            ("th", (label, "in", (1, 8, 16, 16)))]
        pooled = requantized_sides(label, b_to_c, via[b_to_c], passes)
        assert pooled == (None if pools_in_int8 else [("tb", (label, "out", (1, 8, 16, 16))),
                                                      ("tp", (label, "in", (1, 8, 8, 8)))])

    problem = CrossProblem(edges=edges, via=via, int8_passes={"mlas": plugins.libraries()["mlas"].int8_passes})
    table = ConversionTable({("mlas:int8", "out", (1, 8, 16, 16)): 3.0, ("mlas:int8", "in", (1, 8, 16, 16)): 5.0})
    assert problem.cost_us(table, a_to_b, "mlas:int8", "mlas:int8") == 8.0
    assert problem.cost_us(table, b_to_c, "mlas:int8", "mlas:int8") == 0.0
    assert {side for _, side in problem.requantized(a_to_b, "mlas:int8", "mlas:int8")} <= set(table.times_us)

    rng = np.random.default_rng(1)
    feeds = [{"x": rng.normal(0, 1, (1, 8, 16, 16)).astype(np.float32)} for _ in range(4)]
    quantize_qdq(model.proto, tmp_path / "qdq.onnx", feeds, nodes_to_quantize=nodes_to_quantize(model, tuned))
    optimized = ort_optimized(onnx.load(tmp_path / "qdq.onnx")).graph
    dequantized = {out for node in optimized.node if node.op_type == "DequantizeLinear" for out in node.output}
    read_in_float = {node.op_type for node in optimized.node if set(node.input) & dequantized}
    assert read_in_float == {"Tanh"}, read_in_float


def test_a_tensor_several_int8_ops_read_is_quantized_and_dequantized_once(tmp_path):
    """x -> conv a -> Tanh -> conv b and conv c -> Add: ONNX Runtime's QDQ graph of an all-int8
    MLAS plan dequantizes a's output once and quantizes the Tanh's output once for both readers,
    so the planners' total pays each once, not once per edge; and an int8 tensor two fp32 ops
    read is dequantized once."""
    from onnx import helper, numpy_helper

    from kselect.core.contract import plugins
    from kselect.core.cross_library.conversions import GRAPH_LABEL, ConversionTable
    from kselect.core.cross_library.planner import Option, solve
    from kselect.core.cross_library.problem import CrossProblem, connect
    from kselect.core.models.model import model_from_proto
    from kselect.core.precision.calibration import quantize_qdq
    from kselect.core.precision.calibration import nodes_to_quantize

    rng = np.random.default_rng(0)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("Tanh", ["ta"], ["th"], name="tanh"),
             helper.make_node("Conv", ["th", "wb"], ["tb"], name="b", **conv),
             helper.make_node("Conv", ["th", "wc"], ["tc"], name="c", **conv),
             helper.make_node("Add", ["tb", "tc"], ["y"], name="add")]
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32), f"w{n}") for n in "abc"]
    shape = (1, 8, 16, 16)
    model = model_from_proto("fanout", graphs.model(nodes, weights, shape, output_shapes=[list(shape)]))
    mlas = plugins.libraries()["mlas"]

    by_precision = {node: {"fp32": Option("mlas:NCHW", 10.0), "int8": Option("mlas:int8", 5.0)} for node in "abc"}
    problem = CrossProblem(options={node: list(options.values()) for node, options in by_precision.items()})
    connect(problem, model, {"mlas": mlas})
    # between float and int8 ops: with the transposes of ONNX Runtime's NHWC int8 convs; around the
    # Tanh between two int8 ops they cancel (checked below), so that round trip is labelled apart
    table = ConversionTable({("mlas:int8", "out", shape): 3.0, ("mlas:int8", "in", shape): 4.0,
                             ("mlas:int8-in-place", "out", shape): 1.0, ("mlas:int8-in-place", "in", shape): 2.0,
                             ("mlas:NCHW", "out", shape): 0.5, ("mlas:NCHW", "in", shape): 0.5})
    assert set(table.times_us) - {("mlas:NCHW", "out", shape)} <= problem.sides()

    def assignment(**precisions):
        chosen = {node: options[0] for node, options in problem.options.items()}
        return {**chosen, **{node: by_precision[node][p] for node, p in precisions.items()}}

    readers = [e for e in problem.edges if e.producer == "a"]
    assert {e.consumer for e in readers} == {"b", "c"}
    all_int8 = assignment(a="int8", b="int8", c="int8")
    assert sum(problem.cost_us(table, e, "mlas:int8", "mlas:int8") for e in readers) == 2 * (1.0 + 2.0)
    # ops 3 x 5, one dequantize and one quantize around the Tanh, the model's input quantized, the output dequantized
    assert problem.total_us(table, all_int8) == pytest.approx(15.0 + 1.0 + 2.0 + 4.0 + 3.0)
    # a in int8, both readers in fp32 (the Tanh on a's library): a's output dequantized once
    assert problem.total_us(table, assignment(a="int8", b="fp32", c="fp32")) == pytest.approx(25.0 + 4.0 + 3.0 + 0.5)
    assert problem.total_us(table, assignment(a="fp32", b="fp32", c="fp32")) == pytest.approx(30.0 + 0.5 + 0.5)
    assert all(o.label == GRAPH_LABEL for o in problem.options["input:x"])
    # the exact solver's cost of every labelling is that total, so its optimum is the true one:
    # charged per edge, b and c in int8 after a float a would pay the Tanh output's quantize twice
    graph = problem.graph(table)
    labellings = [assignment(**dict(zip("abc", precisions))) for precisions in itertools.product(("fp32", "int8"), repeat=3)]
    for labelling in labellings:
        assert graph.total_us(labelling) == pytest.approx(problem.total_us(table, labelling))
    solved, total = solve(graph)
    assert total == pytest.approx(min(problem.total_us(table, labelling) for labelling in labellings))
    problem.options["a"] = [by_precision["a"]["fp32"]]  # a float producer: b and c share one quantize
    solved, total = solve(problem.graph(table))
    assert [solved[node].label for node in "bc"] == ["mlas:int8"] * 2
    # ops; the input into NCHW; the Tanh's output leaving NCHW on each edge (a layout side), quantized once; y dequantized
    assert total == pytest.approx(10.0 + 2 * 5.0 + 0.5 + 2 * 0.5 + 4.0 + 3.0)

    feeds = [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(4)]
    quantize_qdq(model.proto, tmp_path / "qdq.onnx", feeds, nodes_to_quantize=nodes_to_quantize(model, {"a", "b", "c"}))
    optimized = ort_optimized(onnx.load(tmp_path / "qdq.onnx")).graph
    into_tanh = [n for n in optimized.node if n.op_type == "DequantizeLinear"
                 and any(t in n.output for m in optimized.node if m.op_type == "Tanh" for t in m.input)]
    tanh_out = next(n for n in optimized.node if n.op_type == "Tanh").output[0]
    requantized = [n for n in optimized.node if n.op_type == "QuantizeLinear" and n.input[0] == tanh_out]
    assert len(into_tanh) == 1 and len(requantized) == 1
    assert "Transpose" not in {n.op_type for n in optimized.node if set(n.output) & set(into_tanh[0].input)}
    assert "Transpose" not in {n.op_type for n in optimized.node if requantized[0].output[0] in n.input}
    x = feeds[0]["x"]
    for direction in ("out", "in"):
        candidate = mlas.conversion("mlas:int8-in-place", direction, x)
        candidate.run()
        step = (x.max() - x.min()) / 255
        assert candidate.output().shape == x.shape and np.max(np.abs(candidate.output() - x)) <= step
    readers_of_requantized = [n for n in optimized.node if requantized[0].output[0] in n.input]
    assert len(readers_of_requantized) == 2, [n.op_type for n in readers_of_requantized]


def test_the_ops_after_a_convtranspose_run_in_int8_where_int8_ops_take_its_output_on(tmp_path):
    """conv a -> ConvTranspose u -> conv b, and LeakyReLU(u) + b -> Add -> conv c; a second
    ConvTranspose v -> Sigmoid -> output. MLAS has no int8 ConvTranspose, so a plan with a, b and
    c in int8 is as int8 as it gets: its export quantizes u's output once and runs the LeakyReLU
    and the Add in 8 bits, as ONNX Runtime's whole-model quantization does (float there, they cost
    waifu2x-cunet 30 ms: docs/mixed-precision-benchmark.md), while v's Sigmoid, which no int8 op
    reads, stays float. The ConvTransposes keep their float weights (``float_ops_kept_float``). The
    export is accurate to the quantization of its tensors."""
    from onnx import helper, numpy_helper

    from kselect.core.models.model import model_from_proto
    from kselect.core.precision.calibration import quantize_qdq
    from kselect.core.precision.calibration import nodes_to_quantize
    from kselect.plugins.mlas.int8 import float_ops_kept_float

    rng = np.random.default_rng(0)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    up = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("ConvTranspose", ["ta", "wu"], ["tu"], name="u", **up),
             helper.make_node("Conv", ["tu", "wb"], ["tb"], name="b", **conv),
             helper.make_node("LeakyRelu", ["tu"], ["tl"], name="leaky", alpha=0.1),
             helper.make_node("Add", ["tl", "tb"], ["ts"], name="add"),
             helper.make_node("Conv", ["ts", "wc"], ["y"], name="c", **conv),
             helper.make_node("ConvTranspose", ["ta", "wv"], ["tv"], name="v", **up),
             helper.make_node("Sigmoid", ["tv"], ["z"], name="sigmoid")]
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32), f"w{n}") for n in "abc"]
    weights += [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 2, 2)).astype(np.float32), f"w{n}") for n in "uv"]
    model = model_from_proto("upsample", graphs.model(nodes, weights, (1, 8, 8, 8), outputs=("y", "z"),
                                                      output_shapes=[[1, 8, 16, 16]] * 2))

    quantized = nodes_to_quantize(model, {"a", "b", "c"})
    assert set(quantized) == {"a", "b", "c", "leaky", "add"}, quantized
    feeds = [{"x": rng.normal(0, 1, (1, 8, 8, 8)).astype(np.float32)} for _ in range(4)]
    quantize_qdq(model.proto, tmp_path / "qdq.onnx", feeds, nodes_to_quantize=quantized)
    exported = float_ops_kept_float(onnx.load(tmp_path / "qdq.onnx"), quantized)
    optimized = ort_optimized(exported).graph
    op_types = {node.op_type for node in optimized.node}
    assert {"QLinearLeakyRelu", "QLinearAdd", "Sigmoid"} <= op_types and "QLinearSigmoid" not in op_types
    dequantized = {out for node in optimized.node if node.op_type == "DequantizeLinear" for out in node.output}
    assert {node.op_type for node in optimized.node if set(node.input) & dequantized} == {"ConvTranspose"}
    weights = {node.input[1] for node in optimized.node if node.op_type == "ConvTranspose"}
    assert weights <= {tensor.name for tensor in optimized.initializer}, "ONNX Runtime quantized their weights"
    cosines = _output_cosines(model.proto, exported, feeds[0])
    assert min(cosines) > 0.99, cosines


def test_the_ops_after_a_conv_sent_back_to_float_run_in_int8_where_int8_ops_take_its_output_on(tmp_path):
    """conv a -> conv b -> ReLU -> Add (with a's output) -> conv c, and b -> Sigmoid -> output z,
    with b sent back to float: as ONNX Runtime's quantizer does with an excluded node, the ReLU
    and the Add between b and the int8 conv c run in 8 bits (float, they sat between ORT's NHWC
    int8 convs behind transposes: u2netp), while the Sigmoid only an output reads stays float.
    Only b reads a DequantizeLinear in ONNX Runtime's graph, and b runs in float."""
    from onnx import helper, numpy_helper

    from kselect.core.models.model import model_from_proto
    from kselect.core.precision.calibration import quantize_qdq
    from kselect.core.precision.calibration import nodes_to_quantize
    from kselect.plugins.mlas.int8 import float_ops_kept_float

    rng = np.random.default_rng(2)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("Conv", ["ta", "wb"], ["tb"], name="b", **conv),
             helper.make_node("Relu", ["tb"], ["tr"], name="relu"),
             helper.make_node("Add", ["tr", "ta"], ["ts"], name="add"),
             helper.make_node("Conv", ["ts", "wc"], ["y"], name="c", **conv),
             helper.make_node("Sigmoid", ["tb"], ["z"], name="sigmoid")]
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32), f"w{n}") for n in "abc"]
    shape = [1, 8, 16, 16]
    model = model_from_proto("backed_off", graphs.model(nodes, weights, shape, outputs=("y", "z"), output_shapes=[shape] * 2))

    quantized = nodes_to_quantize(model, {"a", "c"})
    assert set(quantized) == {"a", "c", "relu", "add"}, quantized
    feeds = [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(4)]
    quantize_qdq(model.proto, tmp_path / "qdq.onnx", feeds, nodes_to_quantize=quantized)
    exported = float_ops_kept_float(onnx.load(tmp_path / "qdq.onnx"), quantized)
    optimized = ort_optimized(exported).graph
    op_types = [node.op_type for node in optimized.node]
    assert op_types.count("QLinearConv") == 2 and "QLinearAdd" in op_types and "Sigmoid" in op_types, op_types
    dequantized = {out for node in optimized.node if node.op_type == "DequantizeLinear" for out in node.output}
    assert {node.op_type for node in optimized.node if set(node.input) & dequantized} <= {"Conv", "FusedConv"}
    cosines = _output_cosines(model.proto, exported, feeds[0])
    assert min(cosines) > 0.99, cosines


def test_a_conv_the_plan_keeps_in_fp32_between_int8_ops_runs_in_fp32(tmp_path):
    """conv a -> conv b -> conv c with a and c in int8 and b in fp32. ONNX Runtime's
    WeightBiasQuantization quantizes the weights of a float conv reading a per-tensor
    DequantizeLinear (per tensor, to int8) and then runs it as a QLinearConv; the export has b read
    a per-channel DequantizeLinear of the same values, so b runs in float as the plan says and
    the outputs are those of the quantized model; the per-tensor DequantizeLinear b read is gone
    (ONNX Runtime runs a node nothing reads: waifu2x-upconv7 lost 2.5 ms to one)."""
    from onnx import helper, numpy_helper

    from kselect.core.models.model import model_from_proto
    from kselect.core.precision.calibration import quantize_qdq
    from kselect.core.precision.calibration import nodes_to_quantize
    from kselect.plugins.mlas.int8 import float_ops_kept_float

    rng = np.random.default_rng(1)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", [x, f"w{n}"], [y], name=n, **conv)
             for n, x, y in (("a", "x", "ta"), ("b", "ta", "tb"), ("c", "tb", "y"))]
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32), f"w{n}") for n in "abc"]
    model = model_from_proto("chain", graphs.model(nodes, weights, (1, 8, 16, 16), output_shapes=[[1, 8, 16, 16]]))
    quantized = nodes_to_quantize(model, {"a", "c"})
    assert "b" not in quantized
    feeds = [{"x": rng.normal(0, 1, (1, 8, 16, 16)).astype(np.float32)} for _ in range(4)]
    quantize_qdq(model.proto, tmp_path / "qdq.onnx", feeds, nodes_to_quantize=quantized)
    as_written = onnx.load(tmp_path / "qdq.onnx")
    kept = float_ops_kept_float(onnx.load(tmp_path / "qdq.onnx"), quantized)
    ops_as_written = [node.op_type for node in ort_optimized(as_written).graph.node]
    assert ops_as_written.count("QLinearConv") == 3  # ONNX Runtime quantized b itself
    optimized = ort_optimized(kept).graph
    ops = [node.op_type for node in optimized.node]
    assert ops.count("QLinearConv") == 2 and ops.count("Conv") + ops.count("FusedConv") == 1, ops
    read = {name for node in optimized.node for name in node.input} | {value.name for value in optimized.output}
    unread = [node.name for node in optimized.node if not set(node.output) & read]
    assert not unread, f"ONNX Runtime runs {unread}, whose outputs nothing reads"
    session = ort.InferenceSession(kept.SerializeToString(), providers=["CPUExecutionProvider"])
    written = ort.InferenceSession(as_written.SerializeToString(), providers=["CPUExecutionProvider"],
                                   disabled_optimizers=["WeightBiasQuantization"])
    np.testing.assert_allclose(session.run(None, feeds[0])[0], written.run(None, feeds[0])[0], rtol=0, atol=1e-5)


def test_a_half_precision_tune_of_a_users_model_without_data_names_the_precision_it_needs_data_for(tmp_path,
                                                                                                   small_model_path):
    """`--precision all` on a library with bf16 and no int8 (oneDNN) needs held-out data for its
    accuracy budget: the one-line refusal names bf16, not int8, which this library does not offer."""
    onednn = plugins.libraries()["onednn"]
    if not onednn.availability()[0] or "bf16" not in onednn.plan_precisions or "int8" in onednn.plan_precisions:
        pytest.skip("needs oneDNN with bf16 plans and without int8 ones")
    db = tmp_path / "records.db"
    result = run_kselect("tune", small_model_path, "--library", "onednn", "--precision", "all", "--db", db)
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "bf16 needs calibration data for the accuracy budget" in error[0]
    assert "int8" not in error[0] and "Traceback" not in result.stderr
    assert not db.exists()  # refused before anything was measured
