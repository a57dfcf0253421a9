// Flash attention backward, sm90 family (sm_90a; f16 and bf16, head dims 33-128): the
// dk/dv kernel of the sm80 family's atomic-dQ path (flash/bwd_sm80.cuh) on wgmma, its
// tiles landed by bulk tensor copies. The sm80 delta (D = dO . O, zeroing the dQ
// accumulator) and dq-convert kernels run before and after it unchanged: this kernel
// adds dS K into the same f32 accumulator, in the same chunk layout (sm80_tiles.h).
//
// One block = 128 keys of one kv head of one sequence (grid: key blocks, kv heads,
// batch + 1 padding block):
// - warpgroup 0, the producer: thread 0 copies K and V once, then for every tile (query
//   head of the GQA group x bwd_rows(D) query rows: 64, d64 128) Q and dO into one of
//   kStages stages, with the tile's lse and D rows (the consumers zero those past the
//   rows that see the block).
// - warpgroups 1 and 2, the consumers, 64 keys each: per tile S^T = K Q^T and dP^T = V
//   dO^T (wgmma, both operands in shared memory), P^T = exp2(S^T - lse) and dS^T = P^T
//   (dP^T - D) in registers (the sm80 kernel's masks, softcap and ALiBi), dV += P^T dO and
//   dK += dS^T Q (P^T, dS^T from registers, dO and Q read N-major), and dQ = dS K (dS^T
//   through shared memory, read M-major) over the block's 128 keys (d128: the whole tile,
//   the warpgroups in turns by tile, a tile late; d64: 64 of the 128 rows each, in the
//   tile). Added into the accumulator by bulk reductions from shared memory.
//
// Rows the boxes read past a sequence (the next sequence's rows, NaN padding, keys past
// seqused_k) are zeroed in shared memory before any product reads them: 0 x NaN is NaN.
#pragma once
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "flash/bwd_sm80.cuh"
#include "flash/sm90_tiles.h"

namespace xla_attn {

namespace flash_sm90 {

// Zeroes rows [from, rows) of a column-blocked tile (rows x 128 bytes a block) with the
// 256 consumer threads (ct their index), then makes the zeros visible to the tensor
// cores (proxy fence) and meets the other consumers at named barrier 1.
template <int kColBlocks>
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int rows, int from, int ct) {
  constexpr int kChunksPerRow = kRowBytes / 16;
  for (int c = ct; c < kColBlocks * rows * kChunksPerRow; c += 256) {
    if ((c / kChunksPerRow) % rows >= from) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tile + 16u * uint32_t(c)),
                   "r"(0u)
                   : "memory");
    }
  }
}

// zero_tile_rows for two tiles of the same shape (K and V, or a stage's Q and dO), then
// the fence that shows the zeros to the tensor cores; named barrier 1 publishes them.
template <int kColBlocks>
__device__ __forceinline__ void zero_tiles_rows(uint32_t a, uint32_t b, int rows, int from,
                                                int ct) {
  zero_tile_rows<kColBlocks>(a, rows, from, ct);
  zero_tile_rows<kColBlocks>(b, rows, from, ct);
  sm90::fence_proxy_async_shared();
}

// The backward's products take their descriptors as low words (wgmma_sm90.cuh,
// kDescHigh: +3-4 % fwd+bwd at d128 on an H100).
constexpr bool kDescLowWord = true;

// What a dk/dv block works on: kKeys keys from n0 of kv head hk of sequence b (grid:
// key blocks, kv heads, batch + 1 padding block), against the row tiles (query head of
// the GQA group x kRows rows from i_lo) whose rows see some of its keys.
struct BwdBlock {
  Sequence s;
  Window win;
  int hk, b, n0, group;
  int keys_valid;       // keys below num_k (past seqused_k take no part; may be <= 0)
  int i_lo, i_hi;       // the rows that see some key of the block
  int per_head, tiles;  // row tiles a query head, and in all
  int full_lo, full_hi; // rows [full_lo, full_hi) see every key: no element-wise mask
  BwdTileCursor first;  // the block's first tile
};

// Plans block blockIdx (row tiles of kRows); false where it owns no key rows (it does
// nothing).
template <int kKeys, int kRows>
__device__ __forceinline__ bool bwd_block(const xla_attn_flash_bwd_params& p, BwdBlock* k) {
  // Key block n of a head sees its rows from about n kKeys on under a causal mask.
  int x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
  longest_first_tail(p.batch, &x, &y, &z);
  k->hk = y;
  k->b = z;
  k->s = bwd_sequence(p, k->b);
  k->n0 = x * kKeys;
  if (k->n0 >= k->s.num_k_rows) return false;
  const Sequence& s = k->s;
  const int n0 = k->n0;
  k->group = p.num_heads / p.num_heads_k;
  k->win = Window{p.window_left, p.window_right};
  k->keys_valid = s.num_k - n0;
  int i_lo = 0, i_hi = 0;
  if (k->keys_valid > 0) {
    k->win.row_range(n0, min(n0 + kKeys, s.num_k) - 1, s.offset, s.num_q, &i_lo, &i_hi);
  }
  // Tiles start on the accumulator's 16-row chunks (rows added in front see none of the
  // block's keys: their dS is masked to 0).
  i_lo -= i_lo % sm80::kAccChunkRows;
  k->i_lo = i_lo;
  k->i_hi = i_hi;
  k->per_head = (i_hi - i_lo + kRows - 1) / kRows;
  k->tiles = k->per_head * k->group;
  k->full_lo = 0;
  k->full_hi = 0;
  if (n0 + kKeys <= s.num_k) {
    k->win.rows_seeing_all(n0, n0 + kKeys - 1, s.offset, i_hi, &k->full_lo, &k->full_hi);
  }
  // Key blocks of a head start at different tiles, so that they do not all add into
  // the same dQ lines at once (as the sm80 kernel).
  const int first_tile = k->tiles > 0 ? x % k->tiles : 0;
  k->first = BwdTileCursor{first_tile / max(k->per_head, 1), first_tile % max(k->per_head, 1)};
  return true;
}

