#include "tests/rpc/rpc_suite.h"

#include <atomic>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/deferred.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <boost/system/system_error.hpp>

#include "rdmarpc/test/rpc_test.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/frame.h"
#include "rpc/server.h"
#include "transport/uri.h"

namespace rdmarpc::testing {
namespace {

namespace asio = boost::asio;
using rdmarpc::test::Empty;
using rdmarpc::test::FailRequest;
using rdmarpc::test::MetadataReply;
using rdmarpc::test::Payload;
using rdmarpc::test::SleepRequest;
using TestSvc = rdmarpc::test::Test;
using std::chrono::milliseconds;

class TestService final : public TestSvc::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext&, const Payload& request, Payload& response) override {
    ++coroutine_echoes;
    response = request;
    co_return Status();
  }
  // With inline_mode: echoes whose data starts with "inline:" are answered by
  // the inline fast path, the others fall back to Echo() above.
  std::optional<Status> EchoInline(ServerContext&, const Payload& request, Payload& response) override {
    if (!inline_mode || !request.data().starts_with("inline:")) return std::nullopt;
    ++inline_echoes;
    inline_thread = std::this_thread::get_id();
    response = request;
    return Status();
  }
  std::optional<Status> MetadataInline(ServerContext& ctx, const Empty&, MetadataReply& reply) override {
    if (!inline_mode) return std::nullopt;
    for (const auto& [k, v] : ctx.metadata()) reply.add_entries("inline:" + k + "=" + v);
    reply.set_peer(ctx.peer());
    reply.set_has_deadline(ctx.deadline().has_value());
    return Status();
  }
  std::optional<Status> FailInline(ServerContext&, const FailRequest& request, Empty&) override {
    if (!inline_mode) return std::nullopt;
    return Status(static_cast<StatusCode>(request.code()), "inline: " + request.message());
  }
  std::optional<Status> ThrowInline(ServerContext&, const Empty&, Empty&) override {
    if (inline_mode) throw std::runtime_error("boom from the inline handler");
    return std::nullopt;
  }
  asio::awaitable<Status> Sleep(ServerContext& ctx, const SleepRequest& request, Empty&) override {
    ++sleeps_started;
    asio::steady_timer timer(co_await asio::this_coro::executor, milliseconds(request.ms()));
    try {
      auto [ec] = co_await timer.async_wait(asio::as_tuple(asio::use_awaitable));
      if (ec) {
        Observe(ctx);
        co_return CancelledError("sleep interrupted");
      }
    } catch (const boost::system::system_error&) {
      Observe(ctx);
      throw;
    }
    ++sleeps_finished;
    co_return Status();
  }
  asio::awaitable<Status> Metadata(ServerContext& ctx, const Empty&, MetadataReply& reply) override {
    for (const auto& [k, v] : ctx.metadata()) reply.add_entries(k + "=" + v);
    reply.set_peer(ctx.peer());
    reply.set_has_deadline(ctx.deadline().has_value());
    co_return Status();
  }
  asio::awaitable<Status> Fail(ServerContext&, const FailRequest& request, Empty&) override {
    co_return Status(static_cast<StatusCode>(request.code()), request.message());
  }
  asio::awaitable<Status> Throw(ServerContext&, const Empty&, Empty&) override {
    throw std::runtime_error("boom from the handler");
    co_return Status();
  }

  std::atomic<int> sleeps_started{0};
  std::atomic<int> sleeps_finished{0};
  std::atomic<int> sleeps_cancelled{0};
  std::atomic<StatusCode> cancel_reason{StatusCode::kOk};
  std::atomic<bool> inline_mode{false};
  std::atomic<int> coroutine_echoes{0};
  std::atomic<int> inline_echoes{0};
  std::atomic<std::thread::id> inline_thread{};

 private:
  void Observe(const ServerContext& ctx) {
    cancel_reason = ctx.cancel_reason();
    ++sleeps_cancelled;
  }
};

// One io_context on a background thread runs server and channel; the test
// thread starts calls (they hop to the channel's executor) and waits on futures.
class Env {
 public:
  explicit Env(const RpcTransport& t) : transport_(t), work_(asio::make_work_guard(io_)) {
    thread_ = std::thread([this] { io_.run(); });
  }
  ~Env() {
    OnIo([this] {
      channels_.clear();
      servers_.clear();
      return 0;
    });
    work_.reset();
    // Let closes and cancellations drain, then stop whatever is left.
    auto stopper = std::async(std::launch::async, [this] {
      std::this_thread::sleep_for(milliseconds(200));
      io_.stop();
    });
    thread_.join();
  }

  template <typename F>
  auto OnIo(F f) -> decltype(f()) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto fut = task.get_future();
    asio::post(io_, [&task] { task(); });
    if (fut.wait_for(kRpcWait) != std::future_status::ready) {
      ADD_FAILURE() << "io thread did not run the task within " << kRpcWait.count() << " s";
      std::abort();  // the task references this frame: cannot return
    }
    return fut.get();
  }

  // Starts a server on `uri` (default: the transport's, port 0); returns its URI.
  std::string StartServer(std::string uri = "", std::function<void(ServerOptions&)> tweak = {}) {
    return OnIo([&] {
      ServerOptions options;
      options.listen = {uri.empty() ? transport_.listen_uri : uri};
      options.transport = transport_.options();
      if (tweak) tweak(options);
      auto server = std::make_unique<Server>(io_.get_executor(), options);
      EXPECT_TRUE(server->AddService(service).ok());
      Status st = server->Start();
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return std::string();
      std::string local = server->local_uris().at(0);
      servers_.push_back(std::move(server));
      return local;
    });
  }
  Server& server(size_t i = 0) { return *servers_.at(i); }
  void StopServers() {
    OnIo([this] {
      servers_.clear();
      return 0;
    });
  }

  std::shared_ptr<Channel> NewChannel(const std::string& uri, std::function<void(ChannelOptions&)> tweak = {}) {
    return OnIo([&] {
      ChannelOptions options;
      options.transport = transport_.options();
      if (tweak) tweak(options);
      auto ch = Channel::Create(io_.get_executor(), uri, options);
      EXPECT_TRUE(ch.ok()) << ch.status();
      channels_.push_back(*ch);
      return *ch;
    });
  }

  asio::io_context& io() { return io_; }
  bool OnIoThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  TestService service;

 private:
  RpcTransport transport_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  std::vector<std::unique_ptr<Server>> servers_;
  std::vector<std::shared_ptr<Channel>> channels_;
};

template <typename T>
T Get(std::future<T>& f) {
  if (f.wait_for(kRpcWait) != std::future_status::ready) {
    ADD_FAILURE() << "call did not complete within " << kRpcWait.count() << " s";
    std::abort();  // the pending call references this frame
  }
  return f.get();
}

std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    s[i] = static_cast<char>(x);
  }
  return s;
}

// A completion handler that fulfils a future with (error_code, Resp). (Boost
// 1.81's as_tuple(use_future) does not compile.)
template <typename Resp>
struct Pending {
  using Result = std::tuple<boost::system::error_code, Resp>;
  std::shared_ptr<std::promise<Result>> promise = std::make_shared<std::promise<Result>>();
  std::future<Result> future = promise->get_future();
  auto token() {
    return [p = promise](boost::system::error_code ec, Resp r) { p->set_value(Result(ec, std::move(r))); };
  }
};

// A call through the generated stub, waited for from the test thread.
template <typename Resp, typename Call>
std::pair<StatusCode, Resp> Sync(Call&& start) {
  Pending<Resp> pending;
  start(pending.token());
  auto [ec, resp] = Get(pending.future);
  return {ToStatusCode(ec), std::move(resp)};
}

// Raw transport connections (no channel) for speaking frames at a server.
std::unique_ptr<transport::Connection> RawConnect(Env& env, const std::string& uri_text, TransportOptions opts) {
  auto uri = transport::ParseUri(uri_text);
  EXPECT_TRUE(uri.ok()) << uri.status();
  if (!uri.ok()) return nullptr;
  std::promise<std::unique_ptr<transport::Connection>> p;
  env.OnIo([&] {
    ConnectTo(env.io().get_executor(), *uri, opts, [&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
      EXPECT_TRUE(c.ok()) << c.status();
      p.set_value(c.ok() ? std::move(*c) : nullptr);
    });
    return 0;
  });
  auto f = p.get_future();
  return Get(f);
}

