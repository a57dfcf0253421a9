// Shared pieces of the XLA FFI handlers: dtype mapping, optional operands, errors,
// and the one macro that defines a handler for both platforms from one signature.
#pragma once
#include <cuda_runtime_api.h>

#include <string>
#include <type_traits>

#include "common/checks.h"
#include "common/op.h"
#include "xla/ffi/api/ffi.h"

namespace xla_attn::ffi_glue {

namespace ffi = xla::ffi;
using xla_attn::Checker;

inline xla_attn_dtype to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return XLA_ATTN_F32;
    case ffi::DataType::F16: return XLA_ATTN_F16;
    case ffi::DataType::BF16: return XLA_ATTN_BF16;
    case ffi::DataType::F8E4M3FN: return XLA_ATTN_F8E4M3;
    case ffi::DataType::F8E5M2: return XLA_ATTN_F8E5M2;
    case ffi::DataType::S32: return XLA_ATTN_I32;
    case ffi::DataType::S64: return XLA_ATTN_I64;
    case ffi::DataType::U8: return XLA_ATTN_U8;
    default: return -1;
  }
}

// An absent optional operand arrives as a zero-element buffer.
inline const void* optional(const ffi::AnyBuffer& b) {
  return b.element_count() == 0 ? nullptr : b.untyped_data();
}
inline int64_t dim(const ffi::AnyBuffer& b, size_t i) { return b.dimensions()[i]; }
inline size_t rank(const ffi::AnyBuffer& b) { return b.dimensions().size(); }

// i64 attributes that land in int32 params fields (window sizes, seq-length hints).
inline bool fits_int32(int64_t v) { return v >= -(int64_t(1) << 31) && v < (int64_t(1) << 31); }

inline ffi::Error to_error(const std::string& message) {
  if (message.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

// "auto" keeps the cache's own dtype; the fp8 names reinterpret (u8) caches.
inline xla_attn_dtype cache_format(std::string_view name, xla_attn_dtype stored) {
  if (name == "fp8" || name == "fp8_e4m3") return XLA_ATTN_F8E4M3;
  if (name == "fp8_e5m2") return XLA_ATTN_F8E5M2;
  if (name == "auto") return stored;
  return -1;
}

// Checks shared by the handlers of several targets (one message each, one place).
inline void check_scales(Checker& c, const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale) {
  for (const ffi::AnyBuffer* b : {&k_scale, &v_scale}) {
    c.expect(b->element_count() <= 1 && to_dtype(b->element_type()) == XLA_ATTN_F32,
             "k_scale and v_scale must be float32 scalars");
  }
}

// The storage format of a paged cache: its array dtype, or the fp8 format a uint8
// cache holds (kv_cache_dtype); -1 with a recorded error when they disagree.
inline xla_attn_dtype checked_cache_format(Checker& c, std::string_view kv_cache_dtype,
                                           const ffi::AnyBuffer& cache) {
  const xla_attn_dtype stored = to_dtype(cache.element_type());
  const xla_attn_dtype format = cache_format(kv_cache_dtype, stored);
  c.expect(format >= 0, "kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2")
      .expect(stored != XLA_ATTN_U8 || format != stored,
              "a uint8 cache needs kv_cache_dtype fp8_e4m3 or fp8_e5m2")
      .expect(stored == XLA_ATTN_U8 || stored == format,
              "kv_cache_dtype names a format other than the cache array's dtype");
  return format;
}

// Flash forward and backward: the int32 params fields the i64 attributes land in,
// and the ALiBi operand. Returns the ALiBi batch stride (0: shared by all sequences).
inline int32_t check_flash_common(Checker& c, int64_t window_left, int64_t window_right,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k,
                                  const ffi::AnyBuffer& alibi, int64_t batch, int64_t num_heads) {
  c.expect(fits_int32(window_left) && fits_int32(window_right) && fits_int32(max_seqlen_q) &&
               fits_int32(max_seqlen_k),
           "window_left, window_right, max_seqlen_q, max_seqlen_k must fit in int32")
      .expect(alibi.element_count() == 0 ||
                  (to_dtype(alibi.element_type()) == XLA_ATTN_F32 &&
                   (alibi.element_count() == size_t(num_heads) ||
                    alibi.element_count() == size_t(batch * num_heads))),
              "alibi_slopes must be float32 [num_heads] or [batch, num_heads]");
  return alibi.element_count() == size_t(batch * num_heads) && batch > 1
             ? static_cast<int32_t>(num_heads) : 0;
}

// The attributes xla_attn_flash_fwd_v1 and _bwd_v1 share (docs/xla-targets.md).
template <typename B>
auto with_flash_attributes(B binding) {
  return std::move(binding)
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<int64_t>("max_seqlen_q")
      .template Attr<int64_t>("max_seqlen_k");
}

// The workspace a CUDA kernel needs is an extra result of the custom call, sized by
// the frontend with xla_attn_*_workspace_size() (XLA's own allocator then owns it,
// and the call stays capturable in a command buffer). Too small is an error, never
// an out-of-bounds write.
template <typename Params>
ffi::Error run_with_workspace(Params& p, int platform, cudaStream_t stream,
                              ffi::AnyBuffer* workspace) {
  std::string error = validate(p);
  if (!error.empty()) return to_error(error);
  if constexpr (!std::is_same_v<Params, xla_attn_reshape_and_cache_flash_params>) {
    // A 0-byte workspace is none (xla_attn_flash_bwd_v2 then runs v1's path).
    if (platform == XLA_ATTN_CUDA && workspace && workspace->size_bytes() > 0) {
      p.workspace = workspace->untyped_data();
      p.workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
    }
  }
  return to_error(run(p, platform, stream));
}

// Host handlers have no stream; both platforms share one body taking (stream,
// platform, ...). The CUDA handlers are command-buffer compatible (XLA may replay
// them in a CUDA graph): they only enqueue work on the stream they are given — no
// host synchronisation, no allocation (scratch is a result buffer), no host reads of
// device data, and the same launches for the same shapes on every call. Written out rather than through XLA_FFI_DEFINE_HANDLER_SYMBOL,
// which needs a plain function per platform.
#define XLA_ATTN_DEFINE_HANDLERS(HostName, CudaName, Body, Signature)                   \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* HostName(XLA_FFI_CallFrame* call_frame) {                   \
    static auto* handler =                                                              \
        Signature(::xla::ffi::Ffi::Bind())                                              \
            .To([](auto... args) { return Body(nullptr, XLA_ATTN_HOST, args...); })     \
            .release();                                                                 \
    return handler->Call(call_frame);                                                   \
  }                                                                                     \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* CudaName(XLA_FFI_CallFrame* call_frame) {                   \
    static auto* handler =                                                              \
        Signature(::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()) \
            .To([](cudaStream_t stream, auto... args) {                                 \
                  return Body(stream, XLA_ATTN_CUDA, args...);                          \
                },                                                                      \
                {::xla::ffi::Traits::kCmdBufferCompatible})                             \
            .release();                                                                 \
    return handler->Call(call_frame);                                                   \
  }

}  // namespace xla_attn::ffi_glue
