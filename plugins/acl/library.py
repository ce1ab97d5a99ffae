"""The ACL library plugin: spaces from the runner's ``validate``, ACL's own choice as the default,
measuring through a persistent runner process, and whole models through the runner's engine.

INT8 twins of conv and fc tasks (``Task.precision == "int8"``) run in ACL's quantized forms
(int8.py, README.md "int8"), alone and, as a plan's int8 entries, in the whole-model engine.
No fp16 twins: the ACL builds kselect runs with refuse F16 in validate(); ``missing_precisions``
names ACL's reason (README.md "fp16").

Everything is executed by the aarch64 runner (``runner/*.cpp``, PROTOCOL.md). On
an x86_64 host it runs under qemu user-mode emulation: ``emulated`` is then true and every time
this plugin produces is an emulated time, never Arm performance.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kselect.core.contract.labels import Label, boundary_label
from kselect.core.contract.library import Library
from kselect.core.contract.space import Categorical, Integer, Space, WorkloadSplit
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.measure import time_candidate
from kselect.core.models.activations import clamp_range
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import Task, extract_tasks, find_ops
from kselect.core.plans.plan import write_atomically
from kselect.core.precision.calibration import plan_ranges
from kselect.core.precision.quant import asymmetric_u8, dequantize
from kselect.plugins.acl import build, engine, int8
from kselect.plugins.acl.client import AclRunner, RunnerError
from kselect.plugins.acl.engine import ACTIVATIONS, runner_activation

CONV_METHODS = ("GEMM", "WINOGRAD", "DIRECT", "FFT")
GEMM_METHODS = ("GEMM", "WINOGRAD", "AUTO")  # methods whose work is arm_gemm GEMMs
# CPU model hints that change the fp32 arm_gemm path in 20.08 (kernel choice and the
# A53 / A55r1 / X1 variants of the sgemm and hybrid kernels); the FP16/DOT/A55r0/A73 models only
# matter to fp16 and int8 kernels.
CPU_MODEL_HINTS = ("GENERIC", "A53", "A55r1", "X1")
# arm_gemm's fp32 kernels in the order the space lists them: 20.08's names, then 24.11's
KERNEL_ORDER = ("sgemm_12x8_1d", "sgemm_12x8_2d", "hybrid_fp32_mla_16x4", "hybrid_fp32_mla_4x8_normal",
                "smallK_hybrid_fp32_mla_4x6", "smallK_hybrid_fp32_mla_4x8", "sgemv_pretransposed",
                "a64_sgemm_8x12", "a64_hybrid_fp32_mla_6x16", "a64_hybrid_fp32_mla_4x24", "a64_hybrid_fp32_mla_8x4",
                "a64_smallK_hybrid_fp32_mla_6x4", "a64_smallK_hybrid_fp32_mla_8x4", "a64_sgemm_8x6", "gemv_batched")
SPLIT_GRANULARITY = 8
SCHEDULERS = ("acl", "kselect")  # ACL's CPPScheduler / the runner's own work-splitting scheduler


def _kernel_rank(name: str) -> tuple:
    return (KERNEL_ORDER.index(name) if name in KERNEL_ORDER else len(KERNEL_ORDER), name)


def armnn_threads(device: Device) -> int:
    """ArmNN's rule for ACL's thread count: the smallest core count over the clusters."""
    return max(1, min((len(c) for c in device.clusters if c), default=device.cores))


def cluster_cpus(device: Device, threads: int) -> list[int] | None:
    """CPUs for the split scheduler's threads, cluster by cluster (biggest cores first); None on a
    device with one cluster (threads are not pinned there)."""
    if len(device.clusters) < 2:
        return None
    cpus = [cpu for cluster in device.clusters for cpu in cluster]
    return cpus[:threads] if threads <= len(cpus) else None


def runner_config(config: dict, device: Device | None = None) -> dict:
    """A kselect config (space dims) as the runner's ``config`` (PROTOCOL.md)."""
    out: dict = {}
    for key in ("method", "layout"):
        if key in config:
            out[key] = config[key]
    if "fast_math" in config:
        out["fast_math"] = bool(config["fast_math"])
    if config.get("gemm_kernel", "default") != "default":
        out["gemm_kernel"] = config["gemm_kernel"]
    if config.get("cpu_model", "detected") != "detected":
        out["cpu_model"] = config["cpu_model"]
    threads = int(config.get("threads", 0))
    out["threads"] = threads
    if config.get("scheduler") == "kselect" and threads > 1:
        out["scheduler"] = "split"
        out["split_ratios"] = [float(s) for s in config.get("split", [1.0 / threads] * threads)]
        pins = cluster_cpus(device or this_device(), threads)
        if pins:
            out["pin_threads"] = pins
    else:
        out["scheduler"] = "default"
    return out


def _intersection(lists: list[list[str]]) -> list[str]:
    if not lists:
        return []
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return sorted(common, key=_kernel_rank)


def _build_arch(info: dict) -> str:
    """"arch=arm64-v8a" from the runner's build information (ACL's build options), or "?"."""
    match = re.search(r"'arch': '([^']+)'", info.get("build_information", ""))
    return f"arch={match.group(1) if match else '?'}"


