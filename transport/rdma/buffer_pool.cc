#include "transport/rdma/buffer_pool.h"

#include <numaif.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/common/log.h"

namespace rdmarpc::rdma {
namespace {

// The hugetlb page size we ask for explicitly (MAP_HUGE_2MB), whatever the
// system default is: 2 MiB is the size x86-64 and arm64 (4 KiB granule)
// reserve by default, and the one our default slab size matches.
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr int kMapHuge2Mb = 21 << MAP_HUGE_SHIFT;  // log2(2 MiB) = 21.
// Class sizes are multiples of a cache line so that buffers used by different
// threads never share one (false sharing on the hottest bytes: headers).
constexpr size_t kClassAlign = 64;
// Enough for any size-class scheme that makes sense (16x steps: 4 classes by
// default); bounds the per-entry arrays of a thread cache.
constexpr size_t kMaxClasses = 16;
// Pools one thread caches at once. A thread typically talks to 1-3 pools
// (eager, rendezvous, maybe one per device); 8 leaves room, and a linear scan
// of 8 pointers beats hashing on the fast path.
constexpr size_t kThreadCacheSlots = 8;
// Nodes representable in our mbind mask; the kernel's own ceiling on x86-64
// (CONFIG_NODES_SHIFT=10).
constexpr int kMaxNumaNodes = 1024;
// HeapSlabProvider alignment: a page, so slabs look like mmap memory.
constexpr size_t kHeapSlabAlign = 4096;

std::string HumanBytes(size_t v) {
  if (v >= (size_t{1} << 30) && v % (size_t{1} << 30) == 0) return absl::StrCat(v >> 30, " GiB");
  if (v >= (size_t{1} << 20) && v % (size_t{1} << 20) == 0) return absl::StrCat(v >> 20, " MiB");
  if (v >= (size_t{1} << 10) && v % (size_t{1} << 10) == 0) return absl::StrCat(v >> 10, " KiB");
  return absl::StrCat(v, " bytes");
}

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace

// ---- providers ---------------------------------------------------------------

absl::StatusOr<Slab> HeapSlabProvider::Allocate(size_t bytes, int /*access*/) {
  void* p = std::aligned_alloc(kHeapSlabAlign, RoundUp(std::max<size_t>(bytes, 1), kHeapSlabAlign));
  if (p == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat("heap slab of ", HumanBytes(bytes), ": out of memory"));
  ++next_key_;
  return Slab{.base = p, .bytes = bytes, .lkey = next_key_, .rkey = next_key_};
}

void HeapSlabProvider::Free(const Slab& slab) noexcept { std::free(slab.base); }

VerbsSlabProvider::VerbsSlabProvider(const Device& device, VerbsSlabOptions options)
    : device_(&device),
      options_(options),
      numa_node_(options.numa_node.value_or(device.numa_node())) {}

VerbsSlabProvider::~VerbsSlabProvider() {
  for (auto& [base, mapping] : mappings_) Unmap(base, mapping);
}

void VerbsSlabProvider::Unmap(void* base, Mapping& mapping) noexcept {
  mapping.mr.reset();  // Deregister first: the device must drop the pages before they go.
  if (munmap(base, mapping.mapped_bytes) != 0)
    RDMARPC_LOG(kError, "buffer_pool", "event=munmap_failed bytes=", mapping.mapped_bytes,
                " errno=", errno, " (", std::strerror(errno), ")");
}

absl::StatusOr<Slab> VerbsSlabProvider::Allocate(size_t bytes, int access) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t mapped = RoundUp(std::max<size_t>(bytes, 1), page);
  void* base = MAP_FAILED;
  bool huge = false;
  if (options_.try_huge_pages && bytes % kHugePageBytes == 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | kMapHuge2Mb, -1, 0);
    if (base != MAP_FAILED) {
      huge = true;
      mapped = bytes;
    } else if (!logged_hugepage_fallback_) {
      logged_hugepage_fallback_ = true;
      RDMARPC_LOG(kInfo, "buffer_pool", "event=hugepage_fallback device=", device_->name(),
                  " errno=", errno, " (", std::strerror(errno),
                  ") using 4 KiB pages; reserve 2 MiB pages with `sysctl vm.nr_hugepages=N`");
    }
  }
  if (base == MAP_FAILED) {
    base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
      return ErrnoStatus(errno, absl::StrCat("mmap of a ", HumanBytes(bytes), " buffer-pool slab"));
  }

