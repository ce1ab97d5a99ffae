"""Faults and bad input (issue 25, first part): a NaN never passes an output check, a failed
measurement is taken again under a later run's settings, options are refused when parsed, SIGTERM
keeps every record, the measuring child dies with the tuner, and a plan is written whole or not
at all."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
import graphs
from graphs import small_cnn
from helpers import REPO, run_kselect

from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.tasks import Task, task_key
from kselect.core.plans.plan import write_atomically
from kselect.core.whole_model.bench import compare_outputs


def _statuses(db) -> dict[str, int]:
    with sqlite3.connect(db) as connection:
        return dict(connection.execute("SELECT status, COUNT(*) FROM records GROUP BY status").fetchall())


def test_a_nan_or_infinite_output_never_matches():
    reference = [np.ones((2, 3), np.float32)]
    assert compare_outputs(reference, [np.ones((2, 3))]) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        output = np.ones((2, 3), np.float32)
        output[1, 2] = bad
        assert compare_outputs(reference, [output]) == float("inf")
        assert compare_outputs([output], [output]) == float("inf")  # a NaN model does not pass against itself
    assert compare_outputs(reference, []) == float("inf")


def test_an_output_saturated_near_zero_is_compared_to_a_magnitude_floor():
    """PP-OCRv5's probability map on random input: every value near 1e-5, float32 rounding 2e-7."""
    rng = np.random.default_rng(0)
    reference = [rng.uniform(1e-6, 2e-5, (1, 1, 64, 64))]
    rounded = reference[0] + rng.uniform(-2e-7, 2e-7, reference[0].shape)
    assert compare_outputs(reference, [rounded]) < 1e-3
    assert compare_outputs(reference, [2 * reference[0]]) > 1e-2  # a wrong plan still fails


@pytest.mark.parametrize("option, value, says", [
    ("--min-time", "-1", "must be above 0"), ("--min-repeats", "0", "must be at least 1"),
    ("--early-stop", "-1", "must be at least 1"), ("--timeout", "0", "must be above 0"),
    ("--time-budget", "0", "must be above 0"), ("--time-budget", "-5", "must be above 0"),
    ("--budget", "0", "must be at least 1"), ("--budget", "two", "is not an integer"),
    ("--storage", "bogus://x", "is not a database URL"), ("--check-rounds", "0", "must be at least 1"),
])
def test_options_are_refused_when_parsed_in_one_line(tmp_path, option, value, says):
    db = tmp_path / "records.db"
    result = run_kselect("tune", "resnet18", "--library", "mlas", "--db", db, option, value)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr and option in result.stderr
    assert not db.exists()  # refused before anything was opened, let alone measured


def test_an_option_the_search_backend_does_not_take_is_refused(tmp_path):
    db = tmp_path / "records.db"
    result = run_kselect("tune", "resnet18", "--library", "mlas", "--search", "xgb", "--db", db,
                         "--storage", f"sqlite:///{tmp_path / 'optuna.db'}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "search 'xgb' takes no option 'storage'" in result.stderr
    assert not db.exists()


def test_a_repeated_input_shape_with_other_dims_is_refused(small_model_path):
    result = run_kselect("tasks", small_model_path, "--input-shape", "input=1,3,32,32", "--input-shape", "input=1,3,64,64")
    assert result.returncode == 2 and "twice" in result.stderr


def test_a_failed_measurement_is_measured_again_by_the_next_tune(tmp_path, small_model_path):
    """A tune whose time limit kills every candidate stores failures; the next tune, with a sane
    limit, measures those configs again instead of trusting the failure for good."""
    db = tmp_path / "records.db"
    args = ("tune", small_model_path, "--library", "mlas", "--budget", "2", "--min-time", "0.01", "--db", db,
            "--no-verify", "-o", tmp_path / "plan.json")
    first = run_kselect(*args, "--timeout", "0.001")
    assert _statuses(db).get("failed", 0) > 0, first.stderr
    second = run_kselect(*args)
    assert second.returncode == 0, second.stderr
    assert "failed" not in _statuses(db)  # every failure replaced by a measurement


def _start_tune(tmp_path, *extra):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "kselect.cli.main", "tune", "resnet18", "--library", "mlas",
                             "--budget", "40", "--min-time", "0.05", "--db", str(tmp_path / "records.db"), "--no-verify",
                             *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for_records(db, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if db.exists() and sum(_statuses_or_empty(db).values()) >= 2:  # tables may not exist yet
            return
        time.sleep(0.2)
    raise AssertionError("the tune stored nothing")


def test_sigterm_is_handled_like_ctrl_c_and_keeps_every_record(tmp_path):
    process = _start_tune(tmp_path)
    _wait_for_records(tmp_path / "records.db")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 143
    assert "terminated (SIGTERM)" in stderr and "Traceback" not in stderr
    assert sum(_statuses(tmp_path / "records.db").values()) >= 2


def test_the_measuring_child_dies_with_a_killed_tuner(tmp_path):
    process = _start_tune(tmp_path)
    _wait_for_records(tmp_path / "records.db")
    children = _children(process.pid)
    assert children, "no measuring child"
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and
                                              "Z" not in open(f"/proc/{pid}/stat").read().split()[2] for pid in children):
        time.sleep(0.1)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]]
    assert not alive


def test_a_plan_is_written_whole_or_not_at_all(tmp_path):
    """Disk full on a small tmpfs: the valid plan that was there stays (skipped where no tmpfs can
    be mounted)."""
    with _tmpfs(tmp_path / "small", "64k") as mount:
        plan = mount / "model.plan.json"
        write_atomically(plan, "{\"valid\": true}\n")
        with pytest.raises(OSError):
            write_atomically(plan, "x" * 200_000)  # larger than the filesystem
        assert plan.read_text() == "{\"valid\": true}\n"
        assert [p.name for p in mount.iterdir()] == ["model.plan.json"]  # no partial file left behind


@contextlib.contextmanager
def _tmpfs(mount, size: str):
    """A tmpfs of ``size`` mounted at ``mount`` while the block runs; the test is skipped where none
    can be mounted (not root, or no mount permission)."""
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


# -- refused before anything is measured ----------------------------------------------------------
def _fp16_model(path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float16), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])], "half",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


