// Streams: server-streaming, client-streaming and bidirectional methods.
//
// Server side: the generated handler gets a ServerWriter<Resp>,
// ServerReader<Req> or ServerReaderWriter<Resp, Req> that is valid while the
// handler runs; returning from the handler ends the stream with that status
// (after every message it wrote). Client side: the stub's async_M completes
// with (error_code, ClientReader<Resp> / ClientWriter<Req, Resp> /
// ClientReaderWriter<Req, Resp>) once the stream is open.
//
// Every operation takes any Asio completion token and completes with
// (error_code):
//  - async_read(msg): OK with the next message in order; asio::error::eof when
//    the peer ended its side cleanly (client: the server returned OK, after
//    every message it sent was read); otherwise the stream's status code
//    (ClientContext::status() has the message on the client).
//  - async_write(msg): OK once the message is handed to the transport. It
//    waits while the reader's window is full: a slow reader backpressures the
//    writer, it never makes the reader buffer without bound.
//  - async_writes_done(): half-close (the server's reads then end with eof).
//  - async_finish(): the final status (and, client-streaming, the response).
// Flow control: each reader grants a window of messages
// (ChannelOptions::stream_window, ServerOptions::stream_window,
// ClientContext::set_stream_window) and re-grants as it reads, so it holds at
// most `window` unread messages of at most max_message_size bytes each.
// Cancellation: a terminal/partial cancellation of a pending operation, or
// Cancel(), or dropping the client end before the stream ended, cancels the
// stream (the server's handler sees CANCELLED); the ClientContext's deadline
// ends it DEADLINE_EXCEEDED on both sides. At most one read and one finish may
// be pending at a time; writes queue in order.
//
// Threads: operations may be started from any thread (they hop to the
// channel's or server's executor); completions run on the handler's
// associated executor. The ClientContext must outlive the client end.
#pragma once

#include <memory>
#include <utility>

#include <boost/asio/async_result.hpp>

#include "rpc/stream_core.h"
#include "transport/handler_memory.h"

namespace rdmarpc {

namespace internal {

template <typename Token>
auto AsyncStreamWrite(const std::shared_ptr<StreamCore>& core, const google::protobuf::MessageLite& m, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [](auto handler, StreamCore* c, const google::protobuf::MessageLite* msg) {
        c->StartWrite(*msg, StreamHandler(transport::WithHandlerMemory(std::move(handler))));
      },
      token, core.get(), &m);
}
template <typename Token>
auto AsyncStreamRead(const std::shared_ptr<StreamCore>& core, google::protobuf::MessageLite& m, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [](auto handler, StreamCore* c, google::protobuf::MessageLite* msg) {
        c->StartRead(msg, StreamHandler(transport::WithHandlerMemory(std::move(handler))));
      },
      token, core.get(), &m);
}
template <typename Token>
auto AsyncStreamWritesDone(const std::shared_ptr<StreamCore>& core, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [](auto handler, StreamCore* c) { c->StartWritesDone(StreamHandler(transport::WithHandlerMemory(std::move(handler)))); },
      token, core.get());
}
template <typename Token>
auto AsyncStreamFinish(const std::shared_ptr<StreamCore>& core, google::protobuf::MessageLite* response, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [](auto handler, StreamCore* c, google::protobuf::MessageLite* r) {
        c->StartFinish(r, StreamHandler(transport::WithHandlerMemory(std::move(handler))));
      },
      token, core.get(), response);
}

// A client end: move-only; dropping it before the stream ended cancels it.
class ClientStreamHandle {
 public:
  ClientStreamHandle() = default;
  explicit ClientStreamHandle(std::shared_ptr<StreamCore> core) : core_(std::move(core)) {}
  ClientStreamHandle(ClientStreamHandle&&) noexcept = default;
  ClientStreamHandle& operator=(ClientStreamHandle&& o) noexcept {
    if (this != &o) {
      Drop();
      core_ = std::move(o.core_);
    }
    return *this;
  }
  ~ClientStreamHandle() { Drop(); }

  explicit operator bool() const { return core_ != nullptr; }
  // Ends the stream CANCELLED; the server's handler is cancelled.
  void Cancel() {
    if (core_) core_->StartCancel();
  }
  // On the channel's executor.
  StreamStats stats() const { return core_->stats(); }
  uint64_t last_sequence() const { return core_->last_sequence(); }
  const std::shared_ptr<StreamCore>& core() const { return core_; }

