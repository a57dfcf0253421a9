// Flash attention forward, sm90 family (sm_90a; f16, bf16, fp8 e4m3): FlashAttention-2's
// online softmax on Hopper's own instructions (the FA3 paper's structure, arXiv
// 2407.08608): tiles land by bulk tensor copies (TMA) on mbarriers, products run as
// warpgroup wgmma, and the block is warp-specialized.
//
// One block = kBlockM (128, or 192 with three consumers) query rows of one head of one
// sequence:
// - warpgroup 0, the producer: one thread copies Q once and then each K / V tile into
//   rings of shared-memory stages (sm90_tiles.h), each copy completing on its stage's
//   full barrier, a stage refilled once every consumer warp has released it (its empty
//   barrier);
// - warpgroups 1 .. kWgs, the consumers, 64 query rows each: S = Q K^T (wgmma, both
//   operands in shared memory), the online softmax in registers (sm80::TileSoftmax, the
//   same code as the sm80 family: the accumulator fragments are mma.sync's), P rounded
//   to 16 bits in registers and O += P V (wgmma, P from registers, V read N-major);
//   with two consumers they take turns issuing products (ping-pong, below).
//
// The contract is the sm80 kernel's for what this family takes (the launcher sends the
// rest there): varlen, seqused_k, GQA, causal / sliding window, softcap, ALiBi, lse
// (+inf for rows that see no key), batch_used, decode_max_q, paged K/V (block sizes
// whose gcd with block_n is a multiple of 8); not split-KV, and head_dim % 8 == 0 with
// 16-byte aligned tensors (the copy engine's strides).
//
// Paged K/V: a tile's rows come in boxes of kv_box_rows keys (sm90_tiles.h, Args), each
// box from the row its page starts at. The block table is untrusted: a box whose page
// index is outside [0, num_blocks) is copied from past the cache's last row, which the
// copy engine reads as zeros without touching memory, and its keys are masked: each
// consumer warp looks its tile's boxes up itself (a lane a box) and, where one has no
// page, writes valid bytes for sm80::TileSoftmax in its own slice of shared memory
// (published by __syncwarp alone: the producer's copies cannot tell the consumers).
//
// fp8 (e4m3 q, k, v with q/k/v_descale; bf16 out; head dims up to 128 in one 128-byte
// column block, the d64 bucket's upper half zeros, 129-256 in two: sm90_tiles.h,
// fp8_bucket; 128-key tiles in every bucket): S = Q K^T on m64n128k32 e4m3 products; P is
// rounded to e4m3 in registers for P V. 8-bit wgmma reads B only K-major, and P V's K is
// the keys, so the producer warpgroup transposes each V tile in shared memory into a V^T
// tile (below, transpose_v_e4m3) while the consumers compute, then releases it on a
// full_vt barrier.
// The descales scale the scores (q_descale * k_descale) and O (v_descale).
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

// One kBlockN-key V tile of e4m3 (rows = keys, in 128-byte column blocks, swizzled as the
// copy engine lands them) into V^T (rows = head dims, the first D, kBlockN bytes of keys in
// 128-byte rows swizzled the same way), as the K-major B operand of P V, by the producer's
// transposing warps. Keys are permuted inside each 16: V^T column 16c + 4t + j holds key
// 16c + 2t + (j & 1) + 8 (j >> 1), the key whose score sits in byte j of the P register
// that the consumers pack from accumulator pairs (2t, 2t + 1) and (2t + 8, 2t + 9) (to_p),
// so P needs no shuffle. Keys at or past `have` read as zeros (rows past the sequence may
// hold NaN). A warp moves a 16-key x 32-dim block a step: one ldmatrix.x4.trans (16-bit units: a
// lane gets dims 2g, 2g + 1 of keys 2t, 2t + 1, and of keys 2t + 8, 2t + 9 and dims + 16
// in the other three matrices), 4 byte permutes into 4 keys of one dim a register, one
// stmatrix.x4 (matrix row g = V^T row 2g (+1, +16, +17), bytes 4t.. = keys 4t..). The
// loads hit 8 distinct 16-byte chunks a phase, the stores 4 (2-way): rows 2g + e share
// their swizzle phase in pairs (addresses simulated). With 4-byte loads and stores the
// transpose took ~70 instructions per 16 bytes a lane, and issue slots that the consumer
// warps on the same schedulers needed: the fp8 forward ran at 0.8-1.0x bf16.
// kMaskKeys: the tile holds keys at or past `have` (a sequence's last tile), zeroed.
// d256: the raw tile's dims 128.. in its second column block (kBlockN rows further).
template <int D, bool kMaskKeys>
__device__ __forceinline__ void transpose_v_blocks(uint32_t raw, uint32_t vt, int have, int pt) {
  constexpr uint32_t kKeyBlocks = uint32_t(block_n(D, 1) / 16);
  constexpr uint32_t kBlocks = kKeyBlocks * uint32_t(D / 32);  // key blocks x D / 32 dim blocks
  constexpr uint32_t kRawBlockBytes = uint32_t(block_n(D, 1)) * 128u;  // a raw column block
  const int lane = pt % 32, warp = pt / 32;
  const int m = lane / 8, r = lane % 8, half = m >> 1, t = lane % 4;
  // this lane's ldmatrix row (key r of matrix m) and stmatrix row (V^T row n_lane)
  const uint32_t ld_row = raw + uint32_t(r + 8 * (m & 1)) * 128u;
  const int n_lane = 16 * half + 2 * r + (m & 1);
  const uint32_t st_row = vt + uint32_t(n_lane) * 128u;
#pragma unroll 1
  for (uint32_t blk = warp; blk < kBlocks; blk += kTransposeWarps) {
    const uint32_t c = blk % kKeyBlocks, xb = blk / kKeyBlocks;  // keys 16c .., dims 32xb ..
    uint32_t x[4];
    if constexpr (D <= 128) {  // one raw column block (the d64 / d128 code as it was)
      sm80::ldsm_x4_trans(x,
                          ld_row + c * 2048u + (((2u * xb + uint32_t(half)) ^ uint32_t(r)) << 4));
    } else {  // raw column block xb / 4, its 32-dim block xb % 4
      sm80::ldsm_x4_trans(x, ld_row + xb / 4u * kRawBlockBytes + c * 2048u +
                                 (((2u * (xb % 4u) + uint32_t(half)) ^ uint32_t(r)) << 4));
    }
    if constexpr (kMaskKeys) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int key = 16 * int(c) + 2 * t + 8 * (q & 1);
        x[q] &= (key < have ? 0xFFFFu : 0u) | (key + 1 < have ? 0xFFFF0000u : 0u);
      }
    }
    const uint32_t y[4] = {__byte_perm(x[0], x[1], 0x6420u), __byte_perm(x[0], x[1], 0x7531u),
                           __byte_perm(x[2], x[3], 0x6420u), __byte_perm(x[2], x[3], 0x7531u)};
    sm90::stsm_x4(st_row + xb * 4096u + ((c ^ uint32_t(n_lane & 7)) << 4), y);
  }
}
// The key mask only where the tile has such keys: tested in every block (a warp-uniform
// branch ptxas wrapped in BSSY / BSYNC), with signed block indices, the loop ran 35
// instructions a block, now 20, and the transposing warps took 18 % of the fp8 kernel's
// stall samples beside three consumer warpgroups (ncu, H100, d128 S=8192). H100, same run:
// +0..+1 % up to S=8192, +4 % at 16384: the transposes were not what held the consumers.
template <int D>
__device__ __forceinline__ void transpose_v_e4m3(uint32_t raw, uint32_t vt, int have, int pt) {
  if (have >= block_n(D, 1)) {
    transpose_v_blocks<D, false>(raw, vt, have, pt);
  } else {
    transpose_v_blocks<D, true>(raw, vt, have, pt);
  }
}

