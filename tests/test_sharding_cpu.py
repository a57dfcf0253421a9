"""SPMD on 4 fake CPU devices (conftest sets --xla_force_host_platform_device_count):
jax.shard_map over heads (and kv heads) gives the unsharded result, for
flash_attn_varlen (forward and gradient), paged_attention and the cache write."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

N = 4


@pytest.fixture(scope="module")
def mesh():
    cpus = jax.devices("cpu")
    assert len(cpus) >= N, f"expected {N} fake CPU devices (XLA_FLAGS), got {len(cpus)}"
    return Mesh(np.array(cpus[:N]), ("h",))


def close(a, b, bound=1e-6):
    """Sharded vs unsharded: the same per-head computation, so (near) identical."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert ref.rel_error(a, b) <= bound, ref.rel_error(a, b)


HEADS = [(8, 8), (8, 4), (8, 1)]  # MHA, GQA (kv heads sharded too), MQA (kv replicated)


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_varlen_over_heads(rng, mk, mesh, heads, dtype):
    h, hk = heads
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [5, 0, 9, 3], [7, 2, 9, 3], h, hk, 32,
                                           pad_q=3)
    slopes = mk.alibi(rng, h)
    kv_spec = P(None, "h", None) if hk >= N else P()
    kw = dict(causal=True, window_size=(6, -1), softcap=5.0, return_softmax_lse=True)

    def f(q_, k_, v_, cu_q_, cu_k_, slopes_):
        return xj.flash_attn_varlen(q_, k_, v_, cu_q_, cu_k_, 9, 9, alibi_slopes=slopes_, **kw)

    sharded = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P(None, "h", None), kv_spec, kv_spec, P(), P(), P("h")),
        out_specs=(P(None, "h", None), P("h", None))))
    args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k, slopes)]
    out_s, lse_s = sharded(*args)
    out_u, lse_u = jax.jit(f)(*args)
    assert len(out_s.sharding.device_set) == N
    close(out_s, out_u)
    close(lse_s, lse_u)
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, alibi_slopes=slopes,
                                               causal=True, window_size=(6, -1), softcap=5.0)
    ref.assert_attention_close(np.asarray(out_s), want, dtype, np.asarray(lse_s), want_lse,
                               valid_rows=int(cu_q[-1]))


def test_flash_varlen_per_batch_alibi_over_heads(rng, mk, mesh):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [4, 6], [8, 6], 8, 4, 32)
    slopes = mk.alibi(rng, 2, 8)
    f = functools.partial(xla_attn.flash_attn_varlen, max_seqlen_q=6, max_seqlen_k=8)
    g = lambda q_, k_, v_, a, b, s: f(q_, k_, v_, a, b, alibi_slopes=s)
    sharded = jax.jit(jax.shard_map(
        g, mesh=mesh, in_specs=(P(None, "h"), P(None, "h"), P(None, "h"), P(), P(), P(None, "h")),
        out_specs=P(None, "h")))
    args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k, slopes)]
    close(sharded(*args), jax.jit(g)(*args))


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out and lse"])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
def test_flash_varlen_grad_over_heads(rng, mk, mesh, heads, with_lse):
    """Gradients inside shard_map, of a loss on out (and on softmax_lse: its cotangent is
    sharded over the heads like softmax_lse itself)."""
    h, hk = heads
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 9, 3], [7, 9, 3], h, hk, 32,
                                           pad_q=1)
    dout = jnp.asarray(mk.random_array(rng, q.shape, "float32"))
    # the padding row sees no key (lse = +inf): out of the loss
    w = np.where(np.arange(q.shape[0]) < cu_q[-1], rng.standard_normal((h, q.shape[0])), 0.0)
    w = w if with_lse else np.zeros_like(w)
    kv_spec = P(None, "h", None) if hk >= N else P()

    def f(q_, k_, v_, cu_q_, cu_k_):
        return xj.flash_attn_varlen(q_, k_, v_, cu_q_, cu_k_, 9, 9, causal=True, softcap=3.0,
                                    return_softmax_lse=True)

    sharded = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "h"), kv_spec, kv_spec, P(), P()),
                            out_specs=(P(None, "h"), P("h", None)))
    jcu_q, jcu_k, jw = jnp.asarray(cu_q), jnp.asarray(cu_k), jnp.asarray(w, jnp.float32)

    def grads(fn):
        def loss(a, b, c):
            out, lse = fn(a, b, c, jcu_q, jcu_k)
            lse_term = jnp.sum(jnp.where(jw != 0, lse, 0.0) * jw) if with_lse else 0.0
            return jnp.sum(out * dout) + lse_term
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k),
                                                          jnp.asarray(v))

    for a, b in zip(grads(sharded), grads(f)):
        close(a, b, 1e-6)
    want = ref.flash_attn_varlen_bwd_ref(np.asarray(dout), q, k, v, cu_q, cu_k, None, True,
                                         (-1, -1), 3.0, dlse=w if with_lse else None)
    for g, w in zip(grads(sharded), want):
        assert ref.rel_error(g, w) < 1e-5


