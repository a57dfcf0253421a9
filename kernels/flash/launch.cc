#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "common/checks.h"
#include "common/op.h"
#include "dispatch/dispatch.h"
#include "dispatch/tensor_map.h"
#include "flash/portable_tiles.h"
#include "flash/sm80_tiles.h"
#include "flash/sm90_tiles.h"
#include "variants_features.h"

namespace xla_attn {
namespace {

template <typename P>
unsigned features_of(const P& p) {
  unsigned f = 0;
  if (p.alibi_slopes) f |= kFeatureAlibi;
  if (p.softcap > 0.f) f |= kFeatureSoftcap;
  if (p.window_left >= 0 || p.window_right >= 0) f |= kFeatureWindow;
  return f;
}

dispatch::Query fwd_query(const xla_attn_flash_fwd_params& p) {
  unsigned f = features_of(p);
  if (p.block_table) f |= kFeaturePaged;
  if (is_fp8_dtype(p.q_dtype) || is_fp8_dtype(p.kv_dtype)) f |= kFeatureFp8;
  return {"flash_fwd", p.q_dtype, p.kv_dtype, p.head_dim, f, 0};
}

// What the grid and split plan depend on in a forward variant: its family's tiles
// header (the kernels read the same constexprs).
struct FwdTiles {
  int block_m;         // query rows per block
  size_t smem;         // dynamic shared memory per block
  int target_blocks;   // blocks that fill the reference GPU (split-KV stops there)
  int min_keys_per_split;
  int max_splits;
};

FwdTiles portable_tiles(int head_dim) {
  const int d = portable::head_bucket(head_dim);
  return {portable::fwd_block_m(d), 0, portable::kTargetBlocks, portable::kMinKeysPerSplit,
          portable::kMaxSplits};
}

// `eb`: element bytes, 1 for the fp8 kernels (their own buckets and shared memory).
FwdTiles sm80_tiles(int head_dim, int eb = 2) {
  const int d = sm80::head_bucket(head_dim, eb);
  return {sm80::block_m(d), size_t(sm80::smem_bytes(d, eb)), sm80::kTargetBlocks,
          sm80::kMinKeysPerSplit, sm80::kMaxSplits};
}

// Grid of the forward: (row blocks x splits, heads, batch + 1 padding block).
struct FwdPlan {
  int row_blocks;
  int splits;
  size_t workspace;
};

FwdPlan plan(const xla_attn_flash_fwd_params& p, const FwdTiles& t) {
  FwdPlan plan{std::max(1, (p.max_seqlen_q + t.block_m - 1) / t.block_m), 1, 0};
  if (p.num_splits > 0) {
    plan.splits = std::min(p.num_splits, t.max_splits);
  } else {
    // Split the keys only when the grid cannot fill the GPU by itself. The plan
    // depends on shapes alone (frontends size the workspace at trace time), so the
    // row blocks that do work are estimated from the mean query count per sequence.
    const int64_t rows = std::min<int64_t>(p.max_seqlen_q, (p.total_q + std::max(p.batch, 1) - 1) /
                                                               std::max(p.batch, 1));
    const int64_t useful = std::max<int64_t>(1, (rows + t.block_m - 1) / t.block_m);
    const int64_t blocks = useful * p.num_heads * std::max(p.batch, 1);
    const int64_t want = (t.target_blocks + blocks - 1) / blocks;
    const int64_t by_keys = std::max(1, p.max_seqlen_k / t.min_keys_per_split);
    plan.splits = int(std::clamp<int64_t>(std::min(want, by_keys), 1, t.max_splits));
  }
  if (plan.splits > 1) {
    plan.workspace = size_t(plan.splits) * p.total_q * p.num_heads * (p.head_dim + 1) * sizeof(float);
  }
  return plan;
}

// `d`: the kernel's head-dim bucket, `eb`: its element bytes (1 for fp8), `vt_given`: fp8
// d256's instance for V given transposed (sm90_tiles.h, k_stages).
FwdTiles sm90_tiles(int d, int wgs, int eb, bool walk, bool vt_given) {
  return {flash_sm90::block_m(wgs), size_t(flash_sm90::smem_bytes(d, wgs, eb, walk, vt_given)),
          flash_sm90::kTargetBlocks, sm80::kMinKeysPerSplit, sm80::kMaxSplits};
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether the sm80 family's fp8 kernels (op flash_fwd_mma_fp8, sm_89+) can take the call:
// e4m3 q, k and v, rows of whole 16-byte chunks (head_dim % 16 == 0) in 16-byte aligned
// tensors, a 4-byte aligned bf16 out. Elsewhere fp8 runs on the portable family.
bool fp8_mma_takes(const xla_attn_flash_fwd_params& p) {
  return p.q_dtype == XLA_ATTN_F8E4M3 && p.kv_dtype == XLA_ATTN_F8E4M3 && p.head_dim % 16 == 0 &&
         p.head_dim <= 256 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) &&
         reinterpret_cast<uintptr_t>(p.out) % 4 == 0;
}

// A [rows][heads][head_dim] tensor of `eb`-byte elements (2, or 1 for fp8) as the sm90
// family reads it: boxes of 128 bytes of columns x 1 head x `box_rows` rows, 128-byte
// swizzled.
std::string encode_rows(sm90::TensorMap* map, const void* base, int64_t rows, int heads,
                        int head_dim, int box_rows, int eb = 2) {
  const uint64_t dims[3] = {uint64_t(head_dim), uint64_t(heads), uint64_t(rows)};
  const uint64_t strides[2] = {uint64_t(head_dim) * eb, uint64_t(heads) * head_dim * eb};
  const uint32_t box[3] = {uint32_t(128 / eb), 1, uint32_t(box_rows)};
  return dispatch::encode_tiled(map, base, eb, 3, dims, strides, box, 128, 128);
}

// Whether the fp8 forward's V would come given transposed (sm90_tiles.h,
// vt_given_covers), read the same way when the workspace is sized and at the launch.
// XLA_ATTN_SM90_VT: "0" never (tests, A/B: the transposes), "1" wherever the head dim
// allows at any rows (tests: short rows; the walks still transpose), else by the rows.
bool wants_vt(const xla_attn_flash_fwd_params& p) {
  const char* env = std::getenv("XLA_ATTN_SM90_VT");
  const int mode = env && (*env == '0' || *env == '1') && !env[1] ? *env - '0' : -1;
  return mode != 0 && flash_sm90::vt_given_covers(p.head_dim,
                                                  mode == 1 ? INT32_MAX : p.max_seqlen_q,
                                                  p.window_right >= 0);
}

// Whether the fp8 forward takes V given transposed (sm90_tiles.h, vt_given; its kVtGiven
// instance, op flash_fwd_tma_vt): where it pays (wants_vt; `d`: the bucket), tiles start on
// a sequence's key 0, 128, ... (no left window) and the workspace holds V^T (frontends
// that size it with the dtypes: xla_attn_flash_fwd_workspace_size_v2). Where it does,
// args->vt, vt_cols and vt_map view V^T in the workspace, for flash_fwd_vt_pack to write.
bool vt_given(const xla_attn_flash_fwd_params& p, int d, flash_sm90::Args* args) {
  const int64_t cols = flash_sm90::vt_cols(p.total_k, p.batch);
  if (!wants_vt(p) || p.window_left >= 0 || !p.workspace ||
      p.workspace_bytes < flash_sm90::vt_workspace_bytes(p.total_k, p.batch, p.num_heads_k,
                                                         p.head_dim) ||
      cols >= (int64_t(1) << 31) - flash_sm90::block_n(d, 1)) {
    return false;
  }
  args->vt = static_cast<unsigned char*>(p.workspace) + flash_sm90::kVtOffset;
  args->vt_cols = cols;
  const uint64_t dims[3] = {uint64_t(cols), uint64_t(p.head_dim), uint64_t(p.num_heads_k)};
  const uint64_t strides[2] = {uint64_t(cols), uint64_t(cols) * p.head_dim};
  const uint32_t box[3] = {uint32_t(flash_sm90::block_n(d, 1)), uint32_t(d), 1};
  return aligned16(args->vt) &&
         dispatch::encode_tiled(&args->vt_map, args->vt, 1, 3, dims, strides, box, 128, 128)
             .empty();
}

// flash_fwd_vt_pack: kVtPackKeys a block, each block looping over the rest of its sequence's
// keys past the hint. "" or the launch's error.
std::string launch_vt_pack(const xla_attn_flash_fwd_params& p, const dispatch::Query& query,
                           cudaStream_t stream, const flash_sm90::Args& args) {
  dispatch::Query q = query;
  q.op = "flash_fwd_vt_pack";
  const int keys = flash_sm90::kVtPackKeys;
  const dim3 grid(unsigned((std::max(p.max_seqlen_k, 1) + keys - 1) / keys), p.num_heads_k,
                  p.batch);
  return dispatch::launch(q, grid, 0, stream, &args);
}

// The sm90 family (flash/fwd_sm90.cuh) where it takes the call: sm_90, 16-bit q/k/v
// (or fp8 e4m3 with head_dim 16..256, in its d64, d128 and d256 buckets), paged with
// block sizes that give whole 8-row boxes (flash_sm90::Args), no split wanted (asked for,
// or planned because the grid would not fill the GPU), rows the copy engine can stride
// (16-byte rows and 16-byte aligned tensors). Returns false (and launches nothing) where
// it does not; `error` is set only when it took the call and the launch failed.
bool launch_sm90(const xla_attn_flash_fwd_params& params, const dispatch::Query& query,
                 cudaStream_t stream, std::string* error) {
  const bool fp8 = params.q_dtype == XLA_ATTN_F8E4M3;
  const int eb = fp8 ? 1 : 2;
  const int d =
      fp8 ? flash_sm90::fp8_bucket(params.head_dim) : flash_sm90::head_bucket(params.head_dim);
  // Paged: boxes of gcd(block_size, block_n) rows, a multiple of 8 (Args), and
  // box coordinates (int32) that reach one past the cache's rows.
  const bool paged = params.block_table != nullptr;
  const int block_n = flash_sm90::block_n(d, eb);
  const int box = paged ? std::gcd(std::max(params.block_size, 1), block_n) : block_n;
  if (paged && (params.block_size <= 0 || box % 8 != 0 || params.num_blocks <= 0 ||
                params.total_k >= (int64_t(1) << 31) - block_n)) {
    return false;
  }
  if (query.arch != 90 || params.num_splits > 1 ||
      params.head_dim * eb % 16 != 0 || params.total_k <= 0 ||
      params.q_dtype != params.kv_dtype ||
      (params.q_dtype != XLA_ATTN_F16 && params.q_dtype != XLA_ATTN_BF16 && !fp8) ||
      (fp8 && !flash_sm90::fp8_covers(params.head_dim)) ||
      (fp8 && reinterpret_cast<uintptr_t>(params.out) % 4 != 0) ||
      !aligned16(params.q) || !aligned16(params.k) || !aligned16(params.v)) {
    return false;
  }
  // The persistent walk (ops ..._walk) where it pays (sm90_tiles.h, walks); a block count
  // in XLA_ATTN_SM90_BLOCKS takes it wherever there is one (tests: a few blocks walking
  // many items each), 0 never (tests: the one block an item kernels the walk displaced).
  const bool counter =
      params.workspace && size_t(params.workspace_bytes) >= flash_sm90::kItemCounterBytes;
  const char* blocks_env = std::getenv("XLA_ATTN_SM90_BLOCKS");
  const int64_t forced_blocks =
      blocks_env && *blocks_env ? std::max<int64_t>(std::atoll(blocks_env), 0) : -1;
  const bool walk = !paged && flash_sm90::has_walk(d) && forced_blocks != 0 &&
                    (forced_blocks > 0 || (flash_sm90::walks(d, params.max_seqlen_q, eb) &&
                                           (counter || params.window_right < 0)));
  const char* walk_suffix = walk ? "_walk" : "";
  // d64: three consumer warpgroups (op flash_fwd_tma_m192) where they pay (sm90_tiles.h,
  // wide_d64), else two; fp8 as fp8_wgs (its flash_fwd_tma instances) unless paged (two).
  dispatch::Query q = query;
  std::string unused, op;
  const dispatch::VariantEntry* v = nullptr;
  flash_sm90::Args args;
  bool vt = fp8 && !paged && !walk && vt_given(params, d, &args);
  if (vt) {
    q.op = "flash_fwd_tma_vt";
    vt = (v = dispatch::select(q, &unused)) != nullptr;
  }
  if (!v && !fp8 && !paged && d == 64 &&
      flash_sm90::wide_d64(params.window_right, params.max_seqlen_q)) {
    q.op = (op = std::string("flash_fwd_tma_m192") + walk_suffix).c_str();
    v = dispatch::select(q, &unused);
  }
  // Every sequence of max_seqlen_q rows (the dense layout): the walk's longest-first
  // tail (below) and its instance without the rowless pass (sm90_tiles.h, passes_rowless).
  const bool equal_lengths = !params.seqused_k &&
                             params.total_q == int64_t(params.batch) * params.max_seqlen_q &&
                             params.total_k == int64_t(params.batch) * params.max_seqlen_k;
  const bool rowless =
      walk && flash_sm90::passes_rowless(d, eb, equal_lengths, params.max_seqlen_q);
  if (!v) {
    op = std::string(paged ? "flash_fwd_tma_paged" : "flash_fwd_tma") + walk_suffix +
         (rowless ? "_rowless" : "");
    q.op = op.c_str();
    if (!(v = dispatch::select(q, &unused))) return false;
  }
  // The kernel's consumer warpgroups, as the variant table built it: a producer
  // warpgroup and wgs consumers (variants.py, threads = 128 (1 + wgs)).
  const int wgs = v->threads / 128 - 1;
  const FwdTiles tiles = sm90_tiles(d, wgs, eb, walk, vt);
  const FwdPlan pl = plan(params, tiles);
  if (pl.splits > 1) return false;
  args.p = params;
  args.p.num_splits = 1;
  args.kv_box_rows = box;
  if (!encode_rows(&args.q_map, params.q, params.total_q, params.num_heads, params.head_dim,
                   tiles.block_m, eb).empty() ||
      !encode_rows(&args.k_map, params.k, params.total_k, params.num_heads_k, params.head_dim,
                   box, eb).empty() ||
      !encode_rows(&args.v_map, params.v, params.total_k, params.num_heads_k, params.head_dim,
                   box, eb).empty()) {
    return false;
  }
  // O by bulk tensor stores (16-bit; fp8's bf16 O is stored from registers) where the
  // copy engine can write it, else by the consumer threads.
  args.o_by_copy = !fp8 && aligned16(params.out) &&
                   encode_rows(&args.o_map, params.out, params.total_q, params.num_heads,
                               params.head_dim, flash_sm90::kOStoreRows)
                       .empty();
  // The items (Args): the walk's blocks (one an SM: one block fits an SM) claim them from
  // a counter in the workspace as they finish one; otherwise one block an item, the grid
  // (row blocks, heads, batch + 1).
  const int64_t items = int64_t(pl.row_blocks) * params.num_heads * (int64_t(params.batch) + 1);
  if (items > INT32_MAX) return false;
  int64_t blocks = !walk             ? items
                   : forced_blocks > 0 ? forced_blocks
                                       : dispatch::multiprocessors(error);
  if (blocks <= 0) return true;
  blocks = std::min(blocks, items);
  args.row_blocks = pl.row_blocks;
  args.items = int(items);
  args.item_counter = nullptr;
  // The walk's longest-first tail (sequence.cuh) over 2 items an SM where every sequence
  // has the longest length (the dense rows, which it was measured on), 8 where lengths
  // differ: then a long sequence's items may sit anywhere in the claim order, not only
  // at its end. H200, same run, the varlen row (16 causal sequences, mean 1024) at 4
  // length seeds, 8 against 2: d128 +2.5..+4.6 %, d64 +1.6 %; 4: +0..+2 %; 16: -3..+6 %;
  // every pair: -4..-11 % (a head's row blocks no longer share its K / V in L2). The
  // dk/dv grid and the one block an item forward keep 2 (8 there: fwd+bwd -2.5..+2 %,
  // within the forward's gain; d256 varlen forward -3..-5 %). fp8 d128 varlen (its walk)
  // +5.5 %.
  args.tail_waves = equal_lengths ? 2 : 8;
  if (walk && counter && blocks < items) {
    args.item_counter = static_cast<int*>(params.workspace);
    const cudaError_t st =
        cudaMemsetAsync(args.item_counter, 0, flash_sm90::kItemCounterBytes, stream);
    if (st != cudaSuccess) {
      *error = std::string("flash_fwd: zeroing the item counter failed: ") + cudaGetErrorString(st);
      return true;
    }
  }
  if (vt && !(*error = launch_vt_pack(params, query, stream, args)).empty()) return true;
  const dim3 grid = walk ? dim3(unsigned(blocks))
                        : dim3(unsigned(pl.row_blocks), params.num_heads, params.batch + 1);
  *error = dispatch::launch(*v, grid, tiles.smem, stream, &args);
  return true;
}

// The sm90 dk/dv kernel (flash/bwd_sm90.cuh) for the atomic-dQ path's middle step
// where it covers the call: sm_90, 16-bit, head_dim 33-128 and % 8 == 0, 16-byte aligned
// inputs. Returns false (launching nothing) where it does not; `error` is set only when
// it took the step and the launch failed.
bool launch_bwd_dkdv_sm90(const xla_attn_flash_bwd_params& p, unsigned features, int arch,
                          cudaStream_t stream, std::string* error) {
  if (arch != 90 || !p.workspace || !flash_sm90::bwd_covers(p.head_dim) ||
      p.head_dim % 8 != 0 || p.total_q <= 0 || p.total_k <= 0 ||
      (p.dtype != XLA_ATTN_F16 && p.dtype != XLA_ATTN_BF16) || !aligned16(p.q) ||
      !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.dout)) {
    return false;
  }
  std::string unused;
  const dispatch::VariantEntry* v = dispatch::select(
      {"flash_bwd_dkdv_tma", p.dtype, p.dtype, p.head_dim, features, arch}, &unused);
  if (!v) return false;
  flash_sm90::BwdArgs args;
  args.p = p;
  const int bucket = flash_sm90::head_bucket(p.head_dim), keys = flash_sm90::bwd_keys(bucket);
  const int rows = flash_sm90::bwd_rows(bucket);
  if (!encode_rows(&args.q_map, p.q, p.total_q, p.num_heads, p.head_dim, rows).empty() ||
      !encode_rows(&args.dout_map, p.dout, p.total_q, p.num_heads, p.head_dim, rows).empty() ||
      !encode_rows(&args.k_map, p.k, p.total_k, p.num_heads_k, p.head_dim, keys).empty() ||
      !encode_rows(&args.v_map, p.v, p.total_k, p.num_heads_k, p.head_dim, keys).empty()) {
    return false;
  }
  if (flash_sm90::bwd_stats_staged(bucket)) {
    // lse and D rows ([num_heads][total_q] f32; D at the workspace's start, bwd_delta) as
    // one dimension: a tile's rows are in one box from head x total_q + row rounded down
    // (flash_sm90::bwd_stat_box), a 32-bit coordinate (past the tensor's end, zeros).
    const int64_t stat_floats = int64_t(p.num_heads) * p.total_q;
    const int stat_box = flash_sm90::bwd_stat_box(bucket);
    if (stat_floats + stat_box > INT32_MAX || !p.softmax_lse) return false;
    const uint64_t dims[1] = {uint64_t(stat_floats)};
    const uint32_t box[1] = {uint32_t(stat_box)};
    if (!dispatch::encode_tiled(&args.lse_map, p.softmax_lse, 4, 1, dims, nullptr, box, 0, 0)
             .empty() ||
        !dispatch::encode_tiled(&args.delta_map, p.workspace, 4, 1, dims, nullptr, box, 0, 0)
             .empty()) {
      return false;
    }
  }
  const dim3 grid(unsigned((std::max(p.max_seqlen_k, 1) + keys - 1) / keys), p.num_heads_k,
                  p.batch + 1);
  // longest_first_tail numbers the blocks in 32 bits (one long sequence beside 65534 short
  // ones could pass 2^31): the sm80 kernel takes such a grid.
  if (int64_t(grid.x) * grid.y * grid.z > INT32_MAX) return false;
  const size_t smem = size_t(flash_sm90::bwd_smem_bytes(bucket));
  *error = dispatch::launch(*v, grid, smem, stream, &args);
  return true;
}

}  // namespace

