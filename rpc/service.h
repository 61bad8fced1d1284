// The server side of a generated service: the method table the Server
// dispatches on. Generated `X::Service` classes derive from this; users derive
// from those and override the handlers they serve (the others answer
// UNIMPLEMENTED).
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string_view>

#include <boost/asio/awaitable.hpp>
#include <google/protobuf/message_lite.h>

#include "rpc/context.h"
#include "rpc/method_id.h"
#include "rpc/status.h"
#include "rpc/stream_core.h"

namespace rdmarpc {

namespace asio = boost::asio;

class Service {
 public:
  // Calls the handler for one unary call; request and response are the
  // method's types (the generated trampoline casts them back).
  using UnaryInvoker = asio::awaitable<Status> (*)(Service& service, ServerContext& context,
                                                   const google::protobuf::MessageLite& request,
                                                   google::protobuf::MessageLite& response);
  // Calls the handler of a streaming method: `request` is parsed (server
  // streaming), `response` is answered (client streaming), the stream carries
  // the rest (the generated trampoline wraps it in the typed end).
  using StreamInvoker = asio::awaitable<Status> (*)(Service& service, ServerContext& context,
                                                    const google::protobuf::MessageLite& request,
                                                    google::protobuf::MessageLite& response,
                                                    std::shared_ptr<internal::StreamCore> stream);
  // The unary fast path: a Status answers the call inline; std::nullopt
  // runs the coroutine (`invoke`) for it.
  using InlineInvoker = std::optional<Status> (*)(Service& service, ServerContext& context,
                                                  const google::protobuf::MessageLite& request,
                                                  google::protobuf::MessageLite& response);
  struct Method {
    MethodInfo info;
    const google::protobuf::MessageLite& (*request_prototype)();
    const google::protobuf::MessageLite& (*response_prototype)();
    UnaryInvoker invoke;         // unary methods, else null
    StreamInvoker invoke_stream;  // streaming methods, else null
    InlineInvoker invoke_inline;  // unary methods (tried before invoke), else null
  };

  virtual ~Service() = default;
  virtual std::string_view service_name() const = 0;
  virtual std::span<const Method> methods() const = 0;
};

}  // namespace rdmarpc