// A dk/dv block's mbarriers (8 bytes each from `at`): K and V landed, then per stage its
// Q and dO landed (full) and the consumers done with them (empty: one arrival a
// consumer warp).
struct BwdBars {
  uint32_t at;
  __device__ __forceinline__ uint32_t kv_full() const { return at; }
  __device__ __forceinline__ uint32_t full(int st) const { return at + 8u * uint32_t(1 + st); }
  __device__ __forceinline__ uint32_t empty(int st) const {
    return at + 8u * uint32_t(1 + kStages + st);
  }
  __device__ __forceinline__ void init() const {
    sm90::mbar_init(kv_full());
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(full(st));
      sm90::mbar_init(empty(st), 4 * kConsumerWarpgroups);
    }
    sm90::mbar_init_fence();
  }
};
static_assert(kBwdBarrierBytes == 8 * (1 + 2 * kStages), "BwdBars' layout");

// The producer warpgroup's work (tid its thread): thread 0 copies the block's kKeys rows
// of K and V (to sK, sV) once, then each tile's Q and dO rows into stage it % kStages
// (kRows bytes apart from sQ, sdO) once the consumers have freed it; kStats, also the
// tile's lse and D boxes into the stage's two slots from sStat (bwd_stat_bytes; zeros
// past the tensors, and the consumers zero the rows past the block's).
template <int kColBlocks, int kKeys, int kTileRows, bool kStats = false>
__device__ __forceinline__ void bwd_produce(const BwdArgs& a, const BwdBlock& k, BwdBars bars,
                                            uint32_t sK, uint32_t sV, uint32_t sQ, uint32_t sdO,
                                            int tid, uint32_t sStat = 0) {
  constexpr uint32_t kKVBlock = kKeys * kRowBytes, kRowsBlock = kTileRows * kRowBytes;
  constexpr uint32_t kKV = kColBlocks * kKVBlock, kRows = kColBlocks * kRowsBlock;
  constexpr int kD = kColBlocks * 64;
  constexpr uint32_t kStatSlot = bwd_stat_slot_bytes(kD);
  constexpr uint32_t kStatTx = kStats ? 2 * bwd_stat_box(kD) * 4 : 0;  // the two boxes' bytes
  static_assert(!kStats || kTileRows == bwd_rows(kD), "the stat boxes' rows");
  // Only thread 0 copies: the warpgroup's other threads leave at once instead of waiting
  // on every stage's mbarrier beside it (ncu: the producer warpgroup held 32 % of the
  // kernel's warp samples, polling), and thread 0 waits parked (mbar_wait<true>, as the
  // forward's copying thread).
  if (tid != 0) return;
  if (k.tiles > 0) {
    sm90::mbar_arrive_expect_tx(bars.kv_full(), 2 * kKV);
    for (int c = 0; c < kColBlocks; ++c) {
      const int row = int(k.s.k_start + k.n0);
      sm90::tma_load_3d(sK + c * kKVBlock, &a.k_map, bars.kv_full(), 64 * c, k.hk, row);
      sm90::tma_load_3d(sV + c * kKVBlock, &a.v_map, bars.kv_full(), 64 * c, k.hk, row);
    }
  }
  BwdTileCursor tile = k.first;
  for (int it = 0; it < k.tiles; ++it, tile.advance(k.per_head, k.group)) {
    const int st = it % kStages;
    if (it >= kStages) sm90::mbar_wait<true>(bars.empty(st), uint32_t(it / kStages - 1) & 1u);
    const int h = k.hk * k.group + tile.head, i0 = k.i_lo + tile.row * kTileRows;
    sm90::mbar_arrive_expect_tx(bars.full(st), 2 * kRows + kStatTx);
    for (int c = 0; c < kColBlocks; ++c) {
      const int row = int(k.s.q_start + i0);
      sm90::tma_load_3d(sQ + st * kRows + c * kRowsBlock, &a.q_map, bars.full(st), 64 * c, h,
                        row);
      sm90::tma_load_3d(sdO + st * kRows + c * kRowsBlock, &a.dout_map, bars.full(st), 64 * c,
                        h, row);
    }
    if constexpr (kStats) {  // [head][row] floats; the launcher checks that this fits in 32 bits
      const int at = bwd_stat_box_start(h * a.p.total_q + int(k.s.q_start) + i0);
      const uint32_t stat = sStat + uint32_t(st) * 2u * kStatSlot;
      sm90::tma_load_1d(stat, &a.lse_map, bars.full(st), at);
      sm90::tma_load_1d(stat + kStatSlot, &a.delta_map, bars.full(st), at);
    }
  }
}