// Sized at trace time from shapes alone, possibly on a host without a GPU, before any
// variant is selected: the most that either family's plan would use, and for fp8 K (its
// dtype known: xla_attn_workspace_size, xla_attn_flash_fwd_workspace_size_v2; v1 gives
// none) V^T where the sm90 forward would take V given transposed (vt_given).
size_t workspace_size(const xla_attn_flash_fwd_params& p) {
  const bool paged = p.block_table != nullptr || p.block_size > 0;
  const size_t vt = p.kv_dtype == XLA_ATTN_F8E4M3 && !paged &&
                            wants_vt(p) && p.total_k >= 0
                        ? size_t(flash_sm90::vt_workspace_bytes(p.total_k, p.batch,
                                                                p.num_heads_k, p.head_dim))
                        : 0;
  return std::max({plan(p, portable_tiles(p.head_dim)).workspace,
                   plan(p, sm80_tiles(p.head_dim)).workspace,
                   plan(p, sm80_tiles(p.head_dim, 1)).workspace,
                   flash_sm90::kItemCounterBytes,  // the sm90 walk's (Args)
                   vt});
}

std::string launch_cuda(const xla_attn_flash_fwd_params& params, cudaStream_t stream) {
  if (params.total_q == 0 || params.batch == 0) return "";
  if (params.batch + 1 > 65535) return "flash_fwd: at most 65534 sequences per call";
  xla_attn_flash_fwd_params p = params;
  std::string error;
  dispatch::Query q = fwd_query(p);
  if ((q.arch = dispatch::current_arch(&error)) < 0) return error;
  if (launch_sm90(p, q, stream, &error)) return error;
  const dispatch::VariantEntry* v = nullptr;
  if (fp8_mma_takes(p)) {
    dispatch::Query fp8 = q;
    fp8.op = "flash_fwd_mma_fp8";
    std::string unused;  // none (below sm_89, or forced off): the generic query decides
    v = dispatch::select(fp8, &unused);
  }
  const int eb = v ? 1 : 2;
  if (!v && !(v = dispatch::select(q, &error))) return error;
  const bool sm80 = std::strcmp(v->family, "sm80") == 0;
  if (sm80 && v->head_dim_max != sm80::head_bucket(p.head_dim, eb)) {
    return std::string("flash_fwd: ") + v->kernel + " does not match sm80::head_bucket(" +
           std::to_string(p.head_dim) + "); kernels/dispatch/variants.py and "
           "kernels/flash/sm80_tiles.h disagree";
  }
  const FwdTiles tiles = sm80 ? sm80_tiles(p.head_dim, eb) : portable_tiles(p.head_dim);
  const FwdPlan pl = plan(p, tiles);
  p.num_splits = pl.splits;
  if (pl.splits > 1 && (!p.workspace || size_t(p.workspace_bytes) < pl.workspace)) {
    return "flash_fwd: the split-KV workspace is missing or smaller than "
           "xla_attn_workspace_size() asked for";
  }
  const dim3 grid(unsigned(pl.row_blocks) * pl.splits, p.num_heads, p.batch + 1);
  error = dispatch::launch(*v, grid, tiles.smem, stream, &p);
  if (!error.empty() || pl.splits == 1) return error;
  // 16 rows per combine block (its 4 warps x 4 rows).
  const dim3 combine_grid((std::max(p.max_seqlen_q, 1) + 15) / 16, p.num_heads, p.batch);
  // The merge reads f32 partials whatever the inputs were: fp8 is not its feature.
  const dispatch::Query c{"flash_combine", p.out_dtype, p.out_dtype, p.head_dim,
                          q.features & ~unsigned(kFeatureFp8), q.arch};
  return dispatch::launch(c, combine_grid, 0, stream, &p);
}

