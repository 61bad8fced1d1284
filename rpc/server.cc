#include "rpc/server.h"

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/system/system_error.hpp>

#include <deque>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "rpc/admin.h"
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
// After the grace period: how long the cancellation answers get to go out
// before connections that did not drain are closed.
constexpr std::chrono::milliseconds kShutdownLinger{250};
}  // namespace

class Server::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(asio::any_io_executor ex, ServerOptions options)
      : ex_(std::move(ex)), options_(std::move(options)), grace_timer_(ex_), keepalive_timer_(ex_) {}
  // Parked workers hold no reference to the server; destroying their resume
  // handlers unwinds their coroutines (through the executor, as Asio does).
  ~Impl() {
    ReleaseIdleWorkers();
    pool_->closed = true;
    for (auto& list : pool_->lists) list->clear();  // their calls hold the pool (Call::pool_ref)
  }
  void ReleaseIdleWorkers() {
    for (auto& w : idle_workers_) w->resume.reset();
    idle_workers_.clear();
  }

  Status AddService(Service& service);
  Status Start();
  const std::vector<std::string>& uris() const { return uris_; }
  void Shutdown(std::chrono::milliseconds grace, asio::any_completion_handler<void()> handler);
  void Stop();
  const ServerStats& stats() const { return stats_; }
  const ServerMetrics& metrics() const { return metrics_; }
  const std::string& admin_uri() const { return admin_uri_; }
  const asio::any_io_executor& executor() const { return ex_; }

 private:
  struct Call;
  struct Conn;
  class ServerStream;
  // Runs handlers one call after another. Handing a call to a parked worker
  // resumes it inline: a handler that completes without suspending costs no
  // co_spawn (no entry-point frame, no post, no new cancellation state). A
  // handler that suspends keeps its worker; the next call finds another, or a
  // new one is spawned. Parked workers are reused most-recent first.
  struct Worker {
    asio::cancellation_signal cancel;  // the worker's co_spawn slot: CancelCall emits here
    std::optional<asio::any_completion_handler<void(Call*)>> resume;  // set while parked
  };
  // Finished calls go back to a per-method free list with their request and
  // response messages, so a steady stream of calls reuses objects (and the
  // messages' string capacity) instead of allocating them. Shared with the
  // deleters, which may run after the server is gone. A call in a free list
  // keeps the reference its deleter had (Call::pool_ref) and hands it to the
  // next deleter: a reused call costs no reference count. The server empties
  // the lists and closes the pool when it goes (no cycle is left), and a call
  // finished after that is deleted.
  struct CallPool {
    using FreeList = std::vector<std::unique_ptr<Call>>;
    std::vector<std::unique_ptr<FreeList>> lists;  // one per method (stable addresses: Entry and Call point here)
    bool closed = false;                             // the server is gone
    static constexpr size_t kKeepPerMethod = 256;
  };
  struct Recycle {
    std::shared_ptr<CallPool> pool;
    void operator()(Call* call);
  };
  using CallPtr = std::unique_ptr<Call, Recycle>;
  struct Entry;
  CallPtr NewCall(const Entry& entry);

  struct Conn {
    // Declared before c: the connection (closed by its destructor) goes first.
    std::unique_ptr<transport::MessageSink> sink;  // set: messages come through it, no Receive() loop
    std::unique_ptr<Connection> c;
    std::string peer;
    uint64_t id = 0;  // 1, 2, ... in accept order (logs, /connections)
    bool dead = false;
    absl::flat_hash_map<uint64_t, Call*> calls;
    // Responses waiting for send space (Prepare() said RESOURCE_EXHAUSTED);
    // sent in order as earlier sends complete. `call` keeps the response alive.
    struct Pending {
      uint64_t call_id;
      Status status;
      CallPtr call;
    };
    std::deque<Pending> pending;
    internal::Keepalive keepalive{internal::Keepalive::Clock::now()};
    bool keepalive_dead = false;
    // Sends handed to the transport and not yet completed. A draining
    // connection closes only at zero: closing cancels queued sends, and the
    // last responses were lost that way (seen over RDMA in CI).
    size_t sends_in_flight = 0;
    // Set by Shutdown(): send completions go through OnSendsCompleted, which
    // closes the connection once drained.
    bool draining = false;
    // Open streams by call id (their handler may have returned while the
    // last messages wait for credits), and those waiting for send space.
    absl::flat_hash_map<uint64_t, std::shared_ptr<ServerStream>> streams;
    std::vector<std::weak_ptr<internal::StreamCore>> stream_waiters;
    // The method of this connection's last request (FindMethod).
    uint32_t last_method_id = 0;
    const Entry* last_method = nullptr;
  };
  struct Call {
    explicit Call(const asio::any_io_executor& ex) : deadline_timer(ex) {}
    std::shared_ptr<Conn> conn;
    uint64_t id = 0;
    Service* service = nullptr;
    const Service::Method* method = nullptr;
    MethodMetrics* metrics = nullptr;
    Clock::time_point received;
    std::unique_ptr<MessageLite> request;
    std::unique_ptr<MessageLite> response;
    ServerContext ctx;
    Worker* worker = nullptr;  // running this call's handler
    asio::steady_timer deadline_timer;
    std::shared_ptr<ServerStream> stream;  // streaming methods
    bool answered = false;
    uint64_t generation = 0;  // bumped each time the object is recycled
    CallPool::FreeList* home = nullptr;  // the method's free list
    std::shared_ptr<CallPool> pool_ref;  // while in home: its last deleter's reference
  };
  struct Entry {
    Service* service;
    const Service::Method* method;
    MethodMetrics* metrics;
    CallPool::FreeList* free;  // its recycled calls (pool_->lists)
  };

  // The served method `id` names, or null. A connection's calls mostly go to
  // the method of its last one: that is checked first, without hashing
  // (~25 instructions a call). methods_ is fixed from Start() on, so the
  // pointer stays valid.
  const Entry* FindMethod(Conn& conn, uint32_t id) const {
    if (conn.last_method != nullptr && conn.last_method_id == id) return conn.last_method;
    auto it = methods_.find(id);
    if (it == methods_.end()) return nullptr;
    conn.last_method_id = id;
    conn.last_method = &it->second;
    return &it->second;
  }

  void Accept(transport::Listener* listener);
  // listeners_[index] broke (its RDMA device was removed): listen on its URI
  // again every second until the device is back.
  void Relisten(size_t index, int attempt);
  template <typename, typename>
  friend class internal::ReceiveSink;
  // Messages through a sink when the transport has one, else Receive() after Receive().
  void StartReceiving(const std::shared_ptr<Conn>& conn);
  void Receive(std::shared_ptr<Conn> conn);
  void OnReceive(const std::shared_ptr<Conn>& conn, absl::StatusOr<Message> message);
  void OnRequest(const std::shared_ptr<Conn>& conn, Message message, const rpc::DecodedFrame& f);
  void OnHandlerDone(Call* call, std::exception_ptr error, Status status);
  static Status ThrownStatus(const MethodInfo& info, const ServerContext& ctx, std::exception_ptr error);
  void RunHandler(Call* call);
  static asio::awaitable<void> WorkerLoop(std::weak_ptr<Impl> weak, std::shared_ptr<Worker> worker, Call* first);
  void CancelCall(Call* call, StatusCode reason, const Status* answer);
  // Queues the response behind earlier ones that wait for send space; `call`
  // (may be null) owns `response` and is freed once the response is sent.
  void Respond(const std::shared_ptr<Conn>& conn, uint64_t call_id, Status status, CallPtr call);
  // false: no send space now (nothing sent).
  bool TrySend(const std::shared_ptr<Conn>& conn, uint64_t call_id, Status& status, const MessageLite* response);
  void PumpPending(const std::shared_ptr<Conn>& conn);
  void OnSendDone(const std::shared_ptr<Conn>& conn, const absl::Status& st);
  // Through the sink: `count` responses sent with SendUntracked() completed.
  void OnSendsCompleted(const std::shared_ptr<Conn>& conn, size_t count);
  // The common case of OnSendsCompleted() without the server: count them,
  // and nothing else when no response or stream waits for send space and the
  // connection is not draining (true: done; ReceiveSink calls it first).
  static bool SendsCompletedWithoutOwner(Conn& conn, size_t count) {
    if (conn.draining || !conn.pending.empty() || !conn.stream_waiters.empty()) return false;
    conn.sends_in_flight -= count;
    return true;
  }
  void OnStreamFrame(const std::shared_ptr<Conn>& conn, const rpc::DecodedFrame& f);
  void SendControl(const std::shared_ptr<Conn>& conn, rpc::FrameType type, bool close_after);
  void CloseConn(const std::shared_ptr<Conn>& conn, const Status& why);
  void MaybeCloseDrained(const std::shared_ptr<Conn>& conn);
  void ArmKeepalive();
  void SweepKeepalive();
  void MaybeFinishShutdown();
  std::string ServiceNames() const;
  AdminResponse AdminPage(std::string_view path) const;

  asio::any_io_executor ex_;
  ServerOptions options_;
  absl::flat_hash_map<uint32_t, Entry> methods_;
  std::vector<Service*> services_;
  std::vector<std::unique_ptr<transport::Listener>> listeners_;
  std::vector<std::string> uris_;
  std::vector<std::shared_ptr<Conn>> conns_;
  std::shared_ptr<CallPool> pool_ = std::make_shared<CallPool>();
  std::vector<std::shared_ptr<Worker>> idle_workers_;
  bool started_ = false;
  bool shutting_down_ = false;
  bool stopped_ = false;
  asio::steady_timer grace_timer_;
  asio::steady_timer keepalive_timer_;
  std::vector<asio::any_completion_handler<void()>> shutdown_waiters_;
  ServerStats stats_;
  ServerMetrics metrics_;
  std::shared_ptr<AdminServer> admin_;
  std::string admin_uri_;
};

