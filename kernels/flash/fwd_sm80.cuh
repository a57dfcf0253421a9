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
//
// The pieces are in files of their own, included in this order: the shared-memory
// tiles and copies (fwd_sm80_tile.cuh), the online softmax (fwd_sm80_softmax.cuh);
// this file has the kernel.
#pragma once
#include "flash/fwd_sm80_softmax.cuh"

namespace xla_attn {

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
