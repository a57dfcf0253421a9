"""Automatic partitioning on 4 fake CPU devices (conftest sets
--xla_force_host_platform_device_count): plain `jax.jit` on inputs placed with a
NamedSharding runs each op once per shard (custom_partitioning with a Shardy
sharding_rule, and the GSPMD callbacks with Shardy off), and `xla_attn.jax.sharded`
does the same through shard_map.

Every case checks three things that a wrong rule would break:
* the numbers, against the float64 reference on fresh random inputs (and the
  gradients against its analytic backward);
* the compiled HLO: no all-gather / all-to-all / collective-permute when heads (or the
  dense batch) are split, only the all-reduce that sums dk/dv when kv is replicated;
* the result shardings (each shard holds only its heads / batch).
The last tests show the checks are not vacuous: the same ops without the rule gather,
and a partition that gives a shard the wrong kv head is caught by the numbers.

XLA_ATTN_TEST_MESH=gpu runs the same module over the GPUs instead (2 or 4 of them;
the 2 x 2 mesh cases need 4): the multi-GPU run recorded in docs/benchmarks.md.
"""

import os
import re

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xla_attn
from xla_attn import _native, _ops, jax as xj
from xla_attn.testing import reference as ref

PLATFORM = os.environ.get("XLA_ATTN_TEST_MESH", "cpu")
N = 4 if PLATFORM == "cpu" else min(4, len(jax.devices(PLATFORM)))
_COLLECTIVE = re.compile(
    r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")
MOVES = {"all-gather", "all-to-all", "collective-permute"}  # data movement of operands


def collectives(fn, *args) -> set:
    """The collective ops in the compiled (partitioned) HLO of jit-ed fn."""
    return set(_COLLECTIVE.findall(fn.lower(*args).compile().as_text()))


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices(PLATFORM)
    assert len(devices) >= N >= 2, f"expected {N} {PLATFORM} devices (XLA_FLAGS), got {len(devices)}"
    return Mesh(np.array(devices[:N]), ("x",))


@pytest.fixture(scope="module")
def mesh2d():
    if N != 4:
        pytest.skip(f"the 2 x 2 mesh needs 4 devices, this run has {N}")
    return Mesh(np.array(jax.devices(PLATFORM)[:N]).reshape(2, 2), ("b", "h"))


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Both of XLA's partitioners: Shardy (jax's default) reads the sharding_rule,
    GSPMD the infer/partition callbacks."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)


def put(mesh, x, spec):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


def shard_shape(x) -> tuple:
    return tuple(x.addressable_shards[0].data.shape)


# ------------------------------------------------------------------ flash_attn_varlen
HEADS = {"mha": (8, 8), "gqa": (8, 4), "gqa-kv<shards": (8, 2), "mqa": (8, 1)}
KW = dict(causal=True, window_size=(6, -1), softcap=5.0)


def _varlen_case(rng, mk, mesh, h, hk, dtype="float32"):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, [5, 0, 9, 3], [7, 2, 9, 3], h, hk, 32,
                                           pad_q=3)
    slopes = mk.alibi(rng, h)
    kv = P(None, "x") if hk % N == 0 else P()  # kv heads split only where they divide
    args = (put(mesh, q, P(None, "x")), put(mesh, k, kv), put(mesh, v, kv), put(mesh, cu_q, P()),
            put(mesh, cu_k, P()), put(mesh, slopes, P("x")))
    return (q, k, v, cu_q, cu_k, slopes), args


