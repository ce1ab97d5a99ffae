"""The Arm Compute Library (ACL, NEON backend, Debian's 20.08) as a kselect library plugin.

Per conv, kselect chooses the method (GEMM, Winograd with or without fast math, Direct, FFT, or
depthwise: what ACL's validate() accepts), the arm_gemm micro-kernel of GEMM-based methods, the
layout (NCHW / NHWC, once per plan), a CPU model hint, the thread count, and a workload split of
every kernel's window over the threads (the runner's own scheduler); per fully connected layer the
GEMM kernel, CPU model hint, threads and split. The baseline is ACL's own choice with ArmNN's
thread rule. INT8 twins of convs and fcs run in ACL's quantized forms (int8.py; README.md "int8"). Everything runs in an aarch64 runner process (``runner/``, PROTOCOL.md); on other
hosts under qemu, and then every time is labelled emulated.
"""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.acl.library import AclLibrary


@hookimpl
def register_libraries(register):
    register(AclLibrary())
