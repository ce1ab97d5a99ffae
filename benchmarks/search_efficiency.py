"""Search efficiency of the backends on recorded (replayed) tables: no kernel runs.

For each backend, each task of each table and several seeds: the samples needed to get within
2% of the exhaustive optimum, and the gap to the optimum after a few budgets. Printed as tables
(rich) and written as JSON (default benchmarks/results/search_efficiency.json).

Backends: random, xgb, tpe, and xgb+transfer (xgb given, as the tuner would, earlier results of
the table's other tasks: up to --prior-per-task random configs of each; leave-one-task-out).
The library default is not measured first here (``--with-default`` does), so this is the
searchers' own efficiency.

    .venv/bin/python benchmarks/search_efficiency.py [--tables benchmarks/tables] [--seeds 5]
        [--backends random,xgb,tpe,xgb+transfer] [--budgets 5,10,25,50,100] [--synthetic 12]

``--synthetic N`` also runs on a SYNTHETIC large-space table built from the first N tasks of each
recorded table (made-up extra dims and cost factor, see ``kselect.search.replay.SYNTHETIC_NOTE``):
it exercises the backends on spaces of thousands of configs until ACL and XNNPack tables exist.
Its figures are labelled synthetic and are not measurements.

``--jobs N`` runs up to N backends at once, each in its own process (the slowest first). Their
figures are the same as one at a time: a replay's results depend on the seed only. On a
2-core machine ``--jobs 2`` takes about the time of xgb+transfer alone.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kselect.search.replay import ReplayTable, load_tables, run_searcher, synthetic_table

console = Console(width=None if sys.stdout.isatty() else 180)
TABLES = Path(__file__).resolve().parent / "tables"
LARGE = 2000  # spaces at least this big: 100 samples are at most 5% of exhaustive
TOLERANCE = 0.02


def prior_for(table: ReplayTable, key: str, per_task: int, seed: int) -> list:
    """Earlier results for transfer: up to ``per_task`` random ok configs of every other task."""
    rng = random.Random(seed)
    prior = []
    for other in table.tasks:
        if other.key == key:
            continue
        ok = [(k, r) for k, r in other.results.items() if r.status == "ok"]
        for k, result in rng.sample(ok, min(per_task, len(ok))):
            prior.append((other.task, other.configs[k], result.median_us))
    return prior


def run_backend(backend: str, table: ReplayTable, seeds: list[int], budget: int, per_task: int,
                with_default: bool) -> list[dict]:
    rows = []
    searcher, transfer = backend.split("+")[0], backend.endswith("+transfer")
    for replay_task in table.tasks:
        optimum = replay_task.optimum_us
        if optimum is None:
            continue
        for seed in seeds:
            prior = prior_for(table, replay_task.key, per_task, seed) if transfer else None
            trajectory = run_searcher(searcher, replay_task, budget, seed=seed, prior=prior, include_default=with_default)
            reached = trajectory.samples_to_within(optimum, TOLERANCE)
            rows.append({"task": replay_task.key, "name": replay_task.name, "size": replay_task.size, "seed": seed,
                         "samples": trajectory.samples, "to_2pct": reached,
                         "best_us": trajectory.best_at(budget), "optimum_us": optimum,
                         "best": trajectory.best, "search_s": round(trajectory.elapsed_s, 3)})
    return rows


def load_run(path: str, synthetic: int = 0) -> ReplayTable:
    """A table file, or the SYNTHETIC table built from its first ``synthetic`` tasks."""
    table = ReplayTable.load(path)
    return synthetic_table(table, synthetic) if synthetic else table


def _run_loaded(backend: str, source: tuple[str, int], args: tuple) -> list[dict]:
    return run_backend(backend, load_run(*source), *args)


def run_backends(backends: list[str], table: ReplayTable, source: tuple[str, int], jobs: int,
                 args: tuple) -> dict[str, list[dict]]:
    """``run_backend(backend, table, *args)`` for every backend, up to ``jobs`` at once. A
    parallel backend runs in a spawned process that loads the table again from ``source``
    (``load_run``'s arguments): tables hold closures, which do not pickle, and a process forked
    after XGBoost has trained hangs in its thread pool."""
    results = {}
    if jobs <= 1:
        for backend in backends:
            start = time.perf_counter()
            results[backend] = run_backend(backend, table, *args)
            console.print(f"  {backend}: {time.perf_counter() - start:.0f} s")
        return results
    from concurrent.futures import ProcessPoolExecutor, as_completed

    slowest_first = sorted(backends, key=lambda b: {"xgb+transfer": 0, "tpe": 1}.get(b, 2))
    start = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_loaded, backend, source, args): backend for backend in slowest_first}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            console.print(f"  {futures[future]}: done after {time.perf_counter() - start:.0f} s")
    return {backend: results[backend] for backend in backends}


def _gap(row: dict, budget: int) -> float:
    best = row["best"][min(budget, len(row["best"])) - 1] if row["best"] else None
    return math.inf if best is None else best / row["optimum_us"] - 1.0


def summarise(rows: list[dict], budgets: list[int], budget: int) -> dict:
    reached = [r for r in rows if r["to_2pct"] is not None and r["to_2pct"] <= budget]
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    # A task counts as solved when every seed got within 2% within the budget.
    tasks_solved = sum(all(x["to_2pct"] is not None and x["to_2pct"] <= budget for x in runs) for runs in by_task.values())
    large = [r for r in rows if r["size"] >= LARGE]
    return {
        "runs": len(rows),
        "tasks": len(by_task),
        "within_2pct_share": len(reached) / len(rows) if rows else math.nan,
        "tasks_solved_share": tasks_solved / len(by_task) if by_task else math.nan,
        "samples_to_2pct_mean": statistics.mean(r["to_2pct"] for r in reached) if reached else None,
        "samples_to_2pct_median": statistics.median(r["to_2pct"] for r in reached) if reached else None,
        "fraction_of_space_mean": statistics.mean(r["to_2pct"] / r["size"] for r in reached) if reached else None,
        "large_space_runs": len(large),
        "large_within_5pct_of_space": (sum(r["to_2pct"] is not None and r["to_2pct"] <= 0.05 * r["size"] for r in large)
                                       / len(large)) if large else None,
        "gap_mean": {str(b): statistics.mean(min(_gap(r, b), 10.0) for r in rows) if rows else None for b in budgets},
        "gap_median": {str(b): statistics.median(_gap(r, b) for r in rows) if rows else None for b in budgets},
        "search_s_mean": statistics.mean(r["search_s"] for r in rows) if rows else None,
    }


def versus(rows: list[dict], baseline: list[dict], budget: int) -> dict:
    """Per task, mean samples to 2% (``budget + 1`` when not reached) of a backend vs baseline."""
    def per_task(runs):
        out: dict[str, list[int]] = {}
        for r in runs:
            out.setdefault(r["task"], []).append(r["to_2pct"] if r["to_2pct"] is not None else budget + 1)
        return {k: statistics.mean(v) for k, v in out.items()}

    mine, base = per_task(rows), per_task(baseline)
    common = [k for k in mine if k in base]
    better = sum(mine[k] < base[k] for k in common)
    worse = sum(mine[k] > base[k] for k in common)
    ratio = statistics.mean(mine[k] / base[k] for k in common) if common else None
    return {"tasks_better": better, "tasks_worse": worse, "tasks_equal": len(common) - better - worse,
            "mean_samples_ratio": ratio}


def show(name: str, summaries: dict, comparisons: dict, budgets: list[int], budget: int, synthetic: bool,
         emulated: bool = False) -> None:
    title = (f"{name}: samples to within 2% of the exhaustive optimum, gap at budgets" + (" [SYNTHETIC]" if synthetic else "")
             + (" [EMULATED: timed under qemu, not Arm performance]" if emulated else ""))
    table = Table(title=title)
    columns = ["backend", "runs", f"<=2% in {budget}", "tasks solved", "samples mean", "median", "of space",
               *[f"gap@{b}" for b in budgets], "samples vs random", "search s"]
    for column in columns:
        table.add_column(column, justify="left" if column == "backend" else "right")
    for backend, s in summaries.items():
        c = comparisons.get(backend)
        vs = f"{c['mean_samples_ratio']:.2f}x ({c['tasks_better']}+/{c['tasks_worse']}-)" if c else "-"
        table.add_row(backend, str(s["runs"]), f"{s['within_2pct_share']:.0%}", f"{s['tasks_solved_share']:.0%}",
                      f"{s['samples_to_2pct_mean']:.1f}" if s["samples_to_2pct_mean"] else "-",
                      f"{s['samples_to_2pct_median']:g}" if s["samples_to_2pct_median"] else "-",
                      f"{s['fraction_of_space_mean']:.1%}" if s["fraction_of_space_mean"] else "-",
                      *[f"{s['gap_mean'][str(b)]:.1%}" for b in budgets], vs, f"{s['search_s_mean']:.2f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default=str(TABLES), help="a directory of tables or one table file")
    parser.add_argument("--backends", default="random,xgb,tpe,xgb+transfer")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=100)
    parser.add_argument("--budgets", default="5,10,25,50,100")
    parser.add_argument("--prior-per-task", type=int, default=100)
    parser.add_argument("--with-default", action="store_true", help="measure the library default first, as tune does")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N",
                        help="also run on a SYNTHETIC large-space table from N tasks of each recorded table")
    parser.add_argument("--json", default="benchmarks/results/search_efficiency.json")
    parser.add_argument("--jobs", type=int, default=1, help="backends run at once, each in its own process")
    args = parser.parse_args()

    path = Path(args.tables)
    tables = [ReplayTable.load(path)] if path.is_file() else load_tables(path)
    if not tables:
        raise SystemExit(f"no tables in {path}: record some with benchmarks/record_tables.py")
    # each run with what a parallel backend loads it from (load_run's arguments)
    runs = [(t, (t.source, 0)) for t in tables] + \
        [(synthetic_table(t, args.synthetic), (t.source, args.synthetic)) for t in tables if args.synthetic]
    budgets = [int(b) for b in args.budgets.split(",")]
    seeds = list(range(args.seeds))
    backends = args.backends.split(",")
    report = {"tolerance": TOLERANCE, "budget": args.budget, "budgets": budgets, "seeds": seeds,
              "with_default": args.with_default, "prior_per_task": args.prior_per_task, "tables": []}
    for table, source in runs:
        synthetic = bool(source[1])
        sizes = [t.size for t in table.tasks]
        name = f"{table.library} {table.library_version} on {table.device.get('cpu_model', '?')} [{table.fingerprint}]"
        console.print(f"[bold]{name}[/]: {len(table.tasks)} tasks, space sizes {min(sizes)}..{max(sizes)}"
                      + (" [yellow]SYNTHETIC[/]" if synthetic else ""))
        results = run_backends(backends, table, source, args.jobs,
                               (seeds, args.budget, args.prior_per_task, args.with_default))
        summaries = {backend: summarise(rows, budgets, args.budget) for backend, rows in results.items()}
        comparisons = {b: versus(results[b], results["random"], args.budget) for b in backends
                       if b != "random" and "random" in results}
        if "xgb" in results and "xgb+transfer" in results:
            comparisons["xgb+transfer vs xgb"] = versus(results["xgb+transfer"], results["xgb"], args.budget)
        show(name, summaries, {k: v for k, v in comparisons.items() if k in summaries}, budgets, args.budget, synthetic,
             table.emulated)
        if "xgb+transfer vs xgb" in comparisons:
            c = comparisons["xgb+transfer vs xgb"]
            x, xt = summaries["xgb"], summaries["xgb+transfer"]
            console.print(f"  transfer: samples to 2% {x['samples_to_2pct_mean']:.1f} -> {xt['samples_to_2pct_mean']:.1f} "
                          f"(per task mean ratio {c['mean_samples_ratio']:.2f}; {c['tasks_better']} tasks better, "
                          f"{c['tasks_worse']} worse)")
        unsolved = {b: sorted({r["task"] for r in results[b] if r["to_2pct"] is None or r["to_2pct"] > args.budget})
                    for b in backends}
        for backend, keys in unsolved.items():
            if keys:
                console.print(f"  {backend}: not within 2% in {args.budget} samples on some seed: {len(keys)} tasks "
                              f"({', '.join(table.task(k).name for k in keys[:8])}{', ...' if len(keys) > 8 else ''})")
        report["tables"].append({
            "source": table.source, "synthetic": table.meta.get("synthetic") if synthetic else None,
            "library": table.library, "library_version": table.library_version, "device": table.device,
            "emulated": table.emulated, "tasks": len(table.tasks), "space_sizes": {"min": min(sizes), "max": max(sizes), "total": sum(sizes)},
            "summary": summaries, "comparisons": comparisons, "unsolved": unsolved,
            "runs": {b: [{k: v for k, v in r.items() if k != "best"} for r in rows] for b, rows in results.items()},
        })
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
