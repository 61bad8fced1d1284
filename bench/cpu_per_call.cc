// CPU budget per call, counted rather than timed: user-space instructions
// (callgrind) and heap allocations (bench/alloc_hooks.cc) per unary echo,
// client and server together, for rdmarpc over tcp:// and rdma:// and for
// gRPC over the same messages.
//
//   cpu_per_call [--transport=tcp,rdma,grpc] [--calls=N] [--warmup=N] [--size=B]
//                [--concurrency=N] [--callgrind] [--device=NAME] [--ip=ADDR]
//                [--poll=event|adaptive|busy] [--rtc]
//
// rdmarpc rows run client and server on ONE io_context on ONE thread (the
// RDMA connection by default in event mode: completion channels in the
// reactor, no poller thread), so every instruction of a call, both sides, is
// on that thread and the count does not depend on scheduling. --poll=adaptive
// --rtc keeps that one thread and polls the CQs on it (no syscall while calls
// flow); its count includes the polls that found nothing, so it varies a
// little from run to run. --poll without --rtc adds poller threads, which
// callgrind counts too (their spinning is CPU the call costs). For tcp,
// --poll=adaptive|busy is TcpOptions::poll_mode: the same thread polls the
// sockets with non-blocking recv() instead of waiting in epoll (no threads
// to add, so --rtc changes nothing there). gRPC runs as its API
// wants (server completion-queue thread, client on the main thread, its own
// internal threads); callgrind counts all of them.
//
// --callgrind re-runs this binary once per transport under
// `valgrind --tool=callgrind --instr-atstart=no`; the child switches
// instrumentation on (CALLGRIND_START_INSTRUMENTATION) only for the measured
// calls, and the parent divides callgrind's total by the calls. Without
// --callgrind, only allocations and wall time are printed. Prints; asserts
// nothing (tests/rpc/rpc_alloc_test.cc is the test).
#include <sys/wait.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/alloc_hooks.h"
#include "bench/bench_common.h"
#include "rdmarpc/bench/echo.pb.h"
#include "rdmarpc/bench/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"

#if RDMARPC_BENCH_HAVE_GRPC
#include <grpcpp/grpcpp.h>

#include "rdmarpc/bench/grpc_echo.grpc.pb.h"
#endif

namespace rdmarpc::bench {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::string> transports = {"tcp", "grpc"};
  uint64_t calls = 20'000;
  uint64_t warmup = 2'000;
  size_t size = 64;
  int concurrency = 1;
  bool callgrind = false;
  bool child = false;  // Internal: one transport, measured phase instrumented.
  int alloc_trace = 0;  // Print the stacks of this many measured-phase allocations.
  std::string device, ip;
  // The poll mode (rdma: and run to completion, busy/adaptive; tcp: the
  // executor's thread polls the socket, TcpOptions::poll_mode).
  rdma::PollMode poll = rdma::PollMode::kEvent;
  bool rtc = false;
  // The server answers from the generated inline fast path (EchoInline), not
  // from the coroutine handler.
  bool inline_handler = false;
  // The io_context's concurrency hint: BOOST_ASIO_CONCURRENCY_HINT_UNSAFE_IO
  // (no locking around each descriptor's reactor operations; the scheduler
  // keeps its lock) instead of 1.
  bool unsafe_io = false;
  // Calls go in bursts of `concurrency`, each started from a posted task
  // (outside any completion handler, as a timer or another component would
  // start them); the next once the whole burst is done. `batch`: each burst
  // inside a Channel::Batch (one doorbell / one sendmsg for the burst).
  bool burst = false;
  bool batch = false;
  // rdma: RdmaOptions::recv_repost_batch (0: the default, recv_depth / 8;
  // 1: every receive reposted alone), for an A/B in one boot.
  int repost_batch = 0;
};

