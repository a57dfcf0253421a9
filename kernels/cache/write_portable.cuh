// reshape_and_cache_flash, portable family (sm_70+): one block per token (grid-
// stride), each thread moving 16 bytes of source per step. The op is a scatter of
// rows; its cost is bytes, so the only aims are full-width coalesced accesses and
// not touching rows whose slot is padding.
#pragma once
#include "cache/params.h"
#include "common/vec.cuh"

namespace xla_attn {

// x / scale rounded exactly as IEEE single division (what the Host reference and vLLM
// compute), in 3 FMA-pipe instructions instead of div.rn's ~12 with a branch: with
// r = RN(1 / scale), q = RN(x r) is within an ulp and one residual step
// q + (x - q scale) r rounds correctly (Markstein) unless x r overflows, where q is
// already the right inf. Valid for a scale that is a normal float (`fast()`); for 0,
// subnormals, inf and NaN r would overflow or vanish, and the caller divides.
// SASS (sm_90) of the bf16 -> e4m3 loop before: MUFU.RCP + 4 FFMA + FCHK + a branch to
// a slow path per element, ~110 instructions per 16-byte vector, 82 % of the copy rate.
struct Quotient {
  float scale, r;
  __device__ explicit Quotient(float s) : scale(s), r(__frcp_rn(s)) {}
  __device__ bool fast() const { return isfinite(scale) && fabsf(scale) >= 1.17549435e-38f; }
  template <bool kFast>
  __device__ __forceinline__ float of(float x) const {
    if constexpr (!kFast) return x / scale;
    const float q = x * r;
    // the residual step loses the sign of a zero quotient (-0 + +0 = +0): q's is right
    const float q1 = copysignf(fmaf(fmaf(-q, scale, x), r, q), q);
    return isinf(q) ? q : q1;
  }
};

// One element or one vector of Src as stored in the cache: copied, or quantized to
// fp8 (pairs in one cvt).
template <typename Cache, bool kFast, typename Src>
__device__ __forceinline__ Cache store_as(Src x, const Quotient& div) {
  if constexpr (kSameType<Src, Cache>) {
    return x;
  } else {
    return from_float<Cache>(div.template of<kFast>(to_float(x)));
  }
}
template <typename Cache, bool kFast, typename Src, int N>
__device__ __forceinline__ Vec<Cache, N> store_as(const Vec<Src, N>& in, const Quotient& div) {
  Vec<Cache, N> out;
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    if constexpr (kSameType<Src, Cache>) {
      out.v[j] = in.v[j];
      out.v[j + 1] = in.v[j + 1];
    } else {
      *reinterpret_cast<__nv_fp8x2_storage_t*>(&out.v[j]) =
          fp8x2_from_float<Cache>(div.template of<kFast>(to_float(in.v[j])),
                                  div.template of<kFast>(to_float(in.v[j + 1])));
    }
  }
  return out;
}

// A token's key and value rows (n elements each) into their cache rows. Both rows'
// loads are issued before either conversion: with a row after the other, the fp8
// conversion between a thread's K load and its V load left one load in flight and the
// write at 85 % of the copy rate.
template <typename Src, typename Cache, bool kFast>
__device__ __forceinline__ void write_rows(const Src* __restrict__ key,
                                           const Src* __restrict__ value,
                                           Cache* __restrict__ key_dst,
                                           Cache* __restrict__ value_dst, int64_t n,
                                           const Quotient& k_div, const Quotient& v_div,
                                           bool vectorized) {
  constexpr int kVec = 16 / sizeof(Src);  // 4 floats or 8 halves per 16-byte load
  if (vectorized) {
    using In = Vec<Src, kVec>;
    using Out = Vec<Cache, kVec>;
    for (int64_t i = threadIdx.x; i < n / kVec; i += blockDim.x) {
      const In k = reinterpret_cast<const In*>(key)[i];
      const In v = reinterpret_cast<const In*>(value)[i];
      reinterpret_cast<Out*>(key_dst)[i] = store_as<Cache, kFast>(k, k_div);
      reinterpret_cast<Out*>(value_dst)[i] = store_as<Cache, kFast>(v, v_div);
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    key_dst[i] = store_as<Cache, kFast>(key[i], k_div);
    value_dst[i] = store_as<Cache, kFast>(value[i], v_div);
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
  const Quotient k_div((quantize && p.k_scale) ? *p.k_scale : 1.0f);
  const Quotient v_div((quantize && p.v_scale) ? *p.v_scale : 1.0f);
  const bool fast = k_div.fast() && v_div.fast();  // uniform: one loop or the other
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = p.slot_dtype == XLA_ATTN_I64
                             ? static_cast<const int64_t*>(p.slot_mapping)[t]
                             : int64_t(static_cast<const int32_t*>(p.slot_mapping)[t]);
    if (slot < 0 || slot >= p.num_slots) continue;  // -1 is padding; others are untrusted
    const Src* key = static_cast<const Src*>(p.key) + t * row;
    const Src* value = static_cast<const Src*>(p.value) + t * row;
    Cache* key_dst = static_cast<Cache*>(p.key_cache) + slot * row;
    Cache* value_dst = static_cast<Cache*>(p.value_cache) + slot * row;
    if (!quantize || fast) {
      write_rows<Src, Cache, true>(key, value, key_dst, value_dst, row, k_div, v_div, vectorized);
    } else {
      write_rows<Src, Cache, false>(key, value, key_dst, value_dst, row, k_div, v_div, vectorized);
    }
  }
}

}  // namespace xla_attn
