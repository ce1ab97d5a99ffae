"""The f32 GEMM / IGEMM micro-kernel choice on Debian 13's arm64 build (``libXNNPACK.so.0.20241108``,
XNNPack 0.0~git20241108.4ea82e5, the 2024 API), known builds only.

In this XNNPack the kernels live in per-kind static configs (src/configs/gemm-config.c): the
first f32 convolution or fully connected operator initialises ``f32_gemm_config`` once, choosing
by the micro-architecture cpuinfo reports for core 0 (cortex-a53 / a55 / a73 / a75 assembly,
exynos s4 kernels, ...), and every ``xnn_create_*`` copies its kernel cases (one per row tile
``mr``, three uarch slots each), its tiles and its packing and params-init functions into the
operator. The library is stripped and keeps no assert strings, so:

* the config is found at run time: a tiny f32 convolution is created and the config in .bss/.data
  is the one whose IGEMM cases the operator holds (checked: tiles, pointers into .text, empty
  relu / linear entries, at the offset listed for the build);
* each uarch branch of ``init_f32_gemm_config`` is read in a child process that sets core 0's
  uarch in libcpuinfo before the first operator exists (``PROBES``); a kernel is named by the
  branch and row tile XNNPack's source puts it at, and every name must get one address and every
  address one name across all branches;
* each candidate is verified against a float64 numpy reference in a child before it is offered;
* ``forced_config`` rewrites the config around one operator's creation and restores it.

Depthwise convolutions have one kernel per tap count on arm64 (no uarch switch): no choice there.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np

from kselect.core.paths import cache_root
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.ukernel_catalog import GemmChoice, save_catalog
from kselect.plugins.xnnpack.ukernel_probes import CHILD_ENV, CpuinfoCore, checked_child, run_child
from kselect.plugins.xnnpack.ukernel_table import OverrideRefused, loaded_path_and_base, sections_and_dynsym

_THIS_MODULE = "kselect.plugins.xnnpack.ukernel_arm64"

KNOWN_BUILDS = {
    # Debian trixie libxnnpack0.20241108 0.0~git20241108.4ea82e5-2, arm64.
    "7c7e201c106febbfae1a7740c664745f47a88cdaed71b4e4e3e6cd4f1f731777": {
        "debian_version": "0.0~git20241108.4ea82e5-2",
        "upstream_commit": "4ea82e595b36106653175dcb04b2aa532660d0d8",
        "machine": "aarch64",
        # f32_gemm_config from the library base, found by the scan below; a cross-check only
        "config_offset": 0x141E10,
    },
}

# -- struct xnn_gemm_config (src/xnnpack/config-types.h, microfnptr.h @ 4ea82e5) on aarch64 Linux:
# XNN_MAX_UARCH_TYPES = 3, XNN_MAX_MR = 32 --------------------------------------------------------
UARCH_SLOTS = 3
MAX_MR = 32


class HmpKernel(ctypes.Structure):  # struct xnn_hmp_gemm_ukernel: one function per uarch slot
    _fields_ = [("function", ctypes.c_void_p * UARCH_SLOTS)]


class FusedKernels(ctypes.Structure):  # struct gemm_fused_ukernels: the case of row tile mr at [mr - 1]
    _fields_ = [("gemm", HmpKernel * MAX_MR), ("igemm", HmpKernel * MAX_MR)]


POINTER_FIELDS = ("init", "pack_weights_and_biases", "packed_stride_weights_and_biases", "pack_gemm_gio",
                  "pack_gemm_goi", "pack_gemm_goi_bl", "pack_igemm_goki", "pack_igemm_kgo", "pack_deconv_goki")
BYTE_FIELDS = ("mr", "nr", "log2_kr", "log2_sr", "planes", "mr_packed")


class GemmConfig(ctypes.Structure):
    _fields_ = ([("minmax", FusedKernels), ("relu", FusedKernels), ("linear", FusedKernels)]
                + [(name, ctypes.c_void_p) for name in POINTER_FIELDS]
                + [(name, ctypes.c_uint8) for name in BYTE_FIELDS])


CONFIG_SIZE = ctypes.sizeof(GemmConfig)

# -- the uarch branches of init_f32_gemm_config (XNN_ARCH_ARM64, assembly on, M specialization on) --
# probe -> (cpuinfo uarch set for core 0, {kind: {mr: kernel}}, mr, nr, log2_sr); the kernel names
# are XNNPack's without the "xnn_f32_{kind}_minmax_ukernel_" prefix.
_A64 = "__asm_aarch64_neonfma_"


def _both(cases: dict[int, str]) -> dict[str, dict[int, str]]:
    return {"gemm": dict(cases), "igemm": dict(cases)}


PROBES = {
    "cortex_a72": (0x00300372, _both({1: "1x8" + _A64 + "cortex_a75_prfm",
                                      4: "4x8" + _A64 + "cortex_a75_prfm"}), 4, 8, 0),
    "neoverse_n1": (0x00300400, _both({1: "1x8" + _A64 + "cortex_a75_prfm", 4: "4x8" + _A64 + "cortex_a75_prfm",
                                       6: "6x8" + _A64 + "cortex_a75_prfm"}), 6, 8, 0),
    "exynos_m1": (0x00600100, _both({1: "1x8s4__neonfma", 4: "4x8s4__neonfma", 6: "6x8s4__neonfma"}), 6, 8, 2),
    "cortex_a53": (0x00300353, _both({1: "1x8" + _A64 + "cortex_a53_prfm", 4: "4x8" + _A64 + "cortex_a53_prfm",
                                      6: "6x8" + _A64 + "cortex_a53_prfm"}), 6, 8, 0),
    "cortex_a55r0": (0x00300354, _both({1: "1x8" + _A64 + "cortex_a53", 4: "4x8" + _A64 + "cortex_a53",
                                        6: "6x8" + _A64 + "cortex_a53"}), 6, 8, 0),
    "cortex_a55": (0x00300355, _both({1: "1x8" + _A64 + "cortex_a53", 4: "4x8" + _A64 + "cortex_a55",
                                      6: "6x8" + _A64 + "cortex_a55"}), 6, 8, 0),
    "cortex_a73": (0x00300373, _both({1: "1x8" + _A64 + "cortex_a75_prfm", 6: "6x8" + _A64 + "cortex_a73"}), 6, 8, 0),
    "cortex_a77": (0x00300377, _both({1: "1x8" + _A64 + "cortex_a75", 4: "4x8" + _A64 + "cortex_a75"}), 4, 8, 0),
    "cortex_x3": (0x00300503, {"gemm": {1: "1x8" + _A64 + "ld128_acc2", 6: "6x8__aarch64_neonfma_lane_ld128"},
                               "igemm": {1: "1x8" + _A64 + "ld64", 6: "6x8__aarch64_neonfma_lane_ld128"}}, 6, 8, 0),
    "cortex_a78": (0x00300378, {"gemm": {1: "1x8" + _A64 + "ld128_acc4", 4: "4x8" + _A64 + "ld128",
                                         6: "6x8" + _A64 + "ld128"},
                                "igemm": {1: "1x8" + _A64 + "ld64", 4: "4x8" + _A64 + "ld128",
                                          6: "6x8" + _A64 + "ld128"}}, 6, 8, 0),
}


def kernel_name(kind: str, short: str) -> str:
    return f"xnn_f32_{kind}_minmax_ukernel_{short}"


# -- the loaded library --------------------------------------------------------------------------
@dataclasses.dataclass
class Build:
    path: str
    sha256: str
    info: dict
    base: int
    sections: dict[str, tuple[int, int, int]]
    config_addr: int  # f32_gemm_config in this process

    @property
    def config(self) -> GemmConfig:
        return GemmConfig.from_address(self.config_addr)

    def in_text(self, addr: int | None) -> bool:
        va, _, size = self.sections[".text"]
        return bool(addr) and self.base + va <= addr < self.base + va + size

    def rel(self, addr: int | None) -> int | None:
        return None if not addr else int(addr) - self.base


_BUILD: Build | None = None


def verify_build() -> Build:
    """Identify the loaded library and locate ``f32_gemm_config``; raise :class:`OverrideRefused`."""
    global _BUILD
    if _BUILD is not None:
        return _BUILD
    ok, why = xa.availability()
    if not ok:
        raise OverrideRefused(why)
    if xa.api() != xa.API_2024:
        raise OverrideRefused("not the 2024 API")
    if platform.machine() != "aarch64":
        raise OverrideRefused(f"only the aarch64 build of the 2024 API is described (this is {platform.machine()})")
    path, fn = loaded_path_and_base()
    data = Path(path).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    info = KNOWN_BUILDS.get(sha)
    if info is None:
        raise OverrideRefused(
            f"{path} (sha256 {sha[:16]}..., {xa.installed_package()} {xa.library_version()}) is not a known build: "
            "the f32 GEMM config's layout cannot be trusted; use the public API only")
    sections, dynsym = sections_and_dynsym(data)
    base = fn - dynsym["xnn_initialize"]
    b = Build(path, sha, info, base, sections, 0)
    b.config_addr = _locate_config(b)
    if info["config_offset"] is not None and b.config_addr - base != info["config_offset"]:
        raise OverrideRefused(f"f32_gemm_config found at base+{b.config_addr - base:#x}, expected "
                              f"base+{info['config_offset']:#x} for this build")
    _BUILD = b
    return b


def _operator_bytes(op: xa.Operator) -> bytes:
    libc = ctypes.CDLL(None)
    libc.malloc_usable_size.restype = ctypes.c_size_t
    libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
    size = libc.malloc_usable_size(op.handle)
    return ctypes.string_at(op.handle, size - size % 8)


def _tiny_conv() -> xa.Operator:
    """A 3x3 f32 convolution (an IGEMM operator): its creation initialises f32_gemm_config."""
    w = np.ones((16, 4, 3, 3), np.float32)
    return xa.Convolution2DNHWC(w, np.zeros(16, np.float32), padding=1)


def _locate_config(b: Build) -> int:
    op = _tiny_conv()
    try:
        held = _operator_bytes(op)
    finally:
        op.close()
    words = set(int(v) for v in np.frombuffer(held, dtype="<u8") if b.in_text(int(v)))
    found = []
    for sec in (".data", ".bss"):
        va, _, size = b.sections[sec]
        lo, hi = b.base + va, b.base + va + size
        arr = np.frombuffer(ctypes.string_at(lo, size - size % 8), dtype="<u8")
        for j in np.nonzero(np.isin(arr, np.fromiter(words, dtype=np.uint64, count=len(words))))[0]:
            slot = lo + 8 * int(j)
            for index in range(MAX_MR):  # the slot as igemm[index].function[0]
                start = slot - FusedKernels.igemm.offset - index * ctypes.sizeof(HmpKernel)
                if lo <= start and start + CONFIG_SIZE <= hi and _plausible(b, start, held):
                    found.append(start)
    found = sorted(set(found))
    if len(found) != 1:
        raise OverrideRefused(f"f32_gemm_config not found: {len(found)} place(s) fit its layout and the "
                              "IGEMM cases a new f32 convolution holds")
    return found[0]


def _plausible(b: Build, start: int, operator_bytes: bytes) -> bool:
    c = GemmConfig.from_address(start)
    if not (1 <= c.mr <= MAX_MR and c.nr == 8 and c.log2_kr == 0 and c.log2_sr in (0, 2)):
        return False
    if not all(b.in_text(getattr(c, name)) for name in ("init", "pack_gemm_goi", "pack_gemm_gio")):
        return False
    main = (c.minmax.gemm[c.mr - 1].function[0], c.minmax.igemm[c.mr - 1].function[0])
    if not all(b.in_text(fn) for fn in main):
        return False
    empty = ctypes.string_at(start + GemmConfig.relu.offset, 2 * ctypes.sizeof(FusedKernels))
    if empty.count(0) != len(empty):
        return False
    cases = ctypes.string_at(start + GemmConfig.minmax.offset + FusedKernels.igemm.offset,
                             c.mr * ctypes.sizeof(HmpKernel))
    return cases in operator_bytes


def snapshot(b: Build | None = None) -> dict:
    """The live f32 GEMM config: kernel cases by row tile (slot 0, base offsets), other fields."""
    b = b or verify_build()
    c = b.config
    cases = {}
    for kind in ("gemm", "igemm"):
        row = {}
        for index in range(MAX_MR):
            slots = list(getattr(c.minmax, kind)[index].function)
            if not slots[0]:
                if any(slots):
                    raise OverrideRefused(f"{kind}[{index}] has uarch slots without a default kernel")
                continue
            if not all(b.in_text(fn) for fn in slots):
                raise OverrideRefused(f"{kind}[{index}] holds a pointer outside the library's code")
            row[index + 1] = b.rel(slots[0])
        cases[kind] = row
    return {"config_offset": b.config_addr - b.base, "cases": cases,
            "pointers": {name: b.rel(getattr(c, name)) for name in POINTER_FIELDS},
            "bytes": {name: int(getattr(c, name)) for name in BYTE_FIELDS}}


# -- probes of every uarch branch (children) -------------------------------------------------------
def _probe_in_this_process(probe: str) -> dict:
    uarch = PROBES[probe][0]
    cpuinfo = ctypes.CDLL("libcpuinfo.so.0", mode=ctypes.RTLD_GLOBAL)
    cpuinfo.cpuinfo_initialize.restype = ctypes.c_bool
    if not cpuinfo.cpuinfo_initialize():
        raise OverrideRefused("cpuinfo_initialize failed")
    cpuinfo.cpuinfo_get_core.restype = ctypes.c_void_p
    cpuinfo.cpuinfo_get_core.argtypes = [ctypes.c_uint32]
    core = CpuinfoCore.from_address(cpuinfo.cpuinfo_get_core(0))
    if core.processor_start != 0 or core.core_id != 0 or core.processor_count < 1 or (core.uarch >> 24) != 0:
        raise OverrideRefused(f"cpuinfo_core layout check failed (processor_start={core.processor_start}, "
                              f"core_id={core.core_id}, uarch={core.uarch:#x})")
    core.uarch = uarch
    snap = snapshot(verify_build())  # the first f32 operator (in verify_build) runs init_f32_gemm_config
    snap["probe"] = probe
    return snap


@functools.lru_cache(maxsize=None)
def probe(name: str) -> dict:
    verify_build()  # refuse here before starting children on an unknown build
    return checked_child(_THIS_MODULE, ["--probe", name], f"probe {name}", timeout=300)


@dataclasses.dataclass(frozen=True)
class ConfigChoice(GemmChoice):
    """A GemmChoice for this build: also the config's packing functions and byte fields of the
    branch it was read from (the s4 kernels pack their weights differently)."""
    pointers: tuple = ()   # (field, base offset or None) for POINTER_FIELDS but init
    bytes_: tuple = ()     # (field, value) for planes, mr_packed


def _name_cases(snaps: dict[str, dict]) -> dict[int, str]:
    """Base offset -> kernel name, from where each branch's source puts each kernel; every branch's
    cases and tiles must be the source's, every name one address and every address one name."""
    by_offset: dict[int, str] = {}
    by_name: dict[str, int] = {}
    for probe_name, snap in snaps.items():
        _, expected, mr, nr, log2_sr = PROBES[probe_name]
        got = snap["bytes"]
        if (got["mr"], got["nr"], got["log2_sr"]) != (mr, nr, log2_sr):
            raise OverrideRefused(f"probe {probe_name}: mr={got['mr']} nr={got['nr']} log2_sr={got['log2_sr']}, "
                                  f"the source says {mr}x{nr} log2_sr={log2_sr}")
        for kind in ("gemm", "igemm"):
            cases = {int(k): v for k, v in snap["cases"][kind].items()}
            if sorted(cases) != sorted(expected[kind]):
                raise OverrideRefused(f"probe {probe_name}: {kind} cases at mr {sorted(cases)}, the source says "
                                      f"{sorted(expected[kind])}")
            for row_tile, offset in cases.items():
                name = kernel_name(kind, expected[kind][row_tile])
                if by_offset.setdefault(offset, name) != name or by_name.setdefault(name, offset) != offset:
                    raise OverrideRefused(f"{name} at base+{offset:#x} is also {by_offset[offset]} / at "
                                          f"base+{by_name[name]:#x}")
    return by_offset


