#include "transport/common/auth.h"

#include <cstring>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::auth {
namespace {

// Domain separation: a MAC made here is useless to any other protocol that
// happens to use the same secret, and a future scheme changes the label.
constexpr std::string_view kLabel = "rdmarpc-auth-v1";

// The first kMacBytes of HMAC-SHA256(token, kLabel || nonce). False only if
// libcrypto fails.
bool Mac(std::string_view token, const std::byte* nonce, std::byte* out) {
  unsigned char message[kLabel.size() + kNonceBytes];
  std::memcpy(message, kLabel.data(), kLabel.size());
  std::memcpy(message + kLabel.size(), nonce, kNonceBytes);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), message, sizeof message, digest,
           &digest_len) == nullptr ||
      digest_len < kMacBytes)
    return false;
  std::memcpy(out, digest, kMacBytes);
  OPENSSL_cleanse(digest, sizeof digest);
  return true;
}

}  // namespace

absl::StatusOr<Proof> MakeProof(std::string_view token) {
  Proof proof{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(proof.data()), kNonceBytes) != 1)
    return absl::InternalError("auth: the random generator failed to make a nonce");
  if (!Mac(token, proof.data(), proof.data() + kNonceBytes))
    return absl::InternalError("auth: HMAC-SHA256 failed");
  return proof;
}

Verdict Check(std::string_view token, const Proof* proof) {
  if (token.empty()) return Verdict::kOk;
  if (proof == nullptr) return Verdict::kTokenRequired;
  std::byte want[kMacBytes];
  if (!Mac(token, proof->data(), want)) return Verdict::kTokenMismatch;  // fail closed
  // Constant time: how many leading bytes matched must not leak.
  return CRYPTO_memcmp(want, proof->data() + kNonceBytes, kMacBytes) == 0 ? Verdict::kOk
                                                                          : Verdict::kTokenMismatch;
}

const char* VerdictReason(Verdict verdict) {
  switch (verdict) {
    case Verdict::kOk:
      return "authenticated";
    case Verdict::kTokenRequired:
      return "server requires an auth token";
    case Verdict::kTokenMismatch:
      return "auth token mismatch";
  }
  return "unknown auth verdict";
}

absl::Status RefusedStatus(Verdict verdict, std::string_view server) {
  if (verdict == Verdict::kOk) return absl::OkStatus();
  return absl::UnauthenticatedError(
      absl::StrCat(std::string(server), " refused the connection: ", VerdictReason(verdict)));
}

}  // namespace rdmarpc::transport::auth
