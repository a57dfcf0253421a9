// Legacy (untyped, api_version 2) custom calls: descriptor (ffi/legacy.h) + raw
// buffers -> the same params structs the typed handlers fill -> run(). The CUDA
// handlers have XLA's GPU signature; xla_attn_legacy_run is the same path from the C
// ABI on either platform (tests, and runtimes that call it directly).
#include "ffi/legacy.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "capi/xla_attn.h"
#include "common/op.h"

// XLA's status object of api_version 2 calls, opaque to us.
typedef struct XlaCustomCallStatus_ XlaCustomCallStatus;
typedef void (*xla_attn_status_fn)(XlaCustomCallStatus*, const char*, size_t);

namespace {

xla_attn_status_fn g_set_failure = nullptr;

template <typename Desc>
std::string decode(const char* opaque, size_t len, int op, Desc* out) {
  xla_attn_legacy_header h{};
  if (!opaque || len < sizeof(h)) {
    return "xla_attn legacy descriptor: " + std::to_string(len) + " bytes, shorter than its " +
           std::to_string(sizeof(h)) + "-byte header";
  }
  std::memcpy(&h, opaque, sizeof(h));
  if (h.magic != XLA_ATTN_LEGACY_MAGIC) {
    return "xla_attn legacy descriptor: bad magic (not written by xla_attn)";
  }
  if (h.version != XLA_ATTN_LEGACY_VERSION) {
    return "xla_attn legacy descriptor: version " + std::to_string(h.version) +
           ", this library reads version " + std::to_string(XLA_ATTN_LEGACY_VERSION) +
           "; the Python package and the native library come from different builds";
  }
  if (h.op != op) {
    return "xla_attn legacy descriptor: written for op " + std::to_string(h.op) +
           ", passed to the handler of op " + std::to_string(op);
  }
  if (h.size != sizeof(Desc) || len != sizeof(Desc)) {
    return "xla_attn legacy descriptor: op " + std::to_string(op) + " takes " +
           std::to_string(sizeof(Desc)) + " bytes, got " + std::to_string(len) +
           " (header says " + std::to_string(h.size) + ")";
  }
  std::memcpy(out, opaque, sizeof(Desc));
  return "";
}

// Optional operand i: its buffer when the descriptor says it is present, else null.
inline void* optional(const xla_attn_legacy_header& h, void** buffers, int i) {
  return (h.present >> i) & 1u ? buffers[i] : nullptr;
}

std::string flash_fwd(int platform, cudaStream_t stream, void** b, const char* opaque,
                      size_t len) {
  xla_attn_legacy_flash_fwd d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_FLASH_FWD, &d);
  if (!error.empty()) return error;
  const auto& h = d.header;
  xla_attn_flash_fwd_params p{};
  p.q = b[0];
  p.k = b[1];
  p.v = b[2];
  p.cu_seqlens_q = static_cast<const int32_t*>(b[3]);
  p.cu_seqlens_k = static_cast<const int32_t*>(b[4]);
  p.seqused_k = static_cast<const int32_t*>(optional(h, b, 5));
  p.block_table = static_cast<const int32_t*>(optional(h, b, 6));
  p.alibi_slopes = static_cast<const float*>(optional(h, b, 7));
  p.q_descale = static_cast<const float*>(optional(h, b, 8));
  p.k_descale = static_cast<const float*>(optional(h, b, 9));
  p.v_descale = static_cast<const float*>(optional(h, b, 10));
  p.out = b[11];
  p.softmax_lse = static_cast<float*>(b[12]);
  if (platform == XLA_ATTN_CUDA && d.workspace_bytes > 0) {
    p.workspace = b[13];
    p.workspace_bytes = d.workspace_bytes;
  }
  p.total_q = d.total_q;
  p.total_k = d.total_k;
  p.batch = d.batch;
  p.num_heads = d.num_heads;
  p.num_heads_k = d.num_heads_k;
  p.head_dim = d.head_dim;
  p.max_seqlen_q = d.max_seqlen_q;
  p.max_seqlen_k = d.max_seqlen_k;
  p.num_blocks = d.num_blocks;
  p.block_size = d.block_size;
  p.max_blocks_per_seq = d.max_blocks_per_seq;
  p.alibi_batch_stride = d.alibi_batch_stride;
  p.window_left = d.window_left;
  p.window_right = d.window_right;
  p.softmax_scale = d.softmax_scale;
  p.softcap = d.softcap;
  p.q_dtype = d.q_dtype;
  p.kv_dtype = d.kv_dtype;
  p.out_dtype = d.out_dtype;
  return xla_attn::run(p, platform, stream);
}

