#!/usr/bin/env python3
"""Compile xla_attn's device code into fatbins and the tables that describe them.

Device code is compiled without nvcc: NVRTC (nvidia-cuda-nvrtc-cu12) turns each
module into PTX once per virtual arch, ptxas (nvidia-cuda-nvcc-cu12) assembles a
cubin per real arch, and nvFatbin (nvidia-nvfatbin-cu12) packs the cubins plus the
newest PTX (for later GPUs to JIT) into one fatbin per module. The outputs are

  <out>/kernels_blob.S     .incbin of every module's fatbin (linked into the library)
  <out>/kernel_table.inc   C++ tables of modules and variants for the dispatcher
  <out>/variants_features.h  the feature bits, for host code that builds queries

Fatbins are cached by a hash of everything that shapes them (sources, flags,
compiler versions, archs) under $XLA_ATTN_KERNEL_CACHE (default
~/.cache/xla_attn/kernels), so a rebuild with unchanged device code takes seconds.

  build_kernels.py paths                 CMake `set()` lines for the toolkit files
  build_kernels.py compile --archs "70;80" --out DIR
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
sys.path.insert(0, str(KERNELS / "dispatch"))
import variants as vt  # noqa: E402  (the variant table lives beside the dispatcher)

# NVRTC flags shared by every module. -std=c++17 for if constexpr; no fast-math:
# the cache write must round exactly like the host reference (bit-exact fp8).
NVRTC_FLAGS = ("-std=c++17", "-DNDEBUG", "--extra-device-vectorization")
PTXAS_FLAGS = ("-O3",)


# --------------------------------------------------------------------- toolkit
def _find(relative: str) -> pathlib.Path:
    """First sys.path entry holding `relative` (the isolated build env puts the
    CUDA wheels in more than one prefix, so importing `nvidia` is not enough)."""
    for entry in sys.path:
        candidate = pathlib.Path(entry or ".") / relative
        if candidate.exists():
            return candidate.resolve()
    raise SystemExit(
        f"build_kernels: cannot find {relative} on sys.path; install the CUDA 12 wheels "
        "of the flavour (XLA_ATTN_CUDA_FLAVOUR; see pyproject.toml's build-system.requires) "
        "or build with `pip install .`"
    )


# Where each CUDA flavour's PyPI wheels put their files (relative to site-packages).
# cu12: nvidia-cuda-{nvrtc,nvcc,runtime}-cu12 + nvidia-nvfatbin-cu12, one folder per
# wheel; cu13: nvidia-cuda-{nvrtc,nvcc,runtime,crt} + nvidia-nvfatbin, all under cu13/.
TOOLKIT_LAYOUT = {
    "cu12": {
        "nvrtc": "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
        "ptxas": "nvidia/cuda_nvcc/bin/ptxas",
        "nvfatbin": "nvidia/nvfatbin/lib/libnvfatbin.so.12",
        "cuda_include": "nvidia/cuda_runtime/include/cuda_runtime.h",
        "crt_include": "nvidia/cuda_nvcc/include/crt/host_defines.h",
        "cudart_static": "nvidia/cuda_runtime/lib/libcudart_static.a",
    },
    "cu13": {
        "nvrtc": "nvidia/cu13/lib/libnvrtc.so.13",
        "ptxas": "nvidia/cu13/bin/ptxas",
        "nvfatbin": "nvidia/cu13/lib/libnvfatbin.so.13",
        "cuda_include": "nvidia/cu13/include/cuda_runtime.h",
        "crt_include": "nvidia/cu13/include/crt/host_defines.h",
        "cudart_static": "nvidia/cu13/lib/libcudart_static.a",
    },
}
# CUDA 13 dropped sm_70/72: its flavour starts at sm_75.
DEFAULT_ARCHS = {"cu12": vt.ALL_ARCHS, "cu13": tuple(a for a in vt.ALL_ARCHS if a != "70")}


def flavour() -> str:
    name = os.environ.get("XLA_ATTN_CUDA_FLAVOUR", "cu12") or "cu12"
    if name not in TOOLKIT_LAYOUT:
        raise SystemExit(f"build_kernels: XLA_ATTN_CUDA_FLAVOUR must be one of "
                         f"{sorted(TOOLKIT_LAYOUT)}, got {name!r}")
    return name


def toolkit(host: bool = True) -> dict[str, pathlib.Path]:
    """Toolkit files of the flavour; `host` adds those only the host build needs
    (FFI headers)."""
    found = {}
    for key, relative in TOOLKIT_LAYOUT[flavour()].items():
        path = _find(relative)
        # Header locations are given by a file inside them (the folder is shared).
        found[key] = path.parent.parent if key == "crt_include" else (
            path.parent if path.suffix == ".h" else path)
    if host:
        found["xla_ffi_include"] = ffi_include()
    return found


# Handlers built against FFI API 0.1 load in every runtime from torch_xla 2.9 to the
# newest jax; newer headers produce handlers that older runtimes refuse.
FFI_API = (0, 1)


def ffi_include() -> pathlib.Path:
    override = os.environ.get("XLA_ATTN_FFI_INCLUDE")
    root = pathlib.Path(override) if override else _find("jaxlib/include/xla/ffi/api/ffi.h").parents[3]
    c_api = (root / "xla/ffi/api/c_api.h").read_text()
    version = tuple(int(c_api.split(f"#define XLA_FFI_API_{part} ")[1].split()[0])
                    for part in ("MAJOR", "MINOR"))
    if version != FFI_API:
        raise SystemExit(f"build_kernels: XLA FFI headers at {root} declare API {version}, "
                         f"need {FFI_API} (jaxlib 0.7.x); set XLA_ATTN_FFI_INCLUDE or install "
                         "jaxlib==0.7.2 in the build environment")
    return root


# ---------------------------------------------------------------- NVRTC / ptxas
def _check(lib, status: int, what: str, log: str = "") -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed ({status}): {log}")


def load_nvrtc(nvrtc_path: str) -> ctypes.CDLL:
    """libnvrtc dlopens its builtins library by name; the CUDA 13 wheel's libnvrtc does
    not find it beside itself, so load it first (globally) from the same folder."""
    folder = pathlib.Path(nvrtc_path).parent
    for builtins in sorted(folder.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(nvrtc_path)


def nvrtc_ptx(nvrtc_path: str, source: str, name: str, arch: str, includes: list[str],
              extra: tuple[str, ...] = ()) -> bytes:
    nvrtc = load_nvrtc(nvrtc_path)
    prog = ctypes.c_void_p()
    _check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           0, None, None), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=compute_{arch}", *NVRTC_FLAGS, *extra,
            *(f"-I{i}" for i in includes)]
    c_opts = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), c_opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if status != 0:
        raise RuntimeError(f"NVRTC failed on {name} for compute_{arch}:\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.raw.rstrip(b"\0")


def ptxas_cubin(ptxas: str, ptx: bytes, arch: str) -> bytes:
    # XLA_ATTN_PTXAS_VERBOSE=1 prints ptxas -v (registers, spills, shared memory) of
    # every kernel; only modules that are compiled (not cached) print.
    verbose = ("-v",) if os.environ.get("XLA_ATTN_PTXAS_VERBOSE") else ()
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = pathlib.Path(tmp, "m.ptx"), pathlib.Path(tmp, "m.cubin")
        src.write_bytes(ptx)
        run = subprocess.run([ptxas, f"-arch=sm_{arch}", *PTXAS_FLAGS, *verbose, str(src), "-o",
                              str(dst)], capture_output=True, text=True)
        sys.stderr.write(run.stdout + run.stderr)
        if run.returncode != 0:
            raise subprocess.CalledProcessError(run.returncode, run.args, run.stdout, run.stderr)
        # ptxas serializes every wgmma of a kernel where it cannot prove the async
        # products' registers safe (C7513, C7518: a product issued or waited for on one
        # branch only); it still assembles, and the kernel ran 20 % slower on an H100.
        if "Potential Performance Loss" in run.stderr:
            raise RuntimeError(f"ptxas sm_{arch}: wgmma serialized (see above)")
        return dst.read_bytes()


def fatbin(nvfatbin_path: str, cubins: dict[str, bytes], ptx: tuple[str, bytes], name: str) -> bytes:
    lib = ctypes.CDLL(nvfatbin_path)
    handle = ctypes.c_void_p()
    opts = (ctypes.c_char_p * 1)(b"-64")
    _check(lib, lib.nvFatbinCreate(ctypes.byref(handle), opts, 1), "nvfatbinCreate")
    for arch, cubin in cubins.items():
        _check(lib, lib.nvFatbinAddCubin(handle, cubin, len(cubin), arch.encode(), name.encode()),
               f"nvfatbinAddCubin sm_{arch}")
    ptx_arch, ptx_text = ptx
    text = ptx_text + b"\0"
    _check(lib, lib.nvFatbinAddPTX(handle, text, len(text), ptx_arch.encode(), name.encode(), b""),
           f"nvfatbinAddPTX compute_{ptx_arch}")
    size = ctypes.c_size_t()
    _check(lib, lib.nvFatbinSize(handle, ctypes.byref(size)), "nvfatbinSize")
    out = ctypes.create_string_buffer(size.value)
    _check(lib, lib.nvFatbinGet(handle, out), "nvfatbinGet")
    lib.nvFatbinDestroy(ctypes.byref(handle))
    return out.raw


# ------------------------------------------------------------------ generation
def module_source(module: vt.Module) -> str:
    """The translation unit of a module: its family header plus one extern "C"
    entry point per variant, each taking the params struct by value."""
    lines = [f'#include "{module.header}"', ""]
    for v in vt.VARIANTS:
        if v.module == module.name:
            lines += [
                f'extern "C" __global__ void __launch_bounds__({v.threads}, {v.min_blocks})',
                f"{v.kernel}(const __grid_constant__ {v.params} p) {{ {v.template}(p); }}",
                "",
            ]
    return "\n".join(lines)


def _tool_version(tk: dict[str, pathlib.Path]) -> str:
    nvrtc = load_nvrtc(str(tk["nvrtc"]))
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    ptxas = subprocess.run([str(tk["ptxas"]), "--version"], capture_output=True, text=True).stdout
    return f"nvrtc {major.value}.{minor.value}\n{ptxas}"


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(KERNELS.rglob("*")):
        if path.suffix in (".h", ".cuh", ".py") and "host" not in path.parts:
            h.update(str(path.relative_to(KERNELS)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _ptx_and_cubins(nvrtc: str, ptxas: str, source: str, name: str, virtual: str,
                    reals: list[str], includes: list[str]) -> dict[str, bytes]:
    """One front-end run and the cubins assembled from it (a pool job): {"ptx": ...,
    real arch: cubin}."""
    ptx = nvrtc_ptx(nvrtc, source, name, virtual, includes)
    return {"ptx": ptx, **{a: ptxas_cubin(ptxas, ptx, a) for a in reals}}


class ModuleBuild:
    """A module's fatbin: from the cache, or from pool jobs submitted up front (one
    per virtual arch, every module's at once, so neither core waits on a serial step)."""

    def __init__(self, module: vt.Module, archs: list[str], tk: dict[str, pathlib.Path],
                 cache_dir: pathlib.Path, digest: str, pool):
        self.module, self.tk = module, tk
        self.plan = vt.cubin_plan(module, archs)
        self.source = module_source(module)
        key = hashlib.sha256(
            "\n".join([self.source, digest, repr(sorted(self.plan.items())),
                       " ".join(NVRTC_FLAGS + PTXAS_FLAGS), _tool_version(tk)]).encode()
        ).hexdigest()[:24]
        self.cached = cache_dir / f"{module.name}-{key}.fatbin"
        self.jobs = {}
        if self.cached.exists():
            return
        includes = [str(KERNELS), str(tk["cuda_include"])]
        for virtual in sorted(set(self.plan.values()), key=lambda a: int(a.rstrip("a"))):
            reals = [a for a, v in self.plan.items() if v == virtual]
            self.jobs[virtual] = pool.submit(_ptx_and_cubins, str(tk["nvrtc"]), str(tk["ptxas"]),
                                             self.source, f"{module.name}.cu", virtual, reals,
                                             includes)

    def result(self) -> bytes:
        name = self.module.name
        if not self.jobs:
            print(f"build_kernels: {name}: cached ({self.cached.name})", flush=True)
            return self.cached.read_bytes()
        outputs = {v: job.result() for v, job in self.jobs.items()}
        cubins = {a: outputs[v][a] for a, v in self.plan.items()}
        newest = max(outputs, key=lambda a: int(a.rstrip("a")))
        blob = fatbin(str(self.tk["nvfatbin"]), cubins, (newest, outputs[newest]["ptx"]), name)
        self.cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cached.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(self.cached)
        print(f"build_kernels: {name}: " + ", ".join(
            f"sm_{a} (compute_{v})" for a, v in self.plan.items())
            + f" + compute_{newest} PTX -> {len(blob)} bytes", flush=True)
        return blob


