// The RDMA transport on a real (Soft-RoCE) device: integrity across the eager,
// inline and rendezvous paths, flow control under load, every poll mode,
// poller pinning, and teardown that gives every verbs resource back.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "tests/support/rdma_env.h"
#include "transport/rdma/poller.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {
namespace {

namespace asio = boost::asio;
using transport::Connection;
using transport::Message;

std::shared_ptr<RdmaContext> OpenContext() {
  auto ctx = RdmaContext::Open({.name = testing::TestDevice()});
  EXPECT_TRUE(ctx.ok()) << ctx.status();
  return ctx.ok() ? *ctx : nullptr;
}

struct Pair {
  std::unique_ptr<Connection> client, server;
};

// The server listens with `opt`, the client connects with `client_opt`
// (`opt` when not given).
Pair ConnectPair(asio::io_context& io, std::shared_ptr<RdmaContext> ctx, RdmaOptions opt,
                 std::optional<RdmaOptions> client_opt = std::nullopt) {
  Pair p;
  auto listener = Listen(io.get_executor(), ctx, testing::TestIp(), 0, opt);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return p;
  absl::Status server_st = absl::UnknownError("pending"), client_st = server_st;
  (*listener)->Accept([&](absl::StatusOr<std::unique_ptr<Connection>> c) {
    server_st = c.status();
    if (c.ok()) p.server = std::move(*c);
  });
  Connect(io.get_executor(), ctx, testing::TestIp(), static_cast<uint16_t>(std::stoi((*listener)->local_uri().substr((*listener)->local_uri().rfind(':') + 1))),
          client_opt.value_or(opt), [&](absl::StatusOr<std::unique_ptr<Connection>> c) {
            client_st = c.status();
            if (c.ok()) p.client = std::move(*c);
          });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((!p.client || !p.server) && client_st.code() == absl::StatusCode::kUnknown &&
         std::chrono::steady_clock::now() < deadline)
    io.run_one_for(std::chrono::milliseconds(100));
  while ((!p.client || !p.server) && server_st.code() == absl::StatusCode::kUnknown &&
         client_st.ok() && std::chrono::steady_clock::now() < deadline)
    io.run_one_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(client_st.ok()) << client_st;
  EXPECT_TRUE(server_st.ok()) << server_st;
  return p;
}

uint8_t PatternByte(size_t size, size_t i) { return static_cast<uint8_t>((size * 31 + i * 7 + (i >> 8)) & 0xFF); }

// Sends `size` bytes from `from` and checks them byte by byte at `to`.
void ExpectDelivered(asio::io_context& io, Connection& from, Connection& to, size_t size) {
  auto buf = from.Prepare(size);
  ASSERT_TRUE(buf.ok()) << buf.status();
  for (size_t i = 0; i < size; ++i) buf->data()[i] = std::byte(PatternByte(size, i));
  absl::Status sent = absl::UnknownError("pending");
  bool received = false;
  from.Send(std::move(*buf), [&](absl::Status st) { sent = st; });
  to.Receive([&](absl::StatusOr<Message> m) {
    received = true;
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->size(), size);
    size_t bad = 0;
    for (size_t i = 0; i < size; ++i) bad += m->data()[i] != std::byte(PatternByte(size, i));
    EXPECT_EQ(bad, 0u) << "corrupted bytes in a " << size << "-byte message";
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while ((!received || sent.code() == absl::StatusCode::kUnknown) && std::chrono::steady_clock::now() < deadline)
    io.run_one_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(received) << size;
  EXPECT_TRUE(sent.ok()) << size << ": " << sent;
}

class RdmaTransport : public ::testing::TestWithParam<PollMode> {
 protected:
  RdmaOptions Options() const {
    RdmaOptions o;
    o.poll_mode = GetParam();
    return o;
  }
};

TEST_P(RdmaTransport, EverySizeArrivesIntactInBothDirections) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  Pair p = ConnectPair(io, ctx, Options());
  ASSERT_TRUE(p.client && p.server);
  // 0, 1; around the inline limit (64 + header); 4 KiB and around the eager
  // limit; rendezvous sizes, and 16 MiB: above rxe's 8 MiB max message, so
  // the WRITE is split.
  const size_t eager = rdma::RdmaOptions{}.eager_limit;
  for (size_t size : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4095}, size_t{4096},
                      size_t{4097}, eager - 1, eager, eager + 1, size_t{65536}, size_t{1} << 20,
                      size_t{16} << 20}) {
    SCOPED_TRACE(size);
    ExpectDelivered(io, *p.client, *p.server, size);
    ExpectDelivered(io, *p.server, *p.client, size);
  }
  auto cs = p.client->stats();
  EXPECT_EQ(cs.qp_state, 1u + IBV_QPS_RTS);
  EXPECT_GT(cs.eager_bytes, 0u);
  EXPECT_GT(cs.rendezvous_bytes, size_t{16} << 20);
  EXPECT_EQ(cs.grants_live, 0u);
  EXPECT_EQ(p.server->stats().grants_live, 0u);
}

// Between two ends that offer it, a DATA frame is a SEND_WITH_IMM of the body
// alone, its header in the immediate: no header bytes on the wire for it. An
// end that does not offer it (a peer from before) gets headers and sends them.
// Either way every eager size, 0 and the eager limit included, arrives intact
// in both directions, prepared or from the application's registered memory
// (SendRegistered's gather).
TEST(RdmaTransportWire, DataHeadersRideInTheImmediateOnlyWhenBothEndsOfferIt) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  const size_t eager = RdmaOptions{}.eager_limit;
  BufferPoolOptions po;
  po.class_bytes = {256};
  auto pool = BufferPool::CreateForDevice(ctx->device(), po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (bool server_offers : {true, false}) {
    for (bool client_offers : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "server offers " << server_offers << ", client offers " << client_offers);
      RdmaOptions so, co;
      so.data_header_in_immediate = server_offers;
      co.data_header_in_immediate = client_offers;
      asio::io_context io;
      Pair p = ConnectPair(io, ctx, so, co);
      ASSERT_TRUE(p.client && p.server);
      for (size_t size : {size_t{0}, size_t{1}, size_t{64}, size_t{65}, size_t{4096}, eager}) {
        SCOPED_TRACE(size);
        ExpectDelivered(io, *p.client, *p.server, size);
        ExpectDelivered(io, *p.server, *p.client, size);
      }
      for (size_t size : {size_t{0}, size_t{64}}) {  // client -> server from registered memory
        SCOPED_TRACE(::testing::Message() << "registered " << size);
        auto b = (*pool)->Acquire(size);
        ASSERT_TRUE(b.ok()) << b.status();
        for (size_t i = 0; i < size; ++i) b->data()[i] = std::byte(PatternByte(size, i));
        bool sent = false, received = false;
        SendRegistered(*p.client, std::make_shared<const Buffer>(std::move(*b)), [&](absl::Status st) {
          EXPECT_TRUE(st.ok()) << st;
          sent = true;
        });
        p.server->Receive([&](absl::StatusOr<Message> m) {
          received = true;
          ASSERT_TRUE(m.ok()) << m.status();
          ASSERT_EQ(m->size(), size);
          for (size_t i = 0; i < size; ++i) ASSERT_EQ(m->data()[i], std::byte(PatternByte(size, i))) << i;
        });
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while ((!sent || !received) && std::chrono::steady_clock::now() < deadline)
          io.run_one_for(std::chrono::milliseconds(100));
        EXPECT_TRUE(sent && received);
      }
      const bool in_immediate = server_offers && client_offers;
      for (Connection* c : {p.client.get(), p.server.get()}) {
        const auto st = c->stats();
        const uint64_t messages = c == p.client.get() ? 8 : 6;
        EXPECT_EQ(st.messages_sent, messages);
        // Eager traffic sends no RTS or CTS: CREDIT frames are its only control frames.
        EXPECT_EQ(st.header_bytes_sent, wire::kHeaderSize * (st.credit_frames_sent + (in_immediate ? 0 : messages)));
      }
    }
  }
}

