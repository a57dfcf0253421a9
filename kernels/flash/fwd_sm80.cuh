// Flash attention forward, sm80 family (sm_80 .. sm_90; f16 and bf16): FlashAttention-2's
// algorithm on tensor cores (mma.sync m16n8k16, f32 accumulators).
//
// One block = 4 warps = block_m query rows (64 or 128: one or two m16 tiles per warp)
// of one head of one sequence. Q sits in shared memory for the whole block; K/V tiles
// of block_n keys stream through two shared-memory stages with cp.async, tile j + 1
// in flight while tile j is computed. Per tile each warp computes S = Q K^T for its
// rows (ldmatrix + mma), applies softcap / ALiBi / the mask, updates the online
// softmax in registers (base 2, the scale folded into log2 e), rounds P to 16 bits in
// registers and feeds it straight back as the A operand of O += P V (the C fragment of
// one mma is the A fragment of the next; see common/mma_sm80.cuh). O is normalised,
// staged through Q's shared memory and written with 16-byte stores.
//
// The contract is the portable kernel's (fwd_portable.cuh): varlen, seqused_k, paged
// K/V through an untrusted block table, GQA, causal / sliding window (bottom-right),
// softcap, ALiBi, batch_used, decode_max_q, lse (+inf for rows that see no key), and
// split-KV partials in the portable workspace layout, merged by flash_combine_portable.
#pragma once
#include "common/mma_sm80.cuh"
#include "flash/fwd_portable.cuh"
#include "flash/sm80_tiles.h"