// The params of either flash_bwd descriptor (v3 is v1 plus dlse as buffer 10 and a
// workspace); the results start at buffer `results`.
xla_attn_flash_bwd_params bwd_params(const xla_attn_legacy_flash_bwd& d, void** b, int results) {
  xla_attn_flash_bwd_params p{};
  p.dout = b[0];
  p.q = b[1];
  p.k = b[2];
  p.v = b[3];
  p.out = b[4];
  p.softmax_lse = static_cast<const float*>(b[5]);
  p.cu_seqlens_q = static_cast<const int32_t*>(b[6]);
  p.cu_seqlens_k = static_cast<const int32_t*>(b[7]);
  p.seqused_k = static_cast<const int32_t*>(optional(d.header, b, 8));
  p.alibi_slopes = static_cast<const float*>(optional(d.header, b, 9));
  p.dq = b[results];
  p.dk = b[results + 1];
  p.dv = b[results + 2];
  p.total_q = d.total_q;
  p.total_k = d.total_k;
  p.batch = d.batch;
  p.num_heads = d.num_heads;
  p.num_heads_k = d.num_heads_k;
  p.head_dim = d.head_dim;
  p.max_seqlen_q = d.max_seqlen_q;
  p.max_seqlen_k = d.max_seqlen_k;
  p.alibi_batch_stride = d.alibi_batch_stride;
  p.window_left = d.window_left;
  p.window_right = d.window_right;
  p.softmax_scale = d.softmax_scale;
  p.softcap = d.softcap;
  p.dtype = d.dtype;
  return p;
}

std::string flash_bwd(int platform, cudaStream_t stream, void** b, const char* opaque,
                      size_t len) {
  xla_attn_legacy_flash_bwd d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_FLASH_BWD, &d);
  if (!error.empty()) return error;
  return xla_attn::run(bwd_params(d, b, 10), platform, stream);
}

std::string flash_bwd_v3(int platform, cudaStream_t stream, void** b, const char* opaque,
                         size_t len) {
  xla_attn_legacy_flash_bwd_v3 d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_FLASH_BWD_V3, &d);
  if (!error.empty()) return error;
  xla_attn_flash_bwd_params p = bwd_params(d.v1, b, 11);
  p.dlse = static_cast<const float*>(optional(d.v1.header, b, 10));
  if (platform == XLA_ATTN_CUDA && d.workspace_bytes > 0) {
    p.workspace = b[14];
    p.workspace_bytes = d.workspace_bytes;
  }
  return xla_attn::run(p, platform, stream);
}

// The params of either paged_attention descriptor (v2 is v1 plus ALiBi and the
// max_query_len hint); the results start at buffer `results`.
xla_attn_paged_attention_params paged_params(const xla_attn_legacy_paged_attention& d,
                                             int platform, void** b, int results) {
  xla_attn_paged_attention_params p{};
  p.query = b[0];
  p.key_cache = b[1];
  p.value_cache = b[2];
  p.seq_lens = static_cast<const int32_t*>(b[3]);
  p.block_tables = static_cast<const int32_t*>(b[4]);
  p.query_start_loc = static_cast<const int32_t*>(b[5]);
  p.num_seqs = static_cast<const int32_t*>(optional(d.header, b, 6));
  p.k_scale = static_cast<const float*>(optional(d.header, b, 7));
  p.v_scale = static_cast<const float*>(optional(d.header, b, 8));
  p.out = b[results];
  if (platform == XLA_ATTN_CUDA && d.workspace_bytes > 0) {
    p.workspace = b[results + 1];
    p.workspace_bytes = d.workspace_bytes;
  }
  p.total_q = d.total_q;
  p.max_num_seqs = d.max_num_seqs;
  p.num_heads = d.num_heads;
  p.num_heads_k = d.num_heads_k;
  p.head_dim = d.head_dim;
  p.num_blocks = d.num_blocks;
  p.block_size = d.block_size;
  p.max_blocks_per_seq = d.max_blocks_per_seq;
  p.sliding_window = d.sliding_window;
  p.scale = d.scale;
  p.soft_cap = d.soft_cap;
  p.q_dtype = d.q_dtype;
  p.cache_dtype = d.cache_dtype;
  return p;
}

std::string paged_attention(int platform, cudaStream_t stream, void** b, const char* opaque,
                            size_t len) {
  xla_attn_legacy_paged_attention d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_PAGED_ATTENTION, &d);
  if (!error.empty()) return error;
  return xla_attn::run(paged_params(d, platform, b, 9), platform, stream);
}

