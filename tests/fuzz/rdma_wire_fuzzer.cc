// libFuzzer target: the RDMA transport's wire decoders (transport/rdma/wire.h):
// DecodeHello (the rdma_cm private-data handshake), DecodeHeader (every SEND's
// 16-byte header), DecodeGrant (a CTS body) and DecodeImmHeader (a DATA
// header in a SEND_WITH_IMM's immediate). Every input goes through all four;
// none needs a device.
//
// Invariants:
//  - Header: a decoded header re-encodes to the input's first 16 bytes exactly
//    (magic, version and reserved bits are fixed, so the encoding is
//    canonical); the body size agrees with the type (DATA: length, CTS: one
//    grant that decodes, RTS/CREDIT: none). The inline DATA decode
//    (DecodeDataHeader) takes exactly the frames DecodeHeader decodes as
//    DATA, with the same fields.
//  - Grant: decodes exactly when the body is 16 bytes, and re-encodes to it.
//  - Immediate: the input's first 4 bytes as an immediate decode exactly when
//    their low byte is DATA of our version, re-encode to the same 32 bits,
//    and take the RECV's byte count as the body's length.
//  - Hello: decodes only from >= 24 bytes, the limits it promises hold, and it
//    re-encodes to the input's first 24 bytes with the reserved fields zeroed.
//  - From fields: the input read as field values encodes and decodes back to
//    the same values (header, grant, hello).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "transport/rdma/wire.h"
#include "tests/fuzz/fuzz_support.h"

