// paged_attention's tensor-core decode kernel (sm_80+; caches of the query's 16-bit
// dtype, or fp8 e4m3/e5m2 converted to f16 in shared memory): the decode kernel of
// paged/decode.cuh with its dot products and weighted sums on mma.sync instead of
// FP32 FMAs and shuffles. ncu on an H100 showed the FMA
// kernel issue-bound at 2.2 TB/s (65 % of issue slots, 66 % of DRAM bandwidth); here
// a key costs 2 mma per 16 keys and dimension block instead of ~100 instructions.
//
// One block = one (split of the keys, kv head, sequence), 4 warps. The block's query
// rows are the heads of the kv head's GQA group times the query tokens (<= 16: one
// m16 tile, its A fragments held in registers for the whole loop), so each K/V byte
// is read once for the group. Each warp streams its own 16-key tiles (tile i of the
// split goes to warp i % 4) through kStages shared-memory stages with cp.async, two
// tiles in flight while one is computed: S = Q K^T (ldmatrix of K), the online softmax
// on the S fragments, O += P V (P straight from the S registers, ldmatrix.trans of V).
// fp8 tiles land in a raw staging area and each warp converts its tile to f16 (exact:
// every e4m3/e5m2 value is an f16) before the ldmatrix; the mma then run in f16 (Q
// and P rounded to f16), the cache scales applied to the scores and the output.
// The warps merge their partial softmax states through shared memory at the end;
// splits write partials that paged_decode_combine (paged/decode.cuh) merges.
#pragma once
#include "common/mma_sm80.cuh"
#include "flash/fwd_sm80.cuh"
#include "paged/decode.cuh"
#include "paged/decode_tiles.h"