def _choices(snaps: dict[str, dict], names: dict[int, str]) -> dict[str, list[ConfigChoice]]:
    """Every kernel of every branch as a choice: the kernel at its own row tile, with the branch's
    mr=1 kernel as its single-row sibling (XNNPack's heuristic picks among the cases present)."""
    out: dict[str, dict[str, ConfigChoice]] = {"gemm": {}, "igemm": {}}
    for probe_name, snap in snaps.items():
        fields = snap["bytes"]
        pointers = tuple((name, snap["pointers"][name]) for name in POINTER_FIELDS if name != "init")
        extra = (("planes", fields["planes"]), ("mr_packed", fields["mr_packed"]))
        for kind in ("gemm", "igemm"):
            cases = {int(k): v for k, v in snap["cases"][kind].items()}
            for row_tile in sorted(cases, reverse=True):
                name = names[cases[row_tile]]
                choice = ConfigChoice(name=name, kind=kind, fn=cases[row_tile],
                                      fn1=cases.get(1) if row_tile > 1 else None,
                                      init=snap["pointers"]["init"], init_name="xnn_init_f32_minmax_scalar_params",
                                      mr=row_tile, nr=fields["nr"], log2_kr=fields["log2_kr"],
                                      log2_sr=fields["log2_sr"], tier=probe_name, pointers=pointers, bytes_=extra)
                out[kind].setdefault(choice.id, choice)
    return {kind: list(choices.values()) for kind, choices in out.items()}


