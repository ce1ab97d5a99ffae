"""Every measurement, stored as it is made (SQLite), so a tune resumes where it stopped.

Records are keyed by device fingerprint, library and library version, task and config: records
from another device or library build are never reused. Each insert is committed at once, so
Ctrl-C or kill -9 loses at most the candidate being measured.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from kselect.core.errors import KselectError
from kselect.core.measure import Result
from kselect.core.paths import check_can_create

SCHEMA_VERSION = "1"
DEFAULT_DB = Path(os.environ.get("KSELECT_DB", "~/.cache/kselect/records.db")).expanduser()

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (fingerprint TEXT PRIMARY KEY, description TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY,
    device TEXT NOT NULL,
    library TEXT NOT NULL,
    library_version TEXT NOT NULL,
    task TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'invalid', 'failed')),
    median_us REAL,
    spread REAL,
    count INTEGER NOT NULL DEFAULT 0,
    error REAL,
    reason TEXT NOT NULL DEFAULT '',
    emulated INTEGER NOT NULL,
    is_default INTEGER NOT NULL DEFAULT 0,
    task_json TEXT NOT NULL,
    created REAL NOT NULL,
    UNIQUE (device, library, library_version, task, config)
);
CREATE TABLE IF NOT EXISTS claims (
    device TEXT NOT NULL,
    library TEXT NOT NULL,
    library_version TEXT NOT NULL,
    task TEXT NOT NULL,
    config TEXT NOT NULL,
    owner TEXT NOT NULL,
    claimed REAL NOT NULL,
    PRIMARY KEY (device, library, library_version, task, config)
);
"""

# Who measures: host, process and its start, so that a claim of a process that died on this host
# is taken over at once (one on another host only once it is stale).
OWNER = f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"
CLAIM_POLL_S = 0.5


@dataclass
class Record:
    task: str
    config: dict
    config_key: str
    result: Result
    emulated: bool
    is_default: bool


