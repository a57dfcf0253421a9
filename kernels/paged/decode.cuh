// paged_attention's decode kernel (sm_70+): memory-bound attention of a few query
// tokens per sequence over a block-table KV cache.
// One block = one (split of the keys, kv head, sequence). It holds every query row of
// the kv head's GQA group (heads x query tokens, in chunks of kRows) in registers, so
// each K/V byte is read once for the whole group. A key row is read by kLanes lanes
// with 16-byte (fp8: 8-byte) loads, two steps of kUnroll keys per lane group in flight
// (the block-table entries two steps ahead); each lane keeps the
// partial dot products of its 16 bytes, reduced across the key's lanes with shuffles.
// Warps stream disjoint keys with their own online softmax and merge through shared
// memory at the end; splits write partials that paged_decode_combine merges.
#pragma once
#include "common/vec.cuh"
#include "flash/sequence.cuh"
#include "paged/decode_tiles.h"

namespace xla_attn {
namespace decode {


// One lane's elements of a key row through the read-only path, as one 16- or 8-byte
// load; zeros where the key has no row (present false: src is not read).
template <typename Chunk, typename KV>
__device__ __forceinline__ Chunk load_chunk(const KV* src, bool present) {
  Chunk c;
  if constexpr (sizeof(Chunk) == 16) {
    *reinterpret_cast<uint4*>(&c) =
        present ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
  } else {
    static_assert(sizeof(Chunk) == 8, "decode lanes load 8 or 16 bytes");
    *reinterpret_cast<uint2*>(&c) =
        present ? __ldg(reinterpret_cast<const uint2*>(src)) : make_uint2(0u, 0u);
  }
  return c;
}

template <typename KV>
__device__ __forceinline__ float cache_scale(const float* s) {
  return (kSameType<KV, __nv_fp8_e4m3> || kSameType<KV, __nv_fp8_e5m2>) && s ? *s : 1.f;
}

// Writes `value` into query rows [first, last) of the heads of kv head hk's group.
// Padding rows (past the last real sequence) get zeros; the rows of a span longer than
// the decode kernel takes, when no flash forward follows (the caller's max_query_len
// said none is that long), get NaN so the broken promise shows.
template <typename Q>
__device__ void fill_rows(const xla_attn_paged_attention_params& p, int hk, int64_t first,
                          int64_t last, float value) {
  const int group = p.num_heads / p.num_heads_k;
  const int64_t per_row = int64_t(group) * p.head_dim;
  Q* out = static_cast<Q*>(p.out);
  for (int64_t idx = threadIdx.x; idx < (last - first) * per_row; idx += blockDim.x) {
    const int64_t row = first + idx / per_row;
    const int64_t col = int64_t(hk) * per_row + idx % per_row;
    out[row * p.num_heads * p.head_dim + col] = from_float<Q>(value);
  }
}

// Where a decode block (blockIdx: split, kv head, sequence) works, shared by the decode
// kernels: its sequence, the GQA group's query rows (row r: query token r / group,
// head r % group) and this split's keys [k_lo, k_hi), cut in whole steps of `step`
// keys (k_lo a multiple of `align`: the first key rounds down, and the window masks the
// keys before it). A block may read `heads` adjacent kv heads (blockIdx.y: hk / heads).
// locate() returns false for a block with nothing to do (the padding sequence
// index zeroes the rows past the last real sequence first; spans longer than max_q
// belong to the flash forward).
struct DecodeBlock {
  Sequence s;
  Window win;
  KeyRows keys;
  int split, hk, b, group, total_rows, k_lo, k_hi;

