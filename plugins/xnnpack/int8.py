"""XNNPack's 8-bit conv and fully connected operators as int8 candidates (core/precision/quant.py).

Both builds (Debian 12's libxnnpack0 0.0~git20220216, xnnpack.h at ae108ef, the 2022 API; Debian
13's libxnnpack0.20241108, the 2024 API, where qc8 is named ``..._qs8_qc8w``) have three 8-bit
variants, which the operator classes of xnnpack_api.py create the same way on either:

- ``qc8``: int8 activations, int8 weights with one scale per output channel
  (``xnn_create_convolution2d_nhwc_qc8``). It has no per-channel fully connected operator: a
  qc8 fc runs as a 1x1 qc8 convolution on (M, 1, 1, K), the GEMM path with the same qc8 kernels;
- ``qs8``: int8 activations, int8 weights with one scale (``..._convolution2d_nhwc_qs8``,
  ``xnn_create_fully_connected_nc_qs8``);
- ``qu8``: uint8 activations, uint8 weights with one scale and zero point 128
  (``..._convolution2d_nhwc_qu8``, ``xnn_create_fully_connected_nc_qu8``).

A transposed convolution (deconv task, ONNX's ConvTranspose) runs on
``xnn_create_deconvolution2d_nhwc_qs8`` / ``_qu8``: this snapshot has no per-channel (qc8) form,
so its variants are qs8 and qu8, and, as in float, no micro-kernel choice is offered.

A candidate quantizes its input as ``inputs["quant"]`` says (uint8 asymmetric; signed variants
take the same scale with zero point minus 128) before it is timed; the timed run is the 8-bit
operator alone (``xnn_run_operator``) on NHWC (conv) or (M, K) (fc) integers; its output is the
8-bit result dequantized, in the task's NCHW / (M, N) layout. A Relu or Clip after the op is the
operator's output clamp [output_min, output_max] in the output's integers (as TFLite's delegate
folds it). A Sigmoid or a SiLU (Sigmoid, then Mul by the op's output) runs after the operator
on XNNPack's 8-bit sigmoid and multiply operators: the operator writes the pre-activation grid
(``QuantParams.pre_scale``), the sigmoid the only grid XNNPack's sigmoid writes (scale 1/256),
the multiply the output's grid; all of them are the timed run. A LeakyRelu (slope in (0, 1]) runs
after it on XNNPack's 8-bit leaky relu, a lookup table from the pre-activation grid onto the
output's; the 2022 snapshot has it for qu8 only, so such an op's only variant is qu8 (on both
builds). Any other activation makes the int8 twin unsupported. The 2024 build also has a
per-channel fully connected and deconvolution (``..._qs8_qc8w``): not offered, so both builds
offer the same variants.

Micro-kernels (the 2022 amd64 build only): the verified table override (ukernel_forcing.py)
rewrites the family's own gemm / dwconv entry (``xnn_params.qc8`` / ``.qs8`` / ``.qu8``), with the
kernels of every ISA tier read in child processes (``ukernel_catalog.catalog_int8``), at their
native MR only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import Device
from kselect.core.models.activations import clamp_range
from kselect.core.precision.quant import QuantParams, quantize
from kselect.plugins.xnnpack import configured, kernels, tileshim, ukernel_catalog, ukernel_forcing, ukernel_table
from kselect.plugins.xnnpack import xnnpack_api as xa
from kselect.plugins.xnnpack.candidate import XnnCandidate

VARIANTS = xa.INT8_VARIANTS  # ("qc8", "qs8", "qu8")
QU8_KERNEL_ZERO_POINT = 128  # symmetric int8 weights q stored as q + 128


SIGMOID = ["Sigmoid", ["x"], {}]


def activation_after(epilogue: list) -> str | None:
    """"sigmoid", "silu" or "leaky_relu" when the epilogue is one XNNPack's 8-bit operators run
    after the kernel: a lone Sigmoid, Sigmoid then Mul of the op's output by it (either operand
    order), or a lone LeakyRelu whose slope the 8-bit operator takes (0 < alpha <= 1)."""
    steps = [[step[0], list(step[1]), dict(step[2])] for step in epilogue]
    if steps == [SIGMOID]:
        return "sigmoid"
    if len(steps) == 1 and steps[0][:2] == ["LeakyRelu", ["x"]] and 0.0 < steps[0][2].get("alpha", 0.01) <= 1.0:
        return "leaky_relu"
    if len(steps) == 2 and steps[0] == SIGMOID and steps[1][0] == "Mul" and not steps[1][2] \
            and steps[1][1] in (["x", "t0"], ["t0", "x"]):
        return "silu"
    return None


def epilogue_supported(epilogue: list) -> bool:
    """No activation, or one Relu / Clip (the operator's output clamp), or a Sigmoid / SiLU when
    the build has the 8-bit sigmoid and multiply operators, or a LeakyRelu when it has the 8-bit
    leaky relu."""
    if not epilogue or clamp_range(epilogue) is not None:
        return True
    activation = activation_after(epilogue)
    if activation == "leaky_relu":
        return xa.int8_leaky_relu_availability()[0]
    return activation is not None and xa.int8_activation_availability()[0]


def leaky_relu_slope(epilogue: list) -> float:
    return float(dict(epilogue[0][2]).get("alpha", 0.01))


def supports(task) -> bool:
    if task.precision != "int8" or not xa.int8_availability()[0] or not epilogue_supported(task.epilogue):
        return False
    if task.kind == "fc":
        return len(task.input_shape) == 2
    if task.kind == "deconv":
        return xa.int8_deconvolution_availability()[0] and not task.conv1d and len(task.input_shape) == 4 \
            and task.input_shape[1] % task.attrs["group"] == 0
    if task.kind != "conv" or task.conv1d or len(task.input_shape) != 4:
        return False
    groups = task.attrs["group"]
    return task.input_shape[1] % groups == 0 and task.weight_shape[0] % groups == 0


def variants(task) -> tuple[str, ...]:
    """The 8-bit variants of this op's operator: qc8 / qs8 / qu8, a deconvolution qs8 / qu8; qu8
    only with a LeakyRelu after it (the only 8-bit leaky relu of this build)."""
    own = xa.INT8_DECONV_VARIANTS if task.kind == "deconv" else VARIANTS
    if activation_after(task.epilogue) == "leaky_relu":
        return tuple(v for v in own if v == "qu8")
    return own


def has_kernel_choice(task) -> bool:
    """Whether the space offers the 8-bit micro-kernels (not for a deconvolution, as in float)."""
    return task.kind != "deconv" and override_on()


def default_variant(task) -> str:
    """What XNNPack runs for a TFLite-style int8 model (its subgraph API at this snapshot):
    per-channel weights for convolutions (qc8); fully connected and transposed convolutions take
    only per-tensor int8 weights there (qs8); an op the variant cannot take (a LeakyRelu after
    it) its only variant."""
    own = "qs8" if task.kind in ("fc", "deconv") else "qc8"
    return own if own in variants(task) else variants(task)[0]


def offset(variant: str) -> int:
    """What to subtract from the core's uint8 zero points for this variant's activations."""
    return 0 if variant == "qu8" else 128


def quantize_activations(x: np.ndarray, scale: float, zero_point_u8: int, variant: str) -> np.ndarray:
    return quantize(x, scale, zero_point_u8, signed=variant != "qu8")


def output_range(epilogue: list, params: QuantParams, variant: str) -> tuple[int, int]:
    """The output clamp in the output's integers: the whole type, narrowed by a Relu / Clip."""
    return clamp_in_integers(clamp_range(epilogue) if epilogue else None, params, variant)


def clamp_in_integers(bounds, params: QuantParams, variant: str) -> tuple[int, int]:
    """A float clamp ``bounds`` (low, high; None or infinite: none) as the output's integers."""
    low, high = 0, 255
    if bounds is not None:
        def q(v: float, default: int) -> int:
            if math.isinf(v):
                return default
            return int(np.clip(np.round(v / params.y_scale) + params.y_zero_point, 0, 255))
        low, high = q(bounds[0], 0), q(bounds[1], 255)
    return low - offset(variant), high - offset(variant)


def quantized_operands(task, inputs: dict, params: QuantParams, variant: str, folded: bool = False) -> dict:
    """Weights (OIHW conv, ONNX's (C_in, C_out / groups, kH, kW) deconv, (N, K) fc; int8, uint8 for
    qu8), int32 bias and kernel scale(s) of the op under ``params``; a fully connected op's alpha
    and beta folded in (unless ``folded``: the executor has already folded them into ``w`` and ``b``)."""
    w = inputs["w"]
    per_channel = variant == "qc8"
    q = params.quantized_weights(w, per_channel)
    scales = params.w_scales.astype(np.float64) if per_channel else np.float64(params.w_scale_per_tensor)
    b = inputs.get("b")
    if task.kind == "fc" and not folded:
        alpha = float(task.attrs.get("alpha", 1.0))
        if alpha < 0:  # kernel scales must be positive: the sign goes into the weights
            q = (-q.astype(np.int16)).astype(np.int8)
        scales = scales * abs(alpha)
        if b is not None:
            b = b.astype(np.float64) * float(task.attrs.get("beta", 1.0))
    bias = None
    if b is not None:
        bias = np.round(b.astype(np.float64) / (params.x_scale * scales)).astype(np.int32)
    if variant == "qu8":
        q = (q.astype(np.int16) + QU8_KERNEL_ZERO_POINT).astype(np.uint8)
    return {"weights": q, "bias": bias,
            "kernel_scale": scales.astype(np.float32) if per_channel else float(scales),
            "kernel_zero_point": QU8_KERNEL_ZERO_POINT if variant == "qu8" else 0}


def datatype(variant: str) -> str:
    """The 8-bit type of a variant's activations as the elementwise operators name it."""
    return "qu8" if variant == "qu8" else "qs8"


def sigmoid_operator(variant: str, channels: int, scale: float, zero_point_u8: int):
    """XNNPack's 8-bit sigmoid from the (scale, uint8 zero point) grid; it writes the grid
    (``xa.SIGMOID_OUTPUT_SCALE``, uint8 zero point 0)."""
    return xa.QSigmoid(datatype(variant), channels, zero_point_u8 - offset(variant), scale)


def leaky_relu_operator(variant: str, channels: int, slope: float, x: tuple[float, int], y: tuple[float, int]):
    """XNNPack's 8-bit leaky relu from grid ``x`` onto grid ``y`` (each (scale, uint8 zero point));
    qu8 only in this build."""
    if variant != "qu8":
        raise configured.ConfigError(f"no {variant} leaky relu in this build (qu8 only)")
    return xa.QLeakyRelu(channels, slope, x[1], x[0], y[1], y[0])


def multiply_operator(variant: str, a: tuple[float, int], b: tuple[float, int], y: tuple[float, int]):
    """XNNPack's 8-bit multiply of grids ``a`` and ``b`` onto ``y`` (each (scale, uint8 zero point)),
    unclamped."""
    return xa.QMultiply(datatype(variant), a[1] - offset(variant), a[0], b[1] - offset(variant), b[0],
                        y[1] - offset(variant), y[0], -offset(variant), 255 - offset(variant))


SIGMOID_GRID = (xa.SIGMOID_OUTPUT_SCALE, 0)  # (scale, uint8 zero point) of the 8-bit sigmoid's output


def buffer(shape, dtype) -> np.ndarray:
    """An uninitialised 64-byte aligned array with readable slack after its end (the 8-bit
    kernels read inputs in 8-byte chunks and XNNPack allows XNN_EXTRA_BYTES past a tensor)."""
    size = int(np.prod(shape)) if len(shape) else 1
    raw = np.empty(size + 64 + 64, np.uint8).view(np.dtype(dtype))
    start = -raw.ctypes.data % 64
    return raw[start:start + size].reshape(shape)


# -- spaces and defaults ----------------------------------------------------------------------
def op_class(task) -> str:
    return kernels.int8_op_class(task)


def _taps(task) -> int | None:
    return task.attrs["kernel"][0] * task.attrs["kernel"][1] if task.kind == "conv" else None


def override_on() -> bool:
    return kernels.int8_override_status()[0]


def kernel_options(task, variant: str) -> list[str]:
    """The variant family's kernels for this op, XNNPack's own first, then wider ISA and larger
    tiles; for a single-row GEMM / IGEMM only the mr=1 kernels (XNNPack runs a larger kernel's
    mr=1 sibling there)."""
    cls, rows = op_class(task), kernels.gemm_rows(task)
    names = kernels.int8_kernel_names(variant, cls, _taps(task))
    if cls != "dwconv" and rows == 1:
        names = [n for n in names if kernels.native_mr(n) == 1]
    default = kernels.int8_default_kernel(variant, cls, rows, _taps(task))
    return sorted(names, key=lambda n: (n != default, *kernels.int8_promise(n)))


def space(task, device: Device) -> Space:
    space = Space()
    space.add(Categorical("variant", variants(task), role="precision"))
    if has_kernel_choice(task):
        options = [name for variant in variants(task) for name in kernel_options(task, variant)]
        space.add(Categorical("ukernel", tuple(options), role="micro-kernel"))
        space.constrain("ukernel is a kernel of the variant's family (qc8, qs8, qu8)",
                        lambda c: "ukernel" not in c or kernels.int8_family(c["ukernel"]) == c["variant"])
    space.add(Integer("threads", 1, device.cores))
    if device.cores > 1 and tileshim.shim() is not None:
        space.add(Categorical("spinning", (1, 0), role="knob", when={"threads": list(range(2, device.cores + 1))}))
    return space


def default_config(task, device: Device) -> dict:
    """XNNPack's own choice for a TFLite-style int8 model: qc8 convs (per-channel weights), qs8
    fully connected, the kernel its initialisation put in the family's table, all cores."""
    variant = default_variant(task)
    config: dict = {"variant": variant}
    if has_kernel_choice(task):
        config["ukernel"] = kernels.int8_default_kernel(variant, op_class(task), kernels.gemm_rows(task), _taps(task))
    config["threads"] = device.cores
    if device.cores > 1 and tileshim.shim() is not None:
        config["spinning"] = 1
    return config


# -- building and running ---------------------------------------------------------------------
def choice_for(task, config: dict):
    """The table override for ``config["ukernel"]`` (None: XNNPack's own kernel, or no key)."""
    if "ukernel" not in config:
        return None
    ok, why = kernels.int8_override_status()
    if not ok:
        raise configured.ConfigError(f"8-bit micro-kernel override unavailable: {why}")
    name, variant, cls = config["ukernel"], config["variant"], op_class(task)
    if kernels.int8_family(name) != variant:
        raise configured.ConfigError(f"{name} is not a {variant} kernel")
    rows = kernels.gemm_rows(task)
    if cls != "dwconv" and rows == 1 and kernels.native_mr(name) != 1:
        raise configured.ConfigError("a single-row GEMM / IGEMM runs the mr=1 kernel: choose an mr=1 kernel")
    if name == kernels.int8_default_kernel(variant, cls, rows, _taps(task)):
        return None
    try:
        return kernels.int8_resolve(cls, name, _taps(task))
    except KeyError as exc:
        raise configured.ConfigError(str(exc)) from None


@contextlib.contextmanager
def _forced(choice, family: str):
    if choice is None:
        yield
        return
    configured.check_table_pristine()
    gemm = choice if isinstance(choice, ukernel_catalog.GemmChoice) else None
    dwconv = choice if isinstance(choice, ukernel_catalog.DwconvChoice) else None
    try:
        with ukernel_forcing.forced_kernels(gemm, dwconv, allow_in_process=True, family=family):
            yield
    finally:
        configured.check_table_pristine()


def config_variant(config: dict, task) -> str:
    """The config's variant, checked; refuses keys 8-bit operators do not take."""
    variant = config.get("variant", default_variant(task))
    if variant not in variants(task):
        raise configured.ConfigError(f"variant {variant!r} is not offered for this {task.kind} "
                                     f"(its variants: {', '.join(variants(task))})")
    if config.get("path", "nhwc") != "nhwc" or config.get("tile_n", "default") != "default" \
            or config.get("loop", "rows") != "rows":
        raise configured.ConfigError("8-bit operators take variant, ukernel, threads and spinning only")
    return variant


def create_operator(task, config: dict, w: np.ndarray, b: np.ndarray | None, kq: QuantParams,
                    bounds=None, folded: bool = False):
    """The 8-bit operator of ``config`` for float weights ``w`` (OIHW conv, ONNX's deconv, (N, K)
    fc) and bias ``b``, quantized under ``kq`` (input and output scales and uint8 zero points,
    weight scales), its output clamped to the float ``bounds`` (a folded Relu / Clip; None: the
    task's epilogue), with the configured micro-kernel, which is checked to be the one the
    operator holds. Returns (operator, its pool, notes). A qc8 fc is a 1x1 qc8 convolution: set it up on (M, 1, 1, K)
    and (M, 1, 1, N) views. ``folded``: an fc's alpha and beta are already in ``w`` and ``b``."""
    variant = config_variant(config, task)
    pool = configured.pool_for(config.get("threads", 1))
    operands = quantized_operands(task, {"w": w, **({"b": b} if b is not None else {})}, kq, variant, folded)
    out_min, out_max = (output_range(task.epilogue, kq, variant) if bounds is None
                        else clamp_in_integers(bounds, kq, variant))
    quant = dict(input_zero_point=kq.x_zero_point - offset(variant), input_scale=kq.x_scale,
                 kernel_scale=operands["kernel_scale"], kernel_zero_point=operands["kernel_zero_point"],
                 output_zero_point=kq.y_zero_point - offset(variant), output_scale=kq.y_scale,
                 output_min=out_min, output_max=out_max, threadpool=pool)
    choice = choice_for(task, config)
    a = task.attrs
    with _forced(choice, variant):
        if task.kind == "fc" and variant == "qc8":  # no per-channel fully connected operator: 1x1 convolution
            n, k = operands["weights"].shape
            op = xa.QConvolution2DNHWC(variant, operands["weights"].reshape(n, k, 1, 1), operands["bias"], **quant)
        elif task.kind == "fc":
            op = xa.QFullyConnected(variant, operands["weights"], operands["bias"], **quant)
        elif task.kind == "deconv":
            op = xa.QDeconvolution2DNHWC(variant, operands["weights"], operands["bias"], stride=a["strides"],
                                         dilation=a["dilations"], padding=a["pads"], groups=a["group"],
                                         adjustment=a["output_padding"], **quant)
        else:
            op = xa.QConvolution2DNHWC(variant, operands["weights"], operands["bias"], stride=a["strides"],
                                       dilation=a["dilations"], padding=a["pads"], groups=a["group"], **quant)
    try:
        notes: dict = {"variant": variant}
        if "ukernel" in config:
            held = [kernels.short(name) for name in ukernel_table.kernels_in_operator(op)]
            notes["kernels"] = held
            if config["ukernel"] not in held:
                raise RuntimeError(f"the operator holds {held}, not the configured {config['ukernel']}")
        return op, pool, notes
    except BaseException:
        op.close()
        raise


class Chain(configured.Built):
    """The 8-bit operator and the activation's operators after it (``after``), run in turn;
    ``between``: the tensors they pass on, kept alive while the operators point at them."""

    def __init__(self, op, steps, x, y, notes, after: list, between: list):
        super().__init__(op, steps, x, y, notes)
        self.after = after
        self.between = between

    def close(self) -> None:
        super().close()
        for op in self.after:
            op.close()
        self.after = []


def build(task, config: dict, inputs: dict, kernel_quant: QuantParams | None = None) -> Chain:
    """The 8-bit operator for ``config`` on the task's input, quantized as ``inputs["quant"]``
    says, bound to its input and output buffers; with a Sigmoid, SiLU or LeakyRelu after it, the
    operator writes the pre-activation grid and the sigmoid (and multiply) or the leaky relu
    follow. ``kernel_quant`` (default: the same) is what the operators are told the quantization
    is: only a test gives them another one."""
    params: QuantParams = inputs["quant"]
    kq = kernel_quant or params
    variant = config_variant(config, task)
    dtype = xa.int8_dtype(variant)
    activation = activation_after(task.epilogue)
    if activation is not None and kq.pre_scale is None:
        raise ValueError("an int8 op with an activation after it needs the pre-activation grid (pre_scale)")
    x_q = quantize_activations(inputs["x"], params.x_scale, params.x_zero_point, variant)
    if task.kind == "fc":
        m, k = task.input_shape
        n = task.output_shape[1]
        rows = (m, 1, 1) if variant == "qc8" else (m,)  # qc8: a 1x1 convolution on (M, 1, 1, K)
        x, y = buffer((*rows, k), dtype), buffer((*rows, n), dtype)
        np.copyto(x, x_q.reshape(x.shape))
    else:
        n, c, h, w = task.input_shape
        _, oc, oh, ow = task.output_shape
        x = buffer((n, h, w, c), dtype)
        np.copyto(x, x_q.transpose(0, 2, 3, 1))
        y = buffer((n, oh, ow, oc), dtype)
    operator_quant = kq
    if activation is not None:  # the operator writes the pre-activation grid, unclamped
        operator_quant = dataclasses.replace(kq, y_scale=kq.pre_scale, y_zero_point=kq.pre_zero_point)
    op, pool, notes = create_operator(task, config, inputs["w"], inputs.get("b"), operator_quant,
                                      bounds=None if activation is None else (-math.inf, math.inf))
    after, between = [], []
    try:
        op.setup(x, y)
        ops = [op]
        if activation == "leaky_relu":
            channels = y.shape[-1]
            pre, y = y, buffer(y.shape, dtype)
            between.append(pre)
            leaky = leaky_relu_operator(variant, channels, leaky_relu_slope(task.epilogue),
                                        (kq.pre_scale, kq.pre_zero_point), (kq.y_scale, kq.y_zero_point))
            after.append(leaky)
            leaky.setup(pre.reshape(-1, channels), y.reshape(-1, channels))
            ops.append(leaky)
        elif activation is not None:
            channels = y.shape[-1]
            pre, y = y, buffer(y.shape, dtype)
            between.append(pre)
            sigmoid = sigmoid_operator(variant, channels, kq.pre_scale, kq.pre_zero_point)
            after.append(sigmoid)
            sigmoid.setup(pre.reshape(-1, channels), y.reshape(-1, channels))
            ops.append(sigmoid)
            if activation == "silu":
                sigmoid_out, y = y, buffer(y.shape, dtype)
                between.append(sigmoid_out)
                multiply = multiply_operator(variant, (kq.pre_scale, kq.pre_zero_point), SIGMOID_GRID,
                                             (kq.y_scale, kq.y_zero_point))
                after.append(multiply)
                multiply.setup(pre, sigmoid_out, y)
                ops.append(multiply)
        run, pool_handle = xa.lib().xnn.xnn_run_operator, None if pool is None else pool.handle
        return Chain(op, [(run, o.handle, pool_handle) for o in ops], x, y, notes, after, between)
    except BaseException:
        op.close()
        for other in after:
            other.close()
        raise


class Int8Candidate(XnnCandidate):
    """The timed run is ``xnn_run_operator`` of each operator on the quantized input; ``output()``
    dequantizes the last one's output (a lone Sigmoid's from the sigmoid's fixed grid)."""

    def __init__(self, built: configured.Built, task, params: QuantParams, variant: str, flags: int = 0):
        super().__init__(built, task.kind != "fc", flags)
        self.task = task
        scale, zero_point = (SIGMOID_GRID if activation_after(task.epilogue) == "sigmoid"
                             else (params.y_scale, params.y_zero_point))
        self.y_scale = np.float32(scale)
        self.y_zero_point = np.float32(zero_point - offset(variant))

    def output(self) -> np.ndarray:
        y = (self.built.y.astype(np.float32) - self.y_zero_point) * self.y_scale
        if self.task.kind == "fc":
            return y.reshape(self.task.output_shape)
        return np.ascontiguousarray(y.transpose(0, 3, 1, 2))


def prepare(task, config: dict, inputs: dict, kernel_quant: QuantParams | None = None) -> Int8Candidate:
    built = build(task, config, inputs, kernel_quant)
    try:
        flags = configured.pool_flags(config)
    except BaseException:
        built.close()
        raise
    return Int8Candidate(built, task, inputs["quant"], built.notes["variant"], flags)
