"""Prototype: force XNNPack f32 GEMM/IGEMM/DWCONV micro-kernels per operator (x86-64, one build).

XNNPack picks its micro-kernels once, in ``xnn_initialize``, into the hidden global
``struct xnn_parameters xnn_params`` (src/xnnpack/params.h), and every ``xnn_create_*`` copies the
kernel pointers, tile sizes and the params-init result of the current table into the operator.
So rewriting ``xnn_params.f32.gemm`` / ``.f32.dwconv[i]`` just before a ``create`` and restoring it
right after gives that one operator another kernel.  Nothing of this is public API:

* The table is found at run time: after ``xnn_initialize`` the library's .data/.bss is scanned for
  the address of the (accidentally exported) ``xnn_f16_gemm_minmax_ukernel_4x16__avx2_broadcast``,
  which ``init()`` stores in ``xnn_params.f16.gemm.minmax.gemm``; the neighbouring
  ``...gemm1`` slot must hold the other exported symbol (``..._1x16__avx2_broadcast``).
* Non-exported micro-kernels are named through the ``assert()`` strings the build keeps:
  ``__assert_fail`` gets ``__func__``, so each kernel's name is in .rodata and the kernel's code
  loads it with a RIP-relative ``lea``; the FDE (.eh_frame_hdr) around that ``lea`` is the
  function.  Kernels of lower ISA tiers are obtained by clearing ``cpuinfo_isa`` flags (and, for
  the Zen-only 4x16s4 kernels, the uarch of core 0) before ``xnn_initialize`` in a child process
  and reading the table there; addresses travel as offsets from the library base.
* All of it is refused unless the loaded library file is a build listed in ``KNOWN_BUILDS``
  (sha256) and the located table passes consistency checks (kernel names agree with mr/nr and
  tile sizes).  Overrides are applied only in child processes (``run_candidate``), since a wrong
  IGEMM row tile aborts the process on an ``assert``.

CLI:  ``python -m kselect.plugins.xnnpack.ukernels --list`` / ``--demo``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np

from . import xnnpack_api as xa

# --------------------------------------------------------------------------------------------
# Known builds (only these are ever touched)
# --------------------------------------------------------------------------------------------

KNOWN_BUILDS = {
    # Debian bookworm libxnnpack0 0.0~git20220216.ae108ef-2, amd64.
    "40298990e9ad33f768a17ca12cb39a1a5f0617d1d69e685d76c321114d7d2221": {
        "debian_version": "0.0~git20220216.ae108ef-2",
        "upstream_commit": "ae108ef49aa5623b896fc93d4298c49d1750d9ba",
        "machine": "x86_64",
        # Offset of xnn_params from the library load address (in .bss), found by the scan below;
        # kept to cross-check the scan, not used instead of it.
        "params_offset": 0xE89A0,
    },
}

ANCHOR_GEMM = "xnn_f16_gemm_minmax_ukernel_4x16__avx2_broadcast"
ANCHOR_GEMM1 = "xnn_f16_gemm_minmax_ukernel_1x16__avx2_broadcast"
CHILD_ENV = "KSELECT_XNN_UKERNEL_CHILD"

XNN_INIT_FLAG_XNNPACK = 0x1
XNN_INIT_FLAG_F32 = 0x2


class OverrideRefused(RuntimeError):
    """The micro-kernel override cannot be used safely here (unknown build, table not found...)."""


# --------------------------------------------------------------------------------------------
# struct xnn_parameters of src/xnnpack/params.h @ ae108ef, x86-64 (XNN_MAX_UARCH_TYPES = 1,
# XNN_PLATFORM_JIT = 0).  Only offsets matter; function pointers are c_void_p.
# --------------------------------------------------------------------------------------------

P = ctypes.c_void_p
u8, u16, u32 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32


def _S(name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


Allocator = _S("xnn_allocator", [(n, P) for n in ("context", "allocate", "reallocate",
                                                    "deallocate", "aligned_allocate",
                                                    "aligned_deallocate")])
GemmFused = _S("gemm_fused_ukernels", [("gemm", P), ("igemm", P), ("gemm1", P), ("igemm1", P)])
GemmParams = _S("gemm_parameters", [("minmax", GemmFused), ("relu", GemmFused),
                                    ("linear", GemmFused), ("init", P), ("mr", u8), ("nr", u8),
                                    ("log2_kr", u8), ("log2_sr", u8)])
DwconvParams = _S("dwconv_parameters", [("minmax", P), ("linear", P), ("init", P),
                                        ("channel_tile", u8), ("primary_tile", u8),
                                        ("incremental_tile", u8)])
GavgpoolParams = _S("gavgpool_parameters", [("unipass", P), ("multipass", P), ("init", P),
                                            ("update", P), ("row_tile", u16), ("channel_tile", u16)])
VbinFused = _S("vbinary_fused_ukernels", [("op", P), ("opc", P), ("ropc", P)])
VbinParams = _S("vbinary_parameters", [("minmax", VbinFused), ("linear", VbinFused), ("init", P),
                                       ("element_tile", u8)])
AvgpoolParams = _S("avgpool_parameters", [("unipass", P), ("multipass", P), ("init", P),
                                          ("primary_tile", u8), ("incremental_tile", u8),
                                          ("channel_tile", u16)])
PavgpoolParams = _S("pavgpool_parameters", [("unipass", P), ("multipass", P), ("primary_tile", u8),
                                            ("incremental_tile", u8), ("channel_tile", u16)])
MaxpoolParams = _S("maxpool_parameters", [("ukernel", P), ("init", P), ("mr", u8), ("qr", u8)])
ArgmaxpoolParams = _S("argmaxpool_parameters", [("ukernel", P), ("mr", u8), ("qr", u8)])
IbilinearParams = _S("ibilinear_parameters", [("ukernel", P), ("pixel_tile", u8), ("channel_tile", u8)])
VunaryParams = _S("vunary_parameters", [("ukernel", P), ("init", P), ("element_tile", u8)])
ZipParams = _S("zip_parameters", [("x2", P), ("x3", P), ("x4", P), ("xm", P)])
PreluParams = _S("prelu_parameters", [("ukernel", P), ("row_tile", u16), ("channel_tile", u16)])
VmulcaddcParams = _S("vmulcaddc_parameters", [("ukernel", P), ("init", P), ("channel_tile", u8),
                                              ("row_tile", u8)])
RaddParams = _S("raddstoreexpminusmax_parameters", [("ukernel", P), ("init", P), ("element_tile", u8)])
SpmmParams = _S("spmm_parameters", [("ukernel", P), ("mr", u8), ("nr", u8)])
ConvHwc2chwParams = _S("conv_hwc2chw_parameters", [("ukernel", P), ("output_channel_tile", u8),
                                                    ("output_height_tile", u8), ("output_width_tile", u8)])
Dwconv2dChwParams = _S("dwconv2d_chw_parameters", [("ukernel", P), ("output_width_tile", u8),
                                                    ("output_height_tile", u8)])
GavgpoolCwParams = _S("gavgpool_cw_parameters", [("ukernel", P), ("channel_tile", u8)])
IbilinearChwParams = _S("ibilinear_chw_parameters", [("ukernel", P), ("pixel_tile", u8), ("channel_tile", u8)])
D2sParams = _S("depthtospace2d_chw2hwc_parameters", [("ukernel", P), ("pixel_tile", u8), ("channel_tile", u8)])
FillParams = _S("fill_parameters", [("ukernel", P), ("row_tile", u8)])
PadParams = _S("pad_parameters", [("ukernel", P), ("row_tile", u8)])

XnnParameters = _S("xnn_parameters", [
    ("init_flags", u32),
    ("allocator", Allocator),
    ("qc8", _S("qc8", [("gemm", GemmParams), ("dwconv", DwconvParams * 2)])),
    ("qs8", _S("qs8", [("gemm", GemmParams), ("dwconv", DwconvParams * 2),
                       ("gavgpool", GavgpoolParams), ("vadd", VbinParams), ("vmul", VbinParams)])),
    ("qu8", _S("qu8", [("gemm", GemmParams), ("dwconv", DwconvParams * 2),
                       ("avgpool", AvgpoolParams), ("gavgpool", GavgpoolParams),
                       ("vadd", VbinParams), ("vmul", VbinParams)])),
    ("s8", _S("s8", [("clamp", VunaryParams), ("ibilinear", IbilinearParams),
                     ("maxpool", MaxpoolParams)])),
    ("u8", _S("u8", [("clamp", VunaryParams), ("ibilinear", IbilinearParams),
                     ("maxpool", MaxpoolParams), ("lut32norm", P), ("rmax", P)])),
    ("x8", _S("x8", [("lut", P), ("zip", ZipParams)])),
    ("f16", _S("f16", [("gavgpool", GavgpoolParams), ("gemm", GemmParams), ("gemm2", GemmParams),
                       ("dwconv", DwconvParams * 4), ("ibilinear", IbilinearParams),
                       ("maxpool", MaxpoolParams), ("clamp", VunaryParams),
                       ("hswish", VunaryParams), ("lrelu", VunaryParams),
                       ("prelu", PreluParams), ("vadd", VbinParams), ("vmul", VbinParams),
                       ("vmulcaddc", VmulcaddcParams)])),
    ("f32", _S("f32", [("gemm", GemmParams), ("gemm2", GemmParams), ("dwconv", DwconvParams * 4),
                       ("avgpool", AvgpoolParams), ("pavgpool", PavgpoolParams),
                       ("gavgpool", GavgpoolParams), ("maxpool", MaxpoolParams),
                       ("argmaxpool", ArgmaxpoolParams * 3), ("ibilinear", IbilinearParams)]
                      + [(n, VunaryParams) for n in ("abs", "clamp", "elu", "hswish", "lrelu",
                                                     "neg", "relu", "rndne", "rndz", "rndu",
                                                     "rndd", "sigmoid", "sqr", "sqrt")]
                      + [("prelu", PreluParams)]
                      + [(n, VbinParams) for n in ("vadd", "vdiv", "vmax", "vmin", "vmul",
                                                   "vsub", "vsqrdiff")]
                      + [("vmulcaddc", VmulcaddcParams), ("raddstoreexpminusmax", RaddParams),
                         ("rmax", P), ("spmm", SpmmParams), ("spmm2", SpmmParams),
                         ("spmm4", SpmmParams), ("conv_hwc2chw_3x3c3s2", ConvHwc2chwParams),
                         ("dwconv2d_chw_3x3", Dwconv2dChwParams),
                         ("dwconv2d_chw_3x3s2", Dwconv2dChwParams),
                         ("dwconv2d_chw_5x5", Dwconv2dChwParams),
                         ("dwconv2d_chw_5x5s2", Dwconv2dChwParams),
                         ("gavgpool_cw", GavgpoolCwParams), ("ibilinear_chw", IbilinearChwParams)])),
    ("vcvt", _S("vcvt", [(n, VunaryParams) for n in ("f16_to_f32", "f32_to_f16", "f32_to_qs8",
                                                      "f32_to_qu8", "qs8_to_f32", "qu8_to_f32")])),
    ("x32", _S("x32", [("unpool", P), ("zip", ZipParams), ("depthtospace2d_chw2hwc", D2sParams)])),
    ("xx", _S("xx", [("copy", P), ("fill", FillParams), ("pad", PadParams)])),
])

def _layout() -> dict[str, int]:
    f16 = XnnParameters.f16.offset
    f16_t = dict(XnnParameters._fields_)["f16"]
    f32 = XnnParameters.f32.offset
    f32_t = dict(XnnParameters._fields_)["f32"]
    gemm_off = f16 + f16_t.gemm.offset + GemmParams.minmax.offset
    return {
        "sizeof": ctypes.sizeof(XnnParameters),
        "f16_gemm": gemm_off + GemmFused.gemm.offset,
        "f16_gemm1": gemm_off + GemmFused.gemm1.offset,
        "f32_gemm": f32 + f32_t.gemm.offset,
        "f32_gemm2": f32 + f32_t.gemm2.offset,
        "f32_dwconv": f32 + f32_t.dwconv.offset,
    }


LAYOUT = _layout()

# cpuinfo (x86-64 build of /usr/include/cpuinfo.h): byte offsets of the bool fields XNNPack reads.
_CPUINFO_X86_64_ISA_FIELDS = [
    "rdtscp", "rdpid", "sysenter", "msr", "clzero", "clflush", "clflushopt", "mwait", "mwaitx",
    "fxsave", "xsave", "three_d_now", "three_d_now_plus", "prefetch", "prefetchw", "prefetchwt1",
    "sse3", "ssse3", "sse4_1", "sse4_2", "sse4a", "misaligned_sse", "avx", "fma3", "fma4", "xop",
    "f16c", "avx2", "avx512f",
]
ISA_OFFSET = {n: i for i, n in enumerate(_CPUINFO_X86_64_ISA_FIELDS)}
CpuinfoCore = _S("cpuinfo_core", [("processor_start", u32), ("processor_count", u32),
                                   ("core_id", u32), ("cluster", P), ("package", P),
                                   ("vendor", u32), ("uarch", u32), ("cpuid", u32),
                                   ("frequency", ctypes.c_uint64)])
CPUINFO_UARCH_ZEN = 0x00200109
CPUINFO_VENDOR_INTEL, CPUINFO_VENDOR_AMD = 1, 2

# Probes: what is changed before xnn_initialize in a child, and the /proc/cpuinfo flags the
# tier's kernels need (a tier is probed only on a CPU that has them). Clearing a flag the CPU
# lacks changes nothing: on an AVX2-only CPU "default" and "fma3" are the same tier.
TIERS = {
    "default": {"clear": [], "uarch": None, "needs": []},
    "fma3": {"clear": ["avx512f"], "uarch": None, "needs": ["fma3"]},
    "fma3_zen": {"clear": ["avx512f"], "uarch": CPUINFO_UARCH_ZEN, "needs": ["fma3"]},
    "avx": {"clear": ["avx512f", "fma3"], "uarch": None, "needs": ["avx"]},
    "sse": {"clear": ["avx512f", "fma3", "avx"], "uarch": None, "needs": []},
}
_PROC_FLAG = {"avx512f": "avx512f", "fma3": "fma", "avx": "avx", "avx2": "avx2", "sse4_1": "sse4_1", "xop": "xop"}


def _tier_isa(tier: str, flags: set[str]) -> str:
    """The ISA whose f32 GEMM kernels init.c (x86 branch) picks in ``tier`` on a CPU with
    ``flags``: the best of avx512f > fma3 > avx > sse left after the tier's clears."""
    left = [isa for isa in ("avx512f", "fma3", "avx")
            if _PROC_FLAG[isa] in flags and isa not in TIERS[tier]["clear"]]
    return left[0] if left else "sse"


