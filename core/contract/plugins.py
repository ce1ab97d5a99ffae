"""The plugin manager: built-in plugins and third-party ones (entry-point group ``kselect``)
are loaded the same way, then asked through the hooks in ``hookspecs``.

``KSELECT_PLUGINS=mlas,xnnpack`` restricts which library and third-party plugins load; the
built-in search backends, model zoo, op kinds and metrics always load, since every command needs them.
``KSELECT_TRACE=1`` prints every hook call (pluggy's tracing).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from importlib import metadata

import pluggy

from kselect.core.contract import hookspecs
from kselect.core.errors import KselectError

ENTRY_POINT_GROUP = "kselect"

# name -> module; registered exactly like third-party plugins.
CORE_PLUGINS = {
    "ops": "kselect.plugins.ops",
    "metrics": "kselect.core.precision.accuracy",
    "zoo": "kselect.core.models.zoo_plugin",
    "random": "kselect.search.random",
    "exhaustive": "kselect.search.exhaustive",
    "xgb": "kselect.search.xgb",
    "tpe": "kselect.search.tpe",
}
LIBRARY_PLUGINS = {
    "mlas": "kselect.plugins.mlas",
    "xnnpack": "kselect.plugins.xnnpack",
    "acl": "kselect.plugins.acl",
    "openvino": "kselect.plugins.openvino",
}

_pm: pluggy.PluginManager | None = None
_libraries: dict | None = None  # one instance of each library per process
_op_kinds: dict | None = None


def allowed_plugins() -> set[str] | None:
    value = os.environ.get("KSELECT_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager("kselect")
    pm.add_hookspecs(hookspecs)
    allowed = allowed_plugins()
    for name, module_name in CORE_PLUGINS.items():
        pm.register(importlib.import_module(module_name), name=name)
    for name, module_name in LIBRARY_PLUGINS.items():
        if allowed is None or name in allowed:
            module = importlib.import_module(module_name)
            if hasattr(module, "register_libraries"):
                pm.register(module, name=name)
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and entry_point.name not in allowed:
            continue
        if pm.get_plugin(entry_point.name) is not None:
            continue
        try:
            pm.register(entry_point.load(), name=entry_point.name)
        except Exception as exc:  # a broken third-party plugin must not take kselect down
            print(f"kselect: plugin {entry_point.name!r} failed to load: {exc}", file=sys.stderr)
    if os.environ.get("KSELECT_TRACE"):
        pm.trace.root.setwriter(lambda text: print(text, end="", file=sys.stderr))
        pm.enable_tracing()
    _pm = pm
    return pm


def _collect(hook) -> list[tuple]:
    found: list[tuple] = []
    hook(register=lambda *args: found.append(args))
    return found


def libraries() -> dict:
    """Every registered library by name: the same instances for the whole process."""
    global _libraries
    if _libraries is None:
        _libraries = {lib.name: lib for (lib,) in _collect(plugin_manager().hook.register_libraries)}
    return _libraries


def op_kinds() -> dict:
    """Every registered op kind by name (core/contract/opkind.py): the same instances for the whole process."""
    global _op_kinds
    if _op_kinds is None:
        _op_kinds = {kind.name: kind for (kind,) in _collect(plugin_manager().hook.register_op_kinds)}
    return _op_kinds


def metrics() -> dict:
    """Accuracy metrics by name (core/precision/accuracy.py), the built-in ones and every plugin's."""
    return dict(_collect(plugin_manager().hook.register_metrics))


def baseline_library():
    """The library declaring ``baseline`` (core/contract/library.py): its default session is what plans
    are judged against and it runs the nodes other libraries lack."""
    found = [lib for lib in libraries().values() if lib.baseline]
    if len(found) != 1:
        raise KselectError(f"exactly one library plugin must declare itself the baseline (found "
                           f"{', '.join(lib.name for lib in found) or 'none'})")
    return found[0]


def searchers() -> dict:
    return dict(_collect(plugin_manager().hook.register_searchers))


def models() -> dict:
    return {name: (description, build) for name, description, build in _collect(plugin_manager().hook.register_models)}


