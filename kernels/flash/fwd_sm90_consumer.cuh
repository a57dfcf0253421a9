// The sm90 forward's consumers (fwd_sm90.cuh has the kernel and the family's
// structure): a consumer thread's share of one item, consume_item, written once for
// both forward kernels (one item a block and the walk, fwd_sm90_walk.cuh).
#pragma once
#include "flash/fwd_sm90_producer.cuh"

namespace xla_attn {
namespace flash_sm90 {

// A consumer thread's indices (consume_item): tid among the consumer threads (0 ..
// 128 kWgs - 1), its lane, its warpgroup wg, the warpgroup's first row in the block row0,
// its warp in the warpgroup, and g = lane / 4, t = lane % 4 (its rows and column pair
// in the mma fragments).
struct ConsumerThread {
  int tid, lane, wg, row0, warp, g, t;
};

// The shared memory a consumer reads (consume_item): the item's Q buffer, the K, V and
// fp8 V^T rings (sm90_tiles.h), paged: each consumer warp's valid bytes.
struct ConsumerSmem {
  uint32_t sQ, sK, sV, sVt;
  unsigned char* warp_valid;
};

// A consumer thread's share of one item (blk, its keys [n_lo, n_hi) in `tiles` tiles):
// its products, softmax, epilogue and O written out, one source for flash_fwd_sm90 (one
// item a block; kWalk false) and flash_fwd_sm90_walk (its consume; kWalk). Both kernels'
// machine code is what it was when each wrote this out itself (SASS compared kernel by
// kernel; one kernel with a run-time walk ran 3-6 % slower, fwd_sm90_walk.cuh): the few
// kWalk branches below keep each kernel's own order where the other changed ptxas's. Tile
// j sits in stage (g0 + j) % ring (g0: the walk's tiles before the item; 0 for one item a
// block); bar(kind, st) and parity(g, ring) are the kernel's barriers; my_turn() and
// their_turn(last) its ping-pong turns (last: the item's last hand-over). One item a
// block, the consumers wait for Q here (q_full) and warpgroup 1 makes its first hand-over
// here; the walk waits for each item's Q before and makes that hand-over once, before the
// walk. own_tiles (the walk, where warpgroups pass tiles): the warpgroup's tiles from the
// item's record. settle_o_store(): run once, behind the item's first product (before the
// epilogue where there is none), where the walk waits for the previous item's O store
// (sm90_tiles.h, defers_o_store_read); one item a block passes a no-op.
template <typename T, int D, int kWgs, bool kPaged, bool kWalk, bool kVtGiven, typename Bar,
          typename Parity, typename MyTurn, typename TheirTurn, typename Settle>
__device__ __forceinline__ void consume_item(const Args& a, const FwdBlock& blk, int n_lo,
                                             int n_hi, int tiles, const KeyRows& keys,
                                             const ConsumerSmem& sm, uint32_t q_full, int g0,
                                             int own_tiles, const ConsumerThread& th, Bar&& bar,
                                             Parity&& parity, MyTurn&& my_turn,
                                             TheirTurn&& their_turn, Settle&& settle_o_store) {
  // the kernels' tile shapes and rings (FwdBlockTiles, fwd_sm90_producer.cuh)
  using Tiles = FwdBlockTiles<T, D, kWgs, kVtGiven>;
  constexpr int kBlockN = Tiles::kBlockN, kBlockM = Tiles::kBlockM;
  constexpr int kConsumers = Tiles::kConsumers, kEB = Tiles::kEB;
  constexpr bool kFp8 = Tiles::kFp8;
  constexpr int kPSteps = kBlockN * kEB / 32;  // P V k-steps (16 keys, fp8 32)
  constexpr int kNT = kBlockN / 8;    // n8 tiles of S
  constexpr int kDT = D / 8;          // n8 tiles of O
  constexpr uint32_t kKVBytes = Tiles::kKVBytes, kVtBytes = Tiles::kVtBytes;
  constexpr int kColBlocks = Tiles::kColBlocks;
  constexpr int kKRing = Tiles::kKRing, kVRing = Tiles::kVRing, kVtRing = Tiles::kVtRing,
                kPvRing = Tiles::kPvRing;
  constexpr bool paged = kPaged;
  const xla_attn_flash_fwd_params& p = a.p;
  const int h = blk.h, b = blk.b, m0 = blk.m0, hd = blk.hd;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const int tid = th.tid, lane = th.lane, wg = th.wg, row0 = th.row0, warp = th.warp,
            g = th.g, t = th.t;
  const uint32_t sQ = sm.sQ, sK = sm.sK, sV = sm.sV, sVt = sm.sVt;

  // The score transform in base 2, as flash_fwd_sm80 sets it up (TileSoftmax).
  const sm80::ScoreTransform sx =
      sm80::ScoreTransform::of(p, b, h, descale<T>(p.q_descale) * descale<T>(p.k_descale));
  const bool softcap = sx.softcap, prescale = sx.prescale;
  const float mul = sx.mul, cap = sx.cap, slope = sx.slope, exp_mul = sx.exp_mul;
  // Where a sequence's partial row block comes first (sm90_tiles.h, partial_block_first),
  // a block's rows end at rows_end (the first block's rows past it are the next block's,
  // computed and not written), else at the sequence's end.
  constexpr bool kPartialFirst = partial_block_first(kWgs, kEB, D, kWalk);
  // Keys every row of the block sees, inside its range: tiles there need no mask.
  int full_lo, full_hi;
  win.keys_seen_by_all(m0, min(m0 + kBlockM, rows_end<kPartialFirst>(m0, s.num_q, kBlockM)) - 1,
                       s.offset, s.num_k, &full_lo, &full_hi);
  full_hi = min(full_hi, n_hi);

  // O: rows g (elements 0, 1) and g + 8 (2, 3) of the warp's 16. Where the item's first
  // P V writes it (sm90_tiles.h, first_pv_writes_o), not zeroed here: a warpgroup without
  // a tile zeroes it before its epilogue.
  constexpr bool kFirstPvWritesO = first_pv_writes_o(D);
  float o[1][kDT][4];
  if constexpr (!kFirstPvWritesO) {
#pragma unroll
    for (int x = 0; x < kDT; ++x) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[0][x][i] = 0.f;
    }
  }
  float m[1][2] = {{-XLA_ATTN_INF, -XLA_ATTN_INF}}, l[1][2] = {{0.f, 0.f}};
  float(&o_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(o);
  float sc[1][kNT][4];
  float(&s_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(sc);
  uint32_t pa[kPSteps][4];  // P of the previous tile, P V's A operand
  // Tile j's V stage and phase (fp8: its V^T tile's) are (g0 + j) % kPvRing and
  // parity(g0 + j, kPvRing). The 16-bit kernels carry them from tile to tile (v_stage,
  // v_phase, advanced as each V tile is released: release_v) rather than dividing by the
  // ring (3 stages: a division by 3) at each use; H200, kernel time at the base clock,
  // against dividing: d128 S = 512 / 1024 / 8192 full +1.2 / +1.3 / +2.2 %, 512 causal
  // +1.1 %, varlen +1.2 %, d64 512 causal +1.2 %, 2048 full -0.9 %. Not fp8, whose
  // spills grew with it (d256 32 / 60 -> 40 / 88 bytes) and which ran 0.994-0.998
  // (docs/benchmarks.md, 2026-11-29 (49)).
  constexpr bool kCarryV = !kFp8;
  static_assert(kFp8 ? kPvRing == kVtRing : kPvRing == kVRing, "the V stages P V reads");
  int v_stage = g0 % kPvRing;
  uint32_t v_phase = parity(g0, kPvRing);
  auto v_stage_of = [&](int j) { return kCarryV ? v_stage : (g0 + j) % kPvRing; };
  auto v_phase_of = [&](int j) { return kCarryV ? v_phase : parity(g0 + j, kPvRing); };
  // Consumer warp's release of stage st's K or V (after __syncwarp, every lane's reads
  // of the product that used it have completed). The walk makes the barrier's address
  // before the __syncwarp, one item a block after it: the same work, but the other
  // order changed ptxas's schedule (the d64 paged and three-consumer walk kernels).
  auto release = [&](int kind, int st) {
    if constexpr (kWalk) {
      const uint32_t at = bar(kind, st);
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(at);
    } else {
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bar(kind, st));
    }
  };

  // V stage st (v_stage_of(j)) released once P V_j has completed, and with kCarryV the
  // next tile's stage and phase made
  auto release_v = [&](int st) {
    release(kEmptyV, st);
    if constexpr (kCarryV) {
      if (++v_stage == kPvRing) {
        v_stage = 0;
        v_phase ^= 1u;
      }
    }
  };
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
    const int st = v_stage_of(j), n0 = n_lo + j * kBlockN;
    if (!kFp8 && n0 + kBlockN > n_hi) {
      const uint32_t tV = sV + st * kKVBytes;
      sm90::mbar_wait(bar(kFullV, st), v_phase_of(j));
      zero_v_rows_past<kColBlocks, kBlockN, kConsumers>(tV, n_hi - n0, tid);
    }
  };
  // Tile j's P V operand, V_j (fp8: its V^T tile), waited for; its shared address
  auto pv_tile = [&](int j) {
    const int st = v_stage_of(j);
    if constexpr (kFp8) {
      sm90::mbar_wait(bar(kFullVt, st), v_phase_of(j));
      return sVt + st * kVtBytes;
    } else {
      sm90::mbar_wait(bar(kFullV, st), v_phase_of(j));
      return sV + st * kKVBytes;
    }
  };
  // O += P V_j (first_pv_writes_o: j = 0 writes O), issued once V_j is there (issue_pv_on)
  auto issue_pv = [&](int j) { issue_pv_on<T, D>(o_flat, pa, pv_tile(j), j > 0); };
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
  unsigned char* const my_valid = sm.warp_valid + (tid / 32) * kBlockN;
  // sm80::TileSoftmax for the tile whose first key is n0 (absent: some key has no page)
  auto tile_softmax = [&](int n0, bool absent) {
    return sm80::TileSoftmax{int64_t(m0) + row0 + warp * 16 + g + s.offset, n0, n_hi, t, win,
                             mul, cap, exp_mul, slope / exp_mul, prescale,
                             prescale || slope != 0.f, absent, my_valid};
  };
  // A masked tile's warps skip the exponentials of its second half where none of their
  // rows sees a key there (TileSoftmax::warp_sees_first_half): a causal block's diagonal
  // tile in the first warpgroup, with 192-row blocks also the next tile in the third.
  // Where three consumer warpgroups share the exponential unit and the tensor cores
  // (128-key tiles): 16-bit d64's m192 kernels and fp8 d128. H100, against main, best of 3
  // and 4 rounds in two runs: bf16 d64 causal S = 1024 / 2048 / 4096 / 16384 +1.9..+2.4 /
  // +2.9 / +2.8..+3.8 / +1.9 %, fp8 d128 causal 512 / 1024 / 2048 +1.8..+2.1 / +0.4 /
  // +2.2..+3.1 %; but rows without a masked tile gained about as much (bf16 d64 full 1024
  // / 4096 +1.9..+2.2 / +3.0 %, fp8 d128 full 2048 +1.8 %), so most of it is the machine
  // code ptxas made of these kernels with the branch, not the exponentials skipped. Not
  // fp8 d64 (causal 512 / 1024 -4.4 / -0.8 %) nor ping-pong's two warpgroups (16-bit d64
  // causal up to 512 rows, d128; best of 2: d64 causal 512 -6.5 %, d128 causal 512 / 1024
  // -4.1 / -2.7 %, varlen -3.1 %). docs/benchmarks.md, 2026-11-27 (35).
  constexpr bool kSkipHalf = kBlockN == 128 && kWgs == 3 && (kFp8 ? D == 128 : D == 64);
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
    // Softcap in a pass of its own behind one uniform branch, then run_with without it
    // (softcap has no prescale, so the operations and their order are run_with<mask,
    // true>'s): two forms of run_with at each of the softmax's call sites instead of
    // four. sm_90a bf16 walks (sass_report): d128 10,184 -> 7,872 instructions, d64
    // 9,776 -> 7,472, d64 three-warpgroup 10,328 -> 7,512 (spills 120 / 192 -> 100 /
    // 124 bytes); fp8 d256 spills 92 / 256 -> 32 / 60. Time unchanged: H200, kernel time
    // at the base clock, 23 configs in two runs, 0.983..1.014 of before, inside the
    // spread; so the walk's size does not limit it (ncu: no-instruction stalls 0.41 ->
    // 0.38 per issued instruction, d128 S = 512). docs/benchmarks.md 2026-11-29 (42).
    if (softcap) tsm.transform_scores<true>(sc);
    if (!mask) {
      tsm.run_with<false, false>(sc, m, l, defer);
    } else {
      tsm.run_with<true, false, kSkipHalf>(sc, m, l, defer);
    }
  };
  // The softmax against the running max as it stands (softmax_of_landed_s; TileSoftmax::
  // exps_at_max) where it pays (sm90_tiles.h, at_running_max): not on an item's first
  // tile (no max yet) nor with softcap, ALiBi, a score factor <= 0 or paged K/V; the
  // warpgroup agrees on the outcome (a barrier with a vote), since S is computed again
  // by all of it.
  constexpr bool kAtMax = !paged && at_running_max(D, kEB);  // sm90_tiles.h
  auto softmax_at_max = [&](int j) {
    if constexpr (!kAtMax) {
      return 0;
    } else {
      if (j == 0 || softcap || prescale || slope != 0.f) return 0;
      const int n0 = n_lo + j * kBlockN;
      rescale = false;  // where it is not done, the whole softmax sets it
      return softmax_at_running_max<kSkipHalf>(tile_softmax(n0, false),
                                    (n0 < full_lo) | (n0 + kBlockN > full_hi), sc, m, l, wg);
    }
  };
  // P rounded into P V's A fragments (round_p), once the previous P V has completed.
  auto to_p = [&] { round_p<T>(pa, sc); };
  // O's deferred rescale (softmax), once no product is writing O
  auto rescale_o = [&] {
    if (rescale) scale_o_rows(o, corr);
  };