namespace xla_attn {
namespace sm80 {


// Element offset of 16-byte chunk c of row r in a row-major tile of D 16-bit elements,
// with the chunks of each row permuted (swizzled) so that ldmatrix, which reads the
// same logical chunk of 8 consecutive rows in one phase, hits 8 distinct 16-byte bank
// groups instead of one (an 8-way conflict at D = 64, 128, 256):
// - D / 8 a multiple of 8 (D = 64, 128, 256): rows are a multiple of 128 bytes apart,
//   so chunk c of row r goes to c ^ (r % 8).
// - D / 8 = 4 or 12 (D = 32, 96): rows are 64 (mod 128) bytes apart, so odd and even
//   rows already sit in opposite halves of the 128-byte bank window; chunk c goes to
//   c ^ ((r / 2) % 4), spreading the 4 rows of each parity over the 4 groups of their
//   half. Only the low 2 bits change, so the chunk stays inside the row (c < 12).
// cp.async writes and the epilogue reads go through the same map.
template <int D>
__device__ __forceinline__ int swz_term(int r) {
  static_assert((D / 8) % 8 == 0 || (D / 8) % 8 == 4, "head-dim bucket without a swizzle");
  return (D / 8) % 8 == 0 ? (r & 7) : ((r >> 1) & 3);
}
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  return r * D + 8 * (c ^ swz_term<D>(r));
}

// ldmatrix addressing (common/mma_sm80.cuh). Lane l reads row r(l) of a 16-row block
// and column block cb(l) (0 or 1) of its k-step, in a swizzled tile:
// - A operands and transposed B operands (Q; V in P V): r = l & 15, cb = l >> 4;
// - B operands read as stored (K in Q K^T): r = (l & 7) + 8 (l >> 4), cb = (l >> 3) & 1,
//   so that registers {r0, r1} are the B fragment of rows 0-7 and {r2, r3} that of rows
//   8-15. mma.sync takes a B fragment as a register pair; with the A order ({r0, r2},
//   {r1, r3}) ptxas copied two registers per mma (ncu, d128: 1.6 IMAD.MOV per HMMA).
// Block rows are multiples of 16, so the swizzle term is swz_term(r(l)); and since bit
// 0 of 2 kk is clear, (2 kk + cb) ^ x = 2 kk ^ (cb ^ x): the lane's part is computed
// once, a k-step XORs a constant.
template <int D>
struct LdsmLane {
  uint32_t row, chunk;  // byte offsets of the lane's row and (k-step 0) chunk
  __device__ __forceinline__ LdsmLane(int r, int cb)
      : row(uint32_t(r) * 2 * D), chunk(16u * uint32_t(cb ^ swz_term<D>(r))) {}
  static __device__ __forceinline__ LdsmLane a_operand(int lane) {
    return LdsmLane(lane & 15, lane >> 4);
  }
  static __device__ __forceinline__ LdsmLane b_operand(int lane) {
    return LdsmLane((lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1);
  }
  // Shared-window address in the tile at `base` (bytes), block row r0, k-step kk.
  // chunk < 128 (3 bits of chunk index), so XOR-ing 32 kk = 128 (kk / 4) + 32 (kk % 4)
  // only mixes in the low part: (chunk ^ 32 (kk % 4)) + 128 (kk / 4). Grouped so, the
  // lane needs four sums base + row + (chunk ^ 32 j) per tile and every ldmatrix takes
  // the rest as an immediate; with the XOR per k-step ptxas spent an XOR and an add on
  // each ldmatrix (ncu, d256 forward: 88 integer instructions for the 48 ldmatrix of
  // a Q K^T tile).
  __device__ __forceinline__ uint32_t operator()(uint32_t base, int r0, int kk) const {
    const uint32_t lane_part = base + row + (chunk ^ (32u * uint32_t(kk & 3)));
    return lane_part + uint32_t(r0 * 2 * D + 128 * (kk >> 2));
  }
};

// One 16-byte chunk (elements d0 .. d0 + 7 of a row) by element loads, zeros past hd.
__device__ __forceinline__ uint4 load_chunk_scalar(const void* row, int d0, int hd) {
  const unsigned short* src = static_cast<const unsigned short*>(row);
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (d0 + e < hd) w[e / 2] |= uint32_t(src[d0 + e]) << (16 * (e & 1));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Its counterpart: one 16-byte chunk x to elements d0 .. d0 + 7 of a row, as one
// 16-byte store (vec: hd % 8 == 0 and the tensor 16-byte aligned) or element stores
// short of hd.
__device__ __forceinline__ void store_chunk(void* row, uint4 x, int d0, int hd, bool vec) {
  if (vec) {
    *reinterpret_cast<uint4*>(static_cast<unsigned short*>(row) + d0) = x;
    return;
  }
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  unsigned short* dst = static_cast<unsigned short*>(row);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (d0 + e < hd) dst[d0 + e] = (unsigned short)(w[e / 2] >> (16 * (e & 1)));
  }
}

// Fills a swizzled kRows x D tile: row r from src(it, r) (null: a row of zeros), where
// `it` numbers this thread's chunks, columns >= hd zero. Consecutive threads take
// consecutive chunks of a row, so each warp-wide copy reads whole rows. kVec: 16-byte
// cp.async (hd % 8 == 0 and 16-byte aligned tensors); otherwise element loads (head
// dims that are not a multiple of 8, unaligned tensors) in a rolled loop, so src must
// not need a constant `it` there: unrolled, that rare path added 40% to the code.
template <int D, int kRows, bool kVec, typename T, typename Src>
__device__ __forceinline__ void load_tile(T* tile, const Src& src, int hd) {
  constexpr int kChunks = D / 8, kIters = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "tile chunks must spread evenly over the block");
#pragma unroll(kVec ? kIters : 1)
  for (int it = 0; it < kIters; ++it) {
    const int idx = threadIdx.x + it * kThreads, r = idx / kChunks, c = idx % kChunks;
    const T* row = src(it, r);
    T* dst = tile + swz<D>(r, c);
    if (kVec && row && c * 8 < hd) {
      cp_async_16(dst, row + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = row && c * 8 < hd ? load_chunk_scalar(row, c * 8, hd)
                                                          : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Copies kRows consecutive K/V rows (`stride` elements apart; not paged, 16-byte
// aligned) into a swizzled kRows x D tile with 16-byte cp.async, zeros in rows >=
// rows_valid and columns >= hd. Built once per block: a thread's chunks sit a fixed
// number of rows apart in both memories, so a tile costs per chunk one 64-bit pointer
// add and a cp.async at a constant shared offset. load_tile's per-key lookup (the
// paged path) cost ~25 instructions a chunk, 37% of the d128 loop's issued
// instructions in ncu on an H100.
template <int D, int kRows>
struct RowCopier {
  static constexpr int kChunks = D / 8, kIters = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "tile chunks must spread evenly over the block");
  // Rows between a thread's chunks. D = 96 (12 chunks a row) gives a thread chunks of
  // different columns; its offsets are computed per chunk instead.
  static constexpr int kRowStep = kThreads % kChunks == 0 ? kThreads / kChunks : 0;
  int r0, c0;
  int64_t src0;             // element offset of the thread's first chunk from the tile's row 0
  uint32_t dst_even, dst_odd;  // byte offsets of chunk 0 / 1 minus kRowStep rows

  __device__ __forceinline__ RowCopier(int64_t stride)
      : r0(threadIdx.x / kChunks), c0(threadIdx.x % kChunks), src0(r0 * stride + c0 * 8) {
    // swz's term repeats every 8 rows (D / 8 a multiple of 8) or depends on bits 1-2
    // of the row (D = 32): with kRowStep a multiple of 4 it alternates with the
    // chunk's parity at most.
    dst_even = 2u * uint32_t(swz<D>(r0, c0));
    dst_odd = 2u * uint32_t(swz<D>(r0 + kRowStep, c0) - kRowStep * D);
  }

  template <typename T>
  __device__ __forceinline__ void copy(uint32_t tile, const T* src, int64_t stride, int rows_valid,
                                       int hd) const {
    const T* from = src + src0;
    const bool col_ok = c0 * 8 < hd;
    if constexpr (kRowStep > 0) {
      static_assert(kRowStep % 4 == 0, "the swizzle must repeat with the chunk parity");
      // A whole tile (every tile but a sequence's last) copies without a test: the
      // per-chunk row test and pointer select took ~7 instructions a chunk, 13 % of the
      // d128 backward's dk/dv loop (ncu).
      if (rows_valid >= kRows && col_ok) {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
          cp_async_16(tile + (it % 2 ? dst_odd : dst_even) + 2u * it * kRowStep * D, from);
          from += kRowStep * stride;
        }
        return;
      }
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if constexpr (kRowStep > 0) {
        const uint32_t dst = tile + (it % 2 ? dst_odd : dst_even) + 2u * it * kRowStep * D;
        const bool ok = col_ok && r0 + it * kRowStep < rows_valid;
        cp_async_16_or_zero(dst, ok ? from : src, ok);
        from += kRowStep * stride;
      } else {
        const int idx = threadIdx.x + it * kThreads, r = idx / kChunks, c = idx % kChunks;
        const bool ok = c * 8 < hd && r < rows_valid;
        cp_async_16_or_zero(tile + 2u * uint32_t(swz<D>(r, c)), ok ? src + r * stride + c * 8 : src,
                            ok);
      }
    }
  }
};

// vec_src(it, r) may index per-thread arrays by `it`; scalar_src(it, r) must use r only.
template <int D, int kRows, typename T, typename VecSrc, typename ScalarSrc>
__device__ __forceinline__ void load_tile(T* tile, const VecSrc& vec_src,
                                          const ScalarSrc& scalar_src, int hd, bool vec) {
  if (vec) {
    load_tile<D, kRows, true>(tile, vec_src, hd);
  } else {
    load_tile<D, kRows, false>(tile, scalar_src, hd);
  }
}

// One tile's online-softmax update, for the rows of this lane. Lane (g, t) holds, per
// m-tile and half hf, row g + 8 hf at keys nt * 8 + 2t + {0, 1}; the 4 lanes of a quad
// share a row (shuffles over t). Masking and softcap are compile-time flags (four
// copies of the body; the sm90 family applies softcap first itself, transform_scores,
// and inlines two), so the common tile (unmasked, no softcap) carries no per-element
// compare or tanh: as run-time branches the d128 loop issued ~16 instructions per mma.
//
// Scores stay in the units of the dot product as long as possible: with a positive
// score factor, max and scale commute, so the factor is applied inside the exponent
// (one FFMA per element, exp2(x * exp_mul - m), instead of an FMUL and an FADD:
// 64 instructions a tile and lane at d128). Softcap, or a factor <= 0, transforms the
// scores first (prescale) and exp_mul is 1. ALiBi is subtracted in the same units.
// The running max moves only past kMaxSlack (base 2; TileSoftmax::run_with).
constexpr float kMaxSlack = 8.f;
constexpr float kMaxSlackExp = float(1 << int(kMaxSlack));

struct TileSoftmax {
  int64_t pos0;        // key position of the lane's first row (m-tile 0, hf 0)
  int n0, n_hi, t;     // tile's first key; end of the block's key range; lane % 4
  Window win;
  float mul, cap;      // base-2 score transform (see flash_fwd_sm80)
  float exp_mul;       // base-2 score = (transformed) x * exp_mul
  float slope;         // ALiBi slope in the units of x: slope * log2 e / exp_mul
  bool prescale;       // no softcap, but a factor <= 0: x *= mul first
  bool transform;      // prescale || slope != 0: one flag, so that the common tile takes
                       // one branch (tested as two in run(), ptxas kept two)
  bool tile_absent;    // some key of the tile has no page: check valid[]
  const uint8_t* valid;  // [block_n] 1 where the key has a K/V row

  // Row (mt, hf)'s visible keys in the tile: [lo, hi) relative to n0 + 2t (below).
  template <int kBlockN>
  __device__ __forceinline__ void visible(int mt, int hf, int* lo, int* hi) const {
    const int64_t pos = pos0 + mt * kWarps * 16 + 8 * hf;
    *hi = visible_end<kBlockN>(pos);
    *lo = win.left >= 0 ? int(clamp64(pos - win.left - n0, 0, kBlockN)) : 0;
    *lo -= 2 * t;
    *hi -= 2 * t;
  }

  // The end of row pos's visible keys in the tile, relative to n0 (0 .. kBlockN): the
  // key range's end, or the window's right edge before it.
  template <int kBlockN>
  __device__ __forceinline__ int visible_end(int64_t pos) const {
    const int hi = min(n_hi - n0, kBlockN);
    return win.right >= 0 ? int(clamp64(pos + win.right + 1 - n0, 0, hi)) : hi;
  }

  // Whether no row of this lane's warp sees a key in the tile's second half (the warp's
  // last row's visible_end, the same in every lane), so that a masked tile's
  // exponentials skip that half behind one branch the warp takes as one: on a causal
  // block's diagonal tile (128 rows over 128 keys) the first warpgroup's four warps.
  template <int kMT, int kBlockN>
  __device__ __forceinline__ bool warp_sees_first_half() const {
    const int64_t last = pos0 - ((threadIdx.x & 31) >> 2) + (kMT - 1) * kWarps * 16 + 15;
    return visible_end<kBlockN>(last) <= kBlockN / 2;
  }

  // Row (mt, hf)'s exponentials exp2(x exp_mul - m) in place, and their sum; kMask: keys
  // outside [lo, hi) (visible) are 0. kKeep > 0: only the first kKeep n8 tiles' (the rest
  // 0 and left out of the sum, which otherwise adds the same terms in the same order).
  // !kLeft: no left window, so lo <= 0 and only hi is tested (a compare an element less;
  // the two compares were 4.3 % of the d64 causal S = 512 walk's executed instructions,
  // ncu, H100, docs/benchmarks.md 2026-11-28 (38)). H100, kernel time at the base clock,
  // one round against both compares: bf16 d64 causal S = 512 / 1024 / 2048 -4.2 / -3.3 /
  // -2.5 %, d128 causal 512 -1.5 %, varlen -1.2 %, fp8 d64 causal 512 -2.8 %, full rows
  // within 0.3 % (docs/benchmarks.md 2026-11-28 (39)). The max pass's test (run_with)
  // keeps both: a third copy of its body there grew the d64 walk by 1,350 instructions and
  // the three-warpgroup walk's spills from 120 to 176 bytes.
  template <bool kMask, int kKeep = 0, bool kLeft = true, int kMT, int kNT>
  __device__ __forceinline__ float row_exps(float (&sc)[kMT][kNT][4], int mt, int hf, float m,
                                            int lo = 0, int hi = 0) const {
    constexpr int kTiles = kKeep > 0 ? kKeep : kNT;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = sc[mt][nt][2 * hf + e];
        if (nt >= kTiles) {
          x = 0.f;
          continue;
        }
        x = fast_exp2(fmaf(x, exp_mul, -m));
        if constexpr (kMask) {
          if ((kLeft && nt * 8 + e < lo) || nt * 8 + e >= hi) x = 0.f;
        }
        sum += x;
      }
    }
    return sum;
  }

  // The exponentials against the running max m as it stands, without a max pass: where
  // every exponent stays within 2^kMaxSlack the tile would have kept m anyway (run_with),
  // and the result is the same bit for bit. Returns false where a lane's row sum exceeds
  // 2^kMaxSlack (then some exponent may, and sc no longer holds the scores: the caller
  // computes S again and runs run_with); else the lane's row sums in sum (l not yet
  // updated). Only for rows that have a max (m > -inf) and without softcap, ALiBi, a
  // score factor <= 0 or absent pages (the caller's test). A masked tile without a left
  // window (causal) tests only the right edge (row_exps, kLeft).
  template <bool kMask, bool kSkip = false, int kMT, int kNT>
  __device__ __forceinline__ bool exps_at_max(float (&sc)[kMT][kNT][4], const float (&m)[kMT][2],
                                              float (&sum)[kMT][2]) const {
    if constexpr (kMask) {
      return win.left < 0 ? masked_exps<kSkip, false>(sc, m, sum)
                          : masked_exps<kSkip, true>(sc, m, sum);
    }
    return exps_in_rows<false, 0, true>(sc, m, sum);
  }

  // exps_at_max of a masked tile, kLeft as row_exps takes it; kSkip: the warp skips the
  // tile's second half where none of its rows sees a key there.
  template <bool kSkip, bool kLeft, int kMT, int kNT>
  __device__ __forceinline__ bool masked_exps(float (&sc)[kMT][kNT][4], const float (&m)[kMT][2],
                                              float (&sum)[kMT][2]) const {
    if constexpr (kSkip) {
      if (warp_sees_first_half<kMT, kNT * 8>()) {
        return exps_in_rows<true, kNT / 2, kLeft>(sc, m, sum);
      }
    }
    return exps_in_rows<true, 0, kLeft>(sc, m, sum);
  }

  // exps_at_max's rows: each row's exponentials (row_exps, its first kKeep n8 tiles, 0:
  // all) and sum; false where a sum passes 2^kMaxSlack.
  template <bool kMask, int kKeep, bool kLeft, int kMT, int kNT>
  __device__ __forceinline__ bool exps_in_rows(float (&sc)[kMT][kNT][4], const float (&m)[kMT][2],
                                               float (&sum)[kMT][2]) const {
    constexpr int kBlockN = kNT * 8;
    bool ok = true;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        int lo = 0, hi = kBlockN;
        if constexpr (kMask) visible<kBlockN>(mt, hf, &lo, &hi);
        sum[mt][hf] = row_exps<kMask, kKeep, kLeft>(sc, mt, hf, m[mt][hf], lo, hi);
        ok &= sum[mt][hf] <= kMaxSlackExp;
      }
    }
    return ok;
  }

