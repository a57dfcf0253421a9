#!/usr/bin/env python3
"""Where a grid of uneven blocks finishes: the list-scheduling model behind the sm90
kernels' longest-first tail (flash/sequence.cuh longest_first_tail, taken by the dk/dv
kernel, the forward's one block an item grid and its persistent walk, whose blocks claim
items in the same order as the hardware starts a grid's blocks: the "fwd" rows).

  python3 tools/tail_model.py [--sms 132]

Each SM runs one block at a time (both sm90 kernels take one block an SM) and takes the
next block in launch order when it frees up; a block's time is its tiles plus a fixed
cost. The makespan is printed over the ideal (all work spread evenly over the SMs) for
the bench's dense causal rows (16 K tokens, H x D = 2048), in launch order and with the
kernels' remap: the last (head, sequence) pairs, enough for two blocks an SM, start
longest first across the pairs. A model, not a measurement: docs/benchmarks.md section
(16) has the A/B on an H100. Then the walk's varlen rows (tools/bench.py's 16 causal
sequences of random lengths, seeds 0-3) with that tail over 2, 4 and 8 items an SM, and
every pair in it: where lengths differ the launcher takes 8 (section (29)). Last, the
full rows, whose equal blocks lose only the last wave's empty SMs (section (54)).
"""
from __future__ import annotations

import argparse
import heapq
import math

TOKENS, WIDTH = 16384, 2048  # tools/bench.py's dense rows
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)  # and their lengths


def makespan(durations, sms: int) -> float:
    """Finish time of blocks started in the given order on `sms` one-block SMs."""
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def tail_first(x: int, y: int, z: int, grid: tuple[int, int, int], batch: int,
               sms: int, waves: int = 2) -> tuple[int, int, int]:
    """The kernels' remap of block (x, y, z): x the block within a (head, sequence) pair,
    y the head, z the sequence; the padding sequence z == batch keeps its place. The tail
    covers `waves` blocks an SM."""
    blocks, heads, _ = grid
    pairs = heads * batch
    tail_pairs = min(pairs, (waves * sms + blocks - 1) // blocks)
    tail0 = (pairs - tail_pairs) * blocks
    linear = x + blocks * (y + heads * z)
    if tail0 <= linear < pairs * blocks:
        j = linear - tail0
        pair = pairs - tail_pairs + j % tail_pairs
        return j // tail_pairs, pair % heads, pair // heads
    return x, y, z


def launch_order(grid: tuple[int, int, int], batch: int, sms: int, remap: bool,
                 waves: int = 2):
    """The blocks' (x, y, z) in the order the kernel works on them: launch order is x
    fastest, then y, then z; the padding sequence's blocks are left out (no work)."""
    blocks, heads, _ = grid
    for z in range(batch):
        for y in range(heads):
            for x in range(blocks):
                yield tail_first(x, y, z, grid, batch, sms, waves) if remap else (x, y, z)


def causal_rows(kernel: str, head_dim: int, seqlen: int):
    """(grid, batch, work of block x) for the bench's causal row: dk/dv blocks of 128 keys
    (64 at d256) over row tiles of 128 (d64) or 64 rows, key block x seeing the rows from
    x x keys on; forward blocks of 128 rows over key tiles of 128 (64 at d256), launched
    last row block first, row block m seeing m + 1 tiles' worth of keys."""
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    if kernel == "bwd":
        keys = 64 if head_dim == 256 else 128
        rows = 128 if head_dim == 64 else 64
        count = seqlen // keys
        return (count, heads, batch + 1), batch, lambda x: (seqlen - x * keys) / rows + 1.0
    keys = 64 if head_dim == 256 else 128
    count = seqlen // 128
    return (count, heads, batch + 1), batch, lambda x: (count - x) * 128 / keys + 1.5


def over_ideal(kernel: str, head_dim: int, seqlen: int, sms: int, remap: bool) -> float:
    grid, batch, work = causal_rows(kernel, head_dim, seqlen)
    durations = [work(x) for x, _, _ in launch_order(grid, batch, sms, remap)]
    return makespan(durations, sms) / (sum(durations) / sms)


def full_over_ideal(kernel: str, head_dim: int, seqlen: int, sms: int) -> float:
    """The bench's full (non-causal) row: every block has the same work (the forward's
    items of 128 rows, 192 at d64, whose partial row block computes every key too; the
    dk/dv blocks of 128 keys, 64 at d256), so the makespan over the ideal is the last
    wave's emptiness: ceil(n / sms) / (n / sms) for n blocks, whatever the order."""
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    if kernel == "bwd":
        blocks = seqlen // (64 if head_dim == 256 else 128)
    else:
        rows = 192 if head_dim == 64 else 128
        blocks = (seqlen + rows - 1) // rows
    n = batch * heads * blocks
    return math.ceil(n / sms) / (n / sms)


def varlen_over_ideal(seed: int, sms: int, waves: int) -> float:
    """The walk's d128 forward on bench.py's varlen row (lengths of `seed`): items of 128
    rows, each pair's last row block first (x = 0), row block m seeing m + 1 tiles of 128
    keys plus a fixed 1.0; items past a sequence's rows are dropped (the walk skips them
    behind its stage ring, docs/benchmarks.md section (19))."""
    from bench import varlen_lengths

    lengths, heads = varlen_lengths(16, 1024, seed), 16
    blocks = (max(lengths) + 127) // 128
    grid = (blocks, heads, len(lengths) + 1)
    durations = []
    for x, _, z in launch_order(grid, len(lengths), sms, True, waves):
        m = blocks - 1 - x
        if m * 128 < lengths[z]:
            durations.append((min(lengths[z], m * 128 + 128) - 1) // 128 + 2.0)
    return makespan(durations, sms) / (sum(durations) / sms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args()
    print("kernel  d    S      launch order  longest-first tail  (makespan / ideal)")
    for kernel, dims in (("bwd", (64, 128, 256)), ("fwd", (128, 256))):
        for d in dims:
            for s in SEQLENS:
                a = over_ideal(kernel, d, s, args.sms, False)
                b = over_ideal(kernel, d, s, args.sms, True)
                print(f"{kernel:6}  {d:<4} {s:<6} {a:12.3f}  {b:18.3f}")
    print("\nfull rows (equal blocks: the last wave's emptiness)  makespan / ideal")
    for kernel, dims in (("bwd", (64, 128, 256)), ("fwd", (64, 128, 256))):
        for d in dims:
            cells = [full_over_ideal(kernel, d, s, args.sms) for s in SEQLENS]
            print(f"{kernel:6}  {d:<4} S = 512 .. 16384: " + " ".join(f"{c:.3f}" for c in cells))
    print("\nwalk, varlen row  tail over 2 / 4 / 8 items an SM / every pair")
    for seed in range(4):
        cells = [varlen_over_ideal(seed, args.sms, w) for w in (2, 4, 8, 1 << 20)]
        print(f"seed {seed}            " + " / ".join(f"{c:.3f}" for c in cells))


if __name__ == "__main__":
    main()
