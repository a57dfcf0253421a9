#include "common/checks.h"
#include "common/op.h"

namespace xla_attn {
namespace {

template <typename P>
void check_attention_shape(Checker& c, const P& p) {
  c.expect(p.batch >= 0, "batch must be >= 0, got ", p.batch)
      .expect(p.num_heads > 0 && p.num_heads_k > 0, "num_heads and num_heads_k must be positive")
      .expect(p.num_heads_k > 0 && p.num_heads % p.num_heads_k == 0,
              "num_heads (", p.num_heads, ") must be a multiple of num_heads_k (", p.num_heads_k, ")")
      .expect(p.head_dim > 0 && p.head_dim <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim,
              "], got ", p.head_dim)
      .expect(p.total_q >= 0 && p.total_k >= 0, "total_q and total_k must be >= 0")
      .expect(p.window_left >= -1 && p.window_right >= -1, "window sizes must be >= -1")
      // the launch grids are sized by them (a negative one would wrap round)
      .expect(p.max_seqlen_q >= 0 && p.max_seqlen_k >= 0,
              "max_seqlen_q and max_seqlen_k must be >= 0")
      .expect(p.softcap >= 0.f, "softcap must be >= 0")
      .expect(p.cu_seqlens_q && p.cu_seqlens_k, "cu_seqlens_q and cu_seqlens_k are required")
      .expect(p.alibi_batch_stride == 0 || p.alibi_batch_stride == p.num_heads,
              "alibi_batch_stride must be 0 or num_heads");
}

}  // namespace

std::string validate(const xla_attn_flash_fwd_params& p) {
  Checker c("flash_fwd");
  check_attention_shape(c, p);
  const bool fp8 = is_fp8_dtype(p.q_dtype);
  c.expect(p.total_q == 0 || (p.q && p.out), "q and out are required")
      .expect(p.total_k == 0 || (p.k && p.v), "k and v are required")
      .expect(is_float_dtype(p.q_dtype) || p.q_dtype == XLA_ATTN_F8E4M3,
           "q dtype must be float32, float16, bfloat16 or float8_e4m3fn")
      .expect(p.kv_dtype == p.q_dtype, "k and v must have q's dtype")
      .expect(fp8 ? p.out_dtype == XLA_ATTN_BF16 : p.out_dtype == p.q_dtype,
              "out dtype must be q's (bfloat16 for fp8 q)")
      .expect(fp8 || (!p.q_descale && !p.k_descale && !p.v_descale),
              "q/k/v_descale apply to fp8 inputs only");
  if (p.block_table) {
    c.expect(p.num_blocks >= 0 && p.block_size > 0 && p.max_blocks_per_seq >= 0,
             "paged K/V needs block_size > 0")
        .expect(p.total_k == int64_t(p.num_blocks) * p.block_size,
                "paged total_k must be num_blocks * block_size");
  }
  return c.error();
}

std::string validate(const xla_attn_flash_bwd_params& p) {
  Checker c("flash_bwd");
  check_attention_shape(c, p);
  c.expect(is_float_dtype(p.dtype), "dtype must be float32, float16 or bfloat16")
      .expect(p.softmax_lse != nullptr || p.total_q == 0, "softmax_lse is required")
      .expect(p.total_q == 0 || (p.dout && p.q && p.out && p.dq), "dout, q, out and dq are required")
      .expect(p.total_k == 0 || (p.k && p.v && p.dk && p.dv), "k, v, dk and dv are required");
  return c.error();
}

}  // namespace xla_attn
