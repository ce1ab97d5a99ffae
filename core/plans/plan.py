"""From records to a plan: per op, the best measured config; dims a library can only set once
per model (``Library.plan_level_dims``, e.g. a session's thread count) are chosen to minimise
the whole model's time. A plan is JSON that apps read (schema in docs/plan-schema.md)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.errors import KselectError, OutputError
from kselect.core.measuring.device import Device
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task, extract_tasks
from kselect.core.paths import refuse_inputs
from kselect.core.records.store import Record

PLAN_FORMAT = "kselect-plan/1"
# A non-default config must beat the default by more than its measured noise, and at least this.
MIN_GAIN = 0.02
MAX_ASSIGNMENTS = 4096


@dataclass
class TaskChoice:
    task: Task
    config: dict
    time_us: float
    default_config: dict
    default_us: float | None
    samples: int
    emulated: bool


def _consistent(config: dict, assignment: dict) -> bool:
    return all(config[name] == value for name, value in assignment.items() if name in config)


def pick_record(records: list[Record], default_key: str, assignment: dict) -> Record | None:
    """The fastest ok record consistent with ``assignment``; the default's record instead unless
    the fastest beats it by more than the noise of either (at least MIN_GAIN)."""
    candidates = [r for r in records if r.result.status == "ok" and _consistent(r.config, assignment)]
    if not candidates:
        return None
    best = min(candidates, key=lambda r: r.result.median_us)
    default = next((r for r in candidates if r.config_key == default_key), None)
    if default is not None and best is not default:
        noise = max(MIN_GAIN, best.result.spread or 0.0, default.result.spread or 0.0)
        if best.result.median_us > default.result.median_us * (1 - noise):
            return default
    return best


def _evaluate(tasks, records, defaults, assignment) -> tuple[float, list[Record]] | None:
    picks, total = [], 0.0
    for task in tasks:
        record = pick_record(records.get(task.key, []), config_key(defaults[task.key]), assignment)
        if record is None:
            return None
        picks.append(record)
        total += record.result.median_us * len(task.nodes)
    return total, picks


def choose(tasks: list[Task], records: dict[str, list[Record]], defaults: dict[str, dict],
           plan_level_dims: tuple[str, ...]) -> tuple[dict, list[TaskChoice]]:
    """Returns (plan-level assignment, one choice per task) minimising the summed op time. The
    library's default plan-level values are kept unless another assignment is clearly faster."""
    values: dict[str, set] = {name: set() for name in plan_level_dims}
    default_assignment: dict = {}
    for task in tasks:
        for name in plan_level_dims:
            if name in defaults[task.key]:
                default_assignment.setdefault(name, defaults[task.key][name])
        for record in records.get(task.key, []):
            for name in plan_level_dims:
                if name in record.config and record.result.status == "ok":
                    values[name].add(json.dumps(record.config[name]))
    names = [n for n in plan_level_dims if values[n]]
    combos = itertools.islice(itertools.product(*(sorted(values[n]) for n in names)), MAX_ASSIGNMENTS)
    assignments = [dict(zip(names, (json.loads(v) for v in combo))) for combo in combos]

    best = None  # (total, assignment, picks)
    for assignment in assignments:
        evaluated = _evaluate(tasks, records, defaults, assignment)
        if evaluated and (best is None or evaluated[0] < best[0]):
            best = (evaluated[0], assignment, evaluated[1])
    if best is None:
        missing = [t.id for t in tasks if not any(r.result.status == "ok" for r in records.get(t.key, []))]
        raise KselectError(f"no valid measurement for tasks {', '.join(missing) or '(none consistent)'}: run kselect tune first")
    default = _evaluate(tasks, records, defaults, default_assignment)
    if default and best[0] > default[0] * (1 - MIN_GAIN / 2):
        best = (default[0], default_assignment, default[1])
    _, assignment, picks = best

    choices = []
    for task, record in zip(tasks, picks):
        default_record = next((r for r in records.get(task.key, []) if r.config_key == config_key(defaults[task.key])), None)
        default_us = default_record.result.median_us if default_record and default_record.result.status == "ok" else None
        choices.append(TaskChoice(task, record.config, record.result.median_us, defaults[task.key], default_us,
                                  len(records.get(task.key, [])), record.emulated))
    return assignment, choices


