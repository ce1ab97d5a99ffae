"""The fleet on this machine: tuning wall time of a model with one and with two `kselect tune`
workers sharing a PostgreSQL record database, the split of its tasks and the overhead per claimed
task; and the records per second the PostgreSQL store sustains against SQLite.

Two workers on one 2-core machine take turns on the device's measuring lock (timings taken side
by side are not the device's), so two workers here are no speedup: the run shows that the tasks
split, what claiming costs, and that nothing is measured twice. On N boards of one kind the same
split runs in parallel.

Starts its own PostgreSQL (scripts/local-postgres.sh) unless ``--server`` gives one. Every tune
starts from an empty database: records of earlier runs would make the second run measure nothing.

    .venv/bin/python benchmarks/fleet.py --model resnet50 --budget 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from kselect.core.measuring.measure import Result
from kselect.core.records.store import RecordDB

REPO = Path(__file__).resolve().parents[1]
console = Console(width=None if sys.stdout.isatty() else 10_000)


def start_server(folder: str) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = subprocess.run(["bash", REPO / "scripts" / "local-postgres.sh", "start", folder, str(port)],
                             capture_output=True, text=True, check=True)
    return started.stdout.strip()


def fresh_database(server: str, name: str) -> str:
    with psycopg.connect(f"{server}/postgres", autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {name}")
        connection.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"


def tune_with_workers(model: str, db: str, workers: int, budget: int, folder: Path) -> dict:
    """``workers`` tune processes started together on ``db``; wall time until the last exits."""
    command = [sys.executable, "-m", "kselect.cli.main", "tune", model, "--library", "mlas", "--budget", str(budget),
               "--no-verify", "--db", db, "-o", str(folder / f"{model}.plan.json"), "--json"]
    started = time.perf_counter()
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env={**os.environ, "KSELECT_WORKER": f"worker-{i + 1}"}) for i in range(workers)]
    outputs = [p.communicate()[0] for p in processes]
    wall_s = time.perf_counter() - started
    if any(p.returncode for p in processes):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in processes]}")
    fleets = [json.loads(out)["fleet"] for out in outputs]
    claimed = sum(len(f["tuned_here"]) for f in fleets)
    return {"workers": workers, "db": "sqlite" if "://" not in db else "postgresql", "wall_s": round(wall_s, 1),
            "tasks": claimed,
            "split": [{"worker": f["owner"].partition(":")[0], "tasks": len(f["tuned_here"]),
                       "configs_measured": sum(f["measured"].values()), "claim_s": f["claim_s"],
                       "waited_s": f["waited_s"], "wrote_plan": f["wrote_plan"]} for f in fleets],
            "claim_ms_per_task": round(1000 * sum(f["claim_s"] for f in fleets) / max(claimed, 1), 2),
            "configs_measured": sum(sum(f["measured"].values()) for f in fleets)}


def records_per_second(location: str, count: int) -> dict:
    """``count`` records added one by one, each committed as kselect does, then read back."""
    db = RecordDB(location)
    task = {"key": "bench|task", "kind": "conv"}
    started = time.perf_counter()
    for i in range(count):
        db.add("bench-device", "mlas", "1.0", task, json.dumps({"i": i}), Result("ok", 10.0 + i, 0.01, 10, 0.0), False)
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    reads = [len(db.records("bench-device", "mlas", "1.0", "bench|task")) for _ in range(20)]
    read_s = (time.perf_counter() - started) / len(reads)
    assert reads[0] == count
    return {"store": "sqlite" if "://" not in location else "postgresql", "records": count,
            "writes_per_s": round(count / write_s, 1), "read_all_ms": round(1000 * read_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--server", help="a PostgreSQL server URL (default: start one here)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fleet.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kselect-fleet-"))
    server_folder = tempfile.mkdtemp(prefix="kselect-fleet-postgres-")  # its own: the server's user must reach it
    server = args.server or start_server(server_folder)
    try:
        stores = [records_per_second(str(work / "records.db"), args.records),
                  records_per_second(fresh_database(server, "bench_records"), args.records)]
        tunes = [tune_with_workers(args.model, str(work / "one.db"), 1, args.budget, work),
                 tune_with_workers(args.model, fresh_database(server, "bench_one"), 1, args.budget, work),
                 tune_with_workers(args.model, fresh_database(server, "bench_two"), 2, args.budget, work)]
    finally:
        if not args.server:
            subprocess.run(["bash", REPO / "scripts" / "local-postgres.sh", "stop", server_folder],
                           capture_output=True)
    table = Table(title=f"Tuning {args.model} on MLAS, budget {args.budget}, --no-verify, each from an empty database")
    for column in ("record store", "workers", "wall s", "tasks per worker", "configs measured per worker",
                   "claim ms per task", "waited s per worker", "wrote the plan"):
        table.add_column(column)
    for tune in tunes:
        table.add_row(tune["db"], str(tune["workers"]), f"{tune['wall_s']:.1f}",
                      " / ".join(str(s["tasks"]) for s in tune["split"]),
                      " / ".join(str(s["configs_measured"]) for s in tune["split"]), f"{tune['claim_ms_per_task']:.2f}",
                      " / ".join(f"{s['waited_s']:.1f}" for s in tune["split"]),
                      " / ".join("yes" if s["wrote_plan"] else "no" for s in tune["split"]))
    console.print(table)
    table = Table(title=f"Record store: {args.records} records added one by one, each committed")
    for column in ("store", "records/s written", "ms to read them all"):
        table.add_column(column)
    for store in stores:
        table.add_row(store["store"], f"{store['writes_per_s']:,.0f}", f"{store['read_all_ms']:.1f}")
    console.print(table)
    from kselect.core.measuring.device import this_device

    result = {"device": this_device().summary(), "model": args.model, "budget": args.budget, "tunes": tunes,
              "stores": stores, "two_workers_over_one": round(tunes[2]["wall_s"] / tunes[1]["wall_s"], 3)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"two workers / one worker wall time (PostgreSQL): {result['two_workers_over_one']:.3f}; "
                  f"wrote {args.out}")


if __name__ == "__main__":
    main()
