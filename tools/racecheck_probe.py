#!/usr/bin/env python3
"""Does compute-sanitizer's racecheck take a named barrier's bar.arrive -> bar.sync as
ordering? A 256-thread block: warps 0-3 write shared memory and arrive on named barrier 1
(--mode arrive: bar.arrive, which does not wait; --mode sync: bar.sync), warps 4-7 wait
there (bar.sync) and read what the others wrote. By the PTX ISA both modes order the
writes before the reads (the producer / consumer use of bar.arrive), so a hazard reported
in arrive mode alone is the tool's, not the code's.

  compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode arrive
  compute-sanitizer --tool racecheck python3 tools/racecheck_probe.py --mode sync

docs/benchmarks.md section (43): the d128 backward with dQ a tile late hands dS^T and the
dQ staging between its warpgroups this way, and racecheck reported hazards on exactly
those hand-overs (none once the arrive was made a wait). Needs cupy and a GPU.
"""
from __future__ import annotations

import argparse

SOURCE = r"""
extern "C" __global__ void probe(int* out, int arrive) {
  __shared__ int buf[128];
  const int t = threadIdx.x;
  if (t < 128) {
    buf[t] = 3 * t + 1;
    if (arrive) {
      asm volatile("bar.arrive 1, 256;" ::: "memory");
    } else {
      asm volatile("bar.sync 1, 256;" ::: "memory");
    }
  } else {
    asm volatile("bar.sync 1, 256;" ::: "memory");
    out[t - 128] = buf[255 - t];  // another warp's write
  }
}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("arrive", "sync"), default="arrive")
    args = p.parse_args()
    import cupy as cp

    kernel = cp.RawKernel(SOURCE, "probe")
    out = cp.full(128, -1, dtype=cp.int32)
    kernel((1,), (256,), (out, cp.int32(args.mode == "arrive")))
    got = out.get().tolist()
    want = [3 * (127 - i) + 1 for i in range(128)]
    ok = got == want
    print(f"racecheck_probe --mode {args.mode}: reads {'as written' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
