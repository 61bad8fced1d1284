#include "rpc/stream_core.h"

#include <cstring>

#include <boost/asio/error.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "absl/strings/str_cat.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"

namespace rdmarpc::internal {

using google::protobuf::MessageLite;

namespace {

// Runs in an operation's cancellation slot: ends the stream CANCELLED (later,
// on the executor: never inside emit()).
struct Canceller {
  std::weak_ptr<StreamCore> weak;
  void operator()(asio::cancellation_type type) const {
    if ((type & (asio::cancellation_type::terminal | asio::cancellation_type::partial)) == asio::cancellation_type::none)
      return;
    if (auto self = weak.lock()) asio::post(self->executor(), [self] { self->StartCancel(); });
  }
};

boost::system::error_code Code(StatusCode c) { return c == StatusCode::kOk ? boost::system::error_code() : make_error_code(c); }

}  // namespace

StreamCore::StreamCore(asio::any_io_executor ex, Side side, uint32_t window, bool may_read, bool may_write)
    : ex_(std::move(ex)),
      side_(side),
      window_(std::max<uint32_t>(1, std::min(window, rpc::kMaxWindowGrant))),
      may_read_(may_read),
      may_write_(may_write) {
  if (may_read_) {
    recv_allowed_ = window_;
    window_owed_ = window_;  // the first grant goes out when the stream opens
  }
}

StreamCore::~StreamCore() = default;

bool StreamCore::OnExecutorThread() const {
  if (const auto* io = ex_.target<asio::io_context::executor_type>()) return io->running_in_this_thread();
  return false;
}

StreamStats StreamCore::stats() const {
  StreamStats s = stats_;
  s.credits = send_credits_;
  s.unread = in_.size();
  return s;
}

// ---- entry points ---------------------------------------------------------------

void StreamCore::StartWrite(const MessageLite& message, StreamHandler handler) {
  if (OnExecutorThread()) return Write(&message, {}, std::move(handler));
  asio::post(ex_, [self = shared_from_this(), bytes = message.SerializeAsString(), h = std::move(handler)]() mutable {
    self->Write(nullptr, std::move(bytes), std::move(h));
  });
}

void StreamCore::StartRead(MessageLite* out, StreamHandler handler) {
  if (OnExecutorThread()) return Read(out, std::move(handler));
  asio::post(ex_, [self = shared_from_this(), out, h = std::move(handler)]() mutable { self->Read(out, std::move(h)); });
}

void StreamCore::StartWritesDone(StreamHandler handler) {
  if (OnExecutorThread()) return WritesDone(std::move(handler));
  asio::post(ex_, [self = shared_from_this(), h = std::move(handler)]() mutable { self->WritesDone(std::move(h)); });
}

void StreamCore::StartFinish(MessageLite* response, StreamHandler handler) {
  if (OnExecutorThread()) return Finish(response, std::move(handler));
  asio::post(ex_, [self = shared_from_this(), response, h = std::move(handler)]() mutable {
    self->Finish(response, std::move(h));
  });
}

void StreamCore::StartCancel() {
  if (OnExecutorThread()) return Cancel(CancelledError("stream cancelled"));
  asio::post(ex_, [self = shared_from_this()] { self->Cancel(CancelledError("stream cancelled")); });
}

// ---- completions ---------------------------------------------------------------

void StreamCore::Arm(PendingOp& op, StreamHandler handler) {
  op.handler = nullptr;
  {
    StreamHandler h(std::move(handler));
    op.handler.swap(h);
  }
  op.slot = asio::get_associated_cancellation_slot(op.handler);
  if (op.slot.is_connected()) op.slot.template emplace<Canceller>(Canceller{weak_from_this()});
}

// Never inline: the operation that triggers a completion may be the
// application's own next call.
void StreamCore::Complete(PendingOp& op, boost::system::error_code ec) {
  if (!op.handler) return;
  if (op.slot.is_connected()) op.slot.clear();
  op.slot = {};
  StreamHandler h;
  h.swap(op.handler);
  transport::PostCompletion(ex_, std::move(h), ec);
}

boost::system::error_code StreamCore::EndCode() const {
  return end_status_.ok() ? boost::system::error_code(asio::error::eof) : make_error_code(end_status_.code());
}

// ---- writes ---------------------------------------------------------------------

bool StreamCore::SendFrame(rpc::FrameType type, uint32_t arg, uint64_t sequence, std::span<const std::byte> bytes,
                           const MessageLite* message, bool* failed) {
  const bool raw = type == rpc::FrameType::kRequest;  // a whole pre-encoded frame
  const size_t body = message != nullptr ? message->ByteSizeLong() : bytes.size();
  auto buffer = LinkPrepare(raw ? body : rpc::kFrameHeaderSize + body);
  if (!buffer.ok()) {
    if (buffer.status().code() != absl::StatusCode::kResourceExhausted) *failed = true;
    return false;
  }
  std::span<std::byte> out = buffer->data();
  if (raw) {
    std::memcpy(out.data(), bytes.data(), body);
  } else {
    rpc::FrameHeader h;
    h.type = type;
    h.method_id = arg;
    h.payload_length = static_cast<uint32_t>(body);
    h.call_id = LinkStreamId();
    h.timeout_us = sequence;
    rpc::EncodeFrameHead(h, {}, out);
    if (message != nullptr)
      message->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out.data() + rpc::kFrameHeaderSize));
    else if (body > 0)
      std::memcpy(out.data() + rpc::kFrameHeaderSize, bytes.data(), body);
  }
  LinkSend(std::move(*buffer));
  return true;
}