  // The policy must be in place before registration faults the pages in.
  int placed_on = -1;
  if (numa_node_ >= 0 && numa_node_ < kMaxNumaNodes) {
    constexpr int kBitsPerWord = sizeof(unsigned long) * CHAR_BIT;
    std::array<unsigned long, kMaxNumaNodes / kBitsPerWord> mask{};
    mask[static_cast<size_t>(numa_node_ / kBitsPerWord)] = 1ul << (numa_node_ % kBitsPerWord);
    // maxnode is one more than the bits in the mask: the kernel reads maxnode-1 bits.
    if (mbind(base, mapped, MPOL_PREFERRED, mask.data(), kMaxNumaNodes + 1, 0) == 0) {
      placed_on = numa_node_;
    } else {
      RDMARPC_LOG(kWarn, "buffer_pool", "event=mbind_failed node=", numa_node_, " errno=", errno,
                  " (", std::strerror(errno), ") slab left on the default policy");
    }
  }

  auto mr = device_->RegisterMemory(base, bytes, access);
  if (!mr.ok()) {
    munmap(base, mapped);
    return mr.status();  // Unchanged: it carries the RLIMIT_MEMLOCK advice.
  }
  Slab slab{.base = base, .bytes = bytes, .lkey = (*mr)->lkey, .rkey = (*mr)->rkey, .region = mr->get(),
            .huge_pages = huge, .numa_node = placed_on};
  mappings_.emplace(base, Mapping{mapped, *std::move(mr)});
  return slab;
}

const void* VerbsSlabProvider::protection_domain() const { return device_->pd(); }

void VerbsSlabProvider::Free(const Slab& slab) noexcept {
  auto it = mappings_.find(slab.base);
  if (it == mappings_.end()) {
    RDMARPC_LOG(kError, "buffer_pool", "event=free_unknown_slab bytes=", slab.bytes);
    return;
  }
  Unmap(it->first, it->second);
  mappings_.erase(it);
}

void VerbsSlabProvider::Deregister(const Slab& slab) noexcept {
  if (auto it = mappings_.find(slab.base); it != mappings_.end()) it->second.mr.reset();
}

// ---- shared core and thread caches -----------------------------------------

namespace detail {

struct ClassInfo {
  size_t buffer_bytes = 0;
  size_t slab_bytes = 0;
  uint32_t cache_cap = 0;     // Buffers a thread may park; 0 = no cache.
  uint32_t batch = 0;         // Moved per refill/drain: half the cache.
  uint32_t cache_offset = 0;  // Where this class's slots start in an entry.
};

// Own cache line per counter: threads working on different classes do not
// bounce one line between cores on every Acquire/Release.
struct alignas(64) InUseCounter {
  std::atomic<int64_t> value{0};
};

struct ClassState {
  // LIFO: the most recently released (cache-warm) buffer goes out first.
  // Capacity is reserved for every buffer of the class when a slab is added,
  // so pushes never allocate (they run in noexcept release paths).
  std::vector<FreeBuffer> free;
  size_t slabs = 0;
  size_t buffers = 0;
  uint64_t mutex_acquisitions = 0;
};

// What the pool shares with thread caches and Buffer handles; outlives the
// pool while any cache entry (or, after a bug, any Buffer) refers to it.
struct PoolCore : std::enable_shared_from_this<PoolCore> {
  PoolCore(std::vector<ClassInfo> class_info, uint32_t slots)
      : classes(std::move(class_info)),
        cache_slots(slots),
        in_use(new InUseCounter[classes.size()]),
        state(classes.size()) {}

  const std::vector<ClassInfo> classes;
  const uint32_t cache_slots;  // Sum of cache_cap over classes.
  const void* domain = nullptr;  // The provider's protection_domain(); set once at Create.
  const std::unique_ptr<InUseCounter[]> in_use;

  std::mutex mu;
  // Cleared under mu by ~BufferPool, never set again. Read without mu only
  // where a stale "alive" is harmless: a thread cache looking for a dead entry
  // to reuse (Retire rechecks under mu), and Buffer release, where "dead"
  // means the handle outlived its pool (a bug) and the memory was leaked.
  std::atomic<bool> alive{true};
  std::vector<ClassState> state;  // Guarded by mu.
  std::vector<Slab> slabs;        // Guarded by mu.
  size_t registered_bytes = 0;    // Guarded by mu.
  size_t hugepage_slabs = 0;      // Guarded by mu.
  size_t numa_bound_slabs = 0;    // Guarded by mu.
  bool deregistered = false;      // Guarded by mu. BufferPool::Deregister ran.
};

struct CacheEntry {
  PoolCore* key = nullptr;         // == core.get(); compared on the fast path.
  std::shared_ptr<PoolCore> core;  // Keeps key's address from being reused.
  std::unique_ptr<FreeBuffer[]> slots;
  std::unique_ptr<uint32_t[]> counts;  // Per class.

