// The fault suite's two halves (tests/faults/rpc_netem.sh runs them in two VMs).
//
//   fault_rpc serve --listen=rdma://IP:PORT
//       Serves rdmarpc.test.Fault until SIGINT/SIGTERM. Counts handler runs per
//       call id: a second run for one id is a duplicate (Stats reports them).
//   fault_rpc drive --target=rdma://IP:PORT --calls=N [--concurrency=C]
//                   [--sizes=64,4096,65536,262144] [--deadline-ms=D] [--bound-ms=B]
//                   [--label=TEXT] [--expect=ok|any]
//       Makes N echo calls (sizes in turn, each with a unique id and a
//       deadline), checks every byte of every answer, and judges:
//         - every call completed exactly once (a second completion, or none
//           within deadline + bound, fails);
//         - no call completed later than its deadline plus --bound-ms;
//         - with --expect=ok, every call succeeded;
//         - the server ran no handler twice (its Stats after the round).
//       Prints one `fault-rpc:` line with the figures; exit 0 only if all hold.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rdmarpc/test/fault.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"

namespace rdmarpc::faults {
namespace {

namespace asio = boost::asio;
using rdmarpc::test::FaultRequest;
using rdmarpc::test::FaultResponse;
using rdmarpc::test::FaultStatsRequest;
using rdmarpc::test::FaultStatsResponse;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "fault_rpc: %s\nusage: fault_rpc serve --listen=URI [--keepalive-ms=INTERVAL,TIMEOUT] [--grant-windows=0|1]\n"
               "                       [--ack-timeout=N]\n"
               "       fault_rpc drive --target=URI --calls=N [--concurrency=C] [--sizes=LIST] [--deadline-ms=D]\n"
               "                       [--bound-ms=B] [--label=TEXT] [--expect=ok|any] [--keepalive-ms=I,T]\n"
               "                       [--stop-on-failure] [--server-gone] [--until-file=PATH]\n"
               "                       [--grant-windows=0|1] [--ack-timeout=N]\n",
               why.c_str());
  std::exit(2);
}

std::map<std::string, std::string> Flags(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    const auto eq = a.find('=');
    if (a.rfind("--", 0) != 0) Usage("bad argument " + a);
    if (eq == std::string::npos)
      f[a.substr(2)] = "1";  // a switch
    else
      f[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  return f;
}

// A payload whose every byte depends on the call id: a mixed-up answer shows.
void Fill(std::string& s, uint64_t id, size_t size) {
  s.resize(size);
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>((id * 131 + i * 7) & 0xff);
}

class FaultService final : public rdmarpc::test::Fault::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext&, const FaultRequest& req, FaultResponse& resp) override {
    ++requests_;
    if (++runs_[req.id()] > 1) ++duplicates_;
    resp.set_id(req.id());
    resp.set_data(req.data());
    co_return Status();
  }
  asio::awaitable<Status> Stats(ServerContext&, const FaultStatsRequest&, FaultStatsResponse& resp) override {
    resp.set_requests(requests_);
    resp.set_duplicates(duplicates_);
    co_return Status();
  }

 private:
  uint64_t requests_ = 0, duplicates_ = 0;
  absl::flat_hash_map<uint64_t, uint32_t> runs_;
};

// --keepalive-ms=INTERVAL,TIMEOUT (absent: the library's defaults).
void KeepaliveFlag(const std::map<std::string, std::string>& f, KeepaliveOptions& k) {
  auto it = f.find("keepalive-ms");
  if (it == f.end()) return;
  std::vector<std::string> parts = absl::StrSplit(it->second, ',');
  int interval = 0, timeout = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &interval) || !absl::SimpleAtoi(parts[1], &timeout) ||
      interval < 0 || timeout < 0)
    Usage("--keepalive-ms takes INTERVAL,TIMEOUT in milliseconds (0,0: off)");
  k.interval = std::chrono::milliseconds(interval);
  k.timeout = std::chrono::milliseconds(timeout);
}

