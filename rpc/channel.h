// Channel: the client end of rdmarpc. One connection to one URI (rdma:// or
// tcp://), many calls in flight on it, connected lazily on the first call and
// reconnected with exponential backoff after it fails.
//
// Threads: a Channel lives on the executor it was created with (one thread
// running the io_context, or a strand). Calls may be started from any thread;
// they hop to that executor. Completion handlers run on their associated
// executor (default: the channel's), never inside the initiating call.
//
// Failure semantics (every call completes exactly once):
//  - deadline passed: DEADLINE_EXCEEDED, by the channel's own timer, whatever
//    the peer does; the server is sent a CANCEL.
//  - terminal cancellation through the handler's cancellation slot:
//    CANCELLED; the server is sent a CANCEL.
//  - connection lost with the call in flight: UNAVAILABLE (the call may or may
//    not have run on the server).
//  - no connection and none can be made now: UNAVAILABLE at once, unless the
//    context asked to wait_for_ready (then it waits until its deadline).
//  - request larger than the connection accepts: RESOURCE_EXHAUSTED, nothing sent.
//  - Close() or the last reference dropped: pending calls CANCELLED.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include "absl/status/statusor.h"
#include "rpc/call.h"
#include "rpc/endpoint.h"
#include "rpc/keepalive.h"

namespace rdmarpc {

struct ChannelOptions {
  TransportOptions transport;
  // Reconnect backoff: first wait, cap; each failure doubles it (+-20% jitter).
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{2'000};
  // Calls in flight at most; more fail with RESOURCE_EXHAUSTED.
  size_t max_outstanding_calls = 65'536;
  // A connection silent for keepalive.interval gets a PING; if nothing comes
  // back within keepalive.timeout it is declared dead: its calls fail
  // UNAVAILABLE (before their deadlines) and the next call reconnects. This is
  // how a server whose host died after taking calls is found. interval 0 turns
  // it off (rpc/keepalive.h).
  KeepaliveOptions keepalive;
  // Streams: messages the server may send ahead of this end's reads (the
  // read window; ClientContext::set_stream_window overrides it per stream).
  uint32_t stream_window = 64;
};

struct ChannelStats {
  uint64_t calls_started = 0;
  uint64_t calls_ok = 0;
  uint64_t calls_failed = 0;
  uint64_t connects = 0;         // Successful connection set-ups.
  uint64_t connect_failures = 0;
  uint64_t late_responses = 0;   // Responses for calls already completed (deadline/cancel).
  uint64_t keepalive_timeouts = 0;  // Connections declared dead: no answer to a PING.
  uint64_t streams_started = 0;
  uint64_t streams_open = 0;
};

class Channel final : public ChannelInterface {
 public:
  enum class State { kIdle, kConnecting, kReady, kBackoff, kClosed };

  // Validates the URI; connects on the first call (or Connect()).
  static absl::StatusOr<std::shared_ptr<Channel>> Create(asio::any_io_executor ex, std::string_view uri,
                                                         ChannelOptions options = {});
  ~Channel() override;  // Close()

  // Connects now (if not connected) and completes with the outcome:
  // void(boost::system::error_code); the message is in last_error().
  template <typename Token>
  auto async_connect(Token&& token) {
    return asio::async_initiate<Token, void(boost::system::error_code)>(
        [this](auto handler) { Connect(asio::any_completion_handler<void(boost::system::error_code)>(std::move(handler))); },
        token);
  }
  void Connect(asio::any_completion_handler<void(boost::system::error_code)> handler);

  void StartCall(ClientContext& context, const MethodInfo& method,
                 const google::protobuf::MessageLite& request, CallHandler handler) override;
  void StartStream(ClientContext& context, const MethodInfo& method, const google::protobuf::MessageLite* request,
                   StreamOpenHandler handler) override;
  asio::any_io_executor get_executor() const override;

  // Idempotent. Pending calls complete with CANCELLED; later calls fail.
  void Close();

  // Calls started while a Batch lives, on the thread running the channel's
  // io_context, leave together when it ends: over RDMA one doorbell for all
  // their SENDs (one ibv_post_send; on Soft-RoCE one system call), over TCP
  // one sendmsg(), instead of one each. For a burst started outside a
  // completion handler (over RDMA the requests a completion handler starts
  // share a doorbell already). Calls that cannot go yet (no connection) are
  // queued as always; once it is up, every queued call leaves in one batch,
  // Batch or not. Nothing leaves before the Batch ends: keep it to the loop
  // that starts the burst. Nestable. Made on another thread (where calls hop
  // to the executor one by one) it does nothing.
  //   { Channel::Batch batch(*channel); for (auto& r : requests) stub.async_Get(ctx, r, handler); }
  class Batch {
   public:
    explicit Batch(Channel& channel);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

   private:
    // The connection whose sends are held, sharing the channel's ownership of
    // it (no allocation); null when there was none to hold.
    std::shared_ptr<transport::Connection> held_;
  };

  const std::string& target() const;
  // Both read on the channel's executor.
  State state() const;
  Status last_error() const;
  ChannelStats stats() const;
  // The transport counters of the connection in use (messages, doorbells,
  // credits, ...), read on the channel's executor; nullopt while there is
  // none (not connected yet, reconnecting, closed).
  std::optional<transport::ConnectionStats> connection_stats() const;

  class Impl;

 private:
  explicit Channel(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace rdmarpc
