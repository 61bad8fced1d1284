// BufferPool: registered memory for the data path, handed out as buffers of a
// few size classes. In steady state Acquire and Release take no lock and make
// no heap allocation.
//
// Layers
//   SlabProvider   hands out large slabs, each with exactly one MR. It knows
//                  nothing about buffers. VerbsSlabProvider is the real one
//                  (mmap, 2 MiB hugepages when possible, NUMA placement,
//                  Device::RegisterMemory); HeapSlabProvider is plain memory
//                  for unit tests and for backends that need no registration.
//   BufferPool     cuts slabs into buffers of one class each, keeps a central
//                  free list per class behind a mutex, and puts per-thread
//                  caches in front of it.
//   Buffer         move-only handle; gives the buffer back when it dies.
//
// Lifetimes: Device > SlabProvider > BufferPool > every Buffer it handed out.
// Destroying a pool while buffers are outstanding is a caller bug: debug builds
// assert; release builds log it and deliberately leak the slabs (memory, MRs,
// provider) so that outstanding handles and any DMA still in flight keep
// pointing at valid memory. The late handles' destructors then do nothing.
//
// Per-thread caches: the safety rule
//   * A thread has a fixed table of 8 entries (kThreadCacheSlots); each caches
//     free buffers of one pool. An entry is keyed by the address of the pool's
//     shared core and holds a shared_ptr to that core. While the entry exists
//     the core cannot be freed, so no later pool can get the same address: a
//     key match is always the same pool, never a stale hit on a dead one.
//   * Only the owning thread touches an entry. Buffers move between an entry
//     and the core under the core's mutex, and only while the core is alive.
//   * ~BufferPool marks the core dead under that mutex before freeing slabs,
//     so no hand-back can race with the free. It drops the calling thread's
//     entry at once; other threads drop theirs without touching the cached
//     buffers (their memory is gone) when they next need a table slot or exit.
//   * At thread exit every entry of a live pool is handed back, so a finished
//     thread strands nothing. A thread that uses more pools than table slots
//     hands one entry back (round robin) to make room.
//   * The price: up to thread_cache_buffers per class per thread sit parked in
//     other threads' caches, and the cap (max_registered_bytes) counts them.
// Pools are identified by their core, not by a process-wide registry, so
// several pools (per device, per NUMA node, eager vs rendezvous) coexist.
// The steady path is one TLS load, a scan of at most 8 pointers, an array
// pop or push, and one relaxed atomic add on a per-class counter (in_use).
//
// Free lists hold {addr, lkey, rkey} records outside the buffers, never links
// inside them: with REMOTE_WRITE a peer holding a stale rkey could otherwise
// corrupt the list by writing into a freed buffer. Buffers are not cleared on
// reuse; they hold whatever the previous holder left.
//
// Threading: Acquire, Buffer destruction and Stats may run on any thread
// concurrently. Create and destruction must not overlap any other use of the
// same pool. Growing a class (a slab registration) happens under the pool's
// mutex, so it briefly stalls other threads' refills: preallocate (see
// BufferPoolOptions::preallocate_slabs) to keep registration off the hot path.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/access.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

// A contiguous region registered as one MR. One MR per slab rather than per
// buffer keeps the NIC's translation and key tables small and registration
// (a syscall that pins pages) off the per-buffer path.
struct Slab {
  void* base = nullptr;
  size_t bytes = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  // The MR itself (VerbsSlabProvider); null for unregistered memory. A type-2
  // memory window is bound over part of a slab through its MR.
  ibv_mr* region = nullptr;
  // Placement facts, for BufferPoolStats: whether 2 MiB hugetlb pages back
  // the slab, and the NUMA node its memory policy prefers (-1: none).
  bool huge_pages = false;
  int numa_node = -1;
};