[[noreturn]] void Usage(const std::string& why) {
  if (!why.empty()) std::fprintf(stderr, "cpu_per_call: %s\n\n", why.c_str());
  std::fprintf(stderr,
               "usage: cpu_per_call [--transport=tcp,rdma,grpc] [--calls=N] [--warmup=N] [--size=BYTES]\n"
               "                    [--concurrency=N] [--callgrind] [--device=NAME] [--ip=ADDR] [--alloc-trace=N]\n"
               "                    [--poll=event|adaptive|busy] [--rtc]   (poll mode; rdma: run to completion)\n"
               "                    [--handler=coroutine|inline]   (the server's echo: coroutine, or inline fast path)\n"
               "                    [--io-hint=1|unsafe-io]   (tcp: the io_context's concurrency hint)\n"
               "                    [--recv-repost-batch=0..16]   (rdma: RdmaOptions::recv_repost_batch; 1: each alone)\n"
               "                    [--burst=posted|batch]   (bursts of --concurrency calls started from a posted\n"
               "                     task, one by one or in a Channel::Batch, instead of a closed loop; tcp, rdma)\n\n"
               "Unary echo, client and server in this process. Prints heap allocations per call and,\n"
               "with --callgrind (valgrind installed), user-space instructions per call, both sides\n"
               "together. rdma needs --device/--ip, or RXE_VM_DEV/RXE_VM_SELF_IP (set inside tools/rxe-vm).\n");
  std::exit(why.empty() ? 0 : 2);
}

Options Parse(int argc, char** argv) {
  Options o;
  if (const char* d = std::getenv("RXE_VM_DEV")) o.device = d;
  if (const char* ip = std::getenv("RXE_VM_SELF_IP")) o.ip = ip;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") Usage("");
    if (a == "--callgrind") { o.callgrind = true; continue; }
    if (a == "--rtc") { o.rtc = true; continue; }
    if (a == "--child") { o.child = true; continue; }
    const auto eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) Usage("unknown argument " + a);
    const std::string key = a.substr(2, eq - 2), val = a.substr(eq + 1);
    if (key == "transport") {
      o.transports = absl::StrSplit(val, ',', absl::SkipEmpty());
      for (const auto& t : o.transports)
        if (t != "tcp" && t != "rdma" && t != "grpc") Usage("--transport takes tcp, rdma, grpc (got " + t + ")");
    } else if (key == "calls") {
      if (!absl::SimpleAtoi(val, &o.calls) || o.calls == 0) Usage("--calls takes a positive count");
    } else if (key == "warmup") {
      if (!absl::SimpleAtoi(val, &o.warmup)) Usage("--warmup takes a count");
    } else if (key == "size") {
      if (!absl::SimpleAtoi(val, &o.size) || o.size > (64u << 20)) Usage("--size takes bytes (at most 64 MiB)");
    } else if (key == "concurrency") {
      if (!absl::SimpleAtoi(val, &o.concurrency) || o.concurrency < 1 || o.concurrency > 4096)
        Usage("--concurrency takes 1..4096");
    } else if (key == "alloc-trace") {
      if (!absl::SimpleAtoi(val, &o.alloc_trace) || o.alloc_trace < 0) Usage("--alloc-trace takes a count");
    } else if (key == "poll") {
      auto m = rdma::ParsePollMode(val);
      if (!m.ok()) Usage(std::string(m.status().message()));
      o.poll = *m;
    } else if (key == "io-hint") {
      if (val != "1" && val != "unsafe-io") Usage("--io-hint takes 1 or unsafe-io (got " + val + ")");
      o.unsafe_io = val == "unsafe-io";
    } else if (key == "burst") {
      if (val != "posted" && val != "batch") Usage("--burst takes posted or batch (got " + val + ")");
      o.burst = true;
      o.batch = val == "batch";
    } else if (key == "recv-repost-batch") {
      if (!absl::SimpleAtoi(val, &o.repost_batch) || o.repost_batch < 0 || o.repost_batch > 16)
        Usage("--recv-repost-batch takes 0..16 (0: recv_depth / 8, 1: each receive alone)");
    } else if (key == "handler") {
      if (val != "coroutine" && val != "inline") Usage("--handler takes coroutine or inline (got " + val + ")");
      o.inline_handler = val == "inline";
    } else if (key == "device") {
      o.device = val;
    } else if (key == "ip") {
      o.ip = val;
    } else {
      Usage("unknown flag --" + key);
    }
  }
  return o;
}

// What one measured phase produced.
struct Phase {
  uint64_t calls = 0;
  uint64_t allocs = 0;
  double wall_s = 0;
  uint64_t errors = 0;
  uint64_t doorbells = 0;  // the client connection's send_doorbells over the measured calls
};

