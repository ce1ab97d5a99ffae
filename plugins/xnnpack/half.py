"""XNNPack's half-precision (f16) conv, deconv and fully connected operators as fp16 candidates
(core/precision/half.py).

Both builds (Debian 12's libxnnpack0 0.0~git20220216, the 2022 API; Debian 13's
libxnnpack0.20241108 0.0~git20241108, the 2024 API) have ``xnn_create_convolution2d_nhwc_f16``,
``..._deconvolution2d_nhwc_f16`` and ``..._fully_connected_nc_f16``: IEEE half tensors in and
out, weights and bias given in float32 (``XNN_FLAG_FP32_STATIC_WEIGHTS``) and rounded to half
when the operator packs them. xnn_initialize fills its f16 table only where the CPU has what the
kernels need (x86: AVX2 and F16C; Arm: FP16 arithmetic, Armv8.2-A); elsewhere creating one fails
with xnn_status_unsupported_hardware and the library offers no fp16 (``xa.f16_availability``).
The operator classes (xnnpack_api.py) hide the API: the same calls here on both.

An fp16 op reads and writes float32 tensors like its neighbours: it is XNNPack's f32 -> f16
conversion of its input (``xnn_create_convert_nc_f32_f16``; on the 2024 API the unary convert
operator), the f16 operator, and the f16 -> f32
conversion of its output, all three timed as the candidate and run the same way by the executor
in whole models. Its neighbours and the plan's layouts are those of fp32 (the NHWC float
tensors of ``xnnpack:NHWC``), so no conversion is planned around it. A Relu or Clip after the op
is the operator's output clamp (in half); any other activation the executor runs after it in
float32, on the converted output, as it does after an fp32 op. XNNPack's f16 kernels round the
running sum to half after every multiply-add (the x86 ones emulate Arm's FP16 arithmetic so):
``XnnpackLibrary.accumulates_in_half`` says so, and the core allows for it.

Space: ``threads`` and ``spinning`` (as for fp32). No micro-kernel choice: the 2022 amd64
build's f16 table has one GEMM / IGEMM pair (4x16 and 1x16 ``avx2_broadcast``) and one depthwise
kernel per tap count (3, 4, 9, 25; ``fma3``), all from its one f16 ISA tier, and the library holds
no other f16 kernel (no other name among its assert strings): there is nothing to choose among;
on the 2024 build kselect has the public API only (as for fp32). No NCHW path (no f16 NCHW
operator in the 2022 snapshot; the 2024 one's is not bound) and no work split (``tile_n`` /
``loop`` take the kernel's tile from the f32 override's catalog).
"""

from __future__ import annotations

import math

import numpy as np

from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import Device
from kselect.core.models.activations import clamp_range
from kselect.plugins.xnnpack import configured, tileshim
from kselect.plugins.xnnpack import xnnpack_api as xa

NO_KERNEL_CHOICE = "one f16 GEMM and one depthwise kernel per tap count in this build: no micro-kernel choice"
NO_KERNEL_CHOICE_2024 = "public API only on this build: no micro-kernel choice"


def no_kernel_choice() -> str:
    """Why an f16 op offers no micro-kernel choice on the loaded build."""
    return NO_KERNEL_CHOICE if xa.api() == xa.API_2022 else NO_KERNEL_CHOICE_2024


def available() -> tuple[bool, str]:
    """Whether fp16 candidates run here, and what they are (or why not)."""
    ok, why = xa.f16_availability()
    return (True, f"f16 conv / deconv / fc operators ({no_kernel_choice()})") if ok else (False, why)


def supports(task) -> bool:
    """An fp16 twin where XNNPack has f16 kernels here, whose folded Relu / Clip stays a range in
    half (the library checks the op itself as for fp32)."""
    if task.precision != "fp16" or not xa.f16_availability()[0]:
        return False
    bounds = clamp_range(task.epilogue) if task.epilogue else None
    return bounds is None or np.float16(bounds[0]) < np.float16(bounds[1])


def space(task, device: Device) -> Space:
    space = Space()
    space.add(Integer("threads", 1, device.cores))
    if device.cores > 1 and tileshim.shim() is not None:
        space.add(Categorical("spinning", (1, 0), role="knob", when={"threads": list(range(2, device.cores + 1))}))
    return space


def default_config(task, device: Device) -> dict:
    """XNNPack's own choice: its f16 operator on all cores."""
    config: dict = {"threads": device.cores}
    if device.cores > 1 and tileshim.shim() is not None:
        config["spinning"] = 1
    return config


def check_config(config: dict) -> None:
    extra = sorted(set(config) - {"threads", "spinning"})
    if extra:
        raise configured.ConfigError(f"an f16 operator takes threads and spinning only, not {', '.join(extra)} "
                                     f"({no_kernel_choice()})")


class Converted(configured.Built):
    """The f16 operator between the conversion of its float32 input to half and of its half output
    back to float32: ``steps`` run the three; ``x`` and ``y`` are the float32 buffers, ``halves``
    the half ones between (kept alive while the operators point at them)."""

    def __init__(self, to_half, op, to_float, steps, x, y, halves):
        super().__init__(op, steps, x, y, {"datatype": "f16"})
        self.conversions = [to_half, to_float]
        self.halves = halves

    def close(self) -> None:
        super().close()
        for conversion in self.conversions:
            conversion.close()
        self.conversions = []


def build(task, config: dict, w: np.ndarray, b: np.ndarray | None, x: np.ndarray, y: np.ndarray,
          output_min: float = -math.inf, output_max: float = math.inf) -> Converted:
    """The fp16 op for ``config`` reading the float32 buffer ``x`` and writing ``y`` (conv and
    deconv: NHWC, weights OIHW / ONNX's deconv layout; fc: (M, K) -> (M, N), weights (N, K), its
    alpha and beta already folded in), its output clamped to [output_min, output_max]."""
    check_config(config)
    pool = configured.pool_for(int(config.get("threads", 1)))
    a = task.attrs
    clamp = dict(output_min=output_min, output_max=output_max, threadpool=pool, datatype="f16")
    if task.kind == "fc":
        op = xa.FullyConnected(w, b, **clamp)
    elif task.kind == "deconv":
        op = xa.Deconvolution2DNHWC(w, b, stride=a["strides"], dilation=a["dilations"], padding=a["pads"],
                                    groups=a["group"], adjustment=a["output_padding"], **clamp)
    else:
        op = xa.Convolution2DNHWC(w, b, stride=a["strides"], dilation=a["dilations"], padding=a["pads"],
                                  groups=a["group"], **clamp)
    created = [op]
    try:
        x16, y16 = configured.buffer(x.shape, np.float16), configured.buffer(y.shape, np.float16)
        to_half = xa.HalfConvert("f16", x.shape[-1], threadpool=pool)
        created.append(to_half)
        to_float = xa.HalfConvert("f32", y.shape[-1], threadpool=pool)
        created.append(to_float)
        to_half.setup(x.reshape(-1, x.shape[-1]), x16.reshape(-1, x.shape[-1]))
        op.setup(x16, y16)
        to_float.setup(y16.reshape(-1, y.shape[-1]), y.reshape(-1, y.shape[-1]))
    except BaseException:
        for operator in created:
            operator.close()
        raise
    run, pool_handle = xa.lib().xnn.xnn_run_operator, None if pool is None else pool.handle
    steps = [(run, operator.handle, pool_handle) for operator in (to_half, op, to_float)]
    return Converted(to_half, op, to_float, steps, x, y, (x16, y16))