// The stage barriers' kinds, bar(kind, st) in both kernels: full_k, full_v (the
// producer's copies landed), empty_k, empty_v (the consumers are done reading); fp8's
// full_vt (V^T written) and empty_raw (the raw V stage back to the copying thread).
enum { kFullK, kFullV, kEmptyK, kEmptyV, kFullVt, kEmptyRaw };

// The kernel setup and producer code both forward kernels share (flash_fwd_sm90, one
// item a block, and flash_fwd_sm90_walk), as consume_item is their consumers': their tile
// shapes and rings (sm90_tiles.h), the shared-memory layout (layout), the barriers
// (init_barriers), fp8's V transposes (transpose_stage) and the producer's copies
// (copy_q, copy_kv, load). Both kernels' PTX and machine code are what they were when each
// wrote these out itself (compared kernel by kernel); where the two had written the same
// step in another order, each keeps its own (below). Tile g sits in stage g % ring: the
// walk counts its tiles over the block's whole walk, one item a block from its item's
// first (g = j); bar(kind, st) and parity(g, ring) are the kernel's barriers.
// kVtGiven (fp8, flash_fwd_sm90's instance for V given transposed: sm90_tiles.h,
// vt_given): no raw V ring, K and V^T ring through kVtGivenStages each, and the
// producer copies V^T tiles (load_vt) where it would copy V.
template <typename T, int D, int kWgs, bool kVtGiven = false>
struct FwdBlockTiles {
  // Enumerators: NVRTC emits static constexpr data members as global variables.
  enum : int {
    kBlockN = block_n(D, int(sizeof(T))),
    kBlockM = block_m(kWgs),  // kWgs consumer warpgroups of 64 rows
    kConsumers = 128 * kWgs,  // consumer threads
    kEB = int(sizeof(T)),  // element bytes: 2, or 1 for e4m3
    kColBlocks = col_blocks(D, kEB),  // 128-byte column blocks of a row
    // Rings of stages (sm90_tiles.h): K, V as copied, fp8's V^T; P V reads V^T or V.
    kKRing = k_stages(D, kEB, kVtGiven),
    kVRing = v_stages(D, kEB, kVtGiven),
    kVtRing = vt_stages(D, kEB, kVtGiven),
    kPvRing = kEB == 1 ? kVtRing : kVRing,
    // setmaxnreg's counts (sm90_tiles.h): the producer warpgroup's, then each consumer's
    kRegsProducer = producer_regs(kWgs, kEB, D),
    kRegsConsumer = consumer_regs(kWgs, kRegsProducer),
  };
  enum : bool { kFp8 = kEB == 1 };
  using Out = Select<kFp8, __nv_bfloat16, T>;  // fp8's output is bf16
  enum : uint32_t {
    kQBlockBytes = kBlockM * kRowBytes,   // one column block of Q
    kKVBlockBytes = kBlockN * kRowBytes,  // one column block of K or V
    kKVBytes = kColBlocks * kKVBlockBytes,
    kVtBytes = vt_bytes(D, kEB),  // fp8: V^T, D rows of kBlockN bytes
    kQBytes = q_bytes(D, kWgs, kEB),  // one Q buffer
  };
  // The shared memory (sm90_tiles.h) from its kAlign-aligned start: q_buffers Q buffers
  // (Q buffer qb at sQ + qb * kQBytes), the K, V and fp8 V^T rings, the barriers (bars),
  // then the valid-bytes slice.
  struct Smem {
    uint32_t sQ, sK, sV, sVt, bars;
    unsigned char* warp_valid;
  };
  static __device__ __forceinline__ Smem layout(unsigned char* smem, int q_buffers) {
    Smem sm;
    sm.sQ = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
    sm.sK = sm.sQ + uint32_t(q_buffers) * kQBytes;
    sm.sV = sm.sK + kKRing * kKVBytes;
    sm.sVt = sm.sV + kVRing * kKVBytes;
    sm.bars = sm.sVt + kVtRing * kVtBytes;
    // paged: each consumer warp's valid bytes (sm90_tiles.h, valid_bytes), generic
    sm.warp_valid = smem + (sm.bars + uint32_t(barrier_bytes(kEB)) - sm80::smem_addr(smem));
    return sm;
  }

  // The barriers, by thread 0 before the block's threads meet: the kernel's Q barriers
  // (init_q), then each stage's (the kinds above).
  template <typename InitQ, typename Bar>
  static __device__ __forceinline__ void init_barriers(InitQ&& init_q, Bar&& bar) {
    if (threadIdx.x == 0) {
      init_q();
      for (int st = 0; st < kKRing; ++st) {
        sm90::mbar_init(bar(kFullK, st));
        sm90::mbar_init(bar(kEmptyK, st), 4 * kWgs);  // one arrival a consumer warp
      }
      for (int st = 0; st < kVRing; ++st) {
        sm90::mbar_init(bar(kFullV, st));
        if constexpr (kFp8) sm90::mbar_init(bar(kEmptyRaw, st));
      }
      for (int st = 0; st < kPvRing; ++st) {
        sm90::mbar_init(bar(kEmptyV, st), 4 * kWgs);
        if constexpr (kFp8) sm90::mbar_init(bar(kFullVt, st));
      }
      sm90::mbar_init_fence();
    }
    __syncthreads();
  }

  // fp8: V tile g into V^T stage g % kVtRing by the producer's warps 1 .. 3, once the
  // copy has landed and the consumers have released that stage's previous V^T tile; the
  // stores are made visible to wgmma (the async proxy) before full_vt is signalled, and
  // the raw stage is handed back to the copying thread (empty_raw) after the named
  // barrier. have(): the tile's keys inside the item's range, a callable so that each
  // kernel keeps its order: one item a block counts them after the waits, the walk
  // before (an int argument reordered the former's PTX).
  template <typename Have, typename Bar, typename Parity>
  static __device__ __forceinline__ void transpose_stage(int g, Have&& have, const Smem& sm,
                                                         Bar&& bar, Parity&& parity) {
    if constexpr (kFp8) {
      const int st = g % kVtRing, raw = g % kVRing;
      sm90::mbar_wait(bar(kFullV, raw), parity(g, kVRing));
      if (g >= kVtRing) sm90::mbar_wait(bar(kEmptyV, st), parity(g - kVtRing, kVtRing));
      transpose_v_e4m3<D>(sm.sV + raw * kKVBytes, sm.sVt + st * kVtBytes, have(),
                          threadIdx.x - 32);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier(kProducerBarrier, 32 * kTransposeWarps);
      if (threadIdx.x == 32) {
        sm90::mbar_arrive(bar(kFullVt, st));
        sm90::mbar_arrive(bar(kEmptyRaw, raw));
      }
    }
  }