  // The scores in base 2 where they need a pass before the max: softcap (kCap), x = cap
  // tanh(x mul), else a score factor <= 0 (prescale), x = x mul. The sm90 family calls
  // it itself ahead of run_with<kMask, false> (its flash_fwd_sm90 softmax), so that each
  // call site inlines two forms of run_with instead of four.
  template <bool kCap, int kMT, int kNT>
  __device__ __forceinline__ void transform_scores(float (&sc)[kMT][kNT][4]) const {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float& x = sc[mt][nt][i];
          x = kCap ? cap * fast_tanh(x * mul) : x * mul;
        }
      }
    }
  }

  // In phases over all the lane's rows (2 kMT of them), not row by row: a row's quad
  // max needs two dependent shuffles, and with the rows in turn (and the ALiBi branch
  // inside the row loop, a basic block per row) their latency was exposed per row; ncu
  // on an H100 (d64) put 20 K short-scoreboard stall samples on the FMNMX after them,
  // against FA2's 0.3 K.
  template <bool kMask, bool kCap, int kMT, int kNT, int kDT>
  __device__ __forceinline__ void run(float (&sc)[kMT][kNT][4], float (&m)[kMT][2],
                                      float (&l)[kMT][2], float (&o)[kMT][kDT][4]) const {
    run_with<kMask, kCap>(sc, m, l, [&](const float (&corr)[kMT][2]) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) o[mt][dt][i] *= corr[mt][i / 2];
        }
      }
    });
  }

  // The same with O's rescale handed to rescale_o(corr) (corr: each row's factor),
  // called where some row of the warp moved its max: the sm90 family defers it until
  // the asynchronous P V product that is writing O has completed.
  // kSkip (the sm90 family): a masked tile's exponentials skip the half no row of the
  // warp sees (warp_sees_first_half, row_exps).
  template <bool kMask, bool kCap, bool kSkip = false, int kMT, int kNT, typename RescaleO>
  __device__ __forceinline__ void run_with(float (&sc)[kMT][kNT][4], float (&m)[kMT][2],
                                           float (&l)[kMT][2], RescaleO&& rescale_o) const {
    constexpr int kBlockN = kNT * 8;
    // The rare transforms behind one uniform branch (a branch each cost ~0.5 % of the
    // d64 S=512 stall samples).
    if (kCap || transform) {
      if (kCap || prescale) transform_scores<kCap>(sc);
      // ALiBi in a pass of its own behind one uniform branch: tested per element, the
      // branch cost ~4 instructions an element (BSSY/BRA/BSYNC around the FFMA).
      if (slope != 0.f) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int64_t pos = pos0 + mt * kWarps * 16 + 8 * hf;
            const float rel = float(pos - n0 - 2 * t);  // pos - key at nt = e = 0
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                sc[mt][nt][2 * hf + e] -= slope * fabsf(rel - float(nt * 8 + e));
            }
          }
        }
      }
    }
    // Absent pages (paged K/V only) in a pass of their own behind one uniform branch:
    // tested with the range, the branch around the valid[] load cost a BSSY/BRA per
    // element (ncu, d64 S=512 causal: 11 % of the stall samples on branches).
    if (kMask && tile_absent) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!valid[nt * 8 + 2 * t + e]) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) sc[mt][nt][e] = sc[mt][nt][2 + e] = -XLA_ATTN_INF;
          }
        }
      }
    }
    // Masking and the lane's row maxima, then the quad reductions of all rows together.
    float mx[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        // Visible keys of this row in the tile: [lo, hi) relative to n0 + 2t (the lane's
        // key at nt = e = 0), so that key nt * 8 + e is tested against constants: a
        // compare pair and a select an element. With this ptxas (sm_90) spilled 244
        // bytes at d128 (20 with the old per-element test), and the kernel was still
        // faster on every H100 row measured (docs/benchmarks.md, 2026-11-23 (5)); since
        // the O rescale went behind a vote (below), 8 bytes.
        int lo = 0, hi = kBlockN;
        if constexpr (kMask) visible<kBlockN>(mt, hf, &lo, &hi);
        mx[mt][hf] = -XLA_ATTN_INF;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[mt][nt][2 * hf + e];
            if constexpr (kMask) {
              if (nt * 8 + e < lo || nt * 8 + e >= hi) x = -XLA_ATTN_INF;
            }
            mx[mt][hf] = fmaxf(mx[mt][hf], x);
          }
        }
      }
    }
