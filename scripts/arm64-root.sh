#!/usr/bin/env bash
# A Debian 13 (trixie) arm64 root, built once with debootstrap under qemu user-mode emulation and
# cached, in which kselect runs as an aarch64 program. Every timing taken in it is emulated: it proves
# installability and correctness on aarch64, never Arm performance.
#
#   scripts/arm64-root.sh build            build the root if it is not there yet (idempotent)
#   scripts/arm64-root.sh run -- CMD...    run CMD in the root, in the repository (bind-mounted at /kselect)
#   scripts/arm64-root.sh shell            an interactive shell there
#   scripts/arm64-root.sh path             print where the root is
#
# Needs root (mounting binfmt_misc, debootstrap, chroot). The root lives in
# ${KSELECT_ARM64_ROOT:-/var/cache/kselect/arm64-trixie}; the repository's .venv inside the root is
# the root's own (an aarch64 virtualenv kept in the root), not the host's.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
root=${KSELECT_ARM64_ROOT:-/var/cache/kselect/arm64-trixie}
suite=trixie
in_root_repo=/kselect
# what `make setup` needs before it can run; the rest (g++, libraries, wheels) it installs itself
base_packages=python3,python3-venv,python3-pip,ca-certificates,make

die() { echo "arm64-root: $*" >&2; exit 2; }

[[ $(id -u) -eq 0 ]] || die "needs root (binfmt_misc, debootstrap, chroot); run it with sudo"

