// reshape_and_cache_flash (reshape_and_cache_flash): token t's key and value rows go to row
// slot_mapping[t] of the caches viewed as [num_slots, num_heads_k, head_dim].
// Slots outside [0, num_slots) (-1 is padding) are skipped. A cache in the source
// dtype receives the bits unchanged; an fp8 cache receives
// sat_fp8(float(x) / scale), the division in single precision exactly as written so
// that the CUDA kernel (cache/write_portable.cuh) reproduces it bit for bit.
// Duplicate slots: the later token wins.
#include <string.h>

#include "common/convert_host.h"
#include "host/attention_core.h"
#include "host/reference.h"

namespace xla_attn::host {
namespace {

int64_t element_bytes(xla_attn_dtype t) {
  switch (t) {
    case XLA_ATTN_F32: return 4;
    case XLA_ATTN_F16:
    case XLA_ATTN_BF16: return 2;
    default: return 1;  // fp8
  }
}

void write_row(const void* src, int64_t src_row, xla_attn_dtype src_dtype, void* cache,
               int64_t slot, xla_attn_dtype cache_dtype, int64_t row_elems, float scale) {
  if (cache_dtype == src_dtype) {
    const int64_t bytes = row_elems * element_bytes(src_dtype);
    memcpy(static_cast<char*>(cache) + slot * bytes,
           static_cast<const char*>(src) + src_row * bytes, static_cast<size_t>(bytes));
    return;
  }
  for (int64_t e = 0; e < row_elems; ++e) {
    const float x = load_as_float(src, src_row * row_elems + e, src_dtype);
    store_from_float(cache, slot * row_elems + e, cache_dtype, x / scale);
  }
}

}  // namespace

std::string reshape_and_cache_flash(const xla_attn_reshape_and_cache_flash_params& p) {
  if (!is_float_dtype(p.src_dtype))  // common/checks.h: f32, f16 or bf16
    return "reshape_and_cache_flash: src_dtype must be f32, f16 or bf16";
  if (p.cache_dtype != p.src_dtype && !is_fp8_dtype(p.cache_dtype))
    return "reshape_and_cache_flash: cache_dtype must be src_dtype or an fp8 dtype";
  if (p.slot_dtype != XLA_ATTN_I32 && p.slot_dtype != XLA_ATTN_I64)
    return "reshape_and_cache_flash: slot_mapping must be i32 or i64";
  if (p.num_heads_k < 0 || p.head_dim < 0 || p.num_tokens < 0) return "reshape_and_cache_flash: negative size";

  const int64_t row_elems = int64_t{p.num_heads_k} * p.head_dim;
  // Scales only quantize; a cache in the source dtype ignores them.
  const float k_scale = p.k_scale != nullptr ? *p.k_scale : 1.0f;
  const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.0f;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_dtype == XLA_ATTN_I64
                             ? static_cast<const int64_t*>(p.slot_mapping)[t]
                             : int64_t{static_cast<const int32_t*>(p.slot_mapping)[t]};
    if (slot < 0 || slot >= p.num_slots) continue;
    write_row(p.key, t, p.src_dtype, p.key_cache, slot, p.cache_dtype, row_elems, k_scale);
    write_row(p.value, t, p.src_dtype, p.value_cache, slot, p.cache_dtype, row_elems, v_scale);
  }
  return "";
}

}  // namespace xla_attn::host
