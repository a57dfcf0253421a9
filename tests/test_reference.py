"""Self-checks of xla_attn.testing.reference against independent computations: a scalar
per-element loop, jax.nn.dot_product_attention (float32), jax.grad of a separate jnp
float64 formulation, central finite differences, and a brute-force nearest-value
search over every fp8 code. Needs jax and ml_dtypes, not the native library."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xla_attn.testing import reference as ref

# jax >= 0.8 has jax.enable_x64; 0.7.x only jax.experimental.enable_x64.
if hasattr(jax, "enable_x64"):
    enable_x64 = jax.enable_x64
else:
    from jax.experimental import enable_x64



# ------------------------------------------------------------------ a dumb scalar loop
def _loop_attention(q, k, v, cu_q, cu_k, scale, causal=False, window=(-1, -1), softcap=0.0,
                    alibi=None, seqused_k=None, block_table=None):
    """Per (row, head, key) in plain Python floats; k/v dense or paged."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    total_q, nh, d = q.shape
    nhk = k.shape[-2]
    out = np.zeros((total_q, nh, d))
    lse = np.full((nh, total_q), math.inf)
    for b in range(len(cu_q) - 1):
        lq = int(cu_q[b + 1] - cu_q[b])
        lk = int(cu_k[b + 1] - cu_k[b]) if seqused_k is None else int(seqused_k[b])
        for i in range(lq):
            pos = i + lk - lq
            for h in range(nh):
                kvh = h // (nh // nhk)
                scores, values = [], []
                for j in range(lk):
                    if causal and j > pos:
                        continue
                    if window[0] >= 0 and j < pos - window[0]:
                        continue
                    if window[1] >= 0 and not causal and j > pos + window[1]:
                        continue
                    if block_table is None:
                        kj, vj = k[cu_k[b] + j, kvh], v[cu_k[b] + j, kvh]
                    else:
                        bs = k.shape[1]
                        blk = block_table[b][j // bs]
                        kj, vj = k[blk, j % bs, kvh], v[blk, j % bs, kvh]
                    s = scale * sum(float(a) * float(c) for a, c in zip(q[cu_q[b] + i, h], kj))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        slope = float(alibi[h] if np.ndim(alibi) == 1 else alibi[b][h])
                        s -= slope * abs(pos - j)
                    scores.append(s)
                    values.append(vj)
                if not scores:
                    continue
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                lse[h, cu_q[b] + i] = m + math.log(z)
                for wj, vj in zip(w, values):
                    out[cu_q[b] + i, h] += (wj / z) * vj
    return out, lse


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


LOOP_CASES = [
    # name, lens_q, lens_k, heads, heads_k, kwargs
    ("plain", [3, 5], [4, 5], 2, 2, {}),
    ("gqa causal lq<lk", [2, 4], [6, 7], 4, 2, dict(causal=True)),
    ("mqa causal lq>lk", [6, 3], [2, 3], 3, 1, dict(causal=True)),
    ("window", [5, 4], [7, 4], 2, 1, dict(window=(2, 1))),
    ("window left only", [5], [8], 2, 2, dict(window=(1, -1))),
    ("window right only", [5], [3], 2, 2, dict(window=(-1, 0))),
    ("causal window", [4, 6], [9, 6], 2, 2, dict(causal=True, window=(2, 5))),
    ("softcap", [3, 2], [4, 6], 2, 2, dict(softcap=0.7)),
    ("alibi shared", [3, 4], [5, 2], 4, 2, dict(alibi=[0.3, 0.1, 0.7, 1.3], causal=True)),
    ("alibi per batch", [3, 4], [5, 4], 2, 1,
     dict(alibi=[[0.2, 0.9], [1.1, 0.05]], softcap=2.0)),
    ("empty", [0, 3, 2, 0], [2, 0, 3, 0], 2, 2, dict(causal=True)),
    ("seqused_k", [2, 3], [5, 6], 2, 2, dict(seqused_k=[3, 6], causal=True)),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=[c[0] for c in LOOP_CASES])
def test_varlen_matches_scalar_loop(case):
    _, lens_q, lens_k, nh, nhk, kw = case
    rng = np.random.default_rng(len(lens_q) * 31 + nh)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    d = 5
    q = rng.standard_normal((cu_q[-1] + 2, nh, d))  # 2 padding rows
    k = rng.standard_normal((cu_k[-1] + 1, nhk, d))
    v = rng.standard_normal((cu_k[-1] + 1, nhk, d))
    scale = 0.6
    if "alibi" in kw:  # float32 slopes, as the library takes them
        kw = kw | dict(alibi=np.asarray(kw["alibi"], np.float32))
    want_o, want_l = _loop_attention(q, k, v, cu_q, cu_k, scale, **kw)
    args = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                softcap=kw.get("softcap", 0.0), seqused_k=kw.get("seqused_k"),
                alibi_slopes=kw.get("alibi"))
    out, lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, scale, **args)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-13)
    assert np.array_equal(np.isinf(lse), np.isinf(want_l))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_l[np.isfinite(want_l)], rtol=1e-12)
    assert np.all(out[cu_q[-1]:] == 0) and np.all(np.isinf(lse[:, cu_q[-1]:]))