@pytest.mark.parametrize("case", ["fp16", "huge input", "unwritable output"])
def test_inputs_knowable_up_front_are_refused_before_measuring(tmp_path, small_model_path, case):
    db = tmp_path / "records.db"
    model, extra, says = small_model_path, [], ""
    if case == "fp16":
        model, says = _fp16_model(tmp_path / "half.onnx"), "is a float16 model (Conv 'conv'): kselect selects float32"
    elif case == "huge input":
        extra, says = ["--input-shape", "input=1,3,20000,20000"], "too large for this machine"
    else:
        extra, says = ["-o", "/proc/kselect/plan.json"], "cannot write the plan to /proc/kselect/plan.json"
    result = run_kselect("tune", model, "--library", "mlas", "--db", db, *extra)
    assert result.returncode == 2 and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not db.exists() or "records" not in str(_statuses_or_empty(db))


def _statuses_or_empty(db):
    try:
        return _statuses(db)
    except sqlite3.DatabaseError:
        return {}


# -- plans are validated before anything runs them ------------------------------------------------
def _tuned_small_cnn(folder, library: str):
    """(model, plan): the small CNN saved in ``folder`` and tuned on ``library`` (budget 2, unverified)."""
    import onnx

    model = folder / "small.onnx"
    onnx.save(small_cnn(), model)
    plan = folder / f"small.{library}.plan.json"
    result = run_kselect("tune", model, "--library", library, "--budget", "2", "--min-time", "0.01", "--no-verify",
                         "--db", folder / "records.db", "-o", plan)
    assert result.returncode == 0, result.stderr
    return model, plan


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    return _tuned_small_cnn(tmp_path_factory.mktemp("plan"), "xnnpack")


def _mutated(tmp_path, plan_path, mutate):
    import json

    data = json.loads(plan_path.read_text())
    mutate(data)
    path = tmp_path / "bad.plan.json"
    path.write_text(json.dumps(data))
    return path


def _first_node(data):
    return next(iter(data["nodes"]))


@pytest.mark.parametrize("mutation, says", [
    (lambda d: d["nodes"][_first_node(d)]["config"].update(threads=999), "is not in xnnpack's space"),
    (lambda d: d["nodes"][_first_node(d)]["config"].update(tile_n="not-a-number"), "is not in xnnpack's space"),
    (lambda d: d["nodes"][_first_node(d)].update(config={}), "empty or malformed config"),
    (lambda d: d["nodes"].update(ghost={"task": "T01", "library": "xnnpack", "config": {"threads": 1}}),
     "which small does not have"),
    (lambda d: d["nodes"][_first_node(d)].update(library="mlas"), "which the plan does not declare"),
])
def test_a_plan_that_does_not_fit_is_refused_before_it_runs(tmp_path, small_plan, mutation, says):
    model, plan = small_plan
    bad = _mutated(tmp_path, plan, mutation)
    for command in (["bench", model, "--plan", bad, "--rounds", "1", "--runs-per-round", "1"],
                    ["plan", "apply", bad, model, "-o", tmp_path / "out"]):
        result = run_kselect(*command, timeout=120)
        assert result.returncode == 2, (command, result.stderr)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    import kselect
    from kselect.core.errors import KselectError

    with pytest.raises(KselectError, match=says.split("'")[0]):
        kselect.load_plan(bad, str(model))


def test_plan_show_takes_a_plan_without_times(tmp_path, small_plan):
    _, plan = small_plan

    def drop_times(data):
        for task in data["tasks"]:
            task.pop("time_us", None)
    result = run_kselect("plan", "show", _mutated(tmp_path, plan, drop_times))
    assert result.returncode == 0, result.stderr


