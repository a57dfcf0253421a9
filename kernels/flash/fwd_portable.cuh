// Flash attention forward, portable family (sm_70+, fp32 arithmetic on CUDA cores).
// One block = 4 warps = one tile of query rows of one head of one sequence; K/V
// tiles stream through shared memory with the online softmax (FlashAttention-2's
// algorithm). In the Q.K^T step each lane owns a key, in the P.V step each lane owns
// output dims, so both steps keep all 32 lanes busy without tensor cores. Split-KV
// writes partial results to the workspace; flash_combine merges them.
// Also serves paged_attention (kernels/paged/launch.cc maps its params onto these).
#pragma once
#include "common/vec.cuh"
#include "flash/params.h"
#include "flash/portable_tiles.h"
#include "flash/sequence.cuh"

namespace xla_attn {

template <typename T>
__device__ __forceinline__ float descale(const float* s) {
  return (kSameType<T, __nv_fp8_e4m3> || kSameType<T, __nv_fp8_e5m2>) && s ? *s : 1.f;
}

// Rows past the last real sequence are padding: out 0, lse +inf (one head per block),
// written by `threads` threads of which this is `thread`.
template <typename Out>
__device__ void zero_padding_rows(const xla_attn_flash_fwd_params& p, int h, int n, int thread,
                                  int threads) {
  const int64_t first = clamp64(p.cu_seqlens_q[n], 0, p.total_q);
  const int64_t count = (p.total_q - first) * p.head_dim;
  Out* out = static_cast<Out*>(p.out);
  for (int64_t idx = thread; idx < count; idx += threads) {
    const int64_t row = first + idx / p.head_dim;
    out[(row * p.num_heads + h) * p.head_dim + idx % p.head_dim] = from_float<Out>(0.f);
    if (p.softmax_lse && idx % p.head_dim == 0) p.softmax_lse[int64_t(h) * p.total_q + row] = XLA_ATTN_INF;
  }
}

// Where a forward block (blockIdx: row block x split, head, sequence) works, shared by
// every forward family: its sequence, rows [m0, m0 + block_m), kv head, and the keys
// [n_lo, n_hi) of its split that some row can see (tiles outside are never loaded).
// locate() returns false for a block with nothing to do; the padding block (b ==
// batch) zeroes the output rows past the last real sequence first.
struct FwdBlock {
  Sequence s;
  Window win;
  int h, b, m0, hd, hk, splits, split, n_lo, n_hi;
  bool paged;

  // kTailFirst (the sm90 kernels, one block an SM): longest_first_tail (sequence.cuh).
  template <typename Out, bool kTailFirst = false>
  __device__ __forceinline__ bool locate(const xla_attn_flash_fwd_params& p, int block_m,
                                         int block_n) {
    splits = p.num_splits > 1 ? p.num_splits : 1;
    int x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
    if (kTailFirst && splits == 1) longest_first_tail(p.batch, &x, &y, &z);
    // Row blocks in reverse: under a causal mask (bottom-right aligned) the last rows see
    // the most keys, and starting the longest blocks first leaves short ones for the
    // last wave instead of long ones.
    const int m_block = int(gridDim.x) / splits - 1 - x / splits;
    split = unsigned(x) % splits;  // unsigned, as blockIdx.x % splits was
    h = y;
    b = z;
    const int n = real_batch(p.batch, p.batch_used);
    if (b >= n) {
      if (b == p.batch && x == 0) {
        zero_padding_rows<Out>(p, h, n, threadIdx.x, blockDim.x);
      }
      return false;
    }
    paged = p.block_table != nullptr;
    s = sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q, p.total_k, paged,
                 int64_t(p.max_blocks_per_seq) * p.block_size);
    m0 = m_block * block_m;
    if (m0 >= s.num_q || routed_to_decode(p.decode_max_q, s)) return false;
    hd = p.head_dim;
    hk = h / (p.num_heads / p.num_heads_k);
    win = Window{p.window_left, p.window_right};
    win.key_range(m0, min(m0 + block_m, s.num_q) - 1, s.offset, s.num_k, &n_lo, &n_hi);
    if (splits > 1) {  // this split's share of the tiles
      const int tiles = (n_hi - n_lo + block_n - 1) / block_n;
      const int per = (tiles + splits - 1) / splits;
      const int lo = n_lo + split * per * block_n;
      n_hi = min(n_hi, lo + per * block_n);
      n_lo = min(lo, n_hi);
    }
    return true;
  }

