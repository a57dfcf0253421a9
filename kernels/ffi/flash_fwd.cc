// xla_attn_flash_fwd_v1 (docs/xla-targets.md): buffers + attributes -> params -> run.
#include "ffi/common.h"

namespace xla_attn::ffi_glue {
namespace {

ffi::Error FlashFwd(cudaStream_t stream, int platform, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                    ffi::AnyBuffer seqused_k, ffi::AnyBuffer block_table, ffi::AnyBuffer alibi,
                    ffi::AnyBuffer q_descale, ffi::AnyBuffer k_descale, ffi::AnyBuffer v_descale,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                    ffi::Result<ffi::AnyBuffer> workspace,
                    float softmax_scale, float softcap, int64_t window_left, int64_t window_right,
                    int64_t max_seqlen_q, int64_t max_seqlen_k) {
  Checker c("xla_attn_flash_fwd_v1");
  const bool paged = block_table.element_count() > 0;
  c.expect(rank(q) == 3, "q must be [total_q, num_heads, head_dim]")
      .expect(rank(k) == (paged ? 4u : 3u) && k.dimensions() == v.dimensions() &&
                  k.element_type() == v.element_type(),  // the params have one kv_dtype
              paged ? "paged k and v must be [num_blocks, block_size, num_heads_k, head_dim] "
                      "of one dtype"
                    : "k and v must be [total_k, num_heads_k, head_dim] of one dtype")
      .expect(rank(cu_seqlens_q) == 1 && rank(cu_seqlens_k) == 1 &&
                  cu_seqlens_q.element_count() >= 1 &&
                  cu_seqlens_k.element_count() == cu_seqlens_q.element_count(),
              "cu_seqlens_q and cu_seqlens_k must be [batch + 1]")
      .expect(to_dtype(cu_seqlens_q.element_type()) == XLA_ATTN_I32 &&
                  to_dtype(cu_seqlens_k.element_type()) == XLA_ATTN_I32 &&
                  to_dtype(seqused_k.element_type()) == XLA_ATTN_I32 &&
                  to_dtype(block_table.element_type()) == XLA_ATTN_I32,
              "index operands must be int32");
  if (!c.ok()) return to_error(c.error());
  const int64_t batch = cu_seqlens_q.element_count() - 1;
  const int32_t alibi_stride = check_flash_common(c, window_left, window_right, max_seqlen_q,
                                                  max_seqlen_k, alibi, batch, dim(q, 1));
  const int64_t head_dim = dim(q, 2);
  c.expect(dim(k, rank(k) - 1) == head_dim, "k's head_dim must equal q's")
      .expect(seqused_k.element_count() == 0 || seqused_k.element_count() == size_t(batch),
              "seqused_k must be [batch]")
      .expect(!paged || (rank(block_table) == 2 && dim(block_table, 0) == batch),
              "block_table must be [batch, max_blocks_per_seq]")
      .expect(out->dimensions() == q.dimensions(), "out must have q's shape")
      .expect(rank(*lse) == 2 && dim(*lse, 0) == dim(q, 1) && dim(*lse, 1) == dim(q, 0) &&
                  to_dtype(lse->element_type()) == XLA_ATTN_F32,
              "softmax_lse must be float32 [num_heads, total_q]");
  for (const ffi::AnyBuffer* s : {&q_descale, &k_descale, &v_descale}) {
    c.expect(s->element_count() <= 1 && to_dtype(s->element_type()) == XLA_ATTN_F32,
             "descales must be float32 scalars");
  }
  if (!c.ok()) return to_error(c.error());

  xla_attn_flash_fwd_params p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.softmax_lse = static_cast<float*>(lse->untyped_data());
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.untyped_data());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.untyped_data());
  p.seqused_k = static_cast<const int32_t*>(optional(seqused_k));
  p.block_table = static_cast<const int32_t*>(optional(block_table));
  p.alibi_slopes = static_cast<const float*>(optional(alibi));
  p.q_descale = static_cast<const float*>(optional(q_descale));
  p.k_descale = static_cast<const float*>(optional(k_descale));
  p.v_descale = static_cast<const float*>(optional(v_descale));
  p.total_q = dim(q, 0);
  p.batch = static_cast<int32_t>(batch);
  p.num_heads = static_cast<int32_t>(dim(q, 1));
  p.num_heads_k = static_cast<int32_t>(dim(k, rank(k) - 2));
  p.head_dim = static_cast<int32_t>(head_dim);
  p.max_seqlen_q = static_cast<int32_t>(max_seqlen_q);
  p.max_seqlen_k = static_cast<int32_t>(max_seqlen_k);
  if (paged) {
    p.num_blocks = static_cast<int32_t>(dim(k, 0));
    p.block_size = static_cast<int32_t>(dim(k, 1));
    p.max_blocks_per_seq = static_cast<int32_t>(dim(block_table, 1));
    p.total_k = int64_t(p.num_blocks) * p.block_size;
  } else {
    p.total_k = dim(k, 0);
  }
  p.alibi_batch_stride = alibi_stride;
  p.window_left = static_cast<int32_t>(window_left);
  p.window_right = static_cast<int32_t>(window_right);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.q_dtype = to_dtype(q.element_type());
  p.kv_dtype = to_dtype(k.element_type());
  p.out_dtype = to_dtype(out->element_type());
  return run_with_workspace(p, platform, stream, &*workspace);
}

template <typename B>
auto Signature(B binding) {
  return with_flash_attributes(std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()            // k
      .template Arg<ffi::AnyBuffer>()            // v
      .template Arg<ffi::AnyBuffer>()            // cu_seqlens_q
      .template Arg<ffi::AnyBuffer>()            // cu_seqlens_k
      .template Arg<ffi::AnyBuffer>()            // seqused_k
      .template Arg<ffi::AnyBuffer>()            // block_table
      .template Arg<ffi::AnyBuffer>()            // alibi_slopes
      .template Arg<ffi::AnyBuffer>()            // q_descale
      .template Arg<ffi::AnyBuffer>()            // k_descale
      .template Arg<ffi::AnyBuffer>()            // v_descale
      .template Ret<ffi::AnyBuffer>()            // out
      .template Ret<ffi::AnyBuffer>()            // softmax_lse
      .template Ret<ffi::AnyBuffer>());            // workspace (u8, xla_attn_flash_fwd_workspace_size)
}

}  // namespace
}  // namespace xla_attn::ffi_glue

using namespace xla_attn::ffi_glue;  // NOLINT: the macro names unqualified symbols
XLA_ATTN_DEFINE_HANDLERS(XlaAttnFlashFwdV1Host, XlaAttnFlashFwdV1Cuda, FlashFwd, Signature);
