#include "common/op.h"
#include "dispatch/dispatch.h"
#include "variants_features.h"

namespace xla_attn {

size_t workspace_size(const xla_attn_paged_attention_params&) { return 0; }

std::string launch_cuda(const xla_attn_paged_attention_params& p, cudaStream_t stream) {
  unsigned f = kFeaturePaged;
  if (p.alibi_slopes) f |= kFeatureAlibi;
  if (p.soft_cap > 0.f) f |= kFeatureSoftcap;
  if (p.sliding_window > 0) f |= kFeatureWindow;
  dispatch::Query q{"paged_attention", p.q_dtype, p.cache_dtype, p.head_dim, f, 0};
  return dispatch::launch(q, dim3(1), 0, stream, &p);
}

}  // namespace xla_attn
