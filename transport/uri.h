// Endpoint URIs: "rdma://host:port" and "tcp://host:port" ("[v6]:port" too).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::transport {

struct Uri {
  enum class Scheme { kRdma, kTcp };
  Scheme scheme = Scheme::kTcp;
  std::string host;  // Without brackets for IPv6.
  uint16_t port = 0;

  std::string ToString() const;
};

// Errors name the offending text and the accepted forms.
absl::StatusOr<Uri> ParseUri(absl::string_view text);

}  // namespace rdmarpc::transport
