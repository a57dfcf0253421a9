"""Independent float64 NumPy references of every xla_attn op, for the tests and for
`python -m xla_attn check`.

Nothing here imports jax, torch or the package under test: arrays in (numpy, or
anything `np.asarray` accepts; bf16/fp8 as ml_dtypes arrays), float64 arrays out
(the cache write returns arrays in the cache's own dtype, bit for bit what the
library must store). The semantics are those of DESIGN.md §2 and the params headers:

* flash attention (flash-attn >= 2.1): sequence b has queries cu_q[b]:cu_q[b+1] (Lq)
  and keys cu_k[b]:cu_k[b+1] (Lk, or seqused_k[b]); query row i sits at key position
  pos = i + Lk - Lq (bottom-right). Window (left, right), -1 unbounded, causal means
  right = 0: key j visible iff pos - left <= j <= pos + right. Score
  s = scale * q.k, softcap: s = cap * tanh(s / cap), ALiBi: s -= slope * |pos - j|.
  A row that sees no key (and every padding row past cu_q[-1]) has out 0, lse +inf.
* paged attention: causal at pos = i + L - Lq, sliding window W: pos - j < W.
* cache write: slot s -> row s of the cache viewed as (num_slots, Hk, D); slots
  outside [0, num_slots) (-1 = padding) are skipped; fp8 quantizes x / scale in
  float32, saturating at the format's largest finite value.

`tests/test_reference.py` checks these against independent computations.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

__all__ = [
    "flash_attn_varlen_ref", "flash_attn_varlen_bwd_ref", "flash_attn_ref", "flash_attn_bwd_ref",
    "paged_attention_ref", "reshape_and_cache_flash_ref", "quantize_fp8", "rel_error",
    "assert_bits_equal", "assert_attention_close", "BOUNDS", "GRAD_BOUNDS", "FP8_MAX",
    "FP8_P_BOUND",
]

BOUNDS = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}  # DESIGN.md §6
# fp8 (e4m3) flash forward on the Hopper family, bf16 out: P is rounded to e4m3 for the
# P V product (FA3's fp8 path), 3 mantissa bits, so each weight carries up to 2^-4
# relative error (~2.6 % RMS over P's range) and O, a weighted mean of V, about as much.
# The portable fp8 kernel keeps P in float32 and is held to the bfloat16 bound.
FP8_P_BOUND = 5e-2
# Gradients of arbitrary (hypothesis-drawn) shapes: dS = P * (dP - D) sums to zero over
# each row's keys, so with 1-2 visible keys dq is a difference of nearly equal float32
# terms; seen: 4.2e-5 for window (1, 0) + softcap + ALiBi, with no defect behind it.
GRAD_BOUNDS = BOUNDS | {"float32": 1e-4}
FP8_DTYPES = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
KV_CACHE_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}


# ------------------------------------------------------------------ small helpers
def _f64(x, descale=None) -> np.ndarray:
    out = np.asarray(x).astype(np.float64)
    if descale is not None:
        out = out * _scalar(descale)
    return out


def _scalar(x, default: float = 1.0) -> float:
    if x is None:
        return default
    return float(np.asarray(x, dtype=np.float32).reshape(-1)[0])


def _ints(x) -> list[int]:
    return [int(v) for v in np.asarray(x).reshape(-1)]


def rel_error(out, expected) -> float:
    """||out - expected|| / ||expected|| in float64 (inf if out is not finite where
    expected is; absolute error if expected is all zeros)."""
    out = np.asarray(out).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    if not np.array_equal(np.isfinite(out), np.isfinite(expected)):
        return math.inf
    fin = np.isfinite(expected)
    diff = np.linalg.norm(out[fin] - expected[fin])
    denom = np.linalg.norm(expected[fin])
    return float(diff / denom) if denom > 0 else float(diff)


def assert_bits_equal(actual, expected) -> None:
    """Same dtype, same shape and the same bytes (NaN payloads included)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = np.ascontiguousarray(actual).view(np.uint8).reshape(actual.shape + (-1,))
    e = np.ascontiguousarray(expected).view(np.uint8).reshape(expected.shape + (-1,))
    bad = np.argwhere(np.any(a != e, axis=-1))
    if len(bad):
        idx = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {actual.size} elements differ in their bits; first at {idx}: "
            f"got {actual[idx]!r} (bytes {a[idx].tobytes().hex()}), "
            f"expected {expected[idx]!r} (bytes {e[idx].tobytes().hex()})")