# -- forcing ---------------------------------------------------------------------------------------
class forced_config:
    """Context manager: put ``choice`` in f32_gemm_config (its kernel at its row tile in every uarch
    slot, its mr=1 sibling, the branch's packing functions and tiles; the other kind's cases empty)
    and restore the config on exit. Operators created inside keep it for their lifetime. Refused
    outside a child of ``ukernel_probes.run_child`` unless ``allow_in_process``."""

    def __init__(self, choice: ConfigChoice, *, allow_in_process: bool = False):
        if os.environ.get(CHILD_ENV) != "1" and not allow_in_process:
            raise OverrideRefused("micro-kernel overrides run only in a child process "
                                  "(ukernel_probes.run_child), or pass allow_in_process=True")
        self.choice = choice
        self._saved: bytes | None = None

    def __enter__(self):
        b = verify_build()
        ch = self.choice
        self._saved = ctypes.string_at(b.config_addr, CONFIG_SIZE)
        c = b.config
        ctypes.memset(ctypes.addressof(c.minmax), 0, ctypes.sizeof(FusedKernels))
        cases = getattr(c.minmax, ch.kind)
        for index, fn in ((ch.mr - 1, ch.fn), (0, ch.fn1)):
            if fn is not None:
                for slot in range(UARCH_SLOTS):
                    cases[index].function[slot] = b.base + fn
        c.init = b.base + ch.init
        for name, offset in ch.pointers:
            setattr(c, name, None if offset is None else b.base + offset)
        for name, value in ch.bytes_:
            setattr(c, name, value)
        c.mr, c.nr, c.log2_kr, c.log2_sr = ch.mr, ch.nr, ch.log2_kr, ch.log2_sr
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            ctypes.memmove(verify_build().config_addr, self._saved, CONFIG_SIZE)
            self._saved = None


