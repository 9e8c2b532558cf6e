// The optimizer step's passes over the parameters for MindSpore's CPU backend as AOT custom ops, each taking any
// number of tensors (trainer/step.py ClipAndUpdate and trainer/optimizer.py AdamW call them through
// kernels/optimizer.py; kernels/__init__.py builds this file at install time). fp32.
//
//   mindlab_square_sum  the sum of squares of its inputs: one gradient's, for the global norm (clipping's and the
//                       finite check's input)
//   mindlab_adamw       AdamW's update of every parameter and its moments in place, in one op, the gradients times
//                       a factor (1 / loss scale x clipping's)
//
// Where the graph had ~10 ops per parameter (4 for its square sum, the clipping product, the bias-corrected
// hyperparameters, MindSpore's fused AdamWeightDecay, whose pass has about half this one's memory bandwidth):
// compiling those ~750 ops took seconds. The update is marked side_effect_mem (kernels/optimizer.py), so MindSpore
// keeps and orders it like its own in-place optimizer kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "threads.h"

namespace {

// The n tensors params[first .. first + n) as one flat index: tensor k holds elements [start[k], start[k + 1]).
struct Flat {
  std::vector<int64_t> start;

  Flat(int first, int n, int* ndims, int64_t** shapes) : start(n + 1, 0) {
    for (int k = 0; k < n; ++k) {
      int64_t size = 1;
      for (int d = 0; d < ndims[first + k]; ++d) size *= shapes[first + k][d];
      start[k + 1] = start[k] + size;
    }
  }
  int64_t size() const { return start.back(); }

  // body(k, lo, hi) for each part [lo, hi) of tensor k within [flat_lo, flat_hi), on one thread per core
  template <class Body>
  void parallel(Body body) const {
    const int n = static_cast<int>(start.size()) - 1;
    mindlab::parallel_ranges(size(), size(), [&](int64_t flat_lo, int64_t flat_hi, int64_t part) {
      int k = static_cast<int>(std::upper_bound(start.begin(), start.end(), flat_lo) - start.begin()) - 1;
      for (; k < n && start[k] < flat_hi; ++k)
        body(k, std::max(flat_lo, start[k]) - start[k], std::min(flat_hi, start[k + 1]) - start[k], part);
    });
  }
};

// One AdamW range of one tensor. Its own function, with restrict pointers and the hyperparameters as values: in
// the loop of the lambda that calls it they were references, which the stores to m, v and p might alias, so GCC
// reloaded them and did not vectorize the loop (model=small's update took 27-35 ms instead of 8-13 on its own on a
// 2-core AMD EPYC with AVX-512: kernels/probes/ops.py).
void adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g, int64_t lo,
                 int64_t hi, float lr, float beta1, float beta2, float eps, float wd, float factor) {
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g[i] * factor;
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * (mi / (std::sqrt(vi) + eps) + wd * p[i]);
  }
}

}  // namespace

// inputs: tensors[n]; output: the sum of x^2 over all of them [1], in fp32 within blocks of 4096 (vectorized) and in
// fp64 across them. inf or NaN when an input holds one.
extern "C" int mindlab_square_sum(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                 void* stream, void* extra) {
  const int n = nparam - 1;
  if (n < 1) return 1;
  const Flat flat(0, n, ndims, shapes);
  std::vector<double> sums(mindlab::cores(), 0.0);
  flat.parallel([&](int k, int64_t lo, int64_t hi, int64_t part) {
    const float* g = static_cast<const float*>(params[k]);
    for (int64_t block = lo; block < hi; block += 4096) {
      float s = 0.0f;
      for (int64_t i = block; i < std::min(hi, block + 4096); ++i) s += g[i] * g[i];
      sums[part] += s;
    }
  });
  double sum = 0.0;
  for (double s : sums) sum += s;
  static_cast<float*>(params[nparam - 1])[0] = static_cast<float>(sum);
  return 0;
}

// inputs: hyper [6] = (lr, beta1, beta2, eps, decay_scale, factor), decay [n] (each parameter's weight decay), then
// params[n], m[n], v[n] (updated in place) and grads[n]; output: a [1] zero. With g = grad * factor:
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;  p -= lr (m / (sqrt(v) + eps) + decay p)
// decay = decay[k] * decay_scale: nn.AdamWeightDecay's update (no bias correction: AdamW folds it into lr, eps
// and decay_scale).
extern "C" int mindlab_adamw(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                             void* stream, void* extra) {
  if (nparam < 7 || (nparam - 3) % 4 != 0) return 1;
  const int n = (nparam - 3) / 4;
  const float* hyper = static_cast<const float*>(params[0]);
  const float* decay = static_cast<const float*>(params[1]);
  auto tensor = [&](int group, int k) { return static_cast<float*>(params[2 + group * n + k]); };  // p m v g
  Flat(2, n, ndims, shapes).parallel([&](int k, int64_t lo, int64_t hi, int64_t) {
    adamw_range(tensor(0, k), tensor(1, k), tensor(2, k), tensor(3, k), lo, hi, hyper[0], hyper[1], hyper[2],
                hyper[3], decay[k] * hyper[4], hyper[5]);
  });
  static_cast<float*>(params[nparam - 1])[0] = 0.0f;
  return 0;
}
