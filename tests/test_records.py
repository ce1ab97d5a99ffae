"""The record store, the same tests on SQLite and on a real PostgreSQL server: records keyed by
device and library build, committed as made, never reused across devices, claims, resuming."""

from __future__ import annotations

import time

import pytest
from helpers import run_kselect

from kselect.core.errors import KselectError
from kselect.core.measuring.measure import MeasureSettings, Result
from kselect.core.records.store import OWNER, RecordDB

QUICK = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.05)
TASK = {"key": "conv|1x16x8x8|k3", "kind": "conv"}
A, B = '{"threads": 1}', '{"threads": 2}'


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "records.db")
    return request.getfixturevalue("postgres_url")


def _ok(us: float) -> Result:
    return Result("ok", us, 0.01, 10, 0.0)


def test_records_are_read_back_in_the_order_stored_with_who_proposed_and_measured_them(location):
    db = RecordDB(location)
    db.add("dev", "mlas", "1.0", TASK, '{"threads": 2}', _ok(10.0), False, is_default=True, search="xgb")
    db.add("dev", "mlas", "1.0", TASK, '{"threads": 1}', _ok(8.5), False, search="xgb")
    db.add("dev", "mlas", "1.0", TASK, '{"threads": 3}', Result("failed", None, None, 0, None, "crashed"), True,
           search="random")
    records = db.records("dev", "mlas", "1.0", TASK["key"])
    assert [r.config for r in records] == [{"threads": 2}, {"threads": 1}, {"threads": 3}]
    assert [r.search for r in records] == ["default", "xgb", "random"]
    assert [r.is_default for r in records] == [True, False, False]
    assert records[1].result.median_us == pytest.approx(8.5) and records[2].result.reason == "crashed"
    assert records[2].emulated and not records[0].emulated
    assert all(r.measured_by == OWNER for r in records)
    assert records[0].created <= records[1].created <= records[2].created <= time.time()
    assert db.count() == 3
    assert [(task_json, r.config_key) for task_json, r in db.all_records("dev", "mlas", "1.0")] == \
        [(TASK, r.config_key) for r in records]


def test_each_record_is_committed_as_it_is_made_and_a_config_measured_again_keeps_its_place(location):
    writer, reader = RecordDB(location), RecordDB(location)
    writer.add("dev", "mlas", "1.0", TASK, A, _ok(10.0), False)
    assert [r.config_key for r in reader.records("dev", "mlas", "1.0")] == [A]  # seen by another connection at once
    writer.add("dev", "mlas", "1.0", TASK, B, _ok(9.0), False)
    writer.add("dev", "mlas", "1.0", TASK, A, _ok(7.0), False)
    records = reader.records("dev", "mlas", "1.0")
    assert [(r.config_key, r.result.median_us) for r in records] == [(A, 7.0), (B, 9.0)]


def test_records_are_never_reused_across_devices_or_library_builds(location):
    db = RecordDB(location)
    db.add("dev-a", "mlas", "1.0", TASK, A, _ok(10.0), False)
    db.add("dev-b", "mlas", "1.0", TASK, A, _ok(20.0), False)
    db.add("dev-a", "mlas", "1.1", TASK, A, _ok(30.0), False)
    assert [r.result.median_us for r in db.records("dev-a", "mlas", "1.0")] == [10.0]
    assert [r.result.median_us for r in db.records("dev-b", "mlas", "1.0")] == [20.0]
    assert [r.result.median_us for r in db.records("dev-a", "mlas", "1.1")] == [30.0]
    assert db.records("dev-a", "xnnpack", "1.0") == []


def test_a_claimed_config_is_waited_for_and_its_record_taken_instead_of_measuring_it(location):
    import threading

    db, other = RecordDB(location), RecordDB(location)
    key = ("dev", "mlas", "1.0", TASK["key"], A)
    assert other.claim(*key, stale_after_s=600, newer_than=0, owner="board-2:1:0") is None

    def other_stores_it():
        RecordDB(location).add("dev", "mlas", "1.0", TASK, A, _ok(11.0), False)

    threading.Timer(1.0, other_stores_it).start()
    started = time.monotonic()
    result = db.claim(*key, stale_after_s=600, newer_than=0)
    assert result is not None and result.median_us == 11.0 and time.monotonic() - started >= 0.9
    assert db.claim("dev", "mlas", "1.0", TASK["key"], B, 600, 0) is None  # free: claimed, to be measured
    db.release_claims()
    assert other.claim("dev", "mlas", "1.0", TASK["key"], B, 600, 0, owner="board-2:1:0") is None


