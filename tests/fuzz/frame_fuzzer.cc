// libFuzzer target: rpc::DecodeFrame (rpc/frame.h), the RPC frame decoder every
// received message goes through. Input: one message, as the transport
// delivers it.
//
// Invariants on a frame that decodes:
//  - the metadata and payload spans lie inside the input, back to back after
//    the 32-byte header, with the sizes the header gives;
//  - the header's fields are in range (type, status, call id, status only on
//    responses);
//  - ParseMetadata() yields at most kMaxMetadataEntries entries with non-empty
//    keys, whose wire size is the block's;
//  - the encoding is canonical: EncodeFrameHead() of the decoded header and
//    metadata, followed by the payload, gives back the input byte for byte,
//    and that decodes to the same fields.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "rpc/frame.h"
#include "tests/fuzz/fuzz_support.h"

namespace rdmarpc::fuzz {
namespace {

using rpc::DecodedFrame;
using rpc::FrameHeader;
using rpc::FrameType;
using rpc::Metadata;

std::string Encode(const FrameHeader& header, const Metadata& metadata, const std::string& payload) {
  FrameHeader h = header;
  h.metadata_length = static_cast<uint16_t>(rpc::MetadataWireSize(metadata));
  h.payload_length = static_cast<uint32_t>(payload.size());
  std::string out(rpc::kFrameHeaderSize + h.metadata_length, '\0');
  rpc::EncodeFrameHead(h, metadata, AsWritableBytes(out));
  return out + payload;
}

std::vector<Seed> Seeds() {
  std::vector<Seed> seeds;
  FrameHeader req{.type = FrameType::kRequest, .method_id = 0x3248'2f5c, .call_id = 1};
  seeds.push_back({"request-empty", Encode(req, {}, "")});
  seeds.push_back({"request-payload", Encode(req, {}, std::string("\x0a\x05hello", 7))});
  FrameHeader timed = req;
  timed.call_id = 0x0102'0304'0506'0708;
  timed.timeout_us = 250'000;
  seeds.push_back({"request-metadata-timeout",
                   Encode(timed, {{"authorization", "Bearer x"}, {"trace-id", ""}, {"k", "v"}}, "payload")});
  FrameHeader ok{.type = FrameType::kResponse, .call_id = 1};
  seeds.push_back({"response-ok", Encode(ok, {}, std::string("\x0a\x02hi", 4))});
  FrameHeader err{.type = FrameType::kResponse, .status = StatusCode::kDeadlineExceeded, .call_id = 9};
  seeds.push_back({"response-error", Encode(err, {}, "deadline of 5 ms passed")});
  seeds.push_back({"cancel", Encode(FrameHeader{.type = FrameType::kCancel, .call_id = 7}, {}, "")});
  seeds.push_back({"cancel_deadline", Encode(FrameHeader{.type = FrameType::kCancel,
                                                         .status = StatusCode::kDeadlineExceeded, .call_id = 7},
                                             {}, "")});
  seeds.push_back({"goaway", Encode(FrameHeader{.type = FrameType::kGoaway}, {}, "")});
  seeds.push_back({"ping", Encode(FrameHeader{.type = FrameType::kPing}, {}, "")});
  seeds.push_back({"pong", Encode(FrameHeader{.type = FrameType::kPong}, {}, "")});
  seeds.push_back({"stream-message", Encode(FrameHeader{.type = FrameType::kStreamMessage, .call_id = 3, .timeout_us = 17},
                                            {}, std::string("\x0a\x01x", 3))});
  seeds.push_back({"half-close", Encode(FrameHeader{.type = FrameType::kHalfClose, .call_id = 3}, {}, "")});
  seeds.push_back({"window", Encode(FrameHeader{.type = FrameType::kWindow, .method_id = 64, .call_id = 3}, {}, "")});
  seeds.push_back({"window-zero", Encode(FrameHeader{.type = FrameType::kWindow, .method_id = 0, .call_id = 3}, {}, "")});
  // Edge cases: the most metadata entries allowed, and one more; an empty key
  // (the encoder writes what it is given; the decoder must refuse it).
  Metadata many;
  for (size_t i = 0; i < rpc::kMaxMetadataEntries; ++i) many.emplace_back("k" + std::to_string(i), "");
  seeds.push_back({"metadata-64-entries", Encode(req, many, "")});
  many.emplace_back("one-too-many", "");
  seeds.push_back({"metadata-65-entries", Encode(req, many, "")});
  seeds.push_back({"metadata-empty-key", Encode(req, {{"", "v"}}, "")});
  // Lengths that disagree with the message: payload length lies, and a
  // metadata entry that runs past its block.
  std::string lie = Encode(req, {}, "abc");
  lie[12] = '\x40';
  seeds.push_back({"payload-length-lies", lie});
  std::string past = Encode(req, {{"key", "value"}}, "");
  past[rpc::kFrameHeaderSize + 2] = '\x7f';
  seeds.push_back({"metadata-entry-past-block", past});
  seeds.push_back({"header-only-31-bytes", Encode(req, {}, "").substr(0, 31)});
  return seeds;
}

}  // namespace
}  // namespace rdmarpc::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rdmarpc::fuzz::MaybeWriteSeeds(argc, argv, rdmarpc::fuzz::Seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmarpc;
  using namespace rdmarpc::fuzz;
  const std::span<const std::byte> input = AsBytes(data, size);
  rpc::DecodedFrame f;
  if (!rpc::DecodeFrame(input, f).ok()) return 0;

