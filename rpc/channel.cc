#include "rpc/channel.h"

#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "rpc/frame.h"
#include "rpc/receive_sink.h"
#include "transport/common/log.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"

namespace rdmarpc {

using google::protobuf::MessageLite;
using transport::Connection;
using transport::Message;

namespace {

// The request's metadata must fit the frame's u16 fields.
Status CheckMetadata(const rpc::Metadata& md) {
  if (md.size() > rpc::kMaxMetadataEntries)
    return InvalidArgumentError(absl::StrCat(md.size(), " metadata entries, at most ", rpc::kMaxMetadataEntries));
  for (const auto& [k, v] : md) {
    if (k.empty()) return InvalidArgumentError("metadata key is empty");
    if (k.size() > 0xffff || v.size() > 0xffff)
      return InvalidArgumentError(absl::StrCat("metadata entry '", k.substr(0, 32), "' longer than 65535 bytes"));
  }
  if (rpc::MetadataWireSize(md) > 0xffff) return InvalidArgumentError("metadata larger than 65535 bytes in total");
  return Status();
}

// What a CANCEL frame says: the client's deadline, or any other reason (a
// cancelled call, a closed channel) as CANCELLED.
bool OnThisThread(const asio::any_io_executor& ex) {
  if (const auto* io = ex.target<asio::io_context::executor_type>()) return io->running_in_this_thread();
  return false;
}

}  // namespace

class Channel::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(asio::any_io_executor ex, transport::Uri uri, std::string target, ChannelOptions options)
      : ex_(std::move(ex)),
        uri_(std::move(uri)),
        target_(std::move(target)),
        options_(std::move(options)),
        backoff_timer_(ex_),
        keepalive_timer_(ex_),
        backoff_(options_.initial_backoff),
        rng_(std::random_device{}()) {}

  const asio::any_io_executor& executor() const { return ex_; }
  const std::string& target() const { return target_; }
  State state() const { return state_; }
  const Status& last_error() const { return last_error_; }
  const ChannelStats& stats() const { return stats_; }
  std::optional<transport::ConnectionStats> connection_stats() const {
    if (state_ != State::kReady || !conn_) return std::nullopt;
    return conn_->c->stats();
  }
  // Channel::Batch: holds the current connection's sends and returns it,
  // owned with its Conn (aliasing: no allocation); null when there is none.
  std::shared_ptr<transport::Connection> HoldSends() {
    if (state_ != State::kReady || !conn_ || conn_->dead) return nullptr;
    conn_->c->HoldSends();
    return std::shared_ptr<transport::Connection>(conn_, conn_->c.get());
  }

  // `request` is null when the caller serialised it already (into `bytes`).
  void Start(ClientContext& ctx, const MethodInfo& method, const MessageLite* request, std::string bytes,
             CallHandler handler);
  void Connect(asio::any_completion_handler<void(boost::system::error_code)> handler);
  void Close();
  // `request` is null when the caller serialised it already (into `bytes`),
  // or when the method is not server-streaming (both empty then).
  void StartStream(ClientContext& ctx, const MethodInfo& method, const MessageLite* request, std::string bytes,
                   StreamOpenHandler handler);

 private:
  class ClientStream;
  struct Call;
  enum class CallState;
  struct Ref {
    Call* call;
    uint64_t generation;
    bool live() const;
  };
  struct Conn {
    // Declared before c: the connection (closed by its destructor) goes first.
    std::unique_ptr<transport::MessageSink> sink;  // set: messages come through it, no Receive() loop
    std::unique_ptr<Connection> c;
    std::shared_ptr<const std::string> peer;
    bool dead = false;
    bool goaway = false;
    size_t calls = 0;
    // Calls waiting for send space (the transport's Prepare() said
    // RESOURCE_EXHAUSTED: all send slots busy); retried as sends complete.
    std::deque<Ref> blocked;
    // Streams waiting for send space.
    std::vector<std::weak_ptr<internal::StreamCore>> stream_waiters;
    internal::Keepalive keepalive{internal::Keepalive::Clock::now()};
  };
  enum class CallState { kFree, kQueued, kBlocked, kSent };
  struct Call {
    Call(const asio::any_io_executor& ex, uint32_t i) : index(i), timer(ex) {}
    // The wire id of a unary call names its pool slot and that slot's
    // generation (UnaryCallId): a response finds its call by index, no map.
    uint64_t id = 0;
    const uint32_t index;  // in all_calls_
    uint64_t generation = 0;
    CallState state = CallState::kFree;
    ClientContext* ctx = nullptr;
    const MethodInfo* method = nullptr;
    const MessageLite* request = nullptr;  // null once serialised into request_bytes
    std::string request_bytes;             // when the call cannot be sent at once
    CallHandler handler;
    asio::steady_timer timer;
    asio::cancellation_slot slot;
    std::shared_ptr<Conn> conn;
  };

  // Runs in the handler's cancellation slot (on the emitter's thread, which
  // Asio requires to be the channel's executor): completes the call later, on
  // the executor, so the user's handler never runs inside emit().
  struct Canceller {
    std::weak_ptr<Impl> impl;
    Ref ref;
    void operator()(asio::cancellation_type type) {
      if ((type & (asio::cancellation_type::terminal | asio::cancellation_type::partial)) ==
          asio::cancellation_type::none)
        return;
      if (auto self = impl.lock()) {
        asio::post(self->ex_, [self, r = ref] {
          if (r.live()) self->Finish(r.call, CancelledError("call cancelled by the client"), {}, true);
        });
      }
    }
  };

