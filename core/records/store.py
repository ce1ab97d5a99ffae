"""Every measurement, stored as it is made (SQLite, or PostgreSQL shared by a fleet), so a tune resumes where it stopped.

Records are keyed by device fingerprint, library and library version, task and config: records
from another device or library build are never reused. Each insert is committed at once, so
Ctrl-C or kill -9 loses at most the candidate being measured.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from kselect.core.errors import KselectError, KselectWarning, first_line
from kselect.core.measuring.measure import Result
from kselect.core.paths import check_can_create
from kselect.core.records.sql import PostgresConnection, SqliteConnection, is_server_url, shown

SCHEMA_VERSION = "1"
DEFAULT_DB = Path(os.environ.get("KSELECT_DB", "~/.cache/kselect/records.db")).expanduser()

def database_location(location) -> str | Path:
    """Where ``--db`` points: None is the default database; ``sqlite:///relative.db`` and
    ``sqlite:////absolute.db`` are the files they name; a postgresql:// URL stays a URL. An empty
    location or another URL scheme is refused, never taken as a file name."""
    if location is None:
        return DEFAULT_DB
    if isinstance(location, str):
        if not location.strip():
            raise KselectError("--db '': give a database file or a postgresql:// URL, or leave --db out for the default")
        if is_server_url(location):
            return location
        if location.startswith("sqlite:///"):
            return Path(location[len("sqlite:///"):] or ".")
        if "://" in location:
            raise KselectError(f"--db {shown(location)}: give a database file, sqlite:///FILE or a postgresql:// URL")
    return Path(location)


SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS devices (fingerprint TEXT PRIMARY KEY, description TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id {id},
    device TEXT NOT NULL,
    library TEXT NOT NULL,
    library_version TEXT NOT NULL,
    task TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'invalid', 'failed')),
    median_us DOUBLE PRECISION,
    spread DOUBLE PRECISION,
    count INTEGER NOT NULL DEFAULT 0,
    error DOUBLE PRECISION,
    reason TEXT NOT NULL DEFAULT '',
    emulated INTEGER NOT NULL,
    is_default INTEGER NOT NULL DEFAULT 0,
    task_json TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    search TEXT NOT NULL DEFAULT '',
    measured_by TEXT NOT NULL DEFAULT '',
    UNIQUE (device, library, library_version, task, config)
);
CREATE TABLE IF NOT EXISTS claims (
    device TEXT NOT NULL,
    library TEXT NOT NULL,
    library_version TEXT NOT NULL,
    task TEXT NOT NULL,
    config TEXT NOT NULL,
    owner TEXT NOT NULL,
    claimed DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (device, library, library_version, task, config)
);
"""

# Who measures: worker (``$KSELECT_WORKER``, by default the host name), process and its start, so
# that a claim of a process that died on this host is taken over at once (one of another worker
# only once its lease or claim is stale).
# The fleet's tables (core/records/fleet.py): claims of whole tasks by leased workers.
FLEET_SCHEMA = """
CREATE TABLE IF NOT EXISTS task_claims (
    tune TEXT NOT NULL,
    library TEXT NOT NULL,
    task TEXT NOT NULL,
    position INTEGER NOT NULL,
    owner TEXT NOT NULL DEFAULT '',
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tune, library, task)
);
CREATE TABLE IF NOT EXISTS tune_workers (
    tune TEXT NOT NULL,
    owner TEXT NOT NULL,
    lease_until DOUBLE PRECISION NOT NULL,
    finished INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tune, owner)
);
"""

OWNER = f"{os.environ.get('KSELECT_WORKER') or socket.gethostname()}:{os.getpid()}:{time.time():.0f}"
CLAIM_POLL_S = 0.5


@dataclass
class Record:
    task: str
    config: dict
    config_key: str
    result: Result
    emulated: bool
    is_default: bool
    search: str = ""  # the search backend that proposed it ("default": the library's own config; "": not known)
    created: float | None = None  # when it was stored (seconds since the epoch)
    measured_by: str = ""  # the worker that measured it (``OWNER``; "": before kselect kept it)


RECORD_COLUMNS = ("id, task, config, status, median_us, spread, count, error, reason, emulated, is_default, search,"
                  " created, measured_by")


def _record(row, location: str) -> Record | None:
    """The record of a row, or None (with a warning naming the row) for a row no tune could have
    written: a config that is not a JSON object, an "ok" time that is negative or not a number."""
    row_id, task_key, key, status, median, spread, count, error, reason, emulated, is_default, search, created, by = row
    try:
        config = json.loads(key)
        if not isinstance(config, dict):
            raise ValueError("its config is not a JSON object")
        # 0 is a time: a conversion with nothing to do
        if status == "ok" and not (isinstance(median, (int, float)) and math.isfinite(median) and median >= 0):
            raise ValueError(f"its time {median!r} us is not a number of microseconds")
    except ValueError as exc:
        reason = "its config is not JSON" if isinstance(exc, json.JSONDecodeError) else str(exc)
        warnings.warn(KselectWarning(f"record {row_id} of {location} is skipped: {reason}"), stacklevel=3)
        return None
    return Record(task_key, config, key, Result(status, median, spread, count, error, reason), bool(emulated),
                  bool(is_default), search, created, by)