#pragma unroll
    for (int lane_bit = 1; lane_bit <= 2; lane_bit *= 2) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          mx[mt][hf] = fmaxf(mx[mt][hf], __shfl_xor_sync(0xffffffffu, mx[mt][hf], lane_bit));
      }
    }
    // The running max moves only when a row's tile max exceeds it by more than
    // kMaxSlack (base 2). Below that the stale max stays: every exponent is then
    // <= 2^kMaxSlack = 256, which f32 sums and the 16-bit P (same relative precision at
    // 256 as at 1) hold exactly as well, and l and O keep using the same max, so the
    // result and lse are those of the exact max. With random scores a row's max settles
    // within the slack after its first tile, so O is rescaled (kMT * D / 2 FMUL a lane,
    // d256: 128 against the tile's 128 mma) almost only there; and the rescale, a
    // branch on the warp's vote, comes before the exponentials so that those still share
    // a basic block with the P V mma (see the barrier in flash_fwd_sm80).
    float corr[kMT][2], m_use[kMT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float m_tile = mx[mt][hf] * exp_mul;  // exp_mul > 0: -inf stays
        const bool up = m_tile > m[mt][hf] + kMaxSlack;  // m = -inf: any visible key
        moved |= up;
        const float m_new = up ? m_tile : m[mt][hf];
        // A row with no visible key so far keeps m = -inf; exponents then use 0 so
        // that every term is exp2(-inf) = 0 instead of NaN.
        m_use[mt][hf] = m_new == -XLA_ATTN_INF ? 0.f : m_new;
        corr[mt][hf] = fast_exp2(m[mt][hf] - m_use[mt][hf]);
        m[mt][hf] = m_new;
      }
    }
    if (__any_sync(0xffffffffu, moved)) {
      rescale_o(corr);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) l[mt][hf] *= corr[mt][hf];
      }
    }
    if constexpr (kMask && kSkip) {
      if (warp_sees_first_half<kMT, kBlockN>()) return add_exps<kNT / 2>(sc, m_use, l);
    }
    add_exps<0>(sc, m_use, l);
  }

  // run_with's exponentials against m_use (row_exps, the first kKeep n8 tiles, 0: all),
  // their sums added to l
  template <int kKeep, int kMT, int kNT>
  __device__ __forceinline__ void add_exps(float (&sc)[kMT][kNT][4], const float (&m_use)[kMT][2],
                                           float (&l)[kMT][2]) const {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) l[mt][hf] += row_exps<false, kKeep>(sc, mt, hf, m_use[mt][hf]);
    }
  }
};


