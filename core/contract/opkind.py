"""The kinds of op kselect tunes, registered by plugins like libraries are.

Conv (1-D and 2-D), ConvTranspose and fully connected layers are built in (kselect/plugins/ops,
registered through the same ``register_op_kinds`` hook a third-party plugin implements); a new
kind (an attention block, a pooling layer a library has several kernels for) is one ``OpKind``
subclass in a plugin, and the libraries that tune it say so in ``Library.supports``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import onnx

from kselect.core.contract import plugins
from kselect.core.errors import KselectError


class OnnxOp(NamedTuple):
    """A task's op as one ONNX node reading "x", "w" (and "b") and the shapes and weights of the
    one-op model around it (``core.measuring.measure.task_model``)."""
    node: onnx.NodeProto
    input_shape: list[int]
    output_shape: list[int]
    weights: np.ndarray


class OpKind(ABC):
    """A kind of tunable op: which ONNX nodes it reads into tasks, and what every candidate of its
    tasks is measured on and checked against.

    What kselect calls, in order:

    1. ``read(model, node)`` for every node whose ``op_type`` is in ``onnx_ops``, in graph order:
       the ``core.models.tasks.Op`` (shapes in the kind's canonical form, attributes as JSON, whether it
       has a bias; core adds the activation after it), or a one-line reason why the node is left
       untuned, which ``kselect tasks`` shows. Ops with equal signatures share one task.
    2. ``macs(op)`` and ``describe(task)``: for listings (``kselect tasks``, plans).
    3. In the measuring child, per task: ``inputs(task, rng)``, seeded data in the canonical
       layouts (``x``, ``w`` and ``b`` when the op has a bias), and ``reference(task, inputs)``,
       the output in float64 before the activation (core applies it), which every candidate's
       output is compared with (``Library.tolerance``).
    4. ``measure(library, task, config, inputs, settings)``: how a library times one candidate
       of the kind (by default its ``Library.measure``), and ``tolerance(task)``: the error every
       library's candidates are held to, or None to let each library say (``Library.tolerance``).
    5. ``onnx_op(task, inputs, output)``: the op as one ONNX node, for libraries whose runner
       takes graphs (``core.measuring.measure.task_model``).
    """

    name: str = ""  # the task kind, stored in records and plans: never rename one
    onnx_ops: tuple[str, ...] = ()

    @abstractmethod
    def read(self, model, node: onnx.NodeProto):
        """The node as an ``Op``, or a string saying why it is left untuned."""

    @abstractmethod
    def macs(self, op) -> int:
        """Multiply-accumulates of one op (an ``Op`` or a ``Task``)."""

    @abstractmethod
    def inputs(self, task, rng: np.random.Generator) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def reference(self, task, inputs: dict[str, np.ndarray]) -> np.ndarray: ...

    @abstractmethod
    def onnx_op(self, task, inputs: dict[str, np.ndarray], output: str) -> OnnxOp: ...

    def describe(self, task) -> str:
        """The attributes in a few characters (``k3x3 s2 p1``); empty by default."""
        return ""

    def tolerance(self, task) -> float | None:
        """The largest accepted error relative to the reference's largest magnitude for every
        library, or None (the default): the library's own ``Library.tolerance``."""
        return None

    def measure(self, library, task, config: dict, inputs: dict[str, np.ndarray], settings) -> dict:
        """Times one candidate in the measuring child: ``{"times_us": [...], "output": array}``."""
        return library.measure(task, config, inputs, settings)


def op_kinds() -> dict[str, OpKind]:
    """Every registered kind by name (one instance per process)."""
    return plugins.op_kinds()


def op_kind(name: str) -> OpKind:
    kinds = op_kinds()
    if name not in kinds:
        raise KselectError(f"unknown op kind {name!r} (registered: {', '.join(sorted(kinds)) or 'none'}): "
                           f"is the plugin that registers it installed?")
    return kinds[name]


def kinds_by_onnx_op() -> dict[str, OpKind]:
    return {op_type: kind for kind in op_kinds().values() for op_type in kind.onnx_ops}
