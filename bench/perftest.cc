#include "perftest.h"

#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace rdmarpc::bench::perftest {

// Runs a perftest server and client on this host; returns the client's output.
std::string RunPair(const std::string& server_cmd, const std::string& client_cmd, int server_start_s) {
  // `timeout`: a perftest side that loses its peer waits forever otherwise.
  const std::string cmd = "timeout 120 " + server_cmd + " >/dev/null 2>&1 & sleep " + std::to_string(server_start_s) +
                          "; timeout 120 " + client_cmd + " 2>&1; wait";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return "";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  return out;
}

// The all-numeric line of a perftest table that starts with `size`.
std::vector<double> TableLine(const std::string& out, size_t size) {
  for (auto line : absl::StrSplit(out, '\n')) {
    // ib_send_lat separates some columns with tabs.
    std::vector<absl::string_view> tok = absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipWhitespace());
    size_t first = 0;
    if (tok.size() < 2 || !absl::SimpleAtoi(tok[0], &first) || first != size) continue;
    std::vector<double> v;
    for (size_t i = 1; i < tok.size(); ++i) {
      double d = 0;
      if (!absl::SimpleAtod(tok[i], &d)) break;
      v.push_back(d);
    }
    if (v.size() + 1 == tok.size()) return v;
  }
  return {};
}

std::vector<double> Measure(const std::string& server_cmd, const std::string& client_cmd, size_t size) {
  for (int start_s : {2, 5, 10}) {
    auto line = TableLine(RunPair(server_cmd, client_cmd, start_s), size);
    if (!line.empty()) return line;
    std::fprintf(stderr, "  perftest: no result from '%s' (server given %d s to start); %s\n", client_cmd.c_str(),
                 start_s, start_s < 10 ? "retrying" : "giving up");
  }
  return {};
}

}  // namespace rdmarpc::bench::perftest
