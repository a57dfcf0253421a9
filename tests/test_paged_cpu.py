"""paged_attention on the Host platform against the float64 reference: decode and
prefill chunks, GQA/MQA, block sizes 16 and 32, num_seqs below the padded row count,
sliding window, soft cap, ALiBi, fp8 caches with scales, empty sequences, head dims, jit,
the max_query_len hint, and the v1 target old serialized programs call."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

DTYPES = ["float32", "float16", "bfloat16"]


def make_case(rng, mk, dtype, seq_lens, lens_q, block_size, heads=4, heads_k=2, head_dim=32,
              pad_rows=2, cache_dtype=None):
    """query (sum(lens_q) + pad_rows, H, D), paged caches, tables, query_start_loc."""
    kc, vc, tables = mk.paged_kv(rng, cache_dtype or dtype, seq_lens, block_size, heads_k,
                                 head_dim)
    qsl = mk.cu_seqlens(lens_q)
    query = mk.random_array(rng, (int(qsl[-1]) + pad_rows, heads, head_dim), dtype)
    return dict(query=query, key_cache=kc, value_cache=vc,
                seq_lens=np.asarray(seq_lens, np.int32), block_tables=tables, query_start_loc=qsl)


def run(case, fn=None, **kw):
    fn = fn or xla_attn.paged_attention
    args = {n: jnp.asarray(x) for n, x in case.items()}
    extra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    out = fn(**args, **extra)
    assert out.shape == case["query"].shape and out.dtype == case["query"].dtype
    return np.asarray(out)


def check(case, dtype, scale=0.17, **kw):
    out = run(case, scale=scale, **kw)
    kw.pop("max_query_len", None)  # a launch hint: no part of the meaning
    want = ref.paged_attention_ref(**case, scale=scale, **kw)
    n = len(case["seq_lens"]) if kw.get("num_seqs") is None else int(np.ravel(kw["num_seqs"])[0])
    ref.assert_attention_close(out, want, dtype, valid_rows=int(case["query_start_loc"][n]))
    return out, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(rng, mk, dtype, heads, block_size):
    case = make_case(rng, mk, dtype, [37, 1, 16, 70], [1, 1, 1, 1], block_size, *heads,
                     head_dim=64)
    check(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunks(rng, mk, dtype, block_size):
    """Several query tokens per sequence, the last at key position L - 1 (causal)."""
    case = make_case(rng, mk, dtype, [37, 3, 16, 70, 5], [5, 1, 16, 3, 5], block_size)
    check(case, dtype)


@pytest.mark.parametrize("num_seqs_shape", [(), (1,)])
def test_num_seqs_below_rows(rng, mk, num_seqs_shape):
    """Only the first num_seqs rows of the padded batch are real: the rest (which
    hold plausible lengths) produce nothing, and their query rows are 0."""
    case = make_case(rng, mk, "bfloat16", [20, 9, 33, 12, 5], [2, 1, 3, 1, 2], 16)
    num_seqs = np.full(num_seqs_shape, 2, np.int32)
    out, _ = check(case, "bfloat16", num_seqs=num_seqs)
    assert np.all(out[3:].astype(np.float64) == 0)
    full = run(case, scale=0.17)
    np.testing.assert_array_equal(out[:3], full[:3])
    assert np.abs(full[3:9].astype(np.float64)).sum() > 0


def test_num_seqs_all_and_zero(rng, mk):
    case = make_case(rng, mk, "float32", [20, 9], [2, 1], 16)
    check(case, "float32", num_seqs=np.array(2, np.int32))
    out = run(case, scale=0.17, num_seqs=np.array([0], np.int32))
    assert np.all(out == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 17, 1000])
def test_sliding_window(rng, mk, dtype, window):
    case = make_case(rng, mk, dtype, [40, 7, 64], [3, 7, 1], 16)
    check(case, dtype, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft_cap", [0.8, 20.0])
def test_soft_cap(rng, mk, dtype, soft_cap):
    case = make_case(rng, mk, dtype, [40, 7, 64], [3, 2, 1], 32)
    case["query"] = (case["query"].astype(np.float32) * 4).astype(case["query"].dtype)
    check(case, dtype, soft_cap=soft_cap)


def test_window_and_soft_cap(rng, mk):
    case = make_case(rng, mk, "float32", [50, 7, 64], [4, 2, 1], 16, 8, 2)
    check(case, "float32", sliding_window=9, soft_cap=2.5)


FP8 = [("float8_e4m3fn", "auto"), ("float8_e5m2", "auto"), ("uint8", "fp8_e4m3"),
       ("uint8", "fp8_e5m2"), ("uint8", "fp8")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8, ids=[f"{c}-{k}" for c, k in FP8])
def test_fp8_cache(rng, mk, dtype, fmt):
    """fp8 caches hold value / scale; attention reads value * k_scale (v_scale)."""
    storage, kv_cache_dtype = fmt
    name = storage if storage != "uint8" else ref.KV_CACHE_FORMATS[kv_cache_dtype]
    case = make_case(rng, mk, dtype, [37, 5, 60], [2, 5, 1], 16, cache_dtype=name)
    kw = dict(k_scale=mk.f32(0.37), v_scale=mk.f32([2.5]))
    if storage == "uint8":
        case["key_cache"] = case["key_cache"].view(np.uint8)
        case["value_cache"] = case["value_cache"].view(np.uint8)
        kw["kv_cache_dtype"] = kv_cache_dtype
    check(case, dtype, **kw)


def test_fp8_cache_default_scales(rng, mk):
    case = make_case(rng, mk, "bfloat16", [30, 4], [1, 2], 16, cache_dtype="float8_e4m3fn")
    check(case, "bfloat16")  # no scales: 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_scales_ignored_for_float_cache(rng, mk, dtype):
    case = make_case(rng, mk, dtype, [30, 4], [1, 2], 16)
    scaled = run(case, scale=0.2, k_scale=mk.f32(3.0), v_scale=mk.f32(0.1))
    plain = run(case, scale=0.2)
    np.testing.assert_array_equal(scaled, plain)
    ref.assert_attention_close(plain, ref.paged_attention_ref(**case, scale=0.2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_sequences(rng, mk, dtype):
    """Sequences with no query tokens (and with no keys at all) are legal."""
    case = make_case(rng, mk, dtype, [0, 20, 0, 33, 1], [0, 2, 0, 0, 1], 16)
    check(case, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_head_dims(rng, mk, dtype, head_dim):
    case = make_case(rng, mk, dtype, [19, 40], [1, 3], 16, 4, 2, head_dim)
    check(case, dtype, scale=head_dim ** -0.5)


def test_odd_lengths_exact_block_multiples(rng, mk):
    case = make_case(rng, mk, "float32", [1, 15, 16, 17, 31, 32, 33], [1, 2, 1, 3, 1, 1, 2], 16)
    check(case, "float32")


def test_block_table_tail_is_never_read(rng, mk):
    """Entries past a sequence's last block are unused: garbage there changes nothing."""
    case = make_case(rng, mk, "float32", [17, 3], [1, 2], 16)
    good = run(case, scale=0.3)
    tables = case["block_tables"].copy()
    tables[0, 2:] = -1
    tables[1, 1:] = 2 ** 30
    bad = run(dict(case, block_tables=tables), scale=0.3)
    np.testing.assert_array_equal(good, bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_jit(rng, mk, dtype):
    case = make_case(rng, mk, dtype, [37, 5, 60, 9], [2, 5, 1, 1], 16)
    fn = jax.jit(functools.partial(xj.paged_attention, scale=0.21, sliding_window=30,
                                   soft_cap=10.0))
    args = {n: jnp.asarray(x) for n, x in case.items()}
    for n in (4, 3):  # num_seqs is device data: one program
        out = fn(**args, num_seqs=jnp.asarray(n, jnp.int32))
        want = ref.paged_attention_ref(**case, scale=0.21, sliding_window=30, soft_cap=10.0,
                                       num_seqs=n)
        ref.assert_attention_close(np.asarray(out), want, dtype,
                                   valid_rows=int(case["query_start_loc"][n]))


def test_matches_paged_flash_attn_varlen(rng, mk):
    """Two entry points, one meaning: paged_attention is causal flash attention
    over the block table."""
    case = make_case(rng, mk, "float32", [37, 5, 60], [2, 5, 1], 16, pad_rows=0)
    out = run(case, scale=0.25)
    flash = xla_attn.flash_attn_varlen(
        jnp.asarray(case["query"]), jnp.asarray(case["key_cache"]),
        jnp.asarray(case["value_cache"]), jnp.asarray(case["query_start_loc"]),
        jnp.asarray(mk.cu_seqlens(case["seq_lens"])), 5, 60, softmax_scale=0.25, causal=True,
        block_table=jnp.asarray(case["block_tables"]))
    assert ref.rel_error(out, np.asarray(flash)) < 1e-5


# ------------------------------------------------------------------ ALiBi, max_query_len
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [{}, dict(sliding_window=9), dict(soft_cap=2.5),
                                   dict(sliding_window=6, soft_cap=20.0)],
                         ids=["alibi", "alibi_window", "alibi_softcap", "alibi_window_softcap"])