def test_two_tunes_on_one_database_take_turns_and_never_measure_a_config_twice(tmp_path, small_model_path):
    db = tmp_path / "records.db"
    args = [sys.executable, "-m", "kselect.cli.main", "tune", str(small_model_path), "--library", "mlas", "--budget", "4",
            "--min-time", "0.02", "--no-verify", "--db", str(db)]
    env = {**os.environ, "COLUMNS": "200"}
    first = subprocess.Popen([*args, "-o", str(tmp_path / "a.plan.json")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    _wait_for_records(db)
    second = subprocess.Popen([*args, "-o", str(tmp_path / "b.plan.json")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    out_first, err_first = first.communicate(timeout=300)
    first_done = time.time()
    out_second, err_second = second.communicate(timeout=300)
    assert "another kselect process is measuring on this device" in out_second
    # the tune that finished last wrote its plan; the other exits non-zero saying where the plan went
    # (issue 47, case 4): a user who got exit 0 finds a plan at -o
    for process, name, stderr in ((first, "a", err_first), (second, "b", err_second)):
        if process.returncode == 0:
            assert (tmp_path / f"{name}.plan.json").is_file()
        else:
            assert process.returncode == 2 and not (tmp_path / f"{name}.plan.json").exists()
            assert f"no plan was written to {tmp_path / f'{name}.plan.json'}" in stderr.strip().splitlines()[-1]
            assert "writes the plan to its own -o" in stderr
    assert sorted((first.returncode, second.returncode)) in ([0, 0], [0, 2])
    with sqlite3.connect(db) as connection:
        configs = connection.execute("SELECT COUNT(DISTINCT task || config) FROM records").fetchone()[0]
        total, last = connection.execute("SELECT COUNT(*), MAX(created) FROM records").fetchone()
    assert total == configs  # one record per config
    # the second tune waited, then found every config of its budget stored: it measured nothing
    # and overwrote nothing (a record written or replaced by it would be newer than the first's end)
    assert last <= first_done


def test_a_read_only_database_serves_its_records_and_refuses_only_new_measurements(tmp_path, small_model_path):
    """On a read-only filesystem (a tmpfs remounted read-only; skipped where none can be mounted):
    a tune whose records are all stored runs; one that needs a new measurement says so before it
    measures; a new database there is refused as not writable, not as corrupt."""
    with _tmpfs(tmp_path / "ro", "8m") as mount:
        db = mount / "records.db"
        args = ("tune", small_model_path, "--library", "mlas", "--min-time", "0.01", "--no-verify", "--db", db)
        first = run_kselect(*args, "--budget", "2", "-o", tmp_path / "a.plan.json")
        assert first.returncode == 0, first.stderr
        assert subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode == 0
        again = run_kselect(*args, "--budget", "2", "-o", tmp_path / "b.plan.json")
        assert again.returncode == 0, again.stderr  # every record it needs is stored
        more = run_kselect(*args, "--budget", "3", "-o", tmp_path / "c.plan.json")
        assert more.returncode == 2 and "is read-only" in more.stderr
        new = run_kselect(*args[:-1], mount / "new.db", "--budget", "2")
        assert new.returncode == 2 and "is not writable" in new.stderr and "corrupt" not in new.stderr


def test_kill_9_at_seeded_random_moments_loses_nothing_and_resuming_measures_nothing_again(tmp_path, small_model_path):
    """SIGKILL to the tuner (and its process group) at 10 seeded random moments of one tune,
    resumed each time: the database passes SQLite's integrity check after every kill, no stored
    record changes, and the finished tune holds exactly one record per config it had to measure."""
    import random

    rng = random.Random(25)
    db, plan = tmp_path / "records.db", tmp_path / "small.plan.json"
    args = [sys.executable, "-m", "kselect.cli.main", "tune", str(small_model_path), "--library", "mlas",
            "--search", "exhaustive", "--budget", "12", "--min-time", "0.05", "--no-verify", "--db", str(db),
            "-o", str(plan)]
    env = {**os.environ, "COLUMNS": "200"}

    def stored() -> dict:
        if not db.exists():
            return {}
        with sqlite3.connect(db) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            return {(task, config): (status, median, created) for task, config, status, median, created in
                    connection.execute("SELECT task, config, status, median_us, created FROM records")}

    kills = 0
    for _ in range(10):
        before = stored()
        process = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        time.sleep(rng.uniform(0.5, 3.0))
        if process.poll() is not None:
            break  # the tune finished before this kill
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        kills += 1
        after = stored()
        assert all(after[key] == value for key, value in before.items())  # nothing lost, nothing re-measured
    assert kills >= 3
    finished = run_kselect(*args[3:])
    assert finished.returncode == 0, finished.stderr
    with sqlite3.connect(db) as connection:
        total, distinct = connection.execute("SELECT COUNT(*), COUNT(DISTINCT task || config) FROM records").fetchone()
    assert total == distinct and plan.exists()


def _pointwise(channels: int, size: int) -> Task:
    attrs = {"kernel": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1}
    shape, weight = [1, channels, size, size], [channels, channels, 1, 1]
    signature = {"kind": "conv", "input": shape, "weight": weight, "output": shape, "attrs": attrs, "bias": False}
    return Task(f"T{size}", task_key(signature), "conv", shape, weight, shape, attrs, False, ["conv"])


def test_a_candidate_that_allocates_past_its_memory_cap_fails_alone():
    """A 1x1 conv on 1x16x1024x1024 (its output alone 64 MiB) may allocate 32 MiB beyond what the
    child holds: ONNX Runtime cannot allocate the output, the candidate is recorded failed, and
    the same child goes on measuring a small op."""
    settings = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.05, candidate_memory_mb=32)
    config = {"layout": "NCHW", "threads": 1, "spinning": 0}
    small, big = _pointwise(16, 32), _pointwise(16, 1024)
    with MeasureWorker("mlas", settings) as worker:
        assert worker.measure(small, config).status == "ok"
        child = worker.process.pid
        failed = worker.measure(big, config)
        assert failed.status == "failed" and ("memory" in failed.reason or "bad_alloc" in failed.reason), failed
        assert worker.measure(small, config).status == "ok"
        assert worker.process.pid == child  # contained: an allocation failed, nothing crashed


def test_a_plan_computing_something_else_is_never_kept(monkeypatch, small_model_path):
    """The single-library end-to-end check compares outputs as well as speed: an MLAS plan whose
    runner returns values 1% off is refused in one line, and the same plan computing the right
    values is kept."""
    from kselect.core.contract import plugins
    from kselect.core.errors import KselectError
    from kselect.core.measuring.device import this_device
    from kselect.core.models.model import load_model
    from kselect.core.models.tasks import extract_tasks
    from kselect.core.plans.plan import Plan
    from kselect.core.whole_model.selection import verified_plan
    from kselect.plugins.mlas.library import MlasLibrary

    model, library, device = load_model(str(small_model_path)), plugins.get_library("mlas"), this_device()
    library.prepare_model(model)
    tasks = extract_tasks(model)
    configs = {t.id: library.default_config(t, device) for t in tasks}
    plan_level = {k: v for c in configs.values() for k, v in c.items() if k in library.plan_level_dims}
    plan = Plan(model={"name": model.name, "fingerprint": model.fingerprint(), "inputs": model.input_shapes},
                device=device.to_json(), libraries={"mlas": library.version()}, emulated=False, plan_level=plan_level,
                tasks=[{**t.to_json(), "library": "mlas", "config": configs[t.id]} for t in tasks],
                nodes={n: {"task": t.id, "library": "mlas", "config": configs[t.id]} for t in tasks for n in t.nodes})
    assert verified_plan(library, model, [("tuned", plan)], rounds=2, runs_per_round=1).extra["verified"]["chosen"] == "tuned"

    honest = MlasLibrary.model_runner

    def off_by_one_percent(self, model, plan, in_mixed_plan=False):
        run = honest(self, model, plan, in_mixed_plan)
        return run if plan is None else (lambda feeds: [output * 1.01 for output in run(feeds)])

    monkeypatch.setattr(MlasLibrary, "model_runner", off_by_one_percent)
    with pytest.raises(KselectError, match="no plan of mlas computes what its default does"):
        verified_plan(library, model, [("tuned", plan)], rounds=2, runs_per_round=1)


def test_claims_keep_tunes_sharing_a_database_from_measuring_a_config_twice(tmp_path):
    """Another tune (another machine of this device, sharing the database) has claimed the default
    config: this tune waits for its record and takes it instead of measuring. Configs claimed by a
    process that died on this host are taken over at once. No claim is left behind."""
    import socket
    import threading

    from kselect.core.contract import plugins
    from kselect.core.contract.space import config_key
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import Result
    from kselect.core.measuring.tuning_loop import TuneOptions, tune_tasks
    from kselect.core.records.store import RecordDB

    library, device = plugins.get_library("mlas"), this_device()
    task, path = _pointwise(16, 32), tmp_path / "shared.db"
    space = library.space(task, device)
    default = config_key(space.normalise(library.default_config(task, device)))
    other = RecordDB(path)
    key = (device.fingerprint, "mlas", library.version(), task.key)
    assert other.claim(*key, default, 600, 0, owner="otherhost:4242:0") is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f"{socket.gethostname()}:{gone.pid}:0"
    for config in space.enumerate():
        if config_key(config) != default:
            assert other.claim(*key, config_key(config), 600, 0, owner=dead) is None

    def other_tune_stores_its_measurement():
        RecordDB(path).add(*key[:3], task.to_json(), default, Result("ok", 123.0, 0.01, 10, 0.0), False, True)

    threading.Timer(1.0, other_tune_stores_its_measurement).start()
    settings = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.05)
    db = RecordDB(path)
    started = time.monotonic()
    outcome, = tune_tasks([task], library, device, db, TuneOptions("exhaustive", 2, settings=settings))
    assert time.monotonic() - started < 60  # the dead process's claims did not hold it up
    stored = {r.config_key: r.result for r in db.records(*key)}
    assert stored[default].median_us == 123.0 and len(stored) == 2  # the default was not measured again
    assert outcome.measured_now == 1 and outcome.samples == 2
    owners = [row[0] for row in db.connection.execute("SELECT owner FROM claims")]
    assert owners == [dead] * (len(space) - 2)  # only the dead process's claims on configs nobody needed


# -- the rest of the probe's bad inputs: each one line, a non-zero exit, nothing measured ----------
def _bad_inputs(tmp_path, small_model_path, small_plan) -> dict:
    """name -> (arguments, what the error says)."""
    import onnx
    from onnx import TensorProto, helper

    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(small_model_path.read_bytes()[:300])
    no_float_input = tmp_path / "ints.onnx"
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.INT64, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), no_float_input)
    plan_folder = tmp_path / "a-folder.plan.json"
    plan_folder.mkdir()
    _, plan = small_plan
    tune = ("tune", small_model_path, "--library", "mlas")
    return {
        "a directory as model": (("tasks", tmp_path), "is a directory, not an ONNX model"),
        "an empty file": (("tasks", empty), "is not"),
        "a truncated ONNX file": (("tasks", truncated), "is not a readable ONNX model"),
        "a model without a tunable op": (("tune", no_float_input, "--library", "mlas"), "nothing to tune"),
        "an empty library list": ((*tune[:3], ""), "library"),
        "one unknown library among known": ((*tune[:3], "mlas,nosuchlib"), "unknown library 'nosuchlib'"),
        "a zero dim": ((*tune, "--input-shape", "input=1,3,0,32"), "bad --input-shape"),
        "a negative dim": ((*tune, "--input-shape", "input=-1,3,32,32"), "bad --input-shape"),
        "a shape without a name": ((*tune, "--input-shape", "=1,3,32,32"), "bad --input-shape"),
        "a shape of another rank": ((*tune, "--input-shape", "input=1,3,32"), "has 3 dims"),
        "a directory as database": ((*tune, "--db", tmp_path), "is a directory, not a database file"),
        "a directory as plan output": ((*tune, "-o", tmp_path), "is a directory, not a plan file"),
        "an unknown task": (("space", small_model_path, "--library", "mlas", "--task", "T99"), "no task 'T99'"),
        "a precision the library lacks": (("space", small_model_path, "--library", "mlas", "--task", "T01.bf16"),
                                          "mlas has no bf16 tasks here: ONNX Runtime has no bf16 conv"),
        "a directory as plan": (("bench", small_model_path, "--plan", plan_folder), "plan"),
        "a plan for another model": (("bench", "resnet18", "--plan", plan, "--rounds", "1"), "resnet18"),
        "no model": (("tune",), "model"),
        "an unknown command": (("tuen", small_model_path), "tuen"),
        "an unknown option": ((*tune, "--budjet", "3"), "--budjet"),
    }