  Call* Acquire();
  // Unary call ids: the slot's generation (1..2^30, wrapping; a mask, where a
  // modulo cost ~17 instructions a call) above its index; bit 63 clear.
  // Stream ids have bit 63 set (kStreamIdBit), so the two never meet, and a
  // slot's next call never reuses the id of its last one (the server refuses
  // an id still in flight).
  static constexpr uint64_t kStreamIdBit = uint64_t{1} << 63;
  static uint64_t UnaryCallId(const Call& c) {
    return ((c.generation & 0x3fffffffu) + 1) << 32 | c.index;
  }
  // The call a response names, if it is still waiting for one.
  Call* FindSent(uint64_t id) const {
    if ((id & kStreamIdBit) != 0) return nullptr;
    const uint64_t index = id & 0xffffffffu;
    if (index >= all_calls_.size()) return nullptr;
    Call* c = all_calls_[index].get();
    return c->state == CallState::kSent && c->id == id ? c : nullptr;
  }
  void FailLater(Call* call, Status status);
  // How Finish runs the caller's completion handler. kInline where one call
  // ends and nothing of ours follows (a response, its deadline, its
  // cancellation); kPosted where calls end in a loop (a lost or refused
  // connection, Close()): a handler that throws (Asio lets it out of run())
  // must not leave the calls after it in the loop uncompleted.
  enum class Run { kInline, kPosted };
  void Finish(Call* call, Status status, ResponsePayload payload, bool tell_server, Run run = Run::kInline);
  void Send(Call* call);
  // The call cannot go out now: keep its request as bytes, so the caller's
  // request object need not outlive the initiating function.
  static void KeepSerialisedCopy(Call* call) {
    if (call->request == nullptr) return;
    call->request->SerializeToString(&call->request_bytes);
    call->request = nullptr;
  }
  void PumpBlocked(const std::shared_ptr<Conn>& conn);
  void OnSendDone(const std::shared_ptr<Conn>& conn, const absl::Status& st);
  // Through the sink: requests sent with SendUntracked() completed.
  void OnSendsCompleted(const std::shared_ptr<Conn>& conn, size_t count);
  // OnSendsCompleted() only wakes calls and streams waiting for send space:
  // with none, ReceiveSink need not call it (true: nothing left to do).
  static bool SendsCompletedWithoutOwner(Conn& conn, size_t) {
    return conn.blocked.empty() && conn.stream_waiters.empty();
  }
  void OpenStream(ClientContext& ctx, const MethodInfo& method, const MessageLite* request, std::string bytes,
                  StreamOpenHandler handler);
  void StreamEnded(ClientStream* stream);
  void ReleaseConnCall(const std::shared_ptr<Conn>& conn);
  void SendControl(const std::shared_ptr<Conn>& conn, rpc::FrameType type, uint64_t call_id,
                   StatusCode status = StatusCode::kOk);
  void StartConnect();
  void OnConnected(absl::StatusOr<std::unique_ptr<Connection>> result);
  template <typename, typename>
  friend class internal::ReceiveSink;
  // Messages through a sink when the transport has one, else Receive() after Receive().
  void StartReceiving(const std::shared_ptr<Conn>& conn);
  void Receive(std::shared_ptr<Conn> conn);
  void OnReceive(const std::shared_ptr<Conn>& conn, absl::StatusOr<Message> message);
  void ConnFailed(const std::shared_ptr<Conn>& conn, const Status& why);
  void FailCallsOn(const std::shared_ptr<Conn>* conn, const Status& status, bool include_queued);
  void EnterBackoff();
  void ArmKeepalive();
  void CompleteWaiters(const Status& status);

  asio::any_io_executor ex_;
  transport::Uri uri_;
  std::string target_;
  ChannelOptions options_;
  State state_ = State::kIdle;
  bool closed_ = false;
  Status last_error_;
  std::shared_ptr<Conn> conn_;
  std::vector<std::unique_ptr<Call>> all_calls_;
  std::vector<Call*> free_calls_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<ClientStream>> streams_;
  std::deque<Ref> queued_;
  size_t outstanding_ = 0;
  uint64_t next_stream_id_ = 1;  // below kStreamIdBit
  asio::steady_timer backoff_timer_;
  asio::steady_timer keepalive_timer_;
  bool keepalive_armed_ = false;
  std::chrono::milliseconds backoff_;
  std::minstd_rand rng_;
  std::vector<asio::any_completion_handler<void(boost::system::error_code)>> waiters_;
  ChannelStats stats_;
};

bool Channel::Impl::Ref::live() const { return call->generation == generation && call->state != CallState::kFree; }

// ---- streams ---------------------------------------------------------------------

// The channel's end of one stream: the shared flow-control core, reaching the
// connection the stream was opened on.
class Channel::Impl::ClientStream final : public internal::StreamCore {
 public:
  ClientStream(std::shared_ptr<Impl> impl, std::shared_ptr<Conn> conn, uint64_t id, ClientContext* ctx,
               const MethodInfo& method, uint32_t window)
      : StreamCore(impl->ex_, Side::kClient, window, method.server_streaming, method.client_streaming),
        impl_(std::move(impl)),
        conn_(std::move(conn)),
        id_(id),
        ctx_(ctx),
        timer_(impl_->ex_) {}

  const std::shared_ptr<Conn>& conn() const { return conn_; }
  uint64_t id() const { return id_; }
  ClientContext* context() const { return ctx_; }
  asio::steady_timer& timer() { return timer_; }
  void Open(std::string frame_if_queued, bool sent) {
    if (sent)
      SetOpened();
    else
      QueueRawFrame(std::move(frame_if_queued));
  }
  void ExpireDeadline() { Cancel(DeadlineExceededError("stream deadline exceeded (client timer)")); }
  using StreamCore::Cancel;

