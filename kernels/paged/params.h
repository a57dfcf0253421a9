// Paged attention over a block-table KV cache (vLLM "flash" cache layout), tuned
// for decode. Query token i of a sequence with Lq queries and L = seq_lens[s] keys
// sits at key position L - Lq + i and attends causally.
#pragma once
#include "common/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct xla_attn_paged_attention_params {
  const void* query;               // [total_q, num_heads, head_dim]                   q_dtype
  const void* key_cache;           // [num_blocks, block_size, num_heads_k, head_dim]  cache_dtype
  const void* value_cache;         // same as key_cache
  void* out;                       // [total_q, num_heads, head_dim]                   q_dtype
  const int32_t* seq_lens;         // [max_num_seqs]
  const int32_t* block_tables;     // [max_num_seqs, max_blocks_per_seq]
  const int32_t* query_start_loc;  // [max_num_seqs + 1]; rows past the last used entry: padding
  const int32_t* num_seqs;         // [1] device scalar (real rows of the padded batch) or null
  const float* k_scale;            // [1] or null (1.0); dequantizes fp8 caches
  const float* v_scale;            // [1] or null
  const float* alibi_slopes;       // [num_heads] or null
  void* workspace;                 // device scratch of workspace_bytes or null
  int64_t total_q;
  int64_t workspace_bytes;         // what xla_attn_workspace_size() asked for
  int32_t max_num_seqs;
  int32_t num_heads;
  int32_t num_heads_k;
  int32_t head_dim;
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_blocks_per_seq;
  int32_t sliding_window;          // <= 0: off; else key j visible iff pos - j < sliding_window
  float scale;
  float soft_cap;                  // 0: off
  xla_attn_dtype q_dtype;
  xla_attn_dtype cache_dtype;      // storage format of the caches (fp8 for uint8 caches)
  int32_t max_query_len;           // longest query span of any sequence (a launch hint like
                                   // flash's max_seqlen_q); <= 0: unknown, bounded by total_q
  int32_t reserved0;
} xla_attn_paged_attention_params;

XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_paged_attention_params) == 12 * 8 + 2 * 8 + 14 * 4,
                       "paged_attention params layout is part of the C ABI v2");

#ifdef __cplusplus
}
#endif
