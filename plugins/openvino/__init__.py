"""OpenVINO (PyPI ``openvino``, its CPU plugin) as a kselect library plugin.

Per conv / deconv / fully connected op, kselect chooses which of the CPU plugin's implementation
types runs it (every one a ``primitives_priority`` hint makes the plugin take for that op, found
by compiling it); its bf16 and fp16 twins run in OpenVINO's bf16 and f16 where the CPU plugin
computes in them here, chosen per op under an accuracy budget (``--precision fp32,bf16``). The
thread count and pinning are chosen once per plan. A plan runs, and is exported, as an OpenVINO
IR carrying the per-node hints (ir.py).
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.openvino.library import OpenvinoLibrary


@hookimpl
def register_libraries(register):
    register(OpenvinoLibrary())
