// The attention core shared by flash_fwd, flash_bwd and paged_attention: tensor
// access, untrusted-index clamping, masking and scoring, and the forward softmax.
#include "host/attention_core.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common/convert_host.h"

namespace xla_attn::host {

bool is_float_or_fp8(xla_attn_dtype t) { return is_float_dtype(t) || is_fp8_dtype(t); }

std::string check_heads(int64_t num_heads, int64_t num_heads_k, int64_t head_dim) {
  if (num_heads <= 0 || num_heads_k <= 0 || num_heads % num_heads_k != 0)
    return "num_heads (" + std::to_string(num_heads) + ") must be a positive multiple of num_heads_k (" +
           std::to_string(num_heads_k) + ")";
  if (head_dim < 0) return "negative head_dim";
  return "";
}

// ---- Tensor ----

void Tensor::load(int64_t row, int64_t head, double* dst) const {
  const int64_t base = index(row, head);
  for (int64_t d = 0; d < dim; ++d) dst[d] = scale * load_as_float(data, base + d, dtype);
}

double Tensor::dot(const double* x, int64_t row, int64_t head) const {
  const int64_t base = index(row, head);
  double sum = 0.0;
  for (int64_t d = 0; d < dim; ++d) sum += x[d] * (scale * load_as_float(data, base + d, dtype));
  return sum;
}

void Tensor::axpy(double a, int64_t row, int64_t head, double* acc) const {
  const int64_t base = index(row, head);
  for (int64_t d = 0; d < dim; ++d) acc[d] += a * (scale * load_as_float(data, base + d, dtype));
}

// ---- Untrusted index data ----

int64_t Paging::capacity() const {
  return std::max<int64_t>(max_blocks_per_seq, 0) * std::max<int64_t>(block_size, 0);
}

KeyRows Paging::keys_of(int64_t seq) const {
  KeyRows keys;
  keys.blocks = table + seq * std::max<int64_t>(max_blocks_per_seq, 0);
  keys.block_size = block_size;
  keys.num_blocks = num_blocks;
  return keys;
}

void clamp_range(const int32_t* offsets, int64_t b, int64_t total, int64_t* start, int64_t* end) {
  *start = std::clamp<int64_t>(offsets[b], 0, total);
  *end = std::clamp<int64_t>(offsets[b + 1], *start, total);
}

std::vector<Sequence> flash_sequences(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                      const int32_t* seqused_k, int64_t batch, int64_t total_q,
                                      int64_t total_k, const Paging& paging,
                                      const float* alibi_slopes, int64_t alibi_batch_stride) {
  std::vector<Sequence> seqs(static_cast<size_t>(std::max<int64_t>(batch, 0)));
  for (int64_t b = 0; b < batch; ++b) {
    Sequence& s = seqs[b];
    int64_t q_end;
    clamp_range(cu_seqlens_q, b, total_q, &s.q_start, &q_end);
    s.num_q = q_end - s.q_start;
    if (paging.table == nullptr) {
      // Keys are rows [k_start, k_end) of K/V; seqused_k may only shorten that.
      int64_t k_start, k_end;
      clamp_range(cu_seqlens_k, b, total_k, &k_start, &k_end);
      s.num_k = s.num_k_rows = k_end - k_start;
      if (seqused_k != nullptr) s.num_k = std::clamp<int64_t>(seqused_k[b], 0, s.num_k);
      s.keys.first_row = k_start;
    } else {
      // Paged: only the length matters (the keys sit at positions 0.. of the
      // sequence's pages), bounded by what its block-table row can address.
      // int64 arithmetic: the difference of two hostile int32s can overflow int32.
      s.num_k = seqused_k != nullptr
                    ? int64_t{seqused_k[b]}
                    : int64_t{cu_seqlens_k[b + 1]} - int64_t{cu_seqlens_k[b]};
      s.num_k = s.num_k_rows = std::clamp<int64_t>(s.num_k, 0, paging.capacity());
      s.keys = paging.keys_of(b);
    }
    if (alibi_slopes != nullptr) s.alibi_slopes = alibi_slopes + b * alibi_batch_stride;
  }
  return seqs;
}

std::string check_length_hints(const char* op, const std::vector<Sequence>& seqs,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, bool key_rows) {
  const char* key_source = key_rows ? "cu_seqlens_k" : "cu_seqlens_k / seqused_k";
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int64_t keys = key_rows ? seqs[b].num_k_rows : seqs[b].num_k;
    if (seqs[b].num_q > max_seqlen_q)
      return std::string(op) + ": sequence " + std::to_string(b) + " has " +
             std::to_string(seqs[b].num_q) + " queries (cu_seqlens_q), more than max_seqlen_q = " +
             std::to_string(max_seqlen_q) + ": a GPU computes no row past it";
    if (keys > max_seqlen_k)
      return std::string(op) + ": sequence " + std::to_string(b) + " has " + std::to_string(keys) +
             " keys (" + key_source + "), more than max_seqlen_k = " +
             std::to_string(max_seqlen_k) + ": a GPU computes no key past it";
  }
  return "";
}