 private:
  void Drop() {
    if (core_) core_->StartCancel();  // nothing if it ended already
    core_.reset();
  }
  std::shared_ptr<StreamCore> core_;
};

}  // namespace internal

// ---- server ends (valid while the handler runs) ------------------------------------

template <typename W>
class ServerWriter {
 public:
  explicit ServerWriter(std::shared_ptr<internal::StreamCore> core) : core_(std::move(core)) {}
  template <typename Token>
  auto async_write(const W& message, Token&& token) {
    return internal::AsyncStreamWrite(core_, message, std::forward<Token>(token));
  }
  StreamStats stats() const { return core_->stats(); }
  // For rdmarpc::Publisher (rpc/fanout.h).
  const std::shared_ptr<internal::StreamCore>& core() const { return core_; }

 private:
  std::shared_ptr<internal::StreamCore> core_;
};

template <typename R>
class ServerReader {
 public:
  explicit ServerReader(std::shared_ptr<internal::StreamCore> core) : core_(std::move(core)) {}
  template <typename Token>
  auto async_read(R& message, Token&& token) {
    return internal::AsyncStreamRead(core_, message, std::forward<Token>(token));
  }
  uint64_t last_sequence() const { return core_->last_sequence(); }
  StreamStats stats() const { return core_->stats(); }

 private:
  std::shared_ptr<internal::StreamCore> core_;
};

template <typename W, typename R>
class ServerReaderWriter {
 public:
  explicit ServerReaderWriter(std::shared_ptr<internal::StreamCore> core) : core_(std::move(core)) {}
  template <typename Token>
  auto async_write(const W& message, Token&& token) {
    return internal::AsyncStreamWrite(core_, message, std::forward<Token>(token));
  }
  template <typename Token>
  auto async_read(R& message, Token&& token) {
    return internal::AsyncStreamRead(core_, message, std::forward<Token>(token));
  }
  uint64_t last_sequence() const { return core_->last_sequence(); }
  StreamStats stats() const { return core_->stats(); }
  const std::shared_ptr<internal::StreamCore>& core() const { return core_; }

 private:
  std::shared_ptr<internal::StreamCore> core_;
};

// ---- client ends -------------------------------------------------------------------

template <typename R>
class ClientReader : public internal::ClientStreamHandle {
 public:
  using ClientStreamHandle::ClientStreamHandle;
  template <typename Token>
  auto async_read(R& message, Token&& token) {
    return internal::AsyncStreamRead(core(), message, std::forward<Token>(token));
  }
};

template <typename W, typename Resp>
class ClientWriter : public internal::ClientStreamHandle {
 public:
  using ClientStreamHandle::ClientStreamHandle;
  template <typename Token>
  auto async_write(const W& message, Token&& token) {
    return internal::AsyncStreamWrite(core(), message, std::forward<Token>(token));
  }
  template <typename Token>
  auto async_writes_done(Token&& token) {
    return internal::AsyncStreamWritesDone(core(), std::forward<Token>(token));
  }
  // Half-closes if not yet done, then waits for the response and status.
  template <typename Token>
  auto async_finish(Resp& response, Token&& token) {
    return internal::AsyncStreamFinish(core(), &response, std::forward<Token>(token));
  }
};

template <typename W, typename R>
class ClientReaderWriter : public internal::ClientStreamHandle {
 public:
  using ClientStreamHandle::ClientStreamHandle;
  template <typename Token>
  auto async_write(const W& message, Token&& token) {
    return internal::AsyncStreamWrite(core(), message, std::forward<Token>(token));
  }
  template <typename Token>
  auto async_read(R& message, Token&& token) {
    return internal::AsyncStreamRead(core(), message, std::forward<Token>(token));
  }
  template <typename Token>
  auto async_writes_done(Token&& token) {
    return internal::AsyncStreamWritesDone(core(), std::forward<Token>(token));
  }
  template <typename Token>
  auto async_finish(Token&& token) {
    return internal::AsyncStreamFinish(core(), nullptr, std::forward<Token>(token));
  }
};

}  // namespace rdmarpc
