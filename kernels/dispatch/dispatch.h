// Kernel selection and loading. The variant table (kernels/dispatch/variants.py,
// compiled into kernel_table.inc) says what this build contains; select() finds the
// variant for a call, kernel() loads its module on first use and launch() runs it.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "common/types.h"

namespace xla_attn::dispatch {

struct ModuleEntry {
  const char* name;
  const unsigned char* begin;  // embedded fatbin
  const unsigned char* end;
  const char* archs;  // real archs with a cubin, e.g. "70;75;80;86;89;90"
};

struct VariantEntry {
  const char* op;
  const char* family;
  int module;
  const char* kernel;
  xla_attn_dtype dtype0;
  xla_attn_dtype dtype1;
  int head_dim_min;
  int head_dim_max;
  unsigned features;
  int priority;
  int threads;
};

// What a call needs. `arch` is major * 10 + minor.
struct Query {
  const char* op;
  xla_attn_dtype dtype0;
  xla_attn_dtype dtype1;
  int head_dim;
  unsigned features;
  int arch;
};

// The matching variant with the highest priority (restricted to the families named by
// XLA_ATTN_FORCE_FAMILY, comma-separated, when set), or null with `error` naming the query and
// listing what this build has for the op.
const VariantEntry* select(const Query& query, std::string* error);

// Compute capability of the current device as major * 10 + minor, or -1 with error.
int current_arch(std::string* error);

// Shared memory one block of the current device may opt in to (bytes), or -1 with
// error; at most XLA_ATTN_SMEM_OPTIN when that is set (tests run the tile sets of
// GPUs with less, e.g. sm_86's 99 KB, on larger ones).
int shared_optin(std::string* error);

// Streaming multiprocessors of the current device, or -1 with error.
int multiprocessors(std::string* error);

// Loads (once per process) the variant's module and returns its kernel handle.
cudaKernel_t kernel(const VariantEntry& variant, std::string* error);

// Selects for the current device and launches `params` (the kernel's only argument)
// on `stream`. Returns "" or an error message.
std::string launch(const Query& query, dim3 grid, size_t shared_bytes, cudaStream_t stream,
                   const void* params, dim3* block_out = nullptr);

// Launches `variant` with `shared_bytes` of dynamic shared memory; above the 48 KB
// every arch grants by default, the kernel is opted in (once per device) first.
std::string launch(const VariantEntry& variant, dim3 grid, size_t shared_bytes,
                   cudaStream_t stream, const void* params, dim3* block_out = nullptr);

// JSON description of the build (archs, modules, variants) for `python -m xla_attn info`.
const char* build_info_json();

const char* dtype_name(xla_attn_dtype dtype);

}  // namespace xla_attn::dispatch
