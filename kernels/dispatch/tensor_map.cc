#include "dispatch/tensor_map.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace xla_attn::dispatch {
namespace {

// The encoder writes a CUtensorMap into an sm90::TensorMap: the same 128 bytes, aligned to
// the 64 that the copy engine reads a tensor map at (PTX ISA, cp.async.bulk.tensor) and that
// CUDA 12's cuda.h declares. CUDA 13's declares 128; both flavours call the driver's 12.0
// entry point (encoder, below), which the cu12 wheel runs on the same drivers with 64.
// (Asserting equal alignments stopped the cu13 build at this file.)
static_assert(sizeof(sm90::TensorMap) == sizeof(CUtensorMap) && alignof(sm90::TensorMap) >= 64,
              "sm90::TensorMap must hold a CUtensorMap");

// cuTensorMapEncodeTiled as the CUDA 12.0 driver API defines it, found once.
PFN_cuTensorMapEncodeTiled_v12000 encoder(std::string* error) {
  static void* fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // leave no sticky error for the next launch to report
      return static_cast<void*>(nullptr);
    }
    return f;
  }();
  if (!fn) *error = "xla_attn: the CUDA driver has no cuTensorMapEncodeTiled (needs R525+)";
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

}  // namespace

std::string encode_tiled(sm90::TensorMap* map, const void* base, int elem_bytes, int rank,
                         const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                         int swizzle_bytes, int l2_bytes) {
  std::string error;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder(&error);
  if (!encode) return error;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], unit[5];
  if (rank < 1 || rank > 5 || (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4)) {
    return "xla_attn: encode_tiled: rank 1..5 and 1-, 2- or 4-byte elements";
  }
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    unit[i] = 1;
    if (i > 0) s[i - 1] = strides[i - 1];
  }
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  if (swizzle_bytes == 32) swizzle = CU_TENSOR_MAP_SWIZZLE_32B;
  if (swizzle_bytes == 64) swizzle = CU_TENSOR_MAP_SWIZZLE_64B;
  if (swizzle_bytes == 128) swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  CUtensorMapL2promotion l2 = CU_TENSOR_MAP_L2_PROMOTION_NONE;
  if (l2_bytes == 64) l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_64B;
  if (l2_bytes == 128) l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  if (l2_bytes == 256) l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const CUresult status = encode(
      reinterpret_cast<CUtensorMap*>(map),
      elem_bytes == 1   ? CU_TENSOR_MAP_DATA_TYPE_UINT8
      : elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                        : CU_TENSOR_MAP_DATA_TYPE_UINT32,
      cuuint32_t(rank), const_cast<void*>(base), d, s, b, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle, l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    return "xla_attn: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(status)) +
           ")";
  }
  return "";
}

}  // namespace xla_attn::dispatch
