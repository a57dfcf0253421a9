// The sm90 forward's pieces of one consumer warpgroup's tile (fwd_sm90.cuh has the
// kernel and the family's structure): S = Q K^T issued (issue_qk), O += P V issued
// (issue_pv_on), O's rescale and P's rounding, the softmax against the running max and
// its fallback (softmax_at_running_max, softmax_of_landed_s), the tiles a warpgroup's
// rows see (warpgroup_tiles), a tile loop with the products one after the other
// (tiles_in_turn), and an item's end: the rows finished (finish_rows) and O written out
// (write_o_rows).
#pragma once
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "flash/fwd_sm80.cuh"
#include "flash/sm90_tiles.h"

namespace xla_attn {
namespace flash_sm90 {


// A consumer warpgroup's 64 rows of O (block rows row0 .., the block's first at query
// m0), staged by its threads (wt: 0 .. 127) as T in the Q tile layout at sQ (column
// blocks of kBlockM 128-byte rows, 128-byte swizzled), out to p.out. Where all 64 rows
// are the sequence's, one thread copies them out by bulk tensor stores (o_map, a box a
// column block; columns past head_dim are clipped by the map) and waits until the copy
// engine has read the rows, so that the buffer can take the next Q; else (a sequence's
// last rows, whose neighbours belong to the next one, or out not 16-byte aligned) every
// thread copies 16-byte chunks of its rows. The threads' copy loop was 11 % of the d128
// walk's warp samples at S = 512 (ncu, H100: 30 instructions a chunk, 8 chunks a thread).
// kWaitRead = false (sm90_tiles.h, defers_o_store_read): the copying thread does not wait
// for the copy engine's read here; the walk waits for it in the next item, behind that
// item's first product, before it hands the buffer back (fwd_sm90_walk.cuh,
// settle_o_store).
// kPartialFirst (sm90_tiles.h, partial_block_first): the block's rows end at rows_end,
// not at the sequence's end.
template <typename T, int D, int kBlockM, bool kWaitRead = true, bool kPartialFirst = false>
__device__ __forceinline__ void write_o_rows(const Args& a, uint32_t sQ, int row0, int m0,
                                             const Sequence& s, int h, int hd, int wt, int wg) {
  // made at each use (held from here, the other kernels' machine code changed)
  auto row_end = [&] { return rows_end<kPartialFirst>(m0, s.num_q, kBlockM); };
  constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes;
  constexpr int kColBlocks = D * 2 / kRowBytes;
  const xla_attn_flash_fwd_params& p = a.p;
  if (a.o_by_copy && m0 + row0 + kOStoreRows <= row_end()) {
    sm90::fence_proxy_async_shared();  // the staging stores before the copy engine's reads
    sm90::named_barrier(2 + wg, 128);
    if (wt == 0) {
#pragma unroll
      for (int c = 0; c < kColBlocks; ++c) {
        sm90::tma_store_3d(&a.o_map, sQ + c * kQBlockBytes + uint32_t(row0) * kRowBytes, 64 * c,
                           h, int(s.q_start + m0 + row0));
      }
      sm90::bulk_commit();
      if constexpr (kWaitRead) sm90::bulk_wait<0, /*kRead=*/true>();
    }
    return;
  }
  sm90::named_barrier(2 + wg, 128);
  T* out = static_cast<T*>(p.out) + int64_t(h) * hd;
  const int64_t q_stride = int64_t(p.num_heads) * hd;
  const bool vec_out = aligned_to<T>(p.out, 16);
  constexpr int kChunks = D / 8;  // 16-byte chunks of a row
  for (int idx = wt; idx < kOStoreRows * kChunks; idx += 128) {
    const int r = row0 + idx / kChunks, c = idx % kChunks, i = m0 + r;
    if (i >= row_end() || c * 8 >= hd) continue;
    uint4 x;
    const uint32_t at = sm90::swizzled_chunk(sQ, kQBlockBytes, r, c);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(at));
    sm80::store_chunk(out + (s.q_start + i) * q_stride, x, c * 8, hd, vec_out);
  }
}

// A 16-bit V tile's rows (keys) from `have` on zeroed at tV (kColBlocks column blocks
// of kBlockN 128-byte rows), each of the kConsumers consumer threads (this one tid)
// writing its share, then met at named barrier 1 (from two loops: computed tiles and
// passed ones). The rows past a block's key range may hold the next sequence's keys or
// NaN padding, and 0 x NaN is NaN in P V.
template <int kColBlocks, int kBlockN, int kConsumers>
__device__ __forceinline__ void zero_v_rows_past(uint32_t tV, int have, int tid) {
  for (int c = tid; c < kColBlocks * kBlockN * (kRowBytes / 16); c += kConsumers) {
    if ((c / (kRowBytes / 16)) % kBlockN >= have) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tV + 16u * uint32_t(c)),
                   "r"(0u)
                   : "memory");
    }
  }
  sm90::fence_proxy_async_shared();
  sm90::named_barrier_unaligned(1, kConsumers);  // reached from two loops
}

