#!/usr/bin/env python3
"""Is every input check seen by a test? Replaces the condition of each check in
src/xla_attn/_ops.py (`c.value(...)`, `c.type(...)`, and `self.` ones in `_Check`) by
`True`, one at a time, in a copy of the package, and runs the given tests against it.
A check whose tests still pass is one that no test needs: either a test is missing, or
the check is dead.

  python3 tools/check_sweep.py [--only 3,14] [--list] [TESTS ...]
  python3 tools/check_sweep.py --native [--python PY] [--only ...] [--list] [TESTS ...]

TESTS default to the CPU tests that give the frontends bad input. The native library is
the installed package's, or XLA_ATTN_LIBRARY's. Each check costs one pytest run (-x: a
killed check stops at its first failure), ~10-35 s on 2 cores; the whole sweep (54
checks) took ~20 minutes there.

--native does the same to the native library's checks (`.expect(condition, ...)` in the
FFI handlers and the ops' validate.cc): the condition becomes `true` in a copy of the
source tree, which is built with CMake + Ninja (PY: a Python with the build's wheels,
as for a dev build; XLA_ATTN_CUDA_ARCHS=90 keeps the kernels to one arch, and they come
from the kernel cache after the first build), and the tests run against that library
with the installed package's Python. ~15-40 s a check on 2 cores.
"""
from __future__ import annotations

import argparse
import ast
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "xla_attn"
DEFAULT_TESTS = ["tests/test_errors_cpu.py", "tests/test_torch_cpu.py", "tests/test_flash_cpu.py",
                 "tests/test_paged_cpu.py", "tests/test_cache_cpu.py"]


def checks(source: str) -> list[ast.Call]:
    """The check calls whose first argument is the condition, in source order."""
    found = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("value", "type") and isinstance(n.func.value, ast.Name)
             and n.func.value.id in ("c", "self") and n.args]
    return sorted(found, key=lambda n: (n.args[0].lineno, n.args[0].col_offset))


