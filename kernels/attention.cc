// Causal self-attention for MindSpore's CPU backend, forward and backward, as AOT custom ops
// (kernels/attention.py wraps them; kernels/__init__.py builds this file at install time).
//
// Layout: q [B, S, H, D], k and v [B, S, Hkv, D] (H a multiple of Hkv: grouped-query attention reads kv head
// h / (H / Hkv) without repeating it), seg [B, S] int32 (the packed sample of every token; all equal for one
// sequence), fp32. Query i attends to key j when j <= i and seg[j] == seg[i]; scores are scaled by 1/sqrt(D).
//
// Work is split over (batch row, head) pairs, one task each, on the calling thread and threads.h's workers (asleep
// between calls: no spinning OpenMP workers left to compete with MindSpore's own threads); within a task, over blocks
// of BQ query rows. A block's scores [BQ, keys] are computed, softmaxed and multiplied by V right away, so no [S, S]
// array exists: the forward keeps only the output and each row's logsumexp (lse [B, H, S]); the backward recomputes the
// probabilities from it (FlashAttention's recipe). A block's keys are taken BK at a time, the chunk holding the
// diagonal first (with an online softmax in the forward): a block of at most BK keys is one chunk, its whole key row,
// and longer ones keep a chunk's probabilities in cache (the kernel alone, forward and backward at S = 8192: 10% and
// 15% faster than whole key rows). Keys after a block's last row are never
// computed: causal attention does about half the work of the masked [S, S] product.
//
// The products are oneDNN sgemm calls on strided views of the [B, S, heads, D] tensors: nothing is transposed or
// copied, and 1/sqrt(D) rides on sgemm's alpha.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rope.h"
#include "sgemm.h"
#include "stream.h"
#include "threads.h"

namespace {

constexpr int BQ = 64;   // query rows per block
constexpr int BK = 512;  // keys per chunk: a longer block row is taken a chunk at a time (online softmax)
// a masked score: finite, so the file can be built with -ffast-math (vectorized exp), and exp(MASKED - max) = 0
constexpr float MASKED = -1e30f;

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

// The columns query row i may see of keys c0..c0+n-1: none after its own key (the future).
int visible(int64_t i, int64_t c0, int n) { return static_cast<int>(std::min<int64_t>(n, i - c0 + 1)); }

// P [rows, n] = scale q k^T for query rows i0.. of head h against keys c0..c0+n-1, MASKED where a row's key belongs
// to another sample; the columns after visible() are left for exp_row to zero.
void scores(const View& s, const float* q, const float* k, const int32_t* seg, int64_t b, int64_t h, int64_t i0,
            int rows, int64_t c0, int n, float* P) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  dnnl_sgemm('N', 'T', rows, n, s.D, scale, q + s.q_at(b, i0, h), s.ldq(), k + s.kv_at(b, c0, h / s.group()),
             s.ldkv(), 0.0f, P, n);
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    float* p = P + r * n;
    const int seen = visible(i, c0, n);
    for (int c = 0; c < seen; ++c)
      if (seg[c0 + c] != seg[i]) p[c] = MASKED;
  }
}

float row_max(const float* p, int seen) {
  float m = p[0];
  for (int c = 1; c < seen; ++c) m = std::max(m, p[c]);
  return m;
}

// p[c] = exp(p[c] - shift) over the first `seen` columns, zero after them; returns their sum.
float exp_row(float* p, int seen, int n, float shift) {
  float sum = 0.0f;
  for (int c = 0; c < seen; ++c) {
    p[c] = std::exp(p[c] - shift);
    sum += p[c];
  }
  std::fill(p + seen, p + n, 0.0f);
  return sum;
}

// body(c0, n, first) for the chunks of keys klo..end-1 of a block ending at row end-1: BK keys at a time, the chunk
// holding the diagonal first (first = true), so every row of the block sees its own key in the first chunk.
template <class Body>
void key_chunks(int64_t klo, int64_t end, Body body) {
  for (int64_t hi = end; hi > klo; hi -= BK) {
    const int64_t c0 = std::max(klo, hi - BK);
    body(c0, static_cast<int>(hi - c0), hi == end);
  }
}

View view_of(int64_t** shapes) { return View{shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3]}; }

// One worker's buffers: a chunk's probabilities and their gradient, per-row terms, the segments' first keys.
struct Scratch {
  std::vector<float> P, dS, rowdot, max, sum;
  std::vector<int64_t> first;
  explicit Scratch(const View& s)
      : P(BQ * std::min<int64_t>(s.S, BK)), dS(P.size()), rowdot(BQ), max(BQ), sum(BQ) {}
};