 protected:
  absl::StatusOr<transport::SendBuffer> LinkPrepare(size_t size) override {
    if (conn_->dead) return absl::UnavailableError("connection closed");
    return conn_->c->Prepare(size);
  }
  void LinkSend(transport::SendBuffer buffer) override {
    conn_->c->Send(std::move(buffer), transport::WithHandlerMemory([impl = impl_, c = conn_](absl::Status st) {
                     impl->OnSendDone(c, st);
                   }));
  }
  void LinkWaitForSendSpace() override { conn_->stream_waiters.push_back(weak_from_this()); }
  size_t LinkMaxMessageSize() const override { return conn_->c->max_message_size(); }
  uint64_t LinkStreamId() const override { return id_; }
  void LinkCancelled(StatusCode why) override {
    if (!conn_->dead) impl_->SendControl(conn_, rpc::FrameType::kCancel, id_, rpc::CancelReason(why));
  }
  void LinkEnded() override { impl_->StreamEnded(this); }

 private:
  std::shared_ptr<Impl> impl_;  // cycle broken by StreamEnded (streams_ entry) and ~handle
  std::shared_ptr<Conn> conn_;
  uint64_t id_;
  ClientContext* ctx_;
  asio::steady_timer timer_;
};

void Channel::Impl::StartStream(ClientContext& ctx, const MethodInfo& method, const MessageLite* request,
                                std::string bytes, StreamOpenHandler handler) {
  auto fail = [&](Status st) {
    ctx.SetResult(st);
    transport::PostCompletion(ex_, std::move(handler), make_error_code(st.code()),
                              std::shared_ptr<internal::StreamCore>());
  };
  if (closed_) return fail(CancelledError("channel to " + target_ + " is closed"));
  if (auto st = CheckMetadata(ctx.metadata()); !st.ok()) return fail(std::move(st));
  if (auto d = ctx.deadline(); d && *d <= Clock::now())
    return fail(DeadlineExceededError("deadline passed before the stream started"));
  if (state_ == State::kReady) return OpenStream(ctx, method, request, std::move(bytes), std::move(handler));
  if (state_ == State::kBackoff && !ctx.wait_for_ready())
    return fail(UnavailableError("channel to " + target_ + " is waiting to reconnect; last error: " +
                                 last_error_.ToString()));
  // Not connected: open once it is (the request is kept serialised).
  if (request != nullptr) bytes = request->SerializeAsString();
  Connect([self = shared_from_this(), &ctx, &method, bytes = std::move(bytes),
           h = std::move(handler)](boost::system::error_code ec) mutable {
    if (ec) {
      ctx.SetResult(self->last_error_.ok() ? Status(ToStatusCode(ec), "connect failed") : self->last_error_);
      return transport::PostCompletion(self->ex_, std::move(h), ec, std::shared_ptr<internal::StreamCore>());
    }
    self->OpenStream(ctx, method, nullptr, std::move(bytes), std::move(h));
  });
}

void Channel::Impl::OpenStream(ClientContext& ctx, const MethodInfo& method, const MessageLite* request,
                               std::string bytes, StreamOpenHandler handler) {
  if (state_ != State::kReady || !conn_) {  // lost again between connect and here
    ctx.SetResult(UnavailableError("channel to " + target_ + " lost its connection"));
    return transport::PostCompletion(ex_, std::move(handler), make_error_code(StatusCode::kUnavailable),
                                     std::shared_ptr<internal::StreamCore>());
  }
  const std::shared_ptr<Conn> conn = conn_;
  const rpc::Metadata& md = ctx.metadata();
  const size_t md_size = rpc::MetadataWireSize(md);
  const size_t body = request != nullptr ? request->ByteSizeLong() : bytes.size();
  const size_t total = rpc::kFrameHeaderSize + md_size + body;
  if (total > conn->c->max_message_size() || body > 0xffffffffu) {
    ctx.SetResult(ResourceExhaustedError(absl::StrCat("stream request of ", total, " bytes exceeds the ",
                                                      conn->c->max_message_size(), "-byte message limit")));
    return transport::PostCompletion(ex_, std::move(handler), make_error_code(StatusCode::kResourceExhausted),
                                     std::shared_ptr<internal::StreamCore>());
  }
  const uint64_t id = kStreamIdBit | next_stream_id_++;
  const uint32_t window = ctx.stream_window() != 0 ? ctx.stream_window() : options_.stream_window;
  auto stream = std::make_shared<ClientStream>(shared_from_this(), conn, id, &ctx, method, window);
  streams_.emplace(id, stream);
  ++conn->calls;
  ++stats_.streams_started;
  ++stats_.streams_open;
  ctx.SetResult(Status());
  ctx.SetPeer(conn->peer);

  rpc::FrameHeader h;
  h.type = rpc::FrameType::kRequest;
  h.metadata_length = static_cast<uint16_t>(md_size);
  h.method_id = method.id;
  h.payload_length = static_cast<uint32_t>(body);
  h.call_id = id;
  if (auto d = ctx.deadline()) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(*d - Clock::now()).count();
    h.timeout_us = left > 0 ? static_cast<uint64_t>(left) : 1;
    stream->timer().expires_at(*d);
    stream->timer().async_wait([weak = std::weak_ptr<ClientStream>(stream)](boost::system::error_code ec) {
      if (auto s = weak.lock(); s && !ec) s->ExpireDeadline();
    });
  }
  auto encode = [&](std::span<std::byte> out) {
    rpc::EncodeFrameHead(h, md, out);
    std::byte* payload = out.data() + rpc::kFrameHeaderSize + md_size;
    if (request != nullptr)
      request->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(payload));
    else if (body > 0)
      std::memcpy(payload, bytes.data(), body);
  };
  auto buffer = conn->c->Prepare(total);
  if (buffer.ok()) {
    encode(buffer->data());
    conn->c->Send(std::move(*buffer), transport::WithHandlerMemory([self = shared_from_this(), c = conn](absl::Status st) {
                    self->OnSendDone(c, st);
                  }));
    stream->Open({}, true);
  } else if (buffer.status().code() == absl::StatusCode::kResourceExhausted) {
    std::string frame(total, '\0');
    encode(std::as_writable_bytes(std::span(frame)));
    stream->Open(std::move(frame), false);
  } else {
    stream->Abort(Status::FromAbsl(buffer.status()));
  }
  transport::PostCompletion(ex_, std::move(handler), boost::system::error_code(),
                            std::shared_ptr<internal::StreamCore>(stream));
}

