#include "common/op.h"
#include "dispatch/dispatch.h"

namespace xla_attn {

std::string launch_cuda(const xla_attn_reshape_and_cache_flash_params& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_slots == 0) return "";
  // One block per token up to 65535 blocks (~500 per SM on 132 SMs, far past the
  // point where a row copy saturates memory); the kernel grid-strides over the rest.
  const unsigned blocks = static_cast<unsigned>(p.num_tokens < 65535 ? p.num_tokens : 65535);
  dispatch::Query q{"reshape_and_cache_flash", p.src_dtype, p.cache_dtype, p.head_dim, 0u, 0};
  return dispatch::launch(q, dim3(blocks), 0, stream, &p);
}

}  // namespace xla_attn
