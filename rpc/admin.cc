#include "rpc/admin.h"

#include <array>
#include <charconv>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/str_cat.h"
#include "transport/common/log.h"

namespace rdmarpc {

using asio::ip::tcp;

absl::StatusOr<tcp::endpoint> ParseAdminListen(std::string_view text) {
  std::string_view host = "127.0.0.1";
  std::string_view port = text;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      return absl::InvalidArgumentError(absl::StrCat("admin_listen '", internal::Sv(text), "': want [v6addr]:port"));
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else if (const size_t colon = text.rfind(':'); colon != std::string_view::npos) {
    if (colon > 0) host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value > 65535)
    return absl::InvalidArgumentError(
        absl::StrCat("admin_listen '", internal::Sv(text), "': want host:port, :port or port (0-65535)"));
  boost::system::error_code aec;
  const auto address = asio::ip::make_address(std::string(host), aec);
  if (aec)
    return absl::InvalidArgumentError(
        absl::StrCat("admin_listen '", internal::Sv(text), "': '", internal::Sv(host), "' is not an IP address"));
  return tcp::endpoint(address, static_cast<uint16_t>(value));
}

// ---- HTTP ---------------------------------------------------------------------

namespace {

std::string_view Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

AdminResponse Plain(int status, std::string body) {
  AdminResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

// One admin connection: read the request head, answer, close.
struct Session : std::enable_shared_from_this<Session> {
  Session(std::shared_ptr<tcp::socket> s, const asio::any_io_executor& ex, AdminServer::Handler h)
      : socket(std::move(s)), timer(ex), handler(std::move(h)) {}
  std::shared_ptr<tcp::socket> socket;
  asio::steady_timer timer;
  AdminServer::Handler handler;
  std::string request;
  std::array<char, 1024> chunk{};
  std::string response;

  void Read() {
    const size_t room = std::min(chunk.size(), AdminServer::kMaxRequestBytes - request.size());
    socket->async_read_some(asio::buffer(chunk.data(), room),
                            [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                              if (ec) return self->Close();
                              self->request.append(self->chunk.data(), n);
                              if (self->request.find("\r\n\r\n") != std::string::npos ||
                                  self->request.find("\n\n") != std::string::npos)
                                return self->Answer();
                              if (self->request.size() >= AdminServer::kMaxRequestBytes)
                                return self->Write(Plain(431, "request head too large\n"));
                              self->Read();
                            });
  }

  void Answer() {
    // "GET /path?query HTTP/1.1"
    const std::string_view head(request);
    const std::string_view line = head.substr(0, head.find_first_of("\r\n"));
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0)
      return Write(Plain(400, "malformed request line\n"));
    if (line.substr(0, sp1) != "GET") return Write(Plain(405, "only GET\n"));
    std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    target = target.substr(0, target.find('?'));
    Write(handler(target));
  }

  void Write(AdminResponse r) {
    response = absl::StrCat("HTTP/1.1 ", r.status, " ", internal::Sv(Reason(r.status)),
                            "\r\nContent-Type: ", r.content_type, "\r\nContent-Length: ", r.body.size(),
                            r.status == 405 ? "\r\nAllow: GET" : "", "\r\nConnection: close\r\n\r\n", r.body);
    asio::async_write(*socket, asio::buffer(response), [self = shared_from_this()](boost::system::error_code ec, size_t) {
      if (ec) return self->Close();
      boost::system::error_code ignored;
      self->socket->shutdown(tcp::socket::shutdown_send, ignored);
      self->Drain();
    });
  }

  // Reads (and drops) what the client still sends until it closes: closing a
  // socket with unread input sends a reset, which can destroy the response
  // before the client reads it (a 431 answered before the whole request).
  // The timer bounds this.
  void Drain() {
    socket->async_read_some(asio::buffer(chunk), [self = shared_from_this()](boost::system::error_code ec, size_t) {
      if (ec) return self->Close();
      self->Drain();
    });
  }

  void Close() {
    boost::system::error_code ignored;
    socket->close(ignored);
    timer.cancel();
  }
};

}  // namespace

AdminServer::AdminServer(asio::any_io_executor ex, Handler handler)
    : ex_(std::move(ex)), handler_(std::move(handler)), acceptor_(ex_) {}

absl::StatusOr<std::shared_ptr<AdminServer>> AdminServer::Start(asio::any_io_executor ex, std::string_view listen,
                                                                Handler handler) {
  auto endpoint = ParseAdminListen(listen);
  if (!endpoint.ok()) return endpoint.status();
  auto admin = std::make_shared<AdminServer>(std::move(ex), std::move(handler));
  boost::system::error_code ec;
  admin->acceptor_.open(endpoint->protocol(), ec);
  if (!ec) admin->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) admin->acceptor_.bind(*endpoint, ec);
  if (!ec) admin->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) admin->local_ = admin->acceptor_.local_endpoint(ec);
  if (ec)
    return absl::UnavailableError(
        absl::StrCat("admin endpoint: cannot listen on ", internal::Sv(listen), ": ", ec.message()));
  RDMARPC_LOG(kInfo, "admin", "event=listening uri=", admin->uri());
  admin->Accept();
  return admin;
}

