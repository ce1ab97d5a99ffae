"""Which XNNPack micro-kernels an op can be given, what XNNPack picks by itself, and turning a
config's kernel name back into the override ``ukernel_forcing.forced_kernels`` applies.

Names are XNNPack's own without the ``xnn_`` prefix (``f32_igemm_minmax_ukernel_7x16__avx512f_broadcast``).
The catalog (``ukernel_catalog.catalog``: probes of each ISA tier in child processes, ~3 s) is
cached on disk per library file (sha256), CPU flags and the source of the modules it comes from.
On Debian 13's arm64 build (the 2024 API) the f32 GEMM / IGEMM choice is ukernel_arm64.py's: the
functions below ask it instead of the 2022 table (``on_2024_build``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from pathlib import Path

from kselect.core.paths import cache_root
from kselect.plugins.xnnpack import ukernel_arm64, ukernel_catalog, ukernel_probes, ukernel_table
from kselect.plugins.xnnpack import xnnpack_api as xa

PREFIX = "xnn_"
DWCONV_TAPS = (3, 4, 9, 25)  # primary tiles of this build's f32 dwconv table (unipass only)


def short(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def full(name: str) -> str:
    return name if name.startswith(PREFIX) else PREFIX + name


# -- override availability ----------------------------------------------------------------
def on_2024_build() -> bool:
    """Whether the loaded library is a 2024-API build (its override: ukernel_arm64.py)."""
    return xa.availability()[0] and xa.api() == xa.API_2024


def _description():
    return ukernel_arm64 if on_2024_build() else ukernel_table


@functools.lru_cache(maxsize=None)
def override_status() -> tuple[bool, str]:
    """(True, description) when the installed build is the one the override understands and the
    catalog of kernels could be read; else (False, why)."""
    ok, why = _description().availability()
    if not ok:
        return False, why
    try:
        cat = catalog()
    except ukernel_table.OverrideRefused as exc:
        return False, str(exc)
    except Exception as exc:  # the override is optional: say why and keep the public API
        return False, f"catalog failed ({type(exc).__name__}: {exc})"
    counts = ", ".join(f"{len(v)} {k}" for k, v in cat.items() if v)
    build = _description().verify_build().info["debian_version"]
    return True, f"micro-kernel override on ({counts} choices; build {build})"


def kernels_in_operator(op: xa.Operator) -> list[str]:
    """Names of the micro-kernels an f32 operator holds."""
    return _description().kernels_in_operator(op)


def offers(spec) -> bool:
    """Whether this op (a configured.OpSpec) has a micro-kernel choice on this build: GEMM, IGEMM
    and depthwise on the 2022 one; GEMM and IGEMM on the arm64 2024 one (one depthwise kernel per
    tap count there), except a fully connected op with fewer output channels than the config's nr,
    which XNNPack runs with its nr=2 config."""
    if spec.cls not in ("gemm", "igemm", "dwconv"):
        return False
    if not on_2024_build():
        return True
    if spec.cls == "dwconv":
        return False
    return not (spec.kind == "fc" and spec.output_channels < ukernel_arm64.table_defaults()["gemm"]["nr"])


def runs_as_named(cls: str, name: str, rows: int) -> bool:
    """Whether an operator given kernel ``name`` runs it (not its mr=1 sibling) for ``rows`` rows."""
    if on_2024_build():
        choice = resolve(cls, name, None)
        return ukernel_arm64.runs(choice, rows) == choice.name
    if cls == "igemm" and rows == 1:
        return native_mr(name) == 1 or resolve("igemm", name, None).fn1 is None
    return True


def _cache_file(build: ukernel_table.Build) -> Path:
    sources = hashlib.sha256(b"".join(Path(module.__file__).read_bytes()
                                      for module in (ukernel_table, ukernel_probes, ukernel_catalog)))
    key = hashlib.sha256(json.dumps([build.elf.sha256, sorted(ukernel_probes.cpu_flags()),
                                     sources.hexdigest()]).encode())
    return cache_root() / "xnnpack" / f"catalog-{key.hexdigest()[:16]}.json"


@functools.lru_cache(maxsize=None)
def catalog() -> dict[str, list]:
    """``ukernel_catalog.catalog()`` through a disk cache, or on the 2024 build
    ``ukernel_arm64.catalog()`` (raises ``OverrideRefused``)."""
    if on_2024_build():
        return ukernel_arm64.catalog()
    build = ukernel_table.verify_build()
    path = _cache_file(build)
    try:
        data = json.loads(path.read_text())
        return {"gemm": [ukernel_catalog.GemmChoice(**c) for c in data["gemm"]],
                "igemm": [ukernel_catalog.GemmChoice(**c) for c in data["igemm"]],
                "dwconv": [ukernel_catalog.DwconvChoice(**c) for c in data["dwconv"]]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cat = ukernel_catalog.catalog()
    ukernel_catalog.save_catalog(path, cat)
    return cat


@functools.lru_cache(maxsize=None)
def table_defaults() -> dict:
    """What XNNPack's own initialisation put in the table (this process, no override):
    {"gemm": {gemm, igemm, gemm1, igemm1 names, mr, nr}, "dwconv": {taps: name}}."""
    snap = ukernel_table.snapshot(ukernel_table.verify_build())
    g = snap["gemm"]
    names = {slot: short(n) for slot, n in g["names"].items()}
    return {"gemm": {**names, "mr": g["mr"], "nr": g["nr"]},
            "dwconv": {d["primary_tile"]: short(d["name"]) for d in snap["dwconv"] if d["name"]}}


# -- which kernel family XNNPack uses for an op -------------------------------------------
def op_class(task) -> str:
    """XNNPack's micro-kernel family for this task's NHWC operator (convolution-nhwc.c at
    ae108ef): "vmulcaddc" (1x1 depthwise), "dwconv" (depthwise, multiplier 1, kh*kw one of the
    table's tiles), "gemm" (1x1 stride-1 unpadded, and fully connected), "deconv" (transposed
    convolution: its own operator, no micro-kernel choice offered), else "igemm"."""
    if task.kind == "fc":
        return "gemm"
    if task.kind == "deconv":
        return "deconv"
    a = task.attrs
    groups = a["group"]
    cin_g, cout_g = task.input_shape[1] // groups, task.weight_shape[0] // groups
    kh, kw = a["kernel"]
    unit_stride = a["strides"] == [1, 1]
    no_pad = not any(a["pads"])
    if cin_g == 1 and cout_g == 1 and kh * kw == 1 and unit_stride and no_pad:
        return "vmulcaddc"
    if cin_g == 1 and cout_g == 1 and kh * kw in DWCONV_TAPS:
        return "dwconv"
    if kh * kw == 1 and unit_stride and no_pad:
        return "gemm"
    return "igemm"


def gemm_rows(task) -> int:
    """Rows of the GEMM (output pixels times batch, input pixels for a deconv, or the fc batch)."""
    if task.kind == "fc":
        return int(task.input_shape[0])
    if task.kind == "deconv":
        n, _, h, w = task.input_shape
        return int(n * h * w)
    n, _, oh, ow = task.output_shape
    return int(n * oh * ow)


def native_mr(name: str) -> int:
    return ukernel_table.parse_gemm_name(full(name))["mr"]


def nr_of(name: str) -> int:
    return ukernel_table.parse_gemm_name(full(name))["nr"]


def kernel_names(cls: str, taps: int | None = None) -> list[str]:
    """Every catalog kernel of this family (dwconv: of this tap count), default tier first."""
    cat = catalog()
    if cls == "dwconv":
        return [short(c.name) for c in cat["dwconv"] if c.primary_tile == taps]
    seen: dict[str, None] = {}
    for c in cat[cls]:
        seen.setdefault(short(c.name), None)
    return list(seen)


def default_kernel(cls: str, rows: int, taps: int | None = None) -> tuple[str, int] | None:
    """(kernel name, mr) XNNPack itself runs for this family, or None (no choice here)."""
    if on_2024_build():
        if cls not in ("gemm", "igemm"):
            return None
        own = ukernel_arm64.table_defaults()[cls]
        mr = ukernel_arm64.heuristic_mr(rows, own["mr"], own["nr"], set(own["cases"]))
        return short(own["cases"][mr]), mr
    t = table_defaults()
    if cls == "dwconv":
        return t["dwconv"].get(taps), None
    if cls not in ("gemm", "igemm"):
        return None
    g = t["gemm"]
    if rows == 1 and g.get(cls + "1"):
        return g[cls + "1"], 1
    return g[cls], g["mr"]


ISA_RANK = {"avx512f": 0, "fma3": 1, "avx": 2, "sse": 3}


def promise(name: str, isa_rank: dict | None = None) -> tuple:
    """Sort key: wider ISA first, then larger tiles (rows x columns, or channels for depthwise)."""
    isa_rank = ISA_RANK if isa_rank is None else isa_rank
    isa = name.rsplit("__", 1)[-1].split("_")[0]
    if "_dwconv_" in name:
        m = re.search(r"up(\d+)x(\d+)", name)
        size = int(m.group(1)) if m else 0
    else:
        p = ukernel_table.parse_gemm_name(full(name))
        size = p["mr"] * p["nr"]
    return isa_rank.get(isa, 9), -size, name


def resolve(cls: str, name: str, mr: int | None, taps: int | None = None, *, unsafe: bool = False):
    """The catalog choice for (kernel, mr); IGEMM only at its native MR unless ``unsafe`` (an
    IGEMM run at another row tile aborts the process on an XNNPack assert)."""
    cat = catalog()
    name = full(name)
    if cls == "dwconv":
        for c in cat["dwconv"]:
            if c.name == name and c.primary_tile == taps:
                return c
        raise KeyError(f"{short(name)} is not a {taps}-tap depthwise micro-kernel of this build")
    if cls not in ("gemm", "igemm"):
        raise KeyError(f"no micro-kernel choice for a {cls} operator")
    for c in cat[cls]:
        if c.name == name and (mr is None or c.mr == mr):
            return c
    if unsafe and mr is not None:
        for c in cat[cls]:
            if c.name == name:
                return dataclasses.replace(c, mr=int(mr), fn1=None)
    raise KeyError(f"{short(name)} at mr={mr} is not a {cls} choice of this build")


# -- 8-bit kernels (qc8, qs8, qu8) ----------------------------------------------------------
INT8_DWCONV_TAPS = (9, 25)  # primary tiles of this build's 8-bit dwconv tables (no 3/4 taps, no vmulcaddc)
INT8_ISA_RANK = {"avx512skx": 0, "avx2": 1, "xop": 2, "avx": 3, "sse41": 4, "sse2": 5}


def _int8_cache_file(build: ukernel_table.Build) -> Path:
    return _cache_file(build).with_name(_cache_file(build).name.replace("catalog-", "catalog-int8-"))


@functools.lru_cache(maxsize=None)
def int8_catalog() -> dict[str, dict[str, list]]:
    """``ukernel_catalog.catalog_int8()`` through a disk cache (raises ``OverrideRefused``)."""
    build = ukernel_table.verify_build()
    path = _int8_cache_file(build)
    try:
        data = json.loads(path.read_text())
        return {family: {"gemm": [ukernel_catalog.GemmChoice(**c) for c in entries["gemm"]],
                         "igemm": [ukernel_catalog.GemmChoice(**c) for c in entries["igemm"]],
                         "dwconv": [ukernel_catalog.DwconvChoice(**c) for c in entries["dwconv"]]}
                for family, entries in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    cat = ukernel_catalog.catalog_int8()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({family: {k: [dataclasses.asdict(c) for c in v] for k, v in entries.items()}
                                   for family, entries in cat.items()}))
        os.replace(tmp, path)
    except OSError:
        pass
    return cat


@functools.lru_cache(maxsize=None)
def int8_override_status() -> tuple[bool, str]:
    """(True, description) when the f32 override is on (a known build, the table found) and the
    8-bit entries of every ISA tier could be read; else (False, why)."""
    ok, why = override_status()
    if not ok:
        return False, why
    if on_2024_build():
        return False, "described for the 2022 amd64 build only"
    try:
        ukernel_table.check_int8_table()
        cat = int8_catalog()
    except ukernel_table.OverrideRefused as exc:
        return False, str(exc)
    except Exception as exc:
        return False, f"8-bit catalog failed ({type(exc).__name__}: {exc})"
    counts = ", ".join(f"{family} {len(v['gemm'])}/{len(v['igemm'])}/{len(v['dwconv'])}" for family, v in cat.items())
    return True, f"8-bit micro-kernel override on (gemm/igemm/dwconv: {counts})"


@functools.lru_cache(maxsize=None)
def int8_table_defaults() -> dict:
    """What XNNPack's initialisation put in the 8-bit entries (this process, no override):
    {family: {"gemm": {gemm, igemm, gemm1, igemm1 names, mr, nr}, "dwconv": {taps: name}}}."""
    out = {}
    for family, entries in ukernel_table.snapshot_int8(ukernel_table.verify_build()).items():
        g = entries["gemm"]
        out[family] = {"gemm": {**{slot: short(n) for slot, n in g["names"].items()}, "mr": g["mr"], "nr": g["nr"]},
                       "dwconv": {d["primary_tile"]: short(d["name"]) for d in entries["dwconv"] if d["name"]}}
    return out


def int8_op_class(task) -> str:
    """XNNPack's micro-kernel family for the 8-bit NHWC operator (convolution-nhwc.c at ae108ef:
    no vmulcaddc for 8-bit; dwconv for depthwise multiplier 1 with 9 or 25 taps; gemm for 1x1
    stride-1 unpadded convs and fully connected; else igemm)."""
    if task.kind == "fc":
        return "gemm"
    a = task.attrs
    groups = a["group"]
    cin_g, cout_g = task.input_shape[1] // groups, task.weight_shape[0] // groups
    kh, kw = a["kernel"]
    if cin_g == 1 and cout_g == 1 and kh * kw in INT8_DWCONV_TAPS:
        return "dwconv"
    if kh * kw == 1 and a["strides"] == [1, 1] and not any(a["pads"]):
        return "gemm"
    return "igemm"


def int8_family(name: str) -> str:
    """The 8-bit family (qc8, qs8, qu8) of a kernel name."""
    return short(name).split("_", 1)[0]


def int8_kernel_names(family: str, cls: str, taps: int | None = None) -> list[str]:
    entries = int8_catalog()[family]
    if cls == "dwconv":
        return [short(c.name) for c in entries["dwconv"] if c.primary_tile == taps]
    return [short(c.name) for c in entries[cls]]


def int8_default_kernel(family: str, cls: str, rows: int, taps: int | None = None) -> str | None:
    """The kernel XNNPack itself runs for this family and op (the mr=1 sibling for one row)."""
    t = int8_table_defaults()[family]
    if cls == "dwconv":
        return t["dwconv"].get(taps)
    if rows == 1 and t["gemm"].get(cls + "1"):
        return t["gemm"][cls + "1"]
    return t["gemm"][cls]


def int8_promise(name: str) -> tuple:
    """Sort key: wider ISA first, then larger tiles."""
    return promise(name, INT8_ISA_RANK)


def int8_resolve(cls: str, name: str, taps: int | None = None):
    """The catalog choice for an 8-bit kernel name (its family is in the name)."""
    family = int8_family(name)
    if family not in ukernel_table.INT8_FAMILIES:
        raise KeyError(f"{name} is not an 8-bit (qc8, qs8, qu8) micro-kernel")
    name = full(name)
    for c in int8_catalog()[family].get(cls, []):
        if c.name == name and (cls != "dwconv" or c.primary_tile == taps):
            return c
    raise KeyError(f"{short(name)} is not a {family} {cls} choice of this build"
                   + (f" for {taps} taps" if cls == "dwconv" else ""))
