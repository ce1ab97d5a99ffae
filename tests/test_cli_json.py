"""Every command that prints a result takes ``--json``: one JSON document on stdout and nothing
else there (status and warnings go to stderr); and tables piped elsewhere keep whole names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import onnx
import pytest
from graphs import small_cnn
from helpers import run_kselect

QUICK = ("--budget", "2", "--min-time", "0.01", "--min-repeats", "3", "--no-verify")


def json_of(result) -> dict | list:
    """The whole of stdout is the JSON document."""
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A real tune of the small CNN on MLAS, tiny budget: the model, its plan and the records."""
    folder = tmp_path_factory.mktemp("json")
    model_path = folder / "small.onnx"
    onnx.save(small_cnn(), model_path)
    plan_path, db = folder / "small.plan.json", folder / "records.db"
    result = run_kselect("tune", model_path, "--library", "mlas", *QUICK, "--db", db, "-o", plan_path)
    assert result.returncode == 0, result.stderr
    return model_path, plan_path, db


@pytest.fixture(scope="module")
def xnnpack_available():
    found = {p["name"]: p for p in json_of(run_kselect("plugins", "--json"))}
    if not found["xnnpack"]["status"].startswith("available"):
        pytest.skip(f"xnnpack: {found['xnnpack']['status']}")


def test_models_tasks_and_plugins(tuned):
    model_path, _, _ = tuned
    models = json_of(run_kselect("models", "--json"))
    assert "resnet18" in {m["name"] for m in models["zoo"]} and models["real"]
    tasks = json_of(run_kselect("tasks", model_path, "--json"))
    table = run_kselect("tasks", model_path).stdout
    assert tasks["tasks"] and all(re.search(rf"│ {t['id']} ", table) for t in tasks["tasks"])
    assert sum(len(t["nodes"]) for t in tasks["tasks"]) == 7  # 6 convs and the Gemm
    plugins = json_of(run_kselect("plugins", "--json"))
    assert {"mlas", "xnnpack", "xgb"} <= {p["name"] for p in plugins}


def test_space_of_one_task_lists_every_config_with_the_default_among_them(xnnpack_available):
    space = json_of(run_kselect("space", "resnet18", "--library", "xnnpack", "--task", "T02", "--json"))
    table = run_kselect("space", "resnet18", "--library", "xnnpack", "--task", "T02")
    printed = int(re.search(r"(\d+) valid configurations", table.stdout).group(1))
    assert space["task"]["id"] == "T02" and space["library"] == "xnnpack"
    assert space["size"] == len(space["configs"]) == printed > 1
    assert space["default"] in space["configs"]
    assert len({json.dumps(c, sort_keys=True) for c in space["configs"]}) == printed  # no config twice
    assert "ukernel" in {d["name"] for d in space["dimensions"]}
    every = json_of(run_kselect("space", "resnet18", "--library", "xnnpack", "--json"))
    sizes = {t["id"]: t["size"] for t in every["tasks"]}
    assert sizes["T02"] == printed and len(sizes) == len(json_of(run_kselect("tasks", "resnet18", "--json"))["tasks"])


def test_space_of_a_tasks_int8_twin_is_what_the_tune_measures_in_int8():
    """``--task T02.int8``: the space of T02's int8 twin (MLAS's QDQ conv: its activation and weight
    quantization dims), with its own key; the fp32 task's space has none of those dims."""
    twin = json_of(run_kselect("space", "resnet18", "--library", "mlas", "--task", "T02.int8", "--json"))
    plain = json_of(run_kselect("space", "resnet18", "--library", "mlas", "--task", "T02", "--json"))
    assert twin["task"]["id"] == "T02.int8" and twin["task"]["key"] != plain["task"]["key"]
    precision_dims = {d["name"] for d in twin["dimensions"] if d["role"] == "precision"}
    assert precision_dims and not {d["name"] for d in plain["dimensions"] if d["role"] == "precision"}
    assert twin["default"] in twin["configs"] and twin["size"] == len(twin["configs"])


def test_plan_show_matches_the_plan_file(tuned):
    _, plan_path, _ = tuned
    plan = json.loads(plan_path.read_text())
    shown = json_of(run_kselect("plan", "show", plan_path, "--json"))
    assert shown["libraries"] == plan["libraries"] and shown["model"] == plan["model"]
    assert [t["id"] for t in shown["tasks"]] == [t["id"] for t in plan["tasks"]]
    for entry, task in zip(shown["tasks"], plan["tasks"]):
        assert entry["library"] == task["library"] == "mlas" and entry["config"] == task["config"]
        assert entry["ops"] == len(task["nodes"]) and entry["time_us"] == task["time_us"] > 0
        assert entry["speedup"] == pytest.approx(task["default_us"] / task["time_us"], rel=1e-3)


