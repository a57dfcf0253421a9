#!/usr/bin/env python3
"""Runs one op on one benchmark shape a few times, for a profiler to attach to.

  ncu --clock-control none -k regex:xla_attn_flash_fwd -c 1 --section SpeedOfLight \\
      python3 tools/profile_op.py fwd --seqlen 4096 --head-dim 128
  python3 tools/profile_op.py decode --context 4096 --block-size 16 [--fp8]
  ncu --clock-control base --metrics gpu__time_duration.sum \\
      python3 tools/profile_op.py fwd_bwd --seqlen 512 --impl torch-cudnn

--impl runs a peer on the same dense shape instead of ours (the kernels bench.py compares
against), so that a profile of both reads side by side.

Shapes follow tools/bench.py (dense: 16k tokens, H*D = 2048, bf16; decode: 32 query /
8 kv heads, head_dim 128, blocks in random order). Prints the median wall time of
--repeats calls (jax.block_until_ready around each), which includes JAX's dispatch.
"""

from __future__ import annotations

import argparse
import statistics
import time


def dense_inputs(seqlen: int, head_dim: int, keys):
    """q, k, v of tools/bench.py's dense rows: 16 K tokens (batch x seqlen), H x D = 2048,
    bf16 normals, one of `keys` each."""
    import jax
    import jax.numpy as jnp

    b, h = 16384 // seqlen, 2048 // head_dim
    return tuple(jax.random.normal(x, (b, seqlen, h, head_dim), jnp.bfloat16) for x in keys)


def jit_call(op: str, attn):
    """attn(q, k, v) jitted (op fwd), or the gradients in q, k, v of its output's sum
    (fwd_bwd)."""
    import jax
    import jax.numpy as jnp

    if op == "fwd":
        return jax.jit(attn)
    return jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))


def torch_cudnn_call(op: str, seqlen: int, head_dim: int, causal: bool):
    """torch SDPA under SDPBackend.CUDNN_ATTENTION on bench.py's dense shape ((B, H, S, D),
    bf16): fn() runs the forward, or the forward and the gradients in q, k, v of its
    output's sum (fwd_bwd); sync(x) waits for the device and returns x."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // seqlen, 2048 // head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen, requires_grad=op == "fwd_bwd") for _ in range(3))

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if op == "fwd_bwd":
                return torch.autograd.grad(out.float().sum(), (q, k, v))
            return out

    def sync(x):
        torch.cuda.synchronize()
        return x

    return fn, sync


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=("fwd", "fwd_bwd", "decode"))
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fp8", action="store_true",
                   help="fwd: float8_e4m3fn q, k, v (flash_attn_varlen, bf16 out); decode: over a "
                   "float8_e4m3fn cache")
    p.add_argument("--impl", choices=("ours", "jax-cudnn", "torch-cudnn"), default="ours",
                   help="fwd / fwd_bwd: whose attention runs (default ours)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pipelined", action="store_true",
                   help="also time --repeats calls issued back to back with one sync at the end")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from xla_attn import jax as xj

    key = iter(jax.random.split(jax.random.key(0), 8))
    sync = jax.block_until_ready
    if args.impl != "ours" and (args.op == "decode" or args.fp8):
        p.error("--impl takes the 16-bit fwd and fwd_bwd ops")
    if args.impl == "torch-cudnn":
        fn, sync = torch_cudnn_call(args.op, args.seqlen, args.head_dim, args.causal)
        inputs = ()
    elif args.op in ("fwd", "fwd_bwd"):
        d, s = args.head_dim, args.seqlen
        b, h = 16384 // s, 2048 // d
        q, k, v = dense_inputs(s, d, [next(key) for _ in range(3)])

        def fwd(q, k, v):
            if args.impl == "jax-cudnn":
                return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal,
                                                    implementation="cudnn")
            return xj.flash_attn(q, k, v, causal=args.causal)

        if args.fp8:
            if args.op != "fwd":
                p.error("--fp8 runs the forward only")
            q, k, v = (x.reshape(b * s, h, d).astype(jnp.float8_e4m3fn) for x in (q, k, v))
            cu = jnp.arange(0, b * s + 1, s, dtype=jnp.int32)
            fn = jax.jit(lambda q, k, v, cu: xj.flash_attn_varlen(q, k, v, cu, cu, s, s,
                                                                  causal=args.causal))
            inputs = (q, k, v, cu)
        else:
            fn, inputs = jit_call(args.op, fwd), (q, k, v)
    else:
        bsz, ctx, bs, d = args.batch, args.context, args.block_size, 128
        hq, hk = 32, 8
        nb = bsz * ctx // bs
        perm = np.random.default_rng(0).permutation(nb).astype(np.int32)
        dtype = jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16
        kc, vc = ((jax.random.normal(next(key), (nb, bs, hk, d), jnp.float32) * 0.5).astype(dtype)
                  for _ in range(2))
        q = jax.random.normal(next(key), (bsz, hq, d), jnp.bfloat16)
        inputs = (q, kc, vc, jnp.full((bsz,), ctx, jnp.int32),
                  jnp.asarray(perm.reshape(bsz, ctx // bs)), jnp.arange(bsz + 1, dtype=jnp.int32))
        scale = float(d) ** -0.5
        fn = jax.jit(lambda *a: xj.paged_attention(*a, scale))
    sync(fn(*inputs))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sync(fn(*inputs))
        times.append(time.perf_counter() - t0)
    print(f"{args.op}: median {statistics.median(times) * 1e6:.1f} us over {args.repeats} calls")
    if args.pipelined:
        t0 = time.perf_counter()
        outs = [fn(*inputs) for _ in range(args.repeats)]
        sync(outs)
        per = (time.perf_counter() - t0) / args.repeats
        print(f"{args.op}: {per * 1e6:.1f} us per call, {args.repeats} calls back to back")


if __name__ == "__main__":
    main()
