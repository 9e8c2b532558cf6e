// Threads for mindlab's CPU kernels: one per core this process may run on, started per call and joined before
// it returns (no idle workers left spinning against MindSpore's own threads, as OpenMP's did).
#pragma once
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace mindlab {

inline int cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

// Below this many floats a call runs on its caller's thread alone: starting a thread (tens of us) costs more than
// it saves (a decoding step's norms and SwiGLU at batch 8, [8, 384] and [8, 1024]: benchmarks/HISTORY.md's twentieth
// pass).
constexpr int64_t kThreadedWork = int64_t{1} << 16;

// body(lo, hi, part) on [0, n) cut into one contiguous range per core (part: the range's index, < cores()), or
// run as one range when the call touches fewer than kThreadedWork floats (`work`).
template <class Body>
void parallel_ranges(int64_t n, int64_t work, Body body) {
  const int64_t parts = work < kThreadedWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(cores(), n));
  std::vector<std::thread> threads;
  for (int64_t p = 1; p < parts; ++p) threads.emplace_back(body, n * p / parts, n * (p + 1) / parts, p);
  body(int64_t{0}, n / parts, int64_t{0});
  for (auto& t : threads) t.join();
}

}  // namespace mindlab
