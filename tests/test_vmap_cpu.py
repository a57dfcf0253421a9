"""jax.vmap of every op equals a Python loop of unbatched calls (bit for bit on the Host
platform), for each way the batching rule can go:
* flash attention folds the mapped axis into the heads (varlen) or the batch (dense):
  one custom call, no loop in the HLO; unmapped k/v/alibi are broadcast first;
* flash calls whose index arrays (cu_seqlens, seqused_k) are mapped, paged flash,
  paged_attention and the cache write run one call per element (a loop in the HLO);
* gradients under vmap, vmap of vmap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_attn import jax as xj
from xla_attn.testing import reference as ref

V = 3  # the mapped axis


def loop(f, in_axes, *args):
    """f on each element of the mapped axis, stacked: what vmap must equal."""
    def element(i):
        return f(*[a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)])
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[element(i) for i in range(V)])


def assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        ref.assert_bits_equal(np.asarray(g), np.asarray(w))


def hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def fwd_calls(text: str) -> int:
    return text.count('custom_call_target="xla_attn_flash_fwd_v1"')


def check(f, in_axes, *args, folded: bool):
    args = [jnp.asarray(a) for a in args]
    batched = jax.vmap(f, in_axes=in_axes)
    assert_same(jax.jit(batched)(*args), loop(f, in_axes, *args))
    text = hlo(batched, *args)
    assert ("while" not in text) == folded, "folded means one call, no loop"
    return text


# ------------------------------------------------------------------ flash_attn_varlen
def _varlen_inputs(rng, mk, h=8, hk=2, dtype="float32"):
    q = np.stack([mk.random_array(rng, (16, h, 32), dtype) for _ in range(V)])
    k = np.stack([mk.random_array(rng, (20, hk, 32), dtype) for _ in range(V)])
    v = np.stack([mk.random_array(rng, (20, hk, 32), dtype) for _ in range(V)])
    return q, k, v, mk.cu_seqlens([7, 0, 6]), mk.cu_seqlens([9, 4, 7])


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_varlen_folds_into_heads(rng, mk, heads):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk, *heads)
    slopes = mk.alibi(rng, heads[0])

    def f(q, k, v):
        return xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True, softcap=4.0,
                                    alibi_slopes=slopes, return_softmax_lse=True)

    text = check(f, (0, 0, 0), q, k, v, folded=True)
    assert fwd_calls(text) == 1
    want, want_lse = ref.flash_attn_varlen_ref(q[1], k[1], v[1], cu_q, cu_k, None, causal=True,
                                               softcap=4.0, alibi_slopes=slopes)
    out, lse = jax.vmap(f)(q, k, v)
    ref.assert_attention_close(np.asarray(out[1]), want, "float32", np.asarray(lse[1]), want_lse)


def test_varlen_fold_broadcasts_unmapped_operands(rng, mk):
    """Only q (and per-batch ALiBi) mapped: k, v are the same for every element."""
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk, 8, 4, "bfloat16")
    slopes = np.stack([mk.alibi(rng, 3, 8) for _ in range(V)])
    f = lambda q, k, v, s: xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9,  # noqa: E731
                                                alibi_slopes=s, window_size=(3, 1))
    check(f, (0, None, None, 0), q, k[0], v[0], slopes, folded=True)


@pytest.mark.parametrize("mapped", ["cu_seqlens", "seqused_k"])
def test_varlen_with_mapped_index_arrays_loops(rng, mk, mapped):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk)
    if mapped == "cu_seqlens":
        index = np.stack([cu_q, mk.cu_seqlens([3, 5, 8]), mk.cu_seqlens([16, 0, 0])])
        f = lambda q, cu: xj.flash_attn_varlen(q, k[0], v[0], cu, cu_k, 16, 9)  # noqa: E731
    else:
        index = np.array([[9, 4, 7], [1, 0, 7], [5, 2, 2]], np.int32)
        f = lambda q, used: xj.flash_attn_varlen(q, k[0], v[0], cu_q, cu_k, 7, 9,  # noqa: E731
                                                 seqused_k=used)
    check(f, (0, 0), q, index, folded=False)


def test_varlen_paged_loops(rng, mk):
    kc, vc, table = mk.paged_kv(rng, "float32", [9, 20], 8, 2, 32)
    kcs = np.stack([kc, kc + 1, kc - 1]).astype(np.float32)
    cu_q, cu_k = mk.cu_seqlens([2, 3]), mk.cu_seqlens([9, 20])
    q = np.stack([mk.random_array(rng, (5, 4, 32), "float32") for _ in range(V)])
    f = lambda q, kc: xj.flash_attn_varlen(q, kc, vc, cu_q, cu_k, 3, 20,  # noqa: E731
                                           block_table=table, causal=True)
    check(f, (0, 0), q, kcs, folded=False)


def test_varlen_grads_under_vmap(rng, mk):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk)
    dout = mk.random_array(rng, q.shape[1:], "float32")
    loss = lambda q, k, v: jnp.sum(  # noqa: E731
        xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True) * dout)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = check(grad, (0, 0, 0), q, k, v, folded=True)
    assert text.count('custom_call_target="xla_attn_flash_bwd_v2"') == 1
    # k, v unmapped: each element's dk, dv (not their sum: vmap of grad is per element)
    check(grad, (0, None, None), q, k[0], v[0], folded=True)
    # a loss on softmax_lse too: its cotangent folds into the heads with the rest
    w = mk.random_array(rng, (q.shape[2], q.shape[1]), "float32")

    def loss_lse(q, k, v):
        out, lse = xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True,
                                        return_softmax_lse=True)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w)
    text = check(jax.grad(loss_lse, argnums=(0, 1, 2)), (0, 0, 0), q, k, v, folded=True)
    assert text.count('custom_call_target="xla_attn_flash_bwd_v3"') == 1


def test_grad_of_vmap(rng, mk):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk)
    f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9)  # noqa: E731
    q, k, v = map(jnp.asarray, (q, k, v))
    got = jax.grad(lambda *a: jnp.sum(jax.vmap(f)(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(loop(f, (0, 0, 0), *a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert_same(got, want)


def test_vmap_of_vmap(rng, mk):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, mk)
    f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True)  # noqa: E731
    two = lambda x: jnp.stack([x, x[::-1] * 0.5])  # noqa: E731
    got = jax.jit(jax.vmap(jax.vmap(f)))(*map(two, (q, k, v)))
    text = hlo(jax.vmap(jax.vmap(f)), *map(two, (q, k, v)))
    assert fwd_calls(text) == 1 and "while" not in text
    assert_same(got[0], jax.vmap(f)(q, k, v))
    assert_same(got[1], jax.vmap(f)(q[::-1] * 0.5, k[::-1] * 0.5, v[::-1] * 0.5))


# ------------------------------------------------------------------ flash_attn (dense)
def test_dense_folds_into_batch(rng, mk):
    q = mk.random_array(rng, (V, 2, 6, 4, 32), "float32")
    k = mk.random_array(rng, (V, 2, 9, 2, 32), "float32")
    slopes = mk.alibi(rng, V, 2, 4)
    f = lambda q, k, s: xj.flash_attn(q, k, k, causal=True, alibi_slopes=s,  # noqa: E731
                                      return_softmax_lse=True)
    assert fwd_calls(check(f, (0, 0, 0), q, k, slopes, folded=True)) == 1
    check(f, (0, None, 0), q, k[0], slopes, folded=True)
    grad = jax.grad(lambda q, k: jnp.sum(xj.flash_attn(q, k, k) ** 2), argnums=(0, 1))
    check(grad, (0, 0), q, k, folded=True)


def test_dense_with_mapped_per_head_alibi_loops(rng, mk):
    """(H,) slopes have no batch dimension to fold the mapped axis into."""
    q = mk.random_array(rng, (V, 2, 6, 4, 32), "float32")
    k = mk.random_array(rng, (2, 9, 4, 32), "float32")
    f = lambda q, s: xj.flash_attn(q, k, k, alibi_slopes=s)  # noqa: E731
    check(f, (0, 0), q, mk.alibi(rng, V, 4), folded=False)


# ------------------------------------------------------------------ paged attention, cache write
def _paged_inputs(rng, mk):
    kc, vc, tables = mk.paged_kv(rng, "bfloat16", [9, 30, 1], 8, 2, 32)
    query = np.stack([mk.random_array(rng, (5, 4, 32), "bfloat16") for _ in range(V)])
    return query, kc, vc, tables, mk.cu_seqlens([1, 3, 1])


@pytest.mark.parametrize("mapped", ["query", "query+caches+lens", "alibi"])
def test_paged_attention_loops(rng, mk, mapped):
    query, kc, vc, tables, qsl = _paged_inputs(rng, mk)
    lens = np.array([[9, 30, 1], [3, 30, 0], [9, 1, 1]], np.int32)
    f = functools.partial(xj.paged_attention, scale=0.2, soft_cap=5.0, max_query_len=3)
    if mapped == "query":
        slopes = mk.alibi(rng, 4)
        g = lambda q: f(q, kc, vc, lens[0], tables, qsl, alibi_slopes=slopes)  # noqa: E731
        check(g, (0,), query, folded=False)
    elif mapped == "alibi":
        g = lambda a: f(query[0], kc, vc, lens[0], tables, qsl, alibi_slopes=a)  # noqa: E731
        check(g, (0,), mk.alibi(rng, V, 4), folded=False)
    else:
        caches = np.stack([kc, vc, kc])
        g = lambda q, c, n: f(q, c, c, n, tables, qsl)  # noqa: E731
        check(g, (0, 0, 0), query, caches, lens, folded=False)


@pytest.mark.parametrize("mapped", ["tokens+caches", "slots"])
def test_cache_write_loops(rng, mk, mapped):
    key = mk.random_array(rng, (V, 4, 2, 32), "float32")
    cache = mk.random_array(rng, (V, 6, 8, 2, 32), "float32")
    slots = np.array([[3, -1, 40, 7], [0, 1, 2, -1], [47, 46, 45, 44]], np.int32)
    if mapped == "tokens+caches":
        f = lambda k, c: xj.reshape_and_cache_flash(k, k * 2, c, c + 1, slots[0])  # noqa: E731
        check(f, (0, 0), key, cache, folded=False)
    else:
        f = lambda s: xj.reshape_and_cache_flash(key[0], key[1], cache[0], cache[1], s)  # noqa: E731
        check(f, (0,), slots, folded=False)
    got = jax.vmap(f)(*((key, cache) if mapped == "tokens+caches" else (slots,)))
    i = 2
    args = (key[i], key[i] * 2, cache[i], cache[i] + 1, slots[0]) if mapped == "tokens+caches" \
        else (key[0], key[1], cache[0], cache[1], slots[i])
    want = ref.reshape_and_cache_flash_ref(*args)
    ref.assert_bits_equal(np.asarray(got[0][i]), want[0])
    ref.assert_bits_equal(np.asarray(got[1][i]), want[1])
