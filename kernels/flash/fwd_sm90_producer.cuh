// The sm90 forward's block setup and producer (fwd_sm90.cuh has the kernel and the
// family's structure): fp8's V transposes in shared memory (transpose_v_e4m3), the
// stage barriers' kinds, and FwdBlockTiles, the tile shapes, rings, shared-memory layout,
// barriers and copies that both forward kernels (one item a block and the walk) share.
#pragma once
#include "flash/fwd_sm90_tile.cuh"

namespace xla_attn {
namespace flash_sm90 {

// One kBlockN-key V tile of e4m3 (rows = keys, in 128-byte column blocks, swizzled as the
// copy engine lands them) into V^T (rows = head dims, the first D, kBlockN bytes of keys in
// 128-byte rows swizzled the same way), as the K-major B operand of P V, by the producer's
// transposing warps. Keys are permuted inside each 16: V^T column 16c + 4t + j holds key
// 16c + 2t + (j & 1) + 8 (j >> 1), the key whose score sits in byte j of the P register
// that the consumers pack from accumulator pairs (2t, 2t + 1) and (2t + 8, 2t + 9) (to_p),
// so P needs no shuffle. Keys at or past `have` read as zeros (rows past the sequence may
// hold NaN). A warp moves a 16-key x 32-dim block a step: one ldmatrix.x4.trans (16-bit units: a
// lane gets dims 2g, 2g + 1 of keys 2t, 2t + 1, and of keys 2t + 8, 2t + 9 and dims + 16
// in the other three matrices), 4 byte permutes into 4 keys of one dim a register, one
// stmatrix.x4 (matrix row g = V^T row 2g (+1, +16, +17), bytes 4t.. = keys 4t..). The
// loads hit 8 distinct 16-byte chunks a phase, the stores 4 (2-way): rows 2g + e share
// their swizzle phase in pairs (addresses simulated). With 4-byte loads and stores the
// transpose took ~70 instructions per 16 bytes a lane, and issue slots that the consumer
// warps on the same schedulers needed: the fp8 forward ran at 0.8-1.0x bf16.
// kMaskKeys: the tile holds keys at or past `have` (a sequence's last tile), zeroed.
// d256: the raw tile's dims 128.. in its second column block (kBlockN rows further).
template <int D, bool kMaskKeys>
__device__ __forceinline__ void transpose_v_blocks(uint32_t raw, uint32_t vt, int have, int pt) {
  constexpr uint32_t kKeyBlocks = uint32_t(block_n(D, 1) / 16);
  constexpr uint32_t kBlocks = kKeyBlocks * uint32_t(D / 32);  // key blocks x D / 32 dim blocks
  constexpr uint32_t kRawBlockBytes = uint32_t(block_n(D, 1)) * 128u;  // a raw column block
  const int lane = pt % 32, warp = pt / 32;
  const int m = lane / 8, r = lane % 8, half = m >> 1, t = lane % 4;
  // this lane's ldmatrix row (key r of matrix m) and stmatrix row (V^T row n_lane)
  const uint32_t ld_row = raw + uint32_t(r + 8 * (m & 1)) * 128u;
  const int n_lane = 16 * half + 2 * r + (m & 1);
  const uint32_t st_row = vt + uint32_t(n_lane) * 128u;
#pragma unroll 1
  for (uint32_t blk = warp; blk < kBlocks; blk += kTransposeWarps) {
    const uint32_t c = blk % kKeyBlocks, xb = blk / kKeyBlocks;  // keys 16c .., dims 32xb ..
    uint32_t x[4];
    if constexpr (D <= 128) {  // one raw column block (the d64 / d128 code as it was)
      sm80::ldsm_x4_trans(x,
                          ld_row + c * 2048u + (((2u * xb + uint32_t(half)) ^ uint32_t(r)) << 4));
    } else {  // raw column block xb / 4, its 32-dim block xb % 4
      sm80::ldsm_x4_trans(x, ld_row + xb / 4u * kRawBlockBytes + c * 2048u +
                                 (((2u * (xb % 4u) + uint32_t(half)) ^ uint32_t(r)) << 4));
    }
    if constexpr (kMaskKeys) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int key = 16 * int(c) + 2 * t + 8 * (q & 1);
        x[q] &= (key < have ? 0xFFFFu : 0u) | (key + 1 < have ? 0xFFFF0000u : 0u);
      }
    }
    const uint32_t y[4] = {__byte_perm(x[0], x[1], 0x6420u), __byte_perm(x[0], x[1], 0x7531u),
                           __byte_perm(x[2], x[3], 0x6420u), __byte_perm(x[2], x[3], 0x7531u)};
    sm90::stsm_x4(st_row + xb * 4096u + ((c ^ uint32_t(n_lane & 7)) << 4), y);
  }
}
// The key mask only where the tile has such keys: tested in every block (a warp-uniform
// branch ptxas wrapped in BSSY / BSYNC), with signed block indices, the loop ran 35
// instructions a block, now 20, and the transposing warps took 18 % of the fp8 kernel's
// stall samples beside three consumer warpgroups (ncu, H100, d128 S=8192). H100, same run:
// +0..+1 % up to S=8192, +4 % at 16384: the transposes were not what held the consumers.
template <int D>
__device__ __forceinline__ void transpose_v_e4m3(uint32_t raw, uint32_t vt, int have, int pt) {
  if (have >= block_n(D, 1)) {
    transpose_v_blocks<D, false>(raw, vt, have, pt);
  } else {
    transpose_v_blocks<D, true>(raw, vt, have, pt);
  }
}

