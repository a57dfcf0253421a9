// Flash attention backward, sm80 family (sm_80 .. sm_90; f16 and bf16, head dims <= 256):
// FA2's backward on tensor cores (mma.sync m16n8k16, f32 accumulators), P recomputed
// from the forward's softmax_lse. Two paths, by whether the call has a workspace
// (sm80_tiles.h, bwd_workspace_bytes):
//
//   flash_bwd_delta_sm80  D_i = dO_i . O_i - dlse_i as f32 [num_heads, total_q]: in the
//                         workspace, whose dQ accumulator it also zeroes; without one
//                         at the start of the dq buffer (scratch: dq is written last;
//                         hd >= 2 makes it fit).
//   flash_bwd_dkdv_sm80   one block per (64 keys, kv head): K and V stay in shared
//                         memory while tiles of Q, dO, lse and D (64 rows; at d256 32
//                         or 16, see sm80_tiles.h) of every query head of the GQA group stream
//                         through two stages. Per tile and warp (16 keys): S^T = K Q^T
//                         and dP^T = V dO^T, then
//                         P^T = exp(S^T - lse), dS^T = P^T (dP^T - D) softcap'(S), and
//                         dV += P^T dO, dK += dS^T Q with P^T, dS^T straight from the
//                         accumulators as A fragments (see fwd_sm80.cuh). At d256 a
//                         key block is one 8-warp block whose halves accumulate dV and
//                         dK (flash_bwd_dkdv_paired_sm80, sm_80 / sm_90), or where
//                         shared memory is short two blocks, one for each. With a
//                         workspace, dQ += dS K too, added into the f32 accumulator
//                         (dq_tile_atomic): 5 matrix products per tile pair, as FA2.
//   flash_bwd_dq_convert_sm80  with a workspace: dq = scale * the accumulator.
//   flash_bwd_dq_sm80     without one: one block per (64 query rows, head): Q, dO stay,
//                         K/V tiles (64 keys; 16 at d256) stream; S = Q K^T,
//                         dP = dO V^T, dS, dQ += dS K. It computes its rows' D itself,
//                         so overwriting the scratch is safe. Every gradient element
//                         has one owner (deterministic, no atomics); the price is S and
//                         dP computed twice: 7 matrix products per tile pair.
//
// The pieces are in files of their own, included in this order: tile loads, products
// and the dQ accumulator (bwd_sm80_tile.cuh), the delta and dq-convert passes
// (bwd_sm80_passes.cuh); this file has the dk/dv and dq kernels.
#pragma once
#include "flash/bwd_sm80_passes.cuh"