  template <typename Q>
  __device__ __forceinline__ bool locate(const Args& a, int step, int align = 1, int heads = 1) {
    const xla_attn_paged_attention_params& p = a.p;
    split = blockIdx.x;
    hk = blockIdx.y * heads;
    b = blockIdx.z;
    const int n = real_batch(p.max_num_seqs, p.num_seqs);
    if (b >= n) {
      if (b == p.max_num_seqs && split == 0) {
        for (int h = hk; h < hk + heads; ++h) {
          fill_rows<Q>(p, h, clamp64(p.query_start_loc[n], 0, p.total_q), p.total_q, 0.f);
        }
      }
      return false;
    }
    s = sequence(b, p.query_start_loc, nullptr, p.seq_lens, p.total_q,
                 int64_t(p.num_blocks) * p.block_size, true,
                 int64_t(p.max_blocks_per_seq) * p.block_size);
    if (s.num_q > a.max_q && a.no_flash_follows && split == 0) {
      for (int h = hk; h < hk + heads; ++h) {
        fill_rows<Q>(p, h, s.q_start, s.q_start + s.num_q, XLA_ATTN_NAN);
      }
    }
    if (s.num_q == 0 || s.num_q > a.max_q) return false;
    group = p.num_heads / p.num_heads_k;
    total_rows = s.num_q * group;
    win = Window{p.sliding_window > 0 ? p.sliding_window - 1 : -1, 0};
    int lo, hi;
    win.key_range(0, s.num_q - 1, s.offset, s.num_k, &lo, &hi);
    lo -= lo % align;
    const int per = ((hi - lo + a.num_splits - 1) / a.num_splits + step - 1) / step * step;
    k_lo = min(hi, lo + split * per);
    k_hi = min(hi, k_lo + per);
    keys = KeyRows{p.block_tables, p.max_blocks_per_seq, p.block_size, p.num_blocks};
    return true;
  }
};

// Merges the kWarps partial softmax states of a block's query row `r` (row `row` of
// the sequence's rows: query token row / group, head row % group) and writes element
// d of its output: to out, or with splits to the workspace partials (and the lse at
// d == 0) that paged_decode_combine merges. Shared by both decode kernels: s_m / s_l
// are [kWarps][rows] (base-2 max, sum), s_o is [kWarps][rows][D] (unnormalised).
template <typename Q, int D, int kW>
__device__ __forceinline__ void write_merged(const Args& a, const Sequence& s, int hk, int split,
                                             int rows, int r, int row, int d, const float* s_m,
                                             const float* s_l, const float* s_o, float vs) {
  const xla_attn_paged_attention_params& p = a.p;
  float top = -XLA_ATTN_INF;
#pragma unroll
  for (int w = 0; w < kW; ++w) top = fmaxf(top, s_m[w * rows + r]);
  float sum = 0.f, o = 0.f;
  if (top != -XLA_ATTN_INF) {
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const float c = fast_exp2(s_m[w * rows + r] - top);
      sum += s_l[w * rows + r] * c;
      o += s_o[(w * rows + r) * D + d] * c;
    }
  }
  o = sum > 0.f ? o * vs / sum : 0.f;
  const int group = p.num_heads / p.num_heads_k;
  const int64_t q_stride = int64_t(p.num_heads) * D;
  const int64_t q_row = s.q_start + row / group;
  const int h = hk * group + row % group;
  if (a.num_splits > 1) {
    float* ws_out = static_cast<float*>(p.workspace);
    float* ws_lse = ws_out + int64_t(a.num_splits) * p.total_q * q_stride;
    ws_out[(int64_t(split) * p.total_q + q_row) * q_stride + h * D + d] = o;
    if (d == 0) {
      ws_lse[(int64_t(split) * p.num_heads + h) * p.total_q + q_row] =
          sum > 0.f ? top * kLn2 + logf(sum) : -XLA_ATTN_INF;
    }
  } else {
    static_cast<Q*>(p.out)[q_row * q_stride + h * D + d] = from_float<Q>(o);
  }
}

}  // namespace decode

