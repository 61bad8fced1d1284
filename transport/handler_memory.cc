#include "transport/handler_memory.h"

#include <algorithm>
#include <bit>
#include <new>

namespace rdmarpc::transport {
namespace detail {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCache = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kCache = false;
#else
constexpr bool kCache = true;
#endif
#else
constexpr bool kCache = true;
#endif

constexpr std::size_t kClassSize[] = {64, 128, 256, 512, 1024};
constexpr int kClasses = sizeof(kClassSize) / sizeof(kClassSize[0]);
constexpr unsigned kMaxCached = 256;
// Blocks added to a class's cache when a request finds it empty: at least
// kRefill, or as many as this thread already holds of the class (doubling).
// A miss means more handlers of that class are alive at once than ever before
// on this thread. Which peak a run reaches depends on how completions
// interleave (a starved completer holds send handlers until it runs), so a
// warm-up can miss a peak that a busy moment later hits: rpc_alloc_rdma_test
// saw one allocation in 10,000 calls in CI. Headroom taken at each miss makes
// further misses geometrically rarer, as a vector's doubling does for growth;
// ReserveHandlerMemory covers a bound known up front.
constexpr unsigned kRefill = 16;
// The classes that type-erased send, receive and timer handlers fall in.
constexpr std::size_t kReservedClassMax = 256;

struct FreeBlock {
  FreeBlock* next;
};

// The per-thread cache is trivially destructible with a constant initialiser,
// so the hot path reaches it with one %fs-relative access (no TLS guard, no
// init call); it stays readable after the thread's destructors ran (late
// frees then go straight to the heap). Its blocks are freed by Reaper, a
// second thread_local that the first refill arms.
struct Cache {
  FreeBlock* head[kClasses] = {};
  unsigned count[kClasses] = {};
  unsigned out[kClasses] = {};  // Handed out by this thread, not yet back to it.
  unsigned cap = kMaxCached;
  bool armed = false;  // Reaper registered
  bool gone = false;   // Reaper ran: the thread is exiting
};
constinit thread_local Cache t_cache;

struct Reaper {
  void Arm() noexcept {}
  ~Reaper() {
    Cache& cache = t_cache;
    cache.gone = true;
    for (int c = 0; c < kClasses; ++c) {
      while (cache.head[c] != nullptr) {
        FreeBlock* b = cache.head[c];
        cache.head[c] = b->next;
        ::operator delete(b, kClassSize[c]);
      }
      cache.count[c] = 0;
    }
  }
};
thread_local Reaper t_reaper;

void Add(Cache& cache, int c) {
  if (!cache.armed) {
    cache.armed = true;
    t_reaper.Arm();  // first use constructs it and registers its destructor
  }
  auto* b = static_cast<FreeBlock*>(::operator new(kClassSize[c]));
  b->next = cache.head[c];
  cache.head[c] = b;
  ++cache.count[c];
}

// 64 -> 0, 128 -> 1, ... 1024 -> 4; -1 above.
inline int ClassOf(std::size_t size) {
  if (size > kClassSize[kClasses - 1]) return -1;
  return size <= 64 ? 0 : static_cast<int>(std::bit_width(size - 1)) - 6;
}

}  // namespace

void* HandlerAllocate(std::size_t size, std::size_t align) {
  if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return ::operator new(size, std::align_val_t(align));
  const int c = ClassOf(size);
  if (c < 0) return ::operator new(size);
  if (kCache) {
    Cache& cache = t_cache;
    FreeBlock* b = cache.head[c];
    if (b == nullptr && !cache.gone) [[unlikely]] {
      const unsigned want = std::max(kRefill, cache.out[c]);
      for (unsigned i = 0; i < want && cache.count[c] < cache.cap; ++i) Add(cache, c);
      b = cache.head[c];
    }
    if (b != nullptr) {
      cache.head[c] = b->next;
      --cache.count[c];
      ++cache.out[c];
      return b;
    }
  }
  return ::operator new(kClassSize[c]);
}

void HandlerDeallocate(void* p, std::size_t size, std::size_t align) noexcept {
  if (p == nullptr) return;
  if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return ::operator delete(p, std::align_val_t(align));
  const int c = ClassOf(size);
  if (c < 0) return ::operator delete(p);
  if (kCache) {
    Cache& cache = t_cache;
    cache.out[c] -= cache.out[c] > 0;  // approximate when blocks cross threads
    if (cache.count[c] < cache.cap && !cache.gone) {
      auto* b = static_cast<FreeBlock*>(p);
      b->next = cache.head[c];
      cache.head[c] = b;
      ++cache.count[c];
      return;
    }
  }
  ::operator delete(p, kClassSize[c]);
}

}  // namespace detail

void ReserveHandlerMemory(unsigned n) {
  if (!detail::kCache || detail::t_cache.gone) return;
  detail::Cache& cache = detail::t_cache;
  cache.cap = std::max(cache.cap, n);
  for (int c = 0; c < detail::kClasses && detail::kClassSize[c] <= detail::kReservedClassMax; ++c)
    while (cache.count[c] + cache.out[c] < n) detail::Add(cache, c);
}

}  // namespace rdmarpc::transport
