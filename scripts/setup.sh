#!/usr/bin/env bash
# Idempotent install: missing Debian packages (apt), the virtualenv at .venv, kselect in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

host_arch=$(dpkg --print-architecture)
missing=()
while read -r package arches; do
    [[ -z "$package" || "$package" == \#* ]] && continue
    [[ -n "$arches" && " $arches " != *" $host_arch "* ]] && continue
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done < scripts/system-packages.txt
if ((${#missing[@]})); then
    echo "setup: installing Debian packages: ${missing[*]}"
    sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
    if [[ "$host_arch" != arm64 ]] && printf '%s\n' "${missing[@]}" | grep -q ':arm64$'; then
        $sudo dpkg --add-architecture arm64
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "setup: done"
