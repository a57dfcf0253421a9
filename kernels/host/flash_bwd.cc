// flash_bwd: gradient of flash_fwd (not paged). The probabilities are recomputed
// from the GIVEN softmax_lse, and D_i from the given out, exactly as the flash-attn
// kernels do, so this is the reference for them rather than an autodiff of the
// forward:
//   p_ij  = exp(s_ij - lse_i)                (0 for rows whose lse is +inf)
//   D_i   = dout_i . out_i - dlse_i           (dlse: softmax_lse's cotangent, or 0)
//   dv_j += p_ij dout_i
//   ds_ij = p_ij (dout_i . v_j - D_i) * (1 - tanh(u_ij)^2 with softcap, else 1)
//   dq_i += softmax_scale ds_ij k_j,   dk_j += softmax_scale ds_ij q_i
// ALiBi is additive in s and does not change the gradient. GQA: dk/dv sum over the
// query heads of their group. Sequences and masks are the forward's.
#include <algorithm>
#include <cmath>

#include "common/convert_host.h"
#include "host/attention_core.h"
#include "host/reference.h"

namespace xla_attn::host {
namespace {

void store_all(void* dst, xla_attn_dtype dtype, const std::vector<double>& src) {
  for (size_t e = 0; e < src.size(); ++e)
    store_from_float(dst, static_cast<int64_t>(e), dtype, static_cast<float>(src[e]));
}

}  // namespace

std::string flash_bwd(const xla_attn_flash_bwd_params& p) {
  const std::string heads = check_heads(p.num_heads, p.num_heads_k, p.head_dim);
  if (!heads.empty()) return "flash_bwd: " + heads;
  if (!is_float_or_fp8(p.dtype)) return "flash_bwd: dtype must be a float dtype";
  if (p.batch < 0 || p.total_q < 0 || p.total_k < 0) return "flash_bwd: negative size";
  if (p.batch > 0 && (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr))
    return "flash_bwd: cu_seqlens_q and cu_seqlens_k are required";
  if (p.total_q > 0 && p.softmax_lse == nullptr) return "flash_bwd: softmax_lse is required";

  const int64_t dim = p.head_dim;
  Attention a;
  a.q = {p.q, p.dtype, p.num_heads, dim, 1.0};
  a.k = {p.k, p.dtype, p.num_heads_k, dim, 1.0};
  a.v = {p.v, p.dtype, p.num_heads_k, dim, 1.0};
  a.num_heads = p.num_heads;
  a.num_heads_k = p.num_heads_k;
  a.opt = {p.softmax_scale, p.softcap, p.window_left, p.window_right};
  const Tensor dout = {p.dout, p.dtype, p.num_heads, dim, 1.0};
  const Tensor out = {p.out, p.dtype, p.num_heads, dim, 1.0};

  const std::vector<Sequence> seqs =
      flash_sequences(p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.batch, p.total_q, p.total_k,
                      Paging{}, p.alibi_slopes, p.alibi_batch_stride);
  const std::string hints =
      check_length_hints("flash_bwd", seqs, p.max_seqlen_q, p.max_seqlen_k, /*key_rows=*/true);
  if (!hints.empty()) return hints;

  // Gradients accumulate in double over the whole problem and are stored once at
  // the end; rows no sequence reaches stay zero.
  std::vector<double> dq(static_cast<size_t>(p.total_q * p.num_heads * dim), 0.0);
  std::vector<double> dk(static_cast<size_t>(p.total_k * p.num_heads_k * dim), 0.0);
  std::vector<double> dv(dk.size(), 0.0);

  std::vector<double> q_row(dim), dout_row(dim), out_row(dim), dq_row(dim);
  std::vector<Score> scores;
  for (const Sequence& seq : seqs) {
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const int64_t kvh = a.kv_head(h);
      for (int64_t i = 0; i < seq.num_q; ++i) {
        const int64_t row = seq.q_start + i;
        const double lse = p.softmax_lse[h * p.total_q + row];
        if (lse == INFINITY) continue;  // the forward saw no key: every p_ij is 0
        a.q.load(row, h, q_row.data());
        dout.load(row, h, dout_row.data());
        out.load(row, h, out_row.data());
        double D = 0.0;
        for (int64_t d = 0; d < dim; ++d) D += dout_row[d] * out_row[d];
        if (p.dlse) D -= p.dlse[h * p.total_q + row];

        a.scores(seq, i, h, q_row.data(), &scores);
        std::fill(dq_row.begin(), dq_row.end(), 0.0);
        for (const Score& sc : scores) {
          const double prob = std::exp(sc.s - lse);
          const int64_t kv = a.k.index(sc.row, kvh);
          for (int64_t d = 0; d < dim; ++d) dv[kv + d] += prob * dout_row[d];
          const double dp = a.v.dot(dout_row.data(), sc.row, kvh);
          // Gradient with respect to the raw q.k: through the softmax, the softcap
          // and the scale.
          const double ds = prob * (dp - D) * sc.dsoftcap * a.opt.scale;
          a.k.axpy(ds, sc.row, kvh, dq_row.data());
          for (int64_t d = 0; d < dim; ++d) dk[kv + d] += ds * q_row[d];
        }
        const int64_t qi = a.q.index(row, h);
        for (int64_t d = 0; d < dim; ++d) dq[qi + d] += dq_row[d];
      }
    }
  }
  store_all(p.dq, p.dtype, dq);
  store_all(p.dk, p.dtype, dk);
  store_all(p.dv, p.dtype, dv);
  return "";
}

}  // namespace xla_attn::host
