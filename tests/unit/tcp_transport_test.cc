// TCP-backend behaviour the transport seam cannot express: malformed frames
// from a raw socket, connect failures, and heap allocations on the steady path.
// The seam-level contracts are in tests/conformance.
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <optional>
#include <stdexcept>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/bind_allocator.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "transport/rdma/buffer_pool.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/uri.h"

// ---- counting allocator ------------------------------------------------------------
//
// operator new/delete are replaced to count C++ allocations, and the malloc
// family is interposed as well: Asio's recycling allocator gets its memory from
// std::aligned_alloc, which a new/delete counter alone would never see. Both
// forward to glibc's __libc_* entry points (the documented way to replace
// malloc keeps glibc's allocator underneath). Counting is on only inside the
// measured window. Sanitizers bring their own allocator: no counting there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RDMARPC_COUNT_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define RDMARPC_COUNT_ALLOCATIONS 0
#endif
#endif
#ifndef RDMARPC_COUNT_ALLOCATIONS
#define RDMARPC_COUNT_ALLOCATIONS 1
#endif

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_new_calls{0};     // operator new (all forms).
std::atomic<uint64_t> g_malloc_calls{0};  // malloc/calloc/realloc/aligned_alloc/memalign/posix_memalign.
}  // namespace

#if RDMARPC_COUNT_ALLOCATIONS
extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t n, size_t size);
void* __libc_realloc(void* p, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void __libc_free(void* p);

void* malloc(size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(size);
}
void* calloc(size_t n, size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(n, size);
}
void* realloc(void* p, size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, size);
}
void* memalign(size_t alignment, size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(size_t alignment, size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, size_t alignment, size_t size) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_malloc_calls.fetch_add(1, std::memory_order_relaxed);
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
void free(void* p) noexcept { __libc_free(p); }
}  // extern "C"

