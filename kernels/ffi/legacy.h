// Opaque descriptors of the legacy (untyped, api_version 2) custom calls, for runtimes
// that register only untyped targets (torch_xla <= 2.8 on CUDA). An untyped call sees
// raw buffer pointers and one byte string, so the string carries what the typed
// handlers read from buffer shapes and attributes: the scalar fields of the op's
// params struct. Layout (little-endian, packed): a header, then the op's body.
// src/xla_attn/_xla_legacy.py writes the same layout; a descriptor whose magic,
// version, op or size differ is refused with a message naming what differs. An op's
// body never changes: a new layout is a new op code (paged_attention_v2 beside 3).
#pragma once
#include <stdint.h>

#include "common/types.h"

#define XLA_ATTN_LEGACY_MAGIC 0x4C544158u  // the bytes "XATL"
#define XLA_ATTN_LEGACY_VERSION 1

// Ops, in the header's `op` field.
enum {
  XLA_ATTN_LEGACY_FLASH_FWD = 1,
  XLA_ATTN_LEGACY_FLASH_BWD = 2,
  XLA_ATTN_LEGACY_PAGED_ATTENTION = 3,
  XLA_ATTN_LEGACY_RESHAPE_AND_CACHE_FLASH = 4,
  XLA_ATTN_LEGACY_PAGED_ATTENTION_V2 = 5,
  XLA_ATTN_LEGACY_FLASH_BWD_V3 = 6,
};

#pragma pack(push, 1)
typedef struct xla_attn_legacy_header {
  uint32_t magic;
  uint16_t version;
  uint16_t op;
  uint32_t size;     // bytes of header + body
  uint32_t present;  // bit i: optional operand i (buffer index) is present; else null
} xla_attn_legacy_header;

// Buffers: q k v cu_seqlens_q cu_seqlens_k seqused_k block_table alibi_slopes q_descale
// k_descale v_descale | out softmax_lse workspace (the typed target's order).
typedef struct xla_attn_legacy_flash_fwd {
  xla_attn_legacy_header header;
  int64_t total_q, total_k, workspace_bytes;
  int32_t batch, num_heads, num_heads_k, head_dim, max_seqlen_q, max_seqlen_k;
  int32_t num_blocks, block_size, max_blocks_per_seq, alibi_batch_stride;
  int32_t window_left, window_right;
  float softmax_scale, softcap;
  int32_t q_dtype, kv_dtype, out_dtype;
} xla_attn_legacy_flash_fwd;

// Buffers: dout q k v out softmax_lse cu_seqlens_q cu_seqlens_k seqused_k alibi_slopes
// | dq dk dv.
typedef struct xla_attn_legacy_flash_bwd {
  xla_attn_legacy_header header;
  int64_t total_q, total_k;
  int32_t batch, num_heads, num_heads_k, head_dim, max_seqlen_q, max_seqlen_k;
  int32_t alibi_batch_stride, window_left, window_right;
  float softmax_scale, softcap;
  int32_t dtype;
} xla_attn_legacy_flash_bwd;

// xla_attn_flash_bwd_v3's. Buffers: dout q k v out softmax_lse cu_seqlens_q cu_seqlens_k
// seqused_k alibi_slopes dlse | dq dk dv workspace (0 bytes: the deterministic path).
typedef struct xla_attn_legacy_flash_bwd_v3 {
  xla_attn_legacy_flash_bwd v1;  // op 2's layout, header first (its op field says 6)
  int64_t workspace_bytes;
} xla_attn_legacy_flash_bwd_v3;

// Buffers: query key_cache value_cache seq_lens block_tables query_start_loc num_seqs
// k_scale v_scale | out workspace.
typedef struct xla_attn_legacy_paged_attention {
  xla_attn_legacy_header header;
  int64_t total_q, workspace_bytes;
  int32_t max_num_seqs, num_heads, num_heads_k, head_dim, num_blocks, block_size;
  int32_t max_blocks_per_seq, sliding_window;
  float scale, soft_cap;
  int32_t q_dtype, cache_dtype;
} xla_attn_legacy_paged_attention;

// xla_attn_paged_attention_v2's. Buffers: query key_cache value_cache seq_lens
// block_tables query_start_loc num_seqs k_scale v_scale alibi_slopes | out workspace.
typedef struct xla_attn_legacy_paged_attention_v2 {
  xla_attn_legacy_paged_attention v1;  // op 3's layout, header first (its op field says 5)
  int32_t max_query_len;               // <= 0: unknown
} xla_attn_legacy_paged_attention_v2;

// Buffers: key value key_cache value_cache slot_mapping k_scale v_scale | key_cache
// value_cache (results; the same buffers as operands 2 and 3 when aliased).
typedef struct xla_attn_legacy_reshape_and_cache_flash {
  xla_attn_legacy_header header;
  int64_t num_tokens, num_slots;
  int32_t num_heads_k, head_dim, block_size, num_blocks;
  int32_t src_dtype, cache_dtype, slot_dtype;
} xla_attn_legacy_reshape_and_cache_flash;
#pragma pack(pop)

XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_header) == 16, "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_flash_fwd) == 16 + 3 * 8 + 17 * 4,
                       "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_flash_bwd) == 16 + 2 * 8 + 12 * 4,
                       "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_flash_bwd_v3) == 16 + 3 * 8 + 12 * 4,
                       "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_paged_attention) == 16 + 2 * 8 + 12 * 4,
                       "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_reshape_and_cache_flash) == 16 + 2 * 8 + 7 * 4,
                       "legacy descriptor v1 layout");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_legacy_paged_attention_v2) == 16 + 2 * 8 + 13 * 4,
                       "legacy descriptor v1 layout");
