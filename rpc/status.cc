#include "rpc/status.h"

#include <boost/asio/error.hpp>

#include "absl/strings/str_cat.h"

namespace rdmarpc {
namespace {

constexpr std::string_view kNames[] = {
    "OK",        "CANCELLED",          "UNKNOWN",        "INVALID_ARGUMENT",    "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS",     "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",       "UNIMPLEMENTED",  "INTERNAL",            "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED",
};
static_assert(std::size(kNames) == kMaxStatusCode + 1);

// Boost.System's category base has a protected non-virtual destructor by
// design (categories are never deleted through a base pointer).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"
class RpcCategory final : public boost::system::error_category {
 public:
  // A fixed id makes the category compare equal across shared objects.
  constexpr RpcCategory() noexcept : error_category(0x7264'6d61'7270'6301ULL) {}
  const char* name() const noexcept override { return "rdmarpc"; }
  std::string message(int ev) const override {
    return std::string(StatusCodeName(static_cast<StatusCode>(ev)));
  }
};
#pragma GCC diagnostic pop

}  // namespace

std::string_view StatusCodeName(StatusCode code) noexcept {
  auto i = static_cast<size_t>(code);
  return i <= kMaxStatusCode ? kNames[i] : std::string_view("UNKNOWN_CODE");
}

const std::string& Status::EmptyMessage() noexcept {
  static const std::string empty;
  return empty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message();
  return out;
}

absl::Status Status::ToAbsl() const {
  // The numbering is the same by construction (both are the canonical codes).
  return absl::Status(static_cast<absl::StatusCode>(code_), message());
}

Status Status::FromAbsl(const absl::Status& status) {
  auto raw = static_cast<int>(status.code());
  if (raw < 0 || raw > kMaxStatusCode) return Status(StatusCode::kUnknown, std::string(status.message()));
  return Status(static_cast<StatusCode>(raw), std::string(status.message()));
}

const boost::system::error_category& rpc_category() noexcept {
  static constexpr RpcCategory category;
  return category;
}

StatusCode ToStatusCode(const boost::system::error_code& ec) noexcept {
  if (!ec) return StatusCode::kOk;
  if (ec.category() == rpc_category()) return static_cast<StatusCode>(ec.value());
  if (ec == boost::asio::error::operation_aborted) return StatusCode::kCancelled;
  return StatusCode::kUnknown;
}

}  // namespace rdmarpc
