// Streams over every transport (part of the RPC suite: tcp:// on the host,
// rdma:// in the VM). Each scenario runs as one coroutine on the io thread
// that also runs server and channel; the test thread waits for it, bounded.
#include <atomic>
#include <future>
#include <thread>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <boost/system/system_error.hpp>

#include "rdmarpc/test/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/rpc/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

namespace asio = boost::asio;
using asio::use_awaitable;
using rdmarpc::test::Payload;
using EchoSvc = rdmarpc::test::Echo;
using std::chrono::milliseconds;
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);

// ServerStream: request.meta.seq messages (0: until cancelled), each carrying
// its index and request.data; data "fail-after-3" ends with ABORTED after 3.
// ClientStream: reads to eof, checks the order, answers the count.
// Bidi: echoes every message, ends OK at the client's half-close.
class StreamService final : public EchoSvc::Service {
 public:
  asio::awaitable<Status> ServerStream(ServerContext& ctx, const Payload& request,
                                       ServerWriter<Payload>& writer) override {
    ++started;
    const uint64_t n = request.meta().seq();
    Payload p;
    p.set_data(request.data());
    for (uint64_t i = 0; n == 0 || i < n; ++i) {
      if (request.data() == "fail-after-3" && i == 3) co_return Status(StatusCode::kAborted, "told to fail after 3");
      p.mutable_meta()->set_seq(i);
      boost::system::error_code ec;
      try {
        std::tie(ec) = co_await writer.async_write(p, kTuple);
      } catch (const boost::system::system_error& e) {
        // A cancelled handler's next co_await throws (Asio's throw_if_cancelled).
        ec = e.code();
      }
      if (ec) {
        end_code = ctx.is_cancelled() ? ctx.cancel_reason() : ToStatusCode(ec);
        saw_cancel = ctx.is_cancelled();
        ++ended_by_error;
        co_return Status(ToStatusCode(ec), "write failed");
      }
      ++written;
    }
    co_return Status();
  }
  asio::awaitable<Status> ClientStream(ServerContext&, ServerReader<Payload>& reader, Payload& response) override {
    ++started;
    Payload p;
    uint64_t count = 0;
    for (;;) {
      auto [ec] = co_await reader.async_read(p, kTuple);
      if (ec == asio::error::eof) break;
      if (ec) co_return Status(ToStatusCode(ec), "read failed");
      if (p.meta().seq() != count) co_return InvalidArgumentError("out of order");
      ++count;
      if (p.data() == "stop-after-5" && count == 5) co_return Status(StatusCode::kResourceExhausted, "enough");
    }
    response.mutable_meta()->set_seq(count);
    co_return Status();
  }
  asio::awaitable<Status> Bidi(ServerContext&, ServerReaderWriter<Payload, Payload>& stream) override {
    ++started;
    Payload p;
    for (;;) {
      auto [ec] = co_await stream.async_read(p, kTuple);
      if (ec == asio::error::eof) co_return Status();
      if (ec) co_return Status(ToStatusCode(ec), "read failed");
      auto [wec] = co_await stream.async_write(p, kTuple);
      if (wec) co_return Status(ToStatusCode(wec), "write failed");
    }
  }

  std::atomic<int> started{0};
  std::atomic<uint64_t> written{0};
  std::atomic<int> ended_by_error{0};
  std::atomic<bool> saw_cancel{false};
  std::atomic<StatusCode> end_code{StatusCode::kOk};
};

class StreamEnv {
 public:
  explicit StreamEnv(const RpcTransport& t, uint32_t server_window = 64, uint32_t client_window = 64)
      : work_(asio::make_work_guard(io_)) {
    ServerOptions so;
    so.listen = {t.listen_uri};
    so.transport = t.options();
    so.stream_window = server_window;
    server_ = std::make_unique<Server>(io_.get_executor(), so);
    EXPECT_TRUE(server_->AddService(service).ok());
    Status st = server_->Start();
    EXPECT_TRUE(st.ok()) << st.ToString();
    ChannelOptions co;
    co.transport = t.options();
    co.stream_window = client_window;
    auto ch = Channel::Create(io_.get_executor(), server_->local_uris().at(0), co);
    EXPECT_TRUE(ch.ok()) << ch.status();
    channel_ = *ch;
    thread_ = std::thread([this] { io_.run(); });
  }
  ~StreamEnv() {
    std::promise<void> done;
    asio::post(io_, [&] {
      channel_->Close();
      channel_.reset();
      server_.reset();
      done.set_value();
    });
    done.get_future().wait();
    work_.reset();
    auto stopper = std::async(std::launch::async, [this] {
      std::this_thread::sleep_for(milliseconds(200));
      io_.stop();
    });
    thread_.join();
  }