// --grant-windows=0|1 (absent: the library's default): rendezvous grants
// through type-2 memory windows over the grant pool, or an MR per message.
void GrantWindowsFlag(const std::map<std::string, std::string>& f, TransportOptions& t) {
  auto it = f.find("grant-windows");
  if (it == f.end()) return;
  if (it->second != "0" && it->second != "1") Usage("--grant-windows takes 0 or 1");
  t.rdma.grant_windows = it->second == "1";
}

// --ack-timeout=N (absent: the library's 14): the RC local ACK timeout
// exponent, 4.096 us * 2^N per try, 7 tries. 18 gives ~7.5 s before a QP
// gives up: a link outage of a few seconds then stays inside RC's retry budget.
void AckTimeoutFlag(const std::map<std::string, std::string>& f, TransportOptions& t) {
  auto it = f.find("ack-timeout");
  if (it == f.end()) return;
  int n = 0;
  if (!absl::SimpleAtoi(it->second, &n) || n < 1 || n > 31) Usage("--ack-timeout takes an exponent from 1 to 31");
  t.rdma.cm.ack_timeout = static_cast<uint8_t>(n);
}

int Serve(const std::map<std::string, std::string>& f) {
  auto it = f.find("listen");
  if (it == f.end()) Usage("serve needs --listen=URI");
  asio::io_context io;
  FaultService service;
  ServerOptions so;
  so.listen = {it->second};
  KeepaliveFlag(f, so.keepalive);
  GrantWindowsFlag(f, so.transport);
  AckTimeoutFlag(f, so.transport);
  auto server = std::make_shared<Server>(io.get_executor(), so);
  if (auto st = server->AddService(service); !st.ok()) {
    std::fprintf(stderr, "fault_rpc: %s\n", st.ToString().c_str());
    return 1;
  }
  if (auto st = server->Start(); !st.ok()) {
    std::fprintf(stderr, "fault_rpc: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("fault-rpc: serving %s\n", server->local_uris().at(0).c_str());
  std::fflush(stdout);
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](boost::system::error_code, int) {
    server->async_shutdown(std::chrono::milliseconds(500), [&] { io.stop(); });
  });
  io.run();
  return 0;
}

