// Raw transport benchmark: message latency (ping-pong) and bandwidth
// (windowed one-way stream) over the transport seam, for each transport, side
// by side in one run, optionally next to perftest's ib_send_lat/ib_write_bw on
// the same device. Prints; asserts nothing.
//
//   transport_bench [--transport=rdma,tcp] [--sizes=64,4096,65536,1048576]
//                   [--iters=N] [--window=N] [--poll=event|adaptive|busy]
//                   [--device=NAME] [--ip=ADDR] [--with-perftest] [--phase-ms=3000] [--spin]
//                   [--rtc]   (busy/adaptive: run to completion, no poller thread)
//                   [--grant-windows=1|0]  (rendezvous grants: windows over a pool, or an MR per message)
//                   [--imm-headers=1|0]  (DATA headers in the SEND's immediate, or 16 bytes before the body)
//                   [--phases=latency,bandwidth]  (one of them alone: e.g. for strace -c of the ping-pong)
//                   [--rounds=N]  (all of it N times, perftest in each round; medians, ratios per round)
//                   [--stats]  (both ends' connection counters after each size: registrations, credit waits...)
//
// Client and server run in one process on two threads, each with its own
// io_context, so neither side's processing hides in the other's.
#include <boost/asio/io_context.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/perftest.h"
#include "bench/poll_some.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace asio = boost::asio;
namespace perftest = rdmarpc::bench::perftest;
using Clock = std::chrono::steady_clock;
using rdmarpc::transport::Connection;
using rdmarpc::transport::Listener;
using rdmarpc::transport::Message;

namespace {

struct Flags {
  std::vector<std::string> transports = {"rdma", "tcp"};
  std::vector<size_t> sizes = {64, 4096, 65536, 1 << 20};
  int iters = 2000;
  int window = 16;
  rdmarpc::rdma::PollMode poll = rdmarpc::rdma::PollMode::kEvent;
  std::string device, ip;
  bool perftest = false;
  // Upper bound on each latency and bandwidth phase: under emulation a fixed
  // count can take minutes.
  std::chrono::milliseconds phase{3000};
  // Spin both io_contexts (poll instead of sleeping in epoll): what a
  // latency-critical deployment does, and what perftest does. Without it,
  // each round trip pays two thread wake-ups, which emulation makes ~100x
  // dearer than real hardware.
  bool spin = false;
  bool rtc = false;  // RdmaOptions::run_to_completion
  bool receive = false;  // --receive: a Receive() per message instead of the MessageSink
  bool grant_windows = rdmarpc::rdma::RdmaOptions{}.grant_windows;  // --grant-windows; the library's default
  bool imm_headers = rdmarpc::rdma::RdmaOptions{}.data_header_in_immediate;  // --imm-headers; likewise
  // --phases: which measurements run. Latency alone makes a run whose syscalls
  // and instructions (strace -c, callgrind) are the ping-pong's only.
  bool latency = true, bandwidth = true;
  // --rounds: the whole measurement (and perftest) this many times, taking
  // ratios per round (see main).
  int rounds = 1;
  // --stats: both ends' ConnectionStats (SummarizeStats) after each size.
  bool stats = false;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "transport_bench: %s\nusage: transport_bench [--transport=rdma,tcp] [--sizes=64,4096,...] "
               "[--iters=N] [--window=N] [--poll=event|adaptive|busy] [--device=NAME] [--ip=ADDR] "
               "[--with-perftest] [--phase-ms=MS] [--spin] [--rtc] [--grant-windows=1|0] [--imm-headers=1|0] [--receive] "
               "[--phases=latency,bandwidth] [--rounds=N] [--stats]\n",
               why.c_str());
  std::exit(2);
}