size_t workspace_size(const xla_attn_flash_bwd_params& p) {
  // f32 runs on the portable family alone, which takes no workspace.
  if (p.dtype == XLA_ATTN_F32 || p.num_heads <= 0 || p.head_dim <= 0) return 0;
  return size_t(sm80::bwd_workspace_bytes(p.total_q, p.batch, p.num_heads, p.head_dim));
}

// The sm80 backward (flash/bwd_sm80.cuh): D = dO . O (into the workspace, or the dq
// buffer without one), then dk/dv (which read D; with a workspace they add dQ into its
// f32 accumulator too), then dq: converted from the accumulator, or computed by the
// dq kernel (which overwrites D). Every kernel of `family` sm80.
std::string launch_bwd_sm80(const xla_attn_flash_bwd_params& p, const dispatch::VariantEntry& dkdv,
                            unsigned features, int arch, cudaStream_t stream) {
  if (dkdv.head_dim_max != sm80::head_bucket(p.head_dim)) {
    return std::string("flash_bwd: ") + dkdv.kernel + " does not match sm80::head_bucket(" +
           std::to_string(p.head_dim) + "); kernels/dispatch/variants.py and "
           "kernels/flash/sm80_tiles.h disagree";
  }
  const bool atomic_dq = p.workspace != nullptr;
  if (atomic_dq) {
    if (size_t(p.workspace_bytes) < workspace_size(p) ||
        reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
      return "flash_bwd: the workspace must be 16-byte aligned and hold "
             "xla_attn_workspace_size() bytes";
    }
  } else if (reinterpret_cast<uintptr_t>(p.dq) % alignof(float) != 0) {
    return "flash_bwd: dq must be 4-byte aligned (without a workspace the sm80 backward keeps "
           "dO . O in it)";
  }
  std::string error;
  const dispatch::VariantEntry* dq = dispatch::select(
      {atomic_dq ? "flash_bwd_dq_convert" : "flash_bwd_dq", p.dtype, p.dtype, p.head_dim,
       features, arch},
      &error);
  const dispatch::VariantEntry* delta = dispatch::select(
      {"flash_bwd_delta", p.dtype, p.dtype, p.head_dim, features, arch}, &error);
  if (!dq || !delta) return error;
  if (std::strcmp(dq->family, "sm80") != 0 || std::strcmp(delta->family, "sm80") != 0) {
    return "flash_bwd: the sm80 dkdv kernel needs the sm80 dq and delta kernels";
  }
  constexpr int kB = sm80::kBwdBlock;
  const int bucket = sm80::head_bucket(p.head_dim);
  const size_t smem = size_t(sm80::bwd_smem_bytes(bucket));
  // d256 (the split dV / dK blocks' bucket, the only one with a paired kernel): the
  // paired dk/dv kernel where its shared memory fits a block (sm_80, sm_90), else a dV
  // and a dK block per key block (sm80_tiles.h). Other head dims skip the device query
  // and the table search.
  const dispatch::VariantEntry* paired = nullptr;
  if (sm80::bwd_split_grads(bucket)) {
    const int optin = dispatch::shared_optin(&error);
    if (optin < 0) return error;
    if (optin >= sm80::bwd_paired_smem_bytes(bucket)) {
      std::string no_paired;  // a build without it: not an error, the split kernel runs
      paired = dispatch::select(
          {"flash_bwd_dkdv_paired", p.dtype, p.dtype, p.head_dim, features, arch}, &no_paired);
      if (paired && std::strcmp(paired->family, "sm80") != 0) paired = nullptr;
    }
  }
  const dispatch::VariantEntry* dkdv_kernel = paired ? paired : &dkdv;
  const size_t dkdv_smem = size_t(paired ? sm80::bwd_paired_smem_bytes(bucket) : smem);
  const unsigned grads_split = !paired && sm80::bwd_split_grads(bucket) ? 2 : 1;
  if (p.total_q > 0) {  // sm80::bwd_delta_rows(head_dim) rows a delta block
    const int rows = sm80::bwd_delta_rows(p.head_dim);
    const dim3 grid(unsigned((p.total_q + rows - 1) / rows), p.num_heads);
    if (!(error = dispatch::launch(*delta, grid, 0, stream, &p)).empty()) return error;
  }
  const dim3 dkdv_grid(unsigned((std::max(p.max_seqlen_k, 1) + kB - 1) / kB) * grads_split,
                       p.num_heads_k, p.batch + 1);
  if (!launch_bwd_dkdv_sm90(p, features, arch, stream, &error)) {
    error = dispatch::launch(*dkdv_kernel, dkdv_grid, dkdv_smem, stream, &p);
  }
  if (!error.empty()) return error;
  // dq from the accumulator: a block per sm80::bwd_convert_row_chunks(head_dim) chunks of
  // 16 rows; else the dq kernel.
  const int rows =
      atomic_dq ? sm80::kAccChunkRows * sm80::bwd_convert_row_chunks(p.head_dim) : kB;
  const dim3 dq_grid((std::max(p.max_seqlen_q, 1) + rows - 1) / rows, p.num_heads, p.batch + 1);
  return dispatch::launch(*dq, dq_grid, atomic_dq ? 0 : smem, stream, &p);
}

