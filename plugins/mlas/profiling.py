"""Per-node times of a whole run, from ONNX Runtime's own profiler (``SessionOptions.enable_profiling``):
the in-context costs of core/whole_model/context.py.

The profiler writes one "Node" event per node per run, named ``<node>_kernel_time``, with its
duration in microseconds, and one "model_run" event per run. The nodes are those of the graph ORT
runs, after its optimisations: a fused conv keeps the conv's name or takes its output's, the
NCHWc transformer appends ``_nchwc``, the QDQ fusions ``_quant``, and the reorders it inserts have
names of their own (core/whole_model/context.py maps them back to the model's nodes)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

KERNEL_SUFFIX = "_kernel_time"


def profiled_run(make_session, feeds: list[dict], runs: int) -> tuple[float, dict[str, float]]:
    """(median whole-run us, runtime node name -> median us) over ``runs`` runs on ``feeds`` in
    turn, after one warm-up run of each feed: the whole run timed in a plain session
    (``make_session(None)``), since the profiler adds its own time between nodes; the nodes in a
    profiled one (``make_session(prefix)``: apply.py's sessions, profiling into files of that
    prefix, written to a folder of its own and removed)."""
    plain = make_session(None)
    names = [o.name for o in plain.get_outputs()]
    for feed in feeds:
        plain.run(names, feed)
    whole = []
    for index in range(runs):
        start = time.perf_counter()
        plain.run(names, feeds[index % len(feeds)])
        whole.append((time.perf_counter() - start) * 1e6)
    del plain  # its threads gone before the profiled session's run
    with tempfile.TemporaryDirectory(prefix="kselect-profile-") as folder:
        session = make_session(str(Path(folder) / "run"))
        for feed in feeds:
            session.run(names, feed)
        for index in range(runs):
            session.run(names, feeds[index % len(feeds)])
        events = json.loads(Path(session.end_profiling()).read_text())
    per_node: dict[str, list[float]] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith(KERNEL_SUFFIX):
            per_node.setdefault(event["name"][:-len(KERNEL_SUFFIX)], []).append(event["dur"])
    # a node runs once per run: its last ``runs`` events are the timed runs
    return statistics.median(whole), {name: statistics.median(times[-runs:]) for name, times in per_node.items()}
