"""The contract between kselect and an inference library, in three roles and a description.

- ``KernelSource``: supplies and measures kernels: which tasks it takes, their configuration
  space, its own default config, and how one candidate is built and timed.
- ``WholeModelRunner``: runs a whole model as a plan says (or with its own defaults) and writes
  what a deployment needs.
- ``TensorCrossing``: how tensors cross between this library and others, precisions and
  layouts: the label an op leaves its output in, and the conversions its runner makes.
- ``Capabilities``: what the library can do, as a frozen value (``Library.capabilities()``):
  precisions, plan-level dims, emulation...

``Library`` is the three roles together: a library plugin subclasses it and registers one
instance through the ``register_libraries`` hook (docs/writing-a-library.md walks through every
member; ``kselect.core.contract.checks.check_library`` is the suite that says whether a library
keeps the contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kselect.core.contract.labels import INT8, Label
from kselect.core.contract.space import Space
from kselect.core.measuring.device import RUNS_EMULATED, Device
from kselect.core.measuring.measure import time_candidate
from kselect.core.models.tasks import Task
from kselect.core.precision.quant import PRECISIONS


class Candidate:
    """One configured kernel for one task, ready to run on fixed input data."""

    def run(self) -> None:
        raise NotImplementedError

    def output(self) -> np.ndarray:
        """The result of the last run, in the task's NCHW / (M, N) layout."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CallCandidate(Candidate):
    """A candidate made of two functions: the timed work and how to read its result."""

    def __init__(self, run: Callable[[], None], output: Callable[[], np.ndarray]):
        self.run = run
        self.output = output