def table_regions() -> list[tuple[int, int]]:
    """What an override may rewrite (it must be XNNPack's own whenever none is applied)."""
    return [(verify_build().config_addr, CONFIG_SIZE)]


def kernels_in_operator(op: xa.Operator) -> list[str]:
    """Names of the catalog's kernels whose addresses an operator holds."""
    b = verify_build()
    names = {b.base + c.fn: c.name for choices in catalog().values() for c in choices}
    words = np.frombuffer(_operator_bytes(op), dtype="<u8")
    return sorted({names[int(v)] for v in words if int(v) in names})


# -- checking a candidate against numpy (in a child) ---------------------------------------------
CHECK_CASES = {  # an IGEMM conv and a GEMM fc with row counts that are not multiples of any tile
    "igemm": {"cin": 5, "cout": 19, "k": 3, "h": 7, "w": 9},
    "gemm": {"rows": 13, "cin": 37, "cout": 21},
}


def _check_in_this_process(choice: ConfigChoice) -> dict:
    rng = np.random.default_rng(0)
    case = CHECK_CASES[choice.kind]
    b = verify_build()
    if choice.kind == "igemm":
        w = rng.standard_normal((case["cout"], case["cin"], case["k"], case["k"])).astype(np.float32)
        bias = rng.standard_normal(case["cout"]).astype(np.float32)
        h, wd = case["h"], case["w"]
        x = rng.standard_normal((1, h, wd, case["cin"])).astype(np.float32)
        with forced_config(choice):
            op = xa.Convolution2DNHWC(w, bias, padding=1)
        xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
        ref = sum(xp[:, ky:ky + h, kx:kx + wd, :] @ w[:, :, ky, kx].T.astype(np.float64)
                  for ky in range(3) for kx in range(3)) + bias
    else:
        w = rng.standard_normal((case["cout"], case["cin"])).astype(np.float32)
        bias = rng.standard_normal(case["cout"]).astype(np.float32)
        x = rng.standard_normal((case["rows"], case["cin"])).astype(np.float32)
        with forced_config(choice):
            op = xa.FullyConnected(w, bias)
        ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    try:
        raw = _operator_bytes(op)
        held = base_offsets_in(raw, b)
        out = op.run(x)
    finally:
        op.close()
    err = float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))
    return {"ok": err < 1e-4 and choice.fn in held, "rel_err": err, "holds_kernel": choice.fn in held}


