// RMSNorm, SwiGLU, RoPE and token cross-entropy for MindSpore's CPU backend, forward and backward, and a Linear's
// products (at a training step's shapes and at one row, decoding), as AOT custom ops (kernels/layers.py wraps
// them; kernels/__init__.py builds this file at install time). fp32 throughout.
//
// Each is one pass over its rows where MindSpore's ops take several kernels with a temporary array each: the
// RMSNorm's square, mean, rsqrt, two broadcasts and products (and twice as many in its gradient), SiLU's sigmoid
// and two products (its gradient recomputes the sigmoid), RoPE's slices, negation, concatenation, two products
// and a sum. Rows are split into one contiguous range per core (threads.h). Their gradients are written to memory
// by non-temporal stores (stream.h); the Linear's products are oneDNN's sgemm (sgemm.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "rope.h"
#include "sgemm.h"
#include "stream.h"
#include "threads.h"

namespace {

using mindlab::parallel_ranges;
using mindlab::rope_row;
using mindlab::stream_fence;
using mindlab::stream_to;
using mindlab::streamed;

int64_t rows(int ndim, const int64_t* shape) {  // the product of all but the last dimension
  int64_t n = 1;
  for (int i = 0; i + 1 < ndim; ++i) n *= shape[i];
  return n;
}

int64_t elements(int ndim, const int64_t* shape) { return rows(ndim, shape) * shape[ndim - 1]; }

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// RoPE's table rows: cos/sin broadcast against x [..., D] (leading dimensions of 1 or x's, fewer dimensions
// padded on the left); offset(r) is the table row of x's row r.
struct TableRows {
  std::vector<int64_t> extent, stride;  // x's leading dimensions, the table's stride along each (0: broadcast)
  TableRows(int xdim, const int64_t* xshape, int tdim, const int64_t* tshape) {
    const int lead = xdim - 1, pad = xdim - tdim;
    extent.assign(xshape, xshape + lead);
    stride.assign(lead, 0);
    int64_t step = tshape[tdim - 1];
    for (int i = lead - 1; i >= 0; --i) {
      const int64_t t = i - pad >= 0 ? tshape[i - pad] : 1;
      stride[i] = t == 1 ? 0 : step;
      step *= t;
    }
  }
  int64_t offset(int64_t r) const {
    int64_t at = 0;
    for (int i = static_cast<int>(extent.size()) - 1; i >= 0; --i) {
      at += (r % extent[i]) * stride[i];
      r /= extent[i];
    }
    return at;
  }
};

// y = x cos + rotate_half(x) sin, rotate_half(x) = (-x[h:], x[:h]) for h = D/2; with transpose, the gradient
// dx = dy cos + rotate_half^T(dy sin), rotate_half^T(z) = (z[h:], -z[:h]).
void rope(void** params, int* ndims, int64_t** shapes, bool transpose) {
  const float* x = static_cast<const float*>(params[0]);
  const float* cos = static_cast<const float*>(params[1]);
  const float* sin = static_cast<const float*>(params[2]);
  float* y = static_cast<float*>(params[3]);
  const int64_t D = shapes[0][ndims[0] - 1];
  const TableRows table(ndims[0], shapes[0], ndims[1], shapes[1]);
  const int64_t n = rows(ndims[0], shapes[0]);
  if (!transpose) {
    parallel_ranges(n, n * D, [&](int64_t lo, int64_t hi, int64_t) {
      for (int64_t r = lo; r < hi; ++r)
        rope_row(x + r * D, cos + table.offset(r), sin + table.offset(r), y + r * D, D / 2, false);
    });
    return;
  }
  // the gradient: a chunk of rows at a time into L1, then streamed out (stream.h)
  const int64_t chunk = std::max<int64_t>(1, mindlab::kChunk / D);
  parallel_ranges(n, n * D, [&](int64_t lo, int64_t hi, int64_t) {
    std::vector<float> out(chunk * D);
    for (int64_t r0 = lo; r0 < hi; r0 += chunk) {
      const int64_t r1 = std::min(hi, r0 + chunk);
      for (int64_t r = r0; r < r1; ++r)
        rope_row(x + r * D, cos + table.offset(r), sin + table.offset(r), &out[(r - r0) * D], D / 2, true);
      stream_to(y + r0 * D, out.data(), (r1 - r0) * D);
    }
    stream_fence();
  });
}

// y[i] = w[i] . x for rows lo..hi-1 of w [N, K]
void dot_rows(const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t lo, int64_t hi,
              int64_t K) {
  for (int64_t i = lo; i < hi; ++i) {
    const float* wi = w + i * K;
    float sum = 0.0f;
    for (int64_t j = 0; j < K; ++j) sum += wi[j] * x[j];
    y[i] = sum;
  }
}

// c [m, n] = op(a) op(b), c's rows split over the cores; a_row: how far apart op(a)'s rows are in a
void product_by_rows(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t a_row,
                     const float* b, int64_t ldb, float* c) {
  parallel_ranges(m, m * n, [&](int64_t lo, int64_t hi, int64_t) {
    dnnl_sgemm(ta, tb, hi - lo, n, k, 1.0f, a + lo * a_row, lda, b, ldb, 0.0f, c + lo * n, n);
  });
}

}  // namespace