  // An item's Q (head h, its first row at row q_row) into Q buffer qb (layout), landing
  // on q_full (the producer's thread 0).
  static __device__ __forceinline__ void copy_q(const Args& a, const Smem& sm, int qb,
                                                uint32_t q_full, int h, int64_t q_row) {
    sm90::mbar_arrive_expect_tx(q_full, kColBlocks * kQBlockBytes);
    for (int c = 0; c < kColBlocks; ++c) {
      sm90::tma_load_3d(sm.sQ + qb * kQBytes + c * kQBlockBytes, &a.q_map, q_full,
                        128 / kEB * c, h, int(q_row));
    }
  }

  // The producer's copies. Coordinates are (column, head, row), innermost first; boxes
  // past the tensor's rows or head_dim read as zeros.
  // Tile g of item blk (its tile starting at key first_key()) into stage g % ring of the
  // ring at tiles_at (kind: its full barrier), each tensor once the stage's previous tile
  // (g - ring) has released it: its (g / ring - 1)-th release. fp8's raw V stages are
  // released by the transposing warps. As each kernel had it: the walk (kWalk) takes that
  // release's parity as parity(g - ring, ring) and makes the tile's first key before the
  // wait (first_key returns it), one item a block as g / ring - 1 and the key after it
  // (an int argument reordered the latter's PTX).
  // Given its ring (the kernels' lambdas read theirs from captured constants, opaque
  // until inlined): with the ring picked from kind inside, ptxas scheduled the d64 and
  // fp8 kernels' copies differently (their K and V rings are the same length).
  template <bool kPaged, bool kWalk, typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void load(const Args& a, int g, N0&& first_key, int kind,
                                              int ring, uint32_t tiles_at,
                                              const sm90::TensorMap* map, const FwdBlock& blk,
                                              int64_t lane_row, Bar&& bar, Parity&& parity) {
    const int st = g % ring;
    if (g >= ring) {
      const int release = kFp8 && kind == kFullV ? kEmptyRaw : kind + 2;
      sm90::mbar_wait</*kParked=*/true>(
          bar(release, st), kWalk ? parity(g - ring, ring) : uint32_t(g / ring - 1) & 1u);
    }
    const int n0 = first_key();
    if (!kPaged) {
      sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
      for (int c = 0; c < kColBlocks; ++c) {
        sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes, map, bar(kind, st),
                          128 / kEB * c, blk.hk, int(blk.s.k_start + n0));
      }
      return;
    }
    // Paged (warp 0): lane i copies box i from the cache row it looked up (lane_row;
    // none: no page, or past the range) once lane 0 has announced the tile's bytes.
    if (threadIdx.x == 0) sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
    __syncwarp();
    const int r = int(threadIdx.x) * a.kv_box_rows;
    if (r < kBlockN) {
      const int at = lane_row >= 0 ? int(lane_row) : int(a.p.total_k);  // past the rows: zeros
      for (int c = 0; c < kColBlocks; ++c) {
        sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes + r * kRowBytes, map,
                          bar(kind, st), 128 / kEB * c, blk.hk, at);
      }
    }
  }

  // Tile g of K and V (item blk's tile from key first_key()), each by load. Paged: the
  // whole of warp 0 runs the copy loop, lane i looking box i's page up (K and V share it;
  // keys: the cache rows) and issuing its copies. H100, d128, S=4096, causal, 16-row
  // boxes: lookups and copies in one thread 225 TFLOP/s, lookups by the lanes and copies
  // in one thread 263-268, both by the lanes 468 (64-row boxes 482-497).
  template <bool kPaged, bool kWalk, typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void copy_kv(const Args& a, const KeyRows& keys, int g,
                                                 N0&& first_key, const FwdBlock& blk,
                                                 const Smem& sm, Bar&& bar, Parity&& parity) {
    int64_t lane_row = -1;
    if (kPaged) {
      const int key = first_key() + int(threadIdx.x) * a.kv_box_rows;
      if (int(threadIdx.x) * a.kv_box_rows < kBlockN && key < blk.n_hi)
        lane_row = keys.row(blk.b, 0, key);
    }
    load<kPaged, kWalk>(a, g, first_key, kFullK, kKRing, sm.sK, &a.k_map, blk, lane_row, bar,
                        parity);
    if constexpr (kVtGiven) {
      load_vt(a, g, first_key, blk, sm, bar, parity);
    } else {
      load<kPaged, kWalk>(a, g, first_key, kFullV, kVRing, sm.sV, &a.v_map, blk, lane_row, bar,
                          parity);
    }
  }

  // kVtGiven (sm90_tiles.h, vt_given): tile g's V^T straight into
  // V^T stage g % kVtRing, landing on full_vt, once the consumers have released the
  // stage's previous tile (empty_v), as transpose_stage waits for it. The tile's keys
  // past the sequence are the zeros flash_fwd_vt_pack wrote; head dims past head_dim
  // read as zeros (rows past the map's).
  template <typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void load_vt(const Args& a, int g, N0&& first_key,
                                                 const FwdBlock& blk, const Smem& sm, Bar&& bar,
                                                 Parity&& parity) {
    const int st = g % kVtRing;
    if (g >= kVtRing) sm90::mbar_wait(bar(kEmptyV, st), parity(g - kVtRing, kVtRing));
    sm90::mbar_arrive_expect_tx(bar(kFullVt, st), kVtBytes);
    sm90::tma_load_3d(sm.sVt + st * kVtBytes, &a.vt_map, bar(kFullVt, st),
                      int(vt_seq_start(blk.s.k_start, blk.b) + first_key()), 0, blk.hk);
  }
};

// A consumer thread's indices (consume_item): tid among the consumer threads (0 ..
// 128 kWgs - 1), its lane, its warpgroup wg, the warpgroup's first row in the block row0,
// its warp in the warpgroup, and g = lane / 4, t = lane % 4 (its rows and column pair
// in the mma fragments).
struct ConsumerThread {
  int tid, lane, wg, row0, warp, g, t;
};

// The shared memory a consumer reads (consume_item): the item's Q buffer, the K, V and
// fp8 V^T rings (sm90_tiles.h), paged: each consumer warp's valid bytes.
struct ConsumerSmem {
  uint32_t sQ, sK, sV, sVt;
  unsigned char* warp_valid;
};

