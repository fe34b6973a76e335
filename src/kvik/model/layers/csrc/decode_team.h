// A team of threads held for the length of one decode step (DecodeStack::forward), so the step's
// ~5 parallel kernels per layer do not each open and close an OpenMP parallel region.
//
// libgomp releases a region's threads and gathers them back with a futex_wake system call each way,
// whether or not a thread sleeps: 0.7 us to start a region and 0.4 us to end it, measured inside a
// decode step on the 2-core AVX-512 machine, for kernels whose work is 5-30 us a thread. Here one
// OpenMP region spans the step: the calling thread runs the step and hands each kernel's chunks to
// the others through two atomics (kvik::parallel_for below), which they spin on.
//
// kvik::parallel_for splits a range as at::parallel_for does (the same chunks, the calling thread
// taking the first), so a kernel computes the same result either way; outside a step it is
// at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVIK_SPIN_PAUSE() _mm_pause()
#else
#define KVIK_SPIN_PAUSE() ((void)0)
#endif

namespace kvik {

class DecodeTeam {
 public:
  explicit DecodeTeam(int threads) : threads_(threads) {}

  int threads() const { return threads_; }

  // Run f(b, e) over [begin, end) in at::parallel_for's chunks: this thread takes the first and
  // the team's other threads one each (those past the last chunk only acknowledge the job), and
  // return when all are done. An exception from any chunk is rethrown here, the first one.
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const int64_t range = end - begin;
    const int64_t used = std::min<int64_t>(threads_, (range + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    if (used <= 1) {
      f(begin, end);
      return;
    }
    job_.call = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    job_.fn = &f;
    job_.begin = begin;
    job_.end = end;
    job_.chunk = (range + used - 1) / used;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    run_chunk(0);
    wait([&] { return pending_.load(std::memory_order_acquire) == 0; });
    if (failed_.load(std::memory_order_acquire)) {
      failed_.store(false, std::memory_order_relaxed);
      std::exception_ptr error = error_;
      error_ = nullptr;
      std::rethrow_exception(error);
    }
  }

  // The other threads' loop: run their chunk of each job until stop().
  void serve(int tid) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = 0;
      wait([&] { return (now = generation_.load(std::memory_order_acquire)) != seen; });
      seen = now;
      if (stopping_.load(std::memory_order_acquire)) return;
      run_chunk(tid);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void stop() {
    stopping_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }

 private:
  struct Job {
    void (*call)(const void*, int64_t, int64_t) = nullptr;
    const void* fn = nullptr;
    int64_t begin = 0, end = 0, chunk = 0;
  };

  // Spin without pausing at first: a kernel hands out work every few microseconds, and PAUSE
  // (tens of cycles on recent x86) doubled the hand-over (0.2-0.3 us without, 0.6-0.7 us with).
  // After ~100k polls, pause between them: the thread is waiting on something long (the step's
  // Python side never runs inside the team, but a slow kernel on the calling thread can).
  template <typename Ready>
  static void wait(Ready ready) {
    for (int polls = 0; !ready(); ++polls)
      if (polls > 100000) KVIK_SPIN_PAUSE();
  }

  void run_chunk(int tid) {
    const int64_t b = job_.begin + tid * job_.chunk;
    if (b >= job_.end) return;
    try {
      job_.call(job_.fn, b, std::min(job_.end, b + job_.chunk));
    } catch (...) {
      if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
    }
  }

  const int threads_;
  Job job_;
  std::exception_ptr error_;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> failed_{false};
  std::atomic<bool> stopping_{false};
};

// The team of the step this thread is running, or null.
inline thread_local DecodeTeam* current_team = nullptr;

// at::parallel_for, or the running step's team.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (DecodeTeam* team = current_team) return team->parallel_for(begin, end, grain, f);
  at::parallel_for(begin, end, grain, f);
}

// The threads kvik::parallel_for spreads work over.
inline int parallel_threads() {
  if (const DecodeTeam* team = current_team) return team->threads();
  return at::get_num_threads();
}

}  // namespace kvik