// A Linear's three products at a training step's shapes (models/llama/model.py Linear), each on oneDNN's sgemm with
// one range of output rows per core: y = x w^T, dx = dy w, dw = dy^T x for x [..., K], w [N, K], dy [..., N]. On
// 2-core AMD EPYC boxes this ran model=small's products 2-35% faster than MindSpore's MatMul, a small training step
// 1-4% faster and a medium one 4-7%. The two gradients are separate ops, so a frozen weight's (LoRA's base) is pruned from the
// graph as MatMul's is.
//
// inputs x [..., K], w [N, K]; output y [..., N] = x w^T
extern "C" int mindlab_linear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                              void* stream, void* extra) {
  if (nparam != 3) return 1;
  const int64_t M = rows(ndims[0], shapes[0]), N = shapes[1][0], K = shapes[1][1];
  product_by_rows('N', 'T', M, N, K, static_cast<const float*>(params[0]), K, K,
                  static_cast<const float*>(params[1]), K, static_cast<float*>(params[2]));
  return 0;
}

// inputs dy [..., N], w [N, K]; output dx [..., K] = dy w
extern "C" int mindlab_linear_input_grad(int nparam, void** params, int* ndims, int64_t** shapes,
                                         const char** dtypes, void* stream, void* extra) {
  if (nparam != 3) return 1;
  const int64_t M = rows(ndims[0], shapes[0]), N = shapes[1][0], K = shapes[1][1];
  product_by_rows('N', 'N', M, K, N, static_cast<const float*>(params[0]), N, N,
                  static_cast<const float*>(params[1]), K, static_cast<float*>(params[2]));
  return 0;
}

// inputs dy [..., N], x [..., K]; output dw [N, K] = dy^T x (dw's rows are dy's columns: each core reads all of x)
extern "C" int mindlab_linear_weight_grad(int nparam, void** params, int* ndims, int64_t** shapes,
                                          const char** dtypes, void* stream, void* extra) {
  if (nparam != 3) return 1;
  const int64_t M = rows(ndims[0], shapes[0]), N = shapes[0][ndims[0] - 1], K = shapes[1][ndims[1] - 1];
  product_by_rows('T', 'N', N, K, M, static_cast<const float*>(params[0]), N, 1,
                  static_cast<const float*>(params[1]), K, static_cast<float*>(params[2]));
  return 0;
}

// inputs x [..., H], weight [H], eps [1]; outputs y [..., H], inv_rms [rows]: y = x * inv_rms * weight,
// inv_rms = 1 / sqrt(mean(x^2) + eps) per row
extern "C" int mindlab_rms_norm_forward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                        void* stream, void* extra) {
  if (nparam != 5) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  const float eps = *static_cast<const float*>(params[2]);
  float* y = static_cast<float*>(params[3]);
  float* inv = static_cast<float*>(params[4]);
  const int64_t H = shapes[0][ndims[0] - 1], n = rows(ndims[0], shapes[0]);
  parallel_ranges(n, n * H, [&](int64_t lo, int64_t hi, int64_t) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * H;
      float squares = 0.0f;
      for (int64_t i = 0; i < H; ++i) squares += xr[i] * xr[i];
      const float v = 1.0f / std::sqrt(squares / H + eps);
      inv[r] = v;
      for (int64_t i = 0; i < H; ++i) y[r * H + i] = xr[i] * v * w[i];
    }
  });
  return 0;
}