template <typename Q, typename KV, int D, int kRows>
__device__ void paged_decode(const decode::Args& a) {
  using namespace decode;
  constexpr int kElems = elems_per_lane();        // cache elements per lane and key
  constexpr int kLanes = lanes_per_key(D);
  constexpr int kKeysPerWarp = 32 / kLanes;       // keys one warp-wide load covers
  constexpr int kKeysPerStep = kKeysPerWarp * kUnroll;
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a key row must be 8..256 lanes' elements, a power of two");
  static_assert(sizeof(KV) <= 2, "16-bit or fp8 caches (float32 takes the flash forward)");
  using Chunk = Vec<KV, kElems>;  // 16 or 8 bytes
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ float s_acc[kWarps][kRows][D];

  const xla_attn_paged_attention_params& p = a.p;
  DecodeBlock blk;
  if (!blk.locate<Q>(a, kKeysPerStep)) return;  // the split's share in whole warp steps
  const int split = blk.split, hk = blk.hk, b = blk.b, group = blk.group;
  const int total_rows = blk.total_rows, k_lo = blk.k_lo, k_hi = blk.k_hi;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const KeyRows& keys = blk.keys;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = lane % kLanes;  // this lane's 16 bytes of a key: dims part * kElems + e
  const int64_t q_stride = int64_t(p.num_heads) * D;
  const Q* query = static_cast<const Q*>(p.query);
  const KV* k_cache = static_cast<const KV*>(p.key_cache);
  const KV* v_cache = static_cast<const KV*>(p.value_cache);
  const float ks = cache_scale<KV>(p.k_scale), vs = cache_scale<KV>(p.v_scale);

  for (int r0 = 0; r0 < total_rows; r0 += kRows) {
    // Scores live in the log2 domain (exp2 is one instruction). Without softcap, q
    // carries scale * k_scale * log2 e and the score is the dot itself; with it,
    // score = cap2 * tanh(dot * mul). ALiBi subtracts slope2 * |pos - key|.
    const bool capped = p.soft_cap > 0.f;
    const float cap2 = p.soft_cap * kLog2e;
    const float qmul = capped ? 1.f : p.scale * ks * kLog2e;
    const float mul = capped ? p.scale * ks / p.soft_cap : 1.f;
    float q[kRows][kElems];
    float slope2[kRows];
    int pos[kRows];  // key position of the row (< 2^31: keys are int)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = min(r0 + r, total_rows - 1);  // spare rows repeat the last one
      const int h = hk * group + row % group;
      pos[r] = row / group + s.offset;
      slope2[r] = (p.alibi_slopes ? p.alibi_slopes[h] : 0.f) * kLog2e;
      const Q* qrow = query + (s.q_start + row / group) * q_stride + h * D + part * kElems;
#pragma unroll
      for (int e = 0; e < kElems; ++e) q[r][e] = to_float(qrow[e]) * qmul;
    }
    float m[kRows], l[kRows], acc[kRows][kElems];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -XLA_ATTN_INF;
      l[r] = 0.f;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[r][e] = 0.f;
    }

    // Step t of this warp covers keys base_t + u * kKeysPerWarp + lane / kLanes, u <
    // kUnroll, base_t = k_lo + (t * kWarps + warp) * kKeysPerStep. Pipeline: while step t
    // is computed, step t + 1's K/V loads are in flight and step t + 2's block-table
    // entries are being read, so neither the page lookup nor the load latency is paid
    // in series with the math.
    constexpr int kStride = kWarps * kKeysPerStep;
    const int key_lane = lane / kLanes;
    auto lookup = [&](int base, int64_t (&rows)[kUnroll]) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int key = base + u * kKeysPerWarp + key_lane;
        rows[u] = key < k_hi ? keys.row(b, 0, key) : -1;
      }
    };
    Chunk kc[kUnroll], vc[kUnroll];  // the step in flight
    bool present[kUnroll];
    auto issue = [&](const int64_t (&rows)[kUnroll]) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        present[u] = rows[u] >= 0;
        const int64_t off = (rows[u] * p.num_heads_k + hk) * D + part * kElems;
        kc[u] = load_chunk<Chunk>(k_cache + off, present[u]);
        vc[u] = load_chunk<Chunk>(v_cache + off, present[u]);
      }
    };
    int64_t rows[kUnroll];
    int base = k_lo + warp * kKeysPerStep;
    lookup(base, rows);
    issue(rows);
    lookup(base + kStride, rows);
    for (; base < k_hi; base += kStride) {
      float kf[kUnroll][kElems];
      Chunk vcur[kUnroll];
      bool vis_key[kUnroll];
      int key[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) kf[u][e] = to_float(kc[u].v[e]);
        vcur[u] = vc[u];
        vis_key[u] = present[u];
        key[u] = base + u * kKeysPerWarp + key_lane;
      }
      issue(rows);                       // step t + 1 (no-op loads past the range)
      lookup(base + 2 * kStride, rows);  // step t + 2's pages
      // Scores of every row first: K's floats die before V's are made. The kRows x
      // kUnroll dot products are independent chains; reducing them across the key's
      // lanes one shuffle distance at a time for all of them lets their latencies
      // (~30 cycles a shuffle) overlap, and the transform below has no branch, so the
      // scheduler sees one straight block (with a branch per score, ncu showed 5.4
      // cycles between a warp's instructions and 31% of DRAM bandwidth).
      float score[kRows][kUnroll];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < kElems; ++e) dot = fmaf(q[r][e], kf[u][e], dot);
          score[r][u] = dot;
        }
      }
#pragma unroll
      for (int off = 1; off < kLanes; off <<= 1) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            score[r][u] += __shfl_xor_sync(0xffffffffu, score[r][u], off);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float x = capped ? cap2 * fast_tanh(score[r][u] * mul) : score[r][u];
          x -= slope2[r] * float(abs(pos[r] - key[u]));
          const bool vis = vis_key[u] && win.visible(pos[r], key[u]);  // causal: right = 0
          score[r][u] = vis ? x : -XLA_ATTN_INF;
        }
      }
      float vf[kUnroll][kElems];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) vf[u][e] = to_float(vcur[u].v[e]);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float top = -XLA_ATTN_INF;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) top = fmaxf(top, score[r][u]);
