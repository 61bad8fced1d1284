// RPC echo benchmark: rdmarpc over rdma:// and tcp://, side by side with gRPC
// over the same messages, with perftest's raw-verbs figures as ceilings.
// Server and client live in this process (loopback), each on its own thread
// with its own event loop. Prints; asserts nothing. See `--help` and
// docs/benchmarks.md.
//
// Allocations: linked with bench/alloc_hooks.cc, which counts every malloc
// (so operator new too) in the process; rows report heap allocations per call
// over the measured phase.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "bench/poll_some.h"
#include "rdmarpc/bench/echo.pb.h"
#include "rdmarpc/bench/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"

namespace rdmarpc::bench {

namespace {

namespace asio = boost::asio;

// The server's handler: the response carries the request's bytes back.
class EchoService final : public rdmarpc::bench::Echo::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext&, const EchoRequest& request, EchoResponse& response) override {
    response.set_payload(request.payload());
    co_return Status();
  }
  std::optional<Status> EchoInline(ServerContext&, const EchoRequest& request, EchoResponse& response) override {
    if (!inline_handler) return std::nullopt;
    response.set_payload(request.payload());
    return Status();
  }
  bool inline_handler = false;  // --handler=inline
};

// Runs `io` on this thread until `done()`: sleeping in epoll between events,
// or (spin) polling without ever sleeping, as a latency-critical deployment
// would. `tick` runs at `wake()` and at least every 50 ms.
template <typename Done, typename Wake, typename Tick>
void Drive(asio::io_context& io, bool spin, Done done, Wake wake, Tick tick) {
  if (spin) {
    while (!done()) {
      PollSome(io);
      if (io.stopped()) io.restart();
      // wake() moves earlier when a completion frees an open-loop slot.
      if (Clock::now() >= wake()) tick();
    }
    return;
  }
  asio::steady_timer timer(io);
  bool armed = false;
  Clock::time_point expiry;
  while (!done()) {
    const auto w = wake();
    // A completion may have made the next due call earlier than the armed
    // expiry (an open-loop slot came free): re-arm, or that call waits.
    if (armed && w < expiry) timer.cancel();
    if (!armed) {
      armed = true;
      expiry = w;
      timer.expires_at(w);
      timer.async_wait([&](boost::system::error_code ec) {
        armed = false;
        if (!ec) tick();
      });
    }
    io.run_one_for(std::chrono::milliseconds(100));
  }
  timer.cancel();
  while (armed && io.run_one_for(std::chrono::milliseconds(100)) > 0) {
  }
}

TransportOptions MakeOptions(const Flags& f, const std::shared_ptr<rdma::RdmaContext>& ctx) {
  TransportOptions o;
  o.rdma_context = ctx;
  o.rdma.poll_mode = *rdma::ParsePollMode(f.poll);
  o.rdma.run_to_completion = f.rtc;
  o.tcp.poll_mode = *transport::tcp::ParsePollMode(f.tcp_poll);  // checked by ParseFlags
  return o;
}

// The echo server of one transport, on its own thread and event loop
// (--role=both runs it next to the client; --role=server runs only these).
class LocalServer {
 public:
  absl::Status Start(const Flags& f, const std::string& listen_uri, const TransportOptions& options) {
    ServerOptions so;
    so.listen = {listen_uri};
    so.transport = options;
    service_.inline_handler = f.inline_handler;
    server_ = std::make_unique<Server>(io_.get_executor(), so);
    if (auto st = server_->AddService(service_); !st.ok()) return absl::InternalError(st.ToString());
    if (auto st = server_->Start(); !st.ok()) return absl::UnavailableError(st.ToString());
    uri_ = server_->local_uris().at(0);
    thread_ = std::thread([this, spin = f.spin] {
      if (!spin) return (void)io_.run();
      while (!stop_.load(std::memory_order_relaxed)) {
        PollSome(io_);
        if (io_.stopped()) io_.restart();
      }
    });
    cpu_ = CpuClock::Thread(thread_.native_handle());
    return absl::OkStatus();
  }
  void Stop() {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] { server_.reset(); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    work_.reset();
    stop_ = true;
    io_.stop();
    thread_.join();
  }
  ~LocalServer() { Stop(); }
  const std::string& uri() const { return uri_; }
  const CpuClock& cpu() const { return cpu_; }

 private:
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_ = asio::make_work_guard(io_);
  EchoService service_;
  std::unique_ptr<Server> server_;
  std::string uri_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  CpuClock cpu_ = CpuClock::None();
};