void StreamCore::Write(const MessageLite* message, std::string bytes, StreamHandler handler) {
  PendingOp op;
  Arm(op, std::move(handler));
  if (ended_) {
    const Status& s = end_status_;
    return Complete(op, s.ok() ? make_error_code(StatusCode::kFailedPrecondition) : make_error_code(s.code()));
  }
  if (!may_write_ || writes_done_) return Complete(op, make_error_code(StatusCode::kFailedPrecondition));
  const size_t body = message != nullptr ? message->ByteSizeLong() : bytes.size();
  if (rpc::kFrameHeaderSize + body > LinkMaxMessageSize())
    return Complete(op, make_error_code(StatusCode::kResourceExhausted));
  if (out_.empty() && opened_ && send_credits_ > 0 && !waiting_for_space_) {
    bool failed = false;
    if (SendFrame(rpc::FrameType::kStreamMessage, 0, next_sequence_ + 1, std::as_bytes(std::span(bytes)), message, &failed)) {
      ++next_sequence_;
      --send_credits_;
      ++stats_.messages_sent;
      return Complete(op, {});
    }
    if (failed) {
      Abort(UnavailableError("the connection failed while sending a stream message"));
      return Complete(op, make_error_code(StatusCode::kUnavailable));
    }
  }
  // Wait for credits or send space: keep it serialised.
  ++stats_.write_waits;
  if (message != nullptr) message->SerializeToString(&bytes);
  Out o{Out::Kind::kMessage, std::move(bytes), {}, {}};
  o.handler.swap(op.handler);
  o.slot = op.slot;
  out_.push_back(std::move(o));
  PumpOut();
}

bool StreamCore::TryWriteBytes(std::span<const std::byte> bytes, uint64_t sequence) {
  if (ended_ || !may_write_ || writes_done_) return false;
  if (rpc::kFrameHeaderSize + bytes.size() > LinkMaxMessageSize()) {
    Cancel(ResourceExhaustedError(absl::StrCat("a ", bytes.size(), "-byte stream message exceeds the connection's ",
                                               LinkMaxMessageSize(), "-byte limit")));
    return false;
  }
  if (!out_.empty() || !opened_ || send_credits_ == 0 || waiting_for_space_) {
    observer_waiting_ = true;
    return false;
  }
  bool failed = false;
  if (!SendFrame(rpc::FrameType::kStreamMessage, 0, sequence, bytes, nullptr, &failed)) {
    if (failed) {
      Abort(UnavailableError("the connection failed while sending a stream message"));
      return false;
    }
    observer_waiting_ = true;
    if (!waiting_for_space_) {
      waiting_for_space_ = true;
      LinkWaitForSendSpace();
    }
    return false;
  }
  next_sequence_ = sequence;
  --send_credits_;
  ++stats_.messages_sent;
  return true;
}

