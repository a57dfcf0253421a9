// Shapes and the launch plan of paged_attention's decode kernel, read by the kernel
// (NVRTC) and by the host launcher, so the grid and the kernel's loops cannot disagree.
#pragma once
#include "common/tensor_map.h"
#include "paged/params.h"

namespace xla_attn::decode {

// What the decode kernel receives: the op's params plus the launcher's plan.
struct Args {
  xla_attn_paged_attention_params p;
  int32_t num_splits;  // key-range parts per (sequence, kv head); > 1: partials + combine
  int32_t max_q;       // sequences with at most this many queries are the decode kernel's;
                       // longer ones go to the flash forward (which skips these)
  int32_t no_flash_follows;  // 1: the caller's max_query_len <= max_q, so no flash forward
                             // runs; rows of longer spans (a broken promise) get NaN
};

constexpr int kWarps = 4;   // 128 threads: each warp streams its own keys, merged at the end
// Keys per lane group in one step (each a K and a V load of 16 bytes, fp8: 8). The
// loop is software-pipelined (step t + 1's loads fly while step t is computed), so
// 2 x kUnroll x 2 loads (128 B at 16-bit) are in flight per lane. Two, not four: at
// four the lane's registers (q, accumulators, two steps of K/V) reach 234-255, two
// blocks an SM; at two, 4-row blocks fit 168 and three blocks (12 warps), so the SM
// has 48 KB in flight, 2x what Little's law asks for at 3 TB/s and ~1 us latency on
// 132 SMs.
constexpr int kUnroll = 2;

// Cache elements one lane reads per key: 8 (16 bytes of a 16-bit cache, 8 of fp8).
// Eight, not 16 bytes, for fp8: 16 fp8 elements per lane doubled the lane's query and
// accumulator registers (2 x rows x 16 floats), which spilled at 8 rows (ptxas sm_80:
// 1.1 KB of spill stores) and took ptxas minutes per kernel.
XLA_ATTN_HOST_DEVICE constexpr int elems_per_lane() { return 8; }

// A key row (head_dim elements) is read by kLanes lanes; head dims 64..256 give 8..32.
XLA_ATTN_HOST_DEVICE constexpr int lanes_per_key(int head_dim) {
  return head_dim / elems_per_lane();
}

// Query rows one block holds in registers: the query heads of a GQA group (4 for the
// common 32/8 layout) times the query tokens. 4 or 8: registers for q and the
// accumulator are 2 x rows x 8 floats per lane (bf16, hdim 128), so 8 rows keep ~190
// registers and 3 blocks per SM; more would spill.
XLA_ATTN_HOST_DEVICE constexpr int rows_per_block(int group) { return group <= 4 ? 4 : 8; }

// Longest query span the decode kernel takes: a block loops over its rows in chunks
// of rows_per_block, re-reading K/V for each, so spans are capped at 4 chunks (16
// rows); longer ones (chunked prefill) go to the flash forward with the block table.
XLA_ATTN_HOST_DEVICE constexpr int max_query_span(int group) {
  return group >= 16 ? 1 : 16 / group;
}

// Split-KV (flash-decoding): enough (sequence, kv head, split) blocks for 8 per SM on
// an H100's 132 SMs (3 resident blocks of 128 threads per SM plus the tail), each
// split at least 256 keys so the per-split partials (head_dim + 1 floats per row)
// stay < 1/64 of the K/V bytes read. A constant, not the device's SM count, so the
// workspace is a function of shapes alone.
constexpr int kTargetBlocks = 8 * 132;
constexpr int kMinKeysPerSplit = 256;
constexpr int kMaxSplits = 128;

}  // namespace xla_attn::decode

