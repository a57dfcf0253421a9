// paged_attention's Hopper decode kernel (sm_90): decode_sm80's kernel body (one block
// per split, kv head and sequence; 4 warps each streaming their own 16-key tiles through
// shared-memory stages; mma.sync on the GQA group's m16 tile) with the tiles landed by
// bulk tensor copies (TMA) instead of cp.async.
//
// Why: decode reads every K/V byte once, so it runs at the rate the SM can keep bytes in
// flight. A probe of the paged access pattern on an H100 (docs/benchmarks.md,
// 2026-11-23) read 2870-2890 GB/s with 16-byte loads at decode_sm80's occupancy and
// 3000-3080 GB/s with bulk copies; torch's cuDNN decode reads a contiguous cache at
// 3000-3100. Bulk copies of each 256-byte row (32 requests a tile, one per key and
// tensor) lost to cp.async in the kernel itself. Here one lane issues one tensor copy
// per tile and tensor (a 4 KB box at d128 bf16): 2 requests a tile, and the warp's 31
// other lanes issue no copy instructions at all (cp.async took 16 a lane and tile).
//
// A tile's 16 keys lie in one cache block (block_size % 16 == 0, tiles start at keys
// that are multiples of 16), so a box is [parts][16 rows][part] of kv head hk: the
// tensor map (decode_sm90::Args) views the cache as [num_blocks][num_heads_k][parts]
// [block_size][part], part = min(row bytes, 128). The copy engine swizzles each
// 128-byte (64-byte) part row as the flash kernels' swz does rows of 64 (32) 16-bit
// units, so the ldmatrix addressing is LdsmLane's on each part.
//
// Rows under 256 bytes (fp8 d128, 16-bit d64, fp8 d64): paged_decode_sm90<..., kHeads>
// reads decode_sm80::heads_together kv heads a block, one box of all of them a
// tile, their query rows sharing the m16 tile. A key's bytes there are 256 contiguous,
// as a 16-bit d128 row, where a block per head read pieces of 64-128 bytes 512 B-1 KB
// apart. H100, B=64, bs16, GB/s of the cache read, L=4096 / 32768 (one head a block ->
// heads together): fp8 d128 2392 / 2740 -> 2697 / 3019, bf16 d64 2709 / 2858 -> 2826 /
// 2988, fp8 d64 2097 / 2070 -> 2232 / 2684.
//
// Untrusted block tables: a block index outside [0, num_blocks) is never copied (the
// stage's barrier completes on the arrival alone) and its keys are masked; their V rows,
// like those of keys past the split's end in the last tile (cache slots the sequence
// has not written, which may hold NaN), are zeroed before P V reads them.
#pragma once
#include "common/tma_sm90.cuh"
#include "paged/decode_sm80.cuh"

namespace xla_attn {
namespace decode_sm90 {

// kHeads kv heads (decode_sm80::heads_together): a box holds each head's
// [parts][16][part] tile, one after the other (kHeadBytes apart).
template <typename KV, int D, int kHeads_>
struct TmaTiles {
  static constexpr int kHeads = kHeads_;
  static constexpr int kWarps = decode_sm80::kWarps;
  static constexpr int kTileKeys = decode_sm80::kTileKeys;
  static constexpr int kStages = decode_sm80::stages(int(sizeof(KV)), kHeads);
  static constexpr int kRowBytes = D * int(sizeof(KV));
  static constexpr int kPartBytes = part_bytes(D, int(sizeof(KV)));
  static constexpr int kPartW = kPartBytes / 2;                // part width in 16-bit units
  static constexpr int kPartStride = kTileKeys * kPartBytes;   // bytes of one [16][part]
  static constexpr int kStepsPerPart = kPartW / 16;            // ldmatrix k-steps a part
  static constexpr int kHeadBytes = kTileKeys * kRowBytes;  // a head's tile
  static constexpr int kTileBytes = kHeads * kHeadBytes;    // a stage's K (or V) tile
  static_assert(covers(D, int(sizeof(KV))), "rows of 64, 128 or 256 bytes");
  static_assert(kHeads == 1 || kHeads == decode_sm80::heads_together(D, int(sizeof(KV))),
                "heads together make 256-byte key rows");
  static_assert(kHeadBytes % kAlign == 0 || kPartBytes == 64,
                "128-byte swizzled tiles must start on the swizzle's 1 KB period");
  using LdsmLane = sm80::LdsmLane<kPartW>;

