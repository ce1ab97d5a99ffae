"""The XNNPack library plugin on the real library: availability and version, spaces and defaults,
candidates measured in the core worker child (every listed micro-kernel correct, aborts contained
and recorded as failed, overrides undone), the public-API fallback, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import kselect_json, run_kselect

from kselect.core.contract import plugins
from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions, stored_outcomes, tune_tasks
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import load_model
from kselect.core.models.tasks import Task, extract_tasks, task_key
from kselect.core.plans.plan import build_plan
from kselect.core.records.store import RecordDB
from kselect.plugins.xnnpack import configured, kernels, tileshim, ukernel_probes
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.library import XnnpackLibrary

_OK, _REASON = xa.availability()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

TINY = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=60)
FAST = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.2, timeout_s=60)


def override_on() -> bool:
    return kernels.override_status()[0]


needs_override = pytest.mark.skipif(not (_OK and override_on()), reason="micro-kernel override unavailable here")


def conv_task(cin, cout, k, stride=1, pads=None, group=1, h=9, w=11, dilation=1, bias=True) -> Task:
    kh, kw = (k, k) if isinstance(k, int) else k
    pads = pads if pads is not None else [kh // 2, kw // 2, kh // 2, kw // 2]
    oh = (h + pads[0] + pads[2] - ((kh - 1) * dilation + 1)) // stride + 1
    ow = (w + pads[1] + pads[3] - ((kw - 1) * dilation + 1)) // stride + 1
    attrs = {"kernel": [kh, kw], "strides": [stride, stride], "pads": list(pads), "dilations": [dilation, dilation],
             "group": group}
    signature = {"kind": "conv", "input": [1, cin, h, w], "weight": [cout, cin // group, kh, kw],
                 "output": [1, cout, oh, ow], "attrs": attrs, "bias": bias}
    return Task("T", task_key(signature), "conv", [1, cin, h, w], [cout, cin // group, kh, kw], [1, cout, oh, ow],
                attrs, bias, ["n"])


def fc_task(m, k, n) -> Task:
    attrs = {"alpha": 1.0, "beta": 1.0, "transB": 1}
    signature = {"kind": "fc", "input": [m, k], "weight": [n, k], "output": [m, n], "attrs": attrs, "bias": True}
    return Task("F", task_key(signature), "fc", [m, k], [n, k], [m, n], attrs, True, ["f"])


# -- identity ---------------------------------------------------------------------------------
def test_plugins_lists_xnnpack_available_with_version_and_override_status():
    result = run_kselect("plugins", "--json")
    assert result.returncode == 0, result.stderr
    found = {p["name"]: p for p in json.loads(result.stdout)}
    info = found["xnnpack"]
    assert info["kind"] == "library" and info["status"].startswith("available"), info
    assert info["version"].startswith("libxnnpack0 0.0~git20220216")
    assert "(" in info["version"]  # a short hash of the loaded .so: another build never shares records
    assert "override" in info["status"]


def test_version_changes_with_the_library_file():
    lib = plugins.get_library("xnnpack")
    sha = lib.version().rsplit("(", 1)[1].rstrip(")")
    from kselect.plugins.xnnpack.library import _loaded_file_sha256

    assert _loaded_file_sha256().startswith(sha)


# -- spaces and defaults ---------------------------------------------------------------------
@needs_override
def test_spaces_offer_the_kernels_of_each_family_and_defaults_are_xnnpacks_own():
    lib, device = XnnpackLibrary(), this_device()
    table = kernels.table_defaults()
    cases = {
        "igemm": conv_task(16, 24, 3),
        "gemm": conv_task(16, 24, 1, pads=[0, 0, 0, 0]),
        "dwconv": conv_task(24, 24, 3, group=24),
        "fc": fc_task(1, 64, 40),
    }
    for label, task in cases.items():
        space = lib.space(task, device)
        default = lib.default_config(task, device)
        assert default in space, (label, default)
        names = space.dim("ukernel").choices
        if label == "igemm":
            assert default["ukernel"] == table["gemm"]["igemm"]
            assert len(names) == len(kernels.catalog()["igemm"])
        elif label == "gemm":
            assert default["ukernel"] == table["gemm"]["gemm"]
            assert set(names) == {kernels.short(c.name) for c in kernels.catalog()["gemm"]}
        elif label == "dwconv":
            assert default["ukernel"] == table["dwconv"][9]
            # one 3x3 kernel per x86 ISA the CPU has: sse, avx, fma3 and avx512f
            isas = 1 + sum(flag in ukernel_probes.cpu_flags() for flag in ("avx", "fma", "avx512f"))
            assert all("x9__" in n for n in names) and len(names) == isas
        else:  # a single-row fully connected op runs XNNPack's mr=1 kernel
            assert default["ukernel"] == table["gemm"]["gemm1"]
        assert default["threads"] == device.cores
        for name in names:
            assert name.startswith("f32_") and not name.startswith("xnn_")


def test_nchw_path_only_where_xnnpack_has_an_nchw_operator():
    lib, device = XnnpackLibrary(), this_device()
    has_path = lambda t: "path" in {d.name for d in lib.space(t, device).dims}  # noqa: E731
    assert has_path(conv_task(16, 24, 1, pads=[0, 0, 0, 0]))  # SpMM
    assert has_path(conv_task(24, 24, 3, group=24))  # CHW depthwise 3x3
    assert has_path(conv_task(3, 16, 3, stride=2, pads=[1, 1, 1, 1], h=16, w=16))  # HWC->CHW, C_in = 3
    assert not has_path(conv_task(16, 16, 3, stride=2, pads=[1, 1, 1, 1], h=16, w=16))  # that kernel needs C_in = 3
    assert not has_path(conv_task(16, 24, 3))
    assert not has_path(fc_task(1, 64, 40))


# -- candidates in the worker child -------------------------------------------------------------
def test_sampled_configs_of_every_op_kind_measure_and_match_the_reference():
    import random

    lib, device = XnnpackLibrary(), this_device()
    tasks = [conv_task(16, 24, 3), conv_task(16, 40, 1, pads=[0, 0, 0, 0]), conv_task(24, 24, 3, group=24),
             conv_task(24, 24, 3, stride=2, pads=[1, 1, 1, 1], group=24, h=12, w=12), conv_task(8, 8, 5, group=8),
             conv_task(3, 16, 3, stride=2, pads=[1, 1, 1, 1], h=16, w=16), conv_task(16, 32, 3, group=16),
             conv_task(8, 16, (3, 5), pads=[2, 0, 1, 3], dilation=2, h=12, w=13), conv_task(16, 16, 7, group=16),
             conv_task(16, 16, 1, pads=[0, 0, 0, 0], group=16), fc_task(1, 64, 40), fc_task(5, 48, 24)]
    rng = random.Random(0)
    with MeasureWorker("xnnpack", TINY) as worker:
        for task in tasks:
            space = lib.space(task, device)
            configs = [lib.default_config(task, device)] + space.sample(rng, 5)
            if "path" in {d.name for d in space.dims}:
                configs.append({"path": "nchw", "threads": 1})
            for config in configs:
                result = worker.measure(task, config)
                assert result.status == "ok", (task.attrs, config, result)
                assert result.error < 1e-4


@needs_override
def test_every_listed_micro_kernel_gives_a_correct_result():
    cat = kernels.catalog()
    gemm_task = conv_task(24, 40, 1, pads=[0, 0, 0, 0])  # 99 rows: every mr is exercised
    igemm_task = conv_task(16, 24, 3, stride=2, h=15, w=13)
    fc_one_row = fc_task(1, 64, 40)
    dw_tasks = {3: conv_task(24, 24, (1, 3), pads=[0, 1, 0, 1], group=24), 4: conv_task(24, 24, 2, pads=[0, 0, 1, 1], group=24),
                9: conv_task(24, 24, 3, group=24), 25: conv_task(24, 24, 5, group=24)}
    jobs = [(gemm_task, {"ukernel": kernels.short(c.name), "mr": c.mr, "threads": 1}) for c in cat["gemm"]]
    jobs += [(fc_one_row, {"ukernel": n, "threads": 2}) for n in kernels.kernel_names("gemm")]
    jobs += [(igemm_task, {"ukernel": kernels.short(c.name), "threads": 1}) for c in cat["igemm"]]
    jobs += [(dw_tasks[c.primary_tile], {"ukernel": kernels.short(c.name), "threads": 1}) for c in cat["dwconv"]]
    flags = ukernel_probes.cpu_flags()
    isas = {"sse"} | {isa for isa, flag in (("avx", "avx"), ("fma3", "fma"), ("avx512f", "avx512f")) if flag in flags}
    for family in ("gemm", "igemm"):  # kernels of every ISA the CPU has, each with an mr=1 variant
        assert {c.name.split("__")[1].split("_")[0] for c in cat[family]} == isas
        assert len(cat[family]) >= 2 * len(isas)
    assert {c.primary_tile for c in cat["dwconv"]} == {3, 4, 9, 25}
    failures = []
    with MeasureWorker("xnnpack", TINY) as worker:
        for task, config in jobs:
            result = worker.measure(task, config)
            if result.status != "ok" or result.error > 1e-4:
                failures.append((config, result))
    # each candidate also checked that its operator holds exactly the configured kernel
    assert not failures, failures


@needs_override
def test_an_aborting_override_is_contained_recorded_failed_and_never_planned(tmp_path):
    """An IGEMM forced to a row tile other than its MR trips an XNNPack assert (SIGABRT): the space
    never offers it, so a library that does is made here; the core worker contains the abort."""
    name = kernels.table_defaults()["gemm"]["igemm"]
    mr = kernels.native_mr(name)

    class Reckless(XnnpackLibrary):
        def space(self, task, device):
            return Space().add(Categorical("ukernel", (name,))).add(Categorical("mr", (mr, mr - 3))) \
                .add(Integer("threads", 1, 1))

        def default_config(self, task, device):
            return {"ukernel": name, "mr": mr, "threads": 1}

    task, device = conv_task(16, 24, 3), this_device()
    db = RecordDB(tmp_path / "records.db")
    library = Reckless()
    outcomes = tune_tasks([task], library, device, db, TuneOptions("exhaustive", 4, settings=FAST))
    assert outcomes[0].failed == 1 and outcomes[0].default.status == "ok"
    records = db.records(device.fingerprint, "xnnpack", library.version(), task.key)
    failed = [r for r in records if r.result.status == "failed"]
    assert len(failed) == 1 and failed[0].config["mr"] == mr - 3
    assert "SIGABRT" in failed[0].result.reason
    # in this process the same config is refused before anything native runs
    with pytest.raises(configured.ConfigError):
        configured.choice_for(configured.OpSpec(task), failed[0].config, unsafe=False)


@needs_override
def test_an_override_is_undone_before_the_next_candidate():
    """One child measures forced kernels then defaults; a default candidate checks that its operator
    holds XNNPack's own kernel, so a table left overridden would fail it."""
    device, lib = this_device(), XnnpackLibrary()
    igemm, dw = conv_task(16, 24, 3), conv_task(24, 24, 3, group=24)
    others = {"igemm": [n for n in kernels.kernel_names("igemm") if n != kernels.table_defaults()["gemm"]["igemm"]],
              "dw": [n for n in kernels.kernel_names("dwconv", 9) if n != kernels.table_defaults()["dwconv"][9]]}
    with MeasureWorker("xnnpack", TINY) as worker:
        for forced in others["igemm"][:3]:
            assert worker.measure(igemm, {"ukernel": forced, "threads": 1}).status == "ok"
            assert worker.measure(igemm, lib.default_config(igemm, device)).status == "ok"
        for forced in others["dw"]:
            assert worker.measure(dw, {"ukernel": forced, "threads": 1}).status == "ok"
            assert worker.measure(dw, lib.default_config(dw, device)).status == "ok"
    # and in this process: the table is XNNPack's own after a forced creation
    configured.check_table_pristine()
    x = np.zeros((1, 9, 11, 16), np.float32)
    y = np.zeros((1, 9, 11, 24), np.float32)
    w = np.ones((24, 16, 3, 3), np.float32)
    built = configured.build(configured.OpSpec(igemm), {"ukernel": others["igemm"][0], "threads": 1}, w, None, x, y)
    built.close()
    configured.check_table_pristine()  # raises if any byte of the table differs