class AclLibrary(Library):
    name = "acl"
    fresh_instances = 1  # every run request configures a fresh ACL function
    # Per-op timings exclude layout changes; the runner times the NEPermute the engine inserts
    # where layouts change (measure_conversion), and the plan counts them (core/cross_library/plan.py).
    plans_layouts_per_op = True
    # In a plan with other libraries each ACL segment is a runner call that exchanges its tensors
    # as files (engine.AclModelRunner): measured per tensor shape as the "acl:boundary" sides.
    boundary_cost = True
    # int8 twins of conv and fc tasks: ACL's quantized functions (int8.py, README.md "int8"); the
    # engine runs a plan's int8 entries quantized, converting tensors between float and int8 ops.
    # No fp16: Debian's ACL builds refuse F16 (missing_precisions gives ACL's reason, README.md "fp16")
    precisions = ("fp32", "int8")
    plan_precisions = ("fp32", "int8")

    def __init__(self):
        self.emulated = build.is_emulated()
        self._validated: dict[str, dict] = {}
        self._query = None  # AclRunner for validate (parent process)
        self._measurer = None  # AclRunner for measuring (worker child)
        self._version: str | None = None
        self._detected: list[str] | None = None  # the runner's detected CPU models
        self._info: dict | None = None  # the runner's answer to info
        self.last_result: dict | None = None  # the runner's answer to the last measure()

    # -- identity -------------------------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """Cheap: compiler, ACL headers and libraries, qemu on a non-aarch64 host; nothing is built."""
        try:
            build.build_command(Path("kselect-acl-probe"))
            build.runner_command()
        except build.AclUnavailable as exc:
            return False, str(exc)
        return True, ""

    def version(self) -> str:
        """ACL's version from the Debian package (e.g. ``arm-compute 20.08+dfsg-7``); with
        ``KSELECT_ACL_LIBDIR`` (another ACL build) the version that library reports."""
        if self._version is None:
            custom = os.environ.get("KSELECT_ACL_LIBDIR")
            self._version = (None if custom else self._package_version()) or self._runner_version()
        return self._version

    @staticmethod
    def _package_version() -> str | None:
        suffix = "" if build.is_native() else ":arm64"
        for package in ("libarm-compute-dev", "libarm-compute20"):
            try:
                proc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package + suffix],
                                      capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if proc.returncode == 0 and proc.stdout.strip():
                return f"arm-compute {proc.stdout.strip()}"
        return None

    def _runner_version(self) -> str:
        info = self._query_runner().info()
        return f"arm-compute {info.get('acl_version', 'unknown')}"

    # -- runner processes -------------------------------------------------------------------------
    def _query_runner(self):
        if self._query is None:
            try:
                self._query = AclRunner(timeout_s=600)
            except build.AclUnavailable as exc:
                raise KselectError(str(exc)) from None
        return self._query

    def close(self) -> None:
        for runner in (self._query, self._measurer):
            if runner is not None:
                runner.close()
        self._query = self._measurer = None

    # -- what ACL accepts ---------------------------------------------------------------------------
    @staticmethod
    def fused_activation(task: Task) -> tuple[bool, dict | None]:
        """(whether ACL runs the task's epilogue, the runner's "act" for it): ACL fuses one
        activation of engine.ACTIVATIONS into a conv or fc; other epilogues are not ACL ops."""
        if not task.epilogue:
            return True, None
        if len(task.epilogue) != 1 or task.epilogue[0][0] not in ACTIVATIONS:
            return False, None
        op, _, attrs = task.epilogue[0]
        low, high = clamp_range(task.epilogue) if op == "Clip" else (-math.inf, math.inf)
        act = runner_activation(op, attrs.get("alpha", 0.01), low, high)
        if task.precision == "int8":  # only what the quantized output stage clamps (int8.FUSED)
            return (act is None or act["fn"] in int8.FUSED), act
        if task.kind == "fc" and act not in (None, {"fn": "RELU"}):
            return False, None  # the runner's single fc takes a fused Relu only
        return True, act

    @classmethod
    def op_spec(cls, task: Task) -> dict:
        act = cls.fused_activation(task)[1]
        if task.kind == "fc" and task.precision == "int8":  # the runner's fc takes any "act"
            return {"input": task.input_shape, "weights": task.weight_shape, "bias": task.has_bias, "act": act}
        if task.kind == "fc":
            return {"input": task.input_shape, "weights": task.weight_shape, "bias": task.has_bias, "relu": act is not None}
        a = task.attrs
        if task.kind == "deconv":  # weights in ACL's [OFM, IFM, kh, kw] order (``measure`` transposes them)
            cin, cout, kh, kw = task.weight_shape
            return {"input": task.input_shape, "weights": [cout, cin, kh, kw], "stride": a["strides"], "pads": a["pads"],
                    "bias": task.has_bias}
        return {"input": task.input_shape, "weights": task.weight_shape, "stride": a["strides"], "pads": a["pads"],
                "dilation": a["dilations"], "group": a["group"], "bias": task.has_bias, "act": act}

    def _cache_path(self, task: Task, device: Device) -> Path:
        # the answer depends on the CPU too (the arm_gemm kernels eligible on it, ACL's picks, GEMM
        # fast math where it has BF16): a cache directory shared between CPUs keeps one per CPU
        forcing = "-noforce" if os.environ.get("KSELECT_ACL_NO_GEMM_FORCING") else ""
        return (build.cache_dir() / "validate" / f"{build.binary_path().name}-{device.fingerprint}-t{device.cores}{forcing}"
                / f"{task.key}.json")

    def validation(self, task: Task, device: Device | None = None) -> dict:
        """The runner's ``validate`` answer for the task (every method x layout x fast_math, ACL's
        own pick, the arm_gemm GEMMs each method sets up with their eligible kernels); for an int8
        task one answer per activation type and weight granularity (``{"int8": {"QASYMM8/per-tensor":
        answer, ...}}``, int8.py); cached in memory and on disk (keyed by the runner build, the
        CPU and its core count)."""
        device = device or this_device()
        if task.key in self._validated:
            return self._validated[task.key]
        path = self._cache_path(task, device)
        result = None
        if path.is_file():
            try:
                result = json.loads(path.read_text())
            except ValueError:
                result = None
        combos = {f"{a}/{w}": (a, w) for a, w in int8.combos(self._acl_version())}
        if result is not None and task.precision == "int8" and set(result.get("int8", {})) != set(combos):
            result = None  # cached before this release's weights choices were all validated
        fresh = result is None
        if result is None and task.precision == "int8":
            # one validate per (activation type, weights choice): {"int8": {"QASYMM8/per-tensor": answer}}
            result = {"ok": True, "int8": {
                key: self._validate(task, {"quant": int8.placeholder_quant(activations, weights)})
                for key, (activations, weights) in combos.items()}}
        if result is None:
            result = self._validate(task, {"with_gemms": True, "config": {"threads": device.cores}})
        if fresh:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(result, f)
            os.replace(tmp, path)
        self._validated[task.key] = result
        return result

    def _validate(self, task: Task, extra: dict) -> dict:
        """One runner ``validate`` answer for the task (``extra``: further request fields)."""
        request = {"action": "validate", "op": task.kind, **self.op_spec(task), **extra}
        try:
            result = self._query_runner().request(request)
        except RunnerError as exc:
            raise KselectError(f"ACL runner failed validating task {task.id}: {exc}") from None
        if not result.get("ok"):
            raise KselectError(f"ACL runner could not validate task {task.id}: {result.get('error')}")
        result.pop("emulated", None)
        return result

    def _analyse(self, task: Task, device: Device) -> dict:
        """Valid (method, layout, fast_math) combinations and the GEMM kernels each can take."""
        v = self.validation(task, device)
        valid, kernels, defaults = set(), {}, {}
        for c in v["candidates"]:
            if not c["ok"]:
                continue
            combo = (c["method"], c.get("layout", "NCHW"), bool(c.get("fast_math", False)))
            valid.add(combo)
            gemms = (c.get("gemm") or {}).get("gemms") or []
            if gemms:
                kernels[combo] = _intersection([g["compatible"] for g in gemms])
                defaults[combo] = [g["default"] for g in gemms]
        return {"valid": valid, "kernels": kernels, "defaults": defaults, "pick": v.get("acl_pick", {}),
                "depthwise": bool(v.get("depthwise"))}

    def _analyse_int8(self, task: Task, device: Device) -> dict:
        """An int8 task's valid (activations, weights, method, layout) combinations (fc: method
        "FC", layout "NCHW") and ACL's own method pick (NCHW, no fast math) per (activations, weights)."""
        valid, picks, depthwise = set(), {}, False
        for combo, answer in self.validation(task, device)["int8"].items():
            activations, weights = combo.split("/")
            depthwise = depthwise or bool(answer.get("depthwise"))
            for c in answer["candidates"]:
                if c["ok"] and not c.get("fast_math", False):
                    valid.add((activations, weights, c["method"], c.get("layout", "NCHW")))
            picks[(activations, weights)] = answer.get("acl_pick", {}).get("NCHW", {}).get("fast_math_false", "FC")
        return {"valid": valid, "picks": picks, "depthwise": depthwise}

    def _int8_methods(self, info: dict) -> list[str]:
        """The methods of an int8 conv's space: those ACL validates for quantized data (20.08: GEMM;
        DEPTHWISE for a depthwise conv), AUTO only if ACL's pick is none of them."""
        valid = {(m, layout) for _, _, m, layout in info["valid"]}
        if info["depthwise"]:
            return ["DEPTHWISE"] if any(m == "DEPTHWISE" for m, _ in valid) else []
        methods = [m for m in CONV_METHODS if any(v[0] == m for v in valid)]
        picks = {p for p in info["picks"].values() if p not in ("NONE", "FC")}
        if (picks - set(methods) or not methods) and any(m == "AUTO" for m, _ in valid):
            methods.append("AUTO")
        return methods

    def acl_pick(self, task: Task, layout: str = "NCHW", device: Device | None = None) -> str:
        """NEConvolutionLayer::get_convolution_method for the task (fast_math off), as the runner
        reports it: GEMM / WINOGRAD / DIRECT / FFT, DEPTHWISE, or NONE."""
        return self.validation(task, device)["acl_pick"][layout]["fast_math_false"]

    def supports(self, task: Task) -> bool:
        if not self.fused_activation(task)[0]:
            return False
        if task.precision == "int8":
            if task.kind == "conv" and (task.conv1d or (task.attrs["group"] != 1 and not task.is_depthwise)):
                return False
            if task.kind == "fc" and float(task.attrs.get("alpha", 1.0)) == 0.0:
                return False  # no weights scale to fold alpha into
            if task.kind not in ("conv", "fc"):
                return False
            info = self._analyse_int8(task, this_device())
            return bool(info["valid"]) and (task.kind == "fc" or bool(self._int8_methods(info)))
        if task.kind == "conv":
            if task.conv1d:
                return False  # ACL has no 1-D conv, and its engine holds no 3-D tensors to run one as 2-D
            if task.attrs["group"] != 1 and not task.is_depthwise:
                return False  # ACL 20.08 NEON runs no grouped conv except depthwise
            info = self._analyse(task, this_device())
            return info["pick"].get("NCHW", {}).get("fast_math_false", "NONE") != "NONE" and bool(info["valid"])
        if task.kind == "fc":
            return bool(self._analyse(task, this_device())["valid"])
        if task.kind == "deconv":  # NEDeconvolutionLayer: square kernels, no groups, dilation, output padding or activation
            a = task.attrs
            if task.epilogue or a["group"] != 1 or a["dilations"] != [1, 1] or any(a["output_padding"]) \
                    or a["kernel"][0] != a["kernel"][1]:
                return False
            return bool(self._analyse(task, this_device())["valid"])
        return False

    # -- spaces and defaults ------------------------------------------------------------------------
    def _methods(self, info: dict) -> list[str]:
        if info["depthwise"]:
            return ["DEPTHWISE"] if any(m == "DEPTHWISE" for m, _, _ in info["valid"]) else []
        methods = [m for m in CONV_METHODS if any(v[0] == m for v in info["valid"])]
        pick = info["pick"].get("NCHW", {}).get("fast_math_false")
        if pick not in methods and ("AUTO", "NCHW", False) in info["valid"]:
            methods.append("AUTO")  # ACL's pick is a method kselect does not list (never seen in 20.08)
        return methods

    @staticmethod
    def _fast_math_values(info: dict) -> list[bool]:
        """fast_math only unlocks Winograd tiles (e.g. 5x5); where Winograd validates without it the
        function is the same, so True is offered only where it makes Winograd possible."""
        values = []
        layouts = {layout for m, layout, _ in info["valid"] if m == "WINOGRAD"}
        if any(("WINOGRAD", layout, False) in info["valid"] for layout in layouts):
            values.append(False)
        if any(("WINOGRAD", layout, True) in info["valid"] and ("WINOGRAD", layout, False) not in info["valid"] for layout in layouts):
            values.append(True)
        return values

    def _fast_math_by_method(self, info: dict, methods: list[str]) -> dict[str, list[bool]]:
        """The fast_math values of each method where the flag changes the function: Winograd's (the
        tiles it unlocks), and the GEMM method's both values where the runner validates GEMM with
        fast math (ACL 24.11 on a CPU with BF16, in a build with arm_gemm's fast-mode bf16 kernels)."""
        fast_math = {}
        if "WINOGRAD" in methods:
            fast_math["WINOGRAD"] = self._fast_math_values(info)
        if "GEMM" in methods and any(m == "GEMM" and fm for m, _, fm in info["valid"]):
            fast_math["GEMM"] = [False, True]
        return fast_math

    def _schedule_dims(self, space: Space, device: Device, depthwise: bool = False) -> None:
        """Threads, and where there are several cores the scheduler and the work split. Where ACL's
        assembly depthwise kernel divides its work by thread id itself (24.11: it ignores the window
        it is given; it runs the NHWC depthwise convs, NCHW ones go through a kernel that takes its
        window), a depthwise conv in NHWC gets no split of kselect's: it would not change what each
        thread runs."""
        space.add(Integer("threads", 1, device.cores))
        if device.cores > 1:
            space.add(Categorical("scheduler", SCHEDULERS, when={"threads": list(range(2, device.cores + 1))}))
            space.add(WorkloadSplit("split", granularity=SPLIT_GRANULARITY, parts_from="threads", max_parts=device.cores,
                                    when={"scheduler": ["kselect"]}))
            if depthwise and "CpuDepthwiseConv2dAssemblyWrapperKernel" in self._kernels_splitting_by_thread_id():
                space.constrain("a depthwise conv in NHWC runs ACL's assembly kernel, which divides its work by "
                                "thread id itself: kselect's split only in NCHW",
                                lambda c: c.get("scheduler") != "kselect" or c.get("layout") == "NCHW")

    @staticmethod
    def _cpu_models(device_models: list[str] | None = None) -> tuple:
        detected = set(device_models or [])
        return ("detected",) + tuple(m for m in CPU_MODEL_HINTS if m not in detected)

    def missing_dims(self) -> dict[str, str]:
        """What the ACL found here cannot choose (read off the runner's ``info``): the arm_gemm kernel
        where forcing is unavailable (the runner's declarations follow the ABIs of 20.08 and 24.11 and
        are checked at start-up), the CPU model hint where CPUInfo has no setter (after 20.08), and
        24.11's fixed-format weights (not offered) and GEMM fast math (bf16) where it cannot run."""
        extensions = self._runner_info().get("extensions", {})
        missing = {}
        if not extensions.get("gemm_forcing", False):
            missing["gemm_kernel"] = f"arm_gemm kernel forcing unavailable: {extensions.get('gemm_forcing_reason', '?')}"
        if not self._cpu_model_hint():
            missing["cpu_model"] = ("no CPU model hint in this ACL (CPUInfo::set_cpu_model is 20.08's; later "
                                    "releases read the model off the CPU only)")
        # 24.11's knobs that 20.08 lacks, each named with what ACL says here: fixed-format weights (not
        # offered), GEMM fast math (the GEMM method's fast_math where the runner can run it)
        if "fixed_format_reason" in extensions:
            missing["fixed_format"] = extensions["fixed_format_reason"]
        if "gemm_fast_math_reason" in extensions and not extensions.get("gemm_fast_math", False):
            missing["gemm_fast_math"] = extensions["gemm_fast_math_reason"]
        if not int8.SIGNED_WEIGHTS_RIGHT.get(self._acl_version(), False):
            missing[f"weights:{int8.SIGNED_WEIGHTS}"] = int8.SIGNED_WEIGHTS_WRONG_IN_2008
        return missing

    def missing_precisions(self) -> dict[str, str]:
        """bf16 (no bf16 candidates in the plugin), and fp16 with what ACL itself says about F16 here
        (the runner's ``f16_support``: validate() of a small F16 conv, depthwise conv, fc and the
        F32 -> F16 cast): a build compiled for plain Armv8-a (Debian's 20.08) refuses F16 whatever
        the CPU; where ACL accepts F16 the plugin still has no fp16 candidates."""
        missing = super().missing_precisions()
        if "fp16" in missing:
            missing["fp16"] = self._fp16_reason()
        return missing

    def _fp16_reason(self) -> str:
        info = self._runner_info()
        version = info.get("acl_version", "?")
        support = info.get("f16_support", {})
        refused = {op: why for op, why in support.items() if why != "ok"}
        if refused:
            op, why = next(iter(refused.items()))
            if info.get("has_fp16", False):
                # the CPU has FP16 arithmetic: ACL was compiled without its F16 kernels (ACL's
                # message still says "you need v8.2 or above")
                return (f"ACL {version} refuses F16 here although the CPU has FP16 arithmetic (CPUInfo::has_fp16): "
                        f"this build ({_build_arch(info)}) has no F16 kernels; validate() of an F16 {op}: {why}")
            return f"ACL {version} refuses F16 here ({op}: {why})"
        if not info.get("has_fp16", False):
            return f"this CPU has no FP16 arithmetic (ACL {version}: CPUInfo::has_fp16 is false)"
        return (f"ACL {version} validates F16 conv, depthwise and fc here, but kselect's ACL runner "
                "has no F16 candidates yet")

    def _kernels_splitting_by_thread_id(self) -> list[str]:
        return self._runner_info().get("extensions", {}).get("kernels_splitting_by_thread_id", [])

    def _cpu_model_hint(self) -> bool:
        return bool(self._runner_info().get("extensions", {}).get("cpu_model_hint", True))

    def _acl_version(self) -> str:
        return self._runner_info().get("acl_version", "?")

    def _runner_info(self) -> dict:
        if self._info is None:
            self._info = self._query_runner().info()
        return self._info

    def _detected_models(self) -> list[str]:
        if self._detected is None:
            self._detected = self._runner_info().get("detected_cpu_models", [])
        return self._detected

    def _int8_space(self, task: Task, device: Device) -> Space:
        """Activation type, weight granularity, method and layout (those ACL's validate() accepts
        together), and the schedule dims as for fp32. No gemm_kernel or cpu_model: the runner
        forces fp32 arm_gemm kernels only, and a CPU model hint with the dot-product kernels would
        run them on cores without them."""
        info = self._analyse_int8(task, device)
        valid = info["valid"]
        if not valid:
            raise KselectError(f"ACL validates no int8 form of task {task.id}")
        space = Space()
        space.add(Categorical("activations", tuple(a for a in int8.ACTIVATION_TYPES if any(v[0] == a for v in valid)),
                              role="precision"))
        space.add(Categorical("weights", tuple(w for w in int8.weight_granularities(self._acl_version())
                                               if any(v[1] == w for v in valid)), role="precision"))
        if task.kind == "conv":
            methods = self._int8_methods(info)
            if not methods:
                raise KselectError(f"ACL validates no int8 method for task {task.id}")
            space.add(Categorical("method", tuple(methods), role="algorithm"))
            layouts = tuple(layout for layout in ("NCHW", "NHWC") if any(v[3] == layout and v[2] in methods for v in valid))
            space.add(Categorical("layout", layouts, role="layout"))
        self._schedule_dims(space, device, depthwise=info["depthwise"])

        def accepted(c: dict) -> bool:
            return (c["activations"], c["weights"], c.get("method", "FC"), c.get("layout", "NCHW")) in valid

        space.constrain("ACL's validate() accepts (activations, weights, method, layout) "
                        "(20.08: fc takes per-tensor weights only)", accepted)
        return space

    def space(self, task: Task, device: Device) -> Space:
        if task.precision == "int8":
            return self._int8_space(task, device)
        info = self._analyse(task, device)
        valid, kernels = info["valid"], info["kernels"]
        space = Space()
        if task.kind == "fc":
            fc_kernels = kernels.get(("FC", "NCHW", False), [])
            if fc_kernels:
                space.add(Categorical("gemm_kernel", ("default", *fc_kernels), role="micro-kernel"))
            if self._cpu_model_hint():
                space.add(Categorical("cpu_model", self._cpu_models(self._detected_models())))
            self._schedule_dims(space, device)
            return space
        if task.kind == "deconv":  # ACL picks the convolution inside NEDeconvolutionLayer itself
            space.add(Categorical("layout", tuple(layout for layout in ("NCHW", "NHWC") if ("DECONV", layout, False) in valid),
                                  role="layout"))
            self._schedule_dims(space, device)
            return space

        methods = self._methods(info)
        if not methods:
            raise KselectError(f"ACL validates no method for task {task.id}")
        space.add(Categorical("method", tuple(methods), role="algorithm"))
        fast_math = self._fast_math_by_method(info, methods)
        if fast_math:
            values = tuple(v for v in (False, True) if any(v in by_method for by_method in fast_math.values()))
            space.add(Categorical("fast_math", values, role="algorithm", when={"method": list(fast_math)}))
        layouts = tuple(layout for layout in ("NCHW", "NHWC") if any(v[1] == layout and v[0] in methods for v in valid))
        space.add(Categorical("layout", layouts, role="layout"))
        kernel_methods = [m for m in methods if m in GEMM_METHODS and any(k[0] == m and kernels[k] for k in kernels)]
        if kernel_methods:  # none when the runner's arm_gemm ABI check failed: ACL's default kernels
            names = sorted({name for k, names in kernels.items() if k[0] in kernel_methods for name in names}, key=_kernel_rank)
            space.add(Categorical("gemm_kernel", ("default", *names), role="micro-kernel", when={"method": kernel_methods}))
        gemm_methods = [m for m in methods if m in GEMM_METHODS]
        if gemm_methods and self._cpu_model_hint():
            space.add(Categorical("cpu_model", self._cpu_models(self._detected_models()), when={"method": gemm_methods}))
        self._schedule_dims(space, device, depthwise=info["depthwise"])

        def accepted(c: dict) -> bool:
            return (c["method"], c["layout"], bool(c.get("fast_math", False))) in valid

        def eligible(c: dict) -> bool:
            kernel = c.get("gemm_kernel", "default")
            return kernel == "default" or kernel in kernels.get((c["method"], c["layout"], bool(c.get("fast_math", False))), ())

        space.constrain("ACL's validate() accepts (method, layout, fast_math)", accepted)
        if len(fast_math) > 1:
            space.constrain("fast_math where it changes the function: the Winograd tiles it unlocks, GEMM's bf16 kernels",
                            lambda c: c.get("fast_math", False) in fast_math.get(c["method"], [False]))
        if kernel_methods:
            space.constrain("gemm_kernel is eligible for every arm_gemm GEMM of (method, layout), by arm_gemm's "
                            "own rules (e.g. smallK kernels: K <= 16 and N % 4 == 0; sgemv / gemv: one row)", eligible)
        return space

    def default_config(self, task: Task, device: Device) -> dict:
        """ACL's own choice: NEConvolutionLayer::get_convolution_method (fast math off), NCHW, the
        default arm_gemm kernel and CPU model, ACL's scheduler, and ArmNN's thread count."""
        threads = armnn_threads(device)
        config: dict = {}
        if task.precision == "int8":
            return self._int8_default(task, device, threads)
        if task.kind == "conv":
            info = self._analyse(task, device)
            methods = self._methods(info)
            pick = "DEPTHWISE" if info["depthwise"] else info["pick"]["NCHW"]["fast_math_false"]
            method = pick if pick in methods else "AUTO"
            config["method"] = method
            if method in self._fast_math_by_method(info, methods):
                config["fast_math"] = False
            config["layout"] = "NCHW"
            if method in GEMM_METHODS:
                config["gemm_kernel"] = "default"  # dropped by normalise() when the space has no kernels
                config["cpu_model"] = "detected"
        elif task.kind == "deconv":
            config["layout"] = "NCHW"
        else:
            config["gemm_kernel"] = "default"
            config["cpu_model"] = "detected"
        config["threads"] = threads
        if threads > 1:
            config["scheduler"] = "acl"
        return self.space(task, device).normalise(config)

    def _int8_default(self, task: Task, device: Device, threads: int) -> dict:
        """ACL's own choice on what Arm NN gives it for a TFLite int8 model: QASYMM8_SIGNED
        activations, per-channel weights (per-tensor where ACL takes no per-channel weights, e.g.
        an fc), NEConvolutionLayer's method pick (DEPTHWISE for a depthwise conv), NCHW as for fp32,
        ACL's scheduler, ArmNN's thread count."""
        info = self._analyse_int8(task, device)
        valid = info["valid"]
        combos = [(a, w) for a in (int8.DEFAULT_ACTIVATIONS, *int8.ACTIVATION_TYPES)
                  for w in (int8.DEFAULT_WEIGHTS, *int8.WEIGHT_GRANULARITY) if any(v[:2] == (a, w) for v in valid)]
        activations, weights = combos[0]
        config: dict = {"activations": activations, "weights": weights}
        if task.kind == "conv":
            methods = self._int8_methods(info)
            pick = "DEPTHWISE" if info["depthwise"] else info["picks"].get((activations, weights), "NONE")
            config["method"] = pick if pick in methods else "AUTO"
            layouts = [v[3] for v in valid if v[:3] == (activations, weights, config["method"])]
            config["layout"] = "NCHW" if "NCHW" in layouts or not layouts else layouts[0]
        config["threads"] = threads
        if threads > 1:
            config["scheduler"] = "acl"
        return self.space(task, device).normalise(config)

    # -- layouts ----------------------------------------------------------------------------------
    def layout_label(self, config: dict) -> Label:
        return Label(self.name, config.get('layout', 'NCHW'))

    def computes_in(self, task: Task, config: dict) -> str:
        """bf16 for a GEMM conv with fast math (ACL 24.11 on a CPU with BF16 runs it on arm_gemm's
        bf16 kernels): its candidates get bf16's tolerance."""
        if task.precision == "fp32" and config.get("method") == "GEMM" and config.get("fast_math"):
            return "bf16"
        return task.precision

    def tolerance(self, task: Task, config: dict) -> float:
        # Winograd's transforms (and FFT) round more than a direct sum (FINDINGS.md); a
        # deconvolution's inner convolution is ACL's own pick.
        if task.kind == "deconv" or config.get("method") in ("WINOGRAD", "FFT", "AUTO"):
            return 1e-3
        return 1e-4

    # -- measuring (in the worker child) ------------------------------------------------------------
    def _runner_timing(self, settings) -> dict:
        """Starts the runner process on first use; the core protocol's settings, as it takes them."""
        if self._measurer is None:
            self._measurer = AclRunner(timeout_s=max(5.0, 0.9 * settings.timeout_s))
        self._measurer.timeout_s = max(5.0, 0.9 * settings.timeout_s)
        return {"warmup": settings.warmup, "min_repeats": settings.min_repeats, "max_repeats": settings.max_repeats,
                "min_time_ms": 1000.0 * settings.min_time_s, "max_time_ms": 1000.0 * settings.max_time_s,
                "stable_within": settings.stable_within}

    def measure_conversion(self, label: str, direction: str, x: np.ndarray, settings) -> dict:
        if label == f"{self.name}:int8":
            return self._measure_quantize(direction, x, self._runner_timing(settings))
        if label == boundary_label(self.name):
            return self._measure_boundary(x, settings)
        return self._measure_permute(label, direction, x, self._runner_timing(settings))

    def measure(self, task: Task, config: dict, inputs: dict[str, np.ndarray], settings) -> dict:
        timing = self._runner_timing(settings)
        if task.precision == "int8":
            return self._measure_int8(task, config, inputs, timing)
        arrays = {"input": inputs["x"], "weights": inputs["w"]}
        if "b" in inputs:
            arrays["bias"] = inputs["b"]
        if task.kind == "deconv":
            arrays["weights"] = inputs["w"].transpose(1, 0, 2, 3)
        if task.kind == "fc":  # y = alpha * x @ w.T + beta * b, folded into the weights and bias
            arrays["weights"] = inputs["w"] * np.float32(task.attrs["alpha"])
            if "b" in inputs:
                arrays["bias"] = inputs["b"] * np.float32(task.attrs["beta"])
        result, output = self._measurer.run_op(task.kind, self.op_spec(task), runner_config(config), arrays,
                                               want_output=True, **timing)
        self._checked(result)
        return {"times_us": [result["times_us"]], "output": output.reshape(task.output_shape)}

    def _checked(self, result: dict) -> None:
        """Keeps the runner's answer (``last_result``); a failed one raises with its reason."""
        self.last_result = result
        if not result.get("ok"):
            raise RuntimeError(f"{result.get('error_kind')}: {result.get('error')}")

    @staticmethod
    def int8_weight_type(activations: str, weights: str) -> str:
        """ACL's data type of an int8 candidate's weights (int8.weight_type)."""
        return int8.weight_type(activations, weights)

    def _measure_int8(self, task: Task, config: dict, inputs: dict[str, np.ndarray], timing: dict) -> dict:
        """The op on data quantized here (outside the timed work) with ``inputs["quant"]``; its
        quantized output dequantized (NCHW for a conv, (M, N) for an fc)."""
        activations = config["activations"]
        quant, arrays = int8.quantized_op(task, inputs, activations, config["weights"],
                                          self.int8_weight_type(activations, config["weights"]))
        spec = {**self.op_spec(task), "quant": quant}
        output_dtype = np.int8 if activations == "QASYMM8_SIGNED" else np.uint8
        result, output = self._measurer.run_op(task.kind, spec, runner_config(config), arrays, want_output=True,
                                               output_dtype=output_dtype, **timing)
        self._checked(result)
        y = int8.dequantize_output(output, inputs["quant"], activations)
        return {"times_us": [result["times_us"]], "output": y.reshape(task.output_shape)}

    def _measure_permute(self, label: str, direction: str, x: np.ndarray, timing: dict) -> dict:
        """The NEPermute the engine runs where a tensor enters ("in") or leaves ("out") the
        NHWC layout; nothing happens for NCHW or for tensors that are not 4-D."""
        layout = Label(label).form
        if layout != "NHWC" or x.ndim != 4:
            return {"times_us": [[0.0]], "output": x}
        source, target = ("NCHW", "NHWC") if direction == "in" else ("NHWC", "NCHW")
        config = {"from": source, "layout": target, "threads": armnn_threads(this_device()), "scheduler": "default"}
        result, output = self._measurer.run_op("permute", {"input": list(x.shape)}, config, {"input": x},
                                               want_output=True, **timing)
        self._checked(result)
        return {"times_us": [result["times_us"]], "output": output.reshape(x.shape)}

    def _measure_quantize(self, direction: str, x: np.ndarray, timing: dict) -> dict:
        """The engine's step where a float tensor enters an int8 op ("in": NEQuantizationLayer) or
        an int8 op's output enters a float op ("out": NEDequantizationLayer), on the grid of the
        tensor's own range in the default activation type (QASYMM8_SIGNED); the other half of the
        round trip is done here, outside the timed work, so the output is the tensor quantized
        and dequantized, which the core checks."""
        activations = int8.DEFAULT_ACTIVATIONS
        scale, zero_point = asymmetric_u8(x.min(), x.max())
        quant = int8.activation_quant(activations, scale, zero_point)
        config = {"layout": "NCHW", "threads": armnn_threads(this_device()), "scheduler": "default"}
        signed = activations == "QASYMM8_SIGNED"
        if direction == "in":
            result, q = self._measurer.run_op("quantize", {"input": list(x.shape), "quant": quant}, config, {"input": x},
                                              want_output=True, output_dtype=np.int8 if signed else np.uint8, **timing)
            output = dequantize(q, scale, zero_point, signed) if result.get("ok") else None
        else:
            q = int8.quantize_activation(x, scale, zero_point, activations)
            result, output = self._measurer.run_op("dequantize", {"input": list(x.shape), "quant": quant}, config,
                                                   {"input": q}, want_output=True, **timing)
        self._checked(result)
        return {"times_us": [result["times_us"]], "output": output.reshape(x.shape)}

    def _measure_boundary(self, x: np.ndarray, settings) -> dict:
        """Half of a round trip of ``x`` through a runner holding a one-op model (LeakyRelu with
        alpha 1: the identity), as a segment of a mixed plan runs: the tensor written to a file,
        the request, the import into ACL, the op, the export, the file read back. Each side, in
        and out, is charged half. Two arrays alternate, so every call writes its input."""
        from onnx import TensorProto, helper


        shape = list(x.shape)
        graph = helper.make_graph([helper.make_node("LeakyRelu", ["x"], ["y"], alpha=1.0)], "boundary",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
        model = model_from_proto("boundary", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                                ir_version=8))
        work_dir = engine.WorkDir()
        default = {"threads": armnn_threads(this_device()), "scheduler": "default"}
        runner = engine.AclModelRunner(engine.lower(model, {}, default, work_dir.path), work_dir,
                                       timeout_s=max(5.0, 0.9 * settings.timeout_s))
        try:
            feeds = [{"x": x}, {"x": -x}]
            calls = []
            times = time_candidate(lambda: calls.append(runner(feeds[len(calls) % 2])), settings)
            output = runner({"x": x})[0]
        finally:
            runner.close()
        return {"times_us": [[t / 2 for t in times]], "output": output}

    # -- whole models -------------------------------------------------------------------------------
    def node_configs(self, model, plan=None, device: Device | None = None) -> dict[str, dict]:
        """Runner configs per conv / fc node: the plan's, or the library defaults. A plan's int8
        entry (task ``T...int8``, config with ``activations`` / ``weights``) carries ``"int8":
        {"activations", "weights"}``, which ``engine.lower`` turns into the node's quantization."""
        device = device or this_device()
        configs = {}
        for task in (extract_tasks(model) if find_ops(model) else []):
            for node in task.nodes:
                entry = plan.nodes.get(node) if plan is not None else None
                if entry is not None and ("activations" in entry["config"] or str(entry.get("task", "")).endswith(".int8")):
                    if not self.supports(task.at_precision("int8")):
                        raise KselectError(f"ACL runs no int8 form of node {node!r} (task {entry.get('task')})")
                    config = entry["config"]
                    configs[node] = {**runner_config(config, device),
                                     "int8": {"activations": config["activations"], "weights": config["weights"]}}
                    continue
                if not self.supports(task):
                    continue
                if plan is not None and entry is None:
                    raise KselectError(f"the plan has no entry for node {node!r}")
                config = entry["config"] if entry is not None else self.default_config(task, device)
                configs[node] = runner_config(config, device)
        return configs

    def apply(self, plan, model, out_dir: Path, stem: str | None = None) -> list[Path]:
        """A bundle the runner's ``model_load`` runs on the device: ``STEM.acl/graph.json`` (every
        conv / fc with the plan's config) and its weight files, named relative to it."""
        device = this_device()
        bundle = Path(out_dir) / f"{stem or model.name}.acl"
        bundle.mkdir(parents=True, exist_ok=True)
        for old in engine.weight_files(bundle) + [bundle / "graph.json"]:
            old.unlink(missing_ok=True)
        graph = engine.lower(model, self.node_configs(model, plan, device),
                             {"threads": armnn_threads(device), "scheduler": "default"}, bundle, plan_ranges(plan))
        graph["kselect"] = {"model": plan.model, "libraries": plan.libraries, "emulated": plan.emulated,
                            "usage": "kselect_acl_runner: {\"action\":\"model_load\",\"model_id\":\"m\",\"graph_path\":\"graph.json\"}"}
        path = bundle / "graph.json"
        write_atomically(path, json.dumps(graph, indent=1) + "\n")
        return [path]

    def model_runner(self, model, plan, in_mixed_plan: bool = False, timeout_s: float = 1800.0):
        """The model in a persistent runner process (``engine.AclModelRunner``), with the library
        defaults when ``plan`` is None, else the plan's per-op configs. ``in_mixed_plan`` changes
        nothing: ACL's scheduler threads wait on a condition variable, they do not spin."""
        device = this_device()
        configs = self.node_configs(model, plan, device)
        default = {"threads": armnn_threads(device), "scheduler": "default"}
        work_dir = engine.WorkDir()
        try:
            graph = engine.lower(model, configs, default, work_dir.path, plan_ranges(plan))
        except BaseException:
            work_dir.cleanup()
            raise
        return engine.AclModelRunner(graph, work_dir, timeout_s=timeout_s)

    def runs_op(self, op_type: str) -> bool:
        return hasattr(engine._Lowering, f"op_{op_type}")