absl::StatusOr<std::shared_ptr<rdma::RdmaContext>> OpenDevice(const Flags& f) {
  if (f.ip.empty() && f.role != Role::kClient)
    return absl::InvalidArgumentError("rdma needs --ip (an address on the RDMA device's netdev), or run inside tools/rxe-vm");
  return rdma::RdmaContext::Open({.name = f.device});
}

// --role=server: echo servers for every transport asked for, on fixed ports
// (rdma --port, tcp --port+1, grpc --port+2), until SIGINT or SIGTERM.
absl::Status ServeForever(const Flags& f) {
  std::vector<std::unique_ptr<LocalServer>> servers;
  for (const auto& t : f.transports) {
    if (t == "grpc") continue;
    std::shared_ptr<rdma::RdmaContext> ctx;
    if (t == "rdma") {
      auto c = OpenDevice(f);
      if (!c.ok()) return c.status();
      ctx = *c;
    }
    const std::string host = !f.ip.empty() ? f.ip : "0.0.0.0";
    auto s = std::make_unique<LocalServer>();
    if (auto st = s->Start(f, absl::StrCat(t, "://", host, ":", f.port + PortOffset(t)), MakeOptions(f, ctx)); !st.ok())
      return st;
    std::printf("rdmarpc_bench: serving %s\n", s->uri().c_str());
    servers.push_back(std::move(s));
  }
#if RDMARPC_BENCH_HAVE_GRPC
  std::unique_ptr<GrpcServer> grpc;
  if (std::find(f.transports.begin(), f.transports.end(), "grpc") != f.transports.end()) {
    auto g = GrpcServer::Start(absl::StrCat(!f.ip.empty() ? f.ip : "0.0.0.0", ":", f.port + PortOffset("grpc")), 64);
    if (!g.ok()) return g.status();
    grpc = std::move(*g);
    std::printf("rdmarpc_bench: serving grpc://%s\n", grpc->address().c_str());
  }
#endif
  std::printf("rdmarpc_bench: server ready; run the client with --role=client --server=<this host> --port=%d "
              "(Ctrl-C stops)\n", f.port);
  std::fflush(stdout);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  std::printf("rdmarpc_bench: signal %d, stopping\n", sig);
  for (auto& s : servers) s->Stop();
  return absl::OkStatus();
}

// All rows of one rdmarpc transport ("rdma" or "tcp"): one server (unless
// --role=client: the one at --server) and one channel (one connection) for
// every size and concurrency.
absl::Status RunRdmarpc(const Flags& f, const std::string& transport, const std::function<void(const Row&)>& emit) {
  std::shared_ptr<rdma::RdmaContext> ctx;
  std::string host = "127.0.0.1";
  if (transport == "rdma") {
    auto c = OpenDevice(f);
    if (!c.ok()) return c.status();
    ctx = *c;
    host = f.ip;
  }
  const TransportOptions options = MakeOptions(f, ctx);

  asio::io_context client_io;
  LocalServer local;
  std::string uri;
  CpuClock server_cpu = CpuClock::None();
  if (f.role == Role::kClient) {
    uri = absl::StrCat(transport, "://", f.server, ":", f.port + PortOffset(transport));
  } else {
    if (auto st = local.Start(f, absl::StrCat(transport, "://", host, ":0"), options); !st.ok()) return st;
    uri = local.uri();
    server_cpu = local.cpu();
  }
  auto finish_server = [&] { local.Stop(); };

  ChannelOptions co;
  co.transport = options;
  auto channel = Channel::Create(client_io.get_executor(), uri, co);
  if (!channel.ok()) {
    finish_server();
    return absl::InvalidArgumentError(channel.status().ToString());
  }
  std::optional<boost::system::error_code> connected;
  (*channel)->async_connect([&](boost::system::error_code ec) { connected = ec; });
  const auto connect_deadline = Clock::now() + std::chrono::seconds(60);
  while (!connected && Clock::now() < connect_deadline) client_io.run_one_for(std::chrono::milliseconds(100));
  if (!connected || *connected) {
    const std::string why = connected ? (*channel)->last_error().ToString() : "timed out after 60 s";
    (*channel)->Close();
    client_io.run_for(std::chrono::milliseconds(100));
    finish_server();
    return absl::UnavailableError(absl::StrCat("connect to ", uri, ": ", why));
  }

  rdmarpc::bench::Echo::Stub stub(*channel);
  const std::string poll = transport == "rdma" ? f.poll + (f.rtc ? "+rtc" : "")
                           : transport == "tcp" && f.tcp_poll != "event" ? f.tcp_poll
                                                                       : "-";
  for (size_t size : f.sizes) {
    for (int conc : f.concurrency) {
      struct Slot {
        ClientContext ctx;
        EchoRequest req;
        EchoResponse resp;
      };
      std::vector<std::unique_ptr<Slot>> slots;
      for (int i = 0; i < conc; ++i) {
        slots.push_back(std::make_unique<Slot>());
        slots.back()->req.set_payload(std::string(size, 'x'));
      }
      std::unique_ptr<LoadGen> lg;
      lg = std::make_unique<LoadGen>(f, size, conc, [&](int i) {
        Slot& s = *slots[static_cast<size_t>(i)];
        stub.async_Echo(s.ctx, s.req, s.resp, [&lg, &s, i, size](boost::system::error_code ec) {
          lg->Completed(i, !ec && s.resp.payload().size() == size);
        });
      });
      lg->label = absl::StrCat(transport, " ", size, "B c=", conc, f.mode == Mode::kOpen ? " open" : "");
      lg->client_cpu = CpuClock::Thread(pthread_self());
      lg->server_cpu = server_cpu;
      lg->Start();
      Drive(client_io, f.spin, [&] { return lg->done(); }, [&] { return lg->NextWake(); }, [&] { lg->Tick(); });
      Row row = lg->Result(transport, poll);
      if (row.count == 0 && slots[0]->ctx.status().code() != StatusCode::kOk)
        row.note = slots[0]->ctx.status().ToString();
      emit(row);
    }
  }
  (*channel)->Close();
  client_io.run_for(std::chrono::milliseconds(100));
  finish_server();
  return absl::OkStatus();
}

