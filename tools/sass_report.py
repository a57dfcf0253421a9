"""Static SASS report of one kernel module, without a GPU: what ptxas made of it.

  python tools/sass_report.py flash_fwd_sm80 [--ptx-arch 80] [--sm 90] [--kernel bf16_d128]
      [--dump now.sass] [--against before.sass]

The module is compiled as the build compiles it (NVRTC to PTX for --ptx-arch, ptxas to a
cubin for --sm), then disassembled. Per kernel it prints: registers and spill bytes (ptxas
-v), SASS instructions, HMMA, the HMMA whose A or B operand an LDSM wrote fewer than
--near instructions earlier (such an mma stalls on shared memory), wgmma (GMMA), MUFU, local-memory
loads and stores (all, and those between the first and last wgmma), and block barriers.
With --against (a --dump of an earlier build, e.g. of main before a change), also whether
each kernel's machine code is the same as there: "=" the same instructions, "~" changed,
"+" not in that dump. A change meant for some kernels should leave the others "=", and a
timing taken before a comment-only edit still holds where every kernel is "=". A changed
kernel's mark carries how alike its opcode sequence is to the dump's (difflib's ratio, 1.00
the same opcodes in the same order; registers and operands aside): ptxas schedules a kernel
as a whole, so a branch added outside its tile loop can move the loop too. The d128 walk
with a pass added inline read 0.71, with the same pass out of line (__noinline__) 0.92
(docs/benchmarks.md 2026-12-02 (55)).
Below the table: ptxas's warnings and its wgmma notes (ptxas_notes), e.g. products it
serialized, which the build refuses.

Why this check exists: on 2026-11-23, ncu on an H100 traced most of the sm80 forward's
gap to FA2 to two things, both visible in the SASS without a GPU. The S = Q K^T mma waited
on just-issued ldmatrix: 111 of the d128 kernel's 256 HMMA were "near", then 18 after the
fix. The later phased softmax brought the count back to 142, in P V, with no measurable loss.
The softmax's exponentials were also kept out of the P V mma's basic block, which shows as
MUFU runs apart from HMMA runs. docs/benchmarks.md has the measurements.

Needs the build's CUDA wheels (NVRTC and ptxas, pyproject.toml's build-system.requires)
and cuobjdump with nvdisasm, either on PATH or from `pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`.
"""
from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import build_kernels as bk  # noqa: E402

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
PTXAS_KERNEL = re.compile(r"Compiling entry function '(\w+)'")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _nvidia_tool(name: str) -> str | None:
    """A CUDA tool on PATH, else from an nvidia-* wheel's bin folder."""
    found = shutil.which(name)
    if found:
        return found
    for base in {sysconfig.get_paths()["purelib"], *sys.path}:
        for candidate in pathlib.Path(base or ".").glob(f"nvidia/*/bin/{name}"):
            return str(candidate)
    return None