// Writes a consumer warp's 16 key rows (from key_w) of dK or dV (acc: mma accumulators of
// kDT n8 column tiles, times `factor`) into `grad`: staged as 16-bit in the warp's own
// rows of `tile` (a K or V tile of column blocks block_bytes apart) and written as
// 16-byte chunks of whole rows. Keys [num_k, num_k_rows) own gradient rows too: they saw
// nothing, so theirs are 0.
template <typename T, int kDT>
__device__ __forceinline__ void bwd_store_grad(const xla_attn_flash_bwd_params& p,
                                               const BwdBlock& k, uint32_t tile,
                                               uint32_t block_bytes, int key_w, int lane,
                                               const float (&acc)[1][kDT][4], float factor,
                                               void* grad) {
  const int g = lane / 4, t = lane % 4, hd = p.head_dim;
  const int rows_valid = min(16, k.s.num_k_rows - k.n0 - key_w);
  const int64_t kv_stride = int64_t(p.num_heads_k) * hd;
  const bool vec = aligned_to<T>(p.dk, 16) && aligned_to<T>(p.dv, 16);
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint32_t at = sm90::swizzled_chunk(tile, block_bytes, key_w + g + 8 * hf, dt);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(at + 4u * uint32_t(t)),
                   "r"(sm80::pack2<T>(acc[0][dt][2 * hf] * factor, acc[0][dt][2 * hf + 1] * factor))
                   : "memory");
    }
  }
  __syncwarp();
  T* dst = static_cast<T*>(grad) + (k.s.k_start + k.n0 + key_w) * kv_stride + int64_t(k.hk) * hd;
  for (int idx = lane; idx < 16 * kDT; idx += 32) {
    const int r = idx / kDT, c = idx % kDT;
    if (r >= rows_valid || c * 8 >= hd) continue;
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(sm90::swizzled_chunk(tile, block_bytes, key_w + r, c)));
    sm80::store_chunk(dst + r * kv_stride, x, c * 8, hd, vec);
  }
}

// The backward's base-2 score factors for query head h of sequence b (sm80::BwdScore).
__device__ __forceinline__ sm80::BwdScore bwd_score_of(const xla_attn_flash_bwd_params& p, int b,
                                                       int h) {
  const bool capped = p.softcap > 0.f;
  return sm80::BwdScore{
      capped ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e, p.softcap * kLog2e,
      (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f) * kLog2e,
      capped};
}

// Stores a tile's lse or D value x times `factor` (lse: -log2 e, so that the exponent's
// FFMA takes it as is) at shared address `at`. The product sits inside the store's asm,
// where ptxas cannot move it: as plain code it was scheduled right behind the value's
// global load, a tile early, and waited there (ncu, H100, d128: 3.4 % of the consumers'
// stall samples on that one FMUL).
__device__ __forceinline__ void store_stat_scaled(uint32_t at, float x, float factor) {
  asm volatile("{ .reg .f32 y; mul.f32 y, %1, %2; st.shared.f32 [%0], y; }" ::"r"(at), "f"(x),
               "f"(factor)
               : "memory");
}

// Two consecutive lse or D rows at shared address `at`: one ld.shared.v2 where `at` is
// 8-byte aligned (kAligned8: rows the consumers stored), else two loads (a staged box,
// bwd_stats_staged: a tile's rows start 0-3 floats into it).
template <bool kAligned8>
__device__ __forceinline__ float2 stat_pair(uint32_t at) {
  float2 v;
  if constexpr (kAligned8) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(at));
  } else {
    asm volatile("ld.shared.f32 %0, [%2];\n\tld.shared.f32 %1, [%2+4];"
                 : "=f"(v.x), "=f"(v.y)
                 : "r"(at));
  }
  return v;
}

// Stores k-step kk of a consumer warp's dS^T (an A fragment: keys g, g + 8 of the warp's
// 16 x rows 16 kk + 2t, + 1, + 8, + 9) into a keys x rows 16-bit tile (one 128-byte row a
// key, swizzled), `ds_lane` from ds_lane_of<kStsm>. Rows past 64 go to the next column
// block of 64 rows (`block_bytes` further).
// - kStsm: one stmatrix.x4. The fragment's four registers are its four 8 x 8 matrices
//   (keys + 8 for f[1], f[3]; rows + 8 for f[2], f[3]); lane l gives the row address of
//   matrix l / 8, key row l % 8. cuDNN's d128 kernel stores dS so (STSM, ncu source view,
//   docs/benchmarks.md section (43)). d128 (H200, fwd+bwd, ncu): +0.4..1.0 %; d64 lost 2.3
//   / 3.5 % (ptxas spilled 56 / 68 bytes against 36 / 36; section (44)), and with its lse
//   / D staged and no spills still 0.5 / 2.6 % (section (45)), so d64 and d256 keep the four
//   st.shared.b32.
// - else four st.shared.b32, lane (g, t) at its key's row + 16 g + 4 t: the key's row is
//   128-byte aligned and its swizzle term is g, so XOR-ing the chunk index into bits 4-6
//   is the swizzle (sixteen addresses held apart spilled).
template <bool kStsm>
__device__ __forceinline__ void store_ds_step(uint32_t ds_lane, uint32_t block_bytes, int kk,
                                              const uint32_t (&f)[4]) {
  if constexpr (kStsm) {
    // chunk (2 (kk % 4) + l / 16) ^ (l % 8) = (l / 16 ^ l % 8, in ds_lane) ^ 2 (kk % 4)
    sm90::stsm_x4((ds_lane + block_bytes * uint32_t(kk / 4)) ^ (32u * uint32_t(kk % 4)), f);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // f[i]: key + 8 (i odd), rows + 8 (i >= 2)
      const uint32_t at = (ds_lane + block_bytes * uint32_t(kk / 4) + 1024u * uint32_t(i & 1)) ^
                          (16u * uint32_t(2 * (kk % 4) + (i >> 1)));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(f[i]) : "memory");
    }
  }
}

// The lane's address for store_ds_step<kStsm> in a dS^T tile at `tile`, the warp's keys
// from key_w (a multiple of 16, so a key row's swizzle term is its key % 8). kStsm:
// matrix l / 8's row l % 8 is key key_w + l % 8 (+ 8 for matrices 1 and 3), 16-byte chunk
// l / 16 (+ 2 a k-step); else lane (g, t)'s first element.
template <bool kStsm>
__device__ __forceinline__ uint32_t ds_lane_of(uint32_t tile, int key_w, int lane) {
  if constexpr (kStsm) {
    const int r = lane % 8, key = key_w + r + 8 * ((lane / 8) & 1);
    return tile + uint32_t(key) * kRowBytes + 16u * uint32_t((lane / 16) ^ r);
  } else {
    const int g = lane / 4, t = lane % 4;
    return tile + uint32_t(key_w + g) * kRowBytes + 16u * uint32_t(g) + 4u * uint32_t(t);
  }
}

