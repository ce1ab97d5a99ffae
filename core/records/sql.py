"""One SQL connection over SQLite (a local file) or PostgreSQL (a server several devices share),
so that the record store and the fleet's claims are written once.

Statements use ``?`` placeholders and three words that differ between the engines: ``{now}`` (the
database's clock in seconds since the epoch: on PostgreSQL the server's, so devices whose clocks
disagree still agree on leases), ``{skip_locked}`` (PostgreSQL's ``FOR UPDATE SKIP LOCKED``; a
SQLite write transaction locks the whole file instead) and ``{id}`` (an auto-numbered key).
Everything else is the SQL both run.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
from contextlib import contextmanager
from pathlib import Path

from kselect.core.errors import KselectError, first_line

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_server_url(location) -> bool:
    return isinstance(location, str) and location.startswith(POSTGRES_SCHEMES)


def shown(location) -> str:
    """The location as printed: a URL without its password."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", str(location))


class Connection:
    """A DB-API connection with kselect's dialect words filled in. ``execute`` returns the
    cursor; writes are committed by ``commit()`` or a ``transaction()`` block."""

    words: dict[str, str] = {}

    def __init__(self, raw, location: str):
        self.raw, self.location = raw, location

    def sql(self, statement: str) -> str:
        return statement.format(**self.words)

    def execute(self, statement: str, params=()):
        return self.raw.execute(self.sql(statement), params)

    def commit(self) -> None:
        self.raw.commit()

    def rollback(self) -> None:
        self.raw.rollback()

    def close(self) -> None:
        self.raw.close()

    @contextmanager
    def transaction(self):
        """A write transaction: committed when the block ends, rolled back if it raises."""
        self.commit()
        self.begin()
        try:
            yield self
        except BaseException:
            self.rollback()
            raise
        self.commit()

    def begin(self) -> None: ...

    def exclusive(self, name: str) -> None:
        """Inside a transaction: waits until no other transaction holds ``name``, and holds it to
        the end of this one (a SQLite write transaction already excludes every other)."""

    def reopen(self) -> "Connection":
        """Another connection to the same database (for a thread of its own)."""
        raise NotImplementedError


def busy_timeout_s() -> float:
    """How long a write waits for another process's lock on an SQLite record database:
    ``$KSELECT_DB_BUSY_TIMEOUT`` seconds, 30 by default (longer on a network filesystem)."""
    text = os.environ.get("KSELECT_DB_BUSY_TIMEOUT", "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise KselectError(f"KSELECT_DB_BUSY_TIMEOUT={text!r}: give a number of seconds above 0")
    return seconds


class SqliteConnection(Connection):
    """SQLite, its operational failures told in one line: a database another process holds
    locked past the busy time-out is said to be locked (not corrupt); a full disk names the
    file."""

    words = {"now": "((julianday('now') - 2440587.5) * 86400.0)", "skip_locked": "", "id": "INTEGER PRIMARY KEY"}
    Error = sqlite3.DatabaseError

    @contextmanager
    def _told(self):
        try:
            yield
        except sqlite3.OperationalError as exc:
            text = str(exc)
            if "locked" in text or "busy" in text:
                raise KselectError(f"the record database {self.location} is locked by another process (held for "
                                   f"over {busy_timeout_s():g} s, e.g. an open sqlite3 shell or a tune on a network filesystem): wait "
                                   "for it to finish or pass another --db") from None
            if "full" in text or "disk I/O" in text:
                raise KselectError(f"cannot write the record database {self.location}: {text} (free space on its "
                                   "disk or pass --db elsewhere; every record stored before is kept)") from None
            raise

    def execute(self, statement: str, params=()):
        with self._told():
            return super().execute(statement, params)

    def commit(self) -> None:
        with self._told():
            self.raw.commit()

    def __init__(self, path: Path, read_only: bool = False):
        timeout = busy_timeout_s()
        raw = (sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout) if read_only
               else sqlite3.connect(path, timeout=timeout))
        super().__init__(raw, str(path))
        self.path, self.read_only = path, read_only

    def executescript(self, script: str) -> None:
        with self._told():
            self.raw.executescript(self.sql(script))

    def begin(self) -> None:
        with self._told():
            self.raw.execute("BEGIN IMMEDIATE")  # takes the write lock now, so reads in the block see what others wrote

    def reopen(self) -> "SqliteConnection":
        return SqliteConnection(self.path, self.read_only)


class PostgresConnection(Connection):
    words = {"now": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
             "skip_locked": "FOR UPDATE SKIP LOCKED", "id": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"}

    def __init__(self, url: str):
        try:
            import psycopg
        except ImportError:
            raise KselectError(f"--db {shown(url)} needs the PostgreSQL driver: pip install 'psycopg[binary]'") from None
        self.Error, self.OperationalError = psycopg.Error, psycopg.OperationalError
        try:  # keepalives: a device that vanished from the network drops its connection within a minute
            raw = psycopg.connect(url, connect_timeout=int(os.environ.get("KSELECT_DB_CONNECT_TIMEOUT", "10")),
                                  keepalives=1, keepalives_idle=30, keepalives_interval=10, keepalives_count=3)
        except psycopg.Error as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise KselectError(f"cannot connect to the record database {shown(url)}: {reason}") from None
        super().__init__(raw, url)

    def execute(self, statement: str, params=()):
        try:
            return self.raw.execute(self.sql(statement).replace("?", "%s"), params)
        except self.Error as exc:
            if self.raw.closed or isinstance(exc, self.OperationalError):
                raise KselectError(f"the record database {shown(self.location)} failed: {first_line(exc)}") from None
            raise

    def rollback(self) -> None:
        if not self.raw.closed:
            self.raw.rollback()

    def executescript(self, script: str) -> None:
        for statement in self.sql(script).split(";"):
            if statement.strip():
                self.raw.execute(statement)

    def exclusive(self, name: str) -> None:
        self.raw.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))

    def reopen(self) -> "PostgresConnection":
        return PostgresConnection(self.location)


