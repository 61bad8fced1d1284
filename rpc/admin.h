// The admin endpoint: a minimal HTTP/1.1 server (GET only, one request per
// connection, closed after the response) that a Server runs when
// ServerOptions::admin_listen is set. Paths:
//   GET /metrics      Prometheus text exposition format 0.0.4
//   GET /connections  JSON: one object per open connection
// Anything else is 404; a method other than GET is 405; a request whose head
// exceeds kMaxRequestBytes is 431; a client that has not sent its request
// within kRequestTimeout is disconnected.
//
// It binds 127.0.0.1 unless told otherwise: the numbers name peers and
// methods, which is not for the whole network to read.
//
// Threads: runs on the executor it is started with (the server's), so the
// handler reads the server's state without locks.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "absl/status/statusor.h"
#include "rpc/metrics.h"
#include "rpc/server.h"
#include "transport/transport.h"

namespace rdmarpc {

struct AdminResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// "127.0.0.1:9100", "[::1]:0", "0.0.0.0:9100", ":9100" or "9100" (host
// 127.0.0.1); port 0 picks a free port.
absl::StatusOr<asio::ip::tcp::endpoint> ParseAdminListen(std::string_view text);

class AdminServer : public std::enable_shared_from_this<AdminServer> {
 public:
  // Called on the executor with the request's path (query string removed).
  using Handler = std::function<AdminResponse(std::string_view path)>;
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr std::chrono::seconds kRequestTimeout{5};

  // Binds and starts accepting.
  static absl::StatusOr<std::shared_ptr<AdminServer>> Start(asio::any_io_executor ex, std::string_view listen,
                                                           Handler handler);
  // "http://127.0.0.1:9100".
  std::string uri() const;
  // Stops accepting and drops open admin connections. On the executor; idempotent.
  void Close();

  AdminServer(asio::any_io_executor ex, Handler handler);

 private:
  void Accept();
  void Serve(std::shared_ptr<asio::ip::tcp::socket> socket);

  asio::any_io_executor ex_;
  Handler handler_;
  asio::ip::tcp::acceptor acceptor_;
  asio::ip::tcp::endpoint local_;
  std::vector<std::weak_ptr<asio::ip::tcp::socket>> sessions_;
  bool closed_ = false;
};

// A snapshot of one open server connection, for rendering.
struct AdminConnection {
  uint64_t id = 0;
  std::string peer;       // "tcp://127.0.0.1:41234"
  size_t calls_in_flight = 0;
  size_t pending_responses = 0;  // waiting for send space
  transport::ConnectionStats stats;
};

// The whole /metrics page: server counters and gauges, per-method calls and
// latency, per-connection transport counters.
std::string RenderPrometheus(const ServerMetrics& metrics, const ServerStats& stats,
                             std::span<const AdminConnection> connections);
// The /connections page.
std::string RenderConnectionsJson(std::span<const AdminConnection> connections);

}  // namespace rdmarpc
