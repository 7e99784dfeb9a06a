// The kernels' own threads (pool.h).
#include "pool.h"

#include <algorithm>
#include <new>
#include <utility>

#include <pthread.h>

#include "simd.h"

namespace attnserve::kernels {

void Pool::resize(int threads, int spin_us) {
  std::lock_guard<std::mutex> owner(owner_);
  threads = std::min(std::max(threads, 1), kMaxThreads);
  const auto spin = std::chrono::microseconds(std::max(spin_us, 0));
  if (threads == static_cast<int>(workers_.size()) + 1 && spin == spin_) return;
  while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  if (!workers_.empty()) {
    {
      std::lock_guard<std::mutex> lock(sleep_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
    workers_.clear();
    stop_.store(false);
  }
  spin_ = spin;
  // each worker waits for the epoch after this one (read here, while the pool is held: a
  // worker that read it itself once started could miss a call made before then)
  const uint64_t epoch = epoch_.load();
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i, epoch] { work_loop(static_cast<size_t>(i), epoch); });
  }
  size_.store(threads, std::memory_order_relaxed);
  busy_.store(false, std::memory_order_release);
}

void Pool::after_fork_in_child() {
  static auto* orphans = new std::vector<std::thread>();
  for (std::thread& worker : workers_) orphans->push_back(std::move(worker));
  workers_.clear();
  size_.store(1);
  new (&owner_) std::mutex();
  new (&sleep_) std::mutex();
  new (&wake_) std::condition_variable();
  busy_.store(false), stop_.store(false), pending_.store(0), sleepers_.store(0);
  error_ = nullptr;
}

bool Pool::run(void (*fn)(void*, size_t), size_t total, void* data) {
  if (busy_.exchange(true, std::memory_order_acquire)) return false;
  if (workers_.empty()) {
    busy_.store(false, std::memory_order_release);
    return false;
  }
  const size_t shards = workers_.size() + 1;
  runs_.fetch_add(1, std::memory_order_relaxed);
  fn_ = fn, data_ = data, shards_ = shards;
  for (size_t s = 0; s < shards; ++s) {
    shard_[s].next.store(total * s / shards, std::memory_order_relaxed);
    shard_[s].end = total * (s + 1) / shards;
  }
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  epoch_.fetch_add(1);  // sequentially consistent: ordered before the read of sleepers_
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_);
    wake_.notify_all();
  }
  take_tasks(0);
  while (pending_.load(std::memory_order_acquire) > 0) pause();
  std::exception_ptr error = std::exchange(error_, nullptr);
  busy_.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
  return true;
}

void Pool::pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void Pool::take_tasks(size_t home) {
  void (*fn)(void*, size_t) = fn_;
  void* data = data_;
  try {
    for (size_t k = 0; k < shards_; ++k) {
      Shard& shard = shard_[(home + k) % shards_];
      for (size_t i; (i = shard.next.fetch_add(1, std::memory_order_relaxed)) < shard.end;) {
        fn(data, i);
      }
    }
  } catch (...) {  // (an allocation failing) the caller rethrows the first
    std::lock_guard<std::mutex> lock(sleep_);
    if (!error_) error_ = std::current_exception();
    for (size_t k = 0; k < shards_; ++k) shard_[k].next.store(shard_[k].end);  // stop
  }
}

void Pool::work_loop(size_t home, uint64_t seen) {
  for (;;) {
    auto start = std::chrono::steady_clock::now();
    for (unsigned spins = 0; epoch_.load(std::memory_order_acquire) == seen && !stop_.load();) {
      pause();
      if (++spins % 256 != 0 || std::chrono::steady_clock::now() - start < spin_) continue;
      std::unique_lock<std::mutex> lock(sleep_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return epoch_.load() != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
      start = std::chrono::steady_clock::now();
    }
    if (stop_.load()) return;
    seen = epoch_.load(std::memory_order_acquire);
    take_tasks(home);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

Pool& pool() {
  static Pool* instance = [] {  // never destroyed: its threads may outlive static exit
    pthread_atfork([] { pool().before_fork(); }, [] { pool().after_fork_in_parent(); },
                   [] { pool().after_fork_in_child(); });
    return new Pool();
  }();
  return *instance;
}

}  // namespace attnserve::kernels
