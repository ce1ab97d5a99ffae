"""Where a built XNNPack model's time goes (benchmarks/where_time_goes.py, benchmarks/xnnpack_zoo.py):
each step of an ``Executor`` timed in place, and the Python-side cost of its dispatch loop."""

from __future__ import annotations

import statistics
import time

import numpy as np

from kselect.plugins.xnnpack import tileshim
from kselect.plugins.xnnpack import xnnpack_api as xa


def profile(executor, feeds: dict, runs: int = 20) -> dict:
    """Where one inference's time goes, in place: per run, the input and output layout
    conversions and every step timed on its own (the loop's Python and ctypes calls are in the
    whole run's time, not in any step's). Returns medians over ``runs``: ``whole_us``,
    ``edges_us`` and ``nodes`` (node name -> (op type, us))."""
    whole, edges, per_node = [], [], {}
    clock = time.perf_counter_ns
    for _ in range(runs):
        start = clock()
        executor.load_inputs(feeds)
        edge_ns = clock() - start
        node_ns: dict[str, int] = {}
        for (fn, a, b), (node, _) in zip(executor.steps, executor.step_nodes):
            step_start = clock()
            status = fn(a, b)
            if status:
                raise xa.XNNPackError(status, "xnn_run_operator")
            node_ns[node] = node_ns.get(node, 0) + clock() - step_start
        executor.release_pools()
        output_start = clock()
        executor.read_outputs()
        end = clock()
        whole.append((end - start) / 1000)
        edges.append((edge_ns + end - output_start) / 1000)
        for node, ns in node_ns.items():
            per_node.setdefault(node, []).append(ns / 1000)
    op_types = dict(executor.step_nodes)
    return {"whole_us": statistics.median(whole), "edges_us": statistics.median(edges),
            "nodes": {node: (op_types[node], statistics.median(us)) for node, us in per_node.items()}}


def dispatch_overhead_us(executor, repeats: int = 200) -> dict:
    """Python-side cost per inference: the same dispatch loop with every native operator call
    replaced by a no-op C call with the same arguments (so it times the loop and the ctypes
    calls, not XNNPack), and the input / output layout conversions on their own."""
    shim = tileshim.shim()
    noop = shim.lib.kselect_shim_noop if shim is not None else None
    if noop is None:
        return {}
    noop.argtypes = [xa.ctypes.c_void_p, xa.ctypes.c_void_p]
    noop.restype = xa.ctypes.c_int
    steps = [(noop if fn is executor.run_operator else (lambda a, b: 0), a, b) for fn, a, b in executor.steps]

    def loop():
        for fn, a, b in steps:
            if fn(a, b):
                raise RuntimeError

    feeds = {name: np.zeros(t.shape, np.float32) for name, t in executor.inputs}

    def edges():
        executor.load_inputs(feeds)
        executor.read_outputs()

    def best(fn):
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1000.0)
        return float(np.percentile(samples, 10)), float(np.median(samples))

    loop_p10, loop_med = best(loop)
    edge_p10, edge_med = best(edges)
    native_calls = sum(fn is executor.run_operator for fn, _, _ in executor.steps)
    return {"steps": len(executor.steps), "native_calls": native_calls,
            "dispatch_us": round(loop_med, 2), "dispatch_us_p10": round(loop_p10, 2),
            "edge_conversion_us": round(edge_med, 2), "edge_conversion_us_p10": round(edge_p10, 2)}
