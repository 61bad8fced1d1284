#include "rpc/metrics.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc {

namespace metrics_internal {
std::string EscapeLabel(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}
}  // namespace metrics_internal

const MethodMetrics* ServerMetrics::Find(std::string_view full_name) const noexcept {
  for (const auto& m : methods_)
    if (m.info.full_name == full_name) return &m;
  return nullptr;
}

void ServerMetrics::AppendPrometheus(std::string& out) const {
  using metrics_internal::EscapeLabel;
  out += "# HELP rdmarpc_server_calls_total Unary calls finished by the server, by method and final status code.\n";
  out += "# TYPE rdmarpc_server_calls_total counter\n";
  for (const auto& m : methods_) {
    const std::string method = EscapeLabel(m.info.full_name);
    for (size_t code = 0; code <= kMaxStatusCode; ++code) {
      // OK always (so every method shows up), other codes once seen.
      if (code != 0 && m.calls_by_code[code] == 0) continue;
      absl::StrAppend(&out, "rdmarpc_server_calls_total{method=\"", method, "\",code=\"",
                      internal::Sv(StatusCodeName(static_cast<StatusCode>(code))), "\"} ",
                      m.calls_by_code[code], "\n");
    }
  }
  out += "# HELP rdmarpc_server_call_duration_microseconds Time from a request's receipt to its handler's return.\n";
  out += "# TYPE rdmarpc_server_call_duration_microseconds histogram\n";
  for (const auto& m : methods_) {
    const std::string method = EscapeLabel(m.info.full_name);
    uint64_t cumulative = 0;
    const auto& counts = m.latency.counts();
    for (size_t i = 0; i < counts.size(); ++i) {
      cumulative += counts[i];
      const std::string le = i < kLatencyBucketBoundsUs.size() ? absl::StrCat(kLatencyBucketBoundsUs[i]) : "+Inf";
      absl::StrAppend(&out, "rdmarpc_server_call_duration_microseconds_bucket{method=\"", method, "\",le=\"", le,
                      "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "rdmarpc_server_call_duration_microseconds_sum{method=\"", method, "\"} ",
                    m.latency.sum_us(), "\n");
    absl::StrAppend(&out, "rdmarpc_server_call_duration_microseconds_count{method=\"", method, "\"} ",
                    m.latency.count(), "\n");
  }
}

}  // namespace rdmarpc
