// Tile shapes of the sm90 flash family (wgmma + TMA, sm_90a), read by the kernel
// (flash/fwd_sm90.cuh, NVRTC) and by the host launch code (flash/launch.cc).
#pragma once
#include "common/tensor_map.h"
#include "flash/params.h"

namespace xla_attn::flash_sm90 {

// One block = a producer warpgroup (one thread issues every bulk tensor copy) and kWgs
// consumer warpgroups of 64 query rows each (wgmma's M): two, or at d64 three where that
// pays (wide_d64 below). Several consumers let one run its softmax while another's
// products run on the tensor cores (FA3's ping-pong: taken in turns on named barriers
// with two consumers, fwd_sm90.cuh; left to the warp schedulers with three); d64's
// softmax weighs twice d128's against its products (per S element the same exponential
// for half the matrix work).
constexpr int kConsumerWarpgroups = 2;  // the default, and the backward's
XLA_ATTN_HOST_DEVICE constexpr int block_m(int wgs) { return 64 * wgs; }
constexpr int kBlockM = block_m(kConsumerWarpgroups);

// Three consumer warpgroups (192 rows a block) at d64, measured on an H100 against two
// (bf16, B x S = 16384, H = 32): full S = 512 ... 16384 +4 to +20 % (489 against 424
// TFLOP/s at 16384), causal +1 to +11 % from S = 2048 on, but causal S = 512 / 1024 -15 /
// -13 % (117 / 176 against 138 / 203: 192-row blocks carry more masked tiles and there
// are fewer of them). Since a warpgroup passes the tiles none of its rows sees
// (fwd_sm90_tile.cuh, warpgroup_tiles; 2026-11-26, H100, same run, 3 rounds): causal S = 1024
// on three 275-284 against two 267-272, S = 512 187-192 against 191-195. So: three
// unless the mask has a right edge (causal is a window with right = 0) and the longest
// sequence has at most kWideMaxMaskedRows queries. With the partial row block first
// (partial_block_first, below; H200, kernel time at the base clock, three against two):
// causal S = 128 / 256 / 384 / 512 0.983 / 0.830 / 1.049 / 1.067x (at 256, 64 + 192 rows,
// the first block's one warpgroup with rows computes alone). Before it the bound was 512
// (two at causal 1024 ran 0.945x three). docs/benchmarks.md 2026-12-01 (53).
constexpr int kWideMaxMaskedRows = 256;
XLA_ATTN_HOST_DEVICE constexpr bool wide_d64(int window_right, int max_seqlen_q) {
  return window_right < 0 || max_seqlen_q > kWideMaxMaskedRows;
}

// Registers a thread after setmaxnreg (sm_90a): a block starts at 65536 / its threads
// (rounded down to 8: start_regs, 168 at 384 threads, 128 at 512), and setmaxnreg.inc
// waits until the registers the producer's setmaxnreg.dec gave back cover the consumers'
// increase, so consumer_regs shares out only those: the producer drops to 24 and the
// consumers take 240 with two (128 x 24 + 256 x 240 = 3 x 128 x 168), 160 with three
// (3072 + 384 x 160 = 4 x 128 x 128). A count past that share never returns: fp8 d256 at
// 32 / 240 (a share from 65536 instead of the starting 64512) hung its block (H100). A
// consumer holds S (block_n / 2 f32), O (D / 2 f32) and P (block_n / 4 b32, fp8 / 8): d64
// 64 + 32 + 32, d128 64 + 64 + 32, 16-bit d256 32 + 128 + 16, fp8 d256 64 + 128 + 16.
// fp8: the producer also transposes V (fwd_sm90_producer.cuh, transpose_v_e4m3), a 16-key x
// 32-dim block a warp step, in 40 beside two consumers (232: at 56 / 224 they spilled
// 300 bytes), in 24 at d256 (its consumers need 240, below: the producer spills nothing
// more at 24 than at 32); beside three consumers in 32 (consumers 160: at 152 ptxas
// spilled 3.7 KB and serialized every wgmma, C7512; at 32 the one block an item kernel
// spills 28 bytes, the walk none; at 24, 204).
constexpr int kProducerRegs = 24;
XLA_ATTN_HOST_DEVICE constexpr int producer_regs(int wgs, int eb, int d) {
  return eb == 2 ? kProducerRegs : wgs == 3 ? 32 : d > 128 ? 24 : 40;
}
XLA_ATTN_HOST_DEVICE constexpr int start_regs(int wgs) {
  return 65536 / (128 * (wgs + 1)) / 8 * 8;
}
XLA_ATTN_HOST_DEVICE constexpr int consumer_regs(int wgs, int producer_regs = kProducerRegs) {
  return (start_regs(wgs) * (wgs + 1) - producer_regs) / wgs / 8 * 8;
}
constexpr int kConsumerRegs = consumer_regs(kConsumerWarpgroups);
// What the producer gives back covers the consumers' increase (else setmaxnreg.inc never
// returns): the shares the kernels take, and 32 / two, which once hung at 240.
static_assert(consumer_regs(2, 24) == 240 && consumer_regs(2, 40) == 232 &&
                  consumer_regs(2, 32) == 232 && consumer_regs(3, 32) == 160 &&
                  128 * 32 + 256 * consumer_regs(2, 32) <= 3 * 128 * start_regs(2),
              "consumer_regs shares out more registers than the producer gives back");

// fp8 takes three consumer warpgroups (192-row blocks) where it is not paged: its
// softmax (the same per S element as d64's at 16 bits, for products twice as fast)
// outlasts its products twice over (docs/benchmarks.md, 2026-11-25 (13)), and a third
// warpgroup's softmax fills more of that. H100, same run, against two: full S = 512 /
// 2048 / 8192 / 16384 +4 / +9 / +10 / +12 % (845 against 756 TFLOP/s), causal S = 512 /
// 2048 / 8192 +0.5 / +3 / +9 %. Paged fp8 keeps two (its kPaged instance, two consumers).
constexpr int kFp8Wgs = 3;

// FA3's intra-warpgroup overlap (fwd_sm90_consumer.cuh): a consumer issues S_j beside P_{j-1}
// V_{j-1} and runs softmax_j while the latter is in flight, so that S (block_n / 2 f32),
// O (D / 2) and P (block_n / 4, fp8 / 8) are all held by products in flight at once. Three
// fp8 d128 consumers cannot (160 registers: ptxas serialized every wgmma, C7512, also with
// both products waited for before the softmax), so each runs a tile's products one after
// the other (tiles_in_turn) and the other two warpgroups' softmaxes fill the gaps. fp8
// d64 (O 32 registers) can; H100, same run, against tiles_in_turn: one block an item S =
// 4096 full +8 %, 8192 causal +8 %, 16384 +10 %; the walk (fwd_sm90_walk.cuh) S = 512
// -5.5 / -7.6 % (full / causal), 1024 -0.6 / -2.8 %, 2048 +1.4 / -2.2 %, so the walk
// keeps its tiles in turn. fp8 d256's two consumers (240 registers, 128-key tiles) overlap
// as FA3's do, but not paged (as FA3's paged instance does not): there ptxas spilled 164
// bytes overlapped and 56 in turn; H100, paged fp8 d256 B = 8 x 2048, 64-row pages, best of
// 3 against overlapped: full +1.8 %, causal +1.1 % (against 64-key tiles +9.7 / +6.2 %).
XLA_ATTN_HOST_DEVICE constexpr bool overlaps_products(int wgs, int eb, int d, bool walk,
                                                      bool paged) {
  return !(eb == 1 && ((wgs == 3 && (d > 64 || walk)) || (paged && d > 128)));
}

// A tile's softmax after an item's first against the running max as it stands, without
// the max pass (fwd_sm90_tile.cuh, softmax_at_running_max; S is computed again where an
// exponent may pass the bound), where the softmax weighs against the products: fp8 and
// 16-bit up to d128. Against the max pass, same run, best of 2 (an H200; fp8 also an
// H100): fp8 d128 S = 512 -1.5 %, 2048 +2-3 %, 8192 / 16384 +5-7 %; bf16 d64 S = 512 +5.5
// % full / +2.7 % causal, 2048 - 16384 +3.7..+6.4 %; d128 +0.8..+1.8 % (16384 full -1.1
// %: the spread); d256 1024 / 8192 -2.6 / -0.4 % (its products outweigh its softmax).
XLA_ATTN_HOST_DEVICE constexpr bool at_running_max(int d, int eb) { return eb == 1 || d <= 128; }

// An item's first P V writes O (wgmma's scale-d off) instead of adding into an O zeroed
// at the item's start (~95 instructions a warp an item: CS2R / MOV into O's registers), at
// d128, 16-bit and fp8 (fwd_sm90_tile.cuh, issue_pv_on). H200, kernel time at the base clock,
// two rounds, against the zeroing: bf16 d128 full S = 512 / 1024 / 8192 +1.3 / +1.0 /
// +0.1 %, causal 512 +0.8 %, varlen +0.8 %, fp8 d128 causal 1024 +2.2 % (8192 full, one
// round: 1.000); d64 full 1024 / 4096 -0.7 / -0.5 %, causal 512 -0.5 % and d256 full 512
// -0.9 % keep the zeroing (docs/benchmarks.md 2026-12-01 (54)).
XLA_ATTN_HOST_DEVICE constexpr bool first_pv_writes_o(int d) { return d == 128; }

// Head dims are padded with zeros up to 64, 128 or 256 (the copy engine fills columns
// past head_dim with zeros): whole 128-byte rows per 64-column block.
XLA_ATTN_HOST_DEVICE constexpr int head_bucket(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// fp8 (e4m3 q, k, v; bf16 out): three buckets, d64 (head dims 16..64), d128 (65..128) and
// d256 (129..256). d64 and d128 keep a row in one 128-byte swizzle span as the 16-bit
// kernels do (col_blocks): the copy engine fills d64's upper 64 bytes with zeros, which no
// product reads: S takes D / 32 k-steps and P V an N of D, O holds D / 2 registers and the
// producer transposes D rows of V^T. Padded to d128 instead, d64 paid twice its products
// and transposes and ran at 0.81-0.93x our bf16 d64 (H100, docs/benchmarks.md, 2026-11-26
// (21)). d256 takes two consumer warpgroups (O's 128 registers) at 240 registers and
// 128-key tiles (S 64, P 16: FA3's fp8 d256 tile; block_n).
constexpr int kFp8MaxHeadDim = 256;
XLA_ATTN_HOST_DEVICE constexpr bool fp8_covers(int head_dim) {
  return head_dim >= 16 && head_dim <= kFp8MaxHeadDim && head_dim % 16 == 0;
}
XLA_ATTN_HOST_DEVICE constexpr int fp8_bucket(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}
// fp8's consumer warpgroups in its bucket d (non-paged; paged takes two): three up to
// d128 (kFp8Wgs), two at d256 (O's registers, above).
XLA_ATTN_HOST_DEVICE constexpr int fp8_wgs(int d) { return d <= 128 ? kFp8Wgs : 2; }

// Keys per K/V tile: S is 64 x block_n per consumer warpgroup. 128 up to d128 (S 64 +
// O 64 registers at d128); 16-bit d256 takes 64 so that O's 128 registers fit beside S
// (and its 64 KB Q beside the rings). fp8 d256 takes 128 (S 64 beside O 128 at 240
// registers, ptxas spilling 84 bytes of loop-invariant values, read back by ~12 LDL a
// tile): its S on m64n128k32 reads Q once for 128 keys where m64n64k32 read it for 64
// (each of those products moved 4 KB of shared memory in its 32 cycles: the 128 bytes a
// cycle shared memory gives). H100, same run, best of 2, against 64-key tiles taking
// turns: full S = 1024 / 2048 / 8192 / 16384 +1.8 / +3.2 / +7.1 / +7.6 %, causal 2048 /
// 8192 +1.4 / +5.9 % (952 TFLOP/s at S = 16384); another run, causal 4096 / 16384 +2.9 /
// +3.3 % (there two wheels with this same kernel differed by up to 3.5 %).
XLA_ATTN_HOST_DEVICE constexpr int block_n(int d, int eb) {
  return d <= 128 || eb == 1 ? 128 : 64;
}

// The forward's two consumer warpgroups take turns issuing their products (ping-pong,
// fwd_sm90.cuh) at 16 bits. Not at fp8: its products take ~1024 cycles a block tile
// against a softmax of ~2000 (ncu, H100, d128 S=8192: docs/benchmarks.md, 2026-11-25
// (13)), so each warpgroup found its turn late and waited on it; without turns, H100
// same run: fp8 d128 +0..+5 % (S=512 +4.7 %, 8192 +3.8 %), d64 +2 %; bf16 d128 without
// them -2..+4 %, so it keeps them. fp8 d256 takes them: its products are twice d128's
// for the same softmax (64 exponentials a thread a 128-key tile for 2 x 64 x 128 x 256
// products a warpgroup); H100, same run, on 64-key tiles against no turns: S = 512 / 1024
// / 2048 / 8192 / 16384 full +1.8 / +5.0 / +9.0 / +11.1 / +10.1 %, causal 2048 / 8192
// +5.8 / +7.8 %; on 128-key tiles against none: +0.0 .. +2.3 % (S = 1024 .. 16384). The
// walks (d <= 128) are unchanged.
XLA_ATTN_HOST_DEVICE constexpr bool ping_pong(int wgs, int eb, int d) {
  return wgs == 2 && (eb == 2 || d > 128);
}

// Three consumer warpgroups take turns in a ring (fwd_sm90_tile.cuh: tiles_in_turn where each
// runs its tiles in turn, i.e. fp8 d128 and fp8 d64's walk; consume_item's overlapped
// tiles at 16-bit d64), so that one warpgroup's products run while the other two compute
// their softmaxes, rather than all three leaving the tensor cores to the warp
// schedulers' order. In turn, a turn issues one warpgroup's P_{j-1} V_{j-1}, waits for
// it and issues S_j; overlapped, it issues S_j and P_{j-1} V_{j-1} (as ping-pong does).
// H100, same run, against no turns, median of 3 rounds (docs/benchmarks.md, 2026-11-27
// (33)): fp8 d128 full S = 1024 / 2048 / 4096 / 8192 / 16384 +2.3 / +5.1 / +2.5 / +2.9 /
// +2.1 %, causal S = 512 / 2048 / 4096 / 8192 / 16384 +6.5 / +3.1 / +1.4 / +1.4 / +3.5 %,
// S = 512 full -0.4 %; fp8 d64 (walk) causal S = 512 / 2048 +6.6 / +2.1 %, full S = 1024
// -0.7 %; bf16 d64 (the walk's three, best of 3 rounds, docs/benchmarks.md 2026-11-27
// (34)) full S = 512 / 1024 / 2048 / 4096 / 16384 +3.9 / +3.6 / +3.1 / -0.2 / +1.1 %,
// causal S = 1024 / 4096 / 16384 +0.2 / +4.6 / +0.7 %, varlen (16 causal sequences, mean
// 1024) +4.1 %. Not fp8 d64's one block an item kernel (overlapped, past 2048 rows): full
// S = 4096 / 16384 -0.6 / -0.3 %, causal 8192 -1.4 %.
XLA_ATTN_HOST_DEVICE constexpr bool turn_ring(int wgs, int eb, int d, bool walk, bool paged) {
  return wgs == 3 && (eb == 2 || !overlaps_products(wgs, eb, d, walk, paged));
}

// The walks whose warpgroups pass the tiles their rows do not see (three consumers:
// 16-bit d64's 192-row walk, fp8's) put a sequence's partial row block first: rows 0 ..
// (num_q - 1) % 192, then whole blocks ending at num_q, rather than whole blocks from row
// 0 and the partial one last. Under a causal mask the last block sees the most keys, and
// a partial block's warpgroups without rows pass all of them, so the one or two with rows
// compute them alone, beside empty ring turns: at S = 1024 (5 x 192 + 64) the last
// block's one warpgroup with rows computed its 8 tiles alone, the most of any block, for
// 64 of its 192 rows. First, the partial block sees the fewest keys (S = 1024: 1 tile).
// The warpgroup tiles are the same in number; fewer of them run alone. H200, kernel
// time at the base clock, against the partial block last: bf16 d64 causal S = 1024 /
// 2048 / 4096 +7.0 / +2.0 / +2.5 %, full 1024 +1.0 %, fp8 d128 / d64 causal 1024 +4.0 /
// +7.2 %, the varlen row (d128, unchanged) +0.7 % (docs/benchmarks.md 2026-12-01 (53)).
XLA_ATTN_HOST_DEVICE constexpr bool partial_block_first(int wgs, int eb, int d, bool walk) {
  return walk && !ping_pong(wgs, eb, d);
}
// The row before which a block's written rows end (its rows from m0, a sequence of num_q
// rows): where the partial block comes first, the first block ends at (num_q - 1) %
// block_m + 1 and the others are whole; else at the sequence's end (a block's rows past
// m0 + block_m are not its own either way).
template <bool kPartialFirst>
XLA_ATTN_HOST_DEVICE constexpr int rows_end(int m0, int num_q, int block_m) {
  if constexpr (kPartialFirst) {
    return m0 == 0 ? (num_q - 1) % block_m + 1 : m0 + block_m;
  } else {
    return num_q;
  }
}

// The walk's copying thread of a warpgroup waits for the copy engine's read of its O
// rows (fwd_sm90_tile.cuh, write_o_rows) in the next item, behind that item's first product,
// rather than at the item's end, where the wait held its warp and so the warpgroup's
// next products (fwd_sm90_walk.cuh, settle_o_store). H100, same run, medians of 3 rounds,
// against waiting at the item's end: 16-bit d128 (ping-pong) full S = 512 / 1024 +2.3 /
// +2.7 %, causal 512 +1.6 %, varlen +2.1 % (long causal rows, on a noisier machine,
// within an unchanged control's spread: -0.7 .. -1.9 % at 4096 .. 16384); not d64, whose
// 64-row O is half d128's: ping-pong's causal S = 512 -1.2 %, and its three warpgroups'
// walk (160 registers) spilled 12 bytes more with it, full S = 512 -5.8 %. fp8 stores O
// from registers. docs/benchmarks.md, 2026-11-28 (36).
XLA_ATTN_HOST_DEVICE constexpr bool defers_o_store_read(int wgs, int eb, int d, bool walk) {
  return walk && ping_pong(wgs, eb, d) && d == 128;
}

// K/V tiles in flight: the producer fills stage j + 1 while tile j is computed. fp8 (half
// the bytes a tile, twice the product rate) rings K and the copied V through 4 stages and
// its V^T tiles through 3, so that copies and transposes run further ahead of products
// that finish sooner. 16-bit: V_j is released a whole tile later than K_j (after P V_j,
// not S_j) and the producer copies K_j, V_j in order, so V's ring bounds how far both
// run ahead: 3 V stages at d128 / d256 (227 KB with the walk's two Q buffers), 4 and 4 at
// d64 (its tiles are half the size). H100, same run, against 2 and 2 (with O's bulk
// stores): d64 S=512 full +9 %, S=1024 +5 %, d256 +3..+5 %, d128 +0..+2 %; S=16384 alike.
// Barriers are laid out for kMaxStages per kind.
// `vt_given`: fp8's instances for V given transposed (flash_fwd_sm90's kVtGiven, below
// at vt_given_covers) have no raw V ring: K and V^T ring through vt_given_stages each. d256
// kVtGivenStages (32 KB Q + 3 x (32 + 32) KB = 224 KB; against 2 + 2, -2.6..+2.9 %, H100,
// docs/benchmarks.md 2026-11-27 (32)); d64 / d128 kMaxStages (16 KB tiles at most: 24 KB
// Q + 4 x (16 + 16) KB, the rings the transposing kernel has for K and raw V).
constexpr int kStages = 2;
constexpr int kMaxStages = 4;
constexpr int kVtGivenStages = 3;
XLA_ATTN_HOST_DEVICE constexpr int vt_given_stages(int d) {
  return d <= 128 ? kMaxStages : kVtGivenStages;
}
XLA_ATTN_HOST_DEVICE constexpr int k_stages(int d, int eb, bool vt_given) {
  return vt_given ? vt_given_stages(d) : eb == 1 ? (d <= 128 ? 4 : 2) : d <= 64 ? 4 : kStages;
}
// fp8 d256 (32 KB Q, 32 KB K, V and V^T tiles) rings each through 2 stages, 224 KB in
// all (with 64-key tiles it had 4 K, 2 raw V and 3 V^T stages of 16 / 16 / 32 KB).
XLA_ATTN_HOST_DEVICE constexpr int v_stages(int d, int eb, bool vt_given) {
  return vt_given ? 0 : eb == 1 ? (d <= 128 ? 4 : 2) : d <= 64 ? 4 : 3;
}
XLA_ATTN_HOST_DEVICE constexpr int vt_stages(int d, int eb, bool vt_given) {
  return vt_given ? vt_given_stages(d) : eb == 1 ? (d <= 128 ? 3 : 2) : 0;
}

// Named barriers (0 is __syncthreads): 1 the consumers' V-tail zeroing, 2 + wg each
// consumer warpgroup's epilogue (up to 4), kProducerBarrier the fp8 producer's transposes,
// kTurnBarrier + wg the consumers' turns (two: ping-pong; three: turn_ring).
constexpr int kProducerBarrier = 5;
constexpr int kTurnBarrier = 6;
// kVoteBarrier + wg each consumer warpgroup's vote on its softmax at the running max
// (fwd_sm90_tile.cuh, softmax_at_running_max).
constexpr int kVoteBarrier = 9;
static_assert(2 + 3 <= kProducerBarrier && kTurnBarrier + 3 <= kVoteBarrier &&
                  kVoteBarrier + 3 <= 16,
              "named barriers: epilogues, producer, turns and votes (up to three consumers) "
              "apart, within sm_90's 16");
// fp8: the producer warpgroup's warps 1 .. 3 transpose V tiles; warp 0's thread 0 copies.
constexpr int kTransposeWarps = 3;

// Shared memory, every tile in column blocks of 128-byte rows (64 16-bit or 128 fp8
// elements; the 128-byte swizzle repeats every 1 KB, so every block starts on a 1 KB
// boundary): q_buffers(..) Q tiles (block_m rows), then k_stages K tiles, v_stages V
// tiles, for fp8 vt_stages V^T tiles (V transposed by the producer: fp8 wgmma reads B
// K-major only, and P V's K is the keys), then the barriers. kAlign of slack aligns the
// start. d128: 2 x 32 + 4 x 32 KB; d256: 64 + 4 x 32 KB (227 KB is a block's limit on
// sm_90); fp8 d128 (three consumers): 2 x 24 + 11 x 16 KB (226.7 KB in all), fp8 d64 the
// same but 3 x 8 KB of V^T.
constexpr int kAlign = 1024;
constexpr int kRowBytes = 128;  // one column block of a row
constexpr int kSmemLimit = 227 * 1024;
// 128-byte column blocks a row of Q, K or V takes (fp8 d64's 64-byte rows: one, half zeros)
XLA_ATTN_HOST_DEVICE constexpr int col_blocks(int d, int eb = 2) {
  return (d * eb + kRowBytes - 1) / kRowBytes;
}
XLA_ATTN_HOST_DEVICE constexpr int q_bytes(int d, int wgs, int eb = 2) {
  return block_m(wgs) * col_blocks(d, eb) * kRowBytes;
}
XLA_ATTN_HOST_DEVICE constexpr int kv_bytes(int d, int eb = 2) {
  return block_n(d, eb) * col_blocks(d, eb) * kRowBytes;
}
// fp8's V^T: D rows of block_n (128) e4m3 keys, one 128-byte row each (the 128-byte
// swizzle's span, which P V's K-major operand reads)
XLA_ATTN_HOST_DEVICE constexpr int vt_bytes(int d, int eb) { return eb == 1 ? d * kRowBytes : 0; }
// q_full and q_empty of each Q buffer and the item its Q belongs to (an int in an 8-byte
// slot), then kMaxStages each of full_k, full_v, empty_k, empty_v and (fp8) full_vt,
// empty_raw: 8 bytes each.
constexpr int kMaxQBuffers = 3;
XLA_ATTN_HOST_DEVICE constexpr int barrier_bytes(int eb) {
  return 8 * (3 * kMaxQBuffers + (eb == 1 ? 6 : 4) * kMaxStages);
}
// Paged K/V (the kPaged instances): each consumer warp's valid bytes of its current tile, one
// a key (1: its page exists), up to 3 consumer warpgroups.
XLA_ATTN_HOST_DEVICE constexpr int valid_bytes(int d, int eb) { return 3 * 4 * block_n(d, eb); }
XLA_ATTN_HOST_DEVICE constexpr int layout_bytes(int d, int wgs, int eb, int q_buffers,
                                                bool vt_given) {
  return kAlign + q_buffers * q_bytes(d, wgs, eb) +
         (k_stages(d, eb, vt_given) + v_stages(d, eb, vt_given)) * kv_bytes(d, eb) +
         vt_stages(d, eb, vt_given) * vt_bytes(d, eb) + barrier_bytes(eb) + valid_bytes(d, eb);
}
// A block walks several (row block, head, sequence) items where the grid would take
// more than one wave (a persistent grid, fwd_sm90_walk.cuh): with more than one Q buffer the
// producer copies the next item's Q while the consumers still stage the current item's O
// in theirs. The producer copies item i + 1's Q once it has copied item i's last K / V
// tile and item i + 1 - buffers has been written out: with two buffers, item i - 1, so
// that where items are one or two tiles long (causal S = 512: 1 .. 4 tiles of 128 keys)
// the copy had only item i's few tiles to land in. Three where they fit (d64's 16 and 24
// KB tiles), else two (d128), else one (d256, whose 64 KB Q tiles do not fit twice).
// H100, kernel time at the base clock (ncu), one round, with the padding items handed
// over as such (fwd_sm90_walk.cuh), against two: bf16 d64 causal S = 512 / 1024 / 2048
// -2.3 / -1.1 / -0.5 %, full S = 512 -1.4 %, 16384 -0.1 %; fp8 d64 causal 512 -1.3 %.
// d128 fits a third only with two V stages instead of three (v_stages), and lost with
// it: causal S = 512 / 1024 +4.3 / +5.5 %, full 512 / 2048 +11 / +1.4 %, varlen +3.9 %,
// causal 8192 -2.2 % (best of two rounds; docs/benchmarks.md 2026-11-28 (39)).
// One block an item has one (the same shared memory as before the walk: with 32 KB more
// at d128 the L1 carve-out is smaller).
XLA_ATTN_HOST_DEVICE constexpr int q_buffers(int d, int wgs, int eb = 2, bool walk = true) {
  return !walk                                                        ? 1
         : layout_bytes(d, wgs, eb, kMaxQBuffers, false) <= kSmemLimit ? kMaxQBuffers
         : layout_bytes(d, wgs, eb, 2, false) <= kSmemLimit            ? 2
                                                                        : 1;
}
// (the instances for V given transposed never walk: vt_given_covers' rows)
XLA_ATTN_HOST_DEVICE constexpr int smem_bytes(int d, int wgs, int eb, bool walk, bool vt_given) {
  return layout_bytes(d, wgs, eb, q_buffers(d, wgs, eb, walk), vt_given);
}
static_assert(smem_bytes(256, 2, 2, false, false) <= kSmemLimit &&
                  smem_bytes(128, kFp8Wgs, 1, true, false) <= kSmemLimit &&
                  smem_bytes(256, fp8_wgs(256), 1, false, false) <= kSmemLimit &&
                  smem_bytes(256, fp8_wgs(256), 1, false, true) <= kSmemLimit &&
                  smem_bytes(64, kFp8Wgs, 1, true, false) <= kSmemLimit &&
                  smem_bytes(128, kFp8Wgs, 1, false, true) <= kSmemLimit &&
                  kVtGivenStages <= kMaxStages,
              "the d256 (fp8: d128, d256, d128 / d256 with V given) tiles exceed sm_90's 227 "
              "KB a block");
static_assert(q_buffers(64, 2) == 3 && q_buffers(64, 3) == 3 && q_buffers(64, kFp8Wgs, 1) == 3 &&
                  q_buffers(128, 2) == 2 && q_buffers(128, kFp8Wgs, 1) == 2,
              "d64 (16-bit and fp8) is meant to take three Q buffers, d128 two");

// The persistent walk (fwd_sm90_walk.cuh) where it measured faster than one block an
// item. H100, the same run, bf16, B x S = 16384, S = 512 / 1024 / 2048 / 4096 / 8192 /
// 16384, walk / one block an item: d64 full 1.23 / 1.16 / 1.12 / 1.09 / 1.09 / 1.07x,
// causal 1.12 / 1.03 / 1.15 / 1.11 / 1.08 / 1.06x; d128 full 1.08 / 1.01 / 0.98 / 0.95 /
// 0.92 / 0.93x, causal 1.07 / 1.02 / 0.97 / 0.94 / 0.91 / 0.85x; fp8 d128 full 1.13x at
// 512, 1.00x at 2048; d256 0.80 - 0.95x (its single Q buffer: no copy ahead). Causal rows
// need the item counter (Args): without it (no workspace) only rows without a right
// mask edge, which cost alike.
// With O's bulk stores and 3 V stages (2026-11-25, H100, same run, walk / one block an
// item): bf16 d128 S = 1024 1.02x, 2048 0.93 / 0.96x (full / causal), 4096 0.96 /
// 0.94x; fp8 d128 S = 2048 1.06 / 1.09x, 4096 causal 1.02x. So fp8 walks to 2048 rows.
// With the softmax at the running max and the walk's items longest first at the tail
// (fwd_sm90_walk.cuh, locate; 2026-11-26, H200, same run, walk / one block an item):
// bf16 d128 full S = 2048 .. 16384 1.04 - 1.06x, causal S = 2048 / 4096 / 8192 / 16384
// 1.10 / 1.01 / 1.04 / 1.03x; fp8 causal S = 4096 1.01x, 16384 0.98x. So 16-bit d128
// walks at every length, fp8 (d64 as d128, the same tile loop) to 2048 rows.
// d256 has no walk: one that handed its single Q buffer back once its last S product had
// landed (the next Q copied behind the last P V product, O stored from registers) still
// took 1.08 - 1.18x the kernel time of one block an item (2026-11-28, H100, base clock,
// S = 512 .. 8192 full and causal; at 512, 22 % more SM cycles; docs/benchmarks.md (38)).
constexpr int kWalkMaxRowsFp8 = 2048;
XLA_ATTN_HOST_DEVICE constexpr bool has_walk(int d) { return d <= 128; }
XLA_ATTN_HOST_DEVICE constexpr bool walks(int d, int max_seqlen_q, int eb = 2) {
  return eb == 1 ? max_seqlen_q <= kWalkMaxRowsFp8 : d == 64 || d == 128;
}

// The 16-bit d128 walk's instance whose warpgroup without a row of the item passes its
// tiles (fwd_sm90_walk.cuh, kPassRowless): where some sequence's last 128-row block may
// end in its first half, i.e. unless every sequence has max_seqlen_q rows with
// max_seqlen_q % 128 zero or past 64. The launcher knows that only for equal lengths
// (the dense layout), so varlen calls take it. H200, kernel time at the base clock, two
// rounds: the varlen row (16 causal sequences, mean 1024) +1.4 %, its lengths of seed 3
// +0.8 %; the dense d128 rows, which never pass, ran 0.992-0.997 on it (S = 512 full /
// causal, causal 1024, full 8192), so they keep the walk without it
// (docs/benchmarks.md 2026-12-02 (56)).
XLA_ATTN_HOST_DEVICE constexpr bool passes_rowless(int d, int eb, bool equal_lengths,
                                                   int max_seqlen_q) {
  return d == 128 && eb == 2 &&
         (!equal_lengths || (max_seqlen_q % 128 != 0 && max_seqlen_q % 128 <= 64));
}
static_assert(!passes_rowless(128, 2, true, 512) && !passes_rowless(128, 2, true, 1000) &&
                  passes_rowless(128, 2, true, 300) && passes_rowless(128, 2, false, 512) &&
                  !passes_rowless(64, 2, false, 300) && !passes_rowless(128, 1, false, 300),
              "passes_rowless: a last block ending in its first half, 16-bit d128 only");

// Split-KV is not this family's: where the grid cannot fill the GPU by itself (one
// block an SM, 132 SMs on an H100), the launcher takes the sm80 family, which splits.
constexpr int kTargetBlocks = 132;

// What the kernel receives: the op's params and the tensor maps of Q, K and V, each a
// 3-d view [rows][heads][head_dim] (innermost last) read in boxes of 128 bytes of columns
// x 1 head x block_m (Q) or kv_box_rows (K, V) rows. kv_box_rows is block_n, or for a
// paged cache gcd(block_size, block_n): a box then never leaves its page, and a tile
// takes block_n / kv_box_rows boxes a column block, each from the page the block table
// names. The launcher takes paged calls only where that is a multiple of 8 rows, so
// that each box starts on the 128-byte swizzle's 1 KB period.
// The items (row block, head, sequence; row blocks fastest, so that the blocks in flight
// share one or two heads' K / V in L2, and each head's longest row blocks first) number
// row_blocks x num_heads x (batch + 1, the padding rows' item). Block i takes item i
// first, then the next unclaimed one: item_counter (zeroed before the launch) counts the
// claims past the first gridDim.x, so that a block that finishes early takes more (row
// blocks under a causal mask cost 1 ... row_blocks tiles). Without a counter (no
// workspace), items i + gridDim.x, i + 2 gridDim.x, ...
// o_map (16-bit only, where o_by_copy: out 16-byte aligned) views the output as Q's map
// does, in boxes of 64 rows: a consumer warpgroup's rows of O, staged in its rows of the
// Q buffer, go out by bulk tensor stores (fwd_sm90_tile.cuh, write_o_rows).
constexpr int kOStoreRows = 64;  // a consumer warpgroup's rows
// vt_map (fp8, the instance for V given transposed: vt_given below): V^T as
// flash_fwd_vt_pack wrote it into the workspace at vt, read in boxes of 128 keys x D rows
// x 1 head, 128-byte swizzled: the layout transpose_v_e4m3 writes, so that the copy
// engine lands each V^T tile itself.
struct Args {
  xla_attn_flash_fwd_params p;
  sm90::TensorMap q_map, k_map, v_map, o_map, vt_map;
  int o_by_copy;
  int kv_box_rows;
  int row_blocks;
  int items;
  int* item_counter;
  int tail_waves;  // items an SM the walk's longest-first tail covers (launch.cc)
  unsigned char* vt;  // [num_heads_k][head_dim][vt_cols] e4m3 (vt_given)
  int64_t vt_cols;
};
constexpr size_t kItemCounterBytes = sizeof(int);

// fp8's V given transposed. Transposing each V tile in shared memory (transpose_v_e4m3)
// moves 64 KB of a d256 block tile's ~288 KB through shared memory (shared memory's pipe
// read 48 % busy, the products 48 % of e4m3's rate: ncu, H100, d256 S = 8192) and takes
// three warps' issue slots; with V^T left unwritten (a timing experiment) the fp8 d256
// forward ran +31..+33 % (H100, S = 2048 / 8192 full and causal), d128 +5..+6 %, d64 +4 %.
// So a pass before the forward (flash_fwd_vt_pack, fwd_sm90.cuh) writes V^T once into
// the workspace (28 us for 32 MB of V, d256 S = 8192: 3 % of that forward's 858 us), and
// the producer copies its tiles as it copies K (flash_fwd_sm90's kVtGiven instance): fp8
// d256 full S = 2048 / 8192 / 16384 +16 / +25 / +33 %, causal 2048 / 8192 +3 / +26 %
// (H100, pass included; docs/benchmarks.md, 2026-11-27 (32)).
// Sequence b's keys start at column vt_seq_start(k_start, b), 16-byte aligned, with
// zeros up to the next 128 keys (the tiles' keys past the sequence: transpose_v_e4m3's
// zeroed keys, so that rows past it holding NaN stay out of P V) and never reaching
// sequence b + 1's: each sequence gets kVtSeqPad columns more than its keys.
// Columns follow transpose_v_e4m3's key order inside each 16 (V^T column 16c + 4t + j
// holds key 16c + 2t + (j & 1) + 8 (j >> 1)), so tiles must start on a sequence's key 0,
// 128, ...: calls with a left window (tiles from any key) keep the transposes.
constexpr int kVtSeqPad = 144;  // 127 zero keys at most + 15 of alignment, rounded up to 16
constexpr size_t kVtOffset = 1024;  // past the walk's item counter, 1 KB aligned
XLA_ATTN_HOST_DEVICE constexpr int64_t vt_seq_start(int64_t k_start, int b) {
  return (k_start + int64_t(kVtSeqPad) * b + 15) & ~int64_t(15);
}
XLA_ATTN_HOST_DEVICE constexpr int64_t vt_cols(int64_t total_k, int batch) {
  return (total_k + int64_t(kVtSeqPad) * batch + 16 + 15) & ~int64_t(15);
}
// Where V comes given transposed: sequences of enough queries (the pass costs alike per
// key; the forward's per-key work, and its gain, grow with the rows a key meets: at d256
// S = 512 the pass cost 14 %, the same run). d256 from kVtMinRows (measured above); d64
// / d128 (whose transposes cost 4-6 %, above) past their walks (kWalkMaxRowsFp8), from
// kVtMinRowsNarrow rows, twice that with a right window (causal: half the rows meet a
// key). H200, same run, best of 3 rounds, against the transposes (pass included): d128
// full S = 4096 / 8192 / 16384 +5.3 / +6.4 / +9.7 %, causal 4096 / 8192 / 16384 -4.2 /
// +5.8 / +1.3 % (medians -1.2 / +3.9 / +5.2 %); d64 full 4096 / 16384 +1.8 / +7.5 %,
// causal 8192 +3.6 % (docs/benchmarks.md, 2026-12-02 (58)).
constexpr int kVtMinRows = 2048;
constexpr int kVtMinRowsNarrow = 4096;
static_assert(kVtMinRowsNarrow > kWalkMaxRowsFp8, "d64 / d128 with V given: not their walks");
XLA_ATTN_HOST_DEVICE constexpr bool vt_given_covers(int head_dim, int max_seqlen_q,
                                                    bool right_window) {
  return fp8_covers(head_dim) &&
         (fp8_bucket(head_dim) == 256
              ? max_seqlen_q >= kVtMinRows
              : max_seqlen_q >= (right_window ? 2 : 1) * int64_t(kVtMinRowsNarrow));
}
// flash_fwd_vt_pack's keys a block: one V^T tile (block_n at fp8)
constexpr int kVtPackKeys = 128;
XLA_ATTN_HOST_DEVICE constexpr int64_t vt_workspace_bytes(int64_t total_k, int batch,
                                                          int heads_k, int head_dim) {
  return int64_t(kVtOffset) + int64_t(heads_k) * head_dim * vt_cols(total_k, batch);
}

// Backward (flash/bwd_sm90.cuh): the dk/dv kernel of the atomic-dQ path at the d64 and
// d128 buckets (33-128). One block = a producer warpgroup and two consumer warpgroups of
// 64 keys each (wgmma's M: S^T = K Q^T, dP^T = V dO^T), so 128 keys a block; tiles of
// bwd_rows(d) query rows of Q, dO (and their lse, D) stream through kStages stages. A
// consumer thread holds dK and dV (D / 2 f32 each), S^T and dP^T (rows / 2 each) and
// its share of dQ (D / 2: d128 on its turns, d64 every tile): d256's dK and dV alone
// would take 256. So at d256 (flash/bwd_sm90_d256.cuh) both consumer warpgroups share a
// block of 64 keys, one holding dV (128 f32), the other dK.
constexpr int kBwdKeys = 64 * kConsumerWarpgroups;
constexpr int kBwdKeysD256 = 64;
constexpr int kBwdRows = 64;
// d64 takes 128-row tiles: S^T and dP^T at N = 128 (64 f32 each a thread, beside dK and
// dV's 64), so that a tile's fixed costs (its waits, barriers, lse / D and dQ staging)
// and each product's shared-memory operand traffic (an N = 64 product reads both
// operands at shared memory's 128 bytes a cycle) spread over twice the rows; dQ = dS K
// is then split by rows between the warpgroups (64 rows, all 64 columns, each).
constexpr int kBwdRowsD64 = 128;
XLA_ATTN_HOST_DEVICE constexpr int bwd_rows(int d) { return d <= 64 ? kBwdRowsD64 : kBwdRows; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_keys(int d) { return d <= 128 ? kBwdKeys : kBwdKeysD256; }
XLA_ATTN_HOST_DEVICE constexpr bool bwd_covers(int head_dim) {
  return head_dim > 32 && head_dim <= 256;
}
// K and V (kBwdKeys rows), kStages stages of Q and dO (bwd_rows rows), bwd_ds_buffers of
// the block's dS^T (kBwdKeys keys x bwd_rows rows, 16-bit, in column blocks of 64 rows:
// one 128-byte row a key), the consumer warps' dQ chunks on their way to the accumulator
// (a warp's 16 rows x bwd_dq_cols(d) columns of f32, in the accumulator's chunk layout),
// each stage's lse and D boxes (bwd_stat_bytes), then the barriers. d128: 64 + 64 + 48 +
// 32 + 1.5 KB (210.5 KB); d64: 32 + 64 + 64 + 32 + 2.5 KB.
// d256: K and V (64 keys), kStages stages of Q and dO, P^T softcap' (f32, 64 keys x 64
// rows) passed from the dV side to the dK side, one buffer of dS^T (the sides meet
// twice a tile), the lse and D floats: 64 + 128 + 16 + 8 + 1 KB (dQ goes out by bulk
// reductions staged in the tile's Q and dO once their products are done: a buffer of its
// own would need 64 KB more).
XLA_ATTN_HOST_DEVICE constexpr int bwd_kv_bytes(int d) { return bwd_keys(d) * 2 * d; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_rows_bytes(int d) { return bwd_rows(d) * 2 * d; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_ds_bytes(int d) { return kBwdKeys * bwd_rows(d) * 2; }
// dQ = dS K over the block's 128 keys. d128: one warpgroup a tile computes the whole 64 x
// 128 dQ tile (N = 128), the warpgroups in turns by tile parity (cuDNN's d128 backward
// kernel does so, ncu source view), and a tile late: in tile it, warpgroup it % 2 computes
// tile it - 1's dQ after its own element-wise section, so that it never waits for the
// other's dS^T of the tile it is in (flash/bwd_sm90.cuh). That takes three dS^T buffers,
// and lse / D rows a warpgroup. d64 splits its 128-row tiles by rows (64 rows, all 64
// columns, each warpgroup, in the tile itself). A consumer warp stages its 16 rows x
// bwd_dq_cols(d) f32 of dQ in a slice: d64 a slice a consumer warp, d128 a slice a warp of
// the warpgroup whose turn it is.
XLA_ATTN_HOST_DEVICE constexpr bool bwd_dq_late(int d) { return d > 64 && d <= 128; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_dq_cols(int d) { return bwd_dq_late(d) ? 128 : 64; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_dq_warp_bytes(int d) { return 16 * bwd_dq_cols(d) * 4; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_dq_bytes(int d) {
  return 4 * (bwd_dq_late(d) ? 1 : kConsumerWarpgroups) * bwd_dq_warp_bytes(d);
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_ds_buffers(int d) { return bwd_dq_late(d) ? 3 : 2; }
constexpr int kBwdPD256Bytes = kBwdKeysD256 * kBwdRows * 4;
constexpr int kBwdDsD256Bytes = kBwdKeysD256 * kBwdRows * 2;
constexpr int kBwdBarrierBytes = 8 * (1 + 2 * kStages);
// A tile's lse and D rows (f32). bwd_stats_staged (d64, d128): copied with the tile's Q
// and dO by the producer (flash/bwd_sm90.cuh, bwd_produce), so that no consumer register
// or barrier carries them from tile to tile. d64: ptxas's spills 36 / 36 -> 0 / 0 bytes,
// fwd+bwd +2.5 / +4.0 % (H200, ncu). d128 lost 1-3 % that way until its dK read dS^T
// from shared memory; with that, 0 / 0 spills and +2.7..+5.8 % (docs/benchmarks.md
// section (46)). d256's consumers load them a tile ahead.
// Staged, two boxes a stage of bwd_stat_box(d) floats from the tile's first row rounded
// down to kBwdStatPad floats: a tensor copy's global start must be 16-byte aligned (boxes
// from any row stopped the H200 with an illegal instruction), so a tile's rows sit 0-3
// floats into its box. Each box in a 128-byte aligned slot (the copy's destination).
XLA_ATTN_HOST_DEVICE constexpr bool bwd_stats_staged(int d) { return d <= 128; }
constexpr int kBwdStatPad = 4;
XLA_ATTN_HOST_DEVICE constexpr int bwd_stat_box(int d) { return bwd_rows(d) + kBwdStatPad; }
// The staged box of the tile whose first row is float `row` of lse / D ([head][row]): the
// float its copy starts at (bwd_produce), and how many floats into the box that row sits
// (the consumers, which pass the row without the tile's i0: a multiple of 64, so the
// same remainder).
XLA_ATTN_HOST_DEVICE constexpr int bwd_stat_box_start(int row) { return row & -kBwdStatPad; }
XLA_ATTN_HOST_DEVICE constexpr int bwd_stat_row_in_box(int row) {
  return row & (kBwdStatPad - 1);
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_stat_slot_bytes(int d) {
  return (bwd_stat_box(d) * 4 + 127) / 128 * 128;
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_stat_bytes(int d) {
  return bwd_stats_staged(d) ? kStages * 2 * bwd_stat_slot_bytes(d)
                             : 2 * 2 * bwd_rows(d) * 4;  // d256: two tiles' lse and D rows
}
XLA_ATTN_HOST_DEVICE constexpr int bwd_smem_bytes(int d) {
  return kAlign + 2 * bwd_kv_bytes(d) + 2 * kStages * bwd_rows_bytes(d) +
         (d <= 128 ? bwd_ds_buffers(d) * bwd_ds_bytes(d) + bwd_dq_bytes(d)
                   : kBwdPD256Bytes + kBwdDsD256Bytes) +
         bwd_stat_bytes(d) + kBwdBarrierBytes;
}
static_assert(bwd_smem_bytes(64) <= kSmemLimit && bwd_smem_bytes(128) <= kSmemLimit &&
                  bwd_smem_bytes(256) <= kSmemLimit,
              "the d64 / d128 / d256 backward tiles exceed 227 KB");
static_assert(bwd_stat_box(64) <= 256 && bwd_stat_box(128) <= 256,
              "a tensor copy's box takes at most 256 elements a dimension");

struct BwdArgs {
  xla_attn_flash_bwd_params p;
  sm90::TensorMap q_map, dout_map, k_map, v_map;
  // bwd_stats_staged: softmax_lse and the delta rows ([num_heads][total_q] f32 each) as
  // one dimension, boxes of bwd_stat_box(d) floats (zeros past the tensor).
  sm90::TensorMap lse_map, delta_map;
};

}  // namespace xla_attn::flash_sm90
