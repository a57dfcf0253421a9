// Flash attention forward, sm90 family (sm_90a; f16 and bf16): FlashAttention-2's
// online softmax on Hopper's own instructions (the FA3 paper's structure, arXiv
// 2407.08608): tiles land by bulk tensor copies (TMA) on mbarriers, products run as
// warpgroup wgmma, and the block is warp-specialized.
//
// A block works through items of kBlockM (128) query rows of one head of one sequence
// (a persistent grid, one block an SM):
// - warpgroup 0, the producer: one thread copies each item's Q (into one of q_stages
//   buffers) and then each K / V tile into kStages shared-memory stages, each copy
//   completing on its stage's full barrier, a stage refilled once both consumers have
//   released it (its empty barrier);
// - warpgroups 1 and 2, the consumers, 64 query rows each: S = Q K^T (wgmma, both
//   operands in shared memory), the online softmax in registers (sm80::TileSoftmax, the
//   same code as the sm80 family: the accumulator fragments are mma.sync's), P rounded
//   to 16 bits in registers and O += P V (wgmma, P from registers, V read N-major).
//
// The contract is the sm80 kernel's for what this family takes (the launcher sends the
// rest there): varlen, seqused_k, GQA, causal / sliding window, softcap, ALiBi, lse
// (+inf for rows that see no key), batch_used, decode_max_q; not paged K/V, not split-KV,
// and head_dim % 8 == 0 with 16-byte aligned tensors (the copy engine's strides).
//
// Rows past a sequence: the copy engine reads whole boxes, so a tile's rows past the
// sequence's keys hold the next sequence's or padding data (NaN, say). Their scores
// are masked by a select; their V rows are zeroed in shared memory before P V (0 x NaN
// would be NaN); output rows past the sequence's queries are not written.
#pragma once
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "flash/fwd_sm80.cuh"
#include "flash/sm90_tiles.h"

