"""XNNPack (Debian's libxnnpack0 through ctypes) as a kselect library plugin.

Per op, kselect chooses the operator path (NHWC, or XNNPack's NCHW SpMM / CHW-depthwise
operators with the layout conversions they need), the micro-kernel (any f32 GEMM / IGEMM /
depthwise kernel the installed build holds for this CPU's ISA tiers, through an override that is
used only on a build verified at load), the GEMM row tile, the thread count and the column tile of
the parallel loop (through a pthreadpool shim). A plan runs whole models with executor.py.
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.xnnpack.library import XnnpackLibrary


@hookimpl
def register_libraries(register):
    register(XnnpackLibrary())
