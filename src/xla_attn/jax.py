"""JAX frontend: the ops as XLA FFI custom calls (cpu and CUDA), differentiable
flash attention through jax.custom_vjp, and an in-place (aliased) cache write."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xla_attn import _native, _ops

__all__ = ["flash_attn_varlen", "flash_attn", "paged_attention", "reshape_and_cache_flash"]


@functools.cache
def _register() -> None:
    for target, (host, cuda) in _native.HANDLERS.items():
        jax.ffi.register_ffi_target(target, _native.capsule(host), platform="cpu")
        jax.ffi.register_ffi_target(target, _native.capsule(cuda), platform="CUDA")


def _call(target: str, results, *operands, aliases=None, **attributes):
    _register()
    attrs = {k: (np.float32(v) if isinstance(v, float) else v) for k, v in attributes.items()}
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential",
                            input_output_aliases=aliases)
    outputs = call(*operands, **attrs)
    # Inside shard_map a custom call's results vary along every mesh axis any operand
    # varies along; XLA's types do not say so by themselves.
    axes = frozenset().union(*(_vma(x) for x in operands))
    if not axes:
        return outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_vary(o, axes) for o in outputs)
    return _vary(outputs, axes)


def _vma(x) -> frozenset:
    """Mesh axes along which x varies inside shard_map (empty outside it). jax 0.7-0.8
    call them `aval.vma`, later releases `aval.manual_axis_type.varying`."""
    if not hasattr(jax, "typeof"):
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x, axes: frozenset):
    """x typed as varying along `axes` inside shard_map (a no-op elsewhere)."""
    missing = tuple(sorted(axes - _vma(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def _cotangent(g, primal, axes: frozenset):
    """A cotangent computed per shard from operands varying along `axes`, for a
    primal varying along fewer: the primal is shared by those shards (e.g. k/v
    replicated across head shards in MQA/GQA), so its gradient is the sum."""
    extra = tuple(sorted(axes - _vma(primal)))
    return jax.lax.psum(g, extra) if extra else g


def _absent(dtype) -> jax.Array:
    """An optional operand that is not there: a zero-element buffer (docs/xla-targets.md)."""
    return jnp.zeros((0,), dtype)


def _or_absent(x, dtype):
    return _absent(dtype) if x is None else jnp.asarray(x)


# ---------------------------------------------------------------- flash attention
def _flash_fwd(spec: _ops.FlashSpec, q, k, v, cu_q, cu_k, seqused_k, block_table, alibi,
               q_descale=None, k_descale=None, v_descale=None):
    total_q, num_heads, head_dim = q.shape
    workspace = _native.flash_fwd_workspace_size(total_q, cu_q.shape[0] - 1, num_heads, head_dim,
                                                 spec.max_seqlen_q, spec.max_seqlen_k)
    results = (jax.ShapeDtypeStruct(q.shape, jnp.dtype(spec.out_dtype)),
               jax.ShapeDtypeStruct((num_heads, total_q), jnp.float32),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out, lse, _ = _call("xla_attn_flash_fwd_v1", results, q, k, v, cu_q, cu_k,
                        _or_absent(seqused_k, jnp.int32), _or_absent(block_table, jnp.int32),
                        _or_absent(alibi, jnp.float32), _or_absent(q_descale, jnp.float32),
                        _or_absent(k_descale, jnp.float32), _or_absent(v_descale, jnp.float32),
                        **spec.attributes())
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_diff(spec, q, k, v, cu_q, cu_k, seqused_k, alibi):
    return _flash_fwd(spec, q, k, v, cu_q, cu_k, seqused_k, None, alibi)


def _flash_diff_fwd(spec, q, k, v, cu_q, cu_k, seqused_k, alibi):
    out, lse = _flash_fwd(spec, q, k, v, cu_q, cu_k, seqused_k, None, alibi)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi)


def _flash_diff_bwd(spec, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi = residuals
    dout, _ = cotangents  # softmax_lse is an auxiliary output: not differentiated (as flash-attn)
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dq, dk, dv = _call("xla_attn_flash_bwd_v1", results, dout.astype(q.dtype), q, k, v, out, lse,
                       cu_q, cu_k, _or_absent(seqused_k, jnp.int32),
                       _or_absent(alibi, jnp.float32), **spec.attributes())
    axes = _vma(dq)
    return (_cotangent(dq, q, axes), _cotangent(dk, k, axes), _cotangent(dv, v, axes),
            None, None, None, None)


_flash_diff.defvjp(_flash_diff_fwd, _flash_diff_bwd)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, seqused_k=None, block_table=None,
                      return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None):
    """Flash attention over packed variable-length sequences (flash-attn's
    `flash_attn_varlen_func`). q `(total_q, H, D)`; k, v `(total_k, Hk, D)` or, with
    `block_table`, a paged cache `(num_blocks, block_size, Hk, D)`. Returns out like q
    (bf16 for fp8 q) and, if asked, softmax_lse `(H, total_q)` float32.
    Differentiable in q, k, v when not paged and not fp8."""
    spec = _ops.flash_varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  seqused_k, block_table, q_descale, k_descale, v_descale)
    q, k, v, cu_q, cu_k = map(jnp.asarray, (q, k, v, cu_seqlens_q, cu_seqlens_k))
    if spec.paged or spec.out_dtype != q.dtype:
        out, lse = _flash_fwd(spec, q, k, v, cu_q, cu_k, seqused_k, block_table, alibi_slopes,
                              q_descale, k_descale, v_descale)
    else:
        out, lse = _flash_diff(spec, q, k, v, cu_q, cu_k,
                               None if seqused_k is None else jnp.asarray(seqused_k),
                               None if alibi_slopes is None else jnp.asarray(alibi_slopes))
    return (out, lse) if return_softmax_lse else out


def flash_attn(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, return_softmax_lse=False):
    """Dense-layout flash attention: q `(B, Sq, H, D)`, k and v `(B, Sk, Hk, D)` (the
    layout of `jax.nn.dot_product_attention`). softmax_lse is `(B, H, Sq)`."""
    b, sq, sk = _ops.flash_dense_check(q, k, v)
    q, k, v = map(jnp.asarray, (q, k, v))
    cu_q = jnp.arange(b + 1, dtype=jnp.int32) * sq
    cu_k = jnp.arange(b + 1, dtype=jnp.int32) * sk
    out, lse = flash_attn_varlen(
        q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, sq, sk, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        return_softmax_lse=True)
    out = out.reshape(q.shape[:3] + out.shape[-1:])
    if not return_softmax_lse:
        return out
    return out, lse.reshape(lse.shape[0], b, sq).transpose(1, 0, 2)


# ---------------------------------------------------------------- paged attention
def paged_attention(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc, scale,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, num_seqs=None,
                    kv_cache_dtype="auto"):
    """Attention of ragged query spans over a paged KV cache (decode and short
    prefill chunks). query `(total_q, H, D)`; caches `(num_blocks, block_size, Hk, D)`
    (float like query, float8, or uint8 with `kv_cache_dtype`); `num_seqs` an int32
    device scalar counting the real rows of a padded batch."""
    spec = _ops.paged_attention_spec(query, key_cache, value_cache, seq_lens, block_tables,
                                     query_start_loc, scale, sliding_window, soft_cap, k_scale,
                                     v_scale, num_seqs, kv_cache_dtype)
    query = jnp.asarray(query)
    total_q, num_heads, head_dim = query.shape
    workspace = _native.paged_attention_workspace_size(
        total_q, seq_lens.shape[0], num_heads, head_dim, block_tables.shape[1], key_cache.shape[1])
    results = (jax.ShapeDtypeStruct(query.shape, query.dtype),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out, _ = _call("xla_attn_paged_attention_v1", results, query, jnp.asarray(key_cache),
                 jnp.asarray(value_cache), jnp.asarray(seq_lens), jnp.asarray(block_tables),
                 jnp.asarray(query_start_loc), _or_absent(num_seqs, jnp.int32),
                   _or_absent(k_scale, jnp.float32), _or_absent(v_scale, jnp.float32),
                   **spec.attributes())
    return out


# ---------------------------------------------------------------- KV-cache write
def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                            kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """Scatter `key`/`value` `(num_tokens, Hk, D)` into the paged caches at
    `slot_mapping` (slot -1 skipped); fp8 formats quantize as `x / scale`. Returns the
    updated `(key_cache, value_cache)`, aliased onto the inputs: under `jax.jit` with
    the caches donated the update happens in place."""
    fmt = _ops.reshape_and_cache_flash_spec(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                k_scale, v_scale)
    key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
    results = (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
               jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    return _call("xla_attn_reshape_and_cache_flash_v1", results, jnp.asarray(key),
                 jnp.asarray(value), key_cache, value_cache, jnp.asarray(slot_mapping),
                 _or_absent(k_scale, jnp.float32), _or_absent(v_scale, jnp.float32),
                 aliases={2: 0, 3: 1}, kv_cache_dtype=fmt)