class EchoService final : public rdmarpc::bench::Echo::Service {
 public:
  explicit EchoService(bool inline_handler) : inline_(inline_handler) {}
  asio::awaitable<Status> Echo(ServerContext&, const EchoRequest& request, EchoResponse& response) override {
    response.set_payload(request.payload());
    co_return Status();
  }
  std::optional<Status> EchoInline(ServerContext&, const EchoRequest& request, EchoResponse& response) override {
    if (!inline_) return std::nullopt;
    response.set_payload(request.payload());
    return Status();
  }

 private:
  bool inline_;
};

// Closed loop over `concurrency` slots: each completion reissues its slot
// until `warmup + calls` have been issued. Instrumentation and the
// allocation count cover exactly the completions of the measured calls.
class Loop {
 public:
  Loop(const Options& o, std::function<uint64_t()> doorbells) : o_(o), doorbells_(std::move(doorbells)) {}
  uint64_t issued = 0, completed = 0, errors = 0;
  uint64_t allocs_at_start = 0, doorbells_at_start = 0;
  Clock::time_point start;
  bool measuring = false;

  // Call when call number `completed` (1-based) finished.
  void OnCompleted(bool ok) {
    ++completed;
    if (!ok) ++errors;
    if (completed == o_.warmup) Begin();
  }
  void Begin() {
    measuring = true;
    start = Clock::now();
    allocs_at_start = AllocCount();
    doorbells_at_start = doorbells_();
    if (o_.alloc_trace > 0) TraceNextAllocs(o_.alloc_trace);
    CALLGRIND_START_INSTRUMENTATION;
  }
  Phase End() {
    CALLGRIND_STOP_INSTRUMENTATION;
    TraceNextAllocs(0);
    Phase p;
    p.allocs = AllocCount() - allocs_at_start;
    p.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
    p.calls = completed - o_.warmup;
    p.errors = errors;
    p.doorbells = doorbells_() - doorbells_at_start;
    return p;
  }
  bool more() const { return issued < o_.warmup + o_.calls; }
  bool done() const { return completed >= o_.warmup + o_.calls; }

 private:
  const Options& o_;
  std::function<uint64_t()> doorbells_;
};

