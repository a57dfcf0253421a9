"""The one table of kernel variants.

It feeds the build (tools/build_kernels.py compiles exactly these entry points),
the dispatcher (a generated C++ table it searches at run time) and the error
messages (`python -m xla_attn info` and every "no kernel" error print it).

A variant is one `extern "C" __global__` entry point: an op, a family (one
generation of device code), the dtypes it takes, the head dims and features it
covers and the archs it is built for. Selection prefers the highest `priority`
among the variants that match; `XLA_ATTN_FORCE_FAMILY` restricts it to the families it
names (comma-separated).
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
    # Virtual archs the front end (NVRTC) runs for. None: each real arch gets its own
    # cubin from its own VIRTUAL_ARCH. Given: a cubin for the lowest real arch of each
    # major version (the driver runs an sm_8x cubin on every later 8.y) and for each real
    # arch named here, each assembled from the newest of these at or below it. Code that
    # uses nothing of a newer arch then costs 2-3 NVRTC and 3-4 ptxas runs instead of 5
    # and 6 (the decode module: ~14 min -> ~3 min on 2 cores). Name "89" where fp8 is
    # converted: sm_89+ PTX converts e4m3/e5m2 in hardware (cvt), compute_80 PTX in ~10
    # integer instructions an element (fp8 decode ran 10x slower than bf16 on an H100).
    ptx_archs: tuple[str, ...] | None = None
    # Arch-specific code (wgmma, setmaxnreg: sm_90a): one cubin for exactly min_arch, from
    # its "a" PTX, built where the build's archs include min_arch; the dispatcher runs it
    # on that arch alone (an sm_90a cubin loads on no other GPU, and its PTX JITs nowhere).
    arch_specific: bool = False


def cubin_plan(module: Module, archs: list[str]) -> dict[str, str]:
    """{real arch to build a cubin for: virtual arch its PTX comes from} for `archs`
    (the build's real archs) under the module's policy."""
    if module.arch_specific:
        own = f"{module.min_arch}a"
        return {own: own} if any(int(a.rstrip("a")) == module.min_arch for a in archs) else {}
    archs = sorted((a for a in archs if int(a.rstrip("a")) >= module.min_arch),
                   key=lambda a: int(a.rstrip("a")))
    if module.ptx_archs is None:
        return {a: VIRTUAL_ARCH[a] for a in archs}
    plan: dict[str, str] = {}
    for a in archs:
        major_done = any(int(c.rstrip("a")) // 10 == int(a.rstrip("a")) // 10 for c in plan)
        if major_done and a not in module.ptx_archs:
            continue  # an earlier cubin of this major serves it
        below = [v for v in module.ptx_archs if int(v) <= int(a.rstrip("a"))]
        v = max(below, key=int, default=VIRTUAL_ARCH[a])
        # A flavour whose lowest arch is above the shared PTX arch (CUDA 13: sm_75+)
        # compiles that arch's own PTX instead.
        plan[a] = v if int(v) >= int(archs[0].rstrip("a")) else VIRTUAL_ARCH[a]
    return plan


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
    min_blocks: int = 1  # resident blocks per SM ptxas must allow (__launch_bounds__'s 2nd)


# dtype names -> (enum name in kernels/common/types.h, device C++ type)
DTYPES = {
    "f32": ("XLA_ATTN_F32", "float"),
    "f16": ("XLA_ATTN_F16", "__half"),
    "bf16": ("XLA_ATTN_BF16", "__nv_bfloat16"),
    "f8e4m3": ("XLA_ATTN_F8E4M3", "__nv_fp8_e4m3"),
    "f8e5m2": ("XLA_ATTN_F8E5M2", "__nv_fp8_e5m2"),
}

MODULES = (
    # Every arch its own cubin: sm_89/90 convert to fp8 in hardware (cvt), and the
    # module compiles in seconds.
    Module("reshape_and_cache_flash_portable", "cache/write_portable.cuh", min_arch=70),
    Module("flash_fwd_portable", "flash/fwd_portable.cuh", min_arch=70,
           ptx_archs=("70", "80", "89")),
    Module("flash_fwd_sm80", "flash/fwd_sm80.cuh", min_arch=80, ptx_archs=("80",)),
    # Its fp8 kernels: mma.sync with e4m3 operands and cvt to e4m3 are sm_89+ PTX, so
    # one cubin for sm_89 and one for sm_90, both from compute_89.
    Module("flash_fwd_sm89", "flash/fwd_sm80.cuh", min_arch=89, ptx_archs=("89",)),
    # "90": the atomic-dQ path adds 4 floats per lane with red.global.add.v4.f32 there.
    Module("flash_bwd_sm80", "flash/bwd_sm80.cuh", min_arch=80, ptx_archs=("80", "90")),
    Module("flash_bwd_portable", "flash/bwd_portable.cuh", min_arch=70, ptx_archs=("70", "80")),
    Module("paged_decode", "paged/decode.cuh", min_arch=70, ptx_archs=("70", "80", "89")),
    Module("paged_decode_sm80", "paged/decode_sm80.cuh", min_arch=80, ptx_archs=("80", "89")),
    # Bulk tensor copies (TMA) are sm_90 instructions: one cubin, from compute_90 PTX.
    Module("paged_decode_sm90", "paged/decode_sm90.cuh", min_arch=90, ptx_archs=("90",)),
    # wgmma and setmaxnreg are sm_90a instructions: one sm_90a cubin.
    Module("flash_fwd_sm90", "flash/fwd_sm90.cuh", min_arch=90, arch_specific=True),
    Module("flash_fwd_sm90_walk", "flash/fwd_sm90_walk.cuh", min_arch=90, arch_specific=True),
    Module("flash_bwd_sm90", "flash/bwd_sm90.cuh", min_arch=90, arch_specific=True),
    Module("flash_bwd_sm90_d256", "flash/bwd_sm90_d256.cuh", min_arch=90, arch_specific=True),
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
            # 16 blocks (2048 threads) an SM: <= 32 registers, no spills (ptxas sm_90). ncu,
            # bf16 -> fp8 at 56 registers: 9 blocks an SM, 49 % occupancy, DRAM 74 %.
            min_blocks=16,
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


# Head-dim buckets of the sm80 family (kernels/flash/sm80_tiles.h): 96 has its own.
SM80_HEAD_BUCKETS = ((1, 32), (33, 64), (65, 96), (97, 128), (129, 256))


def _flash_fwd_sm80_variants():
    # Tensor-core forward (kernels/flash/fwd_sm80.cuh), f16 and bf16 only: 2 x 5 buckets,
    # preferred over the portable kernel wherever both match. Its split-KV partials are
    # merged by the portable combine, built into this module too so that
    # XLA_ATTN_FORCE_FAMILY=sm80 covers split-KV calls: + 2.
    features = ALL_FEATURES & ~FEATURES["fp8"]
    for dt, (lo, hi) in itertools.product(("f16", "bf16"), SM80_HEAD_BUCKETS):
        yield Variant(
            op="flash_fwd", family="sm80", module="flash_fwd_sm80",
            kernel=f"xla_attn_flash_fwd_sm80_{dt}_d{hi}",
            template=f"xla_attn::flash_fwd_sm80<{DTYPES[dt][1]}, {hi}>",
            params="xla_attn_flash_fwd_params", dtype0=dt, dtype1=dt, head_dim_min=lo,
            head_dim_max=hi, features=features, priority=10, threads=128)
    for dt in ("f16", "bf16"):
        yield Variant(
            op="flash_combine", family="sm80", module="flash_fwd_sm80",
            kernel=f"xla_attn_flash_combine_sm80_{dt}",
            template=f"xla_attn::flash_combine_portable<{DTYPES[dt][1]}>",
            params="xla_attn_flash_fwd_params", dtype0=dt, dtype1=dt, features=features,
            priority=10, threads=128)


# fp8 buckets of the sm80 family (sm80_tiles.h, head_bucket(d, 1)): rows of 64 bytes or more.
SM80_FP8_HEAD_BUCKETS = ((16, 64), (65, 128), (129, 256))


def _flash_fwd_sm89_variants():
    # fp8 e4m3 q, k, v (descales, bf16 out) on mma.sync m16n8k32 (sm_89+), every feature
    # of the 16-bit kernel, head dims a multiple of 16 (the launcher's fp8_mma_takes; the
    # rest run portable): 3 buckets. Its own op, so that the launcher asks for it only
    # where it takes the call.
    for lo, hi in SM80_FP8_HEAD_BUCKETS:
        yield Variant(
            op="flash_fwd_mma_fp8", family="sm80", module="flash_fwd_sm89",
            kernel=f"xla_attn_flash_fwd_sm89_f8e4m3_d{hi}",
            template=f"xla_attn::flash_fwd_sm80<__nv_fp8_e4m3, {hi}>",
            params="xla_attn_flash_fwd_params", dtype0="f8e4m3", dtype1="f8e4m3",
            head_dim_min=lo, head_dim_max=hi, features=ALL_FEATURES, priority=10, threads=128)


# Head-dim buckets of the sm90 family (kernels/flash/sm90_tiles.h): whole 64-column
# blocks; head dims up to 32 stay with the sm80 family.
SM90_HEAD_BUCKETS = ((33, 64), (65, 128), (129, 256))


def _flash_fwd_sm90_variants():
    # The Hopper forward (kernels/flash/fwd_sm90.cuh), f16 and bf16: 2 x 3, + 2 at d64
    # (three consumers), + 2 x 3 for paged K/V, + 2 x 4 persistent walks (d64 with two
    # and three consumers, d128 and its rowless-pass instance). Its own ops
    # (flash_fwd_tma...), because it takes its own args (the tensor maps) and only part of flash_fwd's calls (not
    # split, head_dim % 8 == 0, aligned tensors, paged only with 8-row page boxes): the
    # launcher tries it first where those hold and the device is sm_90, and otherwise
    # selects flash_fwd as before.
    features = ALL_FEATURES & ~FEATURES["fp8"]
    for dt, (lo, hi) in itertools.product(("f16", "bf16"), SM90_HEAD_BUCKETS):
        # two consumer warpgroups (op flash_fwd_tma); at d64 also three (op
        # flash_fwd_tma_m192: 192-row blocks), the launcher choosing by the mask and the
        # sequence length (sm90_tiles.h, wide_d64); paged K/V in an instance of its own
        # (op flash_fwd_tma_paged; fwd_sm90.cuh, kPaged); at d64 and d128 also the
        # persistent walks (ops ..._walk; fwd_sm90_walk.cuh, kWalk), which the launcher takes
        # on the shapes where they measured faster (none at d256: sm90_tiles.h, has_walk)
        shapes = [("flash_fwd_tma", 2, ""), ("flash_fwd_tma_paged", 2, "_paged")]
        shapes += [("flash_fwd_tma_m192", 3, "_m192")] if hi == 64 else []
        shapes += [(op + "_walk", wgs, sfx + "_walk") for op, wgs, sfx in shapes
                   if hi <= 128 and sfx != "_paged"]
        # d128's walk also in an instance whose rowless warpgroup passes its tiles (op
        # flash_fwd_tma_walk_rowless; fwd_sm90_walk.cuh, kPassRowless), for the calls where
        # a sequence's last row block may end in its first half (sm90_tiles.h,
        # passes_rowless)
        shapes += [("flash_fwd_tma_walk_rowless", 2, "_walk_rowless")] if hi == 128 else []
        for op, wgs, suffix in shapes:
            paged, walk = suffix == "_paged", "_walk" in suffix
            rowless = ", true" if suffix.endswith("_rowless") else ""
            yield Variant(
                op=op, family="sm90", module="flash_fwd_sm90_walk" if walk else "flash_fwd_sm90",
                kernel=f"xla_attn_flash_fwd_sm90_{dt}_d{hi}{suffix}",
                template=(f"xla_attn::flash_fwd_sm90_walk<{DTYPES[dt][1]}, {hi}, {wgs}{rowless}>"
                          if walk else f"xla_attn::flash_fwd_sm90<{DTYPES[dt][1]}, {hi}, {wgs}"
                          + (", true>" if paged else ">")),
                params="xla_attn::flash_sm90::Args", dtype0=dt, dtype1=dt, head_dim_min=lo,
                head_dim_max=hi, features=features if paged else features & ~FEATURES["paged"],
                priority=20, threads=128 * (1 + wgs))
    # fp8 e4m3 (q, k, v; bf16 out) in three buckets, head dims 16-64, 65-128 and 129-256
    # (sm90_tiles.h, fp8_bucket), each with its paged instance (two consumer warpgroups);
    # d64 and d128 with three (kFp8Wgs) and a walk, d256 with two (fp8_wgs) and no walk
    # (has_walk): + 8.
    fp8 = DTYPES["f8e4m3"][1]
    for (lo, hi), (op, suffix) in itertools.product(
            ((16, 64), (65, 128), (129, 256)),
            (("flash_fwd_tma", ""), ("flash_fwd_tma_paged", "_paged"),
             ("flash_fwd_tma_walk", "_walk"))):
        if hi == 256 and suffix == "_walk":
            continue
        paged = suffix == "_paged"
        wgs = 2 if paged or hi == 256 else 3
        yield Variant(
            op=op, family="sm90",
            module="flash_fwd_sm90_walk" if suffix == "_walk" else "flash_fwd_sm90",
            kernel=f"xla_attn_flash_fwd_sm90_f8e4m3_d{hi}{suffix}",
            template={"": f"xla_attn::flash_fwd_sm90<{fp8}, {hi}, {wgs}>",
                      "_paged": f"xla_attn::flash_fwd_sm90<{fp8}, {hi}, 2, true>",
                      "_walk": f"xla_attn::flash_fwd_sm90_walk<{fp8}, {hi}, 3>"}[suffix],
            params="xla_attn::flash_sm90::Args", dtype0="f8e4m3", dtype1="f8e4m3",
            head_dim_min=lo, head_dim_max=hi,
            features=(features if paged else features & ~FEATURES["paged"]) | FEATURES["fp8"],
            priority=20, threads=128 * (1 + wgs))
    # Each bucket reading V given transposed (op flash_fwd_tma_vt: sm90_tiles.h, vt_given;
    # its own instance, kVtGiven) and the pass that writes V^T before it (fwd_sm90.cuh,
    # flash_fwd_vt_pack): + 4.
    for lo, hi in ((16, 64), (65, 128), (129, 256)):
        wgs = 2 if hi == 256 else 3
        yield Variant(
            op="flash_fwd_tma_vt", family="sm90", module="flash_fwd_sm90",
            kernel=f"xla_attn_flash_fwd_sm90_f8e4m3_d{hi}_vt",
            template=f"xla_attn::flash_fwd_sm90<{fp8}, {hi}, {wgs}, false, true>",
            params="xla_attn::flash_sm90::Args", dtype0="f8e4m3", dtype1="f8e4m3",
            head_dim_min=lo, head_dim_max=hi,
            features=(features & ~FEATURES["paged"]) | FEATURES["fp8"], priority=20,
            threads=128 * (1 + wgs))
    yield Variant(
        op="flash_fwd_vt_pack", family="sm90", module="flash_fwd_sm90",
        kernel="xla_attn_flash_fwd_sm90_vt_pack_f8e4m3", template="xla_attn::flash_fwd_vt_pack",
        params="xla_attn::flash_sm90::Args", dtype0="f8e4m3", dtype1="f8e4m3", head_dim_min=16,
        head_dim_max=256, features=(features & ~FEATURES["paged"]) | FEATURES["fp8"],
        priority=20, threads=256)


def _flash_bwd_sm90_variants():
    # The Hopper dk/dv kernels of the atomic-dQ path, f16 and bf16: the d64 and d128
    # buckets (33-128, kernels/flash/bwd_sm90.cuh) and d256 (129-256, its two warpgroups
    # sharing the keys: bwd_sm90_d256.cuh): 6. Their own op (their args carry tensor
    # maps); the sm80 launcher takes them for the dk/dv step where they cover the call
    # and keeps the sm80 delta and dq-convert kernels around them.
    features = ALL_FEATURES & ~FEATURES["fp8"] & ~FEATURES["paged"]
    for dt, (lo, hi) in itertools.product(("f16", "bf16"), SM90_HEAD_BUCKETS):
        d256 = hi == 256
        yield Variant(
            op="flash_bwd_dkdv_tma", family="sm90",
            module="flash_bwd_sm90_d256" if d256 else "flash_bwd_sm90",
            kernel=f"xla_attn_flash_bwd_dkdv_sm90_{dt}_d{hi}",
            template=(f"xla_attn::flash_bwd_dkdv_sm90_d256<{DTYPES[dt][1]}>" if d256
                      else f"xla_attn::flash_bwd_dkdv_sm90<{DTYPES[dt][1]}, {hi}>"),
            params="xla_attn::flash_sm90::BwdArgs", dtype0=dt, dtype1=dt, head_dim_min=lo,
            head_dim_max=hi, features=features, priority=20, threads=384)


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


# Head-dim buckets of the sm80 backward (kernels/flash/sm80_tiles.h, bwd_stream_block):
# the forward's, from 2 (D of every row fits in the dq buffer as scratch).
SM80_BWD_HEAD_BUCKETS = ((2, 32),) + SM80_HEAD_BUCKETS[1:]


def _flash_bwd_sm80_variants():
    # Tensor-core backward (kernels/flash/bwd_sm80.cuh), f16 and bf16: dq and dkdv per
    # bucket, 2 x 2 x 5 = 20, plus per dtype the paired d256 dk/dv kernel, the D = dO .
    # O pass and the conversion of the atomic path's f32 dQ: 6. Preferred over the
    # portable kernels wherever they match.
    features = ALL_FEATURES & ~FEATURES["paged"] & ~FEATURES["fp8"]
    for kind, dt, (lo, hi) in itertools.product(("dq", "dkdv"), ("f16", "bf16"),
                                                SM80_BWD_HEAD_BUCKETS):
        yield Variant(
            op=f"flash_bwd_{kind}", family="sm80", module="flash_bwd_sm80",
            kernel=f"xla_attn_flash_bwd_{kind}_sm80_{dt}_d{hi}",
            template=f"xla_attn::flash_bwd_{kind}_sm80<{DTYPES[dt][1]}, {hi}>",
            params="xla_attn_flash_bwd_params", dtype0=dt, dtype1=dt, head_dim_min=lo,
            head_dim_max=hi, features=features, priority=10, threads=128)
    # d256's paired dk/dv kernel (8 warps; sm80_tiles.h, bwd_paired_smem_bytes), which
    # the launcher takes where the device lets a block opt in to its shared memory.
    for dt in ("f16", "bf16"):
        lo, hi = SM80_BWD_HEAD_BUCKETS[-1]
        yield Variant(
            op="flash_bwd_dkdv_paired", family="sm80", module="flash_bwd_sm80",
            kernel=f"xla_attn_flash_bwd_dkdv_paired_sm80_{dt}_d{hi}",
            template=f"xla_attn::flash_bwd_dkdv_paired_sm80<{DTYPES[dt][1]}, {hi}>",
            params="xla_attn_flash_bwd_params", dtype0=dt, dtype1=dt, head_dim_min=lo,
            head_dim_max=hi, features=features, priority=10, threads=256)
    for kind, dt in itertools.product(("delta", "dq_convert"), ("f16", "bf16")):
        yield Variant(
            op=f"flash_bwd_{kind}", family="sm80", module="flash_bwd_sm80",
            kernel=f"xla_attn_flash_bwd_{kind}_sm80_{dt}",
            template=f"xla_attn::flash_bwd_{kind}_sm80<{DTYPES[dt][1]}>",
            params="xla_attn_flash_bwd_params", dtype0=dt, dtype1=dt,
            head_dim_min=SM80_BWD_HEAD_BUCKETS[0][0], head_dim_max=SM80_BWD_HEAD_BUCKETS[-1][1],
            features=features, priority=10, threads=128)


# (query, cache) dtypes of both decode kernels: 16-bit queries over a cache of their
# dtype or fp8 (float32 queries take the flash forward over the block table).
DECODE_DTYPES = tuple((q, kv) for q in ("f16", "bf16") for kv in (q, "f8e4m3", "f8e5m2"))


def _paged_decode_variants():
    # paged_attention's decode kernel (kernels/paged/decode.cuh): 16-bit queries over a
    # cache of their dtype or fp8, exact head dims, query rows per block 4 or 8 (in the
    # op name, as paged_decode_r4 / _r8): 2 x 3 x 3 x 2 = 36. float32 queries take the
    # flash forward over the block table.
    for (q, kv), d, rows in itertools.product(DECODE_DTYPES, DECODE_HEAD_DIMS, (4, 8)):
        yield Variant(
            op=f"paged_decode_r{rows}", family="decode", module="paged_decode",
            kernel=f"xla_attn_paged_decode_{q}_{kv}_d{d}_r{rows}",
            template=f"xla_attn::paged_decode<{DTYPES[q][1]}, {DTYPES[kv][1]}, {d}, {rows}>",
            params="xla_attn::decode::Args", dtype0=q, dtype1=kv, head_dim_min=d,
            head_dim_max=d, features=ALL_FEATURES, threads=128,
            # 4-row blocks at 3 an SM (<= 168 registers, no spill): decode is latency-
            # bound, and at 2 blocks (8 warps) ncu saw 31% of DRAM bandwidth. 8-row
            # blocks spill 0.5 KB at 168 registers, so they stay at 2.
            min_blocks=3 if rows == 4 else 2)
    for q, d in itertools.product(("f16", "bf16"), DECODE_HEAD_DIMS):
        yield Variant(
            op="paged_decode_combine", family="decode", module="paged_decode",
            kernel=f"xla_attn_paged_decode_combine_{q}_d{d}",
            template=f"xla_attn::paged_decode_combine<{DTYPES[q][1]}, {d}>",
            params="xla_attn::decode::Args", dtype0=q, dtype1=q, head_dim_min=d,
            head_dim_max=d, features=ALL_FEATURES, threads=128)


# Head dims with a decode kernel (others take the flash forward over the block table).
DECODE_HEAD_DIMS = (64, 128, 256)


def _paged_decode_mma_variants():
    # The tensor-core decode kernel: 16-bit queries over a cache of their dtype or fp8,
    # head dims 64 and 128 (d256's three stages exceed the 99 KB of shared memory sm_86/89
    # allow a block), 2 x 3 x 2 = 12 in each of two families:
    # - decode_sm80 (kernels/paged/decode_sm80.cuh, op paged_decode_mma, family decode),
    #   tiles by cp.async. The launcher tries it before the FMA kernel
    #   (paged_decode_r4/_r8), which keeps d256 and sm_70/75.
    # - decode_sm90 (kernels/paged/decode_sm90.cuh), the same kernel with its tiles landed
    #   by TMA. Its own op, because it takes its own args (the caches' tensor maps): the
    #   launcher tries it first where the device is sm_90+ and the cache's block size is a
    #   multiple of 16 (a 16-key tile in one block), and falls back to paged_decode_mma.
    for (q, kv), d in itertools.product(DECODE_DTYPES, (64, 128)):
        types = f"{DTYPES[q][1]}, {DTYPES[kv][1]}, {d}"
        same = dict(dtype0=q, dtype1=kv, head_dim_min=d, head_dim_max=d, features=ALL_FEATURES,
                    threads=128,
                    # fp8's 4 stages leave shared memory for 3 blocks an SM; 3 keeps the
                    # registers there too (<= 168 a thread; ptxas used 166-167 unbounded)
                    min_blocks=3 if kv.startswith("f8") else 2)
        yield Variant(op="paged_decode_mma", family="decode", module="paged_decode_sm80",
                      kernel=f"xla_attn_paged_decode_sm80_{q}_{kv}_d{d}",
                      template=f"xla_attn::paged_decode_sm80<{types}>",
                      params="xla_attn::decode::Args", **same)
        yield Variant(op="paged_decode_tma", family="decode_sm90", module="paged_decode_sm90",
                      kernel=f"xla_attn_paged_decode_sm90_{q}_{kv}_d{d}",
                      template=f"xla_attn::paged_decode_sm90<{types}>",
                      params="xla_attn::decode_sm90::Args", priority=10, **same)
        # Rows under 256 bytes: a block reads 256 // row bytes kv heads together
        # (decode_tiles.h's heads_together; 3 stages, 2 blocks an SM), in both families.
        # Their own ops: a call takes them only when its kv heads group so and its spans
        # fit 16 / heads rows a head.
        row_bytes = d * (1 if kv.startswith("f8") else 2)
        if row_bytes < 256:
            heads = 256 // row_bytes
            together = dict(same, min_blocks=2)
            yield Variant(op="paged_decode_mma_heads", family="decode",
                          module="paged_decode_sm80",
                          kernel=f"xla_attn_paged_decode_sm80_{q}_{kv}_d{d}_kv{heads}",
                          template=f"xla_attn::paged_decode_sm80<{types}, {heads}>",
                          params="xla_attn::decode::Args", **together)
            yield Variant(op="paged_decode_tma_heads", family="decode_sm90",
                          module="paged_decode_sm90",
                          kernel=f"xla_attn_paged_decode_sm90_{q}_{kv}_d{d}_kv{heads}",
                          template=f"xla_attn::paged_decode_sm90<{types}, {heads}>",
                          params="xla_attn::decode_sm90::Args", priority=10, **together)
    # Its split merge (decode.cuh's), so that XLA_ATTN_FORCE_FAMILY=decode_sm90 covers splits.
    for q, d in itertools.product(("f16", "bf16"), (64, 128)):
        yield Variant(
            op="paged_decode_combine", family="decode_sm90", module="paged_decode_sm90",
            kernel=f"xla_attn_paged_decode_combine_sm90_{q}_d{d}",
            template=f"xla_attn::paged_decode_combine<{DTYPES[q][1]}, {d}>",
            params="xla_attn::decode::Args", dtype0=q, dtype1=q, head_dim_min=d,
            head_dim_max=d, features=ALL_FEATURES, priority=10, threads=128)


VARIANTS = (tuple(_reshape_and_cache_flash_variants()) + tuple(_flash_fwd_variants())
            + tuple(_flash_fwd_sm80_variants()) + tuple(_flash_fwd_sm89_variants())
            + tuple(_flash_fwd_sm90_variants())
            + tuple(_flash_bwd_sm80_variants()) + tuple(_flash_bwd_sm90_variants())
            + tuple(_flash_bwd_variants()) + tuple(_paged_decode_variants())
            + tuple(_paged_decode_mma_variants()))
