#!/usr/bin/env python3
"""Instructions executed and warp stall samples of one profiled kernel, summed by SASS
opcode, from Nsight Compute's source page: how docs/benchmarks.md section 2026-11-26 (22)
set our short-row forward beside cuDNN's (same MUFU and HGMMA counts; cuDNN's max over
every element; our consumers' stalls on the mbarriers that say a K tile has landed).

  ncu --section SourceCounters --section WarpStateStats -k regex:NAME -c 1 -o rep \\
      python3 tools/profile_op.py fwd --seqlen 512
  ncu -i rep.ncu-rep --page source --print-source sass --csv > rep.csv
  python3 tools/ncu_ops.py rep.csv [other.csv ...] [--top 28] [--waits 8] [--per MUFU]
      [--by-count 8]
      [--lines MODULE [--ptx-arch 90a] [--sm 90a] [--top-lines 25] [--ops LDS,IMAD]]

Per file: the instructions executed and stall samples in all, then the --top opcodes
(predicate and modifiers stripped: `@!P0 BRA` is BRA, `HGMMA.64x128x16.F32.BF16` HGMMA)
by instructions executed with their share of the stall samples, then the same by class
(CLASSES: exponentials, FP32, tensor cores, barriers, branches, memory, the rest), then
the --waits mbarrier operands (`SYNCS... [UR39+0x38030]`) with the most stall samples:
which barrier the warps wait on. A wait's samples include those of the branch that
retries it (`@!P0 BRA` right after `TRYWAIT P0, [...]`), where ptxas's loop puts most of
them: the d256 forward's wait for its Q held 0.1 % on the try-wait and 11.6 % on that
branch (docs/benchmarks.md, 2026-11-28 (38)).

--by-count N: the instructions grouped by how many times each ran (a tile loop's code
shares one count, an item's another), the N groups with the most stall samples: where a
kernel's time goes beside its tile loop (docs/benchmarks.md 2026-11-29 (51)).

--per OPCODE: the files side by side, each opcode's instructions executed per executed
OPCODE (the --top opcodes of all files together). With MUFU, one exponential a score:
instructions a score, as docs/benchmarks.md 2026-11-29 (48) set our d128 S = 512 forward
beside cuDNN's (its FMUL 2.19, FADD 1.97, FMNMX 1.02 a score against our FADD 1.03, FFMA
1.01: cuDNN issues more softmax instructions, not fewer).

--lines MODULE (one of kernels/dispatch/variants.py's, e.g. flash_fwd_sm90_walk, built
from the sources that were profiled): the same sums per source line. The module is
compiled here, without a GPU, as the build compiles it plus NVRTC's -lineinfo (which
leaves the code as it was), and the profiled kernel's instructions are matched one to
one with that build's, opcode by opcode; a mismatch is an error (other sources, other
toolkit). Prints the --top-lines lines by stall samples and by integer / uniform
instructions executed, and with --ops the (opcode, line) pairs executing the most of those
opcodes (docs/benchmarks.md 2026-11-29 (47): the backward walk's extra LDS, its record's
reads in the tile loop).
"""
from __future__ import annotations

import argparse
import collections
import csv
import pathlib
import re
import sys
import tempfile
from dataclasses import dataclass, field

import sass_report
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


def by_class(per_op: collections.Counter) -> collections.Counter:
    """A per-opcode count summed by class (op_class)."""
    out = collections.Counter()
    for op, n in per_op.items():
        out[op_class(op)] += n
    return out


@dataclass
class Profile:
    kernel: str = ""
    executed: collections.Counter = field(default_factory=collections.Counter)
    stalls: collections.Counter = field(default_factory=collections.Counter)
    waits: collections.Counter = field(default_factory=collections.Counter)
    # each instruction in address order: (SASS, executed, stall samples)
    rows: list = field(default_factory=list)


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
        sass, executed, samples = row[src].strip(), number(row[ex]), number(row[st])
        op = opcode(sass)
        prof.rows.append((sass, executed, samples))
        prof.executed[op] += executed
        prof.stalls[op] += samples
        retry = RETRY.match(sass)
        if last_wait and retry and retry.group(1) == last_wait[0]:
            prof.waits[last_wait[1]] += samples
        wait = WAIT.search(sass)
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
    classes_ex = by_class(prof.executed)
    for name, n in by_class(prof.stalls).most_common():
        lines.append(f"  [{name}] {100 * classes_ex[name] / max(executed, 1):5.1f} % executed  "
                     f"stalls {100 * n / max(samples, 1):5.1f} %")
    for operand, n in prof.waits.most_common(waits):
        lines.append(f"  wait [{operand}]  stalls {100 * n / max(samples, 1):5.1f} %")
    return "\n".join(lines)