void Channel::Impl::StreamEnded(ClientStream* stream) {
  auto it = streams_.find(stream->id());
  if (it == streams_.end() || it->second.get() != stream) return;
  std::shared_ptr<ClientStream> keep = std::move(it->second);  // ends this call's use of it
  streams_.erase(it);
  --stats_.streams_open;
  keep->timer().cancel();
  const Status& st = keep->end_status();
  st.ok() ? ++stats_.calls_ok : ++stats_.calls_failed;
  keep->context()->SetResult(st);
  ReleaseConnCall(keep->conn());
}

Channel::Impl::Call* Channel::Impl::Acquire() {
  if (free_calls_.empty()) {
    all_calls_.push_back(std::make_unique<Call>(ex_, static_cast<uint32_t>(all_calls_.size())));
    // Room for every call to come back at once: Finish() never grows it.
    free_calls_.reserve(all_calls_.capacity());
    free_calls_.push_back(all_calls_.back().get());
  }
  Call* c = free_calls_.back();
  free_calls_.pop_back();
  return c;
}

void Channel::Impl::Start(ClientContext& ctx, const MethodInfo& method, const MessageLite* request,
                          std::string bytes, CallHandler handler) {
  ++stats_.calls_started;
  Call* call = Acquire();
  call->id = UnaryCallId(*call);
  call->ctx = &ctx;
  call->method = &method;
  call->request = request;
  call->request_bytes = std::move(bytes);
  call->handler = nullptr;
  { CallHandler h(std::move(handler)); call->handler.swap(h); }
  call->state = CallState::kQueued;  // not yet anywhere; Finish() copes
  ++outstanding_;
  ctx.SetResult(Status());

  if (closed_) return FailLater(call, CancelledError("channel to " + target_ + " is closed"));
  if (outstanding_ > options_.max_outstanding_calls)
    return FailLater(call, ResourceExhaustedError(absl::StrCat("more than ", options_.max_outstanding_calls,
                                                               " calls in flight on channel to ", target_,
                                                               " (ChannelOptions::max_outstanding_calls)")));
  if (!ctx.metadata().empty())  // without a call when there is none (~35 instructions a call)
    if (auto st = CheckMetadata(ctx.metadata()); !st.ok()) return FailLater(call, std::move(st));
  if (auto d = ctx.deadline()) {
    if (*d <= Clock::now()) return FailLater(call, DeadlineExceededError("deadline passed before the call started"));
    call->timer.expires_at(*d);
    call->timer.async_wait(transport::WithHandlerMemory(
        [self = shared_from_this(), r = Ref{call, call->generation}](boost::system::error_code ec) {
          if (!ec && r.live())
            self->Finish(r.call, DeadlineExceededError("deadline exceeded (client timer)"), {}, true);
        }));
  }
  call->slot = asio::get_associated_cancellation_slot(call->handler);
  if (call->slot.is_connected())
    call->slot.template emplace<Canceller>(Canceller{weak_from_this(), Ref{call, call->generation}});

  // The request only has to live until the initiating function returns: a
  // call that cannot go out now keeps a serialised copy.
  if (state_ != State::kReady) KeepSerialisedCopy(call);
  switch (state_) {
    case State::kReady:
      return Send(call);
    case State::kIdle:
      queued_.push_back({call, call->generation});
      return StartConnect();
    case State::kConnecting:
      queued_.push_back({call, call->generation});
      return;
    case State::kBackoff:
      if (ctx.wait_for_ready()) {
        queued_.push_back({call, call->generation});
        return;
      }
      return FailLater(call, UnavailableError("channel to " + target_ + " is waiting to reconnect; last error: " +
                                              last_error_.ToString()));
    case State::kClosed:
      return FailLater(call, CancelledError("channel to " + target_ + " is closed"));
  }
}

void Channel::Impl::FailLater(Call* call, Status status) {
  asio::post(ex_, [self = shared_from_this(), r = Ref{call, call->generation}, s = std::move(status)]() mutable {
    if (r.live()) self->Finish(r.call, std::move(s), {}, false);
  });
}