class PlanTask(TypedDict, total=False):
    """A plan's entry per task (per task, library and config in cross-library plans): the task's
    JSON (``Task.to_json``: id, key, kind, input, weight, output, attrs, bias, nodes) and what was
    chosen for it (docs/plan-schema.md)."""
    id: str
    key: str
    kind: str
    input: list[int]
    weight: list[int]
    output: list[int]
    attrs: dict
    bias: bool
    activation: list  # the activation ops fused after the op, when there are any
    nodes: list[str]
    library: str
    config: dict
    time_us: float  # median of the chosen config
    default_config: dict  # the library's own choice, the baseline
    default_us: float | None
    samples: int  # configs measured
    emulated: bool


class PlanConversion(TypedDict, total=False):
    """A tensor converted on its way into an op, or where an untuned op takes it (``at``)."""
    at: str
    tensor: str
    from_label: str
    to_label: str
    time_us: float


class PlanNode(TypedDict, total=False):
    """A plan's entry per ONNX node: its task, library and config; cross-library plans (and
    libraries planning layouts per op) add the label, the op's time and the conversions into it."""
    task: str
    library: str
    config: dict
    label: str
    time_us: float
    emulated: bool
    conversions: list[PlanConversion]


def reduced_nodes(plan: "Plan") -> dict[str, str]:
    """The nodes a plan runs in a reduced precision (int8, bf16, fp16), each with it: those of its
    tasks of that precision that the plan holds."""
    return {node: task["precision"] for task in plan.tasks
            if isinstance(task, dict) and task.get("precision", "fp32") != "fp32"
            for node in task.get("nodes", []) if node in plan.nodes}


def same_ops(a: "Plan", b: "Plan") -> bool:
    """Whether two plans run every node on the same library, task and config."""
    def ops(plan):
        return {node: (e["library"], e["task"], config_key(e["config"])) for node, e in plan.nodes.items()}
    return ops(a) == ops(b)


def runs_as(plan: "Plan", reference: "Plan") -> bool:
    """Whether ``plan`` runs exactly as ``reference``, a ``LIBRARY_DEFAULT`` plan, does: that
    library's default run, the same ops and plan-level settings."""
    return (bool(plan.extra.get(LIBRARY_DEFAULT)) and bool(reference.extra.get(LIBRARY_DEFAULT))
            and plan.libraries == reference.libraries and plan.plan_level == reference.plan_level
            and same_ops(plan, reference))


def int8_nodes(plan: "Plan") -> set[str]:
    """The nodes a plan runs in int8."""
    return {node for node, precision in reduced_nodes(plan).items() if precision == "int8"}


def plan_task(task: Task, nodes: list[str], library: str, config: dict, time_us: float, default_config: dict,
              default_us: float | None, samples: int, emulated: bool) -> PlanTask:
    return PlanTask(**{**task.to_json(), "nodes": list(nodes)}, library=library, config=config,
                    time_us=round(time_us, 3), default_config=default_config,
                    default_us=round(default_us, 3) if default_us else None, samples=samples, emulated=emulated)


def plan_node(task: Task, library: str, config: dict, **layout) -> PlanNode:
    """``layout``: label, time_us, emulated, conversions, where the plan has them."""
    return PlanNode(task=task.id, library=library, config=config, **layout)


