// Host-side scalar conversions between float and the narrow storage formats.
//
// These are the exact reference for what the device kernels do with cuda_fp16.h,
// cuda_bf16.h and cuda_fp8.h: round-to-nearest-even everywhere; f16/bf16 overflow to
// inf; fp8 saturates (__NV_SATFINITE): every finite value beyond the largest finite
// one, and +-inf, become +-max. Results are bit-identical to NumPy / ml_dtypes
// (np.float16, ml_dtypes.bfloat16, and ml_dtypes' fp8 types after np.clip to the
// finite range). NaN bit patterns, where implementations disagree, are chosen as:
//   float -> f16   NaN keeps sign and top payload bits (NumPy; never becomes inf)
//   float -> bf16  sign | 0x7fc0 (ml_dtypes' quiet NaN)
//   float -> fp8   0x7f for both formats (CUDA's canonical NaN, whatever the sign)
//   narrow -> float: f16/bf16 payloads are kept (exact widening); fp8 NaN becomes
//                    sign | 0x7fc00000, as ml_dtypes does.
#pragma once
#include <stdint.h>
#include <string.h>

#include "common/types.h"

namespace xla_attn {

namespace convert_detail {

inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// v / 2^shift rounded to nearest, ties to even; 1 <= shift <= 31.
inline uint32_t rne_shift(uint32_t v, int shift) {
  const uint32_t q = v >> shift;
  const uint32_t rem = v & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// Encodes the magnitude of a finite float (its bits with the sign cleared) in a
// binary format with `mant` mantissa bits and exponent bias `bias`, rounding to
// nearest even. The result may exceed the format's largest finite code; callers
// clamp (to inf or to max finite).
inline uint32_t round_magnitude(uint32_t a, int mant, int bias) {
  const int fe = int(a >> 23);  // biased float exponent, 0 for float subnormals
  if (fe - 127 >= 1 - bias) {
    // Normal in the target: dropping the low float mantissa bits with RNE; a carry
    // out of the mantissa correctly bumps the exponent. Then rebias the exponent.
    return rne_shift(a, 23 - mant) - (uint32_t(127 - bias) << mant);
  }
  // Subnormal (or zero) in the target: count units of its smallest step,
  // 2^(1 - bias - mant). The float's value is sig * 2^(max(fe, 1) - 150).
  const uint32_t sig = (a & 0x7fffffu) | (fe ? 0x800000u : 0u);
  const int shift = (1 - bias - mant) - ((fe ? fe : 1) - 150);  // > 23 - mant >= 1
  // sig < 2^24, so for shift >= 25 the value is below half a step: rounds to 0.
  return shift >= 25 ? 0u : rne_shift(sig, shift);
}

// Widens a binary format (exp_bits/mant/bias) to float; exact. The caller handles
// the all-ones exponent (inf/NaN) where the format has it.
inline float widen(uint32_t sign, uint32_t exp, uint32_t man, int mant, int bias) {
  float mag;
  if (exp == 0) {
    // Subnormal: man * 2^(1 - bias - mant); the product is exact.
    mag = float(man) * bits_float(uint32_t(127 + 1 - bias - mant) << 23);
  } else {
    mag = bits_float((uint32_t(int(exp) - bias + 127) << 23) | (man << (23 - mant)));
  }
  return sign ? -mag : mag;
}

// Saturating float -> fp8 (the two formats differ only in these constants).
inline uint8_t float_to_fp8_sat(float x, int mant, int bias, float max_finite,
                                uint8_t max_code) {
  const uint32_t u = float_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  if (!(bits_float(a) < max_finite)) return uint8_t(sign | max_code);  // incl. inf
  return uint8_t(sign | round_magnitude(a, mant, bias));  // < max: never overflows
}

}  // namespace convert_detail

// ---- f16 (IEEE binary16: 5 exponent bits, 10 mantissa bits, bias 15) ----

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = h >> 15, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f)  // inf or NaN, payload kept (an f16 NaN has man != 0)
    return convert_detail::bits_float((sign << 31) | 0x7f800000u | (man << 13));
  return convert_detail::widen(sign, exp, man, 10, 15);
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = convert_detail::float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN: keep the top payload bits, but never produce inf
    const uint32_t payload = (a >> 13) & 0x3ffu;
    return uint16_t(sign | 0x7c00u | (payload ? payload : 1u));
  }
  if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);
  // Values from 65520 upward round past the largest finite (65504): clamp to inf.
  uint32_t m = convert_detail::round_magnitude(a, 10, 15);
  if (m > 0x7c00u) m = 0x7c00u;
  return uint16_t(sign | m);
}