# Which init each kernel family needs (params.h union xnn_f32_minmax_params layouts). Params-init
# functions have no assert string: f32.gemm.init of each tier is named after its kernels' ISA;
# other entries (gemm2, dwconv) are named by matching addresses.
_INIT_FOR_ISA = {"avx512f": "xnn_init_f32_minmax_scalar_params",
                 "fma3": "xnn_init_f32_minmax_avx_params", "avx": "xnn_init_f32_minmax_avx_params",
                 "sse": "xnn_init_f32_minmax_sse_params"}

# 8-bit kernels (qc8, qs8, qu8 GEMM / IGEMM / DWCONV). init.c (x86 branch, ae108ef) picks them
# by a chain of its own: avx512skx (avx512f+bw+dq+vl) > xop > avx2 > avx > sse4.1 > sse2, for
# each family alike. Each tier is read in a child that clears the cpuinfo_isa flags above it (a
# tier is probed only where the CPU has the ISA it needs; clearing a flag the CPU lacks changes
# nothing). "default" is the CPU's own tier.
INT8_FAMILIES = ("qc8", "qs8", "qu8")
INT8_TIERS = {
    "default": {"clear": [], "uarch": None, "needs": []},
    "avx2": {"clear": ["avx512f", "xop"], "uarch": None, "needs": ["avx2"]},
    "avx": {"clear": ["avx512f", "xop", "avx2"], "uarch": None, "needs": ["avx"]},
    "sse41": {"clear": ["avx512f", "xop", "avx2", "avx"], "uarch": None, "needs": ["sse4_1"]},
    "sse2": {"clear": ["avx512f", "xop", "avx2", "avx", "sse4_1"], "uarch": None, "needs": []},
}
# The params-init function init.c pairs with each family's kernels of an ISA (the requantization
# parameters' layout differs per ISA; the init functions are not exported, so they are named by
# the ISA of the kernels they sit next to in each tier's table, and every address must get one
# name and every name one address).
_INT8_INIT_ISA = {"avx512skx": "avx512", "avx2": "avx2", "xop": "sse4", "avx": "sse4", "sse41": "sse4", "sse2": "sse2"}
_INT8_INIT_PREFIX = {"qc8": "xnn_init_qs8_minmax_", "qs8": "xnn_init_qs8_conv_minmax_fp32_",
                     "qu8": "xnn_init_qu8_conv_minmax_fp32_"}


