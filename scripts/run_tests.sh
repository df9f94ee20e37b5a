#!/usr/bin/env bash
# Runs pytest in .venv; "no tests collected" (exit 5) is a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1
export HYBRIDKV_CACHE_DIR=${HYBRIDKV_CACHE_DIR:-$(mktemp -d -t hybridkv-test-cache.XXXXXX)}
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
    echo "run_tests: pytest collected no tests; treating as failure" >&2
    exit 1
fi
exit "$rc"
