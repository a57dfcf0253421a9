// paged_attention's tensor-core decode kernel (sm_80+; caches of the query's 16-bit
// dtype, or fp8 e4m3/e5m2 converted to f16 in registers): the decode kernel of
// paged/decode.cuh with its dot products and weighted sums on mma.sync instead of
// FP32 FMAs and shuffles. ncu on an H100 showed the FMA
// kernel issue-bound at 2.2 TB/s (65 % of issue slots, 66 % of DRAM bandwidth); here
// a key costs 2 mma per 16 keys and dimension block instead of ~100 instructions.
//
// One block = one (split of the keys, kv head, sequence), 4 warps. The block's query
// rows are the heads of the kv head's GQA group times the query tokens (<= 16: one
// m16 tile, its A fragments held in registers for the whole loop), so each K/V byte
// is read once for the group. Each warp streams its own 16-key tiles (tile i of the
// split goes to warp i % 4) through shared-memory stages with cp.async, two (fp8:
// four) tiles in flight while one is computed: S = Q K^T (ldmatrix of K), the online softmax
// on the S fragments, O += P V (P straight from the S registers, ldmatrix.trans of V).
// fp8 tiles stay fp8 in shared memory, read by ldmatrix as rows of 16-bit pairs and
// converted in registers (exact: every e4m3/e5m2 value is an f16); the mma then run
// in f16 (Q and P rounded to f16), the cache scales applied to the scores and the
// output. For that, Q K^T sums over a permuted head dim (an ldmatrix lane holds 4
// adjacent fp8 of a key row, which become the B fragment's columns 2t, 2t+1 and
// 2t+8, 2t+9; Q's A fragment is loaded in the same order), and P V's B fragments come
// from transposed pairs whose bytes are split into even and odd dims, so a thread's
// O columns are a permutation too (o_col). Converting each tile to an f16 tile in
// shared memory first, as before, cost a second pass through it (24 KB of shared
// traffic per 4 KB tile) and ran at 71 % of the copy rate.
// The warps merge their partial softmax states through shared memory at the end;
// splits write partials that paged_decode_combine (paged/decode.cuh) merges.
#pragma once
#include "common/mma_sm80.cuh"
#include "flash/fwd_sm80.cuh"
#include "paged/decode.cuh"
#include "paged/decode_tiles.h"

namespace xla_attn {
namespace decode_sm80 {

// The mma operand type: the query's 16-bit type over a cache of it, f16 over fp8.
template <typename T, typename KV>
using Compute = Select<sizeof(KV) == 1, __half, T>;

// Two 16-bit query elements (one b32 of a row) as an A-fragment register of Tc.
template <typename Tc, typename T>
__device__ __forceinline__ uint32_t as_operand(uint32_t x) {
  if constexpr (kSameType<Tc, T>) {
    return x;
  } else {
    T v[2];
    *reinterpret_cast<uint32_t*>(v) = x;
    return sm80::pack2<Tc>(to_float(v[0]), to_float(v[1]));
  }
}

// Four fp8 (bytes 0..3 of x) as two f16 pairs: (b0, b1) and (b2, b3), in hardware on
// sm_89+.
template <typename KV>
__device__ __forceinline__ void fp8x4_to_f16(uint32_t x, uint32_t& lo, uint32_t& hi) {
  constexpr __nv_fp8_interpretation_t kFormat =
      kSameType<KV, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(x & 0xffffu), kFormat);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(x >> 16), kFormat);
  lo = uint32_t(a.x) | (uint32_t(a.y) << 16);
  hi = uint32_t(b.x) | (uint32_t(b.y) << 16);
}

// A transposed ldmatrix register of an fp8 tile holds the pairs (dims 2j, 2j + 1) of
// keys k and k + 1: bytes (k, 2j), (k, 2j + 1), (k + 1, 2j), (k + 1, 2j + 1). As f16
// B-fragment registers: keys (k, k + 1) of dim 2j (even) and of dim 2j + 1 (odd).
template <typename KV>
__device__ __forceinline__ void fp8_pairs_to_f16(uint32_t x, uint32_t& even, uint32_t& odd) {
  fp8x4_to_f16<KV>(__byte_perm(x, 0u, 0x3120), even, odd);
}

