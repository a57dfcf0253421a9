#!/usr/bin/env bash
# The GPU pass in one command, for a machine with an NVIDIA GPU, a CUDA-enabled jax
# (and torch, for its frontend) and compute-sanitizer: install a built wheel, then
# info, check, the GPU tests, memcheck and racecheck over our kernels, and the
# benchmark. Logs go to OUT_DIR: log.txt, and each step's own (tests.txt, bench.txt, ...).
#   tools/gpu_suite.sh dist/xla_attn_cu12-*.whl OUT_DIR [STEPS]
# STEPS: any of info,check,tests,memcheck,racecheck,synccheck,bench (default: all).
# GPU_TESTS_K: a pytest -k expression for the tests step (e.g. "backward or grad", the
# backward kernels' tests alone); GPU_TESTS_WORKERS: pytest-xdist's workers for it (needs
# pytest-xdist; with 16, the backward's 375 tests took 165 s on an H200).
# GPU_SANITIZE_K: a pytest -k expression for the memcheck, racecheck and synccheck steps
# instead of their own (e.g. the forward walks' NaN-tail tests alone);
# GPU_SANITIZE_KERNEL: compute-sanitizer's --kernel-name filter for them (default
# kns=xla_attn, every kernel of ours; e.g. regex=xla_attn_flash_fwd_sm90).
set -uo pipefail
wheel=$1
out=${2:-gpu-results}
steps=${3:-info,check,tests,memcheck,racecheck,synccheck,bench}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
status=0
want() { [[ ",$steps," == *",$1,"* ]]; }
step() {
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name: $*" | tee -a "$out/log.txt"
  local t0=$SECONDS
  # Each step's output in a file of its own (kept: a step that a caller's time bound kills
  # leaves its progress there), then appended to log.txt, one file for all steps.
  "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  cat "$out/$name.txt" >> "$out/log.txt"
  tail -n 12 "$out/$name.txt"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/log.txt"
  status=$((status | rc))
}
# A subset that touches every kernel (and hostile indices) while staying quick
# under the sanitizers, which slow kernels down 10-100x.
subset=${GPU_SANITIZE_K:-'hostile or split or decode or (forward and bfloat16 and causal_window_softcap) or (backward and bfloat16) or (cache and small)'}
race_subset=${GPU_SANITIZE_K:-"$subset and not cache"}
sync_subset=${GPU_SANITIZE_K:-nan_tails}
sanitize=(compute-sanitizer --kernel-name "${GPU_SANITIZE_KERNEL:-kns=xla_attn}" --error-exitcode 9
          --print-limit 20)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/log.txt"
step info python3 -m xla_attn info
step check python3 -m xla_attn check
tests_args=()
[[ -n "${GPU_TESTS_K:-}" ]] && tests_args+=(-k "$GPU_TESTS_K")
[[ -n "${GPU_TESTS_WORKERS:-}" ]] && tests_args+=(-n "$GPU_TESTS_WORKERS")
step tests python3 -m pytest -q -p no:cacheprovider --maxfail=30 -rs "${tests_args[@]}" tests/gpu
step memcheck "${sanitize[@]}" --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/gpu -k "$subset"
# Not the sm90 d128 backward: its warpgroups hand shared memory over by bar.arrive ->
# bar.sync, which racecheck does not credit (it reports the same on
# tools/racecheck_probe.py's 20-line kernel, none once the arrive is a bar.sync;
# docs/benchmarks.md section (44)). The probe's three modes run after it.
step racecheck "${sanitize[@]}" --tool racecheck --racecheck-report analysis \
  --kernel-name-exclude "regex=xla_attn_flash_bwd_dkdv_sm90_.*_d128" \
  python3 -m pytest -q -p no:cacheprovider tests/gpu -k "$race_subset"
for mode in none sync arrive; do
  step "racecheck" compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode "$mode"
done
# synccheck over the NaN-tail tests, which walk the Hopper kernels' every barrier path
# (a named barrier reached from two places as bar.sync showed there; wgmma_sm90.cuh).
step synccheck "${sanitize[@]}" --tool synccheck python3 -m pytest -q -p no:cacheprovider \
  tests/gpu -k "$sync_subset"
step bench python3 tools/bench.py --json "$out/bench.json" --plot "$out/bench.png" \
  --markdown "$out/bench.md" --time-limit "${BENCH_TIME_LIMIT:-240}"
echo "gpu suite status: $status"
exit $status