std::string launch_cuda(const xla_attn_flash_bwd_params& p, cudaStream_t stream) {
  if (p.batch + 1 > 65535) return "flash_bwd: at most 65534 sequences per call";
  if (p.total_q == 0 && p.total_k == 0) return "";
  const unsigned f = features_of(p);
  std::string error;
  const int arch = dispatch::current_arch(&error);
  if (arch < 0) return error;
  const dispatch::VariantEntry* dkdv = dispatch::select(
      {"flash_bwd_dkdv", p.dtype, p.dtype, p.head_dim, f, arch}, &error);
  if (!dkdv) return error;
  if (std::strcmp(dkdv->family, "sm80") == 0) return launch_bwd_sm80(p, *dkdv, f, arch, stream);
  const int block = portable::bwd_block_m(portable::head_bucket(p.head_dim));
  // dq: (query tiles, heads, batch + padding block); dk/dv: (key tiles, kv heads, ...).
  const dim3 dq_grid((std::max(p.max_seqlen_q, 1) + block - 1) / block, p.num_heads, p.batch + 1);
  const dim3 dkdv_grid((std::max(p.max_seqlen_k, 1) + block - 1) / block, p.num_heads_k,
                       p.batch + 1);
  const dispatch::Query dq{"flash_bwd_dq", p.dtype, p.dtype, p.head_dim, f, arch};
  error = dispatch::launch(dq, dq_grid, 0, stream, &p);
  return error.empty() ? dispatch::launch(*dkdv, dkdv_grid, 0, stream, &p) : error;
}

}  // namespace xla_attn
