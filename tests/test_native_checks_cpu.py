"""The typed handlers check every operand and attribute themselves. A raw custom call,
as another runtime emits it (bypassing this package's Python checks), with one bad
operand, result or attribute is refused with the handler's message, and the process
keeps working: it never reads or writes past a buffer.

One case per check of kernels/ffi/*.cc and kernels/*/validate.cc that a custom call
can reach; `tools/check_sweep.py --native` takes each check out in turn and lists the
ones no case here needs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from xla_attn import jax as xla_attn_jax

I32, F32, BF16, U8 = jnp.int32, jnp.float32, jnp.bfloat16, jnp.uint8
FLASH_ATTRS = dict(softmax_scale=np.float32(0.1), softcap=np.float32(0), window_left=-1,
                   window_right=-1, max_seqlen_q=6, max_seqlen_k=7)


def _none(dtype=I32):
    return jnp.zeros((0,), dtype)


def _normal(shape, dtype=F32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _flash_fwd():
    q, k = _normal((10, 4, 32)), _normal((12, 2, 32), seed=1)
    operands = dict(q=q, k=k, v=k + 1, cu_seqlens_q=jnp.array([0, 4, 10], I32),
                    cu_seqlens_k=jnp.array([0, 5, 12], I32), seqused_k=_none(),
                    block_table=_none(), alibi_slopes=_none(F32), q_descale=_none(F32),
                    k_descale=_none(F32), v_descale=_none(F32))
    results = dict(out=((10, 4, 32), F32), softmax_lse=((4, 10), F32), workspace=((0,), U8))
    return operands, results, FLASH_ATTRS


def _flash_bwd(version):
    operands, _, attrs = _flash_fwd()
    q, k, v = operands["q"], operands["k"], operands["v"]
    operands = dict(dout=q + 2, q=q, k=k, v=v, out=q + 3, softmax_lse=_normal((4, 10), seed=2),
                    cu_seqlens_q=operands["cu_seqlens_q"], cu_seqlens_k=operands["cu_seqlens_k"],
                    seqused_k=_none(), alibi_slopes=_none(F32))
    results = dict(dq=(q.shape, F32), dk=(k.shape, F32), dv=(v.shape, F32))
    if version >= 2:
        results["workspace"] = ((0,), U8)
    if version == 3:
        operands["dlse"] = _none(F32)
    return operands, results, attrs


def _paged(version):
    operands = dict(query=_normal((3, 4, 32), BF16), key_cache=_normal((4, 16, 2, 32), BF16, 1),
                    value_cache=_normal((4, 16, 2, 32), BF16, 2),
                    seq_lens=jnp.array([5, 20], I32), block_tables=jnp.array([[0, 1], [2, 3]], I32),
                    query_start_loc=jnp.array([0, 1, 3], I32), num_seqs=_none(),
                    k_scale=_none(F32), v_scale=_none(F32))
    attrs = dict(scale=np.float32(0.2), soft_cap=np.float32(0), sliding_window=0,
                 kv_cache_dtype="auto")
    if version == 2:
        operands["alibi_slopes"] = _none(F32)
        attrs["max_query_len"] = 2
    return operands, dict(out=((3, 4, 32), BF16), workspace=((0,), U8)), attrs


def _cache_write():
    key, cache = _normal((3, 2, 32)), _normal((4, 16, 2, 32), seed=1)
    operands = dict(key=key, value=key + 1, key_cache=cache, value_cache=cache + 1,
                    slot_mapping=jnp.array([1, -1, 5], I32), k_scale=_none(F32),
                    v_scale=_none(F32))
    return operands, dict(key_cache=(cache.shape, F32), value_cache=(cache.shape, F32)), \
        dict(kv_cache_dtype="auto")


TARGETS = {
    "xla_attn_flash_fwd_v1": _flash_fwd,
    "xla_attn_flash_bwd_v1": lambda: _flash_bwd(1),
    "xla_attn_flash_bwd_v2": lambda: _flash_bwd(2),
    "xla_attn_flash_bwd_v3": lambda: _flash_bwd(3),
    "xla_attn_paged_attention_v1": lambda: _paged(1),
    "xla_attn_paged_attention_v2": lambda: _paged(2),
    "xla_attn_reshape_and_cache_flash_v1": _cache_write,
}


def _call(target, operands=None, results=None, attrs=None):
    """Runs `target` raw on the Host with its valid arguments, some replaced: an
    operand by an array, a result by (shape, dtype), an attribute by a value."""
    xla_attn_jax._register()
    base_operands, base_results, base_attrs = TARGETS[target]()
    operands = base_operands | (operands or {})
    results = base_results | (results or {})
    call = jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(s, d) for s, d in results.values()),
                            vmap_method="sequential")
    return jax.block_until_ready(call(*operands.values(), **(base_attrs | (attrs or {}))))


@pytest.mark.parametrize("target", TARGETS)
def test_valid_raw_calls_run(target):
    """The base every case changes one thing of: valid, so each case's error is its own."""
    for out in _call(target):
        assert np.isfinite(np.asarray(out, np.float32)).all()


FWD, BWD = "xla_attn_flash_fwd_v1", "xla_attn_flash_bwd_v2"
PAGED, PAGED2, CACHE = ("xla_attn_paged_attention_v1", "xla_attn_paged_attention_v2",
                        "xla_attn_reshape_and_cache_flash_v1")
