"""The op kinds built into kselect (core/contract/opkind.py), registered like a third-party plugin's:
"conv" (Conv, 1-D and 2-D), "deconv" (ConvTranspose), "fc" (Gemm, MatMul) and "convert" (a tensor's
change of layout, runner or precision between two ops of a plan)."""

from __future__ import annotations

from kselect.core.contract.hookspecs import hookimpl
from kselect.plugins.ops.conv import ConvKind, DeconvKind
from kselect.plugins.ops.convert import ConvertKind
from kselect.plugins.ops.fc import FullyConnectedKind


@hookimpl
def register_op_kinds(register):
    register(ConvKind())
    register(DeconvKind())
    register(FullyConnectedKind())
    register(ConvertKind())
