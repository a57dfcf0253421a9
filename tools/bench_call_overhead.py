#!/usr/bin/env python3
"""Marginal cost of one xla_attn custom call inside jax.jit, on the GPU, beside a
direct launch of the same kernel through the C ABI.

A jitted chain of N dependent tiny ops (each cache write feeds the next) is timed for
N = 1 and N = 101; the difference over 100 is the cost per call, which for such tiny
work is the launch and runtime overhead. A chain of tiny native XLA sorts (one kernel
each; elementwise ops would fuse into one) is the same measurement for XLA's own ops. Run it twice to compare command
buffers (CUDA graphs) on and off. The direct launches (torch CUDA tensors, the
`xla_attn::reshape_and_cache_flash` torch op, which fills the params struct and calls
the C ABI on torch's stream) are timed the same way, eagerly (Python and torch
dispatch included) and as 100 launches captured in one CUDA graph and replayed (the
GPU-side cost alone, what XLA's command buffer is compared with); and the torch
frontend's eager flash, paged and SDPA calls on tiny work (their host time a call):

  python3 tools/bench_call_overhead.py
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 tools/bench_call_overhead.py
"""

from __future__ import annotations

import os
import sys
import time


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
    rows.update(direct_launches())
    rows.update(eager_calls())
    flags = os.environ.get("XLA_FLAGS", "") or "(default: command buffers on)"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS {flags}")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds * 1e6:7.2f} us per call")
    return 0


def per_call(fn, calls: int, repeats: int = 50, pick=None) -> float:
    """Seconds a call of fn() (`calls` calls, then a torch CUDA sync), after a warm-up:
    the median of `repeats` samples, or pick(samples)."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    if pick is not None:
        return pick(samples)
    samples.sort()
    return samples[len(samples) // 2]


def direct_launches() -> dict:
    """Per-launch seconds of the same cache write through the C ABI from torch: eager,
    and replayed from a CUDA graph of 100 launches (empty when torch has no CUDA)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    import xla_attn.torch as xt

    dev = torch.device("cuda")
    key = torch.ones((1, 1, 8), dtype=torch.bfloat16, device=dev)
    slot = torch.zeros((1,), dtype=torch.int32, device=dev)
    kc, vc = (torch.zeros((2, 16, 1, 8), dtype=torch.bfloat16, device=dev) for _ in range(2))

    def launches(n):
        for _ in range(n):
            xt.reshape_and_cache_flash(key, key, kc, vc, slot)

    eager = per_call(lambda: launches(100), 100)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launches(3)  # module load and the op's first-call work, outside the capture
    torch.cuda.synchronize()
    graphs = {}
    for n in (1, 101):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            launches(n)
        graphs[n] = g
    replay = (per_call(graphs[101].replay, 1) - per_call(graphs[1].replay, 1)) / 100
    return {"C ABI launch from torch, eager": eager,
            "C ABI launches in a CUDA graph": replay}


def eager_calls(calls: int = 2000, runs: int = 3) -> dict:
    """Seconds a call of the torch frontend's eager calls on tiny work, `calls` back to
    back then one sync (the best of `runs`): the host's cost a call, which such work
    leaves the GPU waiting on; torch's SDPA on the same shape beside (empty when torch
    has no CUDA). One causal sequence of 256 tokens, 16 heads, d128, bf16 (varlen and
    dense), a decode step of 8 sequences over 100 cached tokens, the write of 8 tokens
    into that cache, and the dense call's forward and backward (gradients asked) beside
    SDPA's."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    import xla_attn.torch as xt

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    n, h, d = 256, 16, 128
    q, k, v = (torch.randn(n, h, d, dtype=bf16, device=dev) for _ in range(3))
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))
    qs, ks, vs = (x.transpose(1, 2) for x in (qb, kb, vb))  # SDPA's (B, H, S, D)
    cache = torch.randn(64, 16, h, d, dtype=bf16, device=dev)
    query = torch.randn(8, h, d, dtype=bf16, device=dev)
    lens = torch.full((8,), 100, dtype=torch.int32, device=dev)
    table = torch.arange(64, dtype=torch.int32, device=dev).reshape(8, 8)
    starts = torch.arange(9, dtype=torch.int32, device=dev)
    slots = torch.arange(8, device=dev) * 16  # one token a cache block
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {
        "torch eager: flash_attn_varlen (256 tokens)":
            lambda: xt.flash_attn_varlen(q, k, v, cu, cu, n, n, causal=True),
        "torch eager: flash_attn (dense, 1 x 256)": lambda: xt.flash_attn(qb, kb, vb, causal=True),
        "torch eager: paged_attention (decode, 8 seqs)":
            lambda: xt.paged_attention(query, cache, cache, lens, table, starts, 0.1,
                                       max_query_len=1),
        "torch eager: reshape_and_cache_flash (8 tokens)":
            lambda: xt.reshape_and_cache_flash(query, query, cache, cache, slots),
        "torch eager: F.scaled_dot_product_attention": lambda: sdpa(qs, ks, vs, is_causal=True),
    }
    # a training step's pair: the forward with gradients asked and its backward
    qg, qsg = qb.clone().requires_grad_(), qs.clone().requires_grad_()
    ones = torch.ones_like(qb)
    steps = {
        "torch eager: flash_attn fwd+bwd (dense, 1 x 256)":
            lambda: torch.autograd.grad(xt.flash_attn(qg, qg, qg, causal=True), (qg,), ones),
        "torch eager: SDPA fwd+bwd":
            lambda: torch.autograd.grad(sdpa(qsg, qsg, qsg, is_causal=True), (qsg,),
                                        ones.transpose(1, 2)),
    }

    def back_to_back(fn):
        for _ in range(calls):
            fn()

    with torch.no_grad():
        times = {name: per_call(lambda f=fn: back_to_back(f), calls, runs, pick=min)
                 for name, fn in fns.items()}
    return times | {name: per_call(lambda f=fn: back_to_back(f), calls, runs, pick=min)
                    for name, fn in steps.items()}


if __name__ == "__main__":
    sys.exit(main())
