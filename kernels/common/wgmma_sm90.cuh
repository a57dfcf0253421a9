// Hopper's warpgroup matrix instructions (wgmma, sm_90a) and what goes with them, as
// inline PTX (PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate").
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) issues one
// wgmma.mma_async of shape m64nNk16 together: D (64 x N, f32, in registers) =/+= A (64
// x 16) B (16 x N). B always comes from shared memory through a matrix descriptor; A
// from shared memory (descriptor) or registers. The products run asynchronously:
// fence() before the first one that reads registers other code wrote, commit() to
// close a group, wait<n>() until at most n groups are in flight.
//
// Fragments in registers are mma.sync's (common/mma_sm80.cuh) per warp: warp w of the
// warpgroup holds rows 16w .. 16w + 15; the accumulator's n8 column tile j sits in
// d[4j .. 4j + 3] as an m16n8 C fragment, and the A operand is an m16n8k16 A fragment.
// So accum_to_a turns two n8 tiles of one product into the A operand of the next.
//
// Shared-memory operands here are 128-byte swizzled tiles, as the bulk tensor copy
// engine writes them with CU_TENSOR_MAP_SWIZZLE_128B: rows of 128 bytes (64 16-bit
// elements), 16-byte chunk c of row r stored at chunk c ^ (r % 8), each 8-row group a
// 1 KB block starting on a 1 KB boundary. Wider rows are cut in 64-element column
// blocks stored one after the other ("chunks" below).
#pragma once
#include "common/mma_sm80.cuh"

namespace xla_attn::sm90 {

// x, which every lane of the warp already holds alike, taken from lane 0: ptxas then
// knows it is warp-uniform and keeps what is made of it (descriptors, stage addresses,
// loop bounds) in uniform registers. Derived from threadIdx or loaded values, each
// descriptor went through R2UR moves (the dk/dv kernels: 129 / 97 R2UR at d128 / d64
// against 21; the forward's d128: 74 against 37).
template <typename T>
__device__ __forceinline__ T warp_uniform(T x) {
  return __shfl_sync(0xffffffffu, x, 0);
}

// The 64-bit matrix descriptor of a 128-byte swizzled operand at shared address
// `addr` (PTX ISA: "Matrix Descriptor Format"): address, leading- and stride-dimension
// byte offsets, all >> 4; bits 62-63 = 1 select the 128-byte swizzle.
// - K-major (Q and K, rows along M / N, the 16 k-elements of a step inside one 128-byte
//   row): the stride offset is 1 KB between 8-row groups; the leading offset is unused
//   (1). A k-step inside the row moves `addr` by 32 bytes.
// - N-major (V for P V, keys along K, head dims along N): the stride offset is 1 KB
//   between 8-key groups, the leading offset the distance between 64-column blocks.
// The high word (stride and swizzle) is the same for every operand of these kernels, so
// a product may take a descriptor's low word as its operand and join it to that
// constant inside its asm (kDescLowWord, XLA_ATTN_DESC): the adds stepping a descriptor
// are then 32-bit. The backward takes it: passed as 64-bit values, each of its products
// had an add with carry, copies and four moves into uniform registers (~13 instructions
// a product in the d64 S^T / dP^T; ncu, H100, S = 4096: IMAD and R2UR were 30 % of the
// kernel's instructions), and at d128 it spilled 104 bytes against 48. H100, same run,
// fwd+bwd: d128 +3..+4 %, d256 +3 %, d64 +1 %. The forward does not: the same change
// there lost 8 % at d128 S = 8192 and 6 % at d256 S = 4096 (walks within 1 %).
constexpr uint32_t kDescHigh = (1024 >> 4) | 1u << 30;
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(leading_bytes >> 4) << 16 |
         uint64_t(kDescHigh) << 32;
}
__device__ __forceinline__ uint32_t desc_lo(uint64_t desc) { return uint32_t(desc); }

// The descriptor of the operand `bytes` (a multiple of 16) further on from `desc`'s: the
// start address is the descriptor's low 14 bits (>> 4), so adding to it is exact while
// both stay inside shared memory's 256 KB window. One add a product, where a descriptor
// built from an address takes five instructions.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Shared address of 16-byte chunk c of row r in such a tile at `base`: column block c /
// 8 (`block_bytes` apart), row r (128 bytes), chunk c % 8 swizzled with the row.
__device__ __forceinline__ uint32_t swizzled_chunk(uint32_t base, uint32_t block_bytes, int r,
                                                   int c) {
  return base + uint32_t(c / 8) * block_bytes + uint32_t(r) * 128u +
         16u * uint32_t((c % 8) ^ (r % 8));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins a product's registers in program order (an empty volatile asm that "writes"
// them): held after wgmma_wait, no read of an accumulator moves above the wait; held
// before wgmma_fence, every write of an accumulator or A fragment lands before the
// fence, as the PTX ISA requires of registers an asynchronous product reads.
template <int R>
__device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void wgmma_hold(uint32_t (&a)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
  }
}

