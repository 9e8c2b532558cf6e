// AdamW's update for MindSpore's CPU backend as one AOT custom op per parameter (trainer/optimizer.py AdamW calls
// it through kernels/optimizer.py; kernels/__init__.py builds this file at install time). fp32.
//
// The op updates the parameter and its two moments in place, one pass over the four arrays, where MindSpore's fused
// AdamWeightDecay kernel makes the same pass at about half the memory bandwidth. The op is marked side_effect_mem
// (kernels/optimizer.py), so MindSpore keeps and orders it like its own in-place optimizer kernels.
#include <cmath>
#include <cstdint>

#include "threads.h"

// inputs param, m, v (updated in place), grad g, hyper [5] = (lr, beta1, beta2, eps, decay); output a [1] zero.
// m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
// param -= lr (m / (sqrt(v) + eps) + decay param): nn.AdamWeightDecay's update (no bias correction: AdamW folds it
// into lr, eps and decay)
extern "C" int mindlab_adamw(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                             void* stream, void* extra) {
  if (nparam != 6) return 1;
  float* p = static_cast<float*>(params[0]);
  float* m = static_cast<float*>(params[1]);
  float* v = static_cast<float*>(params[2]);
  const float* g = static_cast<const float*>(params[3]);
  const float* hyper = static_cast<const float*>(params[4]);
  const float lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], decay = hyper[4];
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  mindlab::parallel_ranges(n, [&](int64_t lo, int64_t hi, int64_t) {
    for (int64_t i = lo; i < hi; ++i) {
      const float mi = beta1 * m[i] + (1.0f - beta1) * g[i];
      const float vi = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
      m[i] = mi;
      v[i] = vi;
      p[i] -= lr * (mi / (std::sqrt(vi) + eps) + decay * p[i]);
    }
  });
  static_cast<float*>(params[5])[0] = 0.0f;
  return 0;
}
