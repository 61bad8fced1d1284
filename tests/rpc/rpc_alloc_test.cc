// Zero heap allocations per call on the steady path: 10,000 unary echoes
// through the generated stub and service, client and server in this process,
// with every malloc/new counted (bench/alloc_hooks.cc replaces malloc). Any
// allocation after the warm-up fails the test and prints where it came from.
//
// Allocation counts do not depend on timing, so this is a unit test. Not built
// under the sanitizers (they own malloc).
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "bench/alloc_hooks.h"
#include "rdmarpc/test/rpc_test.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/support/rdma_env.h"
#include "transport/handler_memory.h"

namespace rdmarpc::testing {
namespace {

namespace asio = boost::asio;
using rdmarpc::test::Payload;

class EchoOnly final : public rdmarpc::test::Test::Service {
 public:
  explicit EchoOnly(bool inline_handler) : inline_(inline_handler) {}
  asio::awaitable<Status> Echo(ServerContext&, const Payload& request, Payload& response) override {
    ++coroutine_calls;
    response.set_data(request.data());
    co_return Status();
  }
  std::optional<Status> EchoInline(ServerContext&, const Payload& request, Payload& response) override {
    if (!inline_) return std::nullopt;
    ++inline_calls;
    response.set_data(request.data());
    return Status();
  }
  uint64_t coroutine_calls = 0;
  uint64_t inline_calls = 0;