namespace {
void* CountedNew(size_t size, size_t alignment) {
  if (g_counting.load(std::memory_order_relaxed)) g_new_calls.fetch_add(1, std::memory_order_relaxed);
  if (size == 0) size = 1;
  void* p = alignment <= __STDCPP_DEFAULT_NEW_ALIGNMENT__ ? __libc_malloc(size) : __libc_memalign(alignment, size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t size) { return CountedNew(size, 0); }
void* operator new[](size_t size) { return CountedNew(size, 0); }
void* operator new(size_t size, std::align_val_t a) { return CountedNew(size, static_cast<size_t>(a)); }
void* operator new[](size_t size, std::align_val_t a) { return CountedNew(size, static_cast<size_t>(a)); }
void* operator new(size_t size, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(size, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t size, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(size, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { __libc_free(p); }
void operator delete[](void* p) noexcept { __libc_free(p); }
void operator delete(void* p, size_t) noexcept { __libc_free(p); }
void operator delete[](void* p, size_t) noexcept { __libc_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { __libc_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { __libc_free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { __libc_free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { __libc_free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { __libc_free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { __libc_free(p); }
#endif  // RDMARPC_COUNT_ALLOCATIONS

namespace rdmarpc::transport::tcp {
namespace {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using ConnectResult = absl::StatusOr<std::unique_ptr<Connection>>;

constexpr std::chrono::seconds kWait{30};

class TcpTransportTest : public ::testing::Test {
 protected:
  // hint: the io_context's concurrency hint (1: one thread runs it).
  explicit TcpTransportTest(int hint = BOOST_ASIO_CONCURRENCY_HINT_DEFAULT) : io_(hint) {}

  bool RunUntil(const std::function<bool()>& done, Clock::duration limit = kWait) {
    const auto deadline = Clock::now() + limit;
    io_.restart();
    while (!done()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      io_.run_one_for(std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100)));
    }
    return true;
  }

  std::unique_ptr<Listener> MustListen(TcpOptions options = {}) {
    auto listener = Listen(io_.get_executor(), "127.0.0.1", 0, options);
    EXPECT_TRUE(listener.ok()) << listener.status();
    return listener.ok() ? std::move(*listener) : nullptr;
  }

  uint16_t PortOf(const Listener& listener) {
    auto uri = ParseUri(listener.local_uri());
    EXPECT_TRUE(uri.ok()) << uri.status();
    return uri.ok() ? uri->port : 0;
  }

  // Connects with the TCP backend and accepts on `listener`.
  std::pair<std::unique_ptr<Connection>, std::unique_ptr<Connection>> ConnectPair(Listener& listener,
                                                                                  TcpOptions options = {}) {
    std::optional<ConnectResult> accepted, connected;
    listener.Accept([&](ConnectResult c) { accepted.emplace(std::move(c)); });
    AsyncConnect(io_.get_executor(), "127.0.0.1", PortOf(listener), options,
                 [&](ConnectResult c) { connected.emplace(std::move(c)); });
    EXPECT_TRUE(RunUntil([&] { return accepted.has_value() && connected.has_value(); }));
    if (!accepted || !connected || !accepted->ok() || !connected->ok()) {
      ADD_FAILURE() << "connect: " << (connected ? connected->status().ToString() : "pending")
                    << ", accept: " << (accepted ? accepted->status().ToString() : "pending");
      return {};
    }
    return {std::move(**connected), std::move(**accepted)};
  }

  // Accepts the raw socket's connection.
  std::unique_ptr<Connection> AcceptRaw(Listener& listener, tcp::socket& raw) {
    std::optional<ConnectResult> accepted;
    listener.Accept([&](ConnectResult c) { accepted.emplace(std::move(c)); });
    boost::system::error_code ec;
    raw.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), PortOf(listener)), ec);
    EXPECT_FALSE(ec) << ec.message();
    // The handshake (tcp_transport.h), then the raw socket speaks frames.
    auto hello = EncodeClientHello("", 0xFFFFFFFFu);
    EXPECT_TRUE(hello.ok()) << hello.status();
    asio::write(raw, asio::buffer(*hello), ec);
    EXPECT_FALSE(ec) << ec.message();
    std::array<std::byte, kServerVerdictBytes> verdict;
    std::optional<boost::system::error_code> read_ec;
    asio::async_read(raw, asio::buffer(verdict), [&](boost::system::error_code e, size_t) { read_ec = e; });
    EXPECT_TRUE(RunUntil([&] { return accepted.has_value() && read_ec.has_value(); }));
    EXPECT_FALSE(read_ec.value_or(asio::error::timed_out)) << "no verdict from the listener";
    if (!accepted || !accepted->ok()) {
      ADD_FAILURE() << "accept: " << (accepted ? accepted->status().ToString() : "pending");
      return nullptr;
    }
    return std::move(**accepted);
  }

  absl::Status SendAndWait(Connection& c, absl::string_view text) {
    std::optional<absl::Status> result;
    c.async_send(std::as_bytes(std::span<const char>(text.data(), text.size())),
                 [&](absl::Status s) { result.emplace(std::move(s)); });
    if (!RunUntil([&] { return result.has_value(); })) return absl::DeadlineExceededError("send");
    return *result;
  }

  absl::StatusOr<std::string> ReceiveAndWait(Connection& c) {
    std::optional<absl::StatusOr<Message>> result;
    c.async_receive([&](absl::StatusOr<Message> m) { result.emplace(std::move(m)); });
    if (!RunUntil([&] { return result.has_value(); })) return absl::DeadlineExceededError("receive");
    if (!result->ok()) return result->status();
    auto bytes = (*result)->data();
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

  void ExpectWorks(Connection& a, Connection& b, absl::string_view tag) {
    ASSERT_TRUE(SendAndWait(a, absl::StrCat("ping ", tag)).ok());
    auto got = ReceiveAndWait(b);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, absl::StrCat("ping ", tag));
    ASSERT_TRUE(SendAndWait(b, absl::StrCat("pong ", tag)).ok());
    got = ReceiveAndWait(a);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, absl::StrCat("pong ", tag));
  }

  // A listener and a connected pair in `options`' poll mode that have
  // exchanged a message each way.
  struct WorkingPair {
    std::unique_ptr<Listener> listener;
    std::unique_ptr<Connection> client, server;
  };
  WorkingPair ConnectWorking(const TcpOptions& options) {
    WorkingPair p;
    p.listener = MustListen(options);
    if (p.listener == nullptr) return p;
    std::tie(p.client, p.server) = ConnectPair(*p.listener, options);
    if (p.client != nullptr) ExpectWorks(*p.client, *p.server, "first");
    return p;
  }

  // Handlers io_ runs while `n` messages go from `from` to `to` and back,
  // one at a time.
  size_t HandlersForRoundTrips(Connection& from, Connection& to, int n) {
    size_t handlers = 0;
    io_.restart();
    const auto deadline = Clock::now() + kWait;
    for (int i = 0; i < n; ++i) {
      for (auto [a, b] : {std::pair<Connection*, Connection*>{&from, &to}, {&to, &from}}) {
        bool sent = false, received = false;
        a->async_send(std::as_bytes(std::span<const char>("turn", 4)), [&](absl::Status s) {
          EXPECT_TRUE(s.ok()) << s;
          sent = true;
        });
        b->async_receive([&](absl::StatusOr<Message> m) {
          EXPECT_TRUE(m.ok()) << m.status();
          received = true;
        });
        while (!(sent && received) && Clock::now() < deadline) handlers += io_.run_one_for(std::chrono::milliseconds(100));
        if (!(sent && received)) {
          ADD_FAILURE() << "round trip " << i << " did not finish";
          return handlers;
        }
      }
    }
    return handlers;
  }

  // HandlersForRoundTrips over a fresh busy pair, then a fresh adaptive one
  // (adaptive_spin longer than the test): {mode, handlers} for
  // kPingPongMessages messages.
  static constexpr size_t kPingPongMessages = 400;
  std::vector<std::pair<PollMode, size_t>> PingPongHandlers() {
    std::vector<std::pair<PollMode, size_t>> out;
    for (PollMode mode : {PollMode::kBusy, PollMode::kAdaptive}) {
      auto [listener, client, server] = ConnectWorking({.poll_mode = mode, .adaptive_spin = std::chrono::seconds(5)});
      if (client == nullptr) {
        ADD_FAILURE() << "no connection in " << PollModeName(mode) << " mode";
        continue;
      }
      out.emplace_back(mode, HandlersForRoundTrips(*client, *server, kPingPongMessages / 2));
    }
    return out;
  }

  // Whether the executor runs out of work within `limit`, one handler at a
  // time (poll() would never return while read passes repost themselves).
  bool RunsDryWithin(std::chrono::milliseconds limit) {
    io_.restart();
    for (const auto until = Clock::now() + limit; Clock::now() < until;)
      if (io_.poll_one() == 0) return true;
    return false;
  }

  static std::array<std::byte, 4> Header(uint32_t n) {
    return {std::byte(n & 0xff), std::byte((n >> 8) & 0xff), std::byte((n >> 16) & 0xff), std::byte(n >> 24)};
  }

  asio::io_context io_;
};

TEST_F(TcpTransportTest, ListenerReportsTheRealPort) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  auto uri = ParseUri(listener->local_uri());
  ASSERT_TRUE(uri.ok()) << uri.status();
  EXPECT_EQ(uri->scheme, Uri::Scheme::kTcp);
  EXPECT_EQ(uri->host, "127.0.0.1");
  EXPECT_NE(uri->port, 0);
}

// The epoll events each socket of this process is registered for, read from
// /proc/self/fdinfo of every epoll instance ("tfd: <fd> events: <hex> ...").
std::vector<std::pair<int, uint32_t>> SocketEpollRegistrations() {
  std::vector<std::pair<int, uint32_t>> out;
  const auto link = [](int fd) {
    std::array<char, 128> target{};
    const ssize_t n = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target.data(), target.size() - 1);
    return n > 0 ? std::string(target.data(), static_cast<size_t>(n)) : std::string();
  };
  for (int fd = 0; fd < 1024; ++fd) {
    if (link(fd) != "anon_inode:[eventpoll]") continue;
    std::FILE* info = std::fopen(absl::StrCat("/proc/self/fdinfo/", fd).c_str(), "r");
    if (info == nullptr) continue;
    std::array<char, 256> line{};
    while (std::fgets(line.data(), line.size(), info) != nullptr) {
      int target = -1;
      unsigned events = 0;
      if (std::sscanf(line.data(), "tfd: %d events: %x", &target, &events) == 2 &&
          link(target).rfind("socket:", 0) == 0) {
        out.emplace_back(target, events);
      }
    }
    std::fclose(info);
  }
  return out;
}

// A connected socket that is only waiting for messages is registered for
// reads. async_connect leaves EPOLLOUT registered on the client's socket, and
// every later wait for a message re-arms the registration, which reports the
// writable socket again: one useless reactor wake-up per message received
// (~340 instructions per echo in bench/cpu_per_call) unless the connector
// registers the socket afresh.
TEST_F(TcpTransportTest, ConnectedSocketsWaitingForMessagesAreNotWatchedForWritability) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  auto [client, server] = ConnectPair(*listener);
  ASSERT_NE(client, nullptr);
  ExpectWorks(*client, *server, "before");
  const auto registrations = SocketEpollRegistrations();
  ASSERT_GE(registrations.size(), 3u) << "listener, client and server sockets in this process's epoll";
  for (const auto& [fd, events] : registrations) {
    EXPECT_EQ(events & EPOLLOUT, 0u) << "socket fd " << fd << " registered for events 0x" << std::hex << events;
  }
  ExpectWorks(*client, *server, "after");
}

// A peer that stops reading fills the socket: a send the socket does not
// take, whole or at all, waits and leaves later, in order, with nothing lost
// or doubled, and every handler completes OK. Small frames of several sizes
// (each on a fresh connection), so the send that meets the full socket is
// sometimes taken in part and sometimes not at all (a single frame with
// nothing queued before it is written by its own send() first).
TEST_F(TcpTransportTest, SendsToAPeerThatStopsReadingWaitAndArriveInOrder) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  for (size_t payload = 8; payload <= 15; ++payload) {
    SCOPED_TRACE(absl::StrCat(payload, "-byte messages"));
    tcp::socket raw(io_);
    std::unique_ptr<Connection> server = AcceptRaw(*listener, raw);
    ASSERT_NE(server, nullptr);
    uint64_t sent = 0, completed = 0, failed = 0;
    auto send_one = [&] {
      auto buffer = server->Prepare(payload);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      std::memset(buffer->data().data(), static_cast<int>(payload), payload);
      std::memcpy(buffer->data().data(), &sent, sizeof sent);
      ++sent;
      server->Send(std::move(*buffer), [&](absl::Status st) { st.ok() ? ++completed : ++failed; });
    };
    // Send until the socket pushes back (a send's handler still pending after
    // the loop ran dry), then queue some more behind it.
    int after = -1;
    while (after < 200 && sent < 4'000'000) {
      send_one();
      io_.restart();
      io_.poll();
      if (after < 0 && completed + failed < sent) after = 0;
      if (after >= 0) ++after;
    }
    ASSERT_GE(after, 200) << "the socket never pushed back after " << sent << " messages";
    // Now read everything: frames in order, each what was sent.
    const uint64_t total = sent;
    std::string error;
    std::atomic<bool> reader_done{false};
    std::thread reader([&] {
      std::vector<std::byte> frame(4 + payload);
      for (uint64_t i = 0; i < total && error.empty(); ++i) {
        boost::system::error_code ec;
        asio::read(raw, asio::buffer(frame), ec);
        uint32_t len = 0;
        uint64_t index = 0;
        std::memcpy(&len, frame.data(), 4);
        std::memcpy(&index, frame.data() + 4, 8);
        if (ec) error = absl::StrCat("read ", i, ": ", ec.message());
        else if (len != payload) error = absl::StrCat("frame ", i, " says ", len, " bytes");
        else if (index != i) error = absl::StrCat("frame ", i, " carries message ", index);
        else if (payload > 8 && frame.back() != std::byte(payload)) error = absl::StrCat("frame ", i, " has the wrong filler");
      }
      reader_done = true;
    });
    EXPECT_TRUE(RunUntil([&] { return completed + failed == total && reader_done; }, std::chrono::seconds(60)))
        << completed << " + " << failed << " of " << total << " sends completed, reader "
        << (reader_done ? "done" : "still waiting for frames");
    if (!reader_done) ::shutdown(raw.native_handle(), SHUT_RDWR);  // a lost frame: unblock the reader
    reader.join();
    EXPECT_EQ(error, "");
    EXPECT_EQ(failed, 0u);
    EXPECT_EQ(completed, total);
  }
}

// Answers to the frames of one read leave in one write: a server's sink
// echoing 16 requests that came in one segment sends its 16 answers with one
// sendmsg(), not 16 send()s (ConnectionCore::ReadLoopHeld); one request at a time
// is answered at once. Every poll mode.
TEST_F(TcpTransportTest, AnswersToTheFramesOfOneReadLeaveInOneWrite) {
  struct EchoSink final : transport::MessageSink {
    Connection* c = nullptr;
    int echoed = 0;
    void OnMessage(Message m) override {
      auto b = c->Prepare(m.size());
      ASSERT_TRUE(b.ok()) << b.status();
      std::memcpy(b->data().data(), m.data().data(), m.size());
      c->SendUntracked(std::move(*b));
      ++echoed;
    }
    void OnConnectionError(absl::Status) override {}
  };
  for (PollMode mode : {PollMode::kEvent, PollMode::kBusy, PollMode::kAdaptive}) {
    SCOPED_TRACE(PollModeName(mode));
    auto [listener, client, server] = ConnectWorking({.poll_mode = mode, .adaptive_spin = std::chrono::seconds(5)});
    ASSERT_NE(client, nullptr);
    EchoSink sink;
    sink.c = server.get();
    ASSERT_TRUE(server->SetSink(&sink));
    // One at a time: each answer is written at once (nothing held).
    for (int i = 0; i < 3; ++i) {
      const uint64_t before = server->stats().send_doorbells;
      ASSERT_TRUE(SendAndWait(*client, absl::StrCat("single ", i)).ok());
      auto got = ReceiveAndWait(*client);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, absl::StrCat("single ", i));
      EXPECT_EQ(server->stats().send_doorbells - before, uint64_t{1});
    }
    // Sixteen in one segment (one sendmsg from the client's batch).
    constexpr int kBurst = 16;
    const uint64_t before = server->stats().send_doorbells;
    const int echoed_before = sink.echoed;
    {
      transport::SendBatch batch(*client);
      for (int i = 0; i < kBurst; ++i) {
        const std::string text = absl::StrCat("burst ", i);
        client->async_send(std::as_bytes(std::span<const char>(text.data(), text.size())),
                           [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; });
      }
    }
    for (int i = 0; i < kBurst; ++i) {
      auto got = ReceiveAndWait(*client);
      ASSERT_TRUE(got.ok()) << "answer " << i << ": " << got.status();
      EXPECT_EQ(*got, absl::StrCat("burst ", i));
    }
    EXPECT_EQ(sink.echoed - echoed_before, kBurst);
    EXPECT_EQ(server->stats().send_doorbells - before, uint64_t{1}) << "the answers were written one by one";
    server->Close();
  }
}

// The names flags and configuration use: each mode round-trips through its
// name, and a wrong name is refused with the choices in the message.
TEST(TcpPollModeTest, ParsesItsOwnNamesAndRefusesOthers) {
  for (PollMode mode : {PollMode::kEvent, PollMode::kAdaptive, PollMode::kBusy}) {
    auto parsed = ParsePollMode(PollModeName(mode));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, mode);
  }
  for (const char* bad : {"", "Busy", "spin", "event "}) {
    auto parsed = ParsePollMode(bad);
    ASSERT_FALSE(parsed.ok()) << "'" << bad << "' accepted";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("event|adaptive|busy"), std::string::npos) << parsed.status();
  }
}