absl::StatusOr<Phase> RunRdmarpc(const Options& o, const std::string& transport) {
  TransportOptions topts;
  std::string host = "127.0.0.1";
  if (transport == "rdma") {
    if (o.unsafe_io)
      return absl::InvalidArgumentError("--io-hint=unsafe-io is for tcp only (not checked with the rdma pollers' threads)");
    if (o.ip.empty())
      return absl::InvalidArgumentError("rdma needs --ip (an address on the RDMA device's netdev), or run inside tools/rxe-vm");
    auto c = rdma::RdmaContext::Open({.name = o.device});
    if (!c.ok()) return c.status();
    topts.rdma_context = *c;
    topts.rdma.poll_mode = o.poll;
    topts.rdma.run_to_completion = o.rtc;
    topts.rdma.recv_repost_batch = static_cast<uint16_t>(o.repost_batch);
    host = o.ip;
  } else {
    topts.tcp.poll_mode = *transport::tcp::ParsePollMode(rdma::PollModeName(o.poll));  // same three names
  }
  // One thread runs everything. Hint 1 still locks the scheduler and each
  // descriptor; UNSAFE_IO drops the descriptor locks (safe with one thread
  // and TCP: nothing else touches the reactor).
  asio::io_context io(o.unsafe_io ? BOOST_ASIO_CONCURRENCY_HINT_UNSAFE_IO : 1);
  EchoService service(o.inline_handler);
  ServerOptions so;
  so.listen = {absl::StrCat(transport, "://", host, ":0")};
  so.transport = topts;
  auto server = std::make_unique<Server>(io.get_executor(), so);
  if (auto st = server->AddService(service); !st.ok()) return absl::InternalError(st.ToString());
  if (auto st = server->Start(); !st.ok()) return absl::UnavailableError(st.ToString());
  ChannelOptions co;
  co.transport = topts;
  auto channel = Channel::Create(io.get_executor(), server->local_uris().at(0), co);
  if (!channel.ok()) return absl::InvalidArgumentError(channel.status().ToString());

  rdmarpc::bench::Echo::Stub stub(*channel);
  struct Slot {
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
  };
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < o.concurrency; ++i) {
    slots.push_back(std::make_unique<Slot>());
    slots.back()->req.set_payload(std::string(o.size, 'x'));
  }
  Loop loop(o, [&] {
    auto s = (*channel)->connection_stats();
    return s ? s->send_doorbells : 0;
  });
  int outstanding = 0;  // --burst: calls of the burst not completed yet
  std::function<void()> burst;
  std::function<void(int)> issue = [&](int i) {
    Slot& s = *slots[static_cast<size_t>(i)];
    ++loop.issued;
    stub.async_Echo(s.ctx, s.req, s.resp, [&, i](boost::system::error_code ec) {
      Slot& done = *slots[static_cast<size_t>(i)];
      loop.OnCompleted(!ec && done.resp.payload().size() == o.size);
      if (!o.burst) {
        if (loop.more()) issue(i);
      } else if (--outstanding == 0 && loop.more()) {
        asio::post(io, [&] { burst(); });
      }
      if (loop.done()) io.stop();
    });
  };
  burst = [&] {
    std::optional<Channel::Batch> batch;
    if (o.batch) batch.emplace(**channel);
    for (int i = 0; i < o.concurrency && loop.more(); ++i) {
      ++outstanding;
      issue(i);
    }
  };
  if (o.warmup == 0) loop.Begin();
  if (o.burst) {
    asio::post(io, [&] { burst(); });
  } else {
    for (int i = 0; i < o.concurrency && loop.more(); ++i) issue(i);
  }
  // run(), not a run_one() loop: Asio keeps its per-thread recycling caches
  // (coroutine frames, cancellation state) only for the life of one run call.
  asio::steady_timer give_up(io, std::chrono::minutes(30));
  give_up.async_wait([&](boost::system::error_code ec) {
    if (!ec) io.stop();
  });
  io.run();
  give_up.cancel();
  io.restart();
  Phase p = loop.End();
  (*channel)->Close();
  server->async_shutdown(std::chrono::milliseconds(0), [] {});
  io.run_for(std::chrono::milliseconds(200));
  if (!loop.done()) return absl::DeadlineExceededError(absl::StrCat(loop.completed, " calls completed in 30 min"));
  return p;
}

#if RDMARPC_BENCH_HAVE_GRPC
absl::StatusOr<Phase> RunGrpc(const Options& o) {
  using EchoGrpc = rdmarpc::bench::grpcsvc::Echo;
  // The same server the RPC benchmark's gRPC row uses (grpc_row.cc).
  auto server = GrpcServer::Start("127.0.0.1:0", o.concurrency);
  if (!server.ok()) return server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = EchoGrpc::NewStub(channel);
  grpc::CompletionQueue cq;
  struct Slot {
    std::optional<grpc::ClientContext> ctx;
    EchoRequest req;
    EchoResponse resp;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<EchoResponse>> rpc;
  };
  std::vector<Slot> slots(static_cast<size_t>(o.concurrency));
  for (auto& s : slots) s.req.set_payload(std::string(o.size, 'x'));
  Loop loop(o, [] { return uint64_t{0}; });
  auto issue = [&](int i) {
    Slot& s = slots[static_cast<size_t>(i)];
    ++loop.issued;
    s.rpc.reset();
    s.ctx.emplace();
    s.rpc = stub->AsyncEcho(&*s.ctx, s.req, &cq);
    s.rpc->Finish(&s.resp, &s.status, reinterpret_cast<void*>(static_cast<intptr_t>(i)));
  };
  if (o.warmup == 0) loop.Begin();
  for (int i = 0; i < o.concurrency && loop.more(); ++i) issue(i);
  while (!loop.done()) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) break;
    const int i = static_cast<int>(reinterpret_cast<intptr_t>(tag));
    Slot& s = slots[static_cast<size_t>(i)];
    loop.OnCompleted(ok && s.status.ok() && s.resp.payload().size() == o.size);
    if (loop.more()) issue(i);
  }
  Phase p = loop.End();
  for (auto& s : slots) s.rpc.reset();
  stub.reset();
  channel.reset();
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  server->reset();
  return p;
}
#endif

