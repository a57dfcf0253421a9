// Tile shapes of the portable flash family, read by the kernels (NVRTC) and by the
// host launch code, so grid sizes and the kernels' loops cannot disagree.
#pragma once
#include "common/types.h"

namespace xla_attn::portable {

// Head dims are padded up to one of four buckets (32, 64, 128, 256): one
// instantiation per bucket, the true head_dim masked at run time.
XLA_ATTN_HOST_DEVICE constexpr int head_bucket(int head_dim) {
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

constexpr int kWarps = 4;  // 128 threads: 4 warps x rows_per_warp query rows share one K/V tile

// Every tile lives in static shared memory (<= 48 KB, so no opt-in is needed on any
// arch): forward, D = 128: Q 16x128 + K 32x129 + V 32x128 floats = 41 KB; D = 256
// halves the rows and the keys to stay at 41 KB.
XLA_ATTN_HOST_DEVICE constexpr int fwd_rows_per_warp(int d) { return d <= 128 ? 4 : 2; }
XLA_ATTN_HOST_DEVICE constexpr int fwd_block_m(int d) { return kWarps * fwd_rows_per_warp(d); }
XLA_ATTN_HOST_DEVICE constexpr int block_n(int d) { return d <= 128 ? 32 : 16; }

// Backward holds two row tiles (Q and dO, or K and V) and two key/query tiles, so it
// keeps fewer rows: D = 128: 8 rows x 2 + 32 x 129 x 2 floats = 41 KB.
XLA_ATTN_HOST_DEVICE constexpr int bwd_rows_per_warp(int d) { return d <= 64 ? 4 : d <= 128 ? 2 : 1; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_block_m(int d) { return kWarps * bwd_rows_per_warp(d); }

// Split-KV (flash-decoding): partials are combined by flash_combine. At most 64
// splits, each at least 256 keys (8 tiles of 32), and only as many as it takes to
// reach 528 blocks: 4 resident blocks (the portable kernel fits ~5 per SM at 41 KB)
// on each of an H100's 132 SMs. The target is a constant, not read off the device,
// so that the workspace size is a function of shapes alone; a smaller GPU merely
// splits more than it needs to.
constexpr int kMaxSplits = 64;
constexpr int kMinKeysPerSplit = 256;
constexpr int kTargetBlocks = 4 * 132;

}  // namespace xla_attn::portable
