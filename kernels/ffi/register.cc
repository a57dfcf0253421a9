// Registration of the typed FFI handlers through a framework's XLA_FFI_Api, for
// runtimes that offer no registration call of their own (torch_xla on the CPU): the
// caller finds the runtime's api pointer (xla::ffi::GetXlaFfiApi()) and hands it here,
// and the handler is registered under any name, so a frontend can register one
// handler under several target names.
#include <cstring>
#include <string>

#include "capi/xla_attn.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* XlaAttnFlashFwdV1Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashFwdV1Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV1Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV1Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV2Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV2Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV3Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnFlashBwdV3Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnPagedAttentionV1Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnPagedAttentionV1Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnPagedAttentionV2Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnPagedAttentionV2Cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnReshapeAndCacheFlashV1Host(XLA_FFI_CallFrame*);
XLA_FFI_Error* XlaAttnReshapeAndCacheFlashV1Cuda(XLA_FFI_CallFrame*);
}

namespace {

struct Target {
  const char* name;
  XLA_FFI_Handler* host;
  XLA_FFI_Handler* cuda;
};

constexpr Target kTargets[] = {
    {"xla_attn_flash_fwd_v1", XlaAttnFlashFwdV1Host, XlaAttnFlashFwdV1Cuda},
    {"xla_attn_flash_bwd_v1", XlaAttnFlashBwdV1Host, XlaAttnFlashBwdV1Cuda},
    {"xla_attn_flash_bwd_v2", XlaAttnFlashBwdV2Host, XlaAttnFlashBwdV2Cuda},
    {"xla_attn_flash_bwd_v3", XlaAttnFlashBwdV3Host, XlaAttnFlashBwdV3Cuda},
    {"xla_attn_paged_attention_v1", XlaAttnPagedAttentionV1Host, XlaAttnPagedAttentionV1Cuda},
    {"xla_attn_paged_attention_v2", XlaAttnPagedAttentionV2Host, XlaAttnPagedAttentionV2Cuda},
    {"xla_attn_reshape_and_cache_flash_v1", XlaAttnReshapeAndCacheFlashV1Host,
     XlaAttnReshapeAndCacheFlashV1Cuda},
};

int report(const std::string& message, char* out, size_t out_len) {
  if (out && out_len) {
    std::strncpy(out, message.c_str(), out_len - 1);
    out[out_len - 1] = '\0';
  }
  return message.empty() ? 0 : 1;
}

// The message of an error the runtime returned (and the error freed).
std::string take_message(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_GetMessage_Args get{};
  get.struct_size = XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE;
  get.error = error;
  api->XLA_FFI_Error_GetMessage(&get);
  std::string message = get.message ? get.message : "(no message)";
  XLA_FFI_Error_Destroy_Args destroy{};
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.error = error;
  api->XLA_FFI_Error_Destroy(&destroy);
  return message;
}

}  // namespace

extern "C" XLA_ATTN_EXPORT int xla_attn_ffi_register(const void* api_ptr, const char* name,
                                                     const char* target, const char* platform,
                                                     char* error, size_t error_len) {
  const auto* api = static_cast<const XLA_FFI_Api*>(api_ptr);
  if (!api || !name || !target || !platform) {
    return report("xla_attn_ffi_register: api, name, target and platform must not be null",
                  error, error_len);
  }
  // Fields are only ever appended to XLA_FFI_Api, so a runtime of the same major
  // version whose struct reaches XLA_FFI_Handler_Register can register.
  constexpr size_t kNeeded = offsetof(XLA_FFI_Api, XLA_FFI_Handler_Register) + sizeof(void*);
  if (api->struct_size < kNeeded || api->api_version.major_version != XLA_FFI_API_MAJOR) {
    return report("xla_attn_ffi_register: the runtime's XLA FFI API (version " +
                      std::to_string(api->api_version.major_version) + "." +
                      std::to_string(api->api_version.minor_version) +
                      ") is not compatible with this library's (" +
                      std::to_string(XLA_FFI_API_MAJOR) + "." +
                      std::to_string(XLA_FFI_API_MINOR) + ")",
                  error, error_len);
  }
  const bool cuda = std::strcmp(platform, "CUDA") == 0;
  if (!cuda && std::strcmp(platform, "Host") != 0) {
    return report(std::string("xla_attn_ffi_register: platform must be Host or CUDA, got ") +
                      platform, error, error_len);
  }
  const Target* found = nullptr;
  for (const Target& t : kTargets) {
    if (std::strcmp(t.name, target) == 0) found = &t;
  }
  if (!found) {
    return report(std::string("xla_attn_ffi_register: unknown target ") + target, error,
                  error_len);
  }
  XLA_FFI_Handler_Register_Args args{};
  args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  args.name = XLA_FFI_ByteSpan{name, std::strlen(name)};
  args.platform = XLA_FFI_ByteSpan{platform, std::strlen(platform)};
  args.bundle.execute = cuda ? found->cuda : found->host;
  // The CUDA handlers only enqueue work on their stream (kernels/ffi/common.h).
  args.traits = cuda ? XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE : 0;
  XLA_FFI_Error* failed = api->XLA_FFI_Handler_Register(&args);
  if (failed) {
    return report("xla_attn_ffi_register: " + std::string(name) + " on " + platform + ": " +
                      take_message(api, failed), error, error_len);
  }
  return 0;
}
