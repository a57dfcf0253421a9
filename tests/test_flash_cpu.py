"""flash_attn_varlen and flash_attn (forward) on the Host platform against the float64
reference: every dtype, MHA/GQA/MQA, causal both ways, windows, softcap, ALiBi, paged
K/V, seqused_k, empty sequences, padded batches, head dims 32-256, softmax_lse, jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

DTYPES = ["float32", "float16", "bfloat16"]


def _max(lengths):
    return max([int(x) for x in lengths] + [0])


def run_varlen(q, k, v, cu_q, cu_k, fn=None, max_seqlen_k=None, **kw):
    """The op on jax arrays, returning (out, lse) as numpy."""
    fn = fn or xla_attn.flash_attn_varlen
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    args = {name: (jnp.asarray(val) if isinstance(val, np.ndarray) else val)
            for name, val in kw.items()}
    out, lse = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu_q),
                  jnp.asarray(cu_k), _max(lens_q),
                  _max(lens_k) if max_seqlen_k is None else max_seqlen_k,
                  return_softmax_lse=True, **args)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    return np.asarray(out), np.asarray(lse)


def check_varlen(q, k, v, cu_q, cu_k, dtype, scale=None, max_seqlen_k=None, **kw):
    out, lse = run_varlen(q, k, v, cu_q, cu_k, softmax_scale=scale, max_seqlen_k=max_seqlen_k,
                          **kw)
    assert out.dtype == np.dtype(q.dtype)
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, scale, **kw)
    ref.assert_attention_close(out, want, dtype, lse, want_lse, valid_rows=int(cu_q[-1]))
    return out, lse, want, want_lse


# ------------------------------------------------------------------ varlen
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_heads(rng, mk, dtype, heads):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [5, 1, 8], [7, 3, 8], *heads, head_dim=64,
                                           pad_q=3)
    check_varlen(q, k, v, cu_q, cu_k, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_varlen_head_dims(rng, mk, dtype, head_dim):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [3, 6], [9, 5], 2, 1, head_dim, pad_q=1)
    check_varlen(q, k, v, cu_q, cu_k, dtype, causal=True)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 100])
def test_varlen_unusual_head_dims(rng, mk, head_dim):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [4, 3], [5, 6], 2, 2, head_dim)
    check_varlen(q, k, v, cu_q, cu_k, "float32")


CAUSAL_LENGTHS = {
    "lq<lk": ([3, 1, 5], [8, 6, 9]),
    "lq>lk": ([9, 6, 4], [3, 1, 4]),  # the first Lq - Lk rows see no key
    "lq=lk": ([7, 1, 5], [7, 1, 5]),
    "mixed odd": ([1, 13, 2, 7], [17, 5, 2, 11]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", CAUSAL_LENGTHS.values(), ids=CAUSAL_LENGTHS.keys())
def test_varlen_causal(rng, mk, dtype, lengths):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, *lengths, 4, 2, 32, pad_q=2)
    _, lse, _, want_lse = check_varlen(q, k, v, cu_q, cu_k, dtype, causal=True)
    if lengths is CAUSAL_LENGTHS["lq>lk"]:
        assert np.isposinf(want_lse).any() and np.isposinf(lse[:, 0]).all()


WINDOWS = [  # (window_size, causal)
    ((2, -1), False), ((-1, 1), False), ((3, 2), False), ((0, 0), False), ((1, 4), False),
    ((2, 0), True), ((0, -1), True), ((5, 3), True),  # causal overrides right
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS, ids=[f"{w}{'-causal' if c else ''}" for w, c in WINDOWS])
def test_varlen_window(rng, mk, dtype, window):
    window_size, causal = window
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [6, 9, 2, 5], [10, 4, 7, 5], 4, 2, 32,
                                           pad_q=2)
    check_varlen(q, k, v, cu_q, cu_k, dtype, causal=causal, window_size=window_size)


def test_varlen_window_hides_every_key(rng, mk):
    """Lq > Lk with a zero-width window: rows before the keys start see nothing."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [6, 3], [2, 3], 2, 1, 32)
    _, lse, _, _ = check_varlen(q, k, v, cu_q, cu_k, "float32", window_size=(0, 0))
    assert np.isposinf(lse[:, :4]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_varlen_softcap(rng, mk, dtype, causal, softcap):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [5, 7], [8, 7], 4, 2, 64, pad_q=1)
    q = (q.astype(np.float32) * 3).astype(q.dtype)  # scores large enough for tanh to bend
    check_varlen(q, k, v, cu_q, cu_k, dtype, causal=causal, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes(H)", "slopes(B,H)"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_alibi(rng, mk, dtype, per_batch, causal):
    lens_q, lens_k = [4, 9, 3], [9, 9, 1]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, 4, 2, 32, pad_q=2)
    slopes = mk.alibi(rng, 3, 4) if per_batch else mk.alibi(rng, 4)
    check_varlen(q, k, v, cu_q, cu_k, dtype, causal=causal, alibi_slopes=slopes)


