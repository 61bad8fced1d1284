// Shared-secret authentication of a connecting client, used by both
// transports' handshakes (transport/tcp: the stream's first bytes;
// transport/rdma: the rdma_cm connect private data).
//
// Scheme: the client sends a fresh random 16-byte nonce and the first 16
// bytes of HMAC-SHA256(token, "rdmarpc-auth-v1" || nonce); the token itself
// never goes on the wire. The listener recomputes the MAC and compares in
// constant time before it creates any connection state: a refused client gets
// no QP, no receive buffers, no grant, and none of its frames is read.
//
// What it is not: it authenticates the client only, it neither encrypts nor
// integrity-protects the traffic that follows, and an on-path attacker who
// records one connect request can replay it (rdma_cm's connect carries one
// client->server message, so there is no room for a server challenge without
// a round trip in the data path). It keeps unauthorised clients on a shared
// fabric out; it is not TLS.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc::transport::auth {

inline constexpr size_t kNonceBytes = 16;
// 128 bits of MAC: forging one is 2^128 guesses, and a guess costs a connect.
inline constexpr size_t kMacBytes = 16;
inline constexpr size_t kProofBytes = kNonceBytes + kMacBytes;
using Proof = std::array<std::byte, kProofBytes>;  // nonce || mac

// A proof of `token` (non-empty) with a fresh nonce from the OS's CSPRNG.
// INTERNAL if the random generator fails.
absl::StatusOr<Proof> MakeProof(std::string_view token);

// The listener's decision, sent back to a refused client (one byte on the
// wire: keep the values).
enum class Verdict : uint8_t {
  kOk = 0,
  kTokenRequired = 1,  // The listener has a token, the client sent no proof.
  kTokenMismatch = 2,  // The proof was made with another token.
};

// `token` empty: the listener requires nothing and every client passes (a
// client's proof is then ignored). `proof` null: the client sent none.
Verdict Check(std::string_view token, const Proof* proof);

// "server requires an auth token", "auth token mismatch".
const char* VerdictReason(Verdict verdict);

// What a refused client reports: UNAUTHENTICATED naming `server` and the
// reason; OK for kOk.
absl::Status RefusedStatus(Verdict verdict, std::string_view server);

}  // namespace rdmarpc::transport::auth
