#include "transport/rdma/wire.h"

#include "absl/strings/str_cat.h"
#include "transport/common/little_endian.h"

namespace rdmarpc::rdma::wire {
namespace {

template <typename T>
void Put(std::byte*& p, T v) noexcept {
  wire_bytes::StoreLE(p, v);
  p += sizeof(T);
}
template <typename T>
T Get(const std::byte*& p) noexcept {
  const T v = wire_bytes::LoadLE<T>(p);
  p += sizeof(T);
  return v;
}

}  // namespace

void EncodeHeader(const Header& h, std::byte* out) noexcept {
  Put<uint8_t>(out, kMagic);
  Put<uint8_t>(out, static_cast<uint8_t>((kVersion << 4) | static_cast<uint8_t>(h.type)));
  Put<uint16_t>(out, h.data_credits);
  Put<uint32_t>(out, (static_cast<uint32_t>(h.ctrl_credits) << 24) | 0);  // Low 24 bits reserved.
  Put<uint32_t>(out, h.length);
  Put<uint32_t>(out, static_cast<uint32_t>(h.cookie));
}

absl::StatusOr<Header> DecodeHeader(std::span<const std::byte> frame) noexcept {
  if (frame.size() < kHeaderSize)
    return absl::DataLossError(absl::StrCat("frame of ", frame.size(), " bytes is shorter than the ",
                                            kHeaderSize, "-byte header"));
  const std::byte* p = frame.data();
  if (Get<uint8_t>(p) != kMagic) return absl::DataLossError("bad frame magic");
  const uint8_t vt = Get<uint8_t>(p);
  if ((vt >> 4) != kVersion)
    return absl::FailedPreconditionError(absl::StrCat("peer speaks frame version ", vt >> 4,
                                                      ", we speak ", kVersion));
  Header h;
  const uint8_t type = vt & 0x0F;
  if (type < 1 || type > 4) return absl::DataLossError(absl::StrCat("unknown frame type ", type));
  h.type = static_cast<Type>(type);
  h.data_credits = Get<uint16_t>(p);
  const uint32_t word = Get<uint32_t>(p);
  if ((word & 0xFFFFFF) != 0) return absl::DataLossError("reserved header bits set");
  h.ctrl_credits = static_cast<uint8_t>(word >> 24);
  h.length = Get<uint32_t>(p);
  h.cookie = Get<uint32_t>(p);
  const size_t body = frame.size() - kHeaderSize;
  switch (h.type) {
    case Type::kData:
      if (h.length != body)
        return absl::DataLossError(absl::StrCat("DATA frame says ", h.length, " bytes but carries ", body));
      break;
    case Type::kCts:
      if (body != kGrantSize) return absl::DataLossError("CTS frame without a grant");
      break;
    case Type::kRts:
    case Type::kCredit:
      if (body != 0) return absl::DataLossError("RTS/CREDIT frame with a body");
      break;
  }
  return h;
}

void EncodeGrant(const Grant& g, std::byte* out) noexcept {
  Put<uint64_t>(out, g.addr);
  Put<uint32_t>(out, g.rkey);
  Put<uint32_t>(out, g.grant_id);
}

absl::StatusOr<Grant> DecodeGrant(std::span<const std::byte> body) noexcept {
  if (body.size() != kGrantSize) return absl::DataLossError("grant of the wrong size");
  const std::byte* p = body.data();
  Grant g;
  g.addr = Get<uint64_t>(p);
  g.rkey = Get<uint32_t>(p);
  g.grant_id = Get<uint32_t>(p);
  return g;
}

void EncodeHello(const Hello& h, std::byte* out) noexcept {
  Put<uint8_t>(out, kMagic);
  Put<uint8_t>(out, kVersion);
  Put<uint16_t>(out, h.recv_data);
  Put<uint16_t>(out, h.recv_ctrl);
  Put<uint16_t>(out, h.flags);
  Put<uint32_t>(out, h.recv_slot_bytes);
  Put<uint32_t>(out, 0);
  Put<uint64_t>(out, h.max_message);
}

absl::StatusOr<Hello> DecodeHello(std::span<const std::byte> data) noexcept {
  // rdma_cm may pad private data with zeros: accept trailing bytes.
  if (data.size() < kHelloSize)
    return absl::FailedPreconditionError(absl::StrCat(
        "peer's connection parameters are ", data.size(), " bytes, expected ", kHelloSize,
        " (is the peer an rdmarpc endpoint?)"));
  const std::byte* p = data.data();
  if (Get<uint8_t>(p) != kMagic)
    return absl::FailedPreconditionError("peer is not an rdmarpc endpoint (bad hello magic)");
  if (uint8_t v = Get<uint8_t>(p); v != kVersion)
    return absl::FailedPreconditionError(absl::StrCat("peer speaks transport version ", v, ", we speak ", kVersion));
  Hello h;
  h.recv_data = Get<uint16_t>(p);
  h.recv_ctrl = Get<uint16_t>(p);
  h.flags = Get<uint16_t>(p);
  h.recv_slot_bytes = Get<uint32_t>(p);
  (void)Get<uint32_t>(p);
  h.max_message = Get<uint64_t>(p);
  if (h.recv_data < 2 || h.recv_ctrl < 3)
    return absl::FailedPreconditionError("peer posts too few receives to make progress");
  if (h.recv_slot_bytes < kHeaderSize + kGrantSize)
    return absl::FailedPreconditionError("peer's receive slots cannot hold a control frame");
  return h;
}

absl::StatusOr<std::optional<auth::Proof>> DecodeHelloProof(std::span<const std::byte> data) noexcept {
  auto hello = DecodeHello(data);
  if (!hello.ok()) return hello.status();
  if ((hello->flags & kHelloAuthProof) == 0) return std::optional<auth::Proof>();
  if (data.size() < kHelloWithProofSize)
    return absl::FailedPreconditionError(absl::StrCat("peer's hello announces an auth proof but is only ",
                                                      data.size(), " bytes"));
  auth::Proof proof;
  std::memcpy(proof.data(), data.data() + kHelloSize, auth::kProofBytes);
  return std::optional<auth::Proof>(proof);
}

}  // namespace rdmarpc::rdma::wire
