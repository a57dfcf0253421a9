"""torch_xla frontend: XLA implementations of the `torch.ops.xla_attn.*` ops of
`xla_attn.torch` (the same ops, autograd and fake kernels), emitting our custom calls
into torch_xla's lazy graph, so they run inside compiled graphs (lazy tensors and
`torch.compile(backend="openxla")`) with no host round trip.

On CPU (torch_xla 2.9, PJRT_DEVICE=CPU) they are typed FFI calls of the Host handlers;
on CUDA (torch_xla <= 2.8) legacy untyped calls (see _torch_xla_call). The public
functions take the arguments of `xla_attn.torch`, plus `partition_spec` / `mesh` as
torch_xla's `flash_attention` does: under SPMD the op runs on each device's shards
(manual sharding), which needs the heads sharded and sequences whole.

The cache write updates the caches in place: the call aliases its cache results onto
the cache operands, so with the caches donated (`donate`) nothing is copied; without
donation XLA copies each cache once (correct, not in place)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:
    import torch_xla
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("xla_attn.torch_xla needs torch_xla (pip install torch_xla)") from e

from xla_attn import _native, _ops, _torch_xla_call, _torch_xla_spmd
from xla_attn import torch as _torch
from xla_attn.torch import _cache_code

__all__ = ["flash_attn_varlen", "flash_attn", "paged_attention", "reshape_and_cache_flash",
           "donate"]


def _code(x: Tensor) -> int:
    return _native.DTYPE_CODES[_ops.dtype_name(x)]


def _or_absent(x: Optional[Tensor], dtype: torch.dtype, device) -> Tensor:
    """An absent optional operand is a zero-element buffer (docs/xla-targets.md)."""
    return torch.zeros(0, dtype=dtype, device=device) if x is None else x


def _alibi_stride(alibi: Optional[Tensor], batch: int, num_heads: int) -> int:
    return num_heads if alibi is not None and alibi.dim() == 2 and batch > 1 else 0


# ---------------------------------------------------------------- XLA kernels of the ops
@torch.library.register_kernel("xla_attn::flash_fwd", "xla")
def _flash_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
               q_descale, k_descale, v_descale, softmax_scale, softcap, window_left,
               window_right, max_seqlen_q, max_seqlen_k, deterministic=False):
    spec = _ops.flash_varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, False, (window_left, window_right),
                                  softcap, alibi_slopes, seqused_k, block_table, q_descale,
                                  k_descale, v_descale, op="xla_attn::flash_fwd")
    total_q, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out_dtype = getattr(torch, spec.out_dtype)
    paged = block_table is not None
    workspace = _native.flash_fwd_workspace_size(
        total_q, batch, num_heads, head_dim, max_seqlen_q, max_seqlen_k, tuple(k.shape),
        str(k.dtype).removeprefix("torch."), paged)
    dev = q.device
    operands = [q, k, v, cu_seqlens_q, cu_seqlens_k, _or_absent(seqused_k, torch.int32, dev),
                _or_absent(block_table, torch.int32, dev),
                _or_absent(alibi_slopes, torch.float32, dev)] + [
        _or_absent(x, torch.float32, dev) for x in (q_descale, k_descale, v_descale)]
    legacy = dict(
        total_q=total_q, total_k=k.shape[0] * k.shape[1] if paged else k.shape[0],
        workspace_bytes=workspace, batch=batch, num_heads=num_heads, num_heads_k=k.shape[-2],
        head_dim=head_dim, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        num_blocks=k.shape[0] if paged else 0, block_size=k.shape[1] if paged else 0,
        max_blocks_per_seq=block_table.shape[1] if paged else 0,
        alibi_batch_stride=_alibi_stride(alibi_slopes, batch, num_heads),
        window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
        softcap=softcap, q_dtype=_code(q), kv_dtype=_code(k),
        out_dtype=_native.DTYPE_CODES[spec.out_dtype])
    out, lse, _ = _torch_xla_call.emit(
        "flash_fwd", "xla_attn_flash_fwd_v1", operands,
        [(q.shape, out_dtype), ((num_heads, total_q), torch.float32),
         ((workspace,), torch.uint8)], spec.attributes(), legacy)
    return out, lse


@torch.library.register_kernel("xla_attn::flash_bwd", "xla")
def _flash_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
               alibi_slopes, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
               max_seqlen_k, deterministic=False, dlse=None):
    # v3 (dlse may be absent) with its workspace, which takes the tensor-core family onto
    # its atomic-dQ path as the other frontends' default; deterministic: a 0-byte workspace.
    spec = _ops.flash_varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, False, (window_left, window_right),
                                  softcap, alibi_slopes, seqused_k, None, None, None, None,
                                  op="xla_attn::flash_bwd")
    total_q, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    dev = q.device
    operands = [dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                _or_absent(seqused_k, torch.int32, dev),
                _or_absent(alibi_slopes, torch.float32, dev)]
    legacy = dict(
        total_q=total_q, total_k=k.shape[0], batch=batch, num_heads=num_heads,
        num_heads_k=k.shape[1], head_dim=head_dim, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, alibi_batch_stride=_alibi_stride(alibi_slopes, batch,
                                                                    num_heads),
        window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
        softcap=softcap, dtype=_code(q))
    workspace = 0 if deterministic else _native.flash_bwd_workspace_size(
        total_q, batch, num_heads, head_dim, _ops.dtype_name(q))
    dlse = _or_absent(None if dlse is None else dlse.to(torch.float32), torch.float32, dev)
    dq, dk, dv, _ = _torch_xla_call.emit(
        "flash_bwd_v3", "xla_attn_flash_bwd_v3", operands + [dlse],
        [(x.shape, x.dtype) for x in (q, k, v)] + [((workspace,), torch.uint8)],
        spec.attributes(), legacy | dict(workspace_bytes=workspace))
    return dq, dk, dv


@torch.library.register_kernel("xla_attn::paged_attention", "xla")
def _paged_attention(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                     num_seqs, k_scale, v_scale, alibi_slopes, scale, soft_cap, sliding_window,
                     kv_cache_dtype, max_query_len):
    op = "xla_attn::paged_attention"
    spec = _ops.paged_attention_spec(query, key_cache, value_cache, seq_lens, block_tables,
                                     query_start_loc, scale,
                                     sliding_window if sliding_window > 0 else None, soft_cap,
                                     k_scale, v_scale, num_seqs, kv_cache_dtype, alibi_slopes,
                                     max_query_len if max_query_len > 0 else None)
    total_q, num_heads, head_dim = query.shape
    num_blocks, block_size, num_heads_k, _ = key_cache.shape
    workspace = _native.paged_attention_workspace_size(
        total_q, seq_lens.shape[0], num_heads, head_dim, block_tables.shape[1], block_size,
        spec.max_query_len)
    dev = query.device
    operands = [query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                _or_absent(num_seqs, torch.int32, dev), _or_absent(k_scale, torch.float32, dev),
                _or_absent(v_scale, torch.float32, dev),
                _or_absent(alibi_slopes, torch.float32, dev)]
    legacy = dict(
        total_q=total_q, workspace_bytes=workspace, max_num_seqs=seq_lens.shape[0],
        num_heads=num_heads, num_heads_k=num_heads_k, head_dim=head_dim,
        num_blocks=num_blocks, block_size=block_size, max_blocks_per_seq=block_tables.shape[1],
        sliding_window=spec.sliding_window, scale=spec.scale, soft_cap=spec.soft_cap,
        q_dtype=_code(query), cache_dtype=_cache_code(op, key_cache, spec.kv_cache_dtype),
        max_query_len=spec.max_query_len)
    out, _ = _torch_xla_call.emit(
        "paged_attention_v2", "xla_attn_paged_attention_v2", operands,
        [(query.shape, query.dtype), ((workspace,), torch.uint8)], spec.attributes(), legacy)
    return out


# torch_xla numbers graph parameters in the reverse of the order it meets them, and
# XLA pairs donated parameters with same-shaped results in parameter order. Handing
# it value_cache before key_cache gives key_cache the lower parameter number, like its
# result, so each cache's result lands in its own buffer and the aliased call writes
# in place (the other way round XLA pairs them crosswise and copies both caches).
_CACHE_OPERAND_ORDER = (3, 2, 0, 1, 4, 5, 6)


# The cache write mutates its caches, and torch_xla runs every XLA tensor through
# functionalization, whose generic fallback refuses mutable custom ops. So the write
# has a functional twin returning the new caches, and a Functionalize kernel maps the
# mutable op onto it (eagerly and under torch.compile, where torch uses that kernel
# instead of auto_functionalized). On CPU/CUDA the twin writes into copies of the
# caches: only compiled graphs of the torch frontend take that path, and only in a
# process that imported this module.
@torch.library.custom_op("xla_attn::reshape_and_cache_flash_functional", mutates_args=(),
                         device_types=("xla", "cpu", "cuda"))
def _cache_write(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                 slot_mapping: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                 kv_cache_dtype: str) -> tuple[Tensor, Tensor]:
    if key.device.type != "xla":
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
        torch.ops.xla_attn.reshape_and_cache_flash(key, value, key_cache, value_cache,
                                                   slot_mapping, k_scale, v_scale,
                                                   kv_cache_dtype)
        return key_cache, value_cache
    op = "xla_attn::reshape_and_cache_flash"
    fmt = _ops.reshape_and_cache_flash_spec(key, value, key_cache, value_cache, slot_mapping,
                                            kv_cache_dtype, k_scale, v_scale)
    num_blocks, block_size, num_heads_k, head_dim = key_cache.shape
    dev = key.device
    operands = [key, value, key_cache, value_cache, slot_mapping,
                _or_absent(k_scale, torch.float32, dev), _or_absent(v_scale, torch.float32, dev)]
    legacy = dict(
        num_tokens=key.shape[0], num_slots=num_blocks * block_size, num_heads_k=num_heads_k,
        head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, src_dtype=_code(key),
        cache_dtype=_cache_code(op, key_cache, fmt), slot_dtype=_code(slot_mapping))
    new_key_cache, new_value_cache = _torch_xla_call.emit(
        "reshape_and_cache_flash", "xla_attn_reshape_and_cache_flash_v1", operands,
        [(key_cache.shape, key_cache.dtype), (value_cache.shape, value_cache.dtype)],
        {"kv_cache_dtype": fmt}, legacy, aliases={0: 2, 1: 3},
        operand_order=_CACHE_OPERAND_ORDER)
    return new_key_cache, new_value_cache


@_cache_write.register_fake
def _cache_write_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                      kv_cache_dtype):
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


def _cache_write_functionalize(key, value, key_cache, value_cache, slot_mapping, k_scale,
                               v_scale, kv_cache_dtype):
    tensors = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    for t in tensors:
        if t is not None:
            torch._sync(t)
    inner = [None if t is None else torch._from_functional_tensor(t) for t in tensors]
    functionalize = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    with torch._C._ExcludeDispatchKeyGuard(functionalize):
        new_key_cache, new_value_cache = torch.ops.xla_attn.reshape_and_cache_flash_functional(
            *inner, kv_cache_dtype)
    for cache, new in ((key_cache, new_key_cache), (value_cache, new_value_cache)):
        torch._functionalize_replace(cache, new)
        torch._functionalize_commit_update(cache)
        torch._sync(cache)


_LIBRARY = torch.library.Library("xla_attn", "IMPL")  # the registration lives as long as it
_LIBRARY.impl("reshape_and_cache_flash", _cache_write_functionalize, "Functionalize")


@torch.library.register_kernel("xla_attn::reshape_and_cache_flash", "xla")
def _reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                             kv_cache_dtype):
    """Reached only with torch_xla's functionalization off (XLA_DISABLE_FUNCTIONALIZATION)."""
    new_key_cache, new_value_cache = torch.ops.xla_attn.reshape_and_cache_flash_functional(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, kv_cache_dtype)
    key_cache.copy_(new_key_cache)
    value_cache.copy_(new_value_cache)


