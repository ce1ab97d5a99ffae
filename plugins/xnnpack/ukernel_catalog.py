"""Every micro-kernel configuration the override can put in XNNPack's table on this CPU: the
kernels of each ISA tier's table (ukernel_probes.py), each paired with the params-init function
of its own table entry. kernels.py caches the catalogs on disk and names their entries in configs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

from kselect.plugins.xnnpack.ukernel_probes import INT8_TIERS, PROC_FLAG, TIERS, cpu_flags, probe_tier, probe_tier_int8
from kselect.plugins.xnnpack.ukernel_table import INT8_FAMILIES, OverrideRefused, parse_gemm_name


def tier_isa(tier: str, flags: set[str]) -> str:
    """The ISA whose f32 GEMM kernels init.c (x86 branch) picks in ``tier`` on a CPU with
    ``flags``: the best of avx512f > fma3 > avx > sse left after the tier's clears."""
    left = [isa for isa in ("avx512f", "fma3", "avx")
            if PROC_FLAG[isa] in flags and isa not in TIERS[tier]["clear"]]
    return left[0] if left else "sse"


# Which init each kernel family needs (params.h union xnn_f32_minmax_params layouts). Params-init
# functions have no assert string: f32.gemm.init of each tier is named after its kernels' ISA;
# other entries (gemm2, dwconv) are named by matching addresses.
_INIT_FOR_ISA = {"avx512f": "xnn_init_f32_minmax_scalar_params",
                 "fma3": "xnn_init_f32_minmax_avx_params", "avx": "xnn_init_f32_minmax_avx_params",
                 "sse": "xnn_init_f32_minmax_sse_params"}

# The params-init function init.c pairs with each family's kernels of an ISA (the requantization
# parameters' layout differs per ISA; the init functions are not exported, so they are named by
# the ISA of the kernels they sit next to in each tier's table, and every address must get one
# name and every name one address).
_INT8_INIT_ISA = {"avx512skx": "avx512", "avx2": "avx2", "xop": "sse4", "avx": "sse4", "sse41": "sse4", "sse2": "sse2"}
_INT8_INIT_PREFIX = {"qc8": "xnn_init_qs8_minmax_", "qs8": "xnn_init_qs8_conv_minmax_fp32_",
                     "qu8": "xnn_init_qu8_conv_minmax_fp32_"}


def int8_init_name(family: str, kernel: str) -> str:
    """The params-init function the table pairs with an 8-bit family's kernel."""
    isa = kernel.rsplit("__", 1)[1].split("_")[0]
    suffix = _INT8_INIT_ISA[isa]
    if family == "qu8" and suffix == "sse4":  # qu8 has no sse4 variant: its xop/avx/sse41 kernels take sse2's
        suffix = "sse2"
    return f"{_INT8_INIT_PREFIX[family]}{suffix}_params"


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """One setting of the f32 (or an 8-bit family's) ``gemm`` entry of ``xnn_params``, for the
    operators created while it is in place."""
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
    """One setting of the f32 (or an 8-bit family's) ``dwconv`` entry with this primary tile (kh*kw)."""
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


def save_catalog(path: Path, catalog: dict[str, list]) -> None:
    """Writes a catalog of choices (dataclasses) as JSON, whole or not at all; a cache that cannot
    be written is left out, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({kind: [dataclasses.asdict(c) for c in choices]
                                       for kind, choices in catalog.items()}))
        os.replace(partial, path)
    except OSError:
        pass


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
    flags = cpu_flags()
    snaps = {t: probe_tier(t) for t in tiers
             if all(PROC_FLAG[f] in flags for f in TIERS[t]["needs"])}
    init_names: dict[int, str] = {}
    for tier, snap in snaps.items():
        name = _INIT_FOR_ISA[tier_isa(tier, flags)]
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
    flags = cpu_flags()
    snaps = {t: probe_tier_int8(t) for t, spec in INT8_TIERS.items()
             if all(PROC_FLAG[f] in flags for f in spec["needs"])}
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