// The server's end of one stream.
class Server::Impl::ServerStream final : public internal::StreamCore {
 public:
  ServerStream(std::shared_ptr<Impl> impl, std::shared_ptr<Conn> conn, uint64_t id, const MethodInfo& method,
               uint32_t window)
      : StreamCore(impl->ex_, Side::kServer, window, method.client_streaming, method.server_streaming),
        impl_(std::move(impl)),
        conn_(std::move(conn)),
        id_(id) {}
  using StreamCore::SetOpened;

 protected:
  absl::StatusOr<transport::SendBuffer> LinkPrepare(size_t size) override {
    if (conn_->dead) return absl::UnavailableError("connection closed");
    return conn_->c->Prepare(size);
  }
  void LinkSend(transport::SendBuffer buffer) override {
    ++conn_->sends_in_flight;
    conn_->c->Send(std::move(buffer), transport::WithHandlerMemory([impl = impl_, c = conn_](absl::Status st) {
                     --c->sends_in_flight;
                     impl->OnSendDone(c, st);
                   }));
  }
  void LinkWaitForSendSpace() override { conn_->stream_waiters.push_back(weak_from_this()); }
  size_t LinkMaxMessageSize() const override { return conn_->c->max_message_size(); }
  uint64_t LinkStreamId() const override { return id_; }
  // The handler cancelled its own stream operation: it returns an error,
  // which answers the client.
  void LinkCancelled(StatusCode) override {}
  void LinkEnded() override {
    if (auto it = conn_->streams.find(id_); it != conn_->streams.end() && it->second.get() == this)
      conn_->streams.erase(it);  // may drop the last reference but one (the caller's)
  }

 private:
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<Conn> conn_;
  uint64_t id_;
};

