#include "examples/market_data/market_data.h"

#include <time.h>

#include <algorithm>
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

#include "absl/strings/str_cat.h"
#include "transport/uri.h"

// GCC 12 inlines Asio's awaitable frame allocation (its thread-local
// recycling allocator) next to the frame's sized operator delete in
// RunSubscriber and reports a new/delete mismatch that is not one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace rdmarpc::examples::md {

namespace {
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);
}

uint64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1'000'000'000u + uint64_t(ts.tv_nsec);
}

asio::awaitable<Status> Service::Subscribe(ServerContext&, const SubscribeRequest& request,
                                           ServerWriter<Tick>& writer) {
  SubscriptionOptions options;
  if (!request.policy().empty()) {
    auto policy = ParseSlowConsumerPolicy(request.policy());
    if (!policy.ok()) co_return Status::FromAbsl(policy.status());
    options.policy = *policy;
  }
  options.queue_limit = request.queue_limit() != 0 ? request.queue_limit() : default_queue_limit_;
  auto [ec] = co_await publisher_.async_serve(writer, options, kTuple);
  if (ec) co_return Status(ToStatusCode(ec), "subscription ended");
  co_return Status();
}

asio::awaitable<FeedResult> RunFeed(Publisher<Tick>& publisher, FeedOptions options) {
  FeedResult result;
  Tick tick;
  // Fixed-width fields: 4 x 9 bytes, plus the pad's 2-byte header.
  const size_t fixed = 36 + 2;
  tick.set_pad(std::string(options.tick_bytes > fixed ? options.tick_bytes - fixed : 0, 'p'));
  const uint32_t symbols = std::max<uint32_t>(1, options.symbols);
  auto publish_one = [&](uint64_t i) {
    tick.set_symbol(i % symbols);
    tick.set_price(int64_t(1'000'000 + (i * 7919) % 10'000));
    tick.set_quantity(int64_t(100 + i % 900));
    tick.set_publish_ns(NowNs());
    return publisher.async_publish(i % symbols, tick, kTuple);
  };
  const auto start = std::chrono::steady_clock::now();
  asio::steady_timer timer(co_await asio::this_coro::executor);
  uint64_t i = 0;
  if (options.rate == 0) {
    for (; i < options.ticks; ++i) {
      auto [ec] = co_await publish_one(i);
      if (ec) {
        result.status = Status(ToStatusCode(ec), "publish failed");
        break;
      }
    }
  } else {
    // 1 ms batches at `rate`; a burst of `burst` extra ticks each second.
    auto next = start;
    double owed = 0;
    uint64_t ms = 0;
    while (i < options.ticks && result.status.ok()) {
      owed += double(options.rate) / 1000.0;
      if (options.burst != 0 && ms % 1000 == 999) owed += options.burst;
      ++ms;
      while (owed >= 1 && i < options.ticks) {
        auto [ec] = co_await publish_one(i++);
        owed -= 1;
        if (ec) {
          result.status = Status(ToStatusCode(ec), "publish failed");
          break;
        }
      }
      next += std::chrono::milliseconds(1);
      timer.expires_at(next);
      co_await timer.async_wait(kTuple);
    }
  }
  result.published = i;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  co_return result;
}

asio::awaitable<SubscriberResult> RunSubscriber(std::shared_ptr<Channel> channel, SubscriberOptions options) {
  SubscriberResult r;
  MarketData::Stub stub(channel);
  ClientContext ctx;
  if (options.window != 0) ctx.set_stream_window(options.window);
  SubscribeRequest req;
  req.set_policy(options.policy);
  req.set_queue_limit(options.queue_limit);
  auto [ec, reader] = co_await stub.async_Subscribe(ctx, req, kTuple);
  if (ec) {
    r.status = ctx.status();
    co_return r;
  }
  r.latency_ns.reserve(1 << 16);
  asio::steady_timer pause(co_await asio::this_coro::executor);
  if (options.stall.count() > 0) {
    pause.expires_after(options.stall);
    co_await pause.async_wait(kTuple);
  }
  while (options.stall_until_feed_done && options.feed_done && !*options.feed_done) {
    pause.expires_after(std::chrono::milliseconds(2));
    co_await pause.async_wait(kTuple);
  }
  Tick tick;
  for (;;) {
    auto [rec] = co_await reader.async_read(tick, kTuple);
    if (rec == asio::error::eof) break;
    if (rec) {
      r.status = ctx.status().ok() ? Status(ToStatusCode(rec), rec.message()) : ctx.status();
      break;
    }
    const uint64_t now = NowNs();
    const uint64_t seq = reader.last_sequence();
    if (r.ticks == 0) {
      r.first_sequence = seq;
    } else if (seq <= r.last_sequence) {
      ++r.out_of_order;
    } else {
      r.missed += seq - r.last_sequence - 1;
    }
    r.last_sequence = seq;
    ++r.ticks;
    const uint64_t lat = now > tick.publish_ns() ? now - tick.publish_ns() : 0;
    r.latency_ns.push_back(uint32_t(std::min<uint64_t>(lat, UINT32_MAX)));
    if (options.stop_after != 0 && r.ticks == options.stop_after) {
      reader.Cancel();
      r.status = CancelledError("stopped by the subscriber");
      break;
    }
    if (options.pause.count() > 0) {
      pause.expires_after(options.pause);
      co_await pause.async_wait(kTuple);
    }
  }
  co_return r;
}

double PercentileUs(std::vector<uint32_t>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, size_t(p * double(v.size())));
  return double(v[i]) / 1000.0;
}

LocalRunResult RunLocal(const LocalRunOptions& options) {
  LocalRunResult result;
  asio::io_context server_io, client_io;
  auto server_work = asio::make_work_guard(server_io);
  auto client_work = asio::make_work_guard(client_io);
  std::thread server_thread([&] { server_io.run(); });
  std::thread client_thread([&] { client_io.run(); });

  auto on_server = [&](auto f) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto fut = task.get_future();
    asio::post(server_io, [&task] { task(); });
    return fut.get();
  };
  // One device context for the server and every channel (not one each).
  TransportOptions transport = options.transport;
  Status st;
  if (auto uri = transport::ParseUri(options.listen_uri); !uri.ok()) {
    st = Status::FromAbsl(uri.status());
  } else if (uri->scheme == transport::Uri::Scheme::kRdma && transport.rdma_context == nullptr) {
    auto ctx = RdmaContextFor(transport, uri->host);
    if (!ctx.ok()) st = Status::FromAbsl(ctx.status());
    else transport.rdma_context = *ctx;
  }
  auto publisher = std::make_unique<Publisher<Tick>>(server_io.get_executor());
  auto service = std::make_unique<Service>(*publisher, options.queue_limit);
  std::unique_ptr<Server> server;
  std::string uri;
  if (st.ok()) st = on_server([&] {
    ServerOptions so;
    so.listen = {options.listen_uri};
    so.transport = transport;
    server = std::make_unique<Server>(server_io.get_executor(), so);
    if (auto s = server->AddService(*service); !s.ok()) return s;
    if (auto s = server->Start(); !s.ok()) return s;
    uri = server->local_uris().at(0);
    return Status();
  });

  std::vector<std::shared_ptr<Channel>> channels;
  std::vector<std::future<SubscriberResult>> subs;
  auto feed_done = std::make_shared<std::atomic<bool>>(false);
  if (st.ok()) {
    for (int i = 0; i < options.subscribers && st.ok(); ++i) {
      ChannelOptions co;
      co.transport = transport;
      auto ch = Channel::Create(client_io.get_executor(), uri, co);
      if (!ch.ok()) {
        st = Status::FromAbsl(ch.status());
        break;
      }
      channels.push_back(*ch);
      SubscriberOptions so = size_t(i) < options.overrides.size() ? options.overrides[size_t(i)] : options.subscriber;
      so.feed_done = feed_done;
      subs.push_back(asio::co_spawn(client_io, RunSubscriber(*ch, so), asio::use_future));
    }
  }
  if (st.ok()) {
    // The feed starts once every subscriber is attached.
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (on_server([&] { return publisher->stats().subscribers; }) < uint64_t(options.subscribers)) {
      if (std::chrono::steady_clock::now() > limit) {
        st = UnavailableError(absl::StrCat("subscribers did not attach within 60 s (",
                                           on_server([&] { return publisher->stats().subscribers; }), " of ",
                                           options.subscribers, ")"));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  const auto feed_start = std::chrono::steady_clock::now();
  if (st.ok()) {
    auto feed = asio::co_spawn(server_io, RunFeed(*publisher, options.feed), asio::use_future);
    result.feed = feed.get();
  }
  *feed_done = true;
  on_server([&] {
    publisher->Close();  // subscribers get what was published, then eof
    return 0;
  });
  for (auto& f : subs) result.subscribers.push_back(f.get());
  result.delivery_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - feed_start).count();
  result.publisher = on_server([&] { return publisher->stats(); });
  on_server([&] {
    for (auto& ch : channels) ch->Close();
    server.reset();
    publisher.reset();
    return 0;
  });
  channels.clear();
  server_work.reset();
  client_work.reset();
  client_thread.join();
  server_thread.join();
  result.status = st;
  return result;
}

}  // namespace rdmarpc::examples::md