// The fixture on an io_context made with the parameter as its concurrency hint.
class TcpHintTest : public TcpTransportTest, public ::testing::WithParamInterface<int> {
 protected:
  TcpHintTest() : TcpTransportTest(GetParam()) {}
};

// The polling tests run on an io_context that any number of threads may run
// (the default hint: a pass per connection) and on one that one thread runs
// (hint 1: the connections' passes share a task a turn).
class TcpPollingTest : public TcpHintTest {};
INSTANTIATE_TEST_SUITE_P(Hint, TcpPollingTest, ::testing::Values(BOOST_ASIO_CONCURRENCY_HINT_DEFAULT, 1),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return param.param == 1 ? std::string("OneThread") : std::string("AnyThreads");
                         });

// TcpOptions::poll_mode: busy keeps a read pass (a non-blocking recv()) queued
// on the connection's executor for as long as the connection lives, so that
// executor never runs dry; adaptive keeps one only until adaptive_spin passes
// without a byte, then waits in the reactor (the executor runs dry), and the
// next message wakes it and polling resumes. In event mode a connection
// waiting for a message has nothing queued.
TEST_P(TcpPollingTest, PollModesPollFromTheExecutorBusyForeverAdaptiveUntilQuiet) {
  for (PollMode mode : {PollMode::kEvent, PollMode::kAdaptive, PollMode::kBusy}) {
    SCOPED_TRACE(PollModeName(mode));
    auto [listener, client, server] =
        ConnectWorking({.poll_mode = mode, .adaptive_spin = std::chrono::milliseconds(20)});
    ASSERT_NE(client, nullptr);
    // Right after a message, a polling connection has its next pass queued.
    io_.restart();
    if (mode == PollMode::kEvent) {
      EXPECT_EQ(io_.poll(), 0u) << "an event-mode connection waiting for bytes has nothing queued";
    } else {
      EXPECT_GT(io_.poll_one(), 0u) << "no read pass queued after a message";
    }
    // Ten times adaptive_spin without traffic: does the executor run dry?
    EXPECT_EQ(RunsDryWithin(std::chrono::milliseconds(200)), mode != PollMode::kBusy);
    // Woken from the reactor (adaptive, event) or found by a pass (busy).
    ExpectWorks(*client, *server, "after the quiet spell");
    io_.restart();
    if (mode != PollMode::kEvent) {
      EXPECT_GT(io_.poll_one(), 0u) << "polling did not resume after the quiet spell";
    }
  }
}

