// xla_attn_paged_attention_v1 and _v2 (docs/xla-targets.md): one body; v1 is v2
// without ALiBi and without the max_query_len hint.
#include "ffi/common.h"

namespace xla_attn::ffi_glue {
namespace {

ffi::Error PagedAttention(cudaStream_t stream, int platform, const char* target,
                          ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                          ffi::AnyBuffer value_cache, ffi::AnyBuffer seq_lens,
                          ffi::AnyBuffer block_tables, ffi::AnyBuffer query_start_loc,
                          ffi::AnyBuffer num_seqs, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          const ffi::AnyBuffer* alibi, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace, float scale, float soft_cap,
                          int64_t sliding_window, std::string_view kv_cache_dtype,
                          int64_t max_query_len) {
  Checker c(target);
  c.expect(rank(query) == 3, "query must be [total_q, num_heads, head_dim]")
      .expect(rank(key_cache) == 4 && key_cache.dimensions() == value_cache.dimensions() &&
                  key_cache.element_type() == value_cache.element_type(),
              "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, head_dim] "
              "of one dtype")
      .expect(rank(seq_lens) == 1 && rank(block_tables) == 2 && rank(query_start_loc) == 1,
              "seq_lens must be [num_seqs], block_tables [num_seqs, max_blocks], "
              "query_start_loc [num_seqs + 1]");
  c.expect(fits_int32(sliding_window), "sliding_window must fit in int32")
      .expect(fits_int32(max_query_len), "max_query_len must fit in int32");
  if (!c.ok()) return to_error(c.error());
  const int64_t max_num_seqs = dim(seq_lens, 0);
  const bool has_alibi = alibi && alibi->element_count() > 0;
  c.expect(dim(block_tables, 0) == max_num_seqs && dim(query_start_loc, 0) == max_num_seqs + 1,
           "block_tables and query_start_loc must match seq_lens' length")
      .expect(dim(key_cache, 3) == dim(query, 2), "cache head_dim must equal query's")
      .expect(out->dimensions() == query.dimensions() &&
                  out->element_type() == query.element_type(),
              "out must have query's shape and dtype")
      .expect(num_seqs.element_count() <= 1, "num_seqs must be a scalar")
      .expect(!has_alibi || (rank(*alibi) == 1 && dim(*alibi, 0) == dim(query, 1) &&
                             to_dtype(alibi->element_type()) == XLA_ATTN_F32),
              "alibi_slopes must be float32 [num_heads]");
  for (const ffi::AnyBuffer* b : {&seq_lens, &block_tables, &query_start_loc, &num_seqs}) {
    c.expect(to_dtype(b->element_type()) == XLA_ATTN_I32, "index operands must be int32");
  }
  check_scales(c, k_scale, v_scale);
  const xla_attn_dtype format = checked_cache_format(c, kv_cache_dtype, key_cache);
  if (!c.ok()) return to_error(c.error());

  xla_attn_paged_attention_params p{};
  p.query = query.untyped_data();
  p.key_cache = key_cache.untyped_data();
  p.value_cache = value_cache.untyped_data();
  p.out = out->untyped_data();
  p.seq_lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  p.block_tables = static_cast<const int32_t*>(block_tables.untyped_data());
  p.query_start_loc = static_cast<const int32_t*>(query_start_loc.untyped_data());
  p.num_seqs = static_cast<const int32_t*>(optional(num_seqs));
  p.k_scale = static_cast<const float*>(optional(k_scale));
  p.v_scale = static_cast<const float*>(optional(v_scale));
  p.alibi_slopes = has_alibi ? static_cast<const float*>(alibi->untyped_data()) : nullptr;
  p.total_q = dim(query, 0);
  p.max_num_seqs = static_cast<int32_t>(max_num_seqs);
  p.num_heads = static_cast<int32_t>(dim(query, 1));
  p.num_heads_k = static_cast<int32_t>(dim(key_cache, 2));
  p.head_dim = static_cast<int32_t>(dim(query, 2));
  p.num_blocks = static_cast<int32_t>(dim(key_cache, 0));
  p.block_size = static_cast<int32_t>(dim(key_cache, 1));
  p.max_blocks_per_seq = static_cast<int32_t>(dim(block_tables, 1));
  p.sliding_window = static_cast<int32_t>(sliding_window);
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.q_dtype = to_dtype(query.element_type());
  p.cache_dtype = format;
  p.max_query_len = static_cast<int32_t>(max_query_len);
  return run_with_workspace(p, platform, stream, &*workspace);
}

ffi::Error PagedAttentionV1(cudaStream_t stream, int platform, ffi::AnyBuffer query,
                            ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                            ffi::AnyBuffer seq_lens, ffi::AnyBuffer block_tables,
                            ffi::AnyBuffer query_start_loc, ffi::AnyBuffer num_seqs,
                            ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace, float scale, float soft_cap,
                            int64_t sliding_window, std::string_view kv_cache_dtype) {
  return PagedAttention(stream, platform, "xla_attn_paged_attention_v1", query, key_cache,
                        value_cache, seq_lens, block_tables, query_start_loc, num_seqs, k_scale,
                        v_scale, nullptr, out, workspace, scale, soft_cap, sliding_window,
                        kv_cache_dtype, 0);
}

ffi::Error PagedAttentionV2(cudaStream_t stream, int platform, ffi::AnyBuffer query,
                            ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                            ffi::AnyBuffer seq_lens, ffi::AnyBuffer block_tables,
                            ffi::AnyBuffer query_start_loc, ffi::AnyBuffer num_seqs,
                            ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::AnyBuffer alibi_slopes, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace, float scale, float soft_cap,
                            int64_t sliding_window, std::string_view kv_cache_dtype,
                            int64_t max_query_len) {
  return PagedAttention(stream, platform, "xla_attn_paged_attention_v2", query, key_cache,
                        value_cache, seq_lens, block_tables, query_start_loc, num_seqs, k_scale,
                        v_scale, &alibi_slopes, out, workspace, scale, soft_cap, sliding_window,
                        kv_cache_dtype, max_query_len);
}

// The operands both versions share, in their order. Bindings are taken by reference:
// one cannot be moved into a parameter, only chained.
template <typename B>
auto with_v1_operands(B&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // query
      .template Arg<ffi::AnyBuffer>()            // key_cache
      .template Arg<ffi::AnyBuffer>()            // value_cache
      .template Arg<ffi::AnyBuffer>()            // seq_lens
      .template Arg<ffi::AnyBuffer>()            // block_tables
      .template Arg<ffi::AnyBuffer>()            // query_start_loc
      .template Arg<ffi::AnyBuffer>()            // num_seqs
      .template Arg<ffi::AnyBuffer>()            // k_scale
      .template Arg<ffi::AnyBuffer>();           // v_scale
}

// The results and the attributes both versions share.
template <typename B>
auto with_v1_results_and_attributes(B&& binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()            // workspace (u8, xla_attn_paged_attention_workspace_size)
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int64_t>("sliding_window")
      .template Attr<std::string_view>("kv_cache_dtype");
}

template <typename B>
auto SignatureV1(B binding) {
  return with_v1_results_and_attributes(with_v1_operands(std::move(binding)));
}

template <typename B>
auto SignatureV2(B binding) {
  return with_v1_results_and_attributes(
             with_v1_operands(std::move(binding)).template Arg<ffi::AnyBuffer>())  // alibi_slopes
      .template Attr<int64_t>("max_query_len");
}

}  // namespace
}  // namespace xla_attn::ffi_glue

using namespace xla_attn::ffi_glue;  // NOLINT: the macro names unqualified symbols
XLA_ATTN_DEFINE_HANDLERS(XlaAttnPagedAttentionV1Host, XlaAttnPagedAttentionV1Cuda,
                         PagedAttentionV1, SignatureV1);
XLA_ATTN_DEFINE_HANDLERS(XlaAttnPagedAttentionV2Host, XlaAttnPagedAttentionV2Cuda,
                         PagedAttentionV2, SignatureV2);
