// The sm80 family's shared-memory tiles (fwd_sm80.cuh has the family's structure): the
// swizzle that keeps ldmatrix conflict-free, each lane's ldmatrix rows (LdsmLane), a
// tensor row's 16-byte chunks loaded and stored (load_chunk_scalar, store_chunk), and row
// tiles copied into shared memory (load_tile, RowCopier).
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

}  // namespace sm80
}  // namespace xla_attn