// An io_context made with concurrency hint 1, or BOOST_ASIO_CONCURRENCY_HINT_
// UNSAFE_IO: Asio's promise that one thread runs it (its own one-thread test),
// which lets polling connections share one read pass a turn.
class TcpOneThreadTest : public TcpHintTest {};
INSTANTIATE_TEST_SUITE_P(Hint, TcpOneThreadTest, ::testing::Values(1, BOOST_ASIO_CONCURRENCY_HINT_UNSAFE_IO),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return param.param == 1 ? std::string("One") : std::string("UnsafeIo");
                         });

// With one thread running the io_context, the polling connections' read
// passes run together from one queued task a turn (transport/poll_group.h),
// where each connection queued its own: a scheduler operation is ~280
// instructions (bench/cpu_per_call). Counted as the handlers the io_context
// runs for a ping-pong between the two ends of one connection, both polling:
// per message its send completion and one task that runs both ends' passes. Without the group each end's pass is a task of its own, and the one
// that finds nothing runs too: three handlers a message (the next test).
TEST_P(TcpOneThreadTest, PollingConnectionsShareOneReadPassATurn) {
  for (const auto& [mode, handlers] : PingPongHandlers()) {
    SCOPED_TRACE(PollModeName(mode));
    EXPECT_LE(handlers, 2u * kPingPongMessages);
  }
}

// A handler that throws out of a pass (a receive completion runs inside the
// read pass) leaves io_context::run() as Asio lets exceptions do, and the
// other connections of the shared pass go on polling: the turn's remaining
// passes move to the next turn. (The connection whose handler threw is left
// as a throw leaves it in any poll mode: mid-read.)
TEST_P(TcpOneThreadTest, AHandlerThrowingOutOfASharedPassLeavesTheOthersPolling) {
  const TcpOptions options{.poll_mode = PollMode::kBusy};
  auto first = ConnectWorking(options);
  auto second = ConnectWorking(options);
  ASSERT_NE(first.client, nullptr);
  ASSERT_NE(second.client, nullptr);
  first.server->async_receive([](absl::StatusOr<Message>) { throw std::runtime_error("handler failed"); });
  first.client->async_send(std::as_bytes(std::span<const char>("boom", 4)), [](absl::Status) {});
  bool thrown = false;
  io_.restart();
  for (const auto until = Clock::now() + kWait; !thrown && Clock::now() < until;) {
    try {
      io_.run_one_for(std::chrono::milliseconds(100));
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "handler failed");
      thrown = true;
    }
  }
  ASSERT_TRUE(thrown) << "the receive handler never ran";
  ExpectWorks(*second.client, *second.server, "after the throw");
}

// An io_context that more than one thread may run (the default hint): each
// polling connection posts its own pass (the group's lists are not locked).
TEST_F(TcpTransportTest, PollingConnectionsOfAContextManyThreadsMayRunPassEach) {
  for (const auto& [mode, handlers] : PingPongHandlers()) {
    SCOPED_TRACE(PollModeName(mode));
    EXPECT_GE(handlers, 3u * kPingPongMessages);
  }
}

// The connected sockets of this process (listeners left out), from the
// epoll registrations above.
std::vector<int> ConnectedSockets() {
  std::vector<int> out;
  for (const auto& [fd, events] : SocketEpollRegistrations()) {
    int listening = 0;
    socklen_t len = sizeof listening;
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening == 0) out.push_back(fd);
  }
  return out;
}