Flags Parse(int argc, char** argv) {
  Flags f;
  if (const char* d = std::getenv("RXE_VM_DEV")) f.device = d;
  if (const char* ip = std::getenv("RXE_VM_SELF_IP")) f.ip = ip;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--transport") {
      f.transports = absl::StrSplit(val, ',', absl::SkipEmpty());
      for (auto& t : f.transports)
        if (t != "rdma" && t != "tcp") Usage("--transport takes rdma,tcp");
    } else if (key == "--sizes") {
      f.sizes.clear();
      for (auto s : absl::StrSplit(val, ',', absl::SkipEmpty())) {
        size_t v = 0;
        if (!absl::SimpleAtoi(s, &v) || v > (size_t{64} << 20)) Usage("bad --sizes value '" + std::string(s) + "'");
        f.sizes.push_back(v);
      }
    } else if (key == "--iters") {
      if (!absl::SimpleAtoi(val, &f.iters) || f.iters <= 0) Usage("--iters needs a positive integer");
    } else if (key == "--window") {
      if (!absl::SimpleAtoi(val, &f.window) || f.window <= 0 || f.window > 60) Usage("--window takes 1..60");
    } else if (key == "--poll") {
      auto m = rdmarpc::rdma::ParsePollMode(val);
      if (!m.ok()) Usage(std::string(m.status().message()));
      f.poll = *m;
    } else if (key == "--phase-ms") {
      int ms = 0;
      if (!absl::SimpleAtoi(val, &ms) || ms <= 0) Usage("--phase-ms needs a positive integer");
      f.phase = std::chrono::milliseconds(ms);
    } else if (key == "--device") {
      f.device = val;
    } else if (key == "--ip") {
      f.ip = val;
    } else if (key == "--spin") {
      f.spin = true;
    } else if (key == "--rtc") {
      f.rtc = true;
    } else if (key == "--receive") {
      f.receive = true;
    } else if (key == "--imm-headers") {
      if (val != "0" && val != "1") Usage("--imm-headers takes 1 (DATA headers in the immediate) or 0 (16 bytes before the body)");
      f.imm_headers = val == "1";
    } else if (key == "--grant-windows") {
      if (val != "0" && val != "1") Usage("--grant-windows takes 1 (memory windows over a pool) or 0 (an MR per message)");
      f.grant_windows = val == "1";
    } else if (key == "--phases") {
      f.latency = f.bandwidth = false;
      for (auto p : absl::StrSplit(val, ',', absl::SkipEmpty())) {
        if (p == "latency") f.latency = true;
        else if (p == "bandwidth") f.bandwidth = true;
        else Usage("--phases takes latency,bandwidth (one or both), not '" + std::string(p) + "'");
      }
      if (!f.latency && !f.bandwidth) Usage("--phases needs latency, bandwidth or both");
    } else if (key == "--rounds") {
      if (!absl::SimpleAtoi(val, &f.rounds) || f.rounds <= 0 || f.rounds > 100) Usage("--rounds takes 1..100");
    } else if (key == "--with-perftest") {
      f.perftest = true;
    } else if (key == "--stats") {
      f.stats = true;
    } else if (key == "--help" || key == "-h") {
      Usage("help");
    } else {
      Usage("unknown flag '" + a + "'");
    }
  }
  return f;
}

// --stats: which CPUs each side's messages were handled on (each array is
// touched by its own side's thread only).
bool g_stats = false;
struct CpuCounts {
  std::array<uint32_t, 16> n{};
  void Note() {
    if (!g_stats) return;
    if (const int cpu = sched_getcpu(); cpu >= 0) ++n[static_cast<unsigned>(cpu) % n.size()];
  }
  std::string Take() {
    std::string out;
    for (size_t c = 0; c < n.size(); ++c)
      if (n[c] != 0) absl::StrAppend(&out, out.empty() ? "" : " ", "cpu", c, ":", n[c]);
    n = {};
    return out;
  }
};

// The server side: a thread with its own io_context echoing (latency phase)
// or swallowing (bandwidth phase) everything it receives.
// Messages come through the connection's MessageSink (the transport's fast
// receive path), or with --receive through a Receive() per message.
struct Server final : rdmarpc::transport::MessageSink {
  asio::io_context io;
  std::unique_ptr<Connection> conn;
  std::atomic<bool> echo{true};
  std::thread thread;
  bool sink = false;
  CpuCounts cpus;

