"""The f32 GEMM / IGEMM micro-kernel choice on Debian 13's arm64 XNNPack build
(``libXNNPACK.so.0.20241108``, ukernel_arm64.py), in the arm64 root: the build is recognised and
its f32 GEMM config located, the kernels' names are the code Debian's ``libmicrokernels-prod.a``
holds under those names, every catalog candidate computes a conv or fc within tolerance through
the plugin's measuring child (holding the configured kernel), the table is XNNPack's own after an
override, a resnet18 plan of other kernels runs in the whole model with ONNX Runtime's output,
``kselect space resnet18 --library xnnpack`` offers ``ukernel``, and a changed copy of
the library is refused in one line (public API only). Skipped where another build is loaded
(x86_64's 2022 one). Part of ``make test-arm64``."""

from __future__ import annotations

import platform
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import kselect_json, plan_and_onnxruntime_outputs, run_kselect

from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task, extract_tasks, task_key
from kselect.core.plans.plan import Plan, plan_node, plan_task
from kselect.plugins.xnnpack import configured, kernels, ukernel_arm64
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_ON_ARM64_2024 = xa.availability()[0] and xa.api() == xa.API_2024 and platform.machine() == "aarch64"
pytestmark = pytest.mark.skipif(not _ON_ARM64_2024, reason="Debian 13's arm64 XNNPack build is not loaded here")

TINY = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=120)
ARCHIVE = Path("/usr/lib/aarch64-linux-gnu/libmicrokernels-prod.a")  # libxnnpack-dev


def conv_task(cin, cout, k, stride=1, h=15, w=13) -> Task:
    pad = k // 2
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    attrs = {"kernel": [k, k], "strides": [stride, stride], "pads": [pad] * 4, "dilations": [1, 1], "group": 1}
    signature = {"kind": "conv", "input": [1, cin, h, w], "weight": [cout, cin, k, k], "output": [1, cout, oh, ow],
                 "attrs": attrs, "bias": True}
    return Task("T", task_key(signature), "conv", [1, cin, h, w], [cout, cin, k, k], [1, cout, oh, ow], attrs, True,
                ["n"])


def fc_task(m, k, n) -> Task:
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": True}
    return Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, True, ["f"])


def test_the_build_is_recognised_and_its_f32_gemm_config_located():
    build = ukernel_arm64.verify_build()
    assert build.info["debian_version"] == "0.0~git20241108.4ea82e5-2"
    assert build.config_addr - build.base == build.info["config_offset"]
    ok, why = kernels.override_status()
    assert ok and why.startswith("micro-kernel override on"), why
    cat = kernels.catalog()
    assert len(cat["gemm"]) >= 20 and len(cat["igemm"]) >= 20 and cat["dwconv"] == []
    # every branch of init_f32_gemm_config was read; this process's own config is one of them
    assert {c.tier for c in cat["igemm"]} == set(ukernel_arm64.PROBES)
    own = ukernel_arm64.table_defaults()["igemm"]
    assert own["cases"][own["mr"]] in {c.name for c in cat["igemm"]}
    entry = {p["name"]: p for p in kselect_json("plugins")}["xnnpack"]
    assert "micro-kernel override on" in entry["status"] and "no work split" in entry["status"], entry


