"""The hooks a kselect plugin can implement.

Every hook receives a ``register`` callback rather than returning values (the simonw/llm style):
a plugin calls ``register(obj)`` once per thing it provides. Built-in plugins use exactly these
hooks, so a third-party plugin is one module with ``@hookimpl`` functions and an entry point in
the ``kselect`` group::

    [project.entry-points.kselect]
    mylib = "kselect_mylib"
"""

import pluggy

hookspec = pluggy.HookspecMarker("kselect")
hookimpl = pluggy.HookimplMarker("kselect")


@hookspec
def register_libraries(register):
    """Register inference libraries: ``register(library)`` with a ``kselect.core.contract.library.Library``."""


@hookspec
def register_searchers(register):
    """Register search backends: ``register(name, searcher_class)``, the class a
    ``kselect.search.Searcher`` subclass."""


@hookspec
def register_models(register):
    """Register built-in models: ``register(name, description, build)`` where ``build(seed)``
    returns an ``onnx.ModelProto``."""


@hookspec
def register_op_kinds(register):
    """Register kinds of tunable op: ``register(kind)`` with a ``kselect.core.contract.opkind.OpKind``."""


@hookspec
def register_metrics(register):
    """Register accuracy metrics for int8 plans: ``register(name, metric)`` where
    ``metric(outputs, reference, feeds) -> float`` scores a plan's outputs against the fp32
    model's on held-out feeds, higher is better (core/precision/accuracy.py)."""