def _varlen(q, k, v, cu_q, cu_k, slopes):
    return xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 9, 9, alibi_slopes=slopes,
                                return_softmax_lse=True, **KW)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_varlen_heads_split(rng, mk, mesh, partitioner, heads):
    h, hk = heads
    (q, k, v, cu_q, cu_k, slopes), args = _varlen_case(rng, mk, mesh, h, hk)
    fn = jax.jit(_varlen)
    out, lse = fn(*args)
    assert shard_shape(out) == (q.shape[0], h // N, 32) and shard_shape(lse) == (h // N, q.shape[0])
    assert collectives(fn, *args) == set()
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, alibi_slopes=slopes, **KW)
    ref.assert_attention_close(np.asarray(out), want, "float32", np.asarray(lse), want_lse,
                               valid_rows=int(cu_q[-1]))

    # a loss on out and on softmax_lse (the padding rows, lse = +inf, left out): lse's
    # cotangent is split over the heads like lse, the backward stays one call a shard
    dout = mk.random_array(rng, q.shape, "float32")
    lse_w = np.where(np.arange(q.shape[0]) < cu_q[-1], rng.standard_normal((h, q.shape[0])),
                     0.0)

    def loss(*a):
        o, lse_ = _varlen(*a)
        return jnp.sum(o * dout) + jnp.sum(jnp.where(lse_w != 0, lse_, 0.0) * lse_w)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads = grad(*args)
    # kv shared by several head shards: its gradient is their sum (an all-reduce)
    assert collectives(grad, *args) == (set() if hk % N == 0 else {"all-reduce"})
    assert shard_shape(grads[0]) == (q.shape[0], h // N, 32)
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, alibi_slopes=slopes,
                                         dlse=lse_w, **KW)
    for g, w in zip(grads, want):
        assert ref.rel_error(g, w) < ref.BOUNDS["float32"]


def test_varlen_bf16_seqused_per_batch_alibi(rng, mk, mesh):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [4, 6, 2], [8, 6, 5], 8, 4, 64)
    seqused = np.array([5, 6, 2], np.int32)
    slopes = mk.alibi(rng, 3, 8)
    f = lambda q, k, v, a, b, s, al: xj.flash_attn_varlen(  # noqa: E731
        q, k, v, a, b, 6, 8, seqused_k=s, alibi_slopes=al, causal=True)
    args = [put(mesh, q, P(None, "x")), put(mesh, k, P(None, "x")), put(mesh, v, P(None, "x")),
            put(mesh, cu_q, P()), put(mesh, cu_k, P()), put(mesh, seqused, P()),
            put(mesh, slopes, P(None, "x"))]
    fn = jax.jit(f)
    assert collectives(fn, *args) == set()
    want, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True,
                                        alibi_slopes=slopes, seqused_k=seqused)
    ref.assert_attention_close(np.asarray(fn(*args)), want, "bfloat16")


def test_varlen_paged_kv_split(rng, mk, mesh):
    lens_q, lens_k = [3, 1, 4], [30, 9, 17]
    kc, vc, table = mk.paged_kv(rng, "float32", lens_k, 8, 4, 32)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    q = mk.random_array(rng, (int(cu_q[-1]), 8, 32), "float32")
    f = lambda q, kc, vc, a, b, t: xj.flash_attn_varlen(  # noqa: E731
        q, kc, vc, a, b, 4, 30, block_table=t, causal=True)
    cache = P(None, None, "x")
    args = [put(mesh, q, P(None, "x")), put(mesh, kc, cache), put(mesh, vc, cache),
            put(mesh, cu_q, P()), put(mesh, cu_k, P()), put(mesh, table, P())]
    fn = jax.jit(f)
    assert collectives(fn, *args) == set()
    want, _ = ref.flash_attn_varlen_ref(q, kc, vc, cu_q, cu_k, None, causal=True,
                                        block_table=table)
    ref.assert_attention_close(np.asarray(fn(*args)), want, "float32")


def test_indivisible_heads_fall_back_to_gathering(rng, mk, mesh):
    """12 query heads over 4 shards give 3 per shard, but 3 kv heads: shards 1 and 2
    would need parts of two kv groups. The op then runs on whole heads (XLA gathers q),
    still right."""
    (q, k, v, cu_q, cu_k, slopes), args = _varlen_case(rng, mk, mesh, 12, 3)
    fn = jax.jit(_varlen)
    assert "all-gather" in collectives(fn, *args)
    want, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, alibi_slopes=slopes, **KW)
    ref.assert_attention_close(np.asarray(fn(*args)[0]), want, "float32",
                               valid_rows=int(cu_q[-1]))


