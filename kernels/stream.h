// Non-temporal stores for the backward kernels' outputs (kernels/layers.cc's gradients, kernels/attention.cc's
// zeroed dq/dk/dv): each 64-byte line goes to memory without being read first. A plain store to a line that is not
// in cache first reads it from memory (a read for ownership). On the 2-core EPYC VMs mindlab was measured on, those
// reads had two speeds: for tens of seconds at a time a step's backward kernels wrote fresh lines ~5x slower (~13 ns
// a line against ~2.7, one thread), while plain reads and non-temporal stores (~1.4 ns a line) kept their speed; a
// small step took ~1,350 ms instead of ~1,180, ~1,280 with the gradients streamed (what is left is MindSpore's own
// products and sums). The next kernel reads them from memory instead of
// cache: a product, which packs its inputs.
// The forward kernels' outputs stay plain stores: their lines were in cache (no slower in the slow periods).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace mindlab {

constexpr int64_t kChunk = 512;  // floats of an output computed into L1 before they are streamed out

inline int64_t line_offset(const float* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) / sizeof(float) % 16);
}

// One line of dst (64-byte aligned) from src (any alignment) by non-temporal stores; plain ones off x86-64.
inline void stream_line(float* dst, const float* src) {
#if defined(__AVX512F__)
  _mm512_stream_ps(dst, _mm512_loadu_ps(src));
#elif defined(__AVX__)
  _mm256_stream_ps(dst, _mm256_loadu_ps(src));
  _mm256_stream_ps(dst + 8, _mm256_loadu_ps(src + 8));
#elif defined(__x86_64__)
  for (int k = 0; k < 16; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
#else
  std::copy(src, src + 16, dst);
#endif
}

// dst[0..c) = src[0..c): dst's whole lines by non-temporal stores, the partial lines at its ends by plain ones.
inline void stream_to(float* dst, const float* src, int64_t c) {
  int64_t k = std::min(c, (16 - line_offset(dst)) % 16);
  std::copy(src, src + k, dst);
  for (; k + 16 <= c; k += 16) stream_line(dst + k, src + k);
  std::copy(src + k, src + c, dst + k);
}

// Non-temporal stores are not ordered by the pool's release/acquire: a thread's part ends with this fence before
// another thread may read what it wrote.
inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

// dst[0..n) = 0 by non-temporal stores: an output accumulated into later (kernels/attention.cc's gradients) is
// then read from memory instead of being read for ownership.
inline void stream_zero(float* dst, int64_t n) {
  const float zeros[16] = {};
  int64_t k = std::min(n, (16 - line_offset(dst)) % 16);
  std::fill(dst, dst + k, 0.0f);
  for (; k + 16 <= n; k += 16) stream_line(dst + k, zeros);
  std::fill(dst + k, dst + n, 0.0f);
}

// body(i, c, out) for elements lo..hi-1 of N outputs of the same shape, c <= kChunk at a time: out[j][k] (an L1
// buffer) is element i + k of dst[j]. Chunks after the first start on a line of dst[0]. Like stream_to, it leaves
// stream_fence() to the end of the caller's part.
template <int N, class Body>
void streamed(int64_t lo, int64_t hi, float* const (&dst)[N], Body body) {
  alignas(64) float buf[N][kChunk];
  float* out[N];
  for (int j = 0; j < N; ++j) out[j] = buf[j];
  for (int64_t i = lo; i < hi;) {
    const int64_t c = std::min(hi - i, kChunk - line_offset(dst[0] + i));
    body(i, c, out);
    for (int j = 0; j < N; ++j) stream_to(dst[j] + i, buf[j], c);
    i += c;
  }
}

}  // namespace mindlab