int Drive(const std::map<std::string, std::string>& f) {
  auto get = [&](const std::string& k, const std::string& dflt) {
    auto it = f.find(k);
    return it == f.end() ? dflt : it->second;
  };
  const std::string target = get("target", "");
  if (target.empty()) Usage("drive needs --target=URI");
  uint64_t calls = 0;
  int concurrency = 0, deadline_ms = 0, bound_ms = 0;
  if (!absl::SimpleAtoi(get("calls", "1000"), &calls) || calls == 0) Usage("--calls takes a positive count");
  if (!absl::SimpleAtoi(get("concurrency", "8"), &concurrency) || concurrency < 1) Usage("--concurrency >= 1");
  if (!absl::SimpleAtoi(get("deadline-ms", "30000"), &deadline_ms) || deadline_ms < 1) Usage("--deadline-ms >= 1");
  if (!absl::SimpleAtoi(get("bound-ms", "2000"), &bound_ms) || bound_ms < 0) Usage("--bound-ms >= 0");
  std::vector<size_t> sizes;
  for (auto s : absl::StrSplit(get("sizes", "64,4096,65536,262144"), ',', absl::SkipEmpty())) {
    size_t v = 0;
    if (!absl::SimpleAtoi(s, &v)) Usage("--sizes takes byte counts");
    sizes.push_back(v);
  }
  const std::string label = get("label", "run");
  const bool expect_ok = get("expect", "ok") == "ok";
  // The server's host is to die during the run: stop issuing once a call
  // fails, and do not ask the server for its handler counts afterwards.
  const bool stop_on_failure = f.count("stop-on-failure") != 0;
  const bool server_gone = f.count("server-gone") != 0;
  // Keep issuing until this file exists (then finish what is in flight):
  // for runs whose length the fault script decides.
  const std::string until_file = get("until-file", "");

  asio::io_context io;
  ChannelOptions co;
  KeepaliveFlag(f, co.keepalive);
  GrantWindowsFlag(f, co.transport);
  AckTimeoutFlag(f, co.transport);
  auto channel = Channel::Create(io.get_executor(), target, co);
  if (!channel.ok()) {
    std::fprintf(stderr, "fault_rpc: %s\n", channel.status().ToString().c_str());
    return 2;
  }
  rdmarpc::test::Fault::Stub stub(*channel);

  struct Slot {
    explicit Slot(asio::io_context& io) : pause(io) {}
    ClientContext ctx;
    FaultRequest req;
    FaultResponse resp;
    Clock::time_point deadline;
    asio::steady_timer pause;  // after a failure: while the server is down calls fail at once
  };
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < concurrency; ++i) slots.push_back(std::make_unique<Slot>(io));
  std::vector<uint32_t> completions(calls, 0);
  std::map<std::string, uint64_t> by_status;
  uint64_t next = 0, done = 0, corrupt = 0, late = 0;
  bool failed = false, stopping = false;
  int64_t first_failure_unix_ms = 0;
  uint64_t ok_since_last_failure = 0;
  int64_t recovered_unix_ms = 0;  // The first OK after the last failure (0: none failed, or none since).
  int in_flight = 0;
  double max_latency_ms = 0, max_over_deadline_ms = -1e9;
  const auto start = Clock::now();
  std::string expected;

  // Ids unique across runs against one server (it counts handler runs per id
  // for its whole life): a random run number above the call's sequence number.
  const uint64_t run = static_cast<uint64_t>(std::random_device{}()) << 32;
  std::function<void(int)> issue = [&](int i) {
    Slot& s = *slots[static_cast<size_t>(i)];
    const uint64_t seq = next++;
    const uint64_t id = run | seq;
    s.ctx.set_timeout(std::chrono::milliseconds(deadline_ms));
    s.deadline = *s.ctx.deadline();
    s.req.set_id(id);
    Fill(*s.req.mutable_data(), id, sizes[seq % sizes.size()]);
    const auto sent = Clock::now();
    ++in_flight;
    stub.async_Echo(s.ctx, s.req, s.resp, [&, i, id, seq, sent](boost::system::error_code ec) {
      Slot& d = *slots[static_cast<size_t>(i)];
      const auto now = Clock::now();
      ++completions[seq];
      ++done;
      --in_flight;
      if (ec) {
        ok_since_last_failure = 0;
        recovered_unix_ms = 0;
      } else if (++ok_since_last_failure == 1 && failed) {
        recovered_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
      }
      if (ec && !failed) {
        failed = true;
        first_failure_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count();
      }
      ++by_status[std::string(StatusCodeName(d.ctx.status().code()))];
      if (!ec) {
        Fill(expected, id, sizes[seq % sizes.size()]);
        if (d.resp.id() != id || d.resp.data() != expected) ++corrupt;
      }
      max_latency_ms = std::max(max_latency_ms, std::chrono::duration<double, std::milli>(now - sent).count());
      const double over = std::chrono::duration<double, std::milli>(now - d.deadline).count();
      max_over_deadline_ms = std::max(max_over_deadline_ms, over);
      if (over > bound_ms) ++late;
      if (stop_on_failure && failed) stopping = true;
      if (next < calls && !stopping) {
        if (!ec) {
          issue(i);
        } else {
          d.pause.expires_after(std::chrono::milliseconds(20));
          d.pause.async_wait([&, i](boost::system::error_code pause_ec) {
            if (!pause_ec && next < calls && !stopping) issue(i);
          });
        }
      }
      if (done == calls || (stopping && in_flight == 0)) io.stop();
    });
  };
  for (int i = 0; i < concurrency && next < calls; ++i) issue(i);
  asio::steady_timer until(io);
  std::function<void()> watch_until = [&] {
    until.expires_after(std::chrono::milliseconds(100));
    until.async_wait([&](boost::system::error_code ec) {
      if (ec) return;
      if (access(until_file.c_str(), F_OK) == 0) {
        stopping = true;
        if (in_flight == 0) io.stop();
        return;
      }
      watch_until();
    });
  };
  if (!until_file.empty()) watch_until();
  // Nothing may hang: every call has a deadline, so all must be over by the
  // last deadline plus the bound. A watchdog turns a hang into a verdict.
  asio::steady_timer watchdog(io, std::chrono::milliseconds(deadline_ms + bound_ms) * (1 + calls / concurrency));
  bool hung = false;
  watchdog.async_wait([&](boost::system::error_code ec) {
    if (!ec) {
      hung = true;
      io.stop();
    }
  });
  io.run();
  watchdog.cancel();
  until.cancel();
  for (auto& slot : slots) slot->pause.cancel();
  io.restart();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();

  // The server's count of handler runs (after the round; the wire is the same).
  uint64_t duplicates = 0, requests = 0;
  bool stats_ok = false;
  if (server_gone) {
    stats_ok = true;  // nobody to ask
  } else {
    ClientContext ctx;
    ctx.set_timeout(std::chrono::seconds(60));
    ctx.set_wait_for_ready(true);
    FaultStatsRequest req;
    FaultStatsResponse resp;
    stub.async_Stats(ctx, req, resp, [&](boost::system::error_code ec) {
      stats_ok = !ec;
      duplicates = resp.duplicates();
      requests = resp.requests();
      io.stop();
    });
    io.run_for(std::chrono::seconds(70));
  }
  (*channel)->Close();
  io.restart();
  io.run_for(std::chrono::milliseconds(200));

  uint64_t never = 0, twice = 0;
  for (uint64_t seq = 0; seq < next; ++seq) {  // every call issued (all of them unless stopped on failure)
    if (completions[seq] == 0) ++never;
    if (completions[seq] > 1) ++twice;
  }
  std::string statuses;
  for (const auto& [name, n] : by_status) absl::StrAppend(&statuses, statuses.empty() ? "" : ",", name, "=", n);
  const bool all_ok = by_status.size() == 1 && by_status.count("OK") == 1;
  const bool pass = !hung && never == 0 && twice == 0 && late == 0 && corrupt == 0 && stats_ok && duplicates == 0 &&
                    (!expect_ok || all_ok);
  std::printf(
      "fault-rpc: %s calls=%llu seconds=%.1f statuses={%s} completed_never=%llu completed_twice=%llu corrupt=%llu "
      "late=%llu max_latency_ms=%.0f max_past_deadline_ms=%.0f server_handler_runs=%llu server_duplicates=%llu%s "
      "first_failure_unix_ms=%lld ok_since_last_failure=%llu recovered_unix_ms=%lld %s\n",
      label.c_str(), static_cast<unsigned long long>(next), secs, statuses.c_str(),
      static_cast<unsigned long long>(never), static_cast<unsigned long long>(twice),
      static_cast<unsigned long long>(corrupt), static_cast<unsigned long long>(late), max_latency_ms,
      max_over_deadline_ms, static_cast<unsigned long long>(requests), static_cast<unsigned long long>(duplicates),
      stats_ok ? "" : " (server stats unavailable)", static_cast<long long>(first_failure_unix_ms),
      static_cast<unsigned long long>(ok_since_last_failure), static_cast<long long>(recovered_unix_ms),
      pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace rdmarpc::faults

int main(int argc, char** argv) {
  if (argc < 2) rdmarpc::faults::Usage("say serve or drive");
  const std::string mode = argv[1];
  auto flags = rdmarpc::faults::Flags(argc, argv);
  if (mode == "serve") return rdmarpc::faults::Serve(flags);
  if (mode == "drive") return rdmarpc::faults::Drive(flags);
  rdmarpc::faults::Usage("unknown mode " + mode);
}
