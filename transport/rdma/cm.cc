#include "transport/rdma/cm.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <variant>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "transport/common/log.h"

namespace rdmarpc::rdma {
namespace {

using namespace boost::asio::experimental::awaitable_operators;
constexpr auto kNoThrow = asio::as_tuple(asio::use_awaitable);

absl::StatusOr<addrinfo*> ResolveNumeric(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
      rc != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, ":", port, "': ", gai_strerror(rc)));
  return res;
}

struct AddrInfoFree {
  void operator()(addrinfo* p) const noexcept { freeaddrinfo(p); }
};

// Waits for the next event on `channel`, giving up after `timeout`.
asio::awaitable<absl::StatusOr<CmEventPtr>> NextEventWithin(CmChannel& channel,
                                                            std::chrono::milliseconds timeout,
                                                            const char* step) {
  asio::steady_timer timer(co_await asio::this_coro::executor, timeout);
  auto result = co_await (channel.NextEvent() || timer.async_wait(kNoThrow));
  if (result.index() == 0) co_return std::move(std::get<0>(result));
  co_return absl::DeadlineExceededError(
      absl::StrCat("rdma_cm ", step, " did not complete within ", timeout.count(), " ms"));
}

// Expects exactly `want`; anything else becomes a status naming what happened.
absl::Status Expect(const absl::StatusOr<CmEventPtr>& ev, rdma_cm_event_type want,
                    const char* step) {
  if (!ev.ok()) return ev.status();
  if ((*ev)->event == want && (*ev)->status == 0) return absl::OkStatus();
  std::string msg = absl::StrCat("rdma_cm ", step, " failed: got ", DescribeCmEvent(**ev));
  const auto& conn = (*ev)->param.conn;
  if ((*ev)->event == RDMA_CM_EVENT_REJECTED && conn.private_data_len > 0 && conn.private_data != nullptr) {
    // Our Reject() sends a NUL-terminated reason; never trust the peer's length.
    const char* p = static_cast<const char*>(conn.private_data);
    const std::string reason(p, strnlen(p, conn.private_data_len));
    const absl::string_view prefix(kRejectUnauthenticated);
    if (absl::StartsWith(reason, prefix))
      return absl::UnauthenticatedError(
          absl::StrCat("the server refused the connection: ", absl::string_view(reason).substr(prefix.size())));
    absl::StrAppend(&msg, " (peer says: ", reason, ")");
  }
  // Unreachable, rejected, removed device, timeout: all "retry the call".
  return absl::UnavailableError(msg);
}

}  // namespace

std::string DescribeCmEvent(const rdma_cm_event& ev) {
  std::string s = rdma_event_str(ev.event);
  if (ev.status != 0) {
    // Negative values are -errno; positive are transport-specific (e.g. IB reject reasons).
    absl::StrAppend(&s, " status ", ev.status);
    if (ev.status < 0) absl::StrAppend(&s, " (", std::strerror(-ev.status), ")");
  }
  return s;
}

// ---- CmChannel -------------------------------------------------------------

CmChannel::CmChannel(CmEventChannelPtr channel, asio::posix::stream_descriptor fd)
    : channel_(std::move(channel)), fd_(std::move(fd)) {}

CmChannel::~CmChannel() {
  // The fd belongs to the event channel: take it back from Asio without
  // closing it. Detached already, there is no Asio object left to touch: the
  // teardown thread destroys detached channels, perhaps after the io_context
  // (whose descriptor service a cancel would read: found by ASan in the
  // rdma conformance suite).
  if (fd_) DetachFromReactor();
}

