// What a generated Stub hands to a channel, and what it gets back.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/system/error_code.hpp>
#include <google/protobuf/message_lite.h>

#include "rpc/context.h"
#include "rpc/method_id.h"
#include "rpc/status.h"
#include "rpc/stream_core.h"
#include "transport/transport.h"

namespace rdmarpc {

namespace asio = boost::asio;

// The serialised response of a completed call: a view of the transport's
// receive buffer (no copy), or bytes the channel owns (mocks). Dropping it
// returns the buffer; it is parsed and dropped on the channel's executor.
class ResponsePayload {
 public:
  ResponsePayload() = default;
  ResponsePayload(transport::Message message, std::span<const std::byte> bytes)
      : message_(std::move(message)), bytes_(bytes) {}
  // Owned bytes sit behind a pointer: a payload moves several times a call,
  // and a std::string member would be moved (SSO copy and reset) each time
  // for a case only mocks use.
  explicit ResponsePayload(std::string owned)
      : owned_(std::make_unique<std::string>(std::move(owned))),
        bytes_(std::as_bytes(std::span<const char>(owned_->data(), owned_->size()))) {}
  ResponsePayload(ResponsePayload&& o) noexcept
      : message_(std::move(o.message_)), owned_(std::move(o.owned_)), bytes_(std::exchange(o.bytes_, {})) {}
  ResponsePayload& operator=(ResponsePayload&& o) noexcept {
    if (this != &o) {
      message_ = std::move(o.message_);
      owned_ = std::move(o.owned_);
      bytes_ = std::exchange(o.bytes_, {});
    }
    return *this;
  }

  std::span<const std::byte> bytes() const { return bytes_; }
  // Parses into `out`; false if the bytes are not a valid `out`.
  bool ParseTo(google::protobuf::MessageLite& out) const {
    return out.ParseFromArray(bytes_.data(), static_cast<int>(bytes_.size()));
  }
  void Reset() {
    message_.Reset();
    owned_.reset();
    bytes_ = {};
  }

 private:
  transport::Message message_;
  std::unique_ptr<std::string> owned_;  // mocks' bytes; bytes_ points into it
  std::span<const std::byte> bytes_;
};

// Invoked exactly once per call, on the channel's executor and never inside
// StartCall(); the generated stub's wrapper parses the payload there and then
// dispatches the user's handler to its associated executor. The wrapper's
// associated cancellation slot is the user's.
using CallHandler = asio::any_completion_handler<void(boost::system::error_code, ResponsePayload)>;

using StreamOpenHandler =
    asio::any_completion_handler<void(boost::system::error_code, std::shared_ptr<internal::StreamCore>)>;

// What a Stub talks to: the Channel, or a generated MockStub.
class ChannelInterface {
 public:
  virtual ~ChannelInterface() = default;
  // Starts a unary call. `context` must stay alive until the handler has run;
  // `request` only until StartCall returns. Sets context.status() before the
  // handler runs.
  virtual void StartCall(ClientContext& context, const MethodInfo& method,
                         const google::protobuf::MessageLite& request, CallHandler handler) = 0;
  // The executor handlers run on when they have no associated executor.
  virtual asio::any_io_executor get_executor() const = 0;
  // Opens a stream (rpc/stream.h); `request` is the request of a
  // server-streaming method, else null. The handler gets the stream's core
  // once the REQUEST is on its way, or an error (UNAVAILABLE: no connection).
  // Default: UNIMPLEMENTED (mocks do not stream).
  virtual void StartStream(ClientContext& context, const MethodInfo& method,
                           const google::protobuf::MessageLite* request, StreamOpenHandler handler);
};

}  // namespace rdmarpc