// Head-dim column of accumulator element o[dt][2 hf + e] of lane quad position t.
// 16-bit: n8 tile dt, columns 2t + e. fp8: tile dt = 4 dd + 2 w + parity holds dims
// 32 dd + 16 w + 2 (2t + e) + parity (fp8_pairs_to_f16's even / odd split).
template <bool kFp8>
__device__ __forceinline__ int o_col(int dt, int t, int e) {
  if constexpr (kFp8) return 32 * (dt / 4) + 16 * ((dt / 2) & 1) + 4 * t + 2 * e + (dt & 1);
  return 8 * dt + 2 * t + e;
}

}  // namespace decode_sm80

namespace decode_sm80 {

// A warp's K/V tiles through cp.async: stage i % kStages of the warp's shared memory
// (decode_sm80::warp_smem_bytes) holds tile i (keys k_lo + (i * kWarps + warp) * 16 ..)
// as stored, rows of kTileW 16-bit units swizzled as the flash kernels' tiles (swz), and
// the physical rows of its keys. The kernel body (paged_decode_mma) asks a tile source
// for: count(), start(), acquire(i) (tile i landed; the next one issued), the stage's
// K and V shared addresses and their ldmatrix lane addresses, present(stage, jl, key)
// (the key has a cache row), release() and drain(). kHeads kv heads (heads_together):
// a stage holds each head's tile, one after the other (kHeadBytes apart).
template <typename KV, int D, int kHeads_ = 1>
struct CpAsyncTiles {
  static constexpr int kHeads = kHeads_;  // kv heads a block reads
  using LdsmLane = sm80::LdsmLane<D * int(sizeof(KV)) / 2>;
  static constexpr int kStages = stages(int(sizeof(KV)), kHeads);
  static constexpr int kTileW = D * int(sizeof(KV)) / 2;   // tile row width in 16-bit units
  static constexpr int kChunks = D * int(sizeof(KV)) / 16;  // 16-byte chunks per cache row
  static constexpr int kLoads = kHeads * kTileKeys * kChunks / 32;  // cp.async a lane and tile
  static constexpr int kHeadBytes = stage_bytes(D, int(sizeof(KV)));  // a head's tile
  static constexpr int kStageBytes = kHeads * kHeadBytes;
  static_assert(kTileKeys * kChunks % 32 == 0, "a tile must spread evenly over a warp");
  static_assert(32 % kChunks == 0, "a lane's chunks must share a column");
  static_assert(kHeads == 1 || kHeads == heads_together(D, int(sizeof(KV))),
                "heads together make 256-byte key rows");
  // A lane's chunk `it` is of row cp_r0 + it * kRowStep of the heads' rows stacked
  // ([kHeads][16]): head it * kRowStep / 16, since cp_r0 < kRowStep and kRowStep | 16.
  static constexpr int kRowStep = 32 / kChunks;
  static_assert(kTileKeys % kRowStep == 0, "a lane's chunk rows must not straddle heads");

  KeyRows keys;  // the block's fields by value: held by reference they were reloaded and
                 // recomputed (the block table's shift) on every lookup
  int b, k_lo, k_hi, warp, lane, my_tiles;
  uint32_t sK, sV;  // shared addresses of stage 0's K and V tiles
  int* sRow;        // [kStages][kTileKeys] physical rows, -1: none
  const KV* kc_col;  // this lane's column of kv head hk's K and V rows (+ row * kv_stride;
                     // head hk + j: + j * D)
  const KV* vc_col;
  int64_t kv_stride;
  int cp_r0;
  uint32_t cp_dst[kLoads];
  int rows_ahead;
  LdsmLane lds_k, lds_v;

  __device__ __forceinline__ CpAsyncTiles(const xla_attn_paged_attention_params& p,
                                          const decode::DecodeBlock& blk, unsigned char* smem,
                                          int warp_, int lane_, int tiles)
      : keys(blk.keys), b(blk.b), k_lo(blk.k_lo), k_hi(blk.k_hi), warp(warp_), lane(lane_),
        my_tiles(tiles > warp_ ? (tiles - warp_ + kWarps - 1) / kWarps : 0),
        lds_k(LdsmLane::b_operand(lane_)), lds_v(LdsmLane::a_operand(lane_)) {
    unsigned char* mine = smem + warp * warp_smem_bytes(D, int(sizeof(KV)), kHeads);
    sK = sm80::smem_addr(mine);
    sV = sK + kStages * kStageBytes;
    sRow = reinterpret_cast<int*>(mine + 2 * kStages * kStageBytes);
    // A lane's chunks: column cp_c of rows cp_r0 + it * kRowStep, at fixed shared
    // offsets (computed once: inside the loop, ptxas recomputed them for every tile).
    const int cp_c = lane % kChunks;
    cp_r0 = lane / kChunks;
#pragma unroll
    for (int it = 0; it < kLoads; ++it) {
      const int head = it * kRowStep / kTileKeys, r = cp_r0 + it * kRowStep % kTileKeys;
      cp_dst[it] = uint32_t(head * kHeadBytes) + 2u * uint32_t(sm80::swz<kTileW>(r, cp_c));
    }
    const int64_t col = int64_t(blk.hk) * D + cp_c * 16 / int(sizeof(KV));
    kc_col = static_cast<const KV*>(p.key_cache) + col;
    vc_col = static_cast<const KV*>(p.value_cache) + col;
    kv_stride = int64_t(p.num_heads_k) * D;
  }

