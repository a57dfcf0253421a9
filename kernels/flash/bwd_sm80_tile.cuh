// The sm80 backward's pieces (bwd_sm80.cuh has the family's structure): tile loads,
// the score and its softcap derivative, the mma.sync products with operands from
// shared memory or registers, the dQ accumulator's atomic adds (dq_tile_atomic), and
// where the workspace keeps delta and the dQ accumulator (bwd_delta, bwd_dq_accum).
#pragma once
#include "flash/bwd_portable.cuh"
#include "flash/fwd_sm80.cuh"

namespace xla_attn {
namespace sm80 {

// A kRows x D tile of rows [0, valid) of a row-major tensor (`stride` elements
// between rows), zeros elsewhere: 16-byte cp.async where rows are 16-byte aligned,
// element loads otherwise.
template <int D, int kRows, typename T>
__device__ __forceinline__ void bwd_load(uint32_t tile_addr, T* tile,
                                         const RowCopier<D, kRows>& copier, const T* src,
                                         int64_t stride, int valid, int hd, bool vec) {
  if (vec) {
    copier.copy(tile_addr, src, stride, valid, hd);
  } else {
    load_tile<D, kRows, false>(
        tile, [&](int, int r) { return r < valid ? src + r * stride : nullptr; }, hd);
  }
}

// The score in base 2 and its softcap derivative: s2 = x * mul, or with softcap
// s2 = cap * tanh(x * mul) and d(score)/d(x * scale) = 1 - tanh^2; ALiBi subtracts
// slope * |pos - key| (base 2 as well) and has no derivative factor.
template <bool kCap>
__device__ __forceinline__ float bwd_score(float x, float mul, float cap, float* grad) {
  if constexpr (kCap) {
    const float th = fast_tanh(x * mul);
    *grad = 1.f - th * th;
    return cap * th;
  } else {
    *grad = 1.f;
    return x * mul;
  }
}

struct BwdScore {
  float mul, cap, slope;  // base-2 factors (see bwd_score); slope: ALiBi * log2 e
  bool capped;
  // P of score x (query position pos, key key) on the general path, against the row's
  // base-2 lse, and d(score)/d(x * scale) in *grad.
  __device__ __forceinline__ float prob(float x, int64_t pos, int64_t key, float lse2,
                                        float* grad) const {
    float y = capped ? bwd_score<true>(x, mul, cap, grad) : bwd_score<false>(x, mul, cap, grad);
    y -= slope * float(pos > key ? pos - key : key - pos);
    return fast_exp2(y - lse2);
  }
};

// Writes a warp's 16 rows of a D-wide f32 accumulator (rows g, g + 8 of each n8 tile,
// times `factor`) to rows [row0, row0 + 16) of a [rows, heads, hd] tensor, rows <
// rows_valid only: staged as T in the warp's own rows of a swizzled tile (no other
// warp reads them any more) for 16-byte stores, or element stores where unaligned.
template <typename T, int D>
__device__ __forceinline__ void bwd_store_rows(T* stage, const float (&acc)[D / 8][4], float factor,
                                               T* dst, int64_t stride, int rows_valid, int hd,
                                               bool vec) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      *reinterpret_cast<uint32_t*>(stage + swz<D>(g + 8 * hf, dt) + 2 * t) =
          pack2<T>(acc[dt][2 * hf] * factor, acc[dt][2 * hf + 1] * factor);
    }
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (r >= rows_valid || c * 8 >= hd) continue;
    store_chunk(dst + r * stride, *reinterpret_cast<const uint4*>(stage + swz<D>(r, c)), c * 8,
                hd, vec);
  }
}

__device__ __forceinline__ float4 as_float4(const float (&a)[4]) {
  return make_float4(a[0], a[1], a[2], a[3]);
}
__device__ __forceinline__ void add4(float (&a)[4], const float4& x) {
  a[0] += x.x, a[1] += x.y, a[2] += x.z, a[3] += x.w;
}

