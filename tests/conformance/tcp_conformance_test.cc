// The transport conformance suite against the TCP backend on loopback.
#include <utility>

#include <boost/asio/append.hpp>
#include <boost/asio/post.hpp>

#include "tests/conformance/transport_conformance.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/uri.h"

namespace rdmarpc::conformance {
namespace {

namespace tcp = transport::tcp;

TransportUnderTest TcpOnLoopback(std::string name, tcp::TcpOptions options) {
  TransportUnderTest t;
  t.name = std::move(name);
  t.listen_with_token = [options](asio::any_io_executor ex, const std::string& token) {
    tcp::TcpOptions o = options;
    o.auth_token = token;
    return tcp::Listen(std::move(ex), "127.0.0.1", 0, o);
  };
  t.connect_with_token = [options](asio::any_io_executor ex, const std::string& uri, const std::string& token,
                                   transport::Listener::AcceptHandler handler) {
    auto parsed = transport::ParseUri(uri);
    if (!parsed.ok()) {
      asio::post(ex, asio::append(std::move(handler),
                                  absl::StatusOr<std::unique_ptr<transport::Connection>>(parsed.status())));
      return;
    }
    tcp::TcpOptions o = options;
    o.auth_token = token;
    tcp::Connect(std::move(ex), parsed->host, parsed->port, o, std::move(handler));
  };
  t.listen = [l = t.listen_with_token](asio::any_io_executor ex) { return l(std::move(ex), ""); };
  t.connect = [c = t.connect_with_token](asio::any_io_executor ex, const std::string& uri,
                                         transport::Listener::AcceptHandler handler) {
    c(std::move(ex), uri, "", std::move(handler));
  };
  t.max_message_size = options.max_message_size;
  return t;
}

TransportUnderTest OneThread(TransportUnderTest t) {
  t.io_concurrency_hint = 1;
  return t;
}

// Default options, and limits small enough that the suite also runs the
// backend's edge paths: the read loop pausing on a full queue and resuming,
// pooled buffers being freed and reallocated, frames at a small size limit.
// Every poll mode (TcpOptions::poll_mode) passes the same suite; adaptive with
// a short spin so that the suite's pauses send it back to the reactor and the
// next bytes wake it. The OneThread variants run on an io_context made with
// concurrency hint 1, where polling connections share one read pass a turn
// (transport/poll_group.h) instead of posting one each.
INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
                         ::testing::Values(TcpOnLoopback("Default", {}),
                                           TcpOnLoopback("Busy", {.poll_mode = tcp::PollMode::kBusy}),
                                           TcpOnLoopback("Adaptive", {.poll_mode = tcp::PollMode::kAdaptive,
                                                                      .adaptive_spin = std::chrono::microseconds(200)}),
                                           OneThread(TcpOnLoopback("BusyOneThread", {.poll_mode = tcp::PollMode::kBusy})),
                                           OneThread(TcpOnLoopback("AdaptiveOneThread",
                                                                   {.poll_mode = tcp::PollMode::kAdaptive,
                                                                    .adaptive_spin = std::chrono::microseconds(200)})),
                                           TcpOnLoopback("TightLimits", {.max_message_size = 64 << 10,
                                                                         .max_queued_messages = 4,
                                                                         .max_queued_bytes = 16 << 10,
                                                                         .pooled_buffers = 2,
                                                                         .pooled_buffer_max_bytes = 4096})),
                         TransportName);

}  // namespace
}  // namespace rdmarpc::conformance
