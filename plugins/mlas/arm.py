"""ONNX Runtime's MLAS knobs on Arm (aarch64): KleidiAI on or off and the bf16 fast-math GEMM, offered as plan-level dims where they can change
something, and why each is missing elsewhere.

Read from ONNX Runtime's sources and checked in the arm64 root (docs/arm.md) on onnxruntime 1.32's
aarch64 wheel, one single-op session per op with each key at both values:

* ``mlas.enable_gemm_fastmath_arm64_bfloat16`` ("1"): the float ``MatMul`` kernel (and
  ``FusedMatMul``) packs its constant weights to bf16 and runs MLAS's SBGEMM (bf16 inputs, fp32
  accumulation) when the CPU has BF16 (``MlasBf16AccelerationSupported``: HWCAP2_BF16, Armv8.6-A);
  it reads the key only in a build for aarch64 Linux. ``Gemm``, ``Conv`` and ``ConvTranspose`` do
  not read it: on the emulated CPU with BF16 their outputs were bit-identical both ways, MatMul's
  not. ORT fuses a MatMul followed by a bias Add into a Gemm, so the knob reaches only the fully
  connected layers ORT keeps as MatMul (``ort_matmul_nodes``). It changes precision: its
  candidates are checked against bf16's tolerance, and a plan enabling it against bf16's bound end
  to end (``BF16_PLAN_ERROR``).
* ``mlas.disable_kleidiai`` ("1": off): MLAS installs KleidiAI's fp32 SGEMM / SGEMV, its convolution
  (SME IGEMM) and its dynamically quantized GEMM only on a CPU with SME (``HasArm_SME``); its bf16
  GEMM needs SME2. Of the ops kselect tunes (float Conv / Gemm / MatMul / ConvTranspose; QDQ int8
  ops run on MLAS's own dot-product / i8mm QGEMM), on the emulated CPU with SME the outputs changed
  with the key for 2-D convolutions with one group and a kernel of at least 3x3 (the ones
  ``ArmKleidiAI::SelectConvRoute`` takes: batch 1, the same padding on every side, more than one
  filter) and for fully connected layers with one row (M = 1, KleidiAI's GEMV); depthwise, grouped,
  1x1 and transposed convolutions and GEMMs with more rows were bit-identical both ways. On a CPU
  without SME the key changes nothing.
* ``mlas.kleidiai.conv_igemm_max_work`` is not offered: it moves a KleidiAI conv between its SME
  IGEMM and its SGEMM route (MLAS's limit: 1,000,000 multiply-adds); at 1 and at the largest value
  every conv tried gave bit-identical outputs under emulation, so whether it changed the route is
  not known without an SME board to time it on.

Each key is looked up in the installed onnxruntime's extension module (its string is there when
the build reads it), never inferred from a version number.
"""

from __future__ import annotations

import functools
import importlib.util
import platform
from pathlib import Path

BF16_FASTMATH_KEY = "mlas.enable_gemm_fastmath_arm64_bfloat16"
DISABLE_KLEIDIAI_KEY = "mlas.disable_kleidiai"

# dim -> the session config key it sets
ARM_DIMS = {"kleidiai": DISABLE_KLEIDIAI_KEY, "bf16_fastmath": BF16_FASTMATH_KEY}
# the CPU feature (Linux's /proc/cpuinfo name) without which each knob changes nothing
NEEDED_FEATURE = {"kleidiai": "sme", "bf16_fastmath": "bf16"}
WHAT = {"kleidiai": "KleidiAI's micro-kernels in MLAS", "bf16_fastmath": "fp32 MatMul computed in bf16"}
WHY_FEATURE = {
    "kleidiai": "MLAS installs KleidiAI's fp32 kernels (SGEMM, conv IGEMM) only on a CPU with SME",
    "bf16_fastmath": "bf16 fast-math GEMM needs the CPU's BF16 instructions (Armv8.6-A)",
}
# The largest output error relative to ORT's default a plan computing its MatMuls in bf16 may show end
# to end: 8 units of bf16's roundoff (2^-8) for a few GEMMs rounding their inputs in sequence.
BF16_PLAN_ERROR = 8 * 2.0 ** -8


def ort_extension_module() -> Path | None:
    """The installed onnxruntime's native module (``onnxruntime/capi/onnxruntime_pybind11_state*``),
    which holds ORT itself, its session config keys included."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted((Path(location) / "capi").glob("onnxruntime_pybind11_state*"))
        if found:
            return found[0]
    return None


@functools.cache
def ort_build_keys() -> frozenset[str]:
    """Which of the Arm MLAS keys the installed onnxruntime build reads (their strings are in it)."""
    module = ort_extension_module()
    if module is None:
        return frozenset()
    data = module.read_bytes()
    return frozenset(key for key in ARM_DIMS.values() if b"\0" + key.encode() + b"\0" in data)


@functools.cache
def cpu_features(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first ``Features`` line of an Arm kernel's /proc/cpuinfo (empty elsewhere)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "features":
            return frozenset(value.split())
    return frozenset()


def missing_arm_dims(machine: str | None = None, build_keys: frozenset[str] | None = None,
                     features: frozenset[str] | None = None) -> dict[str, str]:
    """Each Arm knob that can do nothing here, with why in one line (by default for this machine,
    the installed onnxruntime and this CPU)."""
    machine = machine or platform.machine()
    build_keys = ort_build_keys() if build_keys is None else build_keys
    features = cpu_features() if features is None else features
    missing = {}
    for dim, key in ARM_DIMS.items():
        if machine not in ("aarch64", "arm64"):
            missing[dim] = f"{key} ({WHAT[dim]}) is an option of ONNX Runtime's Arm64 builds: this is {machine}"
        elif key not in build_keys:
            missing[dim] = f"this onnxruntime build has no {key} (onnxruntime 1.32's aarch64 wheel has it)"
        elif NEEDED_FEATURE[dim] not in features:
            missing[dim] = (f"{WHY_FEATURE[dim]}; this one has none (no {NEEDED_FEATURE[dim]} in /proc/cpuinfo "
                            f"Features): {key} changes nothing here")
    return missing


def offered_arm_dims() -> frozenset[str]:
    return frozenset(ARM_DIMS) - frozenset(missing_arm_dims())


def kleidiai_applies(task) -> bool:
    """Whether KleidiAI can run this op (module docstring): a 2-D conv with one group, batch 1, one
    padding on every side, a kernel of at least 3x3 and more than one filter; a fully connected
    layer with one row."""
    if task.kind == "fc":
        return task.input_shape[0] == 1
    if task.kind != "conv" or task.conv1d:
        return False
    a = task.attrs
    return (a["group"] == 1 and task.input_shape[0] == 1 and len(set(a["pads"])) == 1 and min(a["kernel"]) >= 3
            and task.weight_shape[0] > 1)


def arm_config_entries(config: dict) -> dict[str, str]:
    """The session config entries of a config's Arm dims."""
    entries = {}
    if "kleidiai" in config:
        entries[DISABLE_KLEIDIAI_KEY] = "0" if config["kleidiai"] else "1"
    if "bf16_fastmath" in config:
        entries[BF16_FASTMATH_KEY] = str(int(config["bf16_fastmath"]))
    return entries