absl::Status RawSend(Env& env, transport::Connection* c, std::string bytes) {
  std::promise<absl::Status> p;
  env.OnIo([&] {
    c->async_send(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())),
                  [&](absl::Status s) { p.set_value(s); });
    return 0;
  });
  auto f = p.get_future();
  return Get(f);
}

absl::StatusOr<std::string> RawReceive(Env& env, transport::Connection* c) {
  std::promise<absl::StatusOr<std::string>> p;
  env.OnIo([&] {
    c->async_receive([&](absl::StatusOr<transport::Message> m) {
      if (!m.ok()) return p.set_value(m.status());
      p.set_value(std::string(reinterpret_cast<const char*>(m->data().data()), m->size()));
    });
    return 0;
  });
  auto f = p.get_future();
  return Get(f);
}

std::string RawFrame(rpc::FrameHeader h, const std::string& payload) {
  h.payload_length = static_cast<uint32_t>(payload.size());
  std::string out(rpc::kFrameHeaderSize + payload.size(), '\0');
  rpc::EncodeFrameHead(h, {}, std::as_writable_bytes(std::span<char>(out.data(), out.size())));
  std::copy(payload.begin(), payload.end(), out.begin() + rpc::kFrameHeaderSize);
  return out;
}

// One REQUEST frame for `method_id`, `call_id` on a raw connection.
absl::Status RawRequest(Env& env, transport::Connection* c, uint32_t method_id, uint64_t call_id,
                        const std::string& payload, uint64_t timeout_us = 0) {
  rpc::FrameHeader h;
  h.type = rpc::FrameType::kRequest;
  h.method_id = method_id;
  h.call_id = call_id;
  h.timeout_us = timeout_us;
  return RawSend(env, c, RawFrame(h, payload));
}

// Starts a Sleep of a minute and returns once the server's handler runs it.
void StartLongSleep(Env& env, TestSvc::Stub& stub, ClientContext& ctx, Pending<Empty>& pending) {
  SleepRequest req;
  req.set_ms(60'000);
  stub.async_Sleep(ctx, req, pending.token());
  for (int i = 0; i < 3000 && env.service.sleeps_started == 0; ++i) std::this_thread::sleep_for(milliseconds(5));
  ASSERT_EQ(env.service.sleeps_started, 1) << "the server never started the handler";
}

TEST_P(RpcSuite, UnaryEchoKeepsEveryByteFromEmptyTo16MiB) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  for (size_t size : {size_t{0}, size_t{1}, size_t{100}, size_t{4095}, size_t{4096}, size_t{4097},
                      size_t{65536}, size_t{1} << 20, size_t{16} << 20}) {
    Payload req;
    req.set_data(Pattern(size, static_cast<uint32_t>(size)));
    req.mutable_meta()->set_seq(size);
    ClientContext ctx;
    auto [code, resp] = Sync<Payload>([&](auto token) { return stub.async_Echo(ctx, req, token); });
    ASSERT_EQ(code, StatusCode::kOk) << size << ": " << ctx.status().ToString();
    EXPECT_EQ(resp.meta().seq(), size);
    ASSERT_EQ(resp.data().size(), size);
    EXPECT_TRUE(resp.data() == req.data()) << "payload of " << size << " bytes corrupted";
  }
}

TEST_P(RpcSuite, ThousandConcurrentCallsOnOneChannelEachGetTheirOwnAnswer) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  constexpr int kCalls = 1000;
  struct Slot {
    ClientContext ctx;
    Payload req;
  };
  std::vector<Slot> slots(kCalls);
  std::promise<void> all_done;
  std::atomic<int> done{0}, ok{0}, matched{0};
  int max_in_flight = 0;
  env.OnIo([&] {
    for (int i = 0; i < kCalls; ++i) {
      slots[i].req.set_data(Pattern(static_cast<size_t>(i % 300), static_cast<uint32_t>(i)));
      slots[i].req.mutable_meta()->set_seq(static_cast<uint64_t>(i));
      stub.async_Echo(slots[i].ctx, slots[i].req, [&, i](boost::system::error_code ec, Payload resp) {
        if (!ec) ++ok;
        if (resp.meta().seq() == static_cast<uint64_t>(i) && resp.data() == slots[i].req.data()) ++matched;
        if (++done == kCalls) all_done.set_value();
      });
    }
    // All 1000 were started before any completed (handlers never run inline).
    max_in_flight = kCalls - done.load();
    return 0;
  });
  auto f = all_done.get_future();
  ASSERT_EQ(f.wait_for(kRpcWait), std::future_status::ready) << done << " of " << kCalls << " completed";
  EXPECT_EQ(max_in_flight, kCalls);
  EXPECT_EQ(ok, kCalls);
  EXPECT_EQ(matched, kCalls);
  EXPECT_EQ(env.OnIo([&] { return channel->stats().connects; }), 1u);
}

// Calls queued while the channel connects leave together once it is up, and
// so do calls started in a Channel::Batch: one doorbell (RDMA: one
// ibv_post_send) or one sendmsg() (TCP) for the lot, not one a call.
TEST_P(RpcSuite, QueuedCallsAndABatchOfCallsShareOneDoorbell) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer(), [](ChannelOptions& o) { o.keepalive.interval = milliseconds(0); });
  TestSvc::Stub stub(channel);
  constexpr int kCalls = 16;
  std::vector<ClientContext> contexts(2 * kCalls);
  Payload req;
  req.set_data(Pattern(48, 7));
  std::atomic<int> done{0}, ok{0};
  std::promise<void> round_done;
  auto start = [&](int i) {
    stub.async_Echo(contexts[static_cast<size_t>(i)], req, [&](boost::system::error_code ec, Payload resp) {
      if (!ec && resp.data() == req.data()) ++ok;
      if (++done % kCalls == 0) round_done.set_value();
    });
  };
  // Round 1: a fresh channel queues them until it is connected.
  env.OnIo([&] {
    for (int i = 0; i < kCalls; ++i) start(i);
    return 0;
  });
  auto f1 = round_done.get_future();
  ASSERT_EQ(f1.wait_for(kRpcWait), std::future_status::ready) << done << " of " << kCalls << " completed";
  ASSERT_EQ(ok, kCalls);
  auto first = env.OnIo([&] { return channel->connection_stats(); });
  ASSERT_TRUE(first.has_value());
  EXPECT_GE(first->messages_sent, uint64_t{kCalls});
  // One for the queued calls; RDMA may add a CREDIT frame or two for the
  // receives the answers used. One a call would be 16.
  EXPECT_LE(first->send_doorbells, uint64_t{3}) << "the queued calls did not leave together";
  // Round 2: connected; a Batch around the loop.
  round_done = std::promise<void>();
  auto f2 = round_done.get_future();
  const auto [before, after] = env.OnIo([&] {
    const uint64_t b = channel->connection_stats()->send_doorbells;
    {
      Channel::Batch batch(*channel);
      for (int i = kCalls; i < 2 * kCalls; ++i) start(i);
      EXPECT_EQ(channel->connection_stats()->send_doorbells, b) << "a call left before the batch ended";
    }
    return std::pair(b, channel->connection_stats()->send_doorbells);
  });
  EXPECT_EQ(after - before, uint64_t{1}) << "the batch's calls did not share a doorbell";
  ASSERT_EQ(f2.wait_for(kRpcWait), std::future_status::ready) << done << " of " << 2 * kCalls << " completed";
  EXPECT_EQ(ok, 2 * kCalls);
  // A Batch made off the channel's thread does nothing (and holds nothing).
  { Channel::Batch off_thread(*channel); }
  ClientContext last;
  auto [code, resp] = Sync<Payload>([&](auto token) { stub.async_Echo(last, req, std::move(token)); });
  EXPECT_EQ(code, StatusCode::kOk);
}

