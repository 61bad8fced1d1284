// rdma_cm driven from Asio.
//
// Each CmEndpoint owns one rdma_cm_id on its *own* event channel, whose fd sits
// in the Asio reactor. Giving every id its own channel removes demultiplexing:
// the coroutine that waits for an id's events is the only reader of its channel.
// A listener's CONNECT_REQUEST produces a new id that is migrated onto a fresh
// channel before anything else happens to it.
//
// Setup is split in two so the caller can post RECVs before the peer can SEND:
//   client: Resolve() -> CreateQp() -> post RECVs -> Connect()
//   server: Listener::Accept() -> CreateQp() -> post RECVs -> Accept()
//
// Threading: an endpoint is used from one executor (its coroutines run there).
// Every CM event is acked exactly once (CmEventPtr acks when it is dropped).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

namespace asio = boost::asio;

// Prefix of a reject reason that means "not authenticated" (Reject()).
inline constexpr char kRejectUnauthenticated[] = "unauthenticated: ";

// Connection-level knobs that rdma_cm would otherwise leave at values that hurt.
struct CmOptions {
  // Local ACK timeout exponent: 4.096 us * 2^14 = 67 ms. Soft-RoCE has no
  // retransmit timer at all when this is 0 (a dead peer is never detected), and
  // its emulated wire has millisecond RTTs, so we keep well above that.
  uint8_t ack_timeout = 14;
  // Transport retries before IBV_WC_RETRY_EXC_ERR. 7, the field's maximum: on
  // hardware a path that carries nothing for 8 x 67 ms fails the connection.
  // Soft-RoCE treats 7 as "retry forever" (rxe_comp.c, like RNR's 7), so there
  // a silent path is found by keepalive alone. Any finite value is worse on
  // rxe: it counts NAKed retransmissions too and starts the count again only
  // when a whole work request completes, so under 10% loss a 64 KiB+ message
  // runs out (measured with 6: 816 of 1,000 calls UNAVAILABLE, docs/faults.md).
  uint8_t retry_count = 7;
  // RNR retries. Credit-based flow control means RNR never happens by design;
  // 0 turns a violation into an immediate, visible error instead of rdma_cm's
  // default of infinite silent retries (a stall).
  uint8_t rnr_retry_count = 0;
  // Upper bound for address + route resolution and for connect/accept.
  std::chrono::milliseconds timeout{5000};
  // How long a closed connection's cm_id (its QP already gone) waits for the
  // peer's CM to answer its DREQ (CmEndpoint::AwaitDisconnect), on a thread of
  // its own. Destroying an id gives up the kernel's DREQ retries, so a DREQ
  // lost to a link outage would never reach the peer; waiting lets a retry
  // after link up close the old connection on both sides. 0: destroyed at
  // once. (What rxe needs is that no DREQ leaves while the local port is down:
  // see Disconnect. This wait was not shown to be needed on its own.)
  std::chrono::milliseconds disconnect_linger{120000};
};

// The event channel fd registered with the reactor. Owns the channel.
class CmChannel {
 public:
  static absl::StatusOr<std::unique_ptr<CmChannel>> Create(const asio::any_io_executor& ex);
  ~CmChannel();
  CmChannel(const CmChannel&) = delete;
  CmChannel& operator=(const CmChannel&) = delete;

  rdma_event_channel* get() const { return channel_.get(); }
  // Takes the fd back from the reactor (it stays open: blocking reads become
  // the caller's business) and lets go of the Asio object, so this channel
  // may then be used and destroyed on any thread, after its io_context too
  // (QpTeardown's thread). Executor only; NextEvent may not be called after.
  void DetachFromReactor();

  // Next event on this channel; waits in the reactor without blocking the thread.
  asio::awaitable<absl::StatusOr<CmEventPtr>> NextEvent();
  // Cancels a pending NextEvent (it completes with CANCELLED).
  void Cancel();

 private:
  CmChannel(CmEventChannelPtr channel, asio::posix::stream_descriptor fd);
  CmEventChannelPtr channel_;
  // Borrowed fd: released, never closed, by ~CmChannel. Empty once detached.
  std::optional<asio::posix::stream_descriptor> fd_;
};

class CmEndpoint {
 public:
  // Client side: resolves address and route for host:port. On success the id
  // is bound to a device; `device()` tells which (check it against your PD's).
  static asio::awaitable<absl::StatusOr<std::unique_ptr<CmEndpoint>>> Resolve(
      asio::any_io_executor ex, std::string host, uint16_t port, CmOptions options);

  ~CmEndpoint();
  CmEndpoint(const CmEndpoint&) = delete;
  CmEndpoint& operator=(const CmEndpoint&) = delete;