// Register budget per thread of a warpgroup (setmaxnreg, sm_90a): a producer warpgroup
// gives registers back, consumer warpgroups take them. Counts are multiples of 8.
template <int kRegs>
__device__ __forceinline__ void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_acquire() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// stmatrix.x4: four 8 x 8 matrices of 16-bit units to shared memory, lane l giving row
// l / 4, units 2 (l % 4) and + 1 of matrix i in r[i], lanes 8i .. 8i + 7 the row addresses.
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: wait there, or
// only arrive (counted, not waiting).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same wait without .aligned: for a barrier that warps reach from different places in
// the code (bar.sync is barrier.sync.aligned, which the PTX ISA leaves undefined unless
// every thread executes the same instruction; compute-sanitizer's synccheck reports it as
// "divergent threads"). The forward's V-tail meeting is reached from the tile loop by the
// warpgroups that compute the last tile and from the passing loop by those that do not.
__device__ __forceinline__ void named_barrier_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// named_barrier that also returns whether pred held in every thread that came.
__device__ __forceinline__ bool named_barrier_all(int id, int threads, bool pred) {
  uint32_t all;
  asm volatile(
      "{ .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q; }\n"
      : "=r"(all)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

// A descriptor register `reg` from the low word in operand `lo` and the constant high word.
#define XLA_ATTN_DESC(reg, lo) "mov.b64 " reg ", {%" lo ", " XLA_ATTN_DESC_HIGH "};\n"
#define XLA_ATTN_DESC_HIGH "0x40000040"
static_assert(kDescHigh == 0x40000040u, "XLA_ATTN_DESC_HIGH spells kDescHigh");

// Spelled-out operand lists: inline PTX needs every accumulator register by name.
#define XLA_ATTN_WGMMA_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define XLA_ATTN_WGMMA_ACC16(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define XLA_ATTN_WGMMA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define XLA_ATTN_WGMMA_ACC32(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define XLA_ATTN_WGMMA_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define XLA_ATTN_WGMMA_ACC64(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define XLA_ATTN_WGMMA_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define XLA_ATTN_WGMMA_ACC128(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D (64 x N) = A B (accumulate = false) or D += A B; A (64 x 16) and B (16 x N) in
// shared memory, K-major (TRANS "0, 0") or both M/N-major ("1, 1").
#define XLA_ATTN_WGMMA_SS(N, REGS, ACC, A, B, FLAG, TY, TRANS)                                \
  if constexpr (kDescLowWord) {                                                               \
    asm volatile("{ .reg .pred p; .reg .b64 da, db; setp.ne.b32 p, %" FLAG ", 0;\n"          \
                 XLA_ATTN_DESC("da", A) XLA_ATTN_DESC("db", B)                               \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", da, db, p, 1, 1, " TRANS "; }\n"                                       \
                 : ACC(d)                                                                   \
                 : "r"(desc_lo(desc_a)), "r"(desc_lo(desc_b)), "r"(int(accumulate)));       \
  } else {                                                                                    \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" FLAG ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", %" A ", %" B ", p, 1, 1, " TRANS "; }\n"                               \
                 : ACC(d)                                                                   \
                 : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));                         \
  }
// D (64 x N) += A B; A (64 x 16) in registers, B (16 x N) N-major in shared memory. FLAG:
// unused (XLA_ATTN_WGMMA_RS_D's operand, so that XLA_ATTN_WGMMA_RS_NT takes either).
#define XLA_ATTN_WGMMA_RS(N, REGS, ACC, A0, A1, A2, A3, B, FLAG, TY)                          \
  if constexpr (kDescLowWord) {                                                               \
    asm volatile("{ .reg .b64 db;\n" XLA_ATTN_DESC("db", B)                                  \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, db, 1, 1, 1, 1; }\n"              \
                 : ACC(d)                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo(desc_b)));       \
  } else {                                                                                    \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", 1, 1, 1, 1;\n"            \
                 : ACC(d)                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                \
  }
// The same with D = A B where !accumulate (scale-d as a predicate; FLAG its operand).
#define XLA_ATTN_WGMMA_RS_D(N, REGS, ACC, A0, A1, A2, A3, B, FLAG, TY)                        \
  if constexpr (kDescLowWord) {                                                               \
    asm volatile("{ .reg .pred p; .reg .b64 db; setp.ne.b32 p, %" FLAG ", 0;\n"               \
                 XLA_ATTN_DESC("db", B)                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, db, p, 1, 1, 1; }\n"              \
                 : ACC(d)                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo(desc_b)),        \
                   "r"(int(accumulate)));                                                   \
  } else {                                                                                    \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" FLAG ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS        \
                 ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1; }\n"          \
                 : ACC(d)                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                 \
                   "r"(int(accumulate)));                                                   \
  }
// One of those (MACRO) for wgmma_rs's N and T (kBf16).
#define XLA_ATTN_WGMMA_RS_NT(MACRO)                                                            \
  if constexpr (N == 64 && kBf16) {                                                           \
    MACRO("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34", "35", "36",     \
          "37", "bf16");                                                                      \
  } else if constexpr (N == 64) {                                                             \
    MACRO("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34", "35", "36",     \
          "37", "f16");                                                                       \
  } else if constexpr (N == 128 && kBf16) {                                                   \
    MACRO("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66", "67", "68",    \
          "69", "bf16");                                                                      \
  } else if constexpr (N == 128) {                                                            \
    MACRO("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66", "67", "68",    \
          "69", "f16");                                                                       \
  } else if constexpr (kBf16) {                                                               \
    MACRO("256", XLA_ATTN_WGMMA_REGS128, XLA_ATTN_WGMMA_ACC128, "128", "129", "130", "131",    \
          "132", "133", "bf16");                                                              \
  } else {                                                                                    \
    MACRO("256", XLA_ATTN_WGMMA_REGS128, XLA_ATTN_WGMMA_ACC128, "128", "129", "130", "131",    \
          "132", "133", "f16");                                                               \
  }

// The operands' layouts in shared memory (imm-trans-a, imm-trans-b):
// - kK: A (64 x 16) K-major and B (16 x N) K-major ("0, 0"), as S = Q K^T reads them.
// - kMN: A stored M-major and B N-major ("1, 1"; 16-bit types only), as the backward's
//   dQ = dS K reads dS^T and K as stored (N = 32 for a half column block: B then starts
//   64 bytes into its 128-byte rows; N = 128 spans two column blocks, the leading offset
//   apart).
// - kBN: A K-major, B N-major ("0, 1"), as the backward's dK += dS^T Q reads dS^T (keys x
//   rows) and Q (rows x D) as stored.
enum class SsMajor { kK, kMN, kBN };

// One wgmma_ss instruction for wgmma_ss's N and T (kBf16) with the layouts TRANS.
#define XLA_ATTN_WGMMA_SS_NT(TRANS)                                                            \
  if constexpr (N == 32 && kBf16) {                                                           \
    XLA_ATTN_WGMMA_SS("32", XLA_ATTN_WGMMA_REGS16, XLA_ATTN_WGMMA_ACC16, "16", "17", "18",     \
                      "bf16", TRANS);                                                         \
  } else if constexpr (N == 32) {                                                             \
    XLA_ATTN_WGMMA_SS("32", XLA_ATTN_WGMMA_REGS16, XLA_ATTN_WGMMA_ACC16, "16", "17", "18",     \
                      "f16", TRANS);                                                          \
  } else if constexpr (N == 64 && kBf16) {                                                    \
    XLA_ATTN_WGMMA_SS("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34",     \
                      "bf16", TRANS);                                                         \
  } else if constexpr (N == 64) {                                                             \
    XLA_ATTN_WGMMA_SS("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34",     \
                      "f16", TRANS);                                                          \
  } else if constexpr (kBf16) {                                                               \
    XLA_ATTN_WGMMA_SS("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66",    \
                      "bf16", TRANS);                                                         \
  } else {                                                                                    \
    XLA_ATTN_WGMMA_SS("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66",    \
                      "f16", TRANS);                                                          \
  }

// kDescLowWord: the descriptors enter the asm as their low words (see kDescHigh).
template <int N, typename T, SsMajor kMajor = SsMajor::kK, bool kDescLowWord = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
  constexpr bool kBf16 = kSameType<T, __nv_bfloat16>;
  static_assert(kBf16 || kSameType<T, __half>, "wgmma_ss takes __half or __nv_bfloat16");
  static_assert(N == 64 || N == 128 || (N == 32 && kMajor == SsMajor::kMN),
                "wgmma_ss: N = 64 or 128 (32: M/N-major)");
  if constexpr (kMajor == SsMajor::kMN) {
    XLA_ATTN_WGMMA_SS_NT("1, 1")
  } else if constexpr (kMajor == SsMajor::kBN) {
    XLA_ATTN_WGMMA_SS_NT("0, 1")
  } else {
    XLA_ATTN_WGMMA_SS_NT("0, 0")
  }
}

// kScaleD: D = A B where !accumulate (XLA_ATTN_WGMMA_RS_D), else always D += A B.
template <int N, typename T, bool kDescLowWord = false, bool kScaleD = false>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b, bool accumulate = true) {
  constexpr bool kBf16 = kSameType<T, __nv_bfloat16>;
  static_assert(kBf16 || kSameType<T, __half>, "wgmma_rs takes __half or __nv_bfloat16");
  static_assert(N == 64 || N == 128 || N == 256, "wgmma_rs: N = 64, 128 or 256");
  if constexpr (kScaleD) {
    XLA_ATTN_WGMMA_RS_NT(XLA_ATTN_WGMMA_RS_D)
  } else {
    XLA_ATTN_WGMMA_RS_NT(XLA_ATTN_WGMMA_RS)
  }
}

// fp8 (e4m3) products: m64nNk32, both operands K-major (8-bit types take no transpose),
// A from shared memory (SS) or registers (RS: 4 b32 of 4 bytes, row g: k 4t..4t+3 and
// 16+4t.., row g+8 the same, i.e. mma.sync's m16n8k32 A fragment per warp).
#define XLA_ATTN_WGMMA_SS_E4M3(N, REGS, ACC, A, B, FLAG)                                      \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %" FLAG ", 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n" N "k32.f32.e4m3.e4m3 " REGS              \
               ", %" A ", %" B ", p, 1, 1; }\n"                                              \
               : ACC(d)                                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
#define XLA_ATTN_WGMMA_RS_E4M3(N, REGS, ACC, A0, A1, A2, A3, B, FLAG)                         \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" N "k32.f32.e4m3.e4m3 " REGS              \
               ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", 1, 1, 1;\n"                \
               : ACC(d)                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
// The same with D = A B where !accumulate (XLA_ATTN_WGMMA_RS_D's scale-d).
#define XLA_ATTN_WGMMA_RS_E4M3_D(N, REGS, ACC, A0, A1, A2, A3, B, FLAG)                       \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %" FLAG ", 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n" N "k32.f32.e4m3.e4m3 " REGS              \
               ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1; }\n"              \
               : ACC(d)                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)))