def per_report(profiles: list[Profile], per: str, top: int) -> str:
    """The profiles side by side: each opcode's instructions executed per executed `per`
    (the `top` opcodes by their sum over the profiles, shares of each file's total)."""
    for prof in profiles:
        if not prof.executed[per]:
            raise ValueError(f"{prof.kernel or '(kernel)'} executed no {per}")
    totals = [sum(prof.executed.values()) for prof in profiles]
    shares = collections.Counter()
    for prof, total in zip(profiles, totals):
        for op, n in prof.executed.items():
            shares[op] += n / total
    names = [f"#{i + 1}" for i in range(len(profiles))]
    files = ", ".join(f"{name} {prof.kernel or '(kernel)'}" for name, prof in zip(names, profiles))
    lines = [f"instructions executed per {per}: {files}",
             f"  {'opcode':12s}" + "".join(f"{name:>9s}" for name in names)]
    rows = [("all", totals)]
    rows += [(op, [p.executed[op] for p in profiles]) for op, _ in shares.most_common(top)]
    for op, counts in rows:
        lines.append(f"  {op:12s}" + "".join(f"{n / p.executed[per]:9.2f}"
                                            for n, p in zip(counts, profiles)))
    return "\n".join(lines)


def count_report(prof: Profile, top: int) -> str:
    """The instructions grouped by how many times each ran (Instructions Executed): code
    run once a tile, once an item or once a block shares a count, so the groups split the
    stall samples between a kernel's tile loop and what runs around it. Per group, the
    `top` groups by stall samples: the count, its instructions (first and last in address
    order), their share of the stall samples and of the instructions executed
    (docs/benchmarks.md 2026-11-29 (51): at d128 S = 512, cuDNN's forward spends 13 % of
    its samples in code run once an item, ours 31 %)."""
    groups: dict[float, list[int]] = collections.defaultdict(list)
    for i, (_, executed, _) in enumerate(prof.rows):
        groups[executed].append(i)
    total_ex, total_st = sum(prof.executed.values()), sum(prof.stalls.values())
    samples = {n: sum(prof.rows[i][2] for i in at) for n, at in groups.items()}
    out = [f"{prof.kernel or '(kernel)'}: instructions by times executed, the {top} groups "
           "with the most stall samples"]
    for n in sorted(groups, key=lambda n: (-samples[n], -n))[:top]:
        at = groups[n]
        out.append(f"  {n:12,.0f} times: {len(at):5d} instructions (#{at[0]}..#{at[-1]})  "
                   f"stalls {100 * samples[n] / max(total_st, 1):5.1f} %  "
                   f"executed {100 * n * len(at) / max(total_ex, 1):5.1f} %")
    return "\n".join(out)


def matched_opcodes(prof: Profile, lines: list[tuple[str, str, int]]) -> list[str]:
    """The profiled kernel's opcodes, checked one to one against `lines` (each instruction
    of the same kernel built with line information, sass_report.source_lines, in the
    profile's order)."""
    ops = [opcode(x) for x, _, _ in prof.rows]
    built = [opcode(x) for x, _, _ in lines]
    if ops != built:
        differ = sum(a != b for a, b in zip(ops, built)) + abs(len(ops) - len(built))
        raise ValueError(f"{prof.kernel}: the -lineinfo build's code is not the profiled "
                         f"kernel's ({differ} of {len(ops)} instructions differ, "
                         f"{len(built)} built): profile and build the same sources")
    return ops