namespace xla_attn {

// A dk/dv block's walk over its (query head of the GQA group, row tile) pairs, row
// tiles first, wrapping around to head 0.
struct BwdTileCursor {
  int head, row;
  __device__ __forceinline__ void advance(int per_head, int group) {
    if (++row == per_head) {
      row = 0;
      if (++head == group) head = 0;
    }
  }
};

// The gradients a dk/dv block accumulates: both, or at d256 (sm80::bwd_split_grads)
// one of them, so that its accumulators fit the registers.
enum BwdGrads { kGradDV = 1, kGradDK = 2, kGradBoth = 3 };

// Key block `key_block` (64 keys) of kv head blockIdx.y of sequence blockIdx.z, by 4
// warps. kPaired (sm80_tiles.h, bwd_paired_smem_bytes): the dV (kGrads = kGradDV,
// threads 0-127) or the dK half (kGradDK, threads 128-255) of an 8-warp block; both
// halves walk the same tiles and meet at the same block barriers. The dV half copies
// every tile (it has 2 products a tile, the dK half 3) and passes P^T (times
// softcap') to the dK half through sP, which waits for it at named barrier 1.
template <typename T, int D, int kGrads, bool kPaired = false>
__device__ __forceinline__ void flash_bwd_dkdv_sm80_block(const xla_attn_flash_bwd_params& p,
                                                          int key_block) {
  using namespace sm80;
  constexpr int kB = kBwdBlock;             // keys of the block
  // query rows of a streamed tile
  constexpr int kS = kPaired ? bwd_paired_stream_block(D) : bwd_stream_block(D);
  // The warps' grid over a tile's kB keys x kS rows (sm80_tiles.h, bwd_key_mtiles):
  // kKM m16 tiles of keys and kSW rows a warp.
  constexpr int kKM = bwd_key_mtiles(D), kKeyWarps = kB / (16 * kKM);
  constexpr int kRowWarps = kWarps / kKeyWarps, kSW = kS / kRowWarps;
  constexpr int kNT = kSW / 8;  // n8 tiles of S^T (query rows) per warp
  constexpr int kDT = D / 8;    // n8 tiles of dK, dV
  static_assert(!kPaired || (kKM == 1 && kRowWarps == 1),
                "paired halves: 16 keys x all rows a warp");
  constexpr bool kDV = kGrads & kGradDV, kDK = kGrads & kGradDK;
  static_assert(!kPaired || kGrads != kGradBoth, "a paired half holds one gradient");
  constexpr bool kCopies = !kPaired || kDV;  // this warp group issues the copies
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kB * D;
  T* sQ = sV + kB * D;                 // [kStages][kS x D]
  T* sdO = sQ + kStages * kS * D;      // [kStages][kS x D]
  float* sLse = reinterpret_cast<float*>(sdO + kStages * kS * D);  // [kStages][kS], natural log
  float* sDelta = sLse + kStages * kS;                              // [kStages][kS]
  T* sDs = reinterpret_cast<T*>(sDelta + kStages * kS);  // [kB x kS] unless in the dO stage
  // paired: the dV half's P^T (times softcap') for the dK half, f32 in lane order: float4
  // (warp, n8 tile) of a lane at sP[(warp * kNT + nt) * 32 + lane]. After sDs (128-byte
  // aligned: kS floats a stage, kS a multiple of 32).
  float4* sP = reinterpret_cast<float4*>(sDs + kB * kS);

  const int hk = blockIdx.y, b = blockIdx.z, hd = p.head_dim;
  const Sequence s = bwd_sequence(p, b);
  const int n0 = key_block * kB;
  if (n0 >= s.num_k_rows) return;
  const int group = p.num_heads / p.num_heads_k;
  const int64_t q_stride = int64_t(p.num_heads) * hd, kv_stride = int64_t(p.num_heads_k) * hd;
  const T* k = static_cast<const T*>(p.k) + (s.k_start + n0) * kv_stride + int64_t(hk) * hd;
  const T* v = static_cast<const T*>(p.v) + (s.k_start + n0) * kv_stride + int64_t(hk) * hd;
  const float* delta_g = bwd_delta(p);  // flash_bwd_delta_sm80's
  // The atomic-dQ path's accumulator: dK blocks (or halves) add into it; every block
  // (both halves) starts its tiles on its 16-row chunks and staggers them.
  float* const dq_acc = kDK ? bwd_dq_accum(p) : nullptr;
  const bool atomic_dq = (kPaired ? bwd_dq_accum(p) : dq_acc) != nullptr;
  const Window win{p.window_left, p.window_right};
  const bool vec = bwd_vec(hd, p.q, p.k, p.v, p.dout, p.dk, p.dv);
  const int keys_valid = s.num_k - n0;  // keys past seqused_k take no part

  // (paired: numbered within its half)
  const int warp = kPaired ? (threadIdx.x / 32) % kWarps : threadIdx.x / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // the warp's keys key_w .. key_w + 16 kKM - 1 of the block and rows row_w .. row_w +
  // kSW - 1 of each tile (row_w a constant 0 with one row warp: ptxas cannot know that
  // warp < kWarps)
  const int key_w = kRowWarps > 1 ? (warp % kKeyWarps) * 16 * kKM : warp * 16;
  const int row_w = kRowWarps > 1 ? (warp / kKeyWarps) * kSW : 0;
  const LdsmLane<D> lds_a = LdsmLane<D>::a_operand(lane), lds_b = LdsmLane<D>::b_operand(lane);
  const uint32_t sK_addr = smem_addr(sK), sV_addr = smem_addr(sV), sQ_addr = smem_addr(sQ),
                 sdO_addr = smem_addr(sdO), sLse_addr = smem_addr(sLse),
                 sDelta_addr = smem_addr(sDelta);
  const RowCopier<D, kB> kv_copier(kv_stride);
  const RowCopier<D, kS> q_copier(q_stride);
  if (kCopies) {
    bwd_load<D>(sK_addr, sK, kv_copier, k, kv_stride, keys_valid, hd, vec);
    if (kDK || kPaired) bwd_load<D>(sV_addr, sV, kv_copier, v, kv_stride, keys_valid, hd, vec);
    cp_async_commit();
  }

  int i_lo = 0, i_hi = 0;
  if (keys_valid > 0) win.row_range(n0, min(n0 + kB, s.num_k) - 1, s.offset, s.num_q, &i_lo, &i_hi);
  // The atomic path's tiles start on the accumulator's 16-row chunks; the rows added
  // in front see none of the block's keys (the mask zeroes them).
  if (atomic_dq) i_lo -= i_lo % kAccChunkRows;
  const int per_head = (i_hi - i_lo + kS - 1) / kS;
  // Rows [full_lo, full_hi) below i_hi see every key of the block: a tile inside them
  // with all kB keys present needs no element-wise mask. Two compares a tile; the same
  // test written per tile from the window compiled to a chain of branches (in the
  // forward, 2 % of the d64 S=512 stall samples).
  int full_lo = 0, full_hi = 0;
  if (n0 + kB <= s.num_k) win.rows_seeing_all(n0, n0 + kB - 1, s.offset, i_hi, &full_lo, &full_hi);
  const int tiles = per_head * group;  // (query head of the group, row tile) pairs

  // Tile `tile` (head hk * group + tile.head, rows i0 = i_lo + tile.row * kS ...) into
  // `stage`: Q and dO rows, their lse and D (zeros past i_hi: those rows then add nothing).
  auto issue = [&](const BwdTileCursor& tile, int stage) {
    const int h = hk * group + tile.head, i0 = i_lo + tile.row * kS;
    const int64_t first = s.q_start + i0;
    const T* q = static_cast<const T*>(p.q) + first * q_stride + int64_t(h) * hd;
    const T* dout = static_cast<const T*>(p.dout) + first * q_stride + int64_t(h) * hd;
    const uint32_t at = 2u * uint32_t(stage * kS * D);
    bwd_load<D>(sQ_addr + at, sQ + stage * kS * D, q_copier, q, q_stride, i_hi - i0, hd, vec);
    bwd_load<D>(sdO_addr + at, sdO + stage * kS * D, q_copier, dout, q_stride, i_hi - i0, hd, vec);
    if (threadIdx.x < 2 * kS / 4) {  // kS / 4 threads: lse, kS / 4: D, 4 rows each (16 bytes)
      const int part = threadIdx.x / (kS / 4), r = 4 * (threadIdx.x % (kS / 4));
      const float* src = (part == 0 ? p.softmax_lse : delta_g) + int64_t(h) * p.total_q + first + r;
      const uint32_t dst = (part == 0 ? sLse_addr : sDelta_addr) + 4u * uint32_t(stage * kS + r);
      // 4 floats when all 4 rows exist and the source is 16-byte aligned, else one by one
      if (i0 + r + 4 <= i_hi && aligned_to<float>(src, 16)) {
        cp_async_16_or_zero(dst, src, true);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = i0 + r + e < i_hi;
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst + 4u * e),
                       "l"(ok ? src + e : src - r), "r"(ok ? 4 : 0)
                       : "memory");
        }
      }
    }
    cp_async_commit();
  };

  float dk[kKM][kDK ? kDT : 1][4] = {}, dv[kKM][kDV ? kDT : 1][4] = {};
  int64_t h_prev = -1;
  BwdScore sc_mod{};
  // On the atomic-dQ path the key blocks of a head start at different tiles (and wrap
  // around), so that they do not all add into the same dQ lines at once. The cursors
  // step by one tile: a division per tile (head and row from the tile's index) cost
  // ~40 instructions and 9 % of the d128 kernel's stall samples (ncu).
  const int first_tile = atomic_dq && tiles > 0 ? key_block % tiles : 0;
  BwdTileCursor tile{first_tile / max(per_head, 1), first_tile % max(per_head, 1)};
  if (kCopies && tiles > 0) issue(tile, 0);
  // The d256 dV blocks keep the warp's K fragments (16 keys x 256: 64 registers) for
  // every tile: with 16-row tiles S^T = K Q^T reloaded them once per 32 mma. H100
  // (ncu, B=4, S=4096): shared wavefronts -11 %, instructions -13 %, fwd+bwd +1-3 %.
  // The dK blocks (dK, S^T and dP^T live beside them) spilled 108 bytes (ptxas sm_90).
  // The paired dV half holds the first 8 of the 16 k-steps: 32-row tiles take 8 more
  // accumulators and the P^T it passes on; all 16 spilled 136 bytes (ptxas sm_90),
  // and with 0, 4 or 8 held the H100 harness (fwd+bwd d256) was within 1 %, 8 ahead.
  constexpr int kKeySteps = kPaired ? 8 : D / 16;  // k-steps of K held
  constexpr bool kKeyRegs = D == 256 && !kDK && kKeySteps > 0;
  uint32_t kfrag[kKeyRegs ? kKeySteps : 1][4];
  if ((kKeyRegs || kPaired) && tiles > 0) {  // paired: both halves meet here
    cp_async_wait<1>();  // K (tile 0 may still be in flight)
    block_sync<kPaired>();
#pragma unroll
    for (int kk = 0; kk < (kKeyRegs ? kKeySteps : 0); ++kk) {
      ldsm_x4(kfrag[kk], lds_a(sK_addr, key_w, kk));
    }
  }
  for (int it = 0; it < tiles; ++it, tile.advance(per_head, group)) {
    const int stage = it % kStages, h = hk * group + tile.head, i0 = i_lo + tile.row * kS;
    cp_async_wait<0>();      // K, V and tile `it`
    block_sync<kPaired>();  // ... for every thread; tile it - 1 fully consumed
    if (kCopies && it + 1 < tiles) {
      BwdTileCursor next = tile;
      next.advance(per_head, group);
      issue(next, (it + 1) % kStages);
    }
    if (h != h_prev) {
      h_prev = h;
      const bool capped = p.softcap > 0.f;
      sc_mod = BwdScore{capped ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e,
                        p.softcap * kLog2e,
                        (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h]
                                        : 0.f) * kLog2e,
                        capped};
    }

    // S^T = K Q^T and (for dK) dP^T = V dO^T for the warp's keys x rows.
    const uint32_t tQ = sQ_addr + 2u * uint32_t(stage * kS * D);
    const uint32_t tdO = sdO_addr + 2u * uint32_t(stage * kS * D);
    float st[kKM][kNT][4] = {}, dpt[kKM][kNT][4] = {};
    if constexpr (kKeyRegs) {
      product_a_regs<T, D, kSW>(st, kfrag, sK_addr, key_w, tQ, lds_a, lds_b);
    } else if constexpr (kPaired && kDK) {  // dP^T only: S^T is the dV half's
      two_products<T, D, kKM, kSW, false>(dpt, dpt, sV_addr, sV_addr, key_w, tdO, tdO, row_w,
                                          lds_a, lds_b);
    } else {
      two_products<T, D, kKM, kSW, kDK>(st, dpt, sK_addr, sV_addr, key_w, tQ, tdO, row_w, lds_a,
                                        lds_b);
    }

    // P^T and dS^T. Element (m, hf, nt, e): key n0 + key_w + 16 m + g + 8 hf, row i0 +
    // row_w + 8 nt + 2t + e.
    // The common tile (inside every mask, no softcap, no ALiBi) is a copy of its own:
    // per element an FFMA, the exp2, an FADD and an FMUL (the general body tests the
    // mask, softcap and ALiBi per element, ~20 instructions).
    const bool mask = (i0 < full_lo) | (i0 + kS > full_hi);
    const float* lse_t = sLse + stage * kS + row_w;
    const float* del_t = sDelta + stage * kS + row_w;
    // Called with a constant: inlined, each call is a copy specialised on it.
    // Masked tiles without softcap or ALiBi (causal and window edges, a sequence's
    // last tile) as a copy of their own up to d64: each of the lane's two keys sees the
    // rows [lo, hi) of the tile, kept relative to row i0 + 2t so that element (nt, e)
    // tests the constant 8 nt + e (a compare pair and a select). Through the general
    // body (~20 instructions an element) a masked tile cost ~2.7 unmasked ones (static
    // SASS); at S = 512 causal 22 % of the tiles are masked. H100, d64 fwd+bwd causal:
    // +1-6 %. At d96 / d128 the third copy made ptxas spill (d128: 36 -> 88 bytes) and
    // the unmasked rows lost 1-4 %, so those keep the general body.
    constexpr bool kMaskedCopy = D <= 64;
    enum { kProbFast, kProbMasked, kProbGeneral };
    auto probs = [&](const int kMode) {
      int vis_lo[kKM][2] = {}, vis_hi[kKM][2] = {};
      if (kMode == kProbMasked) {
#pragma unroll
        for (int m = 0; m < kKM; ++m) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            // relative to the lane's first row
            win.rows_seeing_key(n0 + key_w + 16 * m + g + 8 * hf, s.num_k, s.offset, i_hi,
                                i0 + row_w + 2 * t, kSW, &vis_lo[m][hf], &vis_hi[m][hf]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = nt * 8 + 2 * t;
        const float2 lse = *reinterpret_cast<const float2*>(lse_t + col);
        const float2 del = *reinterpret_cast<const float2*>(del_t + col);
        const float lse2[2] = {lse.x * kLog2e, lse.y * kLog2e}, dl[2] = {del.x, del.y};
#pragma unroll
        for (int m = 0; m < kKM; ++m) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int key = n0 + key_w + 16 * m + g + 8 * hf;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = st[m][nt][2 * hf + e];
              float& d = dpt[m][nt][2 * hf + e];
              // the paired dV half leaves P^T times softcap' for the dK half in d
              if (kMode == kProbFast) {
                x = fast_exp2(fmaf(x, sc_mod.mul, -lse2[e]));
                d = kDK ? x * (d - dl[e]) : x;
              } else if (kMode == kProbMasked) {
                const int r = nt * 8 + e;
                x = r >= vis_lo[m][hf] && r < vis_hi[m][hf]
                        ? fast_exp2(fmaf(x, sc_mod.mul, -lse2[e]))
                        : 0.f;
                d = kDK ? x * (d - dl[e]) : x;
              } else {
                const int i = i0 + row_w + col + e;
                const int64_t pos = int64_t(i) + s.offset;
                float grad;
                float pr = sc_mod.prob(x, pos, key, lse2[e], &grad);
                if (mask && !(key < s.num_k && i < i_hi && win.visible(pos, key))) pr = 0.f;
                x = pr;
                d = kDK ? pr * (d - dl[e]) * grad : pr * grad;
              }
            }
          }
        }
      }
    };
    // dV += P^T dO, dK += dS^T Q, in each branch: sharing a basic block with the
    // probabilities lets ptxas interleave their exponentials with the mma (as in the
    // forward, flash/fwd_sm80.cuh).
    auto products = [&] {
      if constexpr (kPaired && kDV) {  // P^T (times softcap') to the dK half
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) sP[(warp * kNT + nt) * 32 + lane] = as_float4(dpt[0][nt]);
        named_arrive<1, kPairedWarps * 32>();
      }
      const uint32_t rows_at = 2u * uint32_t(row_w * D);  // the warp's rows of dO and Q
      if constexpr (kDV) product_pb<T, D, kKM, kSW>(dv, st, tdO + rows_at, lds_a);
      if constexpr (kDK) product_pb<T, D, kKM, kSW>(dk, dpt, tQ + rows_at, lds_a);
    };
    const bool plain = !sc_mod.capped && sc_mod.slope == 0.f;
    if constexpr (kPaired && kDK) {  // dS^T = (P^T softcap') (dP^T - D), P^T the dV half's
      named_sync<1, kPairedWarps * 32>();
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const float4 pg = sP[(warp * kNT + nt) * 32 + lane];
        const float2 del = *reinterpret_cast<const float2*>(del_t + nt * 8 + 2 * t);
        float(&d)[4] = dpt[0][nt];
        d[0] = pg.x * (d[0] - del.x), d[1] = pg.y * (d[1] - del.y);
        d[2] = pg.z * (d[2] - del.x), d[3] = pg.w * (d[3] - del.y);
      }
      products();
    } else if (plain && !mask) {
      probs(kProbFast);
      products();
    } else if (kMaskedCopy && plain) {
      probs(kProbMasked);
      products();
    } else {
      probs(kProbGeneral);
      products();
    }
    if (kDK && dq_acc) {  // dQ += dS K (block-uniform)
      // Unpaired: every warp must be done with the tile's dO stage (dP^T, dV) first.
      // Paired: sDs is the dK half's alone, its last reader (the previous tile's dQ)
      // done at this tile's block barrier.
      if (!kPaired) __syncthreads();
      T* sds = !kPaired && bwd_ds_in_dout(D) ? sdO + stage * kS * D : sDs;
      dq_tile_atomic<T, D, kS, kPaired>(dpt, sds, sK_addr, key_w, row_w,
                                        bwd_dq_accum_rows(p, h, s, b, i0 / kAccChunkRows),
                                        bwd_acc_col_chunks(hd), i_hi - i0, hd, lds_a);
    }
  }
  cp_async_wait<0>();      // K and V when there was no tile
  block_sync<kPaired>();  // other threads' copies into this warp's rows of sK / sV too,
                          // and the other warps' dQ reads of sK done

  // With two row warps (kRowWarps), each holds its keys' dK and dV summed over half of
  // every tile's rows: the second passes its sums through the Q / dO stages (free now;
  // 16-byte stores in lane order, no bank conflict), the first adds them and stores.
  if constexpr (kRowWarps > 1) {
    static_assert(kRowWarps == 2, "two row warps at most");
    constexpr int kHeld = (kDK ? 1 : 0) + (kDV ? 1 : 0);  // gradients a block holds
    constexpr int kSums = kKM * kDT * kHeld;                // float4 a lane
    static_assert(kKeyWarps * kSums * 32 * 16 <= 2 * kStages * kS * D * int(sizeof(T)),
                  "the dK / dV partial sums must fit the Q and dO stages");
    float4* sums = reinterpret_cast<float4*>(sQ) + (key_w / (16 * kKM)) * kSums * 32 + lane;
    // the lane's float4 of n8 tile dt of key tile m, dK (which 0) or dV: one slot for
    // both warps
    auto sum_at = [&](int m, int dt, int which) -> float4& {
      return sums[32 * ((m * kDT + dt) * kHeld + which)];
    };
    const bool second = row_w != 0;
    if (second) {
#pragma unroll
      for (int m = 0; m < kKM; ++m) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          if constexpr (kDK) sum_at(m, dt, 0) = as_float4(dk[m][dt]);
          if constexpr (kDV) sum_at(m, dt, kHeld - 1) = as_float4(dv[m][dt]);
        }
      }
    }
    __syncthreads();
    if (second) return;  // no block barrier follows
