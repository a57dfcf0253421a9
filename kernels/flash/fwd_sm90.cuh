// Flash attention forward, sm90 family (sm_90a; f16, bf16, fp8 e4m3): FlashAttention-2's
// online softmax on Hopper's own instructions (the FA3 paper's structure, arXiv
// 2407.08608): tiles land by bulk tensor copies (TMA) on mbarriers, products run as
// warpgroup wgmma, and the block is warp-specialized.
//
// One block = kBlockM (128, or 192 with three consumers) query rows of one head of one
// sequence:
// - warpgroup 0, the producer: one thread copies Q once and then each K / V tile into
//   rings of shared-memory stages (sm90_tiles.h), each copy completing on its stage's
//   full barrier, a stage refilled once every consumer warp has released it (its empty
//   barrier);
// - warpgroups 1 .. kWgs, the consumers, 64 query rows each: S = Q K^T (wgmma, both
//   operands in shared memory), the online softmax in registers (sm80::TileSoftmax, the
//   same code as the sm80 family: the accumulator fragments are mma.sync's), P rounded
//   to 16 bits in registers and O += P V (wgmma, P from registers, V read N-major);
//   with two consumers they take turns issuing products (ping-pong, below).
//
// The contract is the sm80 kernel's for what this family takes (the launcher sends the
// rest there): varlen, seqused_k, GQA, causal / sliding window, softcap, ALiBi, lse
// (+inf for rows that see no key), batch_used, decode_max_q, paged K/V (block sizes
// whose gcd with block_n is a multiple of 8); not split-KV, and head_dim % 8 == 0 with
// 16-byte aligned tensors (the copy engine's strides).
//
// Paged K/V: a tile's rows come in boxes of kv_box_rows keys (sm90_tiles.h, Args), each
// box from the row its page starts at. The block table is untrusted: a box whose page
// index is outside [0, num_blocks) is copied from past the cache's last row, which the
// copy engine reads as zeros without touching memory, and its keys are masked: each
// consumer warp looks its tile's boxes up itself (a lane a box) and, where one has no
// page, writes valid bytes for sm80::TileSoftmax in its own slice of shared memory
// (published by __syncwarp alone: the producer's copies cannot tell the consumers).
//
// fp8 (e4m3 q, k, v with q/k/v_descale; bf16 out; head dims up to 128 in one 128-byte
// column block, the d64 bucket's upper half zeros, 129-256 in two: sm90_tiles.h,
// fp8_bucket; 128-key tiles in every bucket): S = Q K^T on m64n128k32 e4m3 products; P is
// rounded to e4m3 in registers for P V. 8-bit wgmma reads B only K-major, and P V's K is
// the keys, so the producer warpgroup transposes each V tile in shared memory into a V^T
// tile (fwd_sm90_producer.cuh, transpose_v_e4m3) while the consumers compute, then releases it on a
// full_vt barrier; or, where the rows pay for it (sm90_tiles.h, vt_given), a pass before
// the forward writes V^T into the workspace and the copy engine lands its tiles.
// The descales scale the scores (q_descale * k_descale) and O (v_descale).
//
// Rows past a sequence: the copy engine reads whole boxes, so a tile's rows past the
// sequence's keys hold the next sequence's or padding data (NaN, say). Their scores
// are masked by a select; their V rows are zeroed in shared memory before P V (0 x NaN
// would be NaN); output rows past the sequence's queries are not written.
//
// The pieces are in files of their own, included in this order: a consumer warpgroup's
// tile and item end (fwd_sm90_tile.cuh), the block setup and producer
// (fwd_sm90_producer.cuh), the consumers' item (fwd_sm90_consumer.cuh); this file has
// the kernel (flash_fwd_sm90, one item a block) and fp8's V^T pass (flash_fwd_vt_pack).
#pragma once
#include "flash/fwd_sm90_consumer.cuh"