void Channel::Impl::Finish(Call* call, Status status, ResponsePayload payload, bool tell_server, Run run) {
  if (call->state == CallState::kSent) {
    if (call->conn) {
      // The CANCEL says why, so the server counts a call the client's timer
      // ended as DEADLINE_EXCEEDED even when it arrives before its own timer fires.
      if (tell_server && !call->conn->dead)
        SendControl(call->conn, rpc::FrameType::kCancel, call->id, rpc::CancelReason(status.code()));
      ReleaseConnCall(call->conn);
    }
  }
  call->timer.cancel();
  if (call->slot.is_connected()) call->slot.clear();
  call->slot = {};
  status.ok() ? ++stats_.calls_ok : ++stats_.calls_failed;
  call->ctx->SetResult(std::move(status));
  if (call->conn) call->ctx->SetPeer(call->conn->peer);
  const auto code = call->ctx->status().code();
  CallHandler handler;
  handler.swap(call->handler);
  call->state = CallState::kFree;
  ++call->generation;
  call->ctx = nullptr;
  call->conn.reset();
  free_calls_.push_back(call);
  --outstanding_;
  if (run == Run::kPosted) {
    transport::PostCompletion(ex_, std::move(handler), make_error_code(code), std::move(payload));
    return;
  }
  std::move(handler)(make_error_code(code), std::move(payload));
}

void Channel::Impl::ReleaseConnCall(const std::shared_ptr<Conn>& conn) {
  --conn->calls;
  if (conn->goaway && conn->calls == 0 && !conn->dead) {
    conn->dead = true;
    conn->c->Close();
    RDMARPC_LOG(kInfo, "channel", "event=disconnected target=", target_, " peer=", *conn->peer,
                " reason=\"goaway: drained\"");
  }
}

void Channel::Impl::Send(Call* call) {
  const auto& conn = conn_;
  const rpc::Metadata& md = call->ctx->metadata();
  const size_t md_size = rpc::MetadataWireSize(md);
  const size_t body = call->request != nullptr ? call->request->ByteSizeLong() : call->request_bytes.size();
  const size_t total = rpc::kFrameHeaderSize + md_size + body;
  if (total > conn->c->max_message_size() || body > 0xffffffffu)
    return FailLater(call, ResourceExhaustedError(absl::StrCat("request of ", total, " bytes exceeds the ",
                                                               conn->c->max_message_size(),
                                                               "-byte message limit of the connection to ",
                                                               target_)));
  auto buffer = conn->c->Prepare(total);
  if (!buffer.ok()) {
    if (buffer.status().code() == absl::StatusCode::kResourceExhausted) {
      // Every send slot is busy: wait for a send to complete.
      KeepSerialisedCopy(call);
      call->state = CallState::kBlocked;
      call->conn = conn;
      conn->blocked.push_back({call, call->generation});
      return;
    }
    return FailLater(call, Status::FromAbsl(buffer.status()));
  }
  rpc::FrameHeader h;
  h.type = rpc::FrameType::kRequest;
  h.metadata_length = static_cast<uint16_t>(md_size);
  h.method_id = call->method->id;
  h.payload_length = static_cast<uint32_t>(body);
  h.call_id = call->id;
  if (auto d = call->ctx->deadline()) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(*d - Clock::now()).count();
    h.timeout_us = left > 0 ? static_cast<uint64_t>(left) : 1;
  }
  std::span<std::byte> out = buffer->data();
  rpc::EncodeFrameHead(h, md, out);
  std::byte* payload = out.data() + rpc::kFrameHeaderSize + md_size;
  if (call->request != nullptr) {
    call->request->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(payload));
    call->request = nullptr;
  } else if (body > 0) {
    std::memcpy(payload, call->request_bytes.data(), body);
  }
  call->state = CallState::kSent;
  call->conn = conn;
  ++conn->calls;
  if (conn->sink) {
    conn->c->SendUntracked(std::move(*buffer));  // done: OnSendsCompleted; failed: the sink's error
    return;
  }
  conn->c->Send(std::move(*buffer),
                transport::WithHandlerMemory([self = shared_from_this(), c = conn](absl::Status st) {
                  self->OnSendDone(c, st);
                }));
}

void Channel::Impl::OnSendsCompleted(const std::shared_ptr<Conn>& conn, size_t) { OnSendDone(conn, absl::OkStatus()); }

void Channel::Impl::OnSendDone(const std::shared_ptr<Conn>& conn, const absl::Status& st) {
  if (!st.ok()) return ConnFailed(conn, Status::FromAbsl(st));
  if (!conn->blocked.empty()) PumpBlocked(conn);
  if (!conn->stream_waiters.empty() && !conn->dead)
    for (auto& w : std::exchange(conn->stream_waiters, {}))
      if (auto s = w.lock()) s->OnSendSpace();
}

void Channel::Impl::PumpBlocked(const std::shared_ptr<Conn>& conn) {
  while (!conn->blocked.empty() && !conn->dead && conn_ == conn) {
    Ref r = conn->blocked.front();
    conn->blocked.pop_front();
    if (!r.live() || r.call->state != CallState::kBlocked) continue;
    r.call->state = CallState::kQueued;
    Send(r.call);
    if (r.live() && r.call->state == CallState::kBlocked) {
      // Still no room: Send() queued it at the back; put it back in front.
      conn->blocked.pop_back();
      conn->blocked.push_front(r);
      return;
    }
  }
}

void Channel::Impl::SendControl(const std::shared_ptr<Conn>& conn, rpc::FrameType type, uint64_t call_id,
                                StatusCode status) {
  auto buffer = conn->c->Prepare(rpc::kFrameHeaderSize);
  if (!buffer.ok()) return;  // the connection is failing; its receive loop reports it
  rpc::FrameHeader h;
  h.type = type;
  h.call_id = call_id;
  h.status = status;
  rpc::EncodeFrameHead(h, {}, buffer->data());
  conn->c->Send(std::move(*buffer), transport::WithHandlerMemory([](absl::Status) {}));
}