void Server::Impl::Recycle::operator()(Call* call) {
  ++call->generation;
  call->conn.reset();
  call->stream.reset();
  call->answered = false;
  call->ctx.Reset(nullptr);
  auto& list = *call->home;
  if (pool->closed || list.size() >= CallPool::kKeepPerMethod) {
    delete call;
    return;
  }
  call->response->Clear();  // keeps string capacity: the next response reuses it
  call->pool_ref = std::move(pool);
  list.emplace_back(call);
}

Server::Impl::CallPtr Server::Impl::NewCall(const Entry& entry) {
  auto& list = *entry.free;
  if (!list.empty()) {
    Call* reused = list.back().release();
    list.pop_back();
    return CallPtr(reused, Recycle{std::move(reused->pool_ref)});
  }
  const Service::Method* method = entry.method;
  CallPtr call(new Call(ex_), Recycle{pool_});
  call->method = method;
  call->home = entry.free;
  call->request.reset(method->request_prototype().New());
  call->response.reset(method->response_prototype().New());
  return call;
}

Status Server::Impl::AddService(Service& service) {
  if (started_) return Status(StatusCode::kFailedPrecondition, "AddService() after Start()");
  for (const auto& m : service.methods()) {
    if (auto it = methods_.find(m.info.id); it != methods_.end())
      return Status(StatusCode::kAlreadyExists,
                    absl::StrCat("method id 0x", absl::Hex(m.info.id), " of ", internal::Sv(m.info.full_name),
                                 " is already served by ", internal::Sv(it->second.method->info.full_name),
                                 " (same method registered twice, or an id collision: rename one)"));
  }
  for (const auto& m : service.methods()) {
    pool_->lists.push_back(std::make_unique<CallPool::FreeList>());
    methods_.emplace(m.info.id, Entry{&service, &m, metrics_.AddMethod(m.info), pool_->lists.back().get()});
  }
  services_.push_back(&service);
  return Status();
}

Status Server::Impl::Start() {
  if (started_) return Status(StatusCode::kFailedPrecondition, "Start() called twice");
  if (options_.listen.empty()) return InvalidArgumentError("ServerOptions::listen is empty: give at least one URI");
  for (const auto& text : options_.listen) {
    auto uri = transport::ParseUri(text);
    absl::StatusOr<std::unique_ptr<transport::Listener>> listener =
        uri.ok() ? ListenOn(ex_, *uri, options_.transport) : absl::StatusOr<std::unique_ptr<transport::Listener>>(uri.status());
    if (!listener.ok()) {
      for (auto& l : listeners_) l->Close();
      listeners_.clear();
      uris_.clear();
      auto s = Status::FromAbsl(listener.status());
      return Status(s.code(), absl::StrCat("cannot listen on ", text, ": ", s.message()));
    }
    uris_.push_back((*listener)->local_uri());
    listeners_.push_back(std::move(*listener));
  }
  if (!options_.admin_listen.empty()) {
    auto page = [weak = weak_from_this()](std::string_view path) {
      auto self = weak.lock();
      return self ? self->AdminPage(path) : AdminResponse{503, "text/plain; charset=utf-8", "server gone\n"};
    };
    auto admin = AdminServer::Start(ex_, options_.admin_listen, std::move(page));
    if (!admin.ok()) {
      for (auto& l : listeners_) l->Close();
      listeners_.clear();
      uris_.clear();
      return Status::FromAbsl(admin.status());
    }
    admin_ = std::move(*admin);
    admin_uri_ = admin_->uri();
  }
  started_ = true;
  for (auto& l : listeners_) {
    RDMARPC_LOG(kInfo, "server", "event=listening uri=", l->local_uri());
    Accept(l.get());
  }
  if (internal::Keepalive::Enabled(options_.keepalive)) ArmKeepalive();
  return Status();
}

void Server::Impl::ArmKeepalive() {
  keepalive_timer_.expires_after(internal::Keepalive::Tick(options_.keepalive));
  keepalive_timer_.async_wait(transport::WithHandlerMemory([weak = weak_from_this()](boost::system::error_code ec) {
    auto self = weak.lock();
    if (ec || !self || self->stopped_) return;
    self->SweepKeepalive();
    self->ArmKeepalive();
  }));
}

void Server::Impl::SweepKeepalive() {
  const auto now = internal::Keepalive::Clock::now();
  bool any_dead = false;
  for (const auto& conn : conns_) {  // no copy: a sweep must not allocate
    switch (conn->keepalive.Sweep(now, options_.keepalive, conn->c->frames_received())) {
      case internal::Keepalive::Action::kNone:
        break;
      case internal::Keepalive::Action::kPing:
        SendControl(conn, rpc::FrameType::kPing, false);
        break;
      case internal::Keepalive::Action::kDead:
        conn->keepalive_dead = true;
        any_dead = true;
        break;
    }
  }
  if (!any_dead) return;
  for (auto conn : std::vector(conns_)) {
    if (!conn->keepalive_dead) continue;
    ++stats_.keepalive_closed;
    RDMARPC_LOG(kWarn, "server", "event=keepalive_timeout conn=", conn->id, " peer=", conn->peer,
                " calls=", conn->calls.size(), " action=close_connection ",
                transport::SummarizeStats(conn->c->stats()));
    CloseConn(conn, UnavailableError(absl::StrCat("keepalive: nothing from the client within ",
                                                  options_.keepalive.timeout.count(),
                                                  " ms of a PING (its host is down or unreachable)")));
  }
}

