// The transport seam: a message-shaped, ordered, reliable connection between
// two processes. It knows nothing about RPCs. Backends: transport/rdma (RC QPs,
// eager SEND/RECV + rendezvous RDMA WRITE) and transport/tcp (Asio sockets).
//
// Contracts every backend keeps (the conformance suite in tests/conformance
// checks them against each backend):
//  - Messages arrive whole, in send order, each exactly once, with their
//    exact length (0 bytes allowed), up to max_message_size().
//  - Completion handlers run on their associated executor (default: the
//    connection's executor), never inline inside the initiating call.
//  - Receive() honours per-operation cancellation (terminal/partial): the
//    handler completes with CANCELLED and no message is lost -- the next
//    Receive() gets it.
//  - A MessageSink (SetSink) gets the same messages in the same order, inline
//    from the transport's own handlers, never inside the consumer's calls.
//  - After an error or Close(), every pending and later operation completes
//    with a non-OK status (UNAVAILABLE for transport failures, CANCELLED for
//    Close()); a failure on one connection affects that connection only.
//
// Lifetimes: a Connection must outlive the operations started on it; destroy
// it only after Close() and after its pending handlers ran (or drop the
// io_context). Message and SendBuffer keep a pointer to their connection's
// buffer owner and must be released before the connection is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc::transport {

namespace asio = boost::asio;

// Someone who lends memory to a Message or SendBuffer and wants it back.
class BufferOwner {
 public:
  virtual void Release(uint64_t token) noexcept = 0;

 protected:
  ~BufferOwner() = default;
};

// Transport-owned bytes lent to the application; returned to their owner
// (Release(token)) when dropped. Base of Message and SendBuffer.
template <typename Byte>
class LentBytes {
 public:
  LentBytes() = default;
  LentBytes(std::span<Byte> data, BufferOwner* owner, uint64_t token) noexcept
      : data_(data), owner_(owner), token_(token) {}
  LentBytes(LentBytes&& o) noexcept : data_(o.data_), owner_(std::exchange(o.owner_, nullptr)), token_(o.token_) {}
  LentBytes& operator=(LentBytes&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = o.data_;
      owner_ = std::exchange(o.owner_, nullptr);
      token_ = o.token_;
    }
    return *this;
  }
  // Inline: most LentBytes destroyed are moved-from (a message passes through
  // several on its way to the consumer), and a call per destruction cost ~150
  // instructions per RPC.
  ~LentBytes() {
    if (owner_ != nullptr) owner_->Release(token_);
  }

  std::span<Byte> data() const { return data_; }
  size_t size() const { return data_.size(); }
  void Reset() noexcept {
    if (owner_ != nullptr) std::exchange(owner_, nullptr)->Release(token_);
    data_ = {};
  }

 protected:
  std::span<Byte> data_;
  BufferOwner* owner_ = nullptr;
  uint64_t token_ = 0;
};

// A received message: a read-only view of transport-owned memory (for RDMA, a
// registered receive slot or a granted rendezvous buffer). Destroying the
// Message returns that memory, so holding many Messages holds back credits.
class Message : public LentBytes<const std::byte> {
 public:
  using LentBytes::LentBytes;
};

// Writable transport-owned memory for one outgoing message of a fixed size:
// serialise straight into it, then hand it to Send(). Dropping it unsent
// returns the memory.
class SendBuffer : public LentBytes<std::byte> {
 public:
  using LentBytes::LentBytes;
  // For the backend that made it: takes the token without releasing it.
  uint64_t Detach() noexcept {
    owner_ = nullptr;
    return token_;
  }
  BufferOwner* owner() const { return owner_; }
};