def ops_report(prof: Profile, lines: list[tuple[str, str, int]], wanted: list[str],
               top: int) -> str:
    """The source lines that execute the most of the opcodes `wanted` (e.g. LDS, IMAD:
    where a variant's extra instructions of a kind come from), per opcode and line."""
    ops = matched_opcodes(prof, lines)
    executed = collections.Counter()
    for op, (_, ex, _), (_, path, line) in zip(ops, prof.rows, lines):
        if op in wanted:
            executed[(op, f"{path}:{line}")] += ex
    out = [f"{prof.kernel}: the {top} (opcode, source line) pairs of {', '.join(wanted)} "
           "by instructions executed"]
    for (op, where), n in executed.most_common(top):
        out.append(f"  {op:10s} {n:14,.0f}  {where}")
    return "\n".join(out)


def line_report(prof: Profile, lines: list[tuple[str, str, int]], top: int) -> str:
    """Executed instructions and stall samples per source line: `lines` holds each
    instruction of the same kernel built with line information (sass_report.source_lines),
    in the profile's order."""
    ops = matched_opcodes(prof, lines)
    executed, samples = collections.Counter(), collections.Counter()
    integer = collections.Counter()
    for op, (_, ex, st), (_, path, line) in zip(ops, prof.rows, lines):
        where = f"{path}:{line}"
        executed[where] += ex
        samples[where] += st
        if op_class(op) == OTHER:
            integer[where] += ex
    total_ex, total_st = sum(executed.values()), sum(samples.values())
    out = [f"{prof.kernel}: by source line, the {top} with the most stall samples"]
    for where, n in samples.most_common(top):
        out.append(f"  {100 * n / max(total_st, 1):5.1f} % stalls  "
                   f"{100 * executed[where] / max(total_ex, 1):5.1f} % executed  {where}")
    out.append(f"{prof.kernel}: by source line, the {top} with the most {OTHER} executed")
    for where, n in integer.most_common(top):
        out.append(f"  {100 * n / max(total_ex, 1):5.1f} % executed  "
                   f"{100 * samples[where] / max(total_st, 1):5.1f} % stalls  {where}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=28, help="opcodes shown (by instructions executed)")
    p.add_argument("--waits", type=int, default=8, help="mbarrier operands shown (by stalls)")
    p.add_argument("--lines", metavar="MODULE", help="also per source line, from this module "
                   "compiled here with -lineinfo (the profiled sources)")
    p.add_argument("--ptx-arch", default="90a", help="--lines: NVRTC virtual arch (default 90a)")
    p.add_argument("--sm", default="90a", help="--lines: ptxas real arch (default 90a)")
    p.add_argument("--top-lines", type=int, default=25, help="--lines: source lines shown")
    p.add_argument("--ops", default="", help="--lines: also the lines executing the most of "
                   "these opcodes, comma-separated (e.g. LDS,IMAD)")
    p.add_argument("--by-count", type=int, metavar="N", default=0, help="also the N groups "
                   "of instructions that ran the same number of times (a tile loop, an item's "
                   "code) with the most stall samples")
    p.add_argument("--per", metavar="OPCODE", help="also the files side by side, each "
                   "opcode's count per executed OPCODE (e.g. MUFU: per exponential)")
    args = p.parse_args(argv)
    if args.ops and not args.lines:
        p.error("--ops needs --lines MODULE")
    if args.lines:
        sass_report.require_module(p, args.lines, "--lines: module")
    profiles = [read(path) for path in args.csv]
    for prof in profiles:
        print(report(prof, args.top, args.waits))
        if args.by_count:
            print(count_report(prof, args.by_count))
    if args.per:
        try:
            print(per_report(profiles, args.per, args.top))
        except ValueError as e:
            p.error(f"--per: {e}")
    if args.lines:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = pathlib.Path(tmp, "m.cubin")
            sass_report.compile_module(args.lines, args.ptx_arch, args.sm, cubin, lineinfo=True)
            for prof in profiles:
                lines = sass_report.disassemble_lines(cubin, prof.kernel)
                print(line_report(prof, lines, args.top_lines))
                if args.ops:
                    print(ops_report(prof, lines, args.ops.split(","), args.top_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