def test_alibi(rng, mk, dtype, extra):
    """Per-head slopes subtract slope * (pos - j): decode and prefill spans, GQA, with a
    window and a soft cap (the cap applies before the bias, as in flash attention)."""
    case = make_case(rng, mk, dtype, [50, 7, 64, 1, 20], [4, 2, 1, 1, 9], 16, 8, 2)
    out, _ = check(case, dtype, alibi_slopes=mk.alibi(rng, 8), **extra)
    plain = run(case, scale=0.17, **extra)
    assert ref.rel_error(out, plain) > 0.05  # the slopes matter at these distances


def test_alibi_fp8_cache_and_padded_batch(rng, mk):
    case = make_case(rng, mk, "bfloat16", [37, 5, 60, 9], [2, 5, 1, 3], 16,
                     cache_dtype="float8_e4m3fn")
    check(case, "bfloat16", alibi_slopes=mk.alibi(rng, 4), k_scale=mk.f32(0.37),
          v_scale=mk.f32(2.5), num_seqs=np.array(3, np.int32), max_query_len=5)


@pytest.mark.parametrize("max_query_len", [5, 6, 1000])
def test_max_query_len_changes_nothing(rng, mk, max_query_len):
    """A right bound (the largest span is 5) gives the very bits of no bound."""
    case = make_case(rng, mk, "bfloat16", [37, 5, 60, 9], [2, 5, 1, 3], 16)
    plain = run(case, scale=0.2)
    hinted = run(case, scale=0.2, max_query_len=max_query_len)
    np.testing.assert_array_equal(hinted, plain)
    decode = make_case(rng, mk, "bfloat16", [37, 5, 60], [1, 1, 1], 16)
    np.testing.assert_array_equal(run(decode, scale=0.2, max_query_len=1),
                                  run(decode, scale=0.2))