// inputs x, weight, inv_rms (the forward's), dy; outputs dx [..., H], dweight [H]:
// dx = v (w dy) - x v^3 mean(w dy x), dweight = sum over rows of dy x v
extern "C" int mindlab_rms_norm_backward(int nparam, void** params, int* ndims, int64_t** shapes,
                                         const char** dtypes, void* stream, void* extra) {
  if (nparam != 6) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  const float* inv = static_cast<const float*>(params[2]);
  const float* dy = static_cast<const float*>(params[3]);
  float* dx = static_cast<float*>(params[4]);
  float* dw = static_cast<float*>(params[5]);
  const int64_t H = shapes[0][ndims[0] - 1], n = rows(ndims[0], shapes[0]);
  std::vector<std::vector<float>> partial(mindlab::cores(), std::vector<float>(H, 0.0f));  // dweight per range
  parallel_ranges(n, n * H, [&](int64_t lo, int64_t hi, int64_t part) {
    float* acc = partial[part].data();
    std::vector<float> row(H);
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * H;
      const float* g = dy + r * H;
      const float v = inv[r];
      float dot = 0.0f;
      for (int64_t i = 0; i < H; ++i) dot += w[i] * g[i] * xr[i];
      const float k = v * v * v * dot / H;
      for (int64_t i = 0; i < H; ++i) {
        row[i] = v * w[i] * g[i] - k * xr[i];
        acc[i] += g[i] * xr[i] * v;
      }
      stream_to(dx + r * H, row.data(), H);
    }
    stream_fence();
  });
  for (int64_t i = 0; i < H; ++i) {
    float sum = 0.0f;
    for (const auto& p : partial) sum += p[i];
    dw[i] = sum;
  }
  return 0;
}

// inputs gate, up (same shape); output silu(gate) * up
extern "C" int mindlab_swiglu_forward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                      void* stream, void* extra) {
  if (nparam != 3) return 1;
  const float* g = static_cast<const float*>(params[0]);
  const float* u = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  const int64_t n = elements(ndims[0], shapes[0]);
  parallel_ranges(n, n, [&](int64_t lo, int64_t hi, int64_t) {
    for (int64_t i = lo; i < hi; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
  });
  return 0;
}

// inputs gate, up, dy; outputs dgate = dy up sigmoid(gate) (1 + gate (1 - sigmoid(gate))), dup = dy silu(gate)
extern "C" int mindlab_swiglu_backward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                       void* stream, void* extra) {
  if (nparam != 5) return 1;
  const float* g = static_cast<const float*>(params[0]);
  const float* u = static_cast<const float*>(params[1]);
  const float* dy = static_cast<const float*>(params[2]);
  float* dg = static_cast<float*>(params[3]);
  float* du = static_cast<float*>(params[4]);
  const int64_t n = elements(ndims[0], shapes[0]);
  float* const out[2] = {dg, du};
  parallel_ranges(n, n, [&](int64_t lo, int64_t hi, int64_t) {
    streamed(lo, hi, out, [&](int64_t i0, int64_t c, float* const* o) {
      const float* __restrict gi = g + i0;
      const float* __restrict ui = u + i0;
      const float* __restrict dyi = dy + i0;
      float* __restrict a = o[0];
      float* __restrict b = o[1];
      for (int64_t k = 0; k < c; ++k) {
        const float s = sigmoid(gi[k]);
        a[k] = dyi[k] * ui[k] * s * (1.0f + gi[k] * (1.0f - s));
        b[k] = dyi[k] * gi[k] * s;
      }
    });
    stream_fence();
  });
  return 0;
}