  ibv_context* verbs() const { return id_->verbs; }
  rdma_cm_id* id() const { return id_.get(); }
  ibv_qp* qp() const { return qp_ ? qp_->qp : nullptr; }
  // Private data the peer sent with its connect request / accept.
  const std::string& peer_private_data() const { return peer_private_data_; }

  // Creates the RC QP on `pd` (which must be on verbs()). Capacities are checked
  // against the device by the caller; errors name the device and sizes.
  absl::Status CreateQp(ibv_pd* pd, ibv_qp_init_attr attr);

  // Client: rdma_connect with `private_data`, waits for ESTABLISHED.
  asio::awaitable<absl::Status> Connect(std::string private_data);
  // Server: rdma_accept with `private_data`, waits for ESTABLISHED.
  asio::awaitable<absl::Status> Accept(std::string private_data);
  // Rejects a pending connect request, with a reason the peer receives. A
  // reason starting with kRejectUnauthenticated fails the peer's Connect()
  // with UNAUTHENTICATED (the rest of the text says why); any other with
  // UNAVAILABLE.
  absl::Status Reject(absl::string_view reason);

  // Waits for the next event after establishment (DISCONNECTED, DEVICE_REMOVAL,
  // TIMEWAIT_EXIT...). Used by connection owners to notice the peer leaving.
  asio::awaitable<absl::StatusOr<CmEventPtr>> NextEvent();
  // Starts a disconnect (idempotent). The QP moves to error, flushing its WRs.
  // While the local port is not ACTIVE no DREQ is sent (see PortActive in
  // cm.cc): the QP is moved to error directly and the DREQ waits for
  // AwaitDisconnect, or for the next Disconnect() call with the port up.
  void Disconnect();
  // Cancels a pending NextEvent.
  void Cancel() { channel_->Cancel(); }

  // Ending an endpoint off the executor. PrepareTeardown (on the executor,
  // nothing waiting on the endpoint) starts the disconnect (deferred while
  // the port is down, see Disconnect) and takes the event channel out of the
  // reactor. Then, blocking, on a thread of the owner's choosing: DestroyQp
  // (rxe may hold a QP with packets in flight for tens of seconds), and after
  // the CQ is gone too, AwaitDisconnect: if the connection was up and its end
  // not yet reported, waits until rdma_cm reports it (DISCONNECTED,
  // TIMEWAIT_EXIT, DEVICE_REMOVAL) or options.disconnect_linger passes; a
  // deferred DREQ goes once the port has been ACTIVE for a second, and the
  // wait for that has no bound. The cm_id and channel go with the endpoint.
  void PrepareTeardown();
  void DestroyQp() { qp_.reset(); }
  void AwaitDisconnect();

 private:
  friend class CmListener;
  CmEndpoint(std::unique_ptr<CmChannel> channel, CmIdPtr id, CmOptions options);
  absl::Status ApplyQpOptions();
  asio::awaitable<absl::Status> AwaitEstablished(const char* step);

  // Declaration order is destruction order reversed: QP, then id, then channel.
  std::unique_ptr<CmChannel> channel_;
  CmIdPtr id_;
  CmQpPtr qp_;
  CmOptions options_;
  std::string peer_private_data_;
  bool disconnected_ = false;  // rdma_disconnect called.
  bool established_ = false;
  bool finished_ = false;  // rdma_cm reported the connection's end.
};

class CmListener {
 public:
  // Binds host:port ("0.0.0.0" for all; port 0 picks one) and listens.
  static absl::StatusOr<std::unique_ptr<CmListener>> Listen(const asio::any_io_executor& ex,
                                                            const std::string& host,
                                                            uint16_t port, CmOptions options,
                                                            int backlog = 64);
  uint16_t port() const;
  // Waits for the next CONNECT_REQUEST and returns it as an endpoint on its own
  // channel, ready for CreateQp() and Accept() (or Reject()).
  asio::awaitable<absl::StatusOr<std::unique_ptr<CmEndpoint>>> Accept();
  void Cancel() { channel_->Cancel(); }
  // Accept() failed because the listener's device went away
  // (RDMA_CM_EVENT_DEVICE_REMOVAL): this listener is finished.
  bool device_removed() const { return device_removed_; }

 private:
  CmListener(asio::any_io_executor ex, std::unique_ptr<CmChannel> channel, CmIdPtr id,
             CmOptions options);
  asio::any_io_executor ex_;
  std::unique_ptr<CmChannel> channel_;
  CmIdPtr id_;
  CmOptions options_;
  bool device_removed_ = false;
};

// Human-readable "event STATUS" for error messages.
std::string DescribeCmEvent(const rdma_cm_event& ev);

}  // namespace rdmarpc::rdma