// ---- output -------------------------------------------------------------------------

std::string Fmt(double v, int prec = 1) { return absl::StrFormat("%.*f", prec, v); }
std::string Pct(double v) { return v < 0 ? "-" : Fmt(v, 0); }

void PrintTable(FILE* out, const std::vector<Row>& rows) {
  std::fprintf(out,
               "\n| transport | size B | mode | conc | calls | p50 us | p90 us | p99 us | p99.9 us | max us | "
               "rps | Gb/s | client CPU%% | server CPU%% | process CPU%% | CPU us/call | allocs/call |\n"
               "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : rows) {
    std::string name = r.transport + (r.poll != "-" ? "/" + r.poll : "");
    std::fprintf(out, "| %s | %zu | %s | %d | %llu | %s | %s | %s | %s | %s | %.0f | %.3f | %s | %s | %s | %s | %s |%s\n",
                 name.c_str(), r.size, r.mode == Mode::kOpen ? absl::StrCat("open@", r.rate).c_str() : "closed",
                 r.concurrency, static_cast<unsigned long long>(r.count), Fmt(r.p50).c_str(), Fmt(r.p90).c_str(),
                 Fmt(r.p99).c_str(), Fmt(r.p999).c_str(), Fmt(r.max).c_str(), r.rps, r.gbps,
                 Pct(r.client_cpu_pct).c_str(), Pct(r.server_cpu_pct).c_str(), Pct(r.process_cpu_pct).c_str(),
                 Fmt(r.cpu_us_per_call, 2).c_str(), Fmt(r.allocs_per_call, 2).c_str(),
                 r.note.empty() ? "" : absl::StrCat(" ", r.note, r.errors ? absl::StrCat(" (", r.errors, " errors)") : "").c_str());
  }
}

// Ratios of each rdmarpc row to the matching row of `base` (same size, mode, concurrency).
void PrintRatios(FILE* out, const std::vector<Row>& rows, const std::string& num, const std::string& base) {
  bool header = false;
  for (const auto& a : rows) {
    if (a.transport != num) continue;
    for (const auto& b : rows) {
      if (b.transport != base || b.size != a.size || b.concurrency != a.concurrency || b.mode != a.mode) continue;
      if (!header) {
        std::fprintf(out, "\n%s / %s (lower is better for latency and CPU; higher for rps):\n\n"
                          "| size B | conc | p50 | p99 | rps | CPU us/call | allocs/call (%s vs %s) |\n"
                          "|---:|---:|---:|---:|---:|---:|---|\n",
                     num.c_str(), base.c_str(), num.c_str(), base.c_str());
        header = true;
      }
      auto ratio = [](double x, double y) { return y > 0 ? absl::StrFormat("%.2fx", x / y) : std::string("-"); };
      std::fprintf(out, "| %zu | %d | %s | %s | %s | %s | %.2f vs %.2f |\n", a.size, a.concurrency,
                   ratio(a.p50, b.p50).c_str(), ratio(a.p99, b.p99).c_str(), ratio(a.rps, b.rps).c_str(),
                   ratio(a.cpu_us_per_call, b.cpu_us_per_call).c_str(), a.allocs_per_call, b.allocs_per_call);
    }
  }
}

