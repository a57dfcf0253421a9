// Tensor-core and async-copy building blocks of sm_80+ (Ampere, Ada, Hopper through
// the legacy warp-level path), as inline PTX so the kernels read like the algorithm.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type" and "ldmatrix"), with g = lane / 4 (groupID) and t = lane % 4:
//
//   A (16 x 16, row-major, .f16/.bf16), 4 registers of 2 elements (low half first):
//     a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//     a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//   B (16 x 8, "col": element (k, n) with k contiguous), 2 registers:
//     b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
//   C/D (16 x 8, f32), 4 registers:
//     c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g + 8][2t, 2t+1]
//
//   ldmatrix .m8n8 .x4 .b16: lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes
//   each) of matrix i; register i of lane l receives row l / 4, elements 2(l % 4) and
//   2(l % 4) + 1 of matrix i. With .trans it receives instead column l / 4, rows
//   2(l % 4) and 2(l % 4) + 1 (the matrix transposed).
//
// The flash kernels give lane l of ldsm_x4 / ldsm_x4_trans the address of row (l & 15),
// column block (l >> 4) of a 16 x 16 tile for A operands and transposed B operands, so
// the four matrices are, in register order:
//   r[0] = rows 0-7, cols 0-7    r[1] = rows 8-15, cols 0-7
//   r[2] = rows 0-7, cols 8-15   r[3] = rows 8-15, cols 8-15
// which is exactly an A fragment or, transposed, two B fragments of an N-major tile
// ({r0, r1} for cols 0-7, {r2, r3} for cols 8-15). B operands of a K-major tile read as
// stored take row (l & 7) + 8 (l >> 4), column block (l >> 3) & 1 instead, giving
// {r0, r1} = the B fragment of rows 0-7 and {r2, r3} that of rows 8-15 (LdsmLane in
// flash/fwd_sm80_tile.cuh).
#pragma once
#include "common/vec.cuh"

namespace xla_attn::sm80 {

// Shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte global -> shared copy that bypasses L1 (.cg: K/V tiles are read once per
// block, L2 keeps them for the other row blocks of the head).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
// The same with the destination as a shared-window address (smem_addr), so that a
// loop over a tile adds constant offsets to one 32-bit address instead of converting a
// generic pointer per copy.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// And with `valid`: false writes 16 zero bytes and reads nothing (the copy's source
// size 0), with no branch and no separate shared store.
__device__ __forceinline__ void cp_async_16_or_zero(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// `addr`: this lane's row address in the shared window (see smem_addr).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += A B for one m16n8k16 step, f32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (kSameType<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(kSameType<T, __half>, "mma_16816 takes __half or __nv_bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// d += A B for one m16n8k32 step of e4m3 operands (sm_89+), f32 accumulators. The
// fragments hold 4 bytes where the 16-bit ones hold 2 elements (PTX ISA, "Matrix
// Fragments for mma.m16n8k32"): a[0] = A[g][4t .. 4t+3], a[1] = A[g+8][...], a[2] / a[3]
// the same at k + 16; b[0] = B[4t .. 4t+3][g], b[1] at k + 16. So a 16-bit ldmatrix over
// rows of e4m3 pairs returns them as it returns the 16-bit fragments.
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One k-step of 32 bytes a row: m16n8k16 for 16-bit T, m16n8k32 for e4m3.
template <typename T>
__device__ __forceinline__ void mma_step(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kSameType<T, __nv_fp8_e4m3>) {
    mma_e4m3_16832(d, a, b0, b1);
  } else {
    mma_16816<T>(d, a, b0, b1);
  }
}

// Four floats as e4m3 bytes 0..3 of a b32 (round to nearest, saturating at +-448; sm_89+):
// cvt puts its first source in the upper byte of each pair.
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  uint32_t lo, hi;
  asm("{ .reg .b16 l, h;\n"
      "cvt.rn.satfinite.e4m3x2.f32 l, %3, %2;\n"
      "cvt.rn.satfinite.e4m3x2.f32 h, %5, %4;\n"
      "cvt.u32.u16 %0, l;\n"
      "cvt.u32.u16 %1, h; }\n"
      : "=r"(lo), "=r"(hi)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return lo | (hi << 16);
}

// Two floats rounded to T and packed as one b32 register, `lo` in the low half (the
// lower column of a fragment pair, and the lower address in memory).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kSameType<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The A fragment (16 rows x 16 k) of two f32 accumulator n8 tiles side by side (c0, c1
// -> a0 / a2; c2, c3 -> a1 / a3), rounded to T: a product's result as the next
// product's A operand without a trip through shared memory (P V, dV += P^T dO, ...).
template <typename T>
__device__ __forceinline__ void accum_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                           const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

}  // namespace xla_attn::sm80
