// BufferPool behaviour on the heap provider (no device needed): class
// selection, the cap, reuse, lazy growth, per-thread caches under threads,
// thread exit, pool destruction under other threads' caches, and the promise
// that the steady path allocates nothing and takes no lock.
#include "transport/rdma/buffer_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <thread>
#include <vector>

// ---- allocation counting -------------------------------------------------------
// Replacing the two basic forms is enough: libstdc++'s array, nothrow and
// sized forms forward to them.
namespace {
std::atomic<bool> g_count_allocations{false};
std::atomic<size_t> g_allocations{0};
void* CountedAlloc(size_t n, size_t align) {
  if (g_count_allocations.load(std::memory_order_relaxed))
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  n = n == 0 ? 1 : n;
  void* p = align <= alignof(std::max_align_t) ? std::malloc(n)
                                               : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t n) { return CountedAlloc(n, alignof(std::max_align_t)); }
void* operator new(size_t n, std::align_val_t a) { return CountedAlloc(n, static_cast<size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace rdmarpc::rdma {
namespace {

bool Contains(absl::string_view hay, absl::string_view needle) {
  return hay.find(needle) != absl::string_view::npos;
}

// What a provider handed out and still has out, readable after the pool (which
// owns the provider) is gone.
struct Ledger {
  std::mutex mu;
  std::map<uintptr_t, size_t> live;  // base -> bytes
  std::set<uintptr_t> deregistered;  // bases whose registration was dropped (still live)
  int allocations = 0;
  bool Owns(uint64_t addr, size_t len) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.upper_bound(static_cast<uintptr_t>(addr));
    if (it == live.begin()) return false;
    --it;
    return addr >= it->first && addr + len <= it->first + it->second;
  }
};

class RecordingProvider final : public SlabProvider {
 public:
  explicit RecordingProvider(std::shared_ptr<Ledger> ledger) : ledger_(std::move(ledger)) {}
  absl::StatusOr<Slab> Allocate(size_t bytes, int access) override {
    auto slab = heap_.Allocate(bytes, access);
    if (slab.ok()) {
      std::lock_guard<std::mutex> lock(ledger_->mu);
      ledger_->live[reinterpret_cast<uintptr_t>(slab->base)] = slab->bytes;
      ++ledger_->allocations;
    }
    return slab;
  }
  void Free(const Slab& slab) noexcept override {
    {
      std::lock_guard<std::mutex> lock(ledger_->mu);
      ledger_->live.erase(reinterpret_cast<uintptr_t>(slab.base));
    }
    heap_.Free(slab);
  }
  void Deregister(const Slab& slab) noexcept override {
    std::lock_guard<std::mutex> lock(ledger_->mu);
    ledger_->deregistered.insert(reinterpret_cast<uintptr_t>(slab.base));
  }

 private:
  HeapSlabProvider heap_;
  std::shared_ptr<Ledger> ledger_;
};

class FailingProvider final : public SlabProvider {
 public:
  explicit FailingProvider(absl::Status status) : status_(std::move(status)) {}
  absl::StatusOr<Slab> Allocate(size_t, int) override { return status_; }
  void Free(const Slab&) noexcept override {}

 private:
  absl::Status status_;
};

// One class of 64 B buffers, 16 per slab, capped at one slab unless changed.
BufferPoolOptions TinyOptions() {
  BufferPoolOptions o;
  o.class_bytes = {64};
  o.slab_bytes = 1024;
  o.min_buffers_per_slab = 1;
  o.max_registered_bytes = 1024;
  o.thread_cache_buffers = 8;
  return o;
}

std::unique_ptr<BufferPool> MakePool(BufferPoolOptions o, std::shared_ptr<Ledger> ledger = nullptr) {
  std::unique_ptr<SlabProvider> provider;
  if (ledger) provider = std::make_unique<RecordingProvider>(std::move(ledger));
  else provider = std::make_unique<HeapSlabProvider>();
  auto pool = BufferPool::Create(std::move(provider), std::move(o));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

// Two classes (64 B and 128 B, 16 and 8 per 1 KiB slab), no cap that matters.
BufferPoolOptions TwoClassOptions(size_t preallocate_slabs = 0) {
  BufferPoolOptions o = TinyOptions();
  o.class_bytes = {64, 128};
  o.max_registered_bytes = 1 << 20;
  o.preallocate_slabs = preallocate_slabs;
  return o;
}

size_t TotalInUse(const BufferPool& pool) {
  size_t n = 0;
  for (const auto& c : pool.Stats().classes) n += c.in_use;
  return n;
}

// Runs closures on one long-lived thread, so a test can interleave that
// thread's pool use with work (like destroying a pool) on the test thread.
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    Run(nullptr);
    thread_.join();
  }
  // Runs `fn` on the worker and waits for it; nullptr stops the worker.
  void Run(std::function<void()> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool stop = !fn;
    task_ = fn ? std::move(fn) : [this] { stop_ = true; };
    ++posted_;
    cv_.notify_all();
    if (!stop) cv_.wait(lock, [&] { return done_ == posted_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait(lock, [&] { return posted_ != done_; });
      auto fn = std::move(task_);
      lock.unlock();
      fn();
      lock.lock();
      ++done_;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> task_;
  uint64_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;  // Last: starts after the state above exists.
};

TEST(BufferPool, PicksTheSmallestClassThatFitsAtEveryBoundary) {
  BufferPoolOptions o;
  o.class_bytes = {256, 4096, 65536};
  o.slab_bytes = 256 << 10;
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  const std::vector<std::pair<size_t, size_t>> cases = {
      {0, 256}, {1, 256}, {256, 256}, {257, 4096}, {4096, 4096}, {4097, 65536}, {65536, 65536}};
  for (auto [size, want_class] : cases) {
    auto b = pool->Acquire(size);
    ASSERT_TRUE(b.ok()) << size << ": " << b.status();
    EXPECT_EQ(b->capacity(), want_class) << "size " << size;
    EXPECT_EQ(b->size(), size);
    EXPECT_EQ(b->data().size(), size);
    // The handle is counted against the class it came from.
    for (const auto& c : pool->Stats().classes)
      EXPECT_EQ(c.in_use, c.buffer_bytes == want_class ? 1u : 0u) << "size " << size;
  }
  auto too_big = pool->Acquire(65537);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(too_big.status().message(), "64 KiB")) << too_big.status();
  EXPECT_TRUE(Contains(too_big.status().message(), "class_bytes")) << too_big.status();
}

TEST(BufferPool, CapOnRegisteredBytesIsResourceExhaustedNamingTheCapAndTheOption) {
  BufferPoolOptions o = TinyOptions();
  o.max_registered_bytes = 2048;  // Two 1 KiB slabs: 32 buffers.
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  std::vector<Buffer> held;
  for (int i = 0; i < 32; ++i) {
    auto b = pool->Acquire(64);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    held.push_back(*std::move(b));
  }
  auto over = pool->Acquire(64);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(over.status().message(), "cap of 2 KiB")) << over.status();
  EXPECT_TRUE(Contains(over.status().message(), "max_registered_bytes")) << over.status();
  EXPECT_EQ(pool->Stats().registered_bytes, 2048u);
  // The cap is about registered memory, not a latch: a released buffer serves again.
  held.pop_back();
  EXPECT_TRUE(pool->Acquire(64).ok());
}

TEST(BufferPool, LiveBuffersAreDistinctAndDoNotOverlap) {
  BufferPoolOptions o;
  o.class_bytes = {64, 256, 4096};
  o.slab_bytes = 8192;
  o.min_buffers_per_slab = 1;
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  std::vector<Buffer> held;
  for (int i = 0; i < 300; ++i) {
    auto b = pool->Acquire(std::vector<size_t>{1, 64, 200, 256, 3000}[i % 5]);
    ASSERT_TRUE(b.ok()) << b.status();
    std::fill(b->data().begin(), b->data().end(), std::byte(i & 0xff));
    held.push_back(*std::move(b));
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& b : held) ranges.emplace_back(b.addr(), b.addr() + b.capacity());
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    ASSERT_LE(ranges[i - 1].second, ranges[i].first) << "buffers " << i - 1 << " and " << i << " overlap";
  for (size_t i = 0; i < held.size(); ++i)
    for (std::byte v : held[i].data()) ASSERT_EQ(v, std::byte(i & 0xff)) << "buffer " << i;
}

TEST(BufferPool, ReleasedBuffersComeBackInsteadOfNewMemory) {
  auto ledger = std::make_shared<Ledger>();
  BufferPoolOptions o = TinyOptions();
  o.max_registered_bytes = 1 << 20;
  auto pool = MakePool(o, ledger);
  ASSERT_NE(pool, nullptr);
  std::set<uint64_t> first, second;
  for (int round = 0; round < 2; ++round) {
    std::vector<Buffer> held;
    for (int i = 0; i < 16; ++i) {  // The whole slab.
      auto b = pool->Acquire(10);
      ASSERT_TRUE(b.ok()) << b.status();
      (round == 0 ? first : second).insert(b->addr());
      held.push_back(*std::move(b));
    }
  }
  EXPECT_EQ(first.size(), 16u);
  EXPECT_EQ(first, second);
  EXPECT_EQ(ledger->allocations, 1);
  EXPECT_EQ(pool->Stats().slabs, 1u);
}

TEST(BufferPool, GrowsLazilyOneSlabAtATimePerClass) {
  auto ledger = std::make_shared<Ledger>();
  auto pool = MakePool(TwoClassOptions(), ledger);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->Stats().slabs, 0u);
  EXPECT_EQ(pool->Stats().registered_bytes, 0u);
  std::vector<Buffer> held;
  for (int i = 1; i <= 17; ++i) {
    auto b = pool->Acquire(64);
    ASSERT_TRUE(b.ok()) << b.status();
    held.push_back(*std::move(b));
    auto s = pool->Stats();
    EXPECT_EQ(s.classes[0].slabs, i <= 16 ? 1u : 2u) << "after " << i << " buffers";
    EXPECT_EQ(s.classes[1].slabs, 0u) << "an unused class must not register anything";
  }
  EXPECT_EQ(ledger->allocations, 2);
  EXPECT_EQ(pool->Stats().registered_bytes, 2048u);
}

// Device removal (RDMA_CM_EVENT_DEVICE_REMOVAL): every registration goes at
// once, the memory stays for buffers still held, and the pool grows no more.
TEST(BufferPool, DeregisterDropsEveryRegistrationKeepsTheMemoryAndStopsGrowth) {
  auto ledger = std::make_shared<Ledger>();
  auto pool = MakePool(TwoClassOptions(), ledger);
  ASSERT_NE(pool, nullptr);
  std::vector<Buffer> held;
  for (int i = 0; i < 17; ++i) held.push_back(*pool->Acquire(64));  // Two slabs of the first class.
  held.push_back(*pool->Acquire(128));
  for (auto& b : held) std::memset(b.data().data(), 0x5a, b.data().size());
  ASSERT_EQ(ledger->live.size(), 3u);

  pool->Deregister();
  pool->Deregister();  // Idempotent.
  {
    std::lock_guard<std::mutex> lock(ledger->mu);
    EXPECT_EQ(ledger->deregistered.size(), 3u);
    for (const auto& [base, bytes] : ledger->live) EXPECT_EQ(ledger->deregistered.count(base), 1u);
  }
  // Held buffers still point at live memory with what was written.
  for (auto& b : held) {
    EXPECT_TRUE(ledger->Owns(b.addr(), b.data().size()));
    EXPECT_EQ(b.data()[0], std::byte{0x5a});
  }
  // Buffers the pool already has still come out; a new slab does not.
  held.pop_back();
  EXPECT_TRUE(pool->Acquire(128).ok());
  std::vector<Buffer> more;
  absl::Status refused;
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    auto b = pool->Acquire(64);
    if (b.ok()) more.push_back(*std::move(b));
    else refused = b.status();
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(Contains(refused.message(), "device was removed")) << refused;
  EXPECT_EQ(ledger->allocations, 3);
  held.clear();
  more.clear();
  pool.reset();
  EXPECT_TRUE(ledger->live.empty()) << "the memory is freed with the pool";
}

TEST(BufferPool, PreallocateRegistersAtCreateAndTheHotPathDoesNot) {
  auto ledger = std::make_shared<Ledger>();
  auto pool = MakePool(TwoClassOptions(/*preallocate_slabs=*/2), ledger);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(ledger->allocations, 4);
  std::vector<Buffer> held;
  for (int i = 0; i < 32; ++i) held.push_back(*pool->Acquire(64));  // Two slabs' worth.
  for (int i = 0; i < 16; ++i) held.push_back(*pool->Acquire(128));
  EXPECT_EQ(ledger->allocations, 4);
}

TEST(BufferPool, ProviderFailureReachesTheCallerUnchanged) {
  const absl::Status failure = absl::ResourceExhaustedError(
      "ibv_reg_mr of 1024 bytes on rxe0: Cannot allocate memory (errno 12). RLIMIT_MEMLOCK is "
      "64 KiB (hard 64 KiB) ... `ulimit -l unlimited`");
  BufferPoolOptions eager = TinyOptions();
  eager.preallocate_slabs = 1;
  auto created = BufferPool::Create(std::make_unique<FailingProvider>(failure), eager);
  EXPECT_EQ(created.status(), failure);

  auto lazy = BufferPool::Create(std::make_unique<FailingProvider>(failure), TinyOptions());
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  EXPECT_EQ((*lazy)->Acquire(1).status(), failure);
  EXPECT_EQ((*lazy)->Stats().slabs, 0u);
}

TEST(BufferPool, InvalidOptionsAreRejectedNamingTheOption) {
  auto status_of = [](BufferPoolOptions o) {
    return BufferPool::Create(std::make_unique<HeapSlabProvider>(), std::move(o)).status();
  };
  BufferPoolOptions o = TinyOptions();
  o.class_bytes = {100};
  EXPECT_TRUE(Contains(status_of(o).message(), "class_bytes[0] = 100")) << status_of(o);
  o.class_bytes = {128, 64};
  EXPECT_TRUE(Contains(status_of(o).message(), "strictly increasing")) << status_of(o);
  o = TinyOptions();
  o.access = IBV_ACCESS_REMOTE_WRITE;
  EXPECT_TRUE(Contains(status_of(o).message(), "require LOCAL_WRITE")) << status_of(o);
  o = TinyOptions();
  o.max_registered_bytes = 512;
  EXPECT_EQ(status_of(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status_of(o).message(), "max_registered_bytes")) << status_of(o);
}

TEST(BufferPool, ThreadsNeverShareALiveBuffer) {
  BufferPoolOptions o;
  o.class_bytes = {64, 256, 1024, 4096};
  o.slab_bytes = 64 << 10;
  o.max_registered_bytes = 16 << 20;
  // A tiny cache sends every other operation through the central list, so
  // the threads race there as much as in their caches.
  o.thread_cache_buffers = 2;
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  constexpr int kThreads = 4, kIterations = 50000, kHeld = 16;
  std::atomic<int> corrupted{0}, failed{0};
  auto body = [&](uint32_t id) {
    std::mt19937 rng(id);
    std::vector<std::pair<Buffer, uint32_t>> held;  // buffer, the tag written into it
    auto tag_ok = [](const Buffer& b, uint32_t tag) {
      auto d = b.data();
      for (size_t i = 0; i + 4 <= d.size(); i += 4)
        if (std::memcmp(&d[i], &tag, 4) != 0) return false;
      return true;
    };
    for (int it = 0; it < kIterations; ++it) {
      if (held.size() == kHeld || (!held.empty() && rng() % 2 == 0)) {
        size_t victim = rng() % held.size();
        if (!tag_ok(held[victim].first, held[victim].second)) corrupted.fetch_add(1);
        held.erase(held.begin() + static_cast<ptrdiff_t>(victim));
        continue;
      }
      const size_t size = 4 + rng() % 4092;
      auto b = pool->Acquire(size);
      if (!b.ok()) { failed.fetch_add(1); continue; }
      const uint32_t tag = (id << 24) | static_cast<uint32_t>(it);
      auto d = b->data();
      for (size_t i = 0; i + 4 <= d.size(); i += 4) std::memcpy(&d[i], &tag, 4);
      held.emplace_back(*std::move(b), tag);
    }
    for (auto& [b, tag] : held)
      if (!tag_ok(b, tag)) corrupted.fetch_add(1);
  };
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t) threads.emplace_back(body, t + 1);
  for (auto& t : threads) t.join();
  EXPECT_EQ(corrupted.load(), 0) << "a live buffer was handed to two holders";
  EXPECT_EQ(failed.load(), 0);
  for (const auto& c : pool->Stats().classes) {
    EXPECT_EQ(c.in_use, 0u) << c.buffer_bytes;
    // Every thread has exited, so nothing may be parked in a thread cache.
    EXPECT_EQ(c.cached_in_threads, 0u) << c.buffer_bytes;
    EXPECT_EQ(c.free_central, c.buffers) << c.buffer_bytes;
  }
}

TEST(BufferPool, BuffersReleasedOnAnotherThreadFlowBackToTheAcquirer) {
  BufferPoolOptions o = TinyOptions();
  o.max_registered_bytes = 2048;  // 32 buffers; the pipeline below needs at most 24.
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  constexpr int kHandoffs = 50000, kInFlight = 8;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Buffer> queue;
  std::atomic<int> failures{0};
  std::thread consumer([&] {
    for (int i = 0; i < kHandoffs; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !queue.empty(); });
      Buffer b = std::move(queue.front());
      queue.pop_front();
      cv.notify_all();
      lock.unlock();
      b.Reset();  // Released on this thread, acquired on the other.
    }
  });
  for (int i = 0; i < kHandoffs; ++i) {
    auto b = pool->Acquire(64);
    if (!b.ok()) {
      ADD_FAILURE() << "handoff " << i << ": " << b.status();
      failures.fetch_add(1);
      break;
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return queue.size() < kInFlight; });
    queue.push_back(*std::move(b));
    cv.notify_all();
  }
  if (failures.load() != 0) {  // Unblock the consumer so the test can end.
    for (int i = 0; i < kHandoffs; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      queue.emplace_back();
      cv.notify_all();
    }
  }
  consumer.join();
  EXPECT_EQ(TotalInUse(*pool), 0u);
  EXPECT_LE(pool->Stats().slabs, 2u);
}

