#include "common/checks.h"
#include "common/op.h"

namespace xla_attn {
namespace {

// paged_attention is the flash forward over a block table, causal, with the
// sequence count on the device: the same kernels serve both.
xla_attn_flash_fwd_params as_flash(const xla_attn_paged_attention_params& p) {
  xla_attn_flash_fwd_params f{};
  const bool fp8 = is_fp8_dtype(p.cache_dtype);
  f.q = p.query;
  f.k = p.key_cache;
  f.v = p.value_cache;
  f.out = p.out;
  f.cu_seqlens_q = p.query_start_loc;
  f.seqused_k = p.seq_lens;
  f.block_table = p.block_tables;
  f.alibi_slopes = p.alibi_slopes;
  f.k_descale = fp8 ? p.k_scale : nullptr;  // scales dequantize fp8 caches only
  f.v_descale = fp8 ? p.v_scale : nullptr;
  f.batch_used = p.num_seqs;
  f.workspace = p.workspace;
  f.workspace_bytes = p.workspace_bytes;
  f.total_q = p.total_q;
  f.total_k = int64_t(p.num_blocks) * p.block_size;
  f.batch = p.max_num_seqs;
  f.num_heads = p.num_heads;
  f.num_heads_k = p.num_heads_k;
  f.head_dim = p.head_dim;
  // Query counts per sequence live on the device; total_q bounds them all.
  f.max_seqlen_q = int32_t(p.total_q < (int64_t(1) << 30) ? p.total_q : (int64_t(1) << 30));
  f.max_seqlen_k = p.max_blocks_per_seq * p.block_size;
  f.num_blocks = p.num_blocks;
  f.block_size = p.block_size;
  f.max_blocks_per_seq = p.max_blocks_per_seq;
  f.window_left = p.sliding_window > 0 ? p.sliding_window - 1 : -1;
  f.window_right = 0;
  f.softmax_scale = p.scale;
  f.softcap = p.soft_cap;
  f.q_dtype = p.q_dtype;
  f.kv_dtype = p.cache_dtype;
  f.out_dtype = p.q_dtype;
  return f;
}

}  // namespace

size_t workspace_size(const xla_attn_paged_attention_params& p) {
  return workspace_size(as_flash(p));
}

std::string launch_cuda(const xla_attn_paged_attention_params& p, cudaStream_t stream) {
  return launch_cuda(as_flash(p), stream);
}

}  // namespace xla_attn
