// BufferPool on a real device (Soft-RoCE in the VM): slabs registered through
// VerbsSlabProvider, keys a peer and the local NIC accept, what the access
// flags let a peer do, hugepage and NUMA placement, and the RLIMIT_MEMLOCK
// failure as the user sees it.
#include "transport/rdma/buffer_pool.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <numaif.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "tests/support/rdma_env.h"
#include "transport/rdma/rc_link.h"

namespace rdmarpc::rdma {
namespace {

namespace asio = boost::asio;

constexpr size_t kMiB = size_t{1} << 20;

long FreeHugePages() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  long value = 0;
  while (in >> key >> value) {
    if (key == "HugePages_Free:") return value;
    in.ignore(256, '\n');
  }
  return 0;
}

// Connects two RC QPs on `dev` through rdma_cm and posts one RDMA `op` from
// the client: `local` is the source (WRITE) or destination (READ), `remote`
// the peer-side buffer named by its address and rkey. Returns the completion
// status of that work request, mapped by WcStatusToStatus.
absl::Status OneSidedOp(const Device& dev, ibv_wr_opcode op, Buffer& local, const Buffer& remote) {
  constexpr uint64_t kWrId = uint64_t{1} << 40;  // Clear of RcLink's slot ids.
  asio::io_context io;
  auto listener = CmListener::Listen(io.get_executor(), testing::TestIp(), 0, {});
  if (!listener.ok()) return listener.status();
  std::unique_ptr<RcLink> server;
  absl::Status server_status = absl::UnknownError("server did not accept");
  absl::Status result = absl::UnknownError("client did not finish");

  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    auto link = co_await RcLink::Accept(**listener, dev, {});
    server_status = link.status();
    if (link.ok()) server = *std::move(link);
  }, asio::detached);

  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    auto link = co_await RcLink::Connect(io.get_executor(), dev, testing::TestIp(),
                                         (*listener)->port(), {});
    if (!link.ok()) { result = link.status(); co_return; }
    ibv_sge sge{.addr = local.addr(), .length = static_cast<uint32_t>(local.size()),
                .lkey = local.lkey()};
    ibv_send_wr wr{};
    wr.wr_id = kWrId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = remote.addr();
    wr.wr.rdma.rkey = remote.rkey();
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send((*link)->endpoint().qp(), &wr, &bad); rc != 0) {
      result = ErrnoStatus(rc, "ibv_post_send");
      co_return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    ibv_wc wc{};
    while (std::chrono::steady_clock::now() < deadline) {
      if ((*link)->Poll({&wc, 1}) == 1 && wc.wr_id == kWrId) {
        result = WcStatusToStatus(wc.status, wc.vendor_err, "one-sided op");
        break;
      }
      co_await asio::post(co_await asio::this_coro::executor, asio::use_awaitable);
    }
    if (result.code() == absl::StatusCode::kUnknown)
      result = absl::DeadlineExceededError("no completion within 30 s");
    // Let the accept side finish so nothing is left suspended when io stops.
    while (server == nullptr && server_status.code() == absl::StatusCode::kUnknown)
      co_await asio::post(co_await asio::this_coro::executor, asio::use_awaitable);
  }, asio::detached);

  io.run_for(std::chrono::seconds(60));
  if (!server_status.ok()) return server_status;
  return result;
}

TEST(BufferPoolRdma, PreallocatedPoolRegistersEverySlabWithKeysTheNicAccepts) {
  auto opened = Device::Open({.name = testing::TestDevice()});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const Device& dev = *opened;
  BufferPoolOptions eager;
  eager.preallocate_slabs = 1;
  auto pool = BufferPool::CreateForDevice(dev, eager);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto s = (*pool)->Stats();
  // Defaults: 2 MiB slabs for 256 B, 4 KiB, 64 KiB; 8 MiB (8 buffers) for 1 MiB.
  EXPECT_EQ(s.slabs, 4u);
  EXPECT_EQ(s.registered_bytes, 14 * kMiB);
  EXPECT_EQ(s.numa_node, dev.numa_node());
  for (size_t size : {size_t{1}, size_t{4096}, size_t{60000}, kMiB}) {
    auto b = (*pool)->Acquire(size);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NE(b->lkey(), 0u) << size;
  }

  BufferPoolOptions rendezvous;
  rendezvous.class_bytes = {64 << 10};
  rendezvous.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  rendezvous.preallocate_slabs = 1;
  auto rpool = BufferPool::CreateForDevice(dev, rendezvous);
  ASSERT_TRUE(rpool.ok()) << rpool.status();
  auto target = (*rpool)->Acquire(64 << 10);
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_NE(target->lkey(), 0u);
  EXPECT_NE(target->rkey(), 0u);
  EXPECT_EQ((*rpool)->options().access, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);

  // The keys are real: the NIC reads the source through its lkey and a peer
  // writes the target through its rkey, and the bytes land.
  auto source = (*pool)->Acquire(4000);
  ASSERT_TRUE(source.ok()) << source.status();
  for (size_t i = 0; i < source->size(); ++i) source->data()[i] = std::byte(i * 13 + 7);
  std::memset(target->data().data(), 0, target->size());
  ASSERT_TRUE(OneSidedOp(dev, IBV_WR_RDMA_WRITE, *source, *target).ok());
  EXPECT_EQ(std::memcmp(source->data().data(), target->data().data(), source->size()), 0);
}

