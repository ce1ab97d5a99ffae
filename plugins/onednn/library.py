"""The oneDNN library plugin: per op, which of oneDNN's implementations runs it (every one its
primitive descriptor iterator yields), the activation layout it writes, and its thread count;
candidates measured in the core worker child; whole models run by executor.py."""

from __future__ import annotations

import functools
import subprocess

import numpy as np

from kselect.core.contract.labels import FLAT, Label
from kselect.core.contract.library import CallCandidate, Candidate, Library
from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import Device
from kselect.core.measuring.measure import task_model
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import Plan
from kselect.core.precision.quant import PRECISIONS
from kselect.plugins.onednn import dnnl
from kselect.plugins.onednn import primitives as prim
from kselect.plugins.onednn.executor import BUILDERS, Executor
from kselect.plugins.ops.conv import as_conv1d


class PrimitiveCandidate(Candidate):
    """One configured primitive on fixed input data: the input reordered into the format the
    implementation reads before timing (a producer in the same layout hands it over as it is),
    its output read back to NCHW / (M, N) after."""

    def __init__(self, built: prim.Built, x: np.ndarray, output_shape: list[int]):
        self.built = built
        self.output_shape = output_shape
        plain_in = dnnl.Memory(dnnl.plain_desc(built.task.input_shape))
        plain_in.plain_view()[...] = x
        dnnl.reorder_now(plain_in, built.src)
        plain_in.close()
        self.threads = built.threads
        self._steps = [primitive.step for primitive in built.steps]

    def run(self) -> None:
        dnnl.set_threads(self.threads)
        for fn, *args in self._steps:
            status = fn(*args)
            if status:
                raise dnnl.DnnlError(status, "dnnl_primitive_execute")

    def output(self) -> np.ndarray:
        dnnl.wait()
        plain = dnnl.Memory(dnnl.plain_desc(self.built.task.output_shape))
        try:
            dnnl.reorder_now(self.built.dst, plain)
            return plain.plain_view().reshape(self.output_shape).copy()
        finally:
            plain.close()

    def close(self) -> None:
        self.built.close()


class ExecutorCandidate(Candidate):
    """A 1-D conv as the executor runs it in a model: its [N, C, W] tensors are plain, so the
    reorders into and out of the implementation's formats are part of the op (and of its time)."""

    def __init__(self, executor, output_shape: list[int]):
        self.executor = executor
        self.output_shape = output_shape
        self.run = executor.run_loaded

    def output(self) -> np.ndarray:
        return self.executor.read_outputs()[0].reshape(self.output_shape)

    def close(self) -> None:
        self.executor.close()


