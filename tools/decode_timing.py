#!/usr/bin/env python3
"""Decode timing by several methods in one process (docs/benchmarks.md, 2026-11-24 (7)):
ours (xla_attn.jax.paged_attention, bf16 and fp8 caches, pages in random order) against
torch SDPA cuDNN and JAX cuDNN on the contiguous cache, B=64, 32 q / 8 kv heads.

Per cell, GB/s of the cache bytes read by up to three methods: "wall" (batches of
back-to-back calls over one sync, as tools/bench.py), "slope" ((T(2n) - T(n)) / n, which
cancels the sync's latency), and "graph" (torch cuDNN replayed from a CUDA graph) or
"multi" (ours as 8 calls inside one jax.jit).

Environment: CFG=L/bs,... (default 4096/16,32768/16), D (head dim, 128), METHODS
(wall,slope,graph,multi), OURS_ONLY=1 (no peers), ORDER=inorder (pages in order),
NCU=1 (only run each kernel a few times, for a profiler wrapped around it).
"""
import math, os, statistics, time
import numpy as np, jax, jax.numpy as jnp, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from xla_attn import jax as xj

B, HQ, HK = 64, 32, 8
D = int(os.environ.get("D", "128"))
CONFIGS = [tuple(int(x) for x in c.split("/")) for c in os.environ.get("CFG", "4096/16,32768/16").split(",")]
METHODS = os.environ.get("METHODS", "wall,slope,graph,multi").split(",")
NCU = os.environ.get("NCU") == "1"


def timeit(call, sync, n):
    call(); sync()
    def batch(k):
        t0 = time.perf_counter()
        for _ in range(k):
            out = call()
        sync(out)
        return time.perf_counter() - t0
    wall, slope = [], []
    for _ in range(5):
        t1 = batch(n); t2 = batch(2 * n)
        wall.append(t1 / n); slope.append((t2 - t1) / n)
    return statistics.median(wall), statistics.median(slope)