def write_tables(out: pathlib.Path, built: dict[str, tuple[pathlib.Path, list[str]]]) -> None:
    asm = ['.section .rodata.xla_attn_kernels,"a"']
    table = ["// Generated by tools/build_kernels.py from kernels/dispatch/variants.py.", ""]
    for name, (path, _) in built.items():
        asm += [".balign 128", f".hidden xla_attn_fatbin_{name}", f".globl xla_attn_fatbin_{name}",
                f"xla_attn_fatbin_{name}:", f'.incbin "{path}"',
                f".hidden xla_attn_fatbin_{name}_end", f".globl xla_attn_fatbin_{name}_end",
                f"xla_attn_fatbin_{name}_end:"]
        table.append(f'extern "C" const unsigned char xla_attn_fatbin_{name}[], '
                     f"xla_attn_fatbin_{name}_end[];")
    asm.append('.section .note.GNU-stack,"",@progbits')
    table += ["", "static const ModuleEntry kModules[] = {"]
    for name, (_, archs) in built.items():
        table.append(f'    {{"{name}", xla_attn_fatbin_{name}, xla_attn_fatbin_{name}_end, '
                     f'"{";".join(archs)}"}},')
    table += ["    {nullptr, nullptr, nullptr, nullptr},", "};", "",
              "static const VariantEntry kVariants[] = {"]
    module_index = {name: i for i, name in enumerate(built)}
    for v in vt.VARIANTS:
        if v.module not in module_index:
            continue
        table.append(
            f'    {{"{v.op}", "{v.family}", {module_index[v.module]}, "{v.kernel}", '
            f"{vt.DTYPES[v.dtype0][0]}, {vt.DTYPES[v.dtype1][0]}, {v.head_dim_min}, "
            f"{v.head_dim_max}, {v.features}u, {v.priority}, {v.threads}}},")
    table += ["    {nullptr, nullptr, -1, nullptr, 0, 0, 0, 0, 0u, 0, 0},", "};"]
    features = ["// Generated by tools/build_kernels.py: feature bits of kernels/dispatch/variants.py.",
                "#pragma once", "namespace xla_attn {"]
    features += [f"constexpr unsigned kFeature{k.capitalize()} = {v}u;" for k, v in vt.FEATURES.items()]
    features.append("}  // namespace xla_attn")
    (out / "variants_features.h").write_text("\n".join(features) + "\n")
    (out / "kernels_blob.S").write_text("\n".join(asm) + "\n")
    (out / "kernel_table.inc").write_text("\n".join(table) + "\n")