class OnednnLibrary(Library):
    name = "onednn"
    # Layouts are chosen per op with the reorders between them counted (core/cross_library/plan.py):
    # an op's fastest implementation may write another format than its neighbours read.
    plans_layouts_per_op = True

    # -- identity ---------------------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        ok, why = dnnl.availability()
        if not ok:
            return False, why
        missing = "; ".join(f"{precision}: {reason}" for precision, reason in self.missing_precisions().items())
        return True, f"{dnnl.effective_isa()} kernels; {dnnl.threading_control()}" + (f"; {missing}" if missing else "")

    @property
    def precisions(self) -> tuple[str, ...]:
        """fp32, and bf16 where this CPU and build have bf16 kernels (``missing_precisions``)."""
        return ("fp32",) + tuple(p for p in ("bf16",) if p not in self.missing_precisions())

    @property
    def plan_precisions(self) -> tuple[str, ...]:
        """The executor runs a plan's bf16 ops in bf16 (executor.py): the same as ``precisions``."""
        return self.precisions

    def missing_precisions(self) -> dict[str, str]:
        """Each reduced precision oneDNN has no kernels for in kselect here, and why."""
        missing = {precision: f"no {precision} candidates in kselect's oneDNN plugin"
                   for precision in PRECISIONS if precision not in ("fp32", "bf16", "fp16")}
        if dnnl.availability()[0]:
            reason = prim.bf16_missing()
            if reason is not None:
                missing["bf16"] = reason
            missing["fp16"] = prim.fp16_missing()
        else:
            missing["bf16"] = missing["fp16"] = "oneDNN is not available"
        return missing

    def missing_dims(self) -> dict[str, str]:
        """The bf16 twin's second form, f32 primitives in bf16 fp-math mode, is offered for no op
        kind: per kind, why (``fpmath_bf16_change``: oneDNN ignores the mode here, or the plugin
        does not take what it changes)."""
        major, minor, patch = dnnl.version()
        missing = {}
        for kind, what in prim.KIND_NAMES.items():
            change = fpmath_bf16_change(kind)
            missing[f"fpmath_bf16:{kind}"] = (
                f"f32 {what} with fpmath_mode bf16 runs as strict f32 in oneDNN {major}.{minor}.{patch} on "
                f"{dnnl.effective_isa()}: the same implementations, bit-identical output" if change is None else
                f"fpmath_mode bf16 changes f32 {what} here ({change}), but kselect's oneDNN plugin does not "
                f"offer that form")
        return missing

    def version(self) -> str:
        major, minor, patch = dnnl.version()
        package = _debian_version(dnnl.debian_package())
        built = f"{dnnl.debian_package()} {package}" if package else f"oneDNN {major}.{minor}.{patch}"
        return f"{built} ({dnnl.effective_isa()})"

    def supports(self, task: Task) -> bool:
        if task.kind not in ("conv", "deconv", "fc") or task.precision not in self.precisions:
            return False
        if prim.post_ops(task.epilogue) is None:
            return False
        if task.kind == "fc":
            return bool(prim.offered(task).get(None))
        if len(task.input_shape) != 4:
            return False
        groups = task.attrs["group"]
        if task.input_shape[1] % groups or task.output_shape[1] % groups:
            return False
        return any(prim.offered(task).values())

    # -- spaces -----------------------------------------------------------------------------
    def space(self, task: Task, device: Device) -> Space:
        offered = prim.offered(task)
        space = Space()
        if task.kind == "fc":
            space.add(Categorical("impl", tuple(name for name, _ in offered[None]), role="algorithm"))
        else:
            default = self.default_config(task, device)
            layouts = [layout for layout in prim.LAYOUTS if offered[layout]]
            layouts.sort(key=lambda layout: layout != default["layout"])
            names = list(dict.fromkeys(name for layout in layouts for name, _ in offered[layout]))
            preferred = prim.preference(task)
            # most promising first, for budgeted searches: oneDNN's pick, then its order of
            # preference, the reference implementation last
            names.sort(key=lambda name: (name != default["impl"], name.startswith("ref:"),
                                         preferred.index(name) if name in preferred else len(preferred)))
            space.add(Categorical("impl", tuple(names), role="algorithm"))
            space.add(Categorical("layout", tuple(layouts), role="layout"))
            by_layout = {layout: {name for name, _ in offered[layout]} for layout in layouts}
            space.constrain("impl is one oneDNN offers for an output in that layout",
                            lambda c, by_layout=by_layout: c["impl"] in by_layout[c["layout"]])
        space.add(Integer("threads", 1, device.cores))
        return space

    def default_config(self, task: Task, device: Device) -> dict:
        """oneDNN's own choice: the first implementation its iterator yields with every format
        ``any``, in the output layout that implementation picks; all cores."""
        if task.kind == "fc":
            return {"impl": prim.offered(task)[None][0][0], "threads": device.cores}
        offered = prim.offered(task)
        own = prim.own_choice(task)
        if own is not None and own[1] in offered and any(name == own[0] for name, _ in offered[own[1]]):
            return {"layout": own[1], "impl": own[0], "threads": device.cores}
        layout = next(layout for layout in prim.LAYOUTS if offered[layout])  # a format not offered as a layout
        return {"layout": layout, "impl": offered[layout][0][0], "threads": device.cores}

    # -- candidates (in the measuring child) --------------------------------------------------
    def prepare(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        if task.conv1d:
            return self._prepare_in_executor(task, config, inputs)
        built = prim.Built(task, config, inputs["w"], inputs.get("b"))
        try:
            return PrimitiveCandidate(built, inputs["x"], task.output_shape)
        except BaseException:
            built.close()
            raise

    def _prepare_in_executor(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        model = model_from_proto(task.id, task_model(task, inputs))
        plan = Plan(model={}, device={}, libraries={self.name: ""}, emulated=self.emulated,
                    tasks=[{**task.to_json(), "nodes": ["op"]}], plan_level={},
                    nodes={"op": {"library": self.name, "config": config}})
        executor = Executor(self, model, plan)
        executor.load_inputs({"x": inputs["x"].reshape(as_conv1d(task.input_shape))})
        return ExecutorCandidate(executor, task.output_shape)

    # -- layouts, for plans that mix libraries ------------------------------------------------
    def layout_label(self, config: dict) -> Label:
        layout = config.get("layout")
        return Label(self.name, prim.LABELS[layout] if layout else FLAT)

    def input_label(self, task: Task, label: str) -> str:
        """A conv writing a blocked layout may read a plain one (a first conv on 3 channels reads
        nchw): the format its layout's first implementation reads."""
        layout = next((k for k, v in prim.LABELS.items() if f"{self.name}:{v}" == label), None)
        if task.kind == "fc" or layout is None:
            return label
        offered = prim.offered(task).get(layout) or ()
        reads = offered[0][1] if offered else None
        return f"{self.name}:{prim.LABELS[reads]}" if reads else label

    def conversion(self, label: str, direction: str, x: np.ndarray) -> Candidate:
        """What the executor does at a segment boundary: "in" copies the NCHW array into its input
        buffer and, for a layout other than NCHW, reorders it into that layout; "out" reorders to
        NCHW where needed and copies the result out to a new array. A tensor that is not 4-D is
        only copied."""
        layout = Label(label).form
        fmt = next((k for k, v in prim.LABELS.items() if v == layout), None) if x.ndim == 4 else None
        plain = dnnl.Memory(dnnl.plain_desc(x.shape))
        held = dnnl.Memory(dnnl.desc(list(x.shape), fmt)) if fmt not in (None, "nchw") else None
        step = None
        if held is not None:
            step = dnnl.reorder(plain, held) if direction == "in" else dnnl.reorder(held, plain)
        if direction == "in":
            def run():
                np.copyto(plain.plain_view(), x)
                if step is not None:
                    step.execute()
                    dnnl.wait()

            def output():
                if held is None:
                    return plain.plain_view().copy()
                back = dnnl.Memory(dnnl.plain_desc(x.shape))
                dnnl.reorder_now(held, back)
                return back.plain_view().copy()
        else:
            if held is not None:
                staging = dnnl.Memory(dnnl.plain_desc(x.shape))
                np.copyto(staging.plain_view(), x)
                dnnl.reorder_now(staging, held)  # the tensor as the runner holds it, outside the timing
                staging.close()
            else:
                np.copyto(plain.plain_view(), x)
            result = {}

            def run():
                if step is not None:
                    step.execute()
                    dnnl.wait()
                result["y"] = plain.plain_view().copy()

            def output():
                return result["y"]
        candidate = CallCandidate(run, output)
        candidate.close = lambda: [m.close() for m in (step, held, plain) if m is not None]
        return candidate

    # -- plans ------------------------------------------------------------------------------
    def model_runner(self, model, plan, in_mixed_plan: bool = False):
        return Executor(self, model, plan)

    def node_times(self, model, plan, feeds: list[dict], runs: int):
        executor = Executor(self, model, plan)
        try:
            return executor.node_times(feeds, runs)
        finally:
            executor.close()

    def runs_op(self, op_type: str) -> bool:
        return op_type in BUILDERS


@functools.lru_cache(maxsize=None)
def fpmath_bf16_change(kind: str) -> str | None:
    """What oneDNN's bf16 fp-math mode (``dnnl_primitive_attr_set_fpmath_mode``) changes for an f32
    primitive of ``kind`` (conv, deconv, fc) here, or None when nothing: the same implementations
    offered for every output layout, and the first of each computing a bit-identical output from the
    same data in both modes."""
    task = prim.probe_task(kind, "fp32")
    strict, relaxed = prim.offered(task), prim.offered(task, "bf16")
    if strict != relaxed:
        names = lambda by_layout: sorted({name for impls in by_layout.values() for name, _ in impls})  # noqa: E731
        return f"implementations {', '.join(names(strict))} in strict mode, {', '.join(names(relaxed))} in bf16"
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(shape).astype(np.float32)
               for shape in (task.input_shape, task.weight_shape, [task.output_shape[1]]))
    for layout, impls in strict.items():
        if not impls:
            continue
        config = {"impl": impls[0][0], "threads": 1, **({"layout": layout} if layout else {})}
        outputs = []
        for fpmath in ("strict", "bf16"):
            candidate = PrimitiveCandidate(prim.Built(task, config, w, b, fpmath=fpmath), x, task.output_shape)
            try:
                candidate.run()
                outputs.append(candidate.output())
            finally:
                candidate.close()
        if not np.array_equal(*outputs):
            largest = float(np.max(np.abs(outputs[0] - outputs[1])) / np.max(np.abs(outputs[0])))
            return f"{config['impl']}'s output differs by up to {largest:.2g} of its largest magnitude"
    return None


@functools.lru_cache(maxsize=None)
def _debian_version(package: str) -> str | None:
    try:
        proc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None