def main():
    for L, bs in CONFIGS:
        nb = B * L // bs
        rng = np.random.default_rng(L + bs)
        perm = np.arange(nb) if os.environ.get('ORDER') == 'inorder' else rng.permutation(nb)
        inv = jnp.asarray(np.argsort(perm).astype(np.int32))
        key = jax.random.PRNGKey(L)
        def kv(i):
            x8 = (jax.random.normal(jax.random.fold_in(key, i), (B, L, HK, D), jnp.float32) * 4).astype(jnp.float8_e4m3fn)
            dense = x8.astype(jnp.bfloat16) * jnp.bfloat16(0.25)
            pool = jnp.take(dense.reshape(nb, bs, HK, D), inv, axis=0)
            pool8 = jnp.take(x8.reshape(nb, bs, HK, D), inv, axis=0)
            return dense, pool, pool8
        kd, kp, kp8 = kv(1)
        vd, vp, vp8 = kv(2)
        qs = [jax.random.normal(jax.random.fold_in(key, 10 + i), (B, HQ, D), jnp.bfloat16) for i in range(8)]
        bt = jnp.asarray(perm.reshape(B, L // bs).astype(np.int32))
        sl = jnp.full((B,), L, jnp.int32)
        qsl = jnp.arange(B + 1, dtype=jnp.int32)
        ks = jnp.float32(0.25)
        scale = 1 / math.sqrt(D)
        gb = B * L * HK * D * 2 * 2 / 1e9
        f16 = jax.jit(lambda q, kc, vc: xj.paged_attention(q, kc, vc, sl, bt, qsl, scale, max_query_len=1))
        f8 = jax.jit(lambda q, kc, vc: xj.paged_attention(q, kc, vc, sl, bt, qsl, scale, k_scale=ks, v_scale=ks, max_query_len=1))
        m16 = jax.jit(lambda qs, kc, vc: [xj.paged_attention(q, kc, vc, sl, bt, qsl, scale, max_query_len=1) for q in qs])
        m8 = jax.jit(lambda qs, kc, vc: [xj.paged_attention(q, kc, vc, sl, bt, qsl, scale, k_scale=ks, v_scale=ks, max_query_len=1) for q in qs])
        jc = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q.reshape(B, 1, HQ, D), k, v, implementation="cudnn"))
        jsync = lambda out=None: jax.block_until_ready(out) if out is not None else None
        # torch contiguous (B, H, L, D)
        tq = torch.from_dlpack(qs[0]).reshape(B, HQ, 1, D).contiguous()
        tk = torch.from_dlpack(kd).transpose(1, 2).contiguous()
        tv = torch.from_dlpack(vd).transpose(1, 2).contiguous()
        tsync = lambda out=None: torch.cuda.synchronize()
        n = max(3, int(0.05 / (gb / 3000)))
        res = {}
        if NCU:
            for _ in range(3):
                jax.block_until_ready(f16(qs[0], kp, vp)); jax.block_until_ready(f8(qs[0], kp8, vp8))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
                torch.cuda.synchronize()
            continue
        for name, call, sync, bytes_ in [
            ("ours-bf16", lambda: f16(qs[0], kp, vp), jsync, gb),
            ("ours-fp8", lambda: f8(qs[0], kp8, vp8), jsync, gb / 2),
            ("jax-cudnn", lambda: jc(qs[0], kd, vd), jsync, gb),
        ][: 2 if os.environ.get("OURS_ONLY") else 3]:
            w, s = timeit(call, sync, n)
            res[name] = (w, s)
        if not os.environ.get("OURS_ONLY"):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                call = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
                res["torch-cudnn"] = timeit(call, tsync, n)
                if "graph" in METHODS:
                    g = torch.cuda.CUDAGraph()
                    s_ = torch.cuda.Stream(); s_.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s_):
                        for _ in range(2): call()
                    torch.cuda.current_stream().wait_stream(s_); torch.cuda.synchronize()
                    with torch.cuda.graph(g):
                        for _ in range(8): call()
                    g.replay(); torch.cuda.synchronize()
                    ts = []
                    for _ in range(5):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record(); [g.replay() for _ in range(max(1, n // 8))]; e1.record(); torch.cuda.synchronize()
                        ts.append(e0.elapsed_time(e1) / 1e3 / (8 * max(1, n // 8)))
                    res["torch-cudnn"] += (statistics.median(ts),)
        if "multi" in METHODS:
            for name, fm, kc, vc in [("ours-bf16", m16, kp, vp), ("ours-fp8", m8, kp8, vp8)]:
                w, s = timeit(lambda: fm(qs, kc, vc), jsync, max(2, n // 8))
                res[name] += (s / 8,)
        print(f"== B={B} L={L} bs={bs}: GB/s (bf16 bytes; fp8 rows: fp8 bytes) wall / slope / graph-or-8-in-jit")
        for name, ts in res.items():
            by = gb / 2 if "fp8" in name else gb
            print(f"  {name:12s} " + " ".join(f"{by / t:7.0f}" for t in ts) + "   us: " + " ".join(f"{t*1e6:8.1f}" for t in ts))
        b16 = res["ours-bf16"]
        if "torch-cudnn" in res:
            c = res["torch-cudnn"]
            print(f"  ratio ours-bf16/torch-cudnn wall {c[0]/b16[0]:.3f} slope {c[1]/b16[1]:.3f}" +
                  (f" graph-vs-8-in-jit {c[2]/b16[2]:.3f}" if len(c) > 2 and len(b16) > 2 else ""))
        print(f"  fp8 tokens/bf16 wall {b16[0]/res['ours-fp8'][0]:.3f} slope {b16[1]/res['ours-fp8'][1]:.3f}", flush=True)
        kp = vp = kp8 = vp8 = kd = vd = tk = tv = None  # frees the caches before the next config


main()