TEST_P(RdmaTransport, HundredThousandMessagesSixtyFourOutstandingNoRnrInOrder) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  RdmaOptions opt = Options();
  Pair p = ConnectPair(io, ctx, opt);
  ASSERT_TRUE(p.client && p.server);
  const uint64_t kTotal = GetParam() == PollMode::kEvent ? 100'000 : 20'000;
  constexpr int kWindow = 64;
  uint64_t sent = 0, acked = 0, received = 0, out_of_order = 0;
  absl::Status error;
  std::function<void()> send_more = [&] {
    while (sent < kTotal && sent - acked < kWindow) {
      auto buf = p.client->Prepare(sizeof(uint64_t));
      if (!buf.ok()) { error = buf.status(); return; }
      std::memcpy(buf->data().data(), &sent, sizeof sent);
      ++sent;
      p.client->Send(std::move(*buf), [&](absl::Status st) {
        if (!st.ok()) error = st;
        ++acked;
        send_more();
      });
    }
  };
  std::function<void()> receive_next = [&] {
    p.server->Receive([&](absl::StatusOr<Message> m) {
      if (!m.ok()) { error = m.status(); return; }
      uint64_t seq = 0;
      std::memcpy(&seq, m->data().data(), sizeof seq);
      out_of_order += seq != received;
      ++received;
      if (received < kTotal) receive_next();
    });
  };
  send_more();
  receive_next();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(600);
  while ((received < kTotal || acked < kTotal) && error.ok() && std::chrono::steady_clock::now() < deadline)
    io.run_one_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(error.ok()) << error;
  EXPECT_EQ(received, kTotal);
  EXPECT_EQ(out_of_order, 0u);
  auto cs = p.client->stats(), ss = p.server->stats();
  EXPECT_EQ(cs.rnr_errors, 0u);
  EXPECT_EQ(ss.rnr_errors, 0u);
  EXPECT_EQ(cs.wc_errors + ss.wc_errors, 0u);
  // The window (64) equals the receive depth: the sender must have waited for
  // credits, and credits must have come back by CREDIT frames (the server
  // sends nothing else).
  EXPECT_GT(ss.credit_frames_sent, 0u);
  std::printf("[ stats    ] %s: client waits_for_credit=%lu server credit_frames=%lu wr_posted=%lu\n",
              PollModeName(GetParam()), static_cast<unsigned long>(cs.send_waits_for_credit),
              static_cast<unsigned long>(ss.credit_frames_sent), static_cast<unsigned long>(cs.wr_posted));
}

INSTANTIATE_TEST_SUITE_P(PollModes, RdmaTransport,
                         ::testing::Values(PollMode::kEvent, PollMode::kAdaptive, PollMode::kBusy),
                         [](const auto& param_info) { return std::string(PollModeName(param_info.param)); });

// Cpus_allowed_list of every thread named rdmarpc-poll in this process.
std::vector<std::string> PollerAffinities() {
  std::vector<std::string> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name != "rdmarpc-poll") continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("Cpus_allowed_list:", 0) == 0) out.push_back(line.substr(line.find_first_not_of(" \t", 18)));
  }
  return out;
}

TEST(RdmaTransportPollers, BusyPollerThreadsArePinnedToOneCore) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  RdmaOptions opt;
  opt.poll_mode = PollMode::kBusy;
  Pair p = ConnectPair(io, ctx, opt);
  ASSERT_TRUE(p.client && p.server);
  auto affinities = PollerAffinities();
  ASSERT_EQ(affinities.size(), 2u) << "one poller per QP";
  for (const auto& a : affinities)
    EXPECT_TRUE(!a.empty() && a.find_first_not_of("0123456789") == std::string::npos) << "pinned to one CPU, got " << a;
  p.client->Close();
  p.server->Close();
  p = {};
  // Close() joins the threads; the kernel drops a joined thread's
  // /proc/self/task entry a moment later (slowly under emulation).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!PollerAffinities().empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(PollerAffinities().empty()) << "poller threads must stop with their connection";
}

// Large sends are written into the connection's registered send pool: 40
// messages of 256 KiB and 40 of 20 KiB each way register one slab per class
// and side (2 MiB each), not one MR per message; a 2 MiB message (above the
// largest class) registers memory of its own and the stats say so.
TEST(RdmaTransportLimits, LargeSendsUseTheConnectionsRegisteredPool) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  Pair p = ConnectPair(io, ctx, RdmaOptions{});
  ASSERT_TRUE(p.client && p.server);
  EXPECT_EQ(p.client->stats().send_pool_registered_bytes, 0u) << "the pool starts with the first large send";
  for (int i = 0; i < 40; ++i) {
    ExpectDelivered(io, *p.client, *p.server, 256 << 10);
    ExpectDelivered(io, *p.server, *p.client, 20 << 10);
    ExpectDelivered(io, *p.client, *p.server, 20 << 10);
    ExpectDelivered(io, *p.server, *p.client, 256 << 10);
  }
  for (Connection* c : {p.client.get(), p.server.get()}) {
    EXPECT_EQ(c->stats().rendezvous_send_registrations, 0u);
    EXPECT_EQ(c->stats().send_pool_registered_bytes, size_t{4} << 20) << "one 2 MiB slab for each of 2 classes";
  }
  ExpectDelivered(io, *p.client, *p.server, size_t{2} << 20);
  EXPECT_EQ(p.client->stats().rendezvous_send_registrations, 1u);
  p.client->Close();
  p.server->Close();
}