 private:
  bool inline_;
};

struct Shape {
  std::string name;
  std::string transport;   // "tcp" or "rdma"
  int concurrency = 1;
  bool deadline = false;   // each call carries a 10 s deadline (client and server timers)
  size_t size = 64;
  bool inline_handler = false;  // the service answers from EchoInline, not the coroutine
  // Calls go in bursts of `concurrency` started from a posted task inside a
  // Channel::Batch, the next burst once the last is done (not a closed loop).
  bool batched_bursts = false;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& p) { return p.param.name; }

struct Counts {
  uint64_t calls = 0;
  uint64_t errors = 0;
  uint64_t allocs = 0;
};

// Runs `warmup` then `measured` closed-loop calls on one thread (client and
// server on one io_context, run() so Asio's own per-thread caches persist).
// `trace` > 0 prints the stacks of that many measured-phase allocations.
Counts RunCalls(const Shape& s, uint64_t warmup, uint64_t measured, int trace) {
  TransportOptions topts;
  std::string host = "127.0.0.1";
  if (s.transport == "rdma") {
    auto ctx = rdma::RdmaContext::Open({.name = TestDevice()});
    EXPECT_TRUE(ctx.ok()) << ctx.status();
    if (!ctx.ok()) return {};
    topts.rdma_context = *ctx;
    topts.rdma.poll_mode = rdma::PollMode::kEvent;
    host = TestIp();
  }
  asio::io_context io(1);
  EchoOnly service(s.inline_handler);
  ServerOptions so;
  so.listen = {absl::StrCat(s.transport, "://", host, ":0")};
  so.transport = topts;
  auto server = std::make_unique<Server>(io.get_executor(), so);
  EXPECT_TRUE(server->AddService(service).ok());
  const Status started = server->Start();
  EXPECT_TRUE(started.ok()) << started.ToString();
  if (!started.ok()) return {};
  ChannelOptions co;
  co.transport = topts;
  auto channel = Channel::Create(io.get_executor(), server->local_uris().at(0), co);
  EXPECT_TRUE(channel.ok());
  if (!channel.ok()) return {};
  rdmarpc::test::Test::Stub stub(*channel);

  struct Slot {
    ClientContext ctx;
    Payload req, resp;
  };
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < s.concurrency; ++i) {
    slots.push_back(std::make_unique<Slot>());
    slots.back()->req.set_data(std::string(s.size, 'a'));
  }
  uint64_t issued = 0, completed = 0, errors = 0, allocs_before = 0;
  const uint64_t total = warmup + measured;
  int outstanding = 0;  // batched_bursts: calls of the burst not completed yet
  std::function<void()> burst;
  std::function<void(int)> issue = [&](int i) {
    Slot& slot = *slots[static_cast<size_t>(i)];
    ++issued;
    if (s.deadline) slot.ctx.set_timeout(std::chrono::seconds(10));
    stub.async_Echo(slot.ctx, slot.req, slot.resp, [&, i](boost::system::error_code ec) {
      Slot& done = *slots[static_cast<size_t>(i)];
      if (ec || done.resp.data().size() != s.size) ++errors;
      if (++completed == warmup) {
        allocs_before = bench::AllocCount();
        if (trace > 0) bench::TraceNextAllocs(trace);
      }
      if (!s.batched_bursts) {
        if (issued < total) issue(i);
      } else if (--outstanding == 0 && issued < total) {
        asio::post(io, [&] { burst(); });
      }
      if (completed == total) io.stop();
    });
  };
  burst = [&] {
    Channel::Batch batch(**channel);
    for (int i = 0; i < s.concurrency && issued < total; ++i) {
      ++outstanding;
      issue(i);
    }
  };
  if (s.batched_bursts) {
    asio::post(io, [&] { burst(); });
  } else {
    for (int i = 0; i < s.concurrency; ++i) issue(i);
  }
  asio::steady_timer give_up(io, std::chrono::minutes(5));
  give_up.async_wait([&](boost::system::error_code ec) {
    if (!ec) io.stop();
  });
  io.run();
  const uint64_t allocs = bench::AllocCount() - allocs_before;
  bench::TraceNextAllocs(0);
  give_up.cancel();
  io.restart();
  (*channel)->Close();
  server->async_shutdown(std::chrono::milliseconds(0), [] {});
  io.run_for(std::chrono::milliseconds(100));
  EXPECT_EQ(completed, total) << "the calls did not finish within 5 minutes";
  EXPECT_EQ(s.inline_handler ? service.inline_calls : service.coroutine_calls, total) << "the other handler ran";
  return {completed - warmup, errors, allocs};
}

class AllocTest : public ::testing::TestWithParam<Shape> {};

TEST_P(AllocTest, SteadyStateUnaryCallsAllocateNothing) {
  const Shape& s = GetParam();
  bench::WarmAllocTracing();
  // The measured run traces its own first allocations (tracing is not counted):
  // one that depends on timing may not recur in a second run.
  Counts c = RunCalls(s, 2'000, 10'000, 4);
  EXPECT_EQ(c.calls, 10'000u);
  EXPECT_EQ(c.errors, 0u);
  EXPECT_EQ(c.allocs, 0u) << c.allocs << " heap allocations in " << c.calls << " steady-state calls";
  std::printf("[ measured ] %s: %llu calls, %llu allocations\n", s.name.c_str(),
              static_cast<unsigned long long>(c.calls), static_cast<unsigned long long>(c.allocs));
}

// The counter itself works: an allocation the test makes is seen.
TEST(AllocCounter, SeesAnAllocation) {
  const uint64_t before = bench::AllocCount();
  auto* p = new std::string(100, 'x');
  const uint64_t after = bench::AllocCount();
  delete p;
  EXPECT_GE(after - before, 1u);
}

// Handler memory keeps headroom: a thread whose warm-up only ever held one
// handler at a time does not allocate when two are alive at once later (which
// completions overlap depends on timing, so a warm-up cannot be relied on to
// reach every peak).
TEST(HandlerMemory, APeakAboveTheWarmUpsIsServedFromTheCache) {
  uint64_t allocs = 0;
  std::thread t([&] {  // a fresh thread: an empty cache
    transport::HandlerAllocator<std::array<char, 200>> alloc;
    alloc.deallocate(alloc.allocate(1), 1);  // warm-up: a peak of one
    const uint64_t before = bench::AllocCount();
    auto* a = alloc.allocate(1);
    auto* b = alloc.allocate(1);
    auto* c = alloc.allocate(1);
    allocs = bench::AllocCount() - before;
    alloc.deallocate(c, 1);
    alloc.deallocate(b, 1);
    alloc.deallocate(a, 1);
  });
  t.join();
  EXPECT_EQ(allocs, 0u);
}

// A connection reserves room for as many handlers as its queues can hold
// (every send slot's handler waits for its SEND to complete): that many alive
// at once then costs no allocation, however late in a run the peak comes.
TEST(HandlerMemory, AReservedPeakIsServedFromTheCache) {
  uint64_t allocs = 0;
  std::thread t([&] {
    transport::ReserveHandlerMemory(150);
    transport::HandlerAllocator<std::array<char, 48>> small;
    transport::HandlerAllocator<std::array<char, 200>> large;
    std::vector<void*> held;
    held.reserve(300);
    const uint64_t before = bench::AllocCount();
    for (int i = 0; i < 150; ++i) {
      held.push_back(small.allocate(1));
      held.push_back(large.allocate(1));
    }
    allocs = bench::AllocCount() - before;
    for (size_t i = 0; i < held.size(); i += 2) {
      small.deallocate(static_cast<std::array<char, 48>*>(held[i]), 1);
      large.deallocate(static_cast<std::array<char, 200>*>(held[i + 1]), 1);
    }
  });
  t.join();
  EXPECT_EQ(allocs, 0u);
}

#if defined(RDMARPC_ALLOC_TEST_RDMA)
// Eager sizes only: a rendezvous transfer (above the eager limit) still
// allocates and registers its buffer per message, so that the peer's grant
// dies with the MR when the transfer completes (issue 4/8: pool slabs with
// type-2 memory windows would keep that guarantee without the allocation).
INSTANTIATE_TEST_SUITE_P(Rdma, AllocTest,
                         ::testing::Values(Shape{"rdma_64B_c1", "rdma", 1, false, 64},
                                           Shape{"rdma_64B_c8_deadline", "rdma", 8, true, 64},
                                           Shape{"rdma_64B_c32", "rdma", 32, false, 64},
                                           Shape{"rdma_4KiB_c1", "rdma", 1, false, 4096},
                                           Shape{"rdma_64B_c8_deadline_inline", "rdma", 8, true, 64, true},
                                           Shape{"rdma_64B_c16_batched_bursts", "rdma", 16, false, 64, false, true}),
                         ShapeName);
#else
INSTANTIATE_TEST_SUITE_P(Tcp, AllocTest,
                         ::testing::Values(Shape{"tcp_64B_c1", "tcp", 1, false, 64},
                                           Shape{"tcp_64B_c8_deadline", "tcp", 8, true, 64},
                                           Shape{"tcp_64B_c32", "tcp", 32, false, 64},
                                           Shape{"tcp_64KiB_c1", "tcp", 1, false, 65536},
                                           Shape{"tcp_64B_c8_deadline_inline", "tcp", 8, true, 64, true},
                                           Shape{"tcp_64B_c16_batched_bursts", "tcp", 16, false, 64, false, true}),
                         ShapeName);
#endif

}  // namespace
}  // namespace rdmarpc::testing
