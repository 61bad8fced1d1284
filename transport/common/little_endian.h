#pragma once

// Fixed-width integers in little-endian byte order, as every rdmarpc wire
// format carries them. One unaligned load or store on little-endian hosts (the
// byte-at-a-time loops these replace cost ~200 instructions per RPC frame).

#include <bit>
#include <cstddef>
#include <cstring>
#include <type_traits>

namespace rdmarpc::wire_bytes {

template <typename T>
constexpr T ToLittle(T v) noexcept {
  static_assert(std::is_unsigned_v<T>);
  if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xff));
    return r;
  } else {
    return v;
  }
}

template <typename T>
inline void StoreLE(std::byte* p, T v) noexcept {
  v = ToLittle(v);
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
inline T LoadLE(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return ToLittle(v);
}

}  // namespace rdmarpc::wire_bytes