// The score transform of sequence b, head h, in base 2 (TileSoftmax's fields): x = dot *
// scale * log2 e, or with softcap x = softcap * log2 e * tanh(dot * scale / softcap);
// ALiBi subtracts slope * log2 e * |pos - j|. The exponent's factor exp_mul is the score
// factor itself where it is positive and there is no softcap, else 1 after a first pass
// (prescale) applies them.
struct ScoreTransform {
  bool softcap, prescale;
  float mul, cap, slope, exp_mul;
  // qk_descale: the fp8 kernels' q_descale * k_descale, a factor of every raw score.
  static __device__ __forceinline__ ScoreTransform of(const xla_attn_flash_fwd_params& p, int b,
                                                      int h, float qk_descale = 1.f) {
    ScoreTransform x;
    x.softcap = p.softcap > 0.f;
    x.mul = (x.softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e) * qk_descale;
    x.cap = p.softcap * kLog2e;
    x.slope =
        (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f) * kLog2e;
    x.prescale = !x.softcap && !(x.mul > 0.f);
    x.exp_mul = x.softcap || x.prescale ? 1.f : x.mul;
    return x;
  }
};

}  // namespace sm80

// fp8 (T = __nv_fp8_e4m3; sm_89+): q, k, v e4m3 with q/k/v_descale, bf16 out. Rows of D
// bytes move as D / 2 16-bit units (E; sm80_tiles.h, row_units) through the same
// copies, swizzle and ldmatrix; S = Q K^T is m16n8k32, P is rounded to e4m3 in
// registers, and P V reads V's fragments with ldmatrix.trans plus two byte permutes
// (pv below), which permute O's columns; the epilogue undoes that as it stores.
template <typename T, int D>
__device__ void flash_fwd_sm80(const xla_attn_flash_fwd_params& p) {
  using namespace sm80;
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr int kEB = int(sizeof(T));
  using E = Select<kFp8, unsigned short, T>;  // the tiles' 16-bit unit
  using Out = Select<kFp8, __nv_bfloat16, T>;
  constexpr int kU = row_units(D, kEB);    // units per row
  constexpr int kMT = m_tiles(D);          // m16 tiles per warp
  constexpr int kBlockM = block_m(D);
  constexpr int kBlockN = block_n(D);
  constexpr int kNT = kBlockN / 8;         // n8 tiles of S per m-tile
  constexpr int kDT = D / 8;               // n8 tiles of O per m-tile
  constexpr int kChunks = kU / 8;          // 16-byte chunks per row
  constexpr int kKSteps = kU / 16;         // k-steps of S = Q K^T (32 bytes each)
  constexpr int kWarpRows = kWarps * 16;   // rows between a warp's m-tiles
  constexpr bool kQInRegs = q_in_regs(D, kEB);
  constexpr int kQRegSteps = kQInRegs ? kKSteps : 1;
  constexpr int kQElems = smem_q_elems(D, kEB), kKVElems = smem_kv_elems(D, kEB);
  static_assert(!kFp8 || kBlockN % 32 == 0, "fp8 P V takes keys in steps of 32");
  extern __shared__ __align__(128) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);                   // [kBlockM x kU], swizzled
  E* sK = sQ + kQElems;                                 // [kStages][kBlockN x kU]
  E* sV = sK + kStages * kKVElems;                      // [kStages][kBlockN x kU]
  // [kStages][kBlockN]: 1 where the key has a K/V row
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sV + kStages * kKVElems);

  FwdBlock blk;
  if (!blk.locate<Out>(p, kBlockM, kBlockN)) return;
  const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd, hk = blk.hk;
  const int n_lo = blk.n_lo, n_hi = blk.n_hi, splits = blk.splits, split = blk.split;
  const bool paged = blk.paged;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const int m_last = min(m0 + kBlockM, s.num_q) - 1;
  const int tiles = (n_hi - n_lo + kBlockN - 1) / kBlockN;
  // Keys [full_lo, full_hi) are visible to every row of the block and inside its range:
  // a tile inside them needs no element-wise mask. Two compares a tile; the same test
  // written per tile from the window compiled to a chain of four branches (ncu, d64
  // S=512: 2 % of the stall samples).
  int full_lo, full_hi;
  win.keys_seen_by_all(m0, m_last, s.offset, s.num_k, &full_lo, &full_hi);
  full_hi = min(full_hi, n_hi);
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  // In units (fp8: the launcher sends head dims that are a multiple of 16 only).
  const int hu = hd * kEB / 2;
  const int64_t q_stride = int64_t(p.num_heads) * hu, kv_stride = int64_t(p.num_heads_k) * hu;
  const E* q = static_cast<const E*>(p.q) + int64_t(h) * hu;    // + row * q_stride
  const E* k = static_cast<const E*>(p.k) + int64_t(hk) * hu;   // + row * kv_stride
  const E* v = static_cast<const E*>(p.v) + int64_t(hk) * hu;
  const bool vec = hu % 8 == 0 && aligned_to<E>(p.q, 16) && aligned_to<E>(p.k, 16) &&
                   aligned_to<E>(p.v, 16);
  const ScoreTransform sx =
      ScoreTransform::of(p, b, h, descale<T>(p.q_descale) * descale<T>(p.k_descale));
  const bool softcap = sx.softcap, prescale = sx.prescale;
  const float mul = sx.mul, cap = sx.cap, slope = sx.slope, exp_mul = sx.exp_mul;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const LdsmLane<kU> lds = LdsmLane<kU>::a_operand(lane);  // Q, V
  const LdsmLane<kU> lds_k = LdsmLane<kU>::b_operand(lane);
  const uint32_t sQ_addr = smem_addr(sQ), sK_addr = smem_addr(sK), sV_addr = smem_addr(sV);
  float o[kMT][kDT][4] = {};  // O rows g (elements 0, 1) and g + 8 (2, 3) of each m-tile
  float m[kMT][2], l[kMT][2];  // running max (base 2) and this lane's partial row sum
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    m[mt][0] = m[mt][1] = -XLA_ATTN_INF;
    l[mt][0] = l[mt][1] = 0.f;
  }

  // Issues tile j's K and V copies into `stage` (one cp.async group each; the loop
  // waits for both, a tile later) and records which keys exist. Returns whether a key
  // inside [n_lo, n_hi) has no page (the tile then takes the masked path).
  const RowCopier<kU, kBlockN> kv_copier(kv_stride);
  auto issue_kv = [&](int j, int stage) {
    constexpr int kIters = kBlockN * kChunks / kThreads;
    const int n0 = n_lo + j * kBlockN;
    if (!paged && vec) {  // contiguous rows: every key exists
      const int64_t first = (s.k_start + n0) * kv_stride;
      const uint32_t at = 2u * uint32_t(stage * kKVElems);
      kv_copier.copy(sK_addr + at, k + first, kv_stride, n_hi - n0, hu);
      cp_async_commit();
      kv_copier.copy(sV_addr + at, v + first, kv_stride, n_hi - n0, hu);
      cp_async_commit();
      return false;
    }
    int64_t rows[kIters];
    bool absent = false;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = threadIdx.x + it * kThreads, r = idx / kChunks, key = n0 + r;
      rows[it] = key < n_hi ? keys.row(b, s.k_start, key) : -1;
      absent |= key < n_hi && rows[it] < 0;
      if (idx % kChunks == 0) sValid[stage * kBlockN + r] = rows[it] >= 0;
    }
    // The element-wise path looks rows up again (it cannot index rows[] by a variable).
    auto key_row = [&](int r) {
      return n0 + r < n_hi ? keys.row(b, s.k_start, n0 + r) : int64_t(-1);
    };
