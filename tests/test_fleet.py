"""Several `kselect tune` workers pointed at one PostgreSQL record database split a model's
tasks: each task is tuned by one worker, every config measured once, a worker killed with SIGKILL
has its task taken over after its lease, and the worker finishing last writes the plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.records.store import RecordDB

BUDGET = "6"


def _worker(model, url, plan, name, lease="60", min_time="0.05"):
    env = {**os.environ, "KSELECT_WORKER": name, "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "kselect.cli.main", "tune", str(model), "--library", "mlas",
                             "--search", "random", "--budget", BUDGET, "--min-time", min_time, "--min-repeats", "3",
                             "--db", url, "-o", str(plan), "--lease", lease, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(process, timeout=300) -> dict:
    """A worker's JSON; the worker that wrote the plan exits 0, one that did not exits 2 saying
    where the plan went (its -o holds nothing)."""
    stdout, stderr = process.communicate(timeout=timeout)
    result = json.loads(stdout)
    if result["fleet"]["wrote_plan"]:
        assert process.returncode == 0, stderr
    else:
        assert process.returncode == 2, stderr
        assert "no plan was written to" in stderr.strip().splitlines()[-1]
    return result


def _records(url) -> list:
    library = plugins.get_library("mlas")
    return RecordDB(url).records(this_device().fingerprint, "mlas", library.version())


@pytest.mark.slow  # two workers on one database run by default (test_a_worker_killed_mid_task_has_its_task_taken_over_after_its_lease)
def test_two_workers_split_the_tasks_and_neither_measures_a_config_twice(postgres_url, small_model_path, tmp_path):
    plan = tmp_path / "small.plan.json"
    workers = [_worker(small_model_path, postgres_url, plan, name) for name in ("board-1", "board-2")]
    results = [_finish(w) for w in workers]
    fleets = [r["fleet"] for r in results]
    tuned = [set(f["tuned_here"]) for f in fleets]
    records = _records(postgres_url)
    tasks = {r.task for r in records}
    assert len(tasks) == 7 and tuned[0] | tuned[1] == tasks
    assert tuned[0] and tuned[1] and not tuned[0] & tuned[1]  # split, no task tuned twice
    # every config measured exactly once: the workers' measurements add up to the records stored
    assert sum(sum(f["measured"].values()) for f in fleets) == len(records)
    for fleet in fleets:
        name = fleet["owner"].partition(":")[0]
        assert all(r.measured_by.startswith(name + ":") for r in records if r.task in fleet["tuned_here"])
    assert sorted(f["wrote_plan"] for f in fleets) == [False, True]
    assert plan.exists() and [r["plan_file"] for r in results if r["fleet"]["wrote_plan"]] == [str(plan)]
    for task in tasks:  # every task tuned to its budget (or its whole space)
        space = min(int(BUDGET), 8)
        assert sum(r.task == task for r in records) >= min(space, 2)
    # the report reads the tuning curves from the shared database
    report = subprocess.run([sys.executable, "-m", "kselect.cli.main", "report", str(plan), "--db", postgres_url,
                             "-o", str(tmp_path / "report.html"), "--json"], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "tuning-curves" in json.loads(report.stdout)["charts"]
    page = (tmp_path / "report.html").read_text()
    # and the cost model learns from it
    predicted = subprocess.run([sys.executable, "-m", "kselect.cli.main", "predict", str(small_model_path), "--library",
                                "mlas", "--db", postgres_url, "--json"], capture_output=True, text=True)
    assert predicted.returncode == 0, predicted.stderr
    prediction = json.loads(predicted.stdout)
    assert prediction["training_rows"] == len(records) and len(prediction["ops"]) == 7
    assert all(f">{task}<" in page or task in page for task in ("T01", "T07"))
    with psycopg.connect(postgres_url) as connection:  # the last worker cleared the run's claims
        assert connection.execute("SELECT COUNT(*) FROM task_claims").fetchone()[0] == 0
        assert connection.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0


def test_a_worker_killed_mid_task_has_its_task_taken_over_after_its_lease(postgres_url, small_model_path, tmp_path):
    plan, lease = tmp_path / "small.plan.json", 4.0
    RecordDB(postgres_url)  # the tables, for the polling below
    doomed = _worker(small_model_path, postgres_url, plan, "board-1", lease=str(lease), min_time="0.1")
    survivor = _worker(small_model_path, postgres_url, plan, "board-2", lease=str(lease), min_time="0.1")
    held = None
    deadline = time.monotonic() + 120
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        while held is None and time.monotonic() < deadline and doomed.poll() is None:
            # a task board-1 holds, with some of its configs measured and stored
            held = connection.execute(
                "SELECT c.task FROM task_claims c WHERE c.owner LIKE 'board-1:%%' AND c.done=0 AND"
                " (SELECT COUNT(*) FROM records r WHERE r.task=c.task AND r.measured_by LIKE 'board-1:%%') >= 1"
                " LIMIT 1").fetchone()
            time.sleep(0.05)
        assert held is not None, "board-1 never held a task with a record stored"
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        killed_at = time.monotonic()
        by_doomed = {(r.task, r.config_key) for r in _records(postgres_url) if r.measured_by.startswith("board-1:")}
        still_held = connection.execute("SELECT done FROM task_claims WHERE task=%s", (held[0],)).fetchone()
    result = _finish(survivor)
    fleet = result["fleet"]
    assert held[0] in fleet["taken_over"] and fleet["wrote_plan"] and plan.exists()
    assert still_held == (0,)
    assert time.monotonic() - killed_at >= lease * 0.5  # it waited for the lease; it could not know board-1 died
    records = _records(postgres_url)
    # nothing board-1 measured was lost or measured again; every task was tuned
    assert {(r.task, r.config_key) for r in records if r.measured_by.startswith("board-1:")} == by_doomed
    assert len(records) == len(by_doomed) + sum(fleet["measured"].values())
    assert len({r.task for r in records}) == 7
    taken = [r for r in records if r.task == held[0]]
    assert {r.measured_by.partition(":")[0] for r in taken} == {"board-1", "board-2"}
    assert len(taken) == min(int(BUDGET), 8)


def test_tpe_keeps_its_optuna_studies_in_the_fleets_postgresql_database(postgres_url):
    """`--storage` takes the same postgresql:// URL as `--db`: Optuna's RDB storage, as it is."""
    import optuna
    from test_faults import _pointwise

    from kselect.core.measuring.measure import MeasureSettings
    from kselect.core.measuring.tuning_loop import TuneOptions, tune_tasks

    library, device, task = plugins.get_library("mlas"), this_device(), _pointwise(16, 32)
    settings = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.05)
    outcome, = tune_tasks([task], library, device, RecordDB(postgres_url),
                    TuneOptions("tpe", 3, searcher_options={"storage": postgres_url}, settings=settings))
    assert outcome.measured_now == 3
    storage = postgres_url.replace("postgresql://", "postgresql+psycopg://")
    name, = optuna.get_all_study_names(storage)
    assert task.key in name and len(optuna.load_study(study_name=name, storage=storage).trials) >= 2