class KernelSource(ABC):
    """Role: supplies and measures kernels. Called, in order, for ``kselect tune MODEL``:
    ``availability()`` and ``version()`` (records are keyed by device, library name and version:
    a new build is tuned afresh); ``prepare_model(model)`` once; ``supports(task)`` for every task
    (a group of identical conv / deconv / fc ops with the activation after each,
    core/models/tasks.py); ``space(task, device)`` and ``default_config(task, device)`` (the
    library's own choice, the baseline every speedup is measured against); then, in a measuring
    child process (core/measuring/worker.py), ``measure(task, config, inputs, settings)`` for each
    config the search proposes, checked against a float64 reference within
    ``tolerance(task, config)``."""

    def availability(self) -> tuple[bool, str]:
        return True, ""

    @abstractmethod
    def version(self) -> str:
        raise NotImplementedError

    def prepare_model(self, model) -> None:
        """Called once before a model's tasks are tuned or shown. A library whose own defaults
        depend on the graph around an op (not just on the op) records them here."""

    @abstractmethod
    def supports(self, task: Task) -> bool:
        raise NotImplementedError

    @abstractmethod
    def space(self, task: Task, device: Device) -> Space:
        raise NotImplementedError

    @abstractmethod
    def default_config(self, task: Task, device: Device) -> dict:
        raise NotImplementedError

    def missing_dims(self) -> dict[str, str]:
        """Dims other builds of this library offer that this build lacks, each with why in one line
        (``kselect space`` shows them); e.g. a GEMM kernel choice an older release's internals allow."""
        return {}

    def missing_precisions(self) -> dict[str, str]:
        """Each precision kselect knows (core/precision/quant.PRECISIONS) that this library does not
        offer here, with why in one line (``kselect space`` shows them): the plugin has no such
        candidates, or this CPU or build lacks the kernels. A library whose precisions depend on the
        CPU says which part is missing."""
        return {precision: f"no {precision} candidates in kselect's {self.name} plugin"
                for precision in PRECISIONS if precision not in self.precisions}

    def tolerance(self, task: Task, config: dict) -> float:
        """Largest accepted error relative to the reference's largest magnitude."""
        return 1e-3

    def computes_in(self, task: Task, config: dict) -> str:
        """The precision a config of this task computes in: the task's own, unless a knob of the
        config lowers it (MLAS's bf16 fast-math GEMM on an fp32 task: "bf16"); a half precision
        here gets that format's tolerance (core/precision/half.py) in place of ``tolerance``."""
        return task.precision

    def plan_error_bound(self, settings: dict) -> float | None:
        """The largest output error relative to the library default a plan with these plan-level
        settings may show end to end, where the settings lower its precision (None: fp32's bound)."""
        return None

    def prepare(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        """Build a candidate (runs in the measuring child process)."""
        raise NotImplementedError

    def measure(self, task: Task, config: dict, inputs: dict[str, np.ndarray], settings) -> dict:
        """Time one candidate; returns ``{"times_us": [...], "output": array}``. The default
        builds ``fresh_instances`` candidates with ``prepare`` and times each with the core
        protocol; a library that times inside its own runner overrides this."""
        return self._time_fresh(lambda: self.prepare(task, config, inputs), settings)

    def _time_fresh(self, build: Callable[[], Candidate], settings) -> dict:
        times, output = [], None
        for _ in range(self.fresh_instances):
            candidate = build()
            try:
                candidate.run()
                if output is None:
                    output = candidate.output()
                times.append(time_candidate(candidate.run, settings))
            finally:
                candidate.close()
        return {"times_us": times, "output": output}



class WholeModelRunner(ABC):
    """Role: runs a whole model and applies a plan (``kselect bench``, ``kselect.load_plan``,
    ``kselect plan apply``). Nodes for which ``runs_op`` is False go to the baseline library
    (ONNX Runtime) in segments of their own (core/plans/runtime.py)."""

    def apply(self, plan, model, out_dir: Path, stem: str | None = None) -> list[Path]:
        """Write what a deployment needs to run the plan into ``out_dir``, named after ``stem``
        (the plan file's name without ``.plan.json``: core/plans/plan.artifact_stem; None: the
        model's name); returns the files written."""
        return []

    @abstractmethod
    def model_runner(self, model, plan, in_mixed_plan: bool = False) -> Callable[[dict], list]:
        """A callable running the whole model: with the library's defaults when ``plan`` is
        None, else as the plan says. Used by ``kselect bench``. ``in_mixed_plan``: the model is
        one segment of a plan that mixes libraries (core/plans/runtime.py), so another library's
        threads run as soon as the callable returns; threads of this library that would spin
        waiting for more work must stop then, or they hold cores the next segment needs."""
        raise NotImplementedError

    # How this library's users run a model by default, where that differs from the baseline
    # kselect's plans are held to (``model_runner(model, None)``): a ``timed_alone`` candidate
    # (core/whole_model/alone.py), e.g. ``{"factory": "module:function", "args": {}}``. ``kselect
    # bench --alone`` times it beside the plan. None: the same as the baseline. (OpenVINO's own
    # default runs in bf16 on a CPU with AVX512_BF16 or AMX; kselect's baseline for it is f32.)
    users_default: dict | None = None

    def node_times(self, model, plan, feeds: list[dict], runs: int) -> tuple[float, dict[str, float]] | None:
        """``plan`` (None: the library's defaults) run whole on ``feeds`` in turn, ``runs`` times,
        timed per node: (the median whole run, us; the runner's node name -> its median us). The
        in-context costs the planner corrects its isolated times with (core/whole_model/context.py);
        None when the runner cannot time its nodes."""
        return None

    def runs_op(self, op_type: str) -> bool:
        """Whether ``model_runner`` can run a node of this ONNX op type. A plan mixing libraries
        (core/plans/runtime.py) gives an untuned node to the library of the node feeding it only if
        that library runs it; the default is a library that runs any ONNX graph."""
        return True


class TensorCrossing:
    """Role: how tensors cross between this library and others, between precisions and between
    layouts, for plans that mix them (core/cross_library/). An op leaves its output in a form
    named by a ``Label`` (core/contract/labels.py); where the next op reads another label, the
    runners convert the tensor at the boundary, and ``conversion`` / ``measure_conversion`` time
    what that costs, like a kernel (the "convert" op kind, plugins/ops/convert.py)."""

    @property
    def mixes(self) -> bool:
        """Whether this library can share a plan with others: it measures its conversions
        (``conversion``), or what crossing its runner's boundary costs (``boundary_cost``)."""
        return self.boundary_cost or type(self).conversion is not Library.conversion

    def layout_label(self, config: dict) -> Label:
        """What the neighbouring op must match to take this op's output without a conversion:
        ``"<library>:<layout>"``."""
        return Label(self.name, "NCHW")

    def input_label(self, task: Task, label: str) -> str:
        """The label this task's op reads its data input in when it runs in ``label`` and its
        producer's label differs (an input already in ``label`` is read as it is); by default
        ``label`` itself."""
        return label

    def flatten_label(self, label: str) -> Label:
        """The label in which this library's runner flattens a 4-D tensor held in ``label``
        (a Flatten before an FC): ONNX's element order is NCHW's, so by default the tensor is
        first converted to NCHW; a runner that flattens in place returns ``label``."""
        return Label(self.name, "NCHW")

    def conversion(self, label: str, direction: str, x: np.ndarray) -> Candidate | None:
        """A candidate doing what this library's runner does to a tensor at a segment boundary:
        ``direction`` "in" takes NCHW ``x`` into the layout ``label`` names, "out" takes it back
        to NCHW (its input is ``x`` already in that layout, prepared outside the timing). Its
        ``output()`` is the tensor in NCHW, for checking. None: the runner does nothing there.
        Labels ending in ":flat" are tensors that are not 4-D. Entering a library includes
        the cost of calling its runner once more (a segment more)."""
        raise NotImplementedError(f"{self.name} cannot measure layout conversions")

    def measure_conversion(self, label: str, direction: str, x: np.ndarray, settings) -> dict:
        """Time one side of a conversion (``conversion``) in the measuring child, as ``measure``
        times an op: ``{"times_us": [...], "output": x in NCHW}``; the core checks that the values
        came through unchanged. The default times the ``conversion`` candidate (nothing to time
        when it is None); a library that times inside its own runner overrides this."""
        if self.conversion(label, direction, x) is None:
            return {"times_us": [[0.0]], "output": x}
        return self._time_fresh(lambda: self.conversion(label, direction, x), settings)

    def requantized_label(self) -> Label:
        """The conversion label of an 8-bit tensor dequantized before, and quantized again after,
        an untuned op between two int8 ops (one not in ``int8_passes``). By default
        ``<name>:int8``, the label of the sides between float and int8 ops. A library whose
        float / int8 sides also change the layout, where such a round trip stays in the int8
        ops' own layout, names a label ``conversion`` measures without that change (MLAS:
        ``mlas:int8-in-place``)."""
        return Label(self.name, INT8)


@dataclass(frozen=True)
class Capabilities:
    """What a library can do, fixed once it is built: ``Library.capabilities()`` reads it off the
    library's attributes (documented on ``Library``). ``kselect plugins --json`` shows it, and the
    contract suite checks it is consistent."""

    emulated: bool
    fresh_instances: int
    plan_level_dims: tuple[str, ...]
    plans_layouts_per_op: bool
    boundary_cost: bool
    baseline: bool
    spin_dim: str | None
    default_plan_differs: bool
    precisions: tuple[str, ...]
    plan_precisions: tuple[str, ...]
    int8_passes: frozenset[str]
    accumulates_in_half: frozenset[str]

    def to_json(self) -> dict:
        return {name: sorted(value) if isinstance(value, frozenset) else value
                for name, value in self.__dict__.items()}


class Library(KernelSource, WholeModelRunner, TensorCrossing):
    """An inference library whose kernels kselect selects among.

    What kselect calls, in order, for ``kselect tune MODEL --library NAME``:

    1. ``availability()`` and ``version()``: is the library here, and which build. Records are
       keyed by (device, library name, version): a new build is tuned afresh.
    2. ``prepare_model(model)`` once, then ``supports(task)`` for every task of the model (a
       task is a group of identical conv / deconv / fc ops, each with the activation after it,
       core/models/tasks.py). Unsupported tasks run with the library's defaults, or in ONNX Runtime.
    3. ``space(task, device)``: the configurations to choose among, in the core schema
       (core/contract/space.py: categorical and integer dims with a role each, conditions, constraints),
       and ``default_config(task, device)``: the library's own choice, the baseline every
       speedup is measured against.
    4. For each config the search proposes, in a measuring child process (core/measuring/worker.py, which
       builds an instance of the same class): ``measure(task, config, inputs, settings)``. The
       default builds ``fresh_instances`` candidates with ``prepare`` and times them with the
       core protocol; the core then checks the output against a float64 reference within
       ``tolerance(task, config)``. A candidate that crashes, hangs or is wrong is recorded as
       such and never planned.
    5. The plan: per task the best config; dims named in ``plan_level_dims`` take one value
       across the whole model. ``apply(plan, model, out_dir)`` writes what a deployment needs;
       ``model_runner(model, plan)`` runs the whole model as the plan says (``kselect bench``,
       ``kselect.load_plan``), with ``plan=None`` the library's defaults. Nodes for which
       ``runs_op`` is False go to ONNX Runtime in segments of their own.

    To share a plan with other libraries (``--library a,b``) a library also describes the
    layout each op leaves its output in (``layout_label``, ``"<library>:<layout>"``) and how its
    runner converts a tensor at a segment boundary (``conversion``, timed in the measuring child
    by ``measure_conversion``), so the planner can measure and count those costs; a library whose
    runner is another process sets ``boundary_cost``.

    For mixed precision (``--precision fp32,int8``, core/precision/mixed.py) a library lists ``"int8"`` in
    ``precisions`` (it measures the int8 twin of a conv / fc task: ``task.precision == "int8"``,
    candidates quantized as ``inputs["quant"]`` says) and in ``plan_precisions`` once its runner
    runs a plan's int8 nodes; its ``conversion`` then also times the label ``<name>:int8``
    (quantize in, dequantize out), and ``int8_passes`` names the untuned ops its runner keeps
    8-bit between int8 ops.

    Required: ``name``, ``version``, ``supports``, ``space``, ``default_config``,
    ``model_runner``, and either ``prepare`` or ``measure``. Everything else has a default.
    """

    name: str = ""
    # Timings are taken under emulation: never real performance. By default, whether this process
    # itself runs under user-mode emulation (an arm64 root on an x86_64 machine, scripts/arm64-root.sh).
    emulated: bool = RUNS_EMULATED
    fresh_instances: int = 1  # candidates built and timed this many times from scratch
    plan_level_dims: tuple[str, ...] = ()  # dims that must take one value across a whole plan
    # plan-level dims offered only for ops of one form, which a model may lack (MLAS's bf16_fastmath: fully
    # connected layers ONNX Runtime runs as MatMul)
    op_specific_dims: frozenset[str] = frozenset()
    # Layouts chosen per op with the measured conversions between them counted (core/cross_library/plan.py
    # on this library alone), rather than each op's fastest config whatever the changes cost.
    plans_layouts_per_op: bool = False
    # A tensor passing between this library's runner and another library's costs more than the
    # layout sides (``conversion``) say: its ``measure`` times the label ``<name>:boundary``
    # (core/cross_library/conversions.py), counted only where a plan switches libraries.
    boundary_cost: bool = False
    # The baseline: this library's default run of a whole model is what every plan is judged
    # against, and its runner takes every node another library's runner lacks (ONNX Runtime,
    # i.e. the mlas plugin, which runs any ONNX graph). One registered library declares it.
    baseline: bool = False
    # The plan-level dim whose value 1 lets this library's worker threads spin between parallel
    # loops (0: they sleep). In a plan mixing libraries exactly one library spins
    # (core/plans/spinning.py); None: the library's workers never spin.
    spin_dim: str | None = None
    # A plan with every op at its default config does not run as the library runs a model by
    # itself (MLAS: kselect's NCHWc rewrite rather than ORT's own transformer): both are verified
    # end to end, the library's own run as the plan variant marked ``LIBRARY_DEFAULT`` (core/plans/plan.py).
    default_plan_differs: bool = False
    # The precisions this library has kernels for (core/precision/quant.py). A library listing "int8" is
    # offered the int8 twin of each conv and fc task (``Task.precision``) when a tune asks for
    # int8 (``--precision fp32,int8``); ``supports``, ``space`` and ``default_config`` answer for
    # it as for any task, and its candidates quantize as ``inputs["quant"]`` says.
    precisions: tuple[str, ...] = ("fp32",)
    # The precisions ``model_runner`` runs a whole plan in: a library measuring int8 kernels per op
    # whose runner has no int8 path yet keeps ("fp32",) here, and int8 tunes refuse it up front.
    plan_precisions: tuple[str, ...] = ("fp32",)
    # The op types of untuned nodes (an Add, a pooling, a Concat...) that ``model_runner`` runs on
    # 8-bit tensors in a plan with int8 ops. An 8-bit tensor passing from one int8 op to another
    # through any other untuned node is dequantized before it and quantized again after it, and
    # the planners count both, once per tensor (core/cross_library/problem.requantized_sides).
    int8_passes: frozenset[str] = frozenset()
    # The half precisions (bf16, fp16) whose kernels accumulate in the format itself, rounding the
    # running sum to it after every multiply-add (XNNPack's f16 kernels, as FP16 arithmetic does on
    # Arm) rather than in fp32: their candidates are also allowed what that rounding makes on the
    # data (core/precision/half.py ``accumulation_error``).
    accumulates_in_half: frozenset[str] = frozenset()


    def capabilities(self) -> Capabilities:
        """This library's capabilities as one frozen value."""
        return Capabilities(**{name: getattr(self, name) for name in Capabilities.__dataclass_fields__})