  void Clear() {
    key = nullptr;
    core.reset();
    slots.reset();
    counts.reset();
  }
};

namespace {

// Moves the oldest `n` cached buffers of `cls` to the central list (the newest
// stay: they are the cache-warm ones). Caller holds core.mu.
void DrainLocked(PoolCore& core, CacheEntry& e, uint32_t cls, uint32_t n) {
  const ClassInfo& ci = core.classes[cls];
  FreeBuffer* slots = &e.slots[ci.cache_offset];
  uint32_t& count = e.counts[cls];
  n = std::min(n, count);
  auto& free = core.state[cls].free;
  free.insert(free.end(), slots, slots + n);
  std::copy(slots + n, slots + count, slots);
  count -= n;
  ++core.state[cls].mutex_acquisitions;
}

// Hands an entry's buffers back if its pool lives, then empties the entry.
void Retire(CacheEntry& e) noexcept {
  if (e.key == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(e.core->mu);
    if (e.core->alive.load(std::memory_order_relaxed)) {
      for (uint32_t c = 0; c < e.core->classes.size(); ++c)
        if (e.counts[c] != 0) DrainLocked(*e.core, e, c, e.counts[c]);
    }
    // A dead pool's buffers are not touched: their memory is gone.
  }
  e.Clear();
}

class ThreadCache;
// Trivially destructible, so reading them needs no TLS init guard: the fast
// path is one TLS load. t_cache_gone stops a Buffer released by a later
// thread_local destructor from resurrecting the cache: it uses the mutex.
thread_local ThreadCache* t_cache = nullptr;
thread_local bool t_cache_gone = false;

class ThreadCache {
 public:
  ThreadCache() = default;
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;
  ~ThreadCache() {
    t_cache = nullptr;
    t_cache_gone = true;
    for (auto& e : entries_) Retire(e);
  }

  CacheEntry* Find(const PoolCore* core) {
    for (auto& e : entries_)
      if (e.key == core) return &e;
    return nullptr;
  }

  // The entry for `core`, made on first use. nullptr when memory for one
  // cannot be had: the caller then goes to the central list.
  CacheEntry* EntryFor(PoolCore& core) {
    if (CacheEntry* e = Find(&core)) [[likely]] return e;
    return Install(core);
  }

 private:
  CacheEntry* Install(PoolCore& core) {
    CacheEntry* slot = nullptr;
    for (auto& e : entries_)
      if (e.key == nullptr) { slot = &e; break; }
    if (slot == nullptr) {
      for (auto& e : entries_) {
        if (!e.core->alive.load(std::memory_order_relaxed)) { e.Clear(); slot = &e; break; }
      }
    }
    if (slot == nullptr) {
      slot = &entries_[next_victim_];
      next_victim_ = (next_victim_ + 1) % kThreadCacheSlots;
      Retire(*slot);
    }
    std::unique_ptr<FreeBuffer[]> slots(new (std::nothrow) FreeBuffer[core.cache_slots]);
    std::unique_ptr<uint32_t[]> counts(new (std::nothrow) uint32_t[core.classes.size()]());
    if (!slots || !counts) return nullptr;
    slot->core = core.shared_from_this();
    slot->key = &core;
    slot->slots = std::move(slots);
    slot->counts = std::move(counts);
    return slot;
  }