def int8_init_name(family: str, kernel: str) -> str:
    isa = kernel.rsplit("__", 1)[1].split("_")[0]
    suffix = _INT8_INIT_ISA[isa]
    if family == "qu8" and suffix == "sse4":  # qu8 has no sse4 variant: its xop/avx/sse41 kernels take sse2's
        suffix = "sse2"
    return f"{_INT8_INIT_PREFIX[family]}{suffix}_params"

# --------------------------------------------------------------------------------------------
# ELF reading (the library file on disk)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ElfInfo:
    path: str
    sha256: str
    sections: dict[str, tuple[int, int, int]]  # name -> (vaddr, file offset, size)
    dynsym: dict[str, int]                     # defined dynamic symbols -> st_value
    names_by_addr: dict[int, str]              # micro-kernel start (vaddr) -> name (from asserts)

    @functools.cached_property
    def addr_by_name(self) -> dict[str, int]:
        return {v: k for k, v in self.names_by_addr.items()}


def _read_elf(path: str) -> ElfInfo:
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1 or struct.unpack_from("<H", data, 18)[0] != 62:
        raise OverrideRefused(f"{path} is not an x86-64 little-endian ELF64")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = raw[shstrndx][4]

    def cstr(off):
        return data[off:data.index(b"\0", off)].decode()

    secs = {cstr(stroff + s[0]): (s[3], s[4], s[5]) for s in raw}
    by_index = raw
    # .dynsym
    dynsym: dict[str, int] = {}
    for s in by_index:
        if s[1] == 11:  # SHT_DYNSYM
            strtab = by_index[s[6]][4]
            for i in range(s[5] // 24):
                st_name, st_info, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, s[4] + 24 * i)
                if st_shndx != 0 and st_value:
                    dynsym[cstr(strtab + st_name)] = st_value
    names = _assert_names(data, secs)
    return ElfInfo(path, hashlib.sha256(data).hexdigest(), secs, dynsym, names)