TEST_P(RpcSuite, DeadlineExceededEndsTheCallOnTimeAndCancelsTheHandler) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext warm;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(warm, Payload(), t); }).first, StatusCode::kOk);

  SleepRequest req;
  req.set_ms(30'000);
  ClientContext ctx;
  // The deadline is anchored when set_timeout runs, so the clock starts before it.
  const auto start = Clock::now();
  ctx.set_timeout(milliseconds(300));
  auto [code, resp] = Sync<Empty>([&](auto t) { return stub.async_Sleep(ctx, req, t); });
  const auto finished = Clock::now();
  const auto took = finished - start;
  EXPECT_EQ(code, StatusCode::kDeadlineExceeded) << ctx.status().ToString();
  ASSERT_TRUE(ctx.deadline().has_value());
  EXPECT_GE(finished, *ctx.deadline()) << "the call ended before its deadline";
  EXPECT_LT(took, milliseconds(300) + std::chrono::seconds(5)) << "deadline fired late";
  // The server stopped the handler too, as a deadline whichever came first:
  // its own timer or the client's CANCEL (which says DEADLINE_EXCEEDED).
  for (int i = 0; i < 500 && env.service.sleeps_cancelled == 0; ++i) std::this_thread::sleep_for(milliseconds(10));
  EXPECT_EQ(env.service.sleeps_cancelled, 1);
  EXPECT_EQ(env.service.sleeps_finished, 0);
  EXPECT_EQ(env.service.cancel_reason.load(), StatusCode::kDeadlineExceeded)
      << StatusCodeName(env.service.cancel_reason.load());
}

// A CANCEL carries the client's reason: one that says DEADLINE_EXCEEDED (the
// client's timer beat the server's by the transit time) ends the handler as a
// deadline, not a cancellation, however far the server's own deadline is.
TEST_P(RpcSuite, CancelFrameSaysWhetherTheClientsDeadlinePassed) {
  Env env(GetParam());
  auto uri = env.StartServer();
  auto raw = RawConnect(env, uri, GetParam().options());
  ASSERT_NE(raw, nullptr);
  SleepRequest req;
  req.set_ms(60'000);
  for (uint64_t id : {1, 2}) {
    ASSERT_TRUE(RawRequest(env, raw.get(), TestSvc::kSleepId, id, req.SerializeAsString(), 60'000'000).ok());
    for (int i = 0; i < 3000 && env.service.sleeps_started < static_cast<int>(id); ++i)
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_EQ(env.service.sleeps_started, static_cast<int>(id));
    rpc::FrameHeader cancel;
    cancel.type = rpc::FrameType::kCancel;
    cancel.call_id = id;
    cancel.status = id == 1 ? StatusCode::kDeadlineExceeded : StatusCode::kCancelled;
    ASSERT_TRUE(RawSend(env, raw.get(), RawFrame(cancel, "")).ok());
    for (int i = 0; i < 1000 && env.service.sleeps_cancelled < static_cast<int>(id); ++i)
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_EQ(env.service.sleeps_cancelled, static_cast<int>(id));
    EXPECT_EQ(env.service.cancel_reason.load(), id == 1 ? StatusCode::kDeadlineExceeded : StatusCode::kCancelled);
  }
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().connections_open; }), 1u) << "a valid CANCEL closed the connection";
  env.OnIo([&] {
    raw->Close();
    raw.reset();
    return 0;
  });
}

TEST_P(RpcSuite, ClientTimerFiresEvenWhenThePeerNeverAnswers) {
  // A "server" that accepts connections and reads requests but never answers.
  Env env(GetParam());
  auto opts = GetParam().options();
  auto uri = transport::ParseUri(GetParam().listen_uri);
  ASSERT_TRUE(uri.ok());
  std::unique_ptr<transport::Listener> listener;
  std::vector<std::unique_ptr<transport::Connection>> accepted;
  std::string local = env.OnIo([&] {
    auto l = ListenOn(env.io().get_executor(), *uri, opts);
    EXPECT_TRUE(l.ok()) << l.status();
    listener = std::move(*l);
    listener->Accept([&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
      if (c.ok()) accepted.push_back(std::move(*c));  // never Receive()d
    });
    return listener->local_uri();
  });
  auto channel = env.NewChannel(local);
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  ctx.set_timeout(milliseconds(500));
  Payload req;
  req.set_data("anyone there?");
  const auto start = Clock::now();
  auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(ctx, req, t); });
  EXPECT_EQ(code, StatusCode::kDeadlineExceeded) << ctx.status().ToString();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(6));
  env.OnIo([&] {
    channel->Close();
    for (auto& c : accepted) c->Close();
    listener->Close();
    return 0;
  });
  env.OnIo([&] {  // next turn: the closes have run
    accepted.clear();
    listener.reset();
    return 0;
  });
}

// A channel reuses its call slots; a late answer to a call that already ended
// (its deadline passed) must not complete the next call in the same slot, and
// no two calls may go out under one id (the server refuses an id in flight).
// A raw peer plays the server: it answers late, then out of order.
TEST_P(RpcSuite, ALateAnswerNeverCompletesTheNextCallInTheSameSlot) {
  Env env(GetParam());
  auto opts = GetParam().options();
  auto uri = transport::ParseUri(GetParam().listen_uri);
  ASSERT_TRUE(uri.ok());
  std::unique_ptr<transport::Listener> listener;
  std::promise<std::unique_ptr<transport::Connection>> accepted_p;
  std::string local = env.OnIo([&] {
    auto l = ListenOn(env.io().get_executor(), *uri, opts);
    EXPECT_TRUE(l.ok()) << l.status();
    listener = std::move(*l);
    listener->Accept([&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
      EXPECT_TRUE(c.ok()) << c.status();
      accepted_p.set_value(c.ok() ? std::move(*c) : nullptr);
    });
    return listener->local_uri();
  });
  auto channel = env.NewChannel(local);
  TestSvc::Stub stub(channel);
  // Reads the next request frame the channel sent: its call id.
  std::unique_ptr<transport::Connection> peer;
  auto next_request_id = [&]() -> uint64_t {
    for (;;) {
      auto bytes = RawReceive(env, peer.get());
      EXPECT_TRUE(bytes.ok()) << bytes.status();
      if (!bytes.ok()) return 0;
      rpc::DecodedFrame f;
      EXPECT_TRUE(rpc::DecodeFrame(std::as_bytes(std::span<const char>(bytes->data(), bytes->size())), f).ok());
      if (f.header.type == rpc::FrameType::kRequest) return f.header.call_id;
    }
  };
  auto answer = [&](uint64_t id, const std::string& data) {
    Payload p;
    p.set_data(data);
    rpc::FrameHeader h;
    h.type = rpc::FrameType::kResponse;
    h.call_id = id;
    return RawSend(env, peer.get(), RawFrame(h, p.SerializeAsString()));
  };

  // Call 1 times out unanswered.
  ClientContext ctx1;
  ctx1.set_timeout(milliseconds(300));
  Pending<Payload> first;
  env.OnIo([&] {
    stub.async_Echo(ctx1, Payload(), first.token());
    return 0;
  });
  auto accepted_f = accepted_p.get_future();
  peer = Get(accepted_f);
  ASSERT_NE(peer, nullptr);
  const uint64_t id1 = next_request_id();
  EXPECT_EQ(ToStatusCode(std::get<0>(Get(first.future))), StatusCode::kDeadlineExceeded);

  // Calls 2 and 3 start; one of them takes call 1's slot.
  ClientContext ctx2, ctx3;
  Pending<Payload> second, third;
  env.OnIo([&] {
    stub.async_Echo(ctx2, Payload(), second.token());
    stub.async_Echo(ctx3, Payload(), third.token());
    return 0;
  });
  const uint64_t id2 = next_request_id();
  const uint64_t id3 = next_request_id();
  EXPECT_NE(id2, id1);
  EXPECT_NE(id3, id1);
  EXPECT_NE(id2, id3);

  // The late answer to call 1, then the answers to 3 and 2, out of order.
  ASSERT_TRUE(answer(id1, "late").ok());
  ASSERT_TRUE(answer(id3, "three").ok());
  ASSERT_TRUE(answer(id2, "two").ok());
  auto [ec3, r3] = Get(third.future);
  auto [ec2, r2] = Get(second.future);
  EXPECT_FALSE(ec2) << ec2.message();
  EXPECT_FALSE(ec3) << ec3.message();
  EXPECT_EQ(r2.data(), "two");
  EXPECT_EQ(r3.data(), "three");
  EXPECT_EQ(env.OnIo([&] { return channel->stats().late_responses; }), 1u);
  env.OnIo([&] {
    channel->Close();
    peer->Close();
    listener->Close();
    return 0;
  });
  env.OnIo([&] {
    peer.reset();
    listener.reset();
    return 0;
  });
}

