"""oneDNN (Debian's build, through ctypes: libdnnl2 2.6.3 with the 2.x C API, or libdnnl3.6 3.7.2
with the 3.x one, whichever is installed) as a kselect library plugin, registered through the
``kselect`` entry-point group as a third-party plugin would be.

Per conv / deconv / fully connected op, kselect chooses which of oneDNN's implementations runs
it (every one it yields for the op on this CPU: brgconv, jit, jit_1x1, jit_dw, gemm, ref, ...; on
aarch64 jit:sve_*, brgconv:sve_*, gemm:ref, ref), the activation layout it writes (nhwc, nChw16c,
nChw8c, nchw) and its thread count. A plan runs whole models with executor.py.
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.onednn.library import OnednnLibrary


@hookimpl
def register_libraries(register):
    register(OnednnLibrary())
