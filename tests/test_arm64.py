"""kselect on aarch64: which ACL release the runner is built for, and whether this process's timings
are emulated (an arm64 root on an x86_64 machine, scripts/arm64-root.sh) or native."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kselect.core.contract.library import Library
from kselect.core.measuring import device
from kselect.plugins.acl import build

import graphs

# -- ACL release, read from the library at build time -------------------------------------------

def test_build_information_names_the_release():
    assert build.parse_build_information(b"\0arm_compute_version=v20.08 Build options: {'arch': 'arm64-v8a'}\0") \
        == build.AclVersion(20, 8)
    assert build.parse_build_information(b"xx arm_compute_version=v24.11 Build options") == build.AclVersion(24, 11)
    assert build.parse_build_information(b"no version here") is None
    assert str(build.AclVersion(20, 8)) == "20.08" and str(build.AclVersion(24, 11)) == "24.11"


def _installed_libdir() -> str:
    _, _, libs = build._toolchain()
    libdir = build._find_libdir(libs)
    if libdir is None:
        pytest.skip("no libarm_compute.so installed")
    return libdir


def test_installed_acl_is_a_supported_release():
    """Debian 12's package is 20.08, Debian 13's 24.11: the release read from the library is one of them
    and goes to the compiler."""
    libdir = _installed_libdir()
    version = build.acl_version(libdir)
    assert version in build.SUPPORTED_VERSIONS
    if build.shutil.which(build._toolchain()[0]) and build._find_include(build._toolchain()[1]):
        command = build.build_command(Path("out"))
        assert f"-DKSELECT_ACL_VERSION_MAJOR={version.major}" in command
        assert f"-DKSELECT_ACL_VERSION_MINOR={version.minor}" in command


def test_unsupported_release_is_refused_in_one_line():
    with pytest.raises(build.AclUnavailable) as refused:
        build.check_supported(build.AclVersion(22, 5), "/opt/acl/lib")
    message = str(refused.value)
    assert "\n" not in message and "22.05" in message and "20.08" in message and "24.11" in message
    assert "libarm-compute-dev" in message


def test_library_without_a_release_string_is_refused(tmp_path):
    (tmp_path / "libarm_compute.so").write_bytes(b"\x7fELF not an ACL build")
    with pytest.raises(build.AclUnavailable) as refused:
        build.acl_version(tmp_path)
    assert "\n" not in str(refused.value) and "no ACL release" in str(refused.value)


# arm_gemm's plain interleaved fp32 kernel as each release names it, a phrase of what each release's
# runner says of the two 24.11 knobs the plugin does not offer, and whether an NHWC depthwise conv's
# work split can be chosen (24.11's assembly depthwise kernel divides its work by thread id itself)
ACL_RELEASE_FACTS = {
    "v20.08": dict(kernel="sgemm_12x8_1d", fixed_format="ACL 20.08 has no fixed-format weights",
                   gemm_fast_math="ACL 20.08's GEMM convolution takes no fast-math flag", depthwise_split_nhwc=True),
    "v24.11": dict(kernel="a64_sgemm_8x12", fixed_format="fixed-format kernels", gemm_fast_math="bf16",
                   depthwise_split_nhwc=False),
}


def test_acl_space_lists_its_releases_gemm_kernels_and_names_the_knobs_it_lacks():
    """20.08 and 24.11 pick an fp32 GEMM's arm_gemm kernel through different functions, and the
    runner forces the kernel through the one its release has: a 3x3 conv's space offers the
    installed release's kernel names (none of the other's), gemm_kernel is not missing, and
    24.11's fixed-format weights and GEMM fast math are named missing with what ACL says here."""
    from kselect.core.measuring.device import this_device
    from kselect.plugins.acl.library import AclLibrary

    from test_acl_library import conv_task

    library = AclLibrary()
    available, why = library.availability()
    if not available:
        pytest.skip(why)
    facts = ACL_RELEASE_FACTS[library._runner_info()["acl_version"]]
    kernels = set(library.space(conv_task(16, 16, 14, 3), this_device()).dim("gemm_kernel").choices)
    assert facts["kernel"] in kernels
    assert not kernels & {other["kernel"] for other in ACL_RELEASE_FACTS.values() if other is not facts}
    missing = library.missing_dims()
    assert "gemm_kernel" not in missing
    for knob in ("fixed_format", "gemm_fast_math"):
        if knob == "gemm_fast_math" and library._runner_info()["extensions"]["gemm_fast_math"]:
            assert knob not in missing  # offered: 24.11 on a CPU with BF16 (test below)
            continue
        assert facts[knob] in missing[knob] and "\n" not in missing[knob], missing[knob]
    # 24.11's assembly depthwise kernel (NHWC) divides its work by thread id itself: no split there
    device = this_device()
    if device.cores > 1:
        configs = library.space(conv_task(16, 16, 10, 3, group=16), device).enumerate()
        split_in = {c["layout"] for c in configs if c.get("scheduler") == "kselect"}
        assert split_in == ({"NCHW", "NHWC"} if facts["depthwise_split_nhwc"] else {"NCHW"}), split_in
    library.close()