// Waits (up to 2 s, without running the executor) until one of `sockets` has
// bytes queued (loopback delivers at send time); returns that socket, or -1.
int SocketHoldingBytes(const std::vector<int>& sockets) {
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
       std::chrono::steady_clock::now() < until;) {
    for (int fd : sockets) {
      int queued = 0;
      if (::ioctl(fd, FIONREAD, &queued) == 0 && queued > 0) return fd;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return -1;
}

// Whether the socket reports itself readable, as epoll would see it.
bool SignalsReadable(int fd) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

// A socket the read loop polls does not signal each message that arrives
// (otherwise every message also costs a reactor wake-up and a descriptor
// operation, ~300 instructions a call): its bytes sit in the socket without
// making it readable to epoll until the next pass takes them, and none is
// lost. A socket that waits in the reactor (event mode, adaptive gone quiet)
// does signal, or its wait would never end.
TEST_P(TcpPollingTest, PolledSocketsDoNotSignalArrivingBytesWaitingOnesDo) {
  for (PollMode mode : {PollMode::kEvent, PollMode::kAdaptive, PollMode::kBusy}) {
    SCOPED_TRACE(PollModeName(mode));
    auto [listener, client, server] =
        ConnectWorking({.poll_mode = mode, .adaptive_spin = std::chrono::milliseconds(300)});
    ASSERT_NE(client, nullptr);
    const std::vector<int> sockets = ConnectedSockets();
    ASSERT_EQ(sockets.size(), 2u);

    // Send without running the executor: no pass takes the bytes meanwhile.
    std::optional<absl::Status> sent;
    client->async_send(std::as_bytes(std::span<const char>("spinning", 8)),
                       [&](absl::Status s) { sent.emplace(std::move(s)); });
    const int receiver = SocketHoldingBytes(sockets);
    ASSERT_NE(receiver, -1) << "the message never reached the server's socket";
    EXPECT_EQ(SignalsReadable(receiver), mode == PollMode::kEvent);
    auto got = ReceiveAndWait(*server);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, "spinning");
    ASSERT_TRUE(RunUntil([&] { return sent.has_value(); }));

    if (mode != PollMode::kAdaptive) continue;
    // Quiet for longer than adaptive_spin: back in the reactor, and signalled.
    ASSERT_TRUE(RunsDryWithin(std::chrono::seconds(3))) << "adaptive polling never went quiet";
    sent.reset();
    client->async_send(std::as_bytes(std::span<const char>("waiting", 7)),
                       [&](absl::Status s) { sent.emplace(std::move(s)); });
    ASSERT_EQ(SocketHoldingBytes(sockets), receiver);
    EXPECT_TRUE(SignalsReadable(receiver)) << "a socket waiting in the reactor must signal its bytes";
    got = ReceiveAndWait(*server);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, "waiting");
    ExpectWorks(*client, *server, "after");
  }
}

// A hostile length prefix ends that connection only, with a reason, and no
// 4 GiB allocation.
TEST_F(TcpTransportTest, OversizedFrameClosesThatConnectionOnly) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  auto [good_client, good_server] = ConnectPair(*listener);
  ASSERT_NE(good_client, nullptr);

  tcp::socket raw(io_);
  std::unique_ptr<Connection> bad_server = AcceptRaw(*listener, raw);
  ASSERT_NE(bad_server, nullptr);
  std::optional<absl::StatusOr<Message>> pending;
  bad_server->async_receive([&](absl::StatusOr<Message> m) { pending.emplace(std::move(m)); });

  const auto header = Header(0xFFFFFFFFu);
  asio::write(raw, asio::buffer(header));
  ASSERT_TRUE(RunUntil([&] { return pending.has_value(); }));
  ASSERT_FALSE(pending->ok());
  EXPECT_EQ(pending->status().code(), absl::StatusCode::kUnavailable) << pending->status();
  EXPECT_NE(pending->status().message().find("4294967295-byte frame"), absl::string_view::npos)
      << pending->status();

  // The raw peer sees the connection end.
  std::array<std::byte, 16> sink;
  std::optional<boost::system::error_code> raw_end;
  raw.async_read_some(asio::buffer(sink), [&](boost::system::error_code ec, size_t) { raw_end = ec; });
  ASSERT_TRUE(RunUntil([&] { return raw_end.has_value(); }));
  EXPECT_TRUE(*raw_end == asio::error::eof || *raw_end == asio::error::connection_reset) << raw_end->message();

  // Later operations on the bad connection fail; the good one carries on.
  absl::Status later = SendAndWait(*bad_server, "x");
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
  ExpectWorks(*good_client, *good_server, "after bad frame");
  // And new connections are still accepted.
  auto [c2, s2] = ConnectPair(*listener);
  ASSERT_NE(c2, nullptr);
  ExpectWorks(*c2, *s2, "new connection");
}

// ---- handshake (tcp_transport.h) --------------------------------------------------

// A client that connects and says nothing holds a handshake slot, not the
// listener: others connect meanwhile, and it is dropped after handshake_timeout.
TEST_F(TcpTransportTest, SilentClientDoesNotHoldUpOthersAndIsDroppedAtTheHandshakeTimeout) {
  TcpOptions options;
  options.handshake_timeout = std::chrono::milliseconds(300);
  auto listener = MustListen(options);
  ASSERT_NE(listener, nullptr);
  std::vector<ConnectResult> accepted;
  listener->Accept([&](ConnectResult c) { accepted.push_back(std::move(c)); });
  tcp::socket silent(io_);
  boost::system::error_code ec;
  silent.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), PortOf(*listener)), ec);
  ASSERT_FALSE(ec) << ec.message();

  const auto start = Clock::now();
  std::optional<ConnectResult> connected;
  AsyncConnect(io_.get_executor(), "127.0.0.1", PortOf(*listener), TcpOptions{},
               [&](ConnectResult c) { connected.emplace(std::move(c)); });
  ASSERT_TRUE(RunUntil([&] { return connected.has_value() && !accepted.empty(); }));
  ASSERT_TRUE(connected->ok()) << connected->status();
  ASSERT_TRUE(accepted.front().ok()) << "the well-behaved client is accepted first: " << accepted.front().status();
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(250)) << "the silent client held up the listener";

  // The silent one is closed at the timeout and reported to the next Accept().
  listener->Accept([&](ConnectResult c) { accepted.push_back(std::move(c)); });
  std::array<std::byte, 16> sink;
  std::optional<boost::system::error_code> silent_end;
  silent.async_read_some(asio::buffer(sink), [&](boost::system::error_code e, size_t) { silent_end = e; });
  ASSERT_TRUE(RunUntil([&] { return silent_end.has_value() && accepted.size() == 2; }, std::chrono::seconds(5)));
  EXPECT_TRUE(*silent_end == asio::error::eof || *silent_end == asio::error::connection_reset) << silent_end->message();
  EXPECT_EQ(accepted[1].status().code(), absl::StatusCode::kDeadlineExceeded) << accepted[1].status();
  ExpectWorks(*connected.value().value(), *accepted.front().value(), "after the silent client");
}

