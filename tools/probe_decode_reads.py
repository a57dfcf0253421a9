#!/usr/bin/env python3
"""Read-only ceilings of paged_attention's decode access pattern on this GPU (sm_90
for the bulk-copy kernels), to tell the kernel's limits from the cache layout's.

B=64 sequences, 8 kv heads, head_dim 128, bf16 K and V; every probe kernel only reads
(an XOR of the data decides a store that never happens) and is timed over back-to-back
launches (CUDA events), in GB/s of K+V read:

  ldg    16-byte loads: one block per (kv head, sequence) walking its 16-key tiles
         (paged: 16 rows of 256 bytes, 2 KB apart, from blocks in random order or in
         order), a block for all 8 heads (whole 2 KB rows), or a contiguous
         [B, Hkv, L, D] cache; smem=96K pins 2 blocks an SM as decode_sm80's d128
         tiles do.
  bulk   cp.async.bulk into per-warp stages on mbarriers (W warps x S stages of 8 KB):
         paged rows of 256 bytes (mode 0), the contiguous cache as 256-byte rows
         (mode 1) or one 4 KB copy per tile (mode 2).

Needs cupy (and an NVRTC it can use):

  python3 tools/probe_decode_reads.py [--context 4096] [--kind ldg,bulk]
"""

from __future__ import annotations

import argparse

B, HKV, D = 64, 8, 128

LDG_SRC = r'''
#define UNR 2
extern "C" __global__ void paged(const uint4* __restrict__ k, const uint4* __restrict__ v,
    const int* __restrict__ table, int bps, int bs, int heads, int L, unsigned* out, int allheads) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  int hk = blockIdx.x, b = blockIdx.y;
  const int rs = heads * 16;           // row stride in uint4
  const int cpr = allheads ? heads * 16 : 16;   // chunks per key row read by this block
  const int tk = 256 / cpr;                     // keys per warp tile (256 chunks a tensor)
  int key_lo = 0, key_hi = L;
  if (allheads) { int per = L / gridDim.x; key_lo = hk * per; key_hi = key_lo + per; }
  unsigned acc = 0;
  for (int t0 = key_lo + warp * tk; t0 < key_hi; t0 += nw * tk * UNR) {
    uint4 x[UNR][8], y[UNR][8];
#pragma unroll
    for (int u = 0; u < UNR; ++u)
#pragma unroll
      for (int it = 0; it < 8; ++it) {
        int idx = lane + 32 * it, r = idx / cpr, c = idx % cpr;
        int key = t0 + u * nw * tk + r;
        if (key < key_hi) {
          long row = (long)table[b * bps + key / bs] * bs + key % bs;
          long off = row * rs + (allheads ? c : hk * 16 + c);
          x[u][it] = __ldg(k + off); y[u][it] = __ldg(v + off);
        } else { x[u][it] = make_uint4(0,0,0,0); y[u][it] = x[u][it]; }
      }
#pragma unroll
    for (int u = 0; u < UNR; ++u)
#pragma unroll
      for (int it = 0; it < 8; ++it) acc ^= x[u][it].x ^ x[u][it].w ^ y[u][it].y ^ y[u][it].z;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
extern "C" __global__ void contig(const uint4* __restrict__ k, const uint4* __restrict__ v, long per_block, unsigned* out) {
  const uint4* kb = k + blockIdx.x * per_block; const uint4* vb = v + blockIdx.x * per_block;
  unsigned acc = 0;
  for (long i = threadIdx.x; i < per_block; i += blockDim.x * 4) {
    uint4 x[4], y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { long j = i + u * blockDim.x; x[u] = j < per_block ? __ldg(kb + j) : make_uint4(0,0,0,0); y[u] = j < per_block ? __ldg(vb + j) : make_uint4(0,0,0,0); }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ y[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
'''

BULK_SRC = r'''
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wait(unsigned bar, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
extern "C" __global__ void bulkread(const char* k, const char* v, const int* table, int bps, int bs,
    int heads, int L, unsigned* out, int S, int mode, int rb) {
  // mode 0: paged rows (16 x 256 B bulk copies per tile and tensor); 1: contiguous [B][Hk][L][D]
  // as 16 x 256 B; 2: contiguous, one 4 KB copy per tile and tensor; 3: paged, a block for all
  // heads of a sequence (blockIdx.x: a split of its keys), a tile = 2 whole key rows (4 KB)
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bars[16][8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  const int hk = blockIdx.x % heads, split = blockIdx.x / heads, nsplit = gridDim.x / heads, b = blockIdx.y;
  // rb: bytes of a key's row in one kv head (256: bf16 d128; 128: fp8 d128); a stage holds
  // a 16-key tile of K and of V
  const int stage = 2 * 16 * rb;
  unsigned char* mine = sm + warp * S * stage;
  if (lane < S) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bars[warp][lane])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const long rs = (long)heads * rb;
  const int tiles_all = mode == 3 ? L / 2 : L / 16;
  const int parts = mode == 3 ? gridDim.x : nsplit;  // mode 3: every block a split of all heads
  const int per = tiles_all / parts, t0 = (mode == 3 ? blockIdx.x : split) * per;
  const int my = (per - warp + nw - 1) / nw;
  unsigned acc = 0;
  auto issue = [&](int i) {
    const int st = i % S, tile = t0 + i * nw + warp;
    const unsigned bar = sa(&bars[warp][st]);
    if (lane == 0) expect(bar, stage);
    __syncwarp();
    unsigned char* dk = mine + st * stage;
    if (mode == 3) {
      if (lane == 0) {
        const int key = (t0 + i * nw + warp) * 2;
        long off = ((long)table[b * bps + key / bs] * bs + key % bs) * rs;
        bulk(sa(dk), k + off, 4096, bar); bulk(sa(dk + 4096), v + off, 4096, bar);
      }
    } else if (mode == 2) {
      if (lane == 0) {
        long off = ((long)(b * heads + hk) * L + tile * 16) * 256;
        bulk(sa(dk), k + off, 4096, bar); bulk(sa(dk + 4096), v + off, 4096, bar);
      }
    } else if (lane < 16) {
      const int key = tile * 16 + lane;
      long off = mode == 0 ? ((long)table[b * bps + key / bs] * bs + key % bs) * rs + hk * rb
                           : ((long)(b * heads + hk) * L + key) * rb;
      bulk(sa(dk + lane * rb), k + off, rb, bar); bulk(sa(dk + stage / 2 + lane * rb), v + off, rb, bar);
    }
  };
  for (int i = 0; i < S && i < my; ++i) issue(i);
  for (int i = 0; i < my; ++i) {
    const int st = i % S;
    wait(sa(&bars[warp][st]), (i / S) & 1);
    const unsigned* x = reinterpret_cast<const unsigned*>(mine + st * stage);
    acc ^= x[lane] ^ x[stage / 8 + lane];
    __syncwarp();
    if (i + S < my) issue(i + S);
  }
  if (acc == 0x12345678u) out[0] = acc;
}
'''


