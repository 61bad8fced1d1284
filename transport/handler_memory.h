// Memory for completion handlers: a per-thread cache of blocks in a few size
// classes, used through HandlerAllocator as the associated allocator of the
// handlers rdmarpc creates on its hot paths (the type-erased receive, send,
// timer and call handlers, and Asio's operation objects around them).
//
// Why not Asio's recycling allocator: it keeps a handful of blocks per thread
// and hands out the first one large enough, so a small request can take the
// only large block and the next large request misses. Over one RPC that
// churn cost up to 3 heap allocations per call (bench/rdmarpc_bench
// --alloc-trace showed where). Size classes make reuse exact: in the steady
// state every allocation is served from the cache.
//
// Blocks freed on another thread join that thread's cache (each cache is only
// ever touched by its own thread); each class keeps at most kMaxCached blocks
// and returns the rest to the heap. Under AddressSanitizer the cache is off,
// so a use after free of handler memory is still caught.
#pragma once

#include <cstddef>
#include <new>
#include <memory>
#include <type_traits>
#include <utility>

#include <boost/asio/associated_allocator.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/system_executor.hpp>
#include <boost/asio/bind_allocator.hpp>

namespace rdmarpc::transport {

namespace detail {
void* HandlerAllocate(std::size_t size, std::size_t align);
void HandlerDeallocate(void* p, std::size_t size, std::size_t align) noexcept;
}  // namespace detail

// Makes room on the calling thread for `n` more small handlers (send, receive
// and timer handlers) to be alive at once without a heap allocation: a
// connection whose queues bound how many of its handlers can be outstanding
// calls this on its executor's thread at setup, so that peaks reached only
// when completions lag are served from the cache too. Not cumulative: the
// cache for each small class is topped up to `n` blocks (in use or free).
void ReserveHandlerMemory(unsigned n);

template <typename T = void>
class HandlerAllocator {
 public:
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = HandlerAllocator<U>;
  };

  HandlerAllocator() noexcept = default;
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>&) noexcept {}  // NOLINT: rebinding converts implicitly

  T* allocate(std::size_t n) { return static_cast<T*>(detail::HandlerAllocate(sizeof(T) * n, alignof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { detail::HandlerDeallocate(p, sizeof(T) * n, alignof(T)); }

  friend bool operator==(const HandlerAllocator&, const HandlerAllocator&) noexcept { return true; }
};

template <>
class HandlerAllocator<void> {
 public:
  using value_type = void;
  template <typename U>
  struct rebind {
    using other = HandlerAllocator<U>;
  };

  HandlerAllocator() noexcept = default;
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>&) noexcept {}  // NOLINT: rebinding converts implicitly

  friend bool operator==(const HandlerAllocator&, const HandlerAllocator&) noexcept { return true; }
};

// One of our own handlers (a lambda with no associated executor or
// cancellation slot) with `Alloc` as its associated allocator and nothing
// else. bind_allocator's wrapper would do the same, but Asio counts any
// wrapper as naming an executor: a post then goes through a work_dispatcher
// (outstanding work counted, a second dispatch) and an I/O operation builds
// and compares a second executor on completion. Without it: ~120
// instructions less per spin pass over RDMA, ~60 per socket wait over TCP
// (bench/cpu_per_call). Not for callers' handlers: they keep bind_allocator
// (WithHandlerMemory), which passes their associations through.
template <typename Handler, typename Alloc>
class LeanHandler {
  static_assert(std::is_same_v<typename boost::asio::associated_executor<
                                   Handler, boost::asio::system_executor>::asio_associated_executor_is_unspecialised,
                               void>,
                "LeanHandler would drop the handler's associated executor");

 public:
  using allocator_type = Alloc;
  LeanHandler(Alloc alloc, Handler handler) : handler_(std::move(handler)), alloc_(std::move(alloc)) {}
  allocator_type get_allocator() const noexcept { return alloc_; }
  template <typename... Args>
  void operator()(Args&&... args) {
    handler_(std::forward<Args>(args)...);
  }

 private:
  Handler handler_;
  Alloc alloc_;
};

template <typename Alloc, typename Handler>
LeanHandler<std::decay_t<Handler>, Alloc> Lean(Alloc alloc, Handler&& handler) {
  return {std::move(alloc), std::forward<Handler>(handler)};
}

// Storage for the one in-flight operation of a chain of our own operations
// (a TCP connection's read loop, its write chain; an RDMA poller's spin pass
// that re-posts itself). Asio frees an operation's memory before it calls the
// completion, so the chain's next operation finds the slot free again and the
// steady path neither goes to the heap nor to the per-thread cache (Asio's
// "allocation" example). An operation that does not fit, or a second one
// while the slot is taken, falls back to the heap. The memory must outlive
// the operation: keep it in the object the handler holds a reference to.
// Not thread-safe: an operation is allocated and freed on one executor (or
// handed over through Asio's queue).
class OpMemory {
 public:
  OpMemory() = default;
  OpMemory(const OpMemory&) = delete;
  OpMemory& operator=(const OpMemory&) = delete;

  void* Allocate(std::size_t size) {
    if (!in_use_ && size <= sizeof(storage_)) {
      in_use_ = true;
      return storage_;
    }
    return ::operator new(size);
  }
  void Deallocate(void* p) noexcept {
    if (p == storage_) {
      in_use_ = false;
    } else {
      ::operator delete(p);
    }
  }

 private:
  // A TCP write op carries Asio's 64-entry prepared buffer array (1 KiB) plus
  // the composed op and our handler; 2 KiB holds it with room to spare.
  alignas(std::max_align_t) std::byte storage_[2048];
  bool in_use_ = false;
};

template <typename T>
class OpAllocator {
 public:
  using value_type = T;
  explicit OpAllocator(OpMemory* memory) noexcept : memory_(memory) {}
  template <typename U>
  OpAllocator(const OpAllocator<U>& other) noexcept : memory_(other.memory_) {}  // NOLINT: rebinding converts implicitly

  T* allocate(std::size_t n) { return static_cast<T*>(memory_->Allocate(sizeof(T) * n)); }
  void deallocate(T* p, std::size_t) noexcept { memory_->Deallocate(p); }
  template <typename U>
  bool operator==(const OpAllocator<U>& other) const noexcept {
    return memory_ == other.memory_;
  }

 private:
  template <typename>
  friend class OpAllocator;
  OpMemory* memory_;
};

// One of our own handlers (see Lean) whose operation lives in `memory`.
template <typename Handler>
auto WithOpMemory(OpMemory& memory, Handler&& handler) {
  return Lean(OpAllocator<void>(&memory), std::forward<Handler>(handler));
}

// `handler` with HandlerAllocator as its associated allocator, unless it
// already has one of its own (the caller's choice wins). Executor and
// cancellation slot associations pass through unchanged.
template <typename Handler>
auto WithHandlerMemory(Handler&& handler) {
  using H = std::decay_t<Handler>;
  if constexpr (std::is_same_v<boost::asio::associated_allocator_t<H>, std::allocator<void>>) {
    return boost::asio::bind_allocator(HandlerAllocator<void>(), std::forward<Handler>(handler));
  } else {
    return H(std::forward<Handler>(handler));
  }
}

}  // namespace rdmarpc::transport
