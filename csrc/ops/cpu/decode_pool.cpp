// decode_pool.h's pool. Protocol: the caller makes the generation odd (a job being set up),
// waits until no worker is registered, writes the job (shares, body) and makes the
// generation even again (published). A worker that sees a new even generation registers
// (busy + 1), re-reads the generation (changed: not its job, unregister), claims items, and
// unregisters. So no worker is registered while a job is written, and the caller, which
// claims too and then waits for busy == 0, returns with every item done; a worker that
// registers after that finds the shares empty and never calls the body. Workers spin
// ~200 us for the next job (yielding every 64 pauses, so a held core goes to the caller or
// another job), then sleep on a condition variable (woken only when someone sleeps).
#include "decode_pool.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define EXL3_PAUSE() _mm_pause()
#else
#define EXL3_PAUSE() ((void)0)
#endif

namespace {

constexpr int kMaxParticipants = 64;
constexpr auto kSpin = std::chrono::microseconds(200);

struct alignas(64) Share {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers sleep until the process ends
    return *pool;
  }

  void run(int64_t n, int64_t threads, exl3_cpu::PoolBody body, void* context) {
    std::lock_guard<std::mutex> one_job(run_mutex_);
    const int parts = static_cast<int>(std::min<int64_t>({n, threads, kMaxParticipants}));
    if (parts <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i, context);
      return;
    }
    ensure_workers(parts - 1);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // odd: no new registrations count
    while (busy_.load(std::memory_order_seq_cst) != 0) EXL3_PAUSE();
    for (int t = 0; t < parts; ++t) {
      shares_[t].next.store(n * t / parts, std::memory_order_relaxed);
      shares_[t].end = n * (t + 1) / parts;
    }
    parts_ = parts;
    body_ = body;
    context_ = context;
    generation_.fetch_add(1, std::memory_order_seq_cst);  // even: published
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    claim(0);
    while (busy_.load(std::memory_order_acquire) != 0) EXL3_PAUSE();
  }

 private:
  void claim(int first) {
    const int parts = parts_;
    for (int k = 0; k < parts; ++k) {
      Share& share = shares_[(first + k) % parts];
      for (int64_t i; (i = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;)
        body_(i, context_);
    }
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, index] { work(index); });
      workers_.back().detach();
    }
  }

  void work(int index) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    auto fresh = [&](uint64_t g) { return g != seen && (g & 1) == 0; };
    for (;;) {
      uint64_t now = generation_.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int i = 0; !fresh(now); ++i) {
        EXL3_PAUSE();
        now = generation_.load(std::memory_order_acquire);
        if ((i & 63) == 63) {
          if (std::chrono::steady_clock::now() > until) break;
          std::this_thread::yield();  // a held core goes to the caller or another job
        }
      }
      if (!fresh(now)) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return fresh(generation_.load(std::memory_order_seq_cst)); });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      seen = now;
      busy_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == now) claim(index % parts_);
      busy_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_;
  Share shares_[kMaxParticipants];
  int parts_ = 1;
  exl3_cpu::PoolBody body_ = nullptr;
  void* context_ = nullptr;
  std::vector<std::thread> workers_;
};

}  // namespace

namespace exl3_cpu {

namespace {
std::atomic<int> g_pool_on{-1};  // -1: not read from EXL3_CPU_POOL yet
}  // namespace

bool decode_pool_enabled() {
  int on = g_pool_on.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* v = std::getenv("EXL3_CPU_POOL");
    on = v && std::strcmp(v, "1") == 0;
    g_pool_on.store(on, std::memory_order_relaxed);
  }
  return on;
}

// The op exl3_decode_pool(mode): 1 on, 0 off, -1 leave; returns whether the pool is on.
bool exl3_decode_pool(int64_t mode) {
  if (mode == 0 || mode == 1) g_pool_on.store(static_cast<int>(mode), std::memory_order_relaxed);
  return decode_pool_enabled();
}

void decode_pool_for(int64_t n, int64_t threads, PoolBody body, void* context) {
  Pool::get().run(n, threads, body, context);
}

}  // namespace exl3_cpu

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("exl3_decode_pool(int mode) -> bool", &exl3_cpu::exl3_decode_pool);
}
