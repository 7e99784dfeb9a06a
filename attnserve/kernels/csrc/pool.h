// The kernels' own threads.
//
// A language model's decoding step at one row is ~120 products of 0.2-2 MB each: split over
// ONNX Runtime's threads, each product pays the hand-over to the other threads and the wait for
// them (several microseconds with spinning threads on a 2-core VM, a quarter of a product's
// time). When the process asks for it (attnserve_kernels_threads(n), n > 1: the language
// model's backend, whose session then runs ONNX Runtime's own nodes on one thread), the kernels
// run their tasks on n - 1 threads of their own and the calling thread instead: a task index
// taken from an atomic counter, the workers spinning between products (for up to spin_us, then
// asleep on a condition variable until the next). One caller at a time: a kernel called while
// another holds the pool uses ONNX Runtime's threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace attnserve::kernels {

class Pool {
 public:
  ~Pool() { resize(1, 0); }

  // Waits for a kernel running on the pool to finish; the same size and spin again is a no-op.
  void resize(int threads, int spin_us);

  // A fork: the parent holds owner_ across it (no resize half done), and the child, which has
  // none of the parent's threads, starts over with none (the parent's thread objects are left
  // alone, never joined; its locks and counters as a fresh pool's): its kernels run on ONNX
  // Runtime's threads until it asks for threads of its own.
  void before_fork() { owner_.lock(); }
  void after_fork_in_parent() { owner_.unlock(); }
  void after_fork_in_child();

  // Threads in all, the caller's with the workers (a hint: it may change while read).
  int threads() const { return size_.load(std::memory_order_relaxed); }

  // fn(data, i) for every i in [0, total) on the pool and the calling thread; false (nothing
  // run) when the pool has no workers or another caller holds it.
  bool run(void (*fn)(void*, size_t), size_t total, void* data);

 private:
  static constexpr int kMaxThreads = 64;

  static void pause();

  // Thread `home`'s own contiguous share of the tasks first (a stream of weights the CPU's
  // prefetchers follow), then what is left of the others'.
  void take_tasks(size_t home);

  void work_loop(size_t home, uint64_t seen);

  struct alignas(64) Shard {  // a cache line each: threads take tasks from their own
    std::atomic<size_t> next{0};
    size_t end = 0;
  };

  std::mutex owner_;  // resize
  std::vector<std::thread> workers_;
  std::chrono::microseconds spin_{0};
  void (*fn_)(void*, size_t) = nullptr;
  void* data_ = nullptr;
  size_t shards_ = 1;
  Shard shard_[kMaxThreads];
  // each on a cache line of its own: the workers spin on epoch_ while tasks are taken
  std::atomic<int> size_{1};
  alignas(64) std::atomic<bool> busy_{false};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint64_t> epoch_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::mutex sleep_;  // the sleepers' wake-ups, and error_
  std::condition_variable wake_;
  std::exception_ptr error_;

 public:
  std::atomic<uint64_t> runs_{0};  // calls run on the pool (observability, tests)
};

// The process's pool (made at its first use, never destroyed: its threads may outlive static
// exit), its workers left behind in a forked child.
Pool& pool();

}  // namespace attnserve::kernels