namespace xla_attn {
namespace decode_sm80 {

// The mma operand type: the query's 16-bit type over a cache of it, f16 over fp8.
template <typename T, typename KV>
struct Compute {
  using type = T;
};
template <typename T>
struct Compute<T, __nv_fp8_e4m3> {
  using type = __half;
};
template <typename T>
struct Compute<T, __nv_fp8_e5m2> {
  using type = __half;
};

// Two 16-bit query elements (one b32 of a row) as an A-fragment register of Tc.
template <typename Tc, typename T>
__device__ __forceinline__ uint32_t as_operand(uint32_t x) {
  if constexpr (kSameType<Tc, T>) {
    return x;
  } else {
    T v[2];
    *reinterpret_cast<uint32_t*>(v) = x;
    return sm80::pack2<Tc>(to_float(v[0]), to_float(v[1]));
  }
}

// Converts a warp's raw fp8 tile (kTileKeys rows of D bytes) into the swizzled f16
// tile the ldmatrix reads; 16 elements a lane and step, in hardware on sm_89+.
template <typename KV, int D>
__device__ __forceinline__ void fp8_to_f16_tile(__half* dst, const uint8_t* src, int lane) {
  constexpr __nv_fp8_interpretation_t kFormat =
      kSameType<KV, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  constexpr int kChunks = D / 16;  // 16-byte chunks of a raw row
#pragma unroll
  for (int it = 0; it < kTileKeys * kChunks / 32; ++it) {
    const int idx = lane + 32 * it, r = idx / kChunks, c = idx % kChunks;
    const uint4 raw = *reinterpret_cast<const uint4*>(src + r * D + c * 16);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] & 0xffffu), kFormat);
      const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] >> 16), kFormat);
      h[2 * i] = uint32_t(lo.x) | (uint32_t(lo.y) << 16);
      h[2 * i + 1] = uint32_t(hi.x) | (uint32_t(hi.y) << 16);
    }
    // 16 raw bytes = two 16-byte f16 chunks (2c, 2c + 1) of row r
    *reinterpret_cast<uint4*>(dst + sm80::swz<D>(r, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(dst + sm80::swz<D>(r, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

}  // namespace decode_sm80

template <typename T, typename KV, int D>
__device__ void paged_decode_sm80(const decode::Args& a) {
  using namespace sm80;
  using decode_sm80::kStages;
  using decode_sm80::kTileKeys;
  using decode_sm80::kWarps;
  using Tc = typename decode_sm80::Compute<T, KV>::type;  // mma operand type
  constexpr bool kFp8 = sizeof(KV) == 1;
  constexpr int kChunks = D * int(sizeof(KV)) / 16;      // 16-byte chunks per cache row
  constexpr int kLoads = kTileKeys * kChunks / 32;       // cp.async per lane per tile
  constexpr int kDT = D / 8;                             // n8 tiles of O
  static_assert(kTileKeys * kChunks % 32 == 0, "a tile must spread evenly over a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // This warp's shared memory (decode_sm80::warp_smem_bytes): kStages K stages and
  // kStages V stages (cache rows as stored; 16-bit ones swizzled), for fp8 the f16 K
  // and V tiles it converts them into, then the physical rows of each stage.
  constexpr int kStageBytes = decode_sm80::stage_bytes(D, int(sizeof(KV)));
  unsigned char* mine = smem + warp * decode_sm80::warp_smem_bytes(D, int(sizeof(KV)));
  KV* sK = reinterpret_cast<KV*>(mine);
  KV* sV = reinterpret_cast<KV*>(mine + kStages * kStageBytes);
  Tc* cK = reinterpret_cast<Tc*>(mine + 2 * kStages * kStageBytes);  // fp8 only
  Tc* cV = cK + decode_sm80::tile_elems(D);
  int* sRow = reinterpret_cast<int*>(mine + 2 * kStages * kStageBytes +
                                     (kFp8 ? 2 * 2 * decode_sm80::tile_elems(D) : 0));

  const xla_attn_paged_attention_params& p = a.p;
  decode::DecodeBlock blk;
  if (!blk.locate<T>(a, kTileKeys)) return;  // the split's share in whole tiles
  const int split = blk.split, hk = blk.hk, b = blk.b, group = blk.group;
  const int total_rows = blk.total_rows, k_lo = blk.k_lo, k_hi = blk.k_hi;
  const Sequence& s = blk.s;
  const Window& win = blk.win;
  const KeyRows& keys = blk.keys;
  const int tiles = (k_hi - k_lo + kTileKeys - 1) / kTileKeys;
  const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;

  const int64_t q_stride = int64_t(p.num_heads) * D;
  const KV* kc = static_cast<const KV*>(p.key_cache) + int64_t(hk) * D;  // + row * kv_stride
  const KV* vc = static_cast<const KV*>(p.value_cache) + int64_t(hk) * D;
  const float ks = decode::cache_scale<KV>(p.k_scale), vs = decode::cache_scale<KV>(p.v_scale);
  const int64_t kv_stride = int64_t(p.num_heads_k) * D;

  // Scores in base 2 (see decode.cuh): x = dot * mul2, or cap2 * tanh(dot * mul).
  const bool capped = p.soft_cap > 0.f;
  const float cap2 = p.soft_cap * kLog2e;
  const float mul = capped ? p.scale * ks / p.soft_cap : p.scale * ks * kLog2e;
  // Lane rows g and g + 8 of the m16 tile: position, ALiBi slope (base 2), and Q's A
  // fragments (rows past total_rows are zeros; their results are never written).
  int pos[2];
  float slope2[2];
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf, row = min(r, total_rows - 1);
    const int h = hk * group + row % group;
    pos[hf] = row / group + s.offset;
    slope2[hf] = (p.alibi_slopes ? p.alibi_slopes[h] : 0.f) * kLog2e;
    const uint32_t* qrow = reinterpret_cast<const uint32_t*>(
        static_cast<const T*>(p.query) + (s.q_start + row / group) * q_stride + int64_t(h) * D);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // cols 16kk + 2t, +1 and 16kk + 8 + 2t, +1
      qa[kk][hf] = r < total_rows ? decode_sm80::as_operand<Tc, T>(qrow[kk * 8 + t]) : 0u;
      qa[kk][hf + 2] = r < total_rows ? decode_sm80::as_operand<Tc, T>(qrow[kk * 8 + 4 + t]) : 0u;
    }
  }

  // Tile i of this warp (keys k_lo + (i * kWarps + warp) * 16 ...) into stage i % kStages:
  // lanes 0..15 look the keys' rows up (the softmax reads them back for validity), then
  // every lane copies kLoads 16-byte chunks of K and of V; absent keys get zeros.
  auto issue = [&](int i) {
    const int stage = i % kStages, key0 = k_lo + (i * kWarps + warp) * kTileKeys;
    if (lane < kTileKeys) {
      const int key = key0 + lane;
      sRow[stage * kTileKeys + lane] = key < k_hi ? int(keys.row(b, 0, key)) : -1;
    }
    __syncwarp();
    KV* tk = sK + stage * kStageBytes / int(sizeof(KV));
    KV* tv = sV + stage * kStageBytes / int(sizeof(KV));
#pragma unroll
    for (int it = 0; it < kLoads; ++it) {
      const int idx = lane + 32 * it, r = idx / kChunks, c = idx % kChunks;
      const int row = sRow[stage * kTileKeys + r];
      const int off = kFp8 ? r * D + c * 16 : swz<D>(r, c);  // fp8: raw, converted later
      const int elem = c * 16 / int(sizeof(KV));
      if (row >= 0) {
        cp_async_16(tk + off, kc + int64_t(row) * kv_stride + elem);
        cp_async_16(tv + off, vc + int64_t(row) * kv_stride + elem);
      } else {
        *reinterpret_cast<uint4*>(tk + off) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(tv + off) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  float o[kDT][4] = {};
  float m[2] = {-XLA_ATTN_INF, -XLA_ATTN_INF}, l[2] = {0.f, 0.f};
  const LdsmLane<D> lds_k = LdsmLane<D>::b_operand(lane), lds_v = LdsmLane<D>::a_operand(lane);
  if (my_tiles > 0) issue(0);
  cp_async_commit();
  if (my_tiles > 1) issue(1);
  cp_async_commit();
  for (int i = 0; i < my_tiles; ++i) {
    if (i + 2 < my_tiles) issue(i + 2);
    cp_async_commit();  // possibly empty: keeps the wait count uniform
    cp_async_wait<2>();  // this lane's copies of tile i have landed
    __syncwarp();        // and every lane's
    const int stage = i % kStages, key0 = k_lo + (i * kWarps + warp) * kTileKeys;
    uint32_t tk, tv;  // the f16/bf16 tiles the ldmatrix reads
    if constexpr (kFp8) {
      decode_sm80::fp8_to_f16_tile<KV, D>(cK, reinterpret_cast<const uint8_t*>(
          sK + stage * kStageBytes), lane);
      decode_sm80::fp8_to_f16_tile<KV, D>(cV, reinterpret_cast<const uint8_t*>(
          sV + stage * kStageBytes), lane);
      __syncwarp();
      tk = smem_addr(cK);
      tv = smem_addr(cV);
    } else {
      tk = smem_addr(sK + stage * decode_sm80::tile_elems(D));
      tv = smem_addr(sV + stage * decode_sm80::tile_elems(D));
    }

    // S = Q K^T for the 16 keys: per k16 step one ldmatrix.x4 of K, two mma.
    float sc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t bk[4];  // keys 0..7: {bk0, bk1}; keys 8..15: {bk2, bk3}
      ldsm_x4(bk, lds_k(tk, 0, kk));
      mma_16816<Tc>(sc[0], qa[kk], bk[0], bk[1]);
      mma_16816<Tc>(sc[1], qa[kk], bk[2], bk[3]);
    }
    // Online softmax of rows g (c0, c1) and g + 8 (c2, c3) over keys 8 nt + 2t + e.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -XLA_ATTN_INF;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jl = nt * 8 + 2 * t + e, key = key0 + jl;
          float x = sc[nt][2 * hf + e];
          x = capped ? cap2 * fast_tanh(x * mul) : x * mul;
          x -= slope2[hf] * float(abs(pos[hf] - key));
          const bool vis = sRow[stage * kTileKeys + jl] >= 0 && win.visible(pos[hf], key);
          x = vis ? x : -XLA_ATTN_INF;
          sc[nt][2 * hf + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hf], mx);
      const float m_use = m_new == -XLA_ATTN_INF ? 0.f : m_new;  // no key yet: terms are 0
      const float corr = fast_exp2(m[hf] - m_use);
      m[hf] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[nt][2 * hf + e];
          x = fast_exp2(x - m_use);
          sum += x;
        }
      }
      l[hf] = l[hf] * corr + sum;  // this lane's partial row sum (quad-reduced at the end)
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        o[dt][2 * hf] *= corr;
        o[dt][2 * hf + 1] *= corr;
      }
    }
    // O += P V: the S fragments of keys 0..7 and 8..15, rounded to T, are P's A fragment.
    const uint32_t pa[4] = {pack2<Tc>(sc[0][0], sc[0][1]), pack2<Tc>(sc[0][2], sc[0][3]),
                            pack2<Tc>(sc[1][0], sc[1][1]), pack2<Tc>(sc[1][2], sc[1][3])};
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t bv[4];  // dims 16dd + 0..7: {bv0, bv1}; 16dd + 8..15: {bv2, bv3}
      ldsm_x4_trans(bv, lds_v(tv, 0, dd));
      mma_16816<Tc>(o[2 * dd], pa, bv[0], bv[1]);
      mma_16816<Tc>(o[2 * dd + 1], pa, bv[2], bv[3]);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();  // the merge below reuses the tiles

  // Merge the warps: each writes its rows' max, sum and unnormalised O to shared memory.
  float* s_o = reinterpret_cast<float*>(smem);                // [kWarps][16][D]
  float* s_m = s_o + kWarps * decode_sm80::kRows * D;          // [kWarps][16]
  float* s_l = s_m + kWarps * decode_sm80::kRows;              // [kWarps][16]
  static_assert(decode_sm80::kRows * (D + 2) * kWarps * 4 <=
                    decode_sm80::smem_bytes(D, int(sizeof(KV))),
                "the warp merge must fit in the tiles' shared memory");
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf;
    float sum = l[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (t == 0) {
      s_m[warp * decode_sm80::kRows + r] = m[hf];
      s_l[warp * decode_sm80::kRows + r] = sum;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      float* dst = s_o + (warp * decode_sm80::kRows + r) * D + dt * 8 + 2 * t;
      dst[0] = o[dt][2 * hf];
      dst[1] = o[dt][2 * hf + 1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < total_rows * D; idx += blockDim.x) {
    decode::write_merged<T, D, kWarps>(a, s, hk, split, decode_sm80::kRows, idx / D, idx / D,
                                       idx % D, s_m, s_l, s_o, vs);
  }
}

}  // namespace xla_attn
