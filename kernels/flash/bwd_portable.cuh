// Flash attention backward, portable family (sm_70+, fp32 arithmetic on CUDA cores).
// Two kernels, both recomputing P = exp(S - lse) from the forward's softmax_lse:
//   dq:   one block per (query tile, head): dq_i = scale * sum_j dS_ij k_j
//   dkdv: one block per (key tile, kv head), looping over the query heads of its
//         GQA group: dv_j = sum_i P_ij dO_i, dk_j = scale * sum_i dS_ij q_i
// with dS_ij = P_ij (dO_i . v_j - D_i) * softcap'(s_ij) and D_i = dO_i . O_i - dlse_i
// (dlse: softmax_lse's cotangent, 0 without one).
// Every gradient element has exactly one owner, so there are no atomics and no
// workspace, and results are deterministic; the price is computing S twice.
#pragma once
#include "common/vec.cuh"
#include "flash/params.h"
#include "flash/portable_tiles.h"
#include "flash/sequence.cuh"

namespace xla_attn {

// Zeroes rows [first, rows) of a [rows, heads, head_dim] gradient for head h.
template <typename T>
__device__ void zero_rows(void* grad, int64_t first, int64_t rows, int heads, int h, int hd) {
  T* g = static_cast<T*>(grad);
  for (int64_t idx = threadIdx.x; idx < (rows - first) * hd; idx += blockDim.x) {
    g[((first + idx / hd) * heads + h) * hd + idx % hd] = from_float<T>(0.f);
  }
}

// The dq kernels' padding block (blockIdx.z == batch): its x == 0 block zeroes dq's
// rows of head blockIdx.y past the last sequence. True for every padding block.
template <typename T>
__device__ bool dq_padding_block(const xla_attn_flash_bwd_params& p) {
  if (int(blockIdx.z) < p.batch) return false;
  if (blockIdx.x == 0) {
    const int64_t first = clamp64(p.cu_seqlens_q[p.batch], 0, p.total_q);
    zero_rows<T>(p.dq, first, p.total_q, p.num_heads, blockIdx.y, p.head_dim);
  }
  return true;
}

// The dk/dv kernels' padding block (blockIdx.z == batch): its x == 0 block zeroes dk's
// and dv's rows of kv head blockIdx.y past the last sequence's keys. True for every
// padding block.
template <typename T>
__device__ bool dkdv_padding_block(const xla_attn_flash_bwd_params& p) {
  if (int(blockIdx.z) < p.batch) return false;
  if (blockIdx.x == 0) {
    const int64_t first = clamp64(p.cu_seqlens_k[p.batch], 0, p.total_k);
    zero_rows<T>(p.dk, first, p.total_k, p.num_heads_k, blockIdx.y, p.head_dim);
    zero_rows<T>(p.dv, first, p.total_k, p.num_heads_k, blockIdx.y, p.head_dim);
  }
  return true;
}

// D_i = dO_i . O_i for a row, by one warp.
template <typename T>
__device__ __forceinline__ float row_delta(const T* dout, const T* out, int hd) {
  float acc = 0.f;
  for (int d = threadIdx.x % 32; d < hd; d += 32) acc += to_float(dout[d]) * to_float(out[d]);
  return warp_sum(acc);
}

// softmax_lse's cotangent for (head, row), 0 without one. d lse_i / d s_ij = p_ij, so it
// adds p_ij dlse_i to dS_ij = p_ij (dP_ij - D_i): every family subtracts it from D_i.
__device__ __forceinline__ float lse_cotangent(const xla_attn_flash_bwd_params& p, int h,
                                               int64_t row) {
  return p.dlse ? p.dlse[int64_t(h) * p.total_q + row] : 0.f;
}

__device__ __forceinline__ Sequence bwd_sequence(const xla_attn_flash_bwd_params& p, int b) {
  return sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q, p.total_k, false, 0);
}

template <typename T, int D>
__device__ void flash_bwd_dq_portable(const xla_attn_flash_bwd_params& p) {
  constexpr int kRows = portable::bwd_rows_per_warp(D);
  constexpr int kBlockM = portable::bwd_block_m(D);
  constexpr int kBlockN = portable::block_n(D);
  constexpr int kSplit = 32 / kBlockN;
  constexpr int kDims = D / 32;
  __shared__ float sQ[kBlockM][D];
  __shared__ float sdO[kBlockM][D];
  __shared__ float sK[kBlockN][D + 1];
  __shared__ float sV[kBlockN][D + 1];
  __shared__ float sdS[portable::kWarps][kRows][kBlockN];
  __shared__ bool sValid[kBlockN];

  const int h = blockIdx.y, b = blockIdx.z, hd = p.head_dim;
  if (dq_padding_block<T>(p)) return;
  const Sequence s = bwd_sequence(p, b);
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= s.num_q) return;
  const int hk = h / (p.num_heads / p.num_heads_k);
  const int64_t q_stride = int64_t(p.num_heads) * hd, kv_stride = int64_t(p.num_heads_k) * hd;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(p.dout);
  const T* out = static_cast<const T*>(p.out);
  const Window win{p.window_left, p.window_right};
  const ScoreMod mod{p.softmax_scale, p.softcap,
                     p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f};

  for (int idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, i = m0 + r;
    const bool in = i < s.num_q && d < hd;
    const int64_t off = (s.q_start + i) * q_stride + h * hd + d;
    sQ[r][d] = in ? to_float(q[off]) : 0.f;
    sdO[r][d] = in ? to_float(dout[off]) : 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float lse[kRows], delta[kRows], acc[kRows][kDims];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = min(m0 + warp * kRows + r, s.num_q - 1);  // clamped rows are never used
    const int64_t row = s.q_start + i;
    lse[r] = p.softmax_lse[int64_t(h) * p.total_q + row];
    delta[r] = row_delta(dout + row * q_stride + h * hd, out + row * q_stride + h * hd, hd) -
               lse_cotangent(p, h, row);
#pragma unroll
    for (int e = 0; e < kDims; ++e) acc[r][e] = 0.f;
  }
  int n_lo, n_hi;
  win.key_range(m0, min(m0 + kBlockM, s.num_q) - 1, s.offset, s.num_k, &n_lo, &n_hi);
  for (int n0 = n_lo; n0 < n_hi; n0 += kBlockN) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) {
      const int kk = idx / D, d = idx % D, j = n0 + kk;
      const bool in = j < n_hi && d < hd;
      const int64_t off = (s.k_start + j) * kv_stride + hk * hd + d;
      sK[kk][d] = in ? to_float(k[off]) : 0.f;
      sV[kk][d] = in ? to_float(v[off]) : 0.f;
      if (d == 0) sValid[kk] = j < n_hi;
    }
    __syncthreads();
    const int kk = lane / kSplit, part = lane % kSplit;
    const int64_t j = n0 + kk;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = m0 + warp * kRows + r;
      if (i >= s.num_q) break;  // warp-uniform
      float qk = 0.f, dov = 0.f;
#pragma unroll 8
      for (int t = 0; t < D / kSplit; ++t) {
        const int d = part * (D / kSplit) + t;
        qk += sQ[warp * kRows + r][d] * sK[kk][d];
        dov += sdO[warp * kRows + r][d] * sV[kk][d];
      }
#pragma unroll
      for (int off = 1; off < kSplit; off <<= 1) {
        qk += __shfl_xor_sync(0xffffffffu, qk, off);
        dov += __shfl_xor_sync(0xffffffffu, dov, off);
      }
      const int64_t pos = int64_t(i) + s.offset;
      const bool vis = sValid[kk] && win.visible(pos, j) && lse[r] != XLA_ATTN_INF;
      const float prob = vis ? expf(mod(qk, pos, j) - lse[r]) : 0.f;
      if (part == 0) sdS[warp][r][kk] = prob * (dov - delta[r]) * mod.grad(qk);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (m0 + warp * kRows + r >= s.num_q) break;
#pragma unroll 4
      for (int jj = 0; jj < kBlockN; ++jj) {
        const float ds = sdS[warp][r][jj];
#pragma unroll
        for (int e = 0; e < kDims; ++e) acc[r][e] += ds * sK[jj][lane + 32 * e];
      }
    }
  }
  T* dq = static_cast<T*>(p.dq);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + warp * kRows + r;
    if (i >= s.num_q) break;
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int d = lane + 32 * e;
      if (d < hd) dq[(s.q_start + i) * q_stride + h * hd + d] = from_float<T>(acc[r][e] * p.softmax_scale);
    }
  }
}

template <typename T, int D>
__device__ void flash_bwd_dkdv_portable(const xla_attn_flash_bwd_params& p) {
  constexpr int kRows = portable::bwd_rows_per_warp(D);  // keys owned per warp
  constexpr int kBlockM = portable::bwd_block_m(D);
  constexpr int kBlockN = portable::block_n(D);          // query rows per tile
  constexpr int kSplit = 32 / kBlockN;
  constexpr int kDims = D / 32;
  __shared__ float sK[kBlockM][D];
  __shared__ float sV[kBlockM][D];
  __shared__ float sQ[kBlockN][D + 1];
  __shared__ float sdO[kBlockN][D + 1];
  __shared__ float sLse[kBlockN];
  __shared__ float sDelta[kBlockN];
  __shared__ float sP[portable::kWarps][kRows][kBlockN];
  __shared__ float sdS[portable::kWarps][kRows][kBlockN];

  const int hk = blockIdx.y, b = blockIdx.z, hd = p.head_dim;
  if (dkdv_padding_block<T>(p)) return;
  const Sequence s = bwd_sequence(p, b);
  const int n0 = blockIdx.x * kBlockM;
  if (n0 >= s.num_k_rows) return;
  const int group = p.num_heads / p.num_heads_k;
  const int64_t q_stride = int64_t(p.num_heads) * hd, kv_stride = int64_t(p.num_heads_k) * hd;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* out = static_cast<const T*>(p.out);
  const Window win{p.window_left, p.window_right};

  for (int idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, j = n0 + r;
    const bool in = j < s.num_k && d < hd;  // keys past seqused_k take no part
    const int64_t off = (s.k_start + j) * kv_stride + hk * hd + d;
    sK[r][d] = in ? to_float(static_cast<const T*>(p.k)[off]) : 0.f;
    sV[r][d] = in ? to_float(static_cast<const T*>(p.v)[off]) : 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float dk[kRows][kDims], dv[kRows][kDims];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kDims; ++e) dk[r][e] = dv[r][e] = 0.f;
  }
  int i_lo = 0, i_hi = 0;
  if (n0 < s.num_k) win.row_range(n0, min(n0 + kBlockM, s.num_k) - 1, s.offset, s.num_q, &i_lo, &i_hi);

  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const ScoreMod mod{p.softmax_scale, p.softcap,
                       p.alibi_slopes ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : 0.f};
    for (int i0 = i_lo; i0 < i_hi; i0 += kBlockN) {
      __syncthreads();
      for (int idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) {
        const int ii = idx / D, d = idx % D, i = i0 + ii;
        const bool in = i < i_hi && d < hd;
        const int64_t off = (s.q_start + i) * q_stride + h * hd + d;
        sQ[ii][d] = in ? to_float(q[off]) : 0.f;
        sdO[ii][d] = in ? to_float(dout[off]) : 0.f;
      }
      for (int ii = warp; ii < kBlockN; ii += portable::kWarps) {
        const int i = min(i0 + ii, i_hi - 1);
        const int64_t row = s.q_start + i;
        const float delta =
            row_delta(dout + row * q_stride + h * hd, out + row * q_stride + h * hd, hd) -
            lse_cotangent(p, h, row);
        if (lane == 0) {
          sDelta[ii] = delta;
          sLse[ii] = i0 + ii < i_hi ? p.softmax_lse[int64_t(h) * p.total_q + row] : XLA_ATTN_INF;
        }
      }
      __syncthreads();
      const int ii = lane / kSplit, part = lane % kSplit;
      const int64_t pos = int64_t(i0 + ii) + s.offset;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int j = n0 + warp * kRows + r;
        if (j >= s.num_k) break;  // warp-uniform
        float qk = 0.f, dov = 0.f;
#pragma unroll 8
        for (int t = 0; t < D / kSplit; ++t) {
          const int d = part * (D / kSplit) + t;
          qk += sK[warp * kRows + r][d] * sQ[ii][d];
          dov += sV[warp * kRows + r][d] * sdO[ii][d];
        }
#pragma unroll
        for (int off = 1; off < kSplit; off <<= 1) {
          qk += __shfl_xor_sync(0xffffffffu, qk, off);
          dov += __shfl_xor_sync(0xffffffffu, dov, off);
        }
        const bool vis = win.visible(pos, j) && sLse[ii] != XLA_ATTN_INF;
        const float prob = vis ? expf(mod(qk, pos, j) - sLse[ii]) : 0.f;
        if (part == 0) {
          sP[warp][r][ii] = prob;
          sdS[warp][r][ii] = prob * (dov - sDelta[ii]) * mod.grad(qk);
        }
      }
      __syncwarp();
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (n0 + warp * kRows + r >= s.num_k) break;
#pragma unroll 4
        for (int jj = 0; jj < kBlockN; ++jj) {
          const float pr = sP[warp][r][jj], ds = sdS[warp][r][jj];
#pragma unroll
          for (int e = 0; e < kDims; ++e) {
            dv[r][e] += pr * sdO[jj][lane + 32 * e];
            dk[r][e] += ds * sQ[jj][lane + 32 * e];
          }
        }
      }
    }
  }
  T* gk = static_cast<T*>(p.dk);
  T* gv = static_cast<T*>(p.dv);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = n0 + warp * kRows + r;
    if (j >= s.num_k_rows) break;
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int d = lane + 32 * e;
      if (d >= hd) continue;
      const int64_t off = (s.k_start + j) * kv_stride + hk * hd + d;
      gk[off] = from_float<T>(dk[r][e] * p.softmax_scale);
      gv[off] = from_float<T>(dv[r][e]);
    }
  }
}

}  // namespace xla_attn