# -- user-mode emulation ----------------------------------------------------------------------------

def test_program_machine_against_kernel_machine():
    assert device.runs_emulated("aarch64", "x86_64")  # an arm64 root on an x86_64 machine
    assert not device.runs_emulated("aarch64", "aarch64")  # an Arm board
    assert not device.runs_emulated("arm64", "aarch64") and not device.runs_emulated("x86_64", "amd64")
    assert not device.runs_emulated("aarch64", None)  # the kernel does not say: not claimed emulated


def test_kernel_machine_from_proc(tmp_path):
    arch = tmp_path / "arch"
    arch.write_text("x86_64\n")
    assert device.kernel_machine(str(arch), "/nonexistent") == "x86_64"
    # no /proc/sys/kernel/arch (Linux before 6.1): /proc/cpuinfo as qemu passes the host's through, or an Arm kernel's
    x86 = tmp_path / "cpuinfo-x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2\n")
    arm = tmp_path / "cpuinfo-arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    assert device.kernel_machine(str(tmp_path / "none"), str(x86)).startswith(("x86_64", "i686"))
    assert device.kernel_machine(str(tmp_path / "none"), str(arm)) == "aarch64"
    assert device.kernel_machine(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_this_process_is_labelled_as_it_runs():
    """On x86_64 and on an Arm board timings are native; in the arm64 root every library's are emulated."""
    expected = platform.machine() in ("aarch64", "arm64") and device.kernel_machine() not in (None, "aarch64", "arm64")
    assert device.RUNS_EMULATED == expected
    assert Library.emulated == expected
    assert build.is_emulated() == (expected or not build.is_native())


def test_kselect_plugins_json_labels_every_library_as_it_runs():
    """`kselect plugins --json`: MLAS and ACL are available on both machines (ACL 20.08 on Debian 12,
    24.11 on Debian 13); every available library's timings are emulated in the arm64 root, ACL's alone
    on x86_64."""
    listed = subprocess.run([sys.executable, "-m", "kselect.cli.main", "plugins", "--json"], capture_output=True,
                            text=True, timeout=900, check=True)
    libraries = {p["name"]: p for p in json.loads(listed.stdout) if p["kind"] == "library"}
    for name in ("mlas", "acl"):
        assert libraries[name]["status"].startswith("available"), libraries[name]
    assert libraries["acl"]["version"].startswith(("arm-compute 20.08", "arm-compute 24.11"))
    for name, entry in libraries.items():
        if entry["status"].startswith("available"):
            expected = device.RUNS_EMULATED or (name == "acl" and not build.is_native())
            assert entry["capabilities"]["emulated"] == expected, name
            assert ("(emulated)" in entry["status"]) == expected, name


def test_mlas_plans_run_where_mlas_has_no_nchwc_kernels():
    """On aarch64 MLAS has no NCHWc kernels (ONNX Runtime reports block 1): a plan with every conv in
    NCHW runs on the model as it is; asking for NCHWc there is refused."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from kselect.plugins.mlas.rewrite import rewrite_model

    weights = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "W")
    model = graphs.model([helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])], [weights],
                         input_shape=(1, 3, 8, 8), output_shapes=[(1, 4, 8, 8)], opset=13)
    info: dict = {}
    rewritten = rewrite_model(model, {"conv": "NCHW"}, 1, info=info)
    assert rewritten.SerializeToString() == model.SerializeToString() and rewritten is not model
    assert info["nchwc_convs"] == [] and info["reorder_inputs"] == []
    with pytest.raises(ValueError, match="no NCHWc kernels"):
        rewrite_model(model, {"conv": "NCHWc"}, 1)
    onnx.checker.check_model(rewritten)



def test_mlas_offers_nchwc_only_where_it_has_nchwc_kernels():
    """A conv's space holds the NCHWc layout only where MLAS has NCHWc kernels (block > 1, x86); on
    aarch64 (block 1) it is NCHW alone, and so is the default, with or without the model prepared."""
    from kselect.core.measuring.device import this_device
    from kselect.plugins.mlas.layout import nchwc_block_size
    from kselect.plugins.mlas.library import MlasLibrary

    from helpers import twin_conv

    conv = twin_conv("fp32", [1, 16, 8, 8], [32, 16, 3, 3], [1, 32, 8, 8], 3)
    library = MlasLibrary()
    layouts = {d.name: d for d in library.space(conv, this_device()).dims}["layout"].choices
    if nchwc_block_size() > 1:
        assert layouts == ("NCHWc", "NCHW")
    else:
        assert layouts == ("NCHW",) and library.default_config(conv, this_device())["layout"] == "NCHW"

# -- ONNX Runtime's Arm64 MLAS knobs: KleidiAI on or off, the bf16 fast-math GEMM (plugins/mlas/arm.py) --

from kselect.plugins.mlas import arm  # noqa: E402

ON_ARM = platform.machine() in ("aarch64", "arm64")
ARM_KNOBS = {"kleidiai": "sme", "bf16_fastmath": "bf16"}  # dim -> the CPU feature it needs


def _conv_and_matmul_model(path: Path) -> Path:
    """A 3x3 conv (KleidiAI's route on a CPU with SME), a pooling, and a fully connected layer ONNX
    Runtime runs as MatMul (no bias Add to fuse into a Gemm: the bf16 fast-math GEMM reaches it)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    y = graphs.conv(nodes, inits, rng, "conv", "x", 8, 16, 3)
    nodes += [helper.make_node("GlobalAveragePool", [y], ["pooled"], name="pool"),
              helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
              helper.make_node("MatMul", ["flat", "fc.w"], ["y"], name="fc")]
    inits.append(numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "fc.w"))
    onnx.save(graphs.model(nodes, inits, input_shape=(1, 8, 12, 12), output_shapes=[(1, 32)], name="convmatmul"), path)
    return path


def test_arm_knobs_missing_with_reasons():
    keys = frozenset(arm.ARM_DIMS.values())
    on_x86 = arm.missing_arm_dims("x86_64", keys, frozenset({"sme", "bf16"}))
    assert set(on_x86) == set(ARM_KNOBS) and all("this is x86_64" in why for why in on_x86.values())
    old_build = arm.missing_arm_dims("aarch64", frozenset(), frozenset({"sme", "bf16"}))
    assert "no mlas.disable_kleidiai" in old_build["kleidiai"]
    assert "no mlas.enable_gemm_fastmath_arm64_bfloat16" in old_build["bf16_fastmath"]
    neoverse_n1 = arm.missing_arm_dims("aarch64", keys, frozenset({"fp", "asimd", "asimddp"}))
    assert "no sme in /proc/cpuinfo" in neoverse_n1["kleidiai"] and "no bf16 in" in neoverse_n1["bf16_fastmath"]
    assert arm.missing_arm_dims("aarch64", keys, frozenset({"bf16"})).keys() == {"kleidiai"}
    assert arm.missing_arm_dims("aarch64", keys, frozenset({"sme", "bf16"})) == {}
    for reasons in (on_x86, old_build, neoverse_n1):
        assert all("\n" not in why for why in reasons.values())


def test_installed_onnxruntime_has_the_arm_keys_where_it_reads_them():
    """Read off the build: PyPI's aarch64 wheel has both keys; the x86_64 one has no bf16 fast-math
    GEMM (its MatMul reads the key only when built for aarch64 Linux)."""
    keys = arm.ort_build_keys()
    if ON_ARM:
        assert keys == frozenset(arm.ARM_DIMS.values())
    else:
        assert arm.BF16_FASTMATH_KEY not in keys


@pytest.mark.skipif(ON_ARM, reason="the x86_64 side: on aarch64 the knobs are offered where the CPU has them")
def test_space_on_x86_names_the_missing_arm_knobs(tmp_path):
    space = subprocess.run([sys.executable, "-m", "kselect.cli.main", "space", str(_conv_and_matmul_model(tmp_path / "m.onnx")),
                            "--library", "mlas", "--json"], capture_output=True, text=True, timeout=300, check=True)
    listed = json.loads(space.stdout)
    assert set(listed["missing_dims"]) >= set(ARM_KNOBS)
    for dim in ARM_KNOBS:
        why = listed["missing_dims"][dim]
        assert arm.ARM_DIMS[dim] in why and "Arm64" in why and platform.machine() in why
        assert all(dim not in task["dimensions"] for task in listed["tasks"])


@pytest.mark.skipif(not ON_ARM, reason="aarch64 only: on other machines the Arm knobs are missing (test above)")
def test_space_on_aarch64_offers_each_knob_where_the_cpu_has_it(tmp_path):
    """In the arm64 root: on its default Neoverse-N1 (no SME, no BF16) both are missing, named so; with
    KSELECT_ARM64_QEMU_CPU=max (SME and BF16) KleidiAI is a dim of the 3x3 conv and bf16 fast math
    one of the fully connected layer ONNX Runtime runs as MatMul."""
    space = subprocess.run([sys.executable, "-m", "kselect.cli.main", "space", str(_conv_and_matmul_model(tmp_path / "m.onnx")),
                            "--library", "mlas", "--json"], capture_output=True, text=True, timeout=900, check=True)
    listed = json.loads(space.stdout)
    dims = {task["kind"]: task["dimensions"] for task in listed["tasks"]}
    features = arm.cpu_features()
    for dim, feature in ARM_KNOBS.items():
        kind = "conv" if dim == "kleidiai" else "fc"
        if feature in features:
            assert dim in dims[kind] and dim not in listed["missing_dims"], (dim, dims)
        else:
            assert dim not in dims[kind] and f"no {feature} in /proc/cpuinfo" in listed["missing_dims"][dim]


needs_bf16_and_sme = pytest.mark.skipif(
    not (ON_ARM and {"bf16", "sme"} <= arm.cpu_features()),
    reason="needs an aarch64 CPU with BF16 and SME (in the arm64 root: KSELECT_ARM64_QEMU_CPU=max)")


@needs_bf16_and_sme
def test_bf16_fastmath_candidate_is_held_to_bf16_tolerance():
    """A MatMul under the bf16 fast-math GEMM computes in bf16: beyond fp32's tolerance, within bf16's,
    so it is measured valid; KleidiAI off and on are both exact."""
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
    from kselect.core.models.tasks import Task
    from kselect.plugins.mlas.library import MlasLibrary

    library = MlasLibrary()
    fc = Task("T", "fc0123456789abcd", "fc", [1, 256], [64, 256], [1, 64], {"alpha": 1.0, "beta": 1.0, "transB": 0},
              False, ["fc"])
    settings = MeasureSettings(min_time_s=0.001, min_repeats=1)
    base = {"threads": 1, "spinning": 1, "prepacking": 1}
    exact = measure_in_this_process(library, fc, {**base, "bf16_fastmath": 0}, settings, {})
    fast = measure_in_this_process(library, fc, {**base, "bf16_fastmath": 1}, settings, {})
    assert exact.status == "ok" and exact.error < 1e-5
    assert fast.status == "ok" and 1e-4 < fast.error < arm.BF16_PLAN_ERROR, fast
    conv = Task("C", "c0ffee0123456789", "conv", [1, 16, 8, 8], [16, 16, 3, 3], [1, 16, 8, 8],
                {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}, True,
                ["conv"])
    assert "kleidiai" in [d.name for d in library.space(conv, this_device()).dims]
    for kleidiai in (1, 0):
        result = measure_in_this_process(library, conv, {"layout": "NCHW", "threads": 1, "spinning": 1,
                                                         "kleidiai": kleidiai}, settings, {})
        assert result.status == "ok" and result.error < 1e-5, result


@needs_bf16_and_sme
def test_tune_chooses_the_arm_knobs_and_the_plan_runs_with_them(tmp_path):
    """`kselect tune --library mlas` measures both values of each knob, the plan stores the chosen ones,
    its export's session options carry them, and `kselect bench` runs it within bf16's bound."""
    from helpers import kselect_json, run_kselect

    model = _conv_and_matmul_model(tmp_path / "convmatmul.onnx")
    plan_path, bench_path = tmp_path / "plan.json", tmp_path / "bench.json"
    kselect_json("tune", model, "--library", "mlas", "--search", "exhaustive", "--budget", "32", "--min-time", "0.01",
                 "--min-repeats", "3", "--no-verify", "--db", tmp_path / "records.db", "-o", plan_path, timeout=1800)
    plan = json.loads(plan_path.read_text())
    assert plan["plan_level"]["kleidiai"] in (0, 1) and plan["plan_level"]["bf16_fastmath"] in (0, 1)
    kselect_json("plan", "apply", plan_path, model, "-o", tmp_path / "out", timeout=900)
    options = json.loads(next((tmp_path / "out").glob("*.session.json")).read_text())["config_entries"]
    assert options[arm.DISABLE_KLEIDIAI_KEY] == ("0" if plan["plan_level"]["kleidiai"] else "1")
    assert options[arm.BF16_FASTMATH_KEY] == str(plan["plan_level"]["bf16_fastmath"])
    benched = run_kselect("bench", model, "--plan", plan_path, "--rounds", "1", "--runs-per-round", "1",
                          "--json", bench_path, timeout=1800)
    assert benched.returncode == 0, benched.stderr
    result = json.loads(bench_path.read_text())
    assert result["library"] == "mlas" and result["max_relative_output_error"] < arm.BF16_PLAN_ERROR


@needs_bf16_and_sme
def test_bf16_fastmath_is_named_missing_for_a_model_without_matmul():
    """ONNX Runtime runs a Gemm fully connected layer (the contract model's) without the fast-math GEMM."""
    from kselect.core.contract.checks import contract_model
    from kselect.core.models.model import model_from_proto
    from kselect.plugins.mlas.library import MlasLibrary

    library = MlasLibrary()
    assert "bf16_fastmath" not in library.missing_dims()
    library.prepare_model(model_from_proto("contract_cnn", contract_model()))
    assert "runs no MatMul in this model" in library.missing_dims()["bf16_fastmath"]
    assert "kleidiai" not in library.missing_dims()


@pytest.mark.skipif(not (ON_ARM and "bf16" in arm.cpu_features()),
                    reason="needs an aarch64 CPU with BF16 (in the arm64 root: KSELECT_ARM64_QEMU_CPU=max)")
def test_acl_gemm_fast_math_runs_on_bf16_kernels_held_to_bf16s_tolerance():
    """ACL 24.11 on a CPU with BF16, in a build with arm_gemm's fast-mode kernels: a 3x3 conv's
    space offers fast_math on the GEMM method too; a GEMM candidate with it computes in bf16 (held
    to bf16's tolerance, not fp32's), every GEMM of the op ran on an arm_gemm bf16 kernel, and the
    knob is not named missing. Debian's 24.11 has no such kernels (the runner says so, and the test
    is skipped with its words)."""
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
    from kselect.plugins.acl.library import AclLibrary

    from test_acl_library import conv_task

    library = AclLibrary()
    extensions = library._runner_info()["extensions"]
    if not extensions["gemm_fast_math"]:
        pytest.skip(f"no GEMM fast math here: {extensions['gemm_fast_math_reason']}")
    task, device = conv_task(16, 16, 14, 3), this_device()
    space = library.space(task, device)
    assert "GEMM" in space.dim("fast_math").when["method"] and True in space.dim("fast_math").choices
    config = space.normalise({"method": "GEMM", "fast_math": True, "layout": "NHWC", "gemm_kernel": "default", "threads": 1})
    assert config in space and library.computes_in(task, config) == "bf16"
    settings = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05, timeout_s=300)
    result = measure_in_this_process(library, task, config, settings, {})
    assert result.status == "ok", result
    gemms = library.last_result["gemm"]["gemms"]
    assert gemms and all("bf16" in gemm["used"] for gemm in gemms), gemms
    assert "gemm_fast_math" not in library.missing_dims()
    library.close()