namespace rdmarpc::fuzz {
namespace {

namespace wire = rdma::wire;

std::string EncodeHeader(const wire::Header& h, const std::string& body = "") {
  std::string out(wire::kHeaderSize, '\0');
  wire::EncodeHeader(h, reinterpret_cast<std::byte*>(out.data()));
  return out + body;
}
std::string EncodeGrant(const wire::Grant& g) {
  std::string out(wire::kGrantSize, '\0');
  wire::EncodeGrant(g, reinterpret_cast<std::byte*>(out.data()));
  return out;
}
std::string EncodeHello(const wire::Hello& h) {
  std::string out(wire::kHelloSize, '\0');
  wire::EncodeHello(h, reinterpret_cast<std::byte*>(out.data()));
  return out;
}

std::vector<Seed> Seeds() {
  std::vector<Seed> seeds;
  // What the transport sends with its defaults-like values.
  const wire::Hello hello{.recv_data = 64, .recv_ctrl = 8, .recv_slot_bytes = 4096 + 256 + 16, .max_message = 64 << 20};
  seeds.push_back({"hello", EncodeHello(hello)});
  seeds.push_back({"hello-padded-56", EncodeHello(hello) + std::string(56 - wire::kHelloSize, '\0')});
  seeds.push_back({"hello-minimum", EncodeHello({.recv_data = 2, .recv_ctrl = 3, .recv_slot_bytes = 32})});
  seeds.push_back({"hello-too-few-recvs", EncodeHello({.recv_data = 1, .recv_ctrl = 3, .recv_slot_bytes = 32})});
  seeds.push_back({"hello-short", EncodeHello(hello).substr(0, 23)});
  const std::string body = "an eager message";
  seeds.push_back({"data", EncodeHeader({.type = wire::Type::kData, .data_credits = 3, .ctrl_credits = 1,
                                         .length = static_cast<uint32_t>(body.size())},
                                        body)});
  seeds.push_back({"data-empty", EncodeHeader({.type = wire::Type::kData})});
  seeds.push_back({"rts", EncodeHeader({.type = wire::Type::kRts, .length = 1 << 20, .cookie = 41})});
  const wire::Grant grant{.addr = 0x7f00'1234'5000, .rkey = 0x1a2b, .grant_id = 5};
  seeds.push_back({"cts", EncodeHeader({.type = wire::Type::kCts, .length = 1 << 20, .cookie = 41}, EncodeGrant(grant))});
  seeds.push_back({"credit", EncodeHeader({.type = wire::Type::kCredit, .data_credits = 16, .ctrl_credits = 2})});
  seeds.push_back({"grant", EncodeGrant(grant)});
  const uint32_t imm = wire::EncodeImmHeader(3, 1);  // little-endian, as Reader reads it
  seeds.push_back({"immediate", std::string{char(imm & 0xFF), char(imm >> 8 & 0xFF), char(imm >> 16 & 0xFF),
                                            char(imm >> 24), '\x40', '\0', '\0', '\0'}});
  std::string reserved = EncodeHeader({.type = wire::Type::kCredit});
  reserved[4] = '\x01';
  seeds.push_back({"header-reserved-bits", reserved});
  std::string lying = EncodeHeader({.type = wire::Type::kData, .length = 100}, "short");
  seeds.push_back({"data-length-lies", lying});
  return seeds;
}

// Reads little-endian values from the input, zero past its end.
struct Reader {
  std::span<const std::byte> in;
  size_t pos = 0;
  template <typename T>
  T Get() {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i, ++pos)
      if (pos < in.size()) v |= static_cast<T>(static_cast<T>(std::to_integer<uint8_t>(in[pos])) << (8 * i));
    return v;
  }
};

void CheckHeader(std::span<const std::byte> input) {
  absl::StatusOr<wire::Header> h = wire::DecodeHeader(input);
  // The receive path's inline DATA decode agrees with the full check.
  wire::Header fast;
  const bool took = wire::DecodeDataHeader(input, fast);
  FUZZ_CHECK(took == (h.ok() && h->type == wire::Type::kData), "inline DATA decode took ", took);
  if (took)
    FUZZ_CHECK(fast.data_credits == h->data_credits && fast.ctrl_credits == h->ctrl_credits &&
                   fast.length == h->length && fast.cookie == h->cookie,
               "inline DATA decode differs");
  if (!h.ok()) return;
  FUZZ_CHECK(input.size() >= wire::kHeaderSize, input.size());
  const size_t body = input.size() - wire::kHeaderSize;
  switch (h->type) {
    case wire::Type::kData:
      FUZZ_CHECK(h->length == body, "DATA length ", h->length, " body ", body);
      break;
    case wire::Type::kCts: {
      FUZZ_CHECK(body == wire::kGrantSize, "CTS body ", body);
      FUZZ_CHECK(wire::DecodeGrant(input.subspan(wire::kHeaderSize)).ok(), "CTS grant does not decode");
      break;
    }
    case wire::Type::kRts:
    case wire::Type::kCredit:
      FUZZ_CHECK(body == 0, "RTS/CREDIT body ", body);
      break;
    default:
      FUZZ_CHECK(false, "type ", static_cast<int>(h->type), " out of range");
  }
  std::string again = EncodeHeader(*h);
  FUZZ_CHECK(std::memcmp(again.data(), input.data(), wire::kHeaderSize) == 0, "re-encoded header differs");
}

void CheckImmediate(std::span<const std::byte> input) {
  Reader r{input};
  const uint32_t imm = r.Get<uint32_t>();
  const uint32_t byte_len = r.Get<uint32_t>();
  wire::Header h;
  const bool took = wire::DecodeImmHeader(imm, byte_len, h);
  FUZZ_CHECK(took == ((imm & 0xFF) == wire::EncodeImmHeader(0, 0)), "immediate ", imm, " decoded ", took);
  if (!took) return;
  FUZZ_CHECK(h.type == wire::Type::kData && h.length == byte_len && h.cookie == 0, "immediate header fields");
  FUZZ_CHECK(wire::EncodeImmHeader(h.data_credits, h.ctrl_credits) == imm, "re-encoded immediate differs");
}

void CheckGrant(std::span<const std::byte> input) {
  absl::StatusOr<wire::Grant> g = wire::DecodeGrant(input);
  FUZZ_CHECK(g.ok() == (input.size() == wire::kGrantSize), "grant of ", input.size(), " bytes: ", g.status().ToString());
  if (!g.ok()) return;
  std::string again = EncodeGrant(*g);
  FUZZ_CHECK(std::memcmp(again.data(), input.data(), wire::kGrantSize) == 0, "re-encoded grant differs");
}

void CheckHello(std::span<const std::byte> input) {
  absl::StatusOr<wire::Hello> h = wire::DecodeHello(input);
  if (!h.ok()) return;
  FUZZ_CHECK(input.size() >= wire::kHelloSize, input.size());
  FUZZ_CHECK(h->recv_data >= 2 && h->recv_ctrl >= 3, "hello promises too few receives");
  FUZZ_CHECK(h->recv_slot_bytes >= wire::kHeaderSize + wire::kGrantSize, "hello slots too small");
  std::string expected(reinterpret_cast<const char*>(input.data()), wire::kHelloSize);
  std::memset(expected.data() + 12, 0, 4);  // reserved u32 (bytes 6-7 are the flags: they round-trip)
  FUZZ_CHECK(EncodeHello(*h) == expected, "re-encoded hello differs");
  // The auth proof after it: present exactly when the flag says so and the bytes are there.
  auto proof = wire::DecodeHelloProof(input);
  if ((h->flags & wire::kHelloAuthProof) == 0) {
    FUZZ_CHECK(proof.ok() && !proof->has_value(), "a proof without the flag");
  } else {
    FUZZ_CHECK(proof.ok() == (input.size() >= wire::kHelloWithProofSize), "proof of a ", input.size(),
               "-byte hello: ", proof.status().ToString());
  }
}

// The input as field values: Encode then Decode gives them back.
void CheckRoundTrips(std::span<const std::byte> input) {
  Reader r{input};
  wire::Header h;
  h.type = static_cast<wire::Type>(1 + r.Get<uint8_t>() % 4);
  h.data_credits = r.Get<uint16_t>();
  h.ctrl_credits = r.Get<uint8_t>();
  h.length = r.Get<uint32_t>();
  h.cookie = r.Get<uint32_t>();
  wire::Grant g;
  g.addr = r.Get<uint64_t>();
  g.rkey = r.Get<uint32_t>();
  g.grant_id = r.Get<uint32_t>();
  std::string body;
  if (h.type == wire::Type::kData) {
    h.length %= 64;
    body.assign(h.length, 'x');
  } else if (h.type == wire::Type::kCts) {
    body = EncodeGrant(g);
  }
  const std::string frame = EncodeHeader(h, body);
  absl::StatusOr<wire::Header> d = wire::DecodeHeader(AsBytes(frame));
  FUZZ_CHECK(d.ok(), "encoded header does not decode: ", d.status().ToString());
  FUZZ_CHECK(d->type == h.type && d->data_credits == h.data_credits && d->ctrl_credits == h.ctrl_credits &&
                 d->length == h.length && d->cookie == h.cookie,
             "header round trip differs");
  absl::StatusOr<wire::Grant> dg = wire::DecodeGrant(AsBytes(EncodeGrant(g)));
  FUZZ_CHECK(dg.ok() && dg->addr == g.addr && dg->rkey == g.rkey && dg->grant_id == g.grant_id, "grant round trip differs");

  wire::Hello hello;
  hello.recv_data = r.Get<uint16_t>();
  hello.recv_ctrl = r.Get<uint16_t>();
  hello.recv_slot_bytes = r.Get<uint32_t>();
  hello.max_message = r.Get<uint64_t>();
  absl::StatusOr<wire::Hello> dh = wire::DecodeHello(AsBytes(EncodeHello(hello)));
  const bool valid = hello.recv_data >= 2 && hello.recv_ctrl >= 3 && hello.recv_slot_bytes >= wire::kHeaderSize + wire::kGrantSize;
  FUZZ_CHECK(dh.ok() == valid, "hello validity: ", dh.status().ToString());
  if (dh.ok())
    FUZZ_CHECK(dh->recv_data == hello.recv_data && dh->recv_ctrl == hello.recv_ctrl &&
                   dh->recv_slot_bytes == hello.recv_slot_bytes && dh->max_message == hello.max_message,
               "hello round trip differs");
}

}  // namespace
}  // namespace rdmarpc::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rdmarpc::fuzz::MaybeWriteSeeds(argc, argv, rdmarpc::fuzz::Seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmarpc::fuzz;
  const std::span<const std::byte> input = AsBytes(data, size);
  CheckHello(input);
  CheckHeader(input);
  CheckGrant(input);
  CheckImmediate(input);
  CheckRoundTrips(input);
  return 0;
}