#pragma unroll
    for (int t = 0; t < 2; ++t) {  // K, then V: one commit group each
      const E* src = t == 0 ? k : v;
      load_tile<kU, kBlockN>(
          (t == 0 ? sK : sV) + stage * kKVElems,
          [&](int it, int) { return rows[it] >= 0 ? src + rows[it] * kv_stride : nullptr; },
          [&](int, int r) {
            const int64_t row = key_row(r);
            return row >= 0 ? src + row * kv_stride : nullptr;
          },
          hu, vec);
      cp_async_commit();
    }
    return absent;
  };

  if (tiles > 0) {
    // Q rows are contiguous: RowCopier's pointer steps, not load_tile's per-chunk row
    // lookup (~40 instructions a chunk; ncu, d64 S=512 causal: the block's set-up and
    // epilogue were 28 % of the instructions).
    if (vec) {
      const RowCopier<kU, kBlockM> q_copier(q_stride);
      q_copier.copy(sQ_addr, q + (s.q_start + m0) * q_stride, q_stride, s.num_q - m0, hu);
    } else {
      auto q_row = [&](int, int r) {
        return m0 + r < s.num_q ? q + (s.q_start + m0 + r) * q_stride : nullptr;
      };
      load_tile<kU, kBlockM, false>(sQ, q_row, hu);
    }
    cp_async_commit();
    bool absent = issue_kv(0, 0);
    // Q's A fragments for the whole loop (q_in_regs): once Q has landed (the oldest of
    // the three groups in flight), while K_0 and V_0 are still on their way.
    uint32_t qf[kMT][kQRegSteps][4];
    if constexpr (kQInRegs) {
      cp_async_wait<2>();
      __syncthreads();
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          ldsm_x4(qf[mt][kk], lds(sQ_addr, mt * kWarpRows + warp * 16, kk));
        }
      }
    }
    for (int j = 0; j < tiles; ++j) {
      const int n0 = n_lo + j * kBlockN, stage = j % kStages;
      // In flight: (Q,) K_j, V_j, issued a whole tile ago. One barrier a tile: it
      // publishes every thread's copies of K_j and V_j and guarantees tile j - 1 is fully
      // consumed, so its stage can be refilled. With a second barrier before P V (waiting
      // for V_j there), ptxas could not interleave the softmax's exponentials with the
      // P V mma as FA2's SASS does: ncu (d128, H100) counted 38 K stall samples on our
      // P V mma against FA2's 22 K, most of them fixed-latency waits.
      cp_async_wait<0>();
      const bool tile_absent = __syncthreads_or(absent);
      if (j + 1 < tiles) absent = issue_kv(j + 1, (j + 1) % kStages);
      // Element-wise masking only where some key of the tile is hidden from some row:
      // past the range end, absent pages, or a causal / window edge crossing the tile.
      const bool mask = tile_absent | (n0 < full_lo) | (n0 + kBlockN > full_hi);

      // S = Q K^T: per k16 step one ldmatrix.x4 of Q per m-tile (unless Q's fragments
      // are held, q_in_regs), one of K per 16 keys, written one step ahead of the mma
      // that read them (double-buffered fragments).
      // ncu on an H100 (d128) had found each mma waiting on the ldmatrix just before it
      // (1.22 short-scoreboard stall cycles per instruction, FA2 0.32); ptxas kept the
      // order only once the single barrier above freed the schedule (HMMA short-
      // scoreboard samples 35 K -> 9 K); this order alone measured within 2 %.
      const uint32_t tK = sK_addr + stage * 2 * kKVElems;
      float sc[kMT][kNT][4] = {};
      {
        constexpr int kNN = kBlockN / 16;
        uint32_t a[2][kMT][4], bk[2][kNN][4];  // bk: keys +0..7 {bk0, bk1}, +8..15 {bk2, bk3}
        auto load = [&](int kk) {
#pragma unroll
          for (int mt = 0; mt < kMT && !kQInRegs; ++mt)
            ldsm_x4(a[kk % 2][mt], lds(sQ_addr, mt * kWarpRows + warp * 16, kk));
#pragma unroll
          for (int nn = 0; nn < kNN; ++nn) ldsm_x4(bk[kk % 2][nn], lds_k(tK, nn * 16, kk));
        };
        load(0);
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          if (kk + 1 < kKSteps) load(kk + 1);
#pragma unroll
          for (int nn = 0; nn < kNN; ++nn) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              const uint32_t(&qa)[4] = kQInRegs ? qf[mt][kk % kQRegSteps] : a[kk % 2][mt];
              mma_step<T>(sc[mt][2 * nn], qa, bk[kk % 2][nn][0], bk[kk % 2][nn][1]);
              mma_step<T>(sc[mt][2 * nn + 1], qa, bk[kk % 2][nn][2], bk[kk % 2][nn][3]);
            }
          }
        }
      }

      // O += P V: the S accumulators of n8 tiles 2kk and 2kk + 1, rounded to T, are the
      // A fragment of keys kk*16 .. kk*16 + 15 (c0,c1 -> a0 / a2; c2,c3 -> a1 / a3). V
      // fragments are loaded one step ahead, as K's above. Called in each softmax
      // variant's branch so that the two share a basic block (see the barrier above).
      //
      // fp8: m16n8k32 over 32 keys a step. Lane (g, t)'s S elements of the step are keys
      // 2t, 2t + 1 of each n8 tile; packed as they lie (pack4_e4m3 of n8 tiles 4ks + {0,1},
      // then + {2,3}), its A fragment's k slots 4t .. 4t + 3 hold keys {2t, 2t+1, 8+2t,
      // 9+2t} (+16 in a[2], a[3]). V's B fragment must list the same keys: ldmatrix.trans
      // of 16-bit units gives lane (g, t) the bytes (key 2t, key 2t+1) x (column 2g, 2g+1),
      // and keys 8.. from the next 8x8 matrix; __byte_perm 0x6420 of the two takes column
      // 2g of the four keys in that order, 0x7531 column 2g+1. So the n8 tile "even"
      // (odd) of a 16-column group holds columns 2n (2n + 1): lane t's O elements (e = 0,
      // 1) of n8 tile dt are column 16 (dt / 2) + 4t + 2e + dt % 2 (fp8_col). No shared
      // memory transpose, 2 PRMT per mma.
      auto pv = [&] {
        const uint32_t tV = sV_addr + stage * 2 * kKVElems;
        if constexpr (kFp8) {
          constexpr int kDD = kU / 16, kSteps = kBlockN / 32 * kDD;
          uint32_t a[kMT][4], bv[2][2][4];  // [buffer][keys +0..15, +16..31][ldmatrix regs]
          auto load_v = [&](int st, uint32_t(&r)[2][4]) {
            ldsm_x4_trans(r[0], lds(tV, st / kDD * 32, st % kDD));
            ldsm_x4_trans(r[1], lds(tV, st / kDD * 32 + 16, st % kDD));
          };
          load_v(0, bv[0]);
#pragma unroll
          for (int st = 0; st < kSteps; ++st) {
            const int ks = st / kDD, dd = st % kDD;
            if (dd == 0) {
#pragma unroll
              for (int mt = 0; mt < kMT; ++mt) {
                const float(&x)[kNT][4] = sc[mt];
                a[mt][0] = pack4_e4m3(x[4 * ks][0], x[4 * ks][1], x[4 * ks + 1][0], x[4 * ks + 1][1]);
                a[mt][1] = pack4_e4m3(x[4 * ks][2], x[4 * ks][3], x[4 * ks + 1][2], x[4 * ks + 1][3]);
                a[mt][2] = pack4_e4m3(x[4 * ks + 2][0], x[4 * ks + 2][1], x[4 * ks + 3][0],
                                      x[4 * ks + 3][1]);
                a[mt][3] = pack4_e4m3(x[4 * ks + 2][2], x[4 * ks + 2][3], x[4 * ks + 3][2],
                                      x[4 * ks + 3][3]);
              }
            }
            if (st + 1 < kSteps) load_v(st + 1, bv[(st + 1) % 2]);
            const uint32_t(&r)[2][4] = bv[st % 2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // columns 32 dd + 16 half ..
#pragma unroll
              for (int odd = 0; odd < 2; ++odd) {
                const uint32_t sel = odd ? 0x7531u : 0x6420u;
                const uint32_t b0 = __byte_perm(r[0][2 * half], r[0][2 * half + 1], sel);
                const uint32_t b1 = __byte_perm(r[1][2 * half], r[1][2 * half + 1], sel);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
                  mma_e4m3_16832(o[mt][4 * dd + 2 * half + odd], a[mt], b0, b1);
              }
            }
          }
        } else {
          constexpr int kDD = D / 16, kSteps = kBlockN / 16 * kDD;
          uint32_t a[kMT][4], bv[2][4];  // bv: dims +0..7 {bv0, bv1}, +8..15 {bv2, bv3}
          ldsm_x4_trans(bv[0], lds(tV, 0, 0));
#pragma unroll
          for (int st = 0; st < kSteps; ++st) {
            const int kk = st / kDD, dd = st % kDD, nx = st + 1;
            if (dd == 0) {
#pragma unroll
              for (int mt = 0; mt < kMT; ++mt) {
                accum_to_a<T>(a[mt], sc[mt][2 * kk], sc[mt][2 * kk + 1]);
              }
            }
            if (nx < kSteps) ldsm_x4_trans(bv[nx % 2], lds(tV, nx / kDD * 16, nx % kDD));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<T>(o[mt][2 * dd], a[mt], bv[st % 2][0], bv[st % 2][1]);
              mma_16816<T>(o[mt][2 * dd + 1], a[mt], bv[st % 2][2], bv[st % 2][3]);
            }
          }
        }
      };

      // Online softmax (TileSoftmax below), its masking and softcap compile-time flags.
      const TileSoftmax tsm{int64_t(m0) + warp * 16 + g + s.offset, n0, n_hi, t, win, mul,
                            cap, exp_mul, slope / exp_mul, prescale,
                            prescale || slope != 0.f, tile_absent,
                            sValid + stage * kBlockN};
      // The common tile (unmasked, no softcap) first, behind one branch: written the
      // other way round, ptxas tested both flags in a chain of five branches.
      if (!(mask | softcap)) {
        tsm.run<false, false>(sc, m, l, o);
        pv();
      } else if (!softcap) {
        tsm.run<true, false>(sc, m, l, o);
        pv();
      } else if (!mask) {
        tsm.run<false, true>(sc, m, l, o);
        pv();
      } else {
        tsm.run<true, true>(sc, m, l, o);
        pv();
      }
    }
    cp_async_wait<0>();
  }

  // Epilogue: normalise; split-KV partials go to the workspace in f32 (the portable
  // layout); a single split stages O in this warp's own rows of sQ (no other warp reads
  // them) for 16-byte stores, or (fp8, whose bf16 rows are twice Q's) stores each lane's
  // four adjacent columns (fp8_col) from registers, 8 bytes a row: a quad writes 32.
  float* ws_out = static_cast<float*>(p.workspace);
  const int64_t out_stride = int64_t(p.num_heads) * hd;  // elements of out / partials
  float* ws_lse = ws_out + int64_t(splits) * p.total_q * out_stride;
  const float out_scale = descale<T>(p.v_descale);
  Out* out = static_cast<Out*>(p.out) + int64_t(h) * hd;
  auto fp8_col = [&](int dt, int e) { return 16 * (dt / 2) + 4 * t + 2 * e + dt % 2; };
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = l[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // The approximate reciprocal and logarithm (MUFU, ~1 ulp; sum <= the key count):
      // IEEE division and logf cost ~40 instructions a row, 4 rows a lane.
      const float inv = sum > 0.f ? __fdividef(1.f, sum) * out_scale : 0.f;
      const int r = mt * kWarpRows + warp * 16 + g + 8 * hf, i = m0 + r;
      const int64_t row = s.q_start + i;
      if (splits > 1) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = kFp8 ? fp8_col(dt, e) : dt * 8 + 2 * t + e;
            if (i < s.num_q && d < hd) {
              ws_out[(split * p.total_q + row) * out_stride + h * hd + d] =
                  o[mt][dt][2 * hf + e] * inv;
            }
          }
        }
      } else if constexpr (kFp8) {
        // Columns 16 c + 4t .. + 3: n8 tiles 2c (even columns) and 2c + 1 (odd); head dims
        // are a multiple of 16, so a group is all in or all out.
        const bool vec8 = aligned_to<Out>(p.out, 8);
#pragma unroll
        for (int c = 0; c < D / 16; ++c) {
          const int d0 = 16 * c + 4 * t;
          if (i >= s.num_q || d0 >= hd) continue;
          const float(&ev)[4] = o[mt][2 * c];
          const float(&od)[4] = o[mt][2 * c + 1];
          const uint32_t lo = pack2<Out>(ev[2 * hf] * inv, od[2 * hf] * inv);
          const uint32_t hi = pack2<Out>(ev[2 * hf + 1] * inv, od[2 * hf + 1] * inv);
          Out* dst = out + row * out_stride + d0;
          if (vec8) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
          } else {
            reinterpret_cast<uint32_t*>(dst)[0] = lo;  // bf16 pairs: 4-byte aligned
            reinterpret_cast<uint32_t*>(dst)[1] = hi;
          }
        }
      } else {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          *reinterpret_cast<uint32_t*>(sQ + swz<D>(r, dt) + 2 * t) =
              pack2<T>(o[mt][dt][2 * hf] * inv, o[mt][dt][2 * hf + 1] * inv);
        }
      }
      if (t == 0 && i < s.num_q) {
        const float lse = sum > 0.f ? m[mt][hf] * kLn2 + __logf(sum)
                                    : (splits > 1 ? -XLA_ATTN_INF : XLA_ATTN_INF);
        if (splits > 1) {
          ws_lse[(int64_t(split) * p.num_heads + h) * p.total_q + row] = lse;
        } else if (p.softmax_lse) {
          p.softmax_lse[int64_t(h) * p.total_q + row] = lse;
        }
      }
    }
  }
  if constexpr (!kFp8) {
    if (splits > 1) return;
    __syncwarp();
    const bool vec_out = hd % 8 == 0 && aligned_to<Out>(p.out, 16);
#pragma unroll
    for (int idx = lane; idx < kMT * 16 * kChunks; idx += 32) {
      const int lr = idx / kChunks, c = idx % kChunks;
      const int r = (lr / 16) * kWarpRows + warp * 16 + lr % 16, i = m0 + r;
      if (i >= s.num_q || c * 8 >= hd) continue;
      const uint4 x = *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
      store_chunk(out + (s.q_start + i) * out_stride, x, c * 8, hd, vec_out);
    }
  }
}

}  // namespace xla_attn