// An eager limit above the device's largest message (max_msg_sz; rxe: 8 MiB)
// is cut down to it: a message between the two goes by rendezvous instead of
// as one SEND longer than the device advertises (rxe happens to carry it; a
// NIC that enforces its limit fails the WR, and so the connection), and one
// just under the device's limit still goes eagerly. Without the bound the
// first message went as one SEND (checked: rendezvous_bytes was 0).
TEST(RdmaTransportLimits, EagerLimitIsBoundedByTheDevicesLargestMessage) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  const size_t dev_max = ctx->device().port().attr.max_msg_sz;
  if (dev_max >= (size_t{64} << 20)) GTEST_SKIP() << ctx->device().name() << " takes messages of " << dev_max << " bytes";
  asio::io_context io;
  RdmaOptions opt;
  opt.eager_limit = dev_max * 2;
  opt.recv_depth = 2;  // Few slots: each is as large as the device's largest message.
  opt.ctrl_depth = 3;
  opt.send_depth = 2;
  Pair p = ConnectPair(io, ctx, opt);
  ASSERT_TRUE(p.client && p.server);
  ExpectDelivered(io, *p.client, *p.server, dev_max + 4096);
  EXPECT_EQ(p.client->stats().rendezvous_bytes, dev_max + 4096) << "above the device's limit: rendezvous";
  ExpectDelivered(io, *p.client, *p.server, dev_max - 4096);
  EXPECT_EQ(p.client->stats().eager_bytes, dev_max - 4096) << "below it: still one SEND";
  EXPECT_EQ(p.client->stats().wc_errors, 0u);
  p.client->Close();
  p.server->Close();
  io.poll();
}