BAD_INPUTS = ["a directory as model", "an empty file", "a truncated ONNX file", "a model without a tunable op",
              "an empty library list", "one unknown library among known", "a zero dim", "a negative dim",
              "a shape without a name", "a shape of another rank", "a directory as database",
              "a directory as plan output", "an unknown task", "a precision the library lacks", "a directory as plan",
              "a plan for another model",
              "no model", "an unknown command", "an unknown option"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_a_non_zero_exit_before_measuring(tmp_path, small_model_path, small_plan, case):
    args, says = _bad_inputs(tmp_path, small_model_path, small_plan)[case]
    db = tmp_path / "probe.db"
    if "--db" not in args:
        args = (*args, "--db", db) if args and args[0] == "tune" and len(args) > 1 else args
    result = run_kselect(*args, timeout=120)
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not db.exists()  # nothing measured, nothing stored


# -- issue 47: what a hostile user tried -----------------------------------------------------------
def _one_line_error(result, *fragments, code=2):
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def inputs(tmp_path, small_plan):
    """A copy of the small model, its xnnpack plan and a record database, in ``tmp_path``."""
    from kselect.core.records.store import RecordDB

    model, plan = small_plan
    copies = {"model": tmp_path / "small.onnx", "plan": tmp_path / "small.xnnpack.plan.json", "db": tmp_path / "r.db"}
    copies["model"].write_bytes(model.read_bytes())
    copies["plan"].write_bytes(plan.read_bytes())
    RecordDB(copies["db"]).connection.close()
    return copies


@pytest.mark.parametrize("case", ["tune -o model", "tune -o db", "report -o plan", "report -o db",
                                  "predict --json model", "bench --json plan"])
def test_case_01_an_output_that_is_an_input_of_the_same_command_is_refused_and_kept(inputs, case):
    model, plan, db = inputs["model"], inputs["plan"], inputs["db"]
    command, option, target = case.split()
    target = inputs[target]
    args = {"tune": ("tune", model, "--library", "mlas", "--budget", "1", "--db", db, "-o", target),
            "report": ("report", plan, "--db", db, "-o", target),
            "predict": ("predict", model, "--library", "xnnpack", "--db", db, "--json", target),
            "bench": ("bench", model, "--plan", plan, "--rounds", "1", "--json", target)}[command]
    before = {name: path.read_bytes() for name, path in inputs.items()}
    _one_line_error(run_kselect(*args), f"{option} {target} is the", "would destroy it")
    assert {name: path.read_bytes() for name, path in inputs.items()} == before


def test_case_02_artifacts_are_named_after_their_plan_so_two_plans_of_one_model_keep_theirs(tmp_path):
    import json

    import onnx

    model = tmp_path / "good.onnx"
    onnx.save(small_cnn(dynamic=True), model)
    written = {}
    for name, size in (("a", 32), ("b", 48)):
        result = run_kselect("tune", model, "--input-shape", f"input=1,3,{size},{size}", "--library", "mlas",
                             "--budget", "1", "--min-time", "0.01", "--no-verify", "--db", tmp_path / "r.db",
                             "-o", tmp_path / f"{name}.plan.json", "--json")
        assert result.returncode == 0, result.stderr
        written[name] = json.loads(result.stdout)["artifacts"]
    assert written["a"] == [str(tmp_path / "a.kselect.onnx"), str(tmp_path / "a.kselect.session.json")]
    assert written["b"] == [str(tmp_path / "b.kselect.onnx"), str(tmp_path / "b.kselect.session.json")]
    shapes = {name: onnx.load(str(tmp_path / f"{name}.kselect.onnx")).graph.input[0].type.tensor_type.shape
              for name in "ab"}
    assert [d.dim_value for d in shapes["a"].dim] == [1, 3, 32, 32]
    assert [d.dim_value for d in shapes["b"].dim] == [1, 3, 48, 48]
    assert not (tmp_path / "good.kselect.onnx").exists()


def test_case_02_an_artifact_whose_name_is_the_model_never_replaces_it(tmp_path):
    """A model named like its plan's artifact (``a.kselect.onnx`` tuned with ``-o a.plan.json``):
    the artifact is refused in one line and the model keeps its bytes; the plan is written."""
    import onnx

    model = tmp_path / "a.kselect.onnx"
    onnx.save(small_cnn(), model)
    before = model.read_bytes()
    result = run_kselect("tune", model, "--library", "mlas", "--budget", "1", "--min-time", "0.01", "--no-verify",
                         "--db", tmp_path / "r.db", "-o", tmp_path / "a.plan.json")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {model} is the model this command reads: writing an output "
                                                  f"there would destroy it; give another path"]
    assert model.read_bytes() == before and (tmp_path / "a.plan.json").is_file()


