#include "transport/common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace rdmarpc::log {
namespace {

Level FromEnv() noexcept {
  const char* v = std::getenv("RDMARPC_LOG");
  if (v == nullptr) return Level::kWarn;
  if (std::strcmp(v, "error") == 0) return Level::kError;
  if (std::strcmp(v, "info") == 0) return Level::kInfo;
  if (std::strcmp(v, "debug") == 0) return Level::kDebug;
  return Level::kWarn;
}

std::atomic<int>& ThresholdCell() noexcept {
  static std::atomic<int> cell{static_cast<int>(FromEnv())};
  return cell;
}

constexpr const char* kNames[] = {"error", "warn", "info", "debug"};

}  // namespace

Level Threshold() noexcept {
  return static_cast<Level>(ThresholdCell().load(std::memory_order_relaxed));
}

void SetThreshold(Level level) noexcept {
  ThresholdCell().store(static_cast<int>(level), std::memory_order_relaxed);
}

void Emit(Level level, absl::string_view component, absl::string_view message) noexcept {
  try {
    std::string line = absl::StrCat("rdmarpc level=", kNames[static_cast<int>(level)],
                                    " component=", component, " ", message, "\n");
    // One write so concurrent lines do not interleave; a short write to stderr is ignored.
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
  } catch (...) {
    // Logging must never take the process down (allocation failure while formatting).
  }
}

}  // namespace rdmarpc::log