// Zero-copy sends of the application's registered Buffers (SendRegistered):
// every size, eager (header slot + the buffer, gathered) and rendezvous (RDMA
// WRITE from the buffer), arrives intact; the connection holds the buffer
// while the send is in flight and lets go when it completes; one buffer goes
// out three times at once; and no byte went through the connection's send
// pool or a per-message registration -- where a copying send would have put
// the large ones.
TEST(RdmaTransportZeroCopy, RegisteredBuffersGoOutWithoutACopy) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  Pair p = ConnectPair(io, ctx, RdmaOptions{});
  ASSERT_TRUE(p.client && p.server);
  BufferPoolOptions po;
  po.class_bytes = {256, 4 << 10, 64 << 10, 1 << 20, 4 << 20};
  auto pool = BufferPool::CreateForDevice(ctx->device(), po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const size_t eager = RdmaOptions{}.eager_limit;
  for (size_t size : {size_t{0}, size_t{1}, size_t{64}, size_t{200}, eager - 1, eager, eager + 1,
                      size_t{65536}, size_t{1} << 20, size_t{3} << 20}) {
    SCOPED_TRACE(size);
    auto b = (*pool)->Acquire(size);
    ASSERT_TRUE(b.ok()) << b.status();
    for (size_t i = 0; i < size; ++i) b->data()[i] = std::byte(PatternByte(size, i));
    auto shared = std::make_shared<const Buffer>(std::move(*b));
    const int copies = size == 200 || size == (size_t{1} << 20) ? 3 : 1;
    int sent = 0, received = 0;
    for (int c = 0; c < copies; ++c) {
      SendRegistered(*p.client, shared, [&](absl::Status st) {
        EXPECT_TRUE(st.ok()) << st;
        ++sent;
      });
    }
    EXPECT_EQ(shared.use_count(), 1 + copies) << "the connection holds the buffer, not a copy of it";
    for (int c = 0; c < copies; ++c) {
      p.server->Receive([&](absl::StatusOr<Message> m) {
        ASSERT_TRUE(m.ok()) << m.status();
        ASSERT_EQ(m->size(), size);
        size_t bad = 0;
        for (size_t i = 0; i < size; ++i) bad += m->data()[i] != std::byte(PatternByte(size, i));
        EXPECT_EQ(bad, 0u);
        ++received;
      });
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((sent < copies || received < copies) && std::chrono::steady_clock::now() < deadline)
      io.run_one_for(std::chrono::milliseconds(100));
    EXPECT_EQ(sent, copies);
    EXPECT_EQ(received, copies);
    EXPECT_EQ(shared.use_count(), 1) << "released once every send completed";
  }
  auto st = p.client->stats();
  EXPECT_EQ(st.send_pool_registered_bytes, 0u) << "large sends must go from the caller's buffer, not the send pool";
  EXPECT_EQ(st.rendezvous_send_registrations, 0u);
  EXPECT_GT(st.rendezvous_bytes, size_t{3} << 20);
  // Still an ordinary connection: a prepared send works after them.
  ExpectDelivered(io, *p.client, *p.server, 100);
  p.client->Close();
  p.server->Close();
  io.poll();
}

// A Buffer registered in another protection domain (a pool made for another
// RdmaContext) is refused with the reason, and the connection is unharmed:
// posting it would have failed the whole connection with a local protection
// error.
TEST(RdmaTransportZeroCopy, BufferOfAnotherProtectionDomainIsRefused) {
  auto ctx = OpenContext();
  auto other = OpenContext();
  ASSERT_TRUE(ctx && other);
  ASSERT_NE(ctx->device().pd(), other->device().pd());
  asio::io_context io;
  Pair p = ConnectPair(io, ctx, RdmaOptions{});
  ASSERT_TRUE(p.client && p.server);
  auto pool = BufferPool::CreateForDevice(other->device(), BufferPoolOptions{});
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (size_t size : {size_t{64}, size_t{1} << 20}) {
    auto b = (*pool)->Acquire(size);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::Status result = absl::UnknownError("pending");
    SendRegistered(*p.client, std::make_shared<const Buffer>(std::move(*b)), [&](absl::Status s) { result = s; });
    while (result.code() == absl::StatusCode::kUnknown) io.run_one_for(std::chrono::milliseconds(100));
    EXPECT_EQ(result.code(), absl::StatusCode::kInvalidArgument) << result;
    EXPECT_NE(result.message().find("protection domain"), std::string::npos) << result;
  }
  absl::Status empty = absl::UnknownError("pending");
  SendRegistered(*p.client, nullptr, [&](absl::Status s) { empty = s; });
  while (empty.code() == absl::StatusCode::kUnknown) io.run_one_for(std::chrono::milliseconds(100));
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  ExpectDelivered(io, *p.client, *p.server, 64);
  EXPECT_EQ(p.client->stats().wc_errors, 0u);
  p.client->Close();
  p.server->Close();
  io.poll();
}

// Shared pollers (RdmaOptions::shared_pollers): 8 connection pairs, 16 QPs,
// polled by 2 threads in all, each pinned to one core and holding 8 CQs; every
// connection carries eager and rendezvous traffic both ways; closing takes
// each CQ off its thread, and the threads end with the context.
TEST(RdmaTransportPollers, SharedPollersServeManyConnectionsWithTwoThreads) {
  for (PollMode mode : {PollMode::kAdaptive, PollMode::kBusy}) {
    SCOPED_TRACE(PollModeName(mode));
    ASSERT_TRUE(PollerAffinities().empty()) << "a poller thread of an earlier test is still running";
    auto ctx = OpenContext();
    ASSERT_TRUE(ctx);
    asio::io_context io;
    RdmaOptions opt;
    opt.poll_mode = mode;
    opt.shared_pollers = 2;
    std::vector<Pair> pairs;
    for (int i = 0; i < 8; ++i) {
      pairs.push_back(ConnectPair(io, ctx, opt));
      ASSERT_TRUE(pairs.back().client && pairs.back().server) << "pair " << i;
    }
    auto affinities = PollerAffinities();
    EXPECT_EQ(affinities.size(), 2u) << "16 QPs on 2 shared poller threads";
    for (const auto& a : affinities)
      EXPECT_TRUE(!a.empty() && a.find_first_not_of("0123456789") == std::string::npos)
          << "pinned to one CPU, got " << a;
    auto group = ctx->SharedPollers(opt);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ((*group)->Load(), (std::vector<size_t>{8, 8}));
    for (auto& p : pairs) {
      ExpectDelivered(io, *p.client, *p.server, 64);
      ExpectDelivered(io, *p.server, *p.client, 64);
      ExpectDelivered(io, *p.client, *p.server, size_t{1} << 20);
      ExpectDelivered(io, *p.server, *p.client, size_t{1} << 20);
    }
    for (auto& p : pairs) {
      p.client->Close();
      p.server->Close();
    }
    pairs.clear();
    io.poll();
    EXPECT_EQ((*group)->Load(), (std::vector<size_t>{0, 0})) << "closed connections leave their threads";
    group = absl::InternalError("released");
    ctx.reset();
    io.poll();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!PollerAffinities().empty() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(PollerAffinities().empty()) << "shared poller threads must stop with their context";
  }
}

// Run to completion: no poller thread at all; the io_context's thread polls
// the CQ and handles completions, eager and rendezvous, both ways.
TEST(RdmaTransportPollers, RunToCompletionPollsOnTheExecutorThreadOnly) {
  for (PollMode mode : {PollMode::kAdaptive, PollMode::kBusy}) {
    SCOPED_TRACE(PollModeName(mode));
    auto ctx = OpenContext();
    ASSERT_TRUE(ctx);
    asio::io_context io;
    RdmaOptions opt;
    opt.poll_mode = mode;
    opt.run_to_completion = true;
    Pair p = ConnectPair(io, ctx, opt);
    ASSERT_TRUE(p.client && p.server);
    EXPECT_TRUE(PollerAffinities().empty()) << "run to completion starts no poller thread";
    for (size_t size : {size_t{1}, size_t{64}, size_t{4096}, size_t{1} << 20}) {
      ExpectDelivered(io, *p.client, *p.server, size);
      ExpectDelivered(io, *p.server, *p.client, size);
    }
    // Adaptive: quiet for longer than the spin (adaptive_spin, 50 us), the
    // executor sleeps on the channel: no spin pass is queued any more (busy
    // mode always has one). A message must still wake it.
    io.run_for(std::chrono::milliseconds(20));
    if (mode == PollMode::kAdaptive)
      EXPECT_EQ(io.poll_one(), 0u) << "adaptive, quiet for 20 ms: the executor must sleep, not spin";
    else
      EXPECT_EQ(io.poll_one(), 1u) << "busy: the executor keeps spinning";
    ExpectDelivered(io, *p.client, *p.server, 64);
    EXPECT_TRUE(PollerAffinities().empty());
    p.client->Close();
    p.server->Close();
  }
}

// Doorbell batching: the SENDs a completion batch's handlers post go out as
// one chained ibv_post_send when the batch held several messages. An echo
// server answering bursts of 48 from its sink must ring far fewer doorbells
// than it sends messages (one a message without batching); the client, which
// sends from outside any completion batch, rings one per message. Every echo
// must come back intact and in order through the chained posts. Event mode
// and run to completion: the executor's thread finds each burst in the CQ
// together (a poller thread could hand it over one completion at a time).
struct EchoSink final : transport::MessageSink {
  Connection* conn = nullptr;
  absl::Status error;
  void OnMessage(Message m) override {
    auto out = conn->Prepare(m.size());
    if (!out.ok()) { error = out.status(); return; }
    std::memcpy(out->data().data(), m.data().data(), m.size());
    conn->Send(std::move(*out), [this](absl::Status st) { if (!st.ok()) error = st; });
  }
  void OnConnectionError(absl::Status st) override { error = st; }
};

// The two ways a completion batch reaches its handlers on the executor's
// thread: event mode, and busy polling run to completion.
RdmaOptions ExecutorPollingOptions(bool rtc) {
  RdmaOptions opt;
  opt.poll_mode = rtc ? PollMode::kBusy : PollMode::kEvent;
  opt.run_to_completion = rtc;
  return opt;
}

// Runs `body(io, ctx, rtc)` in event mode and then busy with run to completion
// (ExecutorPollingOptions(rtc)), each with an io_context of its own.
template <typename Body>
void InEventAndRunToCompletion(Body body) {
  for (bool rtc : {false, true}) {
    SCOPED_TRACE(rtc ? "busy, run to completion" : "event");
    auto ctx = OpenContext();
    ASSERT_TRUE(ctx);
    asio::io_context io;
    body(io, ctx, rtc);
  }
}

TEST(RdmaTransportDoorbells, ResponsesToABatchOfMessagesShareADoorbell) {
  InEventAndRunToCompletion([](asio::io_context& io, const std::shared_ptr<RdmaContext>& ctx, bool rtc) {
    Pair p = ConnectPair(io, ctx, ExecutorPollingOptions(rtc));
    ASSERT_TRUE(p.client && p.server);
    EchoSink echo;
    echo.conn = p.server.get();
    ASSERT_TRUE(p.server->SetSink(&echo));
    constexpr uint64_t kBurst = 48, kBursts = 4;
    uint64_t next = 0, received = 0, out_of_order = 0;
    absl::Status error;
    std::function<void()> receive_next = [&] {
      p.client->Receive([&](absl::StatusOr<Message> m) {
        if (!m.ok()) { error = m.status(); return; }
        uint64_t seq = ~uint64_t{0};
        if (m->size() == 100) std::memcpy(&seq, m->data().data() + 50, sizeof seq);
        out_of_order += seq != received;
        ++received;
        receive_next();
      });
    };
    receive_next();
    for (uint64_t b = 0; b < kBursts; ++b) {
      for (uint64_t i = 0; i < kBurst; ++i, ++next) {
        auto buf = p.client->Prepare(100);
        ASSERT_TRUE(buf.ok()) << buf.status();
        std::memset(buf->data().data(), 0x5a, 100);
        std::memcpy(buf->data().data() + 50, &next, sizeof next);
        p.client->Send(std::move(*buf), [&](absl::Status st) { if (!st.ok()) error = st; });
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (received < next && error.ok() && echo.error.ok() && std::chrono::steady_clock::now() < deadline)
        io.run_one_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(error.ok()) << error;
    EXPECT_TRUE(echo.error.ok()) << echo.error;
    EXPECT_EQ(received, kBurst * kBursts);
    EXPECT_EQ(out_of_order, 0u);
    const auto cs = p.client->stats(), ss = p.server->stats();
    EXPECT_GE(ss.messages_sent, kBurst * kBursts);
    EXPECT_LE(ss.send_doorbells * 2, ss.messages_sent) << "the echoes were not batched";
    EXPECT_GE(cs.send_doorbells, kBurst * kBursts) << "the client's sends are not in completion batches";
    EXPECT_EQ(cs.wc_errors + ss.wc_errors + cs.rnr_errors + ss.rnr_errors, 0u);
    std::printf("[ stats    ] %s: server sent %lu messages with %lu doorbells; client %lu with %lu\n",
                rtc ? "rtc" : "event", static_cast<unsigned long>(ss.messages_sent),
                static_cast<unsigned long>(ss.send_doorbells), static_cast<unsigned long>(cs.messages_sent),
                static_cast<unsigned long>(cs.send_doorbells));
    p.client->Close();
    p.server->Close();
  });
}

// Selective signalling (docs/transport.md): a ping-pong whose every message
// is an untracked send made from the receiving sink (as the RPC layer answers
// and calls) posts most SENDs unsignalled on both sides, so each side's
// completions are about its receives alone. Then a windowed rendezvous each
// way, which needs the send queue drained for its bind while the ping-pong's
// last unsignalled SENDs are still on it: without a signalled SEND behind them
// (CoverUnsignaled) the bind would wait forever.
struct PingPongSink final : transport::MessageSink {
  Connection* conn = nullptr;
  bool echo = false;     // server: answer every small message
  uint64_t left = 0;     // client: pings still to send
  uint64_t small = 0;    // small messages received
  size_t large = 0;      // size of the last large message received
  size_t large_bad = 0;  // its corrupted bytes
  absl::Status error;
  void OnMessage(Message m) override {
    if (m.size() > 1024) {
      large = m.size();
      large_bad = 0;
      for (size_t i = 0; i < m.size(); ++i) large_bad += m.data()[i] != std::byte(PatternByte(m.size(), i));
      return;
    }
    ++small;
    if (!echo && left == 0) return;
    if (!echo) --left;
    auto out = conn->Prepare(m.size());
    if (!out.ok()) { error = out.status(); return; }
    std::memcpy(out->data().data(), m.data().data(), m.size());
    conn->SendUntracked(std::move(*out));
  }
  void OnConnectionError(absl::Status st) override { error = st; }
};

TEST(RdmaTransportSignalling, UntrackedAnswersFromTheSinkGoUnsignalledAndRendezvousStillDrains) {
  InEventAndRunToCompletion([](asio::io_context& io, const std::shared_ptr<RdmaContext>& ctx, bool rtc) {
    RdmaOptions opt = ExecutorPollingOptions(rtc);
    opt.grant_windows = true;
    Pair p = ConnectPair(io, ctx, opt);
    ASSERT_TRUE(p.client && p.server);
    // Not a multiple of the run of 16: each side ends with unsignalled SENDs
    // that no signalled one of the ping-pong covers.
    constexpr uint64_t kRounds = 2007;
    PingPongSink client, server;
    client.conn = p.client.get();
    server.conn = p.server.get();
    server.echo = true;
    client.left = kRounds - 1;
    ASSERT_TRUE(p.client->SetSink(&client));
    ASSERT_TRUE(p.server->SetSink(&server));
    {
      auto first = p.client->Prepare(64);
      ASSERT_TRUE(first.ok()) << first.status();
      std::memset(first->data().data(), 0x33, 64);
      p.client->SendUntracked(std::move(*first));
    }
    auto run_until = [&](auto done) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (!done() && client.error.ok() && server.error.ok() && std::chrono::steady_clock::now() < deadline)
        io.run_one_for(std::chrono::milliseconds(10));
      return done();
    };
    EXPECT_TRUE(run_until([&] { return client.small == kRounds; })) << client.small << " echoes";
    ASSERT_TRUE(client.error.ok()) << client.error;
    ASSERT_TRUE(server.error.ok()) << server.error;
    for (Connection* c : {p.client.get(), p.server.get()}) {
      const auto st = c->stats();
      SCOPED_TRACE(transport::SummarizeStats(st));
      // All but one SEND in a run of 16 (the client's first is not answered
      // from a sink): each side completes its receives and ~1/16 of its sends.
      EXPECT_GE(st.sends_unsignaled, kRounds * 13 / 16);
      EXPECT_LT(st.wr_completed, st.messages_received + st.messages_sent / 8);
      EXPECT_EQ(st.wc_errors + st.rnr_errors, 0u);
    }
    // Now rendezvous each way: each side binds a window with unsignalled
    // SENDs of the ping-pong possibly still on its queue.
    constexpr size_t kLarge = 1 << 20;
    for (auto [from, to] : {std::pair{p.client.get(), &server}, std::pair{p.server.get(), &client}}) {
      auto buf = from->Prepare(kLarge);
      ASSERT_TRUE(buf.ok()) << buf.status();
      for (size_t i = 0; i < kLarge; ++i) buf->data()[i] = std::byte(PatternByte(kLarge, i));
      absl::Status sent = absl::UnknownError("pending");
      from->Send(std::move(*buf), [&](absl::Status st) { sent = st; });
      EXPECT_TRUE(run_until([&] { return to->large == kLarge && sent.code() != absl::StatusCode::kUnknown; }))
          << "a " << kLarge << "-byte message did not arrive: " << transport::SummarizeStats(from->stats()) << " / "
          << transport::SummarizeStats(to->conn->stats());
      EXPECT_TRUE(sent.ok()) << sent;
      EXPECT_EQ(to->large_bad, 0u);
    }
    // Idle: every SEND accounted for, every window invalidated.
    EXPECT_TRUE(run_until([&] {
      return p.client->stats().send_queue_used == 0 && p.server->stats().send_queue_used == 0 &&
             p.client->stats().invalidations_pending == 0 && p.server->stats().invalidations_pending == 0;
    })) << transport::SummarizeStats(p.client->stats()) << " / " << transport::SummarizeStats(p.server->stats());
    EXPECT_TRUE(client.error.ok()) << client.error;
    EXPECT_TRUE(server.error.ok()) << server.error;
    p.client->Close();
    p.server->Close();
  });
}

// Receives go back in batches (RdmaOptions::recv_repost_batch). A receiver
// that drops each message as it comes reposts their RECVs in chains, one
// ibv_post_recv per batch; and one that holds the message which took the
// sender's last credit still gets every message its drops made room for: the
// RECVs waiting for a batch are posted as soon as the peer may be out of
// credits, not when the batch fills.
struct HoldingReceiver {
  Connection* conn = nullptr;
  std::vector<Message> held;
  uint64_t received = 0;
  absl::Status error;
  std::function<void(HoldingReceiver&)> after_each;  // what to drop, if anything
  void Next() {
    conn->Receive([this](absl::StatusOr<Message> m) {
      if (!m.ok()) {
        if (m.status().code() != absl::StatusCode::kCancelled) error = m.status();
        return;
      }
      ++received;
      held.push_back(std::move(*m));
      if (after_each) after_each(*this);
      Next();
    });
  }
};

absl::Status SendSmall(Connection& c, uint64_t seq, absl::Status& error) {
  auto buf = c.Prepare(64);
  if (!buf.ok()) return buf.status();
  std::memset(buf->data().data(), 0x3c, 64);
  std::memcpy(buf->data().data(), &seq, sizeof seq);
  c.Send(std::move(*buf), [&error](absl::Status st) {
    if (!st.ok() && st.code() != absl::StatusCode::kCancelled) error = st;
  });
  return absl::OkStatus();
}

TEST(RdmaTransportReceives, DroppedMessagesGoBackInChainsOfTheRepostBatch) {
  for (bool rtc : {false, true}) {
    for (uint16_t batch : {uint16_t{0}, uint16_t{1}}) {
      SCOPED_TRACE(absl::StrCat(rtc ? "busy, run to completion" : "event", ", recv_repost_batch ", batch));
      auto ctx = OpenContext();
      ASSERT_TRUE(ctx);
      asio::io_context io;
      RdmaOptions opt = ExecutorPollingOptions(rtc);
      opt.recv_depth = 32;  // batch 0 picks 32 / 8 = 4
      opt.recv_repost_batch = batch;
      Pair p = ConnectPair(io, ctx, opt);
      ASSERT_TRUE(p.client && p.server);
      HoldingReceiver server;
      server.conn = p.server.get();
      server.after_each = [](HoldingReceiver& r) { r.held.clear(); };  // drop each at once
      server.Next();
      const auto before = p.server->stats();
      constexpr uint64_t kMessages = 64;
      absl::Status send_error;
      // One at a time: the sender never runs out of credits, so only the
      // batch decides when RECVs go back.
      for (uint64_t i = 0; i < kMessages; ++i) {
        ASSERT_TRUE(SendSmall(*p.client, i, send_error).ok());
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (server.received <= i && server.error.ok() && std::chrono::steady_clock::now() < deadline)
          io.run_one_for(std::chrono::milliseconds(10));
      }
      ASSERT_EQ(server.received, kMessages);
      EXPECT_TRUE(server.error.ok()) << server.error;
      EXPECT_TRUE(send_error.ok()) << send_error;
      const auto after = p.server->stats();
      const uint64_t calls = after.recv_doorbells - before.recv_doorbells;
      // wr_posted counts the SENDs of the server's CREDIT frames too.
      const uint64_t posted = after.wr_posted - before.wr_posted - (after.credit_frames_sent - before.credit_frames_sent);
      if (batch == 1) {
        EXPECT_EQ(calls, kMessages) << "recv_repost_batch 1 posts each receive alone";
        EXPECT_EQ(posted, kMessages);
      } else {
        EXPECT_EQ(calls, kMessages / 4) << "64 drops in chains of 4";
        EXPECT_EQ(posted, kMessages) << "a receive was not given back";
      }
      EXPECT_EQ(after.rnr_errors + after.wc_errors + p.client->stats().wc_errors, 0u);
      p.client->Close();
      p.server->Close();
      io.run_for(std::chrono::milliseconds(50));
    }
  }
}

TEST(RdmaTransportReceives, AReceiverHoldingTheLastCreditsMessageStillGetsWhatItsDropsMadeRoomFor) {
  InEventAndRunToCompletion([](asio::io_context& io, const std::shared_ptr<RdmaContext>& ctx, bool rtc) {
    RdmaOptions opt = ExecutorPollingOptions(rtc);
    constexpr uint16_t kDepth = 32;  // repost batch 4
    opt.recv_depth = kDepth;
    Pair p = ConnectPair(io, ctx, opt);
    ASSERT_TRUE(p.client && p.server);
    // Holds every message; once the sender's first kDepth credits have all
    // arrived, drops all but the last of them and holds everything after.
    // The sender then has kDepth - 1 credits more, so exactly 2 * kDepth - 1
    // messages can arrive: no more (nothing is sent without a RECV), and no
    // fewer (RECVs left waiting for a batch would be credits never returned).
    HoldingReceiver server;
    server.conn = p.server.get();
    server.after_each = [](HoldingReceiver& r) {
      if (r.received == kDepth) r.held.erase(r.held.begin(), r.held.end() - 1);
    };
    server.Next();
    constexpr uint64_t kQueued = 2 * kDepth + 8;
    absl::Status send_error;
    for (uint64_t i = 0; i < kQueued; ++i) ASSERT_TRUE(SendSmall(*p.client, i, send_error).ok());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (server.received < 2 * kDepth - 1 && server.error.ok() && std::chrono::steady_clock::now() < deadline)
      io.run_one_for(std::chrono::milliseconds(10));
    io.run_for(std::chrono::milliseconds(300));  // room for a message that should not come
    EXPECT_EQ(server.received, 2u * kDepth - 1) << SummarizeStats(p.server->stats());
    EXPECT_TRUE(server.error.ok()) << server.error;
    EXPECT_TRUE(send_error.ok()) << send_error;
    bool in_order = true;
    for (size_t i = 0; i < server.held.size(); ++i) {
      uint64_t seq = 0;
      std::memcpy(&seq, server.held[i].data().data(), sizeof seq);
      in_order = in_order && seq == kDepth - 1 + i;
    }
    EXPECT_TRUE(in_order);
    EXPECT_EQ(p.server->stats().rnr_errors + p.client->stats().rnr_errors, 0u);
    server.held.clear();
    p.client->Close();
    p.server->Close();
    io.run_for(std::chrono::milliseconds(50));
  });
}

TEST(RdmaTransportReceives, ARepostBatchAboveSixteenIsRefusedWithTheRange) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  auto listener = Listen(io.get_executor(), ctx, testing::TestIp(), 0, RdmaOptions{});
  ASSERT_TRUE(listener.ok()) << listener.status();
  const std::string uri = (*listener)->local_uri();
  RdmaOptions bad;
  bad.recv_repost_batch = 17;
  absl::Status st = absl::UnknownError("pending");
  Connect(io.get_executor(), ctx, testing::TestIp(), static_cast<uint16_t>(std::stoi(uri.substr(uri.rfind(':') + 1))),
          bad, [&](absl::StatusOr<std::unique_ptr<Connection>> c) { st = c.status(); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (st.code() == absl::StatusCode::kUnknown && std::chrono::steady_clock::now() < deadline)
    io.run_one_for(std::chrono::milliseconds(50));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("recv_repost_batch 17 is above 16"), std::string::npos) << st;
  (*listener)->Close();
}

TEST(RdmaTransportPollers, RunToCompletionWithSharedPollersIsRefused) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  RdmaOptions opt;
  opt.poll_mode = PollMode::kAdaptive;
  opt.shared_pollers = 1;
  opt.run_to_completion = true;
  auto listener = Listen(io.get_executor(), ctx, testing::TestIp(), 0, opt);
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(listener.status().message().find("exclude each other"), absl::string_view::npos) << listener.status();
}

// Shared pollers in event mode are refused up front, with the reason, by
// both Listen and Connect.
TEST(RdmaTransportPollers, SharedPollersInEventModeAreRefusedWithTheReason) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  RdmaOptions opt;
  opt.poll_mode = PollMode::kEvent;
  opt.shared_pollers = 1;
  auto listener = Listen(io.get_executor(), ctx, testing::TestIp(), 0, opt);
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(listener.status().message().find("busy or adaptive"), absl::string_view::npos) << listener.status();
  absl::Status client_st = absl::UnknownError("pending");
  Connect(io.get_executor(), ctx, testing::TestIp(), 7999, opt,
          [&](absl::StatusOr<std::unique_ptr<Connection>> c) { client_st = c.status(); });
  io.run_for(std::chrono::seconds(1));
  EXPECT_EQ(client_st.code(), absl::StatusCode::kInvalidArgument) << client_st;
  EXPECT_NE(client_st.message().find("busy or adaptive"), absl::string_view::npos) << client_st;
}

