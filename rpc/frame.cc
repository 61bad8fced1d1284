#include "rpc/frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/common/little_endian.h"

namespace rdmarpc::rpc {
namespace {

using wire_bytes::LoadLE;
using wire_bytes::StoreLE;
void Put16(std::byte* p, uint16_t v) noexcept { StoreLE(p, v); }
void Put32(std::byte* p, uint32_t v) noexcept { StoreLE(p, v); }
void Put64(std::byte* p, uint64_t v) noexcept { StoreLE(p, v); }
uint16_t Get16(const std::byte* p) noexcept { return LoadLE<uint16_t>(p); }
uint32_t Get32(const std::byte* p) noexcept { return LoadLE<uint32_t>(p); }
uint64_t Get64(const std::byte* p) noexcept { return LoadLE<uint64_t>(p); }

absl::Status Bad(std::string what) { return absl::InvalidArgumentError(absl::StrCat("bad rpc frame: ", what)); }

}  // namespace

size_t MetadataWireSize(const Metadata& metadata) noexcept {
  size_t n = 0;
  for (const auto& [k, v] : metadata) n += 4 + k.size() + v.size();
  return n;
}

void EncodeFrameHead(const FrameHeader& h, const Metadata& metadata, std::span<std::byte> out) noexcept {
  std::byte* p = out.data();
  Put16(p, kFrameMagic);
  p[2] = std::byte(kFrameVersion);
  p[3] = std::byte(static_cast<uint8_t>(h.type));
  p[4] = std::byte(0);
  p[5] = std::byte(static_cast<uint8_t>(h.status));
  Put16(p + 6, h.metadata_length);
  Put32(p + 8, h.method_id);
  Put32(p + 12, h.payload_length);
  Put64(p + 16, h.call_id);
  Put64(p + 24, h.timeout_us);
  p += kFrameHeaderSize;
  for (const auto& [k, v] : metadata) {
    Put16(p, static_cast<uint16_t>(k.size()));
    Put16(p + 2, static_cast<uint16_t>(v.size()));
    std::memcpy(p + 4, k.data(), k.size());
    std::memcpy(p + 4 + k.size(), v.data(), v.size());
    p += 4 + k.size() + v.size();
  }
}

namespace {

absl::Status DecodeFrameChecked(std::span<const std::byte> bytes, DecodedFrame& out);

}  // namespace

// The frames of a unary call, a request with an OK status or a response,
// without metadata, are decoded here with no call (the full check, below,
// saves and restores registers for its error messages: ~40 instructions a
// frame). Everything this accepts the full check accepts too, with the same
// result; everything else goes to it.
absl::Status DecodeFrame(std::span<const std::byte> bytes, DecodedFrame& out) {
  if (bytes.size() >= kFrameHeaderSize) {
    const std::byte* p = bytes.data();
    // magic (2) version (1) type (1) flags (1) status (1) metadata length (2)
    const uint64_t w = Get64(p);
    const auto type = static_cast<uint8_t>(w >> 24);
    const auto status = static_cast<uint8_t>(w >> 40);
    const uint32_t payload = Get32(p + 12);
    const uint64_t call_id = Get64(p + 16);
    const bool request = type == static_cast<uint8_t>(FrameType::kRequest) && status == 0;
    const bool response = type == static_cast<uint8_t>(FrameType::kResponse) && status <= kMaxStatusCode;
    if ((w & 0xFFFF'00FF'00FF'FFFFull) == (uint64_t{kFrameMagic} | uint64_t{kFrameVersion} << 16) &&
        (request || response) && call_id != 0 && kFrameHeaderSize + uint64_t{payload} == bytes.size()) {
      FrameHeader& h = out.header;
      h.type = static_cast<FrameType>(type);
      h.status = static_cast<StatusCode>(status);
      h.metadata_length = 0;
      h.method_id = Get32(p + 8);
      h.payload_length = payload;
      h.call_id = call_id;
      h.timeout_us = Get64(p + 24);
      out.metadata = bytes.subspan(kFrameHeaderSize, 0);
      out.payload = bytes.subspan(kFrameHeaderSize, payload);
      return absl::OkStatus();
    }
  }
  return DecodeFrameChecked(bytes, out);
}

namespace {

absl::Status DecodeFrameChecked(std::span<const std::byte> bytes, DecodedFrame& out) {
  if (bytes.size() < kFrameHeaderSize)
    return Bad(absl::StrCat(bytes.size(), " bytes, shorter than the ", kFrameHeaderSize, "-byte header"));
  const std::byte* p = bytes.data();
  if (uint16_t magic = Get16(p); magic != kFrameMagic)
    return Bad(absl::StrCat("magic 0x", absl::Hex(magic), ", expected 0x", absl::Hex(kFrameMagic),
                            " (is the peer an rdmarpc endpoint?)"));
  if (auto version = std::to_integer<uint8_t>(p[2]); version != kFrameVersion)
    return Bad(absl::StrCat("version ", version, ", this build speaks version ", kFrameVersion));
  auto type = std::to_integer<uint8_t>(p[3]);
  if (type < static_cast<uint8_t>(FrameType::kRequest) || type > kMaxFrameType)
    return Bad(absl::StrCat("unknown frame type ", type));
  if (auto flags = std::to_integer<uint8_t>(p[4]); flags != 0) return Bad(absl::StrCat("reserved flags 0x", absl::Hex(flags)));
  auto status = std::to_integer<uint8_t>(p[5]);
  if (status > kMaxStatusCode) return Bad(absl::StrCat("status code ", status, " out of range"));
  FrameHeader& h = out.header;
  h.type = static_cast<FrameType>(type);
  h.status = static_cast<StatusCode>(status);
  h.metadata_length = Get16(p + 6);
  h.method_id = Get32(p + 8);
  h.payload_length = Get32(p + 12);
  h.call_id = Get64(p + 16);
  h.timeout_us = Get64(p + 24);
  const uint64_t expected = kFrameHeaderSize + uint64_t{h.metadata_length} + uint64_t{h.payload_length};
  if (expected != bytes.size())
    return Bad(absl::StrCat("header says ", expected, " bytes (metadata ", h.metadata_length, ", payload ",
                            h.payload_length, "), message has ", bytes.size()));
  const bool needs_call = h.type != FrameType::kGoaway && h.type != FrameType::kPing && h.type != FrameType::kPong;
  if (needs_call && h.call_id == 0) return Bad("call id 0");
  if (h.type == FrameType::kWindow && (h.method_id == 0 || h.method_id > kMaxWindowGrant))
    return Bad(absl::StrCat("window grant of ", h.method_id, " messages (1..", kMaxWindowGrant, ")"));
  if ((h.type == FrameType::kWindow || h.type == FrameType::kHalfClose) && (h.payload_length | h.metadata_length) != 0)
    return Bad("window/half-close frame with a body");
  // A CANCEL may say why: CANCELLED or DEADLINE_EXCEEDED (the client's timer).
  if (h.type == FrameType::kCancel && h.status != StatusCode::kOk && h.status != StatusCode::kCancelled &&
      h.status != StatusCode::kDeadlineExceeded)
    return Bad(absl::StrCat("cancel reason ", internal::Sv(StatusCodeName(h.status)), " (CANCELLED or DEADLINE_EXCEEDED)"));
  if (h.type != FrameType::kResponse && h.type != FrameType::kCancel && h.status != StatusCode::kOk)
    return Bad("status set on a frame that is not a response or cancel");
  // Metadata: whole entries, exactly filling the block.
  out.metadata = bytes.subspan(kFrameHeaderSize, h.metadata_length);
  size_t off = 0, entries = 0;
  while (off < out.metadata.size()) {
    if (out.metadata.size() - off < 4) return Bad("truncated metadata entry header");
    size_t k = Get16(out.metadata.data() + off), v = Get16(out.metadata.data() + off + 2);
    if (out.metadata.size() - off - 4 < k + v) return Bad("metadata entry runs past its block");
    if (k == 0) return Bad("metadata entry with an empty key");
    off += 4 + k + v;
    if (++entries > kMaxMetadataEntries)
      return Bad(absl::StrCat("more than ", kMaxMetadataEntries, " metadata entries"));
  }
  out.payload = bytes.subspan(kFrameHeaderSize + h.metadata_length, h.payload_length);
  return absl::OkStatus();
}

}  // namespace

void ParseMetadata(std::span<const std::byte> block, Metadata& out) {
  size_t off = 0;
  while (off + 4 <= block.size()) {
    size_t k = Get16(block.data() + off), v = Get16(block.data() + off + 2);
    const char* base = reinterpret_cast<const char*>(block.data() + off + 4);
    out.emplace_back(std::string(base, k), std::string(base + k, v));
    off += 4 + k + v;
  }
}

}  // namespace rdmarpc::rpc
