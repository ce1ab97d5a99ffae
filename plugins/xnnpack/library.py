"""The XNNPack library plugin: spaces, XNNPack's own defaults, candidates measured in the core
worker child, and whole-model runs of a plan (executor.py)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from kselect.core.contract.labels import Label
from kselect.core.contract.library import CallCandidate, Candidate, Library
from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.measure import task_model
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import Plan
from kselect.core.precision.quant import PRECISIONS, asymmetric_u8
from kselect.plugins.ops.conv import as_conv1d
from kselect.plugins.xnnpack import configured, half, int8, kernels, profiling, tileshim
from kselect.plugins.xnnpack import ukernel_table as uk
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.builders import BUILDERS
from kselect.plugins.xnnpack.candidate import XnnCandidate
from kselect.plugins.xnnpack.executor import Executor

TILE_QUANTUM = 16  # tile_n values are multiples of 16: a multiple of every nr of this build (16, 8, 2)


class _Int8Conversion(Candidate):
    """The executor's quantize ("in": float NHWC -> int8, XNNPack's convert_nc_f32_qs8) or
    dequantize ("out": int8 -> float NHWC, convert_nc_qs8_f32) of a tensor, on the device's
    cores, on the range of its values (asymmetric uint8, zero point - 128 for the signed type the
    default variants use). Only the conversion is timed; ``output()`` is the float result in NCHW."""

    def __init__(self, direction: str, x: np.ndarray):
        self.four_d = x.ndim == 4
        nhwc = x.transpose(0, 2, 3, 1) if self.four_d else x
        scale, zero_point = asymmetric_u8(x.min(), x.max())
        channels = nhwc.shape[-1] if nhwc.ndim else 1
        self.pool = configured.pool_for(this_device().cores)
        self.q = int8.buffer(nhwc.shape, np.int8)
        self.f = configured.buffer(nhwc.shape)
        if direction == "in":
            np.copyto(self.f, nhwc)
            self.op = xa.QuantizeConvert("qs8", channels, scale, zero_point - 128)
            self.op.setup(self.f.reshape(-1, channels), self.q.reshape(-1, channels))
            self.dequantized = lambda: (self.q.astype(np.float32) - np.float32(zero_point - 128)) * np.float32(scale)
        else:
            np.copyto(self.q, int8.quantize_activations(nhwc, scale, zero_point, "qs8"))
            self.op = xa.QuantizeConvert("f32", channels, scale, zero_point - 128, variant="qs8")
            self.op.setup(self.q.reshape(-1, channels), self.f.reshape(-1, channels))
            self.dequantized = lambda: self.f
        run, handle = xa.lib().xnn.xnn_run_operator, self.op.handle
        pool = None if self.pool is None else self.pool.handle

        def timed():
            status = run(handle, pool)
            if status:
                raise xa.XNNPackError(status, "xnn_run_operator")
        self.run = timed

    def output(self) -> np.ndarray:
        y = self.dequantized()
        return np.ascontiguousarray(y.transpose(0, 3, 1, 2)) if self.four_d else np.array(y)

    def close(self) -> None:
        self.op.close()


class ExecutorCandidate(Candidate):
    def __init__(self, executor, output_shape: list[int]):
        self.executor = executor
        self.output_shape = output_shape  # the task's (a 1-D conv's output is 3-D in the executor)
        self.run = executor.run_loaded

    def output(self) -> np.ndarray:
        return self.executor.read_outputs()[0].reshape(self.output_shape)

    def close(self) -> None:
        self.executor.close()


@functools.lru_cache(maxsize=None)
def _loaded_file_sha256() -> str:
    try:
        path, _ = uk.loaded_path_and_base()
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except Exception:
        return "unknown"


def tile_values(channels: int, cores: int) -> list[int]:
    """Column tiles offered: powers of two times 16 below the channel count, all channels, and an
    even split per thread count, rounded up to multiples of 16 (a multiple of every nr here)."""
    up = lambda v: -(-v // TILE_QUANTUM) * TILE_QUANTUM  # noqa: E731
    values = {up(channels)}
    tile = TILE_QUANTUM
    while tile < channels:
        values.add(tile)
        tile *= 2
    for threads in range(2, cores + 1):
        values.add(up(-(-channels // threads)))
    return sorted(values)


class XnnpackLibrary(Library):
    name = "xnnpack"
    # An operator is deterministic once created, but its pthreadpool is not: on a busy machine a
    # multi-threaded op swings between ~1x and 100x+ from one fraction of a second to the next
    # (the pool's worker waits for a core). Three instances, timed one after the other, give the
    # median of three windows and a spread that keeps a lucky window from being planned.
    fresh_instances = 3
    # Threads are per op (the executor keeps one pthreadpool per thread count); whether the pools'
    # workers spin or sleep between parallel loops is one setting for the whole model.
    plan_level_dims = ("spinning",)
    spin_dim = "spinning"
    @property
    def int8_passes(self) -> frozenset[str]:
        """The executor's 8-bit add, max / global average pooling (where the build has those
        operators: not the 2024 API's), and a Flatten (a view)."""
        if xa.int8_graph_availability()[0]:
            return frozenset({"Add", "MaxPool", "GlobalAveragePool", "ReduceMean", "Flatten"})
        return frozenset({"Flatten"})
    # XNNPack's f16 kernels round the running sum to half after every multiply-add (half.py)
    accumulates_in_half = frozenset({"fp16"})

    @property
    def precisions(self) -> tuple[str, ...]:
        """fp32; int8, whose twins of conv / deconv / fc tasks run XNNPack's 8-bit operators
        (int8.py: qc8, qs8, qu8); fp16, on its f16 operators (half.py), where the CPU has f16
        kernels (``missing_precisions``)."""
        return tuple(p for p in PRECISIONS if p not in self.missing_precisions())

    @property
    def plan_precisions(self) -> tuple[str, ...]:
        """The executor runs a plan's int8 conv / deconv / fc nodes on the 8-bit operators,
        quantizing with the plan's calibrated ranges, and its fp16 nodes on the f16 operators,
        their conversions included (executor.py): the same as ``precisions``."""
        return self.precisions

    def missing_precisions(self) -> dict[str, str]:
        """bf16 (no such operators in this snapshot), fp16 where XNNPack has no f16 kernels for this
        CPU, and int8 and fp16 on a build whose 8-bit and f16 operators are not bound (the 2024
        API's), with why."""
        missing = {"bf16": "XNNPack has no bf16 operators in this build"}
        int8_ok, int8_why = xa.int8_availability()
        if not int8_ok:
            missing["int8"] = int8_why
        fp16_ok, fp16_why = half.available()
        if not fp16_ok:
            missing["fp16"] = fp16_why
        return {precision: missing[precision] for precision in PRECISIONS if precision in missing}

    # -- identity ---------------------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        ok, why = xa.availability()
        if not ok:
            return False, why
        override_ok, override_why = kernels.override_status()
        shim_ok, shim_why = tileshim.status()
        parts = [override_why if override_ok else f"micro-kernel override off ({override_why}): public API only"]
        if not shim_ok:
            parts.append(f"no work split or spinning ({shim_why})")
        elif not override_ok:
            parts.append("spinning on through the pthreadpool shim; no work split (it needs the override's nr)")
        elif kernels.on_2024_build():
            parts.append("spinning on through the pthreadpool shim; no work split (its tile rules follow the 2022 "
                         "build's parallel loops)")
        else:
            parts.append("work split (tile_n, loop) and spinning on through the pthreadpool shim")
        int8_ok, int8_why = xa.int8_availability()
        if not int8_ok:
            parts.append(f"no int8 ({int8_why})")
        elif override_ok:
            q_ok, q_why = kernels.int8_override_status()
            parts.append(f"int8: qc8 / qs8 / qu8 operators, {q_why}" if q_ok else
                         f"int8: qc8 / qs8 / qu8 operators, no 8-bit micro-kernel override ({q_why})")
        else:
            parts.append("int8: qc8 / qs8 / qu8 operators")
        fp16_ok, fp16_what = half.available()
        if fp16_ok:
            parts.append(f"fp16: {fp16_what}")
        parts += [f"{precision}: {why}" for precision, why in self.missing_precisions().items()]
        return True, "; ".join(parts)

    def version(self) -> str:
        return f"{xa.installed_package()} {xa.library_version() or 'unknown'} ({_loaded_file_sha256()[:12]})"

    def supports(self, task: Task) -> bool:
        """A conv, deconv or fc whose activation the executor runs; its int8 twin where an 8-bit
        operator takes it (int8.py), its fp16 twin where the f16 operators run here (half.py)."""
        if task.precision == "int8":
            return int8.supports(task)
        if task.precision == "fp16" and not half.supports(task):
            return False
        if task.precision not in ("fp32", "fp16"):
            return False
        if not all(self.runs_op(step[0]) for step in task.epilogue):
            return False
        if task.kind == "fc":
            return True
        if task.kind not in ("conv", "deconv") or len(task.input_shape) != 4:
            return False
        groups = task.attrs["group"]
        return task.input_shape[1] % groups == 0 and configured.OpSpec(task).output_channels % groups == 0

    # -- spaces -----------------------------------------------------------------------------
    @staticmethod
    def _override_on() -> bool:
        return kernels.override_status()[0]

    @staticmethod
    def _shim_on() -> bool:
        return tileshim.shim() is not None

    def kernel_options(self, spec: configured.OpSpec) -> list[str]:
        """The family's kernels, most promising first (XNNPack's own, then wider ISA tiers and
        larger tiles), so that a budgeted exhaustive search explores the likely winners first."""
        if spec.cls == "dwconv":
            names = kernels.kernel_names("dwconv", spec.taps)
        else:
            # where XNNPack runs a kernel's mr=1 sibling instead (one output row), offer only
            # kernels that run as named
            names = [n for n in kernels.kernel_names(spec.cls) if kernels.runs_as_named(spec.cls, n, spec.rows)]
        default = kernels.default_kernel(spec.cls, spec.rows, spec.taps)[0]
        return sorted(names, key=lambda n: (n != default, *kernels.promise(n)))

    def space(self, task: Task, device: Device) -> Space:
        if task.precision == "int8":
            return int8.space(task, device)
        if task.precision == "fp16":
            return half.space(task, device)
        spec = configured.OpSpec(task)
        space = Space()
        nchw_ok, nchw_kind = spec.nchw_path()
        nhwc_only = None
        if nchw_ok:
            space.add(Categorical("path", ("nchw", "nhwc"), role="layout"))  # nchw: one kernel, few configs
            nhwc_only = {"path": ["nhwc"]}
        kernel_dims = self._override_on() and kernels.offers(spec)
        if kernel_dims:
            space.add(Categorical("ukernel", tuple(self.kernel_options(spec)), role="micro-kernel", when=nhwc_only))
        space.add(Integer("threads", 1, device.cores))
        if device.cores > 1 and self._shim_on():
            space.add(Categorical("spinning", (1, 0), role="knob", when={"threads": list(range(2, device.cores + 1))}))
        if self._split_dims(spec):
            values = tile_values(spec.output_channels // spec.groups, device.cores)
            space.add(Categorical("tile_n", ("default", *values), role="knob", when=nhwc_only))
            space.add(Categorical("loop", ("rows", "columns"), role="knob", when=nhwc_only))

            def split_ok(c, spec=spec):
                if "tile_n" not in c:
                    return True
                name, mr = configured.effective_kernel(spec, c)
                nr = kernels.nr_of(name)
                own = configured.default_tile_n(spec, c["threads"], mr, nr)
                tile = own if c["tile_n"] == "default" else c["tile_n"]
                if c["tile_n"] != "default" and (tile % nr or tile == own):
                    return False
                columns = -(-(spec.output_channels // spec.groups) // tile)
                row_tiles = spec.groups * -(-spec.rows // mr)
                return c["loop"] == "rows" or (columns > 1 and row_tiles > 1)

            space.constrain("tile_n is a multiple of the kernel's nr and not XNNPack's own tile; "
                            "loop=columns only with several row and column tiles", split_ok)
        return space

    def _split_dims(self, spec) -> bool:
        # the shim's tile rules follow the 2022 build's parallel loops
        return self._override_on() and spec.cls in ("gemm", "igemm") and self._shim_on() and not kernels.on_2024_build()

    def default_config(self, task: Task, device: Device) -> dict:
        """XNNPack's own choice: the NHWC operator, the kernel its initialisation put in the table
        (the mr=1 sibling for a single-row GEMM / IGEMM), its own tile, all cores. For an int8
        task: qc8 convs, qs8 fully connected (int8.default_config); for an fp16 task, its f16
        operator on all cores (half.default_config)."""
        if task.precision == "int8":
            return int8.default_config(task, device)
        if task.precision == "fp16":
            return half.default_config(task, device)
        spec = configured.OpSpec(task)
        config: dict = {}
        if spec.nchw_path()[0]:
            config["path"] = "nhwc"
        if self._override_on() and kernels.offers(spec):
            config["ukernel"] = kernels.default_kernel(spec.cls, spec.rows, spec.taps)[0]
        config["threads"] = device.cores
        if device.cores > 1 and self._shim_on():
            config["spinning"] = 1
        if self._split_dims(spec):
            config["tile_n"] = "default"
            config["loop"] = "rows"
        return config

    def tolerance(self, task: Task, config: dict) -> float:
        return 1e-3

    # -- candidates (in the measuring child) --------------------------------------------------
    def prepare(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        shim = tileshim.shim()
        if shim is not None and configured.in_measuring_child():
            shim.clear()  # one candidate at a time in the child: no rule of an earlier one survives
        if kernels.override_status()[0]:
            configured.check_table_pristine()
        if task.precision == "int8":
            return int8.prepare(task, config, inputs)
        if task.epilogue or task.conv1d:
            return self._prepare_in_executor(task, config, inputs)
        w, b = inputs["w"], inputs.get("b")
        if task.kind != "fc":
            x = configured.buffer([task.input_shape[i] for i in (0, 2, 3, 1)])
            np.copyto(x, inputs["x"].transpose(0, 2, 3, 1))
            n, c, oh, ow = task.output_shape
            y = configured.buffer((n, oh, ow, c))
        else:
            x = configured.buffer(task.input_shape)
            np.copyto(x, inputs["x"])
            y = configured.buffer(task.output_shape)
            w = (w * np.float32(task.attrs["alpha"])).astype(np.float32)
            b = None if b is None else (b * np.float32(task.attrs["beta"])).astype(np.float32)
        flags = configured.pool_flags(config)
        if task.precision == "fp16":  # the f16 operator between the conversions of its input and output
            built = half.build(task, config, w, b, x, y)
        else:
            built = configured.build(configured.OpSpec(task), config, w, b, x, y,
                                     unsafe=configured.in_measuring_child())
        return XnnCandidate(built, task.kind != "fc", flags)

    def _prepare_in_executor(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        """An op with its activation, or a 1-D conv, run as the executor runs it in a whole model:
        the clamps fused into the operator, other activations as operators of their own (in
        float32 after an fp16 op's conversion back); a 1-D conv's [N, C, W] tensors copied into
        and out of the NHWC operator's height-1 buffers."""
        model = model_from_proto(f"{task.id}", task_model(task, inputs))
        plan = Plan(model={}, device={}, libraries={self.name: ""}, emulated=False,
                    tasks=[{**task.to_json(), "nodes": ["op"]}],  # the node's precision
                    plan_level={"spinning": config.get("spinning", 1)}, nodes={"op": {"config": config}})
        executor = Executor(self, model, plan, unsafe=configured.in_measuring_child())
        x = inputs["x"].reshape(as_conv1d(task.input_shape)) if task.conv1d else inputs["x"]
        executor.load_inputs({"x": x})
        return ExecutorCandidate(executor, task.output_shape)

    # -- layouts, for plans that mix libraries ------------------------------------------------
    def layout_label(self, config: dict) -> Label:
        return Label(self.name, "NHWC")

    def flatten_label(self, label: str) -> str:
        return Label(label)  # the executor folds a Flatten of NHWC into the FC weights' column order

    def conversion(self, label: str, direction: str, x: np.ndarray) -> Candidate | None:
        """What the executor does at its inputs and outputs (executor.py ``__call__``): a copy
        into NHWC on the way in, a copy back to NCHW on the way out; a plain copy when not 4-D.
        Between float and int8 ops inside one model (core/precision/mixed.py's labels): ``xnnpack:int8`` is
        the executor's quantize ("in") or dequantize ("out") of the NHWC tensor, and the float
        side, ``xnnpack:NCHW``, costs nothing more (the executor never holds NCHW tensors)."""
        layout = Label(label).form
        if layout == "int8":
            return _Int8Conversion(direction, x)
        if layout == "NCHW":
            return None
        four_d = label.endswith(":NHWC") and x.ndim == 4
        to_nhwc = (lambda a: a.transpose(0, 2, 3, 1)) if four_d else (lambda a: a)
        to_nchw = (lambda a: a.transpose(0, 3, 1, 2)) if four_d else (lambda a: a)
        if direction == "in":
            stored = configured.buffer(to_nhwc(x).shape)
            return CallCandidate(lambda: np.copyto(stored, to_nhwc(x)), lambda: np.ascontiguousarray(to_nchw(stored)))
        stored, result = np.ascontiguousarray(to_nhwc(x)), {}

        def run():
            result["y"] = to_nchw(stored).copy()
        return CallCandidate(run, lambda: result["y"])

    # -- plans ------------------------------------------------------------------------------
    def apply(self, plan, model, out_dir: Path, stem: str | None = None) -> list[Path]:
        """Nothing to write: the plan JSON is the artifact; ``model_runner`` (executor.py) reads
        it and builds each op as it says."""
        return []

    def model_runner(self, model, plan, in_mixed_plan: bool = False):
        return Executor(self, model, plan, release_at_end=in_mixed_plan)

    def node_times(self, model, plan, feeds: list[dict], runs: int):
        """Each step of the executor timed in place (profiling.py), on the first feed."""
        executor = Executor(self, model, plan)
        try:
            timed = profiling.profile(executor, feeds[0], runs)
        finally:
            executor.close()
        return timed["whole_us"], {node: us for node, (_, us) in timed["nodes"].items()}

    def runs_op(self, op_type: str) -> bool:
        return op_type in BUILDERS
