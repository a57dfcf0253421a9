// xla_attn_flash_bwd_v1, _v2 and _v3 (docs/xla-targets.md): v2 has a workspace result, which
// takes the sm80 family onto its atomic-dQ path; v1 runs the deterministic one; v3 is v2
// with softmax_lse's cotangent as one more operand (zero elements: none).
#include "ffi/common.h"

namespace xla_attn::ffi_glue {
namespace {

ffi::Error FlashBwd(const char* target, cudaStream_t stream, int platform, ffi::AnyBuffer dout,
                    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                    ffi::AnyBuffer lse, ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                    ffi::AnyBuffer seqused_k, ffi::AnyBuffer alibi, const ffi::AnyBuffer* dlse,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, ffi::AnyBuffer* workspace,
                    float softmax_scale, float softcap, int64_t window_left,
                    int64_t window_right, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  Checker c(target);
  c.expect(rank(q) == 3 && rank(k) == 3 && k.dimensions() == v.dimensions(),
           "q must be [total_q, num_heads, head_dim], k and v [total_k, num_heads_k, head_dim]")
      .expect(dout.dimensions() == q.dimensions() && out.dimensions() == q.dimensions(),
              "dout and out must have q's shape")
      .expect(dq->dimensions() == q.dimensions() && dk->dimensions() == k.dimensions() &&
                  dv->dimensions() == v.dimensions(),
              "dq, dk, dv must have the shapes of q, k, v")
      .expect(rank(cu_seqlens_q) == 1 && rank(cu_seqlens_k) == 1 &&
                  cu_seqlens_q.element_count() >= 1 &&
                  cu_seqlens_k.element_count() == cu_seqlens_q.element_count() &&
                  to_dtype(cu_seqlens_q.element_type()) == XLA_ATTN_I32 &&
                  to_dtype(cu_seqlens_k.element_type()) == XLA_ATTN_I32,
              "cu_seqlens_q and cu_seqlens_k must be int32 [batch + 1]");
  if (!c.ok()) return to_error(c.error());
  const int64_t batch = cu_seqlens_q.element_count() - 1;
  const int32_t alibi_stride = check_flash_common(c, window_left, window_right, max_seqlen_q,
                                                  max_seqlen_k, alibi, batch, dim(q, 1));
  const xla_attn_dtype dtype = to_dtype(q.element_type());
  // softmax_lse and its cotangent dlse: float32 [num_heads, total_q]
  auto lse_shaped = [&](const ffi::AnyBuffer& x) {
    return rank(x) == 2 && dim(x, 0) == dim(q, 1) && dim(x, 1) == dim(q, 0) &&
           to_dtype(x.element_type()) == XLA_ATTN_F32;
  };
  c.expect(dim(k, 2) == dim(q, 2), "k's head_dim must equal q's")
      .expect(lse_shaped(lse), "softmax_lse must be float32 [num_heads, total_q]")
      .expect(!dlse || dlse->element_count() == 0 || lse_shaped(*dlse),
              "dlse must be float32 [num_heads, total_q] (or empty: none)")
      .expect(seqused_k.element_count() == 0 ||
                  (seqused_k.element_count() == size_t(batch) &&
                   to_dtype(seqused_k.element_type()) == XLA_ATTN_I32),
              "seqused_k must be int32 [batch]");
  for (const ffi::AnyBuffer* b : {&dout, &k, &v, &out}) {
    c.expect(to_dtype(b->element_type()) == dtype, "dout, q, k, v, out must share one dtype");
  }
  c.expect(to_dtype(dq->element_type()) == dtype && to_dtype(dk->element_type()) == dtype &&
               to_dtype(dv->element_type()) == dtype,
           "dq, dk, dv must have q's dtype");
  if (!c.ok()) return to_error(c.error());

  xla_attn_flash_bwd_params p{};
  p.dout = dout.untyped_data();
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.softmax_lse = static_cast<const float*>(lse.untyped_data());
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.untyped_data());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.untyped_data());
  p.seqused_k = static_cast<const int32_t*>(optional(seqused_k));
  p.alibi_slopes = static_cast<const float*>(optional(alibi));
  p.dlse = dlse ? static_cast<const float*>(optional(*dlse)) : nullptr;
  p.total_q = dim(q, 0);
  p.total_k = dim(k, 0);
  p.batch = static_cast<int32_t>(batch);
  p.num_heads = static_cast<int32_t>(dim(q, 1));
  p.num_heads_k = static_cast<int32_t>(dim(k, 1));
  p.head_dim = static_cast<int32_t>(dim(q, 2));
  p.max_seqlen_q = static_cast<int32_t>(max_seqlen_q);
  p.max_seqlen_k = static_cast<int32_t>(max_seqlen_k);
  p.alibi_batch_stride = alibi_stride;
  p.window_left = static_cast<int32_t>(window_left);
  p.window_right = static_cast<int32_t>(window_right);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.dtype = dtype;
  return run_with_workspace(p, platform, stream, workspace);
}

