// The sm80 family's online softmax of one tile (TileSoftmax) and the score transform
// it runs in (ScoreTransform); the sm90 forward runs the same code on its accumulator
// fragments, which are mma.sync's (fwd_sm80.cuh has the family's structure).
#pragma once
#include "flash/fwd_sm80_tile.cuh"

namespace xla_attn {
namespace sm80 {

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
}  // namespace xla_attn