#pragma unroll
    for (int m = 0; m < kKM; ++m) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if constexpr (kDK) add4(dk[m][dt], sum_at(m, dt, 0));
        if constexpr (kDV) add4(dv[m][dt], sum_at(m, dt, kHeld - 1));
      }
    }
  }
  // Keys [num_k, num_k_rows) own gradient rows too: they saw nothing, so theirs are 0.
#pragma unroll
  for (int m = 0; m < kKM; ++m) {
    const int key = key_w + 16 * m;  // of the block
    const int rows = min(16, s.num_k_rows - n0 - key);
    const int64_t off = (s.k_start + n0 + key) * kv_stride + int64_t(hk) * hd;
    if constexpr (kDK) {
      bwd_store_rows<T, D>(sK + key * D, dk[m], p.softmax_scale, static_cast<T*>(p.dk) + off,
                           kv_stride, rows, hd, vec);
    }
    if constexpr (kDV) {
      bwd_store_rows<T, D>(sV + key * D, dv[m], 1.f, static_cast<T*>(p.dv) + off, kv_stride,
                           rows, hd, vec);
    }
  }
}

// Grid (key blocks x (2 at d256, else 1), kv heads, batch + 1 padding block). At d256
// the even block of a pair accumulates dV, the odd one dK, over the same 64 keys.
template <typename T, int D>
__device__ void flash_bwd_dkdv_sm80(const xla_attn_flash_bwd_params& p) {
  if (dkdv_padding_block<T>(p)) return;
  if constexpr (sm80::bwd_split_grads(D)) {
    if (blockIdx.x % 2 == 0) {
      flash_bwd_dkdv_sm80_block<T, D, kGradDV>(p, blockIdx.x / 2);
    } else {
      flash_bwd_dkdv_sm80_block<T, D, kGradDK>(p, blockIdx.x / 2);
    }
  } else {
    flash_bwd_dkdv_sm80_block<T, D, kGradBoth>(p, blockIdx.x);
  }
}