# (target, operands, results, attributes, the handler's message)
CASES = {
    # flash forward
    "fwd q rank": (FWD, dict(q=_normal((10, 128))), dict(out=((10, 128), F32)), {},
                   "q must be [total_q, num_heads, head_dim]"),
    "fwd k rank": (FWD, dict(k=_normal((12, 64)), v=_normal((12, 64))), {}, {},
                   "k and v must be [total_k, num_heads_k, head_dim] of one dtype"),
    "fwd v shape": (FWD, dict(v=_normal((11, 2, 32))), {}, {},
                    "k and v must be [total_k, num_heads_k, head_dim] of one dtype"),
    "fwd v dtype": (FWD, dict(v=_normal((12, 2, 32), BF16)), {}, {},
                    "k and v must be [total_k, num_heads_k, head_dim] of one dtype"),
    "fwd paged k rank": (FWD, dict(block_table=jnp.zeros((2, 1), I32)), {}, {},
                         "paged k and v must be [num_blocks, block_size, num_heads_k, head_dim] of "
                         "one dtype"),
    "fwd cu_seqlens rank": (FWD, dict(cu_seqlens_q=jnp.array([[0, 4, 10]], I32)), {}, {},
                            "cu_seqlens_q and cu_seqlens_k must be [batch + 1]"),
    "fwd cu_seqlens_k rank": (FWD, dict(cu_seqlens_k=jnp.array([[0, 5, 12]], I32)), {}, {},
                              "cu_seqlens_q and cu_seqlens_k must be [batch + 1]"),
    "fwd cu_seqlens empty": (FWD, dict(cu_seqlens_q=_none(), cu_seqlens_k=_none()), {}, {},
                             "cu_seqlens_q and cu_seqlens_k must be [batch + 1]"),
    "fwd cu_seqlens lengths": (FWD, dict(cu_seqlens_k=jnp.array([0, 5, 9, 12], I32)), {}, {},
                               "cu_seqlens_q and cu_seqlens_k must be [batch + 1]"),
    "fwd cu_seqlens_q dtype": (FWD, dict(cu_seqlens_q=jnp.array([0, 4, 10], jnp.uint32)), {}, {},
                               "index operands must be int32"),
    "fwd cu_seqlens_k dtype": (FWD, dict(cu_seqlens_k=jnp.array([0, 5, 12], jnp.uint32)), {}, {},
                               "index operands must be int32"),
    "fwd seqused_k dtype": (FWD, dict(seqused_k=jnp.array([5, 7], jnp.uint32)), {}, {},
                            "index operands must be int32"),
    "fwd block_table dtype": (FWD, dict(k=_normal((3, 4, 2, 32)), v=_normal((3, 4, 2, 32)),
                                        block_table=jnp.zeros((2, 1), jnp.uint32)), {}, {},
                              "index operands must be int32"),
    "fwd window_left int32": (FWD, {}, {}, dict(window_left=1 << 31),
                              "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in "
                              "int32"),
    "fwd window_right int32": (FWD, {}, {}, dict(window_right=-(1 << 31) - 1),
                               "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in "
                               "int32"),
    "fwd max_seqlen_q int32": (FWD, {}, {}, dict(max_seqlen_q=1 << 32),
                               "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in "
                               "int32"),
    "fwd max_seqlen_k int32": (FWD, {}, {}, dict(max_seqlen_k=1 << 32),
                               "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in "
                               "int32"),
    "fwd alibi dtype": (FWD, dict(alibi_slopes=jnp.ones((4,), BF16)), {}, {},
                        "alibi_slopes must be float32 [num_heads] or [batch, num_heads]"),
    "fwd alibi count": (FWD, dict(alibi_slopes=jnp.ones((3,), F32)), {}, {},
                        "alibi_slopes must be float32 [num_heads] or [batch, num_heads]"),
    "fwd head_dim": (FWD, dict(k=_normal((12, 2, 16)), v=_normal((12, 2, 16))), {}, {},
                     "k's head_dim must equal q's"),
    "fwd seqused_k count": (FWD, dict(seqused_k=jnp.array([5, 7, 1], I32)), {}, {},
                            "seqused_k must be [batch]"),
    "fwd block_table rank": (FWD, dict(k=_normal((3, 4, 2, 32)), v=_normal((3, 4, 2, 32)),
                                       block_table=jnp.zeros((2,), I32)), {}, {},
                             "block_table must be [batch, max_blocks_per_seq]"),
    "fwd block_table rows": (FWD, dict(k=_normal((3, 4, 2, 32)), v=_normal((3, 4, 2, 32)),
                                       block_table=jnp.zeros((3, 2), I32)), {}, {},
                             "block_table must be [batch, max_blocks_per_seq]"),
    "fwd out shape": (FWD, {}, dict(out=((10, 4, 16), F32)), {}, "out must have q's shape"),
    "fwd lse rank": (FWD, {}, dict(softmax_lse=((40,), F32)), {},
                     "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd lse rank 3": (FWD, {}, dict(softmax_lse=((4, 10, 1), F32)), {},
                       "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd lse heads": (FWD, {}, dict(softmax_lse=((10, 4), F32)), {},
                      "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd lse fewer heads": (FWD, {}, dict(softmax_lse=((3, 10), F32)), {},
                            "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd lse rows": (FWD, {}, dict(softmax_lse=((4, 9), F32)), {},
                     "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd lse dtype": (FWD, {}, dict(softmax_lse=((4, 10), BF16)), {},
                      "softmax_lse must be float32 [num_heads, total_q]"),
    "fwd descale count": (FWD, dict(q_descale=jnp.ones((2,), F32)), {}, {},
                          "descales must be float32 scalars"),
    "fwd descale dtype": (FWD, dict(v_descale=jnp.ones((1,), BF16)), {}, {},
                          "descales must be float32 scalars"),
    # kernels/flash/validate.cc, reached through the handler (its messages name the op)
    "fwd gqa": (FWD, dict(k=_normal((12, 3, 32)), v=_normal((12, 3, 32))), {}, {},
                "flash_fwd: num_heads (4) must be a multiple of num_heads_k (3)"),
    "fwd head_dim range": (FWD, dict(q=_normal((10, 4, 264)), k=_normal((12, 2, 264)),
                                     v=_normal((12, 2, 264))), dict(out=((10, 4, 264), F32)), {},
                           "flash_fwd: head_dim must be in [1, 256], got 264"),
    "fwd window range": (FWD, {}, {}, dict(window_right=-2), "flash_fwd: window sizes must be >= -1"),
    "fwd softcap": (FWD, {}, {}, dict(softcap=np.float32(-1)), "flash_fwd: softcap must be >= 0"),
    "fwd max_seqlen range": (FWD, {}, {}, dict(max_seqlen_k=-1),
                             "flash_fwd: max_seqlen_q and max_seqlen_k must be >= 0"),
    "fwd q dtype": (FWD, dict(q=jnp.ones((10, 4, 32), I32), k=jnp.ones((12, 2, 32), I32),
                              v=jnp.ones((12, 2, 32), I32)), dict(out=((10, 4, 32), I32)), {},
                    "flash_fwd: q dtype must be float32, float16, bfloat16 or float8_e4m3fn"),
    "fwd kv dtype": (FWD, dict(k=_normal((12, 2, 32), BF16), v=_normal((12, 2, 32), BF16)), {},
                     {}, "flash_fwd: k and v must have q's dtype"),
    "fwd out dtype": (FWD, {}, dict(out=((10, 4, 32), BF16)), {},
                      "flash_fwd: out dtype must be q's (bfloat16 for fp8 q)"),
    "fwd descale without fp8": (FWD, dict(k_descale=jnp.ones((), F32)), {}, {},
                                "flash_fwd: q/k/v_descale apply to fp8 inputs only"),
    "fwd paged block_size": (FWD, dict(k=_normal((3, 0, 2, 32)), v=_normal((3, 0, 2, 32)),
                                       block_table=jnp.zeros((2, 1), I32)), {}, {},
                             "flash_fwd: paged K/V needs block_size > 0"),
    # flash backward
    "bwd q rank": (BWD, dict(q=_normal((10, 128))), {}, {},
                   "q must be [total_q, num_heads, head_dim], k and v [total_k, num_heads_k, "
                   "head_dim]"),
    "bwd k rank": (BWD, dict(k=_normal((12, 64)), v=_normal((12, 64))), {}, {},
                   "q must be [total_q, num_heads, head_dim], k and v [total_k, num_heads_k, "
                   "head_dim]"),
    "bwd v shape": (BWD, dict(v=_normal((11, 2, 32))), {}, {},
                    "q must be [total_q, num_heads, head_dim], k and v [total_k, num_heads_k, "
                    "head_dim]"),
    "bwd dout shape": (BWD, dict(dout=_normal((9, 4, 32))), {}, {},
                       "dout and out must have q's shape"),
    "bwd out shape": (BWD, dict(out=_normal((9, 4, 32))), {}, {},
                      "dout and out must have q's shape"),
    "bwd dq shape": (BWD, {}, dict(dq=((9, 4, 32), F32)), {},
                     "dq, dk, dv must have the shapes of q, k, v"),
    "bwd dk shape": (BWD, {}, dict(dk=((11, 2, 32), F32)), {},
                     "dq, dk, dv must have the shapes of q, k, v"),
    "bwd dv shape": (BWD, {}, dict(dv=((11, 2, 32), F32)), {},
                     "dq, dk, dv must have the shapes of q, k, v"),
    "bwd cu_seqlens rank": (BWD, dict(cu_seqlens_q=jnp.array([[0, 4, 10]], I32)), {}, {},
                            "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd cu_seqlens_k rank": (BWD, dict(cu_seqlens_k=jnp.array([[0, 5, 12]], I32)), {}, {},
                              "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd cu_seqlens empty": (BWD, dict(cu_seqlens_q=_none(), cu_seqlens_k=_none()), {}, {},
                             "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd cu_seqlens lengths": (BWD, dict(cu_seqlens_k=jnp.array([0, 12], I32)), {}, {},
                               "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd cu_seqlens_q dtype": (BWD, dict(cu_seqlens_q=jnp.array([0, 4, 10], jnp.uint32)), {}, {},
                               "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd cu_seqlens_k dtype": (BWD, dict(cu_seqlens_k=jnp.array([0, 5, 12], jnp.uint32)), {}, {},
                               "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]"),
    "bwd window int32": (BWD, {}, {}, dict(window_left=1 << 31),
                         "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in int32"),
    "bwd alibi count": (BWD, dict(alibi_slopes=jnp.ones((2, 3), F32)), {}, {},
                        "alibi_slopes must be float32 [num_heads] or [batch, num_heads]"),
    "bwd head_dim": (BWD, dict(k=_normal((12, 2, 16)), v=_normal((12, 2, 16))),
                     dict(dk=((12, 2, 16), F32), dv=((12, 2, 16), F32)), {},
                     "k's head_dim must equal q's"),
    "bwd lse shape": (BWD, dict(softmax_lse=_normal((10, 4))), {}, {},
                      "softmax_lse must be float32 [num_heads, total_q]"),
    "bwd lse dtype": (BWD, dict(softmax_lse=_normal((4, 10), BF16)), {}, {},
                      "softmax_lse must be float32 [num_heads, total_q]"),
    "bwd dlse shape": ("xla_attn_flash_bwd_v3", dict(dlse=_normal((10, 4))), {}, {},
                       "dlse must be float32 [num_heads, total_q] (or empty: none)"),
    "bwd seqused_k count": (BWD, dict(seqused_k=jnp.array([5], I32)), {}, {},
                            "seqused_k must be int32 [batch]"),
    "bwd seqused_k dtype": (BWD, dict(seqused_k=jnp.array([5, 7], jnp.uint32)), {}, {},
                            "seqused_k must be int32 [batch]"),
    "bwd dout dtype": (BWD, dict(dout=_normal((10, 4, 32), BF16)), {}, {},
                       "dout, q, k, v, out must share one dtype"),
    "bwd k dtype": (BWD, dict(k=_normal((12, 2, 32), BF16)), {}, {},
                    "dout, q, k, v, out must share one dtype"),
    "bwd v dtype": (BWD, dict(v=_normal((12, 2, 32), BF16)), {}, {},
                    "dout, q, k, v, out must share one dtype"),
    "bwd out dtype": (BWD, dict(out=_normal((10, 4, 32), BF16)), {}, {},
                      "dout, q, k, v, out must share one dtype"),
    "bwd dq dtype": (BWD, {}, dict(dq=((10, 4, 32), BF16)), {}, "dq, dk, dv must have q's dtype"),
    "bwd dk dtype": (BWD, {}, dict(dk=((12, 2, 32), BF16)), {}, "dq, dk, dv must have q's dtype"),
    "bwd dv dtype": (BWD, {}, dict(dv=((12, 2, 32), BF16)), {}, "dq, dk, dv must have q's dtype"),
    "bwd dtype": (BWD, {name: x.astype(jnp.float8_e4m3fn) for name, x in _flash_bwd(2)[0].items()
                        if name in ("dout", "q", "k", "v", "out")},
                  {name: (shape, jnp.float8_e4m3fn) for name, (shape, _) in
                   _flash_bwd(2)[1].items() if name != "workspace"}, {},
                  "flash_bwd: dtype must be float32, float16 or bfloat16"),
    "bwd gqa": (BWD, dict(k=_normal((12, 3, 32)), v=_normal((12, 3, 32))),
                dict(dk=((12, 3, 32), F32), dv=((12, 3, 32), F32)), {},
                "flash_bwd: num_heads (4) must be a multiple of num_heads_k (3)"),
    "bwd softcap": (BWD, {}, {}, dict(softcap=np.float32(-0.5)), "flash_bwd: softcap must be >= 0"),
    "bwd window range": (BWD, {}, {}, dict(window_left=-3), "flash_bwd: window sizes must be >= -1"),
    "bwd max_seqlen range": (BWD, {}, {}, dict(max_seqlen_q=-1),
                             "flash_bwd: max_seqlen_q and max_seqlen_k must be >= 0"),
    # paged attention
    "paged query rank": (PAGED, dict(query=_normal((3, 128), BF16)), dict(out=((3, 128), BF16)),
                         {}, "query must be [total_q, num_heads, head_dim]"),
    "paged cache rank": (PAGED, dict(key_cache=_normal((64, 2, 32), BF16),
                                     value_cache=_normal((64, 2, 32), BF16)), {}, {},
                         "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, "
                         "head_dim] of one dtype"),
    "paged cache shapes": (PAGED, dict(value_cache=_normal((3, 16, 2, 32), BF16)), {}, {},
                           "key_cache and value_cache must be [num_blocks, block_size, "
                           "num_heads_k, head_dim] of one dtype"),
    "paged cache dtypes": (PAGED, dict(value_cache=_normal((4, 16, 2, 32), F32)), {}, {},
                           "key_cache and value_cache must be [num_blocks, block_size, "
                           "num_heads_k, head_dim] of one dtype"),
    "paged seq_lens rank": (PAGED, dict(seq_lens=jnp.array([[5, 20]], I32)), {}, {},
                            "seq_lens must be [num_seqs], block_tables [num_seqs, max_blocks], "
                            "query_start_loc [num_seqs + 1]"),
    "paged block_tables rank": (PAGED, dict(block_tables=jnp.array([0, 1], I32)), {}, {},
                                "seq_lens must be [num_seqs], block_tables [num_seqs, max_blocks], "
                                "query_start_loc [num_seqs + 1]"),
    "paged query_start_loc rank": (PAGED, dict(query_start_loc=jnp.array([[0, 1, 3]], I32)), {},
                                   {}, "seq_lens must be [num_seqs], block_tables [num_seqs, "
                                   "max_blocks], query_start_loc [num_seqs + 1]"),
    "paged sliding_window int32": (PAGED, {}, {}, dict(sliding_window=1 << 31),
                                   "sliding_window must fit in int32"),
    "paged max_query_len int32": (PAGED2, {}, {}, dict(max_query_len=1 << 31),
                                  "max_query_len must fit in int32"),
    "paged block_tables rows": (PAGED, dict(block_tables=jnp.array([[0, 1]], I32)), {}, {},
                                "block_tables and query_start_loc must match seq_lens' length"),
    "paged query_start_loc length": (PAGED, dict(query_start_loc=jnp.array([0, 3], I32)), {}, {},
                                     "block_tables and query_start_loc must match seq_lens' "
                                     "length"),
    "paged head_dim": (PAGED, dict(key_cache=_normal((4, 16, 2, 16), BF16),
                                   value_cache=_normal((4, 16, 2, 16), BF16)), {}, {},
                       "cache head_dim must equal query's"),
    "paged out shape": (PAGED, {}, dict(out=((3, 4, 16), BF16)), {},
                        "out must have query's shape and dtype"),
    "paged out dtype": (PAGED, {}, dict(out=((3, 4, 32), F32)), {},
                        "out must have query's shape and dtype"),
    "paged num_seqs": (PAGED, dict(num_seqs=jnp.array([2, 2], I32)), {}, {},
                       "num_seqs must be a scalar"),
    "paged alibi rank": (PAGED2, dict(alibi_slopes=jnp.ones((1, 4), F32)), {}, {},
                         "alibi_slopes must be float32 [num_heads]"),
    "paged alibi count": (PAGED2, dict(alibi_slopes=jnp.ones((3,), F32)), {}, {},
                          "alibi_slopes must be float32 [num_heads]"),
    "paged alibi dtype": (PAGED2, dict(alibi_slopes=jnp.ones((4,), BF16)), {}, {},
                          "alibi_slopes must be float32 [num_heads]"),
    "paged seq_lens dtype": (PAGED, dict(seq_lens=jnp.array([5, 20], jnp.uint32)), {}, {},
                             "index operands must be int32"),
    "paged block_tables dtype": (PAGED, dict(block_tables=jnp.array([[0, 1], [2, 3]], jnp.uint32)),
                                 {}, {}, "index operands must be int32"),
    "paged query_start_loc dtype": (PAGED, dict(query_start_loc=jnp.array([0, 1, 3], jnp.uint32)),
                                    {}, {}, "index operands must be int32"),
    "paged num_seqs dtype": (PAGED, dict(num_seqs=jnp.array([2], jnp.uint32)), {}, {},
                             "index operands must be int32"),
    "paged k_scale count": (PAGED, dict(k_scale=jnp.ones((2,), F32)), {}, {},
                            "k_scale and v_scale must be float32 scalars"),
    "paged v_scale dtype": (PAGED, dict(v_scale=jnp.ones((1,), BF16)), {}, {},
                            "k_scale and v_scale must be float32 scalars"),
    "paged kv_cache_dtype name": (PAGED, {}, {}, dict(kv_cache_dtype="fp16"),
                                  "kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2"),
    "paged uint8 cache auto": (PAGED, dict(key_cache=jnp.ones((4, 16, 2, 32), U8),
                                           value_cache=jnp.ones((4, 16, 2, 32), U8)), {}, {},
                               "a uint8 cache needs kv_cache_dtype fp8_e4m3 or fp8_e5m2"),
    "paged kv_cache_dtype other": (PAGED, {}, {}, dict(kv_cache_dtype="fp8"),
                                   "kv_cache_dtype names a format other than the cache array's "
                                   "dtype"),
    # kernels/paged/validate.cc
    "paged query dtype": (PAGED, dict(query=jnp.ones((3, 4, 32), I32)), dict(out=((3, 4, 32), I32)),
                          {}, "paged_attention: query dtype must be float32, float16 or bfloat16"),
    "paged cache dtype": (PAGED, dict(key_cache=_normal((4, 16, 2, 32)),
                                      value_cache=_normal((4, 16, 2, 32))), {}, {},
                          "paged_attention: cache dtype must be query's or an fp8 format"),
    "paged gqa": (PAGED, dict(key_cache=_normal((4, 16, 3, 32), BF16),
                              value_cache=_normal((4, 16, 3, 32), BF16)), {}, {},
                  "paged_attention: num_heads (4) must be a multiple of num_heads_k (3)"),
    "paged head_dim range": (PAGED, dict(query=_normal((3, 4, 264), BF16),
                                         key_cache=_normal((4, 16, 2, 264), BF16),
                                         value_cache=_normal((4, 16, 2, 264), BF16)),
                             dict(out=((3, 4, 264), BF16)), {},
                             "paged_attention: head_dim must be in [1, 256], got 264"),
    "paged block_size": (PAGED, dict(key_cache=_normal((4, 0, 2, 32), BF16),
                                     value_cache=_normal((4, 0, 2, 32), BF16)), {}, {},
                         "paged_attention: sizes must be non-negative and block_size positive"),
    "paged soft_cap": (PAGED, {}, {}, dict(soft_cap=np.float32(-2)),
                       "paged_attention: soft_cap must be >= 0"),
    # cache write
    "cache key rank": (CACHE, dict(key=_normal((3, 64)), value=_normal((3, 64))), {}, {},
                       "key and value must be [num_tokens, num_heads_k, head_dim] of one dtype"),
    "cache value shape": (CACHE, dict(value=_normal((2, 2, 32))), {}, {},
                          "key and value must be [num_tokens, num_heads_k, head_dim] of one dtype"),
    "cache value dtype": (CACHE, dict(value=_normal((3, 2, 32), BF16)), {}, {},
                          "key and value must be [num_tokens, num_heads_k, head_dim] of one dtype"),
    "cache rank": (CACHE, dict(key_cache=_normal((64, 2, 32)), value_cache=_normal((64, 2, 32))),
                   dict(key_cache=((64, 2, 32), F32), value_cache=((64, 2, 32), F32)), {},
                   "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, "
                   "head_dim] of one dtype"),
    "cache shapes": (CACHE, dict(value_cache=_normal((3, 16, 2, 32))),
                     dict(value_cache=((3, 16, 2, 32), F32)), {},
                     "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, "
                     "head_dim] of one dtype"),
    "cache dtypes": (CACHE, dict(value_cache=_normal((4, 16, 2, 32), BF16)),
                     dict(value_cache=((4, 16, 2, 32), BF16)), {},
                     "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, "
                     "head_dim] of one dtype"),
    "cache key result shape": (CACHE, {}, dict(key_cache=((4, 8, 2, 32), F32)), {},
                               "results must have the caches' shapes and dtype"),
    "cache value result shape": (CACHE, {}, dict(value_cache=((4, 8, 2, 32), F32)), {},
                                 "results must have the caches' shapes and dtype"),
    "cache key result dtype": (CACHE, {}, dict(key_cache=((4, 16, 2, 32), U8)), {},
                               "results must have the caches' shapes and dtype"),
    "cache value result dtype": (CACHE, {}, dict(value_cache=((4, 16, 2, 32), BF16)), {},
                                 "results must have the caches' shapes and dtype"),
    "cache slot_mapping rank": (CACHE, dict(slot_mapping=jnp.array([[1, -1, 5]], I32)), {}, {},
                                "slot_mapping must be [num_tokens]"),
    "cache slot_mapping length": (CACHE, dict(slot_mapping=jnp.array([1, 5], I32)), {}, {},
                                  "slot_mapping must have one entry per token"),
    "cache heads": (CACHE, dict(key=_normal((3, 1, 32)), value=_normal((3, 1, 32))), {}, {},
                    "cache [.., num_heads_k, head_dim] must match key's"),
    "cache head_dim": (CACHE, dict(key=_normal((3, 2, 16)), value=_normal((3, 2, 16))), {}, {},
                       "cache [.., num_heads_k, head_dim] must match key's"),
    "cache k_scale dtype": (CACHE, dict(k_scale=jnp.ones((), BF16)), {}, {},
                            "k_scale and v_scale must be float32 scalars"),
    "cache v_scale count": (CACHE, dict(v_scale=jnp.ones((3,), F32)), {}, {},
                            "k_scale and v_scale must be float32 scalars"),
    "cache kv_cache_dtype name": (CACHE, {}, {}, dict(kv_cache_dtype="int8"),
                                  "kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2"),
    "cache uint8 auto": (CACHE, dict(key_cache=jnp.ones((4, 16, 2, 32), U8),
                                     value_cache=jnp.ones((4, 16, 2, 32), U8)),
                         dict(key_cache=((4, 16, 2, 32), U8), value_cache=((4, 16, 2, 32), U8)),
                         {}, "a uint8 cache needs kv_cache_dtype fp8_e4m3 or fp8_e5m2"),
    "cache kv_cache_dtype other": (CACHE, {}, {}, dict(kv_cache_dtype="fp8_e5m2"),
                                   "kv_cache_dtype names a format other than the cache array's "
                                   "dtype"),
    # kernels/cache/validate.cc
    "cache key dtype": (CACHE, dict(key=jnp.ones((3, 2, 32), I32), value=jnp.ones((3, 2, 32), I32)),
                        {}, {}, "reshape_and_cache_flash: key/value dtype must be float32, float16 "
                        "or bfloat16"),
    "cache dtype": (CACHE, dict(key=_normal((3, 2, 32), BF16), value=_normal((3, 2, 32), BF16)), {},
                    {}, "reshape_and_cache_flash: cache dtype must equal key's dtype or be an fp8 "
                    "format"),
    "cache slot_mapping dtype": (CACHE, dict(slot_mapping=jnp.array([1, 0, 5], jnp.uint32)), {}, {},
                                 "reshape_and_cache_flash: slot_mapping must be int32 or int64"),
}
VALIDATE_OPS = ("flash_fwd: ", "flash_bwd: ", "paged_attention: ", "reshape_and_cache_flash: ")


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_handler_refuses(case):
    target, operands, results, attrs, message = CASES[case]
    if not message.startswith(VALIDATE_OPS):  # the handler's own checks name the target
        message = f"{target}: {message}"
    with pytest.raises(Exception, match=re.escape(message)):
        _call(target, operands, results, attrs)
    _call(target)  # and the process keeps working


# The C ABI takes the params struct as filled: these checks of kernels/*/validate.cc
# are the only guard of sizes and pointers a custom call's shapes always make sound.
def _address(array):
    return array.ctypes.data


def _capi_base(op):
    """A valid params struct of `op` over small float32 numpy arrays (kept alive by
    the returned list), and the call that runs it on the Host."""
    from xla_attn import _capi

    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((10, 4, 32), np.float32), rng.standard_normal((12, 2, 32), np.float32)
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    lse, f32 = np.zeros((4, 10), np.float32), _capi.DTYPE_CODES["float32"]
    shared = dict(cu_seqlens_q=_address(cu_q), cu_seqlens_k=_address(cu_k), total_q=10,
                  total_k=12, batch=2, num_heads=4, num_heads_k=2, head_dim=32, max_seqlen_q=6,
                  max_seqlen_k=7, window_left=-1, window_right=-1, softmax_scale=0.1)
    keep = [q, k, cu_q, cu_k, lse]
    if op == "flash_fwd":
        out = np.empty_like(q)
        keep.append(out)
        params = _capi.FlashFwdParams().fill(
            q=_address(q), k=_address(k), v=_address(k), out=_address(out),
            softmax_lse=_address(lse), q_dtype=f32, kv_dtype=f32, out_dtype=f32, **shared)
        return params, _capi.flash_fwd, keep
    if op == "flash_bwd":
        grads = [np.empty_like(x) for x in (q, k, k)]
        keep += grads
        params = _capi.FlashBwdParams().fill(
            dout=_address(q), q=_address(q), k=_address(k), v=_address(k), out=_address(q),
            softmax_lse=_address(lse), dq=_address(grads[0]), dk=_address(grads[1]),
            dv=_address(grads[2]), dtype=f32, **shared)
        return params, _capi.flash_bwd, keep
    cache = rng.standard_normal((4, 16, 2, 32), np.float32)
    tables = np.array([[0, 1], [2, 3]], np.int32)
    keep += [cache, tables]
    if op == "paged_attention":
        query, out = q[:3], np.empty_like(q[:3])
        seq_lens, starts = np.array([5, 20], np.int32), np.array([0, 1, 3], np.int32)
        keep += [query, out, seq_lens, starts]
        params = _capi.PagedAttentionParams().fill(
            query=_address(query), key_cache=_address(cache), value_cache=_address(cache),
            out=_address(out), seq_lens=_address(seq_lens), block_tables=_address(tables),
            query_start_loc=_address(starts), total_q=3, max_num_seqs=2, num_heads=4,
            num_heads_k=2, head_dim=32, num_blocks=4, block_size=16, max_blocks_per_seq=2,
            scale=0.2, q_dtype=f32, cache_dtype=f32)
        return params, _capi.paged_attention, keep
    key, slots = k[:3], np.array([1, -1, 5], np.int32)
    keep += [key, slots]
    params = _capi.CacheWriteParams().fill(
        key=_address(key), value=_address(key), key_cache=_address(cache),
        value_cache=_address(cache), slot_mapping=_address(slots), num_tokens=3, num_slots=64,
        num_heads_k=2, head_dim=32, block_size=16, num_blocks=4, src_dtype=f32, cache_dtype=f32,
        slot_dtype=_capi.DTYPE_CODES["int32"])
    return params, _capi.reshape_and_cache_flash, keep


@pytest.mark.parametrize("op", ["flash_fwd", "flash_bwd", "paged_attention",
                                "reshape_and_cache_flash"])
def test_valid_capi_calls_run(op):
    params, run, _ = _capi_base(op)
    run(params, 0)


# (op, fields changed, message)
CAPI_CASES = {
    "fwd batch": ("flash_fwd", dict(batch=-1), "flash_fwd: batch must be >= 0, got -1"),
    "fwd num_heads": ("flash_fwd", dict(num_heads=0),
                      "flash_fwd: num_heads and num_heads_k must be positive"),
    "fwd num_heads_k": ("flash_fwd", dict(num_heads_k=0),
                        "flash_fwd: num_heads and num_heads_k must be positive"),
    "fwd head_dim": ("flash_fwd", dict(head_dim=0), "flash_fwd: head_dim must be in [1, 256], got 0"),
    "fwd total_q": ("flash_fwd", dict(total_q=-1), "flash_fwd: total_q and total_k must be >= 0"),
    "fwd total_k": ("flash_fwd", dict(total_k=-1), "flash_fwd: total_q and total_k must be >= 0"),
    "fwd cu_seqlens_q": ("flash_fwd", dict(cu_seqlens_q=0),
                         "flash_fwd: cu_seqlens_q and cu_seqlens_k are required"),
    "fwd cu_seqlens_k": ("flash_fwd", dict(cu_seqlens_k=0),
                         "flash_fwd: cu_seqlens_q and cu_seqlens_k are required"),
    "fwd alibi stride": ("flash_fwd", dict(alibi_batch_stride=2),
                         "flash_fwd: alibi_batch_stride must be 0 or num_heads"),
    "fwd q": ("flash_fwd", dict(q=0), "flash_fwd: q and out are required"),
    "fwd out": ("flash_fwd", dict(out=0), "flash_fwd: q and out are required"),
    "fwd k": ("flash_fwd", dict(k=0), "flash_fwd: k and v are required"),
    "fwd v": ("flash_fwd", dict(v=0), "flash_fwd: k and v are required"),
    "fwd paged sizes": ("flash_fwd", dict(block_table=1, num_blocks=-1, block_size=16),
                        "flash_fwd: paged K/V needs block_size > 0"),
    "fwd paged blocks": ("flash_fwd", dict(block_table=1, num_blocks=1, block_size=16,
                                           max_blocks_per_seq=-1),
                         "flash_fwd: paged K/V needs block_size > 0"),
    "fwd paged block_size": ("flash_fwd", dict(block_table=1, num_blocks=0, block_size=0,
                                               total_k=0),
                             "flash_fwd: paged K/V needs block_size > 0"),
    "fwd paged total_k": ("flash_fwd", dict(block_table=1, num_blocks=1, block_size=16),
                          "flash_fwd: paged total_k must be num_blocks * block_size"),
    "bwd lse": ("flash_bwd", dict(softmax_lse=0), "flash_bwd: softmax_lse is required"),
    "bwd dout": ("flash_bwd", dict(dout=0), "flash_bwd: dout, q, out and dq are required"),
    "bwd q": ("flash_bwd", dict(q=0), "flash_bwd: dout, q, out and dq are required"),
    "bwd out": ("flash_bwd", dict(out=0), "flash_bwd: dout, q, out and dq are required"),
    "bwd dq": ("flash_bwd", dict(dq=0), "flash_bwd: dout, q, out and dq are required"),
    "bwd k": ("flash_bwd", dict(k=0), "flash_bwd: k, v, dk and dv are required"),
    "bwd v": ("flash_bwd", dict(v=0), "flash_bwd: k, v, dk and dv are required"),
    "bwd dk": ("flash_bwd", dict(dk=0), "flash_bwd: k, v, dk and dv are required"),
    "bwd dv": ("flash_bwd", dict(dv=0), "flash_bwd: k, v, dk and dv are required"),
    "bwd batch": ("flash_bwd", dict(batch=-2), "flash_bwd: batch must be >= 0, got -2"),
    "paged max_num_seqs": ("paged_attention", dict(max_num_seqs=-1),
                           "paged_attention: sizes must be non-negative and block_size positive"),
    "paged total_q": ("paged_attention", dict(total_q=-1),
                      "paged_attention: sizes must be non-negative and block_size positive"),
    "paged num_blocks": ("paged_attention", dict(num_blocks=-1),
                         "paged_attention: sizes must be non-negative and block_size positive"),
    "paged max_blocks": ("paged_attention", dict(max_blocks_per_seq=-1),
                         "paged_attention: sizes must be non-negative and block_size positive"),
    "paged num_heads": ("paged_attention", dict(num_heads=0, num_heads_k=0),
                        "paged_attention: num_heads (0) must be a multiple of num_heads_k (0)"),
    "paged no heads": ("paged_attention", dict(num_heads=0),
                       "paged_attention: num_heads (0) must be a multiple of num_heads_k (2)"),
    "paged no kv heads": ("paged_attention", dict(num_heads_k=0),
                          "paged_attention: num_heads (4) must be a multiple of num_heads_k (0)"),
    "paged head_dim": ("paged_attention", dict(head_dim=0),
                       "paged_attention: head_dim must be in [1, 256], got 0"),
    "paged seq_lens": ("paged_attention", dict(seq_lens=0),
                       "paged_attention: seq_lens, block_tables and query_start_loc are required"),
    "paged block_tables": ("paged_attention", dict(block_tables=0),
                           "paged_attention: seq_lens, block_tables and query_start_loc are "
                           "required"),
    "paged query_start_loc": ("paged_attention", dict(query_start_loc=0),
                              "paged_attention: seq_lens, block_tables and query_start_loc are "
                              "required"),
    "paged query": ("paged_attention", dict(query=0), "paged_attention: query and out are required"),
    "paged out": ("paged_attention", dict(out=0), "paged_attention: query and out are required"),
    "paged key_cache": ("paged_attention", dict(key_cache=0),
                        "paged_attention: key_cache and value_cache are required"),
    "paged value_cache": ("paged_attention", dict(value_cache=0),
                          "paged_attention: key_cache and value_cache are required"),
    "cache num_tokens": ("reshape_and_cache_flash", dict(num_tokens=-1),
                         "reshape_and_cache_flash: sizes must be positive"),
    "cache num_heads_k": ("reshape_and_cache_flash", dict(num_heads_k=0),
                          "reshape_and_cache_flash: sizes must be positive"),
    "cache head_dim": ("reshape_and_cache_flash", dict(head_dim=0),
                       "reshape_and_cache_flash: sizes must be positive"),
    "cache block_size": ("reshape_and_cache_flash", dict(block_size=0, num_slots=0),
                         "reshape_and_cache_flash: sizes must be positive"),
    "cache num_blocks": ("reshape_and_cache_flash", dict(num_blocks=-1, num_slots=-16),
                         "reshape_and_cache_flash: sizes must be positive"),
    "cache num_slots": ("reshape_and_cache_flash", dict(num_slots=65),
                        "reshape_and_cache_flash: num_slots must be num_blocks * block_size"),
    "cache key": ("reshape_and_cache_flash", dict(key=0),
                  "reshape_and_cache_flash: null key/value/slot_mapping"),
    "cache value": ("reshape_and_cache_flash", dict(value=0),
                    "reshape_and_cache_flash: null key/value/slot_mapping"),
    "cache slot_mapping": ("reshape_and_cache_flash", dict(slot_mapping=0),
                           "reshape_and_cache_flash: null key/value/slot_mapping"),
    "cache key_cache": ("reshape_and_cache_flash", dict(key_cache=0),
                        "reshape_and_cache_flash: null cache pointer"),
    "cache value_cache": ("reshape_and_cache_flash", dict(value_cache=0),
                          "reshape_and_cache_flash: null cache pointer"),
}


@pytest.mark.parametrize("case", CAPI_CASES, ids=list(CAPI_CASES))
def test_capi_refuses(case):
    op, fields, message = CAPI_CASES[case]
    params, run, keep = _capi_base(op)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run(params.fill(**fields), 0)
    params, run, keep = _capi_base(op)  # and the process keeps working
    run(params, 0)


# Random damage: any raw call is refused with a message of ours, or runs and writes
# finite outputs; none crashes. (Under tools/sanitize_host.sh, as CI runs it, any read or
# write outside a buffer also fails it.)
DTYPES = [F32, BF16, jnp.float16, I32, U8, jnp.uint32]


@st.composite
def _damage(draw, shapes):
    """A change to one named array: (name, shape, dtype or None: keep, int values?)."""
    name = draw(st.sampled_from(sorted(shapes)))
    shape, dtype = shapes[name]
    kind = draw(st.sampled_from(["axis", "rank", "dtype", "values"]))
    shape = list(shape)
    if kind == "axis" and shape:
        axis = draw(st.integers(0, len(shape) - 1))
        shape[axis] = max(0, shape[axis] + draw(st.sampled_from([-1, 1, -shape[axis]])))
    elif kind == "rank":
        shape = shape[:-1] if shape and draw(st.booleans()) else shape + [1]
    elif kind == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
    return name, tuple(shape), dtype, kind == "values"


def _filled(shape, dtype, seed, hostile):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):  # indices: in range, or anywhere near it
        low, high = (-3, 40) if hostile else (0, 4)
        return jnp.asarray(rng.integers(low, high, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


ATTR_VALUES = {"window_left": [-2, -1, 0, 3, 1 << 31], "window_right": [-2, -1, 0, 3],
               "max_seqlen_q": [-1, 0, 1, 6, 1 << 40], "max_seqlen_k": [-1, 0, 1, 7],
               "softcap": [np.float32(-1), np.float32(0), np.float32(2)],
               "sliding_window": [-1, 0, 3], "max_query_len": [-1, 0, 1, 2, 9],
               "kv_cache_dtype": ["auto", "fp8", "fp8_e5m2", "x"]}


@pytest.mark.parametrize("target", TARGETS)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow],
          print_blob=True)
@given(data=st.data())
def test_damaged_raw_calls_are_refused_or_run_finite(target, data):
    operands, results, attrs = TARGETS[target]()
    shapes = {name: (x.shape, x.dtype) for name, x in operands.items()}
    shapes |= {"result " + name: spec for name, spec in results.items()}
    changed_operands, changed_results = {}, {}
    for i, (name, shape, dtype, hostile) in enumerate(
            data.draw(st.lists(_damage(shapes), min_size=1, max_size=3), label="damage")):
        if name.startswith("result "):
            changed_results[name[len("result "):]] = (shape, dtype)
        else:
            changed_operands[name] = _filled(shape, dtype, i, hostile)
    changed_attrs = {name: data.draw(st.sampled_from(values), label=name)
                     for name, values in ATTR_VALUES.items()
                     if name in attrs and data.draw(st.booleans(), label="change " + name)}
    try:
        outs = _call(target, changed_operands, changed_results, changed_attrs)
    except Exception as error:  # noqa: BLE001 - its message is what is checked
        assert re.match(rf"INVALID_ARGUMENT: ({target}: |{'|'.join(VALIDATE_OPS)})",
                        str(error)), str(error)
        event("refused")
        return
    event("ran")
    names = list((results | changed_results))
    for name, out in zip(names, outs):
        values = np.asarray(out).astype(np.float64)
        if name == "softmax_lse":  # +inf marks a row with no key in view
            values = values[values != np.inf]
        assert np.isfinite(values).all(), name
