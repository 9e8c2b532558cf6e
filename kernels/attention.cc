// Causal self-attention for MindSpore's CPU backend, forward and backward, as AOT custom ops
// (kernels/attention.py wraps them; kernels/__init__.py builds this file at install time).
//
// Layout: q [B, S, H, D], k and v [B, S, Hkv, D] (H a multiple of Hkv: grouped-query attention reads kv head
// h / (H / Hkv) without repeating it), seg [B, S] int32 (the packed sample of every token; all equal for one
// sequence), fp32. Query i attends to key j when j <= i and seg[j] == seg[i]; scores are scaled by 1/sqrt(D).
//
// Work is split over (batch row, head) pairs, one task each, on a thread per core (std::thread, joined at the
// end: no spinning OpenMP workers left to compete with MindSpore's own threads); within a task, over blocks of BQ
// query rows. A block's scores [BQ, keys] are computed, softmaxed and multiplied by V right away, so no [S, S] array
// exists: the forward keeps only the output and each row's logsumexp (lse [B, H, S]); the backward recomputes
// the probabilities from it (FlashAttention's recipe, with whole key rows per block since a CPU block row fits
// in cache). Keys after a block's last row are never computed: causal attention does about half the work of
// the masked [S, S] product.
//
// The products are oneDNN sgemm calls on strided views of the [B, S, heads, D] tensors: nothing is transposed or
// copied, and 1/sqrt(D) rides on sgemm's alpha.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <thread>
#include <unordered_map>
#include <vector>

#include "threads.h"

namespace {

constexpr int BQ = 64;  // query rows per block
// a masked score: finite, so the file can be built with -ffast-math (vectorized exp), and exp(MASKED - max) = 0
constexpr float MASKED = -1e30f;

// oneDNN's sgemm, exported by the libdnnl.so.3 that MindSpore ships and has already loaded (its CPU MatMul):
// C = alpha op(A) op(B) + beta C, row-major, op = transpose for 'T'. Called from our worker threads, it runs on
// the calling thread.
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

struct View {
  int64_t B, S, H, Hkv, D;
  int64_t group() const { return H / Hkv; }
  int64_t q_at(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * H + h) * D; }     // q, o, dq rows
  int64_t kv_at(int64_t b, int64_t j, int64_t h) const { return ((b * S + j) * Hkv + h) * D; }  // k, v rows
  int64_t ldq() const { return H * D; }
  int64_t ldkv() const { return Hkv * D; }
};

// first[i]: the first key row with seg[i]'s sample id (keys before it are never attended).
void first_keys(const int32_t* seg, int64_t S, std::vector<int64_t>& first) {
  std::unordered_map<int32_t, int64_t> seen;
  first.resize(S);
  for (int64_t i = 0; i < S; ++i) first[i] = seen.emplace(seg[i], i).first->second;
}

// The first key column of query rows i0..i0+rows-1: keys klo..i0+rows-1 are computed, the rest never is.
int64_t block_start(const std::vector<int64_t>& first, int64_t i0, int rows) {
  int64_t klo = first[i0];
  for (int r = 1; r < rows; ++r) klo = std::min(klo, first[i0 + r]);
  return klo;
}

// P [rows, n] = softmax(scale q k^T) for query rows i0.. of head h against keys klo..klo+n-1, zero where masked
// (a later key or another sample). Forward (lse_in null): normalized by the row sums, each row's logsumexp
// written to lse_out. Backward: exp(scores - lse_in), the same probabilities without the reductions.
void probabilities(const View& s, const float* q, const float* k, const int32_t* seg, int64_t b, int64_t h,
                   int64_t i0, int rows, int64_t klo, int n, float* P, const float* lse_in, float* lse_out) {
  const int64_t hk = h / s.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  dnnl_sgemm('N', 'T', rows, n, s.D, scale, q + s.q_at(b, i0, h), s.ldq(), k + s.kv_at(b, klo, hk), s.ldkv(), 0.0f,
             P, n);
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    float* p = P + r * n;
    const int allowed = static_cast<int>(i - klo + 1);  // columns after the row's own key are the future
    for (int c = 0; c < allowed; ++c)
      if (seg[klo + c] != seg[i]) p[c] = MASKED;
    float shift;
    if (lse_in) {
      shift = lse_in[r];
    } else {
      shift = p[0];
      for (int c = 1; c < allowed; ++c) shift = std::max(shift, p[c]);
    }
    float sum = 0.0f;
    for (int c = 0; c < allowed; ++c) {
      p[c] = std::exp(p[c] - shift);
      sum += p[c];
    }
    std::fill(p + allowed, p + n, 0.0f);
    if (!lse_in) {
      const float inv = 1.0f / sum;
      for (int c = 0; c < allowed; ++c) p[c] *= inv;
      lse_out[r] = shift + std::log(sum);
    }
  }
}

View view_of(int64_t** shapes) { return View{shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3]}; }

// One worker's buffers: a block's probabilities and their gradient, row terms, the segments' first keys.
struct Scratch {
  std::vector<float> P, dS, rowdot;
  std::vector<int64_t> first;
  explicit Scratch(const View& s) : P(BQ * s.S), dS(BQ * s.S), rowdot(BQ) {}
};

// body(scratch, task) for every task in [0, n), handed out one at a time to a thread per core.
template <class Body>
void parallel_tasks(const View& s, int64_t n, Body body) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    Scratch scratch(s);
    for (int64_t task = next++; task < n; task = next++) body(scratch, task);
  };
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < std::min<int64_t>(mindlab::cores(), n); ++i) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
}

}  // namespace