@dataclass
class Plan:
    model: dict
    device: dict
    libraries: dict[str, str]
    emulated: bool
    plan_level: dict
    tasks: list[PlanTask]
    nodes: dict[str, PlanNode]
    format: str = PLAN_FORMAT
    extra: dict = field(default_factory=dict)
    library_settings: dict[str, dict] = field(default_factory=dict)  # library -> its plan-level settings

    def __post_init__(self):
        if not self.library_settings and len(self.libraries) == 1:
            self.library_settings = {next(iter(self.libraries)): dict(self.plan_level)}

    def to_json(self) -> dict:
        return {"format": self.format, "model": self.model, "device": self.device, "libraries": self.libraries,
                "emulated": self.emulated, "plan_level": self.plan_level, "library_settings": self.library_settings,
                "tasks": self.tasks, "nodes": self.nodes, **({"extra": self.extra} if self.extra else {})}

    @property
    def cross_library(self) -> bool:
        return len(self.libraries) > 1

    def for_library(self, name: str) -> "Plan":
        """The part of this plan one library runs: its nodes and its plan-level settings, as a
        single-library plan (what ``Library.model_runner`` and ``Library.apply`` take)."""
        extra = {key: self.extra[key] for key in ("precision", LIBRARY_DEFAULT) if key in self.extra}
        if name in self.extra.get(LIBRARY_DEFAULT_PARTS, ()):
            extra[LIBRARY_DEFAULT] = True
        return Plan(self.model, self.device, {name: self.libraries[name]}, self.emulated,
                    dict(self.library_settings.get(name, {})), [t for t in self.tasks if t["library"] == name],
                    {node: entry for node, entry in self.nodes.items() if entry["library"] == name}, extra=extra)

    def save(self, path: str | Path) -> None:
        """Written whole or not at all: to a file beside it, then renamed over it."""
        write_atomically(Path(path), json.dumps(self.to_json(), indent=2) + "\n")

    @property
    def library(self) -> str:
        return next(iter(self.libraries))

    def estimated_us(self) -> float:
        return sum(t["time_us"] * len(t["nodes"]) for t in self.tasks)


def build_plan(model: Model, device: Device, library, library_version: str, tasks: list[Task],
               records: dict[str, list[Record]], defaults: dict[str, dict]) -> Plan:
    assignment, choices = choose(tasks, records, defaults, library.plan_level_dims)
    task_entries, nodes = [], {}
    for choice in choices:
        task = choice.task
        task_entries.append(plan_task(task, task.nodes, library.name, choice.config, choice.time_us,
                                      choice.default_config, choice.default_us, choice.samples, choice.emulated))
        for node in task.nodes:
            nodes[node] = plan_node(task, library.name, choice.config)
    return Plan(
        model={"name": model.name, "fingerprint": model.fingerprint(), "inputs": model.input_shapes},
        device=device.to_json(), libraries={library.name: library_version}, emulated=library.emulated,
        plan_level=assignment, tasks=task_entries, nodes=nodes)


def op_level(config: dict, plan_level_dims) -> dict:
    return {k: v for k, v in config.items() if k not in plan_level_dims}


LIBRARY_DEFAULT = "library_default"  # a plan's extra key: run it as the library runs the model by itself
# a plan across libraries' extra key: the libraries whose own plan was their LIBRARY_DEFAULT one;
# their part runs marked so (``Plan.for_library``), as the library by itself ran in its race
LIBRARY_DEFAULT_PARTS = "library_default_parts"
# a plan's extra key: the summed isolated time, us, of its ops and the conversions its planner
# counted (core/whole_model/prediction.py)
PREDICTED_US = "predicted_us"
PREDICTED_BASIS = "predicted_basis"  # what PREDICTED_US covers, when not only isolated op and conversion times
ISOLATED_US = "isolated_us"  # beside a PREDICTED_US corrected in context: the isolated sum it was corrected from


def plan_variants(model: Model, device: Device, library, library_version: str, tasks: list[Task],
                  records: dict[str, list[Record]], defaults: dict[str, dict]) -> list[tuple[str, Plan]]:
    """The tuned plan, then simpler ones to fall back on when it loses end to end: the best
    plan-level settings with every op's own dims at the library default, then the library's
    defaults throughout, marked ``LIBRARY_DEFAULT``: the library runs it as it runs the model
    by itself (MLAS: ONNX Runtime's default session on the original model), which a tuned plan
    whose ops all kept their default configs need not be (``Library.default_plan_differs``)."""
    dims = library.plan_level_dims

    def only(keep) -> dict[str, list[Record]]:
        return {key: [r for r in rs if keep(key, r)] for key, rs in records.items()}

    settings_only = only(lambda key, r: op_level(r.config, dims) == op_level(defaults[key], dims))
    default_only = only(lambda key, r: r.config_key == config_key(defaults[key]))
    variants = [("tuned", records), ("settings only", settings_only), ("library default", default_only)]
    plans: list[tuple[str, Plan]] = []
    index_of: dict[str, int] = {}
    for name, subset in variants:
        try:
            plan = build_plan(model, device, library, library_version, tasks, subset, defaults)
        except KselectError:
            continue  # e.g. a default config that failed: that variant cannot be built
        library_default = name == "library default"
        if library_default:
            plan.extra[LIBRARY_DEFAULT] = True
        key = json.dumps([plan.nodes, plan.plan_level, library_default and library.default_plan_differs], sort_keys=True)
        if key in index_of:  # the same plan as a more tuned variant: keep it once, by its simpler name
            plans[index_of[key]] = (name, plan)
        else:
            index_of[key] = len(plans)
            plans.append((name, plan))
    return plans


