"""The one table of kernel variants.

It feeds the build (tools/build_kernels.py compiles exactly these entry points),
the dispatcher (a generated C++ table it searches at run time) and the error
messages (`python -m xla_attn info` and every "no kernel" error print it).

A variant is one `extern "C" __global__` entry point: an op, a family (one
generation of device code), the dtypes it takes, the head dims and features it
covers and the archs it is built for. Selection prefers the highest `priority`
among the variants that match; `XLA_ATTN_FORCE_FAMILY` restricts it to one family.
"""

from __future__ import annotations

import dataclasses
import itertools

# Real archs of a full build, and the virtual arch each is assembled from. One NVRTC
# front-end run per virtual arch (~25 s for an FA2-class kernel on 2 cores) is
# shared by every real arch that maps to it; ptxas per real arch costs ~0.3 s.
ALL_ARCHS = ("70", "75", "80", "86", "89", "90")
VIRTUAL_ARCH = {"70": "70", "75": "75", "80": "80", "86": "80", "87": "80",
                "89": "89", "90": "90", "90a": "90a"}

# Feature bits a variant may support (the params say which a call needs).
FEATURES = {"paged": 1, "alibi": 2, "softcap": 4, "window": 8, "fp8": 16}


@dataclasses.dataclass(frozen=True)
class Module:
    """One device translation unit: a family's header and the entry points of it."""

    name: str           # also the stem of the generated .cu and the embedded symbol
    header: str         # device header, relative to kernels/
    min_arch: int       # lowest compute capability (major*10+minor) it runs on


@dataclasses.dataclass(frozen=True)
class Variant:
    op: str             # params struct / FFI target stem: reshape_and_cache_flash, flash_fwd, ...
    family: str
    module: str
    kernel: str         # entry-point symbol
    template: str       # the device function the entry point instantiates
    params: str         # params struct type
    dtype0: str         # first dtype key (src / q dtype)
    dtype1: str         # second dtype key (cache / kv dtype)
    head_dim_min: int = 0
    head_dim_max: int = 1 << 30
    features: int = 0   # bit set of FEATURES supported
    priority: int = 0   # higher wins among matches
    threads: int = 128  # block size the entry point is launched with (__launch_bounds__)


# dtype names -> (enum name in kernels/common/types.h, device C++ type)
DTYPES = {
    "f32": ("XLA_ATTN_F32", "float"),
    "f16": ("XLA_ATTN_F16", "__half"),
    "bf16": ("XLA_ATTN_BF16", "__nv_bfloat16"),
    "f8e4m3": ("XLA_ATTN_F8E4M3", "__nv_fp8_e4m3"),
    "f8e5m2": ("XLA_ATTN_F8E5M2", "__nv_fp8_e5m2"),
}

MODULES = (
    Module("reshape_and_cache_flash_portable", "cache/write_portable.cuh", min_arch=70),
    Module("flash_fwd_portable", "flash/fwd_portable.cuh", min_arch=70),
    Module("flash_bwd_portable", "flash/bwd_portable.cuh", min_arch=70),
)

# Head-dim buckets of the portable family (kernels/flash/portable_tiles.h): the
# kernel for bucket D serves every head_dim in (previous bucket, D].
HEAD_BUCKETS = ((1, 32), (33, 64), (65, 128), (129, 256))
ALL_FEATURES = sum(FEATURES.values())


def _reshape_and_cache_flash_variants():
    # Same-dtype copies plus quantizing writes into both fp8 formats: 3 + 3 * 2 = 9.
    for src, cache in itertools.chain(
        ((d, d) for d in ("f32", "f16", "bf16")),
        itertools.product(("f32", "f16", "bf16"), ("f8e4m3", "f8e5m2")),
    ):
        yield Variant(
            op="reshape_and_cache_flash", family="portable", module="reshape_and_cache_flash_portable",
            kernel=f"xla_attn_reshape_and_cache_flash_portable_{src}_{cache}",
            template=f"xla_attn::reshape_and_cache_flash_portable<{DTYPES[src][1]}, {DTYPES[cache][1]}>",
            params="xla_attn_reshape_and_cache_flash_params", dtype0=src, dtype1=cache,
            threads=128,
        )


def _out_dtype(q: str) -> str:
    return "bf16" if q.startswith("f8") else q


def _flash_fwd_variants():
    # flash_attn_varlen: q and k/v of one dtype (fp8 e4m3 with descales, bf16 out);
    # paged_attention adds fp8 caches under 16/32-bit queries: 4 + 6 pairs x 4 buckets.
    pairs = [("f16", "f16"), ("bf16", "bf16"), ("f32", "f32"), ("f8e4m3", "f8e4m3")]
    pairs += list(itertools.product(("f16", "bf16", "f32"), ("f8e4m3", "f8e5m2")))
    for (q, kv), (lo, hi) in itertools.product(pairs, HEAD_BUCKETS):
        out = _out_dtype(q)
        yield Variant(
            op="flash_fwd", family="portable", module="flash_fwd_portable",
            kernel=f"xla_attn_flash_fwd_portable_{q}_{kv}_d{hi}",
            template=(f"xla_attn::flash_fwd_portable<{DTYPES[q][1]}, {DTYPES[kv][1]}, "
                      f"{DTYPES[out][1]}, {hi}>"),
            params="xla_attn_flash_fwd_params", dtype0=q, dtype1=kv, head_dim_min=lo,
            head_dim_max=hi, features=ALL_FEATURES, threads=128)
    for out in ("f16", "bf16", "f32"):  # split-KV merge, any head dim
        yield Variant(
            op="flash_combine", family="portable", module="flash_fwd_portable",
            kernel=f"xla_attn_flash_combine_portable_{out}",
            template=f"xla_attn::flash_combine_portable<{DTYPES[out][1]}>",
            params="xla_attn_flash_fwd_params", dtype0=out, dtype1=out,
            features=ALL_FEATURES, threads=128)


def _flash_bwd_variants():
    # Two kernels per (dtype, head-dim bucket): 2 x 3 x 4 = 24.
    for kind, dt, (lo, hi) in itertools.product(("dq", "dkdv"), ("f16", "bf16", "f32"),
                                                HEAD_BUCKETS):
        yield Variant(
            op=f"flash_bwd_{kind}", family="portable", module="flash_bwd_portable",
            kernel=f"xla_attn_flash_bwd_{kind}_portable_{dt}_d{hi}",
            template=f"xla_attn::flash_bwd_{kind}_portable<{DTYPES[dt][1]}, {hi}>",
            params="xla_attn_flash_bwd_params", dtype0=dt, dtype1=dt, head_dim_min=lo,
            head_dim_max=hi, features=ALL_FEATURES & ~FEATURES["paged"] & ~FEATURES["fp8"],
            threads=128)


VARIANTS = (tuple(_reshape_and_cache_flash_variants()) + tuple(_flash_fwd_variants())
            + tuple(_flash_bwd_variants()))
