// Market-data fanout, the pieces shared by examples/market_data and
// bench/fanout_bench: the MarketData service (a Publisher<Tick> behind
// Subscribe), a tick feed, a measuring subscriber, and a one-process run of
// publisher plus N subscribers over one transport.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/awaitable.hpp>

#include "rdmarpc/examples/market_data.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/fanout.h"
#include "rpc/server.h"

namespace rdmarpc::examples::md {

namespace asio = boost::asio;

// CLOCK_MONOTONIC in ns: publisher and subscribers on one host (or one VM).
uint64_t NowNs();

class Service final : public MarketData::Service {
 public:
  Service(Publisher<Tick>& publisher, uint32_t default_queue_limit)
      : publisher_(publisher), default_queue_limit_(default_queue_limit) {}
  asio::awaitable<Status> Subscribe(ServerContext& context, const SubscribeRequest& request,
                                    ServerWriter<Tick>& writer) override;

 private:
  Publisher<Tick>& publisher_;
  uint32_t default_queue_limit_;
};

struct FeedOptions {
  uint32_t symbols = 100;
  uint64_t ticks = 100'000;
  // Ticks per second, published in 1 ms batches; 0 = as fast as the
  // publisher may (kBlock subscribers backpressure it).
  uint64_t rate = 0;
  // Every second, this many extra ticks at once.
  uint32_t burst = 0;
  size_t tick_bytes = 64;  // serialised size of each tick
};
struct FeedResult {
  uint64_t published = 0;
  double seconds = 0;
  Status status;
};
asio::awaitable<FeedResult> RunFeed(Publisher<Tick>& publisher, FeedOptions options);

struct SubscriberOptions {
  std::string policy = "block";
  uint32_t queue_limit = 0;  // 0: the server's default
  uint32_t window = 0;       // stream window; 0: the channel's
  // Stop (cancel the stream) after this many ticks; 0: read until the end.
  uint64_t stop_after = 0;
  // Sleep this long after each tick (a slow consumer).
  std::chrono::microseconds pause{0};
  // A stalled consumer: read nothing for this long after subscribing...
  std::chrono::milliseconds stall{0};
  // ...or until the feed has published everything (RunLocal sets the flag).
  bool stall_until_feed_done = false;
  std::shared_ptr<std::atomic<bool>> feed_done;
};
struct SubscriberResult {
  uint64_t ticks = 0;         // received
  uint64_t missed = 0;        // ticks skipped in the sequence (dropped for this subscriber)
  uint64_t out_of_order = 0;  // sequence went backwards (must stay 0)
  uint64_t first_sequence = 0;
  uint64_t last_sequence = 0;
  std::vector<uint32_t> latency_ns;  // publish to receipt, per tick
  Status status;              // how the stream ended (OK: the publisher closed)
};
asio::awaitable<SubscriberResult> RunSubscriber(std::shared_ptr<Channel> channel, SubscriberOptions options);

// p in [0, 1]; sorts `v`.
double PercentileUs(std::vector<uint32_t>& v, double p);

// Publisher and `subscribers` subscribers in this process: server and
// publisher on one thread, the subscribers' channel on another, one
// connection per subscriber.
struct LocalRunOptions {
  std::string listen_uri;  // "tcp://127.0.0.1:0", "rdma://10.77.0.1:0"
  TransportOptions transport;
  int subscribers = 4;
  FeedOptions feed;
  SubscriberOptions subscriber;
  // Subscriber i uses overrides[i] when there is one.
  std::vector<SubscriberOptions> overrides;
  uint32_t queue_limit = 1024;  // server default
};
struct LocalRunResult {
  std::vector<SubscriberResult> subscribers;
  FeedResult feed;
  double delivery_seconds = 0;  // feed start to the last subscriber's last tick
  PublisherStats publisher;
  Status status;
};
LocalRunResult RunLocal(const LocalRunOptions& options);

}  // namespace rdmarpc::examples::md
