#!/usr/bin/env python3
"""Does compute-sanitizer's racecheck take a named barrier's bar.arrive -> bar.sync as
ordering? A 256-thread block in two warpgroups hands one shared buffer back and forth
for --rounds rounds: the warpgroup whose turn it is writes the buffer (or, --access read,
reads the other's values and writes its own) and hands it over on named barrier 1 + the
round's parity; the other waits there before its turn.

  --mode arrive: the giver bar.arrive's (does not wait), the taker bar.sync's.
  --mode sync:   both bar.sync (the giver also waits).
  --mode none:   no barrier at all; a real race, so racecheck must report it (the control:
                 a probe that cannot fail would prove nothing).

By the PTX ISA both arrive and sync order the giver's accesses before the taker's (the
producer / consumer use of bar.arrive), so hazards reported in arrive mode but not in sync
mode are the tool's, not the code's.

  compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode arrive
  compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode sync
  compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode none

docs/benchmarks.md section (43): the d128 backward with dQ a tile late hands dS^T and the
dQ staging between its warpgroups this way, and racecheck reported write / write hazards
on exactly those hand-overs (none once the arrive was made a wait). Needs cupy and a GPU.
"""
from __future__ import annotations

import argparse

MODES = {"none": 0, "sync": 1, "arrive": 2}

SOURCE = r"""
__device__ __forceinline__ void hand_over(int id, int mode, bool giver) {
  if (mode == 0) return;
  if (giver && mode == 2) {
    asm volatile("bar.arrive %0, 256;" :: "r"(id) : "memory");
  } else {
    asm volatile("bar.sync %0, 256;" :: "r"(id) : "memory");
  }
}

extern "C" __global__ void probe(int* out, int mode, int rounds, int read_first) {
  // write: one buffer, so that each round's writes follow the other warpgroup's; read:
  // two in turns, so that a round reads the other's last round and writes no element
  // its own warpgroup reads in that round
  __shared__ int buf[2][128];
  const int t = threadIdx.x, group = t / 128, lane = t % 128;
  int seen = 0;
  for (int r = 0; r < rounds; ++r) {
    const bool mine = (r % 2) == group;
    if (mine) {
      // the taker of round r - 1's hand-over; another warp wrote buf[127 - lane]
      if (read_first && r > 0) seen += buf[(r - 1) % 2][127 - lane];
      buf[read_first ? r % 2 : 0][lane] = 1000 * r + lane;
    }
    if (r + 1 < rounds) hand_over(1 + r % 2, mode, mine);
  }
  out[t] = seen;
}
"""


def expected(rounds: int, read_first: bool) -> list[int]:
    out = []
    for t in range(256):
        group = t // 128
        seen = 0
        for r in range(1, rounds):
            if read_first and r % 2 == group:
                seen += 1000 * (r - 1) + (127 - t % 128)
        out.append(seen)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=tuple(MODES), default="arrive")
    p.add_argument("--access", choices=("write", "read"), default="write",
                   help="write: write / write hand-overs only; read: the taker reads first")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    import cupy as cp

    kernel = cp.RawKernel(SOURCE, "probe")
    out = cp.full(256, -1, dtype=cp.int32)
    read_first = args.access == "read"
    kernel((1,), (256,), (out, cp.int32(MODES[args.mode]), cp.int32(args.rounds),
                          cp.int32(read_first)))
    got = out.get().tolist()
    ok = got == expected(args.rounds, read_first)
    print(f"racecheck_probe --mode {args.mode} --access {args.access}: "
          f"{'as the hand-overs order them' if ok else 'NOT as ordered (expected in none mode)'}")
    return 0 if ok or args.mode == "none" else 1


if __name__ == "__main__":
    raise SystemExit(main())