  // Runs `scenario` on the io thread and waits for it (bounded).
  template <typename F>
  void Run(F scenario) {
    auto fut = asio::co_spawn(io_, scenario(), asio::use_future);
    if (fut.wait_for(kRpcWait) != std::future_status::ready) {
      ADD_FAILURE() << "stream scenario did not finish within " << kRpcWait.count() << " s";
      std::abort();
    }
    fut.get();
  }
  template <typename Pred>
  asio::awaitable<bool> WaitFor(Pred pred, milliseconds limit = milliseconds(10'000)) {
    asio::steady_timer t(io_);
    for (auto waited = milliseconds(0); waited < limit; waited += milliseconds(5)) {
      if (pred()) co_return true;
      t.expires_after(milliseconds(5));
      co_await t.async_wait(use_awaitable);
    }
    co_return pred();
  }

  std::shared_ptr<Channel> channel() { return channel_; }
  Server& server() { return *server_; }
  StreamService service;

 private:
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::unique_ptr<Server> server_;
  std::shared_ptr<Channel> channel_;
  std::thread thread_;
};

TEST_P(RpcSuite, ServerStreamDeliversEveryMessageInOrderThroughASmallWindow) {
  StreamEnv env(GetParam(), 64, /*client_window=*/4);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    Payload req;
    req.set_data(std::string(100, 'x'));
    req.mutable_meta()->set_seq(20'000);
    auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
    EXPECT_FALSE(ec) << ctx.status().ToString();
    Payload p;
    uint64_t expected = 0;
    for (;;) {
      auto [rec] = co_await reader.async_read(p, kTuple);
      if (rec == asio::error::eof) break;
      EXPECT_FALSE(rec) << rec.message() << " " << ctx.status().ToString();
      if (rec) co_return;
      EXPECT_EQ(p.meta().seq(), expected);
      EXPECT_EQ(p.data().size(), 100u);
      EXPECT_LE(reader.stats().unread, 4u) << "more unread than the window granted";
      ++expected;
    }
    EXPECT_EQ(expected, 20'000u);
    EXPECT_TRUE(ctx.status().ok()) << ctx.status().ToString();
    EXPECT_EQ(reader.last_sequence(), 20'000u);  // the writer numbers from 1
  });
}

TEST_P(RpcSuite, ClientStreamSendsInOrderAndGetsOneResponse) {
  StreamEnv env(GetParam(), /*server_window=*/8);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    auto [ec, writer] = co_await stub.async_ClientStream(ctx, kTuple);
    EXPECT_FALSE(ec) << ctx.status().ToString();
    Payload p;
    p.set_data(std::string(1000, 'y'));
    for (uint64_t i = 0; i < 5'000; ++i) {
      p.mutable_meta()->set_seq(i);
      auto [wec] = co_await writer.async_write(p, kTuple);
      EXPECT_FALSE(wec) << wec.message();
      if (wec) co_return;
    }
    Payload response;
    auto [fec] = co_await writer.async_finish(response, kTuple);  // half-closes first
    EXPECT_FALSE(fec) << ctx.status().ToString();
    EXPECT_EQ(response.meta().seq(), 5'000u);
  });
}

// The server ends a client stream early: the client's next writes and its
// finish get the server's status; nothing hangs.
TEST_P(RpcSuite, AServerThatEndsAClientStreamEarlyStopsTheClientsWrites) {
  StreamEnv env(GetParam(), /*server_window=*/4);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    auto [ec, writer] = co_await stub.async_ClientStream(ctx, kTuple);
    EXPECT_FALSE(ec);
    Payload p;
    p.set_data("stop-after-5");
    boost::system::error_code wec;
    uint64_t i = 0;
    for (; i < 10'000 && !wec; ++i) {
      p.mutable_meta()->set_seq(i);
      std::tie(wec) = co_await writer.async_write(p, kTuple);
    }
    EXPECT_EQ(ToStatusCode(wec), StatusCode::kResourceExhausted) << wec.message();
    EXPECT_LT(i, 100u) << "the client kept writing into a stream the server had ended";
    Payload response;
    auto [fec] = co_await writer.async_finish(response, kTuple);
    EXPECT_EQ(ToStatusCode(fec), StatusCode::kResourceExhausted);
    EXPECT_EQ(ctx.status().message(), "enough");
  });
}