def test_split_tokens_are_gathered(rng, mk, mesh):
    """total_q / total_k must stay whole (sequences cross shard borders): split
    anyway, they are gathered first and the result is right."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 0, 9, 3], [7, 2, 9, 3], 8, 4, 32,
                                           pad_q=3, pad_k=3)
    slopes = mk.alibi(rng, 8)
    args = (put(mesh, q, P("x")), put(mesh, k, P("x")), put(mesh, v, P("x")),
            put(mesh, cu_q, P()), put(mesh, cu_k, P()), put(mesh, slopes, P()))
    fn = jax.jit(_varlen)
    assert "all-gather" in collectives(fn, *args)
    want, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, alibi_slopes=slopes, **KW)
    ref.assert_attention_close(np.asarray(fn(*args)[0]), want, "float32",
                               valid_rows=int(cu_q[-1]))


# ------------------------------------------------------------------ flash_attn (dense)
def dense_close(out, want, lse, want_lse, dtype="float32"):
    """The dense layout through the varlen check: (B, S, H, D) is B*S rows."""
    (b, sq, h, d), flat = want.shape, lambda x: np.asarray(x).reshape(-1, h, d)  # noqa: E731
    varlen_lse = lambda x: np.asarray(x).transpose(1, 0, 2).reshape(h, b * sq)  # noqa: E731
    ref.assert_attention_close(flat(out), flat(want), dtype, varlen_lse(lse), varlen_lse(want_lse))


@pytest.mark.parametrize("split", [("b", "h"), ("b", None), (None, "h")],
                         ids=["batch+heads", "batch", "heads"])
def test_dense_batch_and_heads_split(rng, mk, mesh2d, partitioner, split):
    b_axis, h_axis = split
    q = mk.random_array(rng, (4, 6, 8, 32), "float32")
    k = mk.random_array(rng, (4, 9, 2, 32), "float32")
    v = mk.random_array(rng, (4, 9, 2, 32), "float32")
    slopes = mk.alibi(rng, 4, 8)
    spec = P(b_axis, None, h_axis)
    args = (put(mesh2d, q, spec), put(mesh2d, k, spec), put(mesh2d, v, spec),
            put(mesh2d, slopes, P(b_axis, h_axis)))
    f = lambda q, k, v, s: xj.flash_attn(q, k, v, causal=True, alibi_slopes=s,  # noqa: E731
                                         return_softmax_lse=True)
    fn = jax.jit(f)
    out, lse = fn(*args)
    nb, nh = (2 if b_axis else 1), (2 if h_axis else 1)
    assert shard_shape(out) == (4 // nb, 6, 8 // nh, 32) and shard_shape(lse) == (4 // nb, 8 // nh, 6)
    assert collectives(fn, *args) == set()
    want, want_lse = ref.flash_attn_ref(q, k, v, causal=True, alibi_slopes=slopes)
    dense_close(out, want, lse, want_lse)

    dout = mk.random_array(rng, q.shape, "float32")
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] * dout), argnums=(0, 1, 2)))
    grads = grad(*args)
    assert collectives(grad, *args) == set()
    assert shard_shape(grads[1]) == (4 // nb, 9, 2 // nh, 32)
    want = ref.flash_attn_bwd_ref(dout, q, k, v, causal=True, alibi_slopes=slopes)
    for g, w in zip(grads, want):
        assert ref.rel_error(g, w) < ref.BOUNDS["float32"]


def test_vmap_of_split_heads_stays_split(rng, mk, mesh2d):
    """vmap folds the mapped axis into the heads on each shard, after partitioning:
    mapped axis on one mesh axis, heads on the other, nothing moves."""
    q = mk.random_array(rng, (2, 16, 8, 32), "float32")
    k = mk.random_array(rng, (2, 20, 2, 32), "float32")
    cu_q, cu_k = mk.cu_seqlens([7, 9]), mk.cu_seqlens([9, 11])
    f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cu_q, cu_k, 9, 11, causal=True)  # noqa: E731
    spec = P("b", None, "h")
    args = [put(mesh2d, x, spec) for x in (q, k, k + 1)]
    fn = jax.jit(jax.vmap(f))
    assert collectives(fn, *args) == set()
    got = np.asarray(fn(*args))
    for i in range(2):
        want, _ = ref.flash_attn_varlen_ref(q[i], k[i], k[i] + 1, cu_q, cu_k, None, causal=True)
        ref.assert_attention_close(got[i], want, "float32")


# ------------------------------------------------------------------ paged attention, cache write
@pytest.mark.parametrize("heads", [(8, 4), (8, 2), (8, 1)], ids=["gqa", "gqa-kv<shards", "mqa"])
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_heads_split(rng, mk, mesh, partitioner, heads, cache):
    h, hk = heads
    seq_lens = np.array([37, 5, 60, 9], np.int32)
    kc, vc, tables = mk.paged_kv(rng, cache, seq_lens, 16, hk, 32)
    qsl = mk.cu_seqlens([2, 5, 1, 1])
    query = mk.random_array(rng, (int(qsl[-1]) + 2, h, 32), "bfloat16")
    cs = P(None, None, "x") if hk % N == 0 else P()
    alibi = mk.alibi(rng, h)  # split like the query heads, or replicated and sliced per shard
    args = [put(mesh, query, P(None, "x")), put(mesh, kc, cs), put(mesh, vc, cs),
            put(mesh, seq_lens, P()), put(mesh, tables, P()), put(mesh, qsl, P()),
            put(mesh, np.int32(3), P()), put(mesh, np.float32(0.5), P()),
            put(mesh, np.float32(1.5), P()),
            put(mesh, alibi, P("x") if cache == "bfloat16" else P())]
    fn = jax.jit(lambda q, kc, vc, sl, bt, qs, n, ks, vs, al: xj.paged_attention(
        q, kc, vc, sl, bt, qs, 0.2, sliding_window=40, soft_cap=8.0, num_seqs=n, k_scale=ks,
        v_scale=vs, alibi_slopes=al, max_query_len=5))
    out = fn(*args)
    assert shard_shape(out) == (query.shape[0], h // N, 32)
    assert collectives(fn, *args) == set()
    want = ref.paged_attention_ref(query, kc, vc, seq_lens, tables, qsl, 0.2, sliding_window=40,
                                   soft_cap=8.0, k_scale=0.5, v_scale=1.5, num_seqs=3,
                                   alibi_slopes=alibi)
    ref.assert_attention_close(np.asarray(out), want, "bfloat16", valid_rows=int(qsl[3]))


def _pointers(x) -> list:
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


@pytest.mark.parametrize("fmt", [("bfloat16", "auto"), ("uint8", "fp8_e4m3")], ids=["bf16", "uint8"])
def test_cache_write_per_shard_in_place(rng, mk, mesh, partitioner, fmt):
    """kv heads split: each shard writes its heads into its own cache shard, in place
    under donation (the same buffers come back), with no copy and no collective."""
    storage, kv_cache_dtype = fmt
    key = mk.random_array(rng, (10, 8, 32), "bfloat16", 50.0)
    value = mk.random_array(rng, (10, 8, 32), "bfloat16", 50.0)
    kc = mk.random_bits(rng, (4, 16, 8, 32), storage, finite=True)
    vc = mk.random_bits(rng, (4, 16, 8, 32), storage, finite=True)
    slots = rng.permutation(64)[:10].astype(np.int32)
    slots[[2, 7]] = -1
    cache = P(None, None, "x")
    fn = jax.jit(lambda k, v, kc, vc, s, ks, vs: xj.reshape_and_cache_flash(
        k, v, kc, vc, s, kv_cache_dtype=kv_cache_dtype, k_scale=ks, v_scale=vs),
        donate_argnums=(2, 3))
    # key/value arrive replicated: each shard takes its heads locally (a slice, no collective)
    args = [put(mesh, key, P()), put(mesh, value, P()), put(mesh, kc, cache),
            put(mesh, vc, cache), put(mesh, slots, P()), put(mesh, np.float32(0.3), P()),
            put(mesh, np.float32(2.0), P())]
    text = fn.lower(*args).compile().as_text()
    assert not set(_COLLECTIVE.findall(text))
    assert not re.search(rf"= \S+\[4,16,{8 // N},32\]\{{[^}}]*\}} copy\(", text), \
        "a cache shard is copied"
    pointers = _pointers(args[2]) + _pointers(args[3])
    got_k, got_v = fn(*args)
    assert _pointers(got_k) + _pointers(got_v) == pointers
    assert shard_shape(got_k) == (4, 16, 8 // N, 32)
    want = ref.reshape_and_cache_flash_ref(key, value, kc, vc, slots, kv_cache_dtype, 0.3, 2.0)
    ref.assert_bits_equal(np.asarray(got_k), want[0])
    ref.assert_bits_equal(np.asarray(got_v), want[1])


def test_decode_step_split_over_kv_heads(rng, mk, mesh):
    """Write the new tokens, then attend, in one jit with kv heads split: no collective."""
    heads, heads_k, dim, bs = 8, 4, 32, 16
    kc, vc, tables = mk.paged_kv(rng, "bfloat16", [17, 40, 5], bs, heads_k, dim)
    seq_lens = np.array([17, 40, 5], np.int32)
    slots, new_k, new_v, query, qsl = mk.decode_step_tokens(rng, tables, seq_lens, bs, heads,
                                                            heads_k, dim)

    def step(kc, vc, q, k, v, slots, seq_lens, tables, qsl):
        kc, vc = xla_attn.reshape_and_cache_flash(k, v, kc, vc, slots)
        return kc, vc, xla_attn.paged_attention(q, kc, vc, seq_lens, tables, qsl, 0.2)

    heads_spec, cache = P(None, "x"), P(None, None, "x")
    args = [put(mesh, kc, cache), put(mesh, vc, cache), put(mesh, query, heads_spec),
            put(mesh, new_k, heads_spec), put(mesh, new_v, heads_spec)]
    args += [put(mesh, x, P()) for x in (slots, seq_lens, tables, qsl)]
    fn = jax.jit(step, donate_argnums=(0, 1))
    assert collectives(fn, *args) == set()
    got_k, got_v, out = fn(*args)
    want_k, want_v = ref.reshape_and_cache_flash_ref(new_k, new_v, kc, vc, slots)
    ref.assert_bits_equal(np.asarray(got_k), want_k)
    want = ref.paged_attention_ref(query, want_k, want_v, seq_lens, tables, qsl, 0.2)
    ref.assert_attention_close(np.asarray(out), want, "bfloat16")


# ------------------------------------------------------------------ xla_attn.jax.sharded
@pytest.mark.parametrize("heads", [(8, 4), (8, 2), (8, 1)], ids=["gqa", "gqa-kv<shards", "mqa"])
def test_sharded_helper_varlen_with_grads(rng, mk, mesh, heads):
    h, hk = heads
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 9, 3], [7, 9, 3], h, hk, 32,
                                           pad_q=1)
    f = xj.sharded(xla_attn.flash_attn_varlen, mesh, head_axis="x")
    run = lambda q, k, v: f(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), 9, 9,  # noqa: E731
                            causal=True, softcap=3.0, return_softmax_lse=True)
    out, lse = jax.jit(run)(q, k, v)
    assert shard_shape(out) == (q.shape[0], h // N, 32)
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, softcap=3.0)
    ref.assert_attention_close(np.asarray(out), want, "float32", np.asarray(lse), want_lse,
                               valid_rows=int(cu_q[-1]))
    dout = mk.random_array(rng, q.shape, "float32")
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a)[0] * dout), argnums=(0, 1, 2)))(q, k, v)
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, True, (-1, -1), 3.0)
    for g, w in zip(grads, want):
        assert ref.rel_error(g, w) < ref.BOUNDS["float32"]


def test_sharded_helper_dense_paged_and_cache(rng, mk, mesh, mesh2d):
    q = mk.random_array(rng, (4, 6, 8, 32), "float32")
    k = mk.random_array(rng, (4, 9, 2, 32), "float32")
    dense = xj.sharded(xj.flash_attn, mesh2d, head_axis="h", batch_axis="b")
    out, lse = jax.jit(lambda q, k: dense(q, k, k, causal=True, return_softmax_lse=True))(q, k)
    assert shard_shape(out) == (2, 6, 4, 32)
    want, want_lse = ref.flash_attn_ref(q, k, k, causal=True)
    dense_close(out, want, lse, want_lse)

    kc, vc, tables = mk.paged_kv(rng, "float32", [20, 3], 8, 4, 32)
    seq_lens, qsl = np.array([20, 3], np.int32), mk.cu_seqlens([1, 1])
    query = mk.random_array(rng, (2, 8, 32), "float32")
    paged = xj.sharded(xj.paged_attention, mesh, head_axis="x")
    alibi = mk.alibi(rng, 8)
    out = jax.jit(lambda *a: paged(*a, 0.3, alibi_slopes=alibi, max_query_len=1))(
        query, kc, vc, seq_lens, tables, qsl)
    ref.assert_attention_close(np.asarray(out), ref.paged_attention_ref(
        query, kc, vc, seq_lens, tables, qsl, 0.3, alibi_slopes=alibi), "float32")

    write = jax.jit(xj.sharded(xj.reshape_and_cache_flash, mesh, head_axis="x"),
                    donate_argnums=(2, 3))
    key = mk.random_array(rng, (2, 4, 32), "float32")
    slots = np.array([5, 40], np.int32)
    got = write(key, key, put(mesh, kc, P(None, None, "x")), put(mesh, vc, P(None, None, "x")),
                slots)
    want = ref.reshape_and_cache_flash_ref(key, key, kc, vc, slots)
    for g, w in zip(got, want):
        assert shard_shape(g) == (kc.shape[0], 8, 4 // N, 32)
        ref.assert_bits_equal(np.asarray(g), w)


def test_sharded_helper_rejects_what_cannot_split(rng, mk, mesh):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [3], [3], 12, 3, 32)
    with pytest.raises(ValueError, match=f"num_heads=12, num_heads_k=3 over {N} shards"):
        xj.sharded(xj.flash_attn_varlen, mesh, head_axis="x")(q, k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="batch_axis"):
        xj.sharded(xj.paged_attention, mesh, batch_axis="x")
    with pytest.raises(TypeError, match="op must be one of"):
        xj.sharded(jnp.add, mesh, head_axis="x")


def test_sharded_helper_exports(rng, mk, mesh):
    """jax.export cannot serialize custom_partitioning; a shard_map program can be."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 9], [7, 9], 8, 4, 32)
    f = xj.sharded(xj.flash_attn_varlen, mesh, head_axis="x")
    fn = jax.jit(lambda q, k, v, a, b: f(q, k, v, a, b, 9, 9, causal=True))
    heads = P(None, "x")
    args = [put(mesh, q, heads), put(mesh, k, heads), put(mesh, v, heads), put(mesh, cu_q, P()),
            put(mesh, cu_k, P())]
    exported = export.export(fn, disabled_checks=[
        export.DisabledSafetyCheck.custom_call(t) for t in _native.HANDLERS])(*args)
    again = export.deserialize(exported.serialize())
    ref.assert_bits_equal(np.asarray(again.call(*args)), np.asarray(fn(*args)))