TEST(BufferPool, AThreadThatExitsHandsItsCachedBuffersBack) {
  auto pool = MakePool(TinyOptions());  // One slab of 16 is all the cap allows.
  ASSERT_NE(pool, nullptr);
  std::thread([&] {
    std::vector<Buffer> held;
    for (int i = 0; i < 16; ++i) held.push_back(*pool->Acquire(64));
    held.clear();  // Eight stay parked in this thread's cache.
    EXPECT_GT(pool->Stats().classes[0].cached_in_threads, 0u);
  }).join();
  auto s = pool->Stats();
  EXPECT_EQ(s.classes[0].in_use, 0u);
  EXPECT_EQ(s.classes[0].cached_in_threads, 0u);
  std::vector<Buffer> again;
  for (int i = 0; i < 16; ++i) {
    auto b = pool->Acquire(64);
    ASSERT_TRUE(b.ok()) << "buffer " << i << " was stranded by the exited thread: " << b.status();
    again.push_back(*std::move(b));
  }
}

TEST(BufferPool, AThreadKeepsWorkingAfterAPoolItCachedIsDestroyedElsewhere) {
  Worker worker;
  std::atomic<int> foreign{0}, failures{0};
  // Many rounds: freed pools' memory (and cores) get reused by later pools, so
  // a cache keyed by a stale identity would hand out a dead pool's buffers.
  for (int round = 0; round < 64; ++round) {
    auto ledger = std::make_shared<Ledger>();
    auto pool = MakePool(TinyOptions(), ledger);
    ASSERT_NE(pool, nullptr);
    worker.Run([&] {
      std::vector<Buffer> held;
      for (int i = 0; i < 12; ++i) {
        auto b = pool->Acquire(64);
        if (!b.ok()) { failures.fetch_add(1); return; }
        if (!ledger->Owns(b->addr(), b->capacity())) foreign.fetch_add(1);
        std::memset(b->data().data(), 0x5a, b->capacity());
        held.push_back(*std::move(b));
      }
    });  // The worker's cache now holds buffers of `pool`.
    pool.reset();
    EXPECT_TRUE(ledger->live.empty()) << "the destroyed pool kept slabs";
  }
  EXPECT_EQ(foreign.load(), 0) << "a thread cache served buffers of a destroyed pool";
  EXPECT_EQ(failures.load(), 0);
}