def cuobjdump() -> tuple[str, dict[str, str]]:
    """cuobjdump and the environment it runs in: it disassembles through nvdisasm, which
    it looks for on PATH or NVDISASM_PATH (the CUDA 13 wheels ship them apart)."""
    tool, disasm = _nvidia_tool("cuobjdump"), _nvidia_tool("nvdisasm")
    if not tool or not disasm:
        raise SystemExit("sass_report: needs cuobjdump and nvdisasm on PATH; "
                         "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
    return tool, dict(os.environ, NVDISASM_PATH=str(pathlib.Path(disasm).parent))


def opcode(instruction: str) -> str:
    words = instruction.split()
    if words and words[0].startswith("@"):  # predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def kernels_of(sass: str) -> dict[str, list[str]]:
    """Kernel name -> its SASS instructions in order (cuobjdump -sass text)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = out.setdefault(line.split(":", 1)[1].strip(), [])
        elif current is not None:
            m = INSTRUCTION.search(line)
            if m:
                current.append(m.group(1))
    return out


def is_gmma(op: str) -> bool:
    """Hopper's warpgroup products (wgmma): HGMMA (16-bit), QGMMA (fp8), IGMMA, BGMMA."""
    return op.endswith("GMMA")


def count_gmma(ops: list[str]) -> int:
    return sum(map(is_gmma, ops))


def local_in_gmma_span(ops: list[str]) -> int:
    """Local-memory loads and stores (spills) between a kernel's first and last wgmma:
    the product loops' share of its spills. In a warp-specialized kernel the spill bytes
    ptxas reports move with code in any branch (2026-11-27: four stores added to the
    producer's copying thread took the fp8 d128 walk's consumers from 9 local accesses
    to 34, their own code unchanged; one variant put 25 inside this span, against 1 on
    main), so where they land is the number to watch."""
    at = [i for i, op in enumerate(ops) if is_gmma(op)]
    if not at:
        return 0
    return sum(op in ("LDL", "STL") for op in ops[at[0]:at[-1] + 1])


def near_hmma(instructions: list[str], near: int) -> int:
    """HMMA whose A or B register was written by an LDSM fewer than `near` instructions
    earlier (an LDSM .x4 writes 4 consecutive registers)."""
    written_at: dict[int, int] = {}
    count = 0
    for i, ins in enumerate(instructions):
        op = opcode(ins)
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", ins)]
        if op == "LDSM" and regs:
            for r in range(regs[0], regs[0] + 4):
                written_at[r] = i
        elif op == "HMMA" and len(regs) >= 3:
            if any(i - written_at.get(r, -near) < near for r in regs[1:3]):
                count += 1
    return count


def same_code(a: list[str], b: list[str]) -> bool:
    """Whether two kernels' instructions are the same, whitespace aside (branch targets are
    offsets within the kernel, so moved code shows)."""
    return len(a) == len(b) and all(x.split() == y.split() for x, y in zip(a, b))


def opcode_likeness(a: list[str], b: list[str]) -> float:
    """How alike two kernels' opcode sequences are: difflib's ratio (2 x matched / total),
    operands and predicates aside."""
    return difflib.SequenceMatcher(None, [opcode(x) for x in a], [opcode(x) for x in b],
                                   autojunk=False).ratio()


def against_mark(name: str, ins: list[str], before: dict[str, list[str]] | None) -> str:
    """"=" where `before` (kernels_of an earlier dump) has the kernel with the same code,
    "~R" where its code differs (R: opcode_likeness, two decimals), "+" where it has no
    such kernel; "" without a dump."""
    if before is None:
        return ""
    if name not in before:
        return "+"
    if same_code(ins, before[name]):
        return "="
    return f"~{opcode_likeness(ins, before[name]):.2f}"


def require_module(parser: argparse.ArgumentParser, module: str, what: str = "module") -> None:
    """A command-line error unless `module` is one of the build's modules
    (kernels/dispatch/variants.py), before anything slow runs."""
    names = sorted(m.name for m in bk.vt.MODULES)
    if module not in names:
        parser.error(f"{what} must be one of {names}, got {module!r}")


def compile_module(module: str, ptx_arch: str, sm: str, cubin: pathlib.Path,
                   lineinfo: bool = False) -> str:
    """Module `module` compiled as the build compiles it (NVRTC to PTX for ptx_arch,
    ptxas for sm) into `cubin`; ptxas -v's log. lineinfo: NVRTC's -lineinfo too, which
    maps each instruction to its source line and leaves the code as it was (the d64
    walk: all 9,464 instructions the same)."""
    modules = {m.name: m for m in bk.vt.MODULES}
    tk = bk.toolkit(host=False)
    ptx = bk.nvrtc_ptx(str(tk["nvrtc"]), bk.module_source(modules[module]), f"{module}.cu",
                       ptx_arch, [str(bk.KERNELS), str(tk["cuda_include"])],
                       ("-lineinfo",) if lineinfo else ())
    src = cubin.with_suffix(".ptx")
    src.write_bytes(ptx)
    log = subprocess.run([str(tk["ptxas"]), f"-arch=sm_{sm}", *bk.PTXAS_FLAGS, "-v", str(src),
                          "-o", str(cubin)], check=True, capture_output=True, text=True)
    return log.stdout + log.stderr


# nvdisasm --print-line-info: a function's start, a source line, an instruction
LINE_FUNCTION = re.compile(r"^\.text\.(\w+):")
LINE_SOURCE = re.compile(r'//## File "([^"]+)", line (\d+)')


def source_lines(listing: str, kernel: str) -> list[tuple[str, str, int]]:
    """Each instruction of `kernel` with the source file and line it came from (file
    relative to the repository root where under it, else as given; "" and 0 before the
    first), from `nvdisasm --print-line-info` of a -lineinfo cubin."""
    root = str(bk.KERNELS.parent) + "/"
    out, inside, where = [], False, ("", 0)
    for line in listing.splitlines():
        fn = LINE_FUNCTION.match(line)
        if fn:
            inside = fn.group(1) == kernel
            continue
        if not inside:
            continue
        src = LINE_SOURCE.search(line)
        if src:
            where = (src.group(1).removeprefix(root), int(src.group(2)))
            continue
        ins = INSTRUCTION.search(line)
        if ins:
            out.append((ins.group(1), *where))
    return out


def disassemble_lines(cubin: pathlib.Path, kernel: str) -> list[tuple[str, str, int]]:
    """source_lines of `kernel` in a -lineinfo cubin (nvdisasm)."""
    _, env = cuobjdump()
    nvdisasm = pathlib.Path(env["NVDISASM_PATH"], "nvdisasm")
    listing = subprocess.run([str(nvdisasm), "--print-line-info", "-c", str(cubin)],
                             check=True, capture_output=True, text=True, env=env).stdout
    return source_lines(listing, kernel)


def ptxas_notes(log: str) -> list[str]:
    """ptxas's warnings and its wgmma notes in `log`, which no column of the table shows:
    C7514 / C7515 (products serialized: an accumulator read or written by other
    instructions inside a product's pipeline stage), C7517 / C7519 (a wait or arrive
    injected), e.g. for a product left in flight across a loop's back edge
    (docs/benchmarks.md, 2026-11-28 (40))."""
    return [line.strip() for line in log.splitlines() if "warning" in line or "(C75" in line]


def ptxas_info(log: str) -> dict[str, tuple[int, int, int]]:
    """Kernel name -> (registers, spill store bytes, spill load bytes) from ptxas -v."""
    info, name, spill = {}, None, (0, 0)
    for line in log.splitlines():
        if m := PTXAS_KERNEL.search(line):
            name, spill = m.group(1), (0, 0)
        elif (m := PTXAS_SPILL.search(line)) and name:
            spill = (int(m.group(1)), int(m.group(2)))
        elif (m := PTXAS_REGS.search(line)) and name:
            info[name] = (int(m.group(1)), *spill)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="a module of kernels/dispatch/variants.py, e.g. flash_fwd_sm80")
    parser.add_argument("--ptx-arch", default="80", help="NVRTC virtual arch (default 80)")
    parser.add_argument("--sm", default="90", help="ptxas real arch (default 90)")
    parser.add_argument("--kernel", default="", help="regex on kernel names")
    parser.add_argument("--near", type=int, default=6, help="LDSM-to-HMMA distance (default 6)")
    parser.add_argument("--dump", help="also write the whole SASS (cuobjdump -sass) to this file, "
                        "e.g. to find a sanitizer's kernel+offset")
    parser.add_argument("--against", help="a --dump of an earlier build: mark each kernel "
                        "= (same machine code), ~ (changed) or + (new)")
    args = parser.parse_args(argv)
    before = (kernels_of(pathlib.Path(args.against).read_text()) if args.against else None)

    require_module(parser, args.module)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp, "m.cubin")
        log = compile_module(args.module, args.ptx_arch, args.sm, cubin)
        tool, env = cuobjdump()
        sass = subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True, env=env).stdout
    if args.dump:
        pathlib.Path(args.dump).write_text(sass)
    info = ptxas_info(log)
    print(f"{args.module}: compute_{args.ptx_arch} PTX -> sm_{args.sm}")
    print(f"{'kernel':44} {'regs':>4} {'spill st/ld':>11} {'instr':>6} {'HMMA':>5} "
          f"{'near':>5} {'GMMA':>5} {'MUFU':>5} {'LDL/STL':>7} {'@GMMA':>5} {'BAR':>4}"
          + ("  vs" if before is not None else ""))
    for name, ins in sorted(kernels_of(sass).items()):
        if not re.search(args.kernel, name):
            continue
        ops = [opcode(x) for x in ins]
        regs, st, ld = info.get(name, (0, 0, 0))
        print(f"{name:44} {regs:4} {f'{st}/{ld}':>11} {len(ins):6} {ops.count('HMMA'):5} "
              f"{near_hmma(ins, args.near):5} {count_gmma(ops):5} {ops.count('MUFU'):5} "
              f"{ops.count('LDL') + ops.count('STL'):7} {local_in_gmma_span(ops):5} "
              f"{ops.count('BAR'):4}" + (f"   {against_mark(name, ins, before)}"
                                         if before is not None else ""))
    for line in ptxas_notes(log):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