// Object counts for our device from `rdma res show` ("pd 3 cq 4 qp 2 ...").
std::map<std::string, int> ResourceCounts(const std::string& dev) {
  std::map<std::string, int> counts;
  FILE* f = popen("rdma res show 2>/dev/null", "r");
  if (!f) return counts;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    std::string l(line);
    if (l.find(dev + ":") == std::string::npos) continue;
    // "0: rxe0: pd 3 cq 4 qp 2 cm_id 0 mr 2 ctx 1 srq 0": name/number pairs.
    std::vector<std::string> tok = absl::StrSplit(l, ' ', absl::SkipWhitespace());
    for (size_t i = 0; i + 1 < tok.size(); ++i) {
      int n = 0;
      if (absl::SimpleAtoi(tok[i + 1], &n) && !tok[i].empty() && std::isalpha(static_cast<unsigned char>(tok[i][0])))
        counts[tok[i]] = n;
    }
  }
  pclose(f);
  return counts;
}

// A connection's QP, CQ and cm_id go on a thread of their own after it is
// dropped (QpTeardown): counts are read once they stop moving, or once they
// equal `want`; 10 s at most.
std::map<std::string, int> SettledCounts(const std::string& dev, const std::map<std::string, int>* want = nullptr) {
  auto last = ResourceCounts(dev);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (want != nullptr && last == *want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto now = ResourceCounts(dev);
    if (want == nullptr && now == last) break;
    last = std::move(now);
  }
  return last;
}

