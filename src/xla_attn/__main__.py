"""`python -m xla_attn info` and `python -m xla_attn check`.

info   version, CUDA flavour, the archs and kernel variants in this build, the GPU
       found and the kernels it would use, framework versions.
check  runs every op on the best device JAX has against the float64 reference
       (xla_attn.testing.reference) and prints errors and times; exit status 1 if
       any op is wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time

from xla_attn import __version__, _native


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "torch",
                 "torch_xla", "ml_dtypes"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def info(as_json: bool = False) -> int:
    build = _native.build_info()
    arch, why = _native.device_arch()
    gpu: dict = {"arch": arch} if arch > 0 else {"none": why}
    if arch > 0:
        chosen = {}
        # name, the dispatcher ops it tries in order, dtypes. paged_attention: decode spans
        # over an fp8 cache (the Hopper decode kernel for block sizes that are multiples of
        # 16, else the tensor-core one, else the FMA one for a GQA group of 4); longer
        # spans take the flash_fwd kernels.
        for name, ops, d0, d1 in (
                ("reshape_and_cache_flash", ("reshape_and_cache_flash",), "bfloat16", "bfloat16"),
                ("flash_attn_varlen", ("flash_fwd",), "bfloat16", "bfloat16"),
                ("flash backward", ("flash_bwd_dkdv",), "bfloat16", "bfloat16"),
                ("paged_attention decode", ("paged_decode_tma_heads", "paged_decode_tma", "paged_decode_mma",
                                            "paged_decode_r4"), "bfloat16",
                 "float8_e4m3fn"),
                ("paged_attention prefill", ("flash_fwd",), "bfloat16", "float8_e4m3fn")):
            for op in ops:
                try:
                    chosen[name] = _native.select_variant(op, d0, d1, 128, arch)
                    break
                except RuntimeError as e:
                    chosen[name] = f"none ({str(e).split('; this build has')[0]})"
        gpu["kernels"] = chosen
    runtime = build["cuda_runtime"]
    report = {
        "xla_attn": __version__, "library": str(_native.LIBRARY), "abi": build["abi"],
        "cuda": f"cu{runtime // 1000} (CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}, "
                "statically linked)",
        "modules": build["modules"], "variants": build["variants"], "gpu": gpu,
        "frameworks": _versions(),
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"xla_attn {report['xla_attn']}  (C ABI {report['abi']}, {report['cuda']})")
    print(f"library  {report['library']}")
    print("cubins   " + "; ".join(f"{m['name']}: sm_{m['archs'].replace(';', ', sm_')} "
                                  f"({m['bytes'] / 1e6:.2f} MB)" for m in build["modules"]))
    print(f"variants {len(build['variants'])}:")
    for v in build["variants"]:
        print(f"  {v['op']:<24} {v['family']:<10} {v['dtype0']:>5} -> {v['dtype1']:<7} "
              f"{v['kernel']}")
    if arch > 0:
        print(f"gpu      sm_{arch}")
        for op, k in gpu["kernels"].items():
            print(f"  {op:<24} {k}")
    else:
        print(f"gpu      none ({why})")
    print("frameworks " + ", ".join(f"{k} {v}" for k, v in report["frameworks"].items()))
    return 0


def check(repeats: int) -> int:
    from xla_attn.testing import checks

    rows = checks.run_all(repeats=repeats)
    print(f"{'op':<40} {'device':<8} {'dtype':<22} {'error':>10} {'bound':>8} {'time':>10}  result")
    failed = 0
    for r in rows:
        failed += r.status == "FAIL"
        err = "bit-exact" if r.exact and r.error == 0 else f"{r.error:.2e}"
        t = f"{r.seconds * 1e6:8.1f}us" if r.seconds is not None else "-"
        print(f"{r.name:<40} {r.device:<8} {r.dtype:<22} {err:>10} {r.bound:>8.0e} {t:>10}  "
              f"{r.status}{'  ' + r.note if r.note else ''}")
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xla_attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="what this build contains and the GPU it finds")
    p_info.add_argument("--json", action="store_true")
    p_check = sub.add_parser("check", help="run every op against the float64 reference")
    p_check.add_argument("--repeats", type=int, default=20, help="timed runs per op (median)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    status = info(args.json) if args.cmd == "info" else check(args.repeats)
    if args.cmd == "check":
        print(f"({time.perf_counter() - started:.1f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