# ------------------------------------------------------------------ the attention core
def _visibility(lq: int, lk: int, left: int, right: int):
    """(visible [lq, lk] bool, pos - j [lq, lk]) for bottom-right aligned rows."""
    pos = np.arange(lq)[:, None] + (lk - lq)
    j = np.arange(lk)[None, :]
    visible = np.ones((lq, lk), dtype=bool)
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0:
        visible &= j <= pos + right
    return visible, pos - j


# The float64 references of long sequences were most of the GPU suite's time, so the
# products are einsums with optimize=True, which hands them to BLAS (numpy's own einsum
# loops took 7.2 s for one S of 2100 x 2100 rows, 16 heads, d128; 0.44 s so), and the
# softmax works in place on the [H, lq, lk] scores (70 M float64 there, each pass over
# them ~0.3 s): the rising-scores test's 2100 + 200 rows, 16 heads, d128, 20.7 / 18.3 s
# full / causal before, 4.4 / 2.4 s now (2 cores). BLAS adds each product's terms in
# another order than numpy's loops did: within 1e-12 of the old results (1,728 shapes).
def _sequence_forward(q, k, v, scale, left, right, softcap, slopes):
    """One sequence. q [lq, H, D], k/v [lk, Hk, D] float64; slopes [H] or None.
    Returns out [lq, H, D], lse [H, lq], and what the backward needs."""
    lq, num_heads, _ = q.shape
    lk, num_heads_k, _ = k.shape
    group = num_heads // num_heads_k
    kh = np.repeat(k, group, axis=1)  # [lk, H, D]: head h reads kv head h // group
    vh = np.repeat(v, group, axis=1)
    visible, dist = _visibility(lq, lk, left, right)
    # [H, lq, lk], contiguous: the row sums below add in the order they always did
    s = np.ascontiguousarray(np.einsum("ihd,jhd->hij", q, kh, optimize=True))
    s *= scale
    t = None
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
    if slopes is not None:
        s -= np.asarray(slopes, np.float64)[:, None, None] * np.abs(dist)[None]
    if not visible.all():
        s[:, ~visible] = -np.inf
    any_visible = visible.any(axis=1)  # [lq]
    m = np.where(any_visible[None, :], s.max(axis=2, initial=-np.inf), 0.0)  # [H, lq]
    # exp(-inf - m) = 0 for the keys a row does not see (m is 0 where it sees none)
    s -= m[..., None]
    p = np.exp(s, out=s)
    denom = p.sum(axis=2)
    safe = np.where(denom > 0, denom, 1.0)
    p /= safe[..., None]
    lse = np.where(any_visible[None, :], m + np.log(safe), np.inf)
    out = np.einsum("hij,jhd->ihd", p, vh, optimize=True)
    return out, lse, dict(p=p, t=t, kh=kh, vh=vh, group=group)


def _sequence_backward(dout, q, k, v, scale, left, right, softcap, slopes, out_dtype=None,
                       dlse=None):
    """Analytic gradient of one sequence: with P = softmax(S), O = P V,
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)); softcap's
    S = c tanh(U / c) gives dU = dS * (1 - tanh^2); U = scale * Q K^T.
    out_dtype (a numpy dtype): rowsum(P * dP) = rowsum(dO * O) taken with O rounded to it, as
    a backward that reads the forward's stored output computes it (FA2's).
    dlse [H, lq]: a cotangent of lse too; lse_i = log sum_j exp(S_ij) adds P * dlse to dS."""
    _, _, cache = _sequence_forward(q, k, v, scale, left, right, softcap, slopes)
    p, kh, vh, group = cache["p"], cache["kh"], cache["vh"], cache["group"]
    dvh = np.einsum("hij,ihd->jhd", p, dout, optimize=True)
    # dP and rowsum(dO * O) by numpy's own loops, which add over d in one order: where a
    # row sees one key (P = 1, O = V) the two are then equal and dS is exactly 0, as the
    # kernels find it (through BLAS, dP's sums differed in the last bit: dq 1e-17, not 0)
    dp = np.einsum("ihd,jhd->hij", dout, vh)
    if out_dtype is None:
        delta = (p * dp).sum(axis=2, keepdims=True)
    else:
        o = np.einsum("hij,jhd->ihd", p, vh).astype(out_dtype).astype(np.float64)
        delta = np.einsum("ihd,ihd->hi", dout, o)[..., None]
    ds = p * (dp - delta)
    if dlse is not None:
        ds = ds + p * np.asarray(dlse, np.float64)[..., None]
    du = ds * (1.0 - cache["t"] ** 2) if cache["t"] is not None else ds
    dq = scale * np.einsum("hij,jhd->ihd", du, kh, optimize=True)
    dkh = scale * np.einsum("hij,ihd->jhd", du, q, optimize=True)
    lk, num_heads_k, d = k.shape
    dk = dkh.reshape(lk, num_heads_k, group, d).sum(axis=2)
    dv = dvh.reshape(lk, num_heads_k, group, d).sum(axis=2)
    return dq, dk, dv