def test_max_query_len_below_a_span_is_an_error(rng, mk):
    """The Host reads query_start_loc, so a broken promise is an error naming the hint
    (on a GPU those rows would be NaN); padding sequences past num_seqs do not count."""
    case = make_case(rng, mk, "float32", [37, 5, 60, 9], [2, 5, 1, 7], 16)
    with pytest.raises(Exception, match=r"paged_attention: sequence 1 has 5 queries "
                                        r"\(query_start_loc\), more than max_query_len = 4"):
        jax.block_until_ready(run(case, scale=0.2, max_query_len=4,
                                  num_seqs=np.array(3, np.int32)))
    check(case, "float32", scale=0.2, max_query_len=5, num_seqs=np.array(3, np.int32))
    fn = jax.jit(functools.partial(xj.paged_attention, scale=0.2, max_query_len=1))
    with pytest.raises(Exception, match="more than max_query_len = 1"):
        jax.block_until_ready(fn(**{n: jnp.asarray(x) for n, x in case.items()}))


@pytest.mark.parametrize("override,error,message", [
    (dict(alibi_slopes=np.ones((2, 4), np.float32)), ValueError,
     "paged_attention: alibi_slopes must have shape (num_heads,) = (4,), got (2, 4)"),
    (dict(alibi_slopes=np.ones((4,), np.float16)), TypeError,
     "paged_attention: alibi_slopes must be float32, got float16"),
    (dict(alibi_slopes=[0.5] * 4), TypeError,
     "paged_attention: alibi_slopes must be a float32 array of shape (num_heads,), got list"),
    (dict(max_query_len=0), ValueError, "paged_attention: max_query_len must be >= 1, got 0"),
    (dict(max_query_len=True), TypeError,
     "paged_attention: max_query_len must be an int, got bool"),
    (dict(max_query_len=2**31), ValueError,
     "paged_attention: max_query_len must be < 2**31, got 2147483648"),
], ids=["alibi_shape", "alibi_dtype", "alibi_list", "max_query_len_0", "max_query_len_bool",
        "max_query_len_huge"])