// S = Q K^T of one consumer warpgroup, issued (not waited for): D / 16 k-steps (fp8:
// D / 32), each 32 bytes further along the 128-byte rows, the next column block every 4
// steps; each operand's descriptor built once and advanced by adds (desc_plus). q_rows:
// the warpgroup's first row of the Q tile (kBlockM rows a column block); k_tile: a K
// tile (block_n rows a column block).
template <typename T, int D, int kBlockM>
__device__ __forceinline__ void issue_qk(float (&s)[block_n(D, sizeof(T)) / 2],
                                         uint32_t q_rows, uint32_t k_tile) {
  constexpr int kBlockN = block_n(D, sizeof(T));
  constexpr int kKSteps = D * int(sizeof(T)) / 32;
  constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes, kKVBlockBytes = kBlockN * kRowBytes;
  const uint64_t q_desc = sm90::smem_desc(q_rows, 16);
  const uint64_t k_desc = sm90::smem_desc(k_tile, 16);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const uint32_t in_row = uint32_t(kk % 4) * 32u;
    const uint64_t dq = sm90::desc_plus(q_desc, uint32_t(kk / 4) * kQBlockBytes + in_row);
    const uint64_t dk = sm90::desc_plus(k_desc, uint32_t(kk / 4) * kKVBlockBytes + in_row);
    if constexpr (sizeof(T) == 1) {
      sm90::wgmma_ss_e4m3<kBlockN>(s, dq, dk, kk > 0);
    } else {
      sm90::wgmma_ss<kBlockN, T>(s, dq, dk, kk > 0);
    }
  }
  sm90::wgmma_commit();
}

// O += P V of one consumer warpgroup, issued: P from registers (pa, block_n keys), B the
// V tile (16-bit: N-major, D columns in column blocks a tile's column block apart, 16
// keys a k-step) or fp8's V^T tile (K-major, 32 keys a k-step along its 128-byte rows).
// Where first_pv_writes_o (sm90_tiles.h), O = P V instead where !accumulate (an item's
// first), so that O needs no zeroing.
template <typename T, int D>
__device__ __forceinline__ void issue_pv_on(
    float (&o)[D / 2], uint32_t (&pa)[block_n(D, sizeof(T)) * sizeof(T) / 32][4],
    uint32_t v_tile, bool accumulate = true) {
  constexpr int kBlockN = block_n(D, sizeof(T));
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr bool kScaleD = first_pv_writes_o(D);
  const uint64_t v_desc = sm90::smem_desc(v_tile, kFp8 ? 16u : kBlockN * kRowBytes);
  sm90::wgmma_hold(o);
  sm90::wgmma_hold(pa);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < int(kBlockN * sizeof(T) / 32); ++kk) {
    if constexpr (kFp8) {
      sm90::wgmma_rs_e4m3<D, kScaleD>(o, pa[kk], sm90::desc_plus(v_desc, uint32_t(kk) * 32u),
                                      kk > 0 || accumulate);
    } else {
      sm90::wgmma_rs<D, T, false, kScaleD>(
          o, pa[kk], sm90::desc_plus(v_desc, uint32_t(kk) * 16u * kRowBytes),
          kk > 0 || accumulate);
    }
  }
  sm90::wgmma_commit();
}

// O's rows times their factors (corr: the softmax's deferred rescale; elements 0, 1 of an
// n8 tile are row g, 2, 3 row g + 8).
template <int kDT>
__device__ __forceinline__ void scale_o_rows(float (&o)[1][kDT][4], const float (&corr)[1][2]) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[0][dt][i] *= corr[0][i / 2];
  }
}

// P (a tile's S after its softmax) rounded into P V's A fragments (pa). Only once the
// previous P V has completed: a register an in-flight product reads may not be written
// (ptxas serializes every wgmma of the kernel otherwise, C7513).
// fp8: k-step kk's 32 keys are n8 tiles 4kk .. 4kk + 3; byte j of a register holds the
// pair element (j & 1) of tile 4kk + (j >> 1) (+2 for registers 2, 3), the order
// transpose_v_e4m3 gives V^T's keys.
template <typename T, int kPSteps, int kNT>
__device__ __forceinline__ void round_p(uint32_t (&pa)[kPSteps][4],
                                        const float (&sc)[1][kNT][4]) {
#pragma unroll
  for (int kk = 0; kk < kPSteps; ++kk) {
    if constexpr (sizeof(T) == 1) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float(&lo)[4] = sc[0][4 * kk + 2 * (r / 2)];
        const float(&hi)[4] = sc[0][4 * kk + 2 * (r / 2) + 1];
        const int e = 2 * (r % 2);  // row g (elements 0, 1) or g + 8 (2, 3)
        pa[kk][r] = sm80::pack4_e4m3(lo[e], lo[e + 1], hi[e], hi[e + 1]);
      }
    } else {
      sm80::accum_to_a<T>(pa[kk], sc[0][2 * kk], sc[0][2 * kk + 1]);
    }
  }
}