// Something that is not an rdmarpc client (an HTTP request on the wrong port)
// is closed without a connection ever reaching the application.
TEST_F(TcpTransportTest, NonRdmarpcClientIsClosedAtTheHandshake) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  std::optional<ConnectResult> accepted;
  listener->Accept([&](ConnectResult c) { accepted.emplace(std::move(c)); });
  tcp::socket raw(io_);
  boost::system::error_code ec;
  raw.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), PortOf(*listener)), ec);
  ASSERT_FALSE(ec) << ec.message();
  const std::string http = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n";
  ASSERT_GE(http.size(), kClientHelloBytes);
  asio::write(raw, asio::buffer(http), ec);
  ASSERT_TRUE(RunUntil([&] { return accepted.has_value(); }));
  ASSERT_FALSE(accepted->ok());
  EXPECT_NE(accepted->status().message().find("not an rdmarpc client"), absl::string_view::npos) << accepted->status();
  auto [c, s] = ConnectPair(*listener);
  ASSERT_NE(c, nullptr);
  ExpectWorks(*c, *s, "after the stranger");
}

// The handshake tells each side what the other accepts: a message the server
// would drop the connection for is refused by the client's Prepare() instead,
// and the connection carries on.
TEST_F(TcpTransportTest, MessageOverThePeersLimitIsRefusedLocallyAndTheConnectionSurvives) {
  TcpOptions server_options;
  server_options.max_message_size = 1024;
  auto listener = MustListen(server_options);
  ASSERT_NE(listener, nullptr);
  auto [client, server] = ConnectPair(*listener);  // client: default 64 MiB
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->max_message_size(), 1024u);
  EXPECT_EQ(server->max_message_size(), 1024u);
  auto too_big = client->Prepare(1025);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_NE(too_big.status().message().find("the peer's limit"), absl::string_view::npos) << too_big.status();
  ASSERT_TRUE(client->Prepare(1024).ok());
  ExpectWorks(*client, *server, "after the refusal");
}

TEST_F(TcpTransportTest, FrameAtTheLimitIsAcceptedOneByteMoreIsNot) {
  TcpOptions options;
  options.max_message_size = 1024;
  auto listener = MustListen(options);
  ASSERT_NE(listener, nullptr);
  tcp::socket raw(io_);
  std::unique_ptr<Connection> server = AcceptRaw(*listener, raw);
  ASSERT_NE(server, nullptr);

  std::vector<std::byte> frame(4 + 1024, std::byte{0x5a});
  const auto at_limit = Header(1024);
  std::copy(at_limit.begin(), at_limit.end(), frame.begin());
  asio::write(raw, asio::buffer(frame));
  auto got = ReceiveAndWait(*server);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::string(1024, '\x5a'));

  const auto over = Header(1025);
  asio::write(raw, asio::buffer(over));
  got = ReceiveAndWait(*server);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_NE(got.status().message().find("1025-byte frame, limit 1024"), absl::string_view::npos) << got.status();
}

// A frame larger than the read buffer is read straight into its own buffer
// by a reactor read; when its tail comes later, in a piece smaller than
// whatever a polling connection had set to keep its socket quiet, that read
// must still be woken (in every poll mode) and the frame arrive whole.
TEST_F(TcpTransportTest, LargeFrameWhoseTailComesLaterArrivesWholeInEveryPollMode) {
  for (PollMode mode : {PollMode::kEvent, PollMode::kAdaptive, PollMode::kBusy}) {
    SCOPED_TRACE(PollModeName(mode));
    auto listener = MustListen({.poll_mode = mode, .adaptive_spin = std::chrono::seconds(5)});
    ASSERT_NE(listener, nullptr);
    tcp::socket raw(io_);
    std::unique_ptr<Connection> server = AcceptRaw(*listener, raw);
    ASSERT_NE(server, nullptr);
    constexpr uint32_t kSize = 200'000, kTail = 20'000;
    std::string body(kSize, '\0');
    for (uint32_t i = 0; i < kSize; ++i) body[i] = static_cast<char>('a' + i % 23);
    const auto h = Header(kSize);
    asio::write(raw, asio::buffer(h));
    asio::write(raw, asio::buffer(body.data(), kSize - kTail));
    std::optional<absl::StatusOr<Message>> got;
    server->async_receive([&](absl::StatusOr<Message> m) { got.emplace(std::move(m)); });
    io_.restart();
    io_.run_for(std::chrono::milliseconds(100));  // the head is read; the frame's read waits for the rest
    ASSERT_FALSE(got.has_value()) << "delivered before its tail was sent";
    asio::write(raw, asio::buffer(body.data() + kSize - kTail, kTail));
    ASSERT_TRUE(RunUntil([&] { return got.has_value(); })) << "the frame's tail never woke its read";
    ASSERT_TRUE(got->ok()) << got->status();
    const auto bytes = (*got)->data();
    ASSERT_EQ(bytes.size(), kSize);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), body);
  }
}

TEST_F(TcpTransportTest, PeerLeavingMidFrameFailsTheReceiveNamingTheCause) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  tcp::socket raw(io_);
  std::unique_ptr<Connection> server = AcceptRaw(*listener, raw);
  ASSERT_NE(server, nullptr);
  // A whole frame, then half of one.
  std::vector<std::byte> bytes;
  for (auto [len, fill] : {std::pair{3u, std::byte{1}}, std::pair{100u, std::byte{2}}}) {
    const auto h = Header(len);
    bytes.insert(bytes.end(), h.begin(), h.end());
    bytes.insert(bytes.end(), len == 100 ? 10 : len, fill);
  }
  asio::write(raw, asio::buffer(bytes));
  raw.close();
  auto first = ReceiveAndWait(*server);
  ASSERT_TRUE(first.ok()) << "the whole frame sent before the close is still delivered: " << first.status();
  EXPECT_EQ(*first, std::string(3, '\x01'));
  auto second = ReceiveAndWait(*server);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find("closed the connection"), absl::string_view::npos) << second.status();
}