// inputs x [..., D], cos, sin (broadcastable to x, e.g. [S, 1, D] or [B, S, 1, D] for x [B, S, heads, D]); output y
extern "C" int mindlab_rope_forward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void* stream, void* extra) {
  if (nparam != 4) return 1;
  rope(params, ndims, shapes, false);
  return 0;
}

// inputs dy, cos, sin; output dx (the transposed rotation)
extern "C" int mindlab_rope_backward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                     void* stream, void* extra) {
  if (nparam != 4) return 1;
  rope(params, ndims, shapes, true);
  return 0;
}

// inputs logits [N, V], targets [N] int32; outputs nll [N] = lse - logits[target], lse [N] = log sum exp(logits)
// per row (a target outside [0, V), e.g. an ignored position, gives nll 0). Two passes over each row, the second
// from cache: MindSpore's log_softmax + gather take five kernels and a [N, V] array for each.
extern "C" int mindlab_cross_entropy_forward(int nparam, void** params, int* ndims, int64_t** shapes,
                                             const char** dtypes, void* stream, void* extra) {
  if (nparam != 4) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const int32_t* t = static_cast<const int32_t*>(params[1]);
  float* nll = static_cast<float*>(params[2]);
  float* lse = static_cast<float*>(params[3]);
  const int64_t V = shapes[0][1];
  parallel_ranges(shapes[0][0], shapes[0][0] * V, [&](int64_t lo, int64_t hi, int64_t) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * V;
      float top = xr[0];
      for (int64_t j = 1; j < V; ++j) top = std::max(top, xr[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < V; ++j) sum += std::exp(xr[j] - top);
      lse[r] = top + std::log(sum);
      nll[r] = t[r] >= 0 && t[r] < V ? lse[r] - xr[t[r]] : 0.0f;
    }
  });
  return 0;
}

// inputs logits, targets, lse (the forward's), dnll [N]; output dlogits = (softmax(logits) - onehot(target)) dnll
// per row (0 for a target outside [0, V)): one pass, the only [N, V] array the backward writes.
extern "C" int mindlab_cross_entropy_backward(int nparam, void** params, int* ndims, int64_t** shapes,
                                              const char** dtypes, void* stream, void* extra) {
  if (nparam != 5) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const int32_t* t = static_cast<const int32_t*>(params[1]);
  const float* lse = static_cast<const float*>(params[2]);
  const float* dnll = static_cast<const float*>(params[3]);
  float* dx = static_cast<float*>(params[4]);
  const int64_t V = shapes[0][1];
  parallel_ranges(shapes[0][0], shapes[0][0] * V, [&](int64_t lo, int64_t hi, int64_t) {
    for (int64_t r = lo; r < hi; ++r) {
      const bool counted = t[r] >= 0 && t[r] < V;  // else the nll is the constant 0
      const float g = counted ? dnll[r] : 0.0f, shift = lse[r];
      const int64_t target = counted ? r * V + t[r] : -1;
      float* const out[1] = {dx};
      streamed(r * V, (r + 1) * V, out, [&](int64_t i, int64_t c, float* const* o) {
        float* __restrict d = o[0];
        const float* __restrict xi = x + i;
        for (int64_t k = 0; k < c; ++k) d[k] = std::exp(xi[k] - shift) * g;
        if (target >= i && target < i + c) d[target - i] -= g;
      });
    }
    stream_fence();
  });
  return 0;
}

// inputs x [1, K], w [N, K]; output y [1, N] = x w^T: a Linear at one row, a decoding step at batch 1, where the
// product is a matrix-vector one bound by reading w. Each row of w is read once, in order, one range of rows per
// core: at model=small's shapes that streams the weights faster than MindSpore's MatMul. A thread started per call
// made it slower; with threads.h's woken workers it is level with one thread in the decode
// graph, though ~1.7x as fast alone in a C++ loop.
extern "C" int mindlab_row_linear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                  void* stream, void* extra) {
  if (nparam != 3 || rows(ndims[0], shapes[0]) != 1) return 1;
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  const int64_t N = shapes[1][0], K = shapes[1][1];
  parallel_ranges(N, N * K, [&](int64_t lo, int64_t hi, int64_t) { dot_rows(w, x, y, lo, hi, K); });
  return 0;
}
