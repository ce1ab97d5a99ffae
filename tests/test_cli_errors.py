"""Bad input gets one line on stderr and a non-zero exit, never a traceback, and stored
records survive it."""

import sqlite3

import onnx
import pytest
from onnx import TensorProto, helper

import graphs
from graphs import small_cnn
from helpers import run_kselect


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def files(tmp_path):
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("this is not a model")
    relu_only = tmp_path / "relu.onnx"
    graphs.saved(graphs.model([helper.make_node("Relu", ["x"], ["y"])], input_shape=(1, 4), output_shapes=[(1, 4)]),
                 relu_only)
    dynamic = tmp_path / "dynamic.onnx"
    onnx.save(small_cnn(dynamic=True), dynamic)
    corrupt_db = tmp_path / "corrupt.db"
    corrupt_db.write_bytes(b"SQLite format 3\x00" + b"\x07" * 4000)
    other_db = tmp_path / "other.db"
    sqlite3.connect(other_db).execute("CREATE TABLE t (x)").connection.commit()
    bad_plan = tmp_path / "bad.plan.json"
    bad_plan.write_text('{"format": "kselect-plan/1", "model": ')
    return {"not_onnx": not_onnx, "relu_only": relu_only, "dynamic": dynamic, "corrupt_db": corrupt_db,
            "other_db": other_db, "bad_plan": bad_plan}


def test_missing_file():
    assert_one_line_error(run_kselect("tasks", "no/such/model.onnx"), "no such model file or built-in model")


def test_not_onnx(files):
    assert_one_line_error(run_kselect("tasks", files["not_onnx"]), "not a readable ONNX model")


def test_nothing_tunable(files):
    assert_one_line_error(run_kselect("tune", files["relu_only"], "--library", "mlas"), "nothing to tune")


def test_an_already_quantized_model_is_named_as_such(tmp_path):
    """A dynamically quantized export (ddddocr's common_old.onnx: DynamicQuantizeLinear and
    ConvInteger) has no float conv to tune: the error says what it is and what to do instead."""
    path = graphs.saved(graphs.model(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "scale", "zero_point"]),
         helper.make_node("ConvInteger", ["xq", "w", "zero_point"], ["acc"]),
         helper.make_node("Cast", ["acc"], ["y"], to=TensorProto.FLOAT)],
        [helper.make_tensor("w", TensorProto.UINT8, [4, 2, 3, 3], [1] * 72)], input_shape=(1, 2, 8, 8),
        output_shapes=[(1, 4, 6, 6)], opset=13), tmp_path / "quantized.onnx")
    assert_one_line_error(run_kselect("tune", path, "--library", "mlas"), "is already quantized (1 DynamicQuantizeLinear, 1 ConvInteger)",
                          "--precision fp32,int8")


def test_unresolved_and_wrong_input_shapes(files):
    assert_one_line_error(run_kselect("tasks", files["dynamic"]), "input 'input' dim 0", "--input-shape input=")
    assert_one_line_error(run_kselect("tasks", files["dynamic"], "--input-shape", "input=1,3,x,4"), "bad --input-shape")
    assert_one_line_error(run_kselect("tasks", files["dynamic"], "--input-shape", "images=1,3,32,32"), "model's inputs are")
    ok = run_kselect("tasks", files["dynamic"], "--input-shape", "input=1,3,32,32")
    assert ok.returncode == 0 and "conv tasks" in ok.stdout


def test_unknown_library_and_search(small_model_path):
    assert_one_line_error(run_kselect("tune", small_model_path, "--library", "nosuchlib"), "unknown library 'nosuchlib'")
    assert_one_line_error(run_kselect("tune", small_model_path, "--library", "mlas", "--search", "magic"), "unknown search 'magic'")


def test_corrupt_or_foreign_database_is_refused_and_kept(files, small_model_path):
    before = files["corrupt_db"].read_bytes()
    assert_one_line_error(run_kselect("tune", small_model_path, "--library", "mlas", "--db", files["corrupt_db"]), "corrupt")
    assert files["corrupt_db"].read_bytes() == before
    assert_one_line_error(run_kselect("tune", small_model_path, "--library", "mlas", "--db", files["other_db"]),
                          "not a kselect record database")


def test_corrupt_plan(files, small_model_path):
    assert_one_line_error(run_kselect("plan", "show", files["bad_plan"]), "not a valid kselect plan")
    assert_one_line_error(run_kselect("bench", small_model_path, "--plan", files["bad_plan"]), "not a valid kselect plan")
    assert_one_line_error(run_kselect("plan", "show", "missing.plan.json"), "no such plan file")