# ------------------------------------------------------------------ the checks can fail
def test_without_the_rule_xla_gathers(rng, mk, mesh):
    """The bare custom call (what the ops were before partitioning rules) on the same
    sharded inputs: XLA cannot split it, so it gathers q, k and v onto every device.
    This is what the collective checks above would see from a missing or ignored rule."""
    (q, k, v, cu_q, cu_k, _), args = _varlen_case(rng, mk, mesh, 8, 4)
    spec = _ops.flash_varlen_spec(q, k, v, cu_q, cu_k, 9, 9, None, True, (6, -1), 5.0, None, None,
                                  None, None, None, None)
    bare = jax.jit(lambda q, k, v, a, b: xj._flash_fwd_impl(spec, q, k, v, a, b))
    assert MOVES & collectives(bare, *args[:5])


def test_a_wrong_kv_head_is_caught(rng, mk, mesh, monkeypatch):
    """A partition that hands every shard kv head 0 (a plausible bug in the "slice"
    mode of GQA with fewer kv heads than shards) moves no data and compiles fine; only
    the comparison with the reference catches it."""
    if N < 4:  # 2 kv heads over 2 shards are split, so kv head 0 of each shard is right
        pytest.skip("needs more shards than kv heads, and more than one kv head: 4 shards")
    (q, k, v, cu_q, cu_k, slopes), args = _varlen_case(rng, mk, mesh, 8, 2)
    monkeypatch.setattr(xj, "_kv_head", lambda plan, mesh, heads_k: jnp.int32(0))
    out = np.asarray(jax.jit(lambda *a: _varlen(*a))(*args)[0])  # a fresh trace
    want, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, alibi_slopes=slopes, **KW)
    assert ref.rel_error(out, want) > 0.1