TEST_P(RpcSuite, BidiStreamEchoesWhileBothSidesRun) {
  StreamEnv env(GetParam(), 16, 16);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    auto [ec, rw] = co_await stub.async_Bidi(ctx, kTuple);
    EXPECT_FALSE(ec) << ctx.status().ToString();
    constexpr uint64_t kN = 3'000;
    // A writer coroutine and this reader run at once; 3,000 messages through
    // windows of 16 both ways would deadlock without flow control working.
    auto ex = co_await asio::this_coro::executor;
    auto writes_ok = std::make_shared<bool>(false);
    asio::co_spawn(ex, [&rw, writes_ok]() -> asio::awaitable<void> {
      Payload p;
      for (uint64_t i = 0; i < kN; ++i) {
        p.mutable_meta()->set_seq(i);
        p.set_data(std::string(i % 5000, 'b'));
        auto [wec] = co_await rw.async_write(p, kTuple);
        if (wec) co_return;
      }
      auto [dec] = co_await rw.async_writes_done(kTuple);
      *writes_ok = !dec;
    }, asio::detached);
    Payload p;
    uint64_t got = 0;
    for (;;) {
      auto [rec] = co_await rw.async_read(p, kTuple);
      if (rec == asio::error::eof) break;
      EXPECT_FALSE(rec) << ctx.status().ToString();
      if (rec) co_return;
      EXPECT_EQ(p.meta().seq(), got);
      EXPECT_EQ(p.data().size(), got % 5000);
      ++got;
    }
    EXPECT_EQ(got, kN);
    EXPECT_TRUE(*writes_ok);
    auto [fec] = co_await rw.async_finish(kTuple);
    EXPECT_FALSE(fec) << ctx.status().ToString();
  });
}

TEST_P(RpcSuite, ASlowStreamReaderBackpressuresTheWriterInsteadOfBuffering) {
  StreamEnv env(GetParam(), 64, /*client_window=*/8);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    Payload req;
    req.mutable_meta()->set_seq(1'000);
    auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
    EXPECT_FALSE(ec);
    // Read nothing for a while: the server gets 8 messages out, then waits.
    co_await env.WaitFor([&] { return env.service.written >= 8; });
    asio::steady_timer t(co_await asio::this_coro::executor, milliseconds(300));
    co_await t.async_wait(use_awaitable);
    EXPECT_EQ(env.service.written.load(), 8u) << "the writer went past the reader's window";
    EXPECT_LE(reader.stats().unread, 8u);
    // Now read: everything arrives.
    Payload p;
    uint64_t got = 0;
    for (;;) {
      auto [rec] = co_await reader.async_read(p, kTuple);
      if (rec) {
        EXPECT_EQ(rec, asio::error::eof) << ctx.status().ToString();
        break;
      }
      ++got;
    }
    EXPECT_EQ(got, 1'000u);
  });
}

// Opens a "fail-after-3" stream and reads it to the end: three messages, then
// ABORTED. With `read_late`, the first read waits until the three messages and
// the error trailer right behind them have all arrived (the order a transport
// that hands over a batch at once gives): they must still be read first.
void ExpectThreeMessagesThenTheError(const RpcTransport& transport, bool read_late) {
  StreamEnv env(transport);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    Payload req;
    req.set_data("fail-after-3");
    req.mutable_meta()->set_seq(10);
    auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
    EXPECT_FALSE(ec);
    if (read_late) {
      EXPECT_TRUE(co_await env.WaitFor([&] { return reader.stats().unread == 3; })) << "three messages never arrived";
      asio::steady_timer settle(co_await asio::this_coro::executor, std::chrono::milliseconds(300));
      co_await settle.async_wait(kTuple);
    }
    Payload p;
    int got = 0;
    boost::system::error_code rec;
    for (;;) {
      std::tie(rec) = co_await reader.async_read(p, kTuple);
      if (rec) break;
      ++got;
    }
    EXPECT_EQ(got, 3) << (read_late ? "messages that arrived before the error were dropped" : "");
    EXPECT_EQ(ToStatusCode(rec), StatusCode::kAborted) << rec.message();
    EXPECT_EQ(ctx.status().message(), "told to fail after 3");
  });
}

TEST_P(RpcSuite, ServerStreamErrorArrivesAfterTheMessagesWrittenBeforeIt) {
  ExpectThreeMessagesThenTheError(GetParam(), /*read_late=*/false);
}

TEST_P(RpcSuite, ServerStreamErrorKeepsTheMessagesThatArrivedBeforeItUnread) {
  ExpectThreeMessagesThenTheError(GetParam(), /*read_late=*/true);
}