// Whether rows of hd elements at these tensors take 16-byte copies.
template <typename... P>
__device__ __forceinline__ bool bwd_vec(int hd, const P*... ptrs) {
  return hd % 8 == 0 && (aligned_to<P>(ptrs, 16) && ...);
}

// Two products over the same D-wide k-steps for the warp's kM m16 tiles x kN columns:
// acc0 += A0 B0^T and (kSecond) acc1 += A1 B1^T, A rows a_row + 16 m of tiles a0 / a1,
// B rows b_row .. b_row + kN - 1 of tiles b0 / b1, read as stored (their rows are the
// products' columns). Each B fragment serves all kM m-tiles.
template <typename T, int D, int kM, int kN, bool kSecond = true>
__device__ __forceinline__ void two_products(float (&acc0)[kM][kN / 8][4],
                                             float (&acc1)[kM][kN / 8][4], uint32_t a0,
                                             uint32_t a1, int a_row, uint32_t b0, uint32_t b1,
                                             int b_row, const LdsmLane<D>& lds_a,
                                             const LdsmLane<D>& lds_b) {
  // Row offsets known only at run time join the bases once. With one m-tile the A
  // offset stays in the ldmatrix address, as before (joined, ptxas sm_90 spilled 24
  // bytes at d128); with two, joined (d64 spill 48 -> 36 bytes).
  if constexpr (kM > 1) {
    a0 += uint32_t(a_row * 2 * D), a1 += uint32_t(a_row * 2 * D), a_row = 0;
  }
  b0 += uint32_t(b_row * 2 * D), b1 += uint32_t(b_row * 2 * D);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t x0[kM][4], x1[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      ldsm_x4(x0[m], lds_a(a0, a_row + 16 * m, kk));
      if constexpr (kSecond) ldsm_x4(x1[m], lds_a(a1, a_row + 16 * m, kk));
    }
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t y[4];  // B rows nn*16 + 0..7: {y0, y1}; + 8..15: {y2, y3}
      ldsm_x4(y, lds_b(b0, nn * 16, kk));
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_16816<T>(acc0[m][2 * nn], x0[m], y[0], y[1]);
        mma_16816<T>(acc0[m][2 * nn + 1], x0[m], y[2], y[3]);
      }
      if constexpr (kSecond) {
        ldsm_x4(y, lds_b(b1, nn * 16, kk));
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma_16816<T>(acc1[m][2 * nn], x1[m], y[0], y[1]);
          mma_16816<T>(acc1[m][2 * nn + 1], x1[m], y[2], y[3]);
        }
      }
    }
  }
}

// acc += A B^T for the warp's 16 rows x kN columns, A's fragments of the first kRegs
// k-steps held in registers (a), those of the rest read from rows a_row .. of the tile
// at a0, B rows 0 .. kN - 1 of the tile at b0 read as stored.
template <typename T, int D, int kN, int kRegs>
__device__ __forceinline__ void product_a_regs(float (&acc)[1][kN / 8][4],
                                               const uint32_t (&a)[kRegs][4], uint32_t a0,
                                               int a_row, uint32_t b0, const LdsmLane<D>& lds_a,
                                               const LdsmLane<D>& lds_b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t ak[4];
    if (kk < kRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) ak[i] = a[kk < kRegs ? kk : 0][i];
    } else {
      ldsm_x4(ak, lds_a(a0, a_row, kk));
    }
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t y[4];
      ldsm_x4(y, lds_b(b0, nn * 16, kk));
      mma_16816<T>(acc[0][2 * nn], ak, y[0], y[1]);
      mma_16816<T>(acc[0][2 * nn + 1], ak, y[2], y[3]);
    }
  }
}

