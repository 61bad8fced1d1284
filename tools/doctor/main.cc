// `rdmarpc`: command-line tools for rdmarpc. Today one command, `doctor`.
//
// Exit status: 0 nothing failed (warnings allowed), 1 a finding failed,
// 2 bad usage (unknown command or option, missing or bad value).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tools/doctor/doctor.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFail = 1;
constexpr int kExitUsage = 2;

constexpr const char* kUsage =
    "Usage: rdmarpc <command> [options]\n"
    "\n"
    "Commands:\n"
    "  doctor    check RDMA devices, ports, GIDs, MTU, NUMA, memlock, hugepages and port\n"
    "            counters; every finding is ok/warn/fail with a one-line fix\n"
    "\n"
    "Options:\n"
    "  -h, --help    this text (`rdmarpc doctor --help` for the command's options)\n";

constexpr const char* kDoctorUsage =
    "Usage: rdmarpc doctor [--json] [--device NAME] [--sample-ms N]\n"
    "\n"
    "Checks what makes RDMA fail or slow on this host and says how to fix it.\n"
    "\n"
    "Options:\n"
    "  --json           print one JSON document instead of text\n"
    "  --device NAME    examine only this RDMA device (default: all of them)\n"
    "  --sample-ms N    read port counters twice, N ms apart, and flag error counters\n"
    "                   that climb (default 1000; 0 reads them once)\n"
    "  -h, --help       this text\n"
    "\n"
    "Exit status: 0 no finding failed, 1 a finding failed (or no device), 2 bad usage.\n";

int Usage(const std::string& error, const char* usage_hint) {
  std::fprintf(stderr, "%s (see `%s --help`)\n", error.c_str(), usage_hint);
  return kExitUsage;
}

int Doctor(int argc, char** argv) {
  rdmarpc::doctor::CollectOptions options;
  bool json = false;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    // Accept both "--flag value" and "--flag=value".
    auto value = [&](std::string_view flag, std::string* out) -> int {
      if (arg.size() > flag.size() && arg.substr(0, flag.size()) == flag && arg[flag.size()] == '=') {
        *out = std::string(arg.substr(flag.size() + 1));
        return 1;
      }
      if (arg != flag) return 0;
      if (i + 1 >= argc) return -1;
      *out = argv[++i];
      return 1;
    };
    std::string v;
    if (arg == "-h" || arg == "--help") {
      std::fputs(kDoctorUsage, stdout);
      return kExitOk;
    } else if (arg == "--json") {
      json = true;
    } else if (int r = value("--device", &v); r != 0) {
      if (r < 0 || v.empty()) return Usage("rdmarpc doctor: --device needs a device name", "rdmarpc doctor");
      options.device = v;
    } else if (int r2 = value("--sample-ms", &v); r2 != 0) {
      if (r2 < 0) return Usage("rdmarpc doctor: --sample-ms needs a number", "rdmarpc doctor");
      char* end = nullptr;
      const long ms = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || ms < 0 || ms > 60000)
        return Usage("rdmarpc doctor: --sample-ms '" + v + "' is not a number of milliseconds in 0..60000",
                     "rdmarpc doctor");
      options.sample_ms = static_cast<int>(ms);
    } else {
      return Usage("rdmarpc doctor: unknown option '" + std::string(arg) + "'", "rdmarpc doctor");
    }
  }
  rdmarpc::doctor::Report report;
  report.facts = rdmarpc::doctor::Collect(options);
  report.findings = rdmarpc::doctor::Evaluate(report.facts);
  const std::string text = json ? RenderJson(report) : RenderText(report);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return report.worst() == rdmarpc::doctor::Severity::kFail ? kExitFail : kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  const std::string_view cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (cmd == "doctor") return Doctor(argc - 2, argv + 2);
  if (!cmd.empty() && cmd[0] == '-') return Usage("rdmarpc: unknown option '" + std::string(cmd) + "'", "rdmarpc");
  return Usage("rdmarpc: unknown command '" + std::string(cmd) + "'; commands: doctor", "rdmarpc");
}