install_host_tools() {
    local missing=()
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    [[ -x /usr/bin/qemu-aarch64-static ]] || missing+=(qemu-user-static)
    if ((${#missing[@]})); then
        echo "arm64-root: installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
}

# The kernel runs aarch64 programs through qemu once binfmt_misc knows the interpreter. Flag F opens
# the interpreter at registration, so it works inside the chroot where /usr/libexec/... is absent.
register_aarch64_interpreter() {
    local binfmt=/proc/sys/fs/binfmt_misc
    [[ -e $binfmt/register ]] || mount -t binfmt_misc binfmt_misc "$binfmt"
    if [[ -e $binfmt/qemu-aarch64 ]]; then
        grep -q '^flags:.*F' "$binfmt/qemu-aarch64" \
            || die "qemu-aarch64 is registered in binfmt_misc without flag F (it cannot run inside a chroot); remove it with 'echo -1 > $binfmt/qemu-aarch64' and run again"
        return
    fi
    local conf=/usr/lib/binfmt.d/qemu-aarch64.conf
    [[ -f $conf ]] || die "$conf is missing: install qemu-user-static"
    grep -q ':[A-Z]*F[A-Z]*$' "$conf" || die "$conf does not carry flag F"
    cat "$conf" > "$binfmt/register"
}

# Debian's registry as this machine's apt sources name it (deb822 .sources or one-line .list files).
debian_mirror() {
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -v '^\s*#' | grep -oE '(https?|file)://[^ ]+/debian/?( |$)' | grep -v -- '-security' | head -n1 | tr -d ' ')
    [[ -n $uri ]] || die "no Debian mirror (a URI ending in /debian) in /etc/apt/sources.list*"
    echo "${uri%/}"
}

build_root() {
    [[ -f $root/.kselect-root ]] && return
    install_host_tools
    register_aarch64_interpreter
    mkdir -p "$(dirname "$root")"
    exec 9>"$root.lock"
    flock 9
    [[ -f $root/.kselect-root ]] && return
    local partial=$root.partial mirror started
    mirror=$(debian_mirror)
    rm -rf "$partial"
    echo "arm64-root: debootstrap --arch=arm64 $suite from $mirror into $root (several minutes: every program of the install runs emulated)"
    started=$(date +%s)
    debootstrap --arch=arm64 --variant=minbase --include="$base_packages" "$suite" "$partial" "$mirror"
    mkdir -p "$partial$in_root_repo" "$partial/var/lib/kselect/venv"
    printf 'built %s\nbuild_seconds %s\nsize_mb_at_build %s\nmirror %s\n' \
        "$(date -u +%FT%TZ)" "$(( $(date +%s) - started ))" "$(du -sm "$partial" | cut -f1)" "$mirror" \
        > "$partial/.kselect-root"
    mv "$partial" "$root"
    echo "arm64-root: built in $(sed -n 's/^build_seconds //p' "$root/.kselect-root") s, $(du -sh "$root" | cut -f1)"
}

# qemu 7.2 (Debian 12) passes the host's /proc/cpuinfo through to aarch64 programs, and aarch64
# programs that read it to describe the CPU crash on an x86 one (onnxruntime's import segfaults). In
# the root /proc/cpuinfo is a stand-in in the Arm kernel's format, one entry per host cpu, for the CPU
# qemu emulates: a Neoverse-N1 (Armv8.2 with NEON and dot product, no SVE), or with
# KSELECT_ARM64_QEMU_CPU=max qemu's "max" CPU, whose features are its HWCAP / HWCAP2 (getauxval)
# under qemu 7.2 and its MIDR (0x000f0510) as read there. Newer qemu (8.2+) emulates the file itself.
# The kernel's own machine (/proc/sys/kernel/arch) still says x86_64, which is how kselect tells it
# runs emulated (core/measuring/device.py).
write_cpuinfo_stand_in() {
    local cpus=$1 cpu=$2 i features ids
    if [[ $cpu == max* ]]; then
        features='fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm ilrcpc flagm sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 i8mm bf16 rng bti mte sme smei16i64 smef64f64 smei8i32 smef16f32 smeb16f32 smef32f32 smefa64'
        ids='CPU implementer\t: 0x00\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x051\nCPU revision\t: 0\n\n'
    else
        features='fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp'
        ids='CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n'
    fi
    for ((i = 0; i < cpus; i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: %s\n' "$i" "$features"
        printf "$ids"
    done
}

# One run at a time: every run writes the stand-in cpuinfo and shares the root's one aarch64 .venv
# (a second `make setup` there while the first one's tests import from it breaks both). The lock
# is held by this script until its command ends; a second run says whose run it waits for.
hold_the_root() {
    local lock=$root.run.lock
    exec 8>>"$lock"
    if ! flock -n 8; then
        echo "arm64-root: waiting for the run that holds $root ($(head -n1 "$lock" 2>/dev/null || echo unknown))" >&2
        flock 8
    fi
    printf 'pid %s since %s: %s\n' "$$" "$(date -u +%FT%TZ)" "$*" > "$lock"
}

# qemu emulates a Neoverse-N1 by default, as the stand-in cpuinfo says: with qemu 7.2's "max" CPU (SVE
# at 512 bits), ACL 24.11's fully connected layer returned wrong values in the last output columns
# (N = 10), right with the Neoverse-N1. KSELECT_ARM64_QEMU_CPU=max runs the other one (it has BF16, I8MM
# and SME: ONNX Runtime's bf16 fast-math GEMM and KleidiAI's SME kernels run there).
# Runs "$@" in the root inside a private mount namespace: every mount made here vanishes when it ends.
run_in_root() {
    build_root
    register_aarch64_interpreter
    hold_the_root "$@"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    # the host's CA bundle (it may hold a proxy's authority); apt in the root never rewrites this copy
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/host-ca-certificates.crt"
    mkdir -p "$repo/.venv"
    mkdir -p "$root/var/lib/kselect"
    write_cpuinfo_stand_in "$(nproc --all)" "${KSELECT_ARM64_QEMU_CPU:-neoverse-n1}" > "$root/var/lib/kselect/cpuinfo"
    # On qemu 7.2's "max" CPU OpenBLAS's float64 GEMM (numpy's matmul, kselect's float64 references)
    # returned garbage (errors of 1e296; einsum agreed with the Neoverse-N1 run): OpenBLAS uses its
    # Neoverse-N1 kernels there
    export KSELECT_ARM64_OPENBLAS=""
    [[ ${KSELECT_ARM64_QEMU_CPU:-} == max* ]] && KSELECT_ARM64_OPENBLAS=OPENBLAS_CORETYPE=NEOVERSEN1
    unshare --mount --propagation private -- bash -euo pipefail -c '
        root=$1 repo=$2 in_root_repo=$3; shift 3
        mount -t proc proc "$root/proc"
        mount --bind "$root/var/lib/kselect/cpuinfo" "$root/proc/cpuinfo"
        mount --rbind /sys "$root/sys"
        mount --rbind /dev "$root/dev"
        mount --bind "$repo" "$root$in_root_repo"
        # the repository'"'"'s .venv is the host'"'"'s; the root keeps an aarch64 one of its own in its place
        mount --bind "$root/var/lib/kselect/venv" "$root$in_root_repo/.venv"
        exec chroot "$root" /usr/bin/env -i \
            HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin TERM="${TERM:-dumb}" LANG=C.UTF-8 \
            SSL_CERT_FILE=/etc/ssl/host-ca-certificates.crt PIP_CERT=/etc/ssl/host-ca-certificates.crt \
            REQUESTS_CA_BUNDLE=/etc/ssl/host-ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
            QEMU_CPU="${KSELECT_ARM64_QEMU_CPU:-neoverse-n1}" $KSELECT_ARM64_OPENBLAS \
            /bin/bash -c "cd $in_root_repo && exec \"\$@\"" bash "$@"
    ' bash "$root" "$repo" "$in_root_repo" "$@"
}

case ${1:-} in
    build) build_root; cat "$root/.kselect-root" ;;
    path) echo "$root" ;;
    shell) run_in_root bash -i ;;
    run)
        shift
        [[ ${1:-} == -- ]] && shift
        (($#)) || die "usage: $0 run -- COMMAND [ARG...]"
        run_in_root "$@"
        ;;
    *) die "usage: $0 build | run -- COMMAND [ARG...] | shell | path" ;;
esac