def base_offsets_in(raw: bytes, b: Build) -> set[int]:
    return {int(v) - b.base for v in np.frombuffer(raw, dtype="<u8") if b.in_text(int(v))}


def _verify_in_child(choices: list[ConfigChoice]) -> dict[str, dict]:
    payload = json.dumps([dataclasses.asdict(c) for c in choices])
    res, err = run_child(_THIS_MODULE, ["--check", payload], timeout=600)
    if res is None or "error" in res:
        err = err or res["error"]
        return {c.id: {"ok": False, "error": err} for c in choices}
    return res


# -- the catalog -----------------------------------------------------------------------------------
def _choice_from(fields: dict) -> ConfigChoice:
    fields = dict(fields)
    fields["pointers"] = tuple(tuple(p) for p in fields["pointers"])
    fields["bytes_"] = tuple(tuple(p) for p in fields["bytes_"])
    return ConfigChoice(**fields)


def _cache_file(b: Build) -> Path:
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([b.sha256, source]).encode()).hexdigest()
    return cache_root() / "xnnpack" / f"catalog-arm64-{key[:16]}.json"


@functools.lru_cache(maxsize=None)
def catalog() -> dict[str, list]:
    """Every verified f32 GEMM / IGEMM choice of this build (cached on disk per build and per the
    source of this module); {"gemm": [...], "igemm": [...], "dwconv": []}."""
    b = verify_build()
    path = _cache_file(b)
    try:
        data = json.loads(path.read_text())
        return {"gemm": [_choice_from(c) for c in data["gemm"]], "igemm": [_choice_from(c) for c in data["igemm"]],
                "dwconv": []}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    snaps = {name: probe(name) for name in PROBES}
    names = _name_cases(snaps)
    own = snapshot(b)
    for kind in ("gemm", "igemm"):
        for offset in own["cases"][kind].values():
            if offset not in names:
                raise OverrideRefused(f"this process's {kind} kernel at base+{offset:#x} is not one of the "
                                      "probed branches'")
    choices = _choices(snaps, names)
    results = _verify_in_child(choices["gemm"] + choices["igemm"])
    failed = {cid: r for cid, r in results.items() if not r.get("ok")}
    if failed:
        raise OverrideRefused(f"{len(failed)} candidate(s) failed the check against numpy: "
                              + "; ".join(f"{cid}: {r}" for cid, r in list(failed.items())[:3]))
    cat = {"gemm": choices["gemm"], "igemm": choices["igemm"], "dwconv": []}
    save_catalog(path, cat)
    return cat


