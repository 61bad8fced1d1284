// The RPC frame: what one transport message carries. Versioned, fixed
// little-endian layout, every field from the wire validated by DecodeFrame()
// before anything uses it (fuzzed in tests/fuzz).
//
//   offset size field
//   0      2    magic 0x5252 ("RR")
//   2      1    version (kFrameVersion)
//   3      1    type (FrameType)
//   4      1    flags (reserved, must be 0)
//   5      1    status (StatusCode; RESPONSE only, else 0)
//   6      2    metadata length M
//   8      4    method id (REQUEST); messages granted (WINDOW); else 0
//               (STREAM_MESSAGE, HALF_CLOSE and WINDOW name their stream by call id)
//   12     4    payload length P
//   16     8    call id (non-zero for REQUEST/RESPONSE/CANCEL)
//   24     8    timeout in microseconds, relative to receipt (REQUEST; 0 = none);
//               the sender's sequence number (STREAM_MESSAGE)
//   32     M    metadata: entries {u16 key length, u16 value length, key, value}
//   32+M   P    payload: the serialised protobuf (REQUEST/RESPONSE with OK,
//               STREAM_MESSAGE), or the status message (RESPONSE with an error)
//
// Streams (rpc/stream.h) are calls too: a REQUEST opens one (its payload is
// the request of a server-streaming method, empty otherwise), STREAM_MESSAGEs
// flow both ways within the credits the receiver granted by WINDOW, the client
// ends its side with HALF_CLOSE, and the server's RESPONSE ends the stream (its
// payload is the response of a client-streaming method).
//
// The message's length must be exactly 32 + M + P. Deadlines travel as a
// relative timeout, so the two hosts' clocks need not agree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "rpc/status.h"

namespace rdmarpc::rpc {

inline constexpr uint16_t kFrameMagic = 0x5252;
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderSize = 32;
inline constexpr size_t kMaxMetadataEntries = 64;

enum class FrameType : uint8_t {
  kRequest = 1,
  kResponse = 2,
  kCancel = 3,   // client -> server: abandon call id; status = why (CANCELLED or DEADLINE_EXCEEDED)
  kGoaway = 4,   // server -> client: no new calls on this connection
  kPing = 5,
  kPong = 6,
  kStreamMessage = 7,  // one message on stream `call_id`; timeout field = sequence number
  kHalfClose = 8,      // client -> server: no more messages from the client on `call_id`
  kWindow = 9,         // the receiver of `call_id` allows `method_id` more messages
};
inline constexpr uint8_t kMaxFrameType = 9;
// The reason a CANCEL frame carries, and the code the server ends the call
// with: DEADLINE_EXCEEDED when the client's deadline passed, CANCELLED for
// anything else (both ends map through this one function).
constexpr StatusCode CancelReason(StatusCode why) {
  return why == StatusCode::kDeadlineExceeded ? StatusCode::kDeadlineExceeded : StatusCode::kCancelled;
}

// At most this many messages granted by one WINDOW frame.
inline constexpr uint32_t kMaxWindowGrant = 1u << 20;

struct FrameHeader {
  FrameType type = FrameType::kRequest;
  StatusCode status = StatusCode::kOk;
  uint16_t metadata_length = 0;
  uint32_t method_id = 0;
  uint32_t payload_length = 0;
  uint64_t call_id = 0;
  uint64_t timeout_us = 0;
};

using MetadataEntry = std::pair<std::string, std::string>;
using Metadata = std::vector<MetadataEntry>;

// Bytes the metadata block takes on the wire.
size_t MetadataWireSize(const Metadata& metadata) noexcept;

// Writes header and metadata into out[0, kFrameHeaderSize + M). `out` must be
// at least that large; the payload goes after it.
void EncodeFrameHead(const FrameHeader& header, const Metadata& metadata, std::span<std::byte> out) noexcept;

struct DecodedFrame {
  FrameHeader header;
  std::span<const std::byte> metadata;  // raw block, validated
  std::span<const std::byte> payload;
};

// Validates and decodes `bytes`. Errors (INVALID_ARGUMENT) name the field and
// the value found: bad magic, unsupported version, unknown type, non-zero
// flags, lengths that disagree with the message size, malformed metadata,
// call id 0 where one is needed, status out of range.
absl::Status DecodeFrame(std::span<const std::byte> bytes, DecodedFrame& out);

// Parses a validated metadata block into `out` (appends).
void ParseMetadata(std::span<const std::byte> block, Metadata& out);

}  // namespace rdmarpc::rpc
