// One end of a stream (client or server): the flow control, queues and
// completion rules shared by both sides. The typed ends users see
// (ServerWriter, ClientReader, ...) are thin wrappers over it (rpc/stream.h);
// the Channel and the Server derive from it to reach their connection.
//
// Everything here runs on the owning executor (the channel's or server's);
// the Start* entry points hop there from any thread.
//
// Flow control: a receiver grants messages (WINDOW frames). It grants its
// window when the stream opens and then, as the application reads, the number
// it consumed whenever that reaches half the window. A sender never sends
// beyond its credits; a peer that does is a protocol violation (the link
// closes the connection). So a reader holds at most `window` unread messages,
// and a writer whose reader is slow waits in async_write: backpressure, not
// memory growth.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>
#include <span>
#include <string>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/system/error_code.hpp>
#include <google/protobuf/message_lite.h>

#include "absl/status/statusor.h"
#include "rpc/frame.h"
#include "rpc/status.h"
#include "transport/transport.h"

namespace rdmarpc {

namespace asio = boost::asio;

struct StreamStats {
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
  uint64_t write_waits = 0;   // writes that had to wait for credits or send space
  uint64_t credits = 0;       // messages we may send now
  uint64_t unread = 0;        // received, not yet read
};

namespace internal {

using StreamHandler = asio::any_completion_handler<void(boost::system::error_code)>;

// Told when a stream that refused a TryWriteBytes can take more, and when it
// ends (the fanout publisher's subscriptions).
class StreamObserver {
 public:
  virtual void OnWritable() = 0;
  virtual void OnStreamEnded(const Status& why) = 0;

 protected:
  ~StreamObserver() = default;
};

class StreamCore : public std::enable_shared_from_this<StreamCore> {
 public:
  enum class Side { kClient, kServer };
  StreamCore(asio::any_io_executor ex, Side side, uint32_t window, bool may_read, bool may_write);
  virtual ~StreamCore();
  StreamCore(const StreamCore&) = delete;
  StreamCore& operator=(const StreamCore&) = delete;

  const asio::any_io_executor& executor() const { return ex_; }
  bool OnExecutorThread() const;

  // ---- Application side (typed wrappers); any thread ----------------------
  // Write: completes when the message is handed to the transport (it may wait
  // for credits). `message` need only live until this returns.
  void StartWrite(const google::protobuf::MessageLite& message, StreamHandler handler);
  // Read into `out` (which must live until completion): OK, or asio eof when
  // the peer ended its side cleanly, or the stream's status code.
  void StartRead(google::protobuf::MessageLite* out, StreamHandler handler);
  // Client: no more writes (HALF_CLOSE after the queued ones).
  void StartWritesDone(StreamHandler handler);
  // Client: waits for the server's final status; parses the response of a
  // client-streaming method into `response` (may be null). Unread messages
  // are discarded.
  void StartFinish(google::protobuf::MessageLite* response, StreamHandler handler);
  // Ends the stream CANCELLED (the client tells the server). Idempotent.
  void StartCancel();

  // ---- On the executor ----------------------------------------------------
  // Sends pre-serialised bytes with an explicit sequence number, now or not at
  // all: false when there is no credit or send space (observer->OnWritable()
  // follows) or the stream ended. The fanout's way to send one serialisation
  // to many streams.
  bool TryWriteBytes(std::span<const std::byte> bytes, uint64_t sequence);
  void SetObserver(StreamObserver* observer) { observer_ = observer; }
  bool ended() const { return ended_; }
  const Status& end_status() const { return end_status_; }
  // Sequence number of the last message read (the sender's numbering: the
  // fanout's tick numbers, so a subscriber sees its gaps).
  uint64_t last_sequence() const { return last_sequence_; }
  StreamStats stats() const;

  // ---- From the link (frames in, connection events) ------------------------
  // false: the peer broke the protocol (sent without credit, or after its
  // half-close): the link closes the connection.
  bool OnMessage(std::span<const std::byte> payload, uint64_t sequence);
  void OnWindow(uint32_t granted);
  bool OnHalfClose();  // server side: the client is done writing
  // Client side: the server's RESPONSE ended the stream.
  void OnTrailer(Status status, std::span<const std::byte> payload);
  void OnSendSpace();
  // The stream is over for a reason the link knows (connection lost,
  // deadline, server cancelled the call): every pending operation fails.
  void Abort(const Status& why);
  // Server side: once every queued message is handed to the transport, runs
  // `then` (which sends the RESPONSE). At once if nothing is queued.
  void CloseWrites(asio::any_completion_handler<void()> then);
  // The link's first frames went out (client: REQUEST): credits and windows may flow.
  void SetOpened();