void Server::Impl::Accept(transport::Listener* listener) {
  listener->Accept([self = shared_from_this(), listener](absl::StatusOr<std::unique_ptr<Connection>> c) {
    if (self->stopped_ || self->shutting_down_) {
      if (c.ok()) (*c)->Close();
      return;
    }
    if (!c.ok()) {
      if (c.status().code() == absl::StatusCode::kCancelled) return;  // listener closed
      if (listener->broken()) {
        // Its device went away. The listener has let go of the device
        // already; so does this server's context, so that the kernel can
        // finish removing it. Connections on it fail on their own.
        RDMARPC_LOG(kWarn, "server", "event=listener_lost uri=", listener->local_uri(), " error=\"",
                    c.status().ToString(), "\" action=\"listen again every 1 s\"");
        ForgetRemovedRdmaContext(self->options_.transport);
        for (size_t i = 0; i < self->listeners_.size(); ++i)
          if (self->listeners_[i].get() == listener) self->Relisten(i, 1);
        return;
      }
      // A client whose handshake failed: that client's problem, keep serving.
      RDMARPC_LOG(kWarn, "server", "event=accept_failed error=\"", c.status().ToString(), "\"");
      self->Accept(listener);
      return;
    }
    if (self->stats_.connections_open >= self->options_.max_connections) {
      ++self->stats_.connections_refused;
      RDMARPC_LOG(kWarn, "server", "event=connection_refused peer=", (*c)->peer(),
                  " reason=\"max_connections ", self->options_.max_connections, " reached\"");
      (*c)->Close();
      self->Accept(listener);
      return;
    }
    auto conn = std::make_shared<Conn>();
    conn->c = std::move(*c);
    conn->peer = conn->c->peer();
    conn->id = ++self->stats_.connections_accepted;
    ++self->stats_.connections_open;
    self->conns_.push_back(conn);
    // The transport hands over established connections: accepted = established.
    RDMARPC_LOG(kInfo, "server", "event=accepted conn=", conn->id, " peer=", conn->peer);
    self->StartReceiving(conn);
    self->Accept(listener);
  });
}

void Server::Impl::Relisten(size_t index, int attempt) {
  auto timer = std::make_shared<asio::steady_timer>(ex_, std::chrono::seconds(1));
  timer->async_wait([weak = weak_from_this(), timer, index, attempt](boost::system::error_code ec) {
    auto self = weak.lock();
    if (ec || !self || self->stopped_ || self->shutting_down_) return;
    // The URI as first bound: same port, so that clients find the server again.
    const std::string& text = self->uris_[index];
    auto uri = transport::ParseUri(text);
    absl::StatusOr<std::unique_ptr<transport::Listener>> listener =
        uri.ok() ? ListenOn(self->ex_, *uri, self->options_.transport)
                 : absl::StatusOr<std::unique_ptr<transport::Listener>>(uri.status());
    if (!listener.ok()) {
      // Logged once in a while: the device may stay away for long.
      if (attempt == 1 || attempt % 30 == 0)
        RDMARPC_LOG(kInfo, "server", "event=relisten_failed uri=", text, " attempt=", attempt, " error=\"",
                    listener.status().ToString(), "\"");
      self->Relisten(index, attempt + 1);
      return;
    }
    RDMARPC_LOG(kWarn, "server", "event=listening uri=", (*listener)->local_uri(), " attempts=", attempt,
                " reason=\"device back\"");
    // The broken one goes after this handler: its last Accept may still be unwinding.
    asio::post(self->ex_, [old = std::move(self->listeners_[index])] {});
    self->listeners_[index] = std::move(*listener);
    self->Accept(self->listeners_[index].get());
  });
}

void Server::Impl::StartReceiving(const std::shared_ptr<Conn>& conn) {
  if (!internal::InstallReceiveSink(shared_from_this(), conn)) Receive(conn);
}

void Server::Impl::Receive(std::shared_ptr<Conn> conn) {
  Connection* c = conn->c.get();
  c->Receive(transport::WithHandlerMemory([self = shared_from_this(), conn = std::move(conn)](absl::StatusOr<Message> m) {
    self->OnReceive(conn, std::move(m));
  }));
}

void Server::Impl::OnReceive(const std::shared_ptr<Conn>& conn, absl::StatusOr<Message> message) {
  if (!message.ok()) {
    CloseConn(conn, Status::FromAbsl(message.status()));
    return;
  }
  conn->keepalive.OnFrame();
  rpc::DecodedFrame f;
  if (auto st = rpc::DecodeFrame(message->data(), f); !st.ok()) {
    ++stats_.bad_frames;
    RDMARPC_LOG(kWarn, "server", "event=bad_frame peer=", conn->peer, " error=\"", st.message(),
                "\" action=close_connection");
    CloseConn(conn, InvalidArgumentError(std::string(st.message())));
    return;
  }
  switch (f.header.type) {
    case rpc::FrameType::kRequest:
      OnRequest(conn, std::move(*message), f);
      break;
    case rpc::FrameType::kCancel: {
      // The client's timer may beat ours by the transit time: its reason counts.
      const StatusCode why = rpc::CancelReason(f.header.status);
      if (auto it = conn->calls.find(f.header.call_id); it != conn->calls.end())
        CancelCall(it->second, why, nullptr);
      if (auto it = conn->streams.find(f.header.call_id); it != conn->streams.end()) {
        std::shared_ptr<ServerStream> st = it->second;
        st->Abort(why == StatusCode::kDeadlineExceeded ? DeadlineExceededError("stream deadline exceeded (client timer)")
                           : CancelledError("stream cancelled by the client"));
      }
      break;
    }
    case rpc::FrameType::kStreamMessage:
    case rpc::FrameType::kHalfClose:
    case rpc::FrameType::kWindow:
      OnStreamFrame(conn, f);
      if (conn->dead) return;
      break;
    case rpc::FrameType::kPing:
      message->Reset();
      SendControl(conn, rpc::FrameType::kPong, false);
      break;
    case rpc::FrameType::kPong:
      break;
    case rpc::FrameType::kResponse:
    case rpc::FrameType::kGoaway:
      ++stats_.bad_frames;
      RDMARPC_LOG(kWarn, "server", "event=bad_frame peer=", conn->peer,
                  " error=\"client sent a server-only frame\" action=close_connection");
      CloseConn(conn, InvalidArgumentError("client sent a server-only frame"));
      return;
  }
  if (!conn->dead && !conn->sink) Receive(conn);
}