// max_rendezvous_bytes_held: a peer announcing many large messages to a
// receiver that does not consume them gets grants for the cap's worth only;
// the rest wait in order, and a message above the cap passes alone.
TEST(RdmaTransportLimits, IncomingRendezvousMemoryIsCappedAndOrderIsKept) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  RdmaOptions opt;
  opt.max_rendezvous_bytes_held = size_t{2} << 20;
  Pair p = ConnectPair(io, ctx, opt);
  ASSERT_TRUE(p.client && p.server);
  constexpr int kMessages = 8;
  constexpr size_t kSize = size_t{1} << 20;
  int sent_ok = 0;
  for (int i = 0; i < kMessages; ++i) {
    auto buf = p.client->Prepare(kSize);
    ASSERT_TRUE(buf.ok()) << buf.status();
    std::memset(buf->data().data(), i + 1, kSize);  // every byte names the message
    p.client->Send(std::move(*buf), [&](absl::Status st) { sent_ok += st.ok(); });
  }
  auto run_until = [&](auto done, std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) io.run_one_for(std::chrono::milliseconds(50));
    return done();
  };
  // Nobody receives yet: two 1 MiB grants fit the cap, the other six wait.
  EXPECT_TRUE(run_until([&] { return sent_ok == 2; }, std::chrono::seconds(60)));
  run_until([] { return false; }, std::chrono::seconds(2));
  auto held = p.server->stats();
  EXPECT_EQ(held.rendezvous_bytes_held, kSize * 2);
  EXPECT_EQ(held.grants_live, 0u) << "both granted messages should have arrived";
  EXPECT_EQ(held.rendezvous_deferred, 6u);
  EXPECT_EQ(sent_ok, 2) << "a send completed without a grant";
  std::vector<int> order;
  size_t max_held = 0;
  for (int i = 0; i < kMessages; ++i) {
    bool got = false;
    p.server->Receive([&](absl::StatusOr<Message> m) {
      got = true;
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_EQ(m->size(), kSize);
      const int first = static_cast<int>(m->data()[0]), last = static_cast<int>(m->data()[kSize - 1]);
      EXPECT_EQ(first, last);
      order.push_back(first);
    });  // the message is released when the handler's argument goes
    ASSERT_TRUE(run_until([&] { return got; }, std::chrono::seconds(60))) << "message " << i;
    max_held = std::max<size_t>(max_held, p.server->stats().rendezvous_bytes_held);
  }
  EXPECT_TRUE(run_until([&] { return sent_ok == kMessages; }, std::chrono::seconds(60)));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_LE(max_held, kSize * 2);
  EXPECT_EQ(p.server->stats().rendezvous_bytes_held, 0u);
  // Above the cap, alone: admitted.
  ExpectDelivered(io, *p.client, *p.server, size_t{3} << 20);
  EXPECT_EQ(p.server->stats().rendezvous_bytes_held, 0u);
}