  std::array<CacheEntry, kThreadCacheSlots> entries_;
  size_t next_victim_ = 0;
};

ThreadCache* CurrentThreadCache() {
  if (t_cache != nullptr) [[likely]] return t_cache;
  if (t_cache_gone) return nullptr;
  thread_local ThreadCache owner;  // Its destructor hands everything back at thread exit.
  t_cache = &owner;
  return t_cache;
}

}  // namespace

void ReleaseBuffer(PoolCore* core, uint32_t cls, FreeBuffer buffer) noexcept {
  // A pool destroyed with this buffer outstanding leaked the memory on
  // purpose (and logged it); there is nothing to give back to.
  if (!core->alive.load(std::memory_order_relaxed)) [[unlikely]] return;
  core->in_use[cls].value.fetch_sub(1, std::memory_order_relaxed);
  const ClassInfo& ci = core->classes[cls];
  ThreadCache* tc = ci.cache_cap != 0 ? CurrentThreadCache() : nullptr;
  if (CacheEntry* e = tc != nullptr ? tc->EntryFor(*core) : nullptr) {
    uint32_t& count = e->counts[cls];
    if (count == ci.cache_cap) [[unlikely]] {
      std::lock_guard<std::mutex> lock(core->mu);
      DrainLocked(*core, *e, cls, ci.batch);
    }
    e->slots[ci.cache_offset + count++] = buffer;
    return;
  }
  std::lock_guard<std::mutex> lock(core->mu);
  core->state[cls].free.push_back(buffer);
  ++core->state[cls].mutex_acquisitions;
}

}  // namespace detail

// ---- Buffer ------------------------------------------------------------------

Buffer::Buffer(Buffer&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)),
      data_(other.data_),
      size_(other.size_),
      capacity_(other.capacity_),
      lkey_(other.lkey_),
      rkey_(other.rkey_),
      region_(other.region_),
      class_index_(other.class_index_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    core_ = std::exchange(other.core_, nullptr);
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    lkey_ = other.lkey_;
    rkey_ = other.rkey_;
    region_ = other.region_;
    class_index_ = other.class_index_;
  }
  return *this;
}

// ---- BufferPool --------------------------------------------------------------