class RecordDB:
    def __init__(self, path: str | Path = DEFAULT_DB):
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise KselectError(f"--db {self.path} is a directory, not a database file")
        self.read_only = False  # a database on a read-only filesystem: its records are used, none added
        existed = self.path.exists() and self.path.stat().st_size > 0
        if not existed:
            check_can_create(self.path, "the record database", "; pass --db a writable path")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if existed and not _writable(self.path):
                self.connection = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
                self.read_only = True
            else:
                self.connection = sqlite3.connect(self.path, timeout=30)
            if existed:
                tables = {row[0] for row in self.connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "records" not in tables or "meta" not in tables:
                    raise KselectError(f"{self.path} is an SQLite database but not a kselect record database")
                version = self.connection.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                if not version or version[0] != SCHEMA_VERSION:
                    raise KselectError(f"{self.path} has record schema {version and version[0]!r}, this kselect reads {SCHEMA_VERSION!r}")
                self.connection.execute("PRAGMA quick_check").fetchone()
            if not self.read_only:  # a database made before claims existed gets their table
                self.connection.executescript(SCHEMA)
            if not existed:
                self.connection.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
                self.connection.commit()
        except sqlite3.DatabaseError as exc:
            raise KselectError(f"{self.path} is corrupt or not a kselect record database ({exc})") from None

    def close(self) -> None:
        self.connection.close()

    def check_writable(self) -> None:
        """Raised before a measurement that could not be stored is taken."""
        if self.read_only:
            raise KselectError(f"the record database {self.path} is read-only: the stored records do not cover what "
                               "this command must measure (copy it somewhere writable and pass --db)")

    def add_device(self, fingerprint: str, description: dict) -> None:
        if self.read_only:
            return
        self.connection.execute("INSERT OR REPLACE INTO devices VALUES (?, ?)", (fingerprint, json.dumps(description)))
        self.connection.commit()

    def add(self, device: str, library: str, version: str, task_json: dict, config_key: str, result: Result,
            emulated: bool, is_default: bool = False) -> None:
        """Stores a measurement and, in the same transaction, releases its claim."""
        self.check_writable()
        self.connection.execute(
            "INSERT OR REPLACE INTO records (device, library, library_version, task, config, status, median_us, spread,"
            " count, error, reason, emulated, is_default, task_json, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (device, library, version, task_json["key"], config_key, result.status, result.median_us, result.spread,
             result.count, result.error, result.reason, int(emulated), int(is_default), json.dumps(task_json), time.time()),
        )
        self.connection.execute("DELETE FROM claims WHERE device=? AND library=? AND library_version=? AND task=? AND config=?",
                                (device, library, version, task_json["key"], config_key))
        self.connection.commit()

    # -- claims: who measures a config now ------------------------------------------------------
    # A tune claims a config before measuring it and its record releases the claim, so that tunes
    # sharing a database (on one machine, or machines of one device fingerprint sharing a server
    # database) never measure a config twice. Plain SQL (INSERT .. ON CONFLICT DO NOTHING, a
    # primary key) that PostgreSQL runs as it is. On one machine the measuring lock (core/lock.py)
    # already makes tunes take turns; claims are what a shared store needs on top.
    def claim(self, device: str, library: str, version: str, task: str, config_key: str, stale_after_s: float,
              newer_than: float, owner: str = OWNER) -> Result | None:
        """Claims a config for ``owner`` and returns None, or, when another owner measured it
        meanwhile (a record newer than ``newer_than``), returns that record's result. A claim
        held by another owner is waited for until it is released or stale (its process gone from
        this host, or older than ``stale_after_s``)."""
        key = (device, library, version, task, config_key)
        where = "device=? AND library=? AND library_version=? AND task=? AND config=?"
        while True:
            holder = self.connection.execute(f"SELECT owner, claimed FROM claims WHERE {where}", key).fetchone()
            if holder is not None and holder[0] != owner and _stale(*holder, stale_after_s):
                self.connection.execute(f"DELETE FROM claims WHERE {where} AND owner=?", (*key, holder[0]))
            held = self.connection.execute(
                "INSERT INTO claims (device, library, library_version, task, config, owner, claimed)"
                " VALUES (?,?,?,?,?,?,?) ON CONFLICT DO NOTHING", (*key, owner, time.time())).rowcount == 1
            held = held or (holder is not None and holder[0] == owner)
            self.connection.commit()
            # checked after claiming: a record stored just before the claim is not measured again
            row = self.connection.execute(f"SELECT status, median_us, spread, count, error, reason FROM records WHERE {where}"
                                          " AND created > ?", (*key, newer_than)).fetchone()
            if row is not None:
                if held:
                    self.connection.execute(f"DELETE FROM claims WHERE {where} AND owner=?", (*key, owner))
                    self.connection.commit()
                return Result(*row)
            if held:
                return None
            time.sleep(CLAIM_POLL_S)

    def release_claims(self, owner: str = OWNER) -> None:
        if not self.read_only:
            self.connection.execute("DELETE FROM claims WHERE owner=?", (owner,))
            self.connection.commit()

    def records(self, device: str, library: str, version: str, task: str | None = None) -> list[Record]:
        query = ("SELECT task, config, status, median_us, spread, count, error, reason, emulated, is_default FROM records"
                 " WHERE device=? AND library=? AND library_version=?")
        params: list = [device, library, version]
        if task is not None:
            query += " AND task=?"
            params.append(task)
        try:
            rows = self.connection.execute(query + " ORDER BY id", params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise KselectError(f"{self.path} is corrupt ({exc})") from None
        return [Record(task_key, json.loads(key), key, Result(status, median, spread, count, error, reason), bool(emulated), bool(is_default))
                for task_key, key, status, median, spread, count, error, reason, emulated, is_default in rows]

    def all_records(self, device: str, library: str, version: str) -> list[tuple[dict, Record]]:
        """Every record of this device and library build, each with its task's JSON (for cost
        models that learn across tasks)."""
        rows = self.connection.execute(
            "SELECT task_json, task, config, status, median_us, spread, count, error, reason, emulated, is_default"
            " FROM records WHERE device=? AND library=? AND library_version=? ORDER BY id", (device, library, version)).fetchall()
        return [(json.loads(task_json), Record(task_key, json.loads(key), key, Result(status, median, spread, count, error, reason),
                                               bool(emulated), bool(is_default)))
                for task_json, task_key, key, status, median, spread, count, error, reason, emulated, is_default in rows]

    def count(self) -> int:
        return self.connection.execute("SELECT COUNT(*) FROM records").fetchone()[0]


def _writable(path: Path) -> bool:
    """Whether SQLite can write this database: the file and its folder (for the journal). A
    read-only filesystem says no even to root."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _stale(owner: str, claimed: float, stale_after_s: float) -> bool:
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return time.time() - claimed > stale_after_s