// inputs q, k, v, seg; outputs o [B, S, H, D], lse [B, H, S]
extern "C" int mindlab_attention_forward(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                         void* stream, void* extra) {
  if (nparam != 6) return 1;
  const View s = view_of(shapes);
  const float* q = static_cast<const float*>(params[0]);
  const float* k = static_cast<const float*>(params[1]);
  const float* v = static_cast<const float*>(params[2]);
  const int32_t* seg = static_cast<const int32_t*>(params[3]);
  float* o = static_cast<float*>(params[4]);
  float* lse = static_cast<float*>(params[5]);
  parallel_tasks(s, s.B * s.H, [&](Scratch& w, int64_t task) {
    const int64_t b = task / s.H, h = task % s.H;
    first_keys(seg + b * s.S, s.S, w.first);
    for (int64_t i0 = 0; i0 < s.S; i0 += BQ) {
      const int rows = static_cast<int>(std::min<int64_t>(BQ, s.S - i0));
      const int64_t klo = block_start(w.first, i0, rows);
      const int n = static_cast<int>(i0 + rows - klo);
      probabilities(s, q, k, seg + b * s.S, b, h, i0, rows, klo, n, w.P.data(), nullptr,
                    lse + (b * s.H + h) * s.S + i0);
      dnnl_sgemm('N', 'N', rows, s.D, n, 1.0f, w.P.data(), n, v + s.kv_at(b, klo, h / s.group()), s.ldkv(), 0.0f,
                 o + s.q_at(b, i0, h), s.ldq());
    }
  });
  return 0;
}

// inputs q, k, v, seg, o, lse, do; outputs dq [B, S, H, D], dk and dv [B, S, Hkv, D]
extern "C" int mindlab_attention_backward(int nparam, void** params, int* ndims, int64_t** shapes,
                                          const char** dtypes, void* stream, void* extra) {
  if (nparam != 10) return 1;
  const View s = view_of(shapes);
  const float* q = static_cast<const float*>(params[0]);
  const float* k = static_cast<const float*>(params[1]);
  const float* v = static_cast<const float*>(params[2]);
  const int32_t* seg = static_cast<const int32_t*>(params[3]);
  const float* o = static_cast<const float*>(params[4]);
  const float* lse = static_cast<const float*>(params[5]);
  const float* dout = static_cast<const float*>(params[6]);
  float* dq = static_cast<float*>(params[7]);
  float* dk = static_cast<float*>(params[8]);
  float* dv = static_cast<float*>(params[9]);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  // one task per (batch row, kv head): it owns that head's dk/dv rows, summed over its query heads and blocks
  parallel_tasks(s, s.B * s.Hkv, [&](Scratch& w, int64_t task) {
    const int64_t b = task / s.Hkv, hk = task % s.Hkv;
    first_keys(seg + b * s.S, s.S, w.first);
    for (int64_t j = 0; j < s.S; ++j) {
      std::fill_n(dk + s.kv_at(b, j, hk), s.D, 0.0f);
      std::fill_n(dv + s.kv_at(b, j, hk), s.D, 0.0f);
    }
    for (int64_t h = hk * s.group(); h < (hk + 1) * s.group(); ++h) {
      for (int64_t i0 = 0; i0 < s.S; i0 += BQ) {
        const int rows = static_cast<int>(std::min<int64_t>(BQ, s.S - i0));
        const int64_t klo = block_start(w.first, i0, rows);
        const int n = static_cast<int>(i0 + rows - klo);
        probabilities(s, q, k, seg + b * s.S, b, h, i0, rows, klo, n, w.P.data(), lse + (b * s.H + h) * s.S + i0,
                      nullptr);
        for (int r = 0; r < rows; ++r) {  // sum(dO * O) per row: the softmax gradient's row term
          const float* x = dout + s.q_at(b, i0 + r, h);
          const float* y = o + s.q_at(b, i0 + r, h);
          float dot = 0.0f;
          for (int64_t d = 0; d < s.D; ++d) dot += x[d] * y[d];
          w.rowdot[r] = dot;
        }
        const float* dO = dout + s.q_at(b, i0, h);
        // dP = dO V^T, then dS = P (dP - rowdot): zero where masked since P is
        dnnl_sgemm('N', 'T', rows, n, s.D, 1.0f, dO, s.ldq(), v + s.kv_at(b, klo, hk), s.ldkv(), 0.0f, w.dS.data(),
                   n);
        for (int r = 0; r < rows; ++r) {
          const float* p = w.P.data() + r * n;
          float* ds = w.dS.data() + r * n;
          for (int c = 0; c < n; ++c) ds[c] = p[c] * (ds[c] - w.rowdot[r]);
        }
        // dQ = dS K / sqrt(D); dK += dS^T Q / sqrt(D); dV += P^T dO
        dnnl_sgemm('N', 'N', rows, s.D, n, scale, w.dS.data(), n, k + s.kv_at(b, klo, hk), s.ldkv(), 0.0f,
                   dq + s.q_at(b, i0, h), s.ldq());
        dnnl_sgemm('T', 'N', n, s.D, rows, scale, w.dS.data(), n, q + s.q_at(b, i0, h), s.ldq(), 1.0f,
                   dk + s.kv_at(b, klo, hk), s.ldkv());
        dnnl_sgemm('T', 'N', n, s.D, rows, 1.0f, w.P.data(), n, dO, s.ldq(), 1.0f, dv + s.kv_at(b, klo, hk),
                   s.ldkv());
      }
    }
  });
  return 0;
}