void StreamCore::PumpOut() {
  if (ended_ || waiting_for_space_) return;
  bool failed = false;
  auto wait = [&] {
    if (failed) return Abort(UnavailableError("the connection failed while sending on a stream"));
    waiting_for_space_ = true;
    LinkWaitForSendSpace();
  };
  while (!out_.empty() && out_.front().kind == Out::Kind::kRaw) {
    if (!SendFrame(rpc::FrameType::kRequest, 0, 0, std::as_bytes(std::span(out_.front().bytes)), nullptr, &failed))
      return wait();
    out_.pop_front();
    opened_ = true;
  }
  if (!opened_) return;
  if (window_owed_ != 0) {
    if (!SendFrame(rpc::FrameType::kWindow, window_owed_, 0, {}, nullptr, &failed)) return wait();
    window_owed_ = 0;
  }
  while (!out_.empty()) {
    Out& o = out_.front();
    if (o.kind == Out::Kind::kMessage) {
      if (send_credits_ == 0) break;  // OnWindow() resumes
      if (!SendFrame(rpc::FrameType::kStreamMessage, 0, next_sequence_ + 1, std::as_bytes(std::span(o.bytes)), nullptr,
                     &failed))
        return wait();
      ++next_sequence_;
      --send_credits_;
      ++stats_.messages_sent;
    } else {  // kHalfClose
      if (!SendFrame(rpc::FrameType::kHalfClose, 0, 0, {}, nullptr, &failed)) return wait();
    }
    PendingOp op;
    op.handler.swap(o.handler);
    op.slot = o.slot;
    out_.pop_front();
    Complete(op, {});
    if (ended_) return;
  }
  if (out_.empty() && close_writes_then_) {
    auto then = std::move(*close_writes_then_);
    close_writes_then_.reset();
    std::move(then)();
    return;
  }
  NotifyWritable();
}

void StreamCore::NotifyWritable() {
  if (!observer_waiting_ || observer_ == nullptr || ended_) return;
  if (send_credits_ == 0 || !out_.empty() || waiting_for_space_ || !opened_) return;
  observer_waiting_ = false;
  observer_->OnWritable();
}

void StreamCore::WritesDone(StreamHandler handler) {
  PendingOp op;
  Arm(op, std::move(handler));
  if (ended_) return Complete(op, end_status_.ok() ? boost::system::error_code() : make_error_code(end_status_.code()));
  if (!may_write_ || writes_done_) return Complete(op, make_error_code(StatusCode::kFailedPrecondition));
  writes_done_ = true;
  Out o{Out::Kind::kHalfClose, {}, {}, {}};
  o.handler.swap(op.handler);
  o.slot = op.slot;
  out_.push_back(std::move(o));
  PumpOut();
}

void StreamCore::QueueRawFrame(std::string frame) {
  out_.push_front(Out{Out::Kind::kRaw, std::move(frame), {}, {}});
  PumpOut();
}

void StreamCore::SetOpened() {
  opened_ = true;
  PumpOut();
}

void StreamCore::CloseWrites(asio::any_completion_handler<void()> then) {
  writes_done_ = true;
  if (ended_) return;
  if (out_.empty()) {
    std::move(then)();
    return;
  }
  close_writes_then_.emplace(std::move(then));
}

// ---- reads ----------------------------------------------------------------------

void StreamCore::Read(MessageLite* out, StreamHandler handler) {
  PendingOp op;
  Arm(op, std::move(handler));
  if (read_) return Complete(op, make_error_code(StatusCode::kFailedPrecondition));
  if (!may_read_) return Complete(op, make_error_code(StatusCode::kFailedPrecondition));
  if (!in_.empty()) {
    In in = std::move(in_.front());
    in_.pop_front();
    const bool ok = out->ParseFromString(in.bytes);
    in.bytes.clear();
    if (spare_.size() < 8) spare_.push_back(std::move(in.bytes));
    if (!ok) {
      Complete(op, make_error_code(StatusCode::kInternal));
      return Cancel(InternalError(absl::StrCat("stream message does not parse as ", out->GetTypeName())));
    }
    last_sequence_ = in.sequence;
    ++consumed_;
    Complete(op, {});
    return MaybeGrant();
  }
  if (ended_) return Complete(op, EndCode());
  if (read_closed_) return Complete(op, asio::error::eof);
  read_out_ = out;
  read_.handler.swap(op.handler);
  read_.slot = op.slot;
}

bool StreamCore::OnMessage(std::span<const std::byte> payload, uint64_t sequence) {
  if (!may_read_ || read_closed_ || recv_allowed_ == 0) return false;
  --recv_allowed_;
  ++stats_.messages_received;
  if (ended_) return true;  // cancelled here; frames already in flight
  if (read_ && in_.empty()) {
    DeliverRead(payload, sequence);
    return true;
  }
  std::string bytes;
  if (!spare_.empty()) {
    bytes = std::move(spare_.back());
    spare_.pop_back();
  }
  bytes.assign(reinterpret_cast<const char*>(payload.data()), payload.size());
  in_.push_back({std::move(bytes), sequence});
  return true;
}