std::string AdminServer::uri() const {
  const auto address = local_.address();
  return address.is_v6() ? absl::StrCat("http://[", address.to_string(), "]:", local_.port())
                         : absl::StrCat("http://", address.to_string(), ":", local_.port());
}

void AdminServer::Accept() {
  auto socket = std::make_shared<tcp::socket>(ex_);
  acceptor_.async_accept(*socket, [self = shared_from_this(), socket](boost::system::error_code ec) {
    if (self->closed_) return;
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      RDMARPC_LOG(kWarn, "admin", "event=accept_failed error=\"", ec.message(), "\"");
    } else {
      self->Serve(socket);
    }
    self->Accept();
  });
}

void AdminServer::Serve(std::shared_ptr<tcp::socket> socket) {
  std::erase_if(sessions_, [](const auto& w) { return w.expired(); });
  sessions_.push_back(socket);
  // The session's handler holds this object alive.
  auto page = [self = shared_from_this()](std::string_view path) { return self->handler_(path); };
  auto session = std::make_shared<Session>(std::move(socket), ex_, std::move(page));
  // A client that does not send its request in time is dropped.
  session->timer.expires_after(kRequestTimeout);
  session->timer.async_wait([s = session->socket](boost::system::error_code ec) {
    if (ec) return;
    boost::system::error_code ignored;
    s->close(ignored);
  });
  session->Read();
}

void AdminServer::Close() {
  if (closed_) return;
  closed_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  for (auto& w : sessions_)
    if (auto s = w.lock()) s->close(ignored);
  sessions_.clear();
}

// ---- Pages --------------------------------------------------------------------