namespace {

absl::Status ValidateOptions(const BufferPoolOptions& o) {
  if (o.class_bytes.empty())
    return absl::InvalidArgumentError("BufferPoolOptions::class_bytes is empty");
  if (o.class_bytes.size() > kMaxClasses)
    return absl::InvalidArgumentError(absl::StrCat("BufferPoolOptions::class_bytes has ",
                                                   o.class_bytes.size(), " classes; at most ",
                                                   kMaxClasses));
  for (size_t i = 0; i < o.class_bytes.size(); ++i) {
    const size_t c = o.class_bytes[i];
    if (c == 0 || c % kClassAlign != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          "BufferPoolOptions::class_bytes[", i, "] = ", c, " is not a positive multiple of ",
          kClassAlign, " (a cache line)"));
    if (i > 0 && c <= o.class_bytes[i - 1])
      return absl::InvalidArgumentError("BufferPoolOptions::class_bytes must be strictly increasing");
  }
  if (o.slab_bytes == 0) return absl::InvalidArgumentError("BufferPoolOptions::slab_bytes is 0");
  if ((o.access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
      (o.access & IBV_ACCESS_LOCAL_WRITE) == 0)
    return absl::InvalidArgumentError(
        "BufferPoolOptions::access: REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<BufferPool>> BufferPool::Create(
    std::unique_ptr<SlabProvider> provider, BufferPoolOptions options) {
  if (provider == nullptr) return absl::InvalidArgumentError("BufferPool::Create: null provider");
  if (auto st = ValidateOptions(options); !st.ok()) return st;

  std::vector<detail::ClassInfo> classes;
  uint32_t cache_slots = 0;
  for (size_t bytes : options.class_bytes) {
    detail::ClassInfo ci;
    ci.buffer_bytes = bytes;
    ci.slab_bytes = std::max(options.slab_bytes, bytes * std::max<size_t>(options.min_buffers_per_slab, 1));
    if (ci.slab_bytes >= kHugePageBytes) ci.slab_bytes = RoundUp(ci.slab_bytes, kHugePageBytes);
    if (ci.slab_bytes > options.max_registered_bytes)
      return absl::InvalidArgumentError(absl::StrCat(
          "BufferPoolOptions::max_registered_bytes (", HumanBytes(options.max_registered_bytes),
          ") is below one slab of the ", HumanBytes(bytes), " class (", HumanBytes(ci.slab_bytes),
          "): that class could never be served"));
    const size_t cap = std::min(options.thread_cache_buffers, options.thread_cache_bytes / bytes);
    ci.cache_cap = static_cast<uint32_t>(std::min<size_t>(cap, ci.slab_bytes / bytes));
    ci.batch = std::max<uint32_t>(1, ci.cache_cap / 2);
    ci.cache_offset = cache_slots;
    cache_slots += ci.cache_cap;
    classes.push_back(ci);
  }

  auto core = std::make_shared<detail::PoolCore>(std::move(classes), cache_slots);
  core->domain = provider->protection_domain();
  std::unique_ptr<BufferPool> pool(new BufferPool(std::move(provider), std::move(options), core));
  std::lock_guard<std::mutex> lock(core->mu);
  for (uint32_t c = 0; c < core->classes.size(); ++c) {
    for (size_t i = 0; i < pool->options_.preallocate_slabs; ++i) {
      if (auto st = pool->GrowLocked(c); !st.ok()) return st;
    }
  }
  return pool;
}

const void* Buffer::protection_domain() const { return core_ != nullptr ? core_->domain : nullptr; }

absl::StatusOr<std::unique_ptr<BufferPool>> BufferPool::CreateForDevice(const Device& device,
                                                                        BufferPoolOptions options) {
  return Create(std::make_unique<VerbsSlabProvider>(device), std::move(options));
}

BufferPool::BufferPool(std::unique_ptr<SlabProvider> provider, BufferPoolOptions options,
                       std::shared_ptr<detail::PoolCore> core)
    : provider_(std::move(provider)), options_(std::move(options)), core_(std::move(core)) {}

BufferPool::~BufferPool() {
  int64_t outstanding = 0;
  for (size_t c = 0; c < core_->classes.size(); ++c)
    outstanding += core_->in_use[c].value.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->alive.store(false, std::memory_order_relaxed);
    if (outstanding == 0) {
      for (const Slab& slab : core_->slabs) provider_->Free(slab);
    }
    core_->slabs.clear();
    for (auto& s : core_->state) s.free = {};
  }
  // This thread's entry goes now; other threads drop theirs lazily.
  if (detail::t_cache != nullptr) {
    if (detail::CacheEntry* e = detail::t_cache->Find(core_.get())) e->Clear();
  }
  if (outstanding != 0) {
    RDMARPC_LOG(kError, "buffer_pool", "event=destroyed_with_outstanding_buffers outstanding=",
                outstanding, " leaking registered_bytes=", core_->registered_bytes,
                " (the pool must outlive its buffers)");
    // Keep the memory, MRs and core valid for the handles still out there.
    static_cast<void>(provider_.release());
    static_cast<void>(new std::shared_ptr<detail::PoolCore>(core_));
    assert(outstanding == 0 && "BufferPool destroyed while buffers are outstanding");
  }
}

void BufferPool::Deregister() {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (core_->deregistered) return;
  core_->deregistered = true;
  for (const Slab& slab : core_->slabs) provider_->Deregister(slab);
}

absl::Status BufferPool::GrowLocked(uint32_t cls) {
  detail::PoolCore& core = *core_;
  const detail::ClassInfo& ci = core.classes[cls];
  if (core.deregistered)
    return absl::FailedPreconditionError(
        "buffer pool: its RDMA device was removed (the pool's memory is deregistered); make a new "
        "pool once the device is back");
  if (core.registered_bytes + ci.slab_bytes > options_.max_registered_bytes) {
    const auto& st = core.state[cls];
    return absl::ResourceExhaustedError(absl::StrCat(
        "buffer pool: another ", HumanBytes(ci.slab_bytes), " slab for the ",
        HumanBytes(ci.buffer_bytes), " class would pass the cap of ",
        HumanBytes(options_.max_registered_bytes),
        " registered memory (BufferPoolOptions::max_registered_bytes); ",
        HumanBytes(core.registered_bytes), " registered, ",
        core.in_use[cls].value.load(std::memory_order_relaxed), " of ", st.buffers,
        " buffers of this class in use. Release buffers or raise max_registered_bytes "
        "(and RLIMIT_MEMLOCK with it)."));
  }
  const size_t n = ci.slab_bytes / ci.buffer_bytes;
  auto& state = core.state[cls];
  // Reserve before allocating, so a failed reserve leaks nothing, and so that
  // later pushes (in noexcept paths) never reallocate.
  state.free.reserve(state.buffers + n);
  core.slabs.reserve(core.slabs.size() + 1);

  absl::StatusOr<Slab> slab = provider_->Allocate(ci.slab_bytes, options_.access);
  if (!slab.ok()) return slab.status();  // Unchanged: it says why (memlock, mmap...).
  if (slab->bytes < ci.slab_bytes) {
    provider_->Free(*slab);
    return absl::InternalError(absl::StrCat("slab provider returned ", slab->bytes,
                                            " bytes for a request of ", ci.slab_bytes));
  }
  core.slabs.push_back(*slab);
  core.registered_bytes += slab->bytes;
  core.hugepage_slabs += slab->huge_pages ? 1 : 0;
  core.numa_bound_slabs += slab->numa_node >= 0 ? 1 : 0;
  auto* base = static_cast<std::byte*>(slab->base);
  // Pushed backwards so that the lowest address is handed out first.
  for (size_t i = n; i-- > 0;)
    state.free.push_back({base + i * ci.buffer_bytes, slab->lkey, slab->rkey, slab->region});
  ++state.slabs;
  state.buffers += n;
  return absl::OkStatus();
}

absl::Status BufferPool::Refill(detail::CacheEntry& e, uint32_t cls) {
  detail::PoolCore& core = *core_;
  const detail::ClassInfo& ci = core.classes[cls];
  std::lock_guard<std::mutex> lock(core.mu);
  auto& free = core.state[cls].free;
  if (free.empty()) {
    if (auto st = GrowLocked(cls); !st.ok()) return st;
  }
  const uint32_t n = static_cast<uint32_t>(std::min<size_t>(ci.batch, free.size()));
  detail::FreeBuffer* slots = &e.slots[ci.cache_offset];
  uint32_t& count = e.counts[cls];
  std::copy(free.end() - n, free.end(), slots + count);
  free.resize(free.size() - n);
  count += n;
  ++core.state[cls].mutex_acquisitions;
  return absl::OkStatus();
}

absl::StatusOr<Buffer> BufferPool::Acquire(size_t size) {
  detail::PoolCore& core = *core_;
  uint32_t cls = 0;
  while (cls < core.classes.size() && core.classes[cls].buffer_bytes < size) ++cls;
  if (cls == core.classes.size())
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer pool: ", size, " bytes requested, more than the largest class (",
        HumanBytes(core.classes.back().buffer_bytes), "; BufferPoolOptions::class_bytes)"));
  const detail::ClassInfo& ci = core.classes[cls];

