#include "dispatch/dispatch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

namespace xla_attn::dispatch {
namespace {
#include "kernel_table.inc"

// `families`: null (any), or a comma-separated list of family names.
bool in_families(const char* family, const char* families) {
  if (!families) return true;
  const size_t n = std::strlen(family);
  for (const char* at = families; *at;) {
    const char* end = std::strchr(at, ',');
    const size_t len = end ? size_t(end - at) : std::strlen(at);
    if (len == n && std::strncmp(at, family, n) == 0) return true;
    if (!end) break;
    at = end + 1;
  }
  return false;
}

bool matches(const VariantEntry& v, const Query& q, const char* families) {
  return std::strcmp(v.op, q.op) == 0 && v.dtype0 == q.dtype0 && v.dtype1 == q.dtype1 &&
         q.head_dim >= v.head_dim_min && q.head_dim <= v.head_dim_max &&
         (q.features & ~v.features) == 0 && in_families(v.family, families);
}

// Lowest real arch the module has a cubin for; the driver runs that cubin (same
// major) or JITs the newest PTX on any later arch.
int min_arch(const ModuleEntry& m) { return std::atoi(m.archs); }

// Whether the module runs on `arch`: from its lowest cubin's arch on, or on exactly that
// arch for arch-specific code ("90a": an sm_90a cubin, whose PTX no later GPU can JIT).
bool runs_on(const ModuleEntry& m, int arch) {
  return std::strchr(m.archs, 'a') ? arch == min_arch(m) : arch >= min_arch(m);
}

std::string describe_op(const char* op) {
  std::ostringstream os;
  bool any = false;
  for (const VariantEntry* v = kVariants; v->op; ++v) {
    if (std::strcmp(v->op, op) != 0) continue;
    os << (any ? ", " : "") << v->family << "(" << dtype_name(v->dtype0) << "->"
       << dtype_name(v->dtype1) << ", sm_" << kModules[v->module].archs << ")";
    any = true;
  }
  if (!any) {
    os << "none; CUDA kernels exist for:";
    const char* last = "";
    for (const VariantEntry* v = kVariants; v->op; ++v) {
      if (std::strcmp(v->op, last) != 0) os << " " << v->op;
      last = v->op;
    }
  }
  return os.str();
}
}  // namespace

const char* dtype_name(xla_attn_dtype dtype) {
  switch (dtype) {
    case XLA_ATTN_F32: return "f32";
    case XLA_ATTN_F16: return "f16";
    case XLA_ATTN_BF16: return "bf16";
    case XLA_ATTN_F8E4M3: return "f8e4m3";
    case XLA_ATTN_F8E5M2: return "f8e5m2";
    case XLA_ATTN_I32: return "i32";
    case XLA_ATTN_I64: return "i64";
    case XLA_ATTN_U8: return "u8";
  }
  return "?";
}

const VariantEntry* select(const Query& q, std::string* error) {
  const char* family = std::getenv("XLA_ATTN_FORCE_FAMILY");
  if (family && !*family) family = nullptr;
  const VariantEntry* best = nullptr;
  for (const VariantEntry* v = kVariants; v->op; ++v) {
    if (!matches(*v, q, family) || !runs_on(kModules[v->module], q.arch)) continue;
    if (!best || v->priority > best->priority) best = v;
  }
  if (!best) {
    std::ostringstream os;
    os << "xla_attn: no CUDA kernel for " << q.op << " with dtypes " << dtype_name(q.dtype0)
       << "->" << dtype_name(q.dtype1) << ", head_dim " << q.head_dim << ", features 0x"
       << std::hex << q.features << std::dec << " on sm_" << q.arch;
    if (family) os << " in families '" << family << "' (XLA_ATTN_FORCE_FAMILY)";
    os << "; this build has: " << describe_op(q.op);
    *error = os.str();
  }
  return best;
}

namespace {
// One attribute of the current device into *value; false with `error` set where the
// runtime cannot say.
bool device_attribute(cudaDeviceAttr attr, int* value, std::string* error) {
  int device = 0;
  cudaError_t st = cudaGetDevice(&device);
  if (st == cudaSuccess) st = cudaDeviceGetAttribute(value, attr, device);
  if (st != cudaSuccess) {
    *error = std::string("xla_attn: cannot query the current CUDA device: ") + cudaGetErrorString(st);
    return false;
  }
  return true;
}
}  // namespace

int current_arch(std::string* error) {
  int major = 0, minor = 0;
  if (!device_attribute(cudaDevAttrComputeCapabilityMajor, &major, error) ||
      !device_attribute(cudaDevAttrComputeCapabilityMinor, &minor, error)) {
    return -1;
  }
  return major * 10 + minor;
}

int multiprocessors(std::string* error) {
  int count = 0;
  return device_attribute(cudaDevAttrMultiProcessorCount, &count, error) ? count : -1;
}

int shared_optin(std::string* error) {
  int bytes = 0;
  if (!device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, &bytes, error)) return -1;
  if (const char* cap = std::getenv("XLA_ATTN_SMEM_OPTIN"); cap && *cap) {
    bytes = std::min(bytes, std::atoi(cap));
  }
  return bytes;
}