namespace {

std::string_view Scheme(std::string_view peer) {
  const size_t p = peer.find("://");
  return p == std::string_view::npos ? std::string_view("unknown") : peer.substr(0, p);
}

std::string JsonString(std::string_view v) {
  std::string out = "\"";
  for (char c : v) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      absl::StrAppend(&out, "\\u00", absl::Hex(u, absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

// The ConnectionStats fields, named once for both pages.
struct StatField {
  const char* name;
  uint64_t transport::ConnectionStats::*field;
  bool gauge;
  const char* help;
};
constexpr StatField kStatFields[] = {
    {"messages_sent", &transport::ConnectionStats::messages_sent, false, "Messages sent on the connection."},
    {"messages_received", &transport::ConnectionStats::messages_received, false, "Messages received."},
    {"bytes_sent", &transport::ConnectionStats::bytes_sent, false, "Message bytes sent."},
    {"bytes_received", &transport::ConnectionStats::bytes_received, false, "Message bytes received."},
    {"frames_received", &transport::ConnectionStats::frames_received, false,
     "Everything that arrived: messages and the transport's own frames (RDMA RTS, CTS, CREDIT, WRITE-with-immediate); keepalive counts it as life."},
    {"wr_posted", &transport::ConnectionStats::wr_posted, false, "RDMA work requests posted (0 for tcp)."},
    {"wr_completed", &transport::ConnectionStats::wr_completed, false, "RDMA work completions polled: one per receive and per signalled send-queue WR (unsignalled SENDs and WRITE chunks have none)."},
    {"send_doorbells", &transport::ConnectionStats::send_doorbells, false,
     "Send kicks: RDMA send queue doorbells (ibv_post_send calls), TCP writes started (send/sendmsg); the sends of one completion batch, one multi-frame read or one SendBatch share one."},
    {"recv_doorbells", &transport::ConnectionStats::recv_doorbells, false,
     "RDMA ibv_post_recv calls (0 for tcp); receives given back by the application go in chains, so fewer than the receives posted."},
    {"sends_unsignaled", &transport::ConnectionStats::sends_unsignaled, false,
     "RDMA SENDs posted without a completion of their own (inline, untracked, inside a completion batch)."},
    {"eager_bytes", &transport::ConnectionStats::eager_bytes, false, "Bytes sent eagerly (SEND)."},
    {"header_bytes_sent", &transport::ConnectionStats::header_bytes_sent, false, "Transport header bytes in SENDs (none for DATA frames with the header in the immediate)."},
    {"rendezvous_bytes", &transport::ConnectionStats::rendezvous_bytes, false, "Bytes sent by rendezvous (RDMA WRITE)."},
    {"credits_available", &transport::ConnectionStats::credits_available, true, "SENDs that may be posted now."},
    {"credit_frames_sent", &transport::ConnectionStats::credit_frames_sent, false, "Credits returned without piggybacking."},
    {"send_waits_for_credit", &transport::ConnectionStats::send_waits_for_credit, false, "Sends that waited for a credit."},
    {"grants_live", &transport::ConnectionStats::grants_live, true, "Rendezvous grants outstanding."},
    {"rendezvous_bytes_held", &transport::ConnectionStats::rendezvous_bytes_held, true,
     "Registered bytes held for incoming rendezvous messages (granted or unreleased)."},
    {"rendezvous_deferred", &transport::ConnectionStats::rendezvous_deferred, false,
     "Incoming large messages whose grant waited for the per-connection cap."},
    {"rnr_errors", &transport::ConnectionStats::rnr_errors, false, "RNR retry-exceeded completions (0 by design)."},
    {"wc_errors", &transport::ConnectionStats::wc_errors, false, "Other non-success work completions."},
    {"qp_state", &transport::ConnectionStats::qp_state, true,
     "RDMA queue pair state, 1 + ibv_qp_state (4 = RTS, healthy; 7 = ERR); 0 for tcp."},
};

void Metric(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  absl::StrAppend(&out, "# HELP ", internal::Sv(name), " ", internal::Sv(help), "\n# TYPE ", internal::Sv(name), " ",
                  internal::Sv(type), "\n");
}

}  // namespace

std::string RenderPrometheus(const ServerMetrics& metrics, const ServerStats& stats,
                             std::span<const AdminConnection> connections) {
  std::string out;
  struct Scalar {
    const char* name;
    const char* type;
    uint64_t value;
    const char* help;
  };
  const Scalar scalars[] = {
      {"rdmarpc_server_connections_open", "gauge", stats.connections_open, "Connections open now."},
      {"rdmarpc_server_connections_accepted_total", "counter", stats.connections_accepted, "Connections accepted."},
      {"rdmarpc_server_calls_in_flight", "gauge", stats.calls_in_flight, "Handlers running now."},
      {"rdmarpc_server_calls_started_total", "counter", stats.calls_started, "Requests received."},
      {"rdmarpc_server_calls_cancelled_total", "counter", stats.calls_cancelled,
       "Calls cancelled (client cancel, deadline, disconnect, shutdown)."},
      {"rdmarpc_server_bad_frames_total", "counter", stats.bad_frames, "Connections closed for a malformed frame."},
      {"rdmarpc_server_keepalive_closed_total", "counter", stats.keepalive_closed,
       "Connections closed because the client answered no keepalive PING (host down, partition)."},
      {"rdmarpc_server_unknown_method_calls_total", "counter", stats.unknown_methods,
       "Requests for a method this server does not serve (answered UNIMPLEMENTED)."},
  };
  for (const auto& s : scalars) {
    Metric(out, s.name, s.type, s.help);
    absl::StrAppend(&out, s.name, " ", s.value, "\n");
  }
  metrics.AppendPrometheus(out);

  std::vector<std::string> labels;
  labels.reserve(connections.size());
  for (const auto& c : connections)
    labels.push_back(absl::StrCat("{conn=\"", c.id, "\",peer=\"", metrics_internal::EscapeLabel(c.peer),
                                  "\",transport=\"", metrics_internal::EscapeLabel(Scheme(c.peer)), "\"}"));
  Metric(out, "rdmarpc_connection_calls_in_flight", "gauge", "Calls in flight on the connection.");
  for (size_t i = 0; i < connections.size(); ++i)
    absl::StrAppend(&out, "rdmarpc_connection_calls_in_flight", labels[i], " ", connections[i].calls_in_flight, "\n");
  for (const auto& f : kStatFields) {
    const std::string name = absl::StrCat("rdmarpc_connection_", f.name, f.gauge ? "" : "_total");
    Metric(out, name, f.gauge ? "gauge" : "counter", f.help);
    for (size_t i = 0; i < connections.size(); ++i)
      absl::StrAppend(&out, name, labels[i], " ", connections[i].stats.*f.field, "\n");
  }
  return out;
}

std::string RenderConnectionsJson(std::span<const AdminConnection> connections) {
  std::string out = "{\"connections\":[";
  for (size_t i = 0; i < connections.size(); ++i) {
    const auto& c = connections[i];
    absl::StrAppend(&out, i == 0 ? "" : ",", "\n{\"id\":", c.id, ",\"peer\":", JsonString(c.peer),
                    ",\"transport\":", JsonString(Scheme(c.peer)), ",\"calls_in_flight\":", c.calls_in_flight,
                    ",\"pending_responses\":", c.pending_responses);
    for (const auto& f : kStatFields) absl::StrAppend(&out, ",\"", f.name, "\":", c.stats.*f.field);
    out += "}";
  }
  out += "\n]}\n";
  return out;
}

}  // namespace rdmarpc
