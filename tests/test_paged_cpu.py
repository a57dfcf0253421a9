"""paged_attention on the Host platform against the float64 reference: decode and
prefill chunks, GQA/MQA, block sizes 16 and 32, num_seqs below the padded row count,
sliding window, soft cap, fp8 caches with scales, empty sequences, head dims, jit."""

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
