"""The cases `python -m xla_attn check` runs: every op, on the best device JAX has,
against the float64 reference, on fresh random inputs, with outputs poisoned first
where the op writes into an existing buffer (the caches)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import ml_dtypes
import numpy as np

from xla_attn.testing import reference as ref

BOUNDS = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}  # DESIGN.md §6


@dataclasses.dataclass
class Row:
    name: str
    device: str
    dtype: str
    error: float
    bound: float
    seconds: float | None
    status: str          # PASS, FAIL or N/A (no kernel for this device in this build)
    exact: bool = False
    note: str = ""


def rel_error(out, expected) -> float:
    out = np.asarray(out, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(out - expected) / (denom if denom else 1.0))


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall time of fn(*args) after a warm-up (compile, module load)."""
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _varlen_inputs(rng, dtype, lens_q, lens_k, heads=4, heads_k=2, dim=64, pad=3):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1] + pad, heads, dim)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], heads_k, dim)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], heads_k, dim)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _flash_cases(rng):
    bf16 = ml_dtypes.bfloat16
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, bf16, [37, 1, 0, 64], [50, 9, 5, 64])
    yield "flash_attn_varlen causal gqa", "bfloat16", (q, k, v, cu_q, cu_k), dict(causal=True)
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, np.float32, [20, 33], [41, 17], heads=4, heads_k=4,
                                         dim=32)
    slopes = rng.uniform(0.1, 1.0, 4).astype(np.float32)
    yield ("flash_attn_varlen window+softcap+alibi", "float32", (q, k, v, cu_q, cu_k),
           dict(window_size=(8, 2), softcap=5.0, alibi_slopes=slopes))


def check_flash(rng, repeats: int, device) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import xla_attn.jax as xj

    rows = []
    for name, dtype, (q, k, v, cu_q, cu_k), kw in _flash_cases(rng):
        scale = 1.0 / np.sqrt(q.shape[-1])
        exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, scale, **kw)
        fn = jax.jit(lambda *a, kw=kw: xj.flash_attn_varlen(*a, return_softmax_lse=True, **kw))
        args = [jax.device_put(jnp.asarray(x), device) for x in (q, k, v, cu_q, cu_k)]
        rows.append(_run(name, dtype, device, fn, args, repeats,
                         lambda r, e=exp_out: rel_error(r[0], e)))
        # Gradients of the same case through out and softmax_lse (every row sees a key, so
        # every lse is finite), against the analytic float64 backward.
        dout = rng.standard_normal(q.shape).astype(q.dtype)
        dlse = rng.standard_normal(exp_lse.shape).astype(np.float32)
        exp_d = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, scale,
                                              kw.get("causal", False),
                                              kw.get("window_size", (-1, -1)),
                                              kw.get("softcap", 0.0), kw.get("alibi_slopes"), None,
                                              dlse=dlse)

        def grads(q, k, v, cu_q, cu_k, dout, dlse, kw=kw):
            f = lambda q, k, v: xj.flash_attn_varlen(  # noqa: E731
                q, k, v, cu_q, cu_k, return_softmax_lse=True, **kw)
            out, vjp = jax.vjp(f, q, k, v)
            return vjp((dout, dlse))

        gargs = args + [jax.device_put(jnp.asarray(x), device) for x in (dout, dlse)]
        rows.append(_run(name.replace("flash_attn_varlen", "flash_attn_varlen grad"), dtype, device,
                         jax.jit(grads), gargs, repeats,
                         lambda r, e=exp_d: max(rel_error(a, b) for a, b in zip(r, e))))
    return rows