  __device__ __forceinline__ int count() const { return my_tiles; }

  // Physical cache row of this lane's key (lanes 0..15) in tile i, -1 where there is
  // none. A block-table read is a global load: acquire() looks tile i + kStages's rows
  // up while tile i is computed, so the load's latency hides behind a tile instead of
  // stalling the copies that need it (ncu, fp8 d128: 0.71 eligible warps per scheduler
  // with the lookup in front of the copies).
  __device__ __forceinline__ int lookup(int i) const {
    const int key = k_lo + (i * kWarps + warp) * kTileKeys + lane;
    return lane < kTileKeys && i < my_tiles && key < k_hi ? int(keys.row(b, 0, key)) : -1;
  }

  // Tile i into stage i % kStages: lanes 0..15 publish their keys' rows (the softmax
  // reads them back for validity), then every lane copies kLoads 16-byte chunks of K
  // and of V, taking each chunk's row from its lane by a shuffle; absent keys get zeros
  // (a zero-byte cp.async). Read back from shared memory after a __syncwarp, with a
  // branch per chunk for the zeros, the copies took ~25 instructions a chunk pair:
  // a third of the d128 tile loop's ~780, and decode is latency-bound (ncu: 0.38
  // eligible warps a scheduler), so every instruction between two tiles' copies counts.
  __device__ __forceinline__ void issue(int i, int row_of_lane) {
    const int stage = i % kStages;
    if (lane < kTileKeys) sRow[stage * kTileKeys + lane] = row_of_lane;
    const uint32_t tk = sK + uint32_t(stage * kStageBytes);
    const uint32_t tv = sV + uint32_t(stage * kStageBytes);
#pragma unroll
    for (int it = 0; it < kLoads; ++it) {
      const int head = it * kRowStep / kTileKeys;
      const int row = __shfl_sync(0xffffffffu, row_of_lane, cp_r0 + it * kRowStep % kTileKeys);
      const int64_t at = int64_t(max(row, 0)) * kv_stride + head * D;
      sm80::cp_async_16_or_zero(tk + cp_dst[it], kc_col + at, row >= 0);
      sm80::cp_async_16_or_zero(tv + cp_dst[it], vc_col + at, row >= 0);
    }
  }

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < my_tiles) issue(i, lookup(i));
      sm80::cp_async_commit();
    }
    rows_ahead = lookup(kStages - 1);  // tile kStages - 1's rows, in flight
  }

  // Issues tile i + kStages - 1 and waits for tile i; returns its stage.
  __device__ __forceinline__ int acquire(int i) {
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, rows_ahead);
    rows_ahead = lookup(i + kStages);
    sm80::cp_async_commit();         // possibly empty: keeps the wait count uniform
    sm80::cp_async_wait<kStages - 1>();  // this lane's copies of tile i have landed
    __syncwarp();                    // and every lane's
    return i % kStages;
  }

  // Head `head` of the block's kv heads in the stage's K and V tiles.
  __device__ __forceinline__ uint32_t k_tile(int stage, int head = 0) const {
    return sK + uint32_t(stage * kStageBytes + head * kHeadBytes);
  }
  __device__ __forceinline__ uint32_t v_tile(int stage, int head = 0) const {
    return sV + uint32_t(stage * kStageBytes + head * kHeadBytes);
  }
  // ldmatrix lane addresses of k-step kk (16 units) of the K tile, of the V tile.
  __device__ __forceinline__ uint32_t k_addr(uint32_t tk, int kk) const { return lds_k(tk, 0, kk); }
  __device__ __forceinline__ uint32_t v_addr(uint32_t tv, int dd) const { return lds_v(tv, 0, dd); }
  __device__ __forceinline__ bool present(int stage, int jl, int /*key*/) const {
    return sRow[stage * kTileKeys + jl] >= 0;
  }
  // Every lane is done with the stage before it is refilled.
  __device__ __forceinline__ void release() const { __syncwarp(); }
  __device__ __forceinline__ void drain() const { sm80::cp_async_wait<0>(); }
};

}  // namespace decode_sm80

