// The server side of a generated service: the method table the Server
// dispatches on. Generated `X::Service` classes derive from this; users derive
// from those and override the handlers they serve (the others answer
// UNIMPLEMENTED).
#pragma once

#include <span>
#include <string_view>

#include <boost/asio/awaitable.hpp>
#include <google/protobuf/message_lite.h>

#include "rpc/context.h"
#include "rpc/method_id.h"
#include "rpc/status.h"

namespace rdmarpc {

namespace asio = boost::asio;

class Service {
 public:
  // Calls the handler for one unary call; request and response are the
  // method's types (the generated trampoline casts them back).
  using UnaryInvoker = asio::awaitable<Status> (*)(Service& service, ServerContext& context,
                                                   const google::protobuf::MessageLite& request,
                                                   google::protobuf::MessageLite& response);
  struct Method {
    MethodInfo info;
    const google::protobuf::MessageLite& (*request_prototype)();
    const google::protobuf::MessageLite& (*response_prototype)();
    // Null for streaming methods: the stream runtime is not part of this
    // release; the server answers them UNIMPLEMENTED.
    UnaryInvoker invoke;
  };

  virtual ~Service() = default;
  virtual std::string_view service_name() const = 0;
  virtual std::span<const Method> methods() const = 0;
};

}  // namespace rdmarpc
