"""Python side of the ACL runner protocol (PROTOCOL.md).

``AclRunner`` keeps one runner process alive and sends it line-delimited JSON requests; if the
process dies (an ACL abort, a timeout) the request fails with ``RunnerError`` and the next request
starts a fresh process. Every result carries ``"emulated": true`` when the runner runs under qemu:
such timings are not Arm timings and must stay labelled as emulated.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kselect.core.measuring.worker import die_with_parent

from . import build


class RunnerError(RuntimeError):
    """The runner process failed (crashed, timed out, or wrote something that is not JSON)."""


class AclRunner:
    def __init__(self, argv: list[str] | None = None, timeout_s: float = 600.0):
        self.argv = argv or build.runner_argv()
        self.timeout_s = timeout_s
        self.emulated = build.is_emulated()
        self._proc: subprocess.Popen | None = None
        self._stderr = None  # temporary file: a pipe could fill up and block the runner
        self._next_id = 0

    # -- process handling -------------------------------------------------------------------
    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            if self._stderr is not None:
                self._stderr.close()
            self._stderr = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._stderr, text=True, bufsize=1,
                                          preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        return self._proc

    def close(self) -> None:
        p, self._proc = self._proc, None
        if p is None:
            return
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "AclRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------
    def request(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and return the parsed result (``ok`` may be false: check it)."""
        p = self._start()
        self._next_id += 1
        req = dict(req, id=self._next_id)
        try:
            p.stdin.write(json.dumps(req) + "\n")
            p.stdin.flush()
        except BrokenPipeError as e:
            self._fail(p, f"runner stdin closed: {e}")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(p, f"runner timed out after {timeout_s or self.timeout_s:.0f} s", kill=True)
            r, _, _ = select.select([p.stdout], [], [], min(left, 1.0))
            if r:
                line = p.stdout.readline()
                if not line:
                    self._fail(p, "runner exited")
                try:
                    res = json.loads(line)
                except json.JSONDecodeError:
                    self._fail(p, f"runner wrote non-JSON: {line[:200]!r}", kill=True)
                if res.get("id") != self._next_id:
                    self._fail(p, f"runner answered id {res.get('id')}, expected {self._next_id}", kill=True)
                res.pop("id", None)
                res["emulated"] = self.emulated
                return res

    def _fail(self, p: subprocess.Popen, msg: str, kill: bool = False) -> None:
        if kill and p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=5)
            self._stderr.seek(0)
            err = self._stderr.read().strip().splitlines()[-3:]
        except Exception:  # noqa: BLE001 - best effort diagnostics
            err = []
        self._proc = None
        rc = p.returncode
        raise RunnerError(f"{msg} (rc={rc}){': ' + ' | '.join(err) if err else ''}")

    # -- conveniences -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return self.request({"action": "info"})

    def validate_conv(self, conv: dict[str, Any]) -> dict[str, Any]:
        return self.request({"action": "validate", "op": "conv", **conv})

    def run_op(self, op: str, spec: dict[str, Any], config: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
               want_output: bool = False, output_dtype=np.float32, **timing: Any) -> tuple[dict[str, Any], np.ndarray | None]:
        """Run one op. ``arrays`` may hold ``input``, ``weights``, ``bias`` (logical NCHW / OIHW /
        (N,K) / (M,K) float32; for a quantized op, ``spec["quant"]``, uint8 / int8 / int32 arrays,
        written with their own element type); missing ones are generated by the runner from ``seed``.
        ``timing`` passes warmup / min_repeats / max_repeats / min_time_ms / seed.
        ``output_dtype``: the element type of the output file (uint8 / int8 for a quantized op).
        Returns (result, output array or None)."""
        arrays = arrays or {}
        with tempfile.TemporaryDirectory(prefix="kselect-acl-") as d:
            req: dict[str, Any] = {"action": "run", "op": op, **spec, "config": config, **timing}
            for name, arr in arrays.items():
                if arr.dtype in (np.uint8, np.int8, np.int32):  # quantized data and S32 biases
                    path = os.path.join(d, f"{name}.{arr.dtype.name}")
                    np.ascontiguousarray(arr).tofile(path)
                else:
                    path = os.path.join(d, f"{name}.f32")
                    np.ascontiguousarray(arr, dtype=np.float32).tofile(path)
                req[f"{name}_path"] = path
            out_path = os.path.join(d, "output.f32" if np.dtype(output_dtype) == np.float32 else f"output.{np.dtype(output_dtype).name}")
            if want_output:
                req["output_path"] = out_path
            res = self.request(req)
            out = None
            if res.get("ok") and want_output:
                out = np.fromfile(out_path, dtype=output_dtype).reshape(res["output"])
            return res, out


def write_f32(path: str | Path, arr: np.ndarray) -> None:
    np.ascontiguousarray(arr, dtype=np.float32).tofile(str(path))
