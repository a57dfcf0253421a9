// Scalar types and the dtype enum shared by host code, device code and the C ABI.
// Device translation units are compiled by NVRTC, which has no <stdint.h>; the
// typedefs below give both sides the same widths.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stddef.h>
#include <stdint.h>
#endif

#ifdef __cplusplus
#define XLA_ATTN_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define XLA_ATTN_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

// constexpr helpers shared by host code and device code (NVRTC treats unannotated
// functions as host-only).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define XLA_ATTN_HOST_DEVICE __host__ __device__
#else
#define XLA_ATTN_HOST_DEVICE
#endif

// Element types. The numbering is part of the C ABI (v1): append, never renumber.
enum {
  XLA_ATTN_F32 = 0,
  XLA_ATTN_F16 = 1,
  XLA_ATTN_BF16 = 2,
  XLA_ATTN_F8E4M3 = 3,  // float8_e4m3fn: no inf, max 448
  XLA_ATTN_F8E5M2 = 4,  // float8_e5m2: IEEE-like, max 57344
  XLA_ATTN_I32 = 5,
  XLA_ATTN_I64 = 6,
  XLA_ATTN_U8 = 7,
};
typedef int32_t xla_attn_dtype;

// Where an op runs. Part of the C ABI (v1).
enum {
  XLA_ATTN_HOST = 0,
  XLA_ATTN_CUDA = 1,
};
