"""Bad input gives a clear error naming the argument and what was expected, and the
process keeps working afterwards."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
import xla_attn.jax
from xla_attn import _native


def _valid(rng):
    q = jnp.asarray(rng.standard_normal((10, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((12, 2, 32)), jnp.float32)
    cu_q = jnp.array([0, 4, 10], jnp.int32)
    cu_k = jnp.array([0, 5, 12], jnp.int32)
    return dict(q=q, k=k, v=k + 1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                max_seqlen_k=7)


def _cache(rng, dtype=jnp.bfloat16, cache_dtype=None):
    key = jnp.asarray(rng.standard_normal((3, 2, 32)), dtype)
    cache = jnp.asarray(rng.standard_normal((4, 16, 2, 32)), cache_dtype or dtype)
    return dict(key=key, value=key, key_cache=cache, value_cache=cache,
                slot_mapping=jnp.array([1, -1, 5], jnp.int32))


def _paged(rng):
    return dict(query=jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.bfloat16),
                key_cache=jnp.asarray(rng.standard_normal((4, 16, 2, 32)), jnp.bfloat16),
                value_cache=jnp.asarray(rng.standard_normal((4, 16, 2, 32)), jnp.bfloat16),
                seq_lens=jnp.array([5, 20], jnp.int32),
                block_tables=jnp.array([[0, 1], [2, 3]], jnp.int32),
                query_start_loc=jnp.array([0, 1, 3], jnp.int32), scale=0.2)


FLASH_CASES = [
    ("q rank", dict(q=jnp.zeros((10, 4), jnp.float32)), ValueError,
     "flash_attn_varlen: q must have shape (total_q, num_heads, head_dim), got shape (10, 4)"),
    ("v shape", dict(v=jnp.ones((11, 2, 32), jnp.float32)), ValueError,
     "flash_attn_varlen: v must have k's shape (12, 2, 32), got (11, 2, 32)"),
    ("q dtype", dict(q=jnp.ones((10, 4, 32), jnp.int32)), TypeError,
     "flash_attn_varlen: q must be float16, bfloat16, float32 or float8_e4m3fn, got int32"),
    ("kv dtype", dict(k=jnp.ones((12, 2, 32), jnp.float16)), TypeError,
     "flash_attn_varlen: k and v must have q's dtype float32, got float16 and float32"),
    ("head_dim", dict(q=jnp.ones((10, 4, 512)), k=jnp.ones((12, 2, 512)), v=jnp.ones((12, 2, 512))),
     ValueError, "flash_attn_varlen: head_dim must be between 1 and 256, got 512"),
    ("head_dim mismatch", dict(k=jnp.ones((12, 2, 16)), v=jnp.ones((12, 2, 16))), ValueError,
     "flash_attn_varlen: k's head_dim (16) must equal q's (32)"),
    ("gqa divisibility", dict(k=jnp.ones((12, 3, 32)), v=jnp.ones((12, 3, 32))), ValueError,
     "flash_attn_varlen: num_heads (4) must be a multiple of num_heads_k (3)"),
    ("cu_seqlens length", dict(cu_seqlens_k=jnp.array([0, 5, 9, 12], jnp.int32)), ValueError,
     "flash_attn_varlen: cu_seqlens_k must have cu_seqlens_q's shape (3,), got (4,)"),
    ("cu_seqlens dtype", dict(cu_seqlens_q=jnp.array([0, 4, 10], jnp.float32)), TypeError,
     "flash_attn_varlen: cu_seqlens_q must be int32, got float32"),
    ("window", dict(window_size=(-2, 0)), ValueError,
     "flash_attn_varlen: window_size must be a pair of ints >= -1 (-1 = unbounded), got (-2, 0)"),
    ("softcap", dict(softcap=-1.0), ValueError, "flash_attn_varlen: softcap must be >= 0.0, got -1.0"),
    ("no offsets", dict(cu_seqlens_q=jnp.zeros((0,), jnp.int32),
                        cu_seqlens_k=jnp.zeros((0,), jnp.int32)), ValueError,
     "flash_attn_varlen: cu_seqlens_q must have at least one entry (batch + 1 >= 1)"),
    ("softmax_scale nan", dict(softmax_scale=float("nan")), ValueError,
     "flash_attn_varlen: softmax_scale must be finite, got nan"),
    ("softcap inf", dict(softcap=float("inf")), ValueError,
     "flash_attn_varlen: softcap must be finite, got inf"),
    ("alibi shape", dict(alibi_slopes=jnp.ones((3,), jnp.float32)), ValueError,
     "flash_attn_varlen: alibi_slopes must have shape (num_heads,) = (4,) or (batch, num_heads)"
     " = (2, 4), got (3,)"),
    ("seqused_k shape", dict(seqused_k=jnp.array([1, 2, 3], jnp.int32)), ValueError,
     "flash_attn_varlen: seqused_k must have shape (batch,) = (2,), got (3,)"),
    ("block_table rows", dict(k=jnp.ones((4, 16, 2, 32)), v=jnp.ones((4, 16, 2, 32)),
                              block_table=jnp.zeros((3, 2), jnp.int32)), ValueError,
     "flash_attn_varlen: block_table must have batch = 2 rows, got 3"),
    ("max_seqlen type", dict(max_seqlen_q=4.5), TypeError,
     "flash_attn_varlen: max_seqlen_q must be an int, got float"),
    ("descale on non-fp8", dict(q_descale=jnp.ones((), jnp.float32)), ValueError,
     "flash_attn_varlen: q_descale applies to float8_e4m3fn inputs only (q is float32)"),
    ("cu_seqlens list", dict(cu_seqlens_q=[0, 4, 10]), TypeError,
     "flash_attn_varlen: cu_seqlens_q must be an array, got list"),
    ("no heads", dict(q=jnp.ones((10, 0, 32)), k=jnp.ones((12, 0, 32)), v=jnp.ones((12, 0, 32))),
     ValueError, "flash_attn_varlen: num_heads and num_heads_k must be >= 1, got 0 and 0"),
    ("window past int32", dict(window_size=(2**31, 0)), ValueError,
     "flash_attn_varlen: window_size must be < 2**31 each, got (2147483648, 0)"),
    ("max_seqlen past int32", dict(max_seqlen_k=2**31), ValueError,
     "flash_attn_varlen: max_seqlen_k must be < 2**31, got 2147483648"),
    ("paged block_size 0", dict(k=jnp.ones((4, 0, 2, 32)), v=jnp.ones((4, 0, 2, 32)),
                                block_table=jnp.zeros((2, 2), jnp.int32)), ValueError,
     "flash_attn_varlen: k's block_size must be >= 1, got 0"),
    # offsets held as numpy arrays are checked on the host (device arrays are not)
    ("host offsets decreasing", dict(cu_seqlens_q=np.array([0, 6, 4], np.int32)), ValueError,
     "flash_attn_varlen: cu_seqlens_q must be non-decreasing offsets in [0, 10], got [0, 6, 4]"),
    ("host offsets past total", dict(cu_seqlens_k=np.array([0, 5, 13], np.int32)), ValueError,
     "flash_attn_varlen: cu_seqlens_k must be non-decreasing offsets in [0, 12], got [0, 5, 13]"),
    ("max_seqlen below a host sequence",
     dict(cu_seqlens_q=np.array([0, 4, 10], np.int32), max_seqlen_q=5), ValueError,
     "flash_attn_varlen: max_seqlen_q (5) must be >= the longest sequence (6): a GPU computes "
     "no row or key past it"),
    ("max_seqlen below host seqused_k",
     dict(cu_seqlens_k=np.array([0, 5, 12], np.int32), seqused_k=np.array([5, 7], np.int32),
          max_seqlen_k=6), ValueError,
     "flash_attn_varlen: max_seqlen_k (6) must be >= the longest sequence (7): a GPU computes "
     "no row or key past it"),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_bad_input(case):
    _, override, error, message = case
    args = _valid(np.random.default_rng(0)) | override
    with pytest.raises(error) as info:
        xla_attn.flash_attn_varlen(**args)
    assert str(info.value) == message


def test_host_offsets_bound_by_seqused_k():
    """max_seqlen_k bounds the keys used: host offsets longer than it are fine where
    seqused_k (numpy: checked; on the device: not known here) uses fewer keys."""
    rng = np.random.default_rng(4)
    for used in (np.array([5, 6], np.int32), jnp.array([5, 6], jnp.int32)):
        args = _valid(rng) | dict(cu_seqlens_k=np.array([0, 5, 12], np.int32), seqused_k=used,
                                  max_seqlen_k=6)
        assert np.isfinite(np.asarray(xla_attn.flash_attn_varlen(**args))).all()


DEVICE_HINT_CASES = [
    ("queries", dict(max_seqlen_q=5), False,
     "flash_fwd: sequence 1 has 6 queries (cu_seqlens_q), more than max_seqlen_q = 5: a GPU "
     "computes no row past it"),
    ("keys seen", dict(seqused_k=jnp.array([5, 7], jnp.int32), max_seqlen_k=6), False,
     "flash_fwd: sequence 1 has 7 keys (cu_seqlens_k / seqused_k), more than max_seqlen_k = 6: "
     "a GPU computes no key past it"),
    ("backward's key spans", dict(seqused_k=jnp.array([5, 6], jnp.int32), max_seqlen_k=6), True,
     "flash_bwd: sequence 1 has 7 keys (cu_seqlens_k), more than max_seqlen_k = 6: a GPU "
     "computes no key past it"),
]


@pytest.mark.parametrize("case", DEVICE_HINT_CASES, ids=[c[0] for c in DEVICE_HINT_CASES])
def test_device_offsets_past_max_seqlen_refused_on_host(case):
    """Offsets on the device are not read back at trace time; the Host handler reads them
    when it runs and refuses a sequence longer than its max_seqlen (a GPU would leave
    its rows past the hint unwritten), naming the sequence. The process keeps working."""
    _, override, backward, message = case
    args = _valid(np.random.default_rng(5)) | override
    if backward:  # the forward alone is fine: it sees only seqused_k's keys
        xla_attn.flash_attn_varlen(**args).block_until_ready()
        loss = lambda q: xla_attn.flash_attn_varlen(**(args | dict(q=q))).sum()
        call = lambda: jax.grad(loss)(args["q"]).block_until_ready()
    else:
        call = lambda: xla_attn.flash_attn_varlen(**args).block_until_ready()
    with pytest.raises(Exception, match=re.escape(message)):
        call()
    assert np.isfinite(np.asarray(xla_attn.flash_attn_varlen(**_valid(np.random.default_rng(5))))).all()


def test_numpy_scalars_are_taken_as_static_arguments():
    """Static arguments given as numpy scalars (np.int32 from `lens.max()`, np.float32,
    np.bool_) give what the Python values give; an array (jax or numpy) in their place
    is refused, naming its type."""
    a = _valid(np.random.default_rng(3))
    plain = xla_attn.flash_attn_varlen(**a, softmax_scale=0.25, causal=True, window_size=(3, 0))
    a_np = a | dict(max_seqlen_q=np.int32(6), max_seqlen_k=np.int64(7))
    got = xla_attn.flash_attn_varlen(**a_np, softmax_scale=np.float32(0.25), causal=np.bool_(True),
                                     window_size=(np.int64(3), np.int32(0)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    with pytest.raises(TypeError) as info:
        xla_attn.flash_attn_varlen(**a, causal=np.array([True]))
    assert str(info.value) == "flash_attn_varlen: causal must be a bool, got numpy.ndarray"
    with pytest.raises(TypeError) as info:
        xla_attn.flash_attn_varlen(**a, softmax_scale=jnp.float32(0.25))
    assert str(info.value).startswith("flash_attn_varlen: softmax_scale must be a float, got ")


DENSE_CASES = [
    ("k batch", (3, 8), (3, 8), "flash_attn: k's batch (3) must equal q's (2)"),
    ("v shape", (2, 8), (2, 9), "flash_attn: v must have k's shape (2, 8, 2, 32), got (2, 9, 2, 32)"),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dense_bad_shapes(case):
    _, k_rows, v_rows, message = case
    q = jnp.ones((2, 8, 4, 32), jnp.float32)
    with pytest.raises(ValueError) as info:
        xla_attn.flash_attn(q, jnp.ones((*k_rows, 2, 32)), jnp.ones((*v_rows, 2, 32)))
    assert str(info.value) == message


def test_dense_rows_past_int32_offsets():
    # shapes alone (jax.eval_shape): 2**16 sequences of 2**15 tokens would need int32
    # sequence offsets past 2**31
    q = jax.ShapeDtypeStruct((2**16, 2**15, 1, 8), jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        jax.eval_shape(xla_attn.jax.flash_attn, q, q, q)
    assert str(info.value) == ("flash_attn: batch x seqlen must be < 2**31 (int32 offsets), "
                               "got 65536 x 32768")
    ok = jax.ShapeDtypeStruct((2**15, 2**15, 1, 8), jnp.bfloat16)
    assert jax.eval_shape(xla_attn.jax.flash_attn, ok, ok, ok).shape == ok.shape


CACHE_CASES = [
    ("kv_cache_dtype", dict(kv_cache_dtype="int4"), ValueError,
     "reshape_and_cache_flash: kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', "
     "'fp8_e5m2', got 'int4'"),
    ("auto dtype mismatch", dict(key_cache=jnp.ones((4, 16, 2, 32), jnp.float16),
                                 value_cache=jnp.ones((4, 16, 2, 32), jnp.float16)), TypeError,
     "reshape_and_cache_flash: key_cache must have key's dtype bfloat16 (or be fp8), got float16"),
    ("uint8 without format", dict(key_cache=jnp.ones((4, 16, 2, 32), jnp.uint8),
                                  value_cache=jnp.ones((4, 16, 2, 32), jnp.uint8)), TypeError,
     "reshape_and_cache_flash: a uint8 cache needs kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2'"),
    ("fp8 format mismatch", dict(key_cache=jnp.ones((4, 16, 2, 32), jnp.float8_e5m2),
                                 value_cache=jnp.ones((4, 16, 2, 32), jnp.float8_e5m2),
                                 kv_cache_dtype="fp8_e4m3"), TypeError,
     "reshape_and_cache_flash: kv_cache_dtype 'fp8_e4m3' needs a uint8 or float8_e4m3fn cache, "
     "got float8_e5m2"),
    ("slot length", dict(slot_mapping=jnp.array([1, 2], jnp.int32)), ValueError,
     "reshape_and_cache_flash: slot_mapping must have shape (num_tokens,) = (3,), got (2,)"),
    ("slot dtype", dict(slot_mapping=jnp.array([1, 2, 3], jnp.float32)), TypeError,
     "reshape_and_cache_flash: slot_mapping must be int32 or int64, got float32"),
    ("cache heads", dict(key_cache=jnp.ones((4, 16, 4, 32), jnp.bfloat16),
                         value_cache=jnp.ones((4, 16, 4, 32), jnp.bfloat16)), ValueError,
     "reshape_and_cache_flash: key_cache's (num_heads_k, head_dim) = (4, 32) must match key's "
     "(2, 32)"),
    ("scale shape", dict(k_scale=jnp.ones((2,), jnp.float32)), ValueError,
     "reshape_and_cache_flash: k_scale must have shape () or (1,), got (2,)"),
    ("value shape", dict(value=jnp.ones((3, 2, 16), jnp.bfloat16)), ValueError,
     "reshape_and_cache_flash: value must have key's shape (3, 2, 32), got (3, 2, 16)"),
    ("value dtype", dict(value=jnp.ones((3, 2, 32), jnp.float16)), TypeError,
     "reshape_and_cache_flash: value must have key's dtype bfloat16, got float16"),
    ("value_cache dtype", dict(value_cache=jnp.ones((4, 16, 2, 32), jnp.float16)), TypeError,
     "reshape_and_cache_flash: value_cache must have key_cache's dtype bfloat16, got float16"),
    ("value_cache shape", dict(value_cache=jnp.ones((5, 16, 2, 32), jnp.bfloat16)), ValueError,
     "reshape_and_cache_flash: value_cache must have key_cache's shape (4, 16, 2, 32), got "
     "(5, 16, 2, 32)"),
    ("scale a Python float", dict(k_scale=0.5), TypeError,
     "reshape_and_cache_flash: k_scale must be a float32 array of shape () or (1,), got float"),
    ("block_size 0", dict(key_cache=jnp.ones((4, 0, 2, 32), jnp.bfloat16),
                          value_cache=jnp.ones((4, 0, 2, 32), jnp.bfloat16)), ValueError,
     "reshape_and_cache_flash: key_cache's block_size must be >= 1, got 0"),
    ("slot_mapping tuple", dict(slot_mapping=(1, -1, 5)), TypeError,
     "reshape_and_cache_flash: slot_mapping must be an array, got tuple"),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_cache_bad_input(case):
    _, override, error, message = case
    args = _cache(np.random.default_rng(0)) | override
    with pytest.raises(error) as info:
        xla_attn.reshape_and_cache_flash(**args)
    assert str(info.value) == message


PAGED_CASES = [
    ("value_cache dtype", dict(value_cache=jnp.ones((4, 16, 2, 32), jnp.float16)), TypeError,
     "paged_attention: value_cache must have key_cache's dtype bfloat16, got float16"),
    ("cache head_dim", dict(key_cache=jnp.ones((4, 16, 2, 16), jnp.bfloat16),
                            value_cache=jnp.ones((4, 16, 2, 16), jnp.bfloat16)), ValueError,
     "paged_attention: key_cache's head_dim (16) must equal query's (32)"),
    ("head_dim 0", dict(query=jnp.ones((3, 4, 0), jnp.bfloat16),
                        key_cache=jnp.ones((4, 16, 2, 0), jnp.bfloat16),
                        value_cache=jnp.ones((4, 16, 2, 0), jnp.bfloat16)), ValueError,
     "paged_attention: head_dim must be between 1 and 256, got 0"),
    ("block_tables rows", dict(block_tables=jnp.array([[0, 1]], jnp.int32)), ValueError,
     "paged_attention: block_tables must have 2 rows like seq_lens, got 1"),
    ("query_start_loc", dict(query_start_loc=jnp.array([0, 3], jnp.int32)), ValueError,
     "paged_attention: query_start_loc must have shape (num_seqs + 1,) = (3,), got (2,)"),
    ("sliding_window", dict(sliding_window=0), ValueError,
     "paged_attention: sliding_window must be >= 1, got 0"),
    ("cache dtype", dict(key_cache=jnp.ones((4, 16, 2, 32), jnp.float16),
                         value_cache=jnp.ones((4, 16, 2, 32), jnp.float16)), TypeError,
     "paged_attention: key_cache must be bfloat16, uint8, float8_e4m3fn or float8_e5m2, "
     "got float16"),
    ("num_seqs dtype", dict(num_seqs=jnp.array(1, jnp.int64 if jax.config.x64_enabled
                                               else jnp.float32)), TypeError,
     "paged_attention: num_seqs must be int32, got float32"),
    # no heads: a ZeroDivisionError from the check itself before
    ("no heads", dict(query=jnp.ones((3, 0, 32), jnp.bfloat16),
                      key_cache=jnp.ones((4, 16, 0, 32), jnp.bfloat16),
                      value_cache=jnp.ones((4, 16, 0, 32), jnp.bfloat16)), ValueError,
     "paged_attention: num_heads and num_heads_k must be >= 1, got 0 and 0"),
    ("seq_lens list", dict(seq_lens=[5, 20]), TypeError,
     "paged_attention: seq_lens must be an array, got list"),
    # past int32: the custom call's handler refused it (XlaRuntimeError) before
    ("sliding_window past int32", dict(sliding_window=2**40), ValueError,
     "paged_attention: sliding_window must be < 2**31, got 1099511627776"),
    ("block_size 0", dict(key_cache=jnp.ones((4, 0, 2, 32), jnp.bfloat16),
                          value_cache=jnp.ones((4, 0, 2, 32), jnp.bfloat16)), ValueError,
     "paged_attention: key_cache's block_size must be >= 1, got 0"),
    # host (numpy) offsets: checked here, as the Host handler would at run time
    ("host offsets past total", dict(query_start_loc=np.array([0, 1, 4], np.int32)),
     ValueError, "paged_attention: query_start_loc must be non-decreasing offsets in [0, 3], "
     "got [0, 1, 4]"),
    ("max_query_len below a host span",
     dict(query_start_loc=np.array([0, 1, 3], np.int32), max_query_len=1), ValueError,
     "paged_attention: max_query_len (1) must be >= the longest sequence (2): a GPU computes "
     "no row or key past it"),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_bad_input(case):
    _, override, error, message = case
    args = _paged(np.random.default_rng(0)) | override
    with pytest.raises(error) as info:
        xla_attn.paged_attention(**args)
    assert str(info.value) == message


def test_unsupported_arch_lists_the_build():
    with pytest.raises(RuntimeError) as info:
        _native.select_variant("reshape_and_cache_flash", "bfloat16", "float8_e4m3fn", 128, arch=60)
    message = str(info.value)
    assert message.startswith("xla_attn: no CUDA kernel for reshape_and_cache_flash with dtypes bf16->f8e4m3, "
                              "head_dim 128, features 0x0 on sm_60; this build has: portable(")
    assert "bf16->f8e4m3, sm_70;75;80;86;89;90" in message


def test_head_dim_without_kernel_lists_what_exists():
    with pytest.raises(RuntimeError) as info:
        _native.select_variant("flash_fwd", "bfloat16", "bfloat16", 512, arch=90)
    message = str(info.value)
    assert message.startswith("xla_attn: no CUDA kernel for flash_fwd with dtypes bf16->bf16, "
                              "head_dim 512, features 0x0 on sm_90; this build has: ")
    assert "portable(bf16->bf16, sm_" in message


def test_unknown_op_lists_the_ops_with_kernels():
    with pytest.raises(RuntimeError) as info:
        _native.select_variant("flash_fwd_v9", "bfloat16", "bfloat16", 128, arch=90)
    assert "this build has: none; CUDA kernels exist for: reshape_and_cache_flash flash_fwd" in str(info.value)


def test_decode_kernels_by_arch_and_forced_families(monkeypatch):
    """The Hopper decode kernel (op paged_decode_tma) exists for sm_90 alone;
    XLA_ATTN_FORCE_FAMILY restricts selection to the families it lists, comma-separated
    (whole names only), and a miss names them."""
    def pick(op, arch):
        return _native.select_variant(op, "bfloat16", "bfloat16", 128, arch=arch)

    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)
    assert pick("paged_decode_tma", 90) == "xla_attn_paged_decode_sm90_bf16_bf16_d128"
    with pytest.raises(RuntimeError, match="on sm_89; this build has: decode_sm90"):
        pick("paged_decode_tma", 89)
    assert pick("paged_decode_combine", 90) == "xla_attn_paged_decode_combine_sm90_bf16_d128"
    assert pick("paged_decode_combine", 89) == "xla_attn_paged_decode_combine_bf16_d128"
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "decode,sm80")
    assert pick("paged_decode_mma", 90) == "xla_attn_paged_decode_sm80_bf16_bf16_d128"
    assert pick("paged_decode_combine", 90) == "xla_attn_paged_decode_combine_bf16_d128"
    assert pick("flash_fwd", 90) == "xla_attn_flash_fwd_sm80_bf16_d128"
    with pytest.raises(RuntimeError) as info:
        pick("paged_decode_tma", 90)
    assert " in families 'decode,sm80' (XLA_ATTN_FORCE_FAMILY); " in str(info.value)
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm8,decode_sm9")
    with pytest.raises(RuntimeError):
        pick("flash_fwd", 90)
    with pytest.raises(RuntimeError):
        pick("paged_decode_tma", 90)


@pytest.mark.parametrize("cache, dim, heads", [("float8_e4m3fn", 128, 2), ("float8_e5m2", 128, 2),
                                              ("bfloat16", 64, 2), ("float8_e4m3fn", 64, 4)])
def test_decode_heads_together_where_rows_are_short(monkeypatch, cache, dim, heads):
    """Rows under 256 bytes have decode kernels that read 256 // row bytes kv heads a
    block (ops paged_decode_tma_heads on sm_90, paged_decode_mma_heads on sm_80+); rows
    of 256 bytes have none (they are read whole already)."""
    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)
    short = {"float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "bfloat16": "bf16"}[cache]
    tma = _native.select_variant("paged_decode_tma_heads", "bfloat16", cache, dim, arch=90)
    assert tma == f"xla_attn_paged_decode_sm90_bf16_{short}_d{dim}_kv{heads}"
    for arch in (80, 89, 90):
        mma = _native.select_variant("paged_decode_mma_heads", "bfloat16", cache, dim, arch=arch)
        assert mma == f"xla_attn_paged_decode_sm80_bf16_{short}_d{dim}_kv{heads}"
    with pytest.raises(RuntimeError):
        _native.select_variant("paged_decode_tma_heads", "bfloat16", "bfloat16", 128, arch=90)
    with pytest.raises(RuntimeError):
        _native.select_variant("paged_decode_tma_heads", "bfloat16", cache, dim, arch=89)


def test_hopper_forward_is_for_sm90_alone(monkeypatch):
    """The wgmma forward (op flash_fwd_tma) is an sm_90a cubin: selected on sm_90 only,
    neither below nor on later archs (its PTX cannot be JIT-compiled for them), and
    only for the head dims of its buckets (33..256)."""
    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)

    def pick(arch, head_dim=128, dtype="bfloat16"):
        return _native.select_variant("flash_fwd_tma", dtype, dtype, head_dim, arch=arch)

    assert pick(90) == "xla_attn_flash_fwd_sm90_bf16_d128"
    assert pick(90, 80, "float16") == "xla_attn_flash_fwd_sm90_f16_d128"
    assert pick(90, 256) == "xla_attn_flash_fwd_sm90_bf16_d256"
    assert pick(90, 33) == "xla_attn_flash_fwd_sm90_bf16_d64"
    # fp8 e4m3: head dims 16..64, 65..128 and 129..256
    assert pick(90, 64, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d64"
    assert pick(90, 16, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d64"
    assert pick(90, 80, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d128"
    assert pick(90, 128, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d128"
    assert pick(90, 144, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d256"
    assert pick(90, 256, "float8_e4m3fn") == "xla_attn_flash_fwd_sm90_f8e4m3_d256"
    for arch, head_dim in ((89, 128), (90, 272)):
        with pytest.raises(RuntimeError):
            pick(arch, head_dim, "float8_e4m3fn")
    for arch, head_dim in ((89, 128), (100, 128), (90, 32)):
        with pytest.raises(RuntimeError, match="; this build has: .*sm90\\(bf16->bf16, sm_90a\\)"):
            pick(arch, head_dim)
    assert _native.select_variant("flash_fwd", "bfloat16", "bfloat16", 128,
                                  arch=90) == "xla_attn_flash_fwd_sm80_bf16_d128"


def test_sm80_fp8_forward_is_for_sm89_and_up(monkeypatch):
    """The sm80 family's fp8 forward (op flash_fwd_mma_fp8, mma.sync e4m3) runs from sm_89
    on (its cubins come from compute_89 PTX), in three head-dim buckets."""
    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)

    def pick(arch, head_dim):
        return _native.select_variant("flash_fwd_mma_fp8", "float8_e4m3fn", "float8_e4m3fn",
                                      head_dim, arch=arch)

    assert pick(89, 16) == "xla_attn_flash_fwd_sm89_f8e4m3_d64"
    assert pick(89, 80) == "xla_attn_flash_fwd_sm89_f8e4m3_d128"
    assert pick(90, 256) == "xla_attn_flash_fwd_sm89_f8e4m3_d256"
    for arch in (80, 86):
        with pytest.raises(RuntimeError):
            pick(arch, 128)
    with pytest.raises(RuntimeError):
        _native.select_variant("flash_fwd_mma_fp8", "bfloat16", "bfloat16", 128, arch=90)


def test_wrong_input_type_names_the_frontend():
    with pytest.raises(TypeError) as info:
        xla_attn.flash_attn_varlen([[1.0]], None, None, None, None)
    assert str(info.value) == "xla_attn.flash_attn_varlen: expected jax arrays (or numpy arrays), got list"


def test_native_check_rejects_what_python_cannot_see():
    """A raw custom call with a bad attribute (as EXLA could emit) is refused by the
    handler with a message, and the process keeps working."""
    from xla_attn import jax as xj

    a = _valid(np.random.default_rng(1))
    spec_attrs = dict(softmax_scale=np.float32(0.1), softcap=np.float32(0), window_left=-5,
                      window_right=-1, max_seqlen_q=6, max_seqlen_k=7)
    xj._register()
    call = jax.ffi.ffi_call("xla_attn_flash_fwd_v1",
                            (jax.ShapeDtypeStruct(a["q"].shape, jnp.float32),
                             jax.ShapeDtypeStruct((4, 10), jnp.float32),
                             jax.ShapeDtypeStruct((0,), jnp.uint8)), vmap_method="sequential")
    empty_i, empty_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    with pytest.raises(Exception, match="flash_fwd: window sizes must be >= -1"):
        jax.block_until_ready(call(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                   empty_i, empty_i, empty_f, empty_f, empty_f, empty_f,
                                   **spec_attrs))


def test_native_check_refuses_a_misshapen_dlse():
    """xla_attn_flash_bwd_v3's dlse operand (softmax_lse's cotangent) is checked by the
    handler like softmax_lse: [num_heads, total_q] float32, or empty for none."""
    from xla_attn import jax as xj

    a = _valid(np.random.default_rng(3))
    q, k = a["q"], a["k"]
    xj._register()
    call = jax.ffi.ffi_call("xla_attn_flash_bwd_v3",
                            tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, k))
                            + (jax.ShapeDtypeStruct((0,), jnp.uint8),), vmap_method="sequential")
    empty_i, empty_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    lse = jnp.zeros((q.shape[1], q.shape[0]), jnp.float32)
    attrs = dict(softmax_scale=np.float32(0.1), softcap=np.float32(0), window_left=-1,
                 window_right=-1, max_seqlen_q=6, max_seqlen_k=7)
    for dlse in (lse.T, lse.astype(jnp.bfloat16)):
        with pytest.raises(Exception, match=re.escape(
                "dlse must be float32 [num_heads, total_q] (or empty: none)")):
            jax.block_until_ready(call(q, q, k, k, q, lse, a["cu_seqlens_q"], a["cu_seqlens_k"],
                                       empty_i, empty_f, dlse, **attrs))
    for dlse in (empty_f, lse + 1):  # both run
        jax.block_until_ready(call(q, q, k, k, q, lse, a["cu_seqlens_q"], a["cu_seqlens_k"],
                                   empty_i, empty_f, dlse, **attrs))


def test_process_keeps_working_after_errors():
    rng = np.random.default_rng(2)
    for case in FLASH_CASES[:3]:
        with pytest.raises(case[2]):
            xla_attn.flash_attn_varlen(**(_valid(rng) | case[1]))
    out = xla_attn.flash_attn_varlen(**_valid(rng))
    assert np.isfinite(np.asarray(out)).all()


def test_cached_spec_keys_types_and_raises_every_call():
    """_ops.cached (the eager frontends' remembered checks): the same spec for the same
    shapes and values, a new one where only a value's type differs (True and 1, 1.0 and
    1 are equal keys otherwise), the error again on every bad call, and numpy offsets
    (whose values are checked) never remembered."""
    from xla_attn import _ops

    calls = []

    def spec(x, flag, window=(-1, -1), scale=None):
        calls.append(1)
        return _ops.flash_varlen_spec(x, x, x, cu, cu, 4, 4, scale, flag, window, 0.0, None,
                                      None, None, None, None, None)

    cu = jnp.asarray(np.array([0, 4], np.int32))
    x = jnp.zeros((4, 2, 8), jnp.float32)
    remembered = _ops.cached(spec)
    first = remembered(x, True)
    assert remembered(jnp.ones((4, 2, 8), jnp.float32), True) is first and len(calls) == 1
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        remembered(x, 1)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        remembered(x, 1)
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        remembered(x, False, (-1.0, -1))
    assert remembered(x, False, [-1, -1]) == remembered(x, False, (-1, -1))  # a list: uncached
    assert remembered(x, True, scale=0.5).softmax_scale == 0.5
    with pytest.raises(TypeError, match="softmax_scale must be a float, got ArrayImpl"):
        remembered(x, True, scale=jnp.float32(0.5))  # an array: named by its own type
    assert len(calls) == 8
    bad = np.array([0, 5], np.int32)  # numpy offsets: checked every call
    for _ in range(2):
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing offsets"):
            _ops.cached(_ops.flash_varlen_spec)(x, x, x, bad, bad, 4, 4, None, False,
                                                (-1, -1), 0.0, None, None, None, None, None,
                                                None)