// ---- bf16 (8 exponent bits, 7 mantissa bits, bias 127: float's upper half) ----

inline float bf16_to_float(uint16_t b) {
  return convert_detail::bits_float(uint32_t(b) << 16);
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = convert_detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(((u >> 16) & 0x8000u) | 0x7fc0u);
  // Same exponent range as float, so RNE on the bits covers subnormals and the
  // overflow to inf (a carry into the all-ones exponent with a zero mantissa).
  return uint16_t(convert_detail::rne_shift(u & 0x7fffffffu, 16) | ((u >> 16) & 0x8000u));
}

// ---- fp8 e4m3fn (4 exponent bits, 3 mantissa bits, bias 7; no inf; NaN = S.1111.111) ----

inline float f8e4m3_to_float(uint8_t b) {
  const uint32_t sign = b >> 7;
  if ((b & 0x7fu) == 0x7fu) return convert_detail::bits_float((sign << 31) | 0x7fc00000u);
  return convert_detail::widen(sign, (b >> 3) & 0xfu, b & 0x7u, 3, 7);
}

inline uint8_t float_to_f8e4m3(float f) {
  return convert_detail::float_to_fp8_sat(f, 3, 7, 448.0f, 0x7e);
}

// ---- fp8 e5m2 (5 exponent bits, 2 mantissa bits, bias 15; IEEE-like inf/NaN) ----

inline float f8e5m2_to_float(uint8_t b) {
  const uint32_t sign = b >> 7, exp = (b >> 2) & 0x1fu, man = b & 0x3u;
  if (exp == 0x1f)
    return convert_detail::bits_float((sign << 31) | (man ? 0x7fc00000u : 0x7f800000u));
  return convert_detail::widen(sign, exp, man, 2, 15);
}

inline uint8_t float_to_f8e5m2(float f) {
  return convert_detail::float_to_fp8_sat(f, 2, 15, 57344.0f, 0x7b);
}

// ---- element access by runtime dtype ----
// Only the float formats are supported (F32, F16, BF16, F8E4M3, F8E5M2); for any
// other dtype load_as_float returns 0 and store_from_float writes nothing.

inline float load_as_float(const void* base, int64_t index, xla_attn_dtype dtype) {
  switch (dtype) {
    case XLA_ATTN_F32: return static_cast<const float*>(base)[index];
    case XLA_ATTN_F16: return f16_to_float(static_cast<const uint16_t*>(base)[index]);
    case XLA_ATTN_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    case XLA_ATTN_F8E4M3: return f8e4m3_to_float(static_cast<const uint8_t*>(base)[index]);
    case XLA_ATTN_F8E5M2: return f8e5m2_to_float(static_cast<const uint8_t*>(base)[index]);
    default: return 0.0f;
  }
}

inline void store_from_float(void* base, int64_t index, xla_attn_dtype dtype, float x) {
  switch (dtype) {
    case XLA_ATTN_F32: static_cast<float*>(base)[index] = x; break;
    case XLA_ATTN_F16: static_cast<uint16_t*>(base)[index] = float_to_f16(x); break;
    case XLA_ATTN_BF16: static_cast<uint16_t*>(base)[index] = float_to_bf16(x); break;
    case XLA_ATTN_F8E4M3: static_cast<uint8_t*>(base)[index] = float_to_f8e4m3(x); break;
    case XLA_ATTN_F8E5M2: static_cast<uint8_t*>(base)[index] = float_to_f8e5m2(x); break;
    default: break;
  }
}

}  // namespace xla_attn
