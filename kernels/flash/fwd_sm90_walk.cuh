// Flash attention forward, sm90 family, as a persistent walk (fwd_sm90.cuh has the kernel
// this one walks with, one block an item): a grid of one block an SM, each block taking
// (row block, head, sequence) items (sm90_tiles.h, Args) as it finishes one. The producer
// claims the next item from a counter in the workspace and hands it to the other warps
// with its Q (two or three Q buffers: sm90_tiles.h, q_buffers), so that the next item's Q
// and first K / V tiles are copied during the current item's tiles and epilogue instead
// of after the block's start; each item is then computed as in flash_fwd_sm90.
//
// Its own kernel rather than a flag of flash_fwd_sm90: built from one source, the one
// block an item instances ran 3-6 % slower at d128 and d256 (H100, the same run; ptxas
// kept the item's coordinates out of uniform registers and scheduled the tile loop
// differently), so those keep their code unchanged and this one carries the walk. What
// a consumer does with an item is written once (fwd_sm90_consumer.cuh, consume_item),
// with both kernels' machine code unchanged.
// The launcher (launch.cc, sm90_tiles.h walks) takes it at d64 and d128 (fp8 up to 2048
// query rows), not paged.
#pragma once
#include "flash/fwd_sm90_consumer.cuh"

namespace xla_attn {

// The rowless warpgroup's pass over an item's `tiles` tiles (flash_fwd_sm90_walk,
// pass_rowless), out of line (__noinline__) so that the walk's other code, which ptxas
// schedules as one, stays as it was: inlined, the d128 walk's tile loop was scheduled
// anew. stage_bars: the walk's first K / V stage barrier, bar(0, 0) (kind k, stage st at
// + 8 (k kMaxStages + st), as the walk's bar has them).
template <int kKRing, int kVRing, int kColBlocks, int kBlockN, int kConsumers>
__device__ __noinline__ void pass_rowless_tiles(uint32_t stage_bars, uint32_t sV,
                                                uint32_t kv_bytes, int g0, int n_lo, int n_hi,
                                                int tiles, int ct, int my_bar, int their_bar) {
  using namespace flash_sm90;
  auto bar = [&](int kind, int st) { return stage_bars + 8u * uint32_t(kind * kMaxStages + st); };
  auto parity = [](int g, int ring) { return uint32_t(g / ring) & 1u; };
  const int lane = ct % 32;
  for (int j = 0; j < tiles; ++j) {
    const int g = g0 + j, sk = g % kKRing, sv = g % kVRing;
    sm90::named_barrier(my_bar, 256);
    sm90::named_arrive(their_bar, 256);
    sm90::mbar_wait(bar(kFullK, sk), parity(g, kKRing));
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bar(kEmptyK, sk));
    sm90::mbar_wait(bar(kFullV, sv), parity(g, kVRing));
    const int n0 = n_lo + j * kBlockN;
    if (n0 + kBlockN > n_hi) {
      zero_v_rows_past<kColBlocks, kBlockN, kConsumers>(sV + uint32_t(sv) * kv_bytes, n_hi - n0,
                                                        ct);
    }
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bar(kEmptyV, sv));
  }
  if (tiles > 0) {  // the last P V's turn
    sm90::named_barrier(my_bar, 256);
    sm90::named_arrive(their_bar, 256);
  }
}