// The tensor-core decode kernel (paged/decode_sm80.cuh).
namespace xla_attn::decode_sm80 {

constexpr int kWarps = 4;
constexpr int kTileKeys = 16;  // keys per warp tile: one k16 step of P V
constexpr int kRows = 16;      // query rows a block holds: one m16 tile
// kv heads one block reads together, so that a key's bytes there are 256 contiguous
// (as a 16-bit d128 row): 2 for rows of 128 bytes (fp8 d128, 16-bit d64), 4 for 64
// (fp8 d64). A block per kv head of an fp8 d128 cache reads 128-byte pieces 1 KB apart;
// the read probe (tools/probe_decode_reads.py, B=64, bs16, pages in random order) on an
// H100 read that at 2702 / 2829 GB/s (L=4096 / 32768; 3 splits, 3 blocks an SM), and
// 256-byte pieces at 2921-2952 / 3024-3041. The kernels' m16 tile holds the heads'
// query rows (2 x 4 at GQA 4), so they take spans of 16 / heads rows a head.
XLA_ATTN_HOST_DEVICE constexpr int heads_together(int d, int cache_bytes) {
  return d * cache_bytes < 256 ? 256 / (d * cache_bytes) : 1;
}

// Stages of a warp's tile pipeline: tiles t + 1 .. t + stages - 1 are in flight while
// tile t is computed. 16-bit caches: 3 stages, 2 x 8 KB in flight per warp at d128, at
// 2 blocks an SM 128 KB per SM, several times what Little's law asks for at 3 TB/s
// (~1 us x 3 TB/s / 132 SMs = 23 KB). An fp8 tile is half the bytes: at 3 stages an
// SM had 32 KB in flight, 1.4x the need, and read at 71 % of the copy rate. 4 stages
// take 66.5 KB a block at d128, so 3 blocks an SM fit (166 registers), 144 KB in
// flight; 5 stages would fit only 2 blocks (83 KB) for 128 KB.
// Heads together: a stage is a 16-bit d128 tile's bytes, so 3 stages as there.
XLA_ATTN_HOST_DEVICE constexpr int stages(int cache_bytes, int heads = 1) {
  return heads > 1 || cache_bytes == 2 ? 3 : 4;
}

// Shared memory: per warp, the stages' K and V tiles as stored (per kv head 16 rows of D
// cache elements, swizzled; fp8 rows as rows of D / 2 16-bit pairs, which the ldmatrix
// reads and registers convert), then the physical rows of each stage; the warp merge at
// the end reuses it all. d128: 96.8 KB a block for 16-bit caches, 66.5 KB for fp8; heads
// together 96.8 KB (all fit the 99 KB every sm_8x allows a block after opting in).
XLA_ATTN_HOST_DEVICE constexpr int tile_elems(int d) { return kTileKeys * d; }
XLA_ATTN_HOST_DEVICE constexpr int stage_bytes(int d, int cache_bytes) {
  return tile_elems(d) * cache_bytes;
}
XLA_ATTN_HOST_DEVICE constexpr int warp_smem_bytes(int d, int cache_bytes, int heads = 1) {
  return stages(cache_bytes, heads) * (2 * heads * stage_bytes(d, cache_bytes) + kTileKeys * 4);
}
XLA_ATTN_HOST_DEVICE constexpr int smem_bytes(int d, int cache_bytes, int heads = 1) {
  return kWarps * warp_smem_bytes(d, cache_bytes, heads);
}
static_assert(smem_bytes(128, 2) <= 99 * 1024 && smem_bytes(128, 1) <= 99 * 1024 &&
                  smem_bytes(128, 1, 2) <= 99 * 1024 && smem_bytes(64, 2, 2) <= 99 * 1024 &&
                  smem_bytes(64, 1, 4) <= 99 * 1024,
              "decode_sm80 exceeds sm_86/89's 99 KB");

// Blocks resident on an SM (an H100's 228 KB of shared memory, 1 KB of it reserved per
// block): d128 16-bit 2, fp8 3; the d64 kernels (107-114 registers) stop at 4 by
// registers. A constant of shapes, not of the device, so the workspace is too.
XLA_ATTN_HOST_DEVICE constexpr int blocks_per_sm(int smem) {
  return 228 * 1024 / (smem + 1024) < 4 ? 228 * 1024 / (smem + 1024) : 4;
}
XLA_ATTN_HOST_DEVICE constexpr int resident_blocks(int d, int cache_bytes, int heads = 1) {
  return blocks_per_sm(smem_bytes(d, cache_bytes, heads));
}
static_assert(resident_blocks(128, 2) == 2 && resident_blocks(128, 1) == 3 &&
                  resident_blocks(128, 1, 2) == 2 && resident_blocks(64, 2, 2) == 2 &&
                  resident_blocks(64, 1, 4) == 2,
              "the occupancy quoted above (and the variants' min_blocks)");
constexpr int kReferenceSms = 132;  // an H100 SXM
constexpr int kMinKeysPerSplit = kWarps * kTileKeys;  // one tile per warp
constexpr int kMaxSplits = 128;

// Split-KV (flash-decoding): the fewest splits whose last wave of blocks fills >= 90 %
// of the resident slots. Every block streams the same number of keys, and the kernel is
// latency-bound per block, so a partial last wave takes as long as a full one: ncu,
// fp8 d128 at B=64 (512 blocks on 396 slots, 1.31 waves) read at 62 % of the DRAM
// bandwidth, the bf16 kernel (512 on 264, 1.94 waves) at 89 %. Splitting B=1 fills the
// GPU the same way (8 blocks -> 30 splits at d128 16-bit). At most max_splits.
XLA_ATTN_HOST_DEVICE constexpr int wave_splits(int64_t blocks, int64_t slots, int max_splits) {
  int best = 1;
  int64_t best_used = 0, best_total = 1;  // best fill as a fraction used / total
  for (int s = 1; s <= max_splits; ++s) {
    const int64_t used = blocks * s, total = (used + slots - 1) / slots * slots;
    if (10 * used >= 9 * total) return s;
    if (used * best_total > best_used * total) {
      best = s;
      best_used = used;
      best_total = total;
    }
  }
  return best;
}
static_assert(wave_splits(64 * 8, 132 * 2, 128) == 1 && wave_splits(64 * 8, 132 * 3, 128) == 3 &&
                  wave_splits(8, 132 * 2, 64) == 30,
              "the split counts quoted above");

}  // namespace xla_attn::decode_sm80