@pytest.mark.parametrize("node", ["fifo", "character device"])
def test_case_03_an_output_that_is_a_device_node_or_fifo_is_refused_and_left_as_it_is(tmp_path, inputs, node):
    import stat

    out = tmp_path / "out"
    out.mkdir()
    target = out / "nulldev"
    if node == "fifo":
        os.mkfifo(target)
    else:
        try:
            os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
    kind = stat.S_IFMT(target.lstat().st_mode)
    for args in (("tune", inputs["model"], "--library", "mlas", "--db", inputs["db"], "-o", target),
                 ("report", inputs["plan"], "-o", target),
                 ("bench", inputs["model"], "--plan", inputs["plan"], "--json", target)):
        _one_line_error(run_kselect(*args), f"{target} is not a regular file")
        assert stat.S_IFMT(target.lstat().st_mode) == kind


@pytest.mark.parametrize("case", ["bench --json", "predict --json", "plan apply into a file",
                                  "plan apply into an unwritable place", "report -o"])
def test_case_13_every_output_path_is_checked_before_the_work(tmp_path, inputs, case):
    model, plan, db = inputs["model"], inputs["plan"], inputs["db"]
    unwritable = "/proc/kselect/out.json"
    args, says = {
        "bench --json": (("bench", model, "--plan", plan, "--rounds", "50", "--json", unwritable),
                         f"cannot write the JSON to {unwritable}"),
        "predict --json": (("predict", model, "--library", "xnnpack", "--db", db, "--json", unwritable),
                           f"cannot write the JSON to {unwritable}"),
        "plan apply into a file": (("plan", "apply", plan, model, "-o", db), f"-o {db} is not a folder"),
        "plan apply into an unwritable place": (("plan", "apply", plan, model, "-o", "/proc/kselect/out"),
                                                "cannot write the plan's artifacts to /proc/kselect/out"),
        "report -o": (("report", plan, "-o", "/proc/kselect/r.html"), "cannot write the report to /proc/kselect/r.html"),
    }[case]
    started = time.monotonic()
    _one_line_error(run_kselect(*args), says)
    assert time.monotonic() - started < 30  # refused up front: 50 rounds of bench were not run first


@pytest.mark.parametrize("libraries, options, says", [
    ("mlas", {"budget": -3}, "--budget -3: must be between 1"),
    ("mlas", {"budget": 2.5}, "--budget 2.5: give an integer"),
    ("mlas", {"budget": 0}, "--budget 0: must be between 1"),
    ("mlas", {"budget": "x"}, "--budget 'x': give an integer"),
    ("mlas", {"time_budget_s": -1}, "--time-budget -1: must be above 0"),
    ("mlas", {"time_budget_s": float("nan")}, "--time-budget nan: must be above 0"),
    (None, {}, "libraries None: give a --library spec"),
    ("mlas", {"budjet": 3}, "kselect.tune takes no option 'budjet'"),
])
def test_case_17_the_python_api_refuses_what_the_cli_refuses_before_measuring(tmp_path, small_model_path, libraries,
                                                                              options, says):
    import kselect
    from kselect.core.errors import KselectError

    db = tmp_path / "records.db"
    with pytest.raises(KselectError) as refused:
        kselect.tune(str(small_model_path), libraries, db=db, **options)
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not db.exists()
    if options and "budjet" not in options:  # the same check behind the config object
        with pytest.raises(KselectError, match=says.split(":")[0]):
            kselect.TuneConfig(**options)


@pytest.mark.parametrize("extra, says", [
    (("--min-time", "1e12"), "--min-time 1000000000000.0: must be above 0 and at most 60"),
    (("--min-repeats", "1000000000"), "--min-repeats 1000000000: must be between 1 and 100,000"),
    (("--metric", "foo"), "--metric is for reduced precisions"),
    (("--db", ""), "--db '': give a database file"),
    (("-o", ""), "-o '': give a file name for the plan"),
    (("--db", "mysql://host/x"), "give a database file, sqlite:///FILE or a postgresql:// URL"),
])
def test_case_18_options_a_tune_cannot_honour_are_refused_in_one_line(tmp_path, small_model_path, extra, says):
    db_args = () if "--db" in extra else ("--db", tmp_path / "records.db")
    result = run_kselect("tune", small_model_path, "--library", "mlas", *db_args, *extra, cwd=tmp_path)
    _one_line_error(result, says)
    assert list(tmp_path.iterdir()) == [small_model_path]  # nothing written, not even a database


def test_case_18_a_sqlite_url_as_db_is_the_file_it_names(tmp_path, small_model_path):
    import json

    db = tmp_path / "dir" / "x.db"
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--budget", "1", "--min-time", "0.01",
                         "--no-verify", "--db", f"sqlite:///{db}", "-o", tmp_path / "p.plan.json", "--json",
                         cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert db.is_file() and json.loads(result.stdout)["plan_file"] == str(tmp_path / "p.plan.json")
    assert not (tmp_path / "sqlite:").exists()


@pytest.fixture(scope="module")
def small_mlas_plan(tmp_path_factory):
    return _tuned_small_cnn(tmp_path_factory.mktemp("mlas-plan"), "mlas")


