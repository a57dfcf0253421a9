// flash_fwd: varlen attention forward with flash-attn >= 2.1 conventions.
//
// Sequence b has query rows [clamp(cu_seqlens_q[b]), clamp(cu_seqlens_q[b+1])) and
//   not paged: key rows [clamp(cu_seqlens_k[b]), clamp(cu_seqlens_k[b+1])), of
//              which the first seqused_k[b] (clamped) when seqused_k is given;
//   paged:     keys 0 .. Lk-1 with Lk = seqused_k[b] or the cu_seqlens_k difference,
//              clamped to [0, max_blocks_per_seq * block_size]; key j is in block
//              block_table[b][j / block_size], and skipped if that id is invalid.
// Scores, masking and the softmax are the shared core's (attention_core.h).
#include <algorithm>

#include "host/attention_core.h"
#include "host/reference.h"

namespace xla_attn::host {

std::string flash_fwd(const xla_attn_flash_fwd_params& p) {
  const std::string heads = check_heads(p.num_heads, p.num_heads_k, p.head_dim);
  if (!heads.empty()) return "flash_fwd: " + heads;
  if (!is_float_or_fp8(p.q_dtype) || !is_float_or_fp8(p.kv_dtype) || !is_float_or_fp8(p.out_dtype))
    return "flash_fwd: q, k/v and out must have float dtypes";
  if (p.batch < 0 || p.total_q < 0 || p.total_k < 0) return "flash_fwd: negative size";
  if (p.batch > 0 && (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr))
    return "flash_fwd: cu_seqlens_q and cu_seqlens_k are required";
  if (p.block_table != nullptr && p.block_size <= 0) return "flash_fwd: paged K/V needs block_size > 0";

  // fp8 inputs carry per-tensor descales (flash-attn 3); other dtypes ignore them.
  const bool fp8 = is_fp8_dtype(p.q_dtype);
  auto descale = [fp8](const float* f) { return fp8 && f != nullptr ? double{*f} : 1.0; };

  Attention a;
  a.q = {p.q, p.q_dtype, p.num_heads, p.head_dim, descale(p.q_descale)};
  a.k = {p.k, p.kv_dtype, p.num_heads_k, p.head_dim, descale(p.k_descale)};
  a.v = {p.v, p.kv_dtype, p.num_heads_k, p.head_dim, descale(p.v_descale)};
  a.num_heads = p.num_heads;
  a.num_heads_k = p.num_heads_k;
  a.opt = {p.softmax_scale, p.softcap, p.window_left, p.window_right};

  Paging paging;
  if (p.block_table != nullptr) {
    paging.table = p.block_table;
    paging.max_blocks_per_seq = p.max_blocks_per_seq;
    paging.block_size = p.block_size;
    // total_k == num_blocks * block_size by contract; the min only makes a broken
    // contract unable to turn a "valid" block id into an out-of-bounds row.
    paging.num_blocks = std::min<int64_t>(p.num_blocks, p.total_k / p.block_size);
  }
  // Sequences past *batch_used (a device scalar, untrusted) are padding.
  const int64_t batch =
      p.batch_used ? std::clamp<int64_t>(*p.batch_used, 0, p.batch) : int64_t{p.batch};
  const std::vector<Sequence> seqs =
      flash_sequences(p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, batch, p.total_q, p.total_k,
                      paging, p.alibi_slopes, p.alibi_batch_stride);
  const std::string hints = check_length_hints("flash_fwd", seqs, p.max_seqlen_q, p.max_seqlen_k);
  if (!hints.empty()) return hints;
  attention_forward(a, seqs, p.total_q, p.out, p.out_dtype, p.softmax_lse);
  return "";
}

}  // namespace xla_attn::host
