#!/usr/bin/env bash
# The GPU pass in one command, for a machine with an NVIDIA GPU, a CUDA-enabled jax
# and compute-sanitizer: install a built wheel, then info, check, the GPU tests,
# memcheck over the GPU kernels, and the benchmark. Logs go to OUT_DIR.
#   tools/gpu_suite.sh dist/xla_attn_cu12-*.whl OUT_DIR
set -uo pipefail
wheel=$1
out=${2:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo "=== $1"; shift; "$@" 2>&1 | tee -a "$out/log.txt"; status=$((status | PIPESTATUS[0])); }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
step info python3 -m xla_attn info
step check python3 -m xla_attn check
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/gpu
step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not slow"
step bench python3 tools/bench.py --json "$out/bench.json"
echo "gpu suite status: $status"
exit $status