// body(scratch, task) for every task in [0, n), handed out one at a time to threads.h's workers and the caller.
template <class Body>
void parallel_tasks(const View& s, int64_t n, Body body) {
  std::atomic<int64_t> next{0};
  mindlab::Pool& pool = mindlab::Pool::get();
  pool.run(std::min(pool.size(), n), [&](int64_t) {
    Scratch scratch(s);
    for (int64_t task = next++; task < n; task = next++) body(scratch, task);
  });
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
    const int32_t* sg = seg + b * s.S;
    first_keys(sg, s.S, w.first);
    for (int64_t i0 = 0; i0 < s.S; i0 += BQ) {
      const int rows = static_cast<int>(std::min<int64_t>(BQ, s.S - i0));
      const int64_t klo = block_start(w.first, i0, rows), end = i0 + rows;
      float* out = o + s.q_at(b, i0, h);
      float* row_lse = lse + (b * s.H + h) * s.S + i0;
      const bool one_chunk = end - klo <= BK;
      // every row sees its own key in the first chunk, so every running max is finite
      key_chunks(klo, end, [&](int64_t c0, int n, bool first) {
        scores(s, q, k, sg, b, h, i0, rows, c0, n, w.P.data());
        for (int r = 0; r < rows; ++r) {
          float* p = w.P.data() + r * n;
          const int seen = visible(i0 + r, c0, n);
          if (first) {
            w.max[r] = row_max(p, seen);
            w.sum[r] = exp_row(p, seen, n, w.max[r]);
            if (one_chunk) {  // normalized before the product, as a short sequence's only chunk
              const float inv = 1.0f / w.sum[r];
              for (int c = 0; c < seen; ++c) p[c] *= inv;
            }
          } else {  // online softmax: rescale what earlier chunks summed to the new running max
            const float m = std::max(w.max[r], row_max(p, seen)), alpha = std::exp(w.max[r] - m);
            w.sum[r] = w.sum[r] * alpha + exp_row(p, seen, n, m);
            w.max[r] = m;
            for (int64_t d = 0; d < s.D; ++d) out[r * s.ldq() + d] *= alpha;
          }
        }
        dnnl_sgemm('N', 'N', rows, s.D, n, 1.0f, w.P.data(), n, v + s.kv_at(b, c0, h / s.group()), s.ldkv(),
                   first ? 0.0f : 1.0f, out, s.ldq());
      });
      for (int r = 0; r < rows; ++r) {
        row_lse[r] = w.max[r] + std::log(w.sum[r]);
        if (one_chunk) continue;
        const float inv = 1.0f / w.sum[r];
        for (int64_t d = 0; d < s.D; ++d) out[r * s.ldq() + d] *= inv;
      }
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
  // the gradients start at zero and every product adds to them; zeroed by non-temporal stores (stream.h)
  const int64_t nkv = s.B * s.S * s.Hkv * s.D;
  for (auto [out, n] : {std::pair{dq, s.B * s.S * s.H * s.D}, std::pair{dk, nkv}, std::pair{dv, nkv}})
    mindlab::parallel_ranges(n, n, [&, out = out](int64_t lo, int64_t hi, int64_t) {
      mindlab::stream_zero(out + lo, hi - lo);
      mindlab::stream_fence();
    });
  // one task per (batch row, kv head): it owns that head's dk/dv rows, summed over its query heads and blocks
  parallel_tasks(s, s.B * s.Hkv, [&](Scratch& w, int64_t task) {
    const int64_t b = task / s.Hkv, hk = task % s.Hkv;
    const int32_t* sg = seg + b * s.S;
    first_keys(sg, s.S, w.first);
    for (int64_t h = hk * s.group(); h < (hk + 1) * s.group(); ++h) {
      for (int64_t i0 = 0; i0 < s.S; i0 += BQ) {
        const int rows = static_cast<int>(std::min<int64_t>(BQ, s.S - i0));
        const int64_t klo = block_start(w.first, i0, rows), end = i0 + rows;
        const float* row_lse = lse + (b * s.H + h) * s.S + i0;
        const float* dO = dout + s.q_at(b, i0, h);
        for (int r = 0; r < rows; ++r) {  // sum(dO * O) per row: the softmax gradient's row term
          const float* x = dout + s.q_at(b, i0 + r, h);
          const float* y = o + s.q_at(b, i0 + r, h);
          float dot = 0.0f;
          for (int64_t d = 0; d < s.D; ++d) dot += x[d] * y[d];
          w.rowdot[r] = dot;
        }
        key_chunks(klo, end, [&](int64_t c0, int n, bool) {
          scores(s, q, k, sg, b, h, i0, rows, c0, n, w.P.data());
          for (int r = 0; r < rows; ++r) exp_row(w.P.data() + r * n, visible(i0 + r, c0, n), n, row_lse[r]);
          // dP = dO V^T, then dS = P (dP - rowdot): zero where masked since P is
          dnnl_sgemm('N', 'T', rows, n, s.D, 1.0f, dO, s.ldq(), v + s.kv_at(b, c0, hk), s.ldkv(), 0.0f,
                     w.dS.data(), n);
          for (int r = 0; r < rows; ++r) {
            const float* p = w.P.data() + r * n;
            float* ds = w.dS.data() + r * n;
            for (int c = 0; c < n; ++c) ds[c] = p[c] * (ds[c] - w.rowdot[r]);
          }
          // dQ (+)= dS K / sqrt(D); dK += dS^T Q / sqrt(D); dV += P^T dO
          dnnl_sgemm('N', 'N', rows, s.D, n, scale, w.dS.data(), n, k + s.kv_at(b, c0, hk), s.ldkv(), 1.0f,
                     dq + s.q_at(b, i0, h), s.ldq());
          dnnl_sgemm('T', 'N', n, s.D, rows, scale, w.dS.data(), n, q + s.q_at(b, i0, h), s.ldq(), 1.0f,
                     dk + s.kv_at(b, c0, hk), s.ldkv());
          dnnl_sgemm('T', 'N', n, s.D, rows, 1.0f, w.P.data(), n, dO, s.ldq(), 1.0f, dv + s.kv_at(b, c0, hk),
                     s.ldkv());
        });
      }
    }
  });
  return 0;
}

// Decoding (models/llama/generation.py): one new token per row against a KV cache, inference only. One op per layer
// and step instead of the ~9 MindSpore kernels of the plain cached path, whose launches (~40 us each on CPU), not
// their arithmetic, bound a decode step at batch 1.
// inputs q [B, 1, H, D], k and v [B, 1, Hkv, D] (the token's projections, before RoPE), cos and sin [B, 1, 1, D]
// (its position's tables), k_cache and v_cache [B, Hkv, L, D], slot [1, 1, L, 1] bool (true at the column the token
// is written to), bias [B, 1, 1, L] (0 where a column may be attended, -1e9 elsewhere); output o [B, 1, H, D].
// The token's rotated k and its v are written into the caches' column in place: the caches are generation's
// Parameters, declared written (RW_WRITE) by kernels/attention.py, so no step copies them.
extern "C" int mindlab_decode_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                        void* stream, void* extra) {
  if (nparam != 10) return 1;
  const int64_t B = shapes[0][0], H = shapes[0][2], D = shapes[0][3], Hkv = shapes[1][2], L = shapes[5][2];
  const float* q = static_cast<const float*>(params[0]);
  const float* k = static_cast<const float*>(params[1]);
  const float* v = static_cast<const float*>(params[2]);
  const float* cos = static_cast<const float*>(params[3]);
  const float* sin = static_cast<const float*>(params[4]);
  float* k_cache = static_cast<float*>(params[5]);
  float* v_cache = static_cast<float*>(params[6]);
  const bool* slot = static_cast<const bool*>(params[7]);
  const float* bias = static_cast<const float*>(params[8]);
  float* o = static_cast<float*>(params[9]);
  const int64_t column = std::find(slot, slot + L, true) - slot;
  if (column == L) return 1;
  const int64_t seen = column + 1;  // the columns after the slot are not written yet: never read (the bias hides them)
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // one task per (row, kv head): its slice of both caches (the new column written) and its query heads
  auto task = [&](int64_t t, std::vector<float>& p, std::vector<float>& qr) {
    const int64_t b = t / Hkv, hk = t % Hkv, at = t * L * D;
    const float* c = cos + b * D;
    const float* s = sin + b * D;
    mindlab::rope_row(k + (b * Hkv + hk) * D, c, s, k_cache + at + column * D, D / 2, false);
    std::memcpy(v_cache + at + column * D, v + (b * Hkv + hk) * D, D * sizeof(float));
    const float* keys = k_cache + at;
    const float* values = v_cache + at;
    const float* row_bias = bias + b * L;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      mindlab::rope_row(q + (b * H + h) * D, c, s, qr.data(), D / 2, false);
      for (int64_t j = 0; j < seen; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * keys[j * D + d];
        p[j] = dot * scale + row_bias[j];
      }
      const float sum = exp_row(p.data(), seen, seen, row_max(p.data(), seen));
      float* out = o + (b * H + h) * D;
      std::fill_n(out, D, 0.0f);
      for (int64_t j = 0; j < seen; ++j) {
        const float w = p[j] / sum;
        for (int64_t d = 0; d < D; ++d) out[d] += w * values[j * D + d];
      }
    }
  };
  // threads.h's workers only when the columns read are many (2^18 floats of each cache, this op's own point,
  // measured when each call started its threads; above threads.h's kThreadedWork): at batch 1 they cost more than
  // they save
  const int64_t tasks = B * Hkv;
  mindlab::parallel_ranges(tasks, tasks * seen * D, [&](int64_t lo, int64_t hi, int64_t) {
    std::vector<float> p(L), qr(D);
    for (int64_t t = lo; t < hi; ++t) task(t, p, qr);
  }, int64_t{1} << 18);
  return 0;
}
