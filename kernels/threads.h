// Threads for mindlab's CPU kernels: one worker per extra core this process may run on, started at the first call
// and asleep on a condition variable between calls (never spinning against MindSpore's own threads, as OpenMP's
// workers did). A call wakes them, runs its first part itself and waits for theirs. Against threads started and
// joined by every call (tens of us each, and the second thread could start late), the pool took 4-5% off a small
// training step and 1-2% off a medium one (both builds in one process, steps alternating). A decoding step did not
// move.
#pragma once
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace mindlab {

inline int cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

// The workers of one kernels/*.so (each library has its own). One call at a time: a call that finds the pool busy
// (another MindSpore thread's kernel running) runs every part itself. A forked child, where the parent's workers
// do not exist, makes a pool of its own.
class Pool {
 public:
  static Pool& get() {
    static std::mutex made;
    static Pool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || owner != getpid()) {  // a parent's pool is left behind in a child: its workers are gone
      pool = new Pool(cores());
      owner = getpid();
    }
    return *pool;
  }

  int64_t size() const { return workers_ + 1; }

  // body(p) for p in [0, parts), parts <= size(): part 0 on the calling thread, part p on worker p
  void run(int64_t parts, const std::function<void(int64_t)>& body) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (parts <= 1 || !busy.owns_lock()) {
      for (int64_t p = 0; p < parts; ++p) body(p);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &body;
      parts_ = parts;
      pending_.store(parts - 1, std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    body(0);
    while (pending_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  }

 private:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) std::thread([this, i] { serve(i); }).detach();  // they live as long as the process
    workers_ = n - 1;
  }

  void serve(int64_t part) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* job;
      int64_t parts;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
        parts = parts_;
      }
      if (part < parts) {
        (*job)(part);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::mutex busy_, mu_;
  std::condition_variable wake_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t parts_ = 0;
  uint64_t generation_ = 0;
  std::atomic<int64_t> pending_{0};
  int workers_ = 0;
};

// Below this many floats a call runs on its caller's thread alone: handing work to a worker costs more than it
// saves (measured when every call started threads: a decoding step's norms and SwiGLU at batch 8, [8, 384] and
// [8, 1024]).
constexpr int64_t kThreadedWork = int64_t{1} << 16;

// body(lo, hi, part) on [0, n) cut into one contiguous range per core (part: the range's index, < cores()), or
// run as one range on the calling thread when the call touches fewer than `min_work` floats (`work`; a kernel with
// its own measured point passes it).
template <class Body>
void parallel_ranges(int64_t n, int64_t work, Body body, int64_t min_work = kThreadedWork) {
  if (work < min_work || n <= 1) {
    body(int64_t{0}, n, int64_t{0});
    return;
  }
  Pool& pool = Pool::get();
  const int64_t parts = std::min<int64_t>(pool.size(), n);
  pool.run(parts, [&](int64_t p) { body(n * p / parts, n * (p + 1) / parts, p); });
}

}  // namespace mindlab