// ---- Scores ----

void Attention::scores(const Sequence& seq, int64_t i, int64_t h, const double* q_row,
                       std::vector<Score>* out) const {
  out->clear();
  const int64_t pos = i + seq.num_k - seq.num_q;  // may be negative
  // The visible keys form the interval [lo, hi) (before skipping invalid blocks).
  int64_t lo = 0, hi = seq.num_k;
  if (opt.window_left >= 0) lo = std::max(lo, pos - opt.window_left);
  if (opt.window_right >= 0) hi = std::min(hi, pos + opt.window_right + 1);
  const int64_t kvh = kv_head(h);
  const double slope = seq.alibi_slopes != nullptr ? seq.alibi_slopes[h] : 0.0;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t row = seq.keys.row(j);
    if (row < 0) continue;
    double s = opt.scale * k.dot(q_row, row, kvh);
    double dsoftcap = 1.0;
    if (opt.softcap > 0.0) {
      const double t = std::tanh(s / opt.softcap);
      s = opt.softcap * t;
      dsoftcap = 1.0 - t * t;
    }
    // ALiBi is applied after the softcap, as in flash-attn.
    if (seq.alibi_slopes != nullptr) s -= slope * static_cast<double>(std::abs(pos - j));
    out->push_back({row, s, dsoftcap});
  }
}

// ---- Forward ----

void attention_forward(const Attention& a, const std::vector<Sequence>& seqs, int64_t total_q,
                       void* out, xla_attn_dtype out_dtype, float* lse) {
  const int64_t dim = a.q.dim;
  const int64_t out_elems = total_q * a.num_heads * dim;
  for (int64_t e = 0; e < out_elems; ++e) store_from_float(out, e, out_dtype, 0.0f);
  if (lse != nullptr) std::fill(lse, lse + a.num_heads * total_q, INFINITY);

  std::vector<double> q_row(dim), acc(dim);
  std::vector<Score> scores;
  for (const Sequence& seq : seqs) {
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const int64_t kvh = a.kv_head(h);
      for (int64_t i = 0; i < seq.num_q; ++i) {
        const int64_t row = seq.q_start + i;
        a.q.load(row, h, q_row.data());
        a.scores(seq, i, h, q_row.data(), &scores);
        double m = -INFINITY;
        for (const Score& sc : scores) m = std::max(m, sc.s);
        // No visible key (or every score -inf): leave the row 0 / +inf. Writing it
        // explicitly matters only when hostile sequences overlap.
        const bool empty = !(m > -INFINITY);
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        if (!empty) {
          for (const Score& sc : scores) {
            const double w = std::exp(sc.s - m);  // stable: every exponent <= 0
            sum += w;
            a.v.axpy(w, sc.row, kvh, acc.data());
          }
        }
        const int64_t base = a.q.index(row, h);  // out has q's shape
        for (int64_t d = 0; d < dim; ++d)
          store_from_float(out, base + d, out_dtype, empty ? 0.0f : static_cast<float>(acc[d] / sum));
        if (lse != nullptr)
          lse[h * total_q + row] = empty ? INFINITY : static_cast<float>(m + std::log(sum));
      }
    }
  }
}

}  // namespace xla_attn::host
