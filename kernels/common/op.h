// What every op provides, by overloading on its params struct:
//   validate(p)          host-side checks of the struct (shapes, dtypes, pointers)
//   launch_cuda(p, s)    select a variant for the current device and launch it on s
//   host::run(p)         the exact C++ reference (kernels/host)
// run() below is the single path both the XLA FFI handlers and the C ABI take.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "cache/params.h"
#include "flash/params.h"
#include "paged/params.h"

namespace xla_attn {

std::string validate(const xla_attn_flash_fwd_params& p);
std::string validate(const xla_attn_flash_bwd_params& p);
std::string validate(const xla_attn_paged_attention_params& p);
std::string validate(const xla_attn_reshape_and_cache_flash_params& p);

std::string launch_cuda(const xla_attn_flash_fwd_params& p, cudaStream_t stream);
std::string launch_cuda(const xla_attn_flash_bwd_params& p, cudaStream_t stream);
std::string launch_cuda(const xla_attn_paged_attention_params& p, cudaStream_t stream);
std::string launch_cuda(const xla_attn_reshape_and_cache_flash_params& p, cudaStream_t stream);

// Device scratch the CUDA path needs (ops without any return 0).
size_t workspace_size(const xla_attn_flash_fwd_params& p);
size_t workspace_size(const xla_attn_paged_attention_params& p);
size_t workspace_size(const xla_attn_flash_bwd_params& p);
inline size_t workspace_size(const xla_attn_reshape_and_cache_flash_params&) { return 0; }

namespace host {
std::string run(const xla_attn_flash_fwd_params& p);
std::string run(const xla_attn_flash_bwd_params& p);
std::string run(const xla_attn_paged_attention_params& p);
std::string run(const xla_attn_reshape_and_cache_flash_params& p);
}  // namespace host

template <typename Params>
std::string run(const Params& p, int platform, cudaStream_t stream) {
  std::string error = validate(p);
  if (!error.empty()) return error;
  if (platform == XLA_ATTN_HOST) return host::run(p);
  if (platform == XLA_ATTN_CUDA) return launch_cuda(p, stream);
  return "xla_attn: platform must be XLA_ATTN_HOST (0) or XLA_ATTN_CUDA (1)";
}

}  // namespace xla_attn