// Counters a connection keeps; read with stats() from any thread (a snapshot).
struct ConnectionStats {
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // Everything that arrived from the peer: messages, and the transport's own
  // frames below them (RDMA: every receive completion, RTS, CTS, CREDIT and
  // WRITE-with-immediate included; TCP, which has no frames of its own:
  // messages_received). The RPC keepalive counts it as a sign of life
  // (rpc/keepalive.h).
  uint64_t frames_received = 0;
  // RDMA only (zero elsewhere).
  uint64_t wr_posted = 0;
  // Work completions polled: one per receive and per signalled send-queue WR.
  // Unsignalled SENDs (sends_unsignaled) and a WRITE chain's leading chunks
  // have none, so wr_posted - wr_completed is not what is in flight
  // (send_queue_used is).
  uint64_t wr_completed = 0;
  // Kicks of the sending side: RDMA, ibv_post_send calls (each one doorbell;
  // one system call on Soft-RoCE); TCP, writes started (send()/sendmsg()
  // calls, and the reactor's write of a remainder counted once). What is sent
  // while a batch of messages is delivered (an RDMA completion batch, a TCP
  // read of several frames) and under a SendBatch shares one.
  uint64_t send_doorbells = 0;
  // RDMA only: ibv_post_recv calls. Receives given back when messages are
  // dropped go in chains (RdmaOptions::recv_repost_batch), so this is below
  // the RECVs posted.
  uint64_t recv_doorbells = 0;
  // SENDs posted unsignalled (no completion of their own): inline SendUntracked()
  // messages sent while a completion batch is handled (docs/transport.md,
  // "Selective signalling").
  uint64_t sends_unsignaled = 0;
  uint64_t eager_bytes = 0;
  // Transport header bytes put in SENDs: 16 per control frame (RTS, CTS,
  // CREDIT) and per DATA frame to a peer without immediate headers; none for
  // a DATA frame whose header rode in the immediate (RdmaOptions::
  // data_header_in_immediate).
  uint64_t header_bytes_sent = 0;
  uint64_t rendezvous_bytes = 0;
  uint64_t credits_available = 0;    // SENDs we may post now.
  uint64_t credit_frames_sent = 0;   // Credits returned without piggybacking.
  uint64_t send_waits_for_credit = 0;
  uint64_t grants_live = 0;
  // Registered bytes held for incoming rendezvous messages (granted, being
  // written, or delivered and not yet released), and the announcements (RTS)
  // that waited because holding them would pass the connection's cap.
  uint64_t rendezvous_bytes_held = 0;
  uint64_t rendezvous_deferred = 0;
  // Large messages sent from memory registered for that message alone (above
  // the send pool's largest class, 1 MiB, or the pool at its cap): each one
  // paid an ibv_reg_mr. The rest were written into the connection's send pool,
  // which holds send_pool_registered_bytes of registered slabs.
  uint64_t rendezvous_send_registrations = 0;
  uint64_t send_pool_registered_bytes = 0;
  // Incoming rendezvous messages granted through a type-2 memory window bound
  // over a buffer of the connection's grant pool (nothing registered), and
  // those that needed an MR of their own (the device has no type-2 windows,
  // RdmaOptions::grant_windows is off, the message is above the pool's
  // largest class, 1 MiB, or the pool is at its cap).
  uint64_t grants_windowed = 0;
  uint64_t rendezvous_receive_registrations = 0;
  // Work requests on the send queue not yet completed (signalled or not), and
  // windowed grants written whose LOCAL_INV has not completed yet: what a
  // connection that went silent was waiting for.
  uint64_t send_queue_used = 0;
  uint64_t invalidations_pending = 0;
  uint64_t rnr_errors = 0;           // IBV_WC_RNR_RETRY_EXC_ERR seen: 0 by design.
  uint64_t wc_errors = 0;            // Non-success completions of any other kind.
  // The queue pair's state as the device reports it, 1 + ibv_qp_state:
  // 1 RESET, 2 INIT, 3 RTR, 4 RTS (healthy), 5 SQD, 6 SQE, 7 ERR; 0 when there
  // is no QP (TCP, or after teardown).
  uint64_t qp_state = 0;
};

// One line of the counters that tell why a connection went quiet, for logs:
// "messages_sent=.. messages_received=.. wr_posted=.. ...".
std::string SummarizeStats(const ConnectionStats& s);

using SendHandler = asio::any_completion_handler<void(absl::Status)>;
using ReceiveHandler = asio::any_completion_handler<void(absl::StatusOr<Message>)>;

// The receiving side for a consumer that takes every message as it arrives
// (an RPC endpoint), instead of asking with Receive() for each one: no
// handler is built, queued and dispatched per message (~450 instructions a
// message over TCP, bench/cpu_per_call). Connection::SetSink() installs it.
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  // One message, in arrival order, on the connection's executor, from the
  // transport's own I/O or completion handler: never inside a call the
  // consumer made on this connection. It may Send(), Close() the connection
  // or destroy it (and the sink with it); the transport checks before it
  // delivers the next message.
  virtual void OnMessage(Message message) = 0;
  // Once, when the connection fails, with the status Receive() would report;
  // nothing is delivered after it. Posted, not from inside a call. Not called
  // once the consumer called Close().
  virtual void OnConnectionError(absl::Status status) = 0;
  // `count` sends made with SendUntracked() completed (their buffers are
  // back: Prepare() may have room again). Called like OnMessage(), from the
  // transport's own handlers, once per batch of completions, never inside
  // a call the consumer made. Not called for failed sends: a failure fails
  // the connection (OnConnectionError).
  virtual void OnSendsCompleted(size_t count) { (void)count; }
};

class Connection {
 public:
  virtual ~Connection() = default;

  virtual asio::any_io_executor get_executor() const = 0;
  // Largest message Send() accepts and Receive() can deliver.
  virtual size_t max_message_size() const = 0;
  // "rdma://10.0.0.1:7000" / "tcp://127.0.0.1:7000" of the peer.
  virtual std::string peer() const = 0;