  // The same for a persistent kernel's item (flash_fwd_sm90_walk): row block x of
  // row_blocks (counted from the last, as above), head, sequence; `threads` of the block's
  // threads, this one `thread`, zero the padding rows (0: none). locate() keeps its own
  // copy: through this one, the sm80 and sm90 kernels' SASS changed (3-6 % slower at
  // d128 on an H100). kPartialFirst (sm90_tiles.h, partial_block_first): the sequence's
  // partial row block is its first, rows [0, (num_q - 1) % block_m + 1), and the others
  // end at num_q; else whole blocks from row 0 and the partial one last.
  template <typename Out, bool kPartialFirst = false>
  __device__ __forceinline__ bool at(const xla_attn_flash_fwd_params& p, int block_m,
                                     int row_blocks, int x, int head, int seq, int thread,
                                     int threads) {
    splits = 1;
    split = 0;
    h = head;
    b = seq;
    const int n = real_batch(p.batch, p.batch_used);
    if (b >= n) {
      if (b == p.batch && x == 0 && threads > 0) zero_padding_rows<Out>(p, h, n, thread, threads);
      return false;
    }
    paged = p.block_table != nullptr;
    s = sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q, p.total_k, paged,
                 int64_t(p.max_blocks_per_seq) * p.block_size);
    m0 = (row_blocks - 1 - x) * block_m;
    if (m0 >= s.num_q || routed_to_decode(p.decode_max_q, s)) return false;
    hd = p.head_dim;
    hk = h / (p.num_heads / p.num_heads_k);
    win = Window{p.window_left, p.window_right};
    if constexpr (kPartialFirst) {
      // block m0 / block_m of the sequence's (num_q + block_m - 1) / block_m, counted
      // from its end
      const int blocks = (s.num_q + block_m - 1) / block_m;
      const int row_end = s.num_q - (blocks - 1 - m0 / block_m) * block_m;
      m0 = max(0, row_end - block_m);
      win.key_range(m0, row_end - 1, s.offset, s.num_k, &n_lo, &n_hi);
    } else {
      win.key_range(m0, min(m0 + block_m, s.num_q) - 1, s.offset, s.num_k, &n_lo, &n_hi);
    }
    return true;
  }
};

template <typename Q, typename KV, typename Out, int D>
__device__ void flash_fwd_portable(const xla_attn_flash_fwd_params& p) {
  constexpr int kRows = portable::fwd_rows_per_warp(D);
  constexpr int kBlockM = portable::fwd_block_m(D);
  constexpr int kBlockN = portable::block_n(D);
  constexpr int kSplit = 32 / kBlockN;  // lanes sharing one key's dot product
  constexpr int kDims = D / 32;         // output dims per lane
  __shared__ float sQ[kBlockM][D];
  __shared__ float sK[kBlockN][D + 1];  // +1: lanes reading different keys hit different banks
  __shared__ float sV[kBlockN][D];
  __shared__ float sP[portable::kWarps][kRows][kBlockN];
  __shared__ bool sValid[kBlockN];

  FwdBlock blk;
  if (!blk.locate<Out>(p, kBlockM, kBlockN)) return;
  const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd, hk = blk.hk;
  const int n_lo = blk.n_lo, n_hi = blk.n_hi, splits = blk.splits, split = blk.split;
  const bool paged = blk.paged;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const ScoreMod mod{p.softmax_scale, p.softcap,
                     p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f};
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  const int64_t q_stride = int64_t(p.num_heads) * hd, kv_stride = int64_t(p.num_heads_k) * hd;
  const Q* q = static_cast<const Q*>(p.q);
  const KV* k = static_cast<const KV*>(p.k);
  const KV* v = static_cast<const KV*>(p.v);
  const float qs = descale<Q>(p.q_descale), ks = descale<KV>(p.k_descale),
              vs = descale<KV>(p.v_descale);

  for (int idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, i = m0 + r;
    sQ[r][d] = (i < s.num_q && d < hd) ? to_float(q[(s.q_start + i) * q_stride + h * hd + d]) * qs
                                       : 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m[kRows], l[kRows], acc[kRows][kDims];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -XLA_ATTN_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < kDims; ++e) acc[r][e] = 0.f;
  }

  for (int n0 = n_lo; n0 < n_hi; n0 += kBlockN) {
    __syncthreads();  // the previous tile is no longer read
    for (int idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) {
      const int kk = idx / D, d = idx % D, j = n0 + kk;
      const int64_t row = j < n_hi ? keys.row(b, s.k_start, j) : -1;
      float kx = 0.f, vx = 0.f;
      if (row >= 0 && d < hd) {
        const int64_t off = row * kv_stride + hk * hd + d;
        kx = to_float(k[off]) * ks;
        vx = to_float(v[off]) * vs;
      }
      sK[kk][d] = kx;
      sV[kk][d] = vx;
      if (d == 0) sValid[kk] = row >= 0;
    }
    __syncthreads();
    const int kk = lane / kSplit, part = lane % kSplit;
    const int64_t j = n0 + kk;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = m0 + warp * kRows + r;
      if (i >= s.num_q) break;  // warp-uniform
      float dot = 0.f;
#pragma unroll 8
      for (int t = 0; t < D / kSplit; ++t) {
        const int d = part * (D / kSplit) + t;
        dot += sQ[warp * kRows + r][d] * sK[kk][d];
      }
#pragma unroll
      for (int off = 1; off < kSplit; off <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const int64_t pos = int64_t(i) + s.offset;
      const bool vis = sValid[kk] && j < n_hi && win.visible(pos, j);
      const float score = vis ? mod(dot, pos, j) : -XLA_ATTN_INF;
      const float m_new = fmaxf(m[r], warp_max(score));
      const float prob = vis ? expf(score - m_new) : 0.f;
      const float corr = m[r] == -XLA_ATTN_INF ? 0.f : expf(m[r] - m_new);
      l[r] = l[r] * corr + warp_sum(part == 0 ? prob : 0.f);
      m[r] = m_new;
      if (part == 0) sP[warp][r][kk] = prob;
#pragma unroll
      for (int e = 0; e < kDims; ++e) acc[r][e] *= corr;
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (m0 + warp * kRows + r >= s.num_q) break;
#pragma unroll 4
      for (int jj = 0; jj < kBlockN; ++jj) {
        const float pr = sP[warp][r][jj];
#pragma unroll
        for (int e = 0; e < kDims; ++e) acc[r][e] += pr * sV[jj][lane + 32 * e];
      }
    }
  }

  float* ws_out = static_cast<float*>(p.workspace);
  float* ws_lse = ws_out + int64_t(splits) * p.total_q * q_stride;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + warp * kRows + r;
    if (i >= s.num_q) break;
    const int64_t row = s.q_start + i;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float lse = l[r] > 0.f ? m[r] + logf(l[r]) : (splits > 1 ? -XLA_ATTN_INF : XLA_ATTN_INF);
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int d = lane + 32 * e;
      if (d >= hd) continue;
      if (splits > 1) {
        ws_out[(split * p.total_q + row) * q_stride + h * hd + d] = acc[r][e] * inv;
      } else {
        static_cast<Out*>(p.out)[row * q_stride + h * hd + d] = from_float<Out>(acc[r][e] * inv);
      }
    }
    if (lane == 0) {
      if (splits > 1) {
        ws_lse[(int64_t(split) * p.num_heads + h) * p.total_q + row] = lse;
      } else if (p.softmax_lse) {
        p.softmax_lse[int64_t(h) * p.total_q + row] = lse;
      }
    }
  }
}