def artifact_stem(plan_path: str | Path) -> str:
    """What a plan's artifacts are named after: its file's name without ``.plan.json``
    (``a.plan.json`` -> ``a``, whose MLAS model is ``a.kselect.onnx``), so two plans of one model
    never share an artifact."""
    return Path(plan_path).name.removesuffix(".json").removesuffix(".plan")


def write_atomically(path: Path, content: str | bytes) -> None:
    """``path`` holds ``content`` or what it held before, never a part (a full disk, a kill): it
    is written to a file beside it, then renamed over it. A path that is not a regular file (a
    device node, a FIFO, a folder), or a file the running command reads (core/paths.protect_inputs),
    is refused, never replaced."""
    import os
    import tempfile

    path = Path(path)
    if path.exists() and not path.is_file():
        raise KselectError(f"{path} is not a regular file: kselect does not replace it")
    refuse_inputs(path, "an output")
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
        os.replace(partial, path)
    except OSError as exc:
        Path(partial).unlink(missing_ok=True)
        kept = " (what it held before is kept)" if path.exists() else ""
        raise OutputError(exc.errno, f"cannot write {path}: {exc.strerror or exc}{kept}") from None
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


MAX_PLAN_BYTES = 512 * 2**20
_PLAN_KEYS = {"format": str, "model": dict, "device": dict, "libraries": dict, "emulated": bool, "plan_level": dict,
              "tasks": list, "nodes": dict, "extra": dict, "library_settings": dict}
_OPTIONAL_PLAN_KEYS = {"extra", "library_settings"}
_TASK_KEYS = {"id": str, "key": str, "kind": str, "input": list, "weight": list, "output": list, "attrs": dict,
              "bias": bool, "nodes": list, "library": str, "config": dict, "time_us": (int, float, type(None)),
              "default_config": (dict, type(None)), "default_us": (int, float, type(None)), "samples": int,
              "emulated": bool, "activation": list, "precision": str}
_REQUIRED_TASK_KEYS = {"id", "key", "kind", "input", "weight", "output", "attrs", "bias", "nodes", "library", "config"}
_NODE_KEYS = {"task": str, "library": str, "config": dict, "label": str, "time_us": (int, float), "emulated": bool,
              "conversions": list}
_REQUIRED_NODE_KEYS = {"task", "library", "config"}


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a number",
                        float: "a number", type(None): "null"}[k] for k in kinds)


def _check_fields(data, kinds: dict, required: set, where: str) -> None:
    if not isinstance(data, dict):
        raise KselectError(f"{where} is {type(data).__name__}, not an object")
    unknown = sorted(set(data) - set(kinds))
    if unknown:
        raise KselectError(f"{where} has an unknown field {unknown[0]!r}")
    missing = sorted(required - set(data))
    if missing:
        raise KselectError(f"{where} lacks the field {missing[0]!r}")
    for name, value in data.items():
        kind = kinds[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in
                                           (kind if isinstance(kind, tuple) else (kind,))):
            raise KselectError(f"{where}: {name!r} is {json.dumps(value)[:40]}, not {_type_name(kind)}")