# ---------------------------------------------------------------- public functions
def donate(*tensors: Tensor) -> None:
    """Marks XLA tensors (e.g. KV caches) as buffer donors, so the graph that updates
    them in place writes into their buffers instead of copies. In lazy mode a donation
    covers the next execution (call it every step, before `torch_xla.sync()`); a graph
    compiled by torch.compile(backend="openxla") keeps donating them."""
    # Only a materialized buffer can be donated: run what is pending on them first.
    pending = [t for t, p in zip(tensors, torch_xla._XLAC._check_tensor_need_materialization(
        list(tensors))) if p]
    if pending:
        torch_xla._XLAC._xla_sync_multi(pending, devices=[], wait=True)
    for t in tensors:
        if not torch_xla._XLAC._set_buffer_donation(t, True):
            raise RuntimeError("xla_attn.torch_xla.donate: torch_xla refused to donate a "
                               f"tensor of shape {tuple(t.shape)} (not backed by a buffer)")


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, seqused_k=None, block_table=None,
                      return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None,
                      partition_spec=None, mesh=None):
    """xla_attn.torch.flash_attn_varlen on XLA tensors. `partition_spec` (of q's
    `(total_q, H, D)`, e.g. `(None, "model", None)`) runs it per head shard under SPMD;
    k/v (and a paged cache) are sharded the same way on their heads."""
    kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                  softcap=softcap, return_softmax_lse=True)
    if partition_spec is None:
        out, lse = _torch.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, alibi_slopes=alibi_slopes,
                                            seqused_k=seqused_k, block_table=block_table,
                                            q_descale=q_descale, k_descale=k_descale,
                                            v_descale=v_descale, **kwargs)
        return (out, lse) if return_softmax_lse else out
    op = "flash_attn_varlen"
    heads = _torch_xla_spmd.heads_axis(op, partition_spec, 3, 1)
    _torch_xla_spmd.check_heads(op, mesh, heads, q.shape[1], k.shape[-2])
    kv_spec = (None, None, heads, None) if block_table is not None else (None, heads, None)
    alibi_spec = (heads,) if alibi_slopes is None or alibi_slopes.dim() == 1 else (None, heads)
    total_k = k.shape[0] * k.shape[1] if block_table is not None else k.shape[0]
    max_seqlen_q = q.shape[0] if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = total_k if max_seqlen_k is None else max_seqlen_k

    def local(q, k, v, cu_q, cu_k, used, table, alibi, qd, kd, vd):
        return _torch.flash_attn_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                        alibi_slopes=alibi, seqused_k=used, block_table=table,
                                        q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)

    out, lse = _torch_xla_spmd.run(
        local, [q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
                q_descale, k_descale, v_descale],
        [(None, heads, None), kv_spec, kv_spec, (None,), (None,), (None,), (None, None),
         alibi_spec, (None,) * (q_descale.dim() if q_descale is not None else 0),
         (None,) * (k_descale.dim() if k_descale is not None else 0),
         (None,) * (v_descale.dim() if v_descale is not None else 0)],
        [(None, heads, None), (heads, None)], mesh)
    return (out, lse) if return_softmax_lse else out