TEST_P(RpcSuite, CancellingAStreamEndsBothSides) {
  StreamEnv env(GetParam(), 64, 4);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    Payload req;  // endless
    auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
    EXPECT_FALSE(ec);
    Payload p;
    for (int i = 0; i < 10; ++i) {
      auto [rec] = co_await reader.async_read(p, kTuple);
      EXPECT_FALSE(rec);
    }
    reader.Cancel();
    auto [rec] = co_await reader.async_read(p, kTuple);
    // Up to the window's worth may still be delivered; then CANCELLED.
    for (int i = 0; i < 8 && !rec; ++i) std::tie(rec) = co_await reader.async_read(p, kTuple);
    EXPECT_EQ(ToStatusCode(rec), StatusCode::kCancelled) << rec.message();
    EXPECT_TRUE(co_await env.WaitFor([&] { return env.service.ended_by_error == 1; }))
        << "the server's handler was not cancelled";
    EXPECT_TRUE(env.service.saw_cancel.load());
  });
}

TEST_P(RpcSuite, DroppingTheClientEndCancelsTheServerHandler) {
  StreamEnv env(GetParam(), 64, 4);
  env.Run([&]() -> asio::awaitable<void> {
    {
      EchoSvc::Stub stub(env.channel());
      ClientContext ctx;
      Payload req;
      auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
      EXPECT_FALSE(ec);
      Payload p;
      auto [rec] = co_await reader.async_read(p, kTuple);
      EXPECT_FALSE(rec);
    }  // reader dropped mid-stream
    EXPECT_TRUE(co_await env.WaitFor([&] { return env.service.ended_by_error == 1; }));
    EXPECT_EQ(env.service.end_code.load(), StatusCode::kCancelled);
  });
}

TEST_P(RpcSuite, AStreamDeadlineEndsBothSides) {
  StreamEnv env(GetParam(), 64, 4);
  env.Run([&]() -> asio::awaitable<void> {
    EchoSvc::Stub stub(env.channel());
    ClientContext ctx;
    ctx.set_timeout(milliseconds(300));
    Payload req;  // endless, and the client stops reading
    auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
    EXPECT_FALSE(ec);
    const auto start = Clock::now();
    Payload p;
    boost::system::error_code rec;
    int got = 0;
    while (!rec) {
      std::tie(rec) = co_await reader.async_read(p, kTuple);
      if (!rec && ++got == 5) {  // then stall until the deadline
        asio::steady_timer t(co_await asio::this_coro::executor, milliseconds(600));
        co_await t.async_wait(use_awaitable);
      }
    }
    EXPECT_EQ(ToStatusCode(rec), StatusCode::kDeadlineExceeded) << rec.message();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    EXPECT_TRUE(co_await env.WaitFor([&] { return env.service.ended_by_error == 1; }));
    // The server's own timer, or the CANCEL the client sends when its timer
    // fires (whichever comes first: the server's deadline is later by the
    // REQUEST's one-way trip).
    const StatusCode server_saw = env.service.end_code.load();
    EXPECT_TRUE(server_saw == StatusCode::kDeadlineExceeded || server_saw == StatusCode::kCancelled)
        << static_cast<int>(server_saw);
  });
}

TEST_P(RpcSuite, ManyStreamsAndUnaryCallsShareOneConnection) {
  StreamEnv env(GetParam(), 8, 8);
  env.Run([&]() -> asio::awaitable<void> {
    auto ex = co_await asio::this_coro::executor;
    constexpr int kStreams = 16;
    auto done = std::make_shared<int>(0);
    auto total = std::make_shared<uint64_t>(0);
    for (int s = 0; s < kStreams; ++s) {
      asio::co_spawn(ex, [&env, done, total]() -> asio::awaitable<void> {
        EchoSvc::Stub stub(env.channel());
        ClientContext ctx;
        Payload req;
        req.mutable_meta()->set_seq(500);
        auto [ec, reader] = co_await stub.async_ServerStream(ctx, req, kTuple);
        Payload p;
        uint64_t expected = 0;
        while (!ec) {
          auto [rec] = co_await reader.async_read(p, kTuple);
          if (rec) {
            EXPECT_EQ(rec, asio::error::eof) << ctx.status().ToString();
            break;
          }
          EXPECT_EQ(p.meta().seq(), expected++);
        }
        *total += expected;
        ++*done;
      }, asio::detached);
    }
    EchoSvc::Stub stub(env.channel());
    for (int i = 0; i < 50; ++i) {
      ClientContext ctx;
      Payload req;
      req.set_data("unary");
      auto [ec, resp] = co_await stub.async_Unary(ctx, req, kTuple);
      EXPECT_EQ(ToStatusCode(ec), StatusCode::kUnimplemented);  // not served: still answered in between
    }
    EXPECT_TRUE(co_await env.WaitFor([&] { return *done == kStreams; }, milliseconds(30'000)));
    EXPECT_EQ(*total, uint64_t{kStreams} * 500);
    EXPECT_EQ(env.channel()->stats().connects, 1u);
  });
}

}  // namespace
}  // namespace rdmarpc::testing
