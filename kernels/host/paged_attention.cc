// paged_attention: vLLM-style attention over a block-table KV cache. It is the
// flash forward with a block table and a causal mask, so it only translates its
// parameters into the shared core's terms:
//   sequences  s < n = clamp(*num_seqs, 0, max_num_seqs) (all max_num_seqs if null);
//              query rows from query_start_loc like cu_seqlens_q, clamped to total_q;
//              L = clamp(seq_lens[s], 0, max_blocks_per_seq * block_size) keys
//   mask       causal (window_right = 0) with query i at pos = i + L - Lq; a
//              sliding window w > 0 keeps key j iff pos - j < w, i.e. j >= pos - (w - 1),
//              which is window_left = w - 1
//   fp8 cache  elements dequantized as float(x) * k_scale / v_scale
// Rows of out outside the first n sequences are 0. A max_query_len > 0 below some
// sequence's query count is an error (on the GPU those rows would be NaN or unwritten).
#include <algorithm>
#include <string>

#include "host/attention_core.h"
#include "host/reference.h"

namespace xla_attn::host {

std::string paged_attention(const xla_attn_paged_attention_params& p) {
  const std::string heads = check_heads(p.num_heads, p.num_heads_k, p.head_dim);
  if (!heads.empty()) return "paged_attention: " + heads;
  if (!is_float_or_fp8(p.q_dtype) || !is_float_or_fp8(p.cache_dtype))
    return "paged_attention: query and cache must have float dtypes";
  if (p.max_num_seqs < 0 || p.total_q < 0) return "paged_attention: negative size";
  if (p.block_size <= 0) return "paged_attention: block_size must be positive";
  if (p.max_num_seqs > 0 &&
      (p.seq_lens == nullptr || p.block_tables == nullptr || p.query_start_loc == nullptr))
    return "paged_attention: seq_lens, block_tables and query_start_loc are required";

  // Scales dequantize fp8 caches only; a cache in the query's dtype ignores them.
  const bool fp8 = is_fp8_dtype(p.cache_dtype);
  auto scale_of = [fp8](const float* f) { return fp8 && f != nullptr ? double{*f} : 1.0; };

  Attention a;
  a.q = {p.query, p.q_dtype, p.num_heads, p.head_dim, 1.0};
  a.k = {p.key_cache, p.cache_dtype, p.num_heads_k, p.head_dim, scale_of(p.k_scale)};
  a.v = {p.value_cache, p.cache_dtype, p.num_heads_k, p.head_dim, scale_of(p.v_scale)};
  a.num_heads = p.num_heads;
  a.num_heads_k = p.num_heads_k;
  a.opt = {p.scale, p.soft_cap, p.sliding_window > 0 ? int64_t{p.sliding_window} - 1 : -1, 0};

  Paging paging;
  paging.table = p.block_tables;
  paging.max_blocks_per_seq = p.max_blocks_per_seq;
  paging.block_size = p.block_size;
  paging.num_blocks = p.num_blocks;

  const int64_t n = p.num_seqs != nullptr ? std::clamp<int64_t>(*p.num_seqs, 0, p.max_num_seqs)
                                          : int64_t{p.max_num_seqs};
  std::vector<Sequence> seqs(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    int64_t q_end;
    clamp_range(p.query_start_loc, s, p.total_q, &seqs[s].q_start, &q_end);
    seqs[s].num_q = q_end - seqs[s].q_start;
    // The hint sizes the GPU launch; the Host can read the counts, so it says so.
    if (p.max_query_len > 0 && seqs[s].num_q > p.max_query_len) {
      return "paged_attention: sequence " + std::to_string(s) + " has " +
             std::to_string(seqs[s].num_q) + " queries (query_start_loc), more than " +
             "max_query_len = " + std::to_string(p.max_query_len);
    }
    seqs[s].num_k = std::clamp<int64_t>(p.seq_lens[s], 0, paging.capacity());
    seqs[s].keys = paging.keys_of(s);
    seqs[s].alibi_slopes = p.alibi_slopes;  // [num_heads], shared by all sequences
  }
  attention_forward(a, seqs, p.total_q, p.out, p.q_dtype, nullptr);
  return "";
}

}  // namespace xla_attn::host