namespace xla_attn {

template <typename T, int D>
__device__ void flash_fwd_sm90(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  constexpr int kBlockN = block_n(D);
  constexpr int kColBlocks = D / 64;  // 64-column blocks of a row
  constexpr int kNT = kBlockN / 8;    // n8 tiles of S
  constexpr int kDT = D / 8;          // n8 tiles of O
  constexpr int kQStages = q_stages(D);
  constexpr bool kPersistent = persistent(D);
  constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes;   // one column block of Q
  constexpr uint32_t kQBytes = kColBlocks * kQBlockBytes;
  constexpr uint32_t kKVBlockBytes = kBlockN * kRowBytes;  // one column block of K or V
  constexpr uint32_t kKVBytes = kColBlocks * kKVBlockBytes;
  const xla_attn_flash_fwd_params& p = a.p;
  extern __shared__ __align__(128) unsigned char smem[];

  // A persistent grid (at most one block an SM; sm90_tiles.h, persistent): block x takes
  // work items x, x + gridDim.x, ... (work_item), so that the producer copies the next
  // item's Q and first tiles while the consumers still finish the current one; else
  // block x takes item x alone. The rows past the last real sequence are zeroed first,
  // one head per block in turn.
  const int batch = real_batch(p.batch, p.batch_used);
  const int row_blocks = max(1, (p.max_seqlen_q + kBlockM - 1) / kBlockM);  // as the launcher
  const int items = row_blocks * p.num_heads * batch;
  for (int h = blockIdx.x; h < p.num_heads; h += gridDim.x) zero_padding_rows<T>(p, h, batch);
  // Item w: row block w / (heads x sequences) counted from the last (the longest causal
  // blocks first, as FwdBlock::locate orders a grid's), then heads, then sequences.
  struct ItemIndex {
    int w, heads, per_row_block, row_blocks;
    __device__ __forceinline__ int x() const { return w / per_row_block; }
    __device__ __forceinline__ int y() const { return w % per_row_block % heads; }
    __device__ __forceinline__ int z() const { return w % per_row_block / heads; }
    __device__ __forceinline__ int nx() const { return row_blocks; }
  };
  auto work_item = [&](int w, FwdBlock& blk) {
    return blk.locate<T>(p, kBlockM, kBlockN,
                         ItemIndex{w, p.num_heads, p.num_heads * batch, row_blocks});
  };
  auto tiles_of = [&](const FwdBlock& blk) { return (blk.n_hi - blk.n_lo + kBlockN - 1) / kBlockN; };

  const uint32_t base = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
  const uint32_t sQ = base;  // + (item % kQStages) * kQBytes
  const uint32_t sK = sQ + kQStages * kQBytes;
  const uint32_t sV = sK + kStages * kKVBytes;
  const uint32_t bars = sV + kStages * kKVBytes;
  // Per K/V stage: full_k, full_v (the producer's copies landed), empty_k, empty_v (both
  // consumer warpgroups are done reading). K and V are released apart: K_j once S_j is
  // computed, a whole softmax and P V earlier than V_j, so that the producer can land
  // K_{j+2} while tile j + 1 is still being consumed. Per Q stage: full_q, empty_q (the
  // consumers' epilogue, which stages O in the Q rows, is done). Every barrier completes
  // one phase per use, in order, and each side counts its uses (tile and item counters
  // that run on across work items), so a parity wait is never more than a phase behind.
  enum { kFullK, kFullV, kEmptyK, kEmptyV };
  auto bar = [&](int kind, int st) { return bars + 8u * uint32_t(kind * kStages + st); };
  auto q_bar = [&](int empty, int qs) {
    return bars + 8u * uint32_t(4 * kStages + empty * kQStages + qs);
  };
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(bar(kFullK, st));
      sm90::mbar_init(bar(kFullV, st));
      sm90::mbar_init(bar(kEmptyK, st), 4 * kConsumerWarpgroups);  // one arrival a warp
      sm90::mbar_init(bar(kEmptyV, st), 4 * kConsumerWarpgroups);
    }
    for (int qs = 0; qs < kQStages; ++qs) {
      sm90::mbar_init(q_bar(0, qs));
      sm90::mbar_init(q_bar(1, qs), 4 * kConsumerWarpgroups);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();
  auto parity = [](int use, int stages) { return uint32_t(use / stages) & 1u; };

  if (threadIdx.x < 128) {
    // The producer. Coordinates are (column, head, row), innermost first; boxes past
    // the tensor's rows or head_dim read as zeros.
    sm90::regs_release<kProducerRegs>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tensor_map(&a.q_map);
      sm90::prefetch_tensor_map(&a.k_map);
      sm90::prefetch_tensor_map(&a.v_map);
      int item = 0, tile = 0;  // uses of the Q and the K/V stages so far
      for (int w = blockIdx.x; w < items; w += kPersistent ? int(gridDim.x) : items) {
        FwdBlock blk;
        if (!work_item(w, blk)) continue;
        const int tiles = tiles_of(blk), qs = item % kQStages;
        if (item >= kQStages) sm90::mbar_wait(q_bar(1, qs), parity(item - kQStages, kQStages));
        // An item without keys copies nothing; its barrier completes on the arrival.
        sm90::mbar_arrive_expect_tx(q_bar(0, qs), tiles > 0 ? kQBytes : 0u);
        for (int c = 0; c < kColBlocks && tiles > 0; ++c) {
          sm90::tma_load_3d(sQ + qs * kQBytes + c * kQBlockBytes, &a.q_map, q_bar(0, qs), 64 * c,
                            blk.h, int(blk.s.q_start + blk.m0));
        }
        ++item;
        // Tile j of the item into stage tile % kStages, each tensor once the stage's
        // previous tile has released it.
        for (int j = 0; j < tiles; ++j, ++tile) {
          const int st = tile % kStages, row = int(blk.s.k_start + blk.n_lo + j * kBlockN);
#pragma unroll
          for (int kind = kFullK; kind <= kFullV; ++kind) {
            if (tile >= kStages) sm90::mbar_wait(bar(kind + 2, st), parity(tile - kStages, kStages));
            sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
            const uint32_t at = (kind == kFullK ? sK : sV) + st * kKVBytes;
            const sm90::TensorMap* map = kind == kFullK ? &a.k_map : &a.v_map;
            for (int c = 0; c < kColBlocks; ++c) {
              sm90::tma_load_3d(at + c * kKVBlockBytes, map, bar(kind, st), 64 * c, blk.hk, row);
            }
          }
        }
      }
    }
  } else {
    sm90::regs_acquire<kConsumerRegs>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. 255
    const int wg = ct / 128, row0 = wg * 64;  // the warpgroup and its first row in the block
    const int warp = (ct % 128) / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
    int item = 0, tile = 0;
    for (int w = blockIdx.x; w < items; w += kPersistent ? int(gridDim.x) : items) {
      FwdBlock blk;
      if (!work_item(w, blk)) continue;
      const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd;
      const int n_lo = blk.n_lo, n_hi = blk.n_hi, tiles = tiles_of(blk);
      const Sequence& s = blk.s;
      const Window& win = blk.win;
      // Counters as constants where each block takes one item (they start at 0).
      const int item0 = kPersistent ? item : 0, tile0 = kPersistent ? tile : 0;
      const int qs = item0 % kQStages;
      const uint32_t tQ = sQ + qs * kQBytes;
      const uint32_t q_parity = parity(item0, kQStages);
      ++item;

      // The score transform in base 2, as flash_fwd_sm80 sets it up (TileSoftmax).
      const bool softcap = p.softcap > 0.f;
      const float mul = softcap ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
      const float cap = p.softcap * kLog2e;
      const float slope =
          (p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f) *
          kLog2e;
      const bool prescale = !softcap && !(mul > 0.f);
      const float exp_mul = softcap || prescale ? 1.f : mul;
      // Keys every row of the block sees, inside its range: tiles there need no mask.
      int full_lo, full_hi;
      win.keys_seen_by_all(m0, min(m0 + kBlockM, s.num_q) - 1, s.offset, s.num_k, &full_lo,
                           &full_hi);
      full_hi = min(full_hi, n_hi);

      float o[1][kDT][4] = {};  // rows g (elements 0, 1) and g + 8 (2, 3) of the warp's 16
      float m[1][2] = {{-XLA_ATTN_INF, -XLA_ATTN_INF}}, l[1][2] = {{0.f, 0.f}};
      float(&o_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(o);
      float sc[1][kNT][4];
      float(&s_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(sc);
      uint32_t pa[kBlockN / 16][4];  // P of the previous tile, P V's A operand
      // Consumer warp's release of a stage (after __syncwarp, every lane's reads of the
      // product that used it have completed).
      auto release = [&](uint32_t barrier) {
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(barrier);
      };

      // S = Q K_j^T, issued (not waited for): D / 16 k-steps, each 32 bytes further along
      // the 128-byte rows, the next column block every 4 steps.
      auto issue_s = [&](int j) {
        const int st = (tile0 + j) % kStages;
        sm90::mbar_wait(bar(kFullK, st), parity(tile0 + j, kStages));
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t at = uint32_t(kk / 4) * kQBlockBytes + uint32_t(kk % 4) * 32u;
          const uint64_t dq = sm90::smem_desc(tQ + at + row0 * kRowBytes, 16);
          const uint64_t dk =
              sm90::smem_desc(sK + st * kKVBytes + uint32_t(kk / 4) * kKVBlockBytes +
                                  uint32_t(kk % 4) * 32u, 16);
          sm90::wgmma_ss<kBlockN, T>(s_flat, dq, dk, kk > 0);
        }
        sm90::wgmma_commit();
      };
      // O += P V_j, issued: block_n / 16 k-steps of 16 keys (2 KB of V rows each); N = D
      // spans the column blocks, kKVBlockBytes apart (the descriptor's leading offset).
      // The last tile's rows past the block's key range are zeroed first (they may hold
      // the next sequence's keys or NaN padding, and 0 x NaN is NaN): both consumer
      // warpgroups read them, so all 256 threads write a share and meet.
      auto issue_pv = [&](int j) {
        const int st = (tile0 + j) % kStages, n0 = n_lo + j * kBlockN;
        const uint32_t tV = sV + st * kKVBytes;
        sm90::mbar_wait(bar(kFullV, st), parity(tile0 + j, kStages));
        if (n0 + kBlockN > n_hi) {
          const int have = n_hi - n0;
          for (int c = ct; c < kColBlocks * kBlockN * (kRowBytes / 16); c += 256) {
            if ((c / (kRowBytes / 16)) % kBlockN >= have) {
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tV + 16u * uint32_t(c)),
                           "r"(0u)
                           : "memory");
            }
          }
          sm90::fence_proxy_async_shared();
          sm90::named_barrier(1, 256);
        }
        sm90::wgmma_hold(o_flat);
        sm90::wgmma_hold(pa);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          const uint64_t dv = sm90::smem_desc(tV + uint32_t(kk) * 16u * kRowBytes, kKVBlockBytes);
          sm90::wgmma_rs<D, T>(o_flat, pa[kk], dv);
        }
        sm90::wgmma_commit();
      };
      // The online softmax of tile j's S (sm80::TileSoftmax), in place. O's rescale is
      // handed back (corr, rescale) for after the P V product in flight.
      float corr[1][2];
      bool rescale = false;
      auto softmax = [&](int j) {
        const int n0 = n_lo + j * kBlockN;
        const bool mask = (n0 < full_lo) | (n0 + kBlockN > full_hi);
        const sm80::TileSoftmax tsm{int64_t(m0) + row0 + warp * 16 + g + s.offset, n0, n_hi, t,
                                    win, mul, cap, exp_mul, slope / exp_mul, prescale,
                                    prescale || slope != 0.f, false, nullptr};
        rescale = false;
        auto defer = [&](const float (&c)[1][2]) {
          corr[0][0] = c[0][0];
          corr[0][1] = c[0][1];
          rescale = true;
        };
        if (!(mask | softcap)) {
          tsm.run_with<false, false>(sc, m, l, defer);
        } else if (!softcap) {
          tsm.run_with<true, false>(sc, m, l, defer);
        } else if (!mask) {
          tsm.run_with<false, true>(sc, m, l, defer);
        } else {
          tsm.run_with<true, true>(sc, m, l, defer);
        }
      };
      // P (sc after the softmax) rounded into P V's A fragments. Only once the previous
      // P V has completed: a register an in-flight product reads may not be written
      // (ptxas serializes every wgmma of the kernel otherwise, C7513).
      auto to_p = [&] {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          sm80::accum_to_a<T>(pa[kk], sc[0][2 * kk], sc[0][2 * kk + 1]);
        }
      };

      // FA3's intra-warpgroup overlap: S_j's product runs while this warpgroup issues
      // P_{j-1} V_{j-1}; the softmax of S_j then runs while that P V is in flight, and O
      // is rescaled once it has landed.
      sm90::mbar_wait(q_bar(0, qs), q_parity);  // Q landed (or the item copies none)
      if (tiles > 0) {
        issue_s(0);
        sm90::wgmma_wait<0>();
        sm90::wgmma_hold(s_flat);
        release(bar(kEmptyK, tile0 % kStages));
        softmax(0);  // O is still zero: nothing to rescale
        to_p();
      }
      for (int j = 1; j < tiles; ++j) {
        issue_s(j);
        issue_pv(j - 1);
        sm90::wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
        sm90::wgmma_hold(s_flat);
        release(bar(kEmptyK, (tile0 + j) % kStages));
        softmax(j);
        sm90::wgmma_wait<0>();
        sm90::wgmma_hold(o_flat);
        release(bar(kEmptyV, (tile0 + j - 1) % kStages));
        if (rescale) {
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) o[0][dt][i] *= corr[0][i / 2];
          }
        }
        to_p();
      }
      if (tiles > 0) {
        issue_pv(tiles - 1);
        sm90::wgmma_wait<0>();
        sm90::wgmma_hold(o_flat);
        release(bar(kEmptyV, (tile0 + tiles - 1) % kStages));
      }
      tile += tiles;

      // Epilogue: O normalised and rounded, staged in this warpgroup's own rows of the
      // item's Q stage (its last S product has completed; the other warpgroup reads only
      // its own rows) in the tile layout, then written as 16-byte chunks of whole rows;
      // lse per row. The stage is released to the producer once every warp has read it.
      const int64_t q_stride = int64_t(p.num_heads) * hd;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = l[0][hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        // MUFU reciprocal and logarithm (~1 ulp), as the sm80 kernel's epilogue.
        const float inv = sum > 0.f ? __fdividef(1.f, sum) : 0.f;
        const int r = row0 + warp * 16 + g + 8 * hf, i = m0 + r;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const uint32_t at = sm90::swizzled_chunk(tQ, kQBlockBytes, r, dt) + 4u * uint32_t(t);
          asm volatile("st.shared.u32 [%0], %1;" ::"r"(at),
                       "r"(sm80::pack2<T>(o[0][dt][2 * hf] * inv, o[0][dt][2 * hf + 1] * inv))
                       : "memory");
        }
        if (t == 0 && i < s.num_q && p.softmax_lse) {
          p.softmax_lse[int64_t(h) * p.total_q + s.q_start + i] =
              sum > 0.f ? m[0][hf] * kLn2 + __logf(sum) : XLA_ATTN_INF;
        }
      }
      sm90::named_barrier(2 + wg, 128);
      T* out = static_cast<T*>(p.out) + int64_t(h) * hd;
      const bool vec_out = aligned_to<T>(p.out, 16);
      constexpr int kChunks = D / 8;  // 16-byte chunks of a row
      for (int idx = ct % 128; idx < 64 * kChunks; idx += 128) {
        const int r = row0 + idx / kChunks, c = idx % kChunks, i = m0 + r;
        if (i >= s.num_q || c * 8 >= hd) continue;
        uint4 x;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "r"(sm90::swizzled_chunk(tQ, kQBlockBytes, r, c)));
        sm80::store_chunk(out + (s.q_start + i) * q_stride, x, c * 8, hd, vec_out);
      }
      // Every warp's staged rows are read, and its S products are long done: the Q stage
      // is free for the producer's copy of a later item. The fence orders this warp's
      // reads and writes of it before the copy engine's write.
      sm90::fence_proxy_async_shared();
      release(q_bar(1, qs));
    }
  }
}

}  // namespace xla_attn