// Rendezvous grants come from the receiver's grant pool, each opened by a
// type-2 memory window over exactly its bytes (issue 4: "grants from its
// pool"; issue 8 item 10): once the pool's slabs exist, a large message
// registers nothing, so the MR count stays flat however many arrive. Above
// the pool's largest class (1 MiB) a grant is an MR of its own. With
// grant_windows off (devices without type-2 windows) every grant is an MR of
// its own, registered and deregistered per message.
TEST(RdmaTransportGrants, GrantsAreWindowsOverPooledMemoryNotRegistrations) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  ASSERT_TRUE(ctx->device().SupportsType2Windows()) << ctx->device().name() << " binds no type-2 memory windows";
  const std::vector<size_t> pooled = {8 << 10, (16 << 10) + 1, (64 << 10) - 1, 200 << 10, 1 << 20};
  const size_t above = (size_t{1} << 20) + 1;
  constexpr int kRounds = 3;
  for (bool windows : {true, false}) {
    SCOPED_TRACE(windows ? "grant_windows on" : "grant_windows off");
    asio::io_context io;
    RdmaOptions opt;
    opt.grant_windows = windows;
    Pair p = ConnectPair(io, ctx, opt);
    ASSERT_TRUE(p.client && p.server);
    std::map<int, int> mrs;  // round -> MRs on the device after it
    for (int round = 0; round < kRounds; ++round) {
      for (size_t size : pooled) {
        ExpectDelivered(io, *p.client, *p.server, size);
        ExpectDelivered(io, *p.server, *p.client, size);
      }
      mrs[round] = ResourceCounts(ctx->device().name())["mr"];
    }
    ExpectDelivered(io, *p.client, *p.server, above);
    const size_t n = pooled.size() * kRounds;
    for (Connection* c : {p.client.get(), p.server.get()}) {
      const auto st = c->stats();
      EXPECT_EQ(st.grants_live, 0u);
      EXPECT_EQ(st.wc_errors, 0u);
      EXPECT_EQ(st.grants_windowed, windows ? n : 0u);
      // Idle again: every work request and every window's LOCAL_INV completed.
      EXPECT_EQ(st.send_queue_used, 0u);
      EXPECT_EQ(st.invalidations_pending, 0u);
    }
    EXPECT_EQ(p.server->stats().rendezvous_receive_registrations, windows ? 1u : n + 1);
    EXPECT_EQ(p.client->stats().rendezvous_receive_registrations, windows ? 0u : n);
    // Warm after the first round: no registration per message left behind.
    EXPECT_EQ(mrs[1], mrs[0]);
    EXPECT_EQ(mrs[2], mrs[0]);
    p.client->Close();
    p.server->Close();
  }
}

