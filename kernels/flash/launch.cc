#include <algorithm>

#include "common/checks.h"
#include "common/op.h"
#include "dispatch/dispatch.h"
#include "flash/portable_tiles.h"
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

// Grid of the forward: (row blocks x splits, heads, batch + 1 padding block).
struct FwdPlan {
  int row_blocks;
  int splits;
  size_t workspace;
};

FwdPlan plan(const xla_attn_flash_fwd_params& p) {
  const int d = portable::head_bucket(p.head_dim);
  FwdPlan plan{std::max(1, (p.max_seqlen_q + portable::fwd_block_m(d) - 1) / portable::fwd_block_m(d)),
               1, 0};
  if (p.num_splits > 0) {
    plan.splits = std::min(p.num_splits, portable::kMaxSplits);
  } else {
    // Split the keys only when the grid cannot fill the GPU by itself. The plan
    // depends on shapes alone (frontends size the workspace at trace time), so the
    // row blocks that do work are estimated from the mean query count per sequence.
    const int64_t rows = std::min<int64_t>(p.max_seqlen_q, (p.total_q + std::max(p.batch, 1) - 1) /
                                                               std::max(p.batch, 1));
    const int64_t useful = std::max<int64_t>(1, (rows + portable::fwd_block_m(d) - 1) /
                                                    portable::fwd_block_m(d));
    const int64_t blocks = useful * p.num_heads * std::max(p.batch, 1);
    const int64_t want = (portable::kTargetBlocks + blocks - 1) / blocks;
    const int64_t by_keys = std::max(1, p.max_seqlen_k / portable::kMinKeysPerSplit);
    plan.splits = int(std::clamp<int64_t>(std::min(want, by_keys), 1, portable::kMaxSplits));
  }
  if (plan.splits > 1) {
    plan.workspace = size_t(plan.splits) * p.total_q * p.num_heads * (p.head_dim + 1) * sizeof(float);
  }
  return plan;
}

}  // namespace

size_t workspace_size(const xla_attn_flash_fwd_params& p) { return plan(p).workspace; }

std::string launch_cuda(const xla_attn_flash_fwd_params& params, cudaStream_t stream) {
  if (params.total_q == 0 || params.batch == 0) return "";
  xla_attn_flash_fwd_params p = params;
  const FwdPlan pl = plan(p);
  p.num_splits = pl.splits;
  if (pl.splits > 1 && (!p.workspace || size_t(p.workspace_bytes) < pl.workspace)) {
    return "flash_fwd: the split-KV workspace is missing or smaller than "
           "xla_attn_workspace_size() asked for";
  }
  if (p.batch + 1 > 65535) return "flash_fwd: at most 65534 sequences per call";
  unsigned f = features_of(p);
  if (p.block_table) f |= kFeaturePaged;
  if (is_fp8_dtype(p.q_dtype) || is_fp8_dtype(p.kv_dtype)) f |= kFeatureFp8;
  const dispatch::Query q{"flash_fwd", p.q_dtype, p.kv_dtype, p.head_dim, f, 0};
  const dim3 grid(unsigned(pl.row_blocks) * pl.splits, p.num_heads, p.batch + 1);
  std::string error = dispatch::launch(q, grid, 0, stream, &p);
  if (!error.empty() || pl.splits == 1) return error;
  // 16 rows per combine block (its 4 warps x 4 rows).
  const dim3 combine_grid((std::max(p.max_seqlen_q, 1) + 15) / 16, p.num_heads, p.batch);
  const dispatch::Query c{"flash_combine", p.out_dtype, p.out_dtype, p.head_dim, f, 0};
  return dispatch::launch(c, combine_grid, 0, stream, &p);
}

std::string launch_cuda(const xla_attn_flash_bwd_params& p, cudaStream_t stream) {
  if (p.batch + 1 > 65535) return "flash_bwd: at most 65534 sequences per call";
  if (p.total_q == 0 && p.total_k == 0) return "";
  const int block = portable::bwd_block_m(portable::head_bucket(p.head_dim));
  const unsigned f = features_of(p);
  // dq: (query tiles, heads, batch + padding block); dk/dv: (key tiles, kv heads, ...).
  const dim3 dq_grid((std::max(p.max_seqlen_q, 1) + block - 1) / block, p.num_heads, p.batch + 1);
  const dim3 dkdv_grid((std::max(p.max_seqlen_k, 1) + block - 1) / block, p.num_heads_k,
                       p.batch + 1);
  const dispatch::Query dq{"flash_bwd_dq", p.dtype, p.dtype, p.head_dim, f, 0};
  const dispatch::Query dkdv{"flash_bwd_dkdv", p.dtype, p.dtype, p.head_dim, f, 0};
  std::string error = dispatch::launch(dq, dq_grid, 0, stream, &p);
  return error.empty() ? dispatch::launch(dkdv, dkdv_grid, 0, stream, &p) : error;
}

}  // namespace xla_attn