@pytest.mark.parametrize("block_size", [2, 3])
def test_paged_varlen_matches_scalar_loop(block_size):
    rng = np.random.default_rng(block_size)
    lens_q, lens_k = [2, 3, 1], [5, 3, 7]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    nblocks = 12
    k = rng.standard_normal((nblocks, block_size, 2, 4))
    v = rng.standard_normal((nblocks, block_size, 2, 4))
    perm = rng.permutation(nblocks)
    table = perm[:12].reshape(3, 4).astype(np.int32)
    q = rng.standard_normal((cu_q[-1] + 1, 4, 4))
    used = np.array([4, 3, 6], np.int32)
    for seqused in (None, used):
        want = _loop_attention(q, k, v, cu_q, cu_k, 0.5, causal=True, seqused_k=seqused,
                               block_table=table)
        got = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, 0.5, causal=True, seqused_k=seqused,
                                        block_table=table)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
    # the same keys laid out densely give the same answer
    lk = np.array(lens_k)
    dense_k = np.concatenate([k[table[b, np.arange(lk[b]) // block_size],
                                np.arange(lk[b]) % block_size] for b in range(3)])
    dense_v = np.concatenate([v[table[b, np.arange(lk[b]) // block_size],
                                np.arange(lk[b]) % block_size] for b in range(3)])
    dense = ref.flash_attn_varlen_ref(q, dense_k, dense_v, cu_q, cu_k, 0.5, causal=True)
    paged = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, 0.5, causal=True, block_table=table)
    np.testing.assert_allclose(paged[0], dense[0], rtol=1e-13, atol=1e-14)


# ------------------------------------------------------------------ jax.nn, float32
JAX_CASES = [
    # name, (B, Sq, Sk, H, Hk, D), kwargs for flash_attn_ref
    ("mha", (2, 7, 7, 4, 4, 32), {}),
    ("gqa", (2, 5, 9, 4, 2, 64), {}),
    ("mqa", (1, 6, 6, 4, 1, 16), {}),
    ("causal", (2, 8, 8, 2, 2, 32), dict(causal=True)),
    ("window", (2, 9, 9, 2, 1, 32), dict(window_size=(3, 2))),
    ("causal window", (1, 9, 9, 2, 2, 32), dict(causal=True, window_size=(2, -1))),
    ("alibi", (2, 6, 6, 4, 2, 32), dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    ("causal lq<lk", (2, 3, 8, 2, 2, 32), dict(causal=True)),
]


@pytest.mark.parametrize("case", JAX_CASES, ids=[c[0] for c in JAX_CASES])
def test_dense_matches_jax_nn(case):
    _, (b, sq, sk, h, hk, d), kw = case
    rng = np.random.default_rng(sq * 100 + sk)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d)
    bias = mask = None
    left, right = kw.get("window_size", (-1, -1))
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    if "alibi_slopes" in kw:
        slopes = np.asarray(kw["alibi_slopes"], np.float32)
        bias = -slopes[None, :, None, None] * np.abs(i - j)[None, None].astype(np.float32)
    window = None
    if sq == sk and kw.get("causal"):
        window = (left if left >= 0 else sq, 0) if left >= 0 else None
        is_causal = window is None
    elif sq == sk:
        is_causal = False
        window = None if (left, right) == (-1, -1) else (left, right)
    else:  # bottom-right causal via an explicit mask (jax.nn's is_causal is top-left)
        is_causal = False
        if kw.get("causal"):
            mask = np.broadcast_to(j <= i, (b, h, sq, sk))
    attention = jax.jit(lambda *a: jax.nn.dot_product_attention(
        *a, scale=scale, is_causal=is_causal, local_window_size=window, return_residual=True))
    out_j, res_j = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bias, mask)
    out, lse = ref.flash_attn_ref(q, k, v, scale, **kw)
    assert ref.rel_error(out_j, out) < 2e-6, ref.rel_error(out_j, out)
    assert ref.rel_error(np.asarray(res_j).transpose(0, 2, 1), lse) < 2e-6