def _window(causal: bool, window_size) -> tuple[int, int]:
    left, right = (int(w) for w in window_size)
    return left, (0 if causal else right)


def _slopes_for(alibi_slopes, b: int):
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, np.float64)
    return a if a.ndim == 1 else a[b]


def _key_rows(b, cu_k, seqused_k, block_table, block_size):
    """Indices of sequence b's keys: row numbers into k (dense), or (block, offset)."""
    lk = cu_k[b + 1] - cu_k[b] if seqused_k is None else seqused_k[b]
    j = np.arange(max(lk, 0))
    if block_table is None:
        return cu_k[b] + j
    return np.asarray(block_table)[b, j // block_size], j % block_size


# ------------------------------------------------------------------ flash attention
def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, seqused_k=None,
                          block_table=None, q_descale=None, k_descale=None, v_descale=None):
    """out [total_q, H, D] and lse [H, total_q], float64. k/v are (total_k, Hk, D), or
    with block_table the paged cache (num_blocks, block_size, Hk, D)."""
    qf = _f64(q, q_descale)
    kf, vf = _f64(k, k_descale), _f64(v, v_descale)
    total_q, num_heads, head_dim = qf.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    cu_q, cu_k = _ints(cu_seqlens_q), _ints(cu_seqlens_k)
    used = None if seqused_k is None else _ints(seqused_k)
    left, right = _window(causal, window_size)
    block_size = kf.shape[1] if block_table is not None else None
    out = np.zeros((total_q, num_heads, head_dim))
    lse = np.full((num_heads, total_q), np.inf)
    for b in range(len(cu_q) - 1):
        rows = _key_rows(b, cu_k, used, block_table, block_size)
        ks, vs = kf[rows], vf[rows]
        o, l, _ = _sequence_forward(qf[cu_q[b]:cu_q[b + 1]], ks, vs, float(softmax_scale), left,
                                    right, float(softcap), _slopes_for(alibi_slopes, b))
        out[cu_q[b]:cu_q[b + 1]] = o
        lse[:, cu_q[b]:cu_q[b + 1]] = l
    return out, lse


def flash_attn_varlen_bwd_ref(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                              causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              seqused_k=None, out_dtype=None, dlse=None):
    """(dq, dk, dv) float64 shaped like q, k, v (not paged). Padding rows of q and keys
    no sequence uses get zero gradients. out_dtype: see _sequence_backward. dlse (H,
    total_q): the cotangent of softmax_lse as well (rows without a key must hold 0)."""
    qf, kf, vf, df = _f64(q), _f64(k), _f64(v), _f64(dout)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(qf.shape[-1])
    cu_q, cu_k = _ints(cu_seqlens_q), _ints(cu_seqlens_k)
    used = None if seqused_k is None else _ints(seqused_k)
    left, right = _window(causal, window_size)
    dq, dk, dv = np.zeros_like(qf), np.zeros_like(kf), np.zeros_like(vf)
    for b in range(len(cu_q) - 1):
        qs = slice(cu_q[b], cu_q[b + 1])
        rows = _key_rows(b, cu_k, used, None, None)
        g = _sequence_backward(df[qs], qf[qs], kf[rows], vf[rows], float(softmax_scale), left,
                               right, float(softcap), _slopes_for(alibi_slopes, b), out_dtype,
                               None if dlse is None else np.asarray(dlse)[:, qs])
        dq[qs] += g[0]
        np.add.at(dk, rows, g[1])
        np.add.at(dv, rows, g[2])
    return dq, dk, dv