def test_varlen_alibi_with_softcap_and_window(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 8], [11, 8], 4, 1, 32)
    check_varlen(q, k, v, cu_q, cu_k, "float32", causal=True, window_size=(4, -1), softcap=2.0,
                 alibi_slopes=mk.alibi(rng, 2, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_seqused_k(rng, mk, dtype):
    """seqused_k overrides the key lengths; keys past it are never read (poisoned)."""
    lens_q, lens_k = [3, 4, 2], [9, 6, 8]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, 4, 2, 32, pad_q=1)
    used = np.array([5, 6, 0], np.int32)
    for b in range(3):  # poison the unused keys: any read of them shows
        k[cu_k[b] + used[b]:cu_k[b + 1]] = np.asarray(1e4, k.dtype)
        v[cu_k[b] + used[b]:cu_k[b + 1]] = np.asarray(-1e4, v.dtype)
    for causal in (False, True):
        check_varlen(q, k, v, cu_q, cu_k, dtype, causal=causal, seqused_k=used)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seqused", [False, True], ids=["lengths", "seqused_k"])
def test_varlen_paged(rng, mk, dtype, block_size, seqused):
    lens_q, lens_k = [3, 1, 6], [37, 16, 6]
    kc, vc, table = mk.paged_kv(rng, dtype, lens_k, block_size, heads_k=2, head_dim=64)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    q = mk.random_array(rng, (cu_q[-1] + 2, 4, 64), dtype)
    kw = dict(causal=True, block_table=table)
    if seqused:
        used = np.array([33, 9, 6], np.int32)
        kw["seqused_k"] = used
        cu_k = mk.cu_seqlens([40, 16, 7])  # the lengths seqused_k overrides (still in pages)
        kw["max_seqlen_k"] = 40
    check_varlen(q, kc, vc, cu_q, cu_k, dtype, **kw)


@pytest.mark.parametrize("block_size", [16, 32])
def test_varlen_paged_features(rng, mk, block_size):
    """Paged K/V with GQA, a window, softcap and ALiBi, non-causal rows too."""
    lens_q, lens_k = [2, 5, 0, 4], [40, 5, 3, 70]
    kc, vc, table = mk.paged_kv(rng, "bfloat16", lens_k, block_size, heads_k=1, head_dim=32)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    q = mk.random_array(rng, (cu_q[-1] + 1, 4, 32), "bfloat16")
    check_varlen(q, kc, vc, cu_q, cu_k, "bfloat16", window_size=(9, 2), softcap=5.0,
                 alibi_slopes=mk.alibi(rng, 4), block_table=table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_empty_sequences(rng, mk, dtype):
    """Length-0 query or key spans are legal: rows with no keys give 0 and lse +inf."""
    lens_q, lens_k = [0, 3, 2, 0, 4, 1], [5, 0, 3, 0, 6, 0]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, 4, 2, 32, pad_q=2)
    for causal in (False, True):
        out, lse, _, _ = check_varlen(q, k, v, cu_q, cu_k, dtype, causal=causal)
        assert np.all(out[0:3].astype(np.float64) == 0) and np.isposinf(lse[:, 0:3]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_padded_batch(rng, mk, dtype):
    """total_q well past cu_seqlens_q[-1] and unused key rows: padding is 0 / +inf."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [2, 5], [4, 5], 4, 2, 32, pad_q=9, pad_k=6)
    out, lse, _, _ = check_varlen(q, k, v, cu_q, cu_k, dtype, causal=True)
    assert np.all(out[7:].astype(np.float64) == 0) and np.isposinf(lse[:, 7:]).all()


def test_varlen_all_padding(rng, mk):
    """A batch whose every sequence is empty: everything is padding."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [0, 0], [3, 0], 2, 2, 32, pad_q=5)
    out, lse = run_varlen(q, k, v, cu_q, cu_k)
    assert np.all(out == 0) and np.isposinf(lse).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_softmax_scale(rng, mk, dtype):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [4, 5], [6, 5], 2, 2, 64)
    check_varlen(q, k, v, cu_q, cu_k, dtype, scale=None)  # 1/sqrt(64)
    check_varlen(q, k, v, cu_q, cu_k, dtype, scale=0.31)
    default, _ = run_varlen(q, k, v, cu_q, cu_k)
    explicit, _ = run_varlen(q, k, v, cu_q, cu_k, softmax_scale=0.125)
    np.testing.assert_array_equal(default, explicit)


def test_varlen_without_lse(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [3, 4], [5, 4], 2, 1, 32, pad_q=1)
    out = xla_attn.flash_attn_varlen(*map(jnp.asarray, (q, k, v, cu_q, cu_k)), 4, 5, causal=True)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    with_lse, _ = run_varlen(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_array_equal(np.asarray(out), with_lse)


def test_varlen_fp8_with_descales(rng, mk):
    """float8_e4m3fn q/k/v: values times their descale; the output is bfloat16."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float8_e4m3fn", [4, 6], [7, 6], 4, 2, 64,
                                           pad_q=2)
    descales = dict(q_descale=mk.f32(0.5), k_descale=mk.f32([0.25]), v_descale=mk.f32(3.0))
    out, lse = run_varlen(q, k, v, cu_q, cu_k, causal=True, **descales)
    assert out.dtype == np.dtype(mk.NP_DTYPES["bfloat16"])
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, **descales)
    ref.assert_attention_close(out, want, "bfloat16", lse, want_lse, valid_rows=int(cu_q[-1]))
    plain, _ = run_varlen(q, k, v, cu_q, cu_k, causal=True)  # no descales: 1.0
    want_plain, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True)
    assert ref.rel_error(plain, want_plain) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_under_jit(rng, mk, dtype):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [3, 8, 1], [9, 8, 2], 4, 2, 32, pad_q=2)
    slopes = mk.alibi(rng, 4)
    fn = jax.jit(functools.partial(xj.flash_attn_varlen, max_seqlen_q=8, max_seqlen_k=9,
                                   causal=True, window_size=(5, -1), softcap=4.0,
                                   return_softmax_lse=True))
    out, lse = fn(*map(jnp.asarray, (q, k, v, cu_q, cu_k)), alibi_slopes=jnp.asarray(slopes))
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True,
                                               window_size=(5, -1), softcap=4.0,
                                               alibi_slopes=slopes)
    ref.assert_attention_close(np.asarray(out), want, dtype, np.asarray(lse), want_lse,
                               valid_rows=int(cu_q[-1]))
    # cu_seqlens are device data: new lengths, same compiled program
    cu_q2, cu_k2 = mk.cu_seqlens([8, 2, 2]), mk.cu_seqlens([8, 9, 2])
    out2, lse2 = fn(*map(jnp.asarray, (q, k, v, cu_q2, cu_k2)), alibi_slopes=jnp.asarray(slopes))
    want2, want_lse2 = ref.flash_attn_varlen_ref(q, k, v, cu_q2, cu_k2, None, causal=True,
                                                 window_size=(5, -1), softcap=4.0,
                                                 alibi_slopes=slopes)
    ref.assert_attention_close(np.asarray(out2), want2, dtype, np.asarray(lse2), want_lse2,
                               valid_rows=int(cu_q2[-1]))


def test_top_level_routes_to_jax(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [3, 5], [4, 5], 2, 2, 32)
    top = xla_attn.flash_attn_varlen(*map(jnp.asarray, (q, k, v, cu_q, cu_k)), 5, 5)
    front = xj.flash_attn_varlen(*map(jnp.asarray, (q, k, v, cu_q, cu_k)), 5, 5)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(front))
    from_numpy = xla_attn.flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 5)  # numpy in, jax out
    np.testing.assert_array_equal(np.asarray(from_numpy), np.asarray(front))


def test_varlen_inputs_not_modified(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [3, 5], [4, 5], 2, 2, 32)
    jq, jk, jv = map(jnp.asarray, (q, k, v))
    xla_attn.flash_attn_varlen(jq, jk, jv, jnp.asarray(cu_q), jnp.asarray(cu_k), 5, 5)
    for a, b in ((jq, q), (jk, k), (jv, v)):
        np.testing.assert_array_equal(np.asarray(a), b)


# ------------------------------------------------------------------ dense layout
DENSE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "causal window": dict(causal=True, window_size=(2, -1)),
    "softcap": dict(softcap=1.5),
    "alibi(H)": dict(alibi="h"),
    "alibi(B,H) causal": dict(alibi="bh", causal=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
@pytest.mark.parametrize("shape", [(2, 5, 9, 4, 2), (2, 9, 5, 4, 1), (1, 7, 7, 2, 2)],
                         ids=["sq<sk gqa", "sq>sk mqa", "sq=sk"])
def test_dense(rng, mk, dtype, case, shape):
    b, sq, sk, h, hk = shape
    d = 32
    q = mk.random_array(rng, (b, sq, h, d), dtype)
    k = mk.random_array(rng, (b, sk, hk, d), dtype)
    v = mk.random_array(rng, (b, sk, hk, d), dtype)
    kw = dict(case)
    if "alibi" in kw:
        kw["alibi_slopes"] = mk.alibi(rng, h) if kw.pop("alibi") == "h" else mk.alibi(rng, b, h)
    out, lse = xla_attn.flash_attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                   return_softmax_lse=True,
                                   **{n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x)
                                      for n, x in kw.items()})
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, sq)
    want, want_lse = ref.flash_attn_ref(q, k, v, None, **kw)
    flat = lambda x: np.asarray(x).reshape(b * sq, h, d)
    ref.assert_attention_close(flat(out), flat(want), dtype,
                               np.asarray(lse).transpose(1, 0, 2).reshape(h, b * sq),
                               want_lse.transpose(1, 0, 2).reshape(h, b * sq))


def test_dense_matches_jax_nn(rng, mk):
    """A second opinion: jax.nn.dot_product_attention (float32, XLA)."""
    q = mk.random_array(rng, (2, 8, 4, 64), "float32")
    k = mk.random_array(rng, (2, 8, 2, 64), "float32")
    v = mk.random_array(rng, (2, 8, 2, 64), "float32")
    for causal in (False, True):
        got = xj.flash_attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=causal)
        want = jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                            is_causal=causal)
        assert ref.rel_error(got, want) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_under_jit(rng, mk, dtype):
    q = mk.random_array(rng, (2, 6, 4, 64), dtype)
    k = mk.random_array(rng, (2, 10, 2, 64), dtype)
    v = mk.random_array(rng, (2, 10, 2, 64), dtype)
    fn = jax.jit(functools.partial(xla_attn.flash_attn, causal=True, softcap=3.0))
    out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    want, _ = ref.flash_attn_ref(q, k, v, None, causal=True, softcap=3.0)
    assert ref.rel_error(out, want) < ref.BOUNDS[dtype]
