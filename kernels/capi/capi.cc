#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "capi/xla_attn.h"
#include "common/op.h"
#include "dispatch/dispatch.h"

#ifndef XLA_ATTN_VERSION
#define XLA_ATTN_VERSION "0+unknown"
#endif

namespace {

int report(const std::string& message, char* out, size_t out_len) {
  if (out && out_len) {
    std::strncpy(out, message.c_str(), out_len - 1);
    out[out_len - 1] = '\0';
  }
  return message.empty() ? 0 : 1;
}

template <typename Params>
int run_op(const Params* p, int platform, void* stream, char* error, size_t error_len) {
  if (!p) return report("xla_attn: params must not be null", error, error_len);
  // A C++ exception must never cross the C boundary (it would abort the caller).
  try {
    return report(xla_attn::run(*p, platform, static_cast<cudaStream_t>(stream)), error,
                  error_len);
  } catch (const std::exception& e) {
    return report(std::string("xla_attn: internal error: ") + e.what(), error, error_len);
  }
}

}  // namespace

extern "C" {

int xla_attn_abi_version(void) { return XLA_ATTN_ABI_VERSION; }
const char* xla_attn_version(void) { return XLA_ATTN_VERSION; }

const char* xla_attn_build_info(void) {
  static const std::string info = [] {
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    std::string modules = xla_attn::dispatch::build_info_json();
    return std::string("{\"abi\": ") + std::to_string(XLA_ATTN_ABI_VERSION) + ", \"version\": \"" +
           XLA_ATTN_VERSION + "\", \"cuda_runtime\": " + std::to_string(runtime) + ", " +
           modules.substr(1);
  }();
  return info.c_str();
}

int xla_attn_flash_fwd(const xla_attn_flash_fwd_params* p, int platform, void* stream, char* e,
                       size_t n) {
  return run_op(p, platform, stream, e, n);
}
int xla_attn_flash_bwd(const xla_attn_flash_bwd_params* p, int platform, void* stream, char* e,
                       size_t n) {
  return run_op(p, platform, stream, e, n);
}
int xla_attn_paged_attention(const xla_attn_paged_attention_params* p, int platform, void* stream,
                             char* e, size_t n) {
  return run_op(p, platform, stream, e, n);
}
int xla_attn_reshape_and_cache_flash(const xla_attn_reshape_and_cache_flash_params* p, int platform, void* stream, char* e,
                         size_t n) {
  return run_op(p, platform, stream, e, n);
}

int xla_attn_select_variant(const char* op, int dtype0, int dtype1, int head_dim,
                            unsigned features, int arch, char* out, size_t out_len) {
  if (!op) return report("xla_attn: op must not be null", out, out_len);
  std::string error;
  xla_attn::dispatch::Query q{op, dtype0, dtype1, head_dim, features, arch};
  const xla_attn::dispatch::VariantEntry* v = xla_attn::dispatch::select(q, &error);
  if (!v) return report(error, out, out_len);
  report(v->kernel, out, out_len);
  return 0;
}

size_t xla_attn_workspace_size(const char* op, const void* params) {
  if (!op || !params) return 0;
  const std::string name(op);
  if (name == "flash_fwd")
    return xla_attn::workspace_size(*static_cast<const xla_attn_flash_fwd_params*>(params));
  if (name == "flash_bwd")
    return xla_attn::workspace_size(*static_cast<const xla_attn_flash_bwd_params*>(params));
  if (name == "paged_attention")
    return xla_attn::workspace_size(*static_cast<const xla_attn_paged_attention_params*>(params));
  return 0;
}

size_t xla_attn_flash_bwd_workspace_size(int64_t total_q, int32_t batch, int32_t num_heads,
                                         int32_t head_dim, int32_t dtype) {
  xla_attn_flash_bwd_params p{};
  p.total_q = total_q;
  p.batch = batch;
  p.num_heads = num_heads;
  p.head_dim = head_dim;
  p.dtype = static_cast<xla_attn_dtype>(dtype);
  return total_q >= 0 && batch >= 0 ? xla_attn::workspace_size(p) : 0;
}

size_t xla_attn_flash_fwd_workspace_size_v2(int64_t total_q, int64_t total_k, int32_t batch,
                                            int32_t num_heads, int32_t num_heads_k,
                                            int32_t head_dim, int32_t max_seqlen_q,
                                            int32_t max_seqlen_k, int32_t kv_dtype,
                                            int32_t paged) {
  xla_attn_flash_fwd_params p{};
  p.total_q = total_q;
  p.total_k = total_k;
  p.batch = batch;
  p.num_heads = num_heads;
  p.num_heads_k = num_heads_k;
  p.head_dim = head_dim;
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  p.kv_dtype = static_cast<xla_attn_dtype>(kv_dtype);
  p.block_size = paged ? 1 : 0;  // paged: no V^T (workspace_size)
  // no window known: sized for the most V^T a call of these shapes may take (a causal
  // d64 / d128 call takes it from twice the rows: sm90_tiles.h, vt_given_covers)
  p.window_left = p.window_right = -1;
  return num_heads > 0 && num_heads_k > 0 && head_dim > 0 && total_q >= 0 && total_k >= 0 &&
                 batch >= 0
             ? xla_attn::workspace_size(p)
             : 0;
}

// v1: blind to K (no fp8 V^T: the forward then transposes V itself).
size_t xla_attn_flash_fwd_workspace_size(int64_t total_q, int32_t batch, int32_t num_heads,
                                         int32_t head_dim, int32_t max_seqlen_q,
                                         int32_t max_seqlen_k) {
  return xla_attn_flash_fwd_workspace_size_v2(total_q, 0, batch, num_heads, num_heads, head_dim,
                                              max_seqlen_q, max_seqlen_k, XLA_ATTN_F32, 0);
}

size_t xla_attn_paged_attention_workspace_size(int64_t total_q, int32_t max_num_seqs,
                                               int32_t num_heads, int32_t head_dim,
                                               int32_t max_blocks_per_seq, int32_t block_size,
                                               int32_t max_query_len) {
  xla_attn_paged_attention_params p{};
  p.total_q = total_q;
  p.max_num_seqs = max_num_seqs;
  p.num_heads = num_heads;
  p.head_dim = head_dim;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.block_size = block_size;
  p.max_query_len = max_query_len;  // bounds the flash grid, which changes its split plan
  return num_heads > 0 && head_dim > 0 ? xla_attn::workspace_size(p) : 0;
}

size_t xla_attn_params_size(const char* op) {
  if (!op) return 0;
  const std::string name(op);
  if (name == "flash_fwd") return sizeof(xla_attn_flash_fwd_params);
  if (name == "flash_bwd") return sizeof(xla_attn_flash_bwd_params);
  if (name == "paged_attention") return sizeof(xla_attn_paged_attention_params);
  if (name == "reshape_and_cache_flash") return sizeof(xla_attn_reshape_and_cache_flash_params);
  return 0;
}

int xla_attn_device_arch(char* error, size_t error_len) {
  std::string message;
  int arch = xla_attn::dispatch::current_arch(&message);
  report(message, error, error_len);
  return arch;
}

}  // extern "C"