def _assert_names(data: bytes, secs) -> dict[int, str]:
    """Micro-kernel name -> function start, via assert() strings, RIP-relative lea and FDEs."""
    ro_va, ro_off, ro_size = secs[".rodata"]
    rod = data[ro_off:ro_off + ro_size]
    strings = {ro_va + m.start(1): m.group(1).decode()
               for m in re.finditer(rb"\0(xnn_[a-z0-9_]*ukernel[a-z0-9_]*)\0", rod)}
    # .eh_frame_hdr: version 1, eh_frame_ptr enc 0x1b, fde_count enc 0x03, table enc 0x3b.
    h_va, h_off, _ = secs[".eh_frame_hdr"]
    ver, _, cnt_enc, tab_enc = data[h_off:h_off + 4]
    if (ver, cnt_enc, tab_enc) != (1, 0x03, 0x3B):
        raise OverrideRefused("unexpected .eh_frame_hdr encoding")
    count, = struct.unpack_from("<I", data, h_off + 8)
    tab = np.frombuffer(data, dtype="<i4", count=2 * count, offset=h_off + 12).reshape(-1, 2).astype(np.int64) + h_va
    ef_va, ef_off, _ = secs[".eh_frame"]
    starts = tab[:, 0]
    ends = np.empty_like(starts)
    for i, fde_va in enumerate(tab[:, 1]):
        fo = int(fde_va) - ef_va + ef_off
        pc_begin, pc_range = struct.unpack_from("<iI", data, fo + 8)  # CIE 'zR', FDE enc pcrel sdata4
        if fde_va + 8 + pc_begin != starts[i]:
            raise OverrideRefused("FDE pc_begin does not match .eh_frame_hdr")
        ends[i] = starts[i] + pc_range
    tx_va, tx_off, tx_size = secs[".text"]
    t = np.frombuffer(data, dtype=np.uint8, count=tx_size, offset=tx_off)
    n = tx_size - 7
    cand = np.nonzero(((t[:n] == 0x48) | (t[:n] == 0x4C)) & (t[1:n + 1] == 0x8D) & ((t[2:n + 2] & 0xC7) == 0x05))[0]
    disp = (t[cand + 3].astype(np.int64) | (t[cand + 4].astype(np.int64) << 8)
            | (t[cand + 5].astype(np.int64) << 16) | (t[cand + 6].astype(np.int64) << 24))
    disp = np.where(disp >= 2**31, disp - 2**32, disp)
    target = tx_va + cand + 7 + disp
    keys = np.fromiter(strings.keys(), dtype=np.int64, count=len(strings))
    hit = np.isin(target, keys)
    out: dict[int, str] = {}
    for pc, tg in zip(tx_va + cand[hit], target[hit]):
        k = int(np.searchsorted(starts, pc, side="right")) - 1
        if k < 0 or pc >= ends[k]:
            continue
        name = strings[int(tg)]
        prev = out.get(int(starts[k]))
        if prev is not None and prev != name:
            raise OverrideRefused(f"function at {int(starts[k]):#x} names both {prev} and {name}")
        out[int(starts[k])] = name
    return out


# --------------------------------------------------------------------------------------------
# The loaded library in this process
# --------------------------------------------------------------------------------------------


def _loaded_path_and_base() -> tuple[str, int]:
    fn = ctypes.cast(xa.lib().xnn.xnn_initialize, ctypes.c_void_p).value
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= fn < hi and len(parts) >= 6:
                path = parts[5]
                break
        else:
            raise OverrideRefused("cannot find the mapping of libXNNPACK in /proc/self/maps")
    return path, fn


@dataclasses.dataclass
class Build:
    elf: ElfInfo
    info: dict
    base: int           # load address
    params_addr: int    # address of xnn_params in this process

    def name_of(self, addr: int | None) -> str | None:
        if not addr:
            return None
        return self.elf.names_by_addr.get(addr - self.base)

    @property
    def table(self) -> "XnnParameters":
        return XnnParameters.from_address(self.params_addr)


_BUILD: Build | None = None


