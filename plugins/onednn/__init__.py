"""oneDNN (Debian's libdnnl2, 2.6.3, through ctypes) as a kselect library plugin, registered
through the ``kselect`` entry-point group as a third-party plugin would be.

Per conv / deconv / fully connected op, kselect chooses which of oneDNN's implementations runs
it (every one its primitive descriptor iterator yields: brgconv, jit, jit_1x1, jit_dw, gemm,
ref, ...), the activation layout it writes (nhwc, nChw16c, nChw8c, nchw) and its thread count.
A plan runs whole models with executor.py.
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.onednn.library import OnednnLibrary


@hookimpl
def register_libraries(register):
    register(OnednnLibrary())
