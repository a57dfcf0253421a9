// Exact CPU ("Host" platform) implementation of every op: what JAX-on-CPU users
// run, and the reference the CUDA kernels are tested against.
//
// Arithmetic is in double (dot products, softmax sums, gradient sums); inputs are
// widened and results narrowed with common/convert_host.h, so the only rounding
// that matters is the final store. Single-threaded and unblocked on purpose: it is
// meant to be obviously right, not fast.
//
// Shapes, dtypes and sizes in the params were validated by the caller. The
// device-side index data (cu_seqlens, seqused_k, block tables, slot mappings,
// seq_lens, query_start_loc, num_seqs) is NOT trusted: it is clamped or skipped so
// that no access ever leaves the tensors, whatever those arrays hold. For
// well-formed input the results are the flash-attn >= 2.1 / vLLM semantics
// documented in docs/xla-targets.md; for ill-formed input they are deterministic
// (sequences are processed in order; a row written twice keeps the last write, a
// gradient row reached twice gets the sum) but otherwise unspecified.
//
// Each function returns "" on success, else a message saying what was refused.
#pragma once
#include <string>

#include "cache/params.h"
#include "flash/params.h"
#include "paged/params.h"

namespace xla_attn::host {

// Varlen flash attention forward, contiguous or paged K/V (block_table non-null).
std::string flash_fwd(const xla_attn_flash_fwd_params& p);

// Its gradient (not paged), recomputing probabilities from the given softmax_lse.
std::string flash_bwd(const xla_attn_flash_bwd_params& p);

// vLLM-style paged attention: flash_fwd with a block table, causal, and the
// sliding-window / soft-cap / fp8-cache parameters of the paged API.
std::string paged_attention(const xla_attn_paged_attention_params& p);

// reshape_and_cache_flash: scatter K/V tokens into the cache, quantizing for fp8.
std::string reshape_and_cache_flash(const xla_attn_reshape_and_cache_flash_params& p);

}  // namespace xla_attn::host
