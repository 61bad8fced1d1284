#include "transport/transport.h"

#include <cstring>

#include "transport/completion.h"

namespace rdmarpc::transport {

void Connection::SendCopy(std::span<const std::byte> bytes, SendHandler handler) {
  auto buffer = Prepare(bytes.size());
  if (!buffer.ok()) {
    PostCompletion(get_executor(), std::move(handler), buffer.status());
    return;
  }
  if (!bytes.empty()) std::memcpy(buffer->data().data(), bytes.data(), bytes.size());
  Send(std::move(*buffer), std::move(handler));
}

}  // namespace rdmarpc::transport
