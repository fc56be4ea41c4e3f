#!/usr/bin/env bash
# The GPU check for one 15-minute device lease (issue 47): benchmarks/gpu/check.py runs its blocks in priority
# order, each its own process group with its own timeout, under an internal deadline (~420 s of work); one JSON
# line per block goes to OUT/results.jsonl, the logs to OUT/logs.tar.gz, and a short table (OUT/table.md) is
# printed last. OUT is --out, else $OUT (the device tool's folder), else runs/gpu-check.
#
#   bash benchmarks/gpu/check.sh [--out DIR] [--dry-run] [--only env,kda_triton] [--work DIR]
#   python benchmarks/gpu/check.py --cpu-reference    # regenerate k3_tiny_cpu_fp32.json here, on CPU
#
# --dry-run lists the blocks with their timeouts and commands and exits 0 without importing torch (CI runs it).
# Nothing is installed (the device machine has no network). The interpreter is $PYTHON, else the checkout's
# .venv/bin/python, else python3: torch with CUDA and moonrt's GPU-path dependencies (numpy, pyyaml, numba,
# safetensors, tqdm, triton; the device image has them all; pulp / highspy / pytest are not needed). moonrt comes
# from this checkout (PYTHONPATH). On the device tool: run `bash benchmarks/gpu/check.sh` with timeout_s 480.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
exec "$py" "$here/check.py" --python "$py" "$@"
