"""Record exhaustive replay tables: tune every config of every task of the given zoo models on
this device (through the core API, exactly as ``kselect tune --search exhaustive`` does) and
write them as one table per library and device, ``benchmarks/tables/<library>-<fingerprint>.json``,
for ``kselect.search.replay`` and ``benchmarks/search_efficiency.py``.

Records go to a database first (default benchmarks/results/record_tables.db), so an interrupted
recording resumes; running it again with more models adds their tasks to the table.

    .venv/bin/python benchmarks/record_tables.py [--models resnet18,mobilenetv2] [--library mlas] [--min-time 0.05]
        [--input-shape input=1,3,56,56] [--tasks N] [--retake-noisy 0.2 [--retakes 2]]
        [--confirm-top 0.1 [--confirm-most 12] [--confirm-rounds 3]]

``--retake-noisy S`` times again every stored config of the models' tasks whose spread is above
S, up to ``--retakes`` times, and keeps the fastest take: a thread stalled by the host only ever
inflates a timing, and a table recorded while the machine stalled has optima that are the few
configs that escaped the stalls (xnnpack resnet50 T08: 4 two-thread configs at 918-929 us with
spreads of 0.9-1.6, the other 2-thread ones at 1,100-7,990 us), which no search can be judged on.

``--confirm-top W`` times each task's fastest configs (those within W of its best, at least 3 and
at most ``--confirm-most``) again in ``--confirm-rounds`` interleaved rounds, and each keeps its
fastest take of those rounds. An exhaustive pass times each config once, minutes apart from its
rivals, so its optimum is the near-best config that happened to be timed in the calmest moment:
in the Xeon XNNPack table 73 of 117 tasks had no other config within 2% of the optimum, and 46 none
within 5%, which makes "within 2% of the optimum" a lottery for any search. Timed side by side,
near-best configs are compared under the same conditions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, Result
from kselect.core.measuring.tuning_loop import TuneOptions, library_tasks, tune_tasks
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task
from kselect.core.records.store import RecordDB
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
    parser.add_argument("--retake-noisy", type=float, metavar="SPREAD",
                        help="time again stored configs whose spread is above SPREAD; keep the fastest take")
    parser.add_argument("--retakes", type=int, default=2, help="at most this many retakes per config (default 2)")
    parser.add_argument("--confirm-top", type=float, metavar="WITHIN",
                        help="time each task's configs within WITHIN of its best again, interleaved; keep each one's fastest take")
    parser.add_argument("--confirm-most", type=int, default=12, help="at most this many configs per task (default 12)")
    parser.add_argument("--confirm-rounds", type=int, default=3, help="interleaved rounds (default 3)")
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
    retakes = dict((table or {}).get("retakes", {}))
    confirmed = dict((table or {}).get("confirmed", {}))
    for name in args.models.split(","):
        model = load_model(name, args.input_shape)
        tasks = library_tasks(model, library)[:args.tasks]
        size = sum(len(library.space(t, device)) for t in tasks)
        console.print(f"[bold]{name}[/]: {len(tasks)} tasks, {size} configs")
        start = time.perf_counter()
        outcomes = tune_tasks(tasks, library, device, db, TuneOptions("exhaustive", budget=10**9, settings=settings))
        elapsed = time.perf_counter() - start
        measured = sum(o.measured_now for o in outcomes)
        console.print(f"  {measured} measured now in {elapsed:.0f} s ({sum(o.samples for o in outcomes)} stored)")
        if measured:
            timings[name] = round(elapsed, 1)
        if args.retake_noisy is not None:
            start = time.perf_counter()
            retaken, faster = retake_noisy(db, device, library, tasks, settings, args.retake_noisy, args.retakes)
            console.print(f"  {retaken} noisy records timed again, {faster} replaced by a faster take, "
                          f"in {time.perf_counter() - start:.0f} s")
            if retaken:
                retakes[name] = {"above_spread": args.retake_noisy, "rounds": args.retakes, "retaken": retaken,
                                 "replaced": faster}
        if args.confirm_top is not None:
            start = time.perf_counter()
            retimed = confirm_top(db, device, library, tasks, settings, args.confirm_top, args.confirm_most,
                                  args.confirm_rounds)
            console.print(f"  {retimed} near-best configs timed again side by side in {time.perf_counter() - start:.0f} s")
            confirmed[name] = {"within": args.confirm_top, "most": args.confirm_most, "rounds": args.confirm_rounds,
                               "configs": retimed,
                               "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        defaults = {o.task.key: o.default_config for o in outcomes}
        part = table_from_records(db, device, library, tasks, defaults, model=name, version=version, settings=settings)
        table = part if table is None else merge_tables(table, part)
        write_recorded(table, timings, retakes, confirmed, library, out)


def retake_noisy(db: RecordDB, device, library, tasks: list[Task], settings: MeasureSettings, above: float,
                 rounds: int) -> tuple[int, int]:
    """Times again the stored ok configs of ``tasks`` whose spread is above ``above``, for up to
    ``rounds`` rounds, replacing a record when a take is faster. Returns (configs retaken, records
    replaced)."""
    by_key = {task.key: task for task in tasks}
    retaken, replaced = set(), set()
    with MeasureWorker(library.name, settings) as worker, Progress(console=console) as progress:
        for round_number in range(1, rounds + 1):
            noisy = [r for r in db.records(device.fingerprint, library.name, library.version())
                     if r.task in by_key and r.result.status == "ok" and (r.result.spread or 0) > above]
            if not noisy:
                break
            bar = progress.add_task(f"  retake {round_number}: {len(noisy)} configs with spread > {above:g}", total=len(noisy))
            for record in noisy:
                result = worker.measure(by_key[record.task], record.config)
                retaken.add((record.task, record.config_key))
                if result.status == "ok" and result.median_us < record.result.median_us:
                    replace_result(db, device, library, by_key[record.task], record, result)
                    replaced.add((record.task, record.config_key))
                progress.advance(bar)
    return len(retaken), len(replaced)


def confirm_top(db: RecordDB, device, library, tasks: list[Task], settings: MeasureSettings, within: float,
                most: int, rounds: int) -> int:
    """Times each task's stored ok configs within ``within`` of its fastest (at least 3, at most
    ``most``) again in ``rounds`` interleaved rounds (the order reversed every other round) and
    stores each one's fastest take of those rounds, failed takes ignored. Returns how many configs
    were timed."""
    stored: dict[str, list] = {}
    for record in db.records(device.fingerprint, library.name, library.version()):
        if record.result.status == "ok":
            stored.setdefault(record.task, []).append(record)
    groups = []
    for task in tasks:
        ranked = sorted(stored.get(task.key, []), key=lambda r: r.result.median_us)
        if ranked:
            best = ranked[0].result.median_us
            groups.append((task, [r for i, r in enumerate(ranked[:most]) if i < 3 or r.result.median_us <= best * (1 + within)]))
    with MeasureWorker(library.name, settings) as worker, Progress(console=console) as progress:
        bar = progress.add_task(f"  confirm the fastest configs of {len(groups)} tasks",
                                total=rounds * sum(len(group) for _, group in groups))
        for task, group in groups:
            fastest: dict[str, Result] = {}
            for round_number in range(rounds):
                for record in group if round_number % 2 == 0 else group[::-1]:
                    result = worker.measure(task, record.config)
                    kept = fastest.get(record.config_key)
                    if result.status == "ok" and (kept is None or result.median_us < kept.median_us):
                        fastest[record.config_key] = result
                    progress.advance(bar)
            for record in group:
                if record.config_key in fastest:
                    replace_result(db, device, library, task, record, fastest[record.config_key])
    return sum(len(group) for _, group in groups)


def replace_result(db: RecordDB, device, library, task: Task, record, result) -> None:
    """Stores ``result``, a new take of ``record``'s config, in place of its stored result."""
    db.add(device.fingerprint, library.name, library.version(), task.to_json(), record.config_key, result,
           library.emulated, record.is_default)


