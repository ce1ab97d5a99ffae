"""The micro-kernels of other ISA tiers than the CPU's own: XNNPack's initialisation picks the
kernels of the best ISA the CPU has, so each tier's table is read in a child process that clears
``cpuinfo_isa`` flags (and, for the Zen-only 4x16s4 kernels, sets the uarch of core 0) before
``xnn_initialize``; addresses travel back as offsets from the library base. A tier is probed only
on a CPU that has the ISA its kernels need. ``python -m kselect.plugins.xnnpack.ukernel_probes
--probe TIER`` / ``--probe-int8 TIER`` is the child's side (one JSON line).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys

from kselect.plugins.xnnpack.ukernel_table import (
    OverrideRefused,
    check_int8_table,
    snapshot,
    snapshot_int8,
    verify_build,
)

CHILD_ENV = "KSELECT_XNN_UKERNEL_CHILD"  # set in the children of run_child
_THIS_MODULE = "kselect.plugins.xnnpack.ukernel_probes"  # the probe children run it

# cpuinfo (x86-64 build of /usr/include/cpuinfo.h): byte offsets of the bool fields XNNPack reads.
_CPUINFO_X86_64_ISA_FIELDS = [
    "rdtscp", "rdpid", "sysenter", "msr", "clzero", "clflush", "clflushopt", "mwait", "mwaitx",
    "fxsave", "xsave", "three_d_now", "three_d_now_plus", "prefetch", "prefetchw", "prefetchwt1",
    "sse3", "ssse3", "sse4_1", "sse4_2", "sse4a", "misaligned_sse", "avx", "fma3", "fma4", "xop",
    "f16c", "avx2", "avx512f",
]
ISA_OFFSET = {n: i for i, n in enumerate(_CPUINFO_X86_64_ISA_FIELDS)}


class CpuinfoCore(ctypes.Structure):
    _fields_ = [("processor_start", ctypes.c_uint32), ("processor_count", ctypes.c_uint32),
                ("core_id", ctypes.c_uint32), ("cluster", ctypes.c_void_p), ("package", ctypes.c_void_p),
                ("vendor", ctypes.c_uint32), ("uarch", ctypes.c_uint32), ("cpuid", ctypes.c_uint32),
                ("frequency", ctypes.c_uint64)]


CPUINFO_UARCH_ZEN = 0x00200109
CPUINFO_VENDOR_INTEL, CPUINFO_VENDOR_AMD = 1, 2

# f32 tiers: what is changed before xnn_initialize in a child, and the /proc/cpuinfo flags the
# tier's kernels need (a tier is probed only on a CPU that has them). Clearing a flag the CPU
# lacks changes nothing: on an AVX2-only CPU "default" and "fma3" are the same tier.
TIERS = {
    "default": {"clear": [], "uarch": None, "needs": []},
    "fma3": {"clear": ["avx512f"], "uarch": None, "needs": ["fma3"]},
    "fma3_zen": {"clear": ["avx512f"], "uarch": CPUINFO_UARCH_ZEN, "needs": ["fma3"]},
    "avx": {"clear": ["avx512f", "fma3"], "uarch": None, "needs": ["avx"]},
    "sse": {"clear": ["avx512f", "fma3", "avx"], "uarch": None, "needs": []},
}
PROC_FLAG = {"avx512f": "avx512f", "fma3": "fma", "avx": "avx", "avx2": "avx2", "sse4_1": "sse4_1", "xop": "xop"}

# 8-bit tiers (qc8, qs8, qu8 GEMM / IGEMM / DWCONV kernels). init.c (x86 branch, ae108ef) picks them
# by a chain of its own: avx512skx (avx512f+bw+dq+vl) > xop > avx2 > avx > sse4.1 > sse2, for
# each family alike. Each tier is read in a child that clears the cpuinfo_isa flags above it (a
# tier is probed only where the CPU has the ISA it needs; clearing a flag the CPU lacks changes
# nothing). "default" is the CPU's own tier.
INT8_TIERS = {
    "default": {"clear": [], "uarch": None, "needs": []},
    "avx2": {"clear": ["avx512f", "xop"], "uarch": None, "needs": ["avx2"]},
    "avx": {"clear": ["avx512f", "xop", "avx2"], "uarch": None, "needs": ["avx"]},
    "sse41": {"clear": ["avx512f", "xop", "avx2", "avx"], "uarch": None, "needs": ["sse4_1"]},
    "sse2": {"clear": ["avx512f", "xop", "avx2", "avx", "sse4_1"], "uarch": None, "needs": []},
}


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _probe_in_this_process(tier: str, int8: bool = False) -> dict:
    """Child side: edit cpuinfo before XNNPack initializes, then read the table (its f32 entries,
    or with ``int8`` its qc8 / qs8 / qu8 ones)."""
    spec = (INT8_TIERS if int8 else TIERS)[tier]
    cpuinfo = ctypes.CDLL("libcpuinfo.so.0", mode=ctypes.RTLD_GLOBAL)
    cpuinfo.cpuinfo_initialize.restype = ctypes.c_bool
    if not cpuinfo.cpuinfo_initialize():
        raise OverrideRefused("cpuinfo_initialize failed")
    isa = ctypes.c_void_p.in_dll(cpuinfo, "cpuinfo_isa")
    isa_addr = ctypes.addressof(isa)
    flags = cpu_flags()
    # The bytes we are about to clear must mirror /proc/cpuinfo (checks our field offsets).
    for name, off in ISA_OFFSET.items():
        if name in PROC_FLAG:
            got = ctypes.c_uint8.from_address(isa_addr + off).value
            if got != (1 if PROC_FLAG[name] in flags else 0):
                raise OverrideRefused(f"cpuinfo_isa.{name} = {got} disagrees with /proc/cpuinfo")
    for name in spec["clear"]:
        ctypes.c_uint8.from_address(isa_addr + ISA_OFFSET[name]).value = 0
    if spec["uarch"] is not None:
        cpuinfo.cpuinfo_get_core.restype = ctypes.c_void_p
        cpuinfo.cpuinfo_get_core.argtypes = [ctypes.c_uint32]
        core = CpuinfoCore.from_address(cpuinfo.cpuinfo_get_core(0))
        if core.vendor not in (CPUINFO_VENDOR_INTEL, CPUINFO_VENDOR_AMD) or (core.uarch >> 24) != 0:
            raise OverrideRefused(f"cpuinfo_core layout check failed (vendor={core.vendor:#x}, "
                                  f"uarch={core.uarch:#x})")
        core.uarch = spec["uarch"]
    if int8:
        # xa.lib() runs xnn_initialize here; below AVX2 the f16 anchor is absent (see verify_build)
        b = verify_build(known_offset_ok=True)
        check_int8_table(b)
        return {"tier": tier, "families": snapshot_int8(b)}
    snap = snapshot(verify_build())  # xa.lib() runs xnn_initialize here
    snap["tier"] = tier
    return snap


def run_child(module: str, args: list[str], timeout: float) -> tuple[dict | None, str]:
    """``python -m module *args`` with ``CHILD_ENV`` set: the JSON line it printed last, or None
    and why it failed (a crash on an XNNPack assert is a signal here, not in this process)."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, CHILD_ENV: "1"})
    if proc.returncode < 0:
        return None, f"child killed by {signal.Signals(-proc.returncode).name}: {proc.stderr.strip()[-300:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, f"child exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return json.loads(lines[-1]), ""