def verify_build(known_offset_ok: bool = False) -> Build:
    """Identify the loaded library and locate ``xnn_params``; raise :class:`OverrideRefused`.
    ``known_offset_ok``: where the f16 anchor is not in the table (a probe child that cleared
    AVX2, so XNNPack left the f16 entries empty), take the offset listed for this build (the
    parent found it by the scan in the very same file); every kernel entry is checked either way."""
    global _BUILD
    if _BUILD is not None:
        return _BUILD
    if platform.machine() != "x86_64":
        raise OverrideRefused(f"only x86_64 builds are described (this is {platform.machine()})")
    ok, why = xa.availability()
    if not ok:
        raise OverrideRefused(why)
    path, fn = _loaded_path_and_base()
    elf = _read_elf(path)
    info = KNOWN_BUILDS.get(elf.sha256)
    if info is None:
        raise OverrideRefused(
            f"{path} (sha256 {elf.sha256[:16]}..., libxnnpack0 {xa.library_version()}) is not a "
            "known build: the xnn_params layout cannot be trusted; use the public API only")
    base = fn - elf.dynsym["xnn_initialize"]
    for sym in (ANCHOR_GEMM, ANCHOR_GEMM1):
        if elf.addr_by_name.get(sym) != elf.dynsym.get(sym):
            raise OverrideRefused(f"assert-name map disagrees with the exported {sym}")
    try:
        params_addr = _locate_params(elf, base)
    except OverrideRefused:
        if not (known_offset_ok and info.get("params_offset") is not None):
            raise
        params_addr = base + info["params_offset"]
    if info.get("params_offset") is not None and params_addr - base != info["params_offset"]:
        raise OverrideRefused(f"xnn_params found at base+{params_addr - base:#x}, expected "
                              f"base+{info['params_offset']:#x} for this build")
    b = Build(elf, info, base, params_addr)
    _check_table(b)
    _BUILD = b
    return b


def _locate_params(elf: ElfInfo, base: int) -> int:
    anchor = base + elf.dynsym[ANCHOR_GEMM]
    anchor1 = base + elf.dynsym[ANCHOR_GEMM1]
    hits = []
    for sec in (".data", ".bss"):
        va, _, size = elf.sections[sec]
        mem = ctypes.string_at(base + va, size)
        arr = np.frombuffer(mem[: size - size % 8], dtype="<u8")
        # The table is 8-byte aligned (it holds pointers); .data/.bss start 32-aligned.
        for i in np.nonzero(arr == anchor)[0]:
            hits.append(base + va + 8 * int(i))
    cands = [h - LAYOUT["f16_gemm"] for h in hits
             if ctypes.c_uint64.from_address(h - LAYOUT["f16_gemm"] + LAYOUT["f16_gemm1"]).value == anchor1]
    if len(cands) != 1:
        raise OverrideRefused(
            f"xnn_params not found: {len(hits)} slot(s) hold {ANCHOR_GEMM}, {len(cands)} fit the "
            "f16.gemm layout (F16 kernels need AVX2; was xnn_initialize called?)")
    addr = cands[0]
    bva, _, bsize = elf.sections[".bss"]
    if not (base + bva <= addr and addr + LAYOUT["sizeof"] <= base + bva + bsize):
        raise OverrideRefused("located xnn_params does not fit in .bss")
    return addr


_GEMM_RE = re.compile(r"xnn_f32_(gemm|igemm)_minmax_ukernel_(\d+)x(\d+)(?:c(\d+))?(?:s(\d+))?__(\w+)")
_DW_RE = re.compile(r"xnn_f32_dwconv_minmax_ukernel_up(\d+)x(\d+)__(\w+)")
_Q_GEMM_RE = re.compile(r"xnn_(qc8|qs8|qu8)_(gemm|igemm)_minmax_fp32_ukernel_(\d+)x(\d+)(?:c(\d+))?(?:s(\d+))?__(\w+)")
_Q_DW_RE = re.compile(r"xnn_(qc8|qs8|qu8)_dwconv_minmax_fp32_ukernel_up(\d+)x(\d+)__(\w+)")


def parse_gemm_name(name: str) -> dict:
    """MRxNR, kr, sr and ISA of an f32 or 8-bit (qc8, qs8, qu8) GEMM / IGEMM kernel name."""
    m = _GEMM_RE.fullmatch(name)
    if m:
        family, (kind, mr, nr, kr, sr, isa) = "f32", m.groups()
    else:
        m = _Q_GEMM_RE.fullmatch(name)
        if not m:
            raise ValueError(name)
        family, kind, mr, nr, kr, sr, isa = m.groups()
    return {"kind": kind, "mr": int(mr), "nr": int(nr), "log2_kr": int(kr or 1).bit_length() - 1,
            "log2_sr": int(sr or 1).bit_length() - 1, "isa": isa, "family": family}


def _check_table(b: Build) -> None:
    t = b.table
    if (t.init_flags & (XNN_INIT_FLAG_XNNPACK | XNN_INIT_FLAG_F32)) != (XNN_INIT_FLAG_XNNPACK | XNN_INIT_FLAG_F32):
        raise OverrideRefused(f"xnn_params.init_flags = {t.init_flags:#x}: not initialized for f32")
    for label, g in (("gemm", t.f32.gemm), ("gemm2", t.f32.gemm2)):
        for slot in ("gemm", "igemm", "gemm1", "igemm1"):
            addr = getattr(g.minmax, slot)
            if not addr:
                continue
            name = b.name_of(addr)
            if name is None:
                raise OverrideRefused(f"f32.{label}.{slot} = {addr:#x} is not a known micro-kernel")
            p = parse_gemm_name(name)
            want_mr = 1 if slot.endswith("1") else g.mr
            if (p["kind"] != slot.rstrip("1") or p["mr"] != want_mr or p["nr"] != g.nr
                    or p["log2_kr"] != g.log2_kr or p["log2_sr"] != g.log2_sr):
                raise OverrideRefused(f"f32.{label}.{slot} = {name} disagrees with mr={g.mr} nr={g.nr}")
    for i, d in enumerate(t.f32.dwconv):
        name = b.name_of(d.minmax)
        m = _DW_RE.fullmatch(name or "")
        if not m or int(m.group(1)) != d.channel_tile or int(m.group(2)) != d.primary_tile:
            raise OverrideRefused(f"f32.dwconv[{i}] = {name} disagrees with tiles "
                                  f"{d.channel_tile}/{d.primary_tile}")


# --------------------------------------------------------------------------------------------
# Table snapshots (base-relative), probes of other ISA tiers in child processes
# --------------------------------------------------------------------------------------------