// A consumer warp's 16 rows of dQ, kChunks 32-column chunks of the accumulator (chunk u's
// n8 tile j, a lane's 4 floats, at dq[16 u + 4 j]), into the accumulator: staged in the
// warp's shared-memory `slice` in the accumulator's layout (sm80::acc_offset: n8 tile j at
// j * 128 + 4 lane), then added by one bulk reduction of the first `chunks` chunks (at
// least one), issued by lane 0 at acc() (the first of them). The caller makes sure the
// slice is free (the warp's last reduction has read it). With one red.global.add.v4 per
// 4 floats, the next tile waited for the reds to release their registers: 17 % of the
// d128 kernel's stall samples (H100, S = 4096), 25 % of the d256 kernel's (H200, S = 4096;
// docs/benchmarks.md 2026-11-29 (51)).
// kTestChunks: lane 0 also tests that `chunks` is positive, which never fails, as the
// d256 kernel did when it was measured (without the test ptxas scheduled that whole
// kernel anew; with it, the d64 / d128 kernel's).
template <int kChunks, bool kTestChunks = false, typename Acc>
__device__ __forceinline__ void dq_rows_bulk_add(const float (&dq)[16 * kChunks], uint32_t slice,
                                                 int lane, int chunks, Acc&& acc) {
  // the lane's first float; the rest are constants past it (acc_offset is linear)
  const uint32_t lane_at = slice + 4u * uint32_t(sm80::acc_offset(0, 0, lane));
#pragma unroll
  for (int u = 0; u < kChunks; ++u) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float* q = &dq[16 * u + 4 * j];
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(
                       lane_at + 4u * uint32_t(u * sm80::kAccChunk + sm80::acc_offset(j, 0, 0))),
                   "f"(q[0]), "f"(q[1]), "f"(q[2]), "f"(q[3])
                   : "memory");
    }
  }
  sm90::fence_proxy_async_shared();
  __syncwarp();
  if (lane == 0 && (!kTestChunks || chunks > 0)) {
    sm90::bulk_reduce_add_f32(acc(), slice, uint32_t(chunks) * sm80::kAccChunk * 4u);
    sm90::bulk_commit();
  }
}

}  // namespace flash_sm90