TEST(BufferPool, AThreadUsingMorePoolsThanCacheSlotsLosesNoBuffers) {
  constexpr int kPools = 20;  // More than the per-thread table holds.
  std::vector<std::unique_ptr<BufferPool>> pools;
  for (int i = 0; i < kPools; ++i) {
    pools.push_back(MakePool(TinyOptions()));  // 16 buffers each, cap = one slab.
    ASSERT_NE(pools.back(), nullptr);
  }
  for (auto& pool : pools) {
    std::vector<Buffer> held;
    for (int i = 0; i < 16; ++i) held.push_back(*pool->Acquire(64));
  }  // Each pool has 8 buffers parked in this thread's cache (until evicted).
  for (int p = 0; p < kPools; ++p) {
    std::vector<Buffer> held;
    for (int i = 0; i < 16; ++i) {
      auto b = pools[p]->Acquire(64);
      ASSERT_TRUE(b.ok()) << "pool " << p << " buffer " << i << ": " << b.status();
      held.push_back(*std::move(b));
    }
  }
  for (auto& pool : pools) EXPECT_EQ(TotalInUse(*pool), 0u);
}

TEST(BufferPool, SteadyStateAcquireReleaseAllocatesNothingAndTakesNoLock) {
  BufferPoolOptions o;
  o.class_bytes = {256, 4096};
  o.slab_bytes = 64 << 10;
  auto pool = MakePool(o);
  ASSERT_NE(pool, nullptr);
  for (int i = 0; i < 100; ++i) {  // Warm-up: slabs, this thread's cache entry.
    ASSERT_TRUE(pool->Acquire(100).ok());
    ASSERT_TRUE(pool->Acquire(3000).ok());
  }
  auto locks_before = pool->Stats().classes;
  bool all_ok = true;
  g_allocations.store(0);
  g_count_allocations.store(true);
  for (int i = 0; i < 10000; ++i) {
    auto b = pool->Acquire(i % 2 == 0 ? 100 : 3000);
    all_ok &= b.ok();
  }
  g_count_allocations.store(false);
  EXPECT_TRUE(all_ok);
  EXPECT_EQ(g_allocations.load(), 0u);
  auto locks_after = pool->Stats().classes;
  for (size_t c = 0; c < locks_after.size(); ++c)
    EXPECT_EQ(locks_after[c].mutex_acquisitions, locks_before[c].mutex_acquisitions)
        << "class " << locks_after[c].buffer_bytes;
}

TEST(BufferPool, DestroyingAPoolWithOutstandingBuffersLeaksRatherThanCrashes) {
#if !defined(NDEBUG)
  GTEST_SKIP() << "debug builds assert on this caller bug";
#elif defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the deliberate leak would fail LeakSanitizer";
#else
  auto pool = MakePool(TinyOptions());
  ASSERT_NE(pool, nullptr);
  Buffer survivor = *pool->Acquire(64);
  pool.reset();
  std::memset(survivor.data().data(), 1, survivor.capacity());  // Memory still valid.
  survivor.Reset();                                             // And a no-op.
  EXPECT_FALSE(survivor);
#endif
}

}  // namespace
}  // namespace rdmarpc::rdma