void Channel::Impl::Connect(asio::any_completion_handler<void(boost::system::error_code)> handler) {
  if (closed_) {
    transport::PostCompletion(ex_, std::move(handler), make_error_code(StatusCode::kCancelled));
    return;
  }
  if (state_ == State::kReady) {
    transport::PostCompletion(ex_, std::move(handler), boost::system::error_code());
    return;
  }
  waiters_.emplace_back(std::move(handler));
  if (state_ == State::kBackoff) backoff_timer_.cancel();
  if (state_ == State::kIdle || state_ == State::kBackoff) StartConnect();
}

void Channel::Impl::StartConnect() {
  state_ = State::kConnecting;
  RDMARPC_LOG(kInfo, "channel", "event=connecting target=", target_);
  ConnectTo(ex_, uri_, options_.transport,
            [self = shared_from_this()](absl::StatusOr<std::unique_ptr<Connection>> c) {
              self->OnConnected(std::move(c));
            });
}

void Channel::Impl::OnConnected(absl::StatusOr<std::unique_ptr<Connection>> result) {
  if (closed_) {
    if (result.ok()) (*result)->Close();
    return;
  }
  if (!result.ok()) {
    ++stats_.connect_failures;
    ForgetRemovedRdmaContext(options_.transport);
    // A refusal for a reason the caller must act on keeps its code (a wrong
    // auth token is UNAUTHENTICATED, not a transient UNAVAILABLE).
    const auto code = result.status().code();
    const StatusCode kept = code == absl::StatusCode::kUnauthenticated    ? StatusCode::kUnauthenticated
                            : code == absl::StatusCode::kPermissionDenied ? StatusCode::kPermissionDenied
                                                                          : StatusCode::kUnavailable;
    last_error_ = Status(kept, absl::StrCat("cannot connect to ", target_, ": ", result.status().message()));
    RDMARPC_LOG(kWarn, "channel", "event=connect_failed target=", target_, " error=\"", result.status().ToString(),
                "\" backoff_ms=", backoff_.count());
    EnterBackoff();
    // Calls that may not wait fail now; wait_for_ready ones stay queued.
    std::deque<Ref> keep;
    for (Ref r : std::exchange(queued_, {})) {
      if (!r.live() || r.call->state != CallState::kQueued) continue;
      if (r.call->ctx->wait_for_ready())
        keep.push_back(r);
      else
        Finish(r.call, last_error_, {}, false, Run::kPosted);
    }
    for (Ref r : keep)
      if (r.live()) queued_.push_back(r);
    CompleteWaiters(last_error_);
    return;
  }
  ++stats_.connects;
  backoff_ = options_.initial_backoff;
  auto conn = std::make_shared<Conn>();
  conn->c = std::move(*result);
  conn->peer = std::make_shared<const std::string>(conn->c->peer());
  conn_ = conn;
  state_ = State::kReady;
  last_error_ = Status();
  RDMARPC_LOG(kInfo, "channel", "event=established target=", target_, " peer=", *conn->peer);
  StartReceiving(conn);
  if (!keepalive_armed_ && internal::Keepalive::Enabled(options_.keepalive)) ArmKeepalive();
  {
    // The calls that waited for the connection leave together: one doorbell
    // (RDMA) or one sendmsg() (TCP) for all of them, not one each.
    transport::SendBatch batch(*conn->c);
    for (Ref r : std::exchange(queued_, {}))
      if (r.live() && r.call->state == CallState::kQueued && conn_ == conn) Send(r.call);
  }
  CompleteWaiters(Status());
}

void Channel::Impl::CompleteWaiters(const Status& status) {
  for (auto& w : std::exchange(waiters_, {}))
    transport::PostCompletion(ex_, std::move(w), make_error_code(status.code()));
}

void Channel::Impl::EnterBackoff() {
  state_ = State::kBackoff;
  const double jitter = std::uniform_real_distribution<double>(0.8, 1.2)(rng_);
  auto wait = std::chrono::milliseconds(static_cast<int64_t>(static_cast<double>(backoff_.count()) * jitter));
  backoff_ = std::min(backoff_ * 2, options_.max_backoff);
  backoff_timer_.expires_after(wait);
  backoff_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (ec || self->closed_ || self->state_ != State::kBackoff) return;
    self->state_ = State::kIdle;
    bool want = !self->waiters_.empty();
    for (Ref r : self->queued_) want = want || r.live();
    if (want) self->StartConnect();
  });
}

// Sweeps the current connection while there is one; stops (and is re-armed by
// the next connect) when there is none, so an idle closed channel holds no timer.
void Channel::Impl::ArmKeepalive() {
  keepalive_armed_ = true;
  keepalive_timer_.expires_after(internal::Keepalive::Tick(options_.keepalive));
  keepalive_timer_.async_wait(transport::WithHandlerMemory([weak = weak_from_this()](boost::system::error_code ec) {
    auto self = weak.lock();
    if (!self) return;
    self->keepalive_armed_ = false;
    if (ec || self->closed_ || !self->conn_ || self->conn_->dead) return;
    const std::shared_ptr<Conn> conn = self->conn_;
    switch (conn->keepalive.Sweep(internal::Keepalive::Clock::now(), self->options_.keepalive,
                                  conn->c->frames_received())) {
      case internal::Keepalive::Action::kNone:
        break;
      case internal::Keepalive::Action::kPing:
        self->SendControl(conn, rpc::FrameType::kPing, 0);
        break;
      case internal::Keepalive::Action::kDead:
        ++self->stats_.keepalive_timeouts;
        // What the connection was waiting for, for whoever reads the log.
        RDMARPC_LOG(kWarn, "channel", "event=keepalive_timeout target=", self->target_, " ",
                    transport::SummarizeStats(conn->c->stats()));
        self->ConnFailed(conn, UnavailableError(absl::StrCat("keepalive: nothing from the server within ",
                                                             self->options_.keepalive.timeout.count(),
                                                             " ms of a PING (its host is down or unreachable)")));
        break;
    }
    if (!self->keepalive_armed_ && self->conn_ && !self->closed_) self->ArmKeepalive();
  }));
}

