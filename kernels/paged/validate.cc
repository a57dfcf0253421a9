#include "common/checks.h"
#include "common/op.h"

namespace xla_attn {

std::string validate(const xla_attn_paged_attention_params& p) {
  Checker c("paged_attention");
  c.expect(is_float_dtype(p.q_dtype), "query dtype must be float32, float16 or bfloat16")
      .expect(p.cache_dtype == p.q_dtype || is_fp8_dtype(p.cache_dtype),
              "cache dtype must be query's or an fp8 format")
      .expect(p.num_heads > 0 && p.num_heads_k > 0 && p.num_heads % p.num_heads_k == 0,
              "num_heads (", p.num_heads, ") must be a multiple of num_heads_k (", p.num_heads_k, ")")
      .expect(p.head_dim > 0 && p.head_dim <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim,
              "], got ", p.head_dim)
      .expect(p.max_num_seqs >= 0 && p.total_q >= 0 && p.num_blocks >= 0 && p.block_size > 0 &&
                  p.max_blocks_per_seq >= 0,
              "sizes must be non-negative and block_size positive")
      .expect(p.soft_cap >= 0.f, "soft_cap must be >= 0")
      .expect(p.seq_lens && p.block_tables && p.query_start_loc,
              "seq_lens, block_tables and query_start_loc are required")
      .expect(p.total_q == 0 || (p.query && p.out), "query and out are required")
      .expect(p.num_blocks == 0 || (p.key_cache && p.value_cache),
              "key_cache and value_cache are required");
  return c.error();
}

}  // namespace xla_attn
