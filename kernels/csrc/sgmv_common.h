// Helpers shared by the CPU SGMV kernels (`sgmv_cpu.cpp`, `sgmv_group_cpu.cpp`): the register-blocked
// shrink and expand of a tile (`sgmv_blocks.h`), and the expand for B stored with ranks contiguous.
// Accumulation is fp32 whatever the storage dtype.
#pragma once

#include <ATen/ATen.h>

#include "convert.h"
#include "sgmv_blocks.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loragate_sgmv {

using loragate::from_float;
using loragate::to_float;

// The expand with B stored [O, R] (ranks contiguous): a dot per output.
template <typename T>
void expand_dots(T* y, int64_t ldy, const float* vs, int64_t tile, int64_t r, const T* b, int64_t o_stride,
                 int64_t r_stride, int64_t outs) {
  for (int64_t o = 0; o < outs; ++o) {
    const T* br = b + o * o_stride;
    for (int64_t u = 0; u < tile; ++u) {
      float s = 0.f;
      for (int64_t j = 0; j < r; ++j) s += vs[u * r + j] * static_cast<float>(br[j * r_stride]);
      y[u * ldy + o] = static_cast<T>(static_cast<float>(y[u * ldy + o]) + s);
    }
  }
}

}  // namespace loragate_sgmv