def _rel(b: Build, addr) -> int | None:
    return None if not addr else int(addr) - b.base


def snapshot(b: Build | None = None) -> dict:
    """The f32 gemm/gemm2/dwconv entries of the live table, addresses as base offsets + names."""
    b = b or verify_build()
    t = b.table

    def gemm(g):
        d = {slot: _rel(b, getattr(g.minmax, slot)) for slot in ("gemm", "igemm", "gemm1", "igemm1")}
        d.update(names={k: b.elf.names_by_addr.get(v) for k, v in d.items() if v is not None},
                 init=_rel(b, g.init), mr=g.mr, nr=g.nr, log2_kr=g.log2_kr, log2_sr=g.log2_sr)
        return d

    return {
        "params_offset": b.params_addr - b.base,
        "gemm": gemm(t.f32.gemm),
        "gemm2": gemm(t.f32.gemm2),
        "dwconv": [{"fn": _rel(b, d.minmax), "name": b.elf.names_by_addr.get(_rel(b, d.minmax) or -1),
                    "init": _rel(b, d.init), "channel_tile": d.channel_tile,
                    "primary_tile": d.primary_tile, "incremental_tile": d.incremental_tile}
                   for d in t.f32.dwconv],
    }


def snapshot_int8(b: Build | None = None) -> dict:
    """The qc8 / qs8 / qu8 gemm and dwconv entries of the live table (base offsets + names)."""
    b = b or verify_build()
    t = b.table
    out = {}
    for family in INT8_FAMILIES:
        entry = getattr(t, family)
        g = entry.gemm
        d = {slot: _rel(b, getattr(g.minmax, slot)) for slot in ("gemm", "igemm", "gemm1", "igemm1")}
        d.update(names={k: b.elf.names_by_addr.get(v) for k, v in d.items() if v is not None},
                 init=_rel(b, g.init), mr=g.mr, nr=g.nr, log2_kr=g.log2_kr, log2_sr=g.log2_sr)
        out[family] = {"gemm": d, "dwconv": [
            {"fn": _rel(b, e.minmax), "name": b.elf.names_by_addr.get(_rel(b, e.minmax) or -1),
             "init": _rel(b, e.init), "channel_tile": e.channel_tile, "primary_tile": e.primary_tile,
             "incremental_tile": e.incremental_tile} for e in entry.dwconv]}
    return out


def check_int8_table(b: Build | None = None) -> None:
    """The live 8-bit entries must name kernels of their family whose tiles match the stored ones."""
    b = b or verify_build()
    t = b.table
    for family, entries in snapshot_int8(b).items():
        g = entries["gemm"]
        for slot in ("gemm", "igemm", "gemm1", "igemm1"):
            if g[slot] is None:
                raise OverrideRefused(f"{family}.gemm.{slot} is empty (was xnn_initialize called?)")
            name = g["names"].get(slot)
            if name is None:
                raise OverrideRefused(f"{family}.gemm.{slot} = base+{g[slot]:#x} is not a known micro-kernel")
            p = parse_gemm_name(name)
            want_mr = 1 if slot.endswith("1") else g["mr"]
            if (p["family"] != family or p["kind"] != slot.rstrip("1") or p["mr"] != want_mr or p["nr"] != g["nr"]
                    or p["log2_kr"] != g["log2_kr"] or p["log2_sr"] != g["log2_sr"]):
                raise OverrideRefused(f"{family}.gemm.{slot} = {name} disagrees with mr={g['mr']} nr={g['nr']} "
                                      f"kr={1 << g['log2_kr']}")
        for i, d in enumerate(entries["dwconv"]):
            m = _Q_DW_RE.fullmatch(d["name"] or "")
            if (not m or m.group(1) != family or int(m.group(2)) != d["channel_tile"]
                    or int(m.group(3)) != d["primary_tile"]):
                raise OverrideRefused(f"{family}.dwconv[{i}] = {d['name']} disagrees with tiles "
                                      f"{d['channel_tile']}/{d['primary_tile']}")
    if not (t.init_flags & XNN_INIT_FLAG_XNNPACK):
        raise OverrideRefused("xnn_params is not initialized")


def _proc_flags() -> set[str]:
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
    flags = _proc_flags()
    # The bytes we are about to clear must mirror /proc/cpuinfo (checks our field offsets).
    for name, off in ISA_OFFSET.items():
        if name in _PROC_FLAG:
            got = ctypes.c_uint8.from_address(isa_addr + off).value
            if got != (1 if _PROC_FLAG[name] in flags else 0):
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


def _child_env() -> dict:
    env = dict(os.environ)
    env[CHILD_ENV] = "1"
    return env


def _run_child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    proc = subprocess.run([sys.executable, "-m", "kselect.plugins.xnnpack.ukernels", *args],
                          capture_output=True, text=True, timeout=timeout, env=_child_env())
    if proc.returncode < 0:
        return None, f"child killed by {signal.Signals(-proc.returncode).name}: {proc.stderr.strip()[-300:]}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, f"child exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return json.loads(lines[-1]), ""


@functools.lru_cache(maxsize=None)
def probe_tier(tier: str) -> dict:
    """Table of the given ISA tier, read in a child process."""
    if tier not in TIERS:
        raise KeyError(tier)
    verify_build()  # refuse here before starting children on an unknown build
    res, err = _run_child(["--probe", tier], timeout=120)
    if res is None:
        raise OverrideRefused(f"probe {tier}: {err}")
    if "error" in res:
        raise OverrideRefused(f"probe {tier}: {res['error']}")
    return res


@functools.lru_cache(maxsize=None)
def probe_tier_int8(tier: str) -> dict:
    """8-bit table entries of the given tier (INT8_TIERS), read in a child process."""
    if tier not in INT8_TIERS:
        raise KeyError(tier)
    verify_build()
    res, err = _run_child(["--probe-int8", tier], timeout=120)
    if res is None:
        raise OverrideRefused(f"probe int8 {tier}: {err}")
    if "error" in res:
        raise OverrideRefused(f"probe int8 {tier}: {res['error']}")
    return res


