// One row of RoPE, y = x cos + rotate_half(x) sin with rotate_half(x) = (-x[h:], x[:h]) for h = D/2, or its
// gradient (transpose): kernels/layers.cc's RoPE op over rows, kernels/attention.cc's decoding step on one token.
#pragma once
#include <cstdint>

namespace mindlab {

// Restrict pointers, so GCC vectorizes the loop: reached through a lambda's captured references, the pointers might
// have been changed by the stores to y and were reloaded every iteration (no vector code: model=small's RoPE took
// ~32 ms of a step by MindSpore's CPU profiler).
inline void rope_row(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                     float* __restrict y, int64_t h, bool transpose) {
  if (transpose) {
    for (int64_t d = 0; d < h; ++d) {
      y[d] = x[d] * c[d] + x[d + h] * s[d + h];
      y[d + h] = x[d + h] * c[d + h] - x[d] * s[d];
    }
  } else {
    for (int64_t d = 0; d < h; ++d) {
      y[d] = x[d] * c[d] - x[d + h] * s[d];
      y[d + h] = x[d + h] * c[d + h] + x[d] * s[d + h];
    }
  }
}

}  // namespace mindlab
