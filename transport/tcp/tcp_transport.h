// The TCP backend of the transport seam: the same message contract as RDMA
// (transport/transport.h), carried over Asio stream sockets so that everything
// above the seam runs where there is no RDMA NIC, and so the benchmark has a
// baseline.
//
// Wire: a handshake, then every message is one frame, a 4-byte little-endian
// payload length followed by the payload. A frame longer than max_message_size
// from the peer ends that connection (logged as event=bad_frame) and fails its
// operations with UNAVAILABLE; other connections are unaffected.
//
// Handshake (little-endian), before any frame:
//   client -> server, kClientHelloBytes: "rRPC", version 1, flags (bit 0: an
//     auth proof follows), 2 reserved bytes, u32 largest message the client
//     accepts, 32 bytes of auth proof (transport/common/auth.h; zeros without).
//   server -> client, kServerVerdictBytes: "rRPS", version 1, verdict
//     (auth::Verdict), 2 reserved bytes, u32 largest message the server accepts.
// The listener reads the hello within handshake_timeout, answers, and hands
// the connection to Accept() only on kOk; a refused client's connect fails
// with UNAUTHENTICATED naming the reason, and the listener logs
// event=auth_refused and closes the socket. Each side then refuses locally
// (RESOURCE_EXHAUSTED from Prepare()) a message larger than the peer accepts.
// Handshakes run concurrently: a client that connects and stays silent holds
// one of kMaxHandshakes slots for handshake_timeout, never the listener.
//
// Threads: a connection (and a listener) is used from its executor -- one
// thread running the io_context, or a strand. Every call (Prepare, Send,
// Receive, Close, destroying a Message or SendBuffer of the connection,
// emitting a Receive's cancellation signal) must be made there; only stats()
// may be read from anywhere. Accepted connections get the listener's executor
// (pass a strand to Listen() when several threads run the io_context).
// Completion handlers run on their associated executor (default: the
// connection's), never inside the call that started the operation.
//
// Lifetimes (beyond transport.h): destroying a connection closes it, and the
// socket operations still in flight keep its internals alive until they have
// completed, so destroying it with operations pending is safe as long as the
// io_context outlives it; their handlers complete CANCELLED. Messages and
// SendBuffers must still be released first.
//
// Memory: one read loop per connection reads each frame straight into a
// pooled buffer that the delivered Message points at; send buffers from
// Prepare() come from the same pool, so after warm-up the steady path does not
// allocate in this backend.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace rdmarpc::transport::tcp {

namespace asio = boost::asio;

// How a connection learns that its socket has bytes to read.
enum class PollMode {
  // The reactor (epoll) wakes it: no CPU spent while idle. The default.
  kEvent,
  // The executor's thread polls the socket with a non-blocking recv() from a
  // task it posts again after every pass (other handlers, timers and sockets
  // of the io_context run in between), until `adaptive_spin` has passed
  // without a byte, then it waits in the reactor again until the next one.
  kAdaptive,
  // As kAdaptive, but polling for as long as the connection lives: that
  // thread never sleeps (give the io_context a core of its own).
  kBusy,
};
const char* PollModeName(PollMode mode);
// "event", "adaptive" or "busy"; anything else is an error naming the choices.
absl::StatusOr<PollMode> ParsePollMode(absl::string_view name);

struct TcpOptions {
  // Largest message either side may send. A peer's larger frame ends the
  // connection. 64 MiB: large enough for any RPC payload we expect, small
  // enough that a hostile length prefix cannot make us allocate gigabytes. Must
  // fit the 32-bit length prefix.
  size_t max_message_size = size_t{64} << 20;
  // Received messages waiting for a Receive() before the read loop stops
  // reading the socket; TCP flow control then slows the sender instead of our
  // queue growing without bound. At least one message is always read.
  size_t max_queued_messages = 1024;
  size_t max_queued_bytes = size_t{64} << 20;
  // Free buffers a connection keeps for reuse, and the largest buffer it keeps:
  // enough to cover a pipeline of small and medium messages without touching
  // the heap, without pinning tens of MiB per connection after one big
  // transfer (bigger buffers are freed when they come back).
  size_t pooled_buffers = 64;
  size_t pooled_buffer_max_bytes = size_t{1} << 20;
  // Bound for resolve + connect. The kernel's own SYN retry limit is about two
  // minutes, far too long for a caller that wants to fail over.
  std::chrono::milliseconds connect_timeout{10'000};
  // Shared secret (transport/common/auth.h). Listener: non-empty means every
  // client must prove it; empty accepts anyone. Connector: non-empty sends a
  // proof (a listener without a token ignores it). TransportOptions::auth_token
  // sets it for both transports.
  std::string auth_token;
  // How long the listener waits for a connected client's hello. Long enough
  // for a client on a loaded host, short enough that silent connections do
  // not pile up.
  std::chrono::milliseconds handshake_timeout{5'000};
  // kAdaptive/kBusy take the epoll round (a wake-up, a reactor operation) out
  // of every message, the way RDMA's run-to-completion polling takes out the
  // completion channel: what a latency-critical deployment runs, and what a
  // fair comparison with a spinning RDMA poller needs (docs/transport.md,
  // "TCP polling"). An empty pass costs a recv() system call.
  PollMode poll_mode = PollMode::kEvent;
  // kAdaptive: how long polling goes on after the last bytes arrived.
  std::chrono::microseconds adaptive_spin{50};
};

inline constexpr size_t kClientHelloBytes = 44;
inline constexpr size_t kServerVerdictBytes = 12;
// Handshakes in progress per listener at most; beyond it the listener stops
// accepting until one finishes (the kernel's backlog holds the rest).
inline constexpr size_t kMaxHandshakes = 64;

// The client's handshake bytes (above), with a proof of `auth_token` when it
// is non-empty; for clients that speak the wire directly (tests, fuzzers).
absl::StatusOr<std::string> EncodeClientHello(const std::string& auth_token, uint32_t max_message);

// Binds and listens on host:port (port 0: the kernel picks; local_uri() then
// reports the real one). `host` may be a numeric address or a name; the first
// address it resolves to is used. Errors name the endpoint and the reason.
absl::StatusOr<std::unique_ptr<Listener>> Listen(asio::any_io_executor ex, const std::string& host,
                                                 uint16_t port, TcpOptions options = {});

using ConnectHandler = asio::any_completion_handler<void(absl::StatusOr<std::unique_ptr<Connection>>)>;

// Resolves host, connects (TCP_NODELAY set) and completes with the connection,
// whose executor is `ex`. Failures: UNAVAILABLE (unresolvable, refused,
// unreachable), DEADLINE_EXCEEDED (connect_timeout), INVALID_ARGUMENT (bad
// options). The handler runs on its associated executor, never inline. Not
// cancellable; connect_timeout bounds it.
void Connect(asio::any_io_executor ex, const std::string& host, uint16_t port, TcpOptions options,
             ConnectHandler handler);

// Connect() for any completion token (use_awaitable, deferred, use_future, a
// callback).
template <typename Token>
auto AsyncConnect(asio::any_io_executor ex, const std::string& host, uint16_t port,
                  TcpOptions options, Token&& token) {
  return asio::async_initiate<Token, void(absl::StatusOr<std::unique_ptr<Connection>>)>(
      [](auto handler, asio::any_io_executor e, const std::string& h, uint16_t p, TcpOptions o) {
        Connect(std::move(e), h, p, std::move(o), std::move(handler));
      },
      token, std::move(ex), host, port, std::move(options));
}

}  // namespace rdmarpc::transport::tcp