// Where a pool's memory comes from. The pool calls a provider only under its
// own mutex, so providers need not be thread-safe. A provider's error status
// reaches the caller of BufferPool::Create / Acquire unchanged.
class SlabProvider {
 public:
  virtual ~SlabProvider() = default;
  // At least `bytes` bytes, 64-byte aligned, usable with verbs `access` flags.
  virtual absl::StatusOr<Slab> Allocate(size_t bytes, int access) = 0;
  // Returns a slab from Allocate. Failures are logged, never thrown.
  virtual void Free(const Slab& slab) noexcept = 0;
  // Drops the slab's registration and keeps its memory (Free still unmaps
  // it): the device is going away (BufferPool::Deregister). No-op for
  // unregistered memory.
  virtual void Deregister(const Slab& /*slab*/) noexcept {}
  // The node slabs are placed on; -1 when there is no placement.
  virtual int numa_node() const { return -1; }
  // The protection domain slabs are registered in (an ibv_pd*), so a user of
  // a Buffer can check it belongs to the PD it will post with; null when the
  // memory is registered nowhere.
  virtual const void* protection_domain() const { return nullptr; }
};

// Page-aligned heap memory with made-up keys: each slab's lkey == rkey == its
// ordinal (1, 2, ...), distinct and non-zero but valid on no device. Used by
// the pool's unit tests and by backends that need no registration (TCP).
class HeapSlabProvider final : public SlabProvider {
 public:
  absl::StatusOr<Slab> Allocate(size_t bytes, int access) override;
  void Free(const Slab& slab) noexcept override;

 private:
  uint32_t next_key_ = 0;
};

struct VerbsSlabOptions {
  // NUMA node to place slabs on. nullopt: the device's node from sysfs
  // (Device::numa_node(); -1 on Soft-RoCE). -1: no placement. Set it when
  // sysfs is wrong, e.g. a NIC passed through to a VM reports -1.
  std::optional<int> numa_node;
  // Try 2 MiB hugetlb pages for slabs whose size is a multiple of 2 MiB.
  bool try_huge_pages = true;
};

// The real provider. Each slab is an anonymous mmap: first with 2 MiB hugetlb
// pages (one TLB/IOMMU entry per 2 MiB, and fewer pages for the NIC to
// translate) when the slab size allows, else normal pages -- hugetlb pages
// exist only if the admin reserved them (vm.nr_hugepages), so falling back is
// the common case and is logged once per provider, not treated as an error.
// Memory is given a MPOL_PREFERRED policy for the node before any page is
// touched (registration faults the pages in), then registered with
// Device::RegisterMemory, whose error names RLIMIT_MEMLOCK and the fix.
// PREFERRED rather than BIND: a full node should cost remote-memory speed,
// not a failed registration (or a SIGBUS on a hugetlb fault).
class VerbsSlabProvider final : public SlabProvider {
 public:
  // `device` must outlive the provider and must not be moved while it lives.
  explicit VerbsSlabProvider(const Device& device, VerbsSlabOptions options = {});
  ~VerbsSlabProvider() override;
  VerbsSlabProvider(const VerbsSlabProvider&) = delete;
  VerbsSlabProvider& operator=(const VerbsSlabProvider&) = delete;

  absl::StatusOr<Slab> Allocate(size_t bytes, int access) override;
  void Free(const Slab& slab) noexcept override;
  void Deregister(const Slab& slab) noexcept override;
  int numa_node() const override { return numa_node_; }
  const void* protection_domain() const override;

 private:
  struct Mapping {
    size_t mapped_bytes = 0;  // What munmap needs (rounded up to the page size).
    MrPtr mr;
  };
  void Unmap(void* base, Mapping& mapping) noexcept;

  const Device* device_;
  VerbsSlabOptions options_;
  int numa_node_;
  bool logged_hugepage_fallback_ = false;
  std::map<void*, Mapping> mappings_;  // By slab base; only touched on grow/free.
};

