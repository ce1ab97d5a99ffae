"""Tunes of one model that share a record database split its tasks between them: devices of one
kind (one fingerprint) pointed at one PostgreSQL server, or two tunes on one machine.

It is PostgreSQL's job-queue idiom, on rows of the record database: every tune of the same model,
device, library builds and search options (one *tune id*) adds the same task rows; a worker
claims the first task nobody holds with ``SELECT .. FOR UPDATE SKIP LOCKED`` (so two workers never
take the same row) and writes a lease on it in the same transaction. A thread renews the worker's
leases while it lives; a claim whose lease ran out (its worker was killed, or lost the network) is
taken by the next worker that asks, and its stored records are reused, so nothing measured is lost
or measured twice. On SQLite a write transaction (``BEGIN IMMEDIATE``) serialises the same
statements. Leases are on the database's clock, not the devices'.

Every worker tunes until no task is left unclaimed, then waits for the tasks others hold, so that
it can take them over if their worker dies. The worker whose finishing leaves no other live
worker unfinished is the last: it builds, checks and writes the plan, and clears the tune's rows,
so the next tune of the model starts a new run (resuming from the records as always).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from kselect.core.records.store import OWNER, RecordDB, process_gone

DEFAULT_LEASE_S = 60.0
POLL_S = 0.5


def tune_id(device: str, items: list[tuple[str, str, str]], options: dict) -> str:
    """Who tunes the same thing: the device fingerprint, every (library, build, task key) and the
    search options that decide when a task is finished."""
    text = json.dumps({"device": device, "tasks": sorted(items), "options": options}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class Claim:
    library: str
    task: str  # the task key
    taken_from: str = ""  # the worker whose lease ran out, when this claim takes a task over


@dataclass
class FleetReport:
    """What one worker did, for the CLI and benchmarks."""

    owner: str
    tune: str
    workers_seen: int = 1
    tuned_here: list[str] = field(default_factory=list)  # task keys this worker tuned
    measured: dict[str, int] = field(default_factory=dict)  # task key -> configs this worker measured
    taken_over: list[str] = field(default_factory=list)  # of those, tasks another worker had claimed and lost
    claim_s: float = 0.0  # time spent claiming, finishing and polling the database
    waited_s: float = 0.0  # time spent waiting for tasks other workers held
    last: bool | None = None  # None until finish(): this worker writes the plan
    still_working: list[str] = field(default_factory=list)  # at finish(), the workers left: the last of them plans

    def to_json(self) -> dict:
        return {"owner": self.owner, "tune": self.tune, "workers_seen": self.workers_seen,
                "tuned_here": self.tuned_here, "taken_over": self.taken_over, "measured": self.measured,
                "claim_s": round(self.claim_s, 3), "waited_s": round(self.waited_s, 1), "wrote_plan": self.last}


class Fleet:
    """One worker's membership in a tune: ``with Fleet(db, tune, items) as fleet`` registers it
    (and its tasks) and renews its leases until the block ends."""

    def __init__(self, db: RecordDB, tune: str, items: list[tuple[str, str]], lease_s: float = DEFAULT_LEASE_S,
                 owner: str = OWNER):
        self.db, self.tune, self.items, self.lease_s, self.owner = db, tune, items, lease_s, owner
        self.report = FleetReport(owner, tune)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- membership -------------------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        sql = self.db.connection
        self._expire_dead_workers()
        with sql.transaction():
            sql.exclusive(f"kselect-tune-{self.tune}")  # two workers starting at once: one after the other
            workers = sql.execute("SELECT owner FROM tune_workers WHERE tune=? AND finished=0 AND lease_until > {now}",
                                  (self.tune,)).fetchall()
            if not workers:  # nobody live on this tune: what is left of an earlier run goes
                sql.execute("DELETE FROM task_claims WHERE tune=?", (self.tune,))
                sql.execute("DELETE FROM tune_workers WHERE tune=?", (self.tune,))
            sql.execute("INSERT INTO tune_workers (tune, owner, lease_until) VALUES (?, ?, {now} + ?)"
                        " ON CONFLICT (tune, owner) DO UPDATE SET lease_until=excluded.lease_until, finished=0",
                        (self.tune, self.owner, self.lease_s))
            for position, (library, task) in enumerate(self.items):
                sql.execute("INSERT INTO task_claims (tune, library, task, position) VALUES (?, ?, ?, ?)"
                            " ON CONFLICT DO NOTHING", (self.tune, library, task, position))
        self.report.workers_seen = len(workers) + 1
        self._heartbeat = threading.Thread(target=self._renew_leases, name="kselect-lease", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.report.last is None:  # stopped before finishing (Ctrl-C, an error): its tasks go back at once
            try:
                with self.db.connection.transaction():
                    self.db.connection.execute("UPDATE task_claims SET owner='', lease_until=0 WHERE tune=? AND owner=?"
                                               " AND done=0", (self.tune, self.owner))
                    self.db.connection.execute("DELETE FROM tune_workers WHERE tune=? AND owner=?", (self.tune, self.owner))
            except Exception:  # the database is what failed: the leases run out instead
                pass

    def _expire_dead_workers(self) -> None:
        """Ends at once the leases of workers that died on this host (others' run out in time)."""
        sql = self.db.connection
        owners = [row[0] for row in sql.execute("SELECT owner FROM tune_workers WHERE tune=? AND lease_until > {now}",
                                                (self.tune,)).fetchall()]
        sql.commit()
        for owner in owners:
            if owner != self.owner and process_gone(owner):
                with sql.transaction():
                    sql.execute("UPDATE task_claims SET lease_until=0 WHERE tune=? AND owner=? AND done=0", (self.tune, owner))
                    sql.execute("UPDATE tune_workers SET lease_until=0 WHERE tune=? AND owner=?", (self.tune, owner))

    def _renew_leases(self) -> None:
        connection = None
        while not self._stop.wait(self.lease_s / 4):
            try:
                connection = connection or self.db.connection.reopen()
                with connection.transaction():
                    connection.execute("UPDATE tune_workers SET lease_until={now} + ? WHERE tune=? AND owner=?",
                                       (self.lease_s, self.tune, self.owner))
                    connection.execute("UPDATE task_claims SET lease_until={now} + ? WHERE tune=? AND owner=? AND done=0",
                                       (self.lease_s, self.tune, self.owner))
            except Exception:  # a lost connection: try a new one next time; the leases tell the others meanwhile
                connection = None
        if connection is not None:
            connection.close()

    # -- tasks ------------------------------------------------------------------------------
    def claim(self, library: str) -> Claim | None:
        """The first of ``library``'s tasks that nobody holds (or whose holder's lease ran out),
        now held by this worker; None when there is none."""
        sql = self.db.connection
        with self._on_the_database(), sql.transaction():
            row = sql.execute("SELECT task, owner FROM task_claims WHERE tune=? AND library=? AND done=0 AND"
                              " (owner='' OR owner=? OR lease_until < {now}) ORDER BY position LIMIT 1 {skip_locked}",
                              (self.tune, library, self.owner)).fetchone()
            if row is not None:
                sql.execute("UPDATE task_claims SET owner=?, lease_until={now} + ? WHERE tune=? AND library=? AND task=?",
                            (self.owner, self.lease_s, self.tune, library, row[0]))
        if row is None:
            return None
        claim = Claim(library, row[0], row[1] if row[1] not in ("", self.owner) else "")
        self.report.tuned_here.append(claim.task)
        if claim.taken_from:
            self.report.taken_over.append(claim.task)
        return claim

    def finished_task(self, claim: Claim, measured: int, complete: bool) -> None:
        """The claimed task is tuned (``complete``) or given back unfinished (out of time), after
        ``measured`` configs measured here."""
        self.report.measured[claim.task] = self.report.measured.get(claim.task, 0) + measured
        with self._on_the_database(), self.db.connection.transaction():
            if complete:
                self.db.connection.execute("UPDATE task_claims SET done=1 WHERE tune=? AND library=? AND task=?",
                                           (self.tune, claim.library, claim.task))
            else:
                self.db.connection.execute("UPDATE task_claims SET owner='', lease_until=0 WHERE tune=? AND library=?"
                                           " AND task=? AND owner=?", (self.tune, claim.library, claim.task, self.owner))

    def held_elsewhere(self, library: str) -> list[tuple[str, str]]:
        """``library``'s unfinished tasks, which other workers hold once ``claim`` found none free:
        (task key, owner)."""
        with self._on_the_database():
            self._expire_dead_workers()
            rows = self.db.connection.execute("SELECT task, owner FROM task_claims WHERE tune=? AND library=? AND done=0"
                                              " ORDER BY position", (self.tune, library)).fetchall()
            self.db.connection.commit()
        return [(task, owner) for task, owner in rows]

    @contextmanager
    def _on_the_database(self):
        """Counts the time of the block in ``report.claim_s``: what sharing the tune costs."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report.claim_s += time.perf_counter() - started

    def wait(self) -> None:
        time.sleep(POLL_S)
        self.report.waited_s += POLL_S

    def finish(self) -> bool:
        """Marks this worker finished; True when no other live worker of the tune is unfinished:
        this one is the last, writes the plan, and the tune's rows are cleared."""
        sql = self.db.connection
        self._expire_dead_workers()
        with sql.transaction():
            sql.exclusive(f"kselect-tune-{self.tune}")
            rows = sql.execute("SELECT owner, finished, lease_until > {now} FROM tune_workers WHERE tune=?",
                               (self.tune,)).fetchall()
            others = [owner for owner, finished, alive in rows if owner != self.owner and not finished and alive]
            if others:
                sql.execute("UPDATE tune_workers SET finished=1 WHERE tune=? AND owner=?", (self.tune, self.owner))
            else:
                sql.execute("DELETE FROM task_claims WHERE tune=?", (self.tune,))
                sql.execute("DELETE FROM tune_workers WHERE tune=?", (self.tune,))
        self.report.last = not others
        self.report.still_working = others
        return self.report.last