def flash_attn(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, return_softmax_lse=False, q_segment_ids=None,
               kv_segment_ids=None, max_segments=None, partition_spec=None, mesh=None):
    """xla_attn.torch.flash_attn on XLA tensors (segment ids converted on the device,
    no host sync). `partition_spec` (of q's `(B, S, H, D)`) may shard the batch and the
    heads, e.g. `("data", None, "model", None)`."""
    kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                  softcap=softcap, return_softmax_lse=True, max_segments=max_segments)
    if partition_spec is None:
        out, lse = _torch.flash_attn(q, k, v, alibi_slopes=alibi_slopes,
                                     q_segment_ids=q_segment_ids,
                                     kv_segment_ids=kv_segment_ids, **kwargs)
        return (out, lse) if return_softmax_lse else out
    op = "flash_attn"
    heads = _torch_xla_spmd.heads_axis(op, partition_spec, 4, 2, allowed=(0,))
    _torch_xla_spmd.check_heads(op, mesh, heads, q.shape[2], k.shape[2])
    batch = tuple(partition_spec)[0]
    spec = (batch, None, heads, None)
    alibi_spec = (heads,) if alibi_slopes is None or alibi_slopes.dim() == 1 else (batch, heads)

    def local(q, k, v, alibi, q_ids, kv_ids):
        return _torch.flash_attn(q, k, v, alibi_slopes=alibi, q_segment_ids=q_ids,
                                 kv_segment_ids=kv_ids, **kwargs)

    out, lse = _torch_xla_spmd.run(
        local, [q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids],
        [spec, spec, spec, alibi_spec, (batch, None), (batch, None)],
        [spec, (batch, heads, None)], mesh)
    return (out, lse) if return_softmax_lse else out