void PrintCeilings(FILE* out, const std::vector<Row>& rows, const std::vector<Ceiling>& ceilings) {
  std::fprintf(out, "\nperftest ceilings (round trip = 2 x ib_send_lat; Gb/s = ib_write_bw average), and rdma rows "
                    "against them (concurrency 1 for latency, the best row for Gb/s):\n\n"
                    "| size B | 2x ib_send_lat p50 us | p99 us | ib_write_bw Gb/s | rdma p50 / ceiling | rdma Gb/s / ceiling |\n"
                    "|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& c : ceilings) {
    std::string lat = "-", bw = "-";
    double best_gbps = 0;
    for (const auto& r : rows) {
      if (r.transport != "rdma" || r.size != c.size) continue;
      if (r.concurrency == 1 && c.rtt_p50_us > 0) lat = absl::StrFormat("%.2fx", r.p50 / c.rtt_p50_us);
      best_gbps = std::max(best_gbps, r.gbps);
    }
    if (c.bw_gbps > 0 && best_gbps > 0) bw = absl::StrFormat("%.2fx", best_gbps / c.bw_gbps);
    std::fprintf(out, "| %zu | %s | %s | %s | %s | %s |\n", c.size, c.rtt_p50_us > 0 ? Fmt(c.rtt_p50_us).c_str() : "-",
                 c.rtt_p99_us > 0 ? Fmt(c.rtt_p99_us).c_str() : "-", c.bw_gbps > 0 ? Fmt(c.bw_gbps, 3).c_str() : "-",
                 lat.c_str(), bw.c_str());
  }
}

}  // namespace
}  // namespace rdmarpc::bench

int main(int argc, char** argv) {
  using namespace rdmarpc::bench;
  WarmAllocTracing();
  const Flags f = ParseFlags(argc, argv);
  if (f.role == Role::kServer) {
    // Blocked before any thread starts, so every thread inherits the mask and
    // sigwait() in ServeForever receives them.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    if (auto st = ServeForever(f); !st.ok()) {
      std::fprintf(stderr, "rdmarpc_bench: %s\n", st.ToString().c_str());
      return 1;
    }
    return 0;
  }
  std::vector<Row> rows;
  auto emit = [&](const Row& r) {
    rows.push_back(r);
    if (f.json) {
      std::printf("%s\n", RowJson(r).c_str());
      std::fflush(stdout);
    }
  };
  int failures = 0;
  for (const auto& t : f.transports) {
    absl::Status st;
    if (t == "grpc") {
#if RDMARPC_BENCH_HAVE_GRPC
      st = RunGrpc(f, emit);
#else
      st = absl::UnimplementedError(
          "this rdmarpc_bench was built without gRPC (install libgrpc++-dev protobuf-compiler-grpc, re-run cmake)");
#endif
    } else {
      st = RunRdmarpc(f, t, emit);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "rdmarpc_bench: %s: %s\n", t.c_str(), st.ToString().c_str());
      ++failures;
    }
  }
  std::vector<Ceiling> ceilings;
  if (f.perftest) {
    for (size_t size : f.sizes) {
      if (f.progress) std::fprintf(stderr, "  perftest %zu B ...\n", size);
      ceilings.push_back(RunPerftest(f, size));
    }
  }

  FILE* out = f.json ? stderr : stdout;  // --json: stdout carries only JSON lines
  PrintTable(out, rows);
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.transport == "grpc"; })) {
    PrintRatios(out, rows, "tcp", "grpc");
    PrintRatios(out, rows, "rdma", "grpc");
  }
  PrintRatios(out, rows, "rdma", "tcp");
  if (!ceilings.empty()) PrintCeilings(out, rows, ceilings);
  std::fprintf(out,
               "\nCPU: client and server share this process. client/server CPU%% are their event-loop threads "
               "(%% of one core; '-' for gRPC,\nwhose I/O runs on its own threads); process CPU%% and CPU us/call "
               "cover every thread (client, server, pollers, gRPC's).\nallocs/call: every malloc/new in the process "
               "over the measured phase, divided by the calls completed.\nGb/s: payload bytes one way "
               "(size x rps x 8); an echo carries them both ways.\n");
  return failures == 0 ? 0 : 1;
}