void Server::Impl::OnStreamFrame(const std::shared_ptr<Conn>& conn, const rpc::DecodedFrame& f) {
  auto it = conn->streams.find(f.header.call_id);
  if (it == conn->streams.end()) return;  // ended here already (late frame)
  std::shared_ptr<ServerStream> stream = it->second;
  bool ok = true;
  switch (f.header.type) {
    case rpc::FrameType::kStreamMessage:
      ok = stream->OnMessage(f.payload, f.header.timeout_us);
      break;
    case rpc::FrameType::kHalfClose:
      ok = stream->OnHalfClose();
      break;
    default:
      stream->OnWindow(f.header.method_id);
      break;
  }
  if (!ok) {
    ++stats_.bad_frames;
    RDMARPC_LOG(kWarn, "server", "event=bad_frame peer=", conn->peer, " error=\"stream ", f.header.call_id,
                ": message beyond the granted window, after half-close, or to a stream that takes none\"",
                " action=close_connection");
    CloseConn(conn, InvalidArgumentError("stream protocol violation"));
  }
}

void Server::Impl::OnRequest(const std::shared_ptr<Conn>& conn, Message message, const rpc::DecodedFrame& f) {
  const uint64_t id = f.header.call_id;
  const Clock::time_point now = Clock::now();
  ++stats_.calls_started;
  if (!conn->calls.empty() && conn->calls.contains(id)) {  // empty: no hash (inline calls never enter it)
    ++stats_.bad_frames;
    RDMARPC_LOG(kWarn, "server", "event=bad_frame peer=", conn->peer, " error=\"call id ", id,
                " reused while in flight\" action=close_connection");
    CloseConn(conn, InvalidArgumentError("call id reused while in flight"));
    return;
  }
  const Entry* served = FindMethod(*conn, f.header.method_id);
  // Calls answered without a handler count for their method (unknown
  // methods only in ServerStats::unknown_methods).
  auto reject = [&](Status st) {
    if (served != nullptr) served->metrics->Record(st.code(), Clock::now() - now);
    Respond(conn, id, std::move(st), nullptr);
  };
  if (shutting_down_ || stopped_)
    return reject(UnavailableError("server is shutting down; reconnect elsewhere"));
  if (conn->calls.size() >= options_.max_calls_per_connection)
    return reject(ResourceExhaustedError(absl::StrCat("more than ", options_.max_calls_per_connection,
                                                      " calls in flight on this connection")));
  if (served == nullptr) {
    ++stats_.unknown_methods;
    return Respond(conn, id,
                   UnimplementedError(absl::StrCat("method id 0x", absl::Hex(f.header.method_id),
                                                   " is not served here (services: ", ServiceNames(), ")")),
                   nullptr);
  }
  const Entry entry = *served;
  const MethodInfo& info = entry.method->info;
  const bool streaming = info.client_streaming || info.server_streaming;
  if (streaming ? entry.method->invoke_stream == nullptr : entry.method->invoke == nullptr)
    return reject(UnimplementedError(absl::StrCat(internal::Sv(info.full_name), " has no handler entry")));
  if (streaming && info.client_streaming && !f.payload.empty())
    return reject(InvalidArgumentError(absl::StrCat(internal::Sv(info.full_name),
                                                    ": a client-streaming REQUEST carries no payload")));
  CallPtr call = NewCall(entry);
  call->conn = conn;
  call->id = id;
  call->service = entry.service;
  call->metrics = entry.metrics;
  call->received = now;
  if (!call->request->ParseFromArray(f.payload.data(), static_cast<int>(f.payload.size())))
    return reject(InvalidArgumentError(absl::StrCat("request for ", internal::Sv(entry.method->info.full_name),
                                                    " does not parse as ", call->request->GetTypeName())));
  call->ctx.Reset(&conn->peer);
  if (!f.metadata.empty()) rpc::ParseMetadata(f.metadata, call->ctx.mutable_metadata());
  message.Reset();  // the receive buffer goes back to the transport (and its credit to the peer)
  if (streaming) {
    ++stats_.streams_started;
    call->stream = std::make_shared<ServerStream>(shared_from_this(), conn, id, info, options_.stream_window);
    conn->streams.emplace(id, call->stream);
  }
  if (entry.method->invoke_inline != nullptr && !streaming) {
    if (f.header.timeout_us != 0)
      call->ctx.set_deadline(now + std::chrono::microseconds(std::min<uint64_t>(f.header.timeout_us, uint64_t{1} << 40)));
    std::optional<Status> answer;
    try {
      answer = entry.method->invoke_inline(*call->service, call->ctx, *call->request, *call->response);
    } catch (...) {
      answer = ThrownStatus(info, call->ctx, std::current_exception());
    }
    if (answer) {
      // Answered inline: no coroutine, no timer, never in conn->calls.
      ++stats_.calls_finished;
      call->metrics->Record(answer->code(), Clock::now() - now);
      call->answered = true;
      Respond(conn, id, std::move(*answer), std::move(call));  // frees the call once sent
      return;
    }
  }
  Call* raw = call.release();
  conn->calls.emplace(id, raw);
  ++stats_.calls_in_flight;
  if (raw->stream) raw->stream->SetOpened();  // grants the client its window
  if (f.header.timeout_us != 0) {
    const auto deadline = now + std::chrono::microseconds(std::min<uint64_t>(f.header.timeout_us, uint64_t{1} << 40));
    raw->ctx.set_deadline(deadline);
    raw->deadline_timer.expires_at(deadline);
    // The expiry may already be queued when the handler finishes (cancel()
    // cannot recall it), and by then `raw` may be recycled for another call or
    // freed: the handler finds the call through its connection and checks the
    // generation before touching it (found by tests/fuzz/server_fuzzer).
    raw->deadline_timer.async_wait(transport::WithHandlerMemory(
        [self = shared_from_this(), weak_conn = std::weak_ptr<Conn>(conn), id, gen = raw->generation,
         us = f.header.timeout_us](boost::system::error_code ec) {
          if (ec) return;
          auto c = weak_conn.lock();
          if (!c) return;
          auto found = c->calls.find(id);
          if (found == c->calls.end() || found->second->generation != gen || found->second->answered) return;
          Status answer = DeadlineExceededError(absl::StrCat("deadline of ", us, " us passed on the server"));
          self->CancelCall(found->second, StatusCode::kDeadlineExceeded, &answer);
        }));
  }
  RunHandler(raw);
}