def main() -> None:
    import cupy as cp
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kind", default="ldg,bulk")
    args = p.parse_args()
    L = args.context
    kinds = args.kind.split(",")
    out = cp.zeros(1, cp.uint32)
    rng = np.random.default_rng(0)
    nbytes = 2 * B * L * HKV * D * 2

    def rate(fn, grid, block, kernel_args, smem=0, n=15, inner=10):
        fn.max_dynamic_shared_size_bytes = smem

        def launch():
            fn(grid, block, kernel_args, shared_mem=smem)

        launch()
        cp.cuda.Device().synchronize()
        s, e, ts = cp.cuda.Event(), cp.cuda.Event(), []
        for _ in range(n):
            s.record()
            for _ in range(inner):
                launch()
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / inner)
        return nbytes / (float(np.median(ts)) * 1e-3) / 1e9

    ldg = cp.RawModule(code=LDG_SRC, options=("-std=c++17",)) if "ldg" in kinds else None
    bulk = (cp.RawModule(code=BULK_SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
            if "bulk" in kinds else None)
    print(f"B={B} L={L} Hkv={HKV} d={D} bf16: {nbytes / 1e9:.3f} GB of K+V")
    for bs in (16, 64):
        nb = B * L // bs
        k = cp.random.randint(0, 2**31, size=(nbytes // 2 // 16, 4), dtype=cp.uint32)
        v = cp.random.randint(0, 2**31, size=(nbytes // 2 // 16, 4), dtype=cp.uint32)
        i32 = np.int32
        for order, tab in (("random", rng.permutation(nb)), ("in order", np.arange(nb))):
            table = cp.asarray(tab.astype(np.int32))
            if ldg is not None:
                f = ldg.get_function("paged")
                for smem in (0, 96 * 1024):
                    r = rate(f, (HKV, B), (128,), (k, v, table, i32(L // bs), i32(bs), i32(HKV),
                                                   i32(L), out, i32(0)), smem)
                    print(f"bs{bs} {order:8s} ldg  per head, smem={smem // 1024}K: {r:.0f} GB/s")
                r = rate(f, (8, B), (128,), (k, v, table, i32(L // bs), i32(bs), i32(HKV),
                                            i32(L), out, i32(1)))
                print(f"bs{bs} {order:8s} ldg  all heads, 8 splits: {r:.0f} GB/s")
            if bulk is not None:
                f = bulk.get_function("bulkread")
                modes = (0, 1, 2, 3) if bs == 16 and order == "random" else (0, 3)
                for mode in modes:
                    for w, s, splits in ((4, 3, 1), (8, 3, 1), (4, 3, 4)):
                        r = rate(f, (HKV * splits, B), (32 * w,),
                                 (k, v, table, i32(L // bs), i32(bs), i32(HKV), i32(L), out,
                                  i32(s), i32(mode), i32(256)), w * s * 8192)
                        print(f"bs{bs} {order:8s} bulk mode {mode} W={w} S={s} splits={splits}: "
                              f"{r:.0f} GB/s")
        if "fp8" in kinds and bulk is not None and bs == 16:
            # an fp8 d128 cache (128-byte rows a head): a block per kv head reads 128-byte
            # pieces 1 KB apart; a block per pair of kv heads, 256-byte pieces
            f = bulk.get_function("bulkread")
            tab = cp.asarray(rng.permutation(nb).astype(np.int32))
            for heads, rb, plans in ((8, 128, ((4, 4, 1), (4, 4, 3), (4, 6, 1))),
                                     (4, 256, ((4, 3, 1), (4, 3, 3), (4, 2, 3)))):
                for w, s, splits in plans:
                    r = rate(f, (heads * splits, B), (32 * w,),
                             (k, v, tab, i32(L // bs), i32(bs), i32(heads), i32(L), out, i32(s),
                              i32(0), i32(rb)), w * s * 32 * rb) / 2
                    print(f"fp8 bs16 random bulk rows of {rb} B ({heads} blocks a sequence) W={w} "
                          f"S={s} splits={splits}: {r:.0f} GB/s")
        if ldg is not None:
            f = ldg.get_function("contig")
            r = rate(f, (B * HKV,), (256,), (k, v, np.int64(L * D * 2 // 16), out))
            print(f"contiguous [B, Hkv, L, D] ldg: {r:.0f} GB/s")
        k = v = None  # frees the GPU memory before the next block size


if __name__ == "__main__":
    main()