def test_dense_flash_over_heads(rng, mk, mesh):
    q = mk.random_array(rng, (2, 6, 8, 32), "bfloat16")
    k = mk.random_array(rng, (2, 9, 4, 32), "bfloat16")
    v = mk.random_array(rng, (2, 9, 4, 32), "bfloat16")
    f = functools.partial(xla_attn.flash_attn, causal=True)
    spec = P(None, None, "h", None)
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    args = [jnp.asarray(x) for x in (q, k, v)]
    close(sharded(*args), jax.jit(f)(*args))


@pytest.mark.parametrize("heads", [(8, 4), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_over_heads(rng, mk, mesh, heads, cache):
    h, hk = heads
    seq_lens = [37, 5, 60, 9]
    kc, vc, tables = mk.paged_kv(rng, cache, seq_lens, 16, hk, 32)
    qsl = mk.cu_seqlens([2, 5, 1, 1])
    query = mk.random_array(rng, (int(qsl[-1]) + 2, h, 32), "bfloat16")
    kv_spec = P(None, None, "h", None) if hk >= N else P()
    scales = dict(k_scale=jnp.asarray(0.5, jnp.float32), v_scale=jnp.asarray(1.5, jnp.float32))

    def f(query_, kc_, vc_, lens_, tables_, qsl_, n_):
        return xj.paged_attention(query_, kc_, vc_, lens_, tables_, qsl_, 0.2, sliding_window=40,
                                  soft_cap=8.0, num_seqs=n_, **scales)

    sharded = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P(None, "h", None), kv_spec, kv_spec, P(), P(), P(), P()),
        out_specs=P(None, "h", None)))
    args = [jnp.asarray(x) for x in (query, kc, vc, np.array(seq_lens, np.int32), tables, qsl)]
    args.append(jnp.asarray(3, jnp.int32))
    out_s = sharded(*args)
    close(out_s, jax.jit(f)(*args))
    want = ref.paged_attention_ref(query, kc, vc, np.array(seq_lens), tables, qsl, 0.2,
                                   sliding_window=40, soft_cap=8.0, k_scale=0.5, v_scale=1.5,
                                   num_seqs=3)
    ref.assert_attention_close(np.asarray(out_s), want, "bfloat16", valid_rows=int(qsl[3]))


@pytest.mark.parametrize("fmt", [("bfloat16", "auto"), ("uint8", "fp8_e4m3"),
                                 ("float8_e5m2", "fp8_e5m2")], ids=["bf16", "uint8", "float8"])
def test_reshape_and_cache_flash_over_kv_heads(rng, mk, mesh, fmt):
    storage, kv_cache_dtype = fmt
    heads_k, d, num_blocks, bs = 8, 32, 4, 16
    key = mk.random_array(rng, (10, heads_k, d), "bfloat16", 50.0)
    value = mk.random_array(rng, (10, heads_k, d), "bfloat16", 50.0)
    # finite poison: jax 0.11's device_put onto a NamedSharding rewrites float8 NaN
    # payloads to 0x7f on CPU (seen with jax 0.11.2), which is no concern of this op
    kc = mk.random_bits(rng, (num_blocks, bs, heads_k, d), storage, finite=True)
    vc = mk.random_bits(rng, (num_blocks, bs, heads_k, d), storage, finite=True)
    slots = rng.permutation(num_blocks * bs)[:10].astype(np.int32)
    slots[[2, 7]] = -1
    scales = (jnp.asarray(0.3, jnp.float32), jnp.asarray(2.0, jnp.float32))

    def f(key_, value_, kc_, vc_, slots_):
        return xj.reshape_and_cache_flash(key_, value_, kc_, vc_, slots_,
                                          kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
                                          v_scale=scales[1])

    tok, cache = P(None, "h", None), P(None, None, "h", None)
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(tok, tok, cache, cache, P()),
                                    out_specs=(cache, cache)), donate_argnums=(2, 3))
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    got = sharded(put(key, tok), put(value, tok), put(kc, cache), put(vc, cache),
                  put(slots, P()))
    unsharded = jax.jit(f)(*[jnp.asarray(x) for x in (key, value, kc, vc, slots)])
    want = ref.reshape_and_cache_flash_ref(key, value, kc, vc, slots, kv_cache_dtype, 0.3, 2.0)
    for g, u, w in zip(got, unsharded, want):
        assert g.sharding.spec == cache or len(g.sharding.device_set) == N
        ref.assert_bits_equal(np.asarray(g), np.asarray(u))
        ref.assert_bits_equal(np.asarray(g), w)
