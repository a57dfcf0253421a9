#!/usr/bin/env python3
"""Marginal cost of one xla_attn custom call inside jax.jit, on the GPU.

A jitted chain of N dependent tiny ops (each cache write feeds the next) is timed for
N = 1 and N = 101; the difference over 100 is the cost per call, which for such tiny
work is the launch and runtime overhead. A chain of tiny native XLA sorts (one kernel
each; elementwise ops would fuse into one) is the same measurement for XLA's own ops. Run it twice to compare command
buffers (CUDA graphs) on and off:

  python3 tools/bench_call_overhead.py
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 tools/bench_call_overhead.py
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import jax
    import jax.numpy as jnp

    import xla_attn.jax as xj
    from xla_attn.testing.checks import median_seconds

    key = jnp.ones((1, 1, 8), jnp.bfloat16)
    slot = jnp.zeros((1,), jnp.int32)

    def ours(n):
        def chain(kc, vc):
            for _ in range(n):
                kc, vc = xj.reshape_and_cache_flash(key, key, kc, vc, slot)
            return kc
        return jax.jit(chain)

    def native(n):
        def chain(x):
            for _ in range(n):
                x = jnp.sort(x[::-1])
            return x
        return jax.jit(chain)

    cache = jnp.zeros((2, 16, 1, 8), jnp.bfloat16)
    x = jnp.ones((1024,), jnp.float32)
    rows = {
        "xla_attn reshape_and_cache_flash": (median_seconds(ours(101), (cache, cache), 200) -
                                             median_seconds(ours(1), (cache, cache), 200)) / 100,
        "native XLA sort (1024 floats)": (median_seconds(native(101), (x,), 200) -
                                      median_seconds(native(1), (x,), 200)) / 100,
    }
    flags = os.environ.get("XLA_FLAGS", "") or "(default: command buffers on)"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS {flags}")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds * 1e6:6.2f} us per call in a jitted chain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