  void Start(bool receive) {
    sink = !receive && conn->SetSink(this);
    if (!sink) Loop();
  }
  // With the sink, echoes are untracked sends (a failure is the connection's,
  // OnConnectionError), as the RPC layer sends: on RDMA, small ones answered
  // from the sink cost no send completion (docs/transport.md, "Selective
  // signalling").
  void Reply(rdmarpc::transport::SendBuffer out) {
    if (sink)
      conn->SendUntracked(std::move(out));
    else
      conn->Send(std::move(out), [](absl::Status) {});
  }
  void OnMessage(Message m) override { Handle(m); }
  void OnConnectionError(absl::Status) override {}  // Closed: the run is over.

  void Handle(Message& m) {
    cpus.Note();
    if (echo) {
      auto out = conn->Prepare(m.size());
      if (out.ok()) {
        if (m.size() > 0) std::memcpy(out->data().data(), m.data().data(), m.size());
        Reply(std::move(*out));
      }
    } else if (m.size() == 1) {  // End-of-burst marker: tell the client.
      auto out = conn->Prepare(1);
      if (out.ok()) Reply(std::move(*out));
    }
    m.Reset();
  }

  void Loop() {
    conn->Receive([this](absl::StatusOr<Message> m) {
      if (!m.ok()) return;  // Closed: the run is over.
      Handle(*m);
      Loop();
    });
  }
};

// The client's sink: the one answer the measuring loop waits for. In the
// latency phase `on_echo` runs the ping-pong from here instead.
struct ClientSink final : rdmarpc::transport::MessageSink {
  bool got = false;
  size_t size = 0;
  absl::Status status;
  std::function<void(size_t)> on_echo;
  absl::Status ping_status;  // The latency phase's sends and echoes.
  CpuCounts cpus;
  void OnMessage(Message m) override {
    cpus.Note();
    got = true;
    size = m.size();
    m.Reset();  // The receive buffer goes back before the next message is sent.
    if (on_echo) on_echo(size);
  }
  void OnConnectionError(absl::Status st) override {
    got = true;
    status = std::move(st);
  }
};

struct Row {
  std::string name;
  size_t size;
  double p50 = 0, p99 = 0, gbps = 0;
};

