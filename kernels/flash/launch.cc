#include "common/checks.h"
#include "common/op.h"
#include "dispatch/dispatch.h"
#include "variants_features.h"

namespace xla_attn {
namespace {

template <typename P>
unsigned features_of(const P& p) {
  unsigned f = 0;
  if (p.alibi_slopes) f |= kFeatureAlibi;
  if (p.softcap > 0.f) f |= kFeatureSoftcap;
  if (p.window_left >= 0 || p.window_right >= 0) f |= kFeatureWindow;
  return f;
}

}  // namespace

size_t workspace_size(const xla_attn_flash_fwd_params&) { return 0; }

std::string launch_cuda(const xla_attn_flash_fwd_params& p, cudaStream_t stream) {
  unsigned f = features_of(p);
  if (p.block_table) f |= kFeaturePaged;
  if (is_fp8_dtype(p.q_dtype)) f |= kFeatureFp8;
  dispatch::Query q{"flash_fwd", p.q_dtype, p.kv_dtype, p.head_dim, f, 0};
  // Grid and shared memory come with the first flash family; until then select()
  // reports that this build has no flash_fwd kernel.
  return dispatch::launch(q, dim3(1), 0, stream, &p);
}

std::string launch_cuda(const xla_attn_flash_bwd_params& p, cudaStream_t stream) {
  dispatch::Query q{"flash_bwd", p.dtype, p.dtype, p.head_dim, features_of(p), 0};
  return dispatch::launch(q, dim3(1), 0, stream, &p);
}

}  // namespace xla_attn
