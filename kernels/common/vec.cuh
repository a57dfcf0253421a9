// Small device helpers shared by every family: conversions to and from float and
// fixed-size vectors for 16-byte memory traffic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/types.h"

namespace xla_attn {

// NVRTC has no <math.h> INFINITY.
#define XLA_ATTN_INF __int_as_float(0x7f800000)
#define XLA_ATTN_NAN __int_as_float(0x7fffffff)

// NVRTC ships no <type_traits>; these are the two traits the families need.
template <typename A, typename B> inline constexpr bool kSameType = false;
template <typename A> inline constexpr bool kSameType<A, A> = true;

// Select<c, A, B>: A if c, else B (std::conditional_t).
template <bool kCond, typename A, typename B>
struct SelectType {
  using type = A;
};
template <typename A, typename B>
struct SelectType<false, A, B> {
  using type = B;
};
template <bool kCond, typename A, typename B>
using Select = typename SelectType<kCond, A, B>::type;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return float(x); }

// Softmax in base 2 (exp2 is one instruction): scores carry log2 e, lse converts back.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x in one MUFU.EX2 (flushes denormal results to 0; 2^-inf = 0). exp2f without
// fast-math wraps it in a range fix-up that softmax probabilities (<= 1, then rounded
// to 16 bits or accumulated in float) do not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh in one MUFU.TANH on sm_75+ (relative error ~2^-11, what flash-attn's softcap
// uses); tanhf, a branchy sequence, before that.
__device__ __forceinline__ float fast_tanh(float x) {
#if __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}

// Round-to-nearest-even from float. The fp8 constructors saturate to the finite
// range (__NV_SATFINITE), which is vLLM's quantization and the host reference's.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  return __nv_fp8_e4m3(x);
}
template <> __device__ __forceinline__ __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) {
  return __nv_fp8_e5m2(x);
}

// Two floats to two saturated fp8 (x in the low byte): one cvt.satfinite...x2 on
// sm_89+ where from_float costs a cvt, a mask and a byte permute per element.
template <typename F8>
__device__ __forceinline__ __nv_fp8x2_storage_t fp8x2_from_float(float x, float y) {
  constexpr __nv_fp8_interpretation_t kFormat =
      kSameType<F8, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  return __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, kFormat);
}

// N elements moved as one aligned access (N * sizeof(T) is 4, 8 or 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
__device__ __forceinline__ bool aligned_to(const void* p, int bytes) {
  return (reinterpret_cast<uint64_t>(p) % bytes) == 0;
}

}  // namespace xla_attn