struct BufferPoolOptions {
  // Buffer sizes, strictly increasing, each a multiple of 64 (a cache line, so
  // buffers handed to different threads never share one). Defaults:
  //   256 B  control messages and small RPCs (headers, credits, HELLO);
  //   4 KiB  one page, and one RoCE MTU: a one-packet message;
  //   64 KiB the eager-send ceiling; larger payloads go by rendezvous;
  //   1 MiB  rendezvous chunks.
  // 16x steps keep the number of slabs (and MRs, and locked memory held idle
  // per class) small at the cost of up to 16x internal waste for sizes just
  // past a class; set your own classes when your sizes are known.
  std::vector<size_t> class_bytes = {256, 4 << 10, 64 << 10, 1 << 20};
  // Slab size per class: max(slab_bytes, class * min_buffers_per_slab),
  // rounded up to a multiple of 2 MiB once it is at least 2 MiB (so it can be
  // hugepage-backed). 2 MiB is one hugepage; 8 buffers per slab amortise one
  // registration over several buffers even for the 1 MiB class (8 MiB slabs).
  size_t slab_bytes = 2 << 20;
  size_t min_buffers_per_slab = 8;
  // Cap on registered (pinned) bytes over all classes; beyond it Acquire
  // returns RESOURCE_EXHAUSTED. Pinned memory can be neither swapped nor
  // reclaimed, so a bound is needed; 256 MiB leaves room for several slabs
  // of every default class (dozens of 1 MiB rendezvous transfers in flight
  // plus thousands of eager buffers) while one pool cannot pin the host.
  size_t max_registered_bytes = 256 << 20;
  // Verbs access flags for every slab's MR. Local write only by default: a
  // peer can never write into these buffers. The rendezvous pool passes
  // access::kRendezvousReceive. Remote read/atomic only
  // when asked for. Remote write/atomic require local write (a verbs rule).
  int access = ::rdmarpc::rdma::access::kLocalOnly;
  // Per-thread cache per class: min(thread_cache_buffers,
  // thread_cache_bytes / class size) buffers, refilled and drained half at a
  // time. 32 covers a send window's burst and amortises one mutex acquisition
  // over 16 operations; 4 MiB bounds memory parked per thread per class (only
  // 4 buffers of 1 MiB). A class whose cache is 0 always uses the mutex.
  size_t thread_cache_buffers = 32;
  size_t thread_cache_bytes = 4 << 20;
  // Slabs to register per class at Create, so the hot path never registers.
  // 0: every class grows lazily on first use.
  size_t preallocate_slabs = 0;
};

// A snapshot. Counts are exact when the pool is quiescent; under concurrent
// use, in_use and cached_in_threads are approximate.
struct BufferPoolStats {
  struct Class {
    size_t buffer_bytes = 0;
    size_t slab_bytes = 0;
    size_t slabs = 0;
    size_t buffers = 0;             // Total carved from slabs.
    size_t in_use = 0;              // Held by live Buffer handles.
    size_t free_central = 0;        // On the central free list.
    size_t cached_in_threads = 0;   // buffers - in_use - free_central.
    // Times Acquire/Release took the pool's mutex for this class (a batch
    // refill or drain of a thread cache, a growth, or an uncached call): how
    // often the slow path ran. Flat in steady state.
    uint64_t mutex_acquisitions = 0;
  };
  size_t registered_bytes = 0;
  size_t max_registered_bytes = 0;
  size_t slabs = 0;
  size_t hugepage_slabs = 0;
  size_t numa_bound_slabs = 0;
  int numa_node = -1;  // The provider's target node; -1: none.
  std::vector<Class> classes;
};

namespace detail {
struct PoolCore;
struct CacheEntry;
struct FreeBuffer {
  std::byte* addr;
  uint32_t lkey;
  uint32_t rkey;
  ibv_mr* region;
};
void ReleaseBuffer(PoolCore* core, uint32_t class_index, FreeBuffer buffer) noexcept;
}  // namespace detail