std::string paged_attention_v2(int platform, cudaStream_t stream, void** b, const char* opaque,
                               size_t len) {
  xla_attn_legacy_paged_attention_v2 d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_PAGED_ATTENTION_V2, &d);
  if (!error.empty()) return error;
  xla_attn_paged_attention_params p = paged_params(d.v1, platform, b, 10);
  p.alibi_slopes = static_cast<const float*>(optional(d.v1.header, b, 9));
  p.max_query_len = d.max_query_len;
  return xla_attn::run(p, platform, stream);
}

// Results that are not the operands' buffers (the call was not aliased) start as a
// copy of the old cache, as the typed handler does.
std::string carry_over(int platform, cudaStream_t stream, const void* in, void* out,
                       size_t bytes) {
  if (in == out || bytes == 0) return "";
  if (platform == XLA_ATTN_HOST) {
    std::memcpy(out, in, bytes);
    return "";
  }
  cudaError_t st = cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream);
  return st == cudaSuccess ? "" : std::string("xla_attn: cache copy failed: ") +
                                      cudaGetErrorString(st);
}

size_t cache_bytes(const xla_attn_legacy_reshape_and_cache_flash& d) {
  const size_t element = d.cache_dtype == XLA_ATTN_F32 ? 4
                         : (d.cache_dtype == XLA_ATTN_F16 || d.cache_dtype == XLA_ATTN_BF16) ? 2
                                                                                            : 1;
  return size_t(d.num_blocks) * size_t(d.block_size) * size_t(d.num_heads_k) *
         size_t(d.head_dim) * element;
}

std::string reshape_and_cache_flash(int platform, cudaStream_t stream, void** b,
                                    const char* opaque, size_t len) {
  xla_attn_legacy_reshape_and_cache_flash d{};
  std::string error = decode(opaque, len, XLA_ATTN_LEGACY_RESHAPE_AND_CACHE_FLASH, &d);
  if (!error.empty()) return error;
  xla_attn_reshape_and_cache_flash_params p{};
  p.key = b[0];
  p.value = b[1];
  p.slot_mapping = b[4];
  p.k_scale = static_cast<const float*>(optional(d.header, b, 5));
  p.v_scale = static_cast<const float*>(optional(d.header, b, 6));
  p.key_cache = b[7];
  p.value_cache = b[8];
  p.num_tokens = d.num_tokens;
  p.num_slots = d.num_slots;
  p.num_heads_k = d.num_heads_k;
  p.head_dim = d.head_dim;
  p.block_size = d.block_size;
  p.num_blocks = d.num_blocks;
  p.src_dtype = d.src_dtype;
  p.cache_dtype = d.cache_dtype;
  p.slot_dtype = d.slot_dtype;
  error = xla_attn::validate(p);
  if (error.empty()) error = carry_over(platform, stream, b[2], b[7], cache_bytes(d));
  if (error.empty()) error = carry_over(platform, stream, b[3], b[8], cache_bytes(d));
  return error.empty() ? xla_attn::run(p, platform, stream) : error;
}

using LegacyOp = std::string (*)(int, cudaStream_t, void**, const char*, size_t);

LegacyOp op_function(int op) {
  switch (op) {
    case XLA_ATTN_LEGACY_FLASH_FWD: return flash_fwd;
    case XLA_ATTN_LEGACY_FLASH_BWD: return flash_bwd;
    case XLA_ATTN_LEGACY_PAGED_ATTENTION: return paged_attention;
    case XLA_ATTN_LEGACY_RESHAPE_AND_CACHE_FLASH: return reshape_and_cache_flash;
    case XLA_ATTN_LEGACY_PAGED_ATTENTION_V2: return paged_attention_v2;
    case XLA_ATTN_LEGACY_FLASH_BWD_V3: return flash_bwd_v3;
    default: return nullptr;
  }
}

// A C++ exception must never cross into XLA or the C caller.
std::string run_guarded(LegacyOp fn, int platform, cudaStream_t stream, void** buffers,
                        const char* opaque, size_t len) {
  try {
    return fn(platform, stream, buffers, opaque, len);
  } catch (const std::exception& e) {
    return std::string("xla_attn: internal error: ") + e.what();
  }
}

void report_status(XlaCustomCallStatus* status, const std::string& message) {
  if (message.empty()) return;
  // Set by the frontend from the runtime's own symbol; else whatever the process
  // exports under XLA's name.
  if (!g_set_failure) {
    g_set_failure = reinterpret_cast<xla_attn_status_fn>(
        dlsym(RTLD_DEFAULT, "XlaCustomCallStatusSetFailure"));
  }
  if (g_set_failure && status) {
    g_set_failure(status, message.data(), message.size());
  } else {
    std::fprintf(stderr, "%s (no XlaCustomCallStatusSetFailure to report it through)\n",
                 message.c_str());
  }
}