template <typename T, int D>
__device__ void flash_bwd_dkdv_sm90(const flash_sm90::BwdArgs& a) {
  using namespace flash_sm90;
  const xla_attn_flash_bwd_params& p = a.p;
  if (dkdv_padding_block<T>(p)) return;
  constexpr int kColBlocks = D / 64;
  // dQ = dS K over all 128 keys (the other warpgroup's dS^T read from shared memory), so
  // that each dQ element is added once a block: with 64-row tiles (d128) one warpgroup a
  // tile takes all columns (N = 128), the warpgroups in turns and a tile late
  // (bwd_dq_late); with 128-row tiles (d64, bwd_rows) each warpgroup its 64 rows (wgmma's
  // M) and all 64 columns. (At d64 each warpgroup once took all 64 columns over its own
  // 64 keys, both adding into the same chunks: twice the reductions; on an H100, ncu,
  // S = 8192: 3.2x the kernel's L2 reads, L2 73 % busy.)
  constexpr int kTileRows = bwd_rows(D);
  constexpr bool kDqByRows = kTileRows > 64, kDqLate = bwd_dq_late(D);
  static_assert(!kDqByRows || (D == 64 && kTileRows == 64 * kConsumerWarpgroups),
                "dQ by rows: a warpgroup's 64 rows, all of d64's columns");
  constexpr int kDqCols = bwd_dq_cols(D);  // d64 and d128 a tile late: D; else D / 2
  constexpr int kDqChunks = kDqCols / sm80::kAccChunkCols;  // accumulator chunks a warp
  static_assert(kDqChunks >= 1 && kDqCols <= 128, "dQ: N of at most 128");
  // S^T and dP^T as two commit groups, P^T's exponentials run while dP^T's product does
  // (as cuDNN's d128 backward kernel orders them, ncu source view). At d64 (S^T, dP^T 64
  // registers each) ptxas then spilled 116 / 140 bytes against 36 / 36.
  constexpr bool kExpsFirst = D > 64;
  constexpr int kNT = kTileRows / 8;  // n8 tiles of S^T (query rows)
  constexpr int kDT = D / 8;         // n8 tiles of dK, dV
  constexpr int kSteps = kTileRows / 16;  // k-steps of dV += P^T dO, dK += dS^T Q
  constexpr uint32_t kKVBlock = kBwdKeys * kRowBytes;     // a column block of K or V
  constexpr uint32_t kRowsBlock = kTileRows * kRowBytes;  // a column block of Q or dO
  constexpr uint32_t kKV = kColBlocks * kKVBlock, kRows = kColBlocks * kRowsBlock;
  static_assert(bwd_stats_staged(D), "lse / D come with each stage (sm90_tiles.h)");
  constexpr uint32_t kStatSlot = bwd_stat_slot_bytes(D);  // staged: lse's box, then D's
  constexpr uint32_t kDsBytes = bwd_ds_bytes(D);          // a tile's dS^T
  constexpr uint32_t kDsBlock = kBwdKeys * kRowBytes;     // 64 of its rows (a column block)
  static_assert(kDsBytes == (kTileRows / 64) * kDsBlock, "dS^T: column blocks of 64 rows");
  static_assert(2 * kTileRows <= 256, "the consumers zero a tile's tail lse / D, one a thread");
  extern __shared__ __align__(128) unsigned char smem[];

  BwdBlock blk;
  if (!bwd_block<kBwdKeys, kTileRows>(p, &blk)) return;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const int hk = blk.hk, b = blk.b, hd = p.head_dim, n0 = blk.n0, group = blk.group;
  const int keys_valid = blk.keys_valid, i_lo = blk.i_lo, i_hi = blk.i_hi;
  // tiles, per_head, the warpgroup and the tile's stage and dS^T buffer addresses:
  // sm90::warp_uniform, so that the tile loop and the products' descriptors stay in
  // uniform registers.
  const int per_head = sm90::warp_uniform(blk.per_head);
  const int tiles = sm90::warp_uniform(blk.tiles), full_lo = blk.full_lo, full_hi = blk.full_hi;
  const BwdTileCursor first = blk.first;

  const uint32_t base = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
  const uint32_t sK = base, sV = sK + kKV, sQ = sV + kKV, sdO = sQ + kStages * kRows;
  constexpr int kDsBuffers = bwd_ds_buffers(D);
  const uint32_t sDs = sdO + kStages * kRows;          // + (tile % kDsBuffers) * kDsBytes
  const uint32_t sDq = sDs + kDsBuffers * kDsBytes;    // + warp * bwd_dq_warp_bytes
  const uint32_t sStat = sDq + bwd_dq_bytes(D);        // + stage * 2 slots
  const uint32_t bars = sStat + bwd_stat_bytes(D);
  static_assert(bwd_stat_bytes(D) == kStages * 2 * int(kStatSlot), "sStat's size");
  const BwdBars bar{bars};
  const uint32_t kv_full = bar.kv_full();
  auto full = [&](int st) { return bar.full(st); };
  auto empty = [&](int st) { return bar.empty(st); };
  if (threadIdx.x == 0) bar.init();
  __syncthreads();

  if (threadIdx.x < 128) {
    sm90::regs_release<kProducerRegs>();
    bwd_produce<kColBlocks, kBwdKeys, kTileRows, true>(a, blk, bar, sK, sV, sQ, sdO, threadIdx.x,
                                                       sStat);
  } else {
    sm90::regs_acquire<kConsumerRegs>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. 255
    const int wg = sm90::warp_uniform(ct / 128), warp = (ct % 128) / 32, lane = ct % 32,
              g = lane / 4, t = lane % 4;
    const int key_wg = 64 * wg, key_w = key_wg + 16 * warp;  // block-relative keys
    float dk[1][kDT][4] = {}, dv[1][kDT][4] = {};
    float(&dk_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(dk);
    float(&dv_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(dv);
    // A tile's lse and D rows, copied with its stage (lse as is; compute-sanitizer's
    // racecheck follows the tensor copy: 0 hazards, docs/benchmarks.md section (45)), the
    // rows past i_hi zeroed here; `staged_stat` the tile's lse row 0 in its box
    // (bwd_stat_row_in_box of h total_q + q_start + i0; i0 % 64 == 0 leaves it out).
    auto staged_stat = [&](int st, int h) {
      return sStat + uint32_t(st) * 2u * kStatSlot +
             4u * uint32_t(bwd_stat_row_in_box(h * p.total_q + int(s.q_start)));
    };
    // Once dV, dK (the products last committed before dQ's, if any) are done, S^T, dP^T,
    // dV and dK are done with stage st: each consumer warp arrives on its empty barrier.
    auto release_stage = [&](int st) {
      sm90::wgmma_wait<kDqLate ? 0 : 1>();
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(empty(st));
    };
    // Named barriers: kBarAll meets all 256 consumer threads (zeroed rows, the block's
    // end; every tile where dQ is not late); with dQ late, warpgroup u % 2 arrives on
    // bar_ds(u) once tile u's dS^T is stored, its dQ of tile u - 1 done with dS^T and its
    // reduction with sDq, and the other warpgroup waits there before tile u's dQ. Two ids
    // in turns: warpgroup u % 2 arrives on bar_ds(u + 2) only after it has waited on bar_ds
    // (u + 1), which the other arrives on after it waited on bar_ds(u). kBarWgDs + wg: one
    // warpgroup's threads (its dS^T rows for dK). compute-sanitizer's racecheck reports the
    // sDq stores on either side of a bar.arrive -> bar.sync hand-over as write / write
    // races; it does the same on tools/racecheck_probe.py's 20-line kernel, and none once
    // the arrive is a bar.sync (docs/benchmarks.md section (44)): the tool does not credit
    // bar.arrive, which the PTX ISA orders as the producer side of such a hand-over.
    constexpr int kBarAll = 1, kBarWgDs = 6;  // (ids 4 and 5 unused)
    auto bar_ds = [](int u) { return 2 + (u & 1); };
    // dQ = dS K for the tile of rows from i0_u of query head h_u, its dS^T at ds_u
    // (kDqCols / 2 f32 a thread: 64 rows of the tile from dq_row0 x kDqCols columns from
    // dq_col0), added into the accumulator's chunks: rows dq_row0 + 16 warp + g (+ 8) of
    // the tile, columns dq_col0 + 8 j + 2t (+ 1). A row chunk wholly past the block's rows
    // adds nothing (it may be the next sequence's); chunks past hd do not exist. Not late
    // (d64), the product's issue releases stage st.
    auto dq_tile = [&](int h_u, int i0_u, uint32_t ds_u, int st) {
      const int dq_col0 = kDqByRows || kDqLate ? 0 : wg * kDqCols;
      const int dq_row0 = kDqByRows ? 64 * wg : 0;
      float dq[kDqCols / 2];
      // K as B, N-major: N = 128 spans both column blocks (the leading offset between).
      uint64_t kcol_desc = sm90::smem_desc(
          sK + uint32_t(dq_col0 / 64) * kKVBlock + uint32_t(dq_col0 % 64) * 2u,
          kDqCols > 64 ? kKVBlock : 0u);
      asm volatile("" : "+l"(kcol_desc));
      const uint64_t ds_desc = sm90::smem_desc(ds_u + uint32_t(dq_row0 / 64) * kDsBlock, 0);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBwdKeys / 16; ++kk) {
        const uint32_t keys_at = uint32_t(16 * kk) * kRowBytes;
        sm90::wgmma_ss<kDqCols, T, sm90::SsMajor::kMN, kDescLowWord>(
            dq, sm90::desc_plus(ds_desc, keys_at), sm90::desc_plus(kcol_desc, keys_at), kk > 0);
      }
      sm90::wgmma_commit();
      if (!kDqLate) release_stage(st);
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(dq);
      // The warp's last reduction has read its sDq slice (long since: it was issued a
      // tile or two ago) before any lane writes it again.
      if (lane == 0) sm90::bulk_wait<0, true>();
      __syncwarp();
      if (i_hi - i0_u > dq_row0 + 16 * warp) {
        // The warp's chunks through its slice of sDq (dq_rows_bulk_add).
        const int chunks = min(kDqChunks, sm80::bwd_acc_col_chunks(hd) - dq_col0 / 32);
        const uint32_t slice =
            sDq + uint32_t(kDqLate ? warp : ct / 32) * uint32_t(bwd_dq_warp_bytes(D));
        dq_rows_bulk_add<kDqChunks>(dq, slice, lane, chunks, [&] {
          return bwd_dq_accum_rows(p, h_u, s, b, (i0_u + dq_row0) / sm80::kAccChunkRows + warp) +
                 dq_col0 / 32 * sm80::kAccChunk;
        });
      }
    };
    // dQ late: tile u's dS^T is stored, this warpgroup's dQ of tile u - 1 done with dS^T
    // and (the bulk wait) its reductions with sDq, which the other warpgroup writes next.
    auto ds_done = [&](int u) {
      if (lane == 0) sm90::bulk_wait<0, true>();
      __syncwarp();
      sm90::named_arrive(bar_ds(u), 256);
    };
    // A pair of rows' -lse log2 e and D at a tile's stat address plus 4 x its first row
    // (lse is copied as is: one FMUL a row for its elements' FFMA).
    auto nlse_pair = [&](uint32_t at) {
      const float2 v = stat_pair<false>(at);
      return float2{v.x * -kLog2e, v.y * -kLog2e};
    };
    auto delta_pair = [&](uint32_t at) { return stat_pair<false>(at + kStatSlot); };
    if (tiles > 0) {
      sm90::mbar_wait(kv_full, 0u);
      if (keys_valid < kBwdKeys) {
        zero_tiles_rows<kColBlocks>(sK, sV, kBwdKeys, max(keys_valid, 0), ct);
      }
      sm90::named_barrier(kBarAll, 256);
    }
    int h_prev = -1, dq_h = 0, dq_i0 = 0;
    sm80::BwdScore sc_mod{};
    BwdTileCursor tile = first;
    for (int it = 0; it < tiles; ++it, tile.advance(per_head, group)) {
      const int st = it % kStages, h = hk * group + tile.head, i0 = i_lo + tile.row * kTileRows;
      const uint32_t tQ = sm90::warp_uniform(sQ + st * kRows), tdO = tQ + kStages * kRows;
      if (h != h_prev) {  // bwd_score_of, written out: called, ptxas allocated this
        h_prev = h;         // kernel's registers otherwise (H100: d128 -2 % at S = 2048)
        const bool capped = p.softcap > 0.f;
        sc_mod = sm80::BwdScore{capped ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e,
                          p.softcap * kLog2e,
                          (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h]
                                          : 0.f) * kLog2e,
                          capped};
      }
      sm90::mbar_wait(full(st), uint32_t(it / kStages) & 1u);
      if (i0 + kTileRows > i_hi) {  // rows past the block's last: zeros (block-uniform)
        // Staged lse and D too (the next sequence's, or a padding row's NaN D: 0 x NaN is
        // NaN), before zero_tiles_rows' proxy fence, which orders them before the stage's
        // next copy.
        if (ct < 2 * kTileRows && ct % kTileRows >= i_hi - i0) {
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(staged_stat(st, h) +
                                                       uint32_t(ct / kTileRows) * kStatSlot +
                                                       4u * uint32_t(ct % kTileRows)),
                       "f"(0.f)
                       : "memory");
        }
        zero_tiles_rows<kColBlocks>(tQ, tdO, kTileRows, i_hi - i0, ct);
        sm90::named_barrier(kBarAll, 256);
      }

      // S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys x the tile's rows
      // (kExpsFirst: S^T's product, then dP^T's).
      float stt[1][kNT][4], dpt[1][kNT][4];
      float(&st_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(stt);
      float(&dp_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(dpt);
      // Descriptors as a base plus constant steps, the bases made anew each tile (an
      // empty asm hides that they are the same): hoisted out of the loop, ptxas kept a
      // descriptor a product in registers and spilled them.
      uint64_t k_desc = sm90::smem_desc(sK + uint32_t(key_wg) * kRowBytes, 16);
      uint64_t q_desc = sm90::smem_desc(tQ, 16);
      asm volatile("" : "+l"(k_desc));
      sm90::wgmma_fence();
      // k-step kk of S^T (K and Q) or of dP^T (dP: V and dO, kKV and a stage further on).
      auto sdp_step = [&](float(&acc)[kNT * 4], bool dp, int kk) {
        const uint32_t at = uint32_t(kk / 4) * kKVBlock + uint32_t(kk % 4) * 32u;
        const uint32_t rows_at = uint32_t(kk / 4) * kRowsBlock + uint32_t(kk % 4) * 32u;
        sm90::wgmma_ss<kTileRows, T, sm90::SsMajor::kK, kDescLowWord>(
            acc, sm90::desc_plus(k_desc, (dp ? kKV : 0u) + at),
            sm90::desc_plus(q_desc, (dp ? kStages * kRows : 0u) + rows_at), kk > 0);
      };
      auto dp_step = [&](int kk) { sdp_step(dp_flat, true, kk); };
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        sdp_step(st_flat, false, kk);
        if (!kExpsFirst) dp_step(kk);
      }
      if (kExpsFirst) {
        sm90::wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) dp_step(kk);
      }
      sm90::wgmma_commit();
      if (kDqLate && it > 0 && ((it - 1) & 1) == wg) ds_done(it - 1);
      sm90::wgmma_wait<kExpsFirst ? 1 : 0>();
      sm90::wgmma_hold(st_flat);
      if (!kExpsFirst) sm90::wgmma_hold(dp_flat);

      // P^T and dS^T (times softcap'). Element (nt, 2 hf + e): key n0 + key_w + g + 8 hf,
      // row i0 + 8 nt + 2t + e.
      const bool mask = (i0 < full_lo) | (i0 + kTileRows > full_hi);
      const uint32_t stat = staged_stat(st, h);
      // dS^T goes to the block's buffer (keys x rows, 16-bit) for dQ = dS K
      // (store_ds_step): the block's 128 keys, kDsBuffers buffers by tile. Not late, a
      // warpgroup writes tile it + 1's while the other may still read tile it's (they meet
      // once a tile); late, tile it - 1's is read in tile it, and a warpgroup may write
      // tile it + 1's before it knows the other is done with tile it - 1's.
      const uint32_t ds_buf = sm90::warp_uniform(sDs + uint32_t(it % kDsBuffers) * kDsBytes);
      const uint32_t ds_lane = ds_lane_of<kDqLate>(ds_buf, key_w, lane);
      uint32_t pa[kSteps][4], da[kSteps][4];
      // Called with a constant: inlined, each call a copy specialised on it. The common
      // tile (every key seen by every row, no softcap, no ALiBi) takes an FFMA and the
      // exp2 an element (exps), then an FADD and an FMUL (grads); a masked tile without
      // softcap or ALiBi (causal and window edges, a sequence's last rows) adds a compare
      // pair and a select to exps; the general copy tests masks, softcap and ALiBi per
      // element (~20 instructions) in grads alone, after both products. With the choice
      // made per element inside one copy (before), ptxas kept both bodies interleaved
      // (~2,000 SASS instructions a tile) and re-derived the choice into a 32-bit
      // predicate mask (64 LOP3 a tile): on an H100 (d128, S = 4096) this section took 49
      // % of the consumers' stall samples, 42 % of them waiting for instructions to be
      // fetched.
      enum { kGradsFast, kGradsMasked, kGradsGeneral };
      // kGradsMasked: the rows [lo, hi) of the tile that see each of the lane's two keys
      // (none past num_k), relative to the lane's first row i0 + 2t, so that element (nt,
      // e) tests the constant 8 nt + e.
      const bool plain = !sc_mod.capped && sc_mod.slope == 0.f;
      int vis_lo[2] = {}, vis_hi[2] = {};
      if (mask && plain) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          win.rows_seeing_key(n0 + key_w + g + 8 * hf, s.num_k, s.offset, i_hi, i0 + 2 * t,
                              kTileRows, &vis_lo[hf], &vis_hi[hf]);
        }
      }
      // P^T in place of S^T (f32) for k-step kk (two n8 tiles of rows): kGradsFast and
      // kGradsMasked.
      auto exps = [&](const int kMode, const int kk) {
#pragma unroll
        for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt) {
          const float2 nlse = nlse_pair(stat + 4u * uint32_t(nt * 8 + 2 * t));
          const float nlse2[2] = {nlse.x, nlse.y};
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = stt[0][nt][2 * hf + e];
              if (kMode == kGradsFast) {
                x = fast_exp2(fmaf(x, sc_mod.mul, nlse2[e]));
              } else {
                const int r = nt * 8 + e;
                x = r >= vis_lo[hf] && r < vis_hi[hf] ? fast_exp2(fmaf(x, sc_mod.mul, nlse2[e]))
                                                      : 0.f;
              }
            }
          }
        }
      };
      // dS^T = P^T (dP^T - D) for k-step kk (P^T from exps), or (kGradsGeneral) P^T and
      // dS^T from S^T and dP^T; then both as A fragments, dS^T stored, so that S^T and
      // dP^T registers die as their 16-bit fragments are made.
      auto grads = [&](const int kMode, const int kk) {
#pragma unroll
        for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt) {
          const int col = nt * 8 + 2 * t;
          float2 nlse;
          if (kMode == kGradsGeneral) nlse = nlse_pair(stat + 4u * uint32_t(col));
          const float2 del = delta_pair(stat + 4u * uint32_t(col));
          const float dl[2] = {del.x, del.y};
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int key = n0 + key_w + g + 8 * hf;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = stt[0][nt][2 * hf + e];
              float& d = dpt[0][nt][2 * hf + e];
              if (kMode != kGradsGeneral) {
                d = x * (d - dl[e]);
              } else {
                const int i = i0 + col + e;
                const int64_t pos = int64_t(i) + s.offset;
                float grad;
                float pr = sc_mod.prob(x, pos, key, e ? -nlse.y : -nlse.x, &grad);
                if (mask && !(key < s.num_k && i < i_hi && win.visible(pos, key))) pr = 0.f;
                x = pr;
                d = pr * (d - dl[e]) * grad;
              }
            }
          }
        }
        sm80::accum_to_a<T>(pa[kk], stt[0][2 * kk], stt[0][2 * kk + 1]);
        sm80::accum_to_a<T>(da[kk], dpt[0][2 * kk], dpt[0][2 * kk + 1]);
        store_ds_step<kDqLate>(ds_lane, kDsBlock, kk, da[kk]);
      };
      // The tile's element-wise section in one of three copies. kExpsFirst: every
      // exponential while dP^T's product runs, then dS^T; else both a k-step at a time.
      auto section = [&](const int kMode) {
        if (kExpsFirst) {
          if (kMode != kGradsGeneral) {
#pragma unroll
            for (int kk = 0; kk < kSteps; ++kk) exps(kMode, kk);
          }
          sm90::wgmma_wait<0>();
          sm90::wgmma_hold(dp_flat);
        }
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          if (!kExpsFirst && kMode != kGradsGeneral) exps(kMode, kk);
          grads(kMode, kk);
        }
      };
      // The masked copy (every head dim of this kernel, d64 and d128). d64: causal gained
      // 2-9 %, full rows within 3 %. d128 with 64-bit descriptors: its registers made
      // ptxas spill 48 bytes more, causal S = 1024 gained 11 % but full S = 1024 / 16384
      // lost 9 % / 3 %; with the descriptors' low words in uniform registers it spills 60
      // / 72 bytes (36 / 36 without) and gains everywhere (H100, fwd+bwd A/B, 2 rounds:
      // causal S = 1024 / 4096 +14 % / +5 %, full S = 4096 / 16384 +2 %).
      if (!plain) {
        section(kGradsGeneral);
      } else if (mask) {
        section(kGradsMasked);
      } else {
        section(kGradsFast);
      }
      sm90::fence_proxy_async_shared();

      // dV += P^T dO, dK += dS^T Q: k-steps of 16 rows (2 KB of a stage), N = D across
      // the column blocks (the leading offset).
      sm90::wgmma_hold(dk_flat);
      sm90::wgmma_hold(dv_flat);
      sm90::wgmma_hold(pa);
      if (!kDqLate) sm90::wgmma_hold(da);
      sm90::wgmma_fence();
      const uint64_t rows_desc = sm90::smem_desc(tQ, kRowsBlock);
      if constexpr (kDqLate) {
        // dK reads dS^T from the buffer dQ reads it from (keys x rows, K-major for dK's
        // A), so that its 16 registers die at the stores: dV first, then the warpgroup's
        // dS^T rows stored and fenced by all its threads, then dK.
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          const uint32_t at = uint32_t(kk) * 16u * kRowBytes;
          sm90::wgmma_rs<D, T, kDescLowWord>(dv_flat, pa[kk],
                                             sm90::desc_plus(rows_desc, kStages * kRows + at));
        }
        sm90::named_barrier(kBarWgDs + wg, 128);
        uint64_t dsa_desc = sm90::smem_desc(ds_buf + uint32_t(key_wg) * kRowBytes, 16);
        asm volatile("" : "+l"(dsa_desc));
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          const uint32_t at = uint32_t(kk) * 16u * kRowBytes;
          sm90::wgmma_ss<D, T, sm90::SsMajor::kBN, kDescLowWord>(
              dk_flat, sm90::desc_plus(dsa_desc, 32u * kk), sm90::desc_plus(rows_desc, at), true);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          const uint32_t at = uint32_t(kk) * 16u * kRowBytes;
          sm90::wgmma_rs<D, T, kDescLowWord>(dv_flat, pa[kk],
                                             sm90::desc_plus(rows_desc, kStages * kRows + at));
          sm90::wgmma_rs<D, T, kDescLowWord>(dk_flat, da[kk], sm90::desc_plus(rows_desc, at));
        }
      }
      sm90::wgmma_commit();
      if (kDqLate) {
        // dQ = dS K is issued with dV and dK in flight: dK reads dS^T from shared memory,
        // so only P^T's 16 registers stay with them (with dS^T's 16 too, beside dQ's 64
        // and dK, dV's 128, ptxas serialized every product: C7512). dQ's wait covers them,
        // and only then is the stage released.
        if (it > 0 && (it & 1) == wg) {
          sm90::named_barrier(bar_ds(it - 1), 256);
          dq_tile(dq_h, dq_i0, sDs + uint32_t((it - 1) % kDsBuffers) * kDsBytes, st);
        }
        release_stage(st);
        dq_h = h;
        dq_i0 = i0;
      } else {
        sm90::named_barrier(kBarAll, 256);  // both warpgroups' dS^T rows
        dq_tile(h, i0, ds_buf, st);
      }
    }
    // Tile tiles - 1's dQ, late: its dS^T from both warpgroups.
    if (kDqLate && tiles > 0) {
      if (((tiles - 1) & 1) == wg) {
        ds_done(tiles - 1);
      } else {
        sm90::named_barrier(bar_ds(tiles - 1), 256);
        dq_tile(dq_h, dq_i0, sDs + uint32_t((tiles - 1) % kDsBuffers) * kDsBytes, 0);
      }
    }
    // dK (times the softmax scale) and dV of the warp's 16 keys, staged in the warp's own
    // rows of sK / sV. The other warpgroup's last dQ = dS K reads all 128 rows of sK:
    // both meet first. (Without this barrier a warpgroup that finished first overwrote K
    // under the other's last dQ product: dq errors of 2-8 % under compute-sanitizer's
    // timing, 1 run in 2.)
    sm90::named_barrier(kBarAll, 256);
    bwd_store_grad<T, kDT>(p, blk, sK, kKVBlock, key_w, lane, dk, p.softmax_scale, p.dk);
    bwd_store_grad<T, kDT>(p, blk, sV, kKVBlock, key_w, lane, dv, 1.f, p.dv);
    // The warp's last reduction has read its sDq slice before the block may end; its
    // adds into dQ's accumulator complete on their own, before the kernel does (the
    // dQ conversion kernel runs after it), as an O tile's store does in the forward.
    // Waiting for them to complete (before dK / dV, as here until 2026-11-29) held every
    // warp on the last tile's reductions through the 256-thread barrier.
    if (lane == 0) sm90::bulk_wait<0, /*kRead=*/true>();
  }
}

}  // namespace xla_attn
