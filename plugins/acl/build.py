"""Build (and cache) the ACL measurement runner, and say how to launch it.

The runner is the C++ sources in ``runner/`` (``main.cpp`` and the parts it uses; README.md lists
them), compiled in one compiler invocation that lists every ``runner/*.cpp`` against the system's
Arm Compute Library (Debian: ``libarm-compute-dev``, v20.08). On an aarch64 host the native ``g++``
is used and the binary runs directly; on any other host the cross compiler
``aarch64-linux-gnu-g++`` is used against the multiarch arm64 package and the binary runs under
``qemu-aarch64-static -L /``. Everything timed that way is emulated (see :func:`is_emulated`).

Binaries are cached in ``$KSELECT_CACHE_DIR/acl`` (default ``~/.cache/kselect/acl``), named by a
hash of every runner source and header (``runner/*.cpp``, ``runner/*.hpp``: names and contents)
and the build command, so editing, adding or removing any of them rebuilds automatically.

The ACL version is read at build time from the library itself (the ``arm_compute_version=vYY.MM``
string of its build information, see :func:`acl_version`) and passed to the compiler as
``KSELECT_ACL_VERSION_MAJOR`` / ``_MINOR``: the runner is written for two APIs, 20.08's (Debian 12)
and 24.11's (Debian 13), and refuses any other version in one line.

Overrides (environment): ``KSELECT_ACL_CXX`` (compiler), ``KSELECT_ACL_INCLUDE`` (directory that
holds ``arm_compute/``), ``KSELECT_ACL_LIBDIR`` (directory that holds ``libarm_compute.so``),
``KSELECT_ACL_QEMU`` (emulator binary).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kselect.core.measuring.device import RUNS_EMULATED

RUNNER_DIR = Path(__file__).resolve().parent / "runner"
MAIN_SOURCE = RUNNER_DIR / "main.cpp"
BINARY_STEM = "kselect_acl_runner"
CXXFLAGS = ["-O2", "-std=c++14", "-Wall"]
LIBS = ["-larm_compute", "-larm_compute_core", "-lpthread", "-ldl"]
# newer releases (24.11) ship one library: no libarm_compute_core
LIBS_SINGLE = ["-larm_compute", "-lpthread", "-ldl"]
GEMM_SYMBOL_24 = ("_ZN8arm_gemm4gemmIfffNS_7NothingEEESt10unique_ptrINS_10GemmCommonIT_T0_T1_EESt14default_deleteIS7_EERKNS_8"
                  "GemmArgsERKT2_")
_PROBE_HEADER = Path("arm_compute") / "runtime" / "NEON" / "functions" / "NEConvolutionLayer.h"


class AclUnavailable(RuntimeError):
    """The runner cannot be built or launched here; the message is one line saying why."""


def sources() -> list[Path]:
    """The runner's translation units (every ``runner/*.cpp``), in a fixed order."""
    return sorted(RUNNER_DIR.glob("*.cpp"))


def runner_files() -> list[Path]:
    """Every file the runner is built from (its ``.cpp`` and ``.hpp`` files), in a fixed order."""
    return sorted([*RUNNER_DIR.glob("*.cpp"), *RUNNER_DIR.glob("*.hpp")])


def is_native() -> bool:
    """True on an aarch64 host: native compiler, no emulator."""
    return platform.machine().lower() in ("aarch64", "arm64")


def is_emulated() -> bool:
    """True when the runner runs under qemu user-mode emulation (timings are NOT Arm timings): run
    through qemu from a non-Arm host, or natively from a Python that is itself emulated (an arm64
    root on an x86_64 machine, where the kernel hands every aarch64 program to qemu)."""
    return not is_native() or RUNS_EMULATED