@functools.lru_cache(maxsize=None)
def probe_tier(tier: str) -> dict:
    """Table of the given ISA tier, read in a child process."""
    if tier not in TIERS:
        raise KeyError(tier)
    return _probe_in_child("--probe", f"probe {tier}", tier)


def _probe_in_child(flag: str, what: str, tier: str) -> dict:
    verify_build()  # refuse here before starting children on an unknown build
    return checked_child(_THIS_MODULE, [flag, tier], what, timeout=120)


def checked_child(module: str, args: list[str], what: str, timeout: float) -> dict:
    """``run_child``'s result; ``OverrideRefused`` naming ``what`` when the child failed or said why not."""
    res, err = run_child(module, args, timeout)
    if res is None:
        raise OverrideRefused(f"{what}: {err}")
    if "error" in res:
        raise OverrideRefused(f"{what}: {res['error']}")
    return res


@functools.lru_cache(maxsize=None)
def probe_tier_int8(tier: str) -> dict:
    """8-bit table entries of the given tier (INT8_TIERS), read in a child process."""
    if tier not in INT8_TIERS:
        raise KeyError(tier)
    return _probe_in_child("--probe-int8", f"probe int8 {tier}", tier)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_THIS_MODULE}")
    parser.add_argument("--probe", choices=list(TIERS))
    parser.add_argument("--probe-int8", choices=list(INT8_TIERS))
    args = parser.parse_args(argv)
    try:
        if args.probe:
            print(json.dumps(_probe_in_this_process(args.probe)))
        elif args.probe_int8:
            print(json.dumps(_probe_in_this_process(args.probe_int8, int8=True)))
    except OverrideRefused as e:
        print(json.dumps({"error": str(e)}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
