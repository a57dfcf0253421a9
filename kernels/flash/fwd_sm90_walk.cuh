// Flash attention forward, sm90 family, as a persistent walk (fwd_sm90.cuh has the kernel
// this one walks with, one block an item): a grid of one block an SM, each block taking
// (row block, head, sequence) items (sm90_tiles.h, Args) as it finishes one. The producer
// claims the next item from a counter in the workspace and hands it to the other warps
// with its Q (two Q buffers where they fit), so that the next item's Q and first K / V
// tiles are copied during the current item's last tiles and epilogue instead of after
// the block's start; each item is then computed as in flash_fwd_sm90.
//
// Its own kernel rather than a flag of flash_fwd_sm90: built from one source, the one
// block an item instances ran 3-6 % slower at d128 and d256 (H100, the same run; ptxas
// kept the item's coordinates out of uniform registers and scheduled the tile loop
// differently), so those keep their code unchanged and this one carries the walk.
// The launcher (launch.cc, sm90_tiles.h walks) takes it at d64 and d128 (fp8 up to 2048
// query rows), not paged.
#pragma once
#include "flash/fwd_sm90.cuh"

namespace xla_attn {

template <typename T, int D, int kWgs>
__device__ void flash_fwd_sm90_walk(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  constexpr int kBlockN = block_n(D);
  constexpr int kBlockM = block_m(kWgs);  // kWgs consumer warpgroups of 64 rows
  constexpr int kConsumers = 128 * kWgs;  // consumer threads
  constexpr int kEB = int(sizeof(T));  // element bytes: 2, or 1 for e4m3
  constexpr bool kFp8 = kEB == 1;
  using Out = Select<kFp8, __nv_bfloat16, T>;  // fp8's output is bf16
  static_assert(!kFp8 || ((D == 64 || D == 128) && kWgs == kFp8Wgs),
                "fp8: the d64 and d128 buckets, three consumers");
  constexpr int kColBlocks = col_blocks(D, kEB);  // 128-byte column blocks of a row
  constexpr int kPSteps = kBlockN * kEB / 32;  // P V k-steps (16 keys, fp8 32)
  constexpr int kNT = kBlockN / 8;    // n8 tiles of S
  constexpr int kDT = D / 8;          // n8 tiles of O
  constexpr uint32_t kQBlockBytes = kBlockM * kRowBytes;   // one column block of Q
  constexpr uint32_t kKVBlockBytes = kBlockN * kRowBytes;  // one column block of K or V
  constexpr uint32_t kKVBytes = kColBlocks * kKVBlockBytes;
  constexpr uint32_t kVtBytes = vt_bytes(D, kEB);  // fp8: V^T, D rows of kBlockN bytes
  constexpr int kQBufs = q_buffers(D, kWgs, kEB, true);
  constexpr int kRecords = 2 * kQBufs;  // item records (below)
  constexpr uint32_t kQBytes = q_bytes(D, kWgs, kEB);
  const xla_attn_flash_fwd_params& p = a.p;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr bool paged = false;  // the walk is not built for paged K/V

  // Item `item` (Args) located in `blk`: true where it has rows to compute. `threads` of
  // the block's threads, this one `thread`, share the padding rows' item (0: none). The
  // last (head, sequence) pairs' items, enough for two a block, come longest first across
  // the pairs (sequence.cuh, longest_first_tail): in plain order the last claims were the
  // last heads' long row blocks under a causal mask, and a list-scheduling model of the
  // bench's causal rows (tools/tail_model.py's, items of x + 1 tiles) finished 5.6-7.1 %
  // past the work's even spread at S = 2048 .. 8192, 1.1-1.7 % with the remap; H200, same
  // run: bf16 d64 causal +1..+5 %.
  auto locate = [&](int item, FwdBlock& blk, int thread, int threads) {
    int x = item % a.row_blocks, head = item / a.row_blocks % p.num_heads,
        seq = item / a.row_blocks / p.num_heads;
    longest_first_tail(p.batch, a.row_blocks, p.num_heads, int(gridDim.x), &x, &head, &seq,
                       a.tail_waves);
    return blk.at<Out>(p, kBlockM, a.row_blocks, x, head, seq, thread, threads);
  };
  // The padding rows' items (sequence `batch`, one a head: their consumers zero the rows
  // past the last real sequence), which have no rows to compute but are walked.
  auto is_padding = [&](int item) {
    return item % a.row_blocks == 0 && item / a.row_blocks / p.num_heads == p.batch;
  };
  // The keys an item's tiles cover: [n_lo, n_hi) in `tiles` tiles. Paged: tiles start on
  // a box (page) boundary, so that no box straddles two pages; the keys added in front
  // are outside every row's window and masked as such.
  struct KeyTiles {
    int n_lo, n_hi, tiles;
  };
  auto key_tiles = [&](const FwdBlock& blk) {
    const int lo = paged ? blk.n_lo - blk.n_lo % a.kv_box_rows : blk.n_lo;
    return KeyTiles{lo, blk.n_hi, (blk.n_hi - lo + kBlockN - 1) / kBlockN};
  };

  const uint32_t base = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
  const uint32_t sQ0 = base;  // Q buffer qb at sQ0 + qb * kQBytes
  const uint32_t sK = sQ0 + kQBufs * kQBytes;
  // Rings of stages (sm90_tiles.h): K, V as copied, fp8's V^T; P V reads V^T or V.
  constexpr int kKRing = k_stages(D, kEB), kVRing = v_stages(D, kEB), kVtRing = vt_stages(kEB);
  constexpr int kPvRing = kFp8 ? kVtRing : kVRing;
  const uint32_t sV = sK + kKRing * kKVBytes;
  const uint32_t sVt = sV + kVRing * kKVBytes;
  const uint32_t bars = sVt + kVtRing * kVtBytes;
  // paged: each consumer warp's valid bytes (sm90_tiles.h, valid_bytes), generic
  unsigned char* const warp_valid =
      smem + (bars + uint32_t(barrier_bytes(kEB)) - sm80::smem_addr(smem));
  // Item records: each item as the producer located it (FwdBlock), read by the consumers
  // and fp8's transposing warps instead of locating it again (the divisions into row
  // block, head and sequence, and cu_seqlens from global memory, on every item's critical
  // path; H100, same run: bf16 d64 S=512 / 1024 causal +4..5 / +3 %, fp8 d128 +1 %). In
  // the paged kernels' valid-bytes slice, which the walk (never paged) leaves unused.
  // Two slots a Q buffer, item qi's in qi % kRecords: the producer writes a record as soon
  // as it has located the item, before waiting for its Q buffer, since the slot's previous
  // item (kRecords back) was read at its start, before its q_empty arrivals, which the
  // producer has waited for. Written with the Q copy instead, every field stayed live
  // across that wait, the producer (24 registers) spilled 80 bytes and fp8 lost 1.5 %.
  FwdBlock* const records = reinterpret_cast<FwdBlock*>(warp_valid);
  // Beside the records, each consumer warpgroup's tiles of item qi (warpgroup_tiles) at
  // wg_tiles_of(qi)[wg], located by the copying thread with
  // the record where warpgroups pass the tiles their rows do not see (kPassesTiles,
  // below).
  int* const record_tiles = reinterpret_cast<int*>(records + kRecords);
  auto wg_tiles_of = [&](int qi) { return record_tiles + (qi % kRecords) * kWgs; };
  static_assert(2 * kMaxQBuffers * (sizeof(FwdBlock) + kWgs * sizeof(int)) <=
                        size_t(valid_bytes(D)) &&
                    barrier_bytes(kEB) % alignof(FwdBlock) == 0 &&
                    sizeof(FwdBlock) % alignof(int) == 0,
                "the walk's item records exceed the valid-bytes slice");
  // The walks without ping-pong (three consumer warpgroups: bf16 d64's wide walk, fp8)
  // pass them; their consumers (160 registers) take their warpgroup's tiles from the
  // item's record. Computing the bound themselves, fp8 d128's spilled 220 bytes, 59 local
  // loads and stores in the tile loop (so fp8 d128 computed every tile); from the
  // record, the kernel spills 40 / 48 bytes (36 / 36 computing every tile), two local
  // loads in the consumers' tile loop.
  constexpr bool kPassesTiles = !ping_pong(kWgs, kEB);
  // Per Q buffer: q_full (its copy landed), q_empty (every consumer warp has written its
  // item's O out of it). Then per stage: full_k, full_v (the producer's copies landed),
  // empty_k, empty_v (both consumer warpgroups are done reading). K and V are released
  // apart: K_j once S_j is computed, a whole softmax and P V earlier than V_j, so that
  // the producer can land K_{j+2} while tile j + 1 is still being consumed. fp8: full_v
  // says the raw V tile landed (the producer's own wait), full_vt that its transpose is
  // written, and empty_v that the consumers are done with the V^T tile.
  // Stages and Q buffers are counted over the block's whole walk: tile g (the g-th the
  // block computes, across items) sits in stage g % ring, the i-th item's Q in buffer
  // i % kQBufs.
  // The producer hands each item to the other warps with its Q: the item's index in an
  // 8-byte slot a buffer (-1: the walk is over), written before q_full's arrival (a
  // release; the waits acquire), read by every thread before its own arrival on q_empty
  // (each thread's: so that compute-sanitizer's racecheck sees every read ordered before
  // the slot's next write; with one arrival a warp after __syncwarp it reported a
  // write-after-read hazard).
  auto q_full = [&](int qb) { return bars + 8u * uint32_t(qb); };
  auto q_empty = [&](int qb) { return bars + 8u * uint32_t(kMaxQBuffers + qb); };
  auto item_slot = [&](int qb) { return bars + 8u * uint32_t(2 * kMaxQBuffers + qb); };
  auto item_of = [&](int qb) {
    int item;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(item) : "r"(item_slot(qb)) : "memory");
    return item;
  };
  auto bar = [&](int kind, int st) {
    return bars + 8u * uint32_t(3 * kMaxQBuffers + kind * kMaxStages + st);
  };
  enum { kFullK, kFullV, kEmptyK, kEmptyV, kFullVt, kEmptyRaw };
  // the parity of use g of its stage (or buffer) in a ring of `ring`
  auto parity = [](int g, int ring) { return uint32_t(g / ring) & 1u; };
  if (threadIdx.x == 0) {
    for (int qb = 0; qb < kQBufs; ++qb) {
      sm90::mbar_init(q_full(qb));
      // one arrival a consumer thread (and fp8's transposing threads, once they have the
      // item)
      sm90::mbar_init(q_empty(qb), kConsumers + (kFp8 ? 32 * kTransposeWarps : 0));
    }
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

  // fp8: V tile j into V^T stage j % kStages by the producer's warps 1 .. 3, once the
  // copy has landed and the consumers have released that stage's previous V^T tile; the
  // stores are made visible to wgmma (the async proxy) before full_vt is signalled, and
  // the raw stage is handed back to the copying thread (empty_raw) after the named
  // barrier.
  // g: the tile's count in the block's walk; have: its keys inside the item's range.
  auto transpose_stage = [&](int g, int have) {
    if constexpr (kFp8) {
      const int st = g % kVtRing, raw = g % kVRing;
      sm90::mbar_wait(bar(kFullV, raw), parity(g, kVRing));
      if (g >= kVtRing) sm90::mbar_wait(bar(kEmptyV, st), parity(g - kVtRing, kVtRing));
      transpose_v_e4m3<D>(sV + raw * kKVBytes, sVt + st * kVtBytes, have, threadIdx.x - 32);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier(kProducerBarrier, 32 * kTransposeWarps);
      if (threadIdx.x == 32) {
        sm90::mbar_arrive(bar(kFullVt, st));
        sm90::mbar_arrive(bar(kEmptyRaw, raw));
      }
    }
  };

  // paged: the cache rows of a sequence's keys (sequence.cuh), pages checked against
  // the cache's blocks
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  if (threadIdx.x < 128) {
    // The producer. Coordinates are (column, head, row), innermost first; boxes past
    // the tensor's rows or head_dim read as zeros.
    sm90::regs_release<producer_regs(kWgs, kEB)>();
    // Tile g of the walk (its item's tile starting at key n0) into stage g % ring, each
    // tensor once the stage's previous tile (g - ring) has released it: its (g / ring -
    // 1)-th release. fp8's raw V stages are released by the transposing warps.
    auto load = [&](int g, int n0, int kind, uint32_t tiles_at, const sm90::TensorMap* map,
                    int hk, int64_t k_start, int64_t lane_row) {
      const int ring = kind == kFullV ? kVRing : kKRing, st = g % ring;
      if (g >= ring) {
        const int release = kFp8 && kind == kFullV ? kEmptyRaw : kind + 2;
        sm90::mbar_wait</*kParked=*/true>(bar(release, st), parity(g - ring, ring));
      }
      if (!paged) {
        sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
        for (int c = 0; c < kColBlocks; ++c) {
          sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes, map, bar(kind, st),
                            128 / kEB * c, hk, int(k_start + n0));
        }
        return;
      }
      // Paged (warp 0): lane i copies box i from the cache row it looked up (lane_row;
      // none: no page, or past the range) once lane 0 has announced the tile's bytes.
      if (threadIdx.x == 0) sm90::mbar_arrive_expect_tx(bar(kind, st), kKVBytes);
      __syncwarp();
      const int r = int(threadIdx.x) * a.kv_box_rows;
      if (r < kBlockN) {
        const int at = lane_row >= 0 ? int(lane_row) : int(p.total_k);  // past the rows: zeros
        for (int c = 0; c < kColBlocks; ++c) {
          sm90::tma_load_3d(tiles_at + st * kKVBytes + c * kKVBlockBytes + r * kRowBytes, map,
                            bar(kind, st), 128 / kEB * c, hk, at);
        }
      }
    };
    // Paged: the whole of warp 0 runs the copy loop, lane i looking box i's page up (K
    // and V share it) and issuing its copies. H100, d128, S=4096, causal, 16-row boxes:
    // lookups and copies in one thread 225 TFLOP/s, lookups by the lanes and copies in
    // one thread 263-268, both by the lanes 468 (64-row boxes 482-497).
    // The walk (warp 0 when paged, else thread 0): each item with rows to compute gets its
    // Q copied (also one whose rows see no key: its consumers stage their zeros in the
    // buffer) into buffer qi % kQBufs once that buffer's previous item has been written
    // out, then its K / V tiles; a padding item is handed over without a copy; past the
    // last item, -1.
    if (paged ? threadIdx.x < 32 : threadIdx.x == 0) {
      if (threadIdx.x == 0) {
        sm90::prefetch_tensor_map(&a.q_map);
        sm90::prefetch_tensor_map(&a.k_map);
        sm90::prefetch_tensor_map(&a.v_map);
      }
      // The item's index (or -1) into buffer qb's slot, then item blk's Q into the buffer
      // (thread 0; not where !work: no rows to compute, or past the last item).
      auto copy_q = [&](const FwdBlock& blk, int qb, bool work, int item) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(item_slot(qb)), "r"(item) : "memory");
        if (!work) {
          sm90::mbar_arrive(q_full(qb));
          return;
        }
        sm90::mbar_arrive_expect_tx(q_full(qb), kColBlocks * kQBlockBytes);
        for (int c = 0; c < kColBlocks; ++c) {
          sm90::tma_load_3d(sQ0 + qb * kQBytes + c * kQBlockBytes, &a.q_map, q_full(qb),
                            128 / kEB * c, blk.h, int(blk.s.q_start + blk.m0));
        }
      };
      // Item blk's K / V tiles, its first the walk's g-th; returns how many.
      auto copy_tiles = [&](const FwdBlock& blk, int g) {
        const KeyTiles kt = key_tiles(blk);
        for (int j = 0; j < kt.tiles; ++j) {
          const int n0 = kt.n_lo + j * kBlockN;
          int64_t lane_row = -1;
          if (paged) {
            const int key = n0 + int(threadIdx.x) * a.kv_box_rows;
            if (int(threadIdx.x) * a.kv_box_rows < kBlockN && key < kt.n_hi)
              lane_row = keys.row(blk.b, 0, key);
          }
          load(g + j, n0, kFullK, sK, &a.k_map, blk.hk, blk.s.k_start, lane_row);
          load(g + j, n0, kFullV, sV, &a.v_map, blk.hk, blk.s.k_start, lane_row);
        }
        return kt.tiles;
      };
      // The block's next item after `item` (thread 0 claims it; paged: the warp's lanes
      // share it).
      auto claim = [&](int item) {
        int next = 0;
        if (threadIdx.x == 0) {
          next = a.item_counter ? atomicAdd(a.item_counter, 1) + int(gridDim.x)
                                : item + int(gridDim.x);
        }
        if constexpr (paged) next = __shfl_sync(0xffffffffu, next, 0);
        return next;
      };
      FwdBlock blk;
      int g = 0;  // tiles so far
      for (int qi = 0, item = blockIdx.x;; ++qi) {
        bool work = false;
        while (item < a.items && !(work = locate(item, blk, 0, 0)) && !is_padding(item)) {
          item = claim(item);
        }
        const bool over = item >= a.items;
        const int qb = qi % kQBufs;
        if (work) {  // published by q_full's arrival (a release)
          records[qi % kRecords] = blk;
          if constexpr (kPassesTiles) {
            // warpgroup_tiles (fwd_sm90.cuh) from the item's key range: a warpgroup's
            // last key is its last row's (the block's first key is its first row's);
            // a count past the tiles its rows see is safe (they are masked). In the
            // copying thread's registers (fp8: 32) warpgroup_tiles itself spilled 44
            // bytes more.
            const KeyTiles kt = key_tiles(blk);
            const int rows = blk.s.num_q - blk.m0;
#pragma unroll
            for (int w = 0; w < kWgs; ++w) {
              int hi = blk.win.right < 0 ? kt.n_hi
                                          : int(min(int64_t(kt.n_hi),
                                                    int64_t(blk.m0) + min(rows, 64 * w + 64) +
                                                        blk.s.offset + blk.win.right));
              hi = rows > 64 * w ? hi : kt.n_lo;
              wg_tiles_of(qi)[w] = hi <= kt.n_lo ? 0 : (hi - kt.n_lo + kBlockN - 1) / kBlockN;
            }
          }
        }
        if (threadIdx.x == 0) {
          if (qi >= kQBufs)
            sm90::mbar_wait</*kParked=*/true>(q_empty(qb), parity(qi - kQBufs, kQBufs));
          copy_q(blk, qb, work, over ? -1 : item);
        }
        if (over) break;
        const int next = claim(item);  // in flight while this item's tiles are copied
        if (work) g += copy_tiles(blk, g);
        item = next;
      }
    } else if (kFp8 && threadIdx.x >= 32) {
      // fp8: warps 1 .. 3 transpose (warp 0's copying thread stays free to run ahead:
      // sharing the copies with a transposing thread held K's copy back a whole tile,
      // and the fp8 forward ran no faster than bf16's); each takes the items as the
      // consumers do.
      auto transpose_item = [&](const FwdBlock& blk, int g) {
        const KeyTiles kt = key_tiles(blk);
        for (int j = 0; j < kt.tiles; ++j) {
          transpose_stage(g + j, kt.n_hi - (kt.n_lo + j * kBlockN));
        }
        return kt.tiles;
      };
      FwdBlock blk;
      int g = 0;
      for (int qi = 0;; ++qi) {
        const int qb = qi % kQBufs;
        sm90::mbar_wait(q_full(qb), parity(qi, kQBufs));
        const int item = item_of(qb);
        // an item handed over has rows to compute unless it is the padding rows' (fp8
        // writes O from registers: the consumers zero those rows)
        const bool work = item >= 0 && !is_padding(item);
        if (work) blk = records[qi % kRecords];
        sm90::mbar_arrive(q_empty(qb));
        if (item < 0) break;
        if (work) g += transpose_item(blk, g);
      }
    }
  } else {
    sm90::regs_acquire<consumer_regs(kWgs, producer_regs(kWgs, kEB))>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. kConsumers - 1
    const int wg = sm90::warp_uniform(ct / 128), lane = ct % 32;

    // FA3's intra-warpgroup overlap: S_j's product runs while this warpgroup issues
    // P_{j-1} V_{j-1}; the softmax of S_j then runs while that P V is in flight, and O
    // is rescaled once it has landed.
    // With two 16-bit consumer warpgroups, FA3's ping-pong: they take turns issuing their
    // products (named barriers kTurnBarrier + wg: wait for one's turn, then hand it to
    // the other), so that one's products run while the other computes its softmax
    // instead of both contending for the tensor cores and then both leaving them idle.
    // Warpgroup 0 goes first, over the block's whole walk; it takes one more turn after
    // its last item, so that every hand-over is waited for.
    constexpr bool kPingPong = ping_pong(kWgs, kEB);  // 16-bit only (sm90_tiles.h)
    auto my_turn = [&] {
      if constexpr (kPingPong) sm90::named_barrier(kTurnBarrier + wg, 256);
    };
    // At d128 a warpgroup hands the turn over once S_j is issued, before P_{j-1} V_{j-1},
    // so that the other's S can queue behind this S rather than behind both products (the
    // walk's own clock: S_j landed 800 cycles after its issue at S=4096, its softmax
    // 1,378). H100, same runs, 3 rounds each: S = 4096 full +1.4 / +3.3 %, causal +3.5 %,
    // 8192 +2.4 %, 16384 +1.2 / +1.7 %, S = 512 .. 2048 -1.3 .. +2.1 % (within the
    // spread); at d64 as well, causal S = 512 lost 5.6 %, so d64 keeps both products in
    // its turn.
    constexpr bool kEarlyHandOver = D == 128;
    auto their_turn = [&] {
      if constexpr (kPingPong) sm90::named_arrive(kTurnBarrier + 1 - wg, 256);
    };
    if (wg == 1) their_turn();
    // Consumer warp's release of a K / V stage (its barrier `at`): after
    // __syncwarp, every lane's reads of it have completed.
    auto release = [&](uint32_t at) {
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(at);
    };

    // Item blk's rows, its Q in buffer qb, its first tile the walk's g0-th (own_tiles: its
    // warpgroup's tiles from the item's record, where warpgroups pass tiles); returns its
    // tiles.
    auto consume = [&](const FwdBlock& blk, int qb, int g0, int own_tiles) {
      const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd;
      const Sequence& s = blk.s;
      const Window& win = blk.win;
      const KeyTiles kt = key_tiles(blk);
      const int n_lo = kt.n_lo, n_hi = kt.n_hi, tiles = kt.tiles;
      const uint32_t sQ = sQ0 + qb * kQBytes;
      // The thread's indices, made anew each item (opaque to ptxas): else it computes the
      // addresses made from them once before the walk and holds them across the tile loop
      // (d256: 200 bytes of spill there). The warp's index through sm90::warp_uniform, so
      // that what is made of it (the products' descriptors) stays in uniform registers.
      int warp_id = ct / 32, ln = lane;
      asm volatile("" : "+r"(warp_id), "+r"(ln));
      warp_id = sm90::warp_uniform(warp_id);
      const int tid = warp_id * 32 + ln;
      const int row0 = warp_id / 4 * 64;  // the warpgroup's first row in the block
      const int warp = warp_id % 4, g = ln / 4, t = ln % 4;

      // The score transform in base 2, as flash_fwd_sm80 sets it up (TileSoftmax).
      const sm80::ScoreTransform sx =
          sm80::ScoreTransform::of(p, b, h, descale<T>(p.q_descale) * descale<T>(p.k_descale));
      const bool softcap = sx.softcap, prescale = sx.prescale;
      const float mul = sx.mul, cap = sx.cap, slope = sx.slope, exp_mul = sx.exp_mul;
      // Keys every row of the block sees, inside its range: tiles there need no mask.
      int full_lo, full_hi;
      win.keys_seen_by_all(m0, min(m0 + kBlockM, s.num_q) - 1, s.offset, s.num_k, &full_lo,
                           &full_hi);
      full_hi = min(full_hi, n_hi);

      float o[1][kDT][4] = {};  // rows g (elements 0, 1) and g + 8 (2, 3) of the warp's 16
      float m[1][2] = {{-XLA_ATTN_INF, -XLA_ATTN_INF}}, l[1][2] = {{0.f, 0.f}};
      float(&o_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(o);
      float sc[1][kNT][4];
      float(&s_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(sc);
      uint32_t pa[kPSteps][4];  // P of the previous tile, P V's A operand

      // S = Q K_j^T, issued once K_j has landed (issue_qk)
      auto issue_s = [&](int j) {
        const int st = (g0 + j) % kKRing;
        sm90::mbar_wait(bar(kFullK, st), parity(g0 + j, kKRing));
        issue_qk<T, D, kBlockM>(s_flat, sQ + row0 * kRowBytes, sK + st * kKVBytes);
      };
      // 16-bit: the last tile's V rows past the block's key range are zeroed before P V
      // reads them (they may hold the next sequence's keys or NaN padding, and 0 x NaN is
      // NaN): both consumer warpgroups read them, so all their threads write a share and
      // meet, outside their turns (ping-pong) since both must get here. fp8: the producer
      // zeroes those keys of the V^T tile.
      auto zero_v_tail = [&](int j) {
        const int st = (g0 + j) % kPvRing, n0 = n_lo + j * kBlockN;
        if (!kFp8 && n0 + kBlockN > n_hi) {
          const uint32_t tV = sV + st * kKVBytes;
          sm90::mbar_wait(bar(kFullV, st), parity(g0 + j, kVRing));
          const int have = n_hi - n0;
          for (int c = tid; c < kColBlocks * kBlockN * (kRowBytes / 16); c += kConsumers) {
            if ((c / (kRowBytes / 16)) % kBlockN >= have) {
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tV + 16u * uint32_t(c)),
                           "r"(0u)
                           : "memory");
            }
          }
          sm90::fence_proxy_async_shared();
          sm90::named_barrier_unaligned(1, kConsumers);  // reached from two loops
        }
      };
      // Tile j's P V operand, V_j (fp8: its V^T tile), waited for; its shared address
      auto pv_tile = [&](int j) {
        const int st = (g0 + j) % kPvRing;
        if constexpr (kFp8) {
          sm90::mbar_wait(bar(kFullVt, st), parity(g0 + j, kVtRing));
          return sVt + st * kVtBytes;
        } else {
          sm90::mbar_wait(bar(kFullV, st), parity(g0 + j, kVRing));
          return sV + st * kKVBytes;
        }
      };
      // O += P V_j, issued once V_j is there (issue_pv_on)
      auto issue_pv = [&](int j) { issue_pv_on<T, D>(o_flat, pa, pv_tile(j)); };
      // The online softmax of tile j's S (sm80::TileSoftmax), in place. O's rescale is
      // handed back (corr, rescale) for after the P V product in flight.
      float corr[1][2];
      bool rescale = false;
      // paged: whether lane i's box of tile j (keys i * kv_box_rows ..) has a page, looked
      // up as the tile starts (the table read in flight behind S's product); boxes past
      // the tile or the key range count as present (the range masks them).
      auto box_present = [&](int j) {
        const int r = lane * a.kv_box_rows, key = n_lo + j * kBlockN + r;
        return !paged || r >= kBlockN || key >= n_hi || keys.row(b, 0, key) >= 0;
      };
      // Where some box has none, the warp writes its keys' valid bytes (TileSoftmax's
      // valid[]; box_rows >= 8, so 4 adjacent keys share a box) in its own slice.
      unsigned char* const my_valid = warp_valid + (tid / 32) * kBlockN;
      // sm80::TileSoftmax for the tile whose first key is n0 (absent: some key has no page)
      auto tile_softmax = [&](int n0, bool absent) {
        return sm80::TileSoftmax{int64_t(m0) + row0 + warp * 16 + g + s.offset, n0, n_hi, t, win,
                                 mul, cap, exp_mul, slope / exp_mul, prescale,
                                 prescale || slope != 0.f, absent, my_valid};
      };
      auto softmax = [&](int j, bool present) {
        const int n0 = n_lo + j * kBlockN;
        const uint32_t boxes = paged ? __ballot_sync(0xffffffffu, present) : 0xffffffffu;
        const bool absent = boxes != 0xffffffffu;
        if (absent) {
          for (int x = 4 * lane; x < kBlockN; x += 128) {
            *reinterpret_cast<uint32_t*>(my_valid + x) =
                (boxes >> (x / a.kv_box_rows)) & 1u ? 0x01010101u : 0u;
          }
          __syncwarp();
        }
        const bool mask = (n0 < full_lo) | (n0 + kBlockN > full_hi) | absent;
        const sm80::TileSoftmax tsm = tile_softmax(n0, absent);
        rescale = false;
        auto defer = [&](const float (&c)[1][2]) {
          corr[0][0] = c[0][0];
          corr[0][1] = c[0][1];
          rescale = true;
        };
        if (!(mask | softcap)) {
          tsm.run_with<false, false>(sc, m, l, defer);
        } else if (!softcap) {
          tsm.run_with<true, false>(sc, m, l, defer);
        } else if (!mask) {
          tsm.run_with<false, true>(sc, m, l, defer);
        } else {
          tsm.run_with<true, true>(sc, m, l, defer);
        }
      };
      // The softmax against the running max as it stands (fwd_sm90.cuh, the same lambda).
      constexpr bool kAtMax = !paged && at_running_max(D, kEB);  // sm90_tiles.h
      auto softmax_at_max = [&](int j) {
        if constexpr (!kAtMax) {
          return 0;
        } else {
          if (j == 0 || softcap || prescale || slope != 0.f) return 0;
          const int n0 = n_lo + j * kBlockN;
          rescale = false;  // where it is not done, the whole softmax sets it
          return softmax_at_running_max(tile_softmax(n0, false),
                                        (n0 < full_lo) | (n0 + kBlockN > full_hi), sc, m, l, wg);
        }
      };
      // P rounded into P V's A fragments (round_p), once the previous P V has completed.
      auto to_p = [&] { round_p<T>(pa, sc); };

      auto rescale_o = [&] {  // O's deferred rescale (softmax), once no product writes O
        if (rescale) scale_o_rows(o, corr);
      };
      // The tiles this warpgroup computes (own_tiles, from the item's record), then the
      // rest passed (kPassesTiles): waited for and released, the last one's V tail zeroed
      // with the other warpgroups (they meet there). Not with ping-pong (every tile takes
      // turns). H100, same run, best of 3: fp8 d64 (the bound computed by the consumers)
      // causal S = 512 / 1024 / 2048 +3.4 / +13 / +4.7 %, full S = 512 / 2048 (no tile to
      // pass) -1.3 / -1.8 %; then with the bound from the record, fp8 d128 causal S = 512 /
      // 1024 / 2048 +7.1 / +14.2 / +5.4 %, full S = 512 -0.8 %; fp8 d64 causal S = 512 /
      // 1024 +2.3 / +2.0 %; bf16 d64 (three warpgroups) full S = 1024 +2.7 %, causal S =
      // 1024 / 2048 / 4096 +2.0 / -0.4 / +0.6 %.
      const int wg_tiles = kPassesTiles ? own_tiles : tiles;
      constexpr bool kOverlap = overlaps_products(kWgs, kEB, D, true);  // else tiles_in_turn
      if constexpr (!kOverlap) {
        tiles_in_turn(
            wg_tiles, s_flat, o_flat, issue_s, softmax_at_max,
            [&](int j) { softmax(j, box_present(j)); },
            [&](int j) { release(bar(kEmptyK, (g0 + j) % kKRing)); },
            [&](int) { rescale_o(); to_p(); }, [&](int j) { zero_v_tail(j); issue_pv(j); },
            [&](int j) { release(bar(kEmptyV, (g0 + j) % kPvRing)); });
      } else {
        if (wg_tiles > 0) {
          const bool present = box_present(0);
          my_turn();
          issue_s(0);
          their_turn();
          sm90::wgmma_wait<0>();
          sm90::wgmma_hold(s_flat);
          release(bar(kEmptyK, g0 % kKRing));
          softmax(0, present);  // O is still zero: nothing to rescale
          to_p();
        }
        for (int j = 1; j < wg_tiles; ++j) {
          const bool present = box_present(j);
          zero_v_tail(j - 1);
          my_turn();
          issue_s(j);
          if constexpr (kEarlyHandOver) their_turn();
          issue_pv(j - 1);
          if constexpr (!kEarlyHandOver) their_turn();
          sm90::wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
          sm90::wgmma_hold(s_flat);
          softmax_of_landed_s(
              j, s_flat, issue_s, softmax_at_max, [&](int j) { softmax(j, present); },
              [&](int j) { release(bar(kEmptyK, (g0 + j) % kKRing)); });
          sm90::wgmma_wait<0>();
          sm90::wgmma_hold(o_flat);
          release(bar(kEmptyV, (g0 + j - 1) % kPvRing));
          rescale_o();
          to_p();
        }
        if (wg_tiles > 0) {
          zero_v_tail(wg_tiles - 1);
          my_turn();
          issue_pv(wg_tiles - 1);
          their_turn();
          sm90::wgmma_wait<0>();
          sm90::wgmma_hold(o_flat);
          release(bar(kEmptyV, (g0 + wg_tiles - 1) % kPvRing));
        }
      }
      if constexpr (kPassesTiles) {
        for (int j = wg_tiles; j < tiles; ++j) {
          zero_v_tail(j);
          const int st = (g0 + j) % kKRing, sv = (g0 + j) % kPvRing;
          sm90::mbar_wait(bar(kFullK, st), parity(g0 + j, kKRing));
          release(bar(kEmptyK, st));
          pv_tile(j);
          release(bar(kEmptyV, sv));
        }
      }
      // Epilogue (finish_rows), then O written out (write_o_rows).
      finish_rows<T, D, kBlockM>(p, o, m, l, sQ, row0, warp, g, t, m0, s, h, hd);
      if constexpr (!kFp8) write_o_rows<T, D, kBlockM>(a, sQ, row0, m0, s, h, hd, tid % 128, wg);
      return tiles;
    };
    FwdBlock blk;
    int g0 = 0;  // tiles of the walk so far
    for (int qi = 0;; ++qi) {
      const int qb = qi % kQBufs;
      sm90::mbar_wait(q_full(qb), parity(qi, kQBufs));
      // read by every lane, made warp-uniform (as blockIdx is: the stage indices and
      // descriptors made from it stay uniform)
      const int item = sm90::warp_uniform(item_of(qb));
      if (item < 0) break;
      // an item handed over has rows to compute (located by the producer: its record)
      // unless it is the padding rows', which locate zeroes
      const bool work = is_padding(item) ? locate(item, blk, ct, kConsumers)
                                         : (blk = records[qi % kRecords], true);
      if (work) {
        const int own_tiles =
            kPassesTiles ? sm90::warp_uniform(wg_tiles_of(qi)[wg]) : 0;
        g0 = sm90::warp_uniform(g0 + consume(blk, qb, g0, own_tiles));
        // this warp's staging stores ordered before the copy engine's next writes to
        // the buffer (the async proxy)
        sm90::fence_proxy_async_shared();
      }
      sm90::mbar_arrive(q_empty(qb));  // the Q buffer (and slot) back to the producer
    }
    if (wg == 0) my_turn();  // warpgroup 1's last hand-over
  }
}

}  // namespace xla_attn