def _plan_readers(model, plan, out):
    return {"bench": ("bench", model, "--plan", plan, "--rounds", "1", "--runs-per-round", "1"),
            "plan apply": ("plan", "apply", plan, model, "-o", out)}


@pytest.mark.parametrize("setting, value, says", [
    ("pointwise_batch", "not-a-number", "plan-level setting pointwise_batch='not-a-number' is not in mlas's space"),
    ("threads", 999, "plan-level setting threads=999 is not in mlas's space"),
    ("threads", -1, "plan-level setting threads=-1 is not in mlas's space"),
    ("spinning", 5, "plan-level setting spinning=5 is not in mlas's space"),
    ("prepacking", "yes", "plan-level setting prepacking='yes' is not in mlas's space"),
    ("colour", "blue", "plan-level setting colour='blue' is not one of mlas's"),
    ("emulated", "false", "'emulated' is \"false\", not true or false"),
])
def test_case_05_plan_level_settings_outside_the_space_are_refused_never_abort(tmp_path, small_mlas_plan, setting,
                                                                               value, says):
    import kselect
    from kselect.core.errors import KselectError

    model, plan = small_mlas_plan

    def mutate(data):
        if setting == "emulated":
            data["emulated"] = value
            return
        data["plan_level"][setting] = value
        data["library_settings"]["mlas"][setting] = value
    bad = _mutated(tmp_path, plan, mutate)
    for name, args in _plan_readers(model, bad, tmp_path / "out").items():
        _one_line_error(run_kselect(*args), says)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # no session.json written
    with pytest.raises(KselectError, match=re.escape(says)):
        kselect.load_plan(bad, str(model))


def _nested(tmp_path, depth=200_000):
    path = tmp_path / "deep.plan.json"
    path.write_text("[" * depth + "]" * depth)
    return path


@pytest.mark.parametrize("mutation, says", [
    (lambda d: d.update(tasks="x"), "'tasks' is \"x\", not a list"),
    (lambda d: d.update(extra=[]), "'extra' is [], not an object"),
    (lambda d: d.update(model="x"), "'model' is \"x\", not an object"),
    (lambda d: d["tasks"][0].pop("nodes"), "task 0 lacks the field 'nodes'"),
    (lambda d: d.update(library_settings="x"), "'library_settings' is \"x\", not an object"),
    (lambda d: d.update(plan_level=[]), "'plan_level' is [], not an object"),
    (lambda d: d["library_settings"]["xnnpack"].update(spinning=[1]), "'spinning' is [1], not a single value"),
    (lambda d: d.update(surprise=1), "unknown field 'surprise'"),
    (None, "nested too deeply"),
])
def test_case_12_a_plan_of_the_wrong_shape_is_one_line_for_every_command_that_reads_it(tmp_path, small_plan,
                                                                                       mutation, says):
    import kselect
    from kselect.core.errors import KselectError

    model, plan = small_plan
    bad = _nested(tmp_path) if mutation is None else _mutated(tmp_path, plan, mutation)
    for args in (*_plan_readers(model, bad, tmp_path / "out").values(), ("plan", "show", bad), ("report", bad),
                 ("plan", "show", bad, "--json")):
        _one_line_error(run_kselect(*args), f"{bad} is not a valid kselect plan", says)
    with pytest.raises(KselectError, match="is not a valid kselect plan"):
        kselect.load_plan(bad, str(model))


def test_case_06_names_print_as_they_are_never_as_rich_markup(tmp_path, small_plan):
    import json

    _one_line_error(run_kselect("tasks", "missing[/b].onnx"), "missing[/b].onnx")
    _one_line_error(run_kselect("tasks", "m[red]x[/red].onnx"), "m[red]x[/red].onnx")
    half = _fp16_model(tmp_path / "half.onnx")
    import onnx

    proto = onnx.load(str(half))
    proto.graph.node[0].name = "[/x]"
    onnx.save(proto, half)
    _one_line_error(run_kselect("tune", half, "--library", "mlas", "--db", tmp_path / "r.db"), "Conv '[/x]'")
    model, plan = small_plan
    data = json.loads(plan.read_text())
    data["nodes"]["[/x]"] = data["nodes"].pop(_first_node(data))
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(data))
    _one_line_error(run_kselect("plan", "apply", bad, model, "-o", tmp_path / "out"), "node '[/x]'")
    data["model"]["name"] = "[red]m[/red] [/x]"
    bad.write_text(json.dumps(data))
    shown = run_kselect("plan", "show", bad)
    assert shown.returncode == 0 and "plan for [red]m[/red] [/x] (" in shown.stdout, shown.stderr


@pytest.mark.parametrize("extra, says", [
    (("--lease", "inf"), "--lease: inf is not a finite number"),
    (("--timeout", "inf"), "--timeout: inf is not a finite number"),
    (("--time-budget", "nan"), "--time-budget: nan is not a finite number"),
    (("--min-time", "1e999"), "--min-time: 1e999 is not a finite number"),
    (("--input-shape", "input=1,3,99999999999999999999,16"), "a dim is larger than 2,147,483,647"),
])
def test_case_08_numbers_past_what_a_tune_can_take_are_refused_when_parsed(tmp_path, small_model_path, extra, says):
    db = tmp_path / "records.db"
    _one_line_error(run_kselect("tune", small_model_path, "--library", "mlas", "--db", db, *extra), says)
    assert not db.exists()


def test_case_14_an_optuna_storage_in_a_missing_folder_is_one_line_before_measuring(tmp_path, small_model_path):
    db = tmp_path / "records.db"
    _one_line_error(run_kselect("tune", small_model_path, "--library", "mlas", "--search", "tpe", "--db", db,
                                "--storage", "sqlite:////nonexistent/optuna.db"),
                    "--storage sqlite:////nonexistent/optuna.db: folder /nonexistent does not exist")
    assert not db.exists()


def test_case_09_a_database_another_process_holds_locked_is_said_to_be_locked_not_corrupt(tmp_path, small_model_path):
    """Past the busy time-out ($KSELECT_DB_BUSY_TIMEOUT, 2 s here; 30 by default) the tune stops
    with one line saying the database is locked, and how long it waited."""
    from kselect.core.records.store import RecordDB

    db = tmp_path / "records.db"
    RecordDB(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        result = run_kselect("tune", small_model_path, "--library", "mlas", "--budget", "1", "--db", db,
                             env={"KSELECT_DB_BUSY_TIMEOUT": "2"}, timeout=120)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    line = _one_line_error(result, f"the record database {db} is locked by another process (held for over 2 s")
    assert "corrupt" not in line


def test_a_busy_time_out_that_is_not_a_number_of_seconds_is_one_line(tmp_path, small_model_path):
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--budget", "1", "--db", tmp_path / "r.db",
                         env={"KSELECT_DB_BUSY_TIMEOUT": "soon"})
    assert not (tmp_path / "r.db").exists()
    _one_line_error(result, "KSELECT_DB_BUSY_TIMEOUT='soon': give a number of seconds above 0")


