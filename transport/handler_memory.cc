#include "transport/handler_memory.h"

#include <new>

namespace rdmarpc::transport::detail {
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

struct FreeBlock {
  FreeBlock* next;
};

// Trivially destructible, so readable after the cache below is destroyed at
// thread exit (late frees then go straight to the heap).
thread_local bool t_cache_gone = false;

struct Cache {
  FreeBlock* head[kClasses] = {};
  unsigned count[kClasses] = {};
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
    if (FreeBlock* b = cache.head[c]) {
      cache.head[c] = b->next;
      --cache.count[c];
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
    if (cache.count[c] < kMaxCached) {
      auto* b = static_cast<FreeBlock*>(p);
      b->next = cache.head[c];
      cache.head[c] = b;
      ++cache.count[c];
      return;
    }
  }
  ::operator delete(p, kClassSize[c]);
}

}  // namespace rdmarpc::transport::detail