  // FA3's intra-warpgroup overlap: S_j's product runs while this warpgroup issues
  // P_{j-1} V_{j-1}; the softmax of S_j then runs while that P V is in flight, and O
  // is rescaled once it has landed (with ping-pong, products issued in the warpgroup's
  // turn: my_turn, their_turn).
  // The walk at d128 hands the turn over once S_j is issued, before P_{j-1} V_{j-1}, so
  // that the other's S can queue behind this S rather than behind both products (the
  // walk's own clock: S_j landed 800 cycles after its issue at S=4096, its softmax
  // 1,378). H100, same runs, 3 rounds each: S = 4096 full +1.4 / +3.3 %, causal +3.5 %,
  // 8192 +2.4 %, 16384 +1.2 / +1.7 %, S = 512 .. 2048 -1.3 .. +2.1 % (within the
  // spread); at d64 as well, causal S = 512 lost 5.6 %, so d64 keeps both products in
  // its turn (its three warpgroups' ring too: against handing over after both, H100, best
  // of 2 rounds, full S = 512 / 1024 / 2048 -2.8 / -2.7 / -3.0 %, causal 1024 / 4096
  // -3.3 / -3.8 %, varlen -4.2 %).
  constexpr bool kEarlyHandOver = kWalk && D == 128;
  // The tiles this warpgroup computes (warpgroup_tiles; the walk: own_tiles, from the
  // item's record), then the rest passed: waited for and released, the last one's V tail
  // zeroed with the other warpgroups (they meet there). Not with ping-pong (every tile
  // takes turns). fp8 here (past its walk's rows) too: its tile loop holds 9 local loads
  // / stores against 12 without. The walk, H100, same run, best of 3: fp8 d64 (the bound
  // computed by the consumers) causal S = 512 / 1024 / 2048 +3.4 / +13 / +4.7 %, full S =
  // 512 / 2048 (no tile to pass) -1.3 / -1.8 %; then with the bound from the record, fp8
  // d128 causal S = 512 / 1024 / 2048 +7.1 / +14.2 / +5.4 %, full S = 512 -0.8 %; fp8 d64
  // causal S = 512 / 1024 +2.3 / +2.0 %; bf16 d64 (three warpgroups) full S = 1024 +2.7 %,
  // causal S = 1024 / 2048 / 4096 +2.0 / -0.4 / +0.6 %.
  constexpr bool kPassesTiles = !ping_pong(kWgs, kEB, D);
  const int wg_tiles =
      !kPassesTiles ? tiles
      : kWalk       ? own_tiles
                    : warpgroup_tiles<kBlockN>(win, s, m0 + row0, n_lo, tiles);
  constexpr bool kOverlap = overlaps_products(kWgs, kEB, D, kWalk, kPaged);  // else tiles_in_turn
  // three warpgroups' turns in a ring (sm90_tiles.h, turn_ring): tiles_in_turn's hooks,
  // or the overlapped tiles' hand-overs below (hand_over)
  constexpr bool kRing = turn_ring(kWgs, kEB, D, kWalk, kPaged);
  // the ring's turns: the item's tiles + 1 for every warpgroup (one block an item skips
  // the last warpgroup's last hand-over: their_turn(last))
  int turns = 0;
  auto ring_turn = [&] {
    if constexpr (kRing) their_turn(++turns == tiles + 1);
  };
  // the overlapped tiles' hand-over: ping-pong's, or a counted turn of the ring
  auto hand_over = [&](bool last = false) {
    if constexpr (kRing) {
      ring_turn();
    } else {
      their_turn(last);
    }
  };
  // The ring's start: one item a block, the last warpgroup hands the first turn to
  // warpgroup 0 (the walk does so once, before the walk); a warpgroup without a tile
  // takes the item's first turn empty.
  auto ring_first_hand_over = [&] {
    if constexpr (kRing) {
      if (wg == kWgs - 1) their_turn();
    }
  };
  auto ring_empty_first_turn = [&] {
    if constexpr (kRing) {
      if (wg_tiles <= 0 && tiles > 0) {
        my_turn();
        ring_turn();
      }
    }
  };
  if constexpr (!kOverlap) {
    if (!kWalk && tiles > 0) {  // (the walk waits for Q and hands over once, before)
      sm90::mbar_wait(q_full, 0u);
      ring_first_hand_over();
    }
    tiles_in_turn(
        wg_tiles, s_flat, o_flat, issue_s, softmax_at_max,
        [&](int j) { softmax(j, box_present(j)); },
        [&](int j) { release(kEmptyK, (g0 + j) % kKRing); }, [&](int) { rescale_o(); to_p(); },
        [&](int j) { zero_v_tail(j); issue_pv(j); },
        [&](int j) { release_v(v_stage_of(j)); },
        [&] {
          if constexpr (kRing) my_turn();
        },
        ring_turn);
    ring_empty_first_turn();  // after the loop, which has no tile for it (fp8's order)
  } else {
    // One item a block, Q is waited for where the warpgroup computes no tile too: its
    // rows of the buffer stage its O.
    if (!kWalk && kPassesTiles && wg_tiles == 0 && tiles > 0) sm90::mbar_wait(q_full, 0u);
    if (!kWalk && tiles > 0) ring_first_hand_over();
    ring_empty_first_turn();
    if (wg_tiles > 0) {
      if (!kRing && !kWalk && wg == 1) their_turn();  // ping-pong: warpgroup 0 goes first
      const bool present = box_present(0);
      if (!kWalk) sm90::mbar_wait(q_full, 0u);
      my_turn();
      issue_s(0);
      hand_over();
      settle_o_store();  // the previous item's O store read, behind S_0's product
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(s_flat);
      release(kEmptyK, g0 % kKRing);
      softmax(0, present);  // O is still zero (or not yet written): nothing to rescale
      to_p();
    }
    for (int j = 1; j < wg_tiles; ++j) {
      const bool present = box_present(j);
      zero_v_tail(j - 1);
      my_turn();
      issue_s(j);
      if constexpr (kEarlyHandOver) hand_over();
      issue_pv(j - 1);
      if constexpr (!kEarlyHandOver) hand_over();
      sm90::wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
      sm90::wgmma_hold(s_flat);
      softmax_of_landed_s(
          j, s_flat, issue_s, softmax_at_max, [&](int j) { softmax(j, present); },
          [&](int j) { release(kEmptyK, (g0 + j) % kKRing); });
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(o_flat);
      release_v(v_stage_of(j - 1));
      rescale_o();
      to_p();
    }
    if (wg_tiles > 0) {
      zero_v_tail(wg_tiles - 1);
      my_turn();
      issue_pv(wg_tiles - 1);
      hand_over(/*last=*/true);
      sm90::wgmma_wait<0>();
      sm90::wgmma_hold(o_flat);
      release_v(v_stage_of(wg_tiles - 1));
    }
  }
  if constexpr (kPassesTiles) {
    for (int j = wg_tiles; j < tiles; ++j) {
      // The V-tail zeroing (16-bit) before the tile's empty turn: every warpgroup meets
      // there having taken the item's turns up to the last tile's and not that one (an
      // empty turn first would wait for a later warpgroup's turn, which waits at the
      // zeroing's barrier for this one: the ring hung so where the last warpgroup had no
      // rows of a short last row block). The empty turns stay: a walk ring that took only
      // the turns with work (each handed to the warpgroup with the next) ran 0.875-0.987x
      // at every row it changed (H200, kernel time at the base clock: fp8 d128 causal S =
      // 512 0.875, bf16 d64 causal 512 0.909; docs/benchmarks.md 2026-12-02 (55)).
      zero_v_tail(j);
      if constexpr (kRing) {  // the tile's turn, empty
        my_turn();
        ring_turn();
      }
      // The walk makes both stage indices first: as with release, each kernel keeps its
      // order (the other changed ptxas's schedule of the fp8 kernels).
      if constexpr (kWalk) {
        // sv: fp8's V stage, made here as its kernel had it (the 16-bit kernels release
        // their carried stage, which kCarryV leaves sv unused for)
        const int st = (g0 + j) % kKRing, sv = (g0 + j) % kPvRing;
        sm90::mbar_wait(bar(kFullK, st), parity(g0 + j, kKRing));
        release(kEmptyK, st);
        pv_tile(j);
        release_v(kCarryV ? v_stage : sv);
      } else {
        sm90::mbar_wait(bar(kFullK, (g0 + j) % kKRing), parity(g0 + j, kKRing));
        release(kEmptyK, (g0 + j) % kKRing);
        pv_tile(j);
        release_v(v_stage_of(j));
      }
    }
  }

  // Epilogue (finish_rows), then O written out (write_o_rows); the previous item's O
  // store read waited for first where no product of this item's did.
  if (!kOverlap || wg_tiles <= 0) settle_o_store();
  // No P V wrote O: zeros for finish_rows. Here, not before the tiles: zeroed on one path
  // there, O was zeroed on all (LLVM took the other path's undefined O for zeros).
  if constexpr (kFirstPvWritesO) {
    if (wg_tiles <= 0) {
#pragma unroll
      for (int x = 0; x < kDT * 4; ++x) o_flat[x] = 0.f;
    }
  }
  finish_rows<T, D, kBlockM, kPartialFirst>(p, o, m, l, sQ, row0, warp, g, t, m0, s, h, hd);
  if constexpr (!kFp8) {
    constexpr bool kWaitRead = !defers_o_store_read(kWgs, kEB, D, kWalk);
    write_o_rows<T, D, kBlockM, kWaitRead, kPartialFirst>(a, sQ, row0, m0, s, h, hd, tid % 128,
                                                          wg);
  }
}

}  // namespace flash_sm90
}  // namespace xla_attn
