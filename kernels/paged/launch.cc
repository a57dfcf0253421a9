#include <algorithm>
#include <cstdint>

#include "common/checks.h"
#include "common/op.h"
#include "dispatch/dispatch.h"
#include "dispatch/tensor_map.h"
#include "paged/decode_tiles.h"
#include "variants_features.h"

namespace xla_attn {
namespace {

// paged_attention is the flash forward over a block table, causal, with the
// sequence count on the device: the same kernels serve both.
xla_attn_flash_fwd_params as_flash(const xla_attn_paged_attention_params& p) {
  xla_attn_flash_fwd_params f{};
  const bool fp8 = is_fp8_dtype(p.cache_dtype);
  f.q = p.query;
  f.k = p.key_cache;
  f.v = p.value_cache;
  f.out = p.out;
  f.cu_seqlens_q = p.query_start_loc;
  f.seqused_k = p.seq_lens;
  f.block_table = p.block_tables;
  f.alibi_slopes = p.alibi_slopes;
  f.k_descale = fp8 ? p.k_scale : nullptr;  // scales dequantize fp8 caches only
  f.v_descale = fp8 ? p.v_scale : nullptr;
  f.batch_used = p.num_seqs;
  f.workspace = p.workspace;
  f.workspace_bytes = p.workspace_bytes;
  f.total_q = p.total_q;
  f.total_k = int64_t(p.num_blocks) * p.block_size;
  f.batch = p.max_num_seqs;
  f.num_heads = p.num_heads;
  f.num_heads_k = p.num_heads_k;
  f.head_dim = p.head_dim;
  // Query counts per sequence live on the device; total_q bounds them all, and the
  // caller's max_query_len, when given, bounds them tighter (a smaller row grid).
  int64_t max_q = std::min<int64_t>(p.total_q, int64_t(1) << 30);
  if (p.max_query_len > 0) max_q = std::min<int64_t>(max_q, p.max_query_len);
  f.max_seqlen_q = int32_t(max_q);
  f.max_seqlen_k = p.max_blocks_per_seq * p.block_size;
  f.num_blocks = p.num_blocks;
  f.block_size = p.block_size;
  f.max_blocks_per_seq = p.max_blocks_per_seq;
  f.window_left = p.sliding_window > 0 ? p.sliding_window - 1 : -1;
  f.window_right = 0;
  f.softmax_scale = p.scale;
  f.softcap = p.soft_cap;
  f.q_dtype = p.q_dtype;
  f.kv_dtype = p.cache_dtype;
  f.out_dtype = p.q_dtype;
  return f;
}

unsigned features_of(const xla_attn_paged_attention_params& p) {
  unsigned f = kFeaturePaged;
  if (p.alibi_slopes) f |= kFeatureAlibi;
  if (p.soft_cap > 0.f) f |= kFeatureSoftcap;
  if (p.sliding_window > 0) f |= kFeatureWindow;
  if (is_fp8_dtype(p.cache_dtype)) f |= kFeatureFp8;
  return f;
}

// How the decode kernel would run this call. It depends on shapes alone (the split
// policies use a reference GPU's SM count, not the device's), so the workspace can be
// sized at trace time.
struct DecodePlan {
  int rows;        // query rows per block of the FMA kernel (its variant's r4 / r8)
  int max_q;       // longest query span the decode kernels take
  int splits;
  size_t workspace;
};

// kMma: the tensor-core kernels (cp.async or TMA, a kv head a block); kHeadsTogether:
// the same over decode_sm80::heads_together kv heads a block.
enum class DecodeKernel { kFma, kMma, kHeadsTogether };

int cache_bytes_of(const xla_attn_paged_attention_params& p) {
  return is_fp8_dtype(p.cache_dtype) ? 1 : 2;
}

int heads_together(const xla_attn_paged_attention_params& p) {
  return decode_sm80::heads_together(p.head_dim, cache_bytes_of(p));
}

// The heads-together kernel covers this call: rows under 256 bytes, kv heads that group
// so, and query spans whose rows fit the m16 tile (the caller's max_query_len, else
// total_q, bounds them), so that it takes every sequence and no flash forward follows.
bool heads_together_cover(const xla_attn_paged_attention_params& p) {
  const int group = p.num_heads / std::max(p.num_heads_k, 1);
  const int heads = heads_together(p);
  int64_t span = p.total_q;
  if (p.max_query_len > 0) span = std::min<int64_t>(span, p.max_query_len);
  return heads > 1 && p.num_heads_k % heads == 0 && span * group * heads <= decode_sm80::kRows;
}

DecodePlan decode_plan(const xla_attn_paged_attention_params& p, DecodeKernel kernel) {
  const int group = p.num_heads / std::max(p.num_heads_k, 1);
  DecodePlan plan{decode::rows_per_block(group), decode::max_query_span(group), 1, 0};
  const int heads = kernel == DecodeKernel::kHeadsTogether ? heads_together(p) : 1;
  const int64_t blocks = std::max<int64_t>(1, int64_t(p.max_num_seqs) * p.num_heads_k / heads);
  const int64_t max_k = int64_t(p.max_blocks_per_seq) * p.block_size;
  if (kernel != DecodeKernel::kFma) {
    namespace t = decode_sm80;
    const int64_t by_keys = std::clamp<int64_t>(max_k / t::kMinKeysPerSplit, 1, t::kMaxSplits);
    // decode_sm90's occupancy is decode_sm80's (decode_tiles.h asserts it)
    const int64_t slots =
        int64_t(t::kReferenceSms) * t::resident_blocks(p.head_dim, cache_bytes_of(p), heads);
    plan.splits = t::wave_splits(blocks, slots, int(by_keys));
    if (heads > 1) plan.max_q = decode_sm80::kRows / heads / group;
  } else {  // enough blocks for the reference GPU, each split >= kMinKeysPerSplit keys
    const int64_t want = (decode::kTargetBlocks + blocks - 1) / blocks;
    const int64_t by_keys = std::max<int64_t>(1, max_k / decode::kMinKeysPerSplit);
    plan.splits = int(std::clamp<int64_t>(std::min(want, by_keys), 1, decode::kMaxSplits));
  }
  if (plan.splits > 1) {
    plan.workspace =
        size_t(plan.splits) * p.total_q * p.num_heads * (p.head_dim + 1) * sizeof(float);
  }
  return plan;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The decode kernel a call gets, its dynamic shared memory and, for the Hopper kernel,
// the caches' tensor maps.
struct DecodeChoice {
  const dispatch::VariantEntry* variant = nullptr;
  size_t smem = 0;
  bool tma = false;
  int heads = 1;  // kv heads a block (> 1: the heads-together kernel)
  DecodeKernel kernel = DecodeKernel::kFma;  // whose split plan the launch follows
  sm90::TensorMap k_map, v_map;
};

// One cache as decode_sm90's 5-d view (paged/decode_tiles.h):
// [num_blocks][num_heads_k][parts][block_size][part], boxes of `heads` kv heads' 16 keys.
std::string encode_cache(sm90::TensorMap* map, const void* cache,
                         const xla_attn_paged_attention_params& p, int heads) {
  const int eb = cache_bytes_of(p);
  const uint64_t row = uint64_t(p.head_dim) * eb;
  const uint32_t part = uint32_t(decode_sm90::part_bytes(p.head_dim, eb));
  const uint64_t dims[5] = {part / eb, uint64_t(p.block_size), row / part,
                            uint64_t(p.num_heads_k), uint64_t(p.num_blocks)};
  const uint64_t strides[4] = {p.num_heads_k * row, part, row,
                               uint64_t(p.block_size) * p.num_heads_k * row};
  const uint32_t box[5] = {part / eb, uint32_t(decode_sm80::kTileKeys), uint32_t(row / part),
                           uint32_t(heads), 1};
  // L2 fetches as wide as the block's bytes of a key (64-256): all it reads there.
  // Measured on an H100 (bench decode, bf16 and fp8 e4m3): the same as no promotion
  // within run-to-run spread, except bf16 bs64 L=4096 (2855 against 2592 GB/s). Heads
  // together: fp8 d64 (4 x 64 bytes) 2234 -> 2324 GB/s at L=4096, 2661 -> 2866 at
  // 32768 with 256 bytes instead of the row's 64; fp8 d128 and bf16 d64 pairs the same.
  const int l2 = int(std::min<uint64_t>(row * heads, 256));
  return dispatch::encode_tiled(map, cache, eb, 5, dims, strides, box, int(part), l2);
}

// kv heads a block, in the order the launcher tries them: heads together where that
// kernel covers the call, then one. Returns how many.
int head_options(const xla_attn_paged_attention_params& p, int* options) {
  int n = 0;
  if (heads_together_cover(p)) options[n++] = heads_together(p);
  options[n++] = 1;
  return n;
}

const dispatch::VariantEntry* select_decode(const xla_attn_paged_attention_params& p, int arch,
                                            const char* op) {
  std::string unused;
  return dispatch::select({op, p.q_dtype, p.cache_dtype, p.head_dim, features_of(p), arch},
                          &unused);
}

// The decode kernel for this call: the Hopper one (sm_90+, a block size that is a
// multiple of its 16-key tiles, rows of 64-256 bytes, tensor maps that encode), else the
// tensor-core one where it covers the call (16-bit and fp8 caches, sm_80+, a GQA group
// of at most 16 heads: its rows are one m16 tile), each over kv heads together first
// where that covers the call; else the FMA one; none when no kernel covers it or the
// caches are not 16-byte aligned.
DecodeChoice decode_variant(const xla_attn_paged_attention_params& p, int arch) {
  DecodeChoice c;
  if (!aligned16(p.key_cache) || !aligned16(p.value_cache)) return c;
  const int group = p.num_heads / std::max(p.num_heads_k, 1);
  const int cache_bytes = cache_bytes_of(p);
  int options[2];
  const int n_options = head_options(p, options);
  // sm_90 only (TMA): below it select() would only scan the table and build a no-match
  // message, on every call.
  if (arch >= 90 && group <= decode_sm80::kRows && p.block_size % decode_sm80::kTileKeys == 0 &&
      decode_sm90::covers(p.head_dim, cache_bytes) && p.num_blocks > 0) {
    for (int i = 0; i < n_options; ++i) {
      const int heads = options[i];
      c.variant = select_decode(p, arch, heads > 1 ? "paged_decode_tma_heads" : "paged_decode_tma");
      if (c.variant && encode_cache(&c.k_map, p.key_cache, p, heads).empty() &&
          encode_cache(&c.v_map, p.value_cache, p, heads).empty()) {
        c.smem = size_t(decode_sm90::smem_bytes(p.head_dim, cache_bytes, heads));
        c.tma = true;
        c.heads = heads;
        c.kernel = heads > 1 ? DecodeKernel::kHeadsTogether : DecodeKernel::kMma;
        return c;
      }
    }
  }
  if (group <= decode_sm80::kRows) {
    for (int i = 0; i < n_options; ++i) {
      const int heads = options[i];
      c.variant = select_decode(p, arch, heads > 1 ? "paged_decode_mma_heads" : "paged_decode_mma");
      if (c.variant) {
        c.smem = size_t(decode_sm80::smem_bytes(p.head_dim, cache_bytes, heads));
        c.heads = heads;
        c.kernel = heads > 1 ? DecodeKernel::kHeadsTogether : DecodeKernel::kMma;
        return c;
      }
    }
  }
  const std::string fma_op = "paged_decode_r" + std::to_string(decode::rows_per_block(group));
  c.variant = select_decode(p, arch, fma_op.c_str());
  return c;
}

// Launches decode kernel `c` (and its split merge) under `plan`.
std::string launch_decode(const xla_attn_paged_attention_params& p, const DecodeChoice& c,
                          const DecodePlan& plan, bool no_flash_follows, int arch,
                          cudaStream_t stream) {
  const decode::Args args{p, plan.splits, plan.max_q, no_flash_follows ? 1 : 0};
  // (splits, kv heads (pairs), sequences + 1 block row that zeroes the padding queries)
  const dim3 grid(plan.splits, p.num_heads_k / c.heads, p.max_num_seqs + 1);
  std::string error;
  if (c.tma) {
    const decode_sm90::Args tma_args{args, c.k_map, c.v_map};
    error = dispatch::launch(*c.variant, grid, c.smem, stream, &tma_args);
  } else {
    error = dispatch::launch(*c.variant, grid, c.smem, stream, &args);
  }
  if (error.empty() && plan.splits > 1) {
    const dispatch::Query q{"paged_decode_combine", p.q_dtype, p.q_dtype, p.head_dim,
                            features_of(p), arch};
    error = dispatch::launch(q, dim3(1, p.num_heads_k, p.max_num_seqs), 0, stream, &args);
  }
  return error;
}

}  // namespace

// The decode kernel and the flash forward share the workspace (they run one after
// the other on the stream): the larger of the two.
size_t workspace_size(const xla_attn_paged_attention_params& p) {
  return std::max({decode_plan(p, DecodeKernel::kFma).workspace,
                   decode_plan(p, DecodeKernel::kMma).workspace,
                   heads_together_cover(p)
                       ? decode_plan(p, DecodeKernel::kHeadsTogether).workspace
                       : 0,
                   workspace_size(as_flash(p))});
}

std::string launch_cuda(const xla_attn_paged_attention_params& p, cudaStream_t stream) {
  if (p.total_q == 0 || p.max_num_seqs == 0) return "";
  if (p.max_num_seqs + 1 > 65535) return "paged_attention: at most 65534 sequences per call";
  if (p.num_heads_k > 65535) return "paged_attention: at most 65535 kv heads";
  std::string error;
  const int arch = dispatch::current_arch(&error);
  if (arch < 0) return error;
  const DecodeChoice choice = decode_variant(p, arch);
  const dispatch::VariantEntry* v = choice.variant;
  const DecodePlan plan = decode_plan(p, choice.kernel);
  // Query counts are device data: unless no sequence can exceed the decode kernel's
  // span (total_q, or the caller's max_query_len, says so), the flash forward runs
  // too and takes the longer ones (chunked prefill).
  const bool decode_only =
      v && (p.total_q <= plan.max_q || (p.max_query_len > 0 && p.max_query_len <= plan.max_q));
  if (v) {
    if (plan.workspace > 0 && (!p.workspace || size_t(p.workspace_bytes) < plan.workspace)) {
      return "paged_attention: the split-KV workspace is missing or smaller than "
             "xla_attn_workspace_size() asked for";
    }
    error = launch_decode(p, choice, plan, decode_only, arch, stream);
    if (!error.empty()) return error;
  }
  if (decode_only) return "";
  const bool decoded = v != nullptr;
  xla_attn_flash_fwd_params f = as_flash(p);
  f.decode_max_q = decoded ? plan.max_q : 0;
  return launch_cuda(f, stream);
}

}  // namespace xla_attn