// A consumer thread's epilogue: its rows (block row r0 = its warpgroup's first + warp *
// 16 + g, and r0 + 8) of O normalised and rounded, staged in the warpgroup's own rows of
// the Q buffer sQ (its last S product has completed; the other warpgroups read only
// their own rows) in the tile layout for write_o_rows; lse per row. fp8: O is scaled by
// v_descale and, bf16 being wider than the Q rows it would be staged in, stored from
// registers (pairs of columns). kPartialFirst: as write_o_rows.
template <typename T, int D, int kBlockM, bool kPartialFirst = false>
__device__ __forceinline__ void finish_rows(const xla_attn_flash_fwd_params& p,
                                            const float (&o)[1][D / 8][4], const float (&m)[1][2],
                                            const float (&l)[1][2], uint32_t sQ, int row0,
                                            int warp, int g, int t, int m0, const Sequence& s,
                                            int h, int hd) {
  constexpr bool kFp8 = sizeof(T) == 1;
  using Out = Select<kFp8, __nv_bfloat16, T>;
  constexpr int kDT = D / 8;
  constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes;
  const int64_t q_stride = int64_t(p.num_heads) * hd;
  const float out_scale = descale<T>(p.v_descale);
  const int row_end = rows_end<kPartialFirst>(m0, s.num_q, kBlockM);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = l[0][hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    // MUFU reciprocal and logarithm (~1 ulp), as the sm80 kernel's epilogue.
    const float inv = sum > 0.f ? __fdividef(out_scale, sum) : 0.f;
    const int r = row0 + warp * 16 + g + 8 * hf, i = m0 + r;
    if constexpr (kFp8) {
      if (i < row_end) {
        Out* row = static_cast<Out*>(p.out) + (s.q_start + i) * q_stride + int64_t(h) * hd;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const int col = 8 * dt + 2 * t;
          if (col < hd) {
            *reinterpret_cast<uint32_t*>(row + col) =
                sm80::pack2<Out>(o[0][dt][2 * hf] * inv, o[0][dt][2 * hf + 1] * inv);
          }
        }
      }
    }
#pragma unroll
    for (int dt = 0; dt < kDT && !kFp8; ++dt) {
      const uint32_t at = sm90::swizzled_chunk(sQ, kQBlockBytes, r, dt) + 4u * uint32_t(t);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(at),
                   "r"(sm80::pack2<T>(o[0][dt][2 * hf] * inv, o[0][dt][2 * hf + 1] * inv))
                   : "memory");
    }
    if (t == 0 && i < row_end && p.softmax_lse) {
      p.softmax_lse[int64_t(h) * p.total_q + s.q_start + i] =
          sum > 0.f ? m[0][hf] * kLn2 + __logf(sum) : XLA_ATTN_INF;
    }
  }
}

// softmax_of_landed_s's softmax_at_max for one consumer warpgroup (wg) on a tile past its
// item's first: the exponentials against the running max m (TileSoftmax::exps_at_max, `mask`:
// the tile has masked keys), agreed on by the warpgroup (a vote on kVoteBarrier + wg):
// 1 where every lane kept within the bound (l updated), -1 where one did not (S is then
// overwritten in every lane of the warpgroup). Rows without a max yet (m = -inf: a
// window's left edge ahead) take the whole softmax.
template <bool kSkipHalf, int kNT>
__device__ __forceinline__ int softmax_at_running_max(const sm80::TileSoftmax& tsm, bool mask,
                                                      float (&sc)[1][kNT][4],
                                                      const float (&m)[1][2], float (&l)[1][2],
                                                      int wg) {
  float sum[1][2];
  bool ok = m[0][0] > -XLA_ATTN_INF && m[0][1] > -XLA_ATTN_INF;
  if (ok) {
    ok = mask ? tsm.exps_at_max<true, kSkipHalf>(sc, m, sum) : tsm.exps_at_max<false>(sc, m, sum);
  }
  if (!sm90::named_barrier_all(kVoteBarrier + wg, 128, ok)) return -1;
  l[0][0] += sum[0][0];
  l[0][1] += sum[0][1];
  return 1;
}