// A consumer thread's share of one item (blk, its keys [n_lo, n_hi) in `tiles` tiles):
// its products, softmax, epilogue and O written out, one source for flash_fwd_sm90 (one
// item a block; kWalk false) and flash_fwd_sm90_walk (its consume; kWalk). Both kernels'
// machine code is what it was when each wrote this out itself (SASS compared kernel by
// kernel; one kernel with a run-time walk ran 3-6 % slower, fwd_sm90_walk.cuh): the few
// kWalk branches below keep each kernel's own order where the other changed ptxas's. Tile
// j sits in stage (g0 + j) % ring (g0: the walk's tiles before the item; 0 for one item a
// block); bar(kind, st) and parity(g, ring) are the kernel's barriers; my_turn() and
// their_turn(last) its ping-pong turns (last: the item's last hand-over). One item a
// block, the consumers wait for Q here (q_full) and warpgroup 1 makes its first hand-over
// here; the walk waits for each item's Q before and makes that hand-over once, before the
// walk. own_tiles (the walk, where warpgroups pass tiles): the warpgroup's tiles from the
// item's record. settle_o_store(): run once, behind the item's first product (before the
// epilogue where there is none), where the walk waits for the previous item's O store
// (sm90_tiles.h, defers_o_store_read); one item a block passes a no-op.
template <typename T, int D, int kWgs, bool kPaged, bool kWalk, bool kVtGiven, typename Bar,
          typename Parity, typename MyTurn, typename TheirTurn, typename Settle>