TEST(RdmaTransportTeardown, PeerClosingMidStreamFailsPendingWorkAndFreesEverything) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  {
    // librdmacm allocates a PD per device on first use and keeps it for the
    // process: one connect/close cycle first, so the baseline includes it.
    asio::io_context io;
    Pair warm = ConnectPair(io, ctx, {});
    ASSERT_TRUE(warm.client && warm.server);
    warm = {};
    io.run_for(std::chrono::milliseconds(200));
  }
  const auto baseline = SettledCounts(ctx->device().name());
  ASSERT_FALSE(baseline.empty()) << "`rdma res show` lists nothing for " << ctx->device().name();
  {
    asio::io_context io;
    Pair p = ConnectPair(io, ctx, {});
    ASSERT_TRUE(p.client && p.server);
    EXPECT_GT(ResourceCounts(ctx->device().name())["qp"], baseline.at("qp"));
    // The client keeps sending (small and large) and keeps one receive
    // pending; the server goes away mid-stream.
    int failed_sends = 0, ok_sends = 0, started = 0;
    absl::Status receive_status = absl::UnknownError("pending");
    p.client->Receive([&](absl::StatusOr<Message> m) { receive_status = m.status(); });
    for (int i = 0; i < 200; ++i) {
      auto buf = p.client->Prepare(i % 10 == 0 ? 100000 : 100);
      if (!buf.ok()) break;  // All send slots busy: that is backpressure, not failure.
      ++started;
      p.client->Send(std::move(*buf), [&](absl::Status st) { st.ok() ? ++ok_sends : ++failed_sends; });
    }
    io.run_for(std::chrono::milliseconds(50));
    p.server->Close();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (receive_status.code() == absl::StatusCode::kUnknown && std::chrono::steady_clock::now() < deadline)
      io.run_one_for(std::chrono::milliseconds(100));
    io.run_for(std::chrono::milliseconds(200));
    EXPECT_EQ(receive_status.code(), absl::StatusCode::kUnavailable) << receive_status;
    EXPECT_GE(started, 64);
    EXPECT_EQ(ok_sends + failed_sends, started) << "every send completes exactly once";
    auto again = p.client->Prepare(10);
    EXPECT_FALSE(again.ok());
    p = {};
    io.run_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(SettledCounts(ctx->device().name(), &baseline), baseline);
}

TEST(RdmaTransportErrors, ConnectingWithNoListenerIsUnavailable) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  asio::io_context io;
  absl::Status st = absl::UnknownError("pending");
  Connect(io.get_executor(), ctx, testing::TestIp(), 9, {}, [&](absl::StatusOr<std::unique_ptr<Connection>> c) {
    st = c.status();
  });
  io.run_for(std::chrono::seconds(20));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
}

}  // namespace
}  // namespace rdmarpc::rdma

namespace rdmarpc::rdma {
namespace {

// Registered memory survives fork(): a child that lives (and writes to its
// copy of every registered page) while the parent keeps sending and receiving
// must not make the NIC write into pages the parent no longer sees. On kernels
// before 5.13 this needs ibv_fork_init(), which RdmaContext::Open() calls.
TEST(RdmaFork, ChildProcessDoesNotCorruptTheParentsRegisteredMemory) {
  auto ctx = OpenContext();
  ASSERT_TRUE(ctx);
  const std::string protection = ctx->fork_protection();
  EXPECT_TRUE(protection == "kernel" || protection == "ibv_fork_init") << protection;
  std::printf("[ measured ] fork protection: %s\n", protection.c_str());
  asio::io_context io;
  Pair p = ConnectPair(io, ctx, RdmaOptions{});
  ASSERT_TRUE(p.client && p.server);
  ExpectDelivered(io, *p.client, *p.server, 100);  // slots in use before the fork
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  if (child == 0) {
    // The child dirties its copy of a send slot and waits for the parent.
    auto buf = p.client->Prepare(64);
    if (buf.ok()) std::memset(buf->data().data(), 0xEE, buf->size());
    char c;
    (void)!::read(pipefd[0], &c, 1);
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  // While the child lives, the parent writes into registered memory (send
  // slots) and the NIC writes into it (receive slots, rendezvous grants).
  for (size_t size : {size_t{64}, size_t{4096}, size_t{65536}, size_t{64}, size_t{1} << 20})
    ExpectDelivered(io, *p.client, *p.server, size);
  (void)!::write(pipefd[1], "x", 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (size_t size : {size_t{100}, size_t{8192}}) ExpectDelivered(io, *p.server, *p.client, size);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
}

}  // namespace
}  // namespace rdmarpc::rdma