def check_plan_json(data) -> None:
    """The one check of a plan's structure (docs/plan-schema.md), before anything reads it: every
    field of the type it must have, no unknown field, and plan-level settings as objects of
    scalars. What the values mean for a model and a library is ``validate_plan``'s part."""
    _check_fields(data, _PLAN_KEYS, set(_PLAN_KEYS) - _OPTIONAL_PLAN_KEYS, "the plan")
    for name, version in data["libraries"].items():
        if not isinstance(version, str):
            raise KselectError(f"the plan's library {name!r} has version {json.dumps(version)[:40]}, not a string")
    settings = {"plan_level": data["plan_level"], **{f"library_settings[{name!r}]": values
                                                     for name, values in data.get("library_settings", {}).items()}}
    for where, values in settings.items():
        if not isinstance(values, dict):
            raise KselectError(f"the plan's {where} is {type(values).__name__}, not an object")
        for key, value in values.items():
            if not isinstance(value, (str, int, float, bool)) or value is None:
                raise KselectError(f"the plan's {where}: {key!r} is {json.dumps(value)[:40]}, not a single value")
    for index, task in enumerate(data["tasks"]):
        _check_fields(task, _TASK_KEYS, _REQUIRED_TASK_KEYS, f"the plan's task {index}")
        if not all(isinstance(node, str) for node in task["nodes"]):
            raise KselectError(f"the plan's task {index}: 'nodes' must be node names")
        for shape in ("input", "weight", "output"):
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in task[shape]):
                raise KselectError(f"the plan's task {index}: {shape!r} must be a list of integers")
    for node, entry in data["nodes"].items():
        _check_fields(entry, _NODE_KEYS, _REQUIRED_NODE_KEYS, f"the plan's node {node!r}")