// The paired d256 kernel (sm80_tiles.h, bwd_paired_smem_bytes): 8 warps, grid (key
// blocks, kv heads, batch + 1 padding block).
template <typename T, int D>
__device__ void flash_bwd_dkdv_paired_sm80(const xla_attn_flash_bwd_params& p) {
  if (dkdv_padding_block<T>(p)) return;
  if (threadIdx.x < sm80::kThreads) {
    flash_bwd_dkdv_sm80_block<T, D, kGradDV, true>(p, blockIdx.x);
  } else {
    flash_bwd_dkdv_sm80_block<T, D, kGradDK, true>(p, blockIdx.x);
  }
}

template <typename T, int D>
__device__ void flash_bwd_dq_sm80(const xla_attn_flash_bwd_params& p) {
  using namespace sm80;
  constexpr int kB = kBwdBlock;            // query rows of the block
  constexpr int kS = bwd_stream_block(D);  // keys of a streamed tile
  constexpr int kNT = kS / 8;  // n8 tiles of S (keys) per warp
  constexpr int kDT = D / 8;   // n8 tiles of dQ
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kB * D;
  T* sK = sdO + kB * D;             // [kStages][kS x D]
  T* sV = sK + kStages * kS * D;    // [kStages][kS x D]

  const int h = blockIdx.y, b = blockIdx.z, hd = p.head_dim;
  if (dq_padding_block<T>(p)) return;
  const Sequence s = bwd_sequence(p, b);
  const int m0 = blockIdx.x * kB;
  if (m0 >= s.num_q) return;
  const int hk = h / (p.num_heads / p.num_heads_k);
  const int64_t q_stride = int64_t(p.num_heads) * hd, kv_stride = int64_t(p.num_heads_k) * hd;
  const int64_t row0 = s.q_start + m0;
  const T* q = static_cast<const T*>(p.q) + row0 * q_stride + int64_t(h) * hd;
  const T* dout = static_cast<const T*>(p.dout) + row0 * q_stride + int64_t(h) * hd;
  const T* out = static_cast<const T*>(p.out) + row0 * q_stride + int64_t(h) * hd;
  const T* k = static_cast<const T*>(p.k) + s.k_start * kv_stride + int64_t(hk) * hd;
  const T* v = static_cast<const T*>(p.v) + s.k_start * kv_stride + int64_t(hk) * hd;
  const Window win{p.window_left, p.window_right};
  const bool vec = bwd_vec(hd, p.q, p.k, p.v, p.dout, p.dq);
  const int rows_valid = s.num_q - m0;
  int n_lo, n_hi;
  const int m_last = min(m0 + kB, s.num_q) - 1;
  win.key_range(m0, m_last, s.offset, s.num_k, &n_lo, &n_hi);
  const int tiles = (n_hi - n_lo + kS - 1) / kS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const LdsmLane<D> lds_a = LdsmLane<D>::a_operand(lane), lds_b = LdsmLane<D>::b_operand(lane);
  const uint32_t sQ_addr = smem_addr(sQ), sdO_addr = smem_addr(sdO), sK_addr = smem_addr(sK),
                 sV_addr = smem_addr(sV);
  const RowCopier<D, kB> q_copier(q_stride);
  const RowCopier<D, kS> kv_copier(kv_stride);
  bwd_load<D>(sQ_addr, sQ, q_copier, q, q_stride, rows_valid, hd, vec);
  bwd_load<D>(sdO_addr, sdO, q_copier, dout, q_stride, rows_valid, hd, vec);
  cp_async_commit();
  auto issue = [&](int j, int stage) {
    const int n0 = n_lo + j * kS;
    const uint32_t at = 2u * uint32_t(stage * kS * D);
    bwd_load<D>(sK_addr + at, sK + stage * kS * D, kv_copier, k + n0 * kv_stride, kv_stride,
                n_hi - n0, hd, vec);
    bwd_load<D>(sV_addr + at, sV + stage * kS * D, kv_copier, v + n0 * kv_stride, kv_stride,
                n_hi - n0, hd, vec);
    cp_async_commit();
  };
  if (tiles > 0) issue(0, 0);

  // This lane's rows g and g + 8 of the warp: lse (base 2) and D = dO . O, the latter
  // computed here (the dkdv pass's scratch under dq is being overwritten by now).
  float lse2[2], delta[2] = {0.f, 0.f};
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = warp * 16 + g + 8 * hf;
    lse2[hf] = r < rows_valid ? p.softmax_lse[int64_t(h) * p.total_q + row0 + r] * kLog2e
                              : XLA_ATTN_INF;
  }
  for (int r = 0; r < 16; ++r) {
    const int rr = min(warp * 16 + r, rows_valid - 1);  // clamped rows are never written
    const float d =
        row_delta(dout + rr * q_stride, out + rr * q_stride, hd) - lse_cotangent(p, h, row0 + rr);
    if (r == g) delta[0] = d;
    if (r == g + 8) delta[1] = d;
  }
  const bool capped = p.softcap > 0.f;
  const BwdScore mod{capped ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e,
                     p.softcap * kLog2e,
                     (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f) *
                         kLog2e,
                     capped};

  // Keys every row of the block sees, as in the forward (fwd_sm80.cuh, full_lo).
  int full_lo, full_hi;
  win.keys_seen_by_all(m0, m_last, s.offset, s.num_k, &full_lo, &full_hi);
  full_hi = min(full_hi, n_hi);

  float dq[1][kDT][4] = {};  // one m16 tile a warp
  for (int j = 0; j < tiles; ++j) {
    const int n0 = n_lo + j * kS, stage = j % kStages;
    cp_async_wait<0>();  // (Q, dO,) K_j, V_j
    __syncthreads();
    if (j + 1 < tiles) issue(j + 1, (j + 1) % kStages);

    // S = Q K^T and dP = dO V^T for the warp's 16 rows x kS keys.
    const uint32_t tK = sK_addr + 2u * uint32_t(stage * kS * D);
    const uint32_t tV = sV_addr + 2u * uint32_t(stage * kS * D);
    float sc[1][kNT][4] = {}, dp[1][kNT][4] = {};
    two_products<T, D, 1, kS>(sc, dp, sQ_addr, sdO_addr, warp * 16, tK, tV, 0, lds_a, lds_b);

    // dS in place of S. Element (hf, nt, e): row m0 + warp*16 + g + 8 hf, key n0 + 8 nt + 2t + e;
    // the common tile a copy of its own, as in the dkdv kernel.
    const bool mask = (n0 < full_lo) | (n0 + kS > full_hi);
    // Called with a constant: inlined, each call is a copy specialised on it.
    auto grads = [&](const bool kFast) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int64_t pos = int64_t(m0) + warp * 16 + g + 8 * hf + s.offset;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[0][nt][2 * hf + e];
            const float d = dp[0][nt][2 * hf + e];
            if (kFast) {
              x = fast_exp2(fmaf(x, mod.mul, -lse2[hf])) * (d - delta[hf]);
            } else {
              const int key = n0 + nt * 8 + 2 * t + e;
              float grad;
              float pr = mod.prob(x, pos, key, lse2[hf], &grad);
              if (mask && !(key < n_hi && win.visible(pos, key))) pr = 0.f;
              x = pr * (d - delta[hf]) * grad;
            }
          }
        }
      }
    };
    // dQ += dS K, in each branch (as dV and dK above).
    if (!mask && !mod.capped && mod.slope == 0.f) {
      grads(true);
      product_pb<T, D, 1, kS>(dq, sc, tK, lds_a);
    } else {
      grads(false);
      product_pb<T, D, 1, kS>(dq, sc, tK, lds_a);
    }
  }
  cp_async_wait<0>();  // Q and dO when there was no tile
  __syncthreads();     // other threads' copies into this warp's rows of sQ too
  bwd_store_rows<T, D>(sQ + warp * 16 * D, dq[0], p.softmax_scale,
                       static_cast<T*>(p.dq) + (row0 + warp * 16) * q_stride + int64_t(h) * hd,
                       q_stride, min(16, rows_valid - warp * 16), hd, vec);
}

}  // namespace xla_attn