def parse_archs(text: str) -> list[str]:
    archs = [a.strip().removeprefix("sm_") for a in text.replace(",", ";").split(";") if a.strip()]
    unknown = [a for a in archs if a not in vt.VIRTUAL_ARCH]
    if unknown:
        raise SystemExit(f"build_kernels: unknown arch(s) {unknown}; known: {sorted(vt.VIRTUAL_ARCH)}")
    return archs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("paths", help="print CMake set() lines for the toolkit files")
    comp = sub.add_parser("compile", help="compile every module for the given archs")
    comp.add_argument("--archs", default=None, help="default: every arch the flavour supports")
    comp.add_argument("--out", required=True, type=pathlib.Path)
    comp.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    tk = toolkit(host=args.cmd == "paths")
    if args.cmd == "paths":
        for key, value in tk.items():
            print(f'set(XLA_ATTN_{key.upper()} "{value}")')
        print(f'set(XLA_ATTN_DEFAULT_ARCHS "{";".join(DEFAULT_ARCHS[flavour()])}")')
        return
    archs = parse_archs(args.archs or ";".join(DEFAULT_ARCHS[flavour()]))
    if flavour() == "cu13" and ("70" in archs or "72" in archs):
        raise SystemExit("build_kernels: CUDA 13 cannot target sm_70/72; build the cu12 flavour")
    args.out.mkdir(parents=True, exist_ok=True)
    cache_dir = pathlib.Path(os.environ.get("XLA_ATTN_KERNEL_CACHE",
                                            pathlib.Path.home() / ".cache" / "xla_attn" / "kernels"))
    digest = _source_digest()
    built = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        builds = []
        for module in vt.MODULES:
            if not vt.cubin_plan(module, archs):
                print(f"build_kernels: {module.name}: skipped (needs sm_{module.min_arch}+)",
                      flush=True)
                continue
            builds.append(ModuleBuild(module, archs, tk, cache_dir, digest, pool))
        for mb in builds:
            path = (args.out / f"{mb.module.name}.fatbin").resolve()
            path.write_bytes(mb.result())
            built[mb.module.name] = (path, list(mb.plan))
    write_tables(args.out, built)


if __name__ == "__main__":
    main()
