// Server: serves registered services on one or more URIs (rdma:// and tcp://
// at once), one receive loop per connection, one handler coroutine per call.
//
// Threads: the server and all its connections live on the executor it was
// made with (one thread running the io_context, or a strand); handlers run
// there as coroutines and may co_await anything. A unary method's inline
// fast path (the generated `MInline`, rpc/service.h) is tried first: when it
// answers, the call ends inside the receive handling, with no coroutine.
//
// Per call: the request is parsed straight from the transport's receive
// buffer, the response serialised straight into the send buffer. The deadline
// the client sent is enforced here too: at the deadline the client is answered
// DEADLINE_EXCEEDED and the handler is cancelled (terminal cancellation of
// what it awaits; ServerContext::is_cancelled()). A CANCEL from the client, or
// the client's connection dropping, cancels the handler the same way.
//
// Streaming methods (rpc/stream.h) are calls whose handler gets a stream end;
// the handler's return ends the stream after every message it wrote.
//
// Errors answered without running a handler: UNIMPLEMENTED (method not
// served), INVALID_ARGUMENT (request does not parse),
// RESOURCE_EXHAUSTED (too many calls in flight on the connection, or a
// response too big for it), UNAVAILABLE (server shutting down). A malformed
// frame closes that connection only (logged with its reason).
//
// Limits against abusive clients (docs/rpc.md "Authentication and limits"):
// an auth token (TransportOptions::auth_token) refuses unknown clients in the
// transport handshake; max_calls_per_connection answers RESOURCE_EXHAUSTED;
// a client that stops reading its responses is disconnected; max_connections
// closes connections beyond it at once (event=connection_refused); the
// transports refuse messages over max_message_size.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include "rpc/endpoint.h"
#include "rpc/keepalive.h"
#include "rpc/metrics.h"
#include "rpc/service.h"
#include "rpc/status.h"

namespace rdmarpc {

struct ServerOptions {
  // "rdma://10.0.0.1:7000", "tcp://0.0.0.0:7001"; port 0 picks a free port
  // (see local_uris()).
  std::vector<std::string> listen;
  TransportOptions transport;
  // Calls in flight per connection at most; more are answered
  // RESOURCE_EXHAUSTED without running a handler. 4096 covers any pipelining
  // client (the channel's own default cap is 65,536 across all calls) while
  // bounding what one connection can hold: call state, handler coroutines.
  // A connection with twice this many responses waiting for send space (a
  // client that sends but does not read) is closed.
  size_t max_calls_per_connection = 4096;
  // Connections open at most, over all listeners; the next ones are closed as
  // soon as they are accepted (logged event=connection_refused; the client's
  // calls fail UNAVAILABLE and it reconnects with backoff). Each RDMA
  // connection pins its QP and ~0.5 MiB of registered slots, so this bounds
  // what clients can make the server register.
  size_t max_connections = 10'000;
  // The admin HTTP endpoint (GET /metrics, /connections; rpc/admin.h):
  // "127.0.0.1:9100", ":9100" (host 127.0.0.1), "[::1]:0"; port 0 picks a
  // free port (see admin_uri()). Empty: no endpoint. Bind 127.0.0.1 unless
  // the numbers may be read by the whole network.
  std::string admin_listen;
  // A connection silent for keepalive.interval gets a PING; one that sends
  // nothing within keepalive.timeout after it is closed (event=keepalive_timeout)
  // and everything its client held is freed: a client whose host died, or
  // whose disconnect never arrived, is gone within interval + timeout + 2 x
  // min(interval, timeout) / 4 of its last frame (defaults: 25 s).
  // interval 0 turns it off (rpc/keepalive.h).
  KeepaliveOptions keepalive;
  // Streams: messages a client may send ahead of the handler's reads.
  uint32_t stream_window = 64;
};

struct ServerStats {
  uint64_t connections_accepted = 0;
  uint64_t connections_open = 0;
  uint64_t connections_refused = 0;   // Closed at once: over max_connections.
  uint64_t slow_readers_closed = 0;   // Closed: too many responses unread.
  uint64_t calls_started = 0;
  uint64_t calls_finished = 0;        // Answered, or abandoned by a cancelled client.
  uint64_t calls_in_flight = 0;
  uint64_t calls_cancelled = 0;       // Client cancel, deadline, or disconnect.
  uint64_t bad_frames = 0;            // Connections closed for a malformed frame.
  uint64_t keepalive_closed = 0;      // Closed: no answer to a keepalive PING.
  uint64_t unknown_methods = 0;
  uint64_t streams_started = 0;       // Calls of streaming methods (also in calls_started).
};

class Server {
 public:
  Server(asio::any_io_executor ex, ServerOptions options);
  // Stops at once: listeners closed, connections closed, handlers cancelled.
  // Prefer async_shutdown() for a graceful stop.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Before Start(). The service must outlive the server. Fails with
  // ALREADY_EXISTS if a method id is already served (naming both methods).
  Status AddService(Service& service);
  // Binds every listen URI; on any failure nothing is left listening and the
  // error names the URI.
  Status Start();
  // The URIs clients connect to, ports resolved; valid after Start().
  std::vector<std::string> local_uris() const;
  // "http://127.0.0.1:9100" of the admin endpoint after Start(); empty if off.
  std::string admin_uri() const;

  // Graceful stop: no new connections; connected clients get GOAWAY; calls
  // that arrive afterwards are answered UNAVAILABLE; calls in flight run to
  // completion. After `grace` the remaining handlers are cancelled (their
  // calls answered UNAVAILABLE) and, 250 ms later, connections that have not
  // drained (a client that does not read, or one gone without a disconnect)
  // are closed. Completes (void()) once every handler has returned and every
  // connection is closed.
  template <typename Token>
  auto async_shutdown(std::chrono::milliseconds grace, Token&& token) {
    return asio::async_initiate<Token, void()>(
        [this](auto handler, std::chrono::milliseconds g) { Shutdown(g, asio::any_completion_handler<void()>(std::move(handler))); },
        token, grace);
  }
  void Shutdown(std::chrono::milliseconds grace, asio::any_completion_handler<void()> handler);

  // On the server's executor.
  ServerStats stats() const;
  // On the server's executor: per-method calls and latency (rpc/metrics.h).
  const ServerMetrics& metrics() const;

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace rdmarpc