void cuda_handler(int op, cudaStream_t stream, void** buffers, const char* opaque, size_t len,
                  XlaCustomCallStatus* status) {
  report_status(status, run_guarded(op_function(op), XLA_ATTN_CUDA, stream, buffers, opaque,
                                    len));
}

}  // namespace

extern "C" {

XLA_ATTN_EXPORT int xla_attn_legacy_run(int platform, void* stream, void** buffers,
                                        const char* opaque, size_t opaque_len, char* error,
                                        size_t error_len) {
  xla_attn_legacy_header h{};
  std::string message;
  if (!buffers) {
    message = "xla_attn_legacy_run: buffers must not be null";
  } else if (!opaque || opaque_len < sizeof(h)) {
    message = "xla_attn legacy descriptor: shorter than its header";
  } else {
    std::memcpy(&h, opaque, sizeof(h));
    LegacyOp fn = op_function(h.op);
    message = fn ? run_guarded(fn, platform, static_cast<cudaStream_t>(stream), buffers, opaque,
                               opaque_len)
                 : "xla_attn legacy descriptor: unknown op " + std::to_string(h.op);
  }
  if (error && error_len) {
    std::strncpy(error, message.c_str(), error_len - 1);
    error[error_len - 1] = '\0';
  }
  return message.empty() ? 0 : 1;
}

XLA_ATTN_EXPORT size_t xla_attn_legacy_descriptor_size(int op) {
  switch (op) {
    case XLA_ATTN_LEGACY_FLASH_FWD: return sizeof(xla_attn_legacy_flash_fwd);
    case XLA_ATTN_LEGACY_FLASH_BWD: return sizeof(xla_attn_legacy_flash_bwd);
    case XLA_ATTN_LEGACY_PAGED_ATTENTION: return sizeof(xla_attn_legacy_paged_attention);
    case XLA_ATTN_LEGACY_RESHAPE_AND_CACHE_FLASH:
      return sizeof(xla_attn_legacy_reshape_and_cache_flash);
    case XLA_ATTN_LEGACY_PAGED_ATTENTION_V2: return sizeof(xla_attn_legacy_paged_attention_v2);
    case XLA_ATTN_LEGACY_FLASH_BWD_V3: return sizeof(xla_attn_legacy_flash_bwd_v3);
    default: return 0;
  }
}

// XLA's XlaCustomCallStatusSetFailure as found in the runtime that will call us
// (null: look it up by name in the process on first error).
XLA_ATTN_EXPORT void xla_attn_legacy_set_status_function(void* fn) {
  g_set_failure = reinterpret_cast<xla_attn_status_fn>(fn);
}

XLA_ATTN_EXPORT void XlaAttnFlashFwdV1Legacy(cudaStream_t stream, void** buffers,
                                             const char* opaque, size_t len,
                                             XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_FLASH_FWD, stream, buffers, opaque, len, status);
}
XLA_ATTN_EXPORT void XlaAttnFlashBwdV1Legacy(cudaStream_t stream, void** buffers,
                                             const char* opaque, size_t len,
                                             XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_FLASH_BWD, stream, buffers, opaque, len, status);
}
XLA_ATTN_EXPORT void XlaAttnFlashBwdV3Legacy(cudaStream_t stream, void** buffers,
                                             const char* opaque, size_t len,
                                             XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_FLASH_BWD_V3, stream, buffers, opaque, len, status);
}
XLA_ATTN_EXPORT void XlaAttnPagedAttentionV1Legacy(cudaStream_t stream, void** buffers,
                                                   const char* opaque, size_t len,
                                                   XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_PAGED_ATTENTION, stream, buffers, opaque, len, status);
}
XLA_ATTN_EXPORT void XlaAttnPagedAttentionV2Legacy(cudaStream_t stream, void** buffers,
                                                   const char* opaque, size_t len,
                                                   XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_PAGED_ATTENTION_V2, stream, buffers, opaque, len, status);
}
XLA_ATTN_EXPORT void XlaAttnReshapeAndCacheFlashV1Legacy(cudaStream_t stream, void** buffers,
                                                         const char* opaque, size_t len,
                                                         XlaCustomCallStatus* status) {
  cuda_handler(XLA_ATTN_LEGACY_RESHAPE_AND_CACHE_FLASH, stream, buffers, opaque, len, status);
}

}  // extern "C"
