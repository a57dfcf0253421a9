#include "common/checks.h"
#include "common/op.h"

namespace xla_attn {

std::string validate(const xla_attn_reshape_and_cache_flash_params& p) {
  Checker c("reshape_and_cache_flash");
  c.expect(is_float_dtype(p.src_dtype), "key/value dtype must be float32, float16 or bfloat16")
      .expect(p.cache_dtype == p.src_dtype || is_fp8_dtype(p.cache_dtype),
              "cache dtype must equal key's dtype or be an fp8 format")
      .expect(p.slot_dtype == XLA_ATTN_I32 || p.slot_dtype == XLA_ATTN_I64,
              "slot_mapping must be int32 or int64")
      .expect(p.num_tokens >= 0 && p.num_heads_k > 0 && p.head_dim > 0 && p.block_size > 0 &&
                  p.num_blocks >= 0,
              "sizes must be positive")
      .expect(p.num_slots == int64_t(p.num_blocks) * p.block_size,
              "num_slots must be num_blocks * block_size")
      .expect(p.num_tokens == 0 || (p.key && p.value && p.slot_mapping), "null key/value/slot_mapping")
      .expect(p.num_slots == 0 || (p.key_cache && p.value_cache), "null cache pointer");
  return c.error();
}

}  // namespace xla_attn