def get_library(name: str):
    libs = libraries()
    if name not in libs:
        known = ", ".join(sorted(libs)) or "none"
        raise KselectError(f"unknown library {name!r} (available plugins: {known})")
    lib = libs[name]
    ok, reason = lib.availability()
    if not ok:
        raise KselectError(f"library {name!r} is not available here: {reason}")
    return lib


def select_libraries(spec: str) -> list:
    """``--library`` values: one name, names joined by commas, or ``all`` (every available
    library that runs natively here). Timings taken under emulation never mix with native ones."""
    if spec == "all":
        available = [lib for lib in libraries().values() if lib.availability()[0]]
        chosen = [lib for lib in available if not lib.emulated] or available
        if len(chosen) > 1:
            chosen = [lib for lib in chosen if lib.mixes]
        if not chosen:
            raise KselectError("no library plugin is available here (see `kselect plugins`)")
        return chosen
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names or len(set(names)) != len(names):
        raise KselectError(f"--library {spec!r}: give one library, several joined by commas, or 'all'")
    chosen = [get_library(name) for name in names]
    emulated = [lib.name for lib in chosen if lib.emulated]
    if emulated and len(emulated) != len(chosen):
        raise KselectError(f"cannot mix {', '.join(emulated)} (timed under emulation on this machine) with natively "
                           f"timed libraries: tune {' and '.join(emulated)} on its own")
    unmixable = [lib.name for lib in chosen if not lib.mixes]
    if len(chosen) > 1 and unmixable:
        raise KselectError(f"{', '.join(unmixable)} cannot share a plan with other libraries yet (no measured "
                           f"conversions to or from other libraries): tune it on its own")
    return chosen


def get_searcher(name: str):
    found = searchers()
    if name not in found:
        raise KselectError(f"unknown search {name!r} (choose from: {', '.join(sorted(found))})")
    return found[name]


@dataclass
class PluginInfo:
    name: str
    kind: str
    version: str
    status: str
    provides: list[str]
    capabilities: dict | None = None  # a library's ``Library.capabilities()``, when it is available


def _distribution_version(module) -> str:
    top = module.__name__.split(".")[0]
    for dist_name in metadata.packages_distributions().get(top, []):
        return metadata.version(dist_name)
    return getattr(module, "__version__", "")


def plugin_infos() -> list[PluginInfo]:
    """Every loaded plugin with its kind, version and status (for ``kselect plugins``)."""
    pm = plugin_manager()
    infos = []
    for name, plugin in pm.list_name_plugin():
        found_libraries = _collect(lambda register: plugin.register_libraries(register)) if hasattr(plugin, "register_libraries") else []
        found_searchers = _collect(lambda register: plugin.register_searchers(register)) if hasattr(plugin, "register_searchers") else []
        found_models = _collect(lambda register: plugin.register_models(register)) if hasattr(plugin, "register_models") else []
        found_kinds = _collect(lambda register: plugin.register_op_kinds(register)) if hasattr(plugin, "register_op_kinds") else []
        found_metrics = _collect(lambda register: plugin.register_metrics(register)) if hasattr(plugin, "register_metrics") else []
        if found_libraries:
            for (lib,) in found_libraries:
                ok, reason = lib.availability()
                version = lib.version() if ok else ""
                status = ("available" + (" (emulated)" if lib.emulated else "") + (f": {reason}" if reason else "")
                          if ok else f"unavailable: {reason}")
                infos.append(PluginInfo(name, "library", version, status, [lib.name],
                                        lib.capabilities().to_json() if ok else None))
        elif found_searchers:
            infos.append(PluginInfo(name, "search", _distribution_version(plugin), "available", [n for n, _ in found_searchers]))
        elif found_metrics:
            infos.append(PluginInfo(name, "metrics", _distribution_version(plugin), "available", [m[0] for m in found_metrics]))
        elif found_kinds:
            infos.append(PluginInfo(name, "op kinds", _distribution_version(plugin), "available", [k.name for (k,) in found_kinds]))
        elif found_models:
            infos.append(PluginInfo(name, "models", _distribution_version(plugin), "available", [m[0] for m in found_models]))
        else:
            infos.append(PluginInfo(name, "other", _distribution_version(plugin), "loaded", []))
    return infos