def _fill(mount):
    """Fills the filesystem at ``mount`` to the last byte."""
    descriptor = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(descriptor, b"\0" * 4096)
    finally:
        os.close(descriptor)


def test_case_10_a_full_disk_is_one_line_naming_the_file(tmp_path, small_model_path):
    from kselect.core.records.store import RecordDB

    with _tmpfs(tmp_path / "small", "2m") as mount:
        full_db, plan = mount / "records.db", mount / "small.plan.json"
        args = ("tune", small_model_path, "--library", "mlas", "--budget", "1", "--min-time", "0.01", "--no-verify")
        first = run_kselect(*args, "--db", tmp_path / "records.db", "-o", plan)
        assert first.returncode == 0, first.stderr
        before = plan.read_bytes()
        RecordDB(full_db).close()
        (mount / "small.kselect.onnx").unlink()  # room for the filler, not for another artifact
        _fill(mount)
        _one_line_error(run_kselect(*args, "--db", full_db, "-o", tmp_path / "b.plan.json"),
                        f"cannot write the record database {full_db}", "full")
        _one_line_error(run_kselect(*args, "--db", tmp_path / "records.db", "-o", plan),
                        f"cannot write {plan}: No space left on device (what it held before is kept)")
        assert plan.read_bytes() == before


def test_case_11_a_bad_record_row_is_skipped_with_a_warning_naming_it(tmp_path, small_model_path):
    db, plan = tmp_path / "records.db", tmp_path / "small.plan.json"
    args = ("tune", small_model_path, "--library", "mlas", "--budget", "2", "--min-time", "0.01", "--no-verify",
            "--db", db, "-o", plan)
    assert run_kselect(*args).returncode == 0
    with sqlite3.connect(db) as connection:
        ids = [row[0] for row in connection.execute("SELECT id FROM records WHERE status='ok' ORDER BY id")]
        connection.execute("UPDATE records SET config='not json' WHERE id=?", (ids[0],))
        connection.execute("UPDATE records SET median_us=-5 WHERE id=?", (ids[1],))
        connection.execute("UPDATE records SET task_json='{}' WHERE id=?", (ids[2],))
    warned = {"predict": run_kselect("predict", small_model_path, "--library", "mlas", "--db", db),
              "report": run_kselect("report", plan, "--db", db, "-o", tmp_path / "r.html"),
              "tune": run_kselect(*args)}
    for command, result in warned.items():
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr
        assert f"warning: record {ids[0]} of {db} is skipped: its config is not JSON" in result.stderr, command
        assert f"warning: record {ids[1]} of {db} is skipped: its time -5.0 us is not a number of microseconds" in \
            result.stderr, command
    assert f"warning: record {ids[2]} of {db} is skipped: its task_json is not a task" in warned["predict"].stderr


def _png_header_only(path, width, height):
    """A PNG that says it is ``width`` x ``height`` (what Pillow reads before decoding anything)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("case", ["a FIFO named f0.npy", "a decompression bomb"])
def test_case_07_calibration_input_that_would_hang_or_explode_is_one_line(tmp_path, small_model_path, case):
    folder = tmp_path / "calibration"
    folder.mkdir()
    if case == "a FIFO named f0.npy":
        os.mkfifo(folder / "f0.npy")
        says = f"--calibration: {folder / 'f0.npy'} is not a regular file"
    else:
        _png_header_only(folder / "huge.png", 15000, 15000)
        says = "--calibration: image huge.png has more than"
    db = tmp_path / "records.db"
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--precision", "fp32,int8", "--calibration",
                         folder, "--db", db, timeout=120)
    _one_line_error(result, says)
    assert not db.exists()


def _one_conv_model(path, x_shape, w_shape, pads=(0, 0, 0, 0), group=1):
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones(w_shape, np.float32), "w")
    return graphs.saved(graphs.model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=list(pads),
                                                       group=group)], [w], input_shape=x_shape, name="one_conv"), path)


@pytest.mark.parametrize("case, x_shape, w_shape, group, says", [
    ("kernel larger than its padded input", [1, 3, 8, 8], [8, 3, 25, 25], 1,
     "Conv 'conv': its kernel [25, 25] is larger than its padded input [8, 8]"),
    ("groups that do not divide", [1, 6, 8, 8], [8, 3, 3, 3], 3, "its 8 output channels do not divide into 3 groups"),
    ("0 output channels", [1, 3, 8, 8], [0, 3, 3, 3], 1, "Conv 'conv' has 0 output channels"),
])
def test_case_15_a_conv_no_library_can_run_is_refused_before_measuring(tmp_path, case, x_shape, w_shape, group, says):
    model = _one_conv_model(tmp_path / "bad.onnx", x_shape, w_shape, group=group)
    db = tmp_path / "records.db"
    for args in (("tasks", model), ("tune", model, "--library", "mlas", "--db", db)):
        result = run_kselect(*args)
        assert result.returncode != 0 and "Traceback" not in result.stderr and "internal error" not in result.stderr
        assert says in result.stderr.strip().splitlines()[-1], result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not db.exists()


def test_case_16_an_input_shape_against_the_weights_is_refused_and_a_static_dim_overridden_is_said(tmp_path):
    import json

    model = _one_conv_model(tmp_path / "static.onnx", [1, 3, 16, 16], [8, 3, 3, 3], pads=(1, 1, 1, 1))
    db = tmp_path / "records.db"
    _one_line_error(run_kselect("tune", model, "--library", "mlas", "--db", db, "--input-shape", "x=1,4,16,16"),
                    "Conv 'conv': its input has 4 channels, its weight takes 3")
    assert not db.exists()
    result = run_kselect("tasks", model, "--input-shape", "x=2,3,32,32", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tasks"][0]["input"] == [2, 3, 32, 32]
    notes = [line for line in result.stderr.splitlines() if line.strip()]
    assert notes == ["note: --input-shape x=2,3,32,32 overrides the model's static dims 1,3,16,16 (dim 0, 2, 3): "
                     "kselect tunes the shape given"]
    plain = run_kselect("tasks", model)  # no override, no note
    assert plain.returncode == 0 and "note:" not in plain.stdout + plain.stderr


def _model_with(tmp_path, name, extra_nodes, extra_inputs, extra_inits, ir_version=8):
    """small_cnn's graph with nodes, inputs and initializers added."""
    import onnx

    proto = small_cnn()
    proto.ir_version = ir_version
    proto.graph.node.extend(extra_nodes)
    proto.graph.input.extend(extra_inputs)
    proto.graph.initializer.extend(extra_inits)
    path = tmp_path / name
    onnx.save(proto, path)
    return path


