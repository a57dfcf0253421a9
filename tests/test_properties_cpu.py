"""Property-based cases (hypothesis): random small configurations of every op on the
Host platform agree with the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings, strategies as st

import xla_attn
from xla_attn.testing import reference as ref

SETTINGS = dict(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow],
                print_blob=True)

head_configs = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1), (3, 3), (6, 2)])
windows = st.tuples(st.integers(-1, 5), st.integers(-1, 5))
dtypes = st.sampled_from(["float32", "bfloat16", "float16"])


@st.composite
def varlen_configs(draw, paged=False):
    batch = draw(st.integers(1, 3))
    lens_q = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(0, 40 if paged else 12), min_size=batch, max_size=batch))
    heads, heads_k = draw(head_configs)
    cfg = dict(
        lens_q=lens_q, lens_k=lens_k, heads=heads, heads_k=heads_k,
        head_dim=draw(st.sampled_from([8, 16, 32, 24, 64])),
        pad_q=draw(st.integers(0, 3)), dtype=draw(dtypes), causal=draw(st.booleans()),
        window=draw(windows), softcap=draw(st.sampled_from([0.0, 0.5, 6.0])),
        alibi=draw(st.sampled_from([None, "h", "bh"])),
        scale=draw(st.sampled_from([None, 0.05, 0.4])), seed=draw(st.integers(0, 2 ** 32 - 1)))
    if paged:
        cfg["block_size"] = draw(st.sampled_from([16, 32]))
        cfg["used"] = draw(st.booleans())
    return cfg


def _kwargs(cfg, rng, mk):
    kw = dict(causal=cfg["causal"], window_size=cfg["window"], softcap=cfg["softcap"])
    if cfg["alibi"] == "h":
        kw["alibi_slopes"] = mk.alibi(rng, cfg["heads"])
    elif cfg["alibi"] == "bh":
        kw["alibi_slopes"] = mk.alibi(rng, len(cfg["lens_q"]), cfg["heads"])
    return kw


def _jax(kw):
    return {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


@settings(**SETTINGS)
@given(cfg=varlen_configs())
def test_flash_varlen_property(mk, cfg):
    rng = np.random.default_rng(cfg["seed"])
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, cfg["dtype"], cfg["lens_q"], cfg["lens_k"],
                                           cfg["heads"], cfg["heads_k"], cfg["head_dim"],
                                           pad_q=cfg["pad_q"])
    kw = _kwargs(cfg, rng, mk)
    out, lse = xla_attn.flash_attn_varlen(
        *map(jnp.asarray, (q, k, v, cu_q, cu_k)), max(cfg["lens_q"]), max(cfg["lens_k"]),
        softmax_scale=cfg["scale"], return_softmax_lse=True, **_jax(kw))
    want, want_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, cfg["scale"], **kw)
    ref.assert_attention_close(np.asarray(out), want, cfg["dtype"], np.asarray(lse), want_lse,
                               valid_rows=int(cu_q[-1]))


@settings(**SETTINGS)
@given(cfg=varlen_configs(paged=True))
def test_flash_varlen_paged_property(mk, cfg):
    rng = np.random.default_rng(cfg["seed"])
    kc, vc, table = mk.paged_kv(rng, cfg["dtype"], cfg["lens_k"], cfg["block_size"],
                                cfg["heads_k"], cfg["head_dim"])
    cu_q, cu_k = mk.cu_seqlens(cfg["lens_q"]), mk.cu_seqlens(cfg["lens_k"])
    q = mk.random_array(rng, (int(cu_q[-1]) + cfg["pad_q"], cfg["heads"], cfg["head_dim"]),
                        cfg["dtype"])
    kw = _kwargs(cfg, rng, mk)
    kw["block_table"] = table
    if cfg["used"]:
        kw["seqused_k"] = np.array([rng.integers(0, n + 1) for n in cfg["lens_k"]], np.int32)
    out, lse = xla_attn.flash_attn_varlen(
        *map(jnp.asarray, (q, kc, vc, cu_q, cu_k)), max(cfg["lens_q"]), max(cfg["lens_k"]),
        softmax_scale=cfg["scale"], return_softmax_lse=True, **_jax(kw))
    want, want_lse = ref.flash_attn_varlen_ref(q, kc, vc, cu_q, cu_k, cfg["scale"], **kw)
    ref.assert_attention_close(np.asarray(out), want, cfg["dtype"], np.asarray(lse), want_lse,
                               valid_rows=int(cu_q[-1]))


# The example: one query row over two keys in bf16, where dS = P (dP - D) cancels and
# D = dO . O from the bf16 output moved dq by 1.25 % against a reference taking D in
# float64 (the reference now takes it from the rounded output, as the backward does).
# with_lse: the loss weighs softmax_lse too (its rows without a key, lse = +inf, left out).
@settings(**(SETTINGS | dict(max_examples=15)))
@given(cfg=varlen_configs(), with_lse=st.booleans())
@example(cfg=dict(lens_q=[1, 0], lens_k=[10, 0], heads=1, heads_k=1, head_dim=16, pad_q=0,
                  dtype="bfloat16", causal=False, window=(1, 0), softcap=0.0, alibi=None,
                  scale=None, seed=0), with_lse=False)
def test_flash_varlen_grad_property(mk, cfg, with_lse):
    if cfg["dtype"] == "float16":
        cfg = cfg | dict(dtype="float32")
    rng = np.random.default_rng(cfg["seed"])
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, cfg["dtype"], cfg["lens_q"], cfg["lens_k"],
                                           cfg["heads"], cfg["heads_k"], cfg["head_dim"],
                                           pad_q=cfg["pad_q"])
    dout = mk.random_array(rng, q.shape, cfg["dtype"])
    kw = _kwargs(cfg, rng, mk)
    jd = jnp.asarray(dout).astype(jnp.float32)
    jcu_q, jcu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    dlse = None
    if with_lse:
        lse_ref = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, cfg["scale"], **kw)[1]
        dlse = np.where(np.isfinite(lse_ref), rng.standard_normal(lse_ref.shape), 0.0)
    jw = jnp.asarray(0.0 if dlse is None else dlse, jnp.float32)

    def loss(a, b, c):
        out, lse = xla_attn.flash_attn_varlen(a, b, c, jcu_q, jcu_k, max(cfg["lens_q"]),
                                              max(cfg["lens_k"]), softmax_scale=cfg["scale"],
                                              return_softmax_lse=True, **_jax(kw))
        total = jnp.sum(out.astype(jnp.float32) * jd)
        return total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jw) if with_lse else total

    got = jax.grad(loss, argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, cfg["scale"],
                                         out_dtype=mk.np_dtype(cfg["dtype"]), dlse=dlse, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = ref.rel_error(np.asarray(g), w)
        assert err < ref.GRAD_BOUNDS[cfg["dtype"]], f"{name}: {err:.3g}"
    assert np.all(np.asarray(got[0])[int(cu_q[-1]):].astype(np.float64) == 0)


@st.composite
def paged_configs(draw):
    n = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    lens_q = [draw(st.integers(0, min(L, 4))) for L in seq_lens]
    heads, heads_k = draw(head_configs)
    cache = draw(st.sampled_from(["same", "float8_e4m3fn", "float8_e5m2"]))
    return dict(seq_lens=seq_lens, lens_q=lens_q, heads=heads, heads_k=heads_k,
                head_dim=draw(st.sampled_from([16, 32, 64])), dtype=draw(dtypes), cache=cache,
                block_size=draw(st.sampled_from([16, 32])),
                num_seqs=draw(st.one_of(st.none(), st.integers(0, n))),
                window=draw(st.one_of(st.none(), st.integers(1, 20))),
                soft_cap=draw(st.one_of(st.none(), st.sampled_from([1.0, 10.0]))),
                alibi=draw(st.booleans()), hint=draw(st.booleans()),
                pad=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2 ** 32 - 1)))


@settings(**SETTINGS)
@given(cfg=paged_configs())
def test_paged_attention_property(mk, cfg):
    rng = np.random.default_rng(cfg["seed"])
    cache_dtype = cfg["dtype"] if cfg["cache"] == "same" else cfg["cache"]
    kc, vc, tables = mk.paged_kv(rng, cache_dtype, cfg["seq_lens"], cfg["block_size"],
                                 cfg["heads_k"], cfg["head_dim"])
    qsl = mk.cu_seqlens(cfg["lens_q"])
    query = mk.random_array(rng, (int(qsl[-1]) + cfg["pad"], cfg["heads"], cfg["head_dim"]),
                            cfg["dtype"])
    lens = np.array(cfg["seq_lens"], np.int32)
    kw = dict(sliding_window=cfg["window"], soft_cap=cfg["soft_cap"])
    if cfg["cache"] != "same":
        kw |= dict(k_scale=np.float32(rng.uniform(0.2, 2)), v_scale=np.float32(rng.uniform(0.2, 2)))
    if cfg["num_seqs"] is not None:
        kw["num_seqs"] = np.array(cfg["num_seqs"], np.int32)
    if cfg["alibi"]:
        kw["alibi_slopes"] = mk.alibi(rng, cfg["heads"])
    hint = dict(max_query_len=max(cfg["lens_q"]) or 1) if cfg["hint"] else {}
    out = xla_attn.paged_attention(*map(jnp.asarray, (query, kc, vc, lens, tables, qsl)), 0.3,
                                   **{n: (jnp.asarray(x) if isinstance(x, np.ndarray | np.float32)
                                          else x) for n, x in kw.items()}, **hint)
    want = ref.paged_attention_ref(query, kc, vc, lens, tables, qsl, 0.3, **kw)
    n = len(lens) if cfg["num_seqs"] is None else cfg["num_seqs"]
    ref.assert_attention_close(np.asarray(out), want, cfg["dtype"], valid_rows=int(qsl[n]))


@st.composite
def cache_configs(draw):
    num_blocks, block_size = draw(st.integers(1, 4)), draw(st.sampled_from([16, 32]))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(num_slots, 20)))
    slots = draw(st.lists(st.one_of(st.integers(0, num_slots - 1), st.just(-1),
                                    st.integers(num_slots, num_slots + 100),
                                    st.integers(-100, -2)),
                          min_size=num_tokens, max_size=num_tokens))
    seen, unique = set(), []
    for s in slots:  # a slot written twice in one call has no defined winner: keep one
        unique.append(-1 if 0 <= s < num_slots and s in seen else s)
        seen.add(s)
    fmt = draw(st.sampled_from([(None, "auto"), ("float8_e4m3fn", "fp8"),
                                ("float8_e5m2", "fp8_e5m2"), ("uint8", "fp8_e4m3"),
                                ("uint8", "fp8_e5m2")]))
    return dict(num_blocks=num_blocks, block_size=block_size, slots=unique, fmt=fmt,
                src=draw(dtypes), heads_k=draw(st.integers(1, 4)),
                head_dim=draw(st.sampled_from([8, 32, 64, 128])),
                k_scale=draw(st.floats(0.0625, 64.0, width=32)),
                v_scale=draw(st.floats(0.0625, 64.0, width=32)),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


@settings(**SETTINGS)
@given(cfg=cache_configs())
def test_reshape_and_cache_flash_property(mk, cfg):
    rng = np.random.default_rng(cfg["seed"])
    storage, kv_cache_dtype = cfg["fmt"]
    shape = (len(cfg["slots"]), cfg["heads_k"], cfg["head_dim"])
    key = mk.random_array(rng, shape, cfg["src"], 200.0)
    value = mk.random_array(rng, shape, cfg["src"], 200.0)
    cshape = (cfg["num_blocks"], cfg["block_size"], cfg["heads_k"], cfg["head_dim"])
    kc = mk.random_bits(rng, cshape, storage or cfg["src"])
    vc = mk.random_bits(rng, cshape, storage or cfg["src"])
    slots = np.array(cfg["slots"], np.int32)
    ks, vs = np.float32(cfg["k_scale"]), np.float32(cfg["v_scale"])
    got = xla_attn.reshape_and_cache_flash(
        *map(jnp.asarray, (key, value, kc, vc, slots)), kv_cache_dtype=kv_cache_dtype,
        k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    want = ref.reshape_and_cache_flash_ref(key, value, kc, vc, slots, kv_cache_dtype, ks, vs)
    for g, w in zip(got, want):
        ref.assert_bits_equal(np.asarray(g), w)
