// Internal to kernels/host: the attention core shared by flash_fwd, flash_bwd and
// paged_attention. One place decides which keys a query row sees and with what
// score; the ops differ only in how they find their sequences and what they do
// with the scores.
#pragma once
#include <stdint.h>

#include <string>
#include <vector>

#include "common/checks.h"  // is_fp8_dtype
#include "common/types.h"

namespace xla_attn::host {

// F32, F16, BF16 or an fp8 format: the dtypes load_as_float / store_from_float
// handle. (common/checks.h's is_float_dtype excludes fp8.)
bool is_float_or_fp8(xla_attn_dtype t);

// "" if the head counts can be used (num_heads_k > 0 divides num_heads > 0,
// head_dim >= 0), else why not: guards the divisions in kv_head().
std::string check_heads(int64_t num_heads, int64_t num_heads_k, int64_t head_dim);

// A dense [rows, heads, dim] tensor of a float dtype, read as double. Every element
// read is multiplied by `scale` (fp8 dequantization; 1 otherwise). The product of a
// float and an fp8 value is exact in double, so the scale costs no precision.
struct Tensor {
  const void* data = nullptr;
  xla_attn_dtype dtype = XLA_ATTN_F32;
  int64_t heads = 0;
  int64_t dim = 0;
  double scale = 1.0;

  int64_t index(int64_t row, int64_t head) const { return (row * heads + head) * dim; }
  void load(int64_t row, int64_t head, double* dst) const;            // dst = t[row, head, :]
  double dot(const double* x, int64_t row, int64_t head) const;       // x . t[row, head, :]
  void axpy(double a, int64_t row, int64_t head, double* acc) const;  // acc += a t[row, head, :]
};

// Where the keys of one sequence live: key j -> row of the K/V tensors, or -1 when
// the key is to be skipped (a paged key whose block id is invalid).
struct KeyRows {
  int64_t first_row = 0;                 // contiguous: key j is row first_row + j
  const int32_t* blocks = nullptr;       // paged: this sequence's block-table row
  int64_t block_size = 0;
  int64_t num_blocks = 0;

  int64_t row(int64_t j) const {
    if (blocks == nullptr) return first_row + j;
    const int64_t blk = blocks[j / block_size];
    if (blk < 0 || blk >= num_blocks) return -1;
    return blk * block_size + j % block_size;
  }
};

// A block table over K/V viewed as [num_blocks * block_size, heads, dim]. With
// table == nullptr the K/V are contiguous (not paged).
struct Paging {
  const int32_t* table = nullptr;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;

  // Most keys one sequence can address; lengths are clamped to it, which also
  // keeps every block-table read inside sequence `seq`'s row.
  int64_t capacity() const;
  KeyRows keys_of(int64_t seq) const;
};

// One sequence, its index data already clamped: query rows
// [q_start, q_start + num_q) of q/out and keys 0 .. num_k-1 found through `keys`.
struct Sequence {
  int64_t q_start = 0;
  int64_t num_q = 0;
  int64_t num_k = 0;
  int64_t num_k_rows = 0;  // flash: keys that own gradient rows, the cu_seqlens_k span (>= num_k)
  KeyRows keys;
  const float* alibi_slopes = nullptr;  // this sequence's [num_heads] slopes, or null
};

// Rows [*start, *end) of entry b of an untrusted offsets array (cu_seqlens_q,
// query_start_loc): start = clamp(offsets[b], 0, total),
// end = clamp(offsets[b + 1], start, total).
void clamp_range(const int32_t* offsets, int64_t b, int64_t total, int64_t* start, int64_t* end);

// The sequences of the flash API, forward and backward alike (see flash_fwd).
std::vector<Sequence> flash_sequences(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                      const int32_t* seqused_k, int64_t batch, int64_t total_q,
                                      int64_t total_k, const Paging& paging,
                                      const float* alibi_slopes, int64_t alibi_batch_stride);

// The GPU kernels size their grids by max_seqlen_q / max_seqlen_k and compute no query
// row or key past them. The Host reads the lengths, so a sequence longer than its hint
// is an error here (naming the sequence) rather than a result no GPU gives. `key_rows`
// (the backward: every cu_seqlens_k row owns a gradient row) checks num_k_rows instead
// of the keys seen.
std::string check_length_hints(const char* op, const std::vector<Sequence>& seqs,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, bool key_rows = false);

struct ScoreOptions {
  double scale = 1.0;         // multiplies q . k
  double softcap = 0.0;       // > 0: s = softcap * tanh(s / softcap)
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded; causal is 0
};

// A key visible to a query row: its K/V row, its score s, and d s / d(scale * q.k)
// before alibi (the softcap's 1 - tanh^2, or 1 without softcap).
struct Score {
  int64_t row;
  double s;
  double dsoftcap;
};

struct Attention {
  Tensor q, k, v;
  int64_t num_heads = 0;
  int64_t num_heads_k = 0;  // divides num_heads (MQA / GQA)
  ScoreOptions opt;

  int64_t kv_head(int64_t h) const { return h / (num_heads / num_heads_k); }

  // The keys that query i (0-based within seq) of head h sees, with their scores,
  // in key order. q_row is that query, widened. Query i sits at key position
  // pos = i + num_k - num_q (bottom-right aligned) and sees key j iff
  //   (window_left < 0 || j >= pos - window_left) &&
  //   (window_right < 0 || j <= pos + window_right), and j is not skipped.
  void scores(const Sequence& seq, int64_t i, int64_t h, const double* q_row,
              std::vector<Score>* out) const;
};

// Softmax attention of every query row of `seqs`. out ([total_q, num_heads, dim] of
// out_dtype) is zero-filled and lse ([num_heads, total_q], may be null) +inf-filled
// first, so rows outside every sequence and rows that see no key stay 0 / +inf.
void attention_forward(const Attention& a, const std::vector<Sequence>& seqs, int64_t total_q,
                       void* out, xla_attn_dtype out_dtype, float* lse);

}  // namespace xla_attn::host