  const sm90::TensorMap* k_map;
  const sm90::TensorMap* v_map;
  const int32_t* table_row;  // the sequence's block-table row
  int block_size, block_shift, num_blocks, hk, k_lo, k_hi, warp, lane, my_tiles;
  uint32_t sK, sV, bars;     // shared addresses: stage 0's K and V tiles, stage 0's barrier
  unsigned valid_mask;       // bit s: stage s holds a copied block
  int block_ahead;
  // Heads together: the block table a warp-wide read at a time. Lane l holds the block
  // of tile 32 c + l for chunk c = chunk (this_chunk) and chunk + 1 (next_chunk), read
  // when the lookups enter chunk c - 1, ~32 tiles before any of its entries is needed,
  // instead of one read a tile issued a tile ahead. H100, B=64, bs16 (GB/s): fp8 d128
  // pairs 2591-2635 -> 2697-2704 at L=4096, 2958-2985 -> 3007-3019 at L=32768. For a
  // head a block it was not kept: fp8 d128 -1 %, fp8 d64 -8 %, bf16 d128 within spread.
  int chunk, this_chunk, next_chunk;
  LdsmLane lds_k, lds_v;

  __device__ __forceinline__ TmaTiles(const Args& a, const decode::DecodeBlock& blk,
                                      unsigned char* smem, int warp_, int lane_, int tiles)
      : k_map(&a.k_map), v_map(&a.v_map),
        table_row(a.base.p.block_tables + int64_t(blk.b) * a.base.p.max_blocks_per_seq),
        block_size(a.base.p.block_size),
        // Block sizes are powers of two in practice: a shift there, not a division.
        block_shift((block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1),
        num_blocks(a.base.p.num_blocks), hk(blk.hk),
        k_lo(blk.k_lo), k_hi(blk.k_hi), warp(warp_), lane(lane_),
        my_tiles(tiles > warp_ ? (tiles - warp_ + kWarps - 1) / kWarps : 0), valid_mask(0u),
        chunk(0), lds_k(LdsmLane::b_operand(lane_)), lds_v(LdsmLane::a_operand(lane_)) {
    if constexpr (kHeads > 1) {
      this_chunk = block_of(lane);
      next_chunk = block_of(32 + lane);
    }
    const uint32_t base = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
    sK = base + uint32_t(warp * kStages * 2 * kTileBytes);
    sV = sK + uint32_t(kStages * kTileBytes);
    bars = base + uint32_t(tiles_bytes(D, int(sizeof(KV)), kHeads) + warp * kStages * 8);
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) sm90::mbar_init(bars + 8 * s);
      sm90::mbar_init_fence();
      sm90::prefetch_tensor_map(k_map);
      sm90::prefetch_tensor_map(v_map);
    }
    __syncwarp();
  }

  __device__ __forceinline__ int count() const { return my_tiles; }
  __device__ __forceinline__ int key0(int i) const {
    return k_lo + (i * kWarps + warp) * kTileKeys;
  }

  // Cache block of tile i, -1 where there is none (past the warp's tiles, or a block
  // index out of range).
  __device__ __forceinline__ int block_of(int i) const {
    if (i >= my_tiles) return -1;
    const int key = key0(i);
    const int block = table_row[block_shift >= 0 ? key >> block_shift : key / block_size];
    return block >= 0 && block < num_blocks ? block : -1;
  }

  // block_of(i), called by the whole warp with i rising by one from 0. A head a block:
  // every lane reads the same entry (one transaction), a tile ahead of the copy that
  // needs it, as in decode_sm80. Heads together: from the chunks, entering the next
  // one shifts them and reads the one after.
  __device__ __forceinline__ int lookup(int i) {
    if constexpr (kHeads == 1) {
      return block_of(i);
    } else {
      if (i >= 32 * (chunk + 1)) {
        ++chunk;
        this_chunk = next_chunk;
        next_chunk = block_of(32 * (chunk + 1) + lane);
      }
      return __shfl_sync(0xffffffffu, this_chunk, i % 32);
    }
  }

