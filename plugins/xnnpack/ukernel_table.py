"""Where XNNPack's micro-kernel table is, and what it holds (x86-64, known builds only).

XNNPack picks its micro-kernels once, in ``xnn_initialize``, into the hidden global
``struct xnn_parameters xnn_params`` (src/xnnpack/params.h), and every ``xnn_create_*`` copies the
kernel pointers, tile sizes and the params-init result of the current table into the operator.
Nothing of this is public API, so:

* Non-exported micro-kernels are named through the ``assert()`` strings the build keeps (read
  from the library file here): ``__assert_fail`` gets ``__func__``, so each kernel's name is in
  .rodata and the kernel's code loads it with a RIP-relative ``lea``; the FDE (.eh_frame_hdr)
  around that ``lea`` is the function.
* The table is found at run time: after ``xnn_initialize`` the library's .data/.bss is scanned
  for the address of the (accidentally exported) ``xnn_f16_gemm_minmax_ukernel_4x16__avx2_broadcast``,
  which ``init()`` stores in ``xnn_params.f16.gemm.minmax.gemm``; the neighbouring ``...gemm1``
  slot must hold the other exported symbol (``..._1x16__avx2_broadcast``).
* All of it is refused (``OverrideRefused``) unless the loaded library file is a build listed in
  ``KNOWN_BUILDS`` (sha256) and the located table passes consistency checks (kernel names agree
  with mr/nr and tile sizes).

The kernels of other ISA tiers are read by ukernel_probes.py, offered by ukernel_catalog.py and
put in the table for one operator's creation by ukernel_forcing.py.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import platform
import re
import struct

import numpy as np

from kselect.plugins.xnnpack import xnnpack_api as xa

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
INT8_FAMILIES = ("qc8", "qs8", "qu8")  # the 8-bit entries of the table with gemm / dwconv kernels


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
    secs, dynsym = sections_and_dynsym(data)
    names = _assert_names(data, secs)
    return ElfInfo(path, hashlib.sha256(data).hexdigest(), secs, dynsym, names)


def sections_and_dynsym(data: bytes) -> tuple[dict[str, tuple[int, int, int]], dict[str, int]]:
    """An ELF64 little-endian file's sections (name -> (vaddr, file offset, size)) and its defined
    dynamic symbols (name -> st_value)."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = raw[shstrndx][4]

    def cstr(off):
        return data[off:data.index(b"\0", off)].decode()

    secs = {cstr(stroff + s[0]): (s[3], s[4], s[5]) for s in raw}
    dynsym: dict[str, int] = {}
    for s in raw:
        if s[1] == 11:  # SHT_DYNSYM
            strtab = raw[s[6]][4]
            for i in range(s[5] // 24):
                st_name, st_info, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, s[4] + 24 * i)
                if st_shndx != 0 and st_value:
                    dynsym[cstr(strtab + st_name)] = st_value
    return secs, dynsym


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


def loaded_path_and_base() -> tuple[str, int]:
    """(path of the loaded libXNNPACK file, address of its xnn_initialize)."""
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
    path, fn = loaded_path_and_base()
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
# Table snapshots (base-relative addresses and kernel names)
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


def availability() -> tuple[bool, str]:
    """Whether overrides are possible here (verifies the build in this process; no override)."""
    try:
        b = verify_build()
    except OverrideRefused as e:
        return False, str(e)
    return True, (f"xnn_params at base+{b.params_addr - b.base:#x}, {len(b.elf.names_by_addr)} "
                  f"named micro-kernels, build {b.info['debian_version']}")