TEST_P(RpcSuite, CancellationSlotAbortsTheCallAndTellsTheServer) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  asio::cancellation_signal signal;
  SleepRequest req;
  req.set_ms(30'000);
  ClientContext ctx;
  std::promise<boost::system::error_code> result;
  env.OnIo([&] {
    stub.async_Sleep(ctx, req,
                     asio::bind_cancellation_slot(signal.slot(), [&](boost::system::error_code ec, Empty) {
                       result.set_value(ec);
                     }));
    return 0;
  });
  for (int i = 0; i < 3000 && env.service.sleeps_started == 0; ++i) std::this_thread::sleep_for(milliseconds(10));
  ASSERT_EQ(env.service.sleeps_started, 1);
  env.OnIo([&] {
    signal.emit(asio::cancellation_type::terminal);
    return 0;
  });
  auto f = result.get_future();
  auto ec = Get(f);
  EXPECT_EQ(ToStatusCode(ec), StatusCode::kCancelled);
  EXPECT_EQ(ctx.status().code(), StatusCode::kCancelled);
  for (int i = 0; i < 500 && env.service.sleeps_cancelled == 0; ++i) std::this_thread::sleep_for(milliseconds(10));
  EXPECT_EQ(env.service.sleeps_cancelled, 1) << "the server's handler was not cancelled";
  EXPECT_EQ(env.service.cancel_reason.load(), StatusCode::kCancelled);
  // The channel is still good.
  ClientContext again;
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(again, Payload(), t); }).first, StatusCode::kOk);
}

TEST_P(RpcSuite, UnknownMethodIsUnimplementedAndNamesWhatIsServed) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  rdmarpc::test::Unserved::Stub stub(channel);
  ClientContext ctx;
  auto [code, resp] = Sync<Empty>([&](auto t) { return stub.async_Nothing(ctx, Empty(), t); });
  EXPECT_EQ(code, StatusCode::kUnimplemented);
  EXPECT_NE(ctx.status().message().find("rdmarpc.test.Test"), std::string::npos) << ctx.status().message();
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().unknown_methods; }), 1u);
}

// The server remembers each connection's last method (no hash lookup when
// the next call goes to the same one): calls that alternate between methods,
// and an unknown one between them, on one connection still each reach their
// own handler and are counted to their own method.
TEST_P(RpcSuite, CallsAlternatingBetweenMethodsOnOneConnectionEachReachTheirOwn) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  rdmarpc::test::Unserved::Stub unserved(channel);
  int echoes = 0, fails = 0;
  for (int i = 0; i < 6; ++i) {
    if (i % 3 != 2) {
      Payload req;
      req.set_data(absl::StrCat("call ", i));
      ClientContext ctx;
      auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(ctx, req, t); });
      ASSERT_EQ(code, StatusCode::kOk) << "call " << i << ": " << ctx.status().ToString();
      EXPECT_EQ(resp.data(), req.data()) << "call " << i;
      ++echoes;
    }
    if (i % 2 == 1) {
      FailRequest req;
      req.set_code(static_cast<uint32_t>(StatusCode::kNotFound));
      req.set_message(absl::StrCat("fail ", i));
      ClientContext ctx;
      EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Fail(ctx, req, t); }).first, StatusCode::kNotFound);
      EXPECT_EQ(ctx.status().message(), req.message());
      ++fails;
    }
    if (i == 3) {
      ClientContext ctx;
      EXPECT_EQ(Sync<Empty>([&](auto t) { return unserved.async_Nothing(ctx, Empty(), t); }).first,
                StatusCode::kUnimplemented);
    }
  }
  env.OnIo([&] {
    const MethodMetrics* echo = env.server().metrics().Find("rdmarpc.test.Test/Echo");
    const MethodMetrics* fail = env.server().metrics().Find("rdmarpc.test.Test/Fail");
    EXPECT_EQ(echo != nullptr ? echo->calls() : ~uint64_t{0}, static_cast<uint64_t>(echoes));
    EXPECT_EQ(fail != nullptr ? fail->calls() : ~uint64_t{0}, static_cast<uint64_t>(fails));
    EXPECT_EQ(env.server().stats().unknown_methods, 1u);
    return 0;
  });
}

TEST_P(RpcSuite, AStreamingMethodTheServiceDoesNotImplementEndsUnimplemented) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  Pending<ClientReader<Payload>> pending;
  stub.async_Stream(ctx, Payload(), pending.token());
  auto [ec, reader] = Get(pending.future);
  ASSERT_FALSE(ec) << ctx.status().ToString();  // the stream opens; its handler answers
  std::promise<boost::system::error_code> read;
  Payload p;
  reader.async_read(p, [&](boost::system::error_code e) { read.set_value(e); });
  auto f = read.get_future();
  EXPECT_EQ(ToStatusCode(Get(f)), StatusCode::kUnimplemented);
  EXPECT_NE(ctx.status().message().find("not implemented by this server"), std::string::npos) << ctx.status().message();
}

TEST_P(RpcSuite, MetadataDeadlineAndPeerReachTheHandler) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  ctx.AddMetadata("tenant", "acme");
  ctx.AddMetadata("trace-id", std::string(300, 'x'));
  ctx.set_timeout(std::chrono::seconds(30));
  auto [code, reply] = Sync<MetadataReply>([&](auto t) { return stub.async_Metadata(ctx, Empty(), t); });
  ASSERT_EQ(code, StatusCode::kOk) << ctx.status().ToString();
  ASSERT_EQ(reply.entries_size(), 2);
  EXPECT_EQ(reply.entries(0), "tenant=acme");
  EXPECT_EQ(reply.entries(1), "trace-id=" + std::string(300, 'x'));
  EXPECT_TRUE(reply.has_deadline());
  EXPECT_FALSE(reply.peer().empty());
  EXPECT_FALSE(ctx.peer().empty());

  ClientContext bad;
  bad.AddMetadata("", "empty key");
  EXPECT_EQ(Sync<MetadataReply>([&](auto t) { return stub.async_Metadata(bad, Empty(), t); }).first,
            StatusCode::kInvalidArgument);
}

TEST_P(RpcSuite, HandlerStatusAndExceptionsReachTheClient) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  FailRequest req;
  req.set_code(static_cast<uint32_t>(StatusCode::kNotFound));
  req.set_message("no such key: k1");
  ClientContext ctx;
  EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Fail(ctx, req, t); }).first, StatusCode::kNotFound);
  EXPECT_EQ(ctx.status().message(), "no such key: k1");
  ClientContext ctx2;
  EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Throw(ctx2, Empty(), t); }).first, StatusCode::kInternal);
  EXPECT_NE(ctx2.status().message().find("boom from the handler"), std::string::npos) << ctx2.status().message();
}

TEST_P(RpcSuite, InlineFastPathAnswersOnTheServersThreadAndFallsBackToTheCoroutinePerCall) {
  Env env(GetParam());
  env.service.inline_mode = true;
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  // 600 echoes in flight at once, every other one answered inline, sizes up
  // to 1 MiB (rendezvous over RDMA): more responses than fit the send window
  // at once, so inline answers also queue for send space.
  constexpr int kCalls = 600;
  struct Slot {
    ClientContext ctx;
    Payload req;
  };
  std::vector<Slot> slots(kCalls);
  std::promise<void> all_done;
  std::atomic<int> done{0}, matched{0};
  env.OnIo([&] {
    for (int i = 0; i < kCalls; ++i) {
      const size_t size = i % 100 == 0 ? size_t{1} << 20 : static_cast<size_t>(i % 300);
      slots[i].req.set_data((i % 2 == 0 ? "inline:" : "coroutine:") + Pattern(size, static_cast<uint32_t>(i)));
      slots[i].req.mutable_meta()->set_seq(static_cast<uint64_t>(i));
      stub.async_Echo(slots[i].ctx, slots[i].req, [&, i](boost::system::error_code ec, Payload resp) {
        if (!ec && resp.meta().seq() == static_cast<uint64_t>(i) && resp.data() == slots[i].req.data()) ++matched;
        if (++done == kCalls) all_done.set_value();
      });
    }
    return 0;
  });
  auto f = all_done.get_future();
  ASSERT_EQ(f.wait_for(kRpcWait), std::future_status::ready) << done << " of " << kCalls << " completed";
  EXPECT_EQ(matched, kCalls);
  EXPECT_EQ(env.service.inline_echoes, kCalls / 2);
  EXPECT_EQ(env.service.coroutine_echoes, kCalls / 2);
  EXPECT_EQ(env.service.inline_thread.load(), env.OnIo([] { return std::this_thread::get_id(); }));

  // Context, statuses and exceptions reach the client as from a coroutine.
  ClientContext mctx;
  mctx.AddMetadata("tenant", "acme");
  mctx.set_timeout(std::chrono::seconds(30));
  auto [mcode, reply] = Sync<MetadataReply>([&](auto t) { return stub.async_Metadata(mctx, Empty(), t); });
  ASSERT_EQ(mcode, StatusCode::kOk) << mctx.status().ToString();
  ASSERT_EQ(reply.entries_size(), 1);
  EXPECT_EQ(reply.entries(0), "inline:tenant=acme");
  EXPECT_TRUE(reply.has_deadline());
  EXPECT_FALSE(reply.peer().empty());
  FailRequest fail;
  fail.set_code(static_cast<uint32_t>(StatusCode::kNotFound));
  fail.set_message("no such key: k1");
  ClientContext fctx;
  EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Fail(fctx, fail, t); }).first, StatusCode::kNotFound);
  EXPECT_EQ(fctx.status().message(), "inline: no such key: k1");
  ClientContext tctx;
  EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Throw(tctx, Empty(), t); }).first, StatusCode::kInternal);
  EXPECT_NE(tctx.status().message().find("boom from the inline handler"), std::string::npos) << tctx.status().message();

  // Inline calls are counted finished and never left in flight.
  const ServerStats st = env.OnIo([&] { return env.server().stats(); });
  EXPECT_EQ(st.calls_started, kCalls + 3u);
  EXPECT_EQ(st.calls_finished, kCalls + 3u);
  EXPECT_EQ(st.calls_in_flight, 0u);
}