def test_plan_apply_lists_the_files_it_wrote(tuned, tmp_path):
    model_path, plan_path, _ = tuned
    applied = json_of(run_kselect("plan", "apply", plan_path, model_path, "-o", tmp_path, "--json"))
    assert applied["written"] and applied["libraries"] == json.loads(plan_path.read_text())["libraries"]
    assert sorted(applied["written"]) == sorted(str(p) for p in tmp_path.iterdir())


def test_predict_prints_every_op_or_writes_the_file_beside_the_table(tuned, tmp_path):
    model_path, plan_path, db = tuned
    predicted = json_of(run_kselect("predict", model_path, "--library", "mlas", "--db", db, "--json"))
    plan_tasks = {t["id"] for t in json.loads(plan_path.read_text())["tasks"]}
    assert {op["task"] for op in predicted["ops"]} == plan_tasks
    assert all(op["predicted_us"] > 0 and op["config"] for op in predicted["ops"])
    assert predicted["library"] == "mlas" and predicted["training_rows"] > 0
    out = tmp_path / "predict.json"  # --json OUT.json: the file, and the table as before
    written = run_kselect("predict", model_path, "--library", "mlas", "--db", db, "--json", out)
    assert written.returncode == 0, written.stderr
    assert "predicted per-op latency" in written.stdout and f"wrote {out}" in " ".join(written.stdout.split())
    assert json.loads(out.read_text())["ops"] == predicted["ops"]


def test_bench_prints_the_results_or_writes_them_beside_the_table(tuned, tmp_path):
    model_path, plan_path, _ = tuned
    quick = ("--rounds", "1", "--runs-per-round", "2")
    benched = json_of(run_kselect("bench", model_path, "--plan", plan_path, *quick, "--json", "-"))
    assert benched["default_ms"] > 0 and benched["plan_ms"] > 0 and benched["max_relative_output_error"] < 1e-3
    assert benched["baseline"] == "mlas default"
    out = tmp_path / "bench.json"
    written = run_kselect("bench", model_path, "--plan", plan_path, *quick, "--json", out)
    assert written.returncode == 0, written.stderr
    assert "whole-model latency" in written.stdout and json.loads(out.read_text())["plan_ms"] > 0


def test_an_error_under_json_is_one_line_on_stderr_and_nothing_on_stdout(tuned):
    model_path, _, _ = tuned
    for args in (("plan", "show", "missing.plan.json", "--json"),
                 ("bench", model_path, "--plan", "missing.plan.json", "--json")):
        result = run_kselect(*args)
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.strip().splitlines()) == 1 and "no such plan file" in result.stderr


def _piped(*args, columns=None) -> str:
    """The command's stdout through a pipe, COLUMNS unset (or set), as `kselect ... | cat` sees it."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = str(columns)
    result = subprocess.run([sys.executable, "-m", "kselect.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_piped_table_keeps_whole_micro_kernel_names(xnnpack_available):
    args = ("space", "resnet18", "--library", "xnnpack", "--task", "T02")
    names = {c["ukernel"] for c in json_of(run_kselect(*args, "--json"))["configs"]}
    assert max(len(n) for n in names) > 40  # f32_igemm_minmax_ukernel_7x16__avx512f_broadcast and the like
    wide = _piped(*args)
    assert "…" not in wide
    row = next(line for line in wide.splitlines() if line.startswith("│ ukernel "))
    assert all(name in row for name in names)  # the whole list on the one row
    narrow = _piped(*args, columns=80)  # a narrow terminal's width: wrapped, never cut
    assert "…" not in narrow and all(len(line) <= 80 for line in narrow.splitlines())
    cells = [line.split("│") for line in narrow.splitlines() if line.startswith("│")]
    start = next(i for i, cell in enumerate(cells) if cell[1].strip() == "ukernel")
    end = next(i for i in range(start + 1, len(cells)) if cells[i][1].strip())  # the next dimension's row
    values = "".join(cell[4].strip() for cell in cells[start:end])  # the folded pieces, joined again
    assert names <= set(values.split(","))
