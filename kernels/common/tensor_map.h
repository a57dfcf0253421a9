// A TMA tensor map (CUtensorMap) as kernel params carry it: encoded on the host
// (cuTensorMapEncodeTiled), read by the copy engine (common/tma_sm90.cuh). Device code
// has no cuda.h, so the type is spelled out here; the host checks it against
// CUtensorMap's size and alignment.
#pragma once
#include "common/types.h"

namespace xla_attn::sm90 {

struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

}  // namespace xla_attn::sm90
