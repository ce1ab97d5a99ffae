"""Record exhaustive replay tables: tune every config of every task of the given zoo models on
this device (through the core API, exactly as ``kselect tune --search exhaustive`` does) and
write them as one table per library and device, ``benchmarks/tables/<library>-<fingerprint>.json``,
for ``kselect.search.replay`` and ``benchmarks/search_efficiency.py``.

Records go to a database first (default benchmarks/results/record_tables.db), so an interrupted
recording resumes; running it again with more models adds their tasks to the table.

    .venv/bin/python benchmarks/record_tables.py [--models resnet18,mobilenetv2] [--library mlas] [--min-time 0.05]
        [--input-shape input=1,3,56,56] [--tasks N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from rich.console import Console

from kselect.core import plugins
from kselect.core.device import this_device
from kselect.core.measure import MeasureSettings
from kselect.core.model import load_model
from kselect.core.records import RecordDB
from kselect.core.tune import TuneOptions, library_tasks, tune
from kselect.search.replay import TABLE_FORMAT, merge_tables, table_from_records, write_table

console = Console()
TABLES = Path(__file__).resolve().parent / "tables"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,mobilenetv2")
    parser.add_argument("--library", default="mlas")
    parser.add_argument("--min-time", type=float, default=0.05, help="minimum timing per candidate instance, s")
    parser.add_argument("--db", default="benchmarks/results/record_tables.db")
    parser.add_argument("--out", help="table path (default benchmarks/tables/<library>-<fingerprint>.json)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                        help="smaller inputs, e.g. input=1,3,56,56 for a set that fits emulation")
    parser.add_argument("--tasks", type=int, help="only the first N tasks of each model")
    args = parser.parse_args()

    library = plugins.get_library(args.library)
    device = this_device()
    version = library.version()
    settings = MeasureSettings(min_time_s=args.min_time, max_time_s=15 * args.min_time)
    out = Path(args.out) if args.out else TABLES / f"{library.name}-{device.fingerprint}.json"
    db = RecordDB(args.db)
    table = json.loads(out.read_text()) if out.exists() else None
    if table is not None and (table.get("format") != TABLE_FORMAT or table["library_version"] != version
                              or table["device"]["fingerprint"] != device.fingerprint):
        console.print(f"[yellow]{out} is of another format, device or library build: replacing it[/]")
        table = None
    console.print(f"recording {args.models} on {library.name} ({version}), device {device.summary()} "
                  f"[{device.fingerprint}], min time {args.min_time} s")
    timings = dict((table or {}).get("recording_s", {}))
    for name in args.models.split(","):
        model = load_model(name, args.input_shape)
        tasks = library_tasks(model, library)[:args.tasks]
        size = sum(len(library.space(t, device)) for t in tasks)
        console.print(f"[bold]{name}[/]: {len(tasks)} tasks, {size} configs")
        start = time.perf_counter()
        outcomes = tune(tasks, library, device, db, TuneOptions("exhaustive", budget=10**9, settings=settings))
        elapsed = time.perf_counter() - start
        measured = sum(o.measured_now for o in outcomes)
        console.print(f"  {measured} measured now in {elapsed:.0f} s ({sum(o.samples for o in outcomes)} stored)")
        if measured:
            timings[name] = round(elapsed, 1)
        defaults = {o.task.key: o.default_config for o in outcomes}
        part = table_from_records(db, device, library, tasks, defaults, model=name, version=version, settings=settings)
        table = part if table is None else merge_tables(table, part)
        write_recorded(table, timings, library, out)


def write_recorded(table: dict, timings: dict, library, out: Path) -> None:
    """Written after every model, so a long recording that stops keeps the models it finished."""
    table["recorded"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    table["recording_s"] = dict(timings)
    table["note"] = ("Measured: exhaustive tunes on the device described here (kselect's measuring protocol: child "
                     "process, warm-up, medians of fresh instances, outputs verified). Other processes shared the "
                     "machine while recording, so timings carry that noise (see spread).")
    if library.emulated:
        table["emulated"] = True
        table["note"] += (" EMULATED: timed under qemu user-mode emulation on x86_64; never Arm performance, only "
                          "a space to replay searches on.")
    write_table(table, out)
    console.print(f"wrote {out}: {len(table['tasks'])} tasks, {sum(len(t['configs']) for t in table['tasks'])} configs")


if __name__ == "__main__":
    main()