#define XLA_ATTN_WGMMA_RS_E4M3_N(MACRO)                                                        \
  if constexpr (N == 64) {                                                                    \
    MACRO("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34", "35", "36",     \
          "37");                                                                              \
  } else if constexpr (N == 128) {                                                            \
    MACRO("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66", "67", "68",    \
          "69");                                                                              \
  } else {                                                                                    \
    MACRO("256", XLA_ATTN_WGMMA_REGS128, XLA_ATTN_WGMMA_ACC128, "128", "129", "130", "131",    \
          "132", "133");                                                                      \
  }

template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], uint64_t desc_a,
                                              uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss_e4m3: N = 64 or 128");
  if constexpr (N == 64) {
    XLA_ATTN_WGMMA_SS_E4M3("64", XLA_ATTN_WGMMA_REGS32, XLA_ATTN_WGMMA_ACC32, "32", "33", "34");
  } else {
    XLA_ATTN_WGMMA_SS_E4M3("128", XLA_ATTN_WGMMA_REGS64, XLA_ATTN_WGMMA_ACC64, "64", "65", "66");
  }
}

// kScaleD as wgmma_rs's.
template <int N, bool kScaleD = false>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, bool accumulate = true) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma_rs_e4m3: N = 64, 128 or 256");
  if constexpr (kScaleD) {
    XLA_ATTN_WGMMA_RS_E4M3_N(XLA_ATTN_WGMMA_RS_E4M3_D)
  } else {
    XLA_ATTN_WGMMA_RS_E4M3_N(XLA_ATTN_WGMMA_RS_E4M3)
  }
}

#undef XLA_ATTN_WGMMA_SS
#undef XLA_ATTN_WGMMA_SS_NT
#undef XLA_ATTN_WGMMA_RS
#undef XLA_ATTN_WGMMA_RS_D
#undef XLA_ATTN_WGMMA_RS_NT
#undef XLA_ATTN_WGMMA_SS_E4M3
#undef XLA_ATTN_WGMMA_RS_E4M3
#undef XLA_ATTN_WGMMA_RS_E4M3_D
#undef XLA_ATTN_WGMMA_RS_E4M3_N
#undef XLA_ATTN_DESC

}  // namespace xla_attn::sm90
