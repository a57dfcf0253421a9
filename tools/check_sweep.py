#!/usr/bin/env python3
"""Is every input check seen by a test? Replaces the condition of each check in
src/xla_attn/_ops.py (`c.value(...)`, `c.type(...)`, and `self.` ones in `_Check`) by
`True`, one at a time, in a copy of the package, and runs the given tests against it.
A check whose tests still pass is one that no test needs: either a test is missing, or
the check is dead.

  python3 tools/check_sweep.py [--only 3,14] [--list] [TESTS ...]

TESTS default to the CPU tests that give the frontends bad input. The native library is
the installed package's, or XLA_ATTN_LIBRARY's. Each check costs one pytest run (-x: a
killed check stops at its first failure), ~10-35 s on 2 cores; the whole sweep (54
checks) took ~20 minutes there.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    ap.add_argument("--only", default="", help="comma-separated check numbers (see --list)")
    ap.add_argument("--list", action="store_true", help="print the checks and stop")
    ap.add_argument("-k", default="", help="pytest -k expression (e.g. to leave out tests "
                                           "that need a build's arch list)")
    args = ap.parse_args()
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
