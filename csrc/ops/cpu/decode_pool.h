// A thread pool for the decode step's parallel loops (EXL3_CPU_POOL=1; default: OpenMP
// through at::parallel_for). An OpenMP region ends in a join barrier that waits for every
// worker, so on a shared host a worker that another job holds back stalls the whole step
// (2-thread decode 4-5x slower with one competing process: bench/NOTES-cpu-exl3.md). Here
// the caller works through the items itself and waits only for items a worker has claimed:
// a worker that has not started costs nothing.
#pragma once

#include <cstdint>

namespace exl3_cpu {

// Whether the pool serves the decode loops: EXL3_CPU_POOL=1 (read at first use), or the
// op exl3_decode_pool(mode) (1 on, 0 off, -1 ask) for A/B runs and tests.
bool decode_pool_enabled();
bool exl3_decode_pool(int64_t mode);

using PoolBody = void (*)(int64_t item, void* context);

// body(i) for every i in [0, n) on the caller and up to threads - 1 workers. Participant t
// owns items [n t / T, n (t + 1) / T) and claims them one by one; done, it claims from the
// others' shares. Returns when every item is done.
void decode_pool_for(int64_t n, int64_t threads, PoolBody body, void* context);

template <typename F>
void pool_for(int64_t n, int64_t threads, F& body) {
  decode_pool_for(n, threads, [](int64_t i, void* c) { (*static_cast<F*>(c))(i); }, &body);
}

}  // namespace exl3_cpu
