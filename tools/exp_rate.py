#!/usr/bin/env python3
"""Exponentials an SM completes a clock, by each way a softmax kernel could compute them:
MUFU.EX2 on one float (`ex2.approx.ftz.f32`, what the flash kernels issue), on packed
halves (`ex2.approx.f16x2`, `ex2.approx.ftz.bf16x2`: two results an instruction), and a
degree-3 polynomial on the FMA pipe (a shifter rounding, three FMAs, an integer add into
the exponent field: the `poly_exp2` of docs/tries/2026-11-29-fwd-poly-exp2.patch).

  python3 tools/exp_rate.py [--iters 2000]

One block of 1024 threads an SM, each thread 8 independent chains; a block's clock64 span
around its loop gives the rate (median over the SMs). Needs a GPU of sm_90 and cupy
(NVRTC compiles the kernel). Measured 2026-11-29 on an H200: 16.0 / 16.0 / 16.0 / 12.2
exponentials an SM a clock, i.e. the packed forms are two MUFU passes (no gain) and the
polynomial is bound by instruction issue (~10.5 instructions an exponential at 128 a
clock); docs/benchmarks.md, 2026-11-29 (47).
"""
from __future__ import annotations

import argparse

SOURCE = r"""
extern "C" __global__ void exp_rate(float* out, long long* cycles, int iters, int mode) {
  float a[8];
  unsigned h[8];
  for (int i = 0; i < 8; ++i) a[i] = -0.001f * float(threadIdx.x + i);
  for (int i = 0; i < 8; ++i) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h[i]) : "f"(a[i]), "f"(0.5f * a[i]));
  }
  __syncthreads();
  const long long t0 = clock64();
  if (mode == 0) {
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(a[i]));
  } else if (mode == 1) {
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(h[i]));
  } else if (mode == 2) {
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) asm volatile("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(h[i]));
  } else {
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float x = fminf(fmaxf(a[i], -126.f), 126.f);
        const float j = x + 12582912.f;
        const float f = x - (j - 12582912.f);
        const float p = fmaf(fmaf(fmaf(0.0551716214f, f, 0.242611119f), f, 0.693260994f), f,
                             0.999928074f);
        // minus 1: the chain stays in [-1, 0] rather than running to infinity
        a[i] = __int_as_float(__float_as_int(p) + (__float_as_int(j) << 23)) - 1.f;
      }
  }
  const long long t1 = clock64();
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i] + __int_as_float(h[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps every chain live
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""
THREADS = 1024
CHAINS = 8
# (mode, name, exponentials an instruction)
MODES = ((0, "ex2.approx.ftz.f32", 1), (1, "ex2.approx.f16x2", 2),
         (2, "ex2.approx.ftz.bf16x2", 2), (3, "degree-3 polynomial (FMA pipe)", 1))


def rate(exps_per_thread: int, cycles: float) -> float:
    """Exponentials an SM a clock: a block's threads' exponentials over its clock span."""
    return THREADS * exps_per_thread / cycles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000, help="loop trips a thread (8 chains each)")
    args = p.parse_args()
    import cupy as cp
    import numpy as np

    kernel = cp.RawModule(code=SOURCE, options=("-arch=sm_90a",)).get_function("exp_rate")
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    out = cp.zeros(sms * THREADS, cp.float32)
    cycles = cp.zeros(sms, cp.int64)
    for mode, name, per in MODES:
        for _ in range(2):  # the first launch warms up
            kernel((sms,), (THREADS,), (out, cycles, np.int32(args.iters), np.int32(mode)))
        cp.cuda.runtime.deviceSynchronize()
        span = float(cp.median(cycles.astype(cp.float64)))
        print(f"{name:32s} {rate(args.iters * CHAINS * per, span):6.1f} an SM a clock "
              f"({span:.0f} cycles)")


if __name__ == "__main__":
    main()