def test_a_claim_older_than_its_staleness_is_taken_over(location):
    db = RecordDB(location)
    key = ("dev", "mlas", "1.0", TASK["key"], A)
    assert db.claim(*key, stale_after_s=600, newer_than=0, owner="board-2:1:0") is None
    time.sleep(1.2)
    assert db.claim(*key, stale_after_s=1.0, newer_than=0) is None


def test_a_tune_resumes_from_the_store_and_measures_nothing_again(location):
    from test_faults import _pointwise

    from kselect.core.contract import plugins
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.tuning_loop import TuneOptions, tune_tasks

    library, device = plugins.get_library("mlas"), this_device()
    task = _pointwise(16, 32)
    first, = tune_tasks([task], library, device, RecordDB(location), TuneOptions("random", 3, settings=QUICK))
    again, = tune_tasks([task], library, device, RecordDB(location), TuneOptions("random", 3, settings=QUICK))
    assert first.measured_now == 3 and first.samples == 3
    assert again.measured_now == 0 and again.samples == 3 and again.best.median_us == first.best.median_us
    stored = RecordDB(location).records(device.fingerprint, "mlas", library.version(), task.key)
    assert len(stored) == 3 and {r.search for r in stored} == {"default", "random"}


def test_a_record_database_of_another_schema_is_refused_in_one_line(location):
    db = RecordDB(location)
    db.connection.execute("UPDATE meta SET value='0' WHERE key='schema'")
    db.connection.commit()
    with pytest.raises(KselectError, match="record schema '0'"):
        RecordDB(location)


def test_an_unreachable_server_is_one_line_and_nothing_is_measured(tmp_path, small_model_path):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://kselect:secret@127.0.0.1:{port}/records"
    result = run_kselect("tune", small_model_path, "--library", "mlas", "--db", url, "-o", tmp_path / "p.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot connect to the record database postgresql://kselect:***@127.0.0.1:")
    assert "secret" not in line and not (tmp_path / "p.json").exists()


# The record tables as kselect wrote them before records kept their search and worker (b8fa9ec).
OLD_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE devices (fingerprint TEXT PRIMARY KEY, description TEXT NOT NULL);
CREATE TABLE records (
    id INTEGER PRIMARY KEY, device TEXT NOT NULL, library TEXT NOT NULL, library_version TEXT NOT NULL,
    task TEXT NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('ok', 'invalid', 'failed')),
    median_us REAL, spread REAL, count INTEGER NOT NULL DEFAULT 0, error REAL, reason TEXT NOT NULL DEFAULT '',
    emulated INTEGER NOT NULL, is_default INTEGER NOT NULL DEFAULT 0, task_json TEXT NOT NULL, created REAL NOT NULL,
    UNIQUE (device, library, library_version, task, config));
CREATE TABLE claims (device TEXT NOT NULL, library TEXT NOT NULL, library_version TEXT NOT NULL, task TEXT NOT NULL,
    config TEXT NOT NULL, owner TEXT NOT NULL, claimed REAL NOT NULL,
    PRIMARY KEY (device, library, library_version, task, config));
INSERT INTO meta VALUES ('schema', '1');
"""


def test_a_database_written_before_the_fleet_opens_and_gains_its_columns(tmp_path):
    """A record file of the schema before records kept their search and worker opens, its
    records read back unchanged, and new ones carry both."""
    import json
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.executescript(OLD_SCHEMA)
        old.execute("INSERT INTO records (device, library, library_version, task, config, status, median_us, spread,"
                    " count, error, reason, emulated, is_default, task_json, created)"
                    " VALUES ('dev', 'mlas', '1.0', ?, ?, 'ok', 9.5, 0.01, 10, 0.0, '', 0, 1, ?, 1.0)",
                    (TASK["key"], B, json.dumps(TASK)))
    db = RecordDB(path)
    old_record, = db.records("dev", "mlas", "1.0")
    assert (old_record.config_key, old_record.result.median_us, old_record.is_default) == (B, 9.5, True)
    assert (old_record.search, old_record.measured_by) == ("", "")
    db.add("dev", "mlas", "1.0", TASK, A, _ok(5.0), False, search="tpe")
    added = db.records("dev", "mlas", "1.0")[1]
    assert (added.config_key, added.search, added.measured_by) == (A, "tpe", OWNER)
