"""Python-side cost of calling an XNNPack operator through the ctypes binding.

    python -m kselect.plugins.xnnpack.bench_overhead [--threads N] [--iters N]

Times, on a tiny tensor (so the native work is ~0), the full ``op.run(x, out)`` (setup + run),
``op.run(x)`` (plus output allocation), ``op.setup`` alone, ``op.execute`` alone, and the bare
ctypes call of ``xnn_run_operator``.  Reports the best of several repeats, in microseconds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from . import xnnpack_api as xa


def _time_us(fn, iters: int, repeats: int = 7) -> float:
    for _ in range(min(iters, 1000)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return min(samples)  # least-disturbed repeat: the machine is shared


def measure(threads: int = 1, iters: int = 20000) -> dict[str, float]:
    pool = xa.Threadpool(threads) if threads > 1 else None
    res: dict[str, float] = {}
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    out = np.empty_like(x)
    clamp = xa.Clamp(16, 0.0, 6.0, threadpool=pool)
    x2, out2 = x.copy(), out.copy()
    flip = [(x, out), (x2, out2)]
    state = [0]

    def alternating():  # new arrays every call: setup + run
        state[0] ^= 1
        a, o = flip[state[0]]
        clamp.run(a, o)

    res["clamp run(x, out), new arrays"] = _time_us(alternating, iters)
    res["clamp run(x, out), same arrays"] = _time_us(lambda: clamp.run(x, out), iters)
    res["clamp run(x) (allocates out)"] = _time_us(lambda: clamp.run(x), iters)
    res["clamp setup only"] = _time_us(lambda: clamp.setup(x, out), iters)
    res["clamp execute only"] = _time_us(clamp.execute, iters)
    run_fn, h, ph = xa.lib().xnn.xnn_run_operator, clamp.handle, None if pool is None else pool.handle
    res["bare ctypes xnn_run_operator"] = _time_us(lambda: run_fn(h, ph), iters)

    xc = np.random.default_rng(1).standard_normal((1, 4, 4, 8)).astype(np.float32)
    conv = xa.Convolution2DNHWC(np.ones((8, 8, 3, 3), np.float32), np.zeros(8, np.float32),
                                padding=1, threadpool=pool)
    outc = np.empty(conv.output_shape(xc.shape), np.float32)
    res["conv3x3 4x4x8 setup+execute"] = _time_us(
        lambda: (conv.setup(xc, outc), conv.execute()), iters // 4)
    res["conv3x3 4x4x8 run(x, out), same arrays"] = _time_us(lambda: conv.run(xc, outc), iters // 4)
    res["conv3x3 4x4x8 execute only"] = _time_us(conv.execute, iters // 4)
    add = xa.Add(threadpool=pool)
    res["add setup+execute"] = _time_us(lambda: (add.setup(x, x, out), add.execute()), iters)
    res["add run(a, b, out), same arrays"] = _time_us(lambda: add.run(x, x, out), iters)
    for op in (clamp, conv, add):
        op.close()
    if pool is not None:
        pool.close()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20000)
    a = ap.parse_args(argv)
    ok, why = xa.availability()
    if not ok:
        raise SystemExit(why)
    for name, us in measure(a.threads, a.iters).items():
        print(f"{name:36s} {us:7.2f} us")


if __name__ == "__main__":
    main()
