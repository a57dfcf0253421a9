// Per-sequence geometry and the attention mask, shared by every flash family.
// cu_seqlens, seqused_k, block tables and batch_used are device data and untrusted:
// every index is clamped so that nothing outside the tensors is ever touched
// (the same clamping as the host reference, kernels/host/attention_core.cc).
#pragma once
#include "common/types.h"

namespace xla_attn {

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// What a sequence b of a varlen batch covers. Rows are global (into q/out), keys are
// sequence-local indices 0..num_k-1 mapped to rows by KeyRows.
struct Sequence {
  int64_t q_start;  // first global query row
  int num_q;        // Lq
  int64_t k_start;  // first global key row (not paged)
  int num_k;        // Lk (keys the softmax sees)
  int num_k_rows;   // keys that own gradient rows: the cu_seqlens_k span (>= num_k)
  int offset;       // Lk - Lq: query row i sits at key position i + offset
};

// Number of real sequences: batch, or *batch_used clamped to it.
__device__ __forceinline__ int real_batch(int batch, const int32_t* batch_used) {
  return batch_used ? int(clamp64(*batch_used, 0, batch)) : batch;
}

// Longest first at the end of a grid of (block x, head y, sequence z; x fastest, z up
// to batch + 1 with the padding sequence last) whose x blocks carry uneven work (a causal
// mask), run one block an SM (the sm90 kernels). Grid order starts a head's blocks
// together (they share its K / V or Q / dO rows in L2), so the last wave still holds
// the last heads' long blocks, started last. The last (head, sequence) pairs, enough for
// two blocks an SM, instead start block 0 of every pair, then block 1, ...: the caller
// numbers x so that block 0 is the longest. A list-scheduling model of the bench's
// causal rows (tools/tail_model.py) puts the grid order's finish 3-7 % (dk/dv) / 6-14 %
// (forward) above the work over 132 SMs, this order's 1-4 %; measured on an H100:
// causal fwd+bwd +1-4 %, forward d256 S = 4096 +9-13 %, d128 +2-6 %, but d256 S = 512 (4
// row blocks a head) -3 %. Remaps (x, y, z) of such a block of `blocks` x `heads` x
// (batch + 1) run `sms` at a time; the padding blocks stay. The persistent forward
// (fwd_sm90_walk.cuh) remaps its items so, its blocks claiming them in order; its tail
// covers `waves` items an SM (launch.cc: 8 where sequence lengths differ).
// 32-bit: the launchers keep these grids under 2^31 blocks.
__device__ __forceinline__ void longest_first_tail(int batch, int blocks, int heads, int sms,
                                                   int* x, int* y, int* z, int waves = 2) {
  const int pairs = heads * batch;
  const int tail_pairs = min(pairs, (waves * sms + blocks - 1) / blocks);
  const int tail0 = (pairs - tail_pairs) * blocks;
  const int linear = *x + blocks * (*y + heads * *z);
  if (linear >= tail0 && linear < pairs * blocks) {
    const int j = linear - tail0, pair = pairs - tail_pairs + j % tail_pairs;
    *x = j / tail_pairs;
    *y = pair % heads;
    *z = pair / heads;
  }
}
// The same for the grid itself (one block an SM).
__device__ __forceinline__ void longest_first_tail(int batch, int* x, int* y, int* z) {
  unsigned sms;
  asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
  longest_first_tail(batch, int(gridDim.x), int(gridDim.y), int(sms), x, y, z);
}

__device__ __forceinline__ Sequence sequence(int b, const int32_t* cu_q, const int32_t* cu_k,
                                             const int32_t* seqused_k, int64_t total_q,
                                             int64_t total_k, bool paged, int64_t paged_max_k) {
  Sequence s;
  s.q_start = clamp64(cu_q[b], 0, total_q);
  s.num_q = int(clamp64(cu_q[b + 1], s.q_start, total_q) - s.q_start);
  if (paged) {
    s.k_start = 0;
    int64_t len = seqused_k ? int64_t(seqused_k[b])
                            : (cu_k ? int64_t(cu_k[b + 1]) - int64_t(cu_k[b]) : 0);
    s.num_k = int(clamp64(len, 0, paged_max_k));
    s.num_k_rows = s.num_k;
  } else {
    s.k_start = clamp64(cu_k[b], 0, total_k);
    s.num_k_rows = int(clamp64(cu_k[b + 1], s.k_start, total_k) - s.k_start);
    s.num_k = seqused_k ? int(clamp64(seqused_k[b], 0, s.num_k_rows)) : s.num_k_rows;
  }
  s.offset = s.num_k - s.num_q;
  return s;
}

// paged_attention serves sequences of at most decode_max_q queries with its decode
// kernel; the flash kernels it also launches leave those alone.
__device__ __forceinline__ bool routed_to_decode(int decode_max_q, const Sequence& s) {
  return decode_max_q > 0 && s.num_q <= decode_max_q;
}

// Sliding window around position pos (window_right = 0 is causal); -1 = unbounded.
struct Window {
  int left, right;
  __device__ __forceinline__ bool visible(int64_t pos, int64_t j) const {
    return (left < 0 || j >= pos - left) && (right < 0 || j <= pos + right);
  }
  // Keys [lo, hi) some row in [row_lo, row_hi] (positions row + offset) can see.
  __device__ __forceinline__ void key_range(int64_t row_lo, int64_t row_hi, int offset, int num_k,
                                            int* lo, int* hi) const {
    int64_t a = left < 0 ? 0 : row_lo + offset - left;
    int64_t b = right < 0 ? int64_t(num_k) : row_hi + offset + right + 1;
    *lo = int(clamp64(a, 0, num_k));
    *hi = int(clamp64(b, *lo, num_k));
  }
  // Query rows [lo, hi) that can see some key in [key_lo, key_hi].
  __device__ __forceinline__ void row_range(int64_t key_lo, int64_t key_hi, int offset, int num_q,
                                            int* lo, int* hi) const {
    int64_t a = right < 0 ? 0 : key_lo - right - offset;
    int64_t b = left < 0 ? int64_t(num_q) : key_hi + left - offset + 1;
    *lo = int(clamp64(a, 0, num_q));
    *hi = int(clamp64(b, *lo, num_q));
  }
  // The rows below num_q that see key `key` (none where key >= num_k), relative to row
  // `first` and clamped to [0, span]: a masked tile's per-key bounds, so that an element
  // of the tile tests two constants.
  __device__ __forceinline__ void rows_seeing_key(int key, int num_k, int offset, int num_q,
                                                  int first, int span, int* lo, int* hi) const {
    int a = 0, b = 0;
    if (key < num_k) row_range(key, key, offset, num_q, &a, &b);
    *lo = int(clamp64(a - first, 0, span));
    *hi = int(clamp64(b - first, 0, span));
  }
  // Keys [lo, hi) that every row in [row_lo, row_hi] sees: from the last row's window
  // start to the first row's window end (empty where those cross). A tile inside them
  // needs no element-wise mask.
  __device__ __forceinline__ void keys_seen_by_all(int64_t row_lo, int64_t row_hi, int offset,
                                                   int num_k, int* lo, int* hi) const {
    key_range(row_hi, row_lo, offset, num_k, lo, hi);
  }
  // Query rows [lo, hi) that see every key in [key_lo, key_hi].
  __device__ __forceinline__ void rows_seeing_all(int64_t key_lo, int64_t key_hi, int offset,
                                                  int num_q, int* lo, int* hi) const {
    row_range(key_hi, key_lo, offset, num_q, lo, hi);
  }
};

// Sequence-local key j -> global row of k/v, or -1 for a page that is not there.
struct KeyRows {
  const int32_t* table;  // null: contiguous keys starting at k_start
  int max_blocks, block_size, num_blocks;
  __device__ __forceinline__ int64_t row(int b, int64_t k_start, int j) const {
    if (!table) return k_start + j;
    // Block sizes are powers of two in practice (8..128): a shift and a mask there,
    // instead of an integer division (~20 instructions and a branch) per lookup.
    int page, slot;
    if ((block_size & (block_size - 1)) == 0) {
      page = j >> (__ffs(block_size) - 1);
      slot = j & (block_size - 1);
    } else {
      page = j / block_size;
      slot = j % block_size;
    }
    const int32_t block = table[int64_t(b) * max_blocks + page];
    if (block < 0 || block >= num_blocks) return -1;
    return int64_t(block) * block_size + slot;
  }
};

// The score transform: softcap, then ALiBi (flash-attn's order).
struct ScoreMod {
  float scale, softcap, slope;  // slope 0: no ALiBi
  __device__ __forceinline__ float operator()(float dot, int64_t pos, int64_t j) const {
    float s = dot * scale;
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    if (slope != 0.f) s -= slope * float(pos > j ? pos - j : j - pos);
    return s;
  }
  // d score / d (scale * dot): the softcap's tanh derivative (ALiBi is additive).
  __device__ __forceinline__ float grad(float dot) const {
    if (softcap <= 0.f) return 1.f;
    const float t = tanhf(dot * scale / softcap);
    return 1.f - t * t;
  }
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace xla_attn
