// Minimal structured logging: one line per event, `key=value` fields, to stderr.
// Silent below the configured level; the fast path never formats a line unless
// its level is enabled. The level is per process, read once from RDMARPC_LOG
// (error|warn|info|debug), default warn. Configuration only, no state that
// affects behaviour, so it is not one of the "globals for devices or pools".
#pragma once

#include "absl/strings/string_view.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// Current threshold; lines above it are dropped before formatting.
Level Threshold() noexcept;
void SetThreshold(Level level) noexcept;
// Writes one complete line atomically (a single write(2)).
void Emit(Level level, absl::string_view component, absl::string_view message) noexcept;

inline bool Enabled(Level level) noexcept { return level <= Threshold(); }

}  // namespace rdmarpc::log

#define RDMARPC_LOG(level, component, ...)                                          \
  do {                                                                              \
    if (::rdmarpc::log::Enabled(::rdmarpc::log::Level::level))                      \
      ::rdmarpc::log::Emit(::rdmarpc::log::Level::level, component,                 \
                           ::absl::StrCat(__VA_ARGS__));                            \
  } while (0)
