#!/usr/bin/env python3
"""Instructions executed and warp stall samples of one profiled kernel, summed by SASS
opcode, from Nsight Compute's source page: how docs/benchmarks.md section 2026-11-26 (22)
set our short-row forward beside cuDNN's (same MUFU and HGMMA counts; cuDNN's max over
every element; our consumers' stalls on the mbarriers that say a K tile has landed).

  ncu --section SourceCounters --section WarpStateStats -k regex:NAME -c 1 -o rep \\
      python3 tools/profile_op.py fwd --seqlen 512
  ncu -i rep.ncu-rep --page source --print-source sass --csv > rep.csv
  python3 tools/ncu_ops.py rep.csv [other.csv ...] [--top 28] [--waits 8]

Per file: the instructions executed and stall samples in all, then the --top opcodes
(predicate and modifiers stripped: `@!P0 BRA` is BRA, `HGMMA.64x128x16.F32.BF16` HGMMA)
by instructions executed with their share of the stall samples, then the same by class
(CLASSES: exponentials, FP32, tensor cores, barriers, branches, memory, the rest), then
the --waits mbarrier operands (`SYNCS... [UR39+0x38030]`) with the most stall samples:
which barrier the warps wait on. A wait's samples include those of the branch that
retries it (`@!P0 BRA` right after `TRYWAIT P0, [...]`), where ptxas's loop puts most of
them: the d256 forward's wait for its Q held 0.1 % on the try-wait and 11.6 % on that
branch (docs/benchmarks.md, 2026-11-28 (38)).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from dataclasses import dataclass, field

from sass_report import opcode  # a SASS line's opcode, predicate and modifiers stripped

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
# an mbarrier wait's predicate and operand: SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR39+0x38030], R2
WAIT = re.compile(r"SYNCS\.\S*TRYWAIT\S*\s+(\w+),\s*\[([^\]]+)\]")
# the branch that retries it while its predicate is false: @!P0 BRA 0x7f6cef7da310
RETRY = re.compile(r"^@!(\w+)\s+BRA\b")
# opcode classes (by opcode, as `opcode` strips it), in the order they are tried
CLASSES = (
    ("exponentials (MUFU)", ("MUFU",)),
    ("FP32 and packing", ("FADD", "FFMA", "FMUL", "FMNMX", "FSEL", "FSETP", "F2FP", "FCHK")),
    ("tensor cores (HGMMA, DEPBAR)", ("HGMMA", "WARPGROUP")),
    ("barriers", ("SYNCS", "BAR", "NANOSLEEP", "FENCE", "WARPSYNC", "B2R", "MEMBAR")),
    ("branches, EXIT", ("BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "VOTE", "BRX", "JMP")),
    ("memory, shuffles", ("LDS", "STS", "LDG", "STG", "LDL", "STL", "LDSM", "STSM", "SHFL",
                          "ATOM", "ATOMS", "RED", "UTMALDG", "UTMASTG", "UBLKCP", "LDC")),
)
OTHER = "integer, uniform, moves"


def op_class(op: str) -> str:
    return next((name for name, ops in CLASSES if op in ops), OTHER)


@dataclass
class Profile:
    kernel: str = ""
    executed: collections.Counter = field(default_factory=collections.Counter)
    stalls: collections.Counter = field(default_factory=collections.Counter)
    waits: collections.Counter = field(default_factory=collections.Counter)


def number(cell: str) -> float:
    cell = cell.replace(",", "").strip()
    return float(cell) if cell else 0.0


def read(path: str) -> Profile:
    """A source-page CSV (one kernel) summed by opcode."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    prof = Profile()
    for i, row in enumerate(rows):
        if row and row[0] == "Kernel Name" and len(row) > 1:
            prof.kernel = row[1]
        if row and row[0] == "Address":
            header, body = row, rows[i + 1:]
            break
    else:
        raise ValueError(f"{path}: no 'Address' header row: not an ncu --page source --csv export")
    missing = [c for c in ("Source", EXECUTED, SAMPLES) if c not in header]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing (profile with --section "
                         "SourceCounters --section WarpStateStats)")
    src, ex, st = header.index("Source"), header.index(EXECUTED), header.index(SAMPLES)
    width = max(src, ex, st)
    last_wait = None  # (predicate, operand) of the instruction before, if a try-wait
    for row in body:
        if len(row) <= width:
            continue
        op, samples = opcode(row[src]), number(row[st])
        prof.executed[op] += number(row[ex])
        prof.stalls[op] += samples
        retry = RETRY.match(row[src].strip())
        if last_wait and retry and retry.group(1) == last_wait[0]:
            prof.waits[last_wait[1]] += samples
        wait = WAIT.search(row[src])
        if wait:
            prof.waits[wait.group(2).strip()] += samples
        last_wait = (wait.group(1), wait.group(2).strip()) if wait else None
    return prof


def report(prof: Profile, top: int, waits: int) -> str:
    executed, samples = sum(prof.executed.values()), sum(prof.stalls.values())
    lines = [f"{prof.kernel or '(kernel)'}: {executed:.4g} instructions executed, "
             f"{samples:.0f} stall samples"]
    for op, n in prof.executed.most_common(top):
        lines.append(f"  {op:12s} {100 * n / max(executed, 1):5.1f} %  {n:12.0f}  "
                     f"stalls {100 * prof.stalls[op] / max(samples, 1):5.1f} %")
    classes_ex, classes_st = collections.Counter(), collections.Counter()
    for op, n in prof.executed.items():
        classes_ex[op_class(op)] += n
    for op, n in prof.stalls.items():
        classes_st[op_class(op)] += n
    for name, n in classes_st.most_common():
        lines.append(f"  [{name}] {100 * classes_ex[name] / max(executed, 1):5.1f} % executed  "
                     f"stalls {100 * n / max(samples, 1):5.1f} %")
    for operand, n in prof.waits.most_common(waits):
        lines.append(f"  wait [{operand}]  stalls {100 * n / max(samples, 1):5.1f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=28, help="opcodes shown (by instructions executed)")
    p.add_argument("--waits", type=int, default=8, help="mbarrier operands shown (by stalls)")
    args = p.parse_args(argv)
    for path in args.csv:
        print(report(read(path), args.top, args.waits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
