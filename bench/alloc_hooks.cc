// Counting allocator: replaces malloc and friends for the whole process with
// wrappers around glibc's, so every heap allocation (operator new, protobuf,
// gRPC, rdma-core) is counted. Linked into the benchmarks and the allocation
// test only, never into the library; not usable with AddressSanitizer (which
// owns malloc itself).
#include "bench/alloc_hooks.h"

#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>

// ---- counting allocator ----------------------------------------------------------
// glibc exports its allocator under __libc_* names; the definitions below
// interpose malloc & co. for the whole process (libstdc++'s operator new,
// protobuf, gRPC, rdma-core all land here) and forward to glibc.
extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t n, size_t size);
void* __libc_realloc(void* p, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void __libc_free(void* p);
}

namespace {

std::atomic<uint64_t> g_allocs{0};
std::atomic<int> g_trace_left{0};
thread_local bool t_in_trace = false;

inline void CountAlloc(size_t size) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (g_trace_left.load(std::memory_order_relaxed) <= 0 || t_in_trace) [[likely]]
    return;
  t_in_trace = true;  // backtrace() may allocate: do not trace that
  if (g_trace_left.fetch_sub(1, std::memory_order_relaxed) > 0) {
    void* frames[32];
    const int n = backtrace(frames, 32);
    char head[80];
    const int len = std::snprintf(head, sizeof head, "---- allocation of %zu bytes in steady phase:\n", size);
    (void)!write(STDERR_FILENO, head, static_cast<size_t>(len));
    backtrace_symbols_fd(frames + 2, n - 2, STDERR_FILENO);  // skip CountAlloc + malloc
  }
  t_in_trace = false;
}

}  // namespace

extern "C" {
void* malloc(size_t size) noexcept {
  CountAlloc(size);
  return __libc_malloc(size);
}
void* calloc(size_t n, size_t size) noexcept {
  CountAlloc(n * size);
  return __libc_calloc(n, size);
}
void* realloc(void* p, size_t size) noexcept {
  CountAlloc(size);
  return __libc_realloc(p, size);
}
void free(void* p) noexcept { __libc_free(p); }
void* memalign(size_t alignment, size_t size) noexcept {
  CountAlloc(size);
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(size_t alignment, size_t size) noexcept {
  CountAlloc(size);
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, size_t alignment, size_t size) noexcept {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) return EINVAL;
  CountAlloc(size);
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
}

namespace rdmarpc::bench {

uint64_t AllocCount() { return g_allocs.load(std::memory_order_relaxed); }
void TraceNextAllocs(int n) { g_trace_left.store(n, std::memory_order_relaxed); }
void WarmAllocTracing() {
  void* warm[2];
  backtrace(warm, 2);  // loads libgcc_s now, not in the middle of a measurement
}

}  // namespace rdmarpc::bench