ffi::Error FlashBwdV1(cudaStream_t stream, int platform, ffi::AnyBuffer dout, ffi::AnyBuffer q,
                      ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                      ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                      ffi::AnyBuffer seqused_k, ffi::AnyBuffer alibi,
                      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, float softcap,
                      int64_t window_left, int64_t window_right, int64_t max_seqlen_q,
                      int64_t max_seqlen_k) {
  return FlashBwd("xla_attn_flash_bwd_v1", stream, platform, dout, q, k, v, out, lse,
                  cu_seqlens_q, cu_seqlens_k, seqused_k, alibi, nullptr, dq, dk, dv, nullptr,
                  softmax_scale, softcap, window_left, window_right, max_seqlen_q, max_seqlen_k);
}

ffi::Error FlashBwdV2(cudaStream_t stream, int platform, ffi::AnyBuffer dout, ffi::AnyBuffer q,
                      ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                      ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                      ffi::AnyBuffer seqused_k, ffi::AnyBuffer alibi,
                      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace,
                      float softmax_scale, float softcap, int64_t window_left,
                      int64_t window_right, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  return FlashBwd("xla_attn_flash_bwd_v2", stream, platform, dout, q, k, v, out, lse,
                  cu_seqlens_q, cu_seqlens_k, seqused_k, alibi, nullptr, dq, dk, dv, &*workspace,
                  softmax_scale, softcap, window_left, window_right, max_seqlen_q, max_seqlen_k);
}

ffi::Error FlashBwdV3(cudaStream_t stream, int platform, ffi::AnyBuffer dout, ffi::AnyBuffer q,
                      ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                      ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                      ffi::AnyBuffer seqused_k, ffi::AnyBuffer alibi, ffi::AnyBuffer dlse,
                      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace,
                      float softmax_scale, float softcap, int64_t window_left,
                      int64_t window_right, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  return FlashBwd("xla_attn_flash_bwd_v3", stream, platform, dout, q, k, v, out, lse,
                  cu_seqlens_q, cu_seqlens_k, seqused_k, alibi, &dlse, dq, dk, dv, &*workspace,
                  softmax_scale, softcap, window_left, window_right, max_seqlen_q, max_seqlen_k);
}

// The operands every version takes (a Binding is not movable: taken by reference, each
// step returns a new one).
template <typename B>
auto Operands(B&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // dout
      .template Arg<ffi::AnyBuffer>()            // q
      .template Arg<ffi::AnyBuffer>()            // k
      .template Arg<ffi::AnyBuffer>()            // v
      .template Arg<ffi::AnyBuffer>()            // out
      .template Arg<ffi::AnyBuffer>()            // softmax_lse
      .template Arg<ffi::AnyBuffer>()            // cu_seqlens_q
      .template Arg<ffi::AnyBuffer>()            // cu_seqlens_k
      .template Arg<ffi::AnyBuffer>()            // seqused_k
      .template Arg<ffi::AnyBuffer>();           // alibi_slopes
}

template <typename B>
auto Gradients(B&& binding) {  // dq, dk, dv
  return std::move(binding).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <typename B>
auto SignatureV1(B binding) {
  return with_flash_attributes(Gradients(Operands(std::move(binding))));
}

template <typename B>
auto SignatureV2(B binding) {  // + workspace (u8, xla_attn_flash_bwd_workspace_size)
  return with_flash_attributes(
      Gradients(Operands(std::move(binding))).template Ret<ffi::AnyBuffer>());
}

template <typename B>
auto SignatureV3(B binding) {  // v2 + dlse after alibi_slopes
  return with_flash_attributes(
      Gradients(Operands(std::move(binding)).template Arg<ffi::AnyBuffer>())
          .template Ret<ffi::AnyBuffer>());
}

}  // namespace
}  // namespace xla_attn::ffi_glue

using namespace xla_attn::ffi_glue;  // NOLINT: the macro names unqualified symbols
XLA_ATTN_DEFINE_HANDLERS(XlaAttnFlashBwdV1Host, XlaAttnFlashBwdV1Cuda, FlashBwdV1, SignatureV1);
XLA_ATTN_DEFINE_HANDLERS(XlaAttnFlashBwdV2Host, XlaAttnFlashBwdV2Cuda, FlashBwdV2, SignatureV2);
XLA_ATTN_DEFINE_HANDLERS(XlaAttnFlashBwdV3Host, XlaAttnFlashBwdV3Cuda, FlashBwdV3, SignatureV3);