void Channel::Impl::StartReceiving(const std::shared_ptr<Conn>& conn) {
  if (!internal::InstallReceiveSink(shared_from_this(), conn)) Receive(conn);
}

void Channel::Impl::Receive(std::shared_ptr<Conn> conn) {
  Connection* c = conn->c.get();
  c->Receive(transport::WithHandlerMemory([self = shared_from_this(), conn = std::move(conn)](absl::StatusOr<Message> m) {
    self->OnReceive(conn, std::move(m));
  }));
}

void Channel::Impl::OnReceive(const std::shared_ptr<Conn>& conn, absl::StatusOr<Message> message) {
  if (!message.ok()) {
    ConnFailed(conn, Status::FromAbsl(message.status()));
    return;
  }
  conn->keepalive.OnFrame();
  rpc::DecodedFrame f;
  if (auto st = rpc::DecodeFrame(message->data(), f); !st.ok()) {
    RDMARPC_LOG(kWarn, "channel", "event=bad_frame target=", target_, " error=\"", st.message(), "\"");
    ConnFailed(conn, InternalError(absl::StrCat("peer sent a malformed frame: ", st.message())));
    return;
  }
  switch (f.header.type) {
    case rpc::FrameType::kResponse: {
      Call* call = FindSent(f.header.call_id);
      if (call == nullptr) {
        if (auto st = streams_.find(f.header.call_id); st != streams_.end() && st->second->conn() == conn) {
          std::shared_ptr<ClientStream> stream = st->second;
          if (f.header.status == StatusCode::kOk) {
            stream->OnTrailer(Status(), f.payload);
          } else {
            std::string text(reinterpret_cast<const char*>(f.payload.data()), f.payload.size());
            stream->OnTrailer(Status(f.header.status, std::move(text)), {});
          }
          break;
        }
      }
      if (call == nullptr || call->conn != conn) {
        ++stats_.late_responses;  // completed already (deadline, cancel)
        break;
      }
      if (f.header.status == StatusCode::kOk) {
        Finish(call, Status(), ResponsePayload(std::move(*message), f.payload), false);
      } else {
        std::string text(reinterpret_cast<const char*>(f.payload.data()), f.payload.size());
        message->Reset();
        Finish(call, Status(f.header.status, std::move(text)), {}, false);
      }
      break;
    }
    case rpc::FrameType::kGoaway:
      RDMARPC_LOG(kInfo, "channel", "event=goaway target=", target_, " calls_in_flight=", conn->calls);
      conn->goaway = true;
      if (conn_ == conn) {
        conn_.reset();
        state_ = State::kIdle;
      }
      // Calls that never left (waiting for send space) go to the next connection.
      for (Ref r : std::exchange(conn->blocked, {})) {
        if (!r.live() || r.call->state != CallState::kBlocked) continue;
        r.call->state = CallState::kQueued;
        r.call->conn.reset();
        queued_.push_back(r);
      }
      if (!queued_.empty() && state_ == State::kIdle && !closed_) StartConnect();
      if (conn->calls == 0) {
        conn->dead = true;
        conn->c->Close();
        RDMARPC_LOG(kInfo, "channel", "event=disconnected target=", target_, " peer=", *conn->peer,
                    " reason=\"goaway: no calls in flight\"");
      }
      break;
    case rpc::FrameType::kPing:
      message->Reset();
      SendControl(conn, rpc::FrameType::kPong, 0);
      break;
    case rpc::FrameType::kPong:
      break;
    case rpc::FrameType::kStreamMessage:
    case rpc::FrameType::kWindow: {
      auto st = streams_.find(f.header.call_id);
      if (st == streams_.end() || st->second->conn() != conn) break;  // ended here already
      std::shared_ptr<ClientStream> stream = st->second;
      if (f.header.type == rpc::FrameType::kWindow) {
        stream->OnWindow(f.header.method_id);
      } else if (!stream->OnMessage(f.payload, f.header.timeout_us)) {
        RDMARPC_LOG(kWarn, "channel", "event=bad_frame target=", target_,
                    " error=\"stream message beyond the granted window\"");
        ConnFailed(conn, InternalError("server sent a stream message beyond the window this client granted"));
        return;
      }
      break;
    }
    case rpc::FrameType::kRequest:
    case rpc::FrameType::kCancel:
    case rpc::FrameType::kHalfClose:
      RDMARPC_LOG(kWarn, "channel", "event=bad_frame target=", target_, " error=\"server sent a client frame\"");
      ConnFailed(conn, InternalError("peer sent a request/cancel frame to a client"));
      return;
  }
  if (!conn->dead && !conn->sink) Receive(conn);
}

void Channel::Impl::ConnFailed(const std::shared_ptr<Conn>& conn, const Status& why) {
  if (conn->dead) {
    // Closed by us (GOAWAY drained, or Close()): fail whatever is left.
    FailCallsOn(&conn, UnavailableError(absl::StrCat("connection to ", target_, " closed")), false);
    return;
  }
  conn->dead = true;
  conn->c->Close();
  RDMARPC_LOG(kWarn, "channel", "event=disconnected target=", target_, " peer=", *conn->peer, " error=\"",
              why.ToString(), "\" calls_failed=", conn->calls);
  // Its RDMA device was removed: let go of the context now (the kernel's
  // removal waits for every holder); the next connect opens a new one.
  ForgetRemovedRdmaContext(options_.transport);
  if (conn_ == conn) {
    conn_.reset();
    // Lost a working connection: the next call reconnects at once (a refused
    // reconnect then backs off).
    state_ = closed_ ? State::kClosed : State::kIdle;
    last_error_ = UnavailableError(absl::StrCat("connection to ", target_, " lost: ", why.ToString()));
  }
  FailCallsOn(&conn, UnavailableError(absl::StrCat("connection to ", target_, " lost: ", why.ToString())), false);
  if (!closed_ && state_ == State::kIdle && !queued_.empty()) StartConnect();
}