// acc += P B for the warp's kM m16 tiles: P (16 x kK each) from f32 accumulators,
// rounded to T as A fragments (c0,c1 -> a0 / a2; c2,c3 -> a1 / a3, see fwd_sm80.cuh),
// and B the kK x D tile at `b` (row-major: its B fragments by ldmatrix.trans, each
// serving all kM m-tiles).
template <typename T, int D, int kM, int kK>
__device__ __forceinline__ void product_pb(float (&acc)[kM][D / 8][4],
                                           const float (&pr)[kM][kK / 8][4], uint32_t b,
                                           const LdsmLane<D>& lds_a) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) accum_to_a<T>(a[m], pr[m][2 * kk], pr[m][2 * kk + 1]);
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t y[4];  // dims dd*16 + 0..7: {y0, y1}; + 8..15: {y2, y3}
      ldsm_x4_trans(y, lds_a(b, kk * 16, dd));
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_16816<T>(acc[m][2 * dd], a[m], y[0], y[1]);
        mma_16816<T>(acc[m][2 * dd + 1], a[m], y[2], y[3]);
      }
    }
  }
}

// Element offset of (key, 8-row chunk c) in the dS^T tile (kBwdBlock keys x kS rows):
// swizzled as a D = kS tile at kS = 64 or 32 (the paired d256 kernel's); at kS = 16
// rows are 32 bytes apart, and an ldmatrix phase (8 keys) meets a 2-way bank conflict.
template <int kS>
__device__ __forceinline__ int ds_offset(int key, int c) {
  if constexpr (kS == 64 || kS == 32) {
    return swz<kS>(key, c);
  } else {
    static_assert(kS == 16, "dS^T tile layout for 64- or 16-row tiles only");
    return key * kS + 8 * c;
  }
}