def cache_dir() -> Path:
    base = os.environ.get("KSELECT_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "kselect"
    return root / "acl"


def _toolchain() -> tuple[str, list[str], list[str]]:
    """(compiler, include dirs, library dirs) for the current host."""
    if is_native():
        cxx = os.environ.get("KSELECT_ACL_CXX", "g++")
    else:
        cxx = os.environ.get("KSELECT_ACL_CXX", "aarch64-linux-gnu-g++")
    inc = os.environ.get("KSELECT_ACL_INCLUDE")
    lib = os.environ.get("KSELECT_ACL_LIBDIR")
    incs = [inc] if inc else ["/usr/include/aarch64-linux-gnu", "/usr/include", "/usr/local/include"]
    libs = [lib] if lib else ["/usr/lib/aarch64-linux-gnu", "/usr/lib", "/usr/local/lib"]
    return cxx, incs, libs


def _find_include(incs: list[str]) -> str | None:
    for d in incs:
        if (Path(d) / _PROBE_HEADER).is_file():
            return d
    return None


def _find_libdir(libs: list[str]) -> str | None:
    for d in libs:
        if (Path(d) / "libarm_compute.so").exists():
            return d
    return None


@dataclass(frozen=True)
class AclVersion:
    """An Arm Compute Library release, e.g. 20.08 or 24.11 (year.month, as ACL names them)."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}"


# The releases whose API the runner is written for: Debian 12's and Debian 13's libarm-compute-dev.
SUPPORTED_VERSIONS = (AclVersion(20, 8), AclVersion(24, 11))
_VERSION_STRING = re.compile(rb"arm_compute_version=v(\d+)\.(\d+)")


def parse_build_information(data: bytes) -> AclVersion | None:
    """The release named in ACL's build information (``arm_compute_version=v24.11 Build options:
    ...``, what ``arm_compute::build_information()`` returns; every ACL library holds it)."""
    match = _VERSION_STRING.search(data)
    return AclVersion(int(match[1]), int(match[2])) if match else None


@lru_cache(maxsize=None)
def _library_version(library: Path, size: int, mtime: float) -> AclVersion | None:
    return parse_build_information(library.read_bytes())


def acl_version(libdir: str | Path) -> AclVersion:
    """The version of the ACL in ``libdir`` (its ``libarm_compute.so``), read from the library."""
    library = (Path(libdir) / "libarm_compute.so").resolve()
    stat = library.stat()
    found = _library_version(library, stat.st_size, stat.st_mtime)
    if found is None:
        raise AclUnavailable(f"ACL runner: {library} names no ACL release (no arm_compute_version string): "
                             f"not an Arm Compute Library build kselect can use")
    return found


def check_supported(version: AclVersion, where: str) -> AclVersion:
    if version not in SUPPORTED_VERSIONS:
        known = " and ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise AclUnavailable(f"ACL runner: ACL {version} in {where} has neither API the runner is written for "
                             f"({known}): install Debian 12's or 13's libarm-compute-dev, or point "
                             f"KSELECT_ACL_INCLUDE / KSELECT_ACL_LIBDIR at a {known} build")
    return version


def _install_hint() -> str:
    if is_native():
        return "apt-get install g++ libarm-compute-dev"
    return ("dpkg --add-architecture arm64 && apt-get update && apt-get install --no-install-recommends "
            "qemu-user-static g++-aarch64-linux-gnu libarm-compute-dev:arm64")


def build_command(output: Path) -> list[str]:
    """The compiler command line (raises AclUnavailable when a prerequisite is missing)."""
    cxx, incs, libs = _toolchain()
    if shutil.which(cxx) is None:
        raise AclUnavailable(f"ACL runner: compiler '{cxx}' not found (install: {_install_hint()})")
    inc = _find_include(incs)
    if inc is None:
        raise AclUnavailable(f"ACL runner: ACL headers ({_PROBE_HEADER}) not found in {':'.join(incs)} "
                             f"(install: {_install_hint()})")
    lib = _find_libdir(libs)
    if lib is None:
        raise AclUnavailable(f"ACL runner: libarm_compute.so not found in {':'.join(libs)} "
                             f"(install: {_install_hint()})")
    version = check_supported(acl_version(lib), lib)
    libraries = LIBS if (Path(lib) / "libarm_compute_core.so").exists() else LIBS_SINGLE
    cmd = [cxx, *CXXFLAGS, f"-DKSELECT_ACL_VERSION_MAJOR={version.major}", f"-DKSELECT_ACL_VERSION_MINOR={version.minor}",
           f"-I{inc}", *(str(s) for s in sources()), "-o", str(output), f"-L{lib}", *libraries]
    if version.major >= 24:
        # the interposed arm_gemm::gemm<float,float,float,Nothing> must be in the executable's
        # dynamic symbols: the library defines it itself, so the linker would not export it
        cmd.append(f"-Wl,--export-dynamic-symbol={GEMM_SYMBOL_24}")
    if lib not in ("/usr/lib/aarch64-linux-gnu", "/usr/lib"):
        cmd.append(f"-Wl,-rpath,{lib}")
    return cmd


def _key() -> str:
    h = hashlib.sha256()
    for f in runner_files():
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    cmd = build_command(Path("OUT"))
    h.update("\0".join(cmd).encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def binary_path() -> Path:
    """Where the binary for the current source lives (it may not be built yet)."""
    return cache_dir() / f"{BINARY_STEM}-{_key()}"


def build_runner(force: bool = False) -> Path:
    """Compile the runner if needed and return the path of the binary.

    Raises AclUnavailable (one-line message) when the compiler, ACL headers or libraries are
    missing, or when compilation fails (first compiler error line included).
    """
    if not MAIN_SOURCE.is_file():
        raise AclUnavailable(f"ACL runner: source {MAIN_SOURCE} is missing")
    out = binary_path()
    if out.is_file() and os.access(out, os.X_OK) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = build_command(Path(tmp))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [l for l in proc.stderr.splitlines() if "error" in l] or proc.stderr.splitlines() or ["?"]
            raise AclUnavailable(f"ACL runner: compilation failed: {lines[0].strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: concurrent builders never see a half-written binary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def runner_command() -> list[str]:
    """argv prefix that launches an aarch64 binary here: qemu on x86_64, nothing on aarch64."""
    if is_native():
        return []
    qemu = os.environ.get("KSELECT_ACL_QEMU", "qemu-aarch64-static")
    path = shutil.which(qemu)
    if path is None:
        raise AclUnavailable(f"ACL runner: '{qemu}' not found (install: apt-get install qemu-user-static)")
    # -L / : use the multiarch arm64 libraries under /usr/lib/aarch64-linux-gnu.
    # (-L /usr/aarch64-linux-gnu hangs: the cross toolchain's loader mixes with the multiarch libc.)
    return [path, "-L", "/"]


def runner_argv(force_build: bool = False) -> list[str]:
    """Full argv: emulator prefix (if any) + built binary."""
    return [*runner_command(), str(build_runner(force=force_build))]


if __name__ == "__main__":  # python -m kselect.plugins.acl.build [--force]
    import sys
    import time

    t0 = time.time()
    try:
        p = build_runner(force="--force" in sys.argv)
    except AclUnavailable as e:
        print(e, file=sys.stderr)
        raise SystemExit(1)
    print(f"{p}  ({time.time() - t0:.1f} s; launch: {' '.join(runner_command() + [str(p)])})")