// The stage barriers' kinds, bar(kind, st) in both kernels: full_k, full_v (the
// producer's copies landed), empty_k, empty_v (the consumers are done reading); fp8's
// full_vt (V^T written) and empty_raw (the raw V stage back to the copying thread).
enum { kFullK, kFullV, kEmptyK, kEmptyV, kFullVt, kEmptyRaw };

// The kernel setup and producer code both forward kernels share (flash_fwd_sm90, one
// item a block, and flash_fwd_sm90_walk), as consume_item is their consumers': their tile
// shapes and rings (sm90_tiles.h), the shared-memory layout (layout), the barriers
// (init_barriers), fp8's V transposes (transpose_stage) and the producer's copies
// (copy_q, copy_kv, load). Both kernels' PTX and machine code are what they were when each
// wrote these out itself (compared kernel by kernel); where the two had written the same
// step in another order, each keeps its own (below). Tile g sits in stage g % ring: the
// walk counts its tiles over the block's whole walk, one item a block from its item's
// first (g = j); bar(kind, st) and parity(g, ring) are the kernel's barriers.
// kVtGiven (fp8, flash_fwd_sm90's instance for V given transposed: sm90_tiles.h,
// vt_given): no raw V ring, K and V^T ring through kVtGivenStages each, and the
// producer copies V^T tiles (load_vt) where it would copy V.
template <typename T, int D, int kWgs, bool kVtGiven = false>
struct FwdBlockTiles {
  // Enumerators: NVRTC emits static constexpr data members as global variables.
  enum : int {
    kBlockN = block_n(D, int(sizeof(T))),
    kBlockM = block_m(kWgs),  // kWgs consumer warpgroups of 64 rows
    kConsumers = 128 * kWgs,  // consumer threads
    kEB = int(sizeof(T)),  // element bytes: 2, or 1 for e4m3
    kColBlocks = col_blocks(D, kEB),  // 128-byte column blocks of a row
    // Rings of stages (sm90_tiles.h): K, V as copied, fp8's V^T; P V reads V^T or V.
    kKRing = k_stages(D, kEB, kVtGiven),
    kVRing = v_stages(D, kEB, kVtGiven),
    kVtRing = vt_stages(D, kEB, kVtGiven),
    kPvRing = kEB == 1 ? kVtRing : kVRing,
    // setmaxnreg's counts (sm90_tiles.h): the producer warpgroup's, then each consumer's
    kRegsProducer = producer_regs(kWgs, kEB, D),
    kRegsConsumer = consumer_regs(kWgs, kRegsProducer),
  };
  enum : bool { kFp8 = kEB == 1 };
  using Out = Select<kFp8, __nv_bfloat16, T>;  // fp8's output is bf16
  enum : uint32_t {
    kQBlockBytes = kBlockM * kRowBytes,   // one column block of Q
    kKVBlockBytes = kBlockN * kRowBytes,  // one column block of K or V
    kKVBytes = kColBlocks * kKVBlockBytes,
    kVtBytes = vt_bytes(D, kEB),  // fp8: V^T, D rows of kBlockN bytes
    kQBytes = q_bytes(D, kWgs, kEB),  // one Q buffer
  };
  // The shared memory (sm90_tiles.h) from its kAlign-aligned start: q_buffers Q buffers
  // (Q buffer qb at sQ + qb * kQBytes), the K, V and fp8 V^T rings, the barriers (bars),
  // then the valid-bytes slice.
  struct Smem {
    uint32_t sQ, sK, sV, sVt, bars;
    unsigned char* warp_valid;
  };
  static __device__ __forceinline__ Smem layout(unsigned char* smem, int q_buffers) {
    Smem sm;
    sm.sQ = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
    sm.sK = sm.sQ + uint32_t(q_buffers) * kQBytes;
    sm.sV = sm.sK + kKRing * kKVBytes;
    sm.sVt = sm.sV + kVRing * kKVBytes;
    sm.bars = sm.sVt + kVtRing * kVtBytes;
    // paged: each consumer warp's valid bytes (sm90_tiles.h, valid_bytes), generic
    sm.warp_valid = smem + (sm.bars + uint32_t(barrier_bytes(kEB)) - sm80::smem_addr(smem));
    return sm;
  }