// ibv_mr does not report its access flags, so observe them the way a peer does.
TEST(BufferPoolRdma, AccessFlagsDecideWhatAPeerMayDo) {
  auto opened = Device::Open({.name = testing::TestDevice()});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const Device& dev = *opened;
  BufferPoolOptions local_only;  // Default access: IBV_ACCESS_LOCAL_WRITE.
  local_only.class_bytes = {4096};
  auto eager = BufferPool::CreateForDevice(dev, local_only);
  ASSERT_TRUE(eager.ok()) << eager.status();
  BufferPoolOptions remote_write = local_only;
  remote_write.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  auto rendezvous = BufferPool::CreateForDevice(dev, remote_write);
  ASSERT_TRUE(rendezvous.ok()) << rendezvous.status();

  BufferPoolOptions remote_read = local_only;
  remote_read.access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  auto readable = BufferPool::CreateForDevice(dev, remote_read);
  ASSERT_TRUE(readable.ok()) << readable.status();

  auto source = (*eager)->Acquire(512);
  auto granted = (*rendezvous)->Acquire(512);
  auto not_granted = (*eager)->Acquire(512);
  auto read_target = (*readable)->Acquire(512);
  ASSERT_TRUE(source.ok() && granted.ok() && not_granted.ok() && read_target.ok());

  // Each failing op puts its QP in error, hence one connection per case. Every
  // refusal has a control showing the same op succeeds where it is granted.
  absl::Status write_granted = OneSidedOp(dev, IBV_WR_RDMA_WRITE, *source, *granted);
  EXPECT_TRUE(write_granted.ok()) << write_granted;
  absl::Status write_local_only = OneSidedOp(dev, IBV_WR_RDMA_WRITE, *source, *not_granted);
  EXPECT_EQ(write_local_only.code(), absl::StatusCode::kPermissionDenied) << write_local_only;
  absl::Status read_readable = OneSidedOp(dev, IBV_WR_RDMA_READ, *source, *read_target);
  EXPECT_TRUE(read_readable.ok()) << read_readable;
  // REMOTE_READ was not asked for, so the rendezvous pool must not grant it.
  absl::Status read_write_only = OneSidedOp(dev, IBV_WR_RDMA_READ, *source, *granted);
  EXPECT_EQ(read_write_only.code(), absl::StatusCode::kPermissionDenied) << read_write_only;
}

TEST(BufferPoolRdma, HugePagesBackTwoMiBSlabsWhenReservedAndPoolsStillWorkWithout) {
  auto opened = Device::Open({.name = testing::TestDevice()});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const Device& dev = *opened;
  const long free_huge = FreeHugePages();
  BufferPoolOptions o;
  o.class_bytes = {64 << 10};
  o.min_buffers_per_slab = 1;
  o.preallocate_slabs = 1;
  auto two_mib = BufferPool::CreateForDevice(dev, o);  // 2 MiB slab: eligible.
  ASSERT_TRUE(two_mib.ok()) << two_mib.status();
  EXPECT_EQ((*two_mib)->Stats().hugepage_slabs, free_huge >= 1 ? 1u : 0u)
      << free_huge << " free hugepages";
  o.slab_bytes = 1 * kMiB;  // Not a multiple of 2 MiB: never hugepages.
  auto one_mib = BufferPool::CreateForDevice(dev, o);
  ASSERT_TRUE(one_mib.ok()) << one_mib.status();
  EXPECT_EQ((*one_mib)->Stats().hugepage_slabs, 0u);
  EXPECT_EQ((*one_mib)->Stats().slabs, 1u);
  std::printf("HugePages_Free before: %ld; 2 MiB slab hugepage-backed: %zu\n", free_huge,
              (*two_mib)->Stats().hugepage_slabs);
}