// kPassRowless: the 16-bit d128 walk's instance for calls where a sequence's last row
// block may end in its first half (sm90_tiles.h, passes_rowless; pass_rowless below).
template <typename T, int D, int kWgs, bool kPassRowless = false>
__device__ void flash_fwd_sm90_walk(const flash_sm90::Args& a) {
  using namespace flash_sm90;
  using Tiles = FwdBlockTiles<T, D, kWgs>;  // shapes, rings, layout, producer (fwd_sm90_producer.cuh)
  constexpr int kBlockN = Tiles::kBlockN, kEB = Tiles::kEB, kConsumers = Tiles::kConsumers;
  constexpr bool kFp8 = Tiles::kFp8;
  static_assert(!kFp8 || ((D == 64 || D == 128) && kWgs == kFp8Wgs),
                "fp8: the d64 and d128 buckets, three consumers");
  constexpr int kQBufs = q_buffers(D, kWgs, kEB, true);
  constexpr int kRecords = 2 * kQBufs;  // item records (below)
  const xla_attn_flash_fwd_params& p = a.p;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr bool paged = false;  // the walk is not built for paged K/V
  // a sequence's partial row block first (sm90_tiles.h, partial_block_first)
  constexpr bool kPartialFirst = partial_block_first(kWgs, kEB, D, true);

  // Item `item` (Args) located in `blk`: true where it has rows to compute. `threads` of
  // the block's threads, this one `thread`, share the padding rows' item (0: none). The
  // last (head, sequence) pairs' items, enough for two a block (eight where sequence
  // lengths differ: a.tail_waves, launch.cc), come longest first across the pairs
  // (sequence.cuh, longest_first_tail): in plain order the last claims were the
  // last heads' long row blocks under a causal mask, and a list-scheduling model of the
  // bench's causal rows (tools/tail_model.py's, items of x + 1 tiles) finished 5.6-7.1 %
  // past the work's even spread at S = 2048 .. 8192, 1.1-1.7 % with the remap; H200, same
  // run: bf16 d64 causal +1..+5 %.
  auto locate = [&](int item, FwdBlock& blk, int thread, int threads) {
    int x = item % a.row_blocks, head = item / a.row_blocks % p.num_heads,
        seq = item / a.row_blocks / p.num_heads;
    longest_first_tail(p.batch, a.row_blocks, p.num_heads, int(gridDim.x), &x, &head, &seq,
                       a.tail_waves);
    return blk.at<typename Tiles::Out, kPartialFirst>(p, Tiles::kBlockM, a.row_blocks, x,
                                                      head, seq, thread, threads);
  };
  // The padding rows' items (sequence `batch`, one a head: their consumers zero the rows
  // past the last real sequence), which have no rows to compute but are walked. Only the
  // producer tests an item (a modulo and two divisions by run-time values); it hands a
  // padding item over as handed_over(item, false) (below).
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

  const typename Tiles::Smem sm = Tiles::layout(smem, kQBufs);
  // the barriers' start, a local of the lambdas below (read through sm there, the 16-bit
  // walks' machine code changed)
  const uint32_t bars = sm.bars;
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
  FwdBlock* const records = reinterpret_cast<FwdBlock*>(sm.warp_valid);
  // Beside the records, each consumer warpgroup's tiles of item qi (warpgroup_tiles) at
  // wg_tiles_of(qi)[wg], written by the copying thread with the record where warpgroups
  // pass the tiles their rows do not see (kPassesTiles, below).
  int* const record_tiles = reinterpret_cast<int*>(records + kRecords);
  auto wg_tiles_of = [&](int qi) { return record_tiles + (qi % kRecords) * kWgs; };
  static_assert(2 * kMaxQBuffers * (sizeof(FwdBlock) + kWgs * sizeof(int)) <=
                        size_t(valid_bytes(D, kEB)) &&
                    barrier_bytes(kEB) % alignof(FwdBlock) == 0 &&
                    sizeof(FwdBlock) % alignof(int) == 0,
                "the walk's item records exceed the valid-bytes slice");
  // The walks without ping-pong (three consumer warpgroups: bf16 d64's wide walk, fp8)
  // pass them; their consumers (160 registers) take their warpgroup's tiles from the
  // item's record. Computing the bound themselves, fp8 d128's spilled 220 bytes, 59 local
  // loads and stores in the tile loop (so fp8 d128 computed every tile); from the
  // record, the kernel spills 40 / 48 bytes (36 / 36 computing every tile), two local
  // loads in the consumers' tile loop.
  constexpr bool kPassesTiles = !ping_pong(kWgs, kEB, D);
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
  // The producer hands each item to the other warps with its Q: an int in an 8-byte slot a
  // buffer, the item's index where it has rows to compute, -2 - index for a padding item,
  // kWalkOver past the last (so that no other thread divides an index to tell: those
  // divisions, every consumer thread's once an item, were 2.2 % of the d64 causal S = 512
  // walk's executed instructions; ncu, H100, docs/benchmarks.md 2026-11-28 (38); the bf16
  // d128 walk, which gained nothing else, took -2.8 / -1.4 % kernel time at S = 512
  // causal / full and -0.9 % on the varlen row, base clock, one round (39)), written
  // before q_full's arrival (a release; the waits acquire), read by every thread before
  // its own arrival on q_empty
  // (each thread's: so that compute-sanitizer's racecheck sees every read ordered before
  // the slot's next write; with one arrival a warp after __syncwarp it reported a
  // write-after-read hazard).
  auto q_full = [&](int qb) { return bars + 8u * uint32_t(qb); };
  auto q_empty = [&](int qb) { return bars + 8u * uint32_t(kMaxQBuffers + qb); };
  auto item_slot = [&](int qb) { return bars + 8u * uint32_t(2 * kMaxQBuffers + qb); };
  constexpr int kWalkOver = -1;
  auto handed_over = [](int item, bool work) { return work ? item : -2 - item; };
  auto padding_item = [](int handed) { return -2 - handed; };
  auto item_of = [&](int qb) {
    int item;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(item) : "r"(item_slot(qb)) : "memory");
    return item;
  };
  auto bar = [&](int kind, int st) {
    return bars + 8u * uint32_t(3 * kMaxQBuffers + kind * kMaxStages + st);
  };
  // the parity of use g of its stage (or buffer) in a ring of `ring`
  auto parity = [](int g, int ring) { return uint32_t(g / ring) & 1u; };
  Tiles::init_barriers(
      [&] {
        for (int qb = 0; qb < kQBufs; ++qb) {
          sm90::mbar_init(q_full(qb));
          // one arrival a consumer thread (and fp8's transposing threads, once they have
          // the item)
          sm90::mbar_init(q_empty(qb), kConsumers + (kFp8 ? 32 * kTransposeWarps : 0));
        }
      },
      bar);

  // paged: the cache rows of a sequence's keys (sequence.cuh), pages checked against
  // the cache's blocks
  const KeyRows keys{p.block_table, p.max_blocks_per_seq, paged ? p.block_size : 1,
                     paged ? int(min(int64_t(p.num_blocks), p.total_k / p.block_size)) : 0};
  if (threadIdx.x < 128) {
    // The producer (FwdBlockTiles: copy_q, copy_kv, transpose_stage).
    sm90::regs_release<Tiles::kRegsProducer>();
    // The walk (warp 0 when paged, else thread 0): each item with rows to compute gets its
    // Q copied (also one whose rows see no key: its consumers stage their zeros in the
    // buffer) into buffer qi % kQBufs once that buffer's previous item has been written
    // out, then its K / V tiles; a padding item is handed over without a copy; past the
    // last item, kWalkOver.
    if (paged ? threadIdx.x < 32 : threadIdx.x == 0) {
      if (threadIdx.x == 0) {
        sm90::prefetch_tensor_map(&a.q_map);
        sm90::prefetch_tensor_map(&a.k_map);
        sm90::prefetch_tensor_map(&a.v_map);
      }
      // The item as handed over (or kWalkOver) into buffer qb's slot, then item blk's Q
      // into the buffer (thread 0; not where !work: no rows to compute, or past the last
      // item).
      auto copy_q = [&](const FwdBlock& blk, int qb, bool work, int item) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(item_slot(qb)), "r"(item) : "memory");
        if (!work) {
          sm90::mbar_arrive(q_full(qb));
          return;
        }
        Tiles::copy_q(a, sm, qb, q_full(qb), blk.h, blk.s.q_start + blk.m0);
      };
      // Item blk's K / V tiles j0 .. j1 - 1 (at most its tiles), its first the walk's g-th.
      auto copy_tiles = [&](const FwdBlock& blk, int g, int j0, int j1) {
        const KeyTiles kt = key_tiles(blk);
        for (int j = j0; j < min(j1, kt.tiles); ++j) {
          const int n0 = kt.n_lo + j * kBlockN;
          Tiles::template copy_kv<paged, /*kWalk=*/true>(
              a, keys, g + j, [&] { return n0; }, blk, sm, bar, parity);
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
      int g = 0;  // tiles so far
      int item = blockIdx.x;
      bool work = false, over = false;
      // Item qi (from `item`, past those without rows but the padding rows' items),
      // located straight into its record (read only where it has rows) and its Q copied
      // into buffer qi % kQBufs once that buffer's item has been written out (or handed
      // over without a copy: no rows, or kWalkOver past the last item).
      auto hand_out = [&](int qi) {
        FwdBlock& rec = records[qi % kRecords];
        work = false;
        while (item < a.items && !(work = locate(item, rec, 0, 0)) && !is_padding(item)) {
          item = claim(item);
        }
        over = item >= a.items;
        const int qb = qi % kQBufs;
        if (work) {  // published by q_full's arrival (a release)
          if constexpr (kPassesTiles) {
            // warpgroup_tiles (fwd_sm90_tile.cuh) from the item's key range: a warpgroup's
            // last key is its last row's (the block's first key is its first row's);
            // a count past the tiles its rows see is safe (they are masked). In the
            // copying thread's registers (fp8: 32) warpgroup_tiles itself spilled 44
            // bytes more.
            const KeyTiles kt = key_tiles(rec);
            const int rows =
                rows_end<kPartialFirst>(rec.m0, rec.s.num_q, Tiles::kBlockM) - rec.m0;
#pragma unroll
            for (int w = 0; w < kWgs; ++w) {
              int hi = rec.win.right < 0 ? kt.n_hi
                                          : int(min(int64_t(kt.n_hi),
                                                    int64_t(rec.m0) + min(rows, 64 * w + 64) +
                                                        rec.s.offset + rec.win.right));
              hi = rows > 64 * w ? hi : kt.n_lo;
              wg_tiles_of(qi)[w] = hi <= kt.n_lo ? 0 : (hi - kt.n_lo + kBlockN - 1) / kBlockN;
            }
          }
        }
        if (threadIdx.x == 0) {
          if (qi >= kQBufs)
            sm90::mbar_wait</*kParked=*/true>(q_empty(qb), parity(qi - kQBufs, kQBufs));
          copy_q(rec, qb, work, over ? kWalkOver : handed_over(item, work));
        }
      };
      // Item qi + 1 is handed out after item qi's first kEarlyQTiles K / V tiles rather
      // than after its last, and its tiles after item qi's last: its Q is copied (once
      // its buffer is free) while item qi runs, however many tiles item qi has. Against
      // the hand-out after the last tile (H200, kernel time at the base clock, two runs):
      // d128 +1.0..+2.3 % (causal S = 512 -0.5..+0.3 %), the varlen row (d128 causal)
      // +4.2..+4.6 %, d64 full 1024 +1.1 %, fp8 d128 +0.5 %. The d64 ping-pong walk
      // (then causal S <= 512, now <= 256: wide_d64) lost 0.7..1.3 % at causal S = 512
      // (three runs) and keeps the late hand-out. After the first tile instead of two:
      // d128 full S = 512 / 1024 -2.6 / -1.8 %; after three: -0.4 % / 0.0, the varlen row
      // -1.3 % (docs/benchmarks.md 2026-11-29 (52)).
      constexpr int kEarlyQTiles = D == 64 && !kPassesTiles ? 1 << 30 : 2;
      hand_out(0);
      for (int qi = 0; !over; ++qi) {
        const bool cur_work = work;
        FwdBlock blk;
        if (cur_work) blk = records[qi % kRecords];
        item = claim(item);  // in flight while this item's first tiles are copied
        if (cur_work) copy_tiles(blk, g, 0, kEarlyQTiles);
        hand_out(qi + 1);
        if (cur_work) g += copy_tiles(blk, g, kEarlyQTiles, 1 << 30);
      }
    } else if (kFp8 && threadIdx.x >= 32) {
      // fp8: warps 1 .. 3 transpose (warp 0's copying thread stays free to run ahead:
      // sharing the copies with a transposing thread held K's copy back a whole tile,
      // and the fp8 forward ran no faster than bf16's); each takes the items as the
      // consumers do.
      auto transpose_item = [&](const FwdBlock& blk, int g) {
        const KeyTiles kt = key_tiles(blk);
        for (int j = 0; j < kt.tiles; ++j) {
          const int have = kt.n_hi - (kt.n_lo + j * kBlockN);
          Tiles::transpose_stage(g + j, [&] { return have; }, sm, bar, parity);
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
        const bool work = item >= 0;
        if (work) blk = records[qi % kRecords];
        sm90::mbar_arrive(q_empty(qb));
        if (item == kWalkOver) break;
        if (work) g += transpose_item(blk, g);
      }
    }
  } else {
    sm90::regs_acquire<Tiles::kRegsConsumer>();
    const int ct = threadIdx.x - 128;  // consumer thread 0 .. kConsumers - 1
    const int wg = sm90::warp_uniform(ct / 128), lane = ct % 32;

    // With two 16-bit consumer warpgroups, FA3's ping-pong (flash_fwd_sm90 has the why):
    // they take turns issuing their products (named barriers kTurnBarrier + wg).
    // Warpgroup 0 goes first, over the block's whole walk; it takes one more turn after
    // its last item, so that every hand-over is waited for (an item's last included:
    // `last` is for one item a block).
    // Three take turns in a ring (sm90_tiles.h, turn_ring): wg hands over to wg + 1.
    constexpr bool kPingPong = ping_pong(kWgs, kEB, D);  // 16-bit (sm90_tiles.h)
    constexpr bool kRing = turn_ring(kWgs, kEB, D, /*walk=*/true, paged);
    auto my_turn = [&] {
      if constexpr (kPingPong || kRing) sm90::named_barrier(kTurnBarrier + wg, 256);
    };
    auto their_turn = [&](bool /*last*/ = false) {
      if constexpr (kPingPong) sm90::named_arrive(kTurnBarrier + 1 - wg, 256);
      if constexpr (kRing) sm90::named_arrive(kTurnBarrier + (wg + 1) % kWgs, 256);
    };
    if (wg == kWgs - 1) their_turn();

    // Where sm90_tiles.h's defers_o_store_read says so (the d128 walk), each warpgroup's
    // copying thread (write_o_rows) leaves its item's O store in flight: it waits for the
    // copy engine's read of the Q buffer, and only then hands the buffer back (its q_empty
    // arrival), in the next item once that item's first product is issued (consume_item:
    // before its epilogue where it issues none; past the walk, before the block exits),
    // so that the wait no longer holds its warp, and with it the warpgroup's next
    // products, at the item boundary. Once for every item after the first: item qi - 1's
    // buffer, which the producer needs back only for item qi + 1's Q, copied after every
    // K / V tile of item qi (so a second Q buffer is what keeps this from waiting on
    // itself).
    constexpr bool kDefersStoreRead = defers_o_store_read(kWgs, kEB, D, true);
    static_assert(!kDefersStoreRead || kQBufs >= 2,
                  "the O store's read is waited for in the next item, whose Q needs its own "
                  "buffer");
    const bool store_thread = kDefersStoreRead && ct % 128 == 0;
    auto settle_o_store = [&](int qi) {
      if (store_thread && qi > 0) {
        sm90::bulk_wait<0, /*kRead=*/true>();
        sm90::mbar_arrive(q_empty((qi - 1) % kQBufs));
      }
    };
    // Item blk's rows, its Q in buffer qb, its first tile the walk's g0-th (own_tiles: its
    // warpgroup's tiles from the item's record, where warpgroups pass tiles); returns its
    // tiles.
    auto consume = [&](const FwdBlock& blk, int qi, int qb, int g0, int own_tiles) {
      const KeyTiles kt = key_tiles(blk);
      // The thread's indices, made anew each item (opaque to ptxas): else it computes the
      // addresses made from them once before the walk and holds them across the tile loop
      // (d256: 200 bytes of spill there). The warp's index through sm90::warp_uniform, so
      // that what is made of it (the products' descriptors) stays in uniform registers.
      int warp_id = ct / 32, ln = lane;
      asm volatile("" : "+r"(warp_id), "+r"(ln));
      warp_id = sm90::warp_uniform(warp_id);
      const int tid = warp_id * 32 + ln;
      const int row0 = warp_id / 4 * 64;  // the warpgroup's first row in the block
      consume_item<T, D, kWgs, paged, /*kWalk=*/true, /*kVtGiven=*/false>(
          a, blk, kt.n_lo, kt.n_hi, kt.tiles, keys,
          ConsumerSmem{sm.sQ + qb * Tiles::kQBytes, sm.sK, sm.sV, sm.sVt, sm.warp_valid},
          /*q_full=*/0u, g0,
          own_tiles, ConsumerThread{tid, lane, wg, row0, warp_id % 4, ln / 4, ln % 4}, bar,
          parity, my_turn, their_turn, [&] { settle_o_store(qi); });
      return kt.tiles;
    };
    // Warpgroup 1 of an item without a row of its own (a sequence's last row block,
    // ending in its first half; about 5 % of the varlen row's warpgroup tiles), in the
    // kPassRowless instance (16-bit d128): it computes no tile. It settles the previous
    // item's O store, then takes the item's tiles + 1 turns empty, in warpgroup 0's
    // alternation, releasing each K / V stage and zeroing its share of the last V tile's
    // rows past the keys (meeting warpgroup 0 there before the last turn, as consume_item's
    // order has it), and writes nothing. Not in consume_item, and in an instance of its
    // own: every change to the walk's code moved ptxas's schedule of its tile loop (section
    // (47)'s form inside consume_item: varlen +1.6 %, d128 causal 512 -2.0 %; out of line in
    // the one walk: varlen +1.4 %, dense d128 -0.3..-0.8 %; docs/benchmarks.md (56)).
    static_assert(!kPassRowless || (kPingPong && D == 128 && !kFp8),
                  "the rowless pass is the 16-bit d128 ping-pong walk's");
    auto pass_rowless = [&](const FwdBlock& blk, int qi, int g0) {
      const KeyTiles kt = key_tiles(blk);
      settle_o_store(qi);
      pass_rowless_tiles<Tiles::kKRing, Tiles::kVRing, Tiles::kColBlocks, kBlockN, kConsumers>(
          bar(0, 0), sm.sV, Tiles::kKVBytes, g0, kt.n_lo, kt.n_hi, kt.tiles, ct,
          kTurnBarrier + wg, kTurnBarrier + 1 - wg);
      return kt.tiles;
    };
    FwdBlock blk;
    int g0 = 0;  // tiles of the walk so far
    for (int qi = 0;; ++qi) {
      const int qb = qi % kQBufs;
      sm90::mbar_wait(q_full(qb), parity(qi, kQBufs));
      // read by every lane, made warp-uniform (as blockIdx is: the stage indices and
      // descriptors made from it stay uniform)
      const int item = sm90::warp_uniform(item_of(qb));
      if (item == kWalkOver) {
        settle_o_store(qi);  // the block's shared memory outlives the copy engine's read
        break;
      }
      // an item handed over has rows to compute (located by the producer: its record)
      // unless it is the padding rows', which locate zeroes
      const bool work = item < 0 ? locate(padding_item(item), blk, ct, kConsumers)
                                 : (blk = records[qi % kRecords], true);
      if (work) {
        const int own_tiles =
            kPassesTiles ? sm90::warp_uniform(wg_tiles_of(qi)[wg]) : 0;
        if constexpr (kPassRowless) {
          const bool pass = wg == 1 && blk.m0 + 64 >= blk.s.num_q;
          g0 = sm90::warp_uniform(
              g0 + (pass ? pass_rowless(blk, qi, g0) : consume(blk, qi, qb, g0, own_tiles)));
        } else {
          g0 = sm90::warp_uniform(g0 + consume(blk, qi, qb, g0, own_tiles));
        }
        // this warp's staging stores ordered before the copy engine's next writes to
        // the buffer (the async proxy)
        sm90::fence_proxy_async_shared();
      }
      if (!work) settle_o_store(qi);  // (else consume_item did)
      // the Q buffer (and slot) back to the producer; the copying thread's in the next item
      if (!store_thread) sm90::mbar_arrive(q_empty(qb));
    }
    if (wg == 0) my_turn();  // the last warpgroup's last hand-over
  }
}

}  // namespace xla_attn
