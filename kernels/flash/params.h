// Flash attention (varlen, optionally paged K/V): the one struct that crosses from
// bindings (XLA FFI handlers, C ABI) into kernels, forward and backward.
// All tensors are dense row-major; sizes are in elements.
#pragma once
#include "common/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct xla_attn_flash_fwd_params {
  const void* q;                // [total_q, num_heads, head_dim]                q_dtype
  const void* k;                // [total_k, num_heads_k, head_dim]              kv_dtype
                                //   paged: [num_blocks, block_size, num_heads_k, head_dim]
  const void* v;                // same shape and dtype as k
  void* out;                    // [total_q, num_heads, head_dim]                out_dtype
  float* softmax_lse;           // [num_heads, total_q] or null
  const int32_t* cu_seqlens_q;  // [batch + 1]; rows >= cu_seqlens_q[batch] are padding
  const int32_t* cu_seqlens_k;  // [batch + 1]; paged: only the lengths are used, and
                                //   sequence b's keys sit at positions 0.. of its pages
  const int32_t* seqused_k;     // [batch] or null: keys used per sequence (overrides lengths)
  const int32_t* block_table;   // [batch, max_blocks_per_seq] or null (not paged)
  const float* alibi_slopes;    // [num_heads] or [batch, num_heads] or null
  const float* q_descale;       // [1] or null; fp8 inputs only
  const float* k_descale;       // [1] or null
  const float* v_descale;       // [1] or null
  const int32_t* batch_used;    // [1] device scalar or null: sequences b >= *batch_used are
                                //   padding (paged_attention's num_seqs)
  void* workspace;              // device scratch of workspace_bytes (split-KV partials) or null
  int64_t total_q;
  int64_t total_k;              // rows of k; paged: num_blocks * block_size
  int64_t workspace_bytes;      // what xla_attn_workspace_size() asked for
  int32_t batch;
  int32_t num_heads;
  int32_t num_heads_k;          // num_heads % num_heads_k == 0 (MQA/GQA)
  int32_t head_dim;
  int32_t max_seqlen_q;         // launch-size hints; never trusted for memory safety
  int32_t max_seqlen_k;
  int32_t num_blocks;           // paged only (else 0)
  int32_t block_size;           // paged only (else 0)
  int32_t max_blocks_per_seq;   // paged only (else 0)
  int32_t alibi_batch_stride;   // 0: slopes shared by all sequences; num_heads: per sequence
  int32_t window_left;          // -1: unbounded
  int32_t window_right;         // -1: unbounded; causal is window_right = 0
  float softmax_scale;
  float softcap;                // 0: off; else softcap * tanh(s / softcap) before masking
  xla_attn_dtype q_dtype;
  xla_attn_dtype kv_dtype;
  xla_attn_dtype out_dtype;
  int32_t num_splits;           // key-range splits per (row block, head); 0: the kernel decides
  int32_t decode_max_q;         // > 0: sequences with at most this many queries belong to
                                //   paged_attention's decode kernel and are skipped here
                                //   (outputs left alone); 0: every sequence is ours
} xla_attn_flash_fwd_params;

typedef struct xla_attn_flash_bwd_params {
  const void* dout;             // [total_q, num_heads, head_dim]                dtype
  const void* q;                // [total_q, num_heads, head_dim]                dtype
  const void* k;                // [total_k, num_heads_k, head_dim]              dtype
  const void* v;                // [total_k, num_heads_k, head_dim]              dtype
  const void* out;              // [total_q, num_heads, head_dim]                dtype
  const float* softmax_lse;     // [num_heads, total_q]
  void* dq;                     // [total_q, num_heads, head_dim]                dtype
  void* dk;                     // [total_k, num_heads_k, head_dim]              dtype
  void* dv;                     // [total_k, num_heads_k, head_dim]              dtype
  void* workspace;              // device scratch (kernel-defined) or null
  const int32_t* cu_seqlens_q;  // [batch + 1]
  const int32_t* cu_seqlens_k;  // [batch + 1]
  const int32_t* seqused_k;     // [batch] or null
  const float* alibi_slopes;    // [num_heads] or [batch, num_heads] or null
  int64_t total_q;
  int64_t total_k;
  int64_t workspace_bytes;
  int32_t batch;
  int32_t num_heads;
  int32_t num_heads_k;
  int32_t head_dim;
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
  int32_t alibi_batch_stride;
  int32_t window_left;
  int32_t window_right;
  float softmax_scale;
  float softcap;
  xla_attn_dtype dtype;
  const float* dlse;  // [num_heads, total_q] or null: softmax_lse's cotangent, which adds
                      //   p_ij dlse_i to dS_ij (the kernels take D_i = dout_i . out_i - dlse_i)
} xla_attn_flash_bwd_params;

XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_flash_fwd_params) == 15 * 8 + 3 * 8 + 20 * 4,
                       "flash_fwd params layout is part of the C ABI v1");
XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_flash_bwd_params) == 14 * 8 + 3 * 8 + 12 * 4 + 8,
                       "flash_bwd params layout is part of the C ABI v3");

#ifdef __cplusplus
}
#endif
