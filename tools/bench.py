#!/usr/bin/env python3
"""Benchmarks of xla_attn's GPU kernels beside the peers on the same GPU, in one run.

Rows so far (later issues add attention rows):
  cache_write   reshape_and_cache_flash, 64k tokens x 8 kv heads x hdim 128, against
                what JAX users write today: cache.at[slots].set(new) with and without
                unique_indices, and a plain device copy (the copy rate, the ceiling).

Prints a table of times, GB/s (bytes that must move: new K/V read once, the written
cache rows written once) and ratios to the best peer; writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _time(fn, args, repeats: int) -> float:
    """Median seconds of `repeats` runs, after a warm-up (jit compile, module load)."""
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_cache_write(repeats: int, tokens: int = 65536) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import xla_attn.jax as xj

    rng = np.random.default_rng(0)
    heads_k, dim, block_size = 8, 128, 16
    num_blocks = 2 * tokens // block_size  # cache twice the new tokens: a realistic scatter
    rows = []
    for src, fmt, cache_dtype in (("bfloat16", "auto", jnp.bfloat16),
                                  ("bfloat16", "fp8_e4m3", jnp.float8_e4m3fn)):
        key = jnp.asarray(rng.standard_normal((tokens, heads_k, dim)), src)
        value = jnp.asarray(rng.standard_normal((tokens, heads_k, dim)), src)
        slots = jnp.asarray(rng.permutation(num_blocks * block_size)[:tokens], jnp.int32)
        shape = (num_blocks, block_size, heads_k, dim)
        kc = jnp.asarray(rng.standard_normal(shape), cache_dtype)
        vc = jnp.asarray(rng.standard_normal(shape), cache_dtype)
        scale = jnp.float32(0.5)
        moved = 2 * tokens * heads_k * dim * (jnp.dtype(src).itemsize + jnp.dtype(cache_dtype).itemsize)

        ours = jax.jit(lambda k, v, kc, vc, s, sc: xj.reshape_and_cache_flash(
            k, v, kc, vc, s, kv_cache_dtype=fmt, k_scale=sc, v_scale=sc), donate_argnums=(2, 3))

        def run_ours(kc=jnp.copy(kc), vc=jnp.copy(vc)):
            # donation consumes the caches: thread them through the timed calls
            state = {"kc": kc, "vc": vc}

            def step(*_):
                state["kc"], state["vc"] = ours(key, value, state["kc"], state["vc"], slots, scale)
                return state["kc"]
            return step

        t_ours = _time(run_ours(), (), repeats)
        peers = {}
        if fmt == "auto":
            for unique in (False, True):
                f = jax.jit(lambda kc, vc, k, v, s, u=unique: (
                    kc.reshape(-1, heads_k, dim).at[s].set(k, unique_indices=u).reshape(shape),
                    vc.reshape(-1, heads_k, dim).at[s].set(v, unique_indices=u).reshape(shape)),
                    donate_argnums=(0, 1))
                st = {"kc": jnp.copy(kc), "vc": jnp.copy(vc)}

                def step(*_, f=f, st=st):
                    st["kc"], st["vc"] = f(st["kc"], st["vc"], key, value, slots)
                    return st["kc"]
                peers[f"jax .at[].set(unique_indices={unique})"] = _time(step, (), repeats)
        big = jnp.asarray(rng.standard_normal(moved // 4), jnp.float16)  # moved/2 bytes read
        copy = jax.jit(lambda x: x + jnp.float16(1))  # reads and writes moved/2 bytes each
        t_copy = _time(copy, (big,), repeats)
        best_peer = min(peers.values()) if peers else None
        rows.append({
            "op": "reshape_and_cache_flash", "shape": f"{tokens} tok x {heads_k} x {dim}",
            "dtype": f"{src}->{jnp.dtype(cache_dtype).name}", "us": t_ours * 1e6,
            "GB/s": moved / t_ours / 1e9, "copy GB/s": moved / t_copy / 1e9,
            "of copy rate": t_copy / t_ours,
            "peers_us": {k: v * 1e6 for k, v in peers.items()},
            "vs best peer": (best_peer / t_ours) if best_peer else None,
        })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    import jax

    print(f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
          f"jax {jax.__version__}")
    rows = bench_cache_write(args.repeats)
    for r in rows:
        peers = "; ".join(f"{k} {v:.1f} us" for k, v in r["peers_us"].items())
        ratio = f"{r['vs best peer']:.2f}x best peer" if r["vs best peer"] else "no peer"
        print(f"{r['op']} {r['shape']} {r['dtype']}: {r['us']:.1f} us, {r['GB/s']:.0f} GB/s "
              f"({r['of copy rate']:.0%} of copy rate {r['copy GB/s']:.0f} GB/s), {ratio}"
              f"{'; ' + peers if peers else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
