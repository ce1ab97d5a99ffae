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