def test_case_19_a_weight_that_is_also_a_graph_input_stays_an_input(tmp_path):
    import json

    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = _model_with(tmp_path, "fed.onnx",
                        [helper.make_node("Conv", ["input", "side.w"], ["side"], name="side", pads=[1, 1, 1, 1])],
                        [helper.make_tensor_value_info("side.w", TensorProto.FLOAT, [4, 3, 3, 3])],
                        [numpy_helper.from_array(w, "side.w")])
    proto = __import__("onnx").load(str(model))
    proto.graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, None))
    __import__("onnx").save(proto, model)
    tasks = json.loads(run_kselect("tasks", model, "--json").stdout)
    assert {"node": "side", "op": "Conv", "why": "its weight 'side.w' is also a graph input, which a feed may replace: "
            "no fixed kernel to select"} in tasks["untuned"]
    plan = tmp_path / "fed.plan.json"
    result = run_kselect("tune", model, "--library", "mlas", "--budget", "1", "--min-time", "0.01", "--no-verify",
                         "--db", tmp_path / "r.db", "-o", plan)
    assert result.returncode == 0, result.stderr
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    fed = {"input": x, "side.w": 2 * w}
    expected = ort.InferenceSession(str(model)).run(["side"], fed)[0]
    assert "side.w" in [i.name for i in __import__("onnx").load(str(tmp_path / "fed.kselect.onnx")).graph.input]
    artifact = ort.InferenceSession(str(tmp_path / "fed.kselect.onnx"))
    np.testing.assert_allclose(artifact.run(["side"], fed)[0], expected, rtol=1e-4, atol=1e-4)


def test_an_unread_weight_listed_as_a_graph_input_is_no_input_to_feed(tmp_path):
    """CenterFace's export lists its BatchNorms' num_batches_tracked counters, which no node reads,
    as graph inputs with initializers: the model takes one input, the picture."""
    from onnx import TensorProto, helper, numpy_helper

    from kselect.core.models.model import load_model

    model = _model_with(tmp_path, "counters.onnx", [],
                        [helper.make_tensor_value_info("bn.num_batches_tracked", TensorProto.INT64, [])],
                        [numpy_helper.from_array(np.array(5, np.int64), "bn.num_batches_tracked")])
    assert list(load_model(str(model)).input_shapes) == ["input"]


def test_a_model_whose_every_weight_is_a_graph_input_says_how_to_make_them_constants(tmp_path):
    """An IR 4+ export with keep_initializers_as_inputs (CenterFace): every weight is an input a
    feed may replace, so nothing is tuned; the one-line error names ONNX Runtime's tool that makes
    them constants, and that tool's output tunes."""
    import onnx

    proto = small_cnn()
    proto.ir_version = 8
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in proto.graph.initializer)
    model, fixed = tmp_path / "inputs.onnx", tmp_path / "fixed.onnx"
    onnx.save(proto, model)
    result = run_kselect("tasks", model)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "remove_initializer_from_input" in result.stderr
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.remove_initializer_from_input", "--input", str(model),
                    "--output", str(fixed)], check=True, capture_output=True)
    assert json.loads(run_kselect("tasks", fixed, "--json").stdout)["tasks"]


def test_case_20_convs_inside_if_and_loop_sub_graphs_are_listed_untuned(tmp_path):
    import json

    from onnx import TensorProto, helper

    conv = helper.make_node("Conv", ["input", "stem.w"], ["inner"], name="inner.conv", pads=[1, 1, 1, 1])
    then_branch = helper.make_graph([conv], "then", [], [helper.make_tensor_value_info("inner", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("Identity", ["input"], ["same"], name="same")], "else", [],
                                    [helper.make_tensor_value_info("same", TensorProto.FLOAT, None)])
    branch = helper.make_node("If", ["flag"], ["branched"], name="branch", then_branch=then_branch,
                              else_branch=else_branch)
    model = _model_with(tmp_path, "branchy.onnx", [branch], [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                        [])
    proto = __import__("onnx").load(str(model))
    proto.graph.output.append(helper.make_tensor_value_info("branched", TensorProto.FLOAT, None))
    __import__("onnx").save(proto, model)
    result = run_kselect("tasks", model, "--json")
    assert result.returncode == 0, result.stderr
    assert {"node": "inner.conv", "op": "Conv", "why": "inside the then_branch sub-graph of If 'branch': only ops of "
            "the main graph are tuned"} in json.loads(result.stdout)["untuned"]
    shown = run_kselect("tasks", model)
    assert "inner.conv" in shown.stdout and "Left untuned" in shown.stdout


def test_case_21_out_of_time_an_unknown_feed_and_a_stopped_bench_say_what_happened(tmp_path, small_plan):
    import kselect
    from kselect.core.errors import KselectError

    model, plan = small_plan
    result = run_kselect("tune", model, "--library", "mlas", "--time-budget", "0.0001", "--db", tmp_path / "r.db",
                         "--no-verify", "-o", tmp_path / "p.plan.json")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "the time budget (--time-budget) ran out before a config of" in lines[-1], result.stderr
    runner = kselect.load_plan(plan, str(model))
    with pytest.raises(KselectError, match="the model has no input 'nope' \\(its inputs: input\\)"):
        runner.run({"nope": np.zeros((1, 3, 32, 32), np.float32)})
    with pytest.raises(KselectError, match="no value for the model's input 'input'"):
        runner.run({})
    env = {**os.environ, "COLUMNS": "200"}
    bench = subprocess.Popen([sys.executable, "-m", "kselect.cli.main", "bench", str(model), "--plan", str(plan),
                              "--alone", "--rounds", "50"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(8)
    bench.send_signal(signal.SIGTERM)
    _, stderr = bench.communicate(timeout=60)
    assert bench.returncode == 143
    assert stderr.strip().splitlines()[-1] == ("terminated (SIGTERM): kselect bench stopped before it finished; run it "
                                               "again to start over")
