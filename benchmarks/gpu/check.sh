#!/usr/bin/env bash
# The prepared single-GPU check of issue 30: benchmarks/gpu/check.py runs its steps (each its own process; a failed
# step is recorded and the others still run), writes check.json and table.md under --out and prints the table.
#
#   bash benchmarks/gpu/check.sh [--out runs/gpu-check] [--force] [--dry-run] [--steps 50] [--budget-s 450]
#
# --dry-run lists every step with its exact command and exits 0 without importing torch (runs in CI, no GPU).
# Nothing is installed (the device machine has no network). The interpreter is $PYTHON, else the checkout's
# .venv/bin/python, else python3: it needs torch with CUDA and moonrt's dependencies; moonrt comes from this checkout
# (PYTHONPATH). On the device tool: the working tree travels; carry what the device image lacks, e.g. wheels of
# moonrt's pure-Python dependencies installed beforehand into a venv made with --system-site-packages (so the
# image's CUDA torch is used), then PYTHON=that/venv/bin/python bash benchmarks/gpu/check.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
exec "$py" "$here/check.py" --python "$py" "$@"