__device__ __forceinline__ void consume_item(const Args& a, const FwdBlock& blk, int n_lo,
                                             int n_hi, int tiles, const KeyRows& keys,
                                             const ConsumerSmem& sm, uint32_t q_full, int g0,
                                             int own_tiles, const ConsumerThread& th, Bar&& bar,
                                             Parity&& parity, MyTurn&& my_turn,
                                             TheirTurn&& their_turn, Settle&& settle_o_store) {
  // the kernels' tile shapes and rings (FwdBlockTiles, above)
  using Tiles = FwdBlockTiles<T, D, kWgs, kVtGiven>;
  constexpr int kBlockN = Tiles::kBlockN, kBlockM = Tiles::kBlockM;
  constexpr int kConsumers = Tiles::kConsumers, kEB = Tiles::kEB;
  constexpr bool kFp8 = Tiles::kFp8;
  constexpr int kPSteps = kBlockN * kEB / 32;  // P V k-steps (16 keys, fp8 32)
  constexpr int kNT = kBlockN / 8;    // n8 tiles of S
  constexpr int kDT = D / 8;          // n8 tiles of O
  constexpr uint32_t kKVBytes = Tiles::kKVBytes, kVtBytes = Tiles::kVtBytes;
  constexpr int kColBlocks = Tiles::kColBlocks;
  constexpr int kKRing = Tiles::kKRing, kVRing = Tiles::kVRing, kVtRing = Tiles::kVtRing,
                kPvRing = Tiles::kPvRing;
  constexpr bool paged = kPaged;
  const xla_attn_flash_fwd_params& p = a.p;
  const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const int tid = th.tid, lane = th.lane, wg = th.wg, row0 = th.row0, warp = th.warp,
            g = th.g, t = th.t;
  const uint32_t sQ = sm.sQ, sK = sm.sK, sV = sm.sV, sVt = sm.sVt;

  // The score transform in base 2, as flash_fwd_sm80 sets it up (TileSoftmax).
  const sm80::ScoreTransform sx =
      sm80::ScoreTransform::of(p, b, h, descale<T>(p.q_descale) * descale<T>(p.k_descale));
  const bool softcap = sx.softcap, prescale = sx.prescale;
  const float mul = sx.mul, cap = sx.cap, slope = sx.slope, exp_mul = sx.exp_mul;
  // Where a sequence's partial row block comes first (sm90_tiles.h, partial_block_first),
  // a block's rows end at rows_end (the first block's rows past it are the next block's,
  // computed and not written), else at the sequence's end.
  constexpr bool kPartialFirst = partial_block_first(kWgs, kEB, D, kWalk);
  // Keys every row of the block sees, inside its range: tiles there need no mask.
  int full_lo, full_hi;
  win.keys_seen_by_all(m0, min(m0 + kBlockM, rows_end<kPartialFirst>(m0, s.num_q, kBlockM)) - 1,
                       s.offset, s.num_k, &full_lo, &full_hi);
  full_hi = min(full_hi, n_hi);

  // O: rows g (elements 0, 1) and g + 8 (2, 3) of the warp's 16. Where the item's first
  // P V writes it (sm90_tiles.h, first_pv_writes_o), not zeroed here: a warpgroup without
  // a tile zeroes it before its epilogue.
  constexpr bool kFirstPvWritesO = first_pv_writes_o(D);
  float o[1][kDT][4];
  if constexpr (!kFirstPvWritesO) {
#pragma unroll
    for (int x = 0; x < kDT; ++x) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[0][x][i] = 0.f;
    }
  }
  float m[1][2] = {{-XLA_ATTN_INF, -XLA_ATTN_INF}}, l[1][2] = {{0.f, 0.f}};
  float(&o_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(o);
  float sc[1][kNT][4];
  float(&s_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(sc);
  uint32_t pa[kPSteps][4];  // P of the previous tile, P V's A operand
  // Tile j's V stage and phase (fp8: its V^T tile's) are (g0 + j) % kPvRing and
  // parity(g0 + j, kPvRing). The 16-bit kernels carry them from tile to tile (v_stage,
  // v_phase, advanced as each V tile is released: release_v) rather than dividing by the
  // ring (3 stages: a division by 3) at each use; H200, kernel time at the base clock,
  // against dividing: d128 S = 512 / 1024 / 8192 full +1.2 / +1.3 / +2.2 %, 512 causal
  // +1.1 %, varlen +1.2 %, d64 512 causal +1.2 %, 2048 full -0.9 %. Not fp8, whose
  // spills grew with it (d256 32 / 60 -> 40 / 88 bytes) and which ran 0.994-0.998
  // (docs/benchmarks.md, 2026-11-29 (49)).
  constexpr bool kCarryV = !kFp8;
  static_assert(kFp8 ? kPvRing == kVtRing : kPvRing == kVRing, "the V stages P V reads");
  int v_stage = g0 % kPvRing;
  uint32_t v_phase = parity(g0, kPvRing);
  auto v_stage_of = [&](int j) { return kCarryV ? v_stage : (g0 + j) % kPvRing; };
  auto v_phase_of = [&](int j) { return kCarryV ? v_phase : parity(g0 + j, kPvRing); };
  // Consumer warp's release of stage st's K or V (after __syncwarp, every lane's reads
  // of the product that used it have completed). The walk makes the barrier's address
  // before the __syncwarp, one item a block after it: the same work, but the other
  // order changed ptxas's schedule (the d64 paged and three-consumer walk kernels).
  auto release = [&](int kind, int st) {
    if constexpr (kWalk) {
      const uint32_t at = bar(kind, st);
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(at);
    } else {
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bar(kind, st));
    }
  };

  // V stage st (v_stage_of(j)) released once P V_j has completed, and with kCarryV the
  // next tile's stage and phase made
  auto release_v = [&](int st) {
    release(kEmptyV, st);
    if constexpr (kCarryV) {
      if (++v_stage == kPvRing) {
        v_stage = 0;
        v_phase ^= 1u;
      }
    }
  };
  // S = Q K_j^T, issued once K_j has landed (issue_qk)
  auto issue_s = [&](int j) {
    const int st = (g0 + j) % kKRing;
    sm90::mbar_wait(bar(kFullK, st), parity(g0 + j, kKRing));
    issue_qk<T, D, kBlockM>(s_flat, sQ + row0 * kRowBytes, sK + st * kKVBytes);
  };
  // 16-bit: the last tile's V rows past the block's key range are zeroed before P V
  // reads them (they may hold the next sequence's keys or NaN padding, and 0 x NaN is
  // NaN): both consumer warpgroups read them, so all their threads write a share and
  // meet, outside their turns (ping-pong) since both must get here. fp8: the producer
  // zeroes those keys of the V^T tile.
  auto zero_v_tail = [&](int j) {
    const int st = v_stage_of(j), n0 = n_lo + j * kBlockN;
    if (!kFp8 && n0 + kBlockN > n_hi) {
      const uint32_t tV = sV + st * kKVBytes;
      sm90::mbar_wait(bar(kFullV, st), v_phase_of(j));
      const int have = n_hi - n0;
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
  };
  // Tile j's P V operand, V_j (fp8: its V^T tile), waited for; its shared address
  auto pv_tile = [&](int j) {
    const int st = v_stage_of(j);
    if constexpr (kFp8) {
      sm90::mbar_wait(bar(kFullVt, st), v_phase_of(j));
      return sVt + st * kVtBytes;
    } else {
      sm90::mbar_wait(bar(kFullV, st), v_phase_of(j));
      return sV + st * kKVBytes;
    }
  };
  // O += P V_j (first_pv_writes_o: j = 0 writes O), issued once V_j is there (issue_pv_on)
  auto issue_pv = [&](int j) { issue_pv_on<T, D>(o_flat, pa, pv_tile(j), j > 0); };
  // The online softmax of tile j's S (sm80::TileSoftmax), in place. O's rescale is
  // handed back (corr, rescale) for after the P V product in flight.
  float corr[1][2];
  bool rescale = false;
  // paged: whether lane i's box of tile j (keys i * kv_box_rows ..) has a page, looked
  // up as the tile starts (the table read in flight behind S's product); boxes past
  // the tile or the key range count as present (the range masks them).
  auto box_present = [&](int j) {
    const int r = lane * a.kv_box_rows, key = n_lo + j * kBlockN + r;
    return !paged || r >= kBlockN || key >= n_hi || keys.row(b, 0, key) >= 0;
  };
  // Where some box has none, the warp writes its keys' valid bytes (TileSoftmax's
  // valid[]; box_rows >= 8, so 4 adjacent keys share a box) in its own slice.
  unsigned char* const my_valid = sm.warp_valid + (tid / 32) * kBlockN;
  // sm80::TileSoftmax for the tile whose first key is n0 (absent: some key has no page)
  auto tile_softmax = [&](int n0, bool absent) {
    return sm80::TileSoftmax{int64_t(m0) + row0 + warp * 16 + g + s.offset, n0, n_hi, t, win,
                             mul, cap, exp_mul, slope / exp_mul, prescale,
                             prescale || slope != 0.f, absent, my_valid};
  };
  // A masked tile's warps skip the exponentials of its second half where none of their
  // rows sees a key there (TileSoftmax::warp_sees_first_half): a causal block's diagonal
  // tile in the first warpgroup, with 192-row blocks also the next tile in the third.
  // Where three consumer warpgroups share the exponential unit and the tensor cores
  // (128-key tiles): 16-bit d64's m192 kernels and fp8 d128. H100, against main, best of 3
  // and 4 rounds in two runs: bf16 d64 causal S = 1024 / 2048 / 4096 / 16384 +1.9..+2.4 /
  // +2.9 / +2.8..+3.8 / +1.9 %, fp8 d128 causal 512 / 1024 / 2048 +1.8..+2.1 / +0.4 /
  // +2.2..+3.1 %; but rows without a masked tile gained about as much (bf16 d64 full 1024
  // / 4096 +1.9..+2.2 / +3.0 %, fp8 d128 full 2048 +1.8 %), so most of it is the machine
  // code ptxas made of these kernels with the branch, not the exponentials skipped. Not
  // fp8 d64 (causal 512 / 1024 -4.4 / -0.8 %) nor ping-pong's two warpgroups (16-bit d64
  // causal up to 512 rows, d128; best of 2: d64 causal 512 -6.5 %, d128 causal 512 / 1024
  // -4.1 / -2.7 %, varlen -3.1 %). docs/benchmarks.md, 2026-11-27 (35).
  constexpr bool kSkipHalf = kBlockN == 128 && kWgs == 3 && (kFp8 ? D == 128 : D == 64);
  auto softmax = [&](int j, bool present) {
    const int n0 = n_lo + j * kBlockN;
    const uint32_t boxes = paged ? __ballot_sync(0xffffffffu, present) : 0xffffffffu;
    const bool absent = boxes != 0xffffffffu;
    if (absent) {
      for (int x = 4 * lane; x < kBlockN; x += 128) {
        *reinterpret_cast<uint32_t*>(my_valid + x) =
            (boxes >> (x / a.kv_box_rows)) & 1u ? 0x01010101u : 0u;
      }
      __syncwarp();
    }
    const bool mask = (n0 < full_lo) | (n0 + kBlockN > full_hi) | absent;
    const sm80::TileSoftmax tsm = tile_softmax(n0, absent);
    rescale = false;
    auto defer = [&](const float (&c)[1][2]) {
      corr[0][0] = c[0][0];
      corr[0][1] = c[0][1];
      rescale = true;
    };
    // Softcap in a pass of its own behind one uniform branch, then run_with without it
    // (softcap has no prescale, so the operations and their order are run_with<mask,
    // true>'s): two forms of run_with at each of the softmax's call sites instead of
    // four. sm_90a bf16 walks (sass_report): d128 10,184 -> 7,872 instructions, d64
    // 9,776 -> 7,472, d64 three-warpgroup 10,328 -> 7,512 (spills 120 / 192 -> 100 /
    // 124 bytes); fp8 d256 spills 92 / 256 -> 32 / 60. Time unchanged: H200, kernel time
    // at the base clock, 23 configs in two runs, 0.983..1.014 of before, inside the
    // spread; so the walk's size does not limit it (ncu: no-instruction stalls 0.41 ->
    // 0.38 per issued instruction, d128 S = 512). docs/benchmarks.md 2026-11-29 (42).
    if (softcap) tsm.transform_scores<true>(sc);
    if (!mask) {
      tsm.run_with<false, false>(sc, m, l, defer);
    } else {
      tsm.run_with<true, false, kSkipHalf>(sc, m, l, defer);
    }
  };
  // The softmax against the running max as it stands (softmax_of_landed_s; TileSoftmax::
  // exps_at_max) where it pays (sm90_tiles.h, at_running_max): not on an item's first
  // tile (no max yet) nor with softcap, ALiBi, a score factor <= 0 or paged K/V; the
  // warpgroup agrees on the outcome (a barrier with a vote), since S is computed again
  // by all of it.
  constexpr bool kAtMax = !paged && at_running_max(D, kEB);  // sm90_tiles.h
  auto softmax_at_max = [&](int j) {
    if constexpr (!kAtMax) {
      return 0;
    } else {
      if (j == 0 || softcap || prescale || slope != 0.f) return 0;
      const int n0 = n_lo + j * kBlockN;
      rescale = false;  // where it is not done, the whole softmax sets it
      return softmax_at_running_max<kSkipHalf>(tile_softmax(n0, false),
                                    (n0 < full_lo) | (n0 + kBlockN > full_hi), sc, m, l, wg);
    }
  };
  // P rounded into P V's A fragments (round_p), once the previous P V has completed.
  auto to_p = [&] { round_p<T>(pa, sc); };
  // O's deferred rescale (softmax), once no product is writing O
  auto rescale_o = [&] {
    if (rescale) scale_o_rows(o, corr);
  };

  // FA3's intra-warpgroup overlap: S_j's product runs while this warpgroup issues
  // P_{j-1} V_{j-1}; the softmax of S_j then runs while that P V is in flight, and O
  // is rescaled once it has landed (with ping-pong, products issued in the warpgroup's
  // turn: my_turn, their_turn).
  // The walk at d128 hands the turn over once S_j is issued, before P_{j-1} V_{j-1}, so
  // that the other's S can queue behind this S rather than behind both products (the
  // walk's own clock: S_j landed 800 cycles after its issue at S=4096, its softmax
  // 1,378). H100, same runs, 3 rounds each: S = 4096 full +1.4 / +3.3 %, causal +3.5 %,
  // 8192 +2.4 %, 16384 +1.2 / +1.7 %, S = 512 .. 2048 -1.3 .. +2.1 % (within the
  // spread); at d64 as well, causal S = 512 lost 5.6 %, so d64 keeps both products in
  // its turn (its three warpgroups' ring too: against handing over after both, H100, best
  // of 2 rounds, full S = 512 / 1024 / 2048 -2.8 / -2.7 / -3.0 %, causal 1024 / 4096
  // -3.3 / -3.8 %, varlen -4.2 %).
  constexpr bool kEarlyHandOver = kWalk && D == 128;
  // The tiles this warpgroup computes (warpgroup_tiles; the walk: own_tiles, from the
  // item's record), then the rest passed: waited for and released, the last one's V tail
  // zeroed with the other warpgroups (they meet there). Not with ping-pong (every tile
  // takes turns). fp8 here (past its walk's rows) too: its tile loop holds 9 local loads
  // / stores against 12 without. The walk, H100, same run, best of 3: fp8 d64 (the bound
  // computed by the consumers) causal S = 512 / 1024 / 2048 +3.4 / +13 / +4.7 %, full S =
  // 512 / 2048 (no tile to pass) -1.3 / -1.8 %; then with the bound from the record, fp8
  // d128 causal S = 512 / 1024 / 2048 +7.1 / +14.2 / +5.4 %, full S = 512 -0.8 %; fp8 d64
  // causal S = 512 / 1024 +2.3 / +2.0 %; bf16 d64 (three warpgroups) full S = 1024 +2.7 %,
  // causal S = 1024 / 2048 / 4096 +2.0 / -0.4 / +0.6 %.
  constexpr bool kPassesTiles = !ping_pong(kWgs, kEB, D);
  const int wg_tiles =
      !kPassesTiles ? tiles
      : kWalk       ? own_tiles
                    : warpgroup_tiles<kBlockN>(win, s, m0 + row0, n_lo, tiles);
  constexpr bool kOverlap = overlaps_products(kWgs, kEB, D, kWalk, kPaged);  // else tiles_in_turn
  // three warpgroups' turns in a ring (sm90_tiles.h, turn_ring): tiles_in_turn's hooks,
  // or the overlapped tiles' hand-overs below (hand_over)
  constexpr bool kRing = turn_ring(kWgs, kEB, D, kWalk, kPaged);
  // the ring's turns: the item's tiles + 1 for every warpgroup (one block an item skips
  // the last warpgroup's last hand-over: their_turn(last))
  int turns = 0;
  auto ring_turn = [&] {
    if constexpr (kRing) their_turn(++turns == tiles + 1);
  };
  // the overlapped tiles' hand-over: ping-pong's, or a counted turn of the ring
  auto hand_over = [&](bool last = false) {
    if constexpr (kRing) {
      ring_turn();
    } else {
      their_turn(last);
    }
  };
  // The ring's start: one item a block, the last warpgroup hands the first turn to
  // warpgroup 0 (the walk does so once, before the walk); a warpgroup without a tile
  // takes the item's first turn empty.
  auto ring_first_hand_over = [&] {
    if constexpr (kRing) {
      if (wg == kWgs - 1) their_turn();
    }
  };
  auto ring_empty_first_turn = [&] {
    if constexpr (kRing) {
      if (wg_tiles <= 0 && tiles > 0) {
        my_turn();
        ring_turn();
      }
    }
  };
  if constexpr (!kOverlap) {
    if (!kWalk && tiles > 0) {  // (the walk waits for Q and hands over once, before)
      sm90::mbar_wait(q_full, 0u);
      ring_first_hand_over();
    }
    tiles_in_turn(
        wg_tiles, s_flat, o_flat, issue_s, softmax_at_max,
        [&](int j) { softmax(j, box_present(j)); },
        [&](int j) { release(kEmptyK, (g0 + j) % kKRing); }, [&](int) { rescale_o(); to_p(); },
        [&](int j) { zero_v_tail(j); issue_pv(j); },
        [&](int j) { release_v(v_stage_of(j)); },
        [&] {
          if constexpr (kRing) my_turn();
        },
        ring_turn);
    ring_empty_first_turn();  // after the loop, which has no tile for it (fp8's order)
  } else {
    // One item a block, Q is waited for where the warpgroup computes no tile too: its
    // rows of the buffer stage its O.
    if (!kWalk && kPassesTiles && wg_tiles == 0 && tiles > 0) sm90::mbar_wait(q_full, 0u);
    if (!kWalk && tiles > 0) ring_first_hand_over();
    ring_empty_first_turn();
    if (wg_tiles > 0) {
      if (!kRing && !kWalk && wg == 1) their_turn();  // ping-pong: warpgroup 0 goes first
      const bool present = box_present(0);
      if (!kWalk) sm90::mbar_wait(q_full, 0u);
      my_turn();
      issue_s(0);
      hand_over();
      settle_o_store();  // the previous item's O store read, behind S_0's product
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(s_flat);
      release(kEmptyK, g0 % kKRing);
      softmax(0, present);  // O is still zero (or not yet written): nothing to rescale
      to_p();
    }
    for (int j = 1; j < wg_tiles; ++j) {
      const bool present = box_present(j);
      zero_v_tail(j - 1);
      my_turn();
      issue_s(j);
      if constexpr (kEarlyHandOver) hand_over();
      issue_pv(j - 1);
      if constexpr (!kEarlyHandOver) hand_over();
      sm90::wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
      sm90::wgmma_hold(s_flat);
      softmax_of_landed_s(
          j, s_flat, issue_s, softmax_at_max, [&](int j) { softmax(j, present); },
          [&](int j) { release(kEmptyK, (g0 + j) % kKRing); });
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(o_flat);
      release_v(v_stage_of(j - 1));
      rescale_o();
      to_p();
    }
    if (wg_tiles > 0) {
      zero_v_tail(wg_tiles - 1);
      my_turn();
      issue_pv(wg_tiles - 1);
      hand_over(/*last=*/true);
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(o_flat);
      release_v(v_stage_of(wg_tiles - 1));
    }
  }
  if constexpr (kPassesTiles) {
    for (int j = wg_tiles; j < tiles; ++j) {
      // The V-tail zeroing (16-bit) before the tile's empty turn: every warpgroup meets
      // there having taken the item's turns up to the last tile's and not that one (an
      // empty turn first would wait for a later warpgroup's turn, which waits at the
      // zeroing's barrier for this one: the ring hung so where the last warpgroup had no
      // rows of a short last row block). The empty turns stay: a walk ring that took only
      // the turns with work (each handed to the warpgroup with the next) ran 0.875-0.987x
      // at every row it changed (H200, kernel time at the base clock: fp8 d128 causal S =
      // 512 0.875, bf16 d64 causal 512 0.909; docs/benchmarks.md 2026-12-02 (55)).
      zero_v_tail(j);
      if constexpr (kRing) {  // the tile's turn, empty
        my_turn();
        ring_turn();
      }
      // The walk makes both stage indices first: as with release, each kernel keeps its
      // order (the other changed ptxas's schedule of the fp8 kernels).
      if constexpr (kWalk) {
        // sv: fp8's V stage, made here as its kernel had it (the 16-bit kernels release
        // their carried stage, which kCarryV leaves sv unused for)
        const int st = (g0 + j) % kKRing, sv = (g0 + j) % kPvRing;
        sm90::mbar_wait(bar(kFullK, st), parity(g0 + j, kKRing));
        release(kEmptyK, st);
        pv_tile(j);
        release_v(kCarryV ? v_stage : sv);
      } else {
        sm90::mbar_wait(bar(kFullK, (g0 + j) % kKRing), parity(g0 + j, kKRing));
        release(kEmptyK, (g0 + j) % kKRing);
        pv_tile(j);
        release_v(v_stage_of(j));
      }
    }
  }

  // Epilogue (finish_rows), then O written out (write_o_rows); the previous item's O
  // store read waited for first where no product of this item's did.
  if (!kOverlap || wg_tiles <= 0) settle_o_store();
  // No P V wrote O: zeros for finish_rows. Here, not before the tiles: zeroed on one path
  // there, O was zeroed on all (LLVM took the other path's undefined O for zeros).
  if constexpr (kFirstPvWritesO) {
    if (wg_tiles <= 0) {
#pragma unroll
      for (int x = 0; x < kDT * 4; ++x) o_flat[x] = 0.f;
    }
  }
  finish_rows<T, D, kBlockM, kPartialFirst>(p, o, m, l, sQ, row0, warp, g, t, m0, s, h, hd);
  if constexpr (!kFp8) {
    constexpr bool kWaitRead = !defers_o_store_read(kWgs, kEB, D, kWalk);
    write_o_rows<T, D, kBlockM, kWaitRead, kPartialFirst>(a, sQ, row0, m0, s, h, hd, tid % 128,
                                                          wg);
  }
}

}  // namespace flash_sm90