// Barriers of the paired d256 kernel, whose two warp groups run different code: the
// non-.aligned forms, which let the threads meet at different barrier instructions
// (bar.sync, and so __syncthreads, is barrier.sync.aligned: every thread of the block
// at the same instruction; compute-sanitizer's synccheck flagged the block barrier
// the two halves reach from their own code). kCount threads of barrier kId (0: the
// block's).
template <int kId, int kCount>
__device__ __forceinline__ void named_sync() {
  asm volatile("barrier.sync %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}
template <int kId, int kCount>
__device__ __forceinline__ void named_arrive() {
  asm volatile("barrier.arrive %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}
// A dk/dv block's barriers: __syncthreads, or kPaired barrier kId over kCount threads:
// the block's (0, both halves from their own code), or the dK half's before its dQ
// (2; the dV half goes on meanwhile).
template <bool kPaired, int kId = 0, int kCount = sm80::kPairedWarps * 32>
__device__ __forceinline__ void block_sync() {
  if constexpr (kPaired) {
    named_sync<kId, kCount>();
  } else {
    __syncthreads();
  }
}

// Where element (n8 tile j, i = 2 hf + e) of lane `lane` sits in an accumulator chunk
// (sm80_tiles.h): so that one warp-wide add covers whole lines. sm_90 adds a lane's 4
// floats of a tile at once (red.global.add.v4.f32: 512 bytes a warp), older archs one
// float a lane (128 bytes). The adder and the conversion of one cubin agree.
__device__ __forceinline__ int acc_offset(int j, int i, int lane) {
#if __CUDA_ARCH__ >= 900
  return j * 128 + lane * 4 + i;
#else
  return (4 * j + i) * 32 + lane;
#endif
}

// Adds a warp's 16 x 32 chunk (mma accumulators q[j][i] of n8 tile j) into the chunk
// whose lane element is at `at` (chunk + acc_offset(0, 0, lane): the offsets are
// linear, so every add is `at` plus a constant, which ptxas folds into the red's
// address). Every row is added, with no test: rows past the tile's last (rows_valid)
// carry exact zeros (their dS is masked to 0) into their own sequence's last chunk,
// whose rows past the sequence are never read. A test per add (a select pair and a
// branch) cost ~9 instructions a red (ncu, d128).
__device__ __forceinline__ void dq_chunk_add(float* at, const float (&q)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(at + acc_offset(j, 0, 0)),
                 "f"(q[j][0]), "f"(q[j][1]), "f"(q[j][2]), "f"(q[j][3])
                 : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) atomicAdd(at + acc_offset(j, i, 0), q[j][i]);
#endif
  }
}

// dQ += dS K for one streamed tile on the atomic-dQ path. Each warp holds dS^T for its
// 16 kKM keys (from key_w) x kS / (its row warps) rows (from row_w; accumulator
// layout, `ds`, as the dk/dv kernel's); the tile passes through shared memory
// (`sds`) so that a warp can take whole rows of dS over all 64 keys: at kS = 64 warp w
// takes rows 16w .. 16w + 15 and every column of dQ, at kS = 16 the 16 rows and
// columns D/4 w .., at kS = 32 (paired) rows 16 (w % 2) .. and columns D/2 (w / 2) ..
// (one red.global.add per element and tile either way: 4x fewer than
// adding each warp's 16-key partial). Columns go in 32-column chunks, two at a time
// (32 accumulators: the dk/dv kernel already holds 128 f32 of dK and dV), each added
// as whole 128-byte lines into the accumulator's chunk layout (sm80_tiles.h,
// kAccChunk). `acc` points at the tile's first chunk (16-row aligned) of the head,
// `col_chunks` chunks a row chunk; rows >= rows_valid add zeros (dq_chunk_add). The
// kWarps warps of the block (kPaired: its dK warps, which synchronise among
// themselves) take part. The caller makes sure sds is free before the call and that
// nothing writes sds or sK before every such warp is done.
template <typename T, int D, int kS, bool kPaired, int kKM, int kNT>
__device__ __forceinline__ void dq_tile_atomic(const float (&ds)[kKM][kNT][4], T* sds,
                                               uint32_t sK_addr, int key_w, int row_w,
                                               float* acc, int col_chunks, int rows_valid,
                                               int hd, const LdsmLane<D>& lds_a) {
  const int warp = kPaired ? (threadIdx.x / 32) % kWarps : threadIdx.x / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // The lane's (key key_w + 16 m + g + 8 hf, rows row_w + 8 nt + 2t ..) at byte
  // `ds_at ^ 16 nt` + 2 kS (16 m + 8 hf) (kS = 64: sds and so every key's row 128-byte
  // aligned, the swizzle term g in bits 4-6 of `ds_at`, 4t below them; row_w / 8 is
  // 0 or 4 and nt < 4 when both are set, so their chunk bits do not meet; kS = 32:
  // row_w = 0, the term (g / 2) % 4 in bits 4-5, the same for key + 8) or
  // `ds_at + 16 nt + 32 (16 m + 8 hf)` (kS = 16): one instruction an address;
  // ds_offset's arithmetic per store took ~70 instructions a tile (d128).
  const uint32_t ds_at =
      smem_addr(sds) + 2u * uint32_t(ds_offset<kS>(key_w + g, row_w / 8) + 2 * t);
#pragma unroll
  for (int m = 0; m < kKM; ++m) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const uint32_t x = pack2<T>(ds[m][nt][2 * hf], ds[m][nt][2 * hf + 1]);
        const uint32_t addr =
            (kS != 16 ? ds_at ^ (16u * nt) : ds_at + 16u * nt) + 2u * kS * (16 * m + 8 * hf);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
      }
    }
  }
  block_sync<kPaired, 2, kWarps * 32>();
  constexpr int kRowGroups = kS / 16, kCols = D * kRowGroups / kWarps;
  static_assert(kCols % kAccChunkCols == 0, "dQ columns a warp takes must be whole chunks");
  const int rg = warp % kRowGroups, col0 = (warp / kRowGroups) * kCols;
  // A fragments of dS rows 16 rg .. (k = keys) by ldmatrix.trans of the stored dS^T:
  // lane l addresses key (l & 7) + 8 (l >> 4) of the k-step, row chunk 2 rg + bit 3.
  const uint32_t sds_addr = smem_addr(sds);
  uint32_t a[kBwdBlock / 16][4];