 protected:
  // The connection: false from Prepare = no send space now (WaitForSendSpace
  // then brings OnSendSpace()); an error status = the connection is failing.
  virtual absl::StatusOr<transport::SendBuffer> LinkPrepare(size_t size) = 0;
  virtual void LinkSend(transport::SendBuffer buffer) = 0;
  virtual void LinkWaitForSendSpace() = 0;
  virtual size_t LinkMaxMessageSize() const = 0;
  virtual uint64_t LinkStreamId() const = 0;
  // The application cancelled (client: send CANCEL, unregister; server: the
  // handler is told through its ServerContext by the caller). `why` is the
  // cancelling status's code (DEADLINE_EXCEEDED for the client's timer).
  virtual void LinkCancelled(StatusCode why) = 0;
  // The stream ended for good (after Abort, Cancel, or the trailer): unregister.
  virtual void LinkEnded() = 0;
  // Client: the REQUEST (a whole encoded frame) that found no send space; it
  // goes first, then the stream opens.
  void QueueRawFrame(std::string frame);
  // Ends the stream with `why`; the link is told (LinkCancelled) so the peer
  // learns. Idempotent.
  void Cancel(const Status& why);

 private:
  struct Out {
    enum class Kind { kMessage, kHalfClose, kRaw } kind;
    std::string bytes;      // kMessage: the serialised message; kRaw: the whole frame
    StreamHandler handler;  // may be empty
    asio::cancellation_slot slot;
  };
  struct PendingOp {
    StreamHandler handler;
    asio::cancellation_slot slot;
    explicit operator bool() const { return static_cast<bool>(handler); }
  };

  void Write(const google::protobuf::MessageLite* message, std::string bytes, StreamHandler handler);
  void Read(google::protobuf::MessageLite* out, StreamHandler handler);
  void WritesDone(StreamHandler handler);
  void Finish(google::protobuf::MessageLite* response, StreamHandler handler);
  // Send one frame now; false = no send space (or the connection failed: then
  // `failed` is set).
  bool SendFrame(rpc::FrameType type, uint32_t arg, uint64_t sequence, std::span<const std::byte> bytes,
                 const google::protobuf::MessageLite* message, bool* failed);
  void PumpOut();
  void MaybeGrant();
  void End(const Status& why);
  void Arm(PendingOp& op, StreamHandler handler);
  // Posts the operation's handler (never inline) and clears its slot.
  void Complete(PendingOp& op, boost::system::error_code ec);
  boost::system::error_code EndCode() const;
  void DeliverRead(std::span<const std::byte> payload, uint64_t sequence);
  void CompleteFinish();
  void NotifyWritable();

  asio::any_io_executor ex_;
  Side side_;
  uint32_t window_;
  bool may_read_;
  bool may_write_;
  bool opened_ = false;
  bool ended_ = false;
  bool read_closed_ = false;   // the peer will send no more messages
  bool writes_done_ = false;   // we will send no more messages
  bool waiting_for_space_ = false;
  bool observer_waiting_ = false;
  Status end_status_;
  std::string trailer_payload_;  // client: RESPONSE payload (client-streaming response)
  bool have_trailer_ = false;

  uint64_t send_credits_ = 0;
  uint64_t recv_allowed_ = 0;  // messages the peer may still send
  uint64_t consumed_ = 0;      // read since the last grant
  uint32_t window_owed_ = 0;   // a grant that found no send space
  uint64_t next_sequence_ = 0;
  uint64_t last_sequence_ = 0;

  std::deque<Out> out_;
  struct In {
    std::string bytes;
    uint64_t sequence;
  };
  std::deque<In> in_;
  std::vector<std::string> spare_;  // recycled In buffers

  PendingOp read_;
  google::protobuf::MessageLite* read_out_ = nullptr;
  PendingOp finish_;
  google::protobuf::MessageLite* finish_out_ = nullptr;
  std::optional<asio::any_completion_handler<void()>> close_writes_then_;
  StreamObserver* observer_ = nullptr;
  StreamStats stats_;
};

}  // namespace internal
}  // namespace rdmarpc