def test_dense_is_varlen_of_equal_lengths():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 4, 2, 8))
    k = rng.standard_normal((3, 6, 1, 8))
    v = rng.standard_normal((3, 6, 1, 8))
    out, lse = ref.flash_attn_ref(q, k, v, 0.3, causal=True, softcap=1.5)
    for b in range(3):
        o, l = ref.flash_attn_varlen_ref(q[b], k[b], v[b], [0, 4], [0, 6], 0.3, causal=True,
                                         softcap=1.5)
        np.testing.assert_array_equal(out[b], o)
        np.testing.assert_array_equal(lse[b], l)


# ------------------------------------------------------------------ backward
def _jnp_varlen_loss(q, k, v, dout, cu_q, cu_k, scale, causal, window, softcap, alibi, used):
    """A separate differentiable jnp formulation (float64) of sum(out * dout)."""
    total = 0.0
    nh, nhk = q.shape[1], k.shape[1]
    for b in range(len(cu_q) - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        lk = int(cu_k[b + 1] - cu_k[b]) if used is None else int(used[b])
        k0 = int(cu_k[b])
        qs, ks, vs = q[q0:q1], k[k0:k0 + lk], v[k0:k0 + lk]
        lq = q1 - q0
        pos = jnp.arange(lq)[:, None] + lk - lq
        j = jnp.arange(lk)[None, :]
        vis = jnp.ones((lq, lk), bool)
        if window[0] >= 0:
            vis = vis & (j >= pos - window[0])
        right = 0 if causal else window[1]
        if right >= 0:
            vis = vis & (j <= pos + right)
        for h in range(nh):
            kh = ks[:, h * nhk // nh]
            vh = vs[:, h * nhk // nh]
            s = scale * qs[:, h] @ kh.T
            if softcap > 0:
                s = softcap * jnp.tanh(s / softcap)
            if alibi is not None:
                slope = alibi[h] if alibi.ndim == 1 else alibi[b, h]
                s = s - slope * jnp.abs(pos - j)
            s = jnp.where(vis, s, -1e300)
            p = jax.nn.softmax(s, axis=-1) * vis
            total = total + jnp.sum((p @ vh) * dout[q0:q1, h])
    return total


BWD_CASES = [
    ("plain", [3, 4], [5, 4], 2, 2, {}),
    ("gqa causal", [3, 6], [5, 4], 4, 2, dict(causal=True)),
    ("mqa window", [5, 2], [6, 6], 2, 1, dict(window=(2, 1))),
    ("softcap alibi", [4, 3], [4, 7], 2, 2, dict(softcap=0.9, alibi=np.array([0.4, 1.2]))),
    ("alibi per batch", [3, 3], [3, 5], 2, 1,
     dict(alibi=np.array([[0.3, 0.6], [0.1, 0.8]]), causal=True)),
    ("seqused empty", [0, 3, 2], [3, 0, 5], 2, 2, dict(used=[2, 0, 4], causal=True)),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_backward_matches_jax_grad(case):
    _, lens_q, lens_k, nh, nhk, kw = case
    rng = np.random.default_rng(sum(lens_q) * 7 + nh)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    d = 6
    q = rng.standard_normal((cu_q[-1] + 2, nh, d))
    k = rng.standard_normal((cu_k[-1] + 1, nhk, d))
    v = rng.standard_normal((cu_k[-1] + 1, nhk, d))
    dout = rng.standard_normal(q.shape)
    causal, window = kw.get("causal", False), kw.get("window", (-1, -1))
    softcap, alibi, used = kw.get("softcap", 0.0), kw.get("alibi"), kw.get("used")
    with enable_x64(True):
        alibi_j = None if alibi is None else jnp.asarray(alibi)
        loss_fn = jax.jit(lambda q_, k_, v_: _jnp_varlen_loss(
            q_, k_, v_, jnp.asarray(dout), cu_q, cu_k, 0.45, causal, window, softcap, alibi_j,
            used))
        value, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        grads = [np.asarray(g, np.float64) for g in grads]
        loss = float(value)
    mine = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, 0.45, causal, window, softcap,
                                         alibi, used)
    for name, g, m in zip("qkv", grads, mine):
        np.testing.assert_allclose(m, g, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")
    assert np.all(mine[0][cu_q[-1]:] == 0)
    # a forward consistent with the loss: sum(out * dout)
    out, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, 0.45, causal, window, softcap, alibi,
                                       used)
    assert abs(loss - float((out * dout).sum())) < 1e-10 * max(1.0, abs(loss))


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(11)
    cu_q, cu_k = _cu([2, 3]), _cu([3, 4])
    q = rng.standard_normal((5, 2, 3))
    k = rng.standard_normal((7, 1, 3))
    v = rng.standard_normal((7, 1, 3))
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=True, window_size=(2, -1), softcap=1.1, alibi_slopes=np.array([0.3, 0.7]))

    def loss(qq, kk, vv):
        return float((ref.flash_attn_varlen_ref(qq, kk, vv, cu_q, cu_k, 0.8, **kw)[0] * dout).sum())

    grads = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, 0.8, kw["causal"],
                                          kw["window_size"], kw["softcap"], kw["alibi_slopes"])
    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        numeric = np.zeros_like(args[which])
        for idx in np.ndindex(args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8, err_msg="qkv"[which])


def test_dense_backward_is_varlen_backward():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 5, 2, 8))
    v = rng.standard_normal((2, 5, 2, 8))
    dout = rng.standard_normal(q.shape)
    dense = ref.flash_attn_bwd_ref(dout, q, k, v, 0.4, causal=True, softcap=3.0)
    for b in range(2):
        one = ref.flash_attn_varlen_bwd_ref(dout[b], q[b], k[b], v[b], [0, 3], [0, 5], 0.4, True,
                                            (-1, -1), 3.0, None)
        for x, y in zip(dense, one):
            np.testing.assert_allclose(x[b], y, rtol=1e-14, atol=1e-15)