// The Hopper decode kernel (paged/decode_sm90.cuh): decode_sm80's warps and stages, the
// tiles landed by bulk tensor copies (TMA) instead of cp.async.
namespace xla_attn::decode_sm90 {

// What it receives: the decode kernel's args plus the K and V caches' tensor maps, each
// a 5-d view [num_blocks][num_heads_k][parts][block_size][part] of the cache, a part
// being head_dim's bytes cut in pieces of at most 128 (one swizzle span), so that one
// copy lands a 16-key tile of one kv head as `parts` [16][part] sub-tiles.
struct Args {
  decode::Args base;
  sm90::TensorMap k_map, v_map;
};

// Bytes of a row piece (the tensor map's box width): 128 or, for 64-byte rows, 64.
XLA_ATTN_HOST_DEVICE constexpr int part_bytes(int d, int cache_bytes) {
  return d * cache_bytes < 128 ? d * cache_bytes : 128;
}
// The kernel covers rows of 64, 128 or 256 bytes: d64 / d128 at 16 bits, fp8 d64 / d128.
XLA_ATTN_HOST_DEVICE constexpr bool covers(int d, int cache_bytes) {
  return d * cache_bytes == 64 || d * cache_bytes == 128 || d * cache_bytes == 256;
}

// Shared memory: 1 KB of slack to align the tiles to the 128-byte swizzle's 1 KB
// period, the warps' K and V stages (each `heads` [16][row] tiles, one per kv head),
// one 8-byte barrier per warp and stage. d128: 97.1 KB at 16 bits, 65.1 KB fp8 (2 and 3
// blocks an SM, as decode_sm80, whose split plans and workspace the one-head kernel
// shares); heads together 97.1 KB, 2 blocks an SM.
constexpr int kAlign = 1024;
XLA_ATTN_HOST_DEVICE constexpr int tiles_bytes(int d, int cache_bytes, int heads) {
  return decode_sm80::kWarps * decode_sm80::stages(cache_bytes, heads) * 2 * heads *
         decode_sm80::stage_bytes(d, cache_bytes);
}
XLA_ATTN_HOST_DEVICE constexpr int smem_bytes(int d, int cache_bytes, int heads) {
  return kAlign + tiles_bytes(d, cache_bytes, heads) +
         decode_sm80::kWarps * decode_sm80::stages(cache_bytes, heads) * 8;
}
// decode_sm80's occupancy in every variant (2 blocks an SM for heads together): the
// launcher plans splits by decode_sm80::resident_blocks for both.
XLA_ATTN_HOST_DEVICE constexpr bool same_occupancy(int d, int cache_bytes, int heads) {
  return decode_sm80::blocks_per_sm(smem_bytes(d, cache_bytes, heads)) ==
         decode_sm80::resident_blocks(d, cache_bytes, heads);
}
static_assert(same_occupancy(128, 2, 1) && same_occupancy(128, 1, 1) &&
                  same_occupancy(64, 2, 1) && same_occupancy(64, 1, 1) &&
                  same_occupancy(128, 1, 2) && same_occupancy(64, 2, 2) &&
                  same_occupancy(64, 1, 4),
              "decode_sm90 must keep decode_sm80's occupancy: they share split plans");

}  // namespace xla_attn::decode_sm90
