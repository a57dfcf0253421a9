"""Opaque descriptors of the legacy (untyped, api_version 2) custom calls: the byte
layout of kernels/ffi/legacy.h, written from Python. Untyped calls are what torch_xla
<= 2.8 can register on CUDA; the descriptor carries the scalar fields of the op's
params struct (what typed handlers read from buffer shapes and attributes).

Layout v1, little-endian, packed: header `magic u32, version u16, op u16, size u32,
present u32` (bit i of `present`: optional buffer i is there), then the op's fields.
An op's fields never change; a new layout gets a new op code (paged_attention_v2)."""

from __future__ import annotations

import struct

MAGIC = 0x4C544158  # b"XATL"
VERSION = 1
_HEADER = "<IHHII"

# op name -> (code, handler symbol, [(field, struct code)]) in kernels/ffi/legacy.h order.
_I64, _I32, _F32 = "q", "i", "f"
# The v1 bodies that a later op extends (legacy.h embeds the v1 struct, then appends).
_FLASH_BWD = [
    ("total_q", _I64), ("total_k", _I64), ("batch", _I32), ("num_heads", _I32),
    ("num_heads_k", _I32), ("head_dim", _I32), ("max_seqlen_q", _I32), ("max_seqlen_k", _I32),
    ("alibi_batch_stride", _I32), ("window_left", _I32), ("window_right", _I32),
    ("softmax_scale", _F32), ("softcap", _F32), ("dtype", _I32)]
_PAGED = [
    ("total_q", _I64), ("workspace_bytes", _I64), ("max_num_seqs", _I32), ("num_heads", _I32),
    ("num_heads_k", _I32), ("head_dim", _I32), ("num_blocks", _I32), ("block_size", _I32),
    ("max_blocks_per_seq", _I32), ("sliding_window", _I32), ("scale", _F32),
    ("soft_cap", _F32), ("q_dtype", _I32), ("cache_dtype", _I32)]
OPS = {
    "flash_fwd": (1, "XlaAttnFlashFwdV1Legacy", [
        ("total_q", _I64), ("total_k", _I64), ("workspace_bytes", _I64),
        ("batch", _I32), ("num_heads", _I32), ("num_heads_k", _I32), ("head_dim", _I32),
        ("max_seqlen_q", _I32), ("max_seqlen_k", _I32), ("num_blocks", _I32),
        ("block_size", _I32), ("max_blocks_per_seq", _I32), ("alibi_batch_stride", _I32),
        ("window_left", _I32), ("window_right", _I32), ("softmax_scale", _F32),
        ("softcap", _F32), ("q_dtype", _I32), ("kv_dtype", _I32), ("out_dtype", _I32)]),
    "flash_bwd": (2, "XlaAttnFlashBwdV1Legacy", _FLASH_BWD),
    # xla_attn_flash_bwd_v3: flash_bwd's body plus workspace_bytes; buffer 10 is dlse, the
    # results dq dk dv workspace.
    "flash_bwd_v3": (6, "XlaAttnFlashBwdV3Legacy", _FLASH_BWD + [("workspace_bytes", _I64)]),
    "paged_attention": (3, "XlaAttnPagedAttentionV1Legacy", _PAGED),
    # xla_attn_paged_attention_v2: a body of its own (bodies never change), v1's plus
    # max_query_len; buffer 9 is alibi_slopes.
    "paged_attention_v2": (5, "XlaAttnPagedAttentionV2Legacy",
                           _PAGED + [("max_query_len", _I32)]),
    "reshape_and_cache_flash": (4, "XlaAttnReshapeAndCacheFlashV1Legacy", [
        ("num_tokens", _I64), ("num_slots", _I64), ("num_heads_k", _I32), ("head_dim", _I32),
        ("block_size", _I32), ("num_blocks", _I32), ("src_dtype", _I32), ("cache_dtype", _I32),
        ("slot_dtype", _I32)]),
}


def _format(op: str) -> str:
    return _HEADER + "".join(code for _, code in OPS[op][2])


def size(op: str) -> int:
    return struct.calcsize(_format(op))


def encode(op: str, present: int, **fields) -> bytes:
    """The descriptor of `op`; `fields` must name every field of its body exactly."""
    code, _, layout = OPS[op]
    names = [name for name, _ in layout]
    missing, extra = set(names) - set(fields), set(fields) - set(names)
    if missing or extra:
        raise TypeError(f"legacy descriptor of {op}: missing {sorted(missing)}, "
                        f"unknown {sorted(extra)}")
    return struct.pack(_format(op), MAGIC, VERSION, code, size(op), present,
                       *(fields[name] for name in names))


def decode(op: str, data: bytes) -> dict:
    """The fields of a descriptor (header fields included), for tests and debugging."""
    values = struct.unpack(_format(op), data)
    header = dict(zip(("magic", "version", "op", "size", "present"), values[:5]))
    return header | dict(zip((name for name, _ in OPS[op][2]), values[5:]))


def present_mask(*operands) -> int:
    """Bit i set when operand i is there (not None and not zero-element)."""
    return sum(1 << i for i, x in enumerate(operands)
               if x is not None and (not hasattr(x, "numel") or x.numel() > 0))