void Server::Impl::RunHandler(Call* call) {
  if (!idle_workers_.empty()) {
    std::shared_ptr<Worker> w = std::move(idle_workers_.back());
    idle_workers_.pop_back();
    call->worker = w.get();
    asio::any_completion_handler<void(Call*)> resume(std::move(*w->resume));
    w->resume.reset();
    std::move(resume)(call);  // runs the handler here until it finishes or suspends
    return;
  }
  auto w = std::make_shared<Worker>();
  call->worker = w.get();
  asio::co_spawn(ex_, WorkerLoop(weak_from_this(), w, call), asio::bind_cancellation_slot(w->cancel.slot(), asio::detached));
}

asio::awaitable<void> Server::Impl::WorkerLoop(std::weak_ptr<Impl> weak, std::shared_ptr<Worker> worker, Call* call) {
  for (;;) {
    {
      // Alive: it just handed us `call`; held while the handler runs (as a
      // co_spawn completion handler would hold it).
      std::shared_ptr<Impl> self = weak.lock();
      if (!self) co_return;
      std::exception_ptr error;
      Status status;
      try {
        if (call->stream)
          status = co_await call->method->invoke_stream(*call->service, call->ctx, *call->request, *call->response,
                                                        call->stream);
        else
          status = co_await call->method->invoke(*call->service, call->ctx, *call->request, *call->response);
      } catch (...) {
        error = std::current_exception();
      }
      self->OnHandlerDone(call, error, std::move(status));
      // A cancelled call leaves the worker's cancellation state tripped; the
      // next call starts clean.
      if ((co_await asio::this_coro::cancellation_state).cancelled() != asio::cancellation_type::none)
        co_await asio::this_coro::reset_cancellation_state();
      if (self->stopped_) co_return;
      self->idle_workers_.push_back(worker);
    }
    // The server may have gone with the last reference above: then nobody
    // would ever resume or destroy a parked worker.
    if (weak.expired()) co_return;
    call = co_await asio::async_initiate<const asio::use_awaitable_t<>&, void(Call*)>(
        [w = worker.get()](auto handler) { w->resume.emplace(transport::WithHandlerMemory(std::move(handler))); },
        asio::use_awaitable);
    if (call == nullptr) co_return;
  }
}

void Server::Impl::CancelCall(Call* call, StatusCode reason, const Status* answer) {
  if (call->ctx.is_cancelled()) return;
  ++stats_.calls_cancelled;
  call->ctx.MarkCancelled(reason);
  if (call->stream) call->stream->Abort(Status(reason, "call cancelled"));
  if (!call->answered) {
    call->answered = true;
    if (answer != nullptr) Respond(call->conn, call->id, *answer, nullptr);
  }
  if (call->worker != nullptr) call->worker->cancel.emit(asio::cancellation_type::terminal);
}

// What a handler's exception answers: the cancellation's reason when a
// cancelled handler's awaited operation threw (system_error), else INTERNAL
// naming the method and the exception.
Status Server::Impl::ThrownStatus(const MethodInfo& info, const ServerContext& ctx, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const boost::system::system_error& e) {
    return ctx.is_cancelled() ? Status(ctx.cancel_reason(), "handler cancelled")
                              : InternalError(absl::StrCat("handler of ", internal::Sv(info.full_name), " threw: ", e.what()));
  } catch (const std::exception& e) {
    return InternalError(absl::StrCat("handler of ", internal::Sv(info.full_name), " threw: ", e.what()));
  } catch (...) {
    return InternalError(absl::StrCat("handler of ", internal::Sv(info.full_name), " threw"));
  }
}

void Server::Impl::OnHandlerDone(Call* raw, std::exception_ptr error, Status status) {
  CallPtr call(raw, Recycle{pool_});
  call->deadline_timer.cancel();
  call->worker = nullptr;
  auto conn = call->conn;
  const uint64_t id = call->id;
  conn->calls.erase(id);
  --stats_.calls_in_flight;
  ++stats_.calls_finished;
  if (!call->answered) {
    if (error) status = ThrownStatus(call->method->info, call->ctx, error);
    call->metrics->Record(status.code(), Clock::now() - call->received);
    call->answered = true;
    if (call->stream) {
      // The RESPONSE ends the stream: it goes after every message the
      // handler wrote (some may still wait for the client's credits).
      std::shared_ptr<ServerStream> stream = call->stream;
      const bool has_response = call->method->info.client_streaming && !call->method->info.server_streaming;
      stream->CloseWrites([self = shared_from_this(), conn, id, stream, has_response, status = std::move(status),
                           call = std::move(call)]() mutable {
        if (auto it = conn->streams.find(id); it != conn->streams.end() && it->second == stream) conn->streams.erase(it);
        if (!has_response) call.reset();
        self->Respond(conn, id, std::move(status), std::move(call));
        stream->Abort(Status());  // over: later frames for it are dropped
      });
      call.reset();
    } else {
      Respond(conn, id, std::move(status), std::move(call));  // frees the call once sent
    }
  } else {
    // Answered (deadline, shutdown) or abandoned (client cancel, disconnect) by a cancellation.
    call->metrics->Record(call->ctx.is_cancelled() ? call->ctx.cancel_reason() : StatusCode::kCancelled,
                          Clock::now() - call->received);
  }
  call.reset();
  MaybeCloseDrained(conn);
  MaybeFinishShutdown();
}