TEST_P(RpcSuite, OversizedRequestIsRefusedLocallyAndLosesNothingElse) {
  Env env(GetParam());
  auto limit = [](TransportOptions& t) {
    t.tcp.max_message_size = 64 << 10;
    t.rdma.max_message_size = 64 << 10;
  };
  auto uri = env.StartServer("", [&](ServerOptions& o) { limit(o.transport); });
  auto channel = env.NewChannel(uri, [&](ChannelOptions& o) { limit(o.transport); });
  TestSvc::Stub stub(channel);
  ClientContext warm;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(warm, Payload(), t); }).first, StatusCode::kOk);
  Payload big;
  big.set_data(std::string(100 << 10, 'b'));
  ClientContext ctx;
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(ctx, big, t); }).first,
            StatusCode::kResourceExhausted);
  EXPECT_NE(ctx.status().message().find("exceeds"), std::string::npos) << ctx.status().message();
  Payload small;
  small.set_data("still fine");
  ClientContext ctx2;
  auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(ctx2, small, t); });
  EXPECT_EQ(code, StatusCode::kOk);
  EXPECT_EQ(resp.data(), "still fine");
  EXPECT_EQ(env.OnIo([&] { return channel->stats().connects; }), 1u) << "the oversized call broke the connection";
}

// Raw transport connections speaking bad frames at the server.
TEST_P(RpcSuite, GarbageFramesCloseOnlyThatConnectionAndBadRequestsGetInvalidArgument) {
  Env env(GetParam());
  auto uri_text = env.StartServer();
  auto channel = env.NewChannel(uri_text);
  TestSvc::Stub stub(channel);
  ClientContext warm;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(warm, Payload(), t); }).first, StatusCode::kOk);

  auto raw_connect = [&] { return RawConnect(env, uri_text, GetParam().options()); };
  auto send = [&](transport::Connection* c, std::string bytes) { return RawSend(env, c, std::move(bytes)); };
  auto receive = [&](transport::Connection* c) { return RawReceive(env, c); };
  auto frame = RawFrame;
  // Sends bytes the server will close the connection for. Their send
  // completes OK, or UNAVAILABLE when the server's read and close overtake
  // the report of the write (a polling TCP connection's next read pass sees
  // the EOF first): the bytes went out either way.
  auto sent_fatal = [&](transport::Connection* c, std::string bytes) {
    const absl::Status sent = send(c, std::move(bytes));
    EXPECT_TRUE(sent.ok() || absl::IsUnavailable(sent)) << sent;
    return sent.ok() || absl::IsUnavailable(sent);
  };

  // 1. A well-formed frame whose payload is not a Payload: INVALID_ARGUMENT.
  auto good = raw_connect();
  ASSERT_NE(good, nullptr);
  rpc::FrameHeader h;
  h.type = rpc::FrameType::kRequest;
  h.method_id = TestSvc::kEchoId;
  h.call_id = 7;
  ASSERT_TRUE(send(good.get(), frame(h, std::string("\xff\xff\xff\xff\xff", 5))).ok());
  auto answer = receive(good.get());
  ASSERT_TRUE(answer.ok()) << answer.status();
  rpc::DecodedFrame f;
  ASSERT_TRUE(rpc::DecodeFrame(std::as_bytes(std::span<const char>(answer->data(), answer->size())), f).ok());
  EXPECT_EQ(f.header.type, rpc::FrameType::kResponse);
  EXPECT_EQ(f.header.call_id, 7u);
  EXPECT_EQ(f.header.status, StatusCode::kInvalidArgument);

  // 2. Garbage: the server closes that connection (our receive fails)...
  auto bad = raw_connect();
  ASSERT_NE(bad, nullptr);
  ASSERT_TRUE(sent_fatal(bad.get(), "GET / HTTP/1.1\r\nHost: rdmarpc\r\n\r\n"));
  auto closed = receive(bad.get());
  EXPECT_FALSE(closed.ok()) << "server answered garbage instead of closing";
  // ... and everyone else is still served, before and after.
  Payload req;
  req.set_data("unaffected");
  ClientContext ctx;
  auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(ctx, req, t); });
  EXPECT_EQ(code, StatusCode::kOk);
  EXPECT_EQ(resp.data(), "unaffected");
  // A length that lies about the message size is just as fatal.
  rpc::FrameHeader lie = h;
  lie.call_id = 8;
  auto lying = frame(lie, "abc");
  lying[12] = '\x40';  // payload length 64 + 3, message has 3
  ASSERT_TRUE(sent_fatal(good.get(), lying));
  EXPECT_FALSE(receive(good.get()).ok());
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().bad_frames; }), 2u);
  ClientContext ctx3;
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(ctx3, req, t); }).first, StatusCode::kOk);
  env.OnIo([&] {
    good->Close();
    bad->Close();
    return 0;
  });
  env.OnIo([&] {
    good.reset();
    bad.reset();
    return 0;
  });
}

TEST_P(RpcSuite, GracefulShutdownDrainsCallsInFlightAndRefusesNewOnes) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  constexpr int kCalls = 5;
  std::vector<ClientContext> ctxs(kCalls);
  SleepRequest req;
  req.set_ms(500);
  std::vector<Pending<Empty>> futs(kCalls);
  for (int i = 0; i < kCalls; ++i) stub.async_Sleep(ctxs[i], req, futs[i].token());
  for (int i = 0; i < 3000 && env.service.sleeps_started < kCalls; ++i) std::this_thread::sleep_for(milliseconds(5));
  ASSERT_EQ(env.service.sleeps_started, kCalls);
  std::promise<void> shut;
  env.OnIo([&] {
    env.server().async_shutdown(std::chrono::seconds(20), [&] { shut.set_value(); });
    return 0;
  });
  for (auto& f : futs) EXPECT_EQ(ToStatusCode(std::get<0>(Get(f.future))), StatusCode::kOk);
  auto sf = shut.get_future();
  ASSERT_EQ(sf.wait_for(kRpcWait), std::future_status::ready) << "shutdown did not complete";
  EXPECT_EQ(env.service.sleeps_finished, kCalls);
  ClientContext late;
  auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(late, Payload(), t); });
  EXPECT_EQ(code, StatusCode::kUnavailable) << late.status().ToString();
}

TEST_P(RpcSuite, ShutdownGraceExpiryCancelsHandlersAndFailsTheirCalls) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  Pending<Empty> pending;
  StartLongSleep(env, stub, ctx, pending);
  auto& fut = pending.future;
  std::promise<void> shut;
  const auto start = Clock::now();
  env.OnIo([&] {
    env.server().async_shutdown(milliseconds(200), [&] { shut.set_value(); });
    return 0;
  });
  EXPECT_EQ(ToStatusCode(std::get<0>(Get(fut))), StatusCode::kUnavailable) << ctx.status().ToString();
  auto sf = shut.get_future();
  ASSERT_EQ(sf.wait_for(kRpcWait), std::future_status::ready);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(env.service.sleeps_cancelled, 1);
}