absl::StatusOr<std::unique_ptr<CmChannel>> CmChannel::Create(const asio::any_io_executor& ex) {
  CmEventChannelPtr ch(rdma_create_event_channel());
  if (!ch)
    return ErrnoStatus(errno, "rdma_create_event_channel (is rdma_ucm loaded? /dev/infiniband/rdma_cm)");
  int flags = fcntl(ch->fd, F_GETFL);
  if (flags < 0 || fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return ErrnoStatus(errno, "fcntl(O_NONBLOCK) on the rdma_cm event channel");
  asio::posix::stream_descriptor fd(ex, ch->fd);
  return std::unique_ptr<CmChannel>(new CmChannel(std::move(ch), std::move(fd)));
}

asio::awaitable<absl::StatusOr<CmEventPtr>> CmChannel::NextEvent() {
  for (;;) {
    rdma_cm_event* raw = nullptr;
    if (rdma_get_cm_event(channel_.get(), &raw) == 0) co_return CmEventPtr(raw);
    if (errno != EAGAIN && errno != EWOULDBLOCK) co_return ErrnoStatus(errno, "rdma_get_cm_event");
    if (!fd_) co_return absl::FailedPreconditionError("CM event channel already detached for teardown");
    auto [ec] = co_await fd_->async_wait(asio::posix::descriptor_base::wait_read, kNoThrow);
    if (ec == asio::error::operation_aborted) co_return absl::CancelledError("CM event wait cancelled");
    if (ec) co_return absl::UnavailableError(absl::StrCat("CM event channel wait: ", ec.message()));
  }
}

void CmChannel::DetachFromReactor() {
  if (!fd_) return;
  boost::system::error_code ignored;
  fd_->cancel(ignored);
  if (fd_->is_open()) fd_->release();
  fd_.reset();
}

void CmChannel::Cancel() {
  if (!fd_) return;
  boost::system::error_code ignored;
  fd_->cancel(ignored);
}

// ---- CmEndpoint ------------------------------------------------------------

CmEndpoint::CmEndpoint(std::unique_ptr<CmChannel> channel, CmIdPtr id, CmOptions options)
    : channel_(std::move(channel)), id_(std::move(id)), options_(options) {}

CmEndpoint::~CmEndpoint() {
  if (qp_ && !disconnected_) rdma_disconnect(id_.get());  // Best effort; peer sees DISCONNECTED.
}

asio::awaitable<absl::StatusOr<std::unique_ptr<CmEndpoint>>> CmEndpoint::Resolve(
    asio::any_io_executor ex, std::string host, uint16_t port, CmOptions options) {
  auto channel = CmChannel::Create(ex);
  if (!channel.ok()) co_return channel.status();
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id((*channel)->get(), &raw, nullptr, RDMA_PS_TCP) != 0)
    co_return ErrnoStatus(errno, "rdma_create_id");
  std::unique_ptr<CmEndpoint> ep(new CmEndpoint(std::move(*channel), CmIdPtr(raw), options));

  auto ai = ResolveNumeric(host, port, false);
  if (!ai.ok()) co_return ai.status();
  std::unique_ptr<addrinfo, AddrInfoFree> res(*ai);
  const int timeout_ms = static_cast<int>(options.timeout.count());
  if (rdma_resolve_addr(ep->id_.get(), nullptr, res->ai_addr, timeout_ms) != 0)
    co_return ErrnoStatus(errno, absl::StrCat("rdma_resolve_addr(", host, ":", port, ")"));
  auto ev = co_await NextEventWithin(*ep->channel_, options.timeout, "address resolution");
  if (auto st = Expect(ev, RDMA_CM_EVENT_ADDR_RESOLVED, "address resolution"); !st.ok())
    co_return absl::Status(st.code(), absl::StrCat(st.message(), " for ", host, ":", port,
                                                   " - is it reachable through an RDMA device?"));
  ev = absl::StatusOr<CmEventPtr>();  // Ack before the next step.

  if (auto st = ep->ApplyQpOptions(); !st.ok()) co_return st;
  if (rdma_resolve_route(ep->id_.get(), timeout_ms) != 0)
    co_return ErrnoStatus(errno, absl::StrCat("rdma_resolve_route(", host, ":", port, ")"));
  ev = co_await NextEventWithin(*ep->channel_, options.timeout, "route resolution");
  if (auto st = Expect(ev, RDMA_CM_EVENT_ROUTE_RESOLVED, "route resolution"); !st.ok()) co_return st;
  co_return ep;
}