#pragma unroll
        for (int off = kLanes; off < 32; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
        const float m_new = fmaxf(m[r], top);
        // Nothing visible yet: m stays -inf and exponents use 0, so every term is
        // exp2(-inf) = 0 rather than NaN (no branch: shuffles stay convergent).
        const float m_use = m_new == -XLA_ATTN_INF ? 0.f : m_new;
        const float corr = fast_exp2(m[r] - m_use);  // m = -inf: 0
        m[r] = m_new;
        l[r] *= corr;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] *= corr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const float prob = fast_exp2(score[r][u] - m_use);
          l[r] += prob;
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[r][e] = fmaf(prob, vf[u][e], acc[r][e]);
        }
      }
    }

    // Lanes of different keys hold partial sums over disjoint keys with one max:
    // add them up, then merge the warps through shared memory.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int off = kLanes; off < 32; off <<= 1) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], off);
      }
      if (lane < kLanes) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) s_acc[warp][r][part * kElems + e] = acc[r][e];
      }
      if (lane == 0) {
        s_m[warp][r] = m[r];
        s_l[warp][r] = l[r];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
      const int r = idx / D, d = idx % D;
      if (r0 + r >= total_rows) break;
      write_merged<Q, D, kWarps>(a, s, hk, split, kRows, r, r0 + r, d, &s_m[0][0], &s_l[0][0],
                                 &s_acc[0][0][0], vs);
    }
    __syncthreads();  // shared memory is reused by the next chunk
  }
}

// Merges the splits of paged_decode: out = sum_s exp(lse_s - lse) out_s. One block per
// (kv head, sequence), one warp per query row of the group. The lanes read the
// splits' lse values side by side and keep the weights in shared memory, and each
// split's partial row is one coalesced warp read: looping the splits one after the
// other per lane (3 dependent loads, then expf and a division per element and split)
// took 12.7 us for B=64 x 3 splits, 5 % of an fp8 L=4096 decode step.
template <typename Q, int D>
__device__ void paged_decode_combine(const decode::Args& a) {
  static_assert(decode::kMaxSplits <= 128 && decode_sm80::kMaxSplits <= 128,
                "combine keeps <= 128 split weights a warp");
  __shared__ float s_w[decode::kWarps][128];
  const xla_attn_paged_attention_params& p = a.p;
  const int hk = blockIdx.y, b = blockIdx.z;
  if (b >= real_batch(p.max_num_seqs, p.num_seqs)) return;
  const Sequence s = sequence(b, p.query_start_loc, nullptr, p.seq_lens, p.total_q,
                              int64_t(p.num_blocks) * p.block_size, true,
                              int64_t(p.max_blocks_per_seq) * p.block_size);
  if (s.num_q == 0 || s.num_q > a.max_q) return;
  const int group = p.num_heads / p.num_heads_k;
  const int64_t q_stride = int64_t(p.num_heads) * D;
  const float* ws_out = static_cast<const float*>(p.workspace);
  const float* ws_lse = ws_out + int64_t(a.num_splits) * p.total_q * q_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* w = s_w[warp];
  for (int row = warp; row < s.num_q * group; row += decode::kWarps) {
    const int64_t q_row = s.q_start + row / group;
    const int h = hk * group + row % group;
    const float* lse = ws_lse + int64_t(h) * p.total_q + q_row;
    const int64_t lse_stride = int64_t(p.num_heads) * p.total_q;
    float top = -XLA_ATTN_INF;
    for (int sp = lane; sp < a.num_splits; sp += 32) top = fmaxf(top, lse[sp * lse_stride]);
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    float total = 0.f;
    for (int sp = lane; sp < a.num_splits; sp += 32) {
      w[sp] = top == -XLA_ATTN_INF ? 0.f : expf(lse[sp * lse_stride] - top);
      total += w[sp];
    }
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    __syncwarp();  // every lane's weights are in w
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float* part = ws_out + q_row * q_stride + h * D;
#pragma unroll
    for (int d = lane; d < D; d += 32) {
      float o = 0.f;
#pragma unroll 4
      for (int sp = 0; sp < a.num_splits; ++sp) {
        o += w[sp] * part[int64_t(sp) * p.total_q * q_stride + d];
      }
      static_cast<Q*>(p.out)[q_row * q_stride + h * D + d] = from_float<Q>(o * inv);
    }
    __syncwarp();  // w is rewritten for the warp's next row
  }
}

}  // namespace xla_attn