// A client that sends but never reads: its responses and the GOAWAY wait for
// send space (TCP) or credits (RDMA) forever. Shutdown must still complete,
// closing that connection once the grace period is over.
TEST_P(RpcSuite, ShutdownClosesAConnectionThatNeverDrainsAfterTheGracePeriod) {
  Env env(GetParam());
  auto uri = env.StartServer();
  auto channel = env.NewChannel(uri);
  TestSvc::Stub stub(channel);
  ClientContext warm;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(warm, Payload(), t); }).first, StatusCode::kOk);
  auto deaf_options = GetParam().options();
  deaf_options.tcp.max_queued_messages = 1;  // TCP: stop reading the socket after one queued message
  auto deaf = RawConnect(env, uri, deaf_options);
  ASSERT_NE(deaf, nullptr);
  Payload big;
  big.set_data(std::string(1 << 20, 'r'));
  const std::string body = big.SerializeAsString();
  constexpr int kRequests = 48;  // 48 MiB of responses: more than any socket buffer or credit window
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(RawRequest(env, deaf.get(), TestSvc::kEchoId, static_cast<uint64_t>(i + 1), body).ok());
  }
  // The server has answered what it could; the rest waits on the deaf client.
  std::this_thread::sleep_for(milliseconds(300));
  auto shut = std::make_shared<std::promise<void>>();  // outlives a failed wait
  auto sf = shut->get_future();
  const auto start = Clock::now();
  env.OnIo([&] {
    env.server().async_shutdown(milliseconds(200), [shut] { shut->set_value(); });
    return 0;
  });
  ASSERT_EQ(sf.wait_for(kRpcWait), std::future_status::ready)
      << "shutdown waited for a client that never reads";
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().connections_open; }), 0u);
  env.OnIo([&] {
    deaf->Close();
    deaf.reset();
    return 0;
  });
}

// A client that ignores GOAWAY (stays connected, a raw connection here)
// still lets a graceful shutdown finish once its last response has been
// sent: the server closes the drained connection itself on that send's
// completion, long before the grace period ends.
TEST_P(RpcSuite, ShutdownClosesADrainedConnectionWhoseClientStaysConnected) {
  Env env(GetParam());
  auto uri = env.StartServer();
  auto raw = RawConnect(env, uri, GetParam().options());
  ASSERT_NE(raw, nullptr);
  SleepRequest req;
  req.set_ms(300);
  ASSERT_TRUE(RawRequest(env, raw.get(), TestSvc::kSleepId, 1, req.SerializeAsString()).ok());
  for (int i = 0; i < 3000 && env.service.sleeps_started == 0; ++i) std::this_thread::sleep_for(milliseconds(5));
  ASSERT_EQ(env.service.sleeps_started, 1);
  auto shut = std::make_shared<std::promise<void>>();  // outlives a failed wait
  auto sf = shut->get_future();
  env.OnIo([&] {
    env.server().async_shutdown(std::chrono::minutes(10), [shut] { shut->set_value(); });
    return 0;
  });
  // Drained ~0.3 s from now. Not waiting longer than 6 s: the server's
  // keepalive would close this client, which answers no PING, after ~12 s.
  ASSERT_EQ(sf.wait_for(std::chrono::seconds(6)), std::future_status::ready)
      << "shutdown went on after the last response was sent: the drained connection was not closed";
  EXPECT_EQ(env.service.sleeps_finished, 1);
  // What the client got before the close: the GOAWAY and its answer, OK.
  bool answered = false;
  for (int i = 0; i < 2 && !answered; ++i) {
    auto frame = RawReceive(env, raw.get());
    ASSERT_TRUE(frame.ok()) << frame.status();
    rpc::DecodedFrame f;
    ASSERT_TRUE(rpc::DecodeFrame(std::as_bytes(std::span<const char>(frame->data(), frame->size())), f).ok());
    if (f.header.type == rpc::FrameType::kResponse) {
      EXPECT_EQ(f.header.call_id, 1u);
      EXPECT_EQ(f.header.status, StatusCode::kOk);
      answered = true;
    }
  }
  EXPECT_TRUE(answered) << "the call's response never reached the client";
  env.OnIo([&] {
    raw->Close();
    raw.reset();
    return 0;
  });
}

// A program that shuts its server down and closes its channel must see its
// io_context run out of work: nothing rdmarpc parked (worker coroutines,
// pollers, CM channels, timers) may keep run() from returning.
TEST_P(RpcSuite, AfterShutdownAndCloseTheIoContextRunsOutOfWork) {
  asio::io_context io;
  TestService service;
  ServerOptions so;
  so.listen = {GetParam().listen_uri};
  so.transport = GetParam().options();
  Server server(io.get_executor(), so);
  ASSERT_TRUE(server.AddService(service).ok());
  ASSERT_TRUE(server.Start().ok());
  ChannelOptions co;
  co.transport = GetParam().options();
  auto channel = Channel::Create(io.get_executor(), server.local_uris().at(0), co);
  ASSERT_TRUE(channel.ok()) << channel.status();
  TestSvc::Stub stub(*channel);
  int ok_calls = 0;
  bool shut = false;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        Payload req, resp;
        req.set_data(std::string(100, 'w'));
        for (int i = 0; i < 20; ++i) {  // several handlers in flight: several parked workers
          std::vector<ClientContext> ctxs(4);
          std::vector<Payload> resps(4);
          int done = 0;
          for (int k = 0; k < 4; ++k)
            stub.async_Echo(ctxs[k], req, resps[k], [&](boost::system::error_code ec) {
              if (!ec) ++ok_calls;
              ++done;
            });
          while (done < 4) co_await asio::post(io, asio::use_awaitable);
        }
      },
      [&](std::exception_ptr) {
        (*channel)->Close();
        server.async_shutdown(milliseconds(500), [&] { shut = true; });
      });
  io.run_for(std::chrono::seconds(30));
  EXPECT_EQ(ok_calls, 80);
  EXPECT_TRUE(shut) << "shutdown did not complete";
  EXPECT_TRUE(io.stopped()) << "io_context still has work 30 s after shutdown and close";
}

// Keepalive. A raw transport connection is a peer whose host is gone as far as
// the RPC layer can tell: it never answers a PING.
TEST_P(RpcSuite, ServerKeepaliveClosesAConnectionThatAnswersNoPing) {
  Env env(GetParam());
  auto uri = env.StartServer("", [](ServerOptions& o) { o.keepalive = {milliseconds(100), milliseconds(200)}; });
  auto silent = RawConnect(env, uri, GetParam().options());
  ASSERT_NE(silent, nullptr);
  const auto start = Clock::now();
  auto ping = RawReceive(env, silent.get());
  ASSERT_TRUE(ping.ok()) << ping.status();
  rpc::DecodedFrame f;
  ASSERT_TRUE(rpc::DecodeFrame(std::as_bytes(std::span<const char>(ping->data(), ping->size())), f).ok());
  EXPECT_EQ(f.header.type, rpc::FrameType::kPing);
  EXPECT_FALSE(RawReceive(env, silent.get()).ok()) << "the server kept a connection that answers no PING";
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().keepalive_closed; }), 1u);
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().connections_open; }), 0u);
  env.OnIo([&] {
    silent->Close();
    silent.reset();
    return 0;
  });
}