absl::Status CmEndpoint::ApplyQpOptions() {
  uint8_t t = options_.ack_timeout;
  if (rdma_set_option(id_.get(), RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof t) != 0)
    return ErrnoStatus(errno, "rdma_set_option(ACK_TIMEOUT)");
  return absl::OkStatus();
}

absl::Status CmEndpoint::CreateQp(ibv_pd* pd, ibv_qp_init_attr attr) {
  if (pd->context != id_->verbs)
    return absl::FailedPreconditionError(absl::StrCat(
        "the peer is reached through device ", ibv_get_device_name(id_->verbs->device),
        " but the protection domain is on ", ibv_get_device_name(pd->context->device)));
  attr.qp_type = IBV_QPT_RC;
  if (rdma_create_qp(id_.get(), pd, &attr) != 0)
    return ErrnoStatus(errno, absl::StrCat("rdma_create_qp(send_wr=", attr.cap.max_send_wr,
                                           " recv_wr=", attr.cap.max_recv_wr, " inline=",
                                           attr.cap.max_inline_data, ") on ",
                                           ibv_get_device_name(pd->context->device)));
  qp_.reset(id_.get());
  return absl::OkStatus();
}

asio::awaitable<absl::Status> CmEndpoint::AwaitEstablished(const char* step) {
  auto ev = co_await NextEventWithin(*channel_, options_.timeout, step);
  if (auto st = Expect(ev, RDMA_CM_EVENT_ESTABLISHED, step); !st.ok()) co_return st;
  established_ = true;
  const auto& conn = (*ev)->param.conn;
  if (conn.private_data != nullptr && conn.private_data_len > 0 && peer_private_data_.empty())
    peer_private_data_.assign(static_cast<const char*>(conn.private_data), conn.private_data_len);
  co_return absl::OkStatus();
}

asio::awaitable<absl::Status> CmEndpoint::Connect(std::string private_data) {
  if (!qp_) co_return absl::FailedPreconditionError("Connect() before CreateQp()");
  rdma_conn_param param{};
  param.private_data = private_data.data();
  param.private_data_len = static_cast<uint8_t>(private_data.size());
  param.retry_count = options_.retry_count;
  param.rnr_retry_count = options_.rnr_retry_count;
  param.responder_resources = 1;
  param.initiator_depth = 1;
  if (rdma_connect(id_.get(), &param) != 0) co_return ErrnoStatus(errno, "rdma_connect");
  co_return co_await AwaitEstablished("connect");
}

asio::awaitable<absl::Status> CmEndpoint::Accept(std::string private_data) {
  if (!qp_) co_return absl::FailedPreconditionError("Accept() before CreateQp()");
  if (auto st = ApplyQpOptions(); !st.ok()) co_return st;
  rdma_conn_param param{};
  param.private_data = private_data.data();
  param.private_data_len = static_cast<uint8_t>(private_data.size());
  param.retry_count = options_.retry_count;
  param.rnr_retry_count = options_.rnr_retry_count;
  param.responder_resources = 1;
  param.initiator_depth = 1;
  if (rdma_accept(id_.get(), &param) != 0) co_return ErrnoStatus(errno, "rdma_accept");
  co_return co_await AwaitEstablished("accept");
}

absl::Status CmEndpoint::Reject(absl::string_view reason) {
  std::string data(reason.substr(0, 128));  // Private data is small on the wire; keep NUL room.
  data.push_back('\0');
  if (rdma_reject(id_.get(), data.data(), static_cast<uint8_t>(data.size())) != 0)
    return ErrnoStatus(errno, "rdma_reject");
  return absl::OkStatus();
}

