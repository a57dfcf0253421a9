#!/usr/bin/env python3
"""Build, repair, check and smoke-test a release wheel: the exact command the wheels
workflow runs, and it runs on any x86_64 Linux machine with Python and pip (no CUDA
toolkit, no GPU, no container).

  build_wheel.py build [--flavour cu12|cu13] [--archs "80;90"] [--out dist] [--smoke]
                       [--ref GIT_REF] [--no-repair]
      pip wheel (isolated build: NVRTC + ptxas from the flavour's CUDA wheels), then
      auditwheel repair (manylinux tag of this machine's glibc: manylinux_2_28 in the
      manylinux_2_28 container, manylinux_2_34 on Debian 12), then `check`, then with
      --smoke `smoke`. --ref builds a commit's tracked files (git archive) instead of
      the working tree, which stays as it is; --no-repair makes a development wheel (no
      repair, no release check), e.g. one per ref for tools/ab_wheels.py:
        build_wheel.py build --ref main --archs 90 --no-repair --out dist/ab/main
  build_wheel.py check WHEEL...     size budget, auditwheel, no CUDA library needed
  build_wheel.py smoke WHEEL        fresh venv: install it, `python -m xla_attn info`
                                    lists the flavour's archs, `python -m xla_attn check`
  build_wheel.py flavour cu13 [--tree DIR]
      rewrite pyproject.toml for a flavour (name, CUDA build wheels, CMake define);
      what cibuildwheel's before-all runs for the cu13 wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# PyPI caps a file at 100 MB; we hold the full-arch wheel to 60 MB (issue: "wheel budget").
BUDGET_MB = 60

# The CUDA build wheels of each flavour (pinned: they decide the cubins' ABI).
FLAVOURS = {
    "cu12": {
        "archs": "70;75;80;86;89;90",
        "requires": ["nvidia-cuda-nvrtc-cu12==12.9.86", "nvidia-cuda-nvcc-cu12==12.9.86",
                     "nvidia-cuda-runtime-cu12==12.9.79", "nvidia-nvfatbin-cu12==12.9.82"],
    },
    "cu13": {
        "archs": "75;80;86;89;90",
        "requires": ["nvidia-cuda-nvrtc==13.0.88", "nvidia-cuda-nvcc==13.0.88",
                     "nvidia-cuda-crt==13.0.88", "nvidia-cuda-runtime==13.0.96",
                     "nvidia-nvfatbin==13.0.85"],
    },
}
# Shared libraries the native library may need at run time: the C/C++ runtime only.
ALLOWED_NEEDED = re.compile(r"^(libstdc\+\+|libgcc_s|libc|libm|libdl|libpthread|librt|"
                            r"ld-linux-x86-64)\.so")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


# ------------------------------------------------------------------ flavour
def set_flavour(flavour: str, tree: pathlib.Path) -> None:
    """Point pyproject.toml at a flavour: dist name, CUDA build wheels, CMake define."""
    path = tree / "pyproject.toml"
    text = path.read_text()
    text = re.sub(r'^name = "xla-attn-cu\d+"', f'name = "xla-attn-{flavour}"', text, flags=re.M)
    cuda = re.compile(r'^  "nvidia-[^"]+",\n', re.M)
    first = cuda.search(text)
    text = cuda.sub("", text)
    block = "".join(f'  "{r}",\n' for r in FLAVOURS[flavour]["requires"])
    text = text[:first.start()] + block + text[first.start():]
    text = re.sub(r'^cmake\.define\.XLA_ATTN_CUDA_FLAVOUR = "cu\d+"',
                  f'cmake.define.XLA_ATTN_CUDA_FLAVOUR = "{flavour}"', text,
                  flags=re.M)
    path.write_text(text)


# ------------------------------------------------------------------ check
def needed_libraries(wheel: pathlib.Path) -> list[str]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    needed = []
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        for name in zf.namelist():
            if name.endswith(".so") or ".so." in name:
                with open(zf.extract(name, tmp), "rb") as f:
                    for section in ELFFile(f).iter_sections():
                        if isinstance(section, DynamicSection):
                            needed += [t.needed for t in section.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    return needed


def check(wheels: list[pathlib.Path], budget_mb: float) -> None:
    failures = []
    for wheel in wheels:
        size_mb = wheel.stat().st_size / 1e6
        print(f"{wheel.name}: {size_mb:.1f} MB (budget {budget_mb} MB)")
        if size_mb > budget_mb:
            failures.append(f"{wheel.name} is {size_mb:.1f} MB, over the {budget_mb} MB budget")
        needed = needed_libraries(wheel)
        print(f"  NEEDED: {', '.join(sorted(set(needed)))}")
        extra = [n for n in needed if not ALLOWED_NEEDED.match(n)]
        if extra:
            failures.append(f"{wheel.name} needs {extra}: only the C/C++ runtime is allowed "
                            "(the CUDA runtime is linked statically, the driver loaded at run time)")
        shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                               capture_output=True, text=True)
        if shown.returncode != 0 or "manylinux_" not in shown.stdout:
            failures.append(f"auditwheel show {wheel.name}: {shown.stdout}{shown.stderr}")
        else:
            print("  auditwheel: " + " ".join(re.findall(r'"(manylinux_[\w.]+)"', shown.stdout)[:1]))
    if failures:
        raise SystemExit("check failed:\n  " + "\n  ".join(failures))


# ------------------------------------------------------------------ smoke
def smoke(wheel: pathlib.Path, flavour: str, archs: str | None = None) -> None:
    """archs: what the wheel was built for (default: the flavour's full set)."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp, "venv")
        run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        run([py, "-m", "pip", "install", "-q", f"{wheel}[jax]"])
        info = json.loads(run([py, "-m", "xla_attn", "info", "--json"], capture_output=True,
                              text=True, cwd=tmp).stdout)
        want = set((archs or FLAVOURS[flavour]["archs"]).replace(",", ";").split(";"))
        have = {a for m in info["modules"] for a in m["archs"].split(";")}
        print(f"installed wheel: {info['cuda']}; cubins for sm_{', sm_'.join(sorted(have))}")
        if not want <= have:
            raise SystemExit(f"smoke: the wheel lacks cubins for {sorted(want - have)}")
        run([py, "-m", "xla_attn", "check", "--repeats", "3"], cwd=tmp)


# ------------------------------------------------------------------ build
def export_ref(ref: str, dest: pathlib.Path) -> None:
    """The tracked files of commit `ref` of this repository, written under `dest`."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--ref {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def build(flavour: str, archs: str | None, out: pathlib.Path, repair: bool, budget_mb: float,
          do_smoke: bool, ref: str | None = None) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if archs:
        env["XLA_ATTN_CUDA_ARCHS"] = archs
    with tempfile.TemporaryDirectory() as tmp:
        tree = ROOT
        # A copy to build from: a commit's files, or the working tree's for a pyproject
        # that names another flavour.
        if ref or flavour != "cu12":
            tree = pathlib.Path(tmp, "src")
            if ref:
                export_ref(ref, tree)
            else:
                shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
                    ".git", "build", "dist", ".venv*", "__pycache__", ".whl"))
        if flavour != "cu12":
            set_flavour(flavour, tree)
        raw = pathlib.Path(tmp, "raw")
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(raw), str(tree)], env=env)
        (wheel,) = raw.glob("*.whl")
        if repair:
            run([sys.executable, "-m", "auditwheel", "repair", "-w", str(out), str(wheel)])
            (wheel,) = [w for w in out.glob(f"xla_attn_{flavour}-*.whl") if "manylinux" in w.name]
        else:
            wheel = pathlib.Path(shutil.copy2(wheel, out))
    if repair:  # a release wheel; an unrepaired one is for development only
        check([wheel], budget_mb)
    if do_smoke:
        smoke(wheel, flavour, archs)
    print(f"built {wheel}")
    return wheel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build, repair and check a wheel")
    b.add_argument("--flavour", choices=sorted(FLAVOURS), default="cu12")
    b.add_argument("--archs", help="XLA_ATTN_CUDA_ARCHS (default: the flavour's full set)")
    b.add_argument("--out", type=pathlib.Path, default=ROOT / "dist")
    b.add_argument("--no-repair", action="store_true",
                   help="a development wheel: no auditwheel repair, no release check")
    b.add_argument("--ref", help="build this git commit's tracked files, not the working tree")
    b.add_argument("--budget-mb", type=float, default=BUDGET_MB)
    b.add_argument("--smoke", action="store_true", help="install in a fresh venv and run check")
    c = sub.add_parser("check", help="size budget, auditwheel, NEEDED libraries")
    c.add_argument("wheels", nargs="+", type=pathlib.Path)
    c.add_argument("--budget-mb", type=float, default=BUDGET_MB)
    s = sub.add_parser("smoke", help="install in a fresh venv and run info + check")
    s.add_argument("wheel", type=pathlib.Path)
    f = sub.add_parser("flavour", help="rewrite pyproject.toml for a flavour")
    f.add_argument("flavour", choices=sorted(FLAVOURS))
    f.add_argument("--tree", type=pathlib.Path, default=ROOT)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args.flavour, args.archs, args.out, not args.no_repair, args.budget_mb, args.smoke,
              args.ref)
    elif args.cmd == "check":
        check(args.wheels, args.budget_mb)
    elif args.cmd == "smoke":
        smoke(args.wheel, re.search(r"xla_attn_(cu\d+)", args.wheel.name).group(1))
    else:
        set_flavour(args.flavour, args.tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
