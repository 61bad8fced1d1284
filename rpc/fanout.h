// Fanout: one publisher, many subscribers, each a server-streaming call.
//
//   rdmarpc::Publisher<Tick> publisher(server_executor);
//   // in the service's Subscribe(ctx, request, ServerWriter<Tick>& writer):
//   co_await publisher.async_serve(writer, {.policy = SlowConsumerPolicy::kDropOldest}, use_awaitable);
//   // in the feed:
//   co_await publisher.async_publish(symbol_id, tick, use_awaitable);
//
// A tick is serialised once, whatever the number of subscribers; each
// subscriber's stream gets a copy of those bytes in its own send buffer (the
// registered slot on RDMA). Every tick carries the publisher's sequence number
// (1, 2, ...) as its stream sequence, so a subscriber sees exactly what it
// missed: ClientReader::last_sequence() jumps.
//
// Slow consumers: a subscriber whose reads fall behind first fills its stream
// window (the credits its client granted), then its queue here, up to
// `queue_limit` ticks. Past that, its policy decides:
//  - kBlock: the publisher waits: async_publish completes only when every
//    blocking subscriber's queue is below its limit (backpressure; memory
//    stays bounded, the publisher is not dropped or crashed).
//  - kDropOldest: the oldest queued tick is dropped (counted).
//  - kConflate: at most one queued tick per key; a new tick replaces the
//    queued one with the same key in place (counted as a drop). The queue
//    never holds more than min(queue_limit, distinct keys) ticks.
// A subscriber that disconnects, cancels or passes its deadline is removed at
// once; the others go on. Close() ends every subscription after its queue has
// drained (each async_serve completes OK and the handler returns).
//
// Threads: the publisher lives on the server's executor (where the streams
// are). async_publish may be called from any thread: it serialises there and
// hops. One async_publish at a time (like async_write).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include "absl/container/flat_hash_map.h"
#include "rpc/status.h"
#include "rpc/stream.h"
#include "rpc/stream_core.h"
#include "transport/handler_memory.h"

namespace rdmarpc {

enum class SlowConsumerPolicy { kBlock, kDropOldest, kConflate };

// "block", "drop_oldest", "conflate".
absl::StatusOr<SlowConsumerPolicy> ParseSlowConsumerPolicy(std::string_view name);
std::string_view SlowConsumerPolicyName(SlowConsumerPolicy policy);

struct SubscriptionOptions {
  SlowConsumerPolicy policy = SlowConsumerPolicy::kBlock;
  // Ticks held here for this subscriber beyond what its stream window takes.
  size_t queue_limit = 1024;
};

struct PublisherStats {
  uint64_t published = 0;          // ticks
  uint64_t subscribers = 0;        // now
  uint64_t subscribed = 0;         // ever
  uint64_t sent = 0;               // tick copies handed to streams
  uint64_t dropped = 0;            // by drop_oldest and conflate, all subscribers
  uint64_t publishes_blocked = 0;  // async_publish calls that waited for a blocking subscriber
  uint64_t max_queued = 0;         // largest queue any subscriber reached
};

namespace internal {

class FanoutCore : public std::enable_shared_from_this<FanoutCore> {
 public:
  explicit FanoutCore(asio::any_io_executor ex);
  ~FanoutCore();
  const asio::any_io_executor& executor() const { return ex_; }

  void StartPublish(uint64_t key, std::string bytes, StreamHandler handler);
  void StartServe(std::shared_ptr<StreamCore> stream, SubscriptionOptions options, StreamHandler done);
  void StartClose();
  // On the executor.
  const PublisherStats& stats() const { return stats_; }

 private:
  struct Tick {
    std::string bytes;
    uint64_t sequence;
    uint64_t key;
  };
  struct Sub;

  void Publish(uint64_t key, std::string bytes, StreamHandler handler);
  void Serve(std::shared_ptr<StreamCore> stream, SubscriptionOptions options, StreamHandler done);
  void Close();
  void Enqueue(Sub& sub, const std::shared_ptr<const Tick>& tick);
  void Pump(Sub& sub);
  void Remove(uint64_t id, boost::system::error_code ec);
  void MaybeUnblock();
  bool Blocked() const;

  asio::any_io_executor ex_;
  std::vector<std::unique_ptr<Sub>> subs_;
  uint64_t sequence_ = 0;
  uint64_t next_sub_id_ = 0;
  bool closed_ = false;
  StreamHandler blocked_publish_;
  PublisherStats stats_;
};

}  // namespace internal

template <typename T>
class Publisher {
 public:
  explicit Publisher(asio::any_io_executor ex) : core_(std::make_shared<internal::FanoutCore>(std::move(ex))) {}
  ~Publisher() { core_->StartClose(); }
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Sends `tick` to every subscriber (serialised once, here); completes with
  // (error_code) when the publisher may publish again: at once, unless a
  // kBlock subscriber's queue is full. CANCELLED after Close().
  template <typename Token>
  auto async_publish(uint64_t key, const T& tick, Token&& token) {
    return asio::async_initiate<Token, void(boost::system::error_code)>(
        [](auto handler, internal::FanoutCore* core, uint64_t k, std::string bytes) {
          core->StartPublish(k, std::move(bytes), internal::StreamHandler(transport::WithHandlerMemory(std::move(handler))));
        },
        token, core_.get(), key, tick.SerializeAsString());
  }

  // Serves one subscriber on `writer` until it leaves (completes with its
  // stream's status: CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE) or the
  // publisher closes (OK, after its queue drained). A cancellation of this
  // operation (the handler's) ends the subscription too.
  template <typename Token>
  auto async_serve(ServerWriter<T>& writer, SubscriptionOptions options, Token&& token) {
    return asio::async_initiate<Token, void(boost::system::error_code)>(
        [](auto handler, internal::FanoutCore* core, std::shared_ptr<internal::StreamCore> stream,
           SubscriptionOptions o) {
          core->StartServe(std::move(stream), o, internal::StreamHandler(std::move(handler)));
        },
        token, core_.get(), writer.core(), options);
  }

  // Ends every subscription once its queue drained; later publishes fail.
  void Close() { core_->StartClose(); }
  // On the executor.
  const PublisherStats& stats() const { return core_->stats(); }

 private:
  std::shared_ptr<internal::FanoutCore> core_;
};

}  // namespace rdmarpc