namespace {
bool EndsConnection(rdma_cm_event_type type) {
  return type == RDMA_CM_EVENT_DISCONNECTED || type == RDMA_CM_EVENT_TIMEWAIT_EXIT ||
         type == RDMA_CM_EVENT_DEVICE_REMOVAL;
}

// Whether the port the id is bound to is ACTIVE. A CM message sent while it is
// not (Debian 6.1 rxe, netdev down) fails in the driver, and that failure
// leaves the device's GSI QP sending but never receiving again: every later
// rdma_cm connection to or from this host times out, for as long as anyone
// watched (10 minutes; docs/faults.md, "Link down"). So no DREQ goes out on a
// port that is down.
bool PortActive(rdma_cm_id* id) {
  if (id == nullptr || id->verbs == nullptr || id->port_num == 0) return true;  // Unbound: nothing to send.
  ibv_port_attr attr{};
  if (ibv_query_port(id->verbs, id->port_num, &attr) != 0) return true;  // Cannot tell: as before.
  return attr.state == IBV_PORT_ACTIVE;
}
}  // namespace

asio::awaitable<absl::StatusOr<CmEventPtr>> CmEndpoint::NextEvent() {
  auto ev = co_await channel_->NextEvent();
  if (ev.ok() && EndsConnection((*ev)->event)) finished_ = true;
  co_return ev;
}

void CmEndpoint::PrepareTeardown() {
  Disconnect();  // The DREQ the kernel's CM will retry, unless the port is down.
  channel_->DetachFromReactor();
}