# ------------------------------------------------------------------ paged attention
def test_paged_attention_matches_scalar_loop():
    rng = np.random.default_rng(21)
    bs, nblocks, nh, nhk, d = 4, 10, 4, 2, 6
    kc = rng.standard_normal((nblocks, bs, nhk, d))
    vc = rng.standard_normal((nblocks, bs, nhk, d))
    tables = rng.permutation(nblocks)[:9].reshape(3, 3).astype(np.int32)
    seq_lens = np.array([9, 1, 12], np.int32)
    lens_q = [2, 1, 4]
    qsl = _cu(lens_q)
    q = rng.standard_normal((qsl[-1] + 3, nh, d))
    slopes = rng.uniform(0.1, 1.0, nh)
    for window, cap, alibi in ((None, None, None), (3, None, None), (None, 2.5, None),
                               (2, 0.8, None), (None, None, slopes), (3, 1.5, slopes)):
        got = ref.paged_attention_ref(q, kc, vc, seq_lens, tables, qsl, 0.7, sliding_window=window,
                                      soft_cap=cap, alibi_slopes=alibi)
        # as flash attention: causal (right = 0) with left = W - 1, paged keys
        want, _ = _loop_attention(q, kc, vc, qsl, _cu(seq_lens), 0.7, causal=True,
                                  window=(-1 if window is None else window - 1, -1),
                                  softcap=cap or 0.0, alibi=alibi, block_table=tables)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
        # sliding window W: key j is visible iff pos - j < W (checked directly)
        if window is not None and alibi is None:
            i, s = 3, 2  # last query of sequence 2, pos = 12 - 4 + 3 = 11
            kv = [(tables[s, j // bs], j % bs) for j in range(11 - window + 1, 12)]
            keys = np.stack([kc[blk, o] for blk, o in kv])
            vals = np.stack([vc[blk, o] for blk, o in kv])
            sc = 0.7 * np.einsum("hd,jhd->hj", q[qsl[s] + i], np.repeat(keys, 2, axis=1))
            if cap:
                sc = cap * np.tanh(sc / cap)
            p = np.exp(sc - sc.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            np.testing.assert_allclose(got[qsl[s] + i],
                                       np.einsum("hj,jhd->hd", p, np.repeat(vals, 2, axis=1)),
                                       rtol=1e-12)
    # num_seqs: only the first rows are real
    got = ref.paged_attention_ref(q, kc, vc, seq_lens, tables, qsl, 0.7, num_seqs=np.array([2]))
    full = ref.paged_attention_ref(q, kc, vc, seq_lens, tables, qsl, 0.7)
    np.testing.assert_array_equal(got[:qsl[2]], full[:qsl[2]])
    assert np.all(got[qsl[2]:] == 0) and np.abs(full[qsl[2]:qsl[3]]).sum() > 0


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "fp8", "fp8_e5m2"])
def test_paged_attention_dequantizes_fp8(fmt):
    rng = np.random.default_rng(22)
    dt = ref.FP8_DTYPES.get(fmt) or ref.FP8_DTYPES[ref.KV_CACHE_FORMATS[fmt]]
    kc = (rng.standard_normal((3, 4, 1, 8)) * 3).astype(dt)
    vc = (rng.standard_normal((3, 4, 1, 8)) * 3).astype(dt)
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    args = (np.array([7, 5], np.int32), np.array([[0, 1], [2, 0]], np.int32),
            np.array([0, 1, 2], np.int32), 0.3)
    want = ref.paged_attention_ref(q, kc.astype(np.float64) * 0.5, vc.astype(np.float64) * 2.0,
                                   *args)
    if fmt.startswith("float8"):
        got = ref.paged_attention_ref(q, kc, vc, *args, k_scale=np.float32(0.5),
                                      v_scale=np.array([2.0], np.float32))
    else:
        got = ref.paged_attention_ref(q, kc.view(np.uint8), vc.view(np.uint8), *args,
                                      k_scale=0.5, v_scale=2.0, kv_cache_dtype=fmt)
    np.testing.assert_array_equal(got, want)
    # scales do not apply to float caches
    f = ref.paged_attention_ref(q, kc.astype(np.float32), vc.astype(np.float32), *args,
                                k_scale=0.5, v_scale=2.0)
    np.testing.assert_array_equal(f, ref.paged_attention_ref(q, kc.astype(np.float32),
                                                             vc.astype(np.float32), *args))


# ------------------------------------------------------------------ cache write
def _nearest_fp8(x: float, dtype) -> int:
    """Code of the fp8 value nearest to x after saturation, ties to the even code
    (brute force over all 256 codes)."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(dtype).astype(np.float64)
    finite = np.isfinite(values)
    limit = values[finite].max()
    if math.isnan(x):
        return -1
    x = min(max(x, -limit), limit)
    dist = np.where(finite, np.abs(values - x), np.inf)
    best = np.flatnonzero(dist == dist.min())
    # ties: the even mantissa; +0 rather than -0 for x == 0 with positive sign
    if len(best) > 1:
        same_sign = [c for c in best if (c >= 128) == (math.copysign(1.0, x) < 0)]
        best = same_sign or list(best)
        best = [c for c in best if c % 2 == 0] or best
    return int(best[0])


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_is_saturating_round_to_nearest_even(name):
    rng = np.random.default_rng(31)
    dt = ref.FP8_DTYPES[name]
    limit = ref.FP8_MAX[name]
    codes = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    finite = np.sort(np.unique(codes[np.isfinite(codes)]))
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties
    x = np.concatenate([rng.standard_normal(300) * limit / 8, rng.standard_normal(100) * 1e-3,
                        mids, finite, [limit * 1.01, -limit * 5, 1e30, -np.inf, np.inf, 0.0]])
    x = x.astype(np.float32)
    for scale in (1.0, 0.37, 3.0):
        got = ref.quantize_fp8(x, dt, np.float32(scale)).view(np.uint8)
        divided = (x / np.float32(scale)).astype(np.float32)
        for xi, g in zip(divided, got):
            want = _nearest_fp8(float(xi), dt)
            assert g == want, (name, scale, float(xi), hex(g), hex(want))
    nans = np.array([np.nan, -np.nan], np.float32)
    nans = np.concatenate([nans, np.array([0x7F800001, 0xFFC01234], np.uint32).view(np.float32)])
    got = ref.quantize_fp8(nans, dt, 0.5)
    assert np.isnan(got.astype(np.float32)).all()
    assert np.all(got.view(np.uint8) == 0x7F)


def _loop_reshape_and_cache_flash(key, value, kc, vc, slots, encode):
    kc, vc = kc.copy(), vc.copy()
    nb, bs = kc.shape[:2]
    for t, s in enumerate(slots):
        s = int(s)
        if s < 0 or s >= nb * bs:
            continue
        for h in range(key.shape[1]):
            for d in range(key.shape[2]):
                kc[s // bs, s % bs, h, d] = encode(key[t, h, d], "k")
                vc[s // bs, s % bs, h, d] = encode(value[t, h, d], "v")
    return kc, vc


@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cache", ["auto", "float8_e4m3fn", "float8_e5m2", "fp8", "fp8_e4m3",
                                   "fp8_e5m2"])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_reshape_and_cache_flash_matches_loop(src, cache, slot_dtype):
    rng = np.random.default_rng(41)
    sdt = np.dtype(ml_dtypes.bfloat16) if src == "bfloat16" else np.dtype(src)
    key = (rng.standard_normal((6, 2, 3)) * 50).astype(sdt)
    value = (rng.standard_normal((6, 2, 3)) * 50).astype(sdt)
    slots = np.array([5, -1, 0, 11, 12, 7], slot_dtype)  # 12 is out of range (3 blocks of 4)
    ks, vs = np.float32(0.3), np.float32(2.5)
    if cache == "auto":
        kc0 = rng.standard_normal((3, 4, 2, 3)).astype(sdt)
        encode = lambda x, _: x
        fmt = "auto"
    else:
        name = cache if cache.startswith("float8") else ref.KV_CACHE_FORMATS[cache]
        dt = ref.FP8_DTYPES[name]
        kc0 = rng.integers(0, 256, (3, 4, 2, 3), dtype=np.uint8)
        if cache.startswith("float8"):
            kc0 = kc0.view(dt)
            fmt = "auto" if name == "float8_e4m3fn" else "fp8_e5m2"
            encode = lambda x, which: ref.quantize_fp8(np.float32(x), dt, ks if which == "k" else vs)
        else:
            fmt = cache
            encode = lambda x, which: ref.quantize_fp8(np.float32(x), dt,
                                                       ks if which == "k" else vs).view(np.uint8)
    vc0 = kc0.copy()[::-1].copy()
    got = ref.reshape_and_cache_flash_ref(key, value, kc0, vc0, slots, fmt, ks, vs)
    want = _loop_reshape_and_cache_flash(key, value, kc0, vc0, slots, encode)
    for g, w in zip(got, want):
        ref.assert_bits_equal(g, w)
    untouched = np.setdiff1d(np.arange(12), slots)
    ref.assert_bits_equal(got[0].reshape(12, 2, 3)[untouched], kc0.reshape(12, 2, 3)[untouched])


def test_rel_error_and_bits_helpers():
    a = np.array([1.0, 2.0, np.inf])
    assert ref.rel_error(a, a) == 0.0
    assert ref.rel_error(np.array([1.0, 2.0, 3.0]), a) == math.inf
    assert ref.rel_error([3.0, 4.0], [0.0, 0.0]) == 5.0
    with pytest.raises(AssertionError):
        ref.assert_bits_equal(np.array([0.0]), np.array([-0.0]))
    ref.assert_bits_equal(np.array([np.nan]), np.array([np.nan]))
