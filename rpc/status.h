// RPC status: canonical codes (the gRPC/absl numbering, so numbers on the wire
// and in logs mean what people already know), a message, conversions to and
// from absl::Status, and an error category for completion signatures.
//
// Completion handlers get a boost::system::error_code (asio::error_code) whose
// category is rdmarpc::rpc_category(): asio::use_awaitable and use_future turn
// it into an exception, as_tuple hands it over, and it converts to
// std::error_code (Boost.System categories convert to std::error_category).
// The full Status, with its message, is on the ClientContext of the call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <boost/system/error_code.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rdmarpc {

enum class StatusCode : uint8_t {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};
inline constexpr uint8_t kMaxStatusCode = 16;

// "OK", "CANCELLED", ... ; "UNKNOWN_CODE" for anything outside the range.
std::string_view StatusCodeName(StatusCode code) noexcept;

// The message lives on the heap, and only when there is one: an OK status (or
// an error without text) is a code and a null pointer, so moving one along a
// call's path costs a pointer, not a std::string (~40 instructions a move,
// five moves a call). Errors pay one more allocation.
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message)
      : code_(code), message_(message.empty() ? nullptr : std::make_unique<std::string>(std::move(message))) {}
  Status(const Status& other) : code_(other.code_), message_(CopyMessage(other)) {}
  Status& operator=(const Status& other) {
    if (this != &other) {
      message_ = CopyMessage(other);
      code_ = other.code_;
    }
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }
  bool ok() const noexcept { return code_ == StatusCode::kOk; }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_ ? *message_ : EmptyMessage(); }
  // "DEADLINE_EXCEEDED: deadline of 5 ms passed" / "OK".
  std::string ToString() const;

  absl::Status ToAbsl() const;
  static Status FromAbsl(const absl::Status& status);

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message() == b.message();
  }

 private:
  static std::unique_ptr<std::string> CopyMessage(const Status& s) {
    return s.message_ ? std::make_unique<std::string>(*s.message_) : nullptr;
  }
  static const std::string& EmptyMessage() noexcept;

  StatusCode code_ = StatusCode::kOk;
  std::unique_ptr<std::string> message_;  // null: no message
};

// Shorthands.
inline Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status DeadlineExceededError(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status UnimplementedError(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

// The category of rdmarpc status codes (value = StatusCode number).
const boost::system::error_category& rpc_category() noexcept;
// OK is the empty error_code, as Asio reports success: every completed call
// passes one, and building it with a category costs a call and a virtual
// failed() (~30 instructions a call, bench/cpu_per_call).
inline boost::system::error_code make_error_code(StatusCode code) noexcept {
  if (code == StatusCode::kOk) return {};
  return boost::system::error_code(static_cast<int>(code), rpc_category());
}
// Code of an error_code from a completion: its value if it is of rpc_category(),
// CANCELLED for asio's operation_aborted, UNKNOWN otherwise.
StatusCode ToStatusCode(const boost::system::error_code& ec) noexcept;

namespace internal {
// Debian's abseil (20220623) has its own string_view: StrCat needs this.
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }
}  // namespace internal

}  // namespace rdmarpc

template <>
struct boost::system::is_error_code_enum<rdmarpc::StatusCode> : std::true_type {};
