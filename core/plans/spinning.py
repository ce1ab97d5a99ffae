"""Worker threads that spin: the plan-level dim a library declares for it (``Library.spin_dim``)
and the variants of a plan mixing libraries that give the spinning to one library each.

Worker threads that spin between parallel loops hold cores the other library's threads need:
resnet18 on 2 cores, all but the last op on ONNX Runtime, ran 27 ms with ORT's threads spinning
and XNNPack's pool yielding, 42 ms the other way round, 38 ms with neither spinning (ORT's
default session: 27 ms). So in a plan that mixes libraries exactly one library spins: the one
with the most op time in the plan as built, each other one as a variant for the end-to-end check
(``spinning_variants``). Not none: with no thread spinning every parallel loop waits for its
workers to wake, which on a VM whose vCPUs stall takes milliseconds in some periods and not in
others (alexnet's plan with none spinning ran 26.0 ms in one run, 46.9 ms in the next, with one
spinning 26.4 ms). Options are taken whatever their spinning setting, and every op of a library
that does not spin is charged what waking its workers costs per op (``ConversionTable.sleep_us``,
core/cross_library/switches.py: 31-78 us per conv for ONNX Runtime, 4-7 us for XNNPack on the AVX2 EPYC), so
the planner solves once per library that could spin and the plan's spinner is the library whose
ops would pay the most asleep (``_spinner``). Whichever spins stops at
the end of its segments (``Library.model_runner(..., in_mixed_plan=True)``): left spinning, the
threads of one segment took a core from the next (resnet101, two XNNPack ops: 251 -> 150 ms).
ONNX Runtime running only the ops a plan's libraries lack (no MLAS plan among them) does not spin
where those are data movement and element-wise ops (plugins/mlas/library.py, ``model_runner``):
its fresh sessions' idle threads held cores the plan's library waited for. Where they include a
matrix op (an LSTM left to ONNX Runtime), its segment spins: that is where the time goes.
"""

from __future__ import annotations

import copy

from kselect.core.contract import plugins
from kselect.core.plans.plan import Plan


def spin_dims(library_name: str) -> tuple[str, ...]:
    """The library's spinning dim, as a tuple (empty: its workers never spin, or it is unknown here)."""
    library = plugins.libraries().get(library_name)
    return (library.spin_dim,) if library is not None and library.spin_dim else ()


def spinning_variants(plan: Plan) -> list[tuple[str, Plan]]:
    """The cross-library plan as built, then with each other library as the one whose workers
    spin; an end-to-end run decides among them."""
    spinners = [name for name, values in plan.library_settings.items() if any(d in values for d in spin_dims(name))]
    if not plan.cross_library or not spinners:
        return [("cross-library plan", plan)]
    current = next((name for name in spinners if all(plan.library_settings[name].get(d, 0) for d in spin_dims(name)
                                                      if d in plan.library_settings[name])), None)
    variants = [(f"cross-library plan ({current or 'none'} spinning)", plan)]
    for owner in spinners:
        if owner != current:
            variants.append((f"cross-library plan ({owner or 'none'} spinning)", with_spinner(plan, owner)))
    return variants


def with_spinner(plan: Plan, owner: str | None) -> Plan:
    """The plan with ``owner``'s workers spinning and every other library's sleeping (None: none spin)."""
    settings = {name: {**values, **{d: int(name == owner) for d in spin_dims(name) if d in values}}
                for name, values in plan.library_settings.items()}

    def configured(library: str, config: dict) -> dict:
        return {**config, **{k: v for k, v in settings[library].items() if k in config}}

    nodes = {node: {**entry, "config": configured(entry["library"], entry["config"])} for node, entry in plan.nodes.items()}
    tasks = [{**entry, "config": configured(entry["library"], entry["config"])} for entry in plan.tasks]
    return Plan(plan.model, plan.device, plan.libraries, plan.emulated, plan.plan_level, tasks, nodes, plan.format,
                copy.deepcopy(plan.extra), settings)
