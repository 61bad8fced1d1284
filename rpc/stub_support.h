// What generated stubs expand to: async_initiate over a ChannelInterface,
// with a wrapper that parses the response on the channel's executor (where the
// receive buffer must be released) and then hands (error_code, Resp) to the
// user's handler on the handler's associated executor (at once when that is
// the executor already running). A handler without an associated allocator
// gets rdmarpc's per-thread handler memory (transport/handler_memory.h), so a
// steady stream of calls allocates nothing.
#pragma once

#include <memory>
#include <utility>

#include <boost/asio/append.hpp>
#include <boost/asio/associator.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/dispatch.hpp>

#include "absl/strings/str_cat.h"
#include "rpc/call.h"
#include "rpc/status.h"
#include "rpc/stream.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"

namespace rdmarpc::internal {

// Resp by value: completion signature void(error_code, Resp).
template <typename Resp, typename Handler>
class UnaryValueCompletion {
 public:
  UnaryValueCompletion(Handler handler, ClientContext* ctx, asio::any_io_executor fallback)
      : handler_(std::move(handler)), ctx_(ctx), fallback_(std::move(fallback)) {}

  void operator()(boost::system::error_code ec, ResponsePayload payload) {
    Resp response;
    if (!ec && !payload.ParseTo(response)) {
      ctx_->SetResult(InternalError(absl::StrCat("response does not parse as ", response.GetTypeName())));
      ec = make_error_code(StatusCode::kInternal);
    }
    payload.Reset();
    transport::DispatchCompletion(fallback_, std::move(handler_), ec, std::move(response));
  }

  Handler handler_;

 private:
  ClientContext* ctx_;
  asio::any_io_executor fallback_;
};

// Into the caller's Resp: completion signature void(error_code). Reusing one
// response object across calls keeps its string capacity: no allocation.
template <typename Handler>
class UnaryIntoCompletion {
 public:
  UnaryIntoCompletion(Handler handler, ClientContext* ctx, google::protobuf::MessageLite* out,
                      asio::any_io_executor fallback)
      : handler_(std::move(handler)), ctx_(ctx), out_(out), fallback_(std::move(fallback)) {}

  void operator()(boost::system::error_code ec, ResponsePayload payload) {
    if (!ec && !payload.ParseTo(*out_)) {
      ctx_->SetResult(InternalError(absl::StrCat("response does not parse as ", out_->GetTypeName())));
      ec = make_error_code(StatusCode::kInternal);
    }
    payload.Reset();
    transport::DispatchCompletion(fallback_, std::move(handler_), ec);
  }

  Handler handler_;

 private:
  ClientContext* ctx_;
  google::protobuf::MessageLite* out_;
  asio::any_io_executor fallback_;
};

template <typename Resp, typename Req, typename Token>
auto AsyncUnary(std::shared_ptr<ChannelInterface> channel, ClientContext& ctx, const MethodInfo& method,
                const Req& request, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code, Resp)>(
      [](auto handler, std::shared_ptr<ChannelInterface> ch, ClientContext* c, const MethodInfo* m, const Req* r) {
        auto ex = ch->get_executor();
        auto h = transport::WithHandlerMemory(std::move(handler));
        using H = decltype(h);
        ch->StartCall(*c, *m, *r, CallHandler(UnaryValueCompletion<Resp, H>(std::move(h), c, std::move(ex))));
      },
      token, std::move(channel), &ctx, &method, &request);
}

template <typename Resp, typename Req, typename Token>
auto AsyncUnaryInto(std::shared_ptr<ChannelInterface> channel, ClientContext& ctx, const MethodInfo& method,
                    const Req& request, Resp& response, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [](auto handler, std::shared_ptr<ChannelInterface> ch, ClientContext* c, const MethodInfo* m, const Req* r,
         Resp* out) {
        auto ex = ch->get_executor();
        auto h = transport::WithHandlerMemory(std::move(handler));
        using H = decltype(h);
        ch->StartCall(*c, *m, *r, CallHandler(UnaryIntoCompletion<H>(std::move(h), c, out, std::move(ex))));
      },
      token, std::move(channel), &ctx, &method, &request, &response);
}

}  // namespace rdmarpc::internal

