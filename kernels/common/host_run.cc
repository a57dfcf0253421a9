// host::run overloads: the Host platform's implementation of each op is the exact
// C++ reference in kernels/host.
#include "common/op.h"
#include "host/reference.h"

namespace xla_attn::host {

std::string run(const xla_attn_flash_fwd_params& p) { return flash_fwd(p); }
std::string run(const xla_attn_flash_bwd_params& p) { return flash_bwd(p); }
std::string run(const xla_attn_paged_attention_params& p) { return paged_attention(p); }
std::string run(const xla_attn_reshape_and_cache_flash_params& p) { return reshape_and_cache_flash(p); }

}  // namespace xla_attn::host