// One buffer of a pool. Move-only; the moved-from handle is empty. Gives the
// buffer back to its pool on destruction or Reset(), from any thread.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  // The requested size() bytes; capacity() bytes are usable.
  std::span<std::byte> data() const { return {data_, size_}; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  // For ibv_sge / remote addressing: the MR keys of the buffer's slab.
  uint32_t lkey() const { return lkey_; }
  uint32_t rkey() const { return rkey_; }
  uint64_t addr() const { return reinterpret_cast<uintptr_t>(data_); }
  // The MR of the buffer's slab (to bind a memory window over the buffer);
  // null when the pool's memory is registered nowhere.
  ibv_mr* memory_region() const { return region_; }
  explicit operator bool() const { return core_ != nullptr; }
  // The ibv_pd* the buffer's slab is registered in (SlabProvider::
  // protection_domain()); null for an empty handle or unregistered memory.
  const void* protection_domain() const;

  // Gives the buffer back now; the handle becomes empty.
  void Reset() noexcept {
    if (core_ != nullptr) {
      detail::ReleaseBuffer(core_, class_index_, {data_, lkey_, rkey_, region_});
      core_ = nullptr;
    }
  }

 private:
  friend class BufferPool;
  Buffer(detail::PoolCore* core, uint32_t class_index, detail::FreeBuffer buffer, size_t size,
         size_t capacity)
      : core_(core), data_(buffer.addr), size_(size), capacity_(capacity), lkey_(buffer.lkey),
        rkey_(buffer.rkey), region_(buffer.region), class_index_(class_index) {}

  detail::PoolCore* core_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  uint32_t lkey_ = 0;
  uint32_t rkey_ = 0;
  ibv_mr* region_ = nullptr;
  uint32_t class_index_ = 0;
};

class BufferPool {
 public:
  // Validates `options` (INVALID_ARGUMENT names the option) and registers
  // options.preallocate_slabs slabs per class; a registration failure is
  // returned unchanged (for verbs: with the RLIMIT_MEMLOCK advice).
  static absl::StatusOr<std::unique_ptr<BufferPool>> Create(
      std::unique_ptr<SlabProvider> provider, BufferPoolOptions options);
  // A pool on a VerbsSlabProvider for `device` (placed on its NUMA node).
  // `device` must outlive the pool and must not be moved while it lives.
  static absl::StatusOr<std::unique_ptr<BufferPool>> CreateForDevice(const Device& device,
                                                                     BufferPoolOptions options);

  // See the header comment: no buffers may be outstanding.
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of the smallest class >= `size` (0 gets the smallest class).
  // INVALID_ARGUMENT when `size` exceeds the largest class; RESOURCE_EXHAUSTED
  // when growing would pass max_registered_bytes, or the provider's error
  // when a slab cannot be had. Any thread.
  absl::StatusOr<Buffer> Acquire(size_t size);

  BufferPoolStats Stats() const;
  const BufferPoolOptions& options() const { return options_; }

  // The device is being removed (RDMA_CM_EVENT_DEVICE_REMOVAL): deregisters
  // every slab now and keeps the memory, so buffers still held stay readable
  // and writable until they come back, while the kernel, which waits for
  // every registration on the device to go before `rdma link delete` can
  // finish, is not kept waiting for the application. Afterwards the pool hands
  // out only buffers it already has (their keys are dead: post nothing with
  // them) and grows no more (FAILED_PRECONDITION). Idempotent. Must not
  // overlap a growth; call it where the pool's owner would destroy it.
  void Deregister();

 private:
  BufferPool(std::unique_ptr<SlabProvider> provider, BufferPoolOptions options,
             std::shared_ptr<detail::PoolCore> core);
  // Registers one more slab for `class_index`. Caller holds core_->mu.
  absl::Status GrowLocked(uint32_t class_index);
  // Moves up to a batch from the central list into this thread's cache entry,
  // growing when the central list is empty.
  absl::Status Refill(detail::CacheEntry& entry, uint32_t class_index);

  std::unique_ptr<SlabProvider> provider_;
  BufferPoolOptions options_;
  std::shared_ptr<detail::PoolCore> core_;
};

}  // namespace rdmarpc::rdma