TEST_P(RpcSuite, ChannelKeepaliveFailsCallsToAServerThatAnswersNoPing) {
  Env env(GetParam());
  // A "server" that accepts and then says nothing, ever: a host that died
  // after taking the call.
  auto opts = GetParam().options();
  auto listen_uri = transport::ParseUri(GetParam().listen_uri);
  ASSERT_TRUE(listen_uri.ok());
  std::unique_ptr<transport::Listener> listener;
  std::unique_ptr<transport::Connection> accepted;
  std::string uri = env.OnIo([&] {
    auto l = ListenOn(env.io().get_executor(), *listen_uri, opts);
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return std::string();
    listener = std::move(*l);
    listener->Accept([&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
      if (c.ok()) accepted = std::move(*c);
    });
    return listener->local_uri();
  });
  ASSERT_FALSE(uri.empty());
  auto channel = env.NewChannel(uri, [](ChannelOptions& o) { o.keepalive = {milliseconds(100), milliseconds(200)}; });
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(50));
  const auto start = Clock::now();
  ::testing::internal::CaptureStderr();
  auto [code, resp] = Sync<Payload>([&](auto t) { return stub.async_Echo(ctx, Payload(), t); });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, StatusCode::kUnavailable) << ctx.status().ToString();
  EXPECT_NE(ctx.status().message().find("keepalive"), std::string::npos) << ctx.status().ToString();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10)) << "the call waited for its deadline";
  EXPECT_EQ(env.OnIo([&] { return channel->stats().keepalive_timeouts; }), 1u);
  // The warning says what the dead connection was waiting for: its counters,
  // and on RDMA its queue (whoever reads the log after a stall needs them).
  EXPECT_NE(log.find("event=keepalive_timeout"), std::string::npos) << log;
  EXPECT_NE(log.find("messages_sent="), std::string::npos) << log;
  if (GetParam().listen_uri.rfind("rdma", 0) == 0) {
    EXPECT_NE(log.find(" send_queue_used="), std::string::npos) << log;
    EXPECT_NE(log.find(" credits_available="), std::string::npos) << log;
  }
  env.OnIo([&] {
    channel->Close();
    if (accepted) accepted->Close();
    listener->Close();
    accepted.reset();
    listener.reset();
    return 0;
  });
}

TEST_P(RpcSuite, KeepaliveLeavesIdleAndSlowCallsAlone) {
  Env env(GetParam());
  const KeepaliveOptions fast{milliseconds(50), milliseconds(150)};
  auto uri = env.StartServer("", [&](ServerOptions& o) { o.keepalive = fast; });
  auto channel = env.NewChannel(uri, [&](ChannelOptions& o) { o.keepalive = fast; });
  TestSvc::Stub stub(channel);
  ClientContext first;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(first, Payload(), t); }).first, StatusCode::kOk);
  std::this_thread::sleep_for(milliseconds(1000));  // idle: both sides ping, both answer
  SleepRequest slow;
  slow.set_ms(800);  // a handler far longer than interval + timeout: the connection stays quiet
  ClientContext second;
  EXPECT_EQ(Sync<Empty>([&](auto t) { return stub.async_Sleep(second, slow, t); }).first, StatusCode::kOk)
      << second.status().ToString();
  EXPECT_EQ(env.OnIo([&] { return channel->stats().connects; }), 1u);
  EXPECT_EQ(env.OnIo([&] { return channel->stats().keepalive_timeouts; }), 0u);
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().keepalive_closed; }), 0u);
}

TEST_P(RpcSuite, ServerGoneMidCallFailsTheCallUnavailableBeforeItsDeadline) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(50));
  Pending<Empty> pending;
  StartLongSleep(env, stub, ctx, pending);
  auto& fut = pending.future;
  const auto start = Clock::now();
  env.StopServers();
  EXPECT_EQ(ToStatusCode(std::get<0>(Get(fut))), StatusCode::kUnavailable) << ctx.status().ToString();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST_P(RpcSuite, ChannelReconnectsAfterTheServerRestarts) {
  Env env(GetParam());
  auto uri = env.StartServer();
  auto channel = env.NewChannel(uri, [](ChannelOptions& o) {
    o.initial_backoff = milliseconds(20);
    o.max_backoff = milliseconds(200);
  });
  TestSvc::Stub stub(channel);
  ClientContext c1;
  ASSERT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(c1, Payload(), t); }).first, StatusCode::kOk);
  env.StopServers();
  // Down: calls fail fast with UNAVAILABLE.
  std::this_thread::sleep_for(milliseconds(200));
  ClientContext c2;
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(c2, Payload(), t); }).first, StatusCode::kUnavailable);
  // Back on the same address: the channel reconnects by itself.
  ASSERT_EQ(env.StartServer(uri), uri);
  StatusCode last = StatusCode::kUnknown;
  for (int i = 0; i < 200 && last != StatusCode::kOk; ++i) {
    ClientContext c;
    last = Sync<Payload>([&](auto t) { return stub.async_Echo(c, Payload(), t); }).first;
    if (last != StatusCode::kOk) std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_EQ(last, StatusCode::kOk);
  EXPECT_EQ(env.OnIo([&] { return channel->stats().connects; }), 2u);
}

TEST_P(RpcSuite, WaitForReadyCallWaitsForTheServerToAppear) {
  Env env(GetParam());
  auto uri = env.StartServer();
  env.StopServers();  // now we know a free address
  auto channel = env.NewChannel(uri, [](ChannelOptions& o) {
    o.initial_backoff = milliseconds(20);
    o.max_backoff = milliseconds(100);
  });
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_timeout(std::chrono::seconds(30));
  Payload req;
  req.set_data("patient");
  Pending<Payload> pending;
  stub.async_Echo(ctx, req, pending.token());
  auto& fut = pending.future;
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(fut.wait_for(std::chrono::seconds(0)), std::future_status::timeout) << ctx.status().ToString();
  ASSERT_EQ(env.StartServer(uri), uri);
  auto [ec, resp] = Get(fut);
  EXPECT_FALSE(ec) << ctx.status().ToString();
  EXPECT_EQ(resp.data(), "patient");
  ClientContext impatient;  // default: fail fast, but the channel is up now
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(impatient, Payload(), t); }).first, StatusCode::kOk);
}

TEST_P(RpcSuite, ChannelCloseCancelsPendingCalls) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  Pending<Empty> pending;
  StartLongSleep(env, stub, ctx, pending);
  auto& fut = pending.future;
  channel->Close();
  EXPECT_EQ(ToStatusCode(std::get<0>(Get(fut))), StatusCode::kCancelled);
  ClientContext after;
  EXPECT_EQ(Sync<Payload>([&](auto t) { return stub.async_Echo(after, Payload(), t); }).first, StatusCode::kCancelled);
}

TEST_P(RpcSuite, EveryCompletionTokenFormWorks) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer());
  TestSvc::Stub stub(channel);
  Payload req;
  req.set_data("token");

  // use_future (throws on error, value on success)
  {
    ClientContext ctx;
    auto f = stub.async_Echo(ctx, req, asio::use_future);
    EXPECT_EQ(Get(f).data(), "token");
  }
  // callback: runs on the channel's executor, after the initiating call returned
  {
    ClientContext ctx;
    std::promise<bool> p;
    bool returned = false;
    env.OnIo([&] {
      stub.async_Echo(ctx, req, [&](boost::system::error_code ec, Payload resp) {
        p.set_value(!ec && resp.data() == "token" && returned && env.OnIoThread());
      });
      returned = true;
      return 0;
    });
    auto f = p.get_future();
    EXPECT_TRUE(Get(f));
  }
  // deferred: nothing happens until it is launched
  {
    ClientContext ctx;
    const uint64_t before = env.OnIo([&] { return channel->stats().calls_started; });
    auto op = stub.async_Echo(ctx, req, asio::deferred);
    std::this_thread::sleep_for(milliseconds(50));
    EXPECT_EQ(env.OnIo([&] { return channel->stats().calls_started; }), before);
    std::promise<std::string> p;
    std::move(op)([&](boost::system::error_code, Payload resp) { p.set_value(resp.data()); });
    auto f = p.get_future();
    EXPECT_EQ(Get(f), "token");
  }
  // use_awaitable, as_tuple(use_awaitable), the into-a-response overload, and
  // use_awaitable's exception on error (rdmarpc category, full status on the context)
  {
    auto f = asio::co_spawn(
        env.io(),
        [&]() -> asio::awaitable<std::string> {
          ClientContext c1;
          Payload r1 = co_await stub.async_Echo(c1, req, asio::use_awaitable);
          ClientContext c2;
          auto [ec, r2] = co_await stub.async_Echo(c2, req, asio::as_tuple(asio::use_awaitable));
          ClientContext c3;
          Payload r3;
          co_await stub.async_Echo(c3, req, r3, asio::use_awaitable);
          ClientContext c4;
          FailRequest fail;
          fail.set_code(static_cast<uint32_t>(StatusCode::kPermissionDenied));
          fail.set_message("go away");
          std::string caught;
          try {
            co_await stub.async_Fail(c4, fail, asio::use_awaitable);
          } catch (const boost::system::system_error& e) {
            if (e.code().category() == rpc_category() && e.code() == StatusCode::kPermissionDenied &&
                c4.status().message() == "go away")
              caught = "caught";
            std::error_code std_ec = e.code();  // converts to std::error_code
            if (std_ec.value() != static_cast<int>(StatusCode::kPermissionDenied)) caught = "bad std::error_code";
          }
          co_return r1.data() + "," + (ec ? "err" : r2.data()) + "," + r3.data() + "," + caught;
        },
        asio::use_future);
    EXPECT_EQ(Get(f), "token,token,token,caught");
  }
}