def _dense_to_varlen(q, k):
    b, sq = np.shape(q)[:2]
    sk = np.shape(k)[1]
    return np.arange(b + 1) * sq, np.arange(b + 1) * sk


def flash_attn_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None):
    """Dense layout: q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D),
    lse (B, H, Sq), float64."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    b, sq, h, d = q.shape
    cu_q, cu_k = _dense_to_varlen(q, k)
    out, lse = flash_attn_varlen_ref(q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q, cu_k, softmax_scale,
                                     causal, window_size, softcap, alibi_slopes)
    return out.reshape(b, sq, h, d), lse.reshape(h, b, sq).transpose(1, 0, 2)


def flash_attn_bwd_ref(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None):
    """(dq, dk, dv) of the dense layout, float64."""
    q, k, v, dout = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(dout)
    cu_q, cu_k = _dense_to_varlen(q, k)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    dq, dk, dv = flash_attn_varlen_bwd_ref(flat(dout), flat(q), flat(k), flat(v), cu_q, cu_k,
                                           softmax_scale, causal, window_size, softcap,
                                           alibi_slopes)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# ------------------------------------------------------------------ paged attention
def _dequantize_cache(cache, scale, kv_cache_dtype):
    """A paged cache as float64: fp8 (float8 arrays, or uint8 with kv_cache_dtype
    naming the format) times its scale; float caches as they are (scale ignored)."""
    cache = np.asarray(cache)
    name = cache.dtype.name
    if name == "uint8":
        if kv_cache_dtype not in KV_CACHE_FORMATS:
            raise ValueError(f"a uint8 cache needs an fp8 kv_cache_dtype, got {kv_cache_dtype!r}")
        cache = cache.view(FP8_DTYPES[KV_CACHE_FORMATS[kv_cache_dtype]])
        name = cache.dtype.name
    if name in FP8_DTYPES:
        return cache.astype(np.float64) * _scalar(scale)
    return cache.astype(np.float64)


def paged_attention_ref(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                        scale, sliding_window=None, soft_cap=None, k_scale=1.0, v_scale=1.0,
                        num_seqs=None, kv_cache_dtype="auto", alibi_slopes=None):
    """out [total_q, H, D] float64. Sequences s < num_seqs (default: all) attend
    causally (pos = i + L - Lq) to their L = seq_lens[s] keys through block_tables[s],
    with alibi_slopes [H] (shared by the sequences) subtracting slope * (pos - j);
    every other query row is padding and is 0."""
    qf = _f64(query)
    kc = _dequantize_cache(key_cache, k_scale, kv_cache_dtype)
    vc = _dequantize_cache(value_cache, v_scale, kv_cache_dtype)
    block_size = kc.shape[1]
    lens, qsl = _ints(seq_lens), _ints(query_start_loc)
    n = len(lens) if num_seqs is None else _ints(num_seqs)[0]
    left = -1 if not sliding_window else int(sliding_window) - 1  # pos - j < W <=> j >= pos-W+1
    cap = 0.0 if soft_cap is None else float(soft_cap)
    out = np.zeros(qf.shape)
    tables = np.asarray(block_tables)
    for s in range(n):
        j = np.arange(lens[s])
        blocks, offsets = tables[s, j // block_size], j % block_size
        o, _, _ = _sequence_forward(qf[qsl[s]:qsl[s + 1]], kc[blocks, offsets], vc[blocks, offsets],
                                    float(scale), left, 0, cap, alibi_slopes)
        out[qsl[s]:qsl[s + 1]] = o
    return out


# ------------------------------------------------------------------ KV-cache write
FP8_NAN = 0x7F  # CUDA's canonical fp8 NaN (both formats, either sign)


def quantize_fp8(x, fp8_dtype, scale) -> np.ndarray:
    """sat_fp8(x / scale): single-precision division, clamp to the largest finite
    value, round to nearest even (ml_dtypes' cast). NaN stays NaN, stored as the
    canonical code 0x7f whatever its sign and payload (what CUDA's satfinite cvt
    writes; ml_dtypes would keep the sign and, for e5m2, write 0x7e)."""
    name = np.dtype(fp8_dtype).name
    limit = np.float32(FP8_MAX[name])
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf inputs are expected
        y = np.asarray(x).astype(np.float32) / np.float32(_scalar(scale))
    out = np.array(np.clip(y, -limit, limit), ndmin=1).astype(FP8_DTYPES[name])
    out.view(np.uint8)[np.isnan(y).reshape(out.shape)] = FP8_NAN
    return out.reshape(y.shape)


def _encode(x, cache_dtype, kv_cache_dtype, scale) -> np.ndarray:
    name = np.dtype(cache_dtype).name
    if name == "uint8":
        if kv_cache_dtype not in KV_CACHE_FORMATS:
            raise ValueError(f"a uint8 cache needs an fp8 kv_cache_dtype, got {kv_cache_dtype!r}")
        return quantize_fp8(x, FP8_DTYPES[KV_CACHE_FORMATS[kv_cache_dtype]], scale).view(np.uint8)
    if name in FP8_DTYPES:
        if kv_cache_dtype != "auto" and KV_CACHE_FORMATS.get(kv_cache_dtype) != name:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} does not describe a {name} cache")
        return quantize_fp8(x, FP8_DTYPES[name], scale)
    x = np.asarray(x)
    if kv_cache_dtype != "auto" or x.dtype != np.dtype(cache_dtype):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: a {name} cache needs {name} input")
    return x.copy()


def reshape_and_cache_flash_ref(key, value, key_cache, value_cache, slot_mapping,
                                kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """New (key_cache, value_cache) in the caches' dtype: token t's key/value
    (encoded for the cache) replace row slot_mapping[t] of the cache viewed as
    (num_blocks * block_size, Hk, D); slots outside that range are skipped."""
    kc, vc = np.array(key_cache, copy=True), np.array(value_cache, copy=True)
    num_slots = kc.shape[0] * kc.shape[1]
    k_rows = kc.reshape(num_slots, *kc.shape[2:])  # views into the copies
    v_rows = vc.reshape(num_slots, *vc.shape[2:])
    new_k = _encode(key, kc.dtype, kv_cache_dtype, k_scale)
    new_v = _encode(value, vc.dtype, kv_cache_dtype, v_scale)
    for t, slot in enumerate(_ints(slot_mapping)):
        if 0 <= slot < num_slots:
            k_rows[slot] = new_k[t]
            v_rows[slot] = new_v[t]
    return kc, vc


def assert_attention_close(out, expected, dtype, lse=None, expected_lse=None, valid_rows=None):
    """out within BOUNDS[dtype] of the reference (relative, float64; dtype "fp8_p": the
    fp8 kernels that round P, FP8_P_BOUND, their lse within bfloat16's); rows the reference
    leaves empty (lse +inf: no visible key, or padding) exactly 0 with lse +inf; lse
    (if given) float32 and within the bound on the other rows; rows from valid_rows
    on (padding) exactly 0."""
    out = np.asarray(out)
    bound = FP8_P_BOUND if dtype == "fp8_p" else BOUNDS[dtype]
    err = rel_error(out, expected)
    assert err < bound, f"out: relative error {err:.3g} >= {bound:g} ({dtype})"
    if valid_rows is not None:
        pad = out[valid_rows:].astype(np.float64)
        assert np.all(pad == 0), f"padding rows {valid_rows}.. are not 0: {np.abs(pad).max()}"
    if expected_lse is None:
        return
    expected_lse = np.asarray(expected_lse)
    empty = ~np.isfinite(expected_lse)  # [H, total_q]
    rows = out.astype(np.float64).transpose(1, 0, 2)[empty]  # [n, D]
    assert np.all(rows == 0), f"{int((rows != 0).any(-1).sum())} rows that see no key are not 0"
    if lse is None:
        return
    lse = np.asarray(lse)
    assert lse.dtype == np.float32, lse.dtype
    assert lse.shape == expected_lse.shape, (lse.shape, expected_lse.shape)
    got_inf = np.isposinf(lse)
    assert np.array_equal(got_inf, empty), (
        f"lse is +inf at {np.argwhere(got_inf & ~empty)[:5].tolist()} (should be finite) / "
        f"finite at {np.argwhere(empty & ~got_inf)[:5].tolist()} (should be +inf)")
    if valid_rows is not None:
        assert np.all(np.isposinf(lse[:, valid_rows:]))
    err = rel_error(lse[~empty], expected_lse[~empty])
    bound = BOUNDS["bfloat16"] if dtype == "fp8_p" else bound
    assert err < bound, f"lse: relative error {err:.3g} >= {bound:g} ({dtype})"