// Merges the split-KV partials of flash_fwd_portable: lse = log sum exp(lse_s), out =
// sum exp(lse_s - lse) out_s. Same grid as the forward without the split factor.
template <typename Out>
__device__ void flash_combine_portable(const xla_attn_flash_fwd_params& p) {
  const int h = blockIdx.y, b = blockIdx.z;
  if (b >= real_batch(p.batch, p.batch_used)) return;
  const Sequence s = sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q,
                              p.total_k, p.block_table != nullptr,
                              int64_t(p.max_blocks_per_seq) * p.block_size);
  if (routed_to_decode(p.decode_max_q, s)) return;
  const int rows_per_block = portable::kWarps * 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_stride = int64_t(p.num_heads) * p.head_dim;
  const float* ws_out = static_cast<const float*>(p.workspace);
  const float* ws_lse = ws_out + int64_t(p.num_splits) * p.total_q * q_stride;
  for (int i = blockIdx.x * rows_per_block + warp; i < min(s.num_q, int(blockIdx.x + 1) * rows_per_block);
       i += portable::kWarps) {
    const int64_t row = s.q_start + i;
    float top = -XLA_ATTN_INF;
    for (int sp = 0; sp < p.num_splits; ++sp)
      top = fmaxf(top, ws_lse[(int64_t(sp) * p.num_heads + h) * p.total_q + row]);
    float total = 0.f;
    if (top != -XLA_ATTN_INF) {
      for (int sp = 0; sp < p.num_splits; ++sp)
        total += expf(ws_lse[(int64_t(sp) * p.num_heads + h) * p.total_q + row] - top);
    }
    const float lse = top == -XLA_ATTN_INF ? XLA_ATTN_INF : top + logf(total);
    for (int d = lane; d < p.head_dim; d += 32) {
      float o = 0.f;
      if (top != -XLA_ATTN_INF) {
        for (int sp = 0; sp < p.num_splits; ++sp) {
          const float w = expf(ws_lse[(int64_t(sp) * p.num_heads + h) * p.total_q + row] - lse);
          o += w * ws_out[(sp * p.total_q + row) * q_stride + h * p.head_dim + d];
        }
      }
      static_cast<Out*>(p.out)[row * q_stride + h * p.head_dim + d] = from_float<Out>(o);
    }
    if (lane == 0 && p.softmax_lse) p.softmax_lse[int64_t(h) * p.total_q + row] = lse;
  }
}

}  // namespace xla_attn
