// Server metrics: per-method call counts by status code and a latency
// histogram in fixed microsecond buckets. One registry per Server (no
// globals); exported by the admin endpoint (rpc/admin.h) in Prometheus text
// format.
//
// Threads: everything here runs on the server's executor (recording and
// reading alike), so counters are plain integers: no lock, no atomic RMW.
// Entries are created at AddService() and never move (pointers stay valid for
// the registry's life), so recording a call is a few increments: no lookup,
// no allocation.
#pragma once

#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>

#include "rpc/method_id.h"
#include "rpc/status.h"

namespace rdmarpc {

// Upper bounds (inclusive, µs) of the latency buckets: 1-2-5 per decade from
// 1 µs (below what a loopback RDMA call takes) to 10 s (past any sensible
// deadline); one more bucket (+Inf) takes the rest. Fixed, so histograms from
// different servers and builds add up.
inline constexpr std::array<uint64_t, 22> kLatencyBucketBoundsUs = {
    1,      2,      5,      10,      20,      50,      100,       200,       500,       1'000,     2'000,
    5'000,  10'000, 20'000, 50'000,  100'000, 200'000, 500'000,   1'000'000, 2'000'000, 5'000'000, 10'000'000};

class LatencyHistogram {
 public:
  static constexpr size_t kBuckets = kLatencyBucketBoundsUs.size() + 1;  // + Inf

  // The bucket of `us`: the first whose bound is >= us (kBuckets - 1: +Inf).
  // A walk from the first bound of us's power of two takes at most one step
  // (consecutive bounds are at least twice apart: one, at most, falls inside a
  // doubling), so recording costs
  // the same whatever the latency; a walk from 1 us cost ~4 instructions a
  // bucket (~30 a call at the 200 us of a call under callgrind).
  static size_t BucketOf(uint64_t us) noexcept {
    size_t i = kFirstCandidate[std::bit_width(us)];
    while (i < kLatencyBucketBoundsUs.size() && us > kLatencyBucketBoundsUs[i]) ++i;
    return i;
  }

  void Record(uint64_t us) noexcept {
    ++counts_[BucketOf(us)];
    sum_us_ += us;
    ++count_;
  }
  // Per bucket, not cumulative; the last is +Inf.
  const std::array<uint64_t, kBuckets>& counts() const noexcept { return counts_; }
  uint64_t sum_us() const noexcept { return sum_us_; }
  uint64_t count() const noexcept { return count_; }

 private:
  // Per bit width w of a value (w = 0 for 0): the first bucket whose bound
  // reaches the smallest value of that width, 2^(w-1).
  static constexpr std::array<uint8_t, 65> kFirstCandidate = [] {
    std::array<uint8_t, 65> t{};
    for (size_t w = 0; w < t.size(); ++w) {
      const uint64_t low = w == 0 ? 0 : uint64_t{1} << (w - 1);
      size_t i = 0;
      while (i < kLatencyBucketBoundsUs.size() && low > kLatencyBucketBoundsUs[i]) ++i;
      t[w] = static_cast<uint8_t>(i);
    }
    return t;
  }();

  std::array<uint64_t, kBuckets> counts_{};
  uint64_t sum_us_ = 0;
  uint64_t count_ = 0;
};

// One served unary method.
struct MethodMetrics {
  explicit MethodMetrics(const MethodInfo& m) : info(m) {}
  MethodInfo info;  // full_name points into the generated method table
  // Calls answered (or abandoned: client cancel, disconnect), by final code.
  std::array<uint64_t, kMaxStatusCode + 1> calls_by_code{};
  // From receipt of the request to the handler's return (or the early answer).
  LatencyHistogram latency;

  void Record(StatusCode code, std::chrono::steady_clock::duration elapsed) noexcept {
    const auto c = static_cast<size_t>(code);
    ++calls_by_code[c <= kMaxStatusCode ? c : static_cast<size_t>(StatusCode::kUnknown)];
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(elapsed).count();
    latency.Record(us < 0 ? 0 : static_cast<uint64_t>(us));
  }
  uint64_t calls() const noexcept {
    uint64_t n = 0;
    for (uint64_t c : calls_by_code) n += c;
    return n;
  }
};

class ServerMetrics {
 public:
  ServerMetrics() = default;
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // At AddService(): the entry the server records into for this method. The
  // pointer stays valid as long as the registry.
  MethodMetrics* AddMethod(const MethodInfo& info) { return &methods_.emplace_back(info); }
  // In registration order.
  const std::deque<MethodMetrics>& methods() const noexcept { return methods_; }
  // Null if the method is not registered.
  const MethodMetrics* Find(std::string_view full_name) const noexcept;

  // Appends rdmarpc_server_calls_total and
  // rdmarpc_server_call_duration_microseconds (with HELP/TYPE lines) in the
  // Prometheus text exposition format 0.0.4.
  void AppendPrometheus(std::string& out) const;

 private:
  std::deque<MethodMetrics> methods_;  // deque: emplace_back never moves entries
};

namespace metrics_internal {
// Escapes a Prometheus label value (backslash, double quote, newline).
std::string EscapeLabel(std::string_view v);
}  // namespace metrics_internal

}  // namespace rdmarpc