def paged_attention(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc, scale,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, num_seqs=None,
                    kv_cache_dtype="auto", alibi_slopes=None, max_query_len=None,
                    partition_spec=None, mesh=None):
    """xla_attn.torch.paged_attention on XLA tensors. `partition_spec` (of query's
    `(total_q, H, D)`) shards the heads; the caches are sharded on theirs and
    alibi_slopes with the query heads."""
    args = (scale, sliding_window, soft_cap)
    kwargs = dict(kv_cache_dtype=kv_cache_dtype, max_query_len=max_query_len)
    if partition_spec is None:
        return _torch.paged_attention(query, key_cache, value_cache, seq_lens, block_tables,
                                      query_start_loc, *args, k_scale=k_scale, v_scale=v_scale,
                                      num_seqs=num_seqs, alibi_slopes=alibi_slopes, **kwargs)
    op = "paged_attention"
    heads = _torch_xla_spmd.heads_axis(op, partition_spec, 3, 1)
    _torch_xla_spmd.check_heads(op, mesh, heads, query.shape[1], key_cache.shape[2])
    cache_spec = (None, None, heads, None)

    def local(query, kc, vc, lens, tables, qsl, n, ks, vs, alibi):
        out = _torch.paged_attention(query, kc, vc, lens, tables, qsl, *args, k_scale=ks,
                                     v_scale=vs, num_seqs=n, alibi_slopes=alibi, **kwargs)
        return (out,)

    scalars = [None if x is None else (None,) * x.dim() for x in (num_seqs, k_scale, v_scale)]
    (out,) = _torch_xla_spmd.run(
        local, [query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                num_seqs, k_scale, v_scale, alibi_slopes],
        [(None, heads, None), cache_spec, cache_spec, (None,), (None, None), (None,)] + scalars
        + [(heads,)],
        [(None, heads, None)], mesh)
    return out


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                            kv_cache_dtype="auto", k_scale=None, v_scale=None,
                            partition_spec=None, mesh=None):
    """xla_attn.torch.reshape_and_cache_flash on XLA tensors: the caches are updated in
    place (see `donate`). `partition_spec` (of key's `(num_tokens, Hk, D)`) shards the
    kv heads; the caches are sharded on theirs."""
    if partition_spec is None:
        _torch.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                       kv_cache_dtype, k_scale, v_scale)
        return
    op = "reshape_and_cache_flash"
    heads = _torch_xla_spmd.heads_axis(op, partition_spec, 3, 1)
    _torch_xla_spmd.check_heads(op, mesh, heads, key.shape[1], key_cache.shape[2])
    cache_spec = (None, None, heads, None)

    def local(key, value, kc, vc, slots, ks, vs):
        _torch.reshape_and_cache_flash(key, value, kc, vc, slots, kv_cache_dtype, ks, vs)
        return kc, vc

    scalars = [None if x is None else (None,) * x.dim() for x in (k_scale, v_scale)]
    new_key_cache, new_value_cache = _torch_xla_spmd.run(
        local, [key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale],
        [(None, heads, None), (None, heads, None), cache_spec, cache_spec, (None,)] + scalars,
        [cache_spec, cache_spec], mesh)
    key_cache.copy_(new_key_cache)
    value_cache.copy_(new_value_cache)