TEST(BufferPoolRdma, SlabsGetAPreferredPolicyForTheNodeAndNoneWhenTheDeviceHasNoNode) {
  auto opened = Device::Open({.name = testing::TestDevice()});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const Device& dev = *opened;
  BufferPoolOptions o;
  o.class_bytes = {4096};
  o.preallocate_slabs = 1;
  auto policy_of = [](const Buffer& b, int* mode, unsigned long* mask) {
    return get_mempolicy(mode, mask, sizeof(*mask) * 8, reinterpret_cast<void*>(b.addr()),
                         MPOL_F_ADDR);
  };

  auto device_node = BufferPool::CreateForDevice(dev, o);
  ASSERT_TRUE(device_node.ok()) << device_node.status();
  EXPECT_EQ((*device_node)->Stats().numa_node, dev.numa_node());
  auto b = (*device_node)->Acquire(1);
  ASSERT_TRUE(b.ok()) << b.status();
  int mode = -1;
  unsigned long mask = 0;
  if (policy_of(*b, &mode, &mask) != 0) GTEST_SKIP() << "get_mempolicy: " << std::strerror(errno);
  if (dev.numa_node() < 0) {
    EXPECT_EQ((*device_node)->Stats().numa_bound_slabs, 0u);
    EXPECT_EQ(mode, MPOL_DEFAULT);
  }

  auto node0 = BufferPool::Create(
      std::make_unique<VerbsSlabProvider>(dev, VerbsSlabOptions{.numa_node = 0}), o);
  ASSERT_TRUE(node0.ok()) << node0.status();
  EXPECT_EQ((*node0)->Stats().numa_node, 0);
  EXPECT_EQ((*node0)->Stats().numa_bound_slabs, 1u);
  auto c = (*node0)->Acquire(1);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(policy_of(*c, &mode, &mask), 0) << std::strerror(errno);
  EXPECT_EQ(mode, MPOL_PREFERRED);
  EXPECT_EQ(mask, 1ul);
}

// Runs in a child process that gtest starts afresh: drops CAP_IPC_LOCK (root
// otherwise ignores RLIMIT_MEMLOCK), lowers the limit to 64 KiB and asks for
// a preallocated pool. Prints the status; exits 0 only for RESOURCE_EXHAUSTED.
void CreatePoolUnderA64KiBMemlockLimit() {
  __user_cap_header_struct header{.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
  __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3]{};
  if (syscall(SYS_capget, &header, caps) != 0) {
    std::fprintf(stderr, "capget: %s\n", std::strerror(errno));
    _exit(10);
  }
  const uint32_t bit = 1u << (CAP_IPC_LOCK % 32);
  auto& word = caps[CAP_IPC_LOCK / 32];
  word.effective &= ~bit;
  word.permitted &= ~bit;
  word.inheritable &= ~bit;
  if (syscall(SYS_capset, &header, caps) != 0) {
    std::fprintf(stderr, "capset: %s\n", std::strerror(errno));
    _exit(11);
  }
  const rlimit limit{.rlim_cur = 64 << 10, .rlim_max = 64 << 10};
  if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0) {
    std::fprintf(stderr, "setrlimit: %s\n", std::strerror(errno));
    _exit(12);
  }
  auto dev = Device::Open({.name = testing::TestDevice()});
  if (!dev.ok()) {
    std::fprintf(stderr, "%s\n", dev.status().ToString().c_str());
    _exit(13);
  }
  BufferPoolOptions o;
  o.class_bytes = {4096};
  o.slab_bytes = 4 * kMiB;
  o.preallocate_slabs = 1;
  auto pool = BufferPool::CreateForDevice(*dev, o);
  if (pool.ok()) {
    std::fprintf(stderr, "pool created despite a 64 KiB memlock limit\n");
    _exit(14);
  }
  std::fprintf(stderr, "%s\n", pool.status().ToString().c_str());
  _exit(pool.status().code() == absl::StatusCode::kResourceExhausted ? 0 : 15);
}

TEST(BufferPoolRdma, MemlockLimitTooLowIsResourceExhaustedWithTheLimitAndTheFix) {
  // "threadsafe" re-executes the binary for the child: a fresh process, with
  // no verbs state inherited across fork.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(CreatePoolUnderA64KiBMemlockLimit(), ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED.*RLIMIT_MEMLOCK is 64 KiB.*ulimit -l");
}

}  // namespace
}  // namespace rdmarpc::rdma
