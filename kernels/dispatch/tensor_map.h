// Tensor maps for Hopper's bulk tensor copies (TMA), encoded on the host by the
// driver's cuTensorMapEncodeTiled. The library links no libcuda: the function comes
// from the driver at run time, through the CUDA runtime's entry-point query.
#pragma once
#include <cstdint>
#include <string>

#include "common/tensor_map.h"

namespace xla_attn::dispatch {

// A tiled map of a `rank`-d tensor at `base` (16-byte aligned) of unsigned integers of
// `elem_bytes` (1 or 2: copies move bits, so any 8- or 16-bit dtype), dims innermost
// first, strides in bytes of dims 1.. (multiples of 16), boxes of `box` elements,
// swizzled in spans of `swizzle_bytes` (0, 32, 64 or 128), L2 fetches widened to
// `l2_bytes` (0, 64, 128 or 256). "" or why it failed.
std::string encode_tiled(sm90::TensorMap* map, const void* base, int elem_bytes, int rank,
                         const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                         int swizzle_bytes, int l2_bytes);

}  // namespace xla_attn::dispatch