#pragma unroll
  for (int kk = 0; kk < kBwdBlock / 16; ++kk) {
    const int key = kk * 16 + (lane & 7) + 8 * (lane >> 4), c = 2 * rg + ((lane >> 3) & 1);
    ldsm_x4_trans(a[kk], sds_addr + 2u * uint32_t(ds_offset<kS>(key, c)));
  }
  // Chunks two at a time, their mma interleaved: one chunk's four accumulators are
  // four dependent chains of kBwdBlock / 16 mma each, and its adds wait on the last.
  // One chunk at a time in a rolled loop took 26 % of the d128 kernel's stall samples
  // (ncu), 41 % of them fixed-latency waits. Chunks past the head dim (hd <= D - 32,
  // a bucket's smaller dims) are computed on the zero columns of sK and not added.
  constexpr int kChunks = kCols / kAccChunkCols, kStep = kChunks >= 2 ? 2 : 1;
  // A row group wholly past the tile's rows adds nothing: its chunk may be the next
  // sequence's first (warp-uniform).
  if (rows_valid <= rg * 16) return;
  // the lane's element of the warp's first chunk; columns past hd land in a chunk's
  // padding, never read
  float* const at = acc + (int64_t(rg) * col_chunks + col0 / kAccChunkCols) * kAccChunk +
                    acc_offset(0, 0, lane);
#pragma unroll
  for (int cc = 0; cc < kChunks; cc += kStep) {
    float q[kStep][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kBwdBlock / 16; ++kk) {
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
        if (cc + u >= kChunks) continue;  // D = 96: 3 chunks
#pragma unroll
        for (int dd = 0; dd < 2; ++dd) {
          uint32_t y[4];  // columns c0 + 16 dd + 0..7: {y0, y1}; + 8..15: {y2, y3}
          ldsm_x4_trans(y, lds_a(sK_addr, kk * 16, (col0 + (cc + u) * kAccChunkCols) / 16 + dd));
          mma_16816<T>(q[u][2 * dd], a[kk], y[0], y[1]);
          mma_16816<T>(q[u][2 * dd + 1], a[kk], y[2], y[3]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      // warp-uniform: chunks past the head dim do not exist
      if (cc + u >= kChunks || col0 + (cc + u) * kAccChunkCols >= hd) continue;
      dq_chunk_add(at + (cc + u) * kAccChunk, q[u]);
    }
  }
}

}  // namespace sm80

// The backward's delta = dO . O rows: in the workspace (atomic-dQ path) or in the dq
// buffer's scratch (deterministic path, no workspace).
__device__ __forceinline__ float* bwd_delta(const xla_attn_flash_bwd_params& p) {
  return static_cast<float*>(p.workspace ? p.workspace : p.dq);
}
// The atomic-dQ path's f32 dQ accumulator (chunk layout, sm80_tiles.h), or null.
__device__ __forceinline__ float* bwd_dq_accum(const xla_attn_flash_bwd_params& p) {
  return p.workspace ? static_cast<float*>(p.workspace) +
                           sm80::bwd_delta_floats(p.total_q, p.num_heads)
                     : nullptr;
}
// Head h's accumulator chunks of sequence b from row chunk `row_chunk` (sequence-relative).
__device__ __forceinline__ float* bwd_dq_accum_rows(const xla_attn_flash_bwd_params& p, int h,
                                                    const Sequence& s, int b, int row_chunk) {
  using namespace sm80;
  const int64_t chunk = int64_t(h) * bwd_acc_row_chunks(p.total_q, p.batch) +
                        bwd_acc_row_chunk(s.q_start, b) + row_chunk;
  return bwd_dq_accum(p) + chunk * bwd_acc_col_chunks(p.head_dim) * kAccChunk;
}

}  // namespace xla_attn
