"""The behavioural checks every library plugin must pass (scikit-learn's ``check_estimator``):
the contract is what these check, on the library's real kernels, not what a page claims.

    from kselect.core.contract.checks import check_library
    check_library(MyLibrary())            # raises ContractError naming the first broken check

or one pytest case per check::

    @pytest.mark.parametrize("check", library_checks(MyLibrary()), ids=lambda c: c.name)
    def test_contract(check):
        check()

The checks run on a small CNN built here (a 3x3 conv with Relu, a residual Add, a strided conv
with asymmetric pads, a depthwise conv, a 1x1 conv, pooling and a Gemm) and tune it for real,
through ``kselect.core.api.tune``, with a few random configs per task.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.api import tune
from kselect.core.config import TuneConfig
from kselect.core.contract.labels import Label
from kselect.core.contract.library import Library
from kselect.core.contract.space import ROLES
from kselect.core.cross_library.conversions import conversion_task
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.runtime import library_runner
from kselect.core.precision.half import HALF_PRECISIONS
from kselect.core.precision.quant import PRECISIONS
from kselect.core.whole_model.bench import compare_outputs
from kselect.core.whole_model.context import in_context

QUICK = MeasureSettings(timeout_s=300, min_time_s=0.005, min_repeats=3, max_time_s=0.5)
TOLERANCE = 1e-3  # largest output error, relative to the output's largest magnitude, against ONNX Runtime


class ContractError(AssertionError):
    pass


def contract_model(seed: int = 0) -> onnx.ModelProto:
    """A small CNN with every op kind a library is asked about (1x3x24x24 in, 10 out)."""
    rng = np.random.default_rng(seed)
    nodes, weights = [], []

    def conv(name, x, cin, cout, k, stride=1, pads=None, group=1, relu=True):
        w = rng.standard_normal((cout, cin // group, k, k)).astype(np.float32) * np.float32((2 / (cin // group * k * k)) ** 0.5)
        weights.extend([numpy_helper.from_array(w, f"{name}.w"),
                        numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.y"], name=name,
                                      kernel_shape=[k, k], strides=[stride] * 2, group=group,
                                      pads=pads if pads is not None else [k // 2] * 4))
        if not relu:
            return f"{name}.y"
        nodes.append(helper.make_node("Relu", [f"{name}.y"], [f"{name}.relu"], name=f"{name}.relu"))
        return f"{name}.relu"

    x = conv("stem", "input", 3, 16, 3)
    y = conv("body", x, 16, 16, 3, relu=False)
    nodes.append(helper.make_node("Add", [y, x], ["sum"], name="add"))
    x = conv("down", "sum", 16, 32, 4, stride=2, pads=[1, 1, 2, 2])
    x = conv("depthwise", x, 32, 32, 3, group=32)
    x = conv("pointwise", x, 32, 48, 1)
    nodes.append(helper.make_node("MaxPool", [x], ["pooled"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("GlobalAveragePool", ["pooled"], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"))
    weights.extend([numpy_helper.from_array((rng.standard_normal((10, 48)) * 0.2).astype(np.float32), "fc.w"),
                    numpy_helper.from_array(np.zeros(10, np.float32), "fc.b")])
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["output"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "contract_cnn",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 24, 24])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 10])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@dataclass
class Check:
    name: str
    run: Callable[[], None]

    def __call__(self) -> None:
        self.run()


class _Subject:
    """The library under check and what the checks share: the model, its tasks, one tune."""

    def __init__(self, library: Library, budget: int):
        self.library = library
        self.budget = budget
        self.model = model_from_proto("contract_cnn", contract_model())

    @cached_property
    def device(self):
        return this_device()

    @cached_property
    def tasks(self):
        self.library.prepare_model(self.model)
        return [task for task in extract_tasks(self.model) if self.library.supports(task)]

    @cached_property
    def int8_tasks(self):
        """The int8 twins the library supports (none unless it lists int8 in ``precisions``)."""
        return self.twins("int8")

    def twins(self, precision: str) -> list:
        """The twins at ``precision`` the library supports (none unless it lists it in ``precisions``)."""
        if precision not in self.library.precisions:
            return []
        try:
            return [t for t in library_tasks(self.model, self.library, (precision,)) if t.precision == precision]
        except KselectError:  # it supports no task at all in that precision
            return []

    @cached_property
    def tuned(self):
        with tempfile.TemporaryDirectory() as folder:
            try:
                config = TuneConfig(search="random", budget=self.budget, db=Path(folder) / "records.db",
                                    settings=QUICK, verify=False)
                return tune(self.model, [self.library], config)
            except KselectError as exc:
                raise ContractError(f"tuning the contract model failed: {exc}") from None

    @cached_property
    def reference(self) -> list[np.ndarray]:
        import onnxruntime as ort

        session = ort.InferenceSession(self.model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, self.feeds)

    @cached_property
    def feeds(self) -> dict[str, np.ndarray]:
        return {"input": np.random.default_rng(1).standard_normal((1, 3, 24, 24)).astype(np.float32)}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractError(message)


def library_checks(library: Library, budget: int = 3) -> list[Check]:
    """The checks, in the order kselect meets a library (core/contract/library.py narrates it)."""
    s = _Subject(library, budget)

    def identity():
        _require(isinstance(library.name, str) and library.name and ":" not in library.name and "/" not in library.name,
                 f"name {library.name!r}: a non-empty word (it prefixes layout labels and record keys)")
        ok, reason = library.availability()
        _require(isinstance(ok, bool) and isinstance(reason, str), "availability() returns (bool, str)")
        _require(ok, f"{library.name} is not available here: {reason}")
        version = library.version()
        _require(isinstance(version, str) and version.strip(), "version() names the build (records are keyed by it)")
        _require(version == library.version(), "version() is stable within a process")
        capabilities = library.capabilities()
        _require(isinstance(capabilities.emulated, bool), "emulated is a bool")
        _require(isinstance(capabilities.fresh_instances, int) and capabilities.fresh_instances >= 1,
                 "fresh_instances is a count of at least 1")
        _require(all(isinstance(d, str) for d in capabilities.plan_level_dims), "plan_level_dims are dim names")
        _require(capabilities.spin_dim is None or capabilities.spin_dim in capabilities.plan_level_dims,
                 f"spin_dim {capabilities.spin_dim!r} is a plan-level dim (one library spins per plan)")
        _require("fp32" in capabilities.precisions and set(capabilities.precisions) <= set(PRECISIONS),
                 f"precisions {capabilities.precisions} hold fp32 and only {sorted(PRECISIONS)}")
        _require(set(capabilities.plan_precisions) <= set(capabilities.precisions),
                 "plan_precisions are precisions the library measures")
        _require(all(isinstance(op, str) for op in capabilities.int8_passes), "int8_passes are ONNX op types")
        _require(set(capabilities.accumulates_in_half) <= set(HALF_PRECISIONS),
                 f"accumulates_in_half {sorted(capabilities.accumulates_in_half)} names half precisions only")
        for flag in ("plans_layouts_per_op", "boundary_cost", "baseline", "default_plan_differs"):
            _require(isinstance(getattr(capabilities, flag), bool), f"{flag} is a bool")

    def supports_a_conv():
        _require(any(t.kind == "conv" for t in s.tasks), f"{library.name} supports none of the contract model's convs "
                                                         f"({', '.join(t.id for t in s.tasks) or 'no task'})")

    def spaces_hold_their_defaults():
        for task in s.tasks:
            space = library.space(task, s.device)
            _require(len(space) >= 1, f"{task.id}: the space is empty")
            default = space.normalise(library.default_config(task, s.device))
            _require(default in space, f"{task.id}: default_config {default} is not a config of its space")
            _require(isinstance(library.layout_label(default), Label),
                     f"{task.id}: layout_label returns a Label (core/contract/labels.py)")
            for dim in space.dims:
                _require(getattr(dim, "role", "") in ROLES,
                         f"{task.id}: dim {dim.name!r} has role {getattr(dim, 'role', '')!r}, not one of {ROLES}")
            _require(space.normalise(library.default_config(task, s.device)) == default,
                     f"{task.id}: default_config changes between calls")

    def plan_level_dims_are_dims():
        names = {dim.name for task in s.tasks + s.int8_tasks for dim in library.space(task, s.device).dims}
        # a dim this build or CPU lacks (missing_dims), or one of ops the contract model has none of, may be absent
        absent_here = set(library.missing_dims()) | set(library.op_specific_dims)
        missing = [d for d in library.plan_level_dims if d not in names and d not in absent_here]
        _require(not missing, f"plan_level_dims {missing} are in no task's space")

    def tunes_and_measures_its_defaults():
        for outcome in s.tuned.tunings[library.name].outcomes:
            default = outcome.default
            _require(default is not None and default.status == "ok",
                     f"{outcome.task.id}: the library's own config did not measure ok against the float64 reference "
                     f"({default.status + ': ' + default.reason if default else 'not measured'})")
            _require(default.median_us > 0 and default.count >= 1, f"{outcome.task.id}: no timing for the default")

    def a_plan_names_every_supported_node():
        plan = s.tuned.plan
        nodes = {node for task in s.tasks for node in task.nodes}
        _require(set(plan.nodes) == nodes, f"the plan covers {sorted(plan.nodes)}, the tasks {sorted(nodes)}")
        _require(plan.emulated == library.emulated, "the plan carries the library's emulated label")
        _require(set(plan.plan_level) <= set(library.plan_level_dims), "plan-level settings are plan_level_dims")

    def default_runner_matches_onnxruntime():
        _matches(library_runner_output(None), "with the library's defaults")

    def plan_runner_matches_onnxruntime():
        _matches(library_runner_output(s.tuned.plan), "with the tuned plan")

    def library_runner_output(plan):
        runner = library_runner(library, s.model, plan)
        try:
            return runner(dict(s.feeds))
        finally:
            runner.close()

    def _matches(outputs, how):
        error = compare_outputs(s.reference, outputs)
        _require(error <= TOLERANCE, f"the whole model {how} differs from ONNX Runtime's output: error {error:.2e}")

    def node_times_cover_the_plan():
        """A library timing a whole run per node (``node_times``): every node of its tuned plan
        is found in those times (core/whole_model/context.py), each with a time."""
        timed = library.node_times(s.model, s.tuned.plan, [dict(s.feeds)], 2)
        if timed is None:
            return
        whole_us, per_node = timed
        run = in_context(s.model, whole_us, per_node)
        _require(set(run.ops_us) == set(s.tuned.plan.nodes),
                 f"node_times found {sorted(run.ops_us)} of the plan's nodes {sorted(s.tuned.plan.nodes)}")
        _require(whole_us > 0 and all(us >= 0 for us in per_node.values()), "node_times: negative or no time")

    def runs_op_answers():
        for op_type in ("Conv", "Relu", "Add", "MaxPool", "Gemm", "NoSuchOp"):
            _require(isinstance(library.runs_op(op_type), bool), f"runs_op({op_type!r}) is not a bool")

    def conversions_keep_values():
        if not library.mixes:
            return
        labels = {library.layout_label(library.space(t, s.device).normalise(library.default_config(t, s.device)))
                  for t in s.tasks}
        for label in labels:
            _require(label.startswith(f"{library.name}:"), f"layout label {label!r} is not '{library.name}:<layout>'")
        with MeasureWorker(library, QUICK) as worker:
            for label in sorted(labels):
                for direction in ("in", "out"):
                    result = worker.measure(conversion_task(label, direction, [1, 16, 12, 12]), {})
                    _require(result.status == "ok", f"conversion {direction} of {label}: {result.status} {result.reason}")

    def defaults_of_twins_match_the_reference(precision: str, twins: list):
        """Each twin's space holds its default, which measures ok (within the precision's tolerance)."""
        _require(bool(twins), f"precisions lists {precision} but no {precision} twin of a conv or fc is supported")
        with MeasureWorker(library, QUICK) as worker:
            for task in twins:
                space = library.space(task, s.device)
                default = space.normalise(library.default_config(task, s.device))
                _require(default in space, f"{task.id}: the {precision} default {default} is not in its space")
                result = worker.measure(task, default)
                _require(result.status == "ok", f"{task.id}: {precision} default {result.status}: {result.reason}")

    def int8_defaults_match_the_reference():
        """A library listing int8: each int8 twin it supports has a space holding its default,
        which measures ok within the int8 tolerance (core/precision/quant.py)."""
        if "int8" in library.precisions:
            defaults_of_twins_match_the_reference("int8", s.int8_tasks)

    def half_defaults_match_the_reference():
        """A library listing bf16 or fp16: it supports a twin of at least one conv or fc in each, whose
        space holds its default, which measures ok within that format's tolerance (core/precision/half.py)."""
        for precision in sorted(set(library.precisions) & set(HALF_PRECISIONS)):
            defaults_of_twins_match_the_reference(precision, s.twins(precision))

    checks = [identity, supports_a_conv, spaces_hold_their_defaults, plan_level_dims_are_dims,
              tunes_and_measures_its_defaults, a_plan_names_every_supported_node, default_runner_matches_onnxruntime,
              plan_runner_matches_onnxruntime, node_times_cover_the_plan, runs_op_answers, conversions_keep_values,
              int8_defaults_match_the_reference, half_defaults_match_the_reference]
    return [Check(f.__name__, f) for f in checks]


def check_library(library: Library, budget: int = 3) -> None:
    """Runs every check in order; raises ``ContractError`` naming the first that fails."""
    for check in library_checks(library, budget):
        try:
            check()
        except ContractError as exc:
            raise ContractError(f"{library.name}: {check.name}: {exc}") from None
