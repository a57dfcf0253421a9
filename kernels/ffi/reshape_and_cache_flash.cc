// xla_attn_reshape_and_cache_flash_v1 (docs/xla-targets.md). The caches are results
// aliased onto operands 2 and 3; XLA hands the handler one buffer for each pair
// (copying first when the input was not donated). Should a runtime ever pass
// distinct buffers, the old cache is copied over before the scatter.
#include <cstring>

#include "ffi/common.h"

namespace xla_attn::ffi_glue {
namespace {

std::string carry_over(int platform, cudaStream_t stream, const ffi::AnyBuffer& in, void* out) {
  if (in.untyped_data() == out || in.size_bytes() == 0) return "";
  if (platform == XLA_ATTN_HOST) {
    std::memcpy(out, in.untyped_data(), in.size_bytes());
    return "";
  }
  cudaError_t st = cudaMemcpyAsync(out, in.untyped_data(), in.size_bytes(),
                                   cudaMemcpyDeviceToDevice, stream);
  return st == cudaSuccess ? "" : std::string("xla_attn: cache copy failed: ") + cudaGetErrorString(st);
}

ffi::Error CacheWrite(cudaStream_t stream, int platform, ffi::AnyBuffer key, ffi::AnyBuffer value,
                      ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                      ffi::AnyBuffer slot_mapping, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                      ffi::Result<ffi::AnyBuffer> key_cache_out,
                      ffi::Result<ffi::AnyBuffer> value_cache_out,
                      std::string_view kv_cache_dtype) {
  Checker c("xla_attn_reshape_and_cache_flash_v1");
  c.expect(rank(key) == 3 && key.dimensions() == value.dimensions() &&
               key.element_type() == value.element_type(),
           "key and value must be [num_tokens, num_heads_k, head_dim] of one dtype")
      .expect(rank(key_cache) == 4 && key_cache.dimensions() == value_cache.dimensions() &&
                  key_cache.element_type() == value_cache.element_type(),
              "key_cache and value_cache must be [num_blocks, block_size, num_heads_k, head_dim] "
              "of one dtype")
      // the old cache is copied into the results whole when they are not aliased
      .expect(key_cache_out->dimensions() == key_cache.dimensions() &&
                  value_cache_out->dimensions() == value_cache.dimensions() &&
                  key_cache_out->element_type() == key_cache.element_type() &&
                  value_cache_out->element_type() == value_cache.element_type(),
              "results must have the caches' shapes and dtype")
      .expect(rank(slot_mapping) == 1, "slot_mapping must be [num_tokens]");
  if (!c.ok()) return to_error(c.error());
  c.expect(dim(slot_mapping, 0) == dim(key, 0), "slot_mapping must have one entry per token")
      .expect(dim(key_cache, 2) == dim(key, 1) && dim(key_cache, 3) == dim(key, 2),
              "cache [.., num_heads_k, head_dim] must match key's");
  check_scales(c, k_scale, v_scale);
  const xla_attn_dtype format = checked_cache_format(c, kv_cache_dtype, key_cache);
  if (!c.ok()) return to_error(c.error());

  xla_attn_reshape_and_cache_flash_params p{};
  p.key = key.untyped_data();
  p.value = value.untyped_data();
  p.key_cache = key_cache_out->untyped_data();
  p.value_cache = value_cache_out->untyped_data();
  p.slot_mapping = slot_mapping.untyped_data();
  p.k_scale = static_cast<const float*>(optional(k_scale));
  p.v_scale = static_cast<const float*>(optional(v_scale));
  p.num_tokens = dim(key, 0);
  p.num_heads_k = static_cast<int32_t>(dim(key, 1));
  p.head_dim = static_cast<int32_t>(dim(key, 2));
  p.num_blocks = static_cast<int32_t>(dim(key_cache, 0));
  p.block_size = static_cast<int32_t>(dim(key_cache, 1));
  p.num_slots = int64_t(p.num_blocks) * p.block_size;
  p.src_dtype = to_dtype(key.element_type());
  p.cache_dtype = format;
  p.slot_dtype = to_dtype(slot_mapping.element_type());
  std::string error = validate(p);
  if (error.empty()) error = carry_over(platform, stream, key_cache, p.key_cache);
  if (error.empty()) error = carry_over(platform, stream, value_cache, p.value_cache);
  if (!error.empty()) return to_error(error);
  return run_with_workspace(p, platform, stream, nullptr);
}

template <typename B>
auto Signature(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // key
      .template Arg<ffi::AnyBuffer>()            // value
      .template Arg<ffi::AnyBuffer>()            // key_cache
      .template Arg<ffi::AnyBuffer>()            // value_cache
      .template Arg<ffi::AnyBuffer>()            // slot_mapping
      .template Arg<ffi::AnyBuffer>()            // k_scale
      .template Arg<ffi::AnyBuffer>()            // v_scale
      .template Ret<ffi::AnyBuffer>()            // key_cache (aliased onto operand 2)
      .template Ret<ffi::AnyBuffer>()            // value_cache (aliased onto operand 3)
      .template Attr<std::string_view>("kv_cache_dtype");
}

}  // namespace
}  // namespace xla_attn::ffi_glue

using namespace xla_attn::ffi_glue;  // NOLINT: the macro names unqualified symbols
XLA_ATTN_DEFINE_HANDLERS(XlaAttnReshapeAndCacheFlashV1Host, XlaAttnReshapeAndCacheFlashV1Cuda,
                         CacheWrite, Signature);