void Channel::Impl::FailCallsOn(const std::shared_ptr<Conn>* conn, const Status& status, bool include_queued) {
  std::vector<Ref> victims;
  for (auto& call : all_calls_)
    if ((call->state == CallState::kSent || call->state == CallState::kBlocked) &&
        (conn == nullptr || call->conn == *conn))
      victims.push_back({call.get(), call->generation});
  if (include_queued)
    for (Ref r : std::exchange(queued_, {}))
      if (r.live()) victims.push_back(r);
  for (Ref r : victims)
    if (r.live()) Finish(r.call, status, {}, false, Run::kPosted);
  std::vector<std::shared_ptr<ClientStream>> streams;
  for (auto& [id, st] : streams_)
    if (conn == nullptr || st->conn() == *conn) streams.push_back(st);
  for (auto& st : streams) st->Abort(status);
}

void Channel::Impl::Close() {
  if (closed_) return;
  closed_ = true;
  state_ = State::kClosed;
  backoff_timer_.cancel();
  keepalive_timer_.cancel();
  auto conn = std::exchange(conn_, nullptr);
  FailCallsOn(nullptr, CancelledError("channel to " + target_ + " closed"), true);
  if (conn && !conn->dead) {
    conn->dead = true;
    conn->c->Close();
    RDMARPC_LOG(kInfo, "channel", "event=disconnected target=", target_, " peer=", *conn->peer,
                " reason=\"channel closed\"");
  }
  CompleteWaiters(CancelledError("channel closed"));
}

// ---- Channel ------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<Channel>> Channel::Create(asio::any_io_executor ex, std::string_view uri,
                                                         ChannelOptions options) {
  auto parsed = transport::ParseUri(absl::string_view(uri.data(), uri.size()));
  if (!parsed.ok()) return parsed.status();
  if (parsed->port == 0) return absl::InvalidArgumentError(absl::StrCat("channel target '", internal::Sv(uri), "' needs a port"));
  if (options.initial_backoff.count() <= 0 || options.max_backoff < options.initial_backoff)
    return absl::InvalidArgumentError("ChannelOptions: need 0 < initial_backoff <= max_backoff");
  auto impl = std::make_shared<Impl>(std::move(ex), *parsed, std::string(uri), std::move(options));
  return std::shared_ptr<Channel>(new Channel(std::move(impl)));
}

Channel::~Channel() { Close(); }

void Channel::Connect(asio::any_completion_handler<void(boost::system::error_code)> handler) {
  asio::dispatch(impl_->executor(), [impl = impl_, h = std::move(handler)]() mutable { impl->Connect(std::move(h)); });
}

void Channel::StartCall(ClientContext& context, const MethodInfo& method, const google::protobuf::MessageLite& request,
                        CallHandler handler) {
  if (OnThisThread(impl_->executor())) {
    impl_->Start(context, method, &request, {}, std::move(handler));
    return;
  }
  // From another thread: serialise here, so the request need not outlive this call.
  asio::post(impl_->executor(), [impl = impl_, &context, &method, bytes = request.SerializeAsString(),
                                 h = std::move(handler)]() mutable {
    impl->Start(context, method, nullptr, std::move(bytes), std::move(h));
  });
}

void Channel::StartStream(ClientContext& context, const MethodInfo& method, const google::protobuf::MessageLite* request,
                          StreamOpenHandler handler) {
  if (OnThisThread(impl_->executor())) {
    impl_->StartStream(context, method, request, {}, std::move(handler));
    return;
  }
  asio::post(impl_->executor(), [impl = impl_, &context, &method, bytes = request ? request->SerializeAsString() : std::string(),
                                 h = std::move(handler)]() mutable {
    impl->StartStream(context, method, nullptr, std::move(bytes), std::move(h));
  });
}

void ChannelInterface::StartStream(ClientContext& context, const MethodInfo& method, const google::protobuf::MessageLite*,
                                   StreamOpenHandler handler) {
  context.SetResult(UnimplementedError(absl::StrCat(internal::Sv(method.full_name), ": this channel does not stream")));
  transport::PostCompletion(get_executor(), std::move(handler), make_error_code(StatusCode::kUnimplemented),
                            std::shared_ptr<internal::StreamCore>());
}

asio::any_io_executor Channel::get_executor() const { return impl_->executor(); }

Channel::Batch::Batch(Channel& channel) {
  if (OnThisThread(channel.impl_->executor())) held_ = channel.impl_->HoldSends();
}

Channel::Batch::~Batch() {
  if (held_) held_->ReleaseSends();
}

void Channel::Close() {
  asio::post(impl_->executor(), [impl = impl_] { impl->Close(); });
}

const std::string& Channel::target() const { return impl_->target(); }
Channel::State Channel::state() const { return impl_->state(); }
Status Channel::last_error() const { return impl_->last_error(); }
ChannelStats Channel::stats() const { return impl_->stats(); }
std::optional<transport::ConnectionStats> Channel::connection_stats() const { return impl_->connection_stats(); }

}  // namespace rdmarpc
