// reshape_and_cache_flash, portable family (sm_70+): one block per token (grid-
// stride), each thread moving 16 bytes of source per step. The op is a scatter of
// rows; its cost is bytes, so the only aims are full-width coalesced accesses and
// not touching rows whose slot is padding.
#pragma once
#include "cache/params.h"
#include "common/vec.cuh"

namespace xla_attn {

template <typename Src, typename Cache>
__device__ __forceinline__ void write_row(const Src* __restrict__ src, Cache* __restrict__ dst,
                                          int64_t n, float scale,
                                          bool vectorized) {
  constexpr bool kQuantize = !kSameType<Src, Cache>;
  constexpr int kVec = 16 / sizeof(Src);  // 4 floats or 8 halves per 16-byte load
  if (vectorized) {
    const auto* s = reinterpret_cast<const Vec<Src, kVec>*>(src);
    auto* d = reinterpret_cast<Vec<Cache, kVec>*>(dst);
    for (int64_t i = threadIdx.x; i < n / kVec; i += blockDim.x) {
      Vec<Src, kVec> in = s[i];
      Vec<Cache, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if constexpr (kQuantize) {
          out.v[j] = from_float<Cache>(to_float(in.v[j]) / scale);
        } else {
          out.v[j] = in.v[j];
        }
      }
      d[i] = out;
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kQuantize) {
      dst[i] = from_float<Cache>(to_float(src[i]) / scale);
    } else {
      dst[i] = src[i];
    }
  }
}

template <typename Src, typename Cache>
__device__ void reshape_and_cache_flash_portable(const xla_attn_reshape_and_cache_flash_params& p) {
  constexpr int kVec = 16 / sizeof(Src);
  const int64_t row = int64_t(p.num_heads_k) * p.head_dim;
  // Vector path when every row starts on a vector boundary (row % kVec == 0) and the
  // bases are aligned; XLA and torch allocations are, odd head dims are not.
  const bool vectorized = row % kVec == 0 && aligned_to<Src>(p.key, 16) &&
                          aligned_to<Src>(p.value, 16) &&
                          aligned_to<Cache>(p.key_cache, sizeof(Cache) * kVec) &&
                          aligned_to<Cache>(p.value_cache, sizeof(Cache) * kVec);
  const bool quantize = !kSameType<Src, Cache>;
  const float k_scale = (quantize && p.k_scale) ? *p.k_scale : 1.0f;
  const float v_scale = (quantize && p.v_scale) ? *p.v_scale : 1.0f;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = p.slot_dtype == XLA_ATTN_I64
                             ? static_cast<const int64_t*>(p.slot_mapping)[t]
                             : int64_t(static_cast<const int32_t*>(p.slot_mapping)[t]);
    if (slot < 0 || slot >= p.num_slots) continue;  // -1 is padding; others are untrusted
    write_row(static_cast<const Src*>(p.key) + t * row,
              static_cast<Cache*>(p.key_cache) + slot * row, row, k_scale, vectorized);
    write_row(static_cast<const Src*>(p.value) + t * row,
              static_cast<Cache*>(p.value_cache) + slot * row, row, v_scale, vectorized);
  }
}

}  // namespace xla_attn