cudaKernel_t kernel(const VariantEntry& variant, std::string* error) {
  // One library per module and one handle per variant, loaded on first use and kept
  // for the life of the process (cudaLibrary_t is context-independent: one load
  // serves every device).
  static std::mutex mu;
  static cudaLibrary_t libraries[sizeof(kModules) / sizeof(kModules[0])] = {};
  static cudaKernel_t kernels[sizeof(kVariants) / sizeof(kVariants[0])] = {};
  const size_t index = &variant - kVariants;
  std::lock_guard<std::mutex> lock(mu);
  if (kernels[index]) return kernels[index];
  // XLA records command-buffer-compatible handlers under stream capture, so the first
  // use of a module may come while this thread's stream is capturing: loading a
  // module is not a stream operation, and relaxed mode lets it happen there.
  struct RelaxedCapture {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
    ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  } relaxed;
  cudaLibrary_t& lib = libraries[variant.module];
  if (!lib) {
    cudaError_t st = cudaLibraryLoadData(&lib, kModules[variant.module].begin, nullptr, nullptr, 0,
                                         nullptr, nullptr, 0);
    if (st != cudaSuccess) {
      lib = nullptr;
      *error = std::string("xla_attn: cannot load kernel module ") + kModules[variant.module].name +
               " (cubins for sm_" + kModules[variant.module].archs + "): " + cudaGetErrorString(st);
      return nullptr;
    }
  }
  cudaError_t st = cudaLibraryGetKernel(&kernels[index], lib, variant.kernel);
  if (st != cudaSuccess) {
    *error = std::string("xla_attn: kernel ") + variant.kernel + " missing from its module: " +
             cudaGetErrorString(st);
    return nullptr;
  }
  return kernels[index];
}

namespace {

// Lets `k` use `bytes` of dynamic shared memory on the current device. The attribute
// is per device; each variant is opted in once per device, to the most it was asked
// for (launch sizes are per variant, so that is one call per variant and device).
std::string allow_shared(const VariantEntry& variant, cudaKernel_t k, size_t bytes) {
  constexpr size_t kDefault = 48 * 1024;  // granted to every kernel without opting in
  constexpr int kMaxDevices = 64;
  if (bytes <= kDefault) return "";
  int device = 0;
  cudaError_t st = cudaGetDevice(&device);
  if (st != cudaSuccess) {
    return std::string("xla_attn: cudaGetDevice failed: ") + cudaGetErrorString(st);
  }
  static std::mutex mu;
  static size_t granted[sizeof(kVariants) / sizeof(kVariants[0])][kMaxDevices] = {};
  const size_t index = &variant - kVariants;
  std::lock_guard<std::mutex> lock(mu);
  if (device < kMaxDevices && granted[index][device] >= bytes) return "";
  // Not a stream operation; relaxed capture mode lets it run while XLA captures.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  st = cudaFuncSetAttribute(reinterpret_cast<const void*>(k),
                            cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (st != cudaSuccess) {
    return std::string("xla_attn: ") + variant.kernel + " cannot have " + std::to_string(bytes) +
           " bytes of shared memory on this device: " + cudaGetErrorString(st);
  }
  if (device < kMaxDevices) granted[index][device] = bytes;
  return "";
}

}  // namespace

std::string launch(const VariantEntry& v, dim3 grid, size_t shared_bytes, cudaStream_t stream,
                   const void* params, dim3* block_out) {
  std::string error;
  cudaKernel_t k = kernel(v, &error);
  if (!k) return error;
  error = allow_shared(v, k, shared_bytes);
  if (!error.empty()) return error;
  dim3 block(v.threads);
  if (block_out) *block_out = block;
  void* args[] = {const_cast<void*>(params)};
  cudaError_t st = cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, block, args,
                                    shared_bytes, stream);
  if (st != cudaSuccess) {
    return std::string("xla_attn: launching ") + v.kernel + " failed: " + cudaGetErrorString(st);
  }
  return "";
}

std::string launch(const Query& query, dim3 grid, size_t shared_bytes, cudaStream_t stream,
                   const void* params, dim3* block_out) {
  std::string error;
  Query q = query;
  if (q.arch <= 0 && (q.arch = current_arch(&error)) < 0) return error;
  const VariantEntry* v = select(q, &error);
  if (!v) return error;
  return launch(*v, grid, shared_bytes, stream, params, block_out);
}

const char* build_info_json() {
  static const std::string json = [] {
    std::ostringstream os;
    os << "{\"modules\": [";
    for (const ModuleEntry* m = kModules; m->name; ++m) {
      os << (m == kModules ? "" : ", ") << "{\"name\": \"" << m->name << "\", \"archs\": \""
         << m->archs << "\", \"bytes\": " << (m->end - m->begin) << "}";
    }
    os << "], \"variants\": [";
    for (const VariantEntry* v = kVariants; v->op; ++v) {
      os << (v == kVariants ? "" : ", ") << "{\"op\": \"" << v->op << "\", \"family\": \""
         << v->family << "\", \"module\": \"" << kModules[v->module].name << "\", \"kernel\": \""
         << v->kernel << "\", \"dtype0\": \"" << dtype_name(v->dtype0) << "\", \"dtype1\": \""
         << dtype_name(v->dtype1) << "\", \"head_dim\": [" << v->head_dim_min << ", "
         << v->head_dim_max << "], \"features\": " << v->features << ", \"priority\": "
         << v->priority << "}";
    }
    os << "]}";
    return os.str();
  }();
  return json.c_str();
}

}  // namespace xla_attn::dispatch