absl::StatusOr<Phase> RunOne(const Options& o, const std::string& transport) {
  if (transport == "grpc") {
#if RDMARPC_BENCH_HAVE_GRPC
    return RunGrpc(o);
#else
    return absl::UnimplementedError(
        "this cpu_per_call was built without gRPC (install libgrpc++-dev protobuf-compiler-grpc, re-run cmake)");
#endif
  }
  return RunRdmarpc(o, transport);
}

// Child mode: one transport, one machine-readable line on stdout.
int Child(const Options& o) {
  auto p = RunOne(o, o.transports.at(0));
  if (!p.ok()) {
    std::fprintf(stderr, "cpu_per_call: %s: %s\n", o.transports[0].c_str(), p.status().ToString().c_str());
    return 1;
  }
  std::printf("PHASE calls=%llu allocs=%llu errors=%llu wall_s=%.6f doorbells=%llu\n",
              static_cast<unsigned long long>(p->calls), static_cast<unsigned long long>(p->allocs),
              static_cast<unsigned long long>(p->errors), p->wall_s, static_cast<unsigned long long>(p->doorbells));
  return 0;
}

std::optional<uint64_t> ReadCallgrindTotal(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::optional<uint64_t> total;
  while (std::getline(in, line)) {
    for (const char* key : {"totals: ", "summary: "}) {
      if (line.rfind(key, 0) == 0) {
        uint64_t v = 0;
        std::string first = line.substr(std::string(key).size());
        first = first.substr(0, first.find(' '));
        if (absl::SimpleAtoi(first, &v)) total = v;
      }
    }
  }
  return total;
}

struct CountRow {
  std::string transport;
  Phase phase;
  std::optional<uint64_t> instructions;
};

absl::StatusOr<CountRow> RunUnderCallgrind(const Options& o, const std::string& self, const std::string& transport) {
  const std::string out = absl::StrCat("/tmp/cpu_per_call.", getpid(), ".", transport, ".callgrind");
  std::vector<std::string> args = {"valgrind",
                                   "--tool=callgrind",
                                   "--instr-atstart=no",
                                   "--quiet",
                                   "--vgdb=no",  // its FIFO in /tmp fails on the VM's 9p root
                                   absl::StrCat("--callgrind-out-file=", out),
                                   self,
                                   "--child",
                                   absl::StrCat("--transport=", transport),
                                   absl::StrCat("--calls=", o.calls),
                                   absl::StrCat("--warmup=", o.warmup),
                                   absl::StrCat("--size=", o.size),
                                   absl::StrCat("--concurrency=", o.concurrency)};
  if (!o.device.empty()) args.push_back(absl::StrCat("--device=", o.device));
  args.push_back(absl::StrCat("--poll=", rdma::PollModeName(o.poll)));
  if (o.rtc) args.push_back("--rtc");
  if (o.inline_handler) args.push_back("--handler=inline");
  if (o.unsafe_io) args.push_back("--io-hint=unsafe-io");
  if (o.repost_batch != 0) args.push_back(absl::StrCat("--recv-repost-batch=", o.repost_batch));
  if (o.burst) args.push_back(o.batch ? "--burst=batch" : "--burst=posted");
  if (!o.ip.empty()) args.push_back(absl::StrCat("--ip=", o.ip));
  int pipefd[2];
  if (pipe(pipefd) != 0) return absl::InternalError("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(pipefd[1], STDOUT_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp("valgrind", argv.data());
    std::fprintf(stderr, "cpu_per_call: cannot run valgrind (apt-get install valgrind)\n");
    _exit(127);
  }
  close(pipefd[1]);
  std::string output;
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) output.append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return absl::InternalError(absl::StrCat("the callgrind run of ", transport, " failed (exit ",
                                            WIFEXITED(status) ? WEXITSTATUS(status) : -1, ")"));
  CountRow row;
  row.transport = transport;
  const auto at = output.find("PHASE ");
  if (at == std::string::npos) return absl::InternalError("the callgrind child printed no result");
  unsigned long long calls = 0, allocs = 0, errors = 0, doorbells = 0;
  double wall = 0;
  if (std::sscanf(output.c_str() + at, "PHASE calls=%llu allocs=%llu errors=%llu wall_s=%lf doorbells=%llu", &calls,
                  &allocs, &errors, &wall, &doorbells) != 5)
    return absl::InternalError("cannot parse the callgrind child's result");
  row.phase = {calls, allocs, wall, errors, doorbells};
  row.instructions = ReadCallgrindTotal(out);
  std::remove(out.c_str());
  if (!row.instructions) return absl::InternalError(absl::StrCat("no total in ", out));
  return row;
}

}  // namespace
}  // namespace rdmarpc::bench