// Tile j's softmax once S_j has landed (held in s): first against the running max as it
// stands (softmax_at_max(j): 1 done, 0 not tried, S as it was; -1 some exponent may have
// passed 2^kMaxSlack and S was overwritten: S_j is computed again, K_j being still held,
// and waited for with any product in flight), else the whole softmax (softmax(j)); K_j
// released (release_k(j)) as soon as no product of this tile reads it.
template <int kS, typename IssueS, typename SoftmaxAtMax, typename Softmax, typename ReleaseK>
__device__ __forceinline__ void softmax_of_landed_s(int j, float (&s)[kS], IssueS&& issue_s,
                                                    SoftmaxAtMax&& softmax_at_max,
                                                    Softmax&& softmax, ReleaseK&& release_k) {
  const int at_max = softmax_at_max(j);
  if (at_max < 0) {
    issue_s(j);
    sm90::wgmma_wait<0>();
    sm90::wgmma_hold(s);
  }
  release_k(j);
  if (at_max <= 0) softmax(j);
}

// Of an item's `tiles` (kBlockN keys each from key n_lo), those up to the last that holds
// a key some row of a consumer warpgroup sees (its 64 rows from sequence row first_row,
// those below s.num_q). The tiles past them are a causal or windowed block's last tiles,
// which only the block's later rows see: a warpgroup outside ping-pong (three take an
// empty turn of their ring for each) waits for them and releases them without computing.
// With 192-row blocks over 128-key tiles (d64 past 256 causal rows, fp8) a causal S =
// 512 / 1024 / 2048 / 4096 / 8192 has 26 / 25 / 10 / 8 / 3 % fewer warpgroup tiles so;
// with 128-row blocks and Lq = Lk none (every warpgroup sees some key of the diagonal
// tile). H100, same run: d64 causal S = 2048 / 4096 +4-5 %, fp8 d128 causal S = 4096 +5 %.
template <int kBlockN>
__device__ __forceinline__ int warpgroup_tiles(const Window& win, const Sequence& s,
                                               int first_row, int n_lo, int tiles) {
  const int last_row = min(first_row + 64, s.num_q) - 1;
  if (last_row < first_row) return 0;  // no row of the warpgroup is the sequence's
  int lo, hi;
  win.key_range(first_row, last_row, s.offset, s.num_k, &lo, &hi);
  return hi <= n_lo ? 0 : min(tiles, (hi - n_lo + kBlockN - 1) / kBlockN);
}

// A consumer warpgroup's tiles 0 .. tiles - 1 with its products one after the other
// (sm90_tiles.h, overlaps_products): S_j issued and waited for, its softmax
// (softmax_of_landed_s), O rescaled and P (p_ready(j); no product is writing O), then
// P_j V_j issued and waited for and V_j released (release_v(j)).
// With three consumer warpgroups they take turns in a ring (sm90_tiles.h, turn_ring;
// elsewhere my_turn and their_turn do nothing): a turn issues P_{j-1} V_{j-1}, waits for
// it and issues S_j (the item's first turn: S_0 alone; its last: P V alone), then hands
// over before S_j is waited for, so that one warpgroup's products run while the other two
// compute their softmaxes. my_turn() waits for this warpgroup's turn, their_turn() hands
// it to the next; every warpgroup takes the item's tiles + 1 turns (consume_item adds
// empty ones for the tiles it passes), so that the ring's order holds. S_j issued at the
// turn's end instead, beside P_{j-1} V_{j-1} or after the loop's back edge, made ptxas
// serialize the products (C7512 / C7515: S live across the back edge at 160 registers).
template <int kS, int kO, typename IssueS, typename SoftmaxAtMax, typename Softmax,
          typename ReleaseK, typename PReady, typename IssuePv, typename ReleaseV,
          typename MyTurn, typename TheirTurn>
__device__ __forceinline__ void tiles_in_turn(int tiles, float (&s)[kS], float (&o)[kO],
                                              IssueS&& issue_s, SoftmaxAtMax&& softmax_at_max,
                                              Softmax&& softmax, ReleaseK&& release_k,
                                              PReady&& p_ready, IssuePv&& issue_pv,
                                              ReleaseV&& release_v, MyTurn&& my_turn,
                                              TheirTurn&& their_turn) {
  for (int j = 0; j < tiles; ++j) {
    if (j == 0) my_turn();  // else taken for P_{j-1} V_{j-1}, below
    issue_s(j);
    their_turn();
    sm90::wgmma_wait<0>();
    sm90::wgmma_hold(s);
    softmax_of_landed_s(j, s, issue_s, softmax_at_max, softmax, release_k);
    p_ready(j);
    my_turn();
    issue_pv(j);
    sm90::wgmma_wait<0>();
    sm90::wgmma_hold(o);
    release_v(j);
    if (j + 1 == tiles) their_turn();
  }
}

}  // namespace flash_sm90
}  // namespace xla_attn