// The decode kernel's body over a tile source (decode_sm80::CpAsyncTiles, or the TMA
// tiles of paged/decode_sm90.cuh): block `blk`, keys in `tiles` 16-key tiles per block.
// A source of Tiles::kHeads > 1 kv heads puts their query rows in the m16 tile (row r:
// head hk + r / total_rows); S is computed against each head's K and each row takes its
// own head's, and P V adds each head's V with the other heads' rows of P zeroed, into
// one accumulator. So a NaN or inf in one head's V at a visible key also reaches the
// other heads' rows of the block (0 x NaN); rows past the keys and absent blocks are
// zeros in the tiles, as for one head.
template <typename T, typename KV, int D, class Tiles>
__device__ __forceinline__ void paged_decode_mma(const decode::Args& a,
                                                 const decode::DecodeBlock& blk, Tiles& tiles,
                                                 unsigned char* smem) {
  using namespace sm80;
  using decode_sm80::kTileKeys;
  using decode_sm80::kWarps;
  using Tc = decode_sm80::Compute<T, KV>;  // mma operand type
  constexpr bool kFp8 = sizeof(KV) == 1;
  constexpr int kHeads = Tiles::kHeads;
  constexpr int kTileW = D * int(sizeof(KV)) / 2;       // tile row width in 16-bit units
  constexpr int kDT = D / 8;                             // n8 tiles of O
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  const xla_attn_paged_attention_params& p = a.p;
  const int split = blk.split, hk = blk.hk, group = blk.group;
  const int total_rows = blk.total_rows, k_lo = blk.k_lo;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const int my_tiles = tiles.count();

  const int64_t q_stride = int64_t(p.num_heads) * D;
  const float ks = decode::cache_scale<KV>(p.k_scale), vs = decode::cache_scale<KV>(p.v_scale);

  // Scores in base 2 (see decode.cuh): x = dot * mul2, or cap2 * tanh(dot * mul).
  const bool capped = p.soft_cap > 0.f;
  const float cap2 = p.soft_cap * kLog2e;
  const float mul = capped ? p.scale * ks / p.soft_cap : p.scale * ks * kLog2e;
  const bool alibi = p.alibi_slopes != nullptr;
  // Lane rows g and g + 8 of the m16 tile: position, ALiBi slope (base 2), and Q's A
  // fragments (rows past total_rows are zeros; their results are never written): cols
  // 16kk + 2t, +1 and 16kk + 8 + 2t, +1; over fp8 caches the permuted head dim's
  // 16kk + 4t, +1 and 16kk + 4t + 2, +3 (the K fragments' order).
  int pos[2], head_of[2];  // head_of: the row's head among the block's kHeads
  float slope2[2];
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf, r_all = min(r, kHeads * total_rows - 1);
    head_of[hf] = r_all / total_rows;
    const int row = r_all % total_rows;  // the row among its head's
    const int h = (hk + head_of[hf]) * group + row % group;
    pos[hf] = row / group + s.offset;
    slope2[hf] = (p.alibi_slopes ? p.alibi_slopes[h] : 0.f) * kLog2e;
    const uint32_t* qrow = reinterpret_cast<const uint32_t*>(
        static_cast<const T*>(p.query) + (s.q_start + row / group) * q_stride + int64_t(h) * D);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int lo = kFp8 ? kk * 8 + 2 * t : kk * 8 + t, hi = kFp8 ? lo + 1 : lo + 4;
      qa[kk][hf] = r < kHeads * total_rows ? decode_sm80::as_operand<Tc, T>(qrow[lo]) : 0u;
      qa[kk][hf + 2] = r < kHeads * total_rows ? decode_sm80::as_operand<Tc, T>(qrow[hi]) : 0u;
    }
  }

  float o[kDT][4] = {};
  float m[2] = {-XLA_ATTN_INF, -XLA_ATTN_INF}, l[2] = {0.f, 0.f};
  tiles.start();
  for (int i = 0; i < my_tiles; ++i) {
    const int stage = tiles.acquire(i), key0 = k_lo + (i * kWarps + warp) * kTileKeys;
    // S = Q K^T for the 16 keys: per k16 step one ldmatrix.x4 of K, two mma (fp8: per
    // two k16 steps, the 4 fp8 of a register converted to the B fragment's 2 f16 pairs).
    // With several heads, each row keeps its own head's scores.
    float sc[2][4];
#pragma unroll
    for (int head = 0; head < kHeads; ++head) {
      const uint32_t tk = tiles.k_tile(stage, head);
      float hs[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kTileW / 16; ++kk) {
        uint32_t bk[4];  // keys 0..7: {bk0, bk1}; keys 8..15: {bk2, bk3}
        ldsm_x4(bk, tiles.k_addr(tk, kk));
        if constexpr (kFp8) {  // bk0 / bk2: dims 32kk .. +15 (step 2kk), bk1 / bk3: the next 16
          uint32_t b[4][2];
#pragma unroll
          for (int j = 0; j < 4; ++j) decode_sm80::fp8x4_to_f16<KV>(bk[j], b[j][0], b[j][1]);
          mma_16816<Tc>(hs[0], qa[2 * kk], b[0][0], b[0][1]);
          mma_16816<Tc>(hs[0], qa[2 * kk + 1], b[1][0], b[1][1]);
          mma_16816<Tc>(hs[1], qa[2 * kk], b[2][0], b[2][1]);
          mma_16816<Tc>(hs[1], qa[2 * kk + 1], b[3][0], b[3][1]);
        } else {
          mma_16816<Tc>(hs[0], qa[kk], bk[0], bk[1]);
          mma_16816<Tc>(hs[1], qa[kk], bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (head == 0 || head_of[(i % 4) / 2] == head) sc[i / 4][i % 4] = hs[i / 4][i % 4];
      }
    }
    // Scores in base 2 (c0, c1: row g, c2, c3: row g + 8; keys 8 nt + 2t + e): softcap
    // and ALiBi each behind one uniform branch (as per-element selects, ptxas put a
    // branch around every element).
    if (capped) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sc[i / 4][i % 4] = cap2 * fast_tanh(sc[i / 4][i % 4] * mul);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) sc[i / 4][i % 4] *= mul;
    }
    if (alibi) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int hf = (i % 4) / 2, key = key0 + (i / 4) * 8 + 2 * t + i % 2;
        sc[i / 4][i % 4] -= slope2[hf] * float(abs(pos[hf] - key));
      }
    }
    // Keys a row cannot see, in a pass behind one uniform branch: none where the
    // warp's 16 keys all exist and the window holds them for every row of the warp
    // (a window is an interval of keys, so its two ends decide), the common tile of a
    // long context. Tested per element, that was 8 shared loads and ~40 instructions.
    const int lane_key = lane & (kTileKeys - 1);
    const bool all_visible = __all_sync(
        0xffffffffu, tiles.present(stage, lane_key, key0 + lane_key) &&
                         win.visible(pos[0], key0) && win.visible(pos[0], key0 + kTileKeys - 1) &&
                         win.visible(pos[1], key0) && win.visible(pos[1], key0 + kTileKeys - 1));
    if (!all_visible) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int jl = nt * 8 + 2 * t + e, key = key0 + jl;
            float& x = sc[nt][2 * hf + e];
            const bool vis = tiles.present(stage, jl, key) && win.visible(pos[hf], key);
            x = vis ? x : -XLA_ATTN_INF;
          }
        }
      }
    }
    // Online softmax of rows g and g + 8.
    float corr[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -XLA_ATTN_INF;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) mx = fmaxf(mx, sc[nt][2 * hf + e]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hf], mx);
      const float m_use = m_new == -XLA_ATTN_INF ? 0.f : m_new;  // no key yet: terms are 0
      corr[hf] = fast_exp2(m[hf] - m_use);
      m[hf] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[nt][2 * hf + e];
          x = fast_exp2(x - m_use);
          sum += x;
        }
      }
      l[hf] = l[hf] * corr[hf] + sum;  // this lane's partial row sum (quad-reduced at the end)
    }
    // Rescale O only when a row's max moved somewhere in the warp: past the first tiles
    // of a long context it rarely does, and the rescale is 64 FMUL a tile at d128 (a
    // sixth of the tile's instructions). ex2.approx(0) is exactly 1.
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[dt][i] *= corr[i / 2];
      }
    }
    // O += P V: the S fragments of keys 0..7 and 8..15, rounded to T, are P's A fragment
    // (a lane's registers 0, 2 hold row g, 1, 3 row g + 8); with several heads, one P V
    // per head, the other heads' rows zeroed.
    const uint32_t p_all[4] = {pack2<Tc>(sc[0][0], sc[0][1]), pack2<Tc>(sc[0][2], sc[0][3]),
                               pack2<Tc>(sc[1][0], sc[1][1]), pack2<Tc>(sc[1][2], sc[1][3])};