// kPaged: the instance for paged K/V (two consumers; 16-bit or fp8), so that the others carry
// none of its code: with a run-time flag ptxas spilled at d128 and the dense forward ran
// 6-9 % slower (H100, d128, S = 4096 / 16384).
// kVtGiven: the fp8 instance that reads V given transposed (FwdBlockTiles), so that the
// one that transposes keeps its code: with a run-time flag the fp8 d256 forward ran 2-5 %
// slower where it transposed (H100, S = 512 .. 16384).
template <typename T, int D, int kWgs, bool kPaged = false, bool kVtGiven = false>
__device__ void flash_fwd_sm90(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  using Tiles = FwdBlockTiles<T, D, kWgs, kVtGiven>;  // shapes, rings, layout, producer (above)
  constexpr int kBlockN = Tiles::kBlockN, kEB = Tiles::kEB;
  constexpr bool kFp8 = Tiles::kFp8;
  static_assert(!kFp8 || ((D == 64 || D == 128 || D == 256) &&
                          kWgs == (kPaged ? 2 : fp8_wgs(D))),
                "fp8: the d64, d128 and d256 buckets, fp8_wgs consumers (paged: two)");
  static_assert(!kVtGiven || (kFp8 && !kPaged), "V given transposed: fp8, not paged");
  const xla_attn_flash_fwd_params& p = a.p;
  extern __shared__ __align__(128) unsigned char smem[];

  FwdBlock blk;
  if (!blk.locate<typename Tiles::Out, true>(p, Tiles::kBlockM, kBlockN)) return;
  const int h = blk.h, m0 = blk.m0;
  static_assert(!kPaged || kWgs == 2, "paged: the two-consumer kernels");
  constexpr bool paged = kPaged;  // the launcher sends paged calls here alone
  // paged: tiles start on a box (page) boundary, so that no box straddles two pages; the
  // keys added in front are outside every row's window and masked as such
  const int n_lo = paged ? blk.n_lo - blk.n_lo % a.kv_box_rows : blk.n_lo, n_hi = blk.n_hi;
  const Sequence& s = blk.s;
  const int tiles = (n_hi - n_lo + kBlockN - 1) / kBlockN;

  const typename Tiles::Smem sm = Tiles::layout(smem, /*q_buffers=*/1);
  // q_full, then per stage: full_k, full_v (the producer's copies landed), empty_k,
  // empty_v (both consumer warpgroups are done reading). K and V are released apart: K_j
  // once S_j is computed, a whole softmax and P V earlier than V_j, so that the producer
  // can land K_{j+2} while tile j + 1 is still being consumed. fp8: full_v says the raw
  // V tile landed (the producer's own wait), full_vt that its transpose is written, and
  // empty_v that the consumers are done with the V^T tile.
  const uint32_t bars = sm.bars, q_full = bars;
  auto bar = [&](int kind, int st) { return bars + 8u * uint32_t(1 + kind * kMaxStages + st); };
  // the parity of tile j's use of its stage in a ring of `ring`
  auto parity = [](int j, int ring) { return uint32_t(j / ring) & 1u; };
  Tiles::init_barriers([&] { sm90::mbar_init(q_full); }, bar);

  // paged: the cache rows of a sequence's keys (sequence.cuh), pages checked against
  // the cache's blocks
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  if (threadIdx.x < 128) {
    // The producer (FwdBlockTiles: copy_q, copy_kv, transpose_stage).
    sm90::regs_release<Tiles::kRegsProducer>();
    // Paged: the whole of warp 0 runs the copy loop (FwdBlockTiles::copy_kv).
    if ((paged ? threadIdx.x < 32 : threadIdx.x == 0) && tiles > 0) {
      if (threadIdx.x == 0) {
        sm90::prefetch_tensor_map(&a.k_map);
        sm90::prefetch_tensor_map(&a.v_map);
        Tiles::copy_q(a, sm, 0, q_full, h, s.q_start + m0);
      }
      for (int j = 0; j < tiles; ++j) {
        Tiles::template copy_kv<paged, /*kWalk=*/false>(
            a, keys, j, [&] { return n_lo + j * kBlockN; }, blk, sm, bar, parity);
      }
    } else if (kFp8 && !kVtGiven && threadIdx.x >= 32) {
      // fp8: warps 1 .. 3 transpose (warp 0's copying thread stays free to run ahead:
      // sharing the copies with a transposing thread held K's copy back a whole tile,
      // and the fp8 forward ran no faster than bf16's)
      for (int j = 0; j < tiles; ++j) {
        Tiles::transpose_stage(j, [&] { return n_hi - (n_lo + j * kBlockN); }, sm, bar, parity);
      }
    }
  } else {
    sm90::regs_acquire<Tiles::kRegsConsumer>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. kConsumers - 1
    // The warpgroup (warp_uniform: its Q rows' descriptors stay in uniform registers).
    const int wg = sm90::warp_uniform(ct / 128), row0 = wg * 64;
    const int warp = (ct % 128) / 32, lane = ct % 32, g = lane / 4, t = lane % 4;

    // With two 16-bit (or fp8 d256) consumer warpgroups, FA3's ping-pong: they take turns
    // issuing their products (named barriers kTurnBarrier + wg: wait for one's turn, then
    // hand it to the other), so that one's products run while the other computes its
    // softmax instead of both contending for the tensor cores and then both leaving them
    // idle. Warpgroup 0 goes first; warpgroup 1 skips its last hand-over, so that every
    // arrival is waited for.
    // Three consumer warpgroups take turns in a ring (sm90_tiles.h, turn_ring): warpgroup
    // wg hands over to wg + 1, the last to 0, which skips its last hand-over.
    constexpr bool kPingPong = ping_pong(kWgs, kEB, D);  // 16-bit, fp8 d256 (sm90_tiles.h)
    constexpr bool kRing = turn_ring(kWgs, kEB, D, /*walk=*/false, kPaged);
    auto my_turn = [&] {
      if constexpr (kPingPong || kRing) sm90::named_barrier(kTurnBarrier + wg, 256);
    };
    auto their_turn = [&](bool last = false) {
      if constexpr (kPingPong) {
        if (!(last && wg == 1)) sm90::named_arrive(kTurnBarrier + 1 - wg, 256);
      } else if constexpr (kRing) {
        if (!(last && wg == kWgs - 1)) sm90::named_arrive(kTurnBarrier + (wg + 1) % kWgs, 256);
      }
    };
    consume_item<T, D, kWgs, paged, /*kWalk=*/false, kVtGiven>(
        a, blk, n_lo, n_hi, tiles, keys,
        ConsumerSmem{sm.sQ, sm.sK, sm.sV, sm.sVt, sm.warp_valid}, q_full, /*g0=*/0,
        /*own_tiles=*/0, ConsumerThread{ct, lane, wg, row0, warp, g, t}, bar, parity, my_turn,
        their_turn, [] {});
  }
}

