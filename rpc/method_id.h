// Stable method identifiers: the wire carries a 32-bit id, not a string.
//
// id = FNV-1a-32("package.Service/Method"). It depends only on the names in the
// .proto, so independently built clients and servers agree without a registry.
// Collisions are rejected by protoc-gen-rdmarpc within a file and by the server
// when services are registered together.
#pragma once

#include <cstdint>
#include <string_view>

namespace rdmarpc {

constexpr uint32_t MethodId(std::string_view full_name) noexcept {
  uint32_t h = 2166136261u;  // FNV offset basis
  for (char c : full_name) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;  // FNV prime
  }
  return h;
}

struct MethodInfo {
  std::string_view full_name;  // "package.Service/Method"
  uint32_t id;
  bool client_streaming;
  bool server_streaming;
};

}  // namespace rdmarpc
