// The RDMA transport's own frame header (below the RPC layer's frames).
//
// Every SEND carries one 16-byte little-endian header followed by its body:
//   DATA    body = a whole message (eager path)
//   RTS     "I have a `length`-byte message #cookie": asks for a grant
//   CTS     body = Grant: where to RDMA WRITE message #cookie
//   CREDIT  no body; only returns credits
// RDMA WRITE_WITH_IMM (imm = grant id) carries rendezvous payloads and has no
// header at all. Between peers that both offer kHelloImmData a DATA frame is a
// SEND_WITH_IMM of the body alone, its header packed into the 32-bit immediate
// (EncodeImmHeader): a 64-byte message is 64 bytes on the wire, not 80.
// Every field read from the wire is validated by Decode before
// anything uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "transport/common/auth.h"
#include "transport/common/little_endian.h"

namespace rdmarpc::rdma::wire {

namespace auth = transport::auth;

inline constexpr uint8_t kMagic = 0xD7;
inline constexpr uint8_t kVersion = 1;

enum class Type : uint8_t { kData = 1, kRts = 2, kCts = 3, kCredit = 4 };

struct Header {
  Type type = Type::kData;
  uint16_t data_credits = 0;  // RECVs for data frames the sender reposted since it last said so.
  uint8_t ctrl_credits = 0;   // Same, for RECVs consumed by CREDIT frames.
  uint32_t length = 0;        // DATA: body bytes. RTS: message bytes. CTS: granted bytes.
  uint32_t cookie = 0;        // RTS/CTS: the sender's message number (wraps).
};
inline constexpr size_t kHeaderSize = 16;

struct Grant {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t grant_id = 0;
};
inline constexpr size_t kGrantSize = 16;

// Connection parameters exchanged in rdma_cm private data (max 56 bytes on
// RC connect with IB CM, 196 on accept; we use 24, or 56 with an auth proof).
struct Hello {
  uint16_t recv_data = 0;      // RECVs the sender keeps posted for data frames.
  uint16_t recv_ctrl = 0;      // ... and for CREDIT frames.
  uint32_t recv_slot_bytes = 0;  // Bytes per receive slot, header included.
  uint64_t max_message = 0;    // Largest message it accepts.
  uint16_t flags = 0;          // kHello* bits; unknown bits are ignored.
};
inline constexpr size_t kHelloSize = 24;
// The connect's hello is followed by a client auth proof (auth::kProofBytes).
// Peers from before this flag ignore it and the bytes after the hello.
inline constexpr uint16_t kHelloAuthProof = 1;
inline constexpr size_t kHelloWithProofSize = kHelloSize + auth::kProofBytes;
// The sender accepts DATA frames whose header rides in the immediate
// (EncodeImmHeader); both peers must offer it before either sends one.
inline constexpr uint16_t kHelloImmData = 2;
static_assert(kHelloWithProofSize <= 56, "rdma_cm RC connect private data is 56 bytes at most");

void EncodeHeader(const Header& h, std::byte* out) noexcept;
void EncodeGrant(const Grant& g, std::byte* out) noexcept;
void EncodeHello(const Hello& h, std::byte* out) noexcept;

// Validates magic, version, type, and that the frame's length agrees with the
// bytes received (`frame` is what the RECV completion reported).
absl::StatusOr<Header> DecodeHeader(std::span<const std::byte> frame) noexcept;

// DecodeHeader's common case, inline: a DATA frame whose length is what
// arrived, decoded with no call and no StatusOr (~50 instructions a message
// less on the receive path). False for anything else, which DecodeHeader then
// judges. It accepts exactly the DATA frames DecodeHeader accepts, with the
// same header (tests/unit/rdma_protocol_test.cc, tests/fuzz/rdma_wire_fuzzer.cc).
inline bool DecodeDataHeader(std::span<const std::byte> frame, Header& h) noexcept {
  if (frame.size() < kHeaderSize) return false;
  // Bytes 0-7: magic, version|type, data credits (2), reserved (3), ctrl credits.
  const uint64_t w = wire_bytes::LoadLE<uint64_t>(frame.data());
  const uint32_t length = wire_bytes::LoadLE<uint32_t>(frame.data() + 8);
  constexpr uint64_t kFixed = 0x00FF'FFFF'0000'FFFFull;  // magic, version|type, reserved
  constexpr uint64_t kData = kMagic | uint64_t{(kVersion << 4) | static_cast<uint8_t>(Type::kData)} << 8;
  if ((w & kFixed) != kData || length != frame.size() - kHeaderSize) return false;
  h.type = Type::kData;
  h.data_credits = static_cast<uint16_t>(w >> 16);
  h.ctrl_credits = static_cast<uint8_t>(w >> 56);
  h.length = length;
  h.cookie = wire_bytes::LoadLE<uint32_t>(frame.data() + 12);
  return true;
}
// A DATA frame's header as a SEND_WITH_IMM immediate (host order; the verbs
// field is big-endian): bits 0-3 type (kData), 4-7 version, 8-15 ctrl
// credits, 16-31 data credits. The body's length is the SEND's byte count,
// so it needs no field; DATA frames carry no cookie.
inline uint32_t EncodeImmHeader(uint16_t data_credits, uint8_t ctrl_credits) noexcept {
  return uint32_t{static_cast<uint8_t>(Type::kData)} | uint32_t{kVersion} << 4 | uint32_t{ctrl_credits} << 8 |
         uint32_t{data_credits} << 16;
}
// False unless `imm` is a DATA header of our version; `byte_len` is what the
// RECV completion reported, the body's length.
inline bool DecodeImmHeader(uint32_t imm, uint32_t byte_len, Header& h) noexcept {
  if ((imm & 0xFF) != (uint32_t{static_cast<uint8_t>(Type::kData)} | uint32_t{kVersion} << 4)) return false;
  h.type = Type::kData;
  h.ctrl_credits = static_cast<uint8_t>(imm >> 8);
  h.data_credits = static_cast<uint16_t>(imm >> 16);
  h.length = byte_len;
  h.cookie = 0;
  return true;
}
absl::StatusOr<Grant> DecodeGrant(std::span<const std::byte> body) noexcept;
absl::StatusOr<Hello> DecodeHello(std::span<const std::byte> data) noexcept;
// The auth proof after a hello that has kHelloAuthProof; nullopt without the
// flag; FAILED_PRECONDITION when the flag is set but the bytes are missing.
absl::StatusOr<std::optional<auth::Proof>> DecodeHelloProof(std::span<const std::byte> data) noexcept;

}  // namespace rdmarpc::rdma::wire
