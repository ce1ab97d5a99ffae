"""What the tuning runs on: CPU model, ISA features, cores and core clusters, and a fingerprint
that keys every record and plan (records from another device are never reused)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

# ISA features that change which kernels a library can run.
INTERESTING_FEATURES = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
    "asimd", "fphp", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16",
)


@dataclass
class Device:
    arch: str
    cpu_model: str
    features: list[str]
    cores: int
    clusters: list[list[int]]  # cpu ids per cluster of alike cores, biggest cores first
    extra: dict = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        text = json.dumps([self.arch, self.cpu_model, self.features, self.cores, self.clusters])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {**asdict(self), "fingerprint": self.fingerprint}

    def summary(self) -> str:
        cluster_text = " + ".join(str(len(c)) for c in self.clusters)
        return f"{self.cpu_model} ({self.arch}, {self.cores} cores: {cluster_text})"


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = value.split()
        elif key == "cpu part" and model == platform.machine():
            model = f"arm part {value.strip()}"
    return model, sorted(set(flags) & set(INTERESTING_FEATURES))


def _core_capacity(cpu: int) -> int | None:
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}")
    for path in (base / "cpu_capacity", base / "cpufreq" / "cpuinfo_max_freq"):
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def clusters_of(cpus: list[int]) -> list[list[int]]:
    capacities = {cpu: _core_capacity(cpu) for cpu in cpus}
    if any(c is None for c in capacities.values()) or len(set(capacities.values())) <= 1:
        return [sorted(cpus)]
    groups: dict[int, list[int]] = {}
    for cpu, capacity in capacities.items():
        groups.setdefault(capacity, []).append(cpu)
    return [sorted(groups[c]) for c in sorted(groups, reverse=True)]


def kernel_machine(proc_arch: str = "/proc/sys/kernel/arch", cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The machine the kernel runs on, read where qemu user-mode emulation does not rewrite it: under
    emulation ``platform.machine()`` (uname) is the guest's (aarch64), but the kernel is the host's.
    /proc/sys/kernel/arch (Linux 6.1+) names it; without that file /proc/cpuinfo tells x86 (its
    ``vendor_id``) from Arm (``CPU implementer``), qemu before 8.2 passing the host's through. None
    when neither says."""
    try:
        return Path(proc_arch).read_text().strip() or None
    except OSError:
        pass
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    keys = {line.partition(":")[0].strip().lower() for line in text.splitlines()}
    if "vendor_id" in keys:
        return "x86_64" if platform.architecture()[0] == "64bit" else "i686"
    if "cpu implementer" in keys:
        return "aarch64"
    return None


def _same_machine(a: str, b: str) -> bool:
    aliases = {"arm64": "aarch64", "amd64": "x86_64"}
    return aliases.get(a.lower(), a.lower()) == aliases.get(b.lower(), b.lower())


def runs_emulated(machine: str, kernel: str | None) -> bool:
    """True when this process runs under user-mode emulation (qemu-user through binfmt_misc, e.g. in
    scripts/arm64-root.sh's root): the program's machine is not the kernel's. Every time taken in
    such a process is emulated, never the guest CPU's performance."""
    return kernel is not None and not _same_machine(machine, kernel)


RUNS_EMULATED = runs_emulated(platform.machine(), kernel_machine())

_DEVICE: Device | None = None


def this_device() -> Device:
    global _DEVICE
    if _DEVICE is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        model, features = _cpuinfo()
        _DEVICE = Device(platform.machine(), model, features, len(cpus), clusters_of(cpus))
    return _DEVICE


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None if unknown."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def proc_bytes(path: str, field: str) -> int | None:
    """A ``<field>: <n> kB`` line of a /proc file, in bytes; None where there is none (not Linux)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