# --------------------------------------------------------------------------------------------
# Catalog of forceable configurations
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """One setting of ``xnn_params.f32.gemm`` for operators created while it is in place."""
    name: str             # XNNPack name of the main kernel (gemm or igemm)
    kind: str             # "gemm" (1x1 s1 unpadded conv, FC) or "igemm" (other convs)
    fn: int               # base-relative address of the main kernel
    fn1: int | None       # mr=1 kernel used when the operator has a single output row, or None
    init: int             # base-relative address of the params-init function
    init_name: str
    mr: int
    nr: int
    log2_kr: int
    log2_sr: int
    tier: str

    @property
    def id(self) -> str:
        native = parse_gemm_name(self.name)["mr"]
        return self.name + (f"@mr{self.mr}" if self.mr != native else "")


@dataclasses.dataclass(frozen=True)
class DwconvChoice:
    """One setting of the ``xnn_params.f32.dwconv`` entry with this primary tile (kh*kw)."""
    name: str
    fn: int
    init: int
    init_name: str
    channel_tile: int
    primary_tile: int
    tier: str

    @property
    def id(self) -> str:
        return self.name


@functools.lru_cache(maxsize=None)
def catalog(tiers: tuple[str, ...] = tuple(TIERS)) -> dict[str, list]:
    """All f32 GEMM / IGEMM / DWCONV configurations this build can run on this CPU.

    GEMM kernels may run with any mr <= their native MR (the kernel handles short tiles);
    IGEMM kernels only with their native MR (the indirection buffer is laid out for it and the
    kernel asserts ``ks % (MR * sizeof(void*)) == 0``), so mr=1 kernels appear as their own
    IGEMM choice.  Kernels of ISA tiers above the CPU's are never offered (probes only clear
    flags the CPU has).
    """
    gemm: dict[str, GemmChoice] = {}
    igemm: dict[str, GemmChoice] = {}
    dw: dict[str, DwconvChoice] = {}
    flags = _proc_flags()
    snaps = {t: probe_tier(t) for t in tiers
             if all(_PROC_FLAG[f] in flags for f in TIERS[t]["needs"])}
    init_names: dict[int, str] = {}
    for tier, snap in snaps.items():
        name = _INIT_FOR_ISA[_tier_isa(tier, flags)]
        prev = init_names.setdefault(snap["gemm"]["init"], name)
        if prev != name:
            raise OverrideRefused(f"init function at {snap['gemm']['init']:#x} seen as {prev} and {name}")

    def init_name_for(off: int, kernel: str) -> str:
        name = init_names.get(off, f"unnamed_init@{off:#x}")
        isa = kernel.rsplit("__", 1)[1].split("_")[0]
        if _INIT_FOR_ISA.get(isa, name) != name:
            raise OverrideRefused(f"{kernel} is paired with {name} in the table")
        return name

    for tier, snap in snaps.items():
        for key in ("gemm", "gemm2"):
            g = snap[key]
            if not g["gemm"]:
                continue
            init_name = init_name_for(g["init"], g["names"]["gemm"])
            common = dict(init=g["init"], init_name=init_name, nr=g["nr"], log2_kr=g["log2_kr"],
                          log2_sr=g["log2_sr"], tier=tier)
            for mr in range(1, g["mr"] + 1):
                c = GemmChoice(g["names"]["gemm"], "gemm", g["gemm"], g["gemm1"] if mr > 1 else None,
                               mr=mr, **common)
                gemm.setdefault(c.id, c)
            c = GemmChoice(g["names"]["igemm"], "igemm", g["igemm"], g["igemm1"], mr=g["mr"], **common)
            igemm.setdefault(c.id, c)
            if g["gemm1"]:
                c = GemmChoice(g["names"]["gemm1"], "gemm", g["gemm1"], None, mr=1, **common)
                gemm.setdefault(c.id, c)
            if g["igemm1"]:
                c = GemmChoice(g["names"]["igemm1"], "igemm", g["igemm1"], None, mr=1, **common)
                igemm.setdefault(c.id, c)
        for d in snap["dwconv"]:
            if d["fn"]:
                c = DwconvChoice(d["name"], d["fn"], d["init"], init_name_for(d["init"], d["name"]),
                                 d["channel_tile"],
                                 d["primary_tile"], tier)
                dw.setdefault(c.id, c)
    return {"gemm": list(gemm.values()), "igemm": list(igemm.values()), "dwconv": list(dw.values())}


@functools.lru_cache(maxsize=None)
def catalog_int8() -> dict[str, dict[str, list]]:
    """Per 8-bit family, every GEMM / IGEMM / DWCONV kernel this build can run on this CPU:
    {"qc8": {"gemm": [...], "igemm": [...], "dwconv": [...]}, ...}. Each kernel at its native MR
    only (with its mr=1 sibling as XNNPack pairs them), with the params-init function of its own
    table entry."""
    flags = _proc_flags()
    snaps = {t: probe_tier_int8(t) for t, spec in INT8_TIERS.items()
             if all(_PROC_FLAG[f] in flags for f in spec["needs"])}
    by_addr: dict[int, str] = {}
    by_name: dict[str, int] = {}

    def init_name_for(off: int, family: str, kernel: str) -> str:
        name = int8_init_name(family, kernel)
        if by_addr.setdefault(off, name) != name or by_name.setdefault(name, off) != off:
            raise OverrideRefused(f"{kernel} is paired with the init at base+{off:#x}, which is also "
                                  f"{by_addr[off]} / {name} is also at base+{by_name[name]:#x}")
        return name

    out: dict[str, dict[str, list]] = {}
    for family in INT8_FAMILIES:
        gemm: dict[str, GemmChoice] = {}
        igemm: dict[str, GemmChoice] = {}
        dw: dict[str, DwconvChoice] = {}
        for tier, snap in snaps.items():
            g = snap["families"][family]["gemm"]
            init_name = init_name_for(g["init"], family, g["names"]["gemm"])
            common = dict(init=g["init"], init_name=init_name, nr=g["nr"], log2_kr=g["log2_kr"],
                          log2_sr=g["log2_sr"], tier=tier)
            for kind, table in (("gemm", gemm), ("igemm", igemm)):
                c = GemmChoice(g["names"][kind], kind, g[kind], g[kind + "1"], mr=g["mr"], **common)
                table.setdefault(c.id, c)
                c = GemmChoice(g["names"][kind + "1"], kind, g[kind + "1"], None, mr=1, **common)
                table.setdefault(c.id, c)
            for d in snap["families"][family]["dwconv"]:
                c = DwconvChoice(d["name"], d["fn"], d["init"], init_name_for(d["init"], family, d["name"]),
                                 d["channel_tile"], d["primary_tile"], tier)
                dw.setdefault(c.id, c)
        out[family] = {"gemm": list(gemm.values()), "igemm": list(igemm.values()), "dwconv": list(dw.values())}
    return out