void Server::Impl::Respond(const std::shared_ptr<Conn>& conn, uint64_t call_id, Status status,
                           CallPtr call) {
  if (conn->dead) return;
  if (conn->pending.empty() && TrySend(conn, call_id, status, call ? call->response.get() : nullptr)) return;
  // Responses pile up only if the client sends but does not read: every call
  // it may have in flight, answered, plus as many rejections, is the bound.
  if (conn->pending.size() >= 2 * options_.max_calls_per_connection) {
    ++stats_.slow_readers_closed;
    RDMARPC_LOG(kWarn, "server", "event=slow_reader conn=", conn->id, " peer=", conn->peer, " pending_responses=",
                conn->pending.size(), " action=close_connection");
    CloseConn(conn, ResourceExhaustedError(absl::StrCat(conn->pending.size(),
                                                        " responses unread by the client; connection closed")));
    return;
  }
  conn->pending.push_back({call_id, std::move(status), std::move(call)});
}

void Server::Impl::PumpPending(const std::shared_ptr<Conn>& conn) {
  while (!conn->pending.empty() && !conn->dead) {
    auto& p = conn->pending.front();
    if (!TrySend(conn, p.call_id, p.status, p.call ? p.call->response.get() : nullptr)) return;
    conn->pending.pop_front();
  }
  MaybeCloseDrained(conn);
}

bool Server::Impl::TrySend(const std::shared_ptr<Conn>& conn, uint64_t call_id, Status& status,
                           const MessageLite* response) {
  if (conn->dead) return true;
  size_t body = status.ok() ? (response != nullptr ? response->ByteSizeLong() : 0) : status.message().size();
  if (status.ok() && rpc::kFrameHeaderSize + body > conn->c->max_message_size()) {
    status = ResourceExhaustedError(absl::StrCat("response of ", body, " bytes exceeds the connection's ",
                                                 conn->c->max_message_size(), "-byte message limit"));
    body = status.message().size();
  }
  if (!status.ok() && rpc::kFrameHeaderSize + body > conn->c->max_message_size()) {
    status = Status(status.code(), status.message().substr(0, 1024));
    body = status.message().size();
  }
  auto buffer = conn->c->Prepare(rpc::kFrameHeaderSize + body);
  if (!buffer.ok()) {
    if (buffer.status().code() == absl::StatusCode::kResourceExhausted) return false;
    RDMARPC_LOG(kWarn, "server", "event=respond_failed peer=", conn->peer, " error=\"", buffer.status().ToString(), "\"");
    return true;
  }
  rpc::FrameHeader h;
  h.type = rpc::FrameType::kResponse;
  // A handler may return any integer as a code; the wire carries only the
  // canonical ones (a peer rejects the frame otherwise and drops the connection).
  h.status = static_cast<uint8_t>(status.code()) <= kMaxStatusCode ? status.code() : StatusCode::kUnknown;
  h.payload_length = static_cast<uint32_t>(body);
  h.call_id = call_id;
  std::span<std::byte> out = buffer->data();
  rpc::EncodeFrameHead(h, {}, out);
  if (status.ok() && response != nullptr)
    response->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out.data() + rpc::kFrameHeaderSize));
  else if (body > 0)
    std::memcpy(out.data() + rpc::kFrameHeaderSize, status.message().data(), body);
  ++conn->sends_in_flight;
  if (conn->sink) {
    conn->c->SendUntracked(std::move(*buffer));  // done: OnSendsCompleted; failed: the sink's error
    return true;
  }
  conn->c->Send(std::move(*buffer), transport::WithHandlerMemory([self = shared_from_this(), conn](absl::Status st) {
    --conn->sends_in_flight;
    self->OnSendDone(conn, st);
  }));
  return true;
}

void Server::Impl::OnSendsCompleted(const std::shared_ptr<Conn>& conn, size_t count) {
  conn->sends_in_flight -= count;
  OnSendDone(conn, absl::OkStatus());
}

void Server::Impl::OnSendDone(const std::shared_ptr<Conn>& conn, const absl::Status& st) {
  if (!st.ok()) return CloseConn(conn, Status::FromAbsl(st));
  if (!conn->pending.empty())
    PumpPending(conn);
  else if (shutting_down_)
    MaybeCloseDrained(conn);
  if (!conn->stream_waiters.empty() && !conn->dead)
    for (auto& w : std::exchange(conn->stream_waiters, {}))
      if (auto s = w.lock()) s->OnSendSpace();
}

void Server::Impl::SendControl(const std::shared_ptr<Conn>& conn, rpc::FrameType type, bool close_after) {
  if (conn->dead) return;
  auto buffer = conn->c->Prepare(rpc::kFrameHeaderSize);
  if (!buffer.ok()) {
    if (close_after) MaybeCloseDrained(conn);
    return;
  }
  rpc::FrameHeader h;
  h.type = type;
  rpc::EncodeFrameHead(h, {}, buffer->data());
  ++conn->sends_in_flight;
  conn->c->Send(std::move(*buffer),
                transport::WithHandlerMemory([self = shared_from_this(), conn, close_after](absl::Status) {
                  --conn->sends_in_flight;
                  if (close_after || self->shutting_down_) self->MaybeCloseDrained(conn);
                }));
}

void Server::Impl::CloseConn(const std::shared_ptr<Conn>& conn, const Status& why) {
  if (conn->dead) return;
  conn->dead = true;
  conn->c->Close();
  conn->pending.clear();  // unsent responses (and the calls they keep alive)
  --stats_.connections_open;
  std::erase(conns_, conn);
  RDMARPC_LOG(kInfo, "server", "event=disconnected conn=", conn->id, " peer=", conn->peer, " reason=\"",
              why.ToString(), "\" calls_cancelled=", conn->calls.size());
  std::vector<Call*> calls;
  for (auto& [id, call] : conn->calls) calls.push_back(call);
  for (Call* call : calls) {
    call->answered = true;  // nobody to answer
    CancelCall(call, StatusCode::kUnavailable, nullptr);
  }
  std::vector<std::shared_ptr<ServerStream>> streams;
  for (auto& [id, st] : conn->streams) streams.push_back(st);
  for (auto& st : streams) st->Abort(UnavailableError("connection closed"));
  conn->streams.clear();
  conn->stream_waiters.clear();
  MaybeFinishShutdown();
}