  // Tile i (cache block `block`) into stage i % kStages: one K and one V box copy (of
  // kHeads heads) issued by lane 0, both completing on the stage's barrier.
  __device__ __forceinline__ void issue(int i, int block) {
    const int stage = i % kStages;
    valid_mask = (valid_mask & ~(1u << stage)) | (block >= 0 ? 1u << stage : 0u);
    if (lane == 0) {
      const uint32_t bar = bars + 8u * uint32_t(stage);
      sm90::mbar_arrive_expect_tx(bar, block >= 0 ? 2u * kTileBytes : 0u);
      if (block >= 0) {
        const int key = key0(i);
        const int slot = block_shift >= 0 ? key & (block_size - 1) : key % block_size;
        sm90::tma_load_5d(sK + uint32_t(stage * kTileBytes), k_map, bar, 0, slot, 0, hk, block);
        sm90::tma_load_5d(sV + uint32_t(stage * kTileBytes), v_map, bar, 0, slot, 0, hk, block);
      }
    }
  }

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < my_tiles) issue(i, lookup(i));
    }
    block_ahead = lookup(kStages - 1);
  }

  // Issues tile i + kStages - 1 and waits for tile i; returns its stage. The stage
  // refilled was released (a __syncwarp) at the end of iteration i - 1.
  __device__ __forceinline__ int acquire(int i) {
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, block_ahead);
    block_ahead = lookup(i + kStages);
    const int stage = i % kStages;
    sm90::mbar_wait(bars + 8u * uint32_t(stage), uint32_t(i / kStages) & 1u);
    // Rows without data in V: all of an uncopied block's, those past k_hi in a copied
    // one. Zeroed by ordinary stores, which the copy engine's next fill of this stage
    // must follow (the proxy fence).
    const int have = (valid_mask >> stage) & 1u ? min(kTileKeys, k_hi - key0(i)) : 0;
    if (have < kTileKeys) {
      const uint32_t tv = sV + uint32_t(stage * kTileBytes);
      constexpr int kChunksPerRow = kPartBytes / 16;
      for (int c = lane; c < kTileBytes / 16; c += 32) {
        if ((c / kChunksPerRow) % kTileKeys >= have) {
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tv + 16u * uint32_t(c)),
                       "r"(0u)
                       : "memory");
        }
      }
      sm90::fence_proxy_async_shared();
    }
    __syncwarp();
    return stage;
  }

  // Head `head` of the block's kv heads in the stage's K and V tiles.
  __device__ __forceinline__ uint32_t k_tile(int stage, int head = 0) const {
    return sK + uint32_t(stage * kTileBytes + head * kHeadBytes);
  }
  __device__ __forceinline__ uint32_t v_tile(int stage, int head = 0) const {
    return sV + uint32_t(stage * kTileBytes + head * kHeadBytes);
  }
  // k-step kk (16 units) lies in part kk / kStepsPerPart, k-step kk % kStepsPerPart of it.
  __device__ __forceinline__ uint32_t k_addr(uint32_t tk, int kk) const {
    return lds_k(tk + uint32_t((kk / kStepsPerPart) * kPartStride), 0, kk % kStepsPerPart);
  }
  __device__ __forceinline__ uint32_t v_addr(uint32_t tv, int dd) const {
    return lds_v(tv + uint32_t((dd / kStepsPerPart) * kPartStride), 0, dd % kStepsPerPart);
  }
  __device__ __forceinline__ bool present(int stage, int /*jl*/, int key) const {
    return ((valid_mask >> stage) & 1u) && key < k_hi;
  }
  __device__ __forceinline__ void release() const { __syncwarp(); }
  // Every copy issued was waited for in acquire().
  __device__ __forceinline__ void drain() const {}
};

}  // namespace decode_sm90

template <typename T, typename KV, int D, int kHeads = 1>
__device__ void paged_decode_sm90(const decode_sm90::Args& a) {
  using decode_sm80::kTileKeys;
  extern __shared__ __align__(128) unsigned char smem[];
  decode::DecodeBlock blk;
  // Tiles start at multiples of 16 keys, so each lies in one cache block: a window's
  // first key rounds down (the keys before it are masked by the window).
  if (!blk.locate<T>(a.base, kTileKeys, kTileKeys, kHeads)) return;
  const int tiles = (blk.k_hi - blk.k_lo + kTileKeys - 1) / kTileKeys;
  decode_sm90::TmaTiles<KV, D, kHeads> source(a, blk, smem, threadIdx.x / 32, threadIdx.x % 32,
                                              tiles);
  paged_decode_mma<T, KV, D>(a.base, blk, source, smem);
}

}  // namespace xla_attn