double Pct(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

bool g_spin = false;

// Runs the client io_context until `done` or the deadline. Ready handlers
// run through poll_one(), which reads no clock; only when none is ready does
// it block in run_one_for(). The deadline is checked every 256 rounds: in the
// Soft-RoCE VM (hpet clocksource, no vDSO clock) every clock read is a
// syscall, and a read per round would be measured as transport latency.
template <typename Pred>
bool RunUntil(asio::io_context& io, Pred done, std::chrono::seconds limit = std::chrono::seconds(300)) {
  const auto deadline = Clock::now() + limit;
  for (unsigned round = 1; !done(); ++round) {
    if (round % 256 == 0 && Clock::now() >= deadline) break;
    if (g_spin) {
      rdmarpc::bench::PollSome(io);
    } else if (io.poll_one() == 0) {
      io.run_one_for(std::chrono::milliseconds(50));
    }
    if (io.stopped()) io.restart();
  }
  return done();
}

absl::Status Measure(const std::string& name, Connection& client, ClientSink* sink, Server& server,
                     asio::io_context& io, const Flags& f, std::vector<Row>& rows) {
  // The server's counters are read on its own thread (its io_context owns them).
  auto print_stats = [&](size_t size) {
    if (!f.stats) return;
    std::promise<std::string> server_line;
    asio::post(server.io, [&] {
      server_line.set_value(absl::StrCat(server.cpus.Take(), " ", rdmarpc::transport::SummarizeStats(server.conn->stats())));
    });
    std::fprintf(stderr, "  %s %zu B client: %s %s\n  %s %zu B server: %s\n", name.c_str(), size,
                 sink != nullptr ? sink->cpus.Take().c_str() : "",
                 rdmarpc::transport::SummarizeStats(client.stats()).c_str(), name.c_str(), size,
                 server_line.get_future().get().c_str());
  };
  for (size_t size : f.sizes) {
    if (size > client.max_message_size()) continue;
    Row row{name, size};
    // Latency: one message in flight.
    server.echo = true;
    std::vector<double> us;
    const int iters = !f.latency ? 0 : size >= (1 << 20) ? std::max(20, f.iters / 20) : f.iters;
    const auto lat_deadline = Clock::now() + f.phase;
    const int warmup = std::min(100, iters / 10);
    // Whether the ping-pong goes on after `i` round trips (negative: warm-up):
    // up to `iters`, and past the phase's time only to the next multiple of
    // 64 (the clock is read only then), at least 10.
    const auto more_latency = [&](int i) {
      return i < iters && (i < 10 || i % 64 != 0 || Clock::now() < lat_deadline);
    };
    if (sink != nullptr && iters > 0) {
      // The ping-pong runs from the client's sink: the handler that takes
      // each echo records the round trip and sends the next message, as the
      // server's sink answers, and as a run-to-completion application would.
      // Each sample is the time from one Send() to the next, as perftest's
      // ib_send_lat measures from one post to the next; what the transport
      // does after the handler returns overlaps the next flight instead of
      // being counted in it (the loop before 2026-12-05 returned to RunUntil
      // for every echo: ~2.4 us more per round trip in the Soft-RoCE VM).
      int i = -warmup;
      bool done = false;
      // In the sink, which outlives the connection: after a failure, send
      // handlers may run after this phase, even after Measure returns.
      absl::Status& st = sink->ping_status;
      st = absl::OkStatus();
      Clock::time_point t0;
      auto send_next = [&] {
        auto buf = client.Prepare(size);
        if (!buf.ok()) {
          st = buf.status();
          return false;
        }
        t0 = Clock::now();
        client.SendUntracked(std::move(*buf));  // a failure reaches the sink (sink->status)
        return true;
      };
      sink->on_echo = [&](size_t got) {
        const auto t1 = Clock::now();
        if (got != size) st = absl::DataLossError("echo size differs");
        if (i >= 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        ++i;
        if (!st.ok() || !more_latency(i) || !send_next()) done = true;
      };
      const bool ran = send_next() && RunUntil(io, [&] { return done || !sink->status.ok(); });
      sink->on_echo = nullptr;
      if (!sink->status.ok()) return sink->status;
      if (!st.ok()) return st;
      if (!ran) return absl::DeadlineExceededError("echo timed out");
    }
    for (int i = -warmup; sink == nullptr && more_latency(i); ++i) {
      auto buf = client.Prepare(size);
      if (!buf.ok()) return buf.status();
      const auto t0 = Clock::now();
      bool back = false;
      absl::Status st;
      client.Send(std::move(*buf), [&](absl::Status s) { if (!s.ok()) st = s; });
      client.Receive([&](absl::StatusOr<Message> m) {
        if (!m.ok()) st = m.status();
        else if (m->size() != size) st = absl::DataLossError("echo size differs");
        back = true;
      });
      if (!RunUntil(io, [&] { return back; })) return absl::DeadlineExceededError("echo timed out");
      if (!st.ok()) return st;
      if (i >= 0) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    row.p50 = Pct(us, 0.5);
    row.p99 = Pct(us, 0.99);

    // Bandwidth: `window` messages in flight one way, then a 1-byte marker
    // the server answers; time from first send to that answer.
    server.echo = false;
    if (!f.bandwidth) {
      rows.push_back(row);
      std::fprintf(stderr, "  %s %zu B: p50 %.1f us, p99 %.1f us\n", name.c_str(), size, row.p50, row.p99);
      print_stats(size);
      continue;
    }
    const size_t total_bytes = std::max<size_t>(size * 200, size_t{64} << 20);
    const int count = static_cast<int>(std::min<size_t>(total_bytes / std::max<size_t>(size, 1), 200000));
    int sent = 0, done_sends = 0;
    absl::Status st;
    const auto t0 = Clock::now();
    const auto bw_deadline = t0 + f.phase;
    int limit = count;
    std::function<void()> pump = [&] {
      if (sent >= 10 && limit == count && Clock::now() > bw_deadline) limit = sent;  // Time's up.
      while (sent < limit && sent - done_sends < f.window && st.ok()) {
        auto buf = client.Prepare(size);
        if (!buf.ok()) { st = buf.status(); return; }
        ++sent;
        client.Send(std::move(*buf), [&](absl::Status s) {
          if (!s.ok()) st = s;
          ++done_sends;
          pump();
        });
      }
    };
    pump();
    if (!RunUntil(io, [&] { return done_sends == limit || !st.ok(); })) return absl::DeadlineExceededError("stream timed out");
    if (!st.ok()) return st;
    bool marker = false;
    auto m = client.Prepare(1);
    if (!m.ok()) return m.status();
    client.Send(std::move(*m), [](absl::Status) {});
    if (sink != nullptr) {
      sink->got = false;
      if (!RunUntil(io, [&] { return sink->got; })) return absl::DeadlineExceededError("marker timed out");
      if (!sink->status.ok()) st = sink->status;
    } else {
      client.Receive([&](absl::StatusOr<Message> r) { marker = true; if (!r.ok()) st = r.status(); });
      if (!RunUntil(io, [&] { return marker; })) return absl::DeadlineExceededError("marker timed out");
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    row.gbps = static_cast<double>(size) * limit * 8 / secs / 1e9;
    rows.push_back(row);
    std::fprintf(stderr, "  %s %zu B: p50 %.1f us, p99 %.1f us, %.3f Gb/s\n", name.c_str(), size, row.p50, row.p99,
                 row.gbps);
    print_stats(size);
  }
  return absl::OkStatus();
}

absl::Status RunTransport(const std::string& name, const Flags& f, std::vector<Row>& rows) {
  asio::io_context io;
  Server server;
  auto guard = asio::make_work_guard(server.io);
  std::shared_ptr<rdmarpc::rdma::RdmaContext> ctx;
  absl::StatusOr<std::unique_ptr<Listener>> listener = absl::UnknownError("unset");
  rdmarpc::rdma::RdmaOptions ro;
  ro.poll_mode = f.poll;
  ro.run_to_completion = f.rtc;
  ro.grant_windows = f.grant_windows;
  ro.data_header_in_immediate = f.imm_headers;
  if (name == "rdma") {
    auto c = rdmarpc::rdma::RdmaContext::Open({.name = f.device});
    if (!c.ok()) return c.status();
    ctx = *c;
    if (f.ip.empty()) return absl::InvalidArgumentError("--ip is required for rdma (an address on the device's netdev)");
    listener = rdmarpc::rdma::Listen(server.io.get_executor(), ctx, f.ip, 0, ro);
  } else {
    listener = rdmarpc::transport::tcp::Listen(server.io.get_executor(), "127.0.0.1", 0, {});
  }
  if (!listener.ok()) return listener.status();
  std::promise<absl::Status> accepted;
  (*listener)->Accept([&](absl::StatusOr<std::unique_ptr<Connection>> c) {
    if (c.ok()) server.conn = std::move(*c);
    accepted.set_value(c.status());
  });
  std::atomic<bool> server_stop{false};
  server.thread = std::thread([&] {
    if (!f.spin) return (void)server.io.run();
    while (!server_stop.load(std::memory_order_relaxed)) {
      rdmarpc::bench::PollSome(server.io);
      if (server.io.stopped()) server.io.restart();
    }
  });
  const std::string uri = (*listener)->local_uri();
  const uint16_t port = static_cast<uint16_t>(std::stoi(uri.substr(uri.rfind(':') + 1)));
  absl::StatusOr<std::unique_ptr<Connection>> client = absl::UnknownError("pending");
  bool connected = false;
  auto on_connect = [&](absl::StatusOr<std::unique_ptr<Connection>> c) {
    client = std::move(c);
    connected = true;
  };
  if (name == "rdma")
    rdmarpc::rdma::Connect(io.get_executor(), ctx, f.ip, port, ro, on_connect);
  else
    rdmarpc::transport::tcp::Connect(io.get_executor(), "127.0.0.1", port, {}, on_connect);
  RunUntil(io, [&] { return connected; }, std::chrono::seconds(30));
  absl::Status st = connected ? client.status() : absl::DeadlineExceededError("connect timed out");
  auto acc = accepted.get_future();
  if (st.ok() && acc.wait_for(std::chrono::seconds(30)) == std::future_status::ready) st = acc.get();
  ClientSink sink;
  if (st.ok()) {
    asio::post(server.io, [&] { server.Start(f.receive); });
    const bool use_sink = !f.receive && (*client)->SetSink(&sink);
    st = Measure(name, **client, use_sink ? &sink : nullptr, server, io, f, rows);
  }
  if (client.ok() && *client) (*client)->Close();
  asio::post(server.io, [&] {
    if (server.conn) server.conn->Close();
    (*listener)->Close();
  });
  io.run_for(std::chrono::milliseconds(100));
  guard.reset();
  server_stop = true;
  server.io.stop();
  server.thread.join();
  return st;
}

// perftest ceilings: ib_send_lat reports one-way latency (half the round
// trip), so its round trip is 2 x t_typical; ib_write_bw's BW average in MB/s.
std::vector<Row> RunPerftest(const Flags& f) {
  std::vector<Row> ceiling;
  const std::string d = f.device.empty() ? "" : " -d " + f.device;
  for (size_t size : f.sizes) {
    Row r{"perftest", size};
    const std::string s = " -s " + std::to_string(size) + d;
    if (f.latency) {
      // Fewer iterations for big messages: under emulation 1 MiB takes ~100 ms.
      // Small ones get as many samples as our phase takes (~5,000 in 2 s).
      const std::string n = size >= 65536 ? " -n 100" : size > 4096 ? " -n 1000" : " -n 5000";
      auto lat = perftest::Measure("ib_send_lat -F" + n + s, "ib_send_lat -F" + n + s + " " + f.ip, size);
      // Columns: #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
      if (lat.size() >= 7) {
        r.p50 = 2 * lat[3];
        r.p99 = 2 * lat[6];
      }
    }
    if (f.bandwidth) {
      auto bw = perftest::Measure("ib_write_bw -F -n 100" + s, "ib_write_bw -F -n 100" + s + " " + f.ip, size);
      // Columns: #iterations BW_peak BW_average MsgRate (MB/s = 2^20 bytes)
      if (bw.size() >= 3) r.gbps = bw[2] * 1048576.0 * 8 / 1e9;
    }
    std::fprintf(stderr, "  perftest %zu B: p50 %.1f us (2 x ib_send_lat), p99 %.1f us, %.3f Gb/s (ib_write_bw)\n", size,
                 r.p50, r.p99, r.gbps);
    ceiling.push_back(r);
  }
  return ceiling;
}

// Of the measured values (0: not measured); the mean of the middle two when
// their number is even.
double Median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !(x > 0); }), v.end());
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f = Parse(argc, argv);
  g_spin = f.spin;
  g_stats = f.stats;
  // Each round measures every transport, then perftest, with nothing of ours
  // running meanwhile (a busy poller would take a core from perftest). The
  // VM's speed drifts by tens of percent within minutes, so the ratios are
  // taken per round, between neighbours, and their median is printed.
  std::vector<std::vector<Row>> rounds_rows, rounds_ceiling;
  for (int round = 1; round <= f.rounds; ++round) {
    std::vector<Row> rows;
    for (const auto& t : f.transports) {
      std::fprintf(stderr, "== %s (poll=%s%s%s%s)%s\n", t.c_str(), rdmarpc::rdma::PollModeName(f.poll),
                   f.rtc ? ", run to completion" : "",
                   t == "rdma" ? (f.grant_windows ? ", grants: windows over a pool" : ", grants: an MR per message") : "",
                   t == "rdma" && !f.imm_headers ? ", DATA headers before the body" : "",
                   f.rounds > 1 ? absl::StrCat(" round ", round, " of ", f.rounds).c_str() : "");
      if (auto st = RunTransport(t, f, rows); !st.ok()) {
        std::fprintf(stderr, "transport_bench: %s: %s\n", t.c_str(), st.ToString().c_str());
        return 1;
      }
    }
    rounds_rows.push_back(std::move(rows));
    rounds_ceiling.push_back(f.perftest ? RunPerftest(f) : std::vector<Row>{});
  }

  // One row per (name, size): medians over the rounds; each ratio is the
  // median of the rounds' ratios.
  struct Summary {
    Row row;
    std::vector<double> p50, p99, gbps, lat_ratio, bw_ratio;
  };
  std::vector<Summary> table;
  auto summary = [&](const Row& r) -> Summary& {
    for (auto& s : table)
      if (s.row.name == r.name && s.row.size == r.size) return s;
    table.push_back({Row{r.name, r.size}, {}, {}, {}, {}, {}});
    return table.back();
  };
  for (size_t round = 0; round < rounds_rows.size(); ++round) {
    for (const auto& r : rounds_rows[round]) {
      Summary& s = summary(r);
      s.p50.push_back(r.p50);
      s.p99.push_back(r.p99);
      s.gbps.push_back(r.gbps);
      for (const auto& c : rounds_ceiling[round])
        if (c.size == r.size && r.name == "rdma") {
          if (c.p50 > 0 && r.p50 > 0) s.lat_ratio.push_back(r.p50 / c.p50);
          if (c.gbps > 0 && r.gbps > 0) s.bw_ratio.push_back(r.gbps / c.gbps);
        }
    }
  }
  for (const auto& ceiling : rounds_ceiling)
    for (const auto& c : ceiling) {
      Summary& s = summary(c);
      s.p50.push_back(c.p50);
      s.p99.push_back(c.p99);
      s.gbps.push_back(c.gbps);
    }

  const bool many = f.rounds > 1;
  std::printf("\n| transport | size B | p50 us | p99 us | Gb/s | p50 vs 2x ib_send_lat | Gb/s vs ib_write_bw |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  // A phase left out by --phases (or with nothing measured) shows "-", not 0.
  auto num = [](double v, int digits) { return v > 0 ? absl::StrFormat("%.*f", digits, v) : std::string("-"); };
  auto ratio = [](double v) { return v > 0 ? absl::StrCat(absl::SixDigits(v), "x") : std::string("-"); };
  for (const auto& s : table)
    std::printf("| %s | %zu | %s | %s | %s | %s | %s |\n", s.row.name.c_str(), s.row.size,
                num(Median(s.p50), 1).c_str(), num(Median(s.p99), 1).c_str(), num(Median(s.gbps), 3).c_str(),
                ratio(Median(s.lat_ratio)).c_str(), ratio(Median(s.bw_ratio)).c_str());
  if (many) {
    std::printf("\n(%d rounds: each cell is the median over the rounds; each ratio the median of the rounds'\n"
                " ratios, every round's own ratios below)\n",
                f.rounds);
    for (const auto& s : table) {
      if (s.lat_ratio.empty() && s.bw_ratio.empty()) continue;
      std::string line = absl::StrCat("  ", s.row.name, " ", s.row.size, " B");
      if (!s.lat_ratio.empty()) {
        absl::StrAppend(&line, ": p50 vs 2x ib_send_lat");
        for (double v : s.lat_ratio) absl::StrAppend(&line, absl::StrFormat(" %.2fx", v));
      }
      if (!s.bw_ratio.empty()) {
        absl::StrAppend(&line, "; Gb/s vs ib_write_bw");
        for (double v : s.bw_ratio) absl::StrAppend(&line, absl::StrFormat(" %.2fx", v));
      }
      std::printf("%s\n", line.c_str());
    }
  }
  std::printf("\n(perftest rows: p50/p99 = 2 x ib_send_lat t_typical / 99%%, one-way x 2 = round trip;\n"
              " Gb/s = ib_write_bw BW average. Inside the Soft-RoCE VM only ratios mean anything.)\n");
  return 0;
}