void CmEndpoint::AwaitDisconnect() {
  using Clock = std::chrono::steady_clock;
  qp_.reset();
  const auto bound = options_.disconnect_linger;
  if (!established_ || finished_ || bound.count() <= 0) return;
  // The id waits for its disconnect to finish. Waiting for the port has no
  // bound: destroying the id sends the DREQ anyway, and on a down port that
  // costs every later connection (PortActive). The id is all that waits.
  const auto t0 = Clock::now();
  bool must_disconnect = !disconnected_;
  auto deadline = t0 + bound;
  std::optional<Clock::time_point> active_since;
  const char* how = "bound";
  for (bool done = false; !done;) {
    rdma_cm_event* raw = nullptr;
    if (rdma_get_cm_event(channel_->get(), &raw) == 0) {
      CmEventPtr ev(raw);
      if (EndsConnection(ev->event)) {
        how = rdma_event_str(ev->event);
        done = true;
      }
      continue;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      how = "event channel error";
      break;
    }
    if (must_disconnect) {
      // The port must stay ACTIVE for a second first: the address and route
      // come back with the link, not necessarily before the port does.
      if (!PortActive(id_.get())) {
        active_since.reset();
      } else if (!active_since) {
        active_since = Clock::now();
      } else if (Clock::now() - *active_since >= std::chrono::seconds(1)) {
        disconnected_ = true;
        rdma_disconnect(id_.get());
        must_disconnect = false;
        deadline = Clock::now() + bound;
        RDMARPC_LOG(kInfo, "rdma", "event=cm_disconnect_sent reason=\"port active again\" waited_ms=",
                    std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (!must_disconnect && left.count() <= 0) break;
    pollfd pfd{channel_->get()->fd, POLLIN, 0};
    const int64_t step = must_disconnect ? 100 : std::min<int64_t>(left.count(), 1000);
    if (poll(&pfd, 1, static_cast<int>(step)) < 0 && errno != EINTR) {
      how = "poll error";
      break;
    }
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  RDMARPC_LOG(kInfo, "rdma", "event=cm_id_released after=\"", how, "\" lingered_ms=", ms);
}

void CmEndpoint::Disconnect() {
  if (disconnected_) return;
  if (established_ && !finished_ && !PortActive(id_.get())) {
    // No DREQ on a down port (PortActive). The QP still stops: error state
    // flushes its work requests, as rdma_disconnect would have. The DREQ
    // goes when the port is back (AwaitDisconnect), or with the id's destruction.
    if (qp_) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp(), &attr, IBV_QP_STATE);
    }
    return;
  }
  disconnected_ = true;
  rdma_disconnect(id_.get());  // EINVAL when never connected: nothing to undo.
}

// ---- CmListener ------------------------------------------------------------

CmListener::CmListener(asio::any_io_executor ex, std::unique_ptr<CmChannel> channel, CmIdPtr id,
                       CmOptions options)
    : ex_(std::move(ex)), channel_(std::move(channel)), id_(std::move(id)), options_(options) {}

absl::StatusOr<std::unique_ptr<CmListener>> CmListener::Listen(const asio::any_io_executor& ex,
                                                               const std::string& host,
                                                               uint16_t port, CmOptions options,
                                                               int backlog) {
  auto channel = CmChannel::Create(ex);
  if (!channel.ok()) return channel.status();
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id((*channel)->get(), &raw, nullptr, RDMA_PS_TCP) != 0)
    return ErrnoStatus(errno, "rdma_create_id");
  CmIdPtr id(raw);
  auto ai = ResolveNumeric(host, port, true);
  if (!ai.ok()) return ai.status();
  std::unique_ptr<addrinfo, AddrInfoFree> res(*ai);
  if (rdma_bind_addr(id.get(), res->ai_addr) != 0)
    return ErrnoStatus(errno, absl::StrCat("rdma_bind_addr(", host, ":", port,
                                           ") - port in use, or address not local?"));
  if (rdma_listen(id.get(), backlog) != 0)
    return ErrnoStatus(errno, absl::StrCat("rdma_listen(", host, ":", port, ")"));
  return std::unique_ptr<CmListener>(
      new CmListener(ex, std::move(*channel), std::move(id), options));
}

uint16_t CmListener::port() const { return ntohs(rdma_get_src_port(id_.get())); }

asio::awaitable<absl::StatusOr<std::unique_ptr<CmEndpoint>>> CmListener::Accept() {
  for (;;) {
    auto ev = co_await channel_->NextEvent();
    if (!ev.ok()) co_return ev.status();
    if ((*ev)->event != RDMA_CM_EVENT_CONNECT_REQUEST) {
      // Listener-level events (DEVICE_REMOVAL, ADDR_CHANGE) end the listener.
      if ((*ev)->event == RDMA_CM_EVENT_DEVICE_REMOVAL) {
        device_removed_ = true;
        co_return absl::UnavailableError("RDMA device removed under the listener");
      }
      RDMARPC_LOG(kInfo, "cm", "event=listener_ignored cm_event=", DescribeCmEvent(**ev));
      continue;
    }
    CmIdPtr id((*ev)->id);
    std::string peer_data;
    const auto& conn = (*ev)->param.conn;
    if (conn.private_data != nullptr && conn.private_data_len > 0)
      peer_data.assign(static_cast<const char*>(conn.private_data), conn.private_data_len);
    ev = absl::StatusOr<CmEventPtr>();  // rdma_migrate_id waits for this ack.

    auto channel = CmChannel::Create(ex_);
    if (!channel.ok()) {
      rdma_reject(id.get(), nullptr, 0);
      co_return channel.status();
    }
    if (rdma_migrate_id(id.get(), (*channel)->get()) != 0) {
      absl::Status st = ErrnoStatus(errno, "rdma_migrate_id");
      rdma_reject(id.get(), nullptr, 0);
      co_return st;
    }
    std::unique_ptr<CmEndpoint> ep(new CmEndpoint(std::move(*channel), std::move(id), options_));
    ep->peer_private_data_ = std::move(peer_data);
    co_return ep;
  }
}

}  // namespace rdmarpc::rdma