def check_paged(rng, repeats: int, device) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import xla_attn.jax as xj

    rows = []
    num_blocks, block_size, heads, heads_k, dim = 80, 16, 8, 2, 128
    seq_lens = np.array([100, 1, 250, 33], np.int32)
    q_lens = np.array([1, 1, 4, 1], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = rng.permutation(num_blocks)[: 4 * 16].reshape(4, 16)
    tables = tables.astype(np.int32)
    slopes = rng.uniform(0.01, 0.1, heads).astype(np.float32)
    for fmt, cache_dtype, dtype in (("auto", ml_dtypes.bfloat16, "bfloat16"),
                                    ("fp8_e4m3", ml_dtypes.float8_e4m3fn, "bfloat16+fp8_e4m3")):
        query = rng.standard_normal((qsl[-1] + 2, heads, dim)).astype(ml_dtypes.bfloat16)
        kc = rng.standard_normal((num_blocks, block_size, heads_k, dim)).astype(cache_dtype)
        vc = rng.standard_normal((num_blocks, block_size, heads_k, dim)).astype(cache_dtype)
        k_scale = np.float32(0.5 if fmt != "auto" else 1.0)
        v_scale = np.float32(2.0 if fmt != "auto" else 1.0)
        scale = 1.0 / np.sqrt(dim)
        expected = ref.paged_attention_ref(query, kc, vc, seq_lens, tables, qsl, scale,
                                           sliding_window=128, k_scale=k_scale, v_scale=v_scale,
                                           alibi_slopes=slopes)
        fn = jax.jit(lambda q, kc, vc, sl, bt, qsl, ks, vs, al: xj.paged_attention(
            q, kc, vc, sl, bt, qsl, scale, sliding_window=128, k_scale=ks, v_scale=vs,
            alibi_slopes=al, max_query_len=int(q_lens.max())))
        args = [jax.device_put(jnp.asarray(x), device)
                for x in (query, kc, vc, seq_lens, tables, qsl, k_scale, v_scale, slopes)]
        rows.append(_run("paged_attention decode gqa window+alibi", dtype, device, fn, args,
                         repeats, lambda r, e=expected: rel_error(r, e)))
    return rows


def check_reshape_and_cache_flash(rng, repeats: int, device) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import xla_attn.jax as xj

    rows = []
    num_blocks, block_size, heads_k, dim, tokens = 64, 16, 8, 128, 300
    for src, fmt, cache_dtype in (("bfloat16", "auto", ml_dtypes.bfloat16),
                                  ("float16", "fp8_e4m3", ml_dtypes.float8_e4m3fn),
                                  ("float32", "fp8_e5m2", np.uint8)):
        key = (rng.standard_normal((tokens, heads_k, dim)) * 4).astype(src)
        value = (rng.standard_normal((tokens, heads_k, dim)) * 4).astype(src)
        slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int64)
        slots[::7] = -1  # padding tokens
        shape = (num_blocks, block_size, heads_k, dim)
        # Poison: the caches start as random bits, so untouched slots must keep them.
        nbytes = int(np.prod(shape)) * np.dtype(cache_dtype).itemsize
        kc, vc = (rng.integers(0, 256, nbytes, dtype=np.uint8).view(cache_dtype).reshape(shape)
                  for _ in range(2))
        ks, vs = np.float32(0.25), np.float32(3.0)
        exp_k, exp_v = ref.reshape_and_cache_flash_ref(key, value, kc, vc, slots, fmt, ks, vs)
        fn = jax.jit(lambda k, v, kc, vc, s, ks, vs, fmt=fmt: xj.reshape_and_cache_flash(
            k, v, kc, vc, s, kv_cache_dtype=fmt, k_scale=ks, v_scale=vs))
        args = [jax.device_put(jnp.asarray(x), device) for x in (key, value, kc, vc, slots, ks, vs)]

        def mismatches(r, ek=exp_k, ev=exp_v):
            got = [np.asarray(x).view(np.uint8) for x in r]
            want = [np.asarray(x).view(np.uint8) for x in (ek, ev)]
            return float(sum(int((g != w).sum()) for g, w in zip(got, want)))

        row = _run(f"reshape_and_cache_flash {fmt}", f"{src}->{np.dtype(cache_dtype).name}",
                   device, fn, args, repeats, mismatches, exact=True)
        rows.append(row)
    return rows


def _run(name, dtype, device, fn, args, repeats, error_of, exact=False) -> Row:
    import jax

    bound = 0.0 if exact else BOUNDS[dtype.split("+")[0]]
    try:
        result = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001  (reported in the table, never swallowed)
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "no CUDA kernel" in message:
            return Row(name, device.platform, dtype, float("nan"), bound, None, "N/A",
                       note="no GPU kernel in this build yet")
        return Row(name, device.platform, dtype, float("inf"), bound, None, "FAIL", note=message)
    err = error_of(result)
    ok = err <= bound
    seconds = median_seconds(fn, args, repeats) if repeats else None
    return Row(name, device.platform, dtype, err, bound, seconds, "PASS" if ok else "FAIL",
               exact=exact)


def run_all(repeats: int = 20, seed: int | None = None) -> list[Row]:
    """Every op on the best device; ops without a kernel for that device also run
    on the CPU so that every op is checked."""
    import jax

    best = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(seed)
    rows = []
    for check in (check_flash, check_paged, check_reshape_and_cache_flash):
        got = check(rng, repeats, best)
        rows += got
        if best.platform != "cpu" and any(r.status == "N/A" for r in got):
            rows += [r for r in check(rng, repeats, cpu)]
    return rows