def without(source: str, call: ast.Call) -> str:
    """The source with `call`'s condition replaced by True."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    cond = call.args[0]
    # ast columns are UTF-8 byte offsets; _ops.py's checks sit on ASCII lines
    begin = starts[cond.lineno - 1] + cond.col_offset
    end = starts[cond.end_lineno - 1] + cond.end_col_offset
    return source[:begin] + "True" + source[end:]


NATIVE_SOURCES = ["kernels/ffi/*.cc", "kernels/ffi/common.h", "kernels/*/validate.cc"]
NATIVE_TESTS = ["tests/test_native_checks_cpu.py", "tests/test_errors_cpu.py",
                "tests/test_xla_legacy_cpu.py"]


def native_checks(source: str) -> list[tuple[int, int]]:
    """The (begin, end) offsets of each `.expect(` call's first argument in C++ source:
    up to the first comma outside brackets, strings and comments."""
    spans, at = [], source.find(".expect(")
    while at >= 0:
        begin = i = at + len(".expect(")
        depth = 0
        while not (depth == 0 and source[i] in ",)"):
            ch = source[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch in "\"'":  # a literal: skip to its closing quote
                i += 1
                while source[i] != ch:
                    i += 2 if source[i] == "\\" else 1
            elif source.startswith("//", i):
                i = source.index("\n", i)
            i += 1
        spans.append((begin, i))
        at = source.find(".expect(", i)
    return spans


def clauses(source: str, span: tuple[int, int]) -> list[tuple[int, int]]:
    """The operands of a condition that is a conjunction at its top level (`a && b`),
    else the whole condition: each one a check of its own for the sweep."""
    parts, depth, begin, i = [], 0, span[0], span[0]
    while i < span[1]:
        ch = source[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch in "\"'":
            i += 1
            while source[i] != ch:
                i += 2 if source[i] == "\\" else 1
        elif source.startswith("//", i):
            i = source.index("\n", i)
        elif depth == 0 and source.startswith("||", i):
            return [span]  # a disjunction or a mixture: taken out whole
        elif depth == 0 and source.startswith("&&", i):
            parts.append((begin, i))
            begin = i + 2
            i += 1
        i += 1
    parts.append((begin, span[1]))
    # without the whitespace and line comments round each operand
    trimmed = []
    for b, e in parts:
        while True:
            rest = source[b:e]
            b += len(rest) - len(rest.lstrip())
            if not source.startswith("//", b):
                break
            b = source.index("\n", b)
        lines = source[b:e].split("\n")
        if "//" in lines[-1] and '"' not in lines[-1]:
            lines[-1] = lines[-1].split("//")[0]
        trimmed.append((b, b + len("\n".join(lines).rstrip())))
    return trimmed


def native_without(source: str, span: tuple[int, int]) -> str:
    return source[:span[0]] + "true" + source[span[1]:]


def native_sweep(args) -> int:
    files = sorted({p for pattern in NATIVE_SOURCES for p in ROOT.glob(pattern)})
    found = [(path, part) for path in files for span in native_checks(path.read_text())
             for part in (clauses(path.read_text(), span) if args.clauses else [span])]
    only = {int(x) for x in args.only.split(",") if x}
    survivors = []
    with tempfile.TemporaryDirectory() as tmp:
        tree, build = pathlib.Path(tmp) / "src", pathlib.Path(tmp) / "build"
        tracked = subprocess.run(["git", "ls-files", "CMakeLists.txt", "kernels", "tools"],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
        for name in tracked.stdout.split():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
        configure = ["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja",
                     f"-DPython_EXECUTABLE={args.python}", "-DCMAKE_BUILD_TYPE=Release"]
        if not args.list:
            subprocess.run(configure, check=True, capture_output=True)
        env = dict(os.environ, XLA_ATTN_LIBRARY=str(build / "libxla_attn.so"))
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *(["-k", args.k] if args.k else []), *(str(ROOT / t) for t in args.tests)]
        if not args.list:  # the unchanged library must pass, or every check reads as killed
            subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
            base = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if base.returncode:
                print(f"the tests fail on the unchanged library:\n{base.stdout[-2000:]}")
                return 2
        for i, (path, span) in enumerate(found):
            source = path.read_text()
            rel = path.relative_to(ROOT)
            line = source.count("\n", 0, span[0]) + 1
            text = " ".join(source[span[0]:span[1]].split())[:90]
            if args.list:
                print(f"{i:3d} {rel}:{line}: {text}")
                continue
            if only and i not in only:
                continue
            (tree / rel).write_text(native_without(source, span))
            made = subprocess.run(["ninja", "-C", str(build)], capture_output=True, text=True)
            (tree / rel).write_text(source)
            if made.returncode:
                print(f"{i:3d} {rel}:{line}: does not build: {made.stdout[-300:]}", flush=True)
                survivors.append(i)
                continue
            run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            status = "killed" if run.returncode else "SURVIVED"
            if not run.returncode:
                survivors.append(i)
            print(f"{i:3d} {rel}:{line}: {status}: {text}", flush=True)
    if not args.list:
        print(f"{len(survivors)} of {len(only) or len(found)} checks no test needs: {survivors}")
    return 1 if survivors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*")
    ap.add_argument("--native", action="store_true", help="sweep the native library's checks")
    ap.add_argument("--clauses", action="store_true",
                    help="--native: take out each operand of a top-level && on its own")
    ap.add_argument("--python", default=sys.executable,
                    help="--native: the Python CMake builds with (its CUDA and jaxlib wheels)")
    ap.add_argument("--only", default="", help="comma-separated check numbers (see --list)")
    ap.add_argument("--list", action="store_true", help="print the checks and stop")
    ap.add_argument("-k", default="", help="pytest -k expression (e.g. to leave out tests "
                                           "that need a build's arch list)")
    args = ap.parse_args()
    if args.native:
        args.tests = args.tests or NATIVE_TESTS
        return native_sweep(args)
    args.tests = args.tests or DEFAULT_TESTS
    source = (PACKAGE / "_ops.py").read_text()
    found = checks(source)
    only = {int(x) for x in args.only.split(",") if x}
    survivors = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp) / "xla_attn"
        shutil.copytree(PACKAGE, copy)
        env = dict(os.environ, PYTHONPATH=tmp + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if "XLA_ATTN_LIBRARY" not in env:  # the copy has no library of its own
            import xla_attn._native as native
            env["XLA_ATTN_LIBRARY"] = str(native.LIBRARY)
        for i, call in enumerate(found):
            text = ast.get_source_segment(source, call).split("\n")[0][:100]
            if args.list:
                print(f"{i:3d} line {call.lineno}: {text}")
                continue
            if only and i not in only:
                continue
            (copy / "_ops.py").write_text(without(source, call))
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   *(["-k", args.k] if args.k else []), *(str(ROOT / t) for t in args.tests)]
            run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            status = "killed" if run.returncode else "SURVIVED"
            if not run.returncode:
                survivors.append(i)
            print(f"{i:3d} line {call.lineno}: {status}: {text}", flush=True)
    if not args.list:
        print(f"{len(survivors)} of {len(only) or len(found)} checks no test needs: {survivors}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