  // The barriers, by thread 0 before the block's threads meet: the kernel's Q barriers
  // (init_q), then each stage's (the kinds above).
  template <typename InitQ, typename Bar>
  static __device__ __forceinline__ void init_barriers(InitQ&& init_q, Bar&& bar) {
    if (threadIdx.x == 0) {
      init_q();
      for (int st = 0; st < kKRing; ++st) {
        sm90::mbar_init(bar(kFullK, st));
        sm90::mbar_init(bar(kEmptyK, st), 4 * kWgs);  // one arrival a consumer warp
      }
      for (int st = 0; st < kVRing; ++st) {
        sm90::mbar_init(bar(kFullV, st));
        if constexpr (kFp8) sm90::mbar_init(bar(kEmptyRaw, st));
      }
      for (int st = 0; st < kPvRing; ++st) {
        sm90::mbar_init(bar(kEmptyV, st), 4 * kWgs);
        if constexpr (kFp8) sm90::mbar_init(bar(kFullVt, st));
      }
      sm90::mbar_init_fence();
    }
    __syncthreads();
  }

  // fp8: V tile g into V^T stage g % kVtRing by the producer's warps 1 .. 3, once the
  // copy has landed and the consumers have released that stage's previous V^T tile; the
  // stores are made visible to wgmma (the async proxy) before full_vt is signalled, and
  // the raw stage is handed back to the copying thread (empty_raw) after the named
  // barrier. have(): the tile's keys inside the item's range, a callable so that each
  // kernel keeps its order: one item a block counts them after the waits, the walk
  // before (an int argument reordered the former's PTX).
  template <typename Have, typename Bar, typename Parity>
  static __device__ __forceinline__ void transpose_stage(int g, Have&& have, const Smem& sm,
                                                         Bar&& bar, Parity&& parity) {
    if constexpr (kFp8) {
      const int st = g % kVtRing, raw = g % kVRing;
      sm90::mbar_wait(bar(kFullV, raw), parity(g, kVRing));
      if (g >= kVtRing) sm90::mbar_wait(bar(kEmptyV, st), parity(g - kVtRing, kVtRing));
      transpose_v_e4m3<D>(sm.sV + raw * kKVBytes, sm.sVt + st * kVtBytes, have(),
                          threadIdx.x - 32);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier(kProducerBarrier, 32 * kTransposeWarps);
      if (threadIdx.x == 32) {
        sm90::mbar_arrive(bar(kFullVt, st));
        sm90::mbar_arrive(bar(kEmptyRaw, raw));
      }
    }
  }

  // An item's Q (head h, its first row at row q_row) into Q buffer qb (layout), landing
  // on q_full (the producer's thread 0).
  static __device__ __forceinline__ void copy_q(const Args& a, const Smem& sm, int qb,
                                                uint32_t q_full, int h, int64_t q_row) {
    sm90::mbar_arrive_expect_tx(q_full, kColBlocks * kQBlockBytes);
    for (int c = 0; c < kColBlocks; ++c) {
      sm90::tma_load_3d(sm.sQ + qb * kQBytes + c * kQBlockBytes, &a.q_map, q_full,
                        128 / kEB * c, h, int(q_row));
    }
  }