def _archive_functions() -> dict[str, bytes]:
    """Function name -> code of every symbol in the archive's objects (ELF64 relocatable)."""
    data = ARCHIVE.read_bytes()
    assert data[:8] == b"!<arch>\n"
    out, pos = {}, 8
    while pos + 60 <= len(data):
        size = int(data[pos + 48:pos + 58])
        member = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if member[:4] != b"\x7fELF":
            continue
        shoff, = struct.unpack_from("<Q", member, 0x28)
        shentsize, shnum, _ = struct.unpack_from("<HHH", member, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", member, shoff + i * shentsize) for i in range(shnum)]
        for sec in sections:
            if sec[1] != 2:  # SHT_SYMTAB
                continue
            strtab = sections[sec[6]][4]
            for i in range(sec[5] // 24):
                entry = struct.unpack_from("<IBBHQQ", member, sec[4] + 24 * i)
                st_name, st_info, _, st_shndx, st_value, st_size = entry
                if st_info & 0xF == 2 and st_size:  # STT_FUNC
                    name = member[strtab + st_name:member.index(b"\0", strtab + st_name)].decode()
                    code_at = sections[st_shndx][4] + st_value
                    out[name] = member[code_at:code_at + st_size]
    return out


@pytest.mark.skipif(not ARCHIVE.exists(), reason="libxnnpack-dev's libmicrokernels-prod.a is not installed")
def test_every_assembly_kernel_is_the_archives_code_of_that_name():
    """The names come from where XNNPack's source puts each kernel; the assembly kernels (no
    relocations) must be byte for byte the archive's functions of those names."""
    build = ukernel_arm64.verify_build()
    library = Path(build.path).read_bytes()
    text_va, text_offset, _ = build.sections[".text"]
    functions = _archive_functions()
    checked = 0
    for choice in kernels.catalog()["gemm"] + kernels.catalog()["igemm"]:
        if "__asm_" not in choice.name:
            continue
        code = functions[choice.name]
        at = choice.fn - text_va + text_offset
        assert library[at:at + len(code)] == code, choice.name
        checked += 1
    assert checked == 35  # all but the C ones (s4 neonfma, 6x8 lane_ld128): their archive copies keep asserts


def test_every_candidate_computes_a_conv_and_an_fc_within_tolerance():
    cat = kernels.catalog()
    igemm_task = conv_task(16, 24, 3, stride=2)  # 8x7 output rows
    gemm_task = conv_task(24, 40, 1)  # 1x1 unpadded: 195 rows
    fc_task_ = fc_task(11, 64, 40)
    jobs = [(igemm_task, {"ukernel": kernels.short(c.name), "threads": 1}) for c in cat["igemm"]]
    jobs += [(task, {"ukernel": kernels.short(c.name), "threads": 2})
             for c in cat["gemm"] for task in (gemm_task, fc_task_)]
    failures = []
    with MeasureWorker("xnnpack", TINY) as worker:
        for task, config in jobs:
            result = worker.measure(task, config)  # also checks that the operator holds the kernel
            if result.status != "ok" or result.error > 1e-4:
                failures.append((config, result.status, result.reason))
    assert not failures, failures


def test_defaults_name_what_xnnpack_runs_and_an_override_is_undone():
    device, lib = this_device(), XnnpackLibrary()
    own = ukernel_arm64.table_defaults()["igemm"]
    assert lib.default_config(conv_task(16, 24, 3, h=1, w=1), device)["ukernel"] == kernels.short(own["cases"][1])
    assert lib.default_config(conv_task(16, 24, 3), device)["ukernel"] == kernels.short(own["cases"][own["mr"]])
    single_row = lib.space(fc_task(1, 64, 40), device)
    offered = {d.name: d for d in single_row.dims}["ukernel"].choices
    assert offered and all(kernels.native_mr(n) == 1 for n in offered)  # a single row runs mr=1 kernels only
    assert "ukernel" not in {d.name for d in lib.space(fc_task(4, 64, 5), device).dims}  # XNNPack's nr=2 config
    task = conv_task(16, 24, 3)
    other = next(n for n in kernels.kernel_names("igemm") if n != lib.default_config(task, device)["ukernel"])
    configured.check_table_pristine()
    x = np.zeros((1, 15, 13, 16), np.float32)
    y = np.zeros((1, 15, 13, 24), np.float32)
    built = configured.build(configured.OpSpec(task), {"ukernel": other, "threads": 1},
                             np.ones((24, 16, 3, 3), np.float32), None, x, y)
    assert other in built.notes["kernels"]
    built.close()
    configured.check_table_pristine()  # raises if any byte of the config differs from XNNPack's own


def test_a_resnet18_plan_of_other_kernels_runs_in_the_whole_model():
    """Every conv and the fc of resnet18 (1x3x32x32) given another kernel than XNNPack's own: the
    plan runs through kselect.load_plan (each operator created with its kernel and checked to hold
    it) and its output is ONNX Runtime's."""
    model = load_model("resnet18", ["input=1,3,32,32"])
    lib, here = XnnpackLibrary(), this_device()
    tasks, nodes, chosen = [], {}, set()
    for task in extract_tasks(model):
        default = lib.default_config(task, here)
        options = {d.name: d for d in lib.space(task, here).dims}["ukernel"].choices
        config = {"ukernel": options[-1], "threads": 1}
        assert config["ukernel"] != default["ukernel"]
        chosen.add(config["ukernel"])
        tasks.append(plan_task(task, task.nodes, "xnnpack", config, 1.0, default, 1.0, 1, False))
        nodes.update({node: plan_node(task, "xnnpack", config) for node in task.nodes})
    plan = Plan(model={}, device={}, libraries={"xnnpack": lib.version()}, emulated=lib.emulated,
                plan_level={"spinning": 1}, tasks=tasks, nodes=nodes)
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)
    output, reference = plan_and_onnxruntime_outputs(plan, model, {"input": x})
    assert len(chosen) >= 2
    assert float(np.max(np.abs(output - reference))) / float(np.max(np.abs(reference))) < 1e-4


def test_space_of_resnet18_offers_micro_kernels():
    space = kselect_json("space", "resnet18", "--library", "xnnpack")
    names = {kernels.short(c.name) for c in kernels.catalog()["gemm"] + kernels.catalog()["igemm"]}
    for task in space["tasks"]:
        assert "ukernel" in task["dimensions"] and "tile_n" not in task["dimensions"], task
        assert task["default"]["ukernel"] in names


def test_a_changed_copy_of_the_library_is_refused_in_one_line(tmp_path):
    """The same file with one byte of its .gnu_debuglink checksum changed loads and runs, but is
    not a known build: the public API only, said in one line."""
    data = bytearray(Path(ukernel_arm64.verify_build().path).read_bytes())
    _, offset, size = ukernel_arm64.verify_build().sections[".gnu_debuglink"]
    data[offset + size - 1] ^= 0xFF
    (tmp_path / xa.LIBXNNPACK_2024).write_bytes(bytes(data))
    env = {"LD_LIBRARY_PATH": str(tmp_path)}
    entry = {p["name"]: p for p in kselect_json("plugins", env=env)}["xnnpack"]
    status = entry["status"]
    assert "micro-kernel override off (" in status and "is not a known build" in status, status
    assert "public API only" in status and "\n" not in status
    space = kselect_json("space", "resnet18", "--library", "xnnpack", "--task", "T02", env=env)
    assert "ukernel" not in {d["name"] for d in space["dimensions"]}
    result = run_kselect("space", "resnet18", "--library", "xnnpack", "--task", "T02", env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr
