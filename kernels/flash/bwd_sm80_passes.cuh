// The sm80 backward's passes around its dk/dv and dq kernels (bwd_sm80.cuh has the
// family's structure): D = dO . O before them (flash_bwd_delta_sm80, which also
// zeroes the dQ accumulator), and dq from the accumulator after them
// (flash_bwd_dq_convert_sm80).
#pragma once
#include "flash/bwd_sm80_tile.cuh"

namespace xla_attn {

// D_i = dO_i . O_i (bwd_delta) for bwd_delta_rows(hd) rows of one head per block (16; 32
// up to d64, 64 up to d32), grid (ceil(total_q / those rows), num_heads). Where rows are
// whole 16-byte chunks (hd % 8 == 0, aligned tensors, hd / 8 a power of two up to 32) each
// lane takes one chunk of a row, hd / 8 lanes a row, every chunk of the block's rows loaded
// before any sum; else one warp a row, element by element. On the atomic-dQ path the
// blocks also zero the dQ accumulator, each an equal contiguous share of it (16-byte
// stores). ncu (H100, d64, 16384 rows x 32 heads):
// with a warp a row, 2-byte loads and the rows in turn, the kernel took 194.6 us (FA2's
// dot_do_o 96-98); d128 101 us (FA2 93).
template <typename T>
__device__ void flash_bwd_delta_sm80(const xla_attn_flash_bwd_params& p) {
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = p.head_dim;
  const int64_t stride = int64_t(p.num_heads) * hd;
  const T* dout = static_cast<const T*>(p.dout) + int64_t(h) * hd;
  const T* out = static_cast<const T*>(p.out) + int64_t(h) * hd;
  float* delta = bwd_delta(p) + int64_t(h) * p.total_q;
  const int rows = sm80::bwd_delta_rows(hd);
  const int64_t row0 = int64_t(blockIdx.x) * rows;
  const int lanes = hd / 8;  // 16-byte chunks a row
  if (hd % 8 == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 && aligned_to<T>(p.dout, 16) &&
      aligned_to<T>(p.out, 16)) {
    // Thread i: chunk i % lanes of row i / lanes + pass x 128 / lanes; a block's rows
    // take up to 4 passes (d256: 16 rows).
    constexpr int kPasses = 4;
    const int sub = threadIdx.x % lanes, rows_per_pass = sm80::kThreads / lanes;
    uint4 a[kPasses], c[kPasses];
    bool ok[kPasses];
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
      const int r = threadIdx.x / lanes + ps * rows_per_pass;
      ok[ps] = r < rows && row0 + r < p.total_q;
      const int64_t at = ok[ps] ? (row0 + r) * stride + sub * 8 : 0;
      a[ps] = ok[ps] ? *reinterpret_cast<const uint4*>(dout + at) : make_uint4(0u, 0u, 0u, 0u);
      c[ps] = ok[ps] ? *reinterpret_cast<const uint4*>(out + at) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
      if (ps * rows_per_pass >= rows) break;  // block-uniform
      const T* x = reinterpret_cast<const T*>(&a[ps]);
      const T* y = reinterpret_cast<const T*>(&c[ps]);
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += to_float(x[e]) * to_float(y[e]);
      for (int off = lanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      const int64_t row = row0 + threadIdx.x / lanes + ps * rows_per_pass;
      if (sub == 0 && ok[ps]) delta[row] = sum - lse_cotangent(p, h, row);
    }
  } else {
    const int per_warp = rows / sm80::kWarps;
    for (int r = 0; r < per_warp; ++r) {
      const int64_t row = row0 + warp * per_warp + r;
      if (row >= p.total_q) break;  // warp-uniform
      const float d = row_delta(dout + row * stride, out + row * stride, hd);
      if (lane == 0) delta[row] = d - lse_cotangent(p, h, row);
    }
  }
  if (float* acc = bwd_dq_accum(p)) {  // 16-byte aligned (bwd_delta_floats)
    const int64_t n4 = sm80::bwd_acc_floats(p.total_q, p.batch, p.num_heads, hd) / 4;
    const int64_t blocks = int64_t(gridDim.x) * gridDim.y;
    const int64_t share = (n4 + blocks - 1) / blocks;
    const int64_t first = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * share;
    float4* acc4 = reinterpret_cast<float4*>(acc);
    for (int64_t i = first + threadIdx.x; i < min(first + share, n4); i += blockDim.x) {
      acc4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// dq = softmax_scale * the f32 accumulator, rounded to T (atomic-dQ path). Grid
// (ceil(max_seqlen_q / (16 R)), num_heads, batch + 1 padding block), R =
// bwd_convert_row_chunks(hd) row chunks of 16 rows a block: its 4 warps take the
// block's (row chunk, column chunk) pairs in turn, each lane loading the elements it
// added as an mma accumulator, all of them before any store; the rounded rows meet in
// shared memory and leave as 16-byte chunks of whole rows. The padding block zeroes
// dq's rows past the last sequence, as the dq kernel's. ncu (H100, 16384 rows x 2048):
// writing each lane's pairs straight to dq (4-byte stores, 8 rows x 16 bytes a warp
// store, a chunk's loads behind the previous chunk's stores) took 178-188 us at
// d64..d256, FA2's convert_dq 72-78.
template <typename T>
__device__ void flash_bwd_dq_convert_sm80(const xla_attn_flash_bwd_params& p) {
  using namespace sm80;
  const int h = blockIdx.y, b = blockIdx.z, hd = p.head_dim;
  if (dq_padding_block<T>(p)) return;
  const Sequence s = bwd_sequence(p, b);
  const int row_chunks = bwd_convert_row_chunks(hd), col_chunks = bwd_acc_col_chunks(hd);
  const int m0 = blockIdx.x * row_chunks * kAccChunkRows;
  if (m0 >= s.num_q) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* chunks = bwd_dq_accum_rows(p, h, s, b, blockIdx.x * row_chunks);
  // Rows of the block's columns plus 8 (16 bytes): a row is 16 col_chunks + 4 words, so a
  // lane quad's 32-bit stores of rows g fall in distinct banks (4 g + t, or 20 g + t mod
  // 32 for odd col_chunks), and rows stay 16-byte aligned for the chunk reads. The
  // largest tile is d256's, 16 rows x 264 (bwd_convert_tile_fits).
  constexpr int kMaxCols = 256, kTileElems = kAccChunkRows * (kMaxCols + 8);
  constexpr int kPerWarp = kMaxCols / kAccChunkCols / kWarps;  // pairs a warp (d256: 8 / 4)
  const int row_elems = col_chunks * kAccChunkCols + 8;
  const int pairs = row_chunks * col_chunks;
  __shared__ __align__(16) T tile[kTileElems];
  float x[kPerWarp][4][4];  // the lane's 4 floats of n8 tile j of pair warp + 4 u
#pragma unroll
  for (int u = 0; u < kPerWarp; ++u) {
    const int pair = warp + u * kWarps, rc = pair / col_chunks;
    // warp-uniform; a row chunk past the sequence's rows is not its own (the next one's)
    if (pair >= pairs || m0 + rc * kAccChunkRows >= s.num_q) continue;
    const float* src = chunks + pair * kAccChunk;  // chunks go [row chunk][column chunk]
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#if __CUDA_ARCH__ >= 900
      *reinterpret_cast<float4*>(x[u][j]) =
          *reinterpret_cast<const float4*>(src + acc_offset(j, 0, lane));
#else
#pragma unroll
      for (int i = 0; i < 4; ++i) x[u][j][i] = src[acc_offset(j, i, lane)];
#endif
    }
  }
  const float f = p.softmax_scale;
#pragma unroll
  for (int u = 0; u < kPerWarp; ++u) {
    const int pair = warp + u * kWarps, rc = pair / col_chunks, c = pair % col_chunks;
    if (pair >= pairs || m0 + rc * kAccChunkRows >= s.num_q) continue;
    T* rows = tile + rc * kAccChunkRows * row_elems;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int col = c * kAccChunkCols + 8 * j + 2 * t;
        *reinterpret_cast<uint32_t*>(rows + (g + 8 * hf) * row_elems + col) =
            pack2<T>(x[u][j][2 * hf] * f, x[u][j][2 * hf + 1] * f);
      }
    }
  }
  __syncthreads();
  const int rows = min(row_chunks * kAccChunkRows, s.num_q - m0);
  const int64_t stride = int64_t(p.num_heads) * hd;
  T* dq = static_cast<T*>(p.dq) + (s.q_start + m0) * stride + int64_t(h) * hd;
  const bool vec = hd % 8 == 0 && aligned_to<T>(p.dq, 16);
  const int per_row = (hd + 7) / 8;  // 16-byte chunks of a row (the last may be short)
  for (int i = threadIdx.x; i < rows * per_row; i += kThreads) {
    const int r = i / per_row, k = i % per_row;
    store_chunk(dq + r * stride, *reinterpret_cast<const uint4*>(tile + r * row_elems + 8 * k),
                8 * k, hd, vec);
  }
}
}  // namespace xla_attn
