#include "transport/handler_memory.h"

#include <algorithm>
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

// Trivially destructible, so readable after the cache below is destroyed at
// thread exit (late frees then go straight to the heap).
thread_local bool t_cache_gone = false;

struct Cache {
  FreeBlock* head[kClasses] = {};
  unsigned count[kClasses] = {};
  unsigned out[kClasses] = {};  // Handed out by this thread, not yet back to it.
  unsigned cap = kMaxCached;
  ~Cache() {
    t_cache_gone = true;
    for (int c = 0; c < kClasses; ++c) {
      while (head[c] != nullptr) {
        FreeBlock* b = head[c];
        head[c] = b->next;
        ::operator delete(b, kClassSize[c]);
      }
    }
  }
  void Add(int c) {
    auto* b = static_cast<FreeBlock*>(::operator new(kClassSize[c]));
    b->next = head[c];
    head[c] = b;
    ++count[c];
  }
};
thread_local Cache t_cache;

inline int ClassOf(std::size_t size) {
  for (int c = 0; c < kClasses; ++c)
    if (size <= kClassSize[c]) return c;
  return -1;
}

}  // namespace

void* HandlerAllocate(std::size_t size, std::size_t align) {
  if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return ::operator new(size, std::align_val_t(align));
  const int c = ClassOf(size);
  if (c < 0) return ::operator new(size);
  if (kCache && !t_cache_gone) {
    Cache& cache = t_cache;
    if (cache.head[c] == nullptr) {
      const unsigned want = std::max(kRefill, cache.out[c]);
      for (unsigned i = 0; i < want && cache.count[c] < cache.cap; ++i) cache.Add(c);
    }
    if (FreeBlock* b = cache.head[c]) {
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
  if (kCache && !t_cache_gone) {
    Cache& cache = t_cache;
    if (cache.out[c] > 0) --cache.out[c];  // approximate when blocks cross threads
    if (cache.count[c] < cache.cap) {
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
  if (!detail::kCache || detail::t_cache_gone) return;
  detail::Cache& cache = detail::t_cache;
  cache.cap = std::max(cache.cap, n);
  for (int c = 0; c < detail::kClasses && detail::kClassSize[c] <= detail::kReservedClassMax; ++c)
    while (cache.count[c] + cache.out[c] < n) cache.Add(c);
}

}  // namespace rdmarpc::transport