// ---- authentication and limits (issue 8 items 11, 12; docs/rpc.md) ----------------

std::pair<StatusCode, Payload> EchoOnce(TestSvc::Stub& stub, size_t size, ClientContext& ctx) {
  Payload req;
  req.set_data(Pattern(size, static_cast<uint32_t>(size)));
  return Sync<Payload>([&](auto token) { return stub.async_Echo(ctx, req, token); });
}

// A refused connect reaches the call as UNAUTHENTICATED naming the cause (the
// channel keeps the transport's code for it, rather than a transient UNAVAILABLE).
void ExpectRefused(StatusCode code, const ClientContext& ctx, const std::string& reason) {
  EXPECT_EQ(code, StatusCode::kUnauthenticated) << ctx.status().ToString();
  EXPECT_NE(ctx.status().message().find(reason), std::string::npos) << ctx.status().ToString();
}

TEST_P(RpcSuite, AuthTokenAdmitsTheRightClientAndRefusesOthersWithTheReason) {
  Env env(GetParam());
  const std::string uri = env.StartServer("", [](ServerOptions& o) { o.transport.auth_token = "s3cret-token"; });
  auto good = env.NewChannel(uri, [](ChannelOptions& o) { o.transport.auth_token = "s3cret-token"; });
  auto wrong = env.NewChannel(uri, [](ChannelOptions& o) { o.transport.auth_token = "not-the-token"; });
  auto none = env.NewChannel(uri);
  TestSvc::Stub good_stub(good), wrong_stub(wrong), none_stub(none);
  {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(wrong_stub, 100, ctx);
    ExpectRefused(code, ctx, "auth token mismatch");
  }
  {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(none_stub, 100, ctx);
    ExpectRefused(code, ctx, "server requires an auth token");
  }
  for (size_t size : {size_t{10}, size_t{100'000}}) {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(good_stub, size, ctx);
    EXPECT_EQ(code, StatusCode::kOk) << ctx.status().ToString();
    EXPECT_EQ(resp.data().size(), size);
  }
  EXPECT_EQ(env.OnIo([&] { return env.server().stats().connections_accepted; }), 1u)
      << "refused clients never reach the server";
}

TEST_P(RpcSuite, ServerWithoutTokenServesAClientThatHasOne) {
  Env env(GetParam());
  auto channel = env.NewChannel(env.StartServer(), [](ChannelOptions& o) { o.transport.auth_token = "client-only"; });
  TestSvc::Stub stub(channel);
  ClientContext ctx;
  auto [code, resp] = EchoOnce(stub, 100, ctx);
  EXPECT_EQ(code, StatusCode::kOk) << ctx.status().ToString();
}

// Beyond max_calls_per_connection the server answers RESOURCE_EXHAUSTED
// without running the handler; another connection is unaffected.
TEST_P(RpcSuite, CallsOverThePerConnectionLimitAreRefusedWhileOtherConnectionsWork) {
  Env env(GetParam());
  constexpr int kLimit = 4;
  const std::string uri = env.StartServer("", [](ServerOptions& o) { o.max_calls_per_connection = kLimit; });
  auto abusive = env.NewChannel(uri);
  auto polite = env.NewChannel(uri);
  TestSvc::Stub abusive_stub(abusive), polite_stub(polite);
  std::vector<ClientContext> ctxs(kLimit);
  std::vector<Pending<Empty>> sleeps(kLimit);
  SleepRequest sleep;
  sleep.set_ms(5'000);
  for (int i = 0; i < kLimit; ++i) abusive_stub.async_Sleep(ctxs[i], sleep, sleeps[i].token());
  for (int i = 0; i < 6000 && env.service.sleeps_started < kLimit; ++i) std::this_thread::sleep_for(milliseconds(5));
  ASSERT_EQ(env.service.sleeps_started, kLimit);

  for (int i = 0; i < 3; ++i) {
    ClientContext ctx;
    auto [code, resp] = Sync<Empty>([&](auto token) { return abusive_stub.async_Sleep(ctx, sleep, token); });
    EXPECT_EQ(code, StatusCode::kResourceExhausted) << ctx.status().ToString();
    EXPECT_NE(ctx.status().message().find("calls in flight"), std::string::npos) << ctx.status().ToString();
  }
  EXPECT_EQ(env.service.sleeps_started, kLimit) << "a refused call ran its handler";
  for (int i = 0; i < 20; ++i) {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(polite_stub, static_cast<size_t>(i) * 1000, ctx);
    EXPECT_EQ(code, StatusCode::kOk) << ctx.status().ToString();
  }
  for (auto& s : sleeps) EXPECT_EQ(ToStatusCode(std::get<0>(Get(s.future))), StatusCode::kOk);
  // The limit counts calls in flight: once they finish, the abusive
  // connection is served again.
  ClientContext ctx;
  auto [code, resp] = EchoOnce(abusive_stub, 10, ctx);
  EXPECT_EQ(code, StatusCode::kOk) << ctx.status().ToString();
}

// A connection over max_connections is closed at once: its calls fail
// UNAVAILABLE, the connection already open keeps working.
TEST_P(RpcSuite, ConnectionsOverTheServerLimitAreClosedWhileTheFirstKeepsWorking) {
  Env env(GetParam());
  const std::string uri = env.StartServer("", [](ServerOptions& o) { o.max_connections = 1; });
  auto first = env.NewChannel(uri);
  auto second = env.NewChannel(uri);
  TestSvc::Stub first_stub(first), second_stub(second);
  {
    ClientContext ctx;
    EXPECT_EQ(EchoOnce(first_stub, 10, ctx).first, StatusCode::kOk) << ctx.status().ToString();
  }
  for (int i = 0; i < 2; ++i) {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(second_stub, 10, ctx);
    EXPECT_EQ(code, StatusCode::kUnavailable) << ctx.status().ToString();
  }
  for (int i = 0; i < 10; ++i) {
    ClientContext ctx;
    EXPECT_EQ(EchoOnce(first_stub, 5000, ctx).first, StatusCode::kOk) << ctx.status().ToString();
  }
  const ServerStats stats = env.OnIo([&] { return env.server().stats(); });
  EXPECT_GE(stats.connections_refused, 1u);
  EXPECT_EQ(stats.connections_open, 1u);
}

// A request over what the server accepts is refused by the client with
// RESOURCE_EXHAUSTED before anything is sent (the limit is learnt in the
// handshake), and the same connection carries on.
TEST_P(RpcSuite, RequestOverTheServersMessageLimitIsRefusedAndTheConnectionSurvives) {
  Env env(GetParam());
  const std::string uri = env.StartServer("", [](ServerOptions& o) {
    o.transport.tcp.max_message_size = 64 << 10;
    o.transport.rdma.max_message_size = 64 << 10;
  });
  auto channel = env.NewChannel(uri);
  TestSvc::Stub stub(channel);
  {
    ClientContext ctx;
    EXPECT_EQ(EchoOnce(stub, 1000, ctx).first, StatusCode::kOk) << ctx.status().ToString();
  }
  {
    ClientContext ctx;
    auto [code, resp] = EchoOnce(stub, 100 << 10, ctx);
    EXPECT_EQ(code, StatusCode::kResourceExhausted) << ctx.status().ToString();
  }
  {
    ClientContext ctx;
    EXPECT_EQ(EchoOnce(stub, 60 << 10, ctx).first, StatusCode::kOk) << ctx.status().ToString();
  }
  EXPECT_EQ(env.OnIo([&] { return channel->stats().connects; }), 1u) << "the connection was not kept";
}

}  // namespace

std::string RpcTransportName(const ::testing::TestParamInfo<RpcTransport>& info) { return info.param.name; }
void PrintTo(const RpcTransport& t, std::ostream* os) { *os << t.name; }

}  // namespace rdmarpc::testing