  // The producer's copies. Coordinates are (column, head, row), innermost first; boxes
  // past the tensor's rows or head_dim read as zeros.
  // Tile g of item blk (its tile starting at key first_key()) into stage g % ring of the
  // ring at tiles_at (kind: its full barrier), each tensor once the stage's previous tile
  // (g - ring) has released it: its (g / ring - 1)-th release. fp8's raw V stages are
  // released by the transposing warps. As each kernel had it: the walk (kWalk) takes that
  // release's parity as parity(g - ring, ring) and makes the tile's first key before the
  // wait (first_key returns it), one item a block as g / ring - 1 and the key after it
  // (an int argument reordered the latter's PTX).
  // Given its ring (the kernels' lambdas read theirs from captured constants, opaque
  // until inlined): with the ring picked from kind inside, ptxas scheduled the d64 and
  // fp8 kernels' copies differently (their K and V rings are the same length).
  template <bool kPaged, bool kWalk, typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void load(const Args& a, int g, N0&& first_key, int kind,
                                              int ring, uint32_t tiles_at,
                                              const sm90::TensorMap* map, const FwdBlock& blk,
                                              int64_t lane_row, Bar&& bar, Parity&& parity) {
    const int st = g % ring;
    if (g >= ring) {
      const int release = kFp8 && kind == kFullV ? kEmptyRaw : kind + 2;
      sm90::mbar_wait</*kParked=*/true>(
          bar(release, st), kWalk ? parity(g - ring, ring) : uint32_t(g / ring - 1) & 1u);
    }
    const int n0 = first_key();
    if (!kPaged) {
      sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
      for (int c = 0; c < kColBlocks; ++c) {
        sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes, map, bar(kind, st),
                          128 / kEB * c, blk.hk, int(blk.s.k_start + n0));
      }
      return;
    }
    // Paged (warp 0): lane i copies box i from the cache row it looked up (lane_row;
    // none: no page, or past the range) once lane 0 has announced the tile's bytes.
    if (threadIdx.x == 0) sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
    __syncwarp();
    const int r = int(threadIdx.x) * a.kv_box_rows;
    if (r < kBlockN) {
      const int at = lane_row >= 0 ? int(lane_row) : int(a.p.total_k);  // past the rows: zeros
      for (int c = 0; c < kColBlocks; ++c) {
        sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes + r * kRowBytes, map,
                          bar(kind, st), 128 / kEB * c, blk.hk, at);
      }
    }
  }

  // Tile g of K and V (item blk's tile from key first_key()), each by load. Paged: the
  // whole of warp 0 runs the copy loop, lane i looking box i's page up (K and V share it;
  // keys: the cache rows) and issuing its copies. H100, d128, S=4096, causal, 16-row
  // boxes: lookups and copies in one thread 225 TFLOP/s, lookups by the lanes and copies
  // in one thread 263-268, both by the lanes 468 (64-row boxes 482-497).
  template <bool kPaged, bool kWalk, typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void copy_kv(const Args& a, const KeyRows& keys, int g,
                                                 N0&& first_key, const FwdBlock& blk,
                                                 const Smem& sm, Bar&& bar, Parity&& parity) {
    int64_t lane_row = -1;
    if (kPaged) {
      const int key = first_key() + int(threadIdx.x) * a.kv_box_rows;
      if (int(threadIdx.x) * a.kv_box_rows < kBlockN && key < blk.n_hi)
        lane_row = keys.row(blk.b, 0, key);
    }
    load<kPaged, kWalk>(a, g, first_key, kFullK, kKRing, sm.sK, &a.k_map, blk, lane_row, bar,
                        parity);
    if constexpr (kVtGiven) {
      load_vt(a, g, first_key, blk, sm, bar, parity);
    } else {
      load<kPaged, kWalk>(a, g, first_key, kFullV, kVRing, sm.sV, &a.v_map, blk, lane_row, bar,
                          parity);
    }
  }

  // kVtGiven (sm90_tiles.h, vt_given): tile g's V^T straight into
  // V^T stage g % kVtRing, landing on full_vt, once the consumers have released the
  // stage's previous tile (empty_v), as transpose_stage waits for it. The tile's keys
  // past the sequence are the zeros flash_fwd_vt_pack wrote; head dims past head_dim
  // read as zeros (rows past the map's).
  template <typename N0, typename Bar, typename Parity>
  static __device__ __forceinline__ void load_vt(const Args& a, int g, N0&& first_key,
                                                 const FwdBlock& blk, const Smem& sm, Bar&& bar,
                                                 Parity&& parity) {
    const int st = g % kVtRing;
    if (g >= kVtRing) sm90::mbar_wait(bar(kEmptyV, st), parity(g - kVtRing, kVtRing));
    sm90::mbar_arrive_expect_tx(bar(kFullVt, st), kVtBytes);
    sm90::tma_load_3d(sm.sVt + st * kVtBytes, &a.vt_map, bar(kFullVt, st),
                      int(vt_seq_start(blk.s.k_start, blk.b) + first_key()), 0, blk.hk);
  }
};

}  // namespace flash_sm90
}  // namespace xla_attn