TEST_F(TcpTransportTest, ConnectFailuresAreStatuses) {
  uint16_t port = 0;
  {
    auto listener = MustListen();
    ASSERT_NE(listener, nullptr);
    port = PortOf(*listener);
  }  // Closed: nothing listens there now.
  std::optional<ConnectResult> refused;
  Connect(io_.get_executor(), "127.0.0.1", port, {}, [&](ConnectResult c) { refused.emplace(std::move(c)); });
  ASSERT_TRUE(RunUntil([&] { return refused.has_value(); }));
  ASSERT_FALSE(refused->ok());
  EXPECT_EQ(refused->status().code(), absl::StatusCode::kUnavailable) << refused->status();
  EXPECT_NE(refused->status().message().find(absl::StrCat("tcp://127.0.0.1:", port)), absl::string_view::npos)
      << refused->status();

  TcpOptions too_big;
  too_big.max_message_size = size_t{1} << 33;
  std::optional<ConnectResult> invalid;
  bool returned = false, inline_call = false;
  Connect(io_.get_executor(), "127.0.0.1", port, too_big, [&](ConnectResult c) {
    inline_call = !returned;
    invalid.emplace(std::move(c));
  });
  returned = true;
  ASSERT_TRUE(RunUntil([&] { return invalid.has_value(); }));
  EXPECT_FALSE(inline_call);
  EXPECT_EQ(invalid->status().code(), absl::StatusCode::kInvalidArgument) << invalid->status();
  auto bad_listen = Listen(io_.get_executor(), "127.0.0.1", 0, too_big);
  EXPECT_EQ(bad_listen.status().code(), absl::StatusCode::kInvalidArgument) << bad_listen.status();
}

// ---- allocations on the steady path ----------------------------------------------------------

// A per-size free list: what an application that cares about allocations
// associates with its handlers (Asio's "allocation" example, generalised to
// the few sizes a connection's handlers need).
// rdma::SendRegistered on a TCP connection: the same application code runs
// on both transports; TCP copies the Buffer's bytes into its own send memory,
// so the buffer is free again as soon as the call returns.
TEST_F(TcpTransportTest, SendRegisteredFallsBackToACopyOverTcp) {
  auto listener = MustListen();
  ASSERT_NE(listener, nullptr);
  auto [client, server] = ConnectPair(*listener);
  ASSERT_NE(client, nullptr);
  auto pool = rdma::BufferPool::Create(std::make_unique<rdma::HeapSlabProvider>(), rdma::BufferPoolOptions{});
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto b = (*pool)->Acquire(5);
  ASSERT_TRUE(b.ok()) << b.status();
  std::memcpy(b->data().data(), "hello", 5);
  auto shared = std::make_shared<const rdma::Buffer>(std::move(*b));
  std::optional<absl::Status> sent;
  rdma::SendRegistered(*client, shared, [&](absl::Status st) { sent = st; });
  EXPECT_EQ(shared.use_count(), 1) << "TCP copied the bytes; it holds no reference";
  auto got = ReceiveAndWait(*server);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "hello");
  ASSERT_TRUE(RunUntil([&] { return sent.has_value(); }));
  EXPECT_TRUE(sent->ok()) << *sent;
  std::optional<absl::Status> empty;
  rdma::SendRegistered(*client, nullptr, [&](absl::Status st) { empty = st; });
  ASSERT_TRUE(RunUntil([&] { return empty.has_value(); }));
  EXPECT_EQ(empty->code(), absl::StatusCode::kInvalidArgument) << *empty;
  ExpectWorks(*client, *server, "after registered sends");
}

class HandlerArena {
 public:
  HandlerArena() = default;
  HandlerArena(const HandlerArena&) = delete;
  HandlerArena& operator=(const HandlerArena&) = delete;
  ~HandlerArena() {
    for (auto& [size, blocks] : free_) {
      for (void* b : blocks) ::operator delete(b);
    }
  }
  void* Allocate(size_t size) {
    for (auto& [s, blocks] : free_) {
      if (s == size && !blocks.empty()) {
        void* b = blocks.back();
        blocks.pop_back();
        return b;
      }
    }
    return ::operator new(size);
  }
  void Deallocate(void* p, size_t size) {
    for (auto& [s, blocks] : free_) {
      if (s == size) return blocks.push_back(p);
    }
    free_.push_back({size, {p}});
  }

 private:
  std::vector<std::pair<size_t, std::vector<void*>>> free_;
};

template <typename T>
struct ArenaAllocator {
  using value_type = T;
  explicit ArenaAllocator(HandlerArena* a) : arena(a) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& o) : arena(o.arena) {}
  T* allocate(size_t n) { return static_cast<T*>(arena->Allocate(sizeof(T) * n)); }
  void deallocate(T* p, size_t n) { arena->Deallocate(p, sizeof(T) * n); }
  template <typename U>
  bool operator==(const ArenaAllocator<U>& o) const {
    return arena == o.arena;
  }
  HandlerArena* arena;
};

// Client sends 64 bytes, server echoes them, client checks and sends the next:
// one round trip = two messages = four completions (two sends, two receives).
// With kArena, every handler carries an ArenaAllocator.
template <bool kArena>
struct PingPong {
  Connection* client = nullptr;
  Connection* server = nullptr;
  int warmup = 0;
  int measured = 0;
  int round_trips = 0;
  std::string failure;
  // 64 bytes a message, or 64 and `large` in turn.
  size_t large = 0;
  std::vector<std::byte> payload = std::vector<std::byte>(64);
  std::function<void()> on_done;
  HandlerArena arena;

  bool done() const { return !failure.empty() || round_trips == warmup + measured; }

  template <typename F>
  auto Wrap(F f) {
    if constexpr (kArena) {
      return asio::bind_allocator(ArenaAllocator<void>(&arena), std::move(f));
    } else {
      return f;
    }
  }

  void Fail(std::string what) {
    g_counting = false;
    if (failure.empty()) failure = std::move(what);
    on_done();
  }

  void ServeOne() {
    server->Receive(Wrap([this](absl::StatusOr<Message> m) {
      if (!m.ok()) return Fail(absl::StrCat("server receive: ", m.status().ToString()));
      absl::StatusOr<SendBuffer> reply = server->Prepare(m->size());
      if (!reply.ok()) return Fail(absl::StrCat("server prepare: ", reply.status().ToString()));
      std::memcpy(reply->data().data(), m->data().data(), m->size());
      m->Reset();
      server->Send(std::move(*reply), Wrap([this](absl::Status s) {
                     if (!s.ok()) Fail(absl::StrCat("server send: ", s.ToString()));
                   }));
      ServeOne();
    }));
  }