# --------------------------------------------------------------------------------------------
# Applying an override (child processes only)
# --------------------------------------------------------------------------------------------


class forced_kernels:
    """Context manager: rewrite ``xnn_params.f32.gemm`` and/or one ``f32.dwconv`` entry, restore
    on exit.  Operators created inside keep the forced kernel for their lifetime.

    Refused outside a child started by :func:`run_candidate` unless ``allow_in_process=True``.
    """

    def __init__(self, gemm: GemmChoice | None = None, dwconv: DwconvChoice | None = None,
                 *, allow_in_process: bool = False, family: str = "f32"):
        if os.environ.get(CHILD_ENV) != "1" and not allow_in_process:
            raise OverrideRefused("micro-kernel overrides run only in a child process "
                                  "(run_candidate), or pass allow_in_process=True")
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


def kernels_in_operator(op: xa.Operator, b: Build | None = None) -> list[str]:
    """Names of the micro-kernels whose addresses an operator holds (scans its allocation)."""
    b = b or verify_build()
    libc = ctypes.CDLL(None)
    libc.malloc_usable_size.restype = ctypes.c_size_t
    libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
    size = libc.malloc_usable_size(op.handle)
    raw = np.frombuffer(ctypes.string_at(op.handle, size - size % 8), dtype="<u8")
    lo = b.base
    rel = raw[(raw > lo) & (raw < lo + (1 << 24))] - np.uint64(lo)
    return sorted({b.elf.names_by_addr[int(r)] for r in rel if int(r) in b.elf.names_by_addr})


# --------------------------------------------------------------------------------------------
# Candidates: create one operator with a forced kernel in a child, check it, time it
# --------------------------------------------------------------------------------------------


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
    res, err = _run_child(["--candidate", json.dumps(payload)], timeout=timeout)
    if res is None:
        return {"ok": False, "error": err}
    return res


def availability() -> tuple[bool, str]:
    """Whether overrides are possible here (verifies the build in this process; no override)."""
    try:
        b = verify_build()
    except OverrideRefused as e:
        return False, str(e)
    return True, (f"xnn_params at base+{b.params_addr - b.base:#x}, {len(b.elf.names_by_addr)} "
                  f"named micro-kernels, build {b.info['debian_version']}")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kselect.plugins.xnnpack.ukernels")
    ap.add_argument("--probe", choices=list(TIERS))
    ap.add_argument("--probe-int8", choices=list(INT8_TIERS))
    ap.add_argument("--candidate")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if a.probe:
        try:
            print(json.dumps(_probe_in_this_process(a.probe)))
        except OverrideRefused as e:
            print(json.dumps({"error": str(e)}))
        return 0
    if a.probe_int8:
        try:
            print(json.dumps(_probe_in_this_process(a.probe_int8, int8=True)))
        except OverrideRefused as e:
            print(json.dumps({"error": str(e)}))
        return 0
    if a.candidate:
        p = json.loads(a.candidate)
        try:
            print(json.dumps(_candidate_in_this_process(p["spec"], p["choice"], p["threads"], p["reps"])))
        except (OverrideRefused, xa.XNNPackError) as e:
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 0
    ok, why = availability()
    print(("OK: " if ok else "REFUSED: ") + why)
    if not ok:
        return 1
    cat = catalog()
    if a.list or not a.demo:
        for kind, items in cat.items():
            print(f"{kind}: {len(items)}")
            for c in items:
                extra = (f"mr={c.mr} nr={c.nr} kr={1 << c.log2_kr} sr={1 << c.log2_sr}"
                         if kind != "dwconv" else f"channel_tile={c.channel_tile} taps={c.primary_tile}")
                print(f"  {c.id:60s} {extra:28s} init={c.init_name} [{c.tier}]")
    if a.demo:
        specs = {
            "conv1x1 64->128 @56": ({"op": "conv", "cin": 64, "cout": 128, "k": 1, "h": 56, "w": 56}, "gemm"),
            "conv3x3 64->64 @56": ({"op": "conv", "cin": 64, "cout": 64, "k": 3, "pad": 1, "h": 56, "w": 56}, "igemm"),
            "dw3x3 x128 @56": ({"op": "conv", "cin": 128, "cout": 128, "k": 3, "pad": 1, "groups": 128,
                                "h": 56, "w": 56}, "dwconv"),
        }
        for label, (spec, kind) in specs.items():
            print(f"== {label} ({a.threads} thread(s))")
            for c in [None] + [c for c in cat[kind] if kind != "dwconv" or c.primary_tile == 9]:
                r = run_candidate(spec, c, threads=a.threads, reps=10)
                name = "(default)" if c is None else c.id
                if "error" in r:
                    print(f"  {name:60s} ERROR {r['error']}")
                else:
                    print(f"  {name:60s} {r['median_us']:9.1f} us  err={r['rel_err']:.1e} "
                          f"ok={r['ok']} held={','.join(k.split('_ukernel_')[-1] for k in r['kernels_in_operator'])}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
