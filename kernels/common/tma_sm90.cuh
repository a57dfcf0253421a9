// Hopper's bulk tensor copies (TMA) and the shared-memory barriers they complete on,
// as inline PTX (PTX ISA: "cp.async.bulk.tensor", "mbarrier"). Plain sm_90: nothing
// here needs sm_90a.
//
// A tensor copy is issued by one thread with a tensor map (a CUtensorMap the host
// encodes, passed inside the kernel's __grid_constant__ params so its generic address
// is valid) and box coordinates; the copy engine writes the box into shared memory,
// swizzled as the map says, and adds the bytes it wrote to an mbarrier's transaction
// count. Coordinates outside the tensor read as zeros and still count their bytes.
#pragma once
#include "common/tensor_map.h"

namespace xla_attn::sm90 {

// `arrivals` arrivals (1: the issuing thread's) complete a phase, once the bytes
// announced by expect_tx have landed.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals = 1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes barrier initialisation visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The issuing thread's arrival, announcing `bytes` of copies to come in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// A plain arrival (no bytes announced): a consumer handing a stage back.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spins until the barrier's phase of parity `parity` has completed; the copies it
// counted are then visible to the waiting thread.
// kParked, for the forward's copying thread, which waits on its consumers (a stage to
// refill, a Q buffer): each try may suspend the thread up to the hint (10 ms; the
// phase's completion wakes it) instead of returning at once, so that its retries take
// no issue slots from the consumer warps on its scheduler. ncu on an H100 (fp8 d128
// forward, S=8192) counted that thread's retry loop at 46 M instructions, 7 % of the
// kernel's; H100 A/B with the forward's descriptor adds (same run): bf16 d64 +2..3 %,
// d256 +4 %, d128 and fp8 within +-2 %.
template <bool kParked = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  constexpr uint32_t kSuspendNs = 10000000;
  uint32_t done;
  do {
    if constexpr (kParked) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;"
          " selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity), "r"(kSuspendNs)
          : "memory");
    } else {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
          " selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  } while (!done);
}

// Orders this thread's earlier generic-proxy shared-memory writes before later
// async-proxy (copy engine) accesses of the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Box at coordinate c0 of a 1-d tensor map into shared address dst, completing on bar.
__device__ __forceinline__ void tma_load_1d(uint32_t dst, const TensorMap* map, uint32_t bar,
                                            int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2}], [%3];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(bar)
      : "memory");
}

// Box at coordinates c0..c4 (innermost first) of a 5-d tensor map into shared address
// dst, completing on barrier bar.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const TensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// Box at coordinates c0..c2 (innermost first) of a 3-d tensor map.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The reverse: the box at coordinates c0..c2 from shared address src (laid out as a load
// of the same map would land it) into global memory, in this thread's current bulk group.
// Elements outside the tensor are not written.
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, uint32_t src, int c0, int c1,
                                             int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// Bulk (non-tensor) reduction: adds `bytes` (a multiple of 16) of f32 from shared memory
// at `src` into global memory at `dst` (both 16-byte aligned), in this thread's current
// bulk group. The copy engine does the adds in L2, so the issuing warp neither holds
// registers nor queues per-thread atomics for them.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's bulk groups are pending: kRead, until their
// shared-memory sources have been read (the buffer may be written again); otherwise
// until they have completed.
template <int N, bool kRead>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
  }
}

// Fetches the tensor map into the copy engine's descriptor cache ahead of first use.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace xla_attn::sm90
