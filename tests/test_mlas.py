"""MLAS through real onnxruntime sessions: measuring, verifying, containing crashes, resuming,
plans, and the applied ONNX model."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import kselect_json, run_kselect

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.measuring.tuning_loop import TuneOptions, tune_tasks
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import load_plan_file
from kselect.core.records.store import RecordDB
from kselect.plugins.mlas.library import MlasLibrary

FAST = MeasureSettings(min_repeats=5, min_time_s=0.02, max_time_s=0.3, timeout_s=60)


@pytest.fixture
def small(small_model_path):
    model = load_model(str(small_model_path))
    return model, {tuple(t.nodes): t for t in extract_tasks(model)}


def test_every_layout_measures_and_matches_the_reference(small):
    _, tasks = small
    library, device = plugins.get_library("mlas"), this_device()
    with MeasureWorker("mlas", FAST) as worker:
        for nodes in [("block.conv1",), ("block.conv2",), ("down",), ("dw",), ("pw",), ("fc",)]:
            task = tasks[nodes]
            for config in library.space(task, device).enumerate()[:4]:
                result = worker.measure(task, config)
                assert result.status == "ok", (nodes, config, result)
                assert result.error < 1e-4 and result.median_us > 0 and result.count >= 5


class TransposedWeightsMlas(MlasLibrary):
    """A real MLAS conv fed the wrong weights: it runs fine and computes the wrong thing."""

    def prepare(self, task, config, inputs):
        swapped = dict(inputs, w=np.ascontiguousarray(inputs["w"].transpose(1, 0, 2, 3)))
        return super().prepare(task, config, swapped)


def test_a_wrong_output_is_invalid_and_never_planned(small):
    _, tasks = small
    task = tasks[("block.conv1",)]
    library = TransposedWeightsMlas()
    config = library.default_config(task, this_device())
    result = measure_in_this_process(library, task, config, FAST, {})
    assert result.status == "invalid" and result.error > 1e-2 and "differs from reference" in result.reason


def test_a_crashing_candidate_is_contained(small):
    _, tasks = small
    task = tasks[("pw",)]
    good = MlasLibrary().default_config(task, this_device())
    # A non-integer channel batch aborts the onnxruntime process (a real crash, see the shared notes).
    crashing = dict(good, pointwise_batch="not-a-number")
    with MeasureWorker("mlas", FAST) as worker:
        result = worker.measure(task, crashing)
        assert result.status == "failed" and "crashed" in result.reason, result
        assert worker.measure(task, good).status == "ok"  # a fresh child took over


def test_records_of_another_device_are_not_reused(small, tmp_path):
    _, tasks = small
    task = tasks[("fc",)]
    library, device = plugins.get_library("mlas"), this_device()
    db = RecordDB(tmp_path / "r.db")
    options = TuneOptions("exhaustive", budget=3, settings=FAST)
    first = tune_tasks([task], library, device, db, options)[0]
    assert first.measured_now == 3
    again = tune_tasks([task], library, device, db, options)[0]
    assert again.measured_now == 0 and again.samples == 3
    other = type(device)(device.arch, "another cpu", device.features, device.cores, device.clusters)
    elsewhere = tune_tasks([task], library, other, db, options)[0]
    assert elsewhere.measured_now == 3


def test_a_retiming_far_slower_than_the_rest_is_taken_again(small, tmp_path):
    """Re-timing before planning (core/measuring/tuning_loop.remeasure): a stall only ever inflates a timing, so
    one that grew far more than the others is taken again and the fastest take kept. Here one
    stored record is made 5x too fast, so its honest re-timing looks like a stall."""
    import dataclasses

    from kselect.core.measuring.tuning_loop import STALL_RETRIES, library_defaults, remeasure

    _, tasks = small
    library, device = plugins.get_library("mlas"), this_device()
    db = RecordDB(tmp_path / "r.db")
    task_list = list(tasks.values())
    tune_tasks(task_list, library, device, db, TuneOptions("exhaustive", budget=1, settings=FAST))
    defaults = library_defaults(task_list, library, device)
    target = task_list[0]
    honest = db.records(device.fingerprint, "mlas", library.version(), target.key)[0].result.median_us
    for task_json, record in db.all_records(device.fingerprint, "mlas", library.version()):
        if record.task == target.key:
            db.add(device.fingerprint, "mlas", library.version(), task_json, record.config_key,
                   dataclasses.replace(record.result, median_us=record.result.median_us / 5), False, True)
    measured = []
    candidates = [(library, task, defaults[task.key]) for task in task_list]
    replaced = remeasure(candidates, {"mlas": defaults}, device, db, FAST,
                         on_measured=lambda task, result: measured.append(task.key))
    assert len(task_list) >= 3 and replaced == len(task_list)
    assert measured.count(target.key) == 1 + STALL_RETRIES
    record = db.records(device.fingerprint, "mlas", library.version(), target.key)[0]
    # The first timing may itself have been inflated by a stall, so "honest" is only an upper
    # bound: the re-timing must be well above the faked value, not near the first timing.
    faked = honest / 5
    assert record.result.status == "ok" and record.is_default and record.result.median_us > 2 * faked


def _records(db_path):
    with sqlite3.connect(db_path) as connection:
        return connection.execute("SELECT id, task, config, created FROM records ORDER BY id").fetchall()


def _records_so_far(db_path):
    """Records of a database another process is still creating: none until its schema exists."""
    try:
        return _records(db_path) if db_path.exists() else []
    except sqlite3.OperationalError:
        return []


def test_a_killed_tune_resumes_without_remeasuring(small_model_path, tmp_path):
    db, plan = tmp_path / "records.db", tmp_path / "small.plan.json"
    args = [sys.executable, "-m", "kselect.cli.main", "tune", str(small_model_path), "--library", "mlas",
            "--search", "exhaustive", "--budget", "6", "--min-time", "0.02", "--db", str(db), "-o", str(plan)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(_records_so_far(db)) < 5:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = _records(db)
    assert len(before) >= 5 and not plan.exists()

    finished = run_kselect(*args[3:])
    assert finished.returncode == 0, finished.stderr
    after = _records(db)
    assert after[: len(before)] == before  # kept as they were: not measured again
    tasks = extract_tasks(load_model(str(small_model_path)))
    library, device = plugins.get_library("mlas"), this_device()
    expected = sum(min(6, len(library.space(t, device))) for t in tasks)
    assert len(after) == expected
    assert plan.exists()


@pytest.fixture(scope="module")
def tuned_small(tmp_path_factory):
    from graphs import small_cnn

    folder = tmp_path_factory.mktemp("tuned")
    model_path = folder / "small.onnx"
    onnx.save(small_cnn(), model_path)
    plan_path = folder / "small.plan.json"
    tuned = kselect_json("tune", model_path, "--library", "mlas", "--budget", "8", "--min-time", "0.02",
                         "--db", folder / "records.db", "-o", plan_path)
    return model_path, plan_path, tuned


def test_tune_reports_default_and_best_per_task_and_writes_plan_and_artifacts(tuned_small):
    model_path, plan_path, tuned = tuned_small
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "mlas" and not tuning["emulated"]
    assert tuning["tasks"] and all(t["default_us"] > 0 and t["best_us"] > 0 for t in tuning["tasks"])
    assert tuned["plan_file"] == str(plan_path)
    plan = load_plan_file(plan_path)
    model = load_model(str(model_path))
    assert plan.model["fingerprint"] == model.fingerprint()
    assert plan.device["fingerprint"] == this_device().fingerprint
    assert set(plan.nodes) == {n for t in extract_tasks(model) for n in t.nodes}
    assert not plan.emulated and plan.libraries["mlas"].startswith("onnxruntime ")
    for entry in plan.tasks:
        assert entry["time_us"] > 0 and entry["default_us"] > 0 and entry["samples"] >= 1
    # Session-wide settings may cost one op a little to win overall; the sum never loses.
    assert sum(t["time_us"] * len(t["nodes"]) for t in plan.tasks) <= sum(t["default_us"] * len(t["nodes"]) for t in plan.tasks)
    assert (plan_path.parent / "small.kselect.onnx").exists()
    shown = kselect_json("plan", "show", plan_path)
    assert shown["tasks"][0]["id"] == "T01" and all(t["speedup"] > 0 for t in shown["tasks"])


def test_plan_round_trip(tuned_small, tmp_path):
    _, plan_path, _ = tuned_small
    plan = load_plan_file(plan_path)
    copy = tmp_path / "copy.plan.json"
    plan.save(copy)
    assert json.loads(copy.read_text()) == json.loads(plan_path.read_text())


def test_applied_model_runs_in_plain_onnxruntime_and_matches(tuned_small, tmp_path):
    model_path, plan_path, _ = tuned_small
    result = run_kselect("plan", "apply", plan_path, model_path, "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    from kselect.plugins.mlas.apply import load_session

    session = load_session(tmp_path / "small.kselect.onnx", tmp_path / "small.kselect.session.json")
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32), dtype=np.float32)
    expected = ort.InferenceSession(str(model_path)).run(None, {"input": x})[0]
    got = session.run(None, {"input": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_bench_compares_default_and_plan(tuned_small, tmp_path):
    model_path, plan_path, _ = tuned_small
    out = tmp_path / "bench.json"
    result = run_kselect("bench", model_path, "--plan", plan_path, "--json", out, "--rounds", "4", "--runs-per-round", "3")
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["default_ms"] > 0 and data["plan_ms"] > 0
    rounding = 1e-4 / min(data["default_ms"], data["plan_ms"])  # the times are written to 4 decimals of a ms
    assert data["speedup"] == pytest.approx(data["default_ms"] / data["plan_ms"], rel=1e-3 + rounding)
    assert data["max_relative_output_error"] < 1e-4 and data["emulated"] is False


def test_a_plan_for_another_device_or_model_is_refused(tuned_small, tmp_path):
    model_path, plan_path, _ = tuned_small
    data = json.loads(plan_path.read_text())
    data["device"]["fingerprint"] = "0000000000000000"
    foreign = tmp_path / "foreign.plan.json"
    foreign.write_text(json.dumps(data))
    refused = run_kselect("bench", model_path, "--plan", foreign)
    assert refused.returncode == 2 and "another device" in refused.stderr and "--force" in refused.stderr
    forced = run_kselect("bench", model_path, "--plan", foreign, "--force", "--rounds", "2", "--runs-per-round", "2",
                         "--json")
    assert forced.returncode == 0 and json.loads(forced.stdout)["plan_ms"] > 0
    assert "warning (--force)" in forced.stderr and "another device" in forced.stderr
    other_model = run_kselect("bench", "resnet18", "--plan", plan_path)
    assert other_model.returncode == 2 and "the plan is for model" in other_model.stderr


@pytest.mark.parametrize("name", ["mobilenetv2", "googlenet", "resnetxy"])
def test_default_layout_is_what_onnxruntime_picks(name):
    """The baseline config says NCHWc exactly for the convs ONNX Runtime's own transformer
    converts (in resnetxy, with 51/77/97-channel convs, it converts almost none)."""
    from kselect.plugins.mlas.ort_session import ort_nchwc_convs, ort_optimized

    model = load_model(name)
    library, device = plugins.get_library("mlas"), this_device()
    library.prepare_model(model)
    default_nchwc = {node for task in extract_tasks(model) if task.kind == "conv"
                     and library.default_config(task, device)["layout"] == "NCHWc" for node in task.nodes}
    optimized = ort_optimized(model.proto)
    ort_nchwc_count = sum(n.domain == "com.microsoft.nchwc" and n.op_type == "Conv" for n in optimized.graph.node)
    assert len(default_nchwc) == ort_nchwc_count
    assert default_nchwc == ort_nchwc_convs(model.proto)


def test_mixed_layouts_on_a_zoo_model_match_the_original():
    """Alternating NCHW / NCHWc convs in MobileNetV2 (depthwise, residual adds, 1x1s)."""
    from kselect.plugins.mlas.layout import nchwc_block_size
    from kselect.plugins.mlas.ort_session import session_options
    from kselect.plugins.mlas.rewrite import rewrite_model

    model = load_model("mobilenetv2")
    convs = [n.name for n in model.proto.graph.node if n.op_type == "Conv"]
    layouts = {name: ("NCHWc" if i % 3 else "NCHW") for i, name in enumerate(convs)}
    rewritten = rewrite_model(model.proto, layouts, nchwc_block_size())
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    expected = ort.InferenceSession(model.proto.SerializeToString()).run(None, {"input": x})[0]
    got = ort.InferenceSession(rewritten.SerializeToString(), session_options()).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert sum(n.domain == "com.microsoft.nchwc" and n.op_type == "Conv" for n in rewritten.graph.node) > len(convs) // 2


def test_ctrl_c_stops_a_tune_cleanly_and_keeps_records(small_model_path, tmp_path):
    db = tmp_path / "records.db"
    args = [sys.executable, "-m", "kselect.cli.main", "tune", str(small_model_path), "--library", "mlas",
            "--budget", "8", "--min-time", "0.02", "--db", str(db), "-o", str(tmp_path / "p.json")]
    # a shell starts background jobs with SIGINT ignored, and children inherit that: restore the
    # default so the CLI sees Ctrl-C even when the suite itself runs in the background
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and len(_records_so_far(db)) < 2:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    assert len(_records(db)) >= 2


def test_early_stop_ends_a_task_after_samples_without_improvement(small, tmp_path):
    _, tasks = small
    task = tasks[("block.conv1",)]
    library, device = plugins.get_library("mlas"), this_device()
    options = TuneOptions("random", budget=8, early_stop=1, settings=FAST)
    outcome = tune_tasks([task], library, device, RecordDB(tmp_path / "r.db"), options)[0]
    # 8 configs, budget 8: only a run of strictly improving samples could reach the budget
    assert outcome.stopped_early and outcome.samples < 8


def test_a_plan_that_differs_from_onnxruntime_is_written_node_by_node(tuned_small, tmp_path):
    """Flip one conv's layout: the applied model then carries kselect's own NCHWc nodes and
    reorders, loads in plain onnxruntime and still matches the original. It does so even when the
    tune kept the library default (marked ``library_default``, run as ORT's own session): the
    mark holds only while every node keeps its default config."""
    from kselect.plugins.mlas.apply import load_session

    model_path, plan_path, _ = tuned_small
    data = json.loads(plan_path.read_text())
    data["extra"]["library_default"] = True
    flipped = "block.conv1"
    old = data["nodes"][flipped]["config"]["layout"]
    data["nodes"][flipped]["config"] = dict(data["nodes"][flipped]["config"], layout="NCHW" if old == "NCHWc" else "NCHWc")
    changed = tmp_path / "flipped.plan.json"
    changed.write_text(json.dumps(data))
    result = run_kselect("plan", "apply", changed, model_path, "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    written = onnx.load(str(tmp_path / "flipped.kselect.onnx"))  # named after its plan
    assert sum(n.op_type in ("ReorderInput", "ReorderOutput") for n in written.graph.node) >= 2
    session = load_session(tmp_path / "flipped.kselect.onnx", tmp_path / "flipped.kselect.session.json")
    x = np.random.default_rng(4).standard_normal((1, 3, 32, 32), dtype=np.float32)
    expected = ort.InferenceSession(str(model_path)).run(None, {"input": x})[0]
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_end_to_end_check_falls_back_to_simpler_plans(small_model_path, tmp_path):
    from kselect.core.measuring.tuning_loop import library_tasks
    from kselect.core.plans.plan import plan_variants
    from kselect.core.whole_model.selection import verified_plan

    model = load_model(str(small_model_path))
    library, device = plugins.get_library("mlas"), this_device()
    tasks = library_tasks(model, library)
    db = RecordDB(tmp_path / "r.db")
    outcomes = tune_tasks(tasks, library, device, db, TuneOptions("random", budget=4, settings=FAST))
    records = {t.key: db.records(device.fingerprint, "mlas", library.version(), t.key) for t in tasks}
    variants = plan_variants(model, device, library, library.version(), tasks, records,
                             {o.task.key: o.default_config for o in outcomes})
    assert variants[-1][0] == "library default"  # identical variants are listed once, by the simpler name
    default_plan = variants[-1][1]
    assert all(t["config"] == t["default_config"] for t in default_plan.tasks)
    # An unreachable bar makes every variant "lose": the library default is kept, with the evidence.
    chosen = verified_plan(library, model, variants, min_speedup=100.0, rounds=2, runs_per_round=2)
    assert chosen is default_plan
    assert [t["variant"] for t in chosen.extra["verified"]["tried"]] == [name for name, _ in variants]