def test_bad_alibi_and_max_query_len(rng, mk, override, error, message):
    case = make_case(rng, mk, "float32", [20, 9], [2, 1], 16)
    with pytest.raises(error) as info:
        run(case, scale=0.2, **override)
    assert str(info.value) == message


def _raw(target, case, results, *extra_operands, **attributes):
    """The custom call `target` on case's arrays, as a serialized program would emit it."""
    xj._register()
    absent_i, absent_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    return call(*(jnp.asarray(case[n]) for n in ("query", "key_cache", "value_cache",
                                                 "seq_lens", "block_tables",
                                                 "query_start_loc")),
                absent_i, absent_f, absent_f, *extra_operands, **attributes)


def test_v1_target_still_runs(rng, mk):
    """Programs serialized before v2 call xla_attn_paged_attention_v1 (no alibi_slopes
    operand, no max_query_len attribute): same results as the frontend's v2 call."""
    case = make_case(rng, mk, "bfloat16", [37, 5, 60, 9], [2, 5, 1, 3], 16)
    results = (jax.ShapeDtypeStruct(case["query"].shape, jnp.bfloat16),
               jax.ShapeDtypeStruct((0,), jnp.uint8))
    attrs = dict(scale=np.float32(0.2), soft_cap=np.float32(3.0), sliding_window=20,
                 kv_cache_dtype="auto")
    out, _ = jax.jit(lambda: _raw("xla_attn_paged_attention_v1", case, results, **attrs))()
    np.testing.assert_array_equal(np.asarray(out),
                                  run(case, scale=0.2, soft_cap=3.0, sliding_window=20))
    assert "xla_attn_paged_attention_v2" in jax.jit(
        lambda: xla_attn.paged_attention(**case, scale=0.2)).lower().as_text()


def test_v2_target_checks_what_python_cannot_see(rng, mk):
    """A raw v2 call (as another frontend could emit) with bad ALiBi or a hint past
    int32 is refused by the handler with a message."""
    case = make_case(rng, mk, "float32", [20, 9], [2, 1], 16)
    results = (jax.ShapeDtypeStruct(case["query"].shape, jnp.float32),
               jax.ShapeDtypeStruct((0,), jnp.uint8))
    attrs = dict(scale=np.float32(0.2), soft_cap=np.float32(0), sliding_window=0,
                 kv_cache_dtype="auto")
    with pytest.raises(Exception, match=r"xla_attn_paged_attention_v2: alibi_slopes must be "
                                        r"float32 \[num_heads\]"):
        jax.block_until_ready(_raw("xla_attn_paged_attention_v2", case, results,
                                   jnp.ones((3,), jnp.float32), max_query_len=0, **attrs))
    with pytest.raises(Exception, match="alibi_slopes must be float32"):
        jax.block_until_ready(_raw("xla_attn_paged_attention_v2", case, results,
                                   jnp.ones((4,), jnp.int32), max_query_len=0, **attrs))
    with pytest.raises(Exception, match="max_query_len must fit in int32"):
        jax.block_until_ready(_raw("xla_attn_paged_attention_v2", case, results,
                                   jnp.zeros((0,), jnp.float32), max_query_len=2**40, **attrs))
    slopes = mk.alibi(rng, 4)
    out, _ = _raw("xla_attn_paged_attention_v2", case, results, jnp.asarray(slopes),
                  max_query_len=-1, **attrs)
    ref.assert_attention_close(np.asarray(out), ref.paged_attention_ref(
        **case, scale=0.2, alibi_slopes=slopes), "float32", valid_rows=3)