  // Memory for one outgoing message of exactly `size` bytes. Thread: the
  // connection's executor.
  virtual absl::StatusOr<SendBuffer> Prepare(size_t size) = 0;
  // Queues `buffer` for sending; completes once the transport is done with it.
  // An empty `handler` makes it an untracked send (SendUntracked()): every
  // backend must accept one.
  virtual void Send(SendBuffer buffer, SendHandler handler) = 0;
  // A send nobody waits for alone, for consumers with a sink: its completion
  // is counted to MessageSink::OnSendsCompleted(), its failure is the
  // connection's (OnConnectionError). Saves a type-erased handler per message.
  void SendUntracked(SendBuffer buffer) { Send(std::move(buffer), SendHandler()); }
  virtual void Receive(ReceiveHandler handler) = 0;
  // Hands every message from now on to `sink` (messages received before go
  // first, from a posted operation); Receive() then fails with
  // FAILED_PRECONDITION. Once per connection, before any Receive(). `sink`
  // must stay valid until Close() or the connection's destruction. False
  // when the backend has no sink: use Receive().
  virtual bool SetSink(MessageSink* sink) {
    (void)sink;
    return false;
  }
  // Idempotent. Pending operations complete with CANCELLED; the peer sees the
  // connection end (its operations fail with UNAVAILABLE).
  virtual void Close() = 0;
  virtual ConnectionStats stats() const = 0;
  // stats().frames_received without the rest (RDMA's stats() queries the QP):
  // read by the RPC keepalive's sweep. Both transports override it cheaply.
  virtual uint64_t frames_received() const { return stats().frames_received; }
  // Sends made between HoldSends() and the matching ReleaseSends() go out
  // together at the release: over RDMA as one chain of SENDs (one
  // ibv_post_send: one doorbell, on Soft-RoCE one system call), over TCP in
  // one sendmsg(), instead of one each. For a burst started outside the
  // transport's own handlers (both batch by themselves what is sent while
  // they deliver several messages at once). Held sends still wait for credits and send-queue room as
  // always; a send that needs a one-sided operation (a rendezvous WRITE)
  // posts what is held first, so order is kept. Nestable; the connection's
  // executor only; a release without a hold is ignored. Use SendBatch.
  // The defaults (a backend without batching) send at once.
  virtual void HoldSends() {}
  virtual void ReleaseSends() {}

  template <typename Token>
  auto async_send(SendBuffer buffer, Token&& token) {
    return asio::async_initiate<Token, void(absl::Status)>(
        [this](auto handler, SendBuffer b) { Send(std::move(b), std::move(handler)); }, token,
        std::move(buffer));
  }
  // Convenience: copies `bytes` into a prepared buffer first.
  template <typename Token>
  auto async_send(std::span<const std::byte> bytes, Token&& token) {
    return asio::async_initiate<Token, void(absl::Status)>(
        [this](auto handler, std::span<const std::byte> b) { SendCopy(b, std::move(handler)); },
        token, bytes);
  }
  template <typename Token>
  auto async_receive(Token&& token) {
    return asio::async_initiate<Token, void(absl::StatusOr<Message>)>(
        [this](auto handler) { Receive(std::move(handler)); }, token);
  }

 private:
  void SendCopy(std::span<const std::byte> bytes, SendHandler handler);
};

// Holds a connection's sends for its lifetime (Connection::HoldSends):
//   { transport::SendBatch batch(*conn); for (auto& m : burst) conn->SendUntracked(...); }
// The connection must outlive it.
class SendBatch {
 public:
  explicit SendBatch(Connection& c) : c_(c) { c_.HoldSends(); }
  ~SendBatch() { c_.ReleaseSends(); }
  SendBatch(const SendBatch&) = delete;
  SendBatch& operator=(const SendBatch&) = delete;

 private:
  Connection& c_;
};

class Listener {
 public:
  virtual ~Listener() = default;
  using AcceptHandler = asio::any_completion_handler<void(absl::StatusOr<std::unique_ptr<Connection>>)>;
  virtual void Accept(AcceptHandler handler) = 0;
  // The URI peers connect to (port resolved when 0 was asked for).
  virtual std::string local_uri() const = 0;
  virtual void Close() = 0;
  // True once the listener can accept nothing more because what it listened
  // on went away (an RDMA listener bound to one address whose device was
  // removed): every Accept fails UNAVAILABLE. Close it and listen again when
  // the address is back.
  virtual bool broken() const { return false; }

  template <typename Token>
  auto async_accept(Token&& token) {
    return asio::async_initiate<Token, void(absl::StatusOr<std::unique_ptr<Connection>>)>(
        [this](auto handler) { Accept(std::move(handler)); }, token);
  }
};

}  // namespace rdmarpc::transport