@functools.lru_cache(maxsize=None)
def table_defaults() -> dict:
    """XNNPack's own config in this process: {"gemm": {"cases": {mr: name}, "mr", "nr"}, "igemm": ...}."""
    own = snapshot(verify_build())
    names = {c.fn: c.name for choices in catalog().values() for c in choices}
    out = {}
    for kind in ("gemm", "igemm"):
        out[kind] = {"cases": {int(mr): names[off] for mr, off in own["cases"][kind].items()},
                     "mr": own["bytes"]["mr"], "nr": own["bytes"]["nr"]}
    return out


def heuristic_mr(rows: int, max_mr: int, nr: int, available: set[int]) -> int:
    """The row tile XNNPack's reshape runs (xnn_get_heuristic_mr_gemm / _igemm, operator-utils.c)."""
    if rows <= max_mr and rows in available:
        return rows
    best, best_cost = max_mr, math.inf
    for mr in range(1, max_mr + 1):
        if mr in available:
            cost = -(-rows // mr) * (3 * (mr + nr) + mr * nr)
            if cost <= best_cost:
                best, best_cost = mr, cost
    return best


def runs(choice: ConfigChoice, rows: int) -> str:
    """The kernel an operator created with ``choice`` runs for ``rows`` rows."""
    available = {choice.mr} | ({1} if choice.fn1 is not None else set())
    if heuristic_mr(rows, choice.mr, choice.nr, available) == choice.mr:
        return choice.name
    return next(c.name for c in catalog()[choice.kind] if c.fn == choice.fn1)


def availability() -> tuple[bool, str]:
    try:
        b = verify_build()
    except OverrideRefused as e:
        return False, str(e)
    return True, f"f32_gemm_config at base+{b.config_addr - b.base:#x}, build {b.info['debian_version']}"


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_THIS_MODULE}")
    parser.add_argument("--probe", choices=list(PROBES))
    parser.add_argument("--check", help="JSON list of choices to check against numpy")
    args = parser.parse_args(argv)
    try:
        if args.probe:
            print(json.dumps(_probe_in_this_process(args.probe)))
        elif args.check:
            results = {}
            for fields in json.loads(args.check):
                choice = _choice_from(fields)
                results[choice.id] = _check_in_this_process(choice)
            print(json.dumps(results))
    except (OverrideRefused, xa.XNNPackError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