#pragma unroll
    for (int head = 0; head < kHeads; ++head) {
      const uint32_t tv = tiles.v_tile(stage, head);
      uint32_t pa[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pa[j] = kHeads == 1 || head_of[j % 2] == head ? p_all[j] : 0u;
      }
#pragma unroll
      for (int dd = 0; dd < kTileW / 16; ++dd) {
        uint32_t bv[4];  // units 16dd + 0..7: {bv0, bv1}; 16dd + 8..15: {bv2, bv3}
        ldsm_x4_trans(bv, tiles.v_addr(tv, dd));
        if constexpr (kFp8) {  // a unit is a dim pair: even and odd dims are n8 tiles of their own
          uint32_t even[4], odd[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) decode_sm80::fp8_pairs_to_f16<KV>(bv[j], even[j], odd[j]);
          mma_16816<Tc>(o[4 * dd], pa, even[0], even[1]);
          mma_16816<Tc>(o[4 * dd + 1], pa, odd[0], odd[1]);
          mma_16816<Tc>(o[4 * dd + 2], pa, even[2], even[3]);
          mma_16816<Tc>(o[4 * dd + 3], pa, odd[2], odd[3]);
        } else {
          mma_16816<Tc>(o[2 * dd], pa, bv[0], bv[1]);
          mma_16816<Tc>(o[2 * dd + 1], pa, bv[2], bv[3]);
        }
      }
    }
    tiles.release();
  }
  tiles.drain();
  __syncthreads();  // the merge below reuses the tiles

  // Merge the warps: each writes its rows' max, sum and unnormalised O to shared memory.
  float* s_o = reinterpret_cast<float*>(smem);                // [kWarps][16][D]
  float* s_m = s_o + kWarps * decode_sm80::kRows * D;          // [kWarps][16]
  float* s_l = s_m + kWarps * decode_sm80::kRows;              // [kWarps][16]
  static_assert(decode_sm80::kRows * (D + 2) * kWarps * 4 <=
                    decode_sm80::smem_bytes(D, int(sizeof(KV))),
                "the warp merge must fit in the tiles' shared memory");
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf;
    float sum = l[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (t == 0) {
      s_m[warp * decode_sm80::kRows + r] = m[hf];
      s_l[warp * decode_sm80::kRows + r] = sum;
    }
    float* dst = s_o + (warp * decode_sm80::kRows + r) * D;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      dst[decode_sm80::o_col<kFp8>(dt, t, 0)] = o[dt][2 * hf];
      dst[decode_sm80::o_col<kFp8>(dt, t, 1)] = o[dt][2 * hf + 1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kHeads * total_rows * D; idx += blockDim.x) {
    const int r = idx / D;  // row r of the tile: row r % total_rows of head hk + r / total_rows
    decode::write_merged<T, D, kWarps>(a, s, hk + r / total_rows, split, decode_sm80::kRows, r,
                                       r % total_rows, idx % D, s_m, s_l, s_o, vs);
  }
}

template <typename T, typename KV, int D, int kHeads = 1>
__device__ void paged_decode_sm80(const decode::Args& a) {
  using decode_sm80::kTileKeys;
  extern __shared__ __align__(128) unsigned char smem[];
  decode::DecodeBlock blk;
  if (!blk.locate<T>(a, kTileKeys, 1, kHeads)) return;  // the split's share in whole tiles
  const int tiles = (blk.k_hi - blk.k_lo + kTileKeys - 1) / kTileKeys;
  decode_sm80::CpAsyncTiles<KV, D, kHeads> source(a.p, blk, smem, threadIdx.x / 32,
                                                  threadIdx.x % 32, tiles);
  paged_decode_mma<T, KV, D>(a, blk, source, smem);
}

}  // namespace xla_attn
