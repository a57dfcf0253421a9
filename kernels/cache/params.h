// reshape_and_cache_flash: scatter new K/V tokens into the paged cache
// (vLLM "flash" layout). Slot s lands in block s / block_size, row s % block_size,
// which in this dense layout is simply row s of [num_slots, num_heads_k, head_dim].
#pragma once
#include "common/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct xla_attn_reshape_and_cache_flash_params {
  const void* key;           // [num_tokens, num_heads_k, head_dim]                 src_dtype
  const void* value;         // [num_tokens, num_heads_k, head_dim]                 src_dtype
  void* key_cache;           // [num_blocks, block_size, num_heads_k, head_dim]     cache_dtype
  void* value_cache;         // [num_blocks, block_size, num_heads_k, head_dim]     cache_dtype
  const void* slot_mapping;  // [num_tokens] int32 or int64; -1 = padding (skipped);
                             //   any other slot outside [0, num_slots) is skipped too
  const float* k_scale;      // [1] or null (1.0); fp8: cache = sat_fp8(key / k_scale)
  const float* v_scale;      // [1] or null
  int64_t num_tokens;
  int64_t num_slots;         // num_blocks * block_size
  int32_t num_heads_k;
  int32_t head_dim;
  int32_t block_size;
  int32_t num_blocks;
  xla_attn_dtype src_dtype;    // f32, f16, bf16
  xla_attn_dtype cache_dtype;  // src_dtype, or f8e4m3 / f8e5m2 (quantized with the scales)
  xla_attn_dtype slot_dtype;   // i32 or i64
  int32_t reserved0;
} xla_attn_reshape_and_cache_flash_params;

XLA_ATTN_STATIC_ASSERT(sizeof(xla_attn_reshape_and_cache_flash_params) == 7 * 8 + 2 * 8 + 8 * 4,
                       "reshape_and_cache_flash params layout is part of the C ABI v1");

#ifdef __cplusplus
}
#endif