// The wrappers carry the user's handler's associated executor, allocator and
// cancellation slot (as Asio's own wrappers do).
template <template <typename, typename> class Associator, typename Resp, typename Handler, typename Default>
struct boost::asio::associator<Associator, rdmarpc::internal::UnaryValueCompletion<Resp, Handler>, Default>
    : Associator<Handler, Default> {
  static typename Associator<Handler, Default>::type get(
      const rdmarpc::internal::UnaryValueCompletion<Resp, Handler>& h) noexcept {
    return Associator<Handler, Default>::get(h.handler_);
  }
  static auto get(const rdmarpc::internal::UnaryValueCompletion<Resp, Handler>& h, const Default& d) noexcept
      -> decltype(Associator<Handler, Default>::get(h.handler_, d)) {
    return Associator<Handler, Default>::get(h.handler_, d);
  }
};

template <template <typename, typename> class Associator, typename Handler, typename Default>
struct boost::asio::associator<Associator, rdmarpc::internal::UnaryIntoCompletion<Handler>, Default>
    : Associator<Handler, Default> {
  static typename Associator<Handler, Default>::type get(
      const rdmarpc::internal::UnaryIntoCompletion<Handler>& h) noexcept {
    return Associator<Handler, Default>::get(h.handler_);
  }
  static auto get(const rdmarpc::internal::UnaryIntoCompletion<Handler>& h, const Default& d) noexcept
      -> decltype(Associator<Handler, Default>::get(h.handler_, d)) {
    return Associator<Handler, Default>::get(h.handler_, d);
  }
};

namespace rdmarpc::internal {

// Completes a stream open with the typed client end (End wraps the core).
template <typename End, typename Handler>
class StreamOpenCompletion {
 public:
  StreamOpenCompletion(Handler handler, asio::any_io_executor fallback)
      : handler_(std::move(handler)), fallback_(std::move(fallback)) {}
  void operator()(boost::system::error_code ec, std::shared_ptr<StreamCore> core) {
    transport::DispatchCompletion(fallback_, std::move(handler_), ec, End(std::move(core)));
  }
  Handler handler_;

 private:
  asio::any_io_executor fallback_;
};

template <typename End, typename Token>
auto AsyncOpenStream(std::shared_ptr<ChannelInterface> channel, ClientContext& ctx, const MethodInfo& method,
                     const google::protobuf::MessageLite* request, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code, End)>(
      [](auto handler, std::shared_ptr<ChannelInterface> ch, ClientContext* c, const MethodInfo* m,
         const google::protobuf::MessageLite* r) {
        auto ex = ch->get_executor();
        using H = decltype(handler);
        ch->StartStream(*c, *m, r, StreamOpenHandler(StreamOpenCompletion<End, H>(std::move(handler), std::move(ex))));
      },
      token, std::move(channel), &ctx, &method, request);
}

}  // namespace rdmarpc::internal

template <template <typename, typename> class Associator, typename End, typename Handler, typename Default>
struct boost::asio::associator<Associator, rdmarpc::internal::StreamOpenCompletion<End, Handler>, Default>
    : Associator<Handler, Default> {
  static typename Associator<Handler, Default>::type get(
      const rdmarpc::internal::StreamOpenCompletion<End, Handler>& h) noexcept {
    return Associator<Handler, Default>::get(h.handler_);
  }
  static auto get(const rdmarpc::internal::StreamOpenCompletion<End, Handler>& h, const Default& d) noexcept
      -> decltype(Associator<Handler, Default>::get(h.handler_, d)) {
    return Associator<Handler, Default>::get(h.handler_, d);
  }
};