  void RoundTrip() {
    // The window opens and closes inside handlers, so only the steady state
    // is counted.
    if (round_trips == warmup) g_counting = true;
    if (round_trips == warmup + measured) {
      g_counting = false;
      on_done();
      return;
    }
    payload.resize(large != 0 && round_trips % 2 == 1 ? large : 64);
    payload[0] = static_cast<std::byte>(round_trips);
    absl::StatusOr<SendBuffer> request = client->Prepare(payload.size());
    if (!request.ok()) return Fail(absl::StrCat("client prepare: ", request.status().ToString()));
    std::memcpy(request->data().data(), payload.data(), payload.size());
    client->Send(std::move(*request), Wrap([this](absl::Status s) {
                   if (!s.ok()) Fail(absl::StrCat("client send: ", s.ToString()));
                 }));
    client->Receive(Wrap([this](absl::StatusOr<Message> m) {
      if (!m.ok()) return Fail(absl::StrCat("client receive: ", m.status().ToString()));
      if (m->size() != payload.size() || std::memcmp(m->data().data(), payload.data(), payload.size()) != 0) {
        return Fail(absl::StrCat("echo of round trip ", round_trips, " differs"));
      }
      m->Reset();
      ++round_trips;
      RoundTrip();
    }));
  }
};

struct AllocationCount {
  uint64_t new_calls = 0;
  uint64_t malloc_calls = 0;
  int messages = 0;
  double new_per_message() const { return static_cast<double>(new_calls) / messages; }
  double malloc_per_message() const { return static_cast<double>(malloc_calls) / messages; }
};

class TcpAllocationTest : public TcpTransportTest {
 protected:
  template <bool kArena>
  AllocationCount Measure(size_t large = 0) {
    auto listener = MustListen();
    EXPECT_NE(listener, nullptr);
    if (listener == nullptr) return {};
    auto [client, server] = ConnectPair(*listener);
    EXPECT_NE(client, nullptr);
    if (client == nullptr) return {};

    PingPong<kArena> p;
    p.client = client.get();
    p.server = server.get();
    p.warmup = 1000;
    p.measured = 10'000;
    p.large = large;
    // Driven by one io_context::run(), as an application would: Asio's
    // per-thread recycling cache lives as long as the run() call (RunUntil's
    // run_one_for() would start every handler with a cold cache).
    p.on_done = [this] { io_.stop(); };
    asio::steady_timer watchdog(io_, std::chrono::seconds(120));
    watchdog.async_wait([this](boost::system::error_code ec) {
      if (!ec) io_.stop();
    });
    g_new_calls = 0;
    g_malloc_calls = 0;
    io_.restart();
    asio::post(io_, [&p] {
      p.ServeOne();
      p.RoundTrip();
    });
    io_.run();
    g_counting = false;
    watchdog.cancel();
    EXPECT_TRUE(p.done()) << "watchdog fired after " << p.round_trips << " round trips";
    EXPECT_EQ(p.failure, "");
    AllocationCount count{g_new_calls.load(), g_malloc_calls.load(), 2 * p.measured};
    std::printf("%s handlers, %d messages: operator new %.2f/message, malloc family %.2f/message\n",
                kArena ? "allocator-bound" : "plain", count.messages, count.new_per_message(),
                count.malloc_per_message());
    // Close and let the cancellations run before the connections go.
    client->Close();
    server->Close();
    io_.restart();
    io_.poll();
    return count;
  }
};

// Steady-state heap allocations per 64-byte round trip, measured:
//  - plain handlers: 0 operator new, 1.5 malloc-family calls per message.
//    The mallocs are misses of Asio 1.81's recycling allocator (aligned_alloc),
//    which backs any_completion_handler's storage and posted ops: it caches two
//    blocks per thread per purpose, and the four completions of a round trip
//    overflow it.
//  - handlers carrying an allocator (second test): 0 and 0. The backend's own
//    steady path (pooled buffers, per-connection memory for socket ops, FIFOs
//    that keep their capacity) allocates nothing.
// PostCompletion (transport/completion.h) posts to the concrete io_context
// executor; through any_io_executor, Boost 1.81 heap-allocates two executor
// wrappers per completion (4 operator new per message, measured before).
// The bounds are the measured values: any new allocation fails the test.
TEST_F(TcpAllocationTest, SteadyStateRoundTripsAllocateOnlyInAsiosRecyclingCache) {
#if !RDMARPC_COUNT_ALLOCATIONS
  GTEST_SKIP() << "allocation counting is off under sanitizers";
#else
  AllocationCount count = Measure<false>();
  ASSERT_GT(count.messages, 0);
  RecordProperty("new_per_message_x100", static_cast<int>(count.new_per_message() * 100));
  RecordProperty("malloc_per_message_x100", static_cast<int>(count.malloc_per_message() * 100));
  EXPECT_EQ(count.new_calls, 0u) << "operator new on the steady path";
  EXPECT_LE(count.malloc_calls, 2u * count.messages) << "malloc beyond Asio's recycling-cache misses";
#endif
}

// Small and large messages in turn each find a kept buffer of their size
// (the pool keeps one free list per power-of-two size): steady mixed-size
// traffic allocates nothing. (A buffer filed under the wrong size allocated
// one buffer a message here.)
TEST_F(TcpAllocationTest, SmallAndLargeMessagesInTurnAllocateNothing) {
#if !RDMARPC_COUNT_ALLOCATIONS
  GTEST_SKIP() << "allocation counting is off under sanitizers";
#else
  AllocationCount count = Measure<true>(20'000);
  ASSERT_GT(count.messages, 0);
  EXPECT_EQ(count.malloc_calls, 0u);
  EXPECT_EQ(count.new_calls, 0u);
#endif
}

TEST_F(TcpAllocationTest, WithHandlerAllocatorsNothingAllocates) {
#if !RDMARPC_COUNT_ALLOCATIONS
  GTEST_SKIP() << "allocation counting is off under sanitizers";
#else
  AllocationCount count = Measure<true>();
  ASSERT_GT(count.messages, 0);
  EXPECT_EQ(count.malloc_calls, 0u);
  EXPECT_EQ(count.new_calls, 0u);
#endif
}

}  // namespace
}  // namespace rdmarpc::transport::tcp