  detail::FreeBuffer buffer;
  detail::ThreadCache* tc = ci.cache_cap != 0 ? detail::CurrentThreadCache() : nullptr;
  if (detail::CacheEntry* e = tc != nullptr ? tc->EntryFor(core) : nullptr) {
    if (e->counts[cls] == 0) [[unlikely]] {
      if (auto st = Refill(*e, cls); !st.ok()) return st;
    }
    buffer = e->slots[ci.cache_offset + --e->counts[cls]];
  } else {
    std::lock_guard<std::mutex> lock(core.mu);
    auto& free = core.state[cls].free;
    if (free.empty()) {
      if (auto st = GrowLocked(cls); !st.ok()) return st;
    }
    buffer = free.back();
    free.pop_back();
    ++core.state[cls].mutex_acquisitions;
  }
  core.in_use[cls].value.fetch_add(1, std::memory_order_relaxed);
  return Buffer(&core, cls, buffer, size, ci.buffer_bytes);
}

BufferPoolStats BufferPool::Stats() const {
  detail::PoolCore& core = *core_;
  BufferPoolStats s;
  s.max_registered_bytes = options_.max_registered_bytes;
  s.numa_node = provider_->numa_node();
  std::lock_guard<std::mutex> lock(core.mu);
  s.registered_bytes = core.registered_bytes;
  s.slabs = core.slabs.size();
  s.hugepage_slabs = core.hugepage_slabs;
  s.numa_bound_slabs = core.numa_bound_slabs;
  for (size_t c = 0; c < core.classes.size(); ++c) {
    const auto& st = core.state[c];
    BufferPoolStats::Class k;
    k.buffer_bytes = core.classes[c].buffer_bytes;
    k.slab_bytes = core.classes[c].slab_bytes;
    k.slabs = st.slabs;
    k.buffers = st.buffers;
    k.in_use = static_cast<size_t>(std::max<int64_t>(0, core.in_use[c].value.load(std::memory_order_relaxed)));
    k.free_central = st.free.size();
    k.cached_in_threads = k.buffers - std::min(k.buffers, k.in_use + k.free_central);
    k.mutex_acquisitions = st.mutex_acquisitions;
    s.classes.push_back(k);
  }
  return s;
}

}  // namespace rdmarpc::rdma
