"""The contract a plugin implements, in one stable module: import from ``kselect.core.contract``.

A library plugin (docs/writing-a-library.md)::

    from kselect.core.contract import Library, CallCandidate, Space, Categorical, Integer, Label, hookimpl

    class MyLibrary(Library):
        name = "mylib"
        ...

    @hookimpl
    def register_libraries(register):
        register(MyLibrary())

What lives here: the hook specifications and marker (``hookspecs``), the plugin manager
(``plugins``), the ``Library`` contract in its roles with its ``Capabilities`` (``library``),
tensor labels (``labels``), op kinds (``opkind``), the configuration-space schema (``space``), the
measuring ``Runner`` interface (``runner``) and the behavioural suite every library passes
(``checks``). The names below are the ones a plugin needs; the submodules stay importable.
"""

import importlib

# name -> module. Resolved on first use (PEP 562), so importing one submodule of the contract
# (``from kselect.core.contract import plugins``) does not import all of them, and core modules the
# contract refers to can import contract submodules without a cycle at start-up.
_EXPORTS = {
    "hookimpl": "kselect.core.contract.hookspecs",
    "Label": "kselect.core.contract.labels",
    "CallCandidate": "kselect.core.contract.library",
    "Candidate": "kselect.core.contract.library",
    "Capabilities": "kselect.core.contract.library",
    "KernelSource": "kselect.core.contract.library",
    "Library": "kselect.core.contract.library",
    "TensorCrossing": "kselect.core.contract.library",
    "WholeModelRunner": "kselect.core.contract.library",
    "OnnxOp": "kselect.core.contract.opkind",
    "OpKind": "kselect.core.contract.opkind",
    "Categorical": "kselect.core.contract.space",
    "Integer": "kselect.core.contract.space",
    "Space": "kselect.core.contract.space",
    "WorkloadSplit": "kselect.core.contract.space",
    "KselectError": "kselect.core.errors",
    "UnsupportedOp": "kselect.core.errors",
    "Device": "kselect.core.measuring.device",
    "Op": "kselect.core.models.tasks",
    "Task": "kselect.core.models.tasks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