void Server::Impl::MaybeCloseDrained(const std::shared_ptr<Conn>& conn) {
  if ((shutting_down_ || stopped_) && conn->calls.empty() && conn->pending.empty() && conn->sends_in_flight == 0 &&
      conn->streams.empty() && !conn->dead) {
    // Every response has been sent (completed); close from the executor after
    // this turn, not inside the completion that got us here.
    asio::post(ex_, [self = shared_from_this(), conn] { self->CloseConn(conn, Status(StatusCode::kUnavailable, "drained")); });
  }
}

void Server::Impl::Shutdown(std::chrono::milliseconds grace, asio::any_completion_handler<void()> handler) {
  shutdown_waiters_.emplace_back(std::move(handler));
  if (!shutting_down_) {
    shutting_down_ = true;
    RDMARPC_LOG(kInfo, "server", "event=shutdown connections=", conns_.size(), " calls_in_flight=",
                stats_.calls_in_flight);
    for (auto& l : listeners_) l->Close();
    for (auto conn : std::vector(conns_)) {
      conn->draining = true;
      SendControl(conn, rpc::FrameType::kGoaway, true);
    }
    grace_timer_.expires_after(grace);
    grace_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return;
      Status answer = UnavailableError("server shut down before the call finished");
      for (auto conn : std::vector(self->conns_)) {
        std::vector<Call*> calls;
        for (auto& [id, call] : conn->calls) calls.push_back(call);
        for (Call* call : calls) self->CancelCall(call, StatusCode::kUnavailable, &answer);
      }
      // A connection still open now never drained: its client does not read
      // (responses or the GOAWAY wait for send space or credits) or is gone
      // without a disconnect reaching us. The answers just queued get a short
      // linger, then every connection is closed so that shutdown completes.
      self->grace_timer_.expires_after(kShutdownLinger);
      self->grace_timer_.async_wait([self](boost::system::error_code linger_ec) {
        if (linger_ec) return;
        for (auto conn : std::vector(self->conns_)) {
          RDMARPC_LOG(kWarn, "server", "event=shutdown_force_close conn=", conn->id, " peer=", conn->peer,
                      " calls=", conn->calls.size(), " unsent_responses=", conn->pending.size());
          self->CloseConn(conn, UnavailableError("server shut down; the connection did not drain within the grace period"));
        }
      });
    });
  }
  MaybeFinishShutdown();
}

void Server::Impl::MaybeFinishShutdown() {
  if (!shutting_down_ || stats_.calls_in_flight != 0 || !conns_.empty() || shutdown_waiters_.empty()) return;
  grace_timer_.cancel();
  if (admin_) admin_->Close();  // its accept would keep the io_context running
  // Nothing is left to serve: parked worker coroutines would keep the
  // io_context running too (run() would never return after a shutdown).
  stopped_ = true;
  keepalive_timer_.cancel();
  ReleaseIdleWorkers();
  for (auto& w : std::exchange(shutdown_waiters_, {})) transport::PostCompletion(ex_, std::move(w));
}

void Server::Impl::Stop() {
  if (stopped_) return;
  stopped_ = true;
  shutting_down_ = true;
  grace_timer_.cancel();
  keepalive_timer_.cancel();
  for (auto& l : listeners_) l->Close();
  if (admin_) admin_->Close();
  for (auto conn : std::vector(conns_)) CloseConn(conn, UnavailableError("server stopped"));
  ReleaseIdleWorkers();
}

std::string Server::Impl::ServiceNames() const {
  std::vector<std::string> names;
  for (Service* s : services_) names.emplace_back(s->service_name());
  return absl::StrJoin(names, ", ");
}

AdminResponse Server::Impl::AdminPage(std::string_view path) const {
  if (path != "/metrics" && path != "/connections")
    return AdminResponse{404, "text/plain; charset=utf-8", "not found: try /metrics or /connections\n"};
  std::vector<AdminConnection> conns;
  conns.reserve(conns_.size());
  for (const auto& c : conns_)
    if (!c->dead) conns.push_back({c->id, c->peer, c->calls.size(), c->pending.size(), c->c->stats()});
  if (path == "/metrics")
    return AdminResponse{200, "text/plain; version=0.0.4; charset=utf-8", RenderPrometheus(metrics_, stats_, conns)};
  return AdminResponse{200, "application/json", RenderConnectionsJson(conns)};
}

// ---- Server -------------------------------------------------------------------

Server::Server(asio::any_io_executor ex, ServerOptions options)
    : impl_(std::make_shared<Impl>(std::move(ex), std::move(options))) {}

Server::~Server() {
  const auto& ex = impl_->executor();
  if (const auto* io = ex.target<asio::io_context::executor_type>(); io && io->running_in_this_thread()) {
    impl_->Stop();
    return;
  }
  asio::post(ex, [impl = impl_] { impl->Stop(); });
}

Status Server::AddService(Service& service) { return impl_->AddService(service); }
Status Server::Start() { return impl_->Start(); }
std::vector<std::string> Server::local_uris() const { return impl_->uris(); }
std::string Server::admin_uri() const { return impl_->admin_uri(); }
void Server::Shutdown(std::chrono::milliseconds grace, asio::any_completion_handler<void()> handler) {
  asio::dispatch(impl_->executor(), [impl = impl_, grace, h = std::move(handler)]() mutable {
    impl->Shutdown(grace, std::move(h));
  });
}
ServerStats Server::stats() const { return impl_->stats(); }
const ServerMetrics& Server::metrics() const { return impl_->metrics(); }

}  // namespace rdmarpc