// fp8's V^T for the forward's copy engine (sm90_tiles.h, vt_given), written without
// shared memory: a block takes 128 keys of sequence blockIdx.z's head blockIdx.y (and
// every 128 keys gridDim.x further: the grid's count comes from max_seqlen_k, a hint),
// its keys past the sequence (seqused_k counted) zeros. Lane (c, t) = (lane / 4, lane %
// 4) holds keys 16c + 2t + {0, 1, 8, 9}: the four bytes of V^T's word t in the keys'
// 16-key group c (transpose_v_e4m3's order), so that 16 bytes of each key's row (16
// head dims, one load each) become 16 such words by byte permutes, one for each dim; a
// warp's store then writes 128 consecutive bytes of one V^T row. Warps take the 16-dim
// chunks in turn. (A first form staged the rows in shared memory and gathered bytes: 59 us
// for d256 S = 8192, 28 % of the DRAM's bandwidth, H100.)
__device__ void flash_fwd_vt_pack(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  constexpr int kKeys = kVtPackKeys;
  static_assert(kKeys == block_n(256, 1), "the pass writes whole V^T tiles");
  const xla_attn_flash_fwd_params& p = a.p;
  const int b = blockIdx.z, hk = blockIdx.y, hd = p.head_dim;
  if (b >= real_batch(p.batch, p.batch_used)) return;
  const Sequence s = sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q,
                              p.total_k, false, 0);
  const int padded = (s.num_k + kKeys - 1) / kKeys * kKeys;
  const int64_t v_row = int64_t(p.num_heads_k) * hd;  // bytes between keys in v
  const unsigned char* v =
      static_cast<const unsigned char*>(p.v) + s.k_start * v_row + int64_t(hk) * hd;
  unsigned char* vt = a.vt + int64_t(hk) * hd * a.vt_cols + vt_seq_start(s.k_start, b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int c = lane / 4, t = lane % 4;
  for (int key0 = int(blockIdx.x) * kKeys; key0 < padded; key0 += int(gridDim.x) * kKeys) {
    const int first = key0 + 16 * c + 2 * t;
    const int key[4] = {first, first + 1, first + 8, first + 9};
    for (int y = warp; y < hd / 16; y += warps) {  // head dims 16y .. 16y + 15
      uint4 x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[e] = key[e] < s.num_k ? __ldg(reinterpret_cast<const uint4*>(v + key[e] * v_row) + y)
                                : make_uint4(0u, 0u, 0u, 0u);
      }
      unsigned char* dst = vt + int64_t(16 * y) * a.vt_cols + key0 + 16 * c + 4 * t;
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // head dims 16y + 4w .. + 3
        const uint32_t k0 = (&x[0].x)[w], k1 = (&x[1].x)[w], k2 = (&x[2].x)[w], k3 = (&x[3].x)[w];
        const uint32_t lo01 = __byte_perm(k0, k1, 0x5140u), hi01 = __byte_perm(k0, k1, 0x7362u);
        const uint32_t lo23 = __byte_perm(k2, k3, 0x5140u), hi23 = __byte_perm(k2, k3, 0x7362u);
        const uint32_t dims[4] = {__byte_perm(lo01, lo23, 0x5410u), __byte_perm(lo01, lo23, 0x7632u),
                                  __byte_perm(hi01, hi23, 0x5410u), __byte_perm(hi01, hi23, 0x7632u)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          *reinterpret_cast<uint32_t*>(dst + int64_t(4 * w + i) * a.vt_cols) = dims[i];
        }
      }
    }
  }
}

}  // namespace xla_attn
