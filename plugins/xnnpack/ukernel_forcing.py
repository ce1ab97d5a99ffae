"""Forcing micro-kernels: ``forced_kernels`` rewrites the f32 or an 8-bit family's gemm and / or
one dwconv entry of ``xnn_params`` for the operators created inside it (they keep those kernels
for their lifetime) and restores the table on exit. A wrong IGEMM row tile aborts the process on
an XNNPack ``assert``, so ``forced_kernels`` is refused outside a child of ``run_child`` unless
the caller passes ``allow_in_process``: configured.py does, having refused the configs that can
abort outside the measuring child. ``run_candidate`` creates, checks and times one operator
with a forced kernel in such a child (``python -m kselect.plugins.xnnpack.ukernel_forcing
--candidate JSON``).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import sys
import time

import numpy as np

from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.ukernel_catalog import DwconvChoice, GemmChoice
from kselect.plugins.xnnpack.ukernel_probes import CHILD_ENV, run_child
from kselect.plugins.xnnpack.ukernel_table import (
    INT8_FAMILIES,
    DwconvParams,
    GemmParams,
    OverrideRefused,
    kernels_in_operator,
    verify_build,
)

_THIS_MODULE = "kselect.plugins.xnnpack.ukernel_forcing"  # run_candidate's children run it


class forced_kernels:
    """Context manager: rewrite ``family``'s (f32, qc8, qs8 or qu8) gemm entry of ``xnn_params``
    and / or its dwconv entry of the choice's primary tile, restore on exit. Operators created
    inside keep the forced kernel for their lifetime.

    Refused outside a child of ``ukernel_probes.run_child`` unless ``allow_in_process=True``.
    """

    def __init__(self, gemm: GemmChoice | None = None, dwconv: DwconvChoice | None = None,
                 *, allow_in_process: bool = False, family: str = "f32"):
        if os.environ.get(CHILD_ENV) != "1" and not allow_in_process:
            raise OverrideRefused("micro-kernel overrides run only in a child process "
                                  "(ukernel_probes.run_child), or pass allow_in_process=True")
        if family not in ("f32",) + INT8_FAMILIES:
            raise ValueError(f"no table entries for {family!r}")
        self.gemm, self.dwconv, self.family = gemm, dwconv, family
        self._saved: list[tuple[int, bytes]] = []

    def __enter__(self):
        b = verify_build()
        t = b.table
        entries = getattr(t, self.family)  # the f32 or the 8-bit family's gemm / dwconv entries
        if self.gemm is not None:
            g = self.gemm
            addr = ctypes.addressof(entries.gemm)
            self._saved.append((addr, ctypes.string_at(addr, ctypes.sizeof(GemmParams))))
            gp = entries.gemm
            gp.minmax.gemm = gp.minmax.igemm = gp.minmax.gemm1 = gp.minmax.igemm1 = None
            if g.kind == "gemm":
                gp.minmax.gemm = b.base + g.fn
                gp.minmax.gemm1 = b.base + g.fn1 if g.fn1 else None
            else:
                gp.minmax.igemm = b.base + g.fn
                gp.minmax.igemm1 = b.base + g.fn1 if g.fn1 else None
            gp.init = b.base + g.init
            gp.mr, gp.nr, gp.log2_kr, gp.log2_sr = g.mr, g.nr, g.log2_kr, g.log2_sr
        if self.dwconv is not None:
            d = self.dwconv
            for entry in entries.dwconv:
                if entry.primary_tile == d.primary_tile:
                    addr = ctypes.addressof(entry)
                    self._saved.append((addr, ctypes.string_at(addr, ctypes.sizeof(DwconvParams))))
                    entry.minmax = b.base + d.fn
                    entry.init = b.base + d.init
                    entry.channel_tile = d.channel_tile
                    break
            else:
                raise OverrideRefused(f"no {self.family}.dwconv entry with primary_tile {d.primary_tile}")
        return self

    def __exit__(self, *exc):
        for addr, raw in reversed(self._saved):
            ctypes.memmove(addr, raw, len(raw))
        self._saved.clear()


# -- a candidate: one operator created with a forced kernel in a child, checked, timed ----------


def _conv_case(spec: dict):
    rng = np.random.default_rng(spec.get("seed", 0))
    cin, cout, g = spec["cin"], spec["cout"], spec.get("groups", 1)
    kh, kw = spec.get("kh", spec["k"]), spec.get("kw", spec["k"])
    w = (rng.standard_normal((cout, cin // g, kh, kw)) / np.sqrt(cin // g * kh * kw)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((spec.get("batch", 1), spec["h"], spec["w"], cin)).astype(np.float32)
    return w, b, x


def _ref_conv(x, w, b, s, p, g):
    n, h, wd, c = x.shape
    o, ig, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (p, p), (p, p), (0, 0)))
    oh = (h + 2 * p - kh) // s + 1
    ow = (wd + 2 * p - kw) // s + 1
    og = o // g
    out = np.zeros((n, oh, ow, o))
    for gi in range(g):
        for ky in range(kh):
            for kx in range(kw):
                patch = xp[:, ky:ky + (oh - 1) * s + 1:s, kx:kx + (ow - 1) * s + 1:s, gi * ig:(gi + 1) * ig]
                out[..., gi * og:(gi + 1) * og] += patch @ w[gi * og:(gi + 1) * og, :, ky, kx].T.astype(np.float64)
    return out + b


def _candidate_in_this_process(spec: dict, choice: dict | None, threads: int, reps: int) -> dict:
    b = verify_build()
    gemm = dw = None
    if choice is not None:
        if choice["type"] == "dwconv":
            dw = DwconvChoice(**choice["fields"])
        else:
            gemm = GemmChoice(**choice["fields"])
    w, bias, x = _conv_case(spec)
    pool = xa.Threadpool(threads) if threads > 1 else None
    with forced_kernels(gemm, dw):
        if spec["op"] == "fc":
            op = xa.FullyConnected(w.reshape(w.shape[0], -1), bias, threadpool=pool)
            x = x.reshape(-1, w.shape[1])
        else:
            op = xa.Convolution2DNHWC(w, bias, stride=spec.get("stride", 1), padding=spec.get("pad", 0),
                                      groups=spec.get("groups", 1), threadpool=pool)
    held = kernels_in_operator(op, b)
    out = op.run(x)
    if spec["op"] == "fc":
        ref = x.astype(np.float64) @ w.reshape(w.shape[0], -1).T.astype(np.float64) + bias
    else:
        ref = _ref_conv(x, w, bias, spec.get("stride", 1), spec.get("pad", 0), spec.get("groups", 1))
    err = float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))
    o = np.empty_like(out)
    op.run(x, o)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        op.execute()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return {"ok": err < 1e-4, "rel_err": err, "median_us": float(np.median(times)),
            "min_us": float(np.min(times)), "kernels_in_operator": held}


def run_candidate(spec: dict, choice: GemmChoice | DwconvChoice | None, *, threads: int = 1,
                  reps: int = 20, timeout: float = 120) -> dict:
    """Create ``spec`` (conv NHWC or fc) with ``choice`` forced, in a child; check vs numpy; time.

    ``spec``: {"op": "conv"|"fc", "cin", "cout", "k" (or "kh"/"kw"), "stride", "pad", "groups",
    "h", "w"}.
    Returns {"ok", "rel_err", "median_us", "min_us", "kernels_in_operator"} or {"ok": False,
    "error": ...} (e.g. the child aborted on an XNNPack assert).
    """
    payload = {"spec": spec, "threads": threads, "reps": reps, "choice": None}
    if choice is not None:
        payload["choice"] = {"type": "dwconv" if isinstance(choice, DwconvChoice) else "gemm",
                             "fields": dataclasses.asdict(choice)}
    res, err = run_child(_THIS_MODULE, ["--candidate", json.dumps(payload)], timeout=timeout)
    if res is None:
        return {"ok": False, "error": err}
    return res


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_THIS_MODULE}")
    parser.add_argument("--candidate", required=True)
    payload = json.loads(parser.parse_args(argv).candidate)
    try:
        result = _candidate_in_this_process(payload["spec"], payload["choice"], payload["threads"], payload["reps"])
    except (OverrideRefused, xa.XNNPackError) as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