def write_recorded(table: dict, timings: dict, retakes: dict, confirmed: dict, library, out: Path) -> None:
    """Written after every model, so a long recording that stops keeps the models it finished."""
    table["recorded"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    table["recording_s"] = dict(timings)
    if retakes:
        table["retakes"] = dict(retakes)
    if confirmed:
        table["confirmed"] = dict(confirmed)
    table["note"] = ("Measured: exhaustive tunes on the device described here (kselect's measuring protocol: child "
                     "process, warm-up, medians of fresh instances, outputs verified). Other processes shared the "
                     "machine while recording, so timings carry that noise (see spread).")
    if table.get("retakes"):
        table["note"] += (" For the models in 'retakes', configs whose spread was above the threshold given there were "
                          "timed again up to 'rounds' times and the fastest take kept (host stalls only inflate timings).")
    if table.get("confirmed"):
        table["note"] += (" For the models in 'confirmed', each task's fastest configs (within 'within' of the best, at "
                          "least 3, at most 'most') were timed again in 'rounds' interleaved rounds after the exhaustive "
                          "pass, each keeping its fastest take of those rounds.")
    if library.emulated:
        table["emulated"] = True
        table["note"] += (" EMULATED: timed under qemu user-mode emulation on x86_64; never Arm performance, only "
                          "a space to replay searches on.")
    write_table(table, out)
    console.print(f"wrote {out}: {len(table['tasks'])} tasks, {sum(len(t['configs']) for t in table['tasks'])} configs")


if __name__ == "__main__":
    main()