def load_plan_file(path: str | Path) -> Plan:
    """A plan file, its structure checked (``check_plan_json``): a bad one is one line."""
    path = Path(path)
    if not path.is_file():
        raise KselectError(f"no such plan file: {path}")
    try:
        if path.stat().st_size > MAX_PLAN_BYTES:
            raise KselectError(f"{path} is larger than {MAX_PLAN_BYTES >> 20} MB: not a kselect plan")
        data = json.loads(path.read_text())
    except RecursionError:
        raise KselectError(f"{path} is not a valid kselect plan (nested too deeply)") from None
    except (ValueError, OSError) as exc:
        raise KselectError(f"{path} is not a valid kselect plan ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise KselectError(f"{path} is not a kselect plan (format {found!r}, expected {PLAN_FORMAT!r})")
    try:
        check_plan_json(data)
    except KselectError as exc:
        raise KselectError(f"{path} is not a valid kselect plan: {exc}") from None
    return Plan(data["model"], data["device"], data["libraries"], data["emulated"], data["plan_level"],
                data["tasks"], data["nodes"], data["format"], data.get("extra", {}), data.get("library_settings", {}))


def check_plan(plan: Plan, model: Model, device: Device, library_versions: dict[str, str], force: bool = False) -> list[str]:
    """Refuses a plan made for another model, device or library build (unless ``force``); returns
    the mismatches that ``force`` let through."""
    problems = []
    if plan.model.get("fingerprint") != model.fingerprint():
        problems.append(f"the plan is for model {plan.model.get('name')!r} ({plan.model.get('fingerprint')}), not this {model.name!r} ({model.fingerprint()})")
    if plan.device.get("fingerprint") != device.fingerprint:
        problems.append(f"the plan was tuned on another device ({plan.device.get('cpu_model')}, {plan.device.get('fingerprint')})")
    for name, version in plan.libraries.items():
        if name not in library_versions:
            problems.append(f"the plan uses library {name!r}, which is not available here")
        elif library_versions[name] != version:
            problems.append(f"the plan was tuned with {name} {version}, this is {name} {library_versions[name]}")
    if problems and not force:
        raise KselectError(problems[0] + " (use --force to run it anyway)")
    return problems


def validate_plan(plan: Plan, model: Model, device: Device) -> None:
    """Refuses, in one line, a plan that does not fit ``model`` and each library's space here:
    a node the model lacks or that is not a tuned op, a library the plan does not declare, an
    empty config, or a config (plan-level settings included) outside the library's space for that
    op (a value such as ``pointwise_batch='not-a-number'`` would otherwise reach a native library
    and abort it). Run before a plan is benchmarked, applied or loaded."""
    if not isinstance(plan.nodes, dict) or not plan.nodes:
        raise KselectError("the plan has no nodes")
    if not isinstance(plan.emulated, bool):
        raise KselectError(f"the plan's 'emulated' is {plan.emulated!r}, not true or false")
    task_of = {node: task for task in extract_tasks(model) for node in task.nodes}
    precision_of = {node: entry.get("precision", "fp32") for entry in plan.tasks if isinstance(entry, dict)
                    for node in entry.get("nodes", [])}
    graph_nodes = {node.name for node in model.proto.graph.node}
    spaces: dict[tuple[str, str], object] = {}
    node_configs: dict[str, dict] = {}  # library -> task key -> (space, a node's config, task id)
    prepared: set[str] = set()
    for node, entry in plan.nodes.items():
        library_name = entry.get("library") if isinstance(entry, dict) else None
        config = entry.get("config") if isinstance(entry, dict) else None
        if node not in graph_nodes:
            raise KselectError(f"the plan names node {node!r}, which {model.name} does not have")
        if node not in task_of:
            raise KselectError(f"the plan configures node {node!r}, which is not an op kselect tunes")
        if library_name not in plan.libraries:
            raise KselectError(f"node {node!r} is planned on {library_name!r}, which the plan does not declare "
                               f"(it declares {', '.join(plan.libraries)})")
        if not isinstance(config, dict) or not config:
            raise KselectError(f"node {node!r} has an empty or malformed config")
        library = plugins.get_library(library_name)
        task = task_of[node].at_precision(precision_of.get(node, "fp32"))
        if task.precision not in library.precisions:
            raise KselectError(f"node {node!r} is planned in {task.precision} on {library_name}, which has no "
                               f"{task.precision} kernels")
        if not library.supports(task):
            raise KselectError(f"{library_name} does not run node {node!r} ({task.kind} {task.describe_attrs()})")
        key = (library_name, task.key)
        if library_name not in prepared:
            library.prepare_model(model)
            prepared.add(library_name)
        if key not in spaces:
            spaces[key] = library.space(task, device)
        space = spaces[key]
        try:
            normalised = space.normalise(config)
        except (TypeError, ValueError):
            normalised = None
        if normalised is None or set(normalised) != set(config) or normalised not in space:
            shown = ", ".join(f"{k}={v!r}" for k, v in config.items())
            raise KselectError(f"node {node!r}: config {{{shown}}} is not in {library_name}'s space for this op "
                               f"(`kselect space {model.name} --library {library_name} --task {task.id}` shows it)")
        node_configs.setdefault(library_name, {})[key] = (space, normalised, task.id)
    for library_name in plan.libraries:
        _check_plan_level(plan, plugins.get_library(library_name), node_configs.get(library_name, {}), model)


def _check_plan_level(plan: Plan, library, node_configs: dict, model: Model) -> None:
    """A library's plan-level settings (``library_settings``, what a whole-model runner and
    ``apply`` hand the library as they are): each one of its ``plan_level_dims``, with a value its
    ops' spaces hold (``threads=999``, ``spinning=5`` or ``pointwise_batch='not-a-number'`` would
    reach ONNX Runtime's session options and abort it)."""
    settings = plan.library_settings.get(library.name, plan.plan_level if len(plan.libraries) == 1 else {})
    if not isinstance(settings, dict):
        raise KselectError(f"the plan's settings for {library.name} are {type(settings).__name__}, not an object")
    for name, value in settings.items():
        if name not in library.plan_level_dims:
            known = ", ".join(library.plan_level_dims) or "none"
            raise KselectError(f"the plan's plan-level setting {name}={value!r} is not one of {library.name}'s "
                               f"(its plan-level settings: {known})")
        for space, config, task_id in node_configs.values():
            taken = {c[name] for c in space.enumerate() if name in c}  # a dim may apply to some configs only
            if taken and value not in taken:
                raise KselectError(f"the plan's plan-level setting {name}={value!r} is not in {library.name}'s "
                                   f"space (`kselect space {model.name} --library {library.name} --task {task_id}` "
                                   "shows it)")