def test_tile_n_and_loop_order_change_only_the_order_of_independent_tiles():
    if tileshim.shim() is None or not override_on():
        pytest.skip(f"work split unavailable: {tileshim.status()[1]}")
    rng = np.random.default_rng(0)
    task = conv_task(64, 96, 3, h=10, w=9)
    x = rng.standard_normal((1, 10, 9, 64), dtype=np.float32)
    w = rng.standard_normal((96, 64, 3, 3), dtype=np.float32)
    spec = configured.OpSpec(task)
    outputs, before = [], tileshim.shim().overridden()
    for config in ({"threads": 2}, {"threads": 2, "tile_n": 32, "loop": "columns"},
                   {"threads": 1, "tile_n": 16, "loop": "columns"}, {"threads": 1, "tile_n": 48, "loop": "rows"}):
        y = np.zeros((1, 10, 9, 96), np.float32)
        built = configured.build(spec, config, w, None, x, y)
        built.run()
        outputs.append(y.copy())
        built.close()
    assert tileshim.shim().overridden() > before
    for y in outputs[1:]:
        np.testing.assert_array_equal(y, outputs[0])
    assert tileshim.shim().rules() == 0  # closing an operator removes its rule


# -- without the override or the shim -----------------------------------------------------------
def _in_subprocess(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_unknown_build_falls_back_to_the_public_api():
    code = """
from kselect.plugins.xnnpack import ukernel_table
ukernel_table.KNOWN_BUILDS.clear()  # as if the installed build were another one
from kselect.plugins.xnnpack.library import XnnpackLibrary
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import measure_in_this_process, MeasureSettings
from kselect.core.models.tasks import Task
lib, device = XnnpackLibrary(), this_device()
ok, why = lib.availability()
print("AVAILABLE", ok, why)
t = Task("T", "0123456789abcdef", "conv", [1, 16, 9, 9], [16, 1, 3, 3], [1, 16, 9, 9],
         {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 16}, True, ["n"])
space = lib.space(t, device)
print("DIMS", [d.name for d in space.dims])
config = lib.default_config(t, device)
print("DEFAULT", config)
r = measure_in_this_process(lib, t, config, MeasureSettings(min_repeats=2, min_time_s=0.0, max_time_s=0.05), {})
print("RESULT", r.status, r.reason)
"""
    out = _in_subprocess(code)
    assert "AVAILABLE True" in out and "override off" in out and "public API only" in out
    assert "ukernel" not in out.split("DIMS", 1)[1].splitlines()[0]
    assert "'path'" in out.split("DIMS", 1)[1].splitlines()[0]  # the public NCHW operator stays on offer
    assert "RESULT ok" in out


def test_without_the_shim_there_is_no_work_split():
    code = """
from kselect.plugins.xnnpack.library import XnnpackLibrary
from kselect.core.measuring.device import this_device
from kselect.core.models.tasks import Task
lib = XnnpackLibrary()
t = Task("T", "0123456789abcdef", "conv", [1, 16, 9, 9], [24, 16, 3, 3], [1, 24, 9, 9],
         {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}, True, ["n"])
print("STATUS", lib.availability()[1])
print("DIMS", [d.name for d in lib.space(t, this_device()).dims])
"""
    out = _in_subprocess(code, {"KSELECT_XNN_TILESHIM": "0"})
    assert "no work split" in out
    dims = out.split("DIMS", 1)[1]
    assert "tile_n" not in dims and "loop" not in dims


# -- tune and bench through the CLI ---------------------------------------------------------------
def test_tune_and_bench_on_the_cli(small_model_path, tmp_path):
    plan_path, bench_path = tmp_path / "small.xnnpack.plan.json", tmp_path / "bench.json"
    tuned = kselect_json("tune", small_model_path, "--library", "xnnpack", "--budget", "5", "--min-time", "0.01",
                         "--db", tmp_path / "records.db", "-o", plan_path)
    (tuning,) = tuned["libraries"]
    assert tuning["library"] == "xnnpack"
    assert tuning["tasks"] and all(t["default_us"] > 0 and t["best_us"] > 0 for t in tuning["tasks"])  # default vs best
    assert plan_path.exists()
    plan = json.loads(plan_path.read_text())
    assert set(plan["libraries"]) == {"xnnpack"} and set(plan["plan_level"]) <= {"spinning"}
    benched = run_kselect("bench", small_model_path, "--plan", plan_path, "--rounds", "2", "--runs-per-round", "2",
                          "--json", bench_path)
    assert benched.returncode == 0, benched.stderr
    result = json.loads(bench_path.read_text())
    assert result["library"] == "xnnpack" and result["max_relative_output_error"] < 1e-3
    assert result["default_ms"] > 0 and result["plan_ms"] > 0


def test_a_tuned_plan_is_not_slower_than_the_default_over_its_ops(small_model_path, tmp_path):
    model = load_model(str(small_model_path))
    lib, device = plugins.get_library("xnnpack"), this_device()
    tasks = [t for t in extract_tasks(model) if lib.supports(t)]
    db = RecordDB(tmp_path / "records.db")
    outcomes = tune_tasks(tasks, lib, device, db, TuneOptions("random", 4, settings=FAST))
    plan = build_plan(model, device, lib, lib.version(), tasks, stored_outcomes(tasks, lib, device, db),
                      {o.task.key: o.default_config for o in outcomes})
    default_total = sum(entry["default_us"] * len(entry["nodes"]) for entry in plan.tasks)
    assert plan.estimated_us() <= default_total * 1.0001
    spinning = {entry["config"].get("spinning") for entry in plan.tasks} - {None}
    assert len(spinning) <= 1 and spinning <= {plan.plan_level.get("spinning", 1)}  # one value per plan