namespace xla_attn {

// kPaged: the instance for paged K/V (two consumers; 16-bit or fp8), so that the others carry
// none of its code: with a run-time flag ptxas spilled at d128 and the dense forward ran
// 6-9 % slower (H100, d128, S = 4096 / 16384).
// kVtGiven: the fp8 instance that reads V given transposed (FwdBlockTiles), so that the
// one that transposes keeps its code: with a run-time flag the fp8 d256 forward ran 2-5 %
// slower where it transposed (H100, S = 512 .. 16384).
template <typename T, int D, int kWgs, bool kPaged = false, bool kVtGiven = false>
__device__ void flash_fwd_sm90(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  using Tiles = FwdBlockTiles<T, D, kWgs, kVtGiven>;  // shapes, rings, layout, producer (fwd_sm90_producer.cuh)
  constexpr int kBlockN = Tiles::kBlockN, kEB = Tiles::kEB;
  constexpr bool kFp8 = Tiles::kFp8;
  static_assert(!kFp8 || ((D == 64 || D == 128 || D == 256) &&
                          kWgs == (kPaged ? 2 : fp8_wgs(D))),
                "fp8: the d64, d128 and d256 buckets, fp8_wgs consumers (paged: two)");
  static_assert(!kVtGiven || (kFp8 && !kPaged), "V given transposed: fp8, not paged");
  const xla_attn_flash_fwd_params& p = a.p;
  extern __shared__ __align__(128) unsigned char smem[];

  FwdBlock blk;
  if (!blk.locate<typename Tiles::Out, true>(p, Tiles::kBlockM, kBlockN)) return;
  const int h = blk.h, m0 = blk.m0;
  static_assert(!kPaged || kWgs == 2, "paged: the two-consumer kernels");
  constexpr bool paged = kPaged;  // the launcher sends paged calls here alone
  // paged: tiles start on a box (page) boundary, so that no box straddles two pages; the
  // keys added in front are outside every row's window and masked as such
  const int n_lo = paged ? blk.n_lo - blk.n_lo % a.kv_box_rows : blk.n_lo, n_hi = blk.n_hi;
  const Sequence& s = blk.s;
  const int tiles = (n_hi - n_lo + kBlockN - 1) / kBlockN;

  const typename Tiles::Smem sm = Tiles::layout(smem, /*q_buffers=*/1);
  // q_full, then per stage: full_k, full_v (the producer's copies landed), empty_k,
  // empty_v (both consumer warpgroups are done reading). K and V are released apart: K_j
  // once S_j is computed, a whole softmax and P V earlier than V_j, so that the producer
  // can land K_{j+2} while tile j + 1 is still being consumed. fp8: full_v says the raw
  // V tile landed (the producer's own wait), full_vt that its transpose is written, and
  // empty_v that the consumers are done with the V^T tile.
  const uint32_t bars = sm.bars, q_full = bars;
  auto bar = [&](int kind, int st) { return bars + 8u * uint32_t(1 + kind * kMaxStages + st); };
  // the parity of tile j's use of its stage in a ring of `ring`
  auto parity = [](int j, int ring) { return uint32_t(j / ring) & 1u; };
  Tiles::init_barriers([&] { sm90::mbar_init(q_full); }, bar);

  // paged: the cache rows of a sequence's keys (sequence.cuh), pages checked against
  // the cache's blocks
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  if (threadIdx.x < 128) {
    // The producer (FwdBlockTiles: copy_q, copy_kv, transpose_stage).
    sm90::regs_release<Tiles::kRegsProducer>();
    // Paged: the whole of warp 0 runs the copy loop (FwdBlockTiles::copy_kv).
    if ((paged ? threadIdx.x < 32 : threadIdx.x == 0) && tiles > 0) {
      if (threadIdx.x == 0) {
        sm90::prefetch_tensor_map(&a.k_map);
        sm90::prefetch_tensor_map(&a.v_map);
        Tiles::copy_q(a, sm, 0, q_full, h, s.q_start + m0);
      }
      for (int j = 0; j < tiles; ++j) {
        Tiles::template copy_kv<paged, /*kWalk=*/false>(
            a, keys, j, [&] { return n_lo + j * kBlockN; }, blk, sm, bar, parity);
      }
    } else if (kFp8 && !kVtGiven && threadIdx.x >= 32) {
      // fp8: warps 1 .. 3 transpose (warp 0's copying thread stays free to run ahead:
      // sharing the copies with a transposing thread held K's copy back a whole tile,
      // and the fp8 forward ran no faster than bf16's)
      for (int j = 0; j < tiles; ++j) {
        Tiles::transpose_stage(j, [&] { return n_hi - (n_lo + j * kBlockN); }, sm, bar, parity);
      }
    }
  } else {
    sm90::regs_acquire<Tiles::kRegsConsumer>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. kConsumers - 1
    // The warpgroup (warp_uniform: its Q rows' descriptors stay in uniform registers).
    const int wg = sm90::warp_uniform(ct / 128), row0 = wg * 64;
    const int warp = (ct % 128) / 32, lane = ct % 32, g = lane / 4, t = lane % 4;

    // With two 16-bit (or fp8 d256) consumer warpgroups, FA3's ping-pong: they take turns
    // issuing their products (named barriers kTurnBarrier + wg: wait for one's turn, then
    // hand it to the other), so that one's products run while the other computes its
    // softmax instead of both contending for the tensor cores and then both leaving them
    // idle. Warpgroup 0 goes first; warpgroup 1 skips its last hand-over, so that every
    // arrival is waited for.
    // Three consumer warpgroups take turns in a ring (sm90_tiles.h, turn_ring): warpgroup
    // wg hands over to wg + 1, the last to 0, which skips its last hand-over.
    constexpr bool kPingPong = ping_pong(kWgs, kEB, D);  // 16-bit, fp8 d256 (sm90_tiles.h)
    constexpr bool kRing = turn_ring(kWgs, kEB, D, /*walk=*/false, kPaged);
    auto my_turn = [&] {
      if constexpr (kPingPong || kRing) sm90::named_barrier(kTurnBarrier + wg, 256);
    };
    auto their_turn = [&](bool last = false) {
      if constexpr (kPingPong) {
        if (!(last && wg == 1)) sm90::named_arrive(kTurnBarrier + 1 - wg, 256);
      } else if constexpr (kRing) {
        if (!(last && wg == kWgs - 1)) sm90::named_arrive(kTurnBarrier + (wg + 1) % kWgs, 256);
      }
    };
    consume_item<T, D, kWgs, paged, /*kWalk=*/false, kVtGiven>(
        a, blk, n_lo, n_hi, tiles, keys,
        ConsumerSmem{sm.sQ, sm.sK, sm.sV, sm.sVt, sm.warp_valid}, q_full, /*g0=*/0,
        /*own_tiles=*/0, ConsumerThread{ct, lane, wg, row0, warp, g, t}, bar, parity, my_turn,
        their_turn, [] {});
  }
}

// fp8's V^T for the forward's copy engine (sm90_tiles.h, vt_given), written without
// shared memory: a block takes 128 keys of sequence blockIdx.z's head blockIdx.y (and
// every 128 keys gridDim.x further: the grid's count comes from max_seqlen_k, a hint),
// its keys past the sequence (seqused_k counted) zeros. Lane (c, t) = (lane / 4, lane %
// 4) holds keys 16c + 2t + {0, 1, 8, 9}: the four bytes of V^T's word t in the keys'
// 16-key group c (transpose_v_e4m3's order), so that 16 bytes of each key's row (16
// head dims, one load each) become 16 such words by byte permutes, one for each dim; a
// warp's store then writes 128 consecutive bytes of one V^T row. Warps take the 16-dim
// chunks in turn. (A first form staged the rows in shared memory and gathered bytes: 59 us
// for d256 S = 8192, 28 % of the DRAM's bandwidth, H100.)
__device__ void flash_fwd_vt_pack(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  constexpr int kKeys = kVtPackKeys;
  static_assert(kKeys == block_n(64, 1) && kKeys == block_n(128, 1) && kKeys == block_n(256, 1),
                "the pass writes whole V^T tiles of every fp8 bucket");
  const xla_attn_flash_fwd_params& p = a.p;
  const int b = blockIdx.z, hk = blockIdx.y, hd = p.head_dim;
  if (b >= real_batch(p.batch, p.batch_used)) return;
  const Sequence s = sequence(b, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k, p.total_q,
                              p.total_k, false, 0);
  const int padded = (s.num_k + kKeys - 1) / kKeys * kKeys;
  const int64_t v_row = int64_t(p.num_heads_k) * hd;  // bytes between keys in v
  const unsigned char* v =
      static_cast<const unsigned char*>(p.v) + s.k_start * v_row + int64_t(hk) * hd;
  unsigned char* vt = a.vt + int64_t(hk) * hd * a.vt_cols + vt_seq_start(s.k_start, b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int c = lane / 4, t = lane % 4;
  for (int key0 = int(blockIdx.x) * kKeys; key0 < padded; key0 += int(gridDim.x) * kKeys) {
    const int first = key0 + 16 * c + 2 * t;
    const int key[4] = {first, first + 1, first + 8, first + 9};
    for (int y = warp; y < hd / 16; y += warps) {  // head dims 16y .. 16y + 15
      uint4 x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[e] = key[e] < s.num_k ? __ldg(reinterpret_cast<const uint4*>(v + key[e] * v_row) + y)
                                : make_uint4(0u, 0u, 0u, 0u);
      }
      unsigned char* dst = vt + int64_t(16 * y) * a.vt_cols + key0 + 16 * c + 4 * t;
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // head dims 16y + 4w .. + 3
        const uint32_t k0 = (&x[0].x)[w], k1 = (&x[1].x)[w], k2 = (&x[2].x)[w], k3 = (&x[3].x)[w];
        const uint32_t lo01 = __byte_perm(k0, k1, 0x5140u), hi01 = __byte_perm(k0, k1, 0x7362u);
        const uint32_t lo23 = __byte_perm(k2, k3, 0x5140u), hi23 = __byte_perm(k2, k3, 0x7362u);
        const uint32_t dims[4] = {__byte_perm(lo01, lo23, 0x5410u), __byte_perm(lo01, lo23, 0x7632u),
                                  __byte_perm(hi01, hi23, 0x5410u), __byte_perm(hi01, hi23, 0x7632u)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          *reinterpret_cast<uint32_t*>(dst + int64_t(4 * w + i) * a.vt_cols) = dims[i];
        }
      }
    }
  }
}

}  // namespace xla_attn