class RecordDB:
    """The record store: ``location`` is an SQLite file (default ~/.cache/kselect/records.db) or a
    ``postgresql://`` URL that several devices share; both hold the same tables and give the same
    guarantees (core/records/sql.py writes the statements once for both)."""

    def __init__(self, location: str | Path = DEFAULT_DB):
        self.read_only = False  # a database on a read-only filesystem: its records are used, none added
        location = database_location(location)
        if is_server_url(location):
            self.path, self.location = None, shown(location)
            self.connection = PostgresConnection(str(location))
            self._open_server()
        else:
            self.path = Path(location).expanduser()
            self.location = str(self.path)
            self._open_file()

    def _open_server(self) -> None:
        try:
            with self.connection.transaction():
                # CREATE TABLE IF NOT EXISTS races when two workers start at once
                self.connection.exclusive("kselect-schema")
                self.connection.executescript(SCHEMA)
                version = self.connection.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                if version is None:
                    self.connection.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
                elif version[0] != SCHEMA_VERSION:
                    raise KselectError(f"{self.location} has record schema {version[0]!r}, this kselect reads {SCHEMA_VERSION!r}")
                self.connection.executescript(FLEET_SCHEMA)
        except self.connection.Error as exc:
            raise KselectError(f"{self.location} is not a usable kselect record database ({first_line(exc)})") from None

    def _open_file(self) -> None:
        if self.path.is_dir():
            raise KselectError(f"--db {self.path} is a directory, not a database file")
        existed = self.path.exists() and self.path.stat().st_size > 0
        if not existed:
            check_can_create(self.path, "the record database", "; pass --db a writable path")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.read_only = existed and not _writable(self.path)
            self.connection = SqliteConnection(self.path, self.read_only)
            if existed:
                tables = {row[0] for row in self.connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "records" not in tables or "meta" not in tables:
                    raise KselectError(f"{self.path} is an SQLite database but not a kselect record database")
                version = self.connection.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                if not version or version[0] != SCHEMA_VERSION:
                    raise KselectError(f"{self.path} has record schema {version and version[0]!r}, this kselect reads {SCHEMA_VERSION!r}")
                self.connection.execute("PRAGMA quick_check").fetchone()
            if not self.read_only:  # a database made by an older kselect gets the tables and columns added since
                self.connection.executescript(SCHEMA + FLEET_SCHEMA)
                columns = {row[1] for row in self.connection.execute("PRAGMA table_info(records)")}
                for column in ("search", "measured_by"):
                    if column not in columns:
                        self.connection.execute(f"ALTER TABLE records ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
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

    def _query(self, statement: str, params=()) -> list:
        """The rows of a read, its transaction ended (so the next read sees what others stored since)."""
        try:
            rows = self.connection.execute(statement, params).fetchall()
        except self.connection.Error as exc:
            raise KselectError(f"the record database {self.location} failed: {first_line(exc)}") from None
        self.connection.commit()
        return rows

    def add_device(self, fingerprint: str, description: dict) -> None:
        if self.read_only:
            return
        self.connection.execute("INSERT INTO devices VALUES (?, ?) ON CONFLICT (fingerprint) DO UPDATE SET"
                                " description=excluded.description", (fingerprint, json.dumps(description)))
        self.connection.commit()

    def add(self, device: str, library: str, version: str, task_json: dict, config_key: str, result: Result,
            emulated: bool, is_default: bool = False, search: str = "") -> None:
        """Stores a measurement and, in the same transaction, releases its claim. A config measured
        again keeps its place and its search, with the new result."""
        self.check_writable()
        key = (device, library, version, task_json["key"], config_key)
        with self.connection.transaction():
            self.connection.execute(
                "INSERT INTO records (device, library, library_version, task, config, status, median_us, spread, count,"
                " error, reason, emulated, is_default, task_json, created, search, measured_by)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT (device, library, library_version, task, config) DO UPDATE SET status=excluded.status,"
                " median_us=excluded.median_us, spread=excluded.spread, count=excluded.count, error=excluded.error,"
                " reason=excluded.reason, emulated=excluded.emulated, is_default=excluded.is_default,"
                " task_json=excluded.task_json, created=excluded.created, measured_by=excluded.measured_by",
                (*key, result.status, result.median_us, result.spread, result.count, result.error, result.reason,
                 int(emulated), int(is_default), json.dumps(task_json), time.time(), "default" if is_default else search,
                 OWNER))
            self.connection.execute("DELETE FROM claims WHERE device=? AND library=? AND library_version=? AND task=?"
                                    " AND config=?", key)

    # -- claims: who measures a config now ------------------------------------------------------
    # A tune claims a config before measuring it and its record releases the claim, so that tunes
    # sharing a database never measure a config twice. In a fleet (core/records/fleet.py) whole tasks are
    # claimed first; these per-config claims still guard what no task claim covers.
    def claim(self, device: str, library: str, version: str, task: str, config_key: str, stale_after_s: float,
              newer_than: float, owner: str = OWNER) -> Result | None:
        """Claims a config for ``owner`` and returns None, or, when another owner measured it
        meanwhile (a record newer than ``newer_than``), returns that record's result. A claim
        held by another owner is waited for until it is released or stale (its process gone from
        this host, or older than ``stale_after_s``)."""
        key = (device, library, version, task, config_key)
        where = "device=? AND library=? AND library_version=? AND task=? AND config=?"
        while True:
            with self.connection.transaction():
                holder = self.connection.execute(f"SELECT owner, claimed FROM claims WHERE {where}", key).fetchone()
                if holder is not None and holder[0] != owner and _stale(*holder, stale_after_s):
                    self.connection.execute(f"DELETE FROM claims WHERE {where} AND owner=?", (*key, holder[0]))
                held = self.connection.execute(
                    "INSERT INTO claims (device, library, library_version, task, config, owner, claimed)"
                    " VALUES (?,?,?,?,?,?,?) ON CONFLICT DO NOTHING", (*key, owner, time.time())).rowcount == 1
                held = held or (holder is not None and holder[0] == owner)
            # checked after claiming: a record stored just before the claim is not measured again
            row = self.connection.execute(f"SELECT status, median_us, spread, count, error, reason FROM records WHERE {where}"
                                          " AND created > ?", (*key, newer_than)).fetchone()
            self.connection.commit()
            if row is not None:
                if held:
                    with self.connection.transaction():
                        self.connection.execute(f"DELETE FROM claims WHERE {where} AND owner=?", (*key, owner))
                return Result(*row)
            if held:
                return None
            time.sleep(CLAIM_POLL_S)

    def drop_claims(self, device: str, library: str, version: str, task: str, owner: str = OWNER) -> None:
        """Frees the configs of ``task`` that other owners claimed: this owner holds the whole task
        now (core/records/fleet.py), taken over from a worker whose lease ran out."""
        with self.connection.transaction():
            self.connection.execute("DELETE FROM claims WHERE device=? AND library=? AND library_version=? AND task=?"
                                    " AND owner<>?", (device, library, version, task, owner))

    def release_claims(self, owner: str = OWNER) -> None:
        if not self.read_only:
            with self.connection.transaction():
                self.connection.execute("DELETE FROM claims WHERE owner=?", (owner,))

    def records(self, device: str, library: str, version: str, task: str | None = None) -> list[Record]:
        """The records of this device and library build (of one task), in the order they were first stored."""
        query = f"SELECT {RECORD_COLUMNS} FROM records WHERE device=? AND library=? AND library_version=?"
        params: list = [device, library, version]
        if task is not None:
            query += " AND task=?"
            params.append(task)
        rows = self._query(query + " ORDER BY id", params)
        return [record for record in (_record(row, self.location) for row in rows) if record is not None]

    def all_records(self, device: str, library: str, version: str) -> list[tuple[dict, Record]]:
        """Every record of this device and library build, each with its task's JSON (for cost
        models that learn across tasks)."""
        rows = self._query(f"SELECT task_json, {RECORD_COLUMNS} FROM records WHERE device=? AND library=?"
                           " AND library_version=? ORDER BY id", (device, library, version))
        found = []
        for row in rows:
            record = _record(row[1:], self.location)
            try:
                task_json = json.loads(row[0])
            except ValueError:
                task_json = None
            if record is not None and (not isinstance(task_json, dict) or "key" not in task_json):
                warnings.warn(KselectWarning(f"record {row[1]} of {self.location} is skipped: its task_json is not a "
                                             "task"), stacklevel=2)
            elif record is not None:
                found.append((task_json, record))
        return found

    def count(self) -> int:
        return self._query("SELECT COUNT(*) FROM records")[0][0]


def _writable(path: Path) -> bool:
    """Whether SQLite can write this database: the file and its folder (for the journal). A
    read-only filesystem says no even to root."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def process_gone(owner: str) -> bool:
    """Whether ``owner`` (host:pid:start) names a process of this host that no longer runs."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return False


def _stale(owner: str, claimed: float, stale_after_s: float) -> bool:
    return process_gone(owner) or time.time() - claimed > stale_after_s