  const rpc::FrameHeader& h = f.header;
  FUZZ_CHECK(size >= rpc::kFrameHeaderSize, size);
  FUZZ_CHECK(Within(f.metadata, input) && Within(f.payload, input), "decoded spans outside the input");
  FUZZ_CHECK(f.metadata.data() == input.data() + rpc::kFrameHeaderSize, "metadata not right after the header");
  FUZZ_CHECK(f.metadata.size() == h.metadata_length, f.metadata.size(), " vs ", h.metadata_length);
  FUZZ_CHECK(f.payload.data() == f.metadata.data() + f.metadata.size(), "payload not right after the metadata");
  FUZZ_CHECK(f.payload.size() == h.payload_length, f.payload.size(), " vs ", h.payload_length);
  FUZZ_CHECK(rpc::kFrameHeaderSize + f.metadata.size() + f.payload.size() == size, "frame does not fill the message");
  const auto type = static_cast<uint8_t>(h.type);
  FUZZ_CHECK(type >= static_cast<uint8_t>(rpc::FrameType::kRequest) && type <= rpc::kMaxFrameType,
             "type ", type);
  FUZZ_CHECK(static_cast<uint8_t>(h.status) <= kMaxStatusCode, "status ", static_cast<int>(h.status));
  if (h.type == rpc::FrameType::kCancel)
    FUZZ_CHECK(h.status == StatusCode::kOk || h.status == StatusCode::kCancelled ||
                   h.status == StatusCode::kDeadlineExceeded,
               "cancel reason ", static_cast<int>(h.status), " accepted");
  else
    FUZZ_CHECK(h.type == rpc::FrameType::kResponse || h.status == StatusCode::kOk, "status on a non-response");
  if (h.type != rpc::FrameType::kGoaway && h.type != rpc::FrameType::kPing && h.type != rpc::FrameType::kPong)
    FUZZ_CHECK(h.call_id != 0, "call id 0 accepted");
  if (h.type == rpc::FrameType::kWindow)
    FUZZ_CHECK(h.method_id >= 1 && h.method_id <= rpc::kMaxWindowGrant, "window grant ", h.method_id, " accepted");
  if (h.type == rpc::FrameType::kWindow || h.type == rpc::FrameType::kHalfClose)
    FUZZ_CHECK(size == rpc::kFrameHeaderSize, "window/half-close with a body accepted");

  rpc::Metadata metadata;
  rpc::ParseMetadata(f.metadata, metadata);
  FUZZ_CHECK(metadata.size() <= rpc::kMaxMetadataEntries, metadata.size(), " entries");
  for (const auto& [key, value] : metadata) FUZZ_CHECK(!key.empty(), "empty metadata key accepted");
  FUZZ_CHECK(rpc::MetadataWireSize(metadata) == f.metadata.size(), "metadata entries do not fill the block");

  // Re-encode: canonical, so byte-identical, and it decodes to the same fields.
  std::string again(rpc::kFrameHeaderSize + f.metadata.size() + f.payload.size(), '\0');
  rpc::EncodeFrameHead(h, metadata, AsWritableBytes(again));
  if (!f.payload.empty())
    std::memcpy(again.data() + rpc::kFrameHeaderSize + f.metadata.size(), f.payload.data(), f.payload.size());
  FUZZ_CHECK(std::memcmp(again.data(), data, size) == 0, "re-encoded frame differs from the input");
  rpc::DecodedFrame g;
  const absl::Status st = rpc::DecodeFrame(AsBytes(again), g);
  FUZZ_CHECK(st.ok(), "re-encoded frame does not decode: ", st.ToString());
  FUZZ_CHECK(g.header.type == h.type && g.header.status == h.status && g.header.metadata_length == h.metadata_length &&
                 g.header.method_id == h.method_id && g.header.payload_length == h.payload_length &&
                 g.header.call_id == h.call_id && g.header.timeout_us == h.timeout_us,
             "re-decoded header differs");
  rpc::Metadata metadata2;
  rpc::ParseMetadata(g.metadata, metadata2);
  FUZZ_CHECK(metadata2 == metadata, "re-decoded metadata differs");
  return 0;
}