void StreamCore::DeliverRead(std::span<const std::byte> payload, uint64_t sequence) {
  MessageLite* out = std::exchange(read_out_, nullptr);
  if (!out->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    Complete(read_, make_error_code(StatusCode::kInternal));
    return Cancel(InternalError(absl::StrCat("stream message does not parse as ", out->GetTypeName())));
  }
  last_sequence_ = sequence;
  ++consumed_;
  Complete(read_, {});
  MaybeGrant();
}

void StreamCore::MaybeGrant() {
  if (ended_ || read_closed_ || consumed_ < std::max<uint64_t>(1, window_ / 2)) return;
  window_owed_ += static_cast<uint32_t>(consumed_);
  recv_allowed_ += consumed_;
  consumed_ = 0;
  PumpOut();
}

void StreamCore::OnWindow(uint32_t granted) {
  send_credits_ += granted;
  PumpOut();
}

bool StreamCore::OnHalfClose() {
  if (!may_read_ || read_closed_) return false;
  read_closed_ = true;
  if (read_ && in_.empty()) {
    read_out_ = nullptr;
    Complete(read_, asio::error::eof);
  }
  return true;
}

void StreamCore::OnTrailer(Status status, std::span<const std::byte> payload) {
  if (ended_) return;
  trailer_payload_.assign(reinterpret_cast<const char*>(payload.data()), payload.size());
  have_trailer_ = true;
  read_closed_ = true;
  End(std::move(status));
}

// ---- ends ------------------------------------------------------------------------

void StreamCore::Finish(MessageLite* response, StreamHandler handler) {
  PendingOp op;
  Arm(op, std::move(handler));
  if (finish_) return Complete(op, make_error_code(StatusCode::kFailedPrecondition));
  finish_out_ = response;
  finish_.handler.swap(op.handler);
  finish_.slot = op.slot;
  if (ended_) return CompleteFinish();
  if (side_ == Side::kClient && may_write_ && !writes_done_) {  // finish implies half-close
    writes_done_ = true;
    out_.push_back(Out{Out::Kind::kHalfClose, {}, {}, {}});
    PumpOut();
  }
}

void StreamCore::CompleteFinish() {
  if (!finish_) return;
  boost::system::error_code ec = Code(end_status_.code());
  MessageLite* out = std::exchange(finish_out_, nullptr);
  if (!ec && out != nullptr && have_trailer_ && !out->ParseFromString(trailer_payload_)) {
    end_status_ = InternalError(absl::StrCat("response does not parse as ", out->GetTypeName()));
    ec = make_error_code(StatusCode::kInternal);
  }
  Complete(finish_, ec);
}

void StreamCore::Cancel(const Status& why) {
  if (ended_) return;
  LinkCancelled(why.code());
  End(why);
}

void StreamCore::Abort(const Status& why) {
  if (ended_) return;
  End(why);
}

void StreamCore::OnSendSpace() {
  waiting_for_space_ = false;
  PumpOut();
}

void StreamCore::End(const Status& why) {
  ended_ = true;
  end_status_ = why;
  const bool clean = why.ok() && have_trailer_;
  if (!clean) {
    // Messages that came before the peer's error trailer were written before
    // it: they stay readable, then reads see the error. A local end (cancel,
    // deadline, lost connection) drops them.
    if (!have_trailer_) in_.clear();
    read_closed_ = true;
  }
  close_writes_then_.reset();  // the server's answer was decided elsewhere
  auto out = std::exchange(out_, {});
  const auto write_ec = why.ok() ? make_error_code(StatusCode::kFailedPrecondition) : make_error_code(why.code());
  for (Out& o : out) {
    PendingOp op;
    op.handler.swap(o.handler);
    op.slot = o.slot;
    Complete(op, write_ec);
  }
  if (read_ && in_.empty()) {
    read_out_ = nullptr;
    Complete(read_, EndCode());
  }
  CompleteFinish();
  if (observer_ != nullptr) {
    StreamObserver* o = std::exchange(observer_, nullptr);
    o->OnStreamEnded(why);
  }
  LinkEnded();
}

}  // namespace rdmarpc::internal
