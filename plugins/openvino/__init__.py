"""OpenVINO (PyPI ``openvino``, its CPU plugin) as a kselect library plugin.

Per conv / deconv / fully connected op, kselect chooses which of the CPU plugin's implementation
types runs it (every one a ``primitives_priority`` hint makes the plugin take for that op, found
by compiling it) and its precision (f32, and bf16 / f16 where the CPU runs them and
KSELECT_OPENVINO_PRECISIONS asks for them); the thread count and pinning are chosen once per
plan. A plan runs, and is exported, as an OpenVINO IR carrying the per-node hints (ir.py).
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.openvino.library import OpenvinoLibrary


@hookimpl
def register_libraries(register):
    register(OpenvinoLibrary())