int main(int argc, char** argv) {
  using namespace rdmarpc::bench;
  WarmAllocTracing();
  const Options o = Parse(argc, argv);
  if (o.child) return Child(o);
  std::vector<CountRow> rows;
  int failures = 0;
  for (const auto& t : o.transports) {
    if (o.callgrind) {
      char self[4096];
      const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
      if (len <= 0) return 1;
      self[len] = '\0';
      std::fprintf(stderr, "  %s under callgrind: %llu + %llu calls ...\n", t.c_str(),
                   static_cast<unsigned long long>(o.warmup), static_cast<unsigned long long>(o.calls));
      auto r = RunUnderCallgrind(o, self, t);
      if (!r.ok()) {
        std::fprintf(stderr, "cpu_per_call: %s: %s\n", t.c_str(), r.status().ToString().c_str());
        ++failures;
        continue;
      }
      rows.push_back(*r);
    } else {
      auto p = RunOne(o, t);
      if (!p.ok()) {
        std::fprintf(stderr, "cpu_per_call: %s: %s\n", t.c_str(), p.status().ToString().c_str());
        ++failures;
        continue;
      }
      rows.push_back({t, *p, std::nullopt});
    }
  }
  std::printf("| transport | size B | conc | calls | instructions/call | allocs/call | errors | wall us/call | client doorbells/call |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  const CountRow* grpc = nullptr;
  for (const auto& r : rows)
    if (r.transport == "grpc") grpc = &r;
  for (const auto& r : rows) {
    const double calls = static_cast<double>(r.phase.calls);
    std::string ins = "-";
    if (r.instructions) {
      ins = absl::StrCat(static_cast<uint64_t>(static_cast<double>(*r.instructions) / calls));
      if (grpc != nullptr && grpc != &r && grpc->instructions)
        ins += absl::StrFormat(" (%.3fx gRPC)", (static_cast<double>(*r.instructions) / calls) /
                                                    (static_cast<double>(*grpc->instructions) /
                                                     static_cast<double>(grpc->phase.calls)));
    }
    const std::string label = r.transport == "grpc" ? r.transport
                              : absl::StrCat(r.transport, o.inline_handler ? " (inline handler" : " (coroutine handler",
                                             o.unsafe_io ? ", UNSAFE_IO" : "",
                                             r.transport == "tcp" && o.poll != rdmarpc::rdma::PollMode::kEvent
                                                 ? absl::StrCat(", poll=", rdmarpc::rdma::PollModeName(o.poll))
                                                 : "",
                                             o.burst ? (o.batch ? ", bursts in a Channel::Batch" : ", posted bursts") : "",
                                             ")");
    const std::string doorbells =
        r.transport == "grpc" ? "-" : absl::StrFormat("%.2f", static_cast<double>(r.phase.doorbells) / calls);
    std::printf("| %s | %zu | %d | %llu | %s | %.2f | %llu | %.1f | %s |\n", label.c_str(), o.size, o.concurrency,
                static_cast<unsigned long long>(r.phase.calls), ins.c_str(),
                static_cast<double>(r.phase.allocs) / calls, static_cast<unsigned long long>(r.phase.errors),
                r.phase.wall_s * 1e6 / calls, doorbells.c_str());
  }
  std::printf(
      "\ninstructions/call: callgrind's user-space instruction total over the measured calls, client and server\n"
      "together (all threads), divided by the calls; syscalls and the kernel are not counted. allocs/call: every\n"
      "malloc/new in the process over the same calls. wall us/call under callgrind is ~50x slower than native.\n"
      "client doorbells/call: the client connection's send_doorbells (RDMA: ibv_post_send calls; TCP: writes).\n");
  return failures == 0 ? 0 : 1;
}
