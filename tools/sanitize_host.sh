#!/usr/bin/env bash
# The Host side of the native library (the FFI handlers, the C ABI, the exact C++
# implementation) under AddressSanitizer and UndefinedBehaviorSanitizer. Builds the
# library with both (the kernels come from the kernel cache when the sources are
# unchanged), then runs against it the CPU tests that call every op with good, bad and
# hostile input: a read or write outside a buffer, or undefined behaviour, aborts the
# test process with the sanitizer's report, and pytest fails.
#   tools/sanitize_host.sh [TESTS / PYTEST ARGS]
# Run it in an environment with the test dependencies and xla_attn installed (the tests
# import the installed package; only the library is swapped, through XLA_ATTN_LIBRARY).
# Needs gcc's libasan and libubsan (they come with gcc on Debian and Ubuntu).
set -euo pipefail
cd "$(dirname "$0")/.."
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
if [[ ! -e $asan || ! -e $ubsan ]]; then
  echo "sanitize_host: gcc has no libasan.so / libubsan.so here" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
python -m pip wheel -q --no-deps . -w "$work" -C build-dir=build/sanitize \
  -C cmake.build-type=RelWithDebInfo -C "cmake.define.CMAKE_CXX_FLAGS=$flags" \
  -C "cmake.define.CMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined"
python -m zipfile -e "$work"/xla_attn*.whl "$work/wheel"
tests=(tests/test_native_checks_cpu.py tests/test_errors_cpu.py tests/test_flash_cpu.py
       tests/test_grad_cpu.py tests/test_paged_cpu.py tests/test_cache_cpu.py
       tests/test_properties_cpu.py tests/test_xla_legacy_cpu.py tests/test_vmap_cpu.py)
python -c "import torch" 2>/dev/null && tests+=(tests/test_torch_cpu.py)
# Leaks are not looked for: XLA and the interpreter keep their allocations to exit.
export XLA_ATTN_LIBRARY=$work/wheel/xla_attn/lib/libxla_attn.so ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1
# First, that the sanitizer is live: a C ABI call told to write a 4-float buffer as
# [10, 4, 32] must be stopped by it (else every test below would pass unseen).
probe="import sys; sys.path.insert(0, 'tests'); import numpy as np, test_native_checks_cpu as t
p, run, keep = t._capi_base('flash_fwd'); small = np.empty(4, np.float32)
run(p.fill(out=small.ctypes.data), 0)"
report=$(LD_PRELOAD="$asan:$ubsan" python -c "$probe" 2>&1 || true)
if [[ $report == *"AddressSanitizer: heap-buffer-overflow"* ]]; then
  echo "sanitize_host: AddressSanitizer is live (it stopped a write past a buffer)"
else
  echo "sanitize_host: a write past a buffer went unreported: the sanitizer is not live" >&2
  exit 1
fi
LD_PRELOAD="$asan:$ubsan" python -m pytest -q -p no:cacheprovider "${@:-${tests[@]}}"
