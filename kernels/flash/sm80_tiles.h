// Tile shapes of the sm80 flash family (tensor cores, sm_80 .. sm_90), read by the
// kernel (NVRTC) and by the host launch code (kernels/flash/launch.cc), so the grid,
// the dynamic shared memory and the kernel's loops cannot disagree.
#pragma once
#include "common/types.h"

namespace xla_attn::sm80 {

// Head dims are padded with zeros up to a bucket D, one instantiation per bucket; the
// variant table (SM80_HEAD_BUCKETS in kernels/dispatch/variants.py) lists the same
// buckets, and the launcher refuses to run if the two disagree. 96 is a bucket of its
// own because head_dim 96 (or 80) padded to 128 would waste 25% (38%) of the mma
// work; every bucket is a multiple of 16 (one mma k-step).
//
// fp8 (e4m3 q, k, v; sm_89+, flash_fwd_sm80<__nv_fp8_e4m3, D>): the same tiles over rows
// of D bytes, which the copies, the swizzle and ldmatrix move as D / 2 16-bit units (an
// e4m3 pair is one unit; row_units). The swizzle needs a multiple of 64 bytes a row, so
// its buckets are 64, 128 and 256 (eb = 1); head dims that are not a multiple of 16
// (16-byte rows) stay with the portable family (the launcher's fp8_mma_takes).
XLA_ATTN_HOST_DEVICE constexpr int head_bucket(int head_dim, int eb = 2) {
  return eb == 1 ? (head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256)
         : head_dim <= 32  ? 32
         : head_dim <= 64  ? 64
         : head_dim <= 96  ? 96
         : head_dim <= 128 ? 128
                           : 256;
}
XLA_ATTN_HOST_DEVICE constexpr int row_units(int d, int eb) { return d * eb / 2; }

constexpr int kWarps = 4;  // 128 threads: each warp owns 16 query rows per m-tile
constexpr int kThreads = kWarps * 32;

// m16 tiles per warp. Two (128 query rows per block) halve the K/V traffic per query
// row; they fit up to D = 64 (O 2x8x4 + S 2x8x4 = 128 f32 accumulators; ptxas: 255
// registers, no spill). From D = 96 on, one m-tile (64 rows): two spill there (ptxas
// sm_80: 84 / 44 bytes of spill stores at D = 96 / 128), one takes 168 / 210 registers.
XLA_ATTN_HOST_DEVICE constexpr int m_tiles(int d) { return d <= 128 && d != 96 ? 2 : 1; }
XLA_ATTN_HOST_DEVICE constexpr int block_m(int d) { return kWarps * 16 * m_tiles(d); }

// Keys per K/V tile. 64 keys give each warp 64 mma for S and 64 for P V per tile (at
// D = 128) between two block barriers; D = 256 drops to 32 so that two stages of K
// and V fit the 99 KB that sm_86/89 allow one block (below).
XLA_ATTN_HOST_DEVICE constexpr int block_n(int d) { return d <= 128 ? 64 : 32; }

// Q's A fragments (m_tiles x d / 16 k-steps x 4 registers) held in registers for the
// whole K/V loop instead of re-read from shared memory every tile (at d64 a fifth of a
// warp's ldmatrix per tile), where they fit beside the O and S accumulators: f32-sized
// registers O + S + Q = m_tiles x (d/2 + block_n/2 + d/4) = 112 / 160 / 104 at d32 / 64
// / 96. H100 harness, bf16, forward: d64 S=16384 304 -> 320 TFLOP/s, S=2048 287 -> 300,
// S=512 +1 %. Not at d128 (256: no room) nor d256 (208; ptxas sm_90 spilled 4 bytes,
// 12-14 % slower: S=16384 302 -> 261; two accumulators per S tile there lost 3-7 %). ptxas
// for sm_80 / sm_86 then spills 20-24 bytes at d64 (about 3 local loads a tile, none
// between the mma; sm_90: none), not measured on those GPUs.
// fp8 holds Q in half the registers (d / 8 a m-tile): d64 does, d128 (224) does not.
XLA_ATTN_HOST_DEVICE constexpr bool q_in_regs(int d, int eb = 2) {
  return m_tiles(d) * (d / 2 + block_n(d) / 2 + d * eb / 8) <= 160;
}

// K/V tiles in flight: tile j + 1 is copied (cp.async) while tile j is computed.
constexpr int kStages = 2;

// Dynamic shared memory: Q (block_m x D) + kStages x (K + V) (block_n x D), in 16-bit
// units (eb: element bytes), then one validity byte per key and stage. D = 128: 16 + 64
// KB; D = 256: 32 + 64 KB (fp8: half). More than 48 KB needs the opt-in (dispatch::launch
// does it).
XLA_ATTN_HOST_DEVICE constexpr int smem_q_elems(int d, int eb = 2) {
  return block_m(d) * row_units(d, eb);
}
XLA_ATTN_HOST_DEVICE constexpr int smem_kv_elems(int d, int eb = 2) {
  return block_n(d) * row_units(d, eb);
}
XLA_ATTN_HOST_DEVICE constexpr int smem_bytes(int d, int eb = 2) {
  return 2 * (smem_q_elems(d, eb) + 2 * kStages * smem_kv_elems(d, eb)) + kStages * block_n(d);
}

// sm_86 and sm_89 let one block opt in to 99 KB (sm_80: 163 KB, sm_90: 227 KB); the
// same compute_80 PTX serves sm_80 and sm_86, so every bucket must fit the smallest.
constexpr int kMaxSmemOptin = 99 * 1024;
static_assert(smem_bytes(32) <= kMaxSmemOptin && smem_bytes(64) <= kMaxSmemOptin &&
                  smem_bytes(96) <= kMaxSmemOptin && smem_bytes(128) <= kMaxSmemOptin &&
                  smem_bytes(256) <= kMaxSmemOptin,
              "an sm80 tile set exceeds the 99 KB of shared memory sm_86/89 allow a block");

// Backward (flash/bwd_sm80.cuh), 4 warps of 16 rows each. A block owns kBwdBlock
// rows of the tensors it keeps (keys for dk/dv, query rows for dq) and streams
// bwd_stream_block(d) rows of the others through kStages stages:
// - d <= 128: 64-row tiles. Shared memory: the two kept tiles, kStages of the two
//   streamed ones and of the per-row lse and delta floats; d128: 97 KB.
// - d = 256: 16-row tiles, 64 + 32 KB, so that it too fits sm_86/89's 99 KB (32-row
//   tiles would take 128 KB: one block an SM even on an H100). A warp's dK and dV
//   accumulators alone would take 256 registers a lane there, so each key block runs
//   as two blocks, one for dV and one for dK (bwd_split_grads): 128 f32 accumulators
//   each, the price S^T = K Q^T computed twice (5 products per tile pair, not 4).
constexpr int kBwdBlock = 64;
XLA_ATTN_HOST_DEVICE constexpr int bwd_stream_block(int d) { return d <= 128 ? 64 : 16; }
// The dk/dv kernel's warps over a tile's 64 keys x 64 rows: up to d64 a 2 x 2 grid of
// 32 keys x 32 rows each (two m16 key tiles), from d96 on 4 x 1 of 16 keys x all rows.
// Per warp and tile at d64 the 2 x 2 grid reads 34 KB of shared memory for the same
// 160 mma, against 46 KB (92 ldmatrix.x4) at 16 keys x 64 rows: each B fragment
// (Q, dO rows) serves two key tiles and each dO / Q row half the warps. ncu (H100, d64,
// B=4, S=4096): the shared pipe at 68 % with 16 keys a warp, 1.29x FA2's wavefronts.
// A warp then holds dK and dV of 32 keys (128 f32 at d64): from d96 on they no longer
// fit beside S^T and dP^T, so the two row warps' partial sums meet once at the end.
XLA_ATTN_HOST_DEVICE constexpr int bwd_key_mtiles(int d) { return d <= 64 ? 2 : 1; }
XLA_ATTN_HOST_DEVICE constexpr bool bwd_split_grads(int d) { return d > 128; }
// The atomic-dQ path (bwd_atomic_dq) passes each streamed tile's dS^T (64 keys x
// bwd_stream_block rows, 16-bit) between warps through shared memory: in the tile's
// dO stage, consumed by then, where that holds it (d >= 64), else in a buffer of its
// own after the lse and delta floats.
XLA_ATTN_HOST_DEVICE constexpr bool bwd_ds_in_dout(int d) { return d >= kBwdBlock; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_smem_bytes(int d) {
  return 2 * d * (2 * kBwdBlock + 2 * kStages * bwd_stream_block(d)) +
         2 * kStages * bwd_stream_block(d) * 4 +
         (bwd_ds_in_dout(d) ? 0 : 2 * kBwdBlock * bwd_stream_block(d));
}

// The backward's workspace (xla_attn_flash_bwd_v2; without one, the deterministic
// path): delta = dO . O as f32 [num_heads, total_q], padded to 128 bytes, then the f32
// dQ accumulator the dk/dv kernel adds dS K into (red.global.add), which
// flash_bwd_dq_convert_sm80 scales and rounds into dq. A function of shapes alone:
// frontends size it at trace time.
//
// The accumulator is laid out in the order the mma accumulators sit in the lanes, so
// that one warp-wide red covers whole lines: a chunk is 16 rows x 32 columns of one
// head (a warp's m16 x 4 n8 tiles), 512 floats, element (j, hf, e) of lane l (row
// 8 hf + l / 4, column 8 j + 2 (l % 4) + e) at (4 j + 2 hf + e) * 32 + l, on sm_90 at
// 128 j + 4 l + 2 hf + e (red.global.add.v4.f32; bwd_sm80_tile.cuh, acc_offset). In the
// row-major layout a red touched 8 rows' sectors, each for 4 floats: ncu (d128, B=4,
// S=4096, H=16) showed that dk/dv kernel L2-bound (83 % throughput, 10.1 ms).
// Chunks go [head][row chunk][column chunk]; sequence b's rows start at row chunk
// ceil(cu_q[b] / 16) + b, so its chunks never reach the next sequence's whatever the
// offsets (bwd_acc_row_chunk); ceil(total_q / 16) + batch row chunks bound them all.
constexpr int kAccChunkRows = 16, kAccChunkCols = 32, kAccChunk = kAccChunkRows * kAccChunkCols;
// Rows a delta block (flash_bwd_delta_sm80) takes: 16 from d65 on, 32 up to d64, 64 up to
// d32, so that each of its threads loads two 16-byte chunks of dO and two of O where rows
// are whole chunks (two passes at d64 / d32, as at d128). ncu (H200, 16384 rows x 2048,
// the dQ accumulator zeroed too, caches as left; docs/benchmarks.md 2026-12-03 (61)): d64
// on 16 rows a block 105 us, on 32 rows 75, against d128's 69 and cuDNN's dot_do_o 72 for
// the same 134 MB read and 137 MB written; d32 on 32 rows (one pass) 111, on 64 rows 89.
XLA_ATTN_HOST_DEVICE constexpr int bwd_delta_rows(int head_dim) {
  return head_dim <= 32 ? 64 : head_dim <= 64 ? 32 : 16;
}
XLA_ATTN_HOST_DEVICE constexpr int64_t bwd_delta_floats(int64_t total_q, int num_heads) {
  return (total_q * num_heads + 31) / 32 * 32;
}
XLA_ATTN_HOST_DEVICE constexpr int64_t bwd_acc_row_chunks(int64_t total_q, int batch) {
  return (total_q + kAccChunkRows - 1) / kAccChunkRows + batch;
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_acc_col_chunks(int head_dim) {
  return (head_dim + kAccChunkCols - 1) / kAccChunkCols;
}
// Row chunks a dq-convert block (flash_bwd_dq_convert_sm80) takes: as many as its 4
// warps have a column chunk each of (4 up to d32, 2 up to d64, else 1; d256's 8 column
// chunks take two a warp). With one row chunk a block, d64's blocks kept two warps idle
// and there were twice d128's blocks for half the bytes each. ncu (H200, 16384 rows x
// 2048, caches as left, the same ~134 MB read and ~72 MB written; docs/benchmarks.md
// 2026-12-03 (62)): d64 60.5 -> 56.1 us, d32 87.6 -> 54.6, d128 53 (cuDNN's 57, (61)).
XLA_ATTN_HOST_DEVICE constexpr int bwd_convert_row_chunks(int head_dim) {
  return bwd_acc_col_chunks(head_dim) >= kWarps ? 1 : kWarps / bwd_acc_col_chunks(head_dim);
}
// Every head dim's convert tile (row chunks x 16 rows of its columns + 8) fits d256's
// 16 x 264, the kernel's static shared tile.
XLA_ATTN_HOST_DEVICE constexpr bool bwd_convert_tile_fits() {
  for (int d = 1; d <= 256; ++d) {
    const int rows = bwd_convert_row_chunks(d) * kAccChunkRows;
    if (rows * (bwd_acc_col_chunks(d) * kAccChunkCols + 8) > kAccChunkRows * (256 + 8)) {
      return false;
    }
  }
  return true;
}
static_assert(bwd_convert_tile_fits(), "a dq-convert tile outgrows the shared tile");
XLA_ATTN_HOST_DEVICE constexpr int64_t bwd_acc_row_chunk(int64_t q_start, int b) {
  return (q_start + kAccChunkRows - 1) / kAccChunkRows + b;
}
XLA_ATTN_HOST_DEVICE constexpr int64_t bwd_acc_floats(int64_t total_q, int batch, int num_heads,
                                                      int head_dim) {
  return num_heads * bwd_acc_row_chunks(total_q, batch) * bwd_acc_col_chunks(head_dim) * kAccChunk;
}
XLA_ATTN_HOST_DEVICE constexpr int64_t bwd_workspace_bytes(int64_t total_q, int batch,
                                                           int num_heads, int head_dim) {
  return 4 * (bwd_delta_floats(total_q, num_heads) +
              bwd_acc_floats(total_q, batch, num_heads, head_dim));
}
static_assert(bwd_smem_bytes(128) <= kMaxSmemOptin && bwd_smem_bytes(256) <= kMaxSmemOptin,
              "the sm80 backward's tiles exceed the 99 KB sm_86/89 allow a block");

// d256 where a block may opt in to bwd_paired_smem_bytes (sm_80: 163 KB, sm_90: 227 KB;
// not sm_86/89's 99 KB): one block of 8 warps per 64 keys instead of a dV and a dK
// block. Warps 0-3 (16 keys each) compute S^T = K Q^T, P^T and dV += P^T dO; warps
// 4-7 (the same keys) dP^T = V dO^T, then take P^T (times softcap') from the first
// four through shared memory for dS^T, dK += dS^T Q and dQ += dS K. 5 products per
// tile pair instead of 6 (S^T once), each Q / dO tile copied once for both
// gradients, and 32-row tiles (twice the work between barriers): K + V 64 KB, two
// stages of Q + dO 64 KB, P^T 8 KB (f32, so dS^T is rounded once, as in the split
// kernel), dS^T 4 KB. 255 registers x 256 threads: one block an SM, 8 warps, as the
// two 4-warp blocks of the split kernel. The same kernel at d128 (202 registers, one
// block an SM; 32- or 64-row tiles) ran fwd+bwd 20 % slower than the 4-warp one,
// which computes S^T once already (H100 harness, S=16384: 310 -> 244 TFLOP/s).
constexpr int kPairedWarps = 2 * kWarps;
XLA_ATTN_HOST_DEVICE constexpr int bwd_paired_stream_block(int) { return 32; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_paired_p_bytes(int d) {
  return 4 * kBwdBlock * bwd_paired_stream_block(d);
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_paired_smem_bytes(int d) {
  return 2 * d * (2 * kBwdBlock + 2 * kStages * bwd_paired_stream_block(d)) +
         2 * kStages * bwd_paired_stream_block(d) * 4 + bwd_paired_p_bytes(d) +
         2 * kBwdBlock * bwd_paired_stream_block(d);
}
static_assert(bwd_paired_smem_bytes(256) <= 163 * 1024,
              "the paired d256 backward must fit the 163 KB an sm_80 block may opt in to");

// Split-KV (flash-decoding), as in portable_tiles.h but for this family's occupancy:
// at 24..96 KB of shared memory (and <= 255 registers) at least two blocks fit an SM
// of an A100 (164 KB) or H100 (228 KB), so 2 x 132 blocks fill an H100. A constant,
// not read off the device, so the workspace size is a function of shapes alone. At
// least 256 keys (4 tiles of 64) per split, at most 64 splits.
constexpr int kMaxSplits = 64;
constexpr int kMinKeysPerSplit = 256;
constexpr int kTargetBlocks = 2 * 132;

}  // namespace xla_attn::sm80
