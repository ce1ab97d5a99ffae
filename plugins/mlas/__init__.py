"""MLAS, ONNX Runtime's CPU kernels, as a kselect library plugin.

MLAS is reached only through ONNX Runtime sessions: each candidate is a single-op model run in a
fresh session with the candidate's session options. Per op, kselect chooses the layout (plain
NCHW Conv, or MLAS's blocked NCHWc Conv written by kselect), the depthwise sliding kernel and the
pointwise channel batch; threads, spinning and prepacking are session-wide, so they are chosen
once per plan (``plan_level_dims``).
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.mlas.library import MlasLibrary


@hookimpl
def register_libraries(register):
    register(MlasLibrary())
