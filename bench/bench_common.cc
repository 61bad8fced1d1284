#include "bench_common.h"
#include "perftest.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::bench {

// ---- flags -------------------------------------------------------------------

namespace {

constexpr char kUsage[] =
    "usage: rdmarpc_bench [--transport=rdma,tcp,grpc] [--size=64,4096,65536,1048576]\n"
    "                     [--concurrency=1,32] [--mode=closed|open] [--rate=CALLS_PER_S]\n"
    "                     [--warmup=MS] [--duration=MS] [--device=NAME] [--ip=ADDR]\n"
    "                     [--poll=busy|adaptive|event] [--rtc] [--tcp-poll=busy|adaptive|event]\n"
    "                     [--spin] [--json] [--no-progress]\n"
    "                     [--handler=coroutine|inline]\n"
    "                     [--with-perftest] [--alloc-trace=N]\n"
    "                     [--role=both|server|client] [--server=HOST] [--port=7470]\n"
    "\n"
    "An echo RPC (bench/protos/rdmarpc/bench/echo.proto) with server and client in this\n"
    "process (--role=both, the default), each on its own thread and event loop; or on two\n"
    "hosts: --role=server on one (rdma on --port, tcp on --port+1, grpc on --port+2, bound\n"
    "to --ip if given; runs until Ctrl-C), --role=client --server=HOST on the other (server\n"
    "CPU is then not measured). One row per transport x size x\n"
    "concurrency. Closed loop: N calls in flight, each reissued when it completes. Open loop:\n"
    "calls due at --rate per second over N slots, latency measured from the due time.\n"
    "CPU and allocations are those of the whole process (client and server share it).\n"
    "rdma needs --device/--ip, or RXE_VM_DEV/RXE_VM_SELF_IP (set inside tools/rxe-vm).\n"
    "--rtc: rdma pollers run to completion (busy/adaptive): the event loop's thread polls\n"
    "the CQ, no poller thread.\n"
    "--tcp-poll: the tcp rows' connections poll their sockets from the event loop's thread\n"
    "(non-blocking recv, no epoll wake-up per message) until quiet (adaptive) or always (busy):\n"
    "the like-for-like comparison with --poll=busy --rtc. Default event.\n"
    "--handler=inline: the rdmarpc server answers from the generated inline fast path\n"
    "(EchoInline) instead of the coroutine handler.\n";

[[noreturn]] void Usage(const std::string& why) {
  if (why != "help") std::fprintf(stderr, "rdmarpc_bench: %s\n", why.c_str());
  std::fputs(kUsage, why == "help" ? stdout : stderr);
  std::exit(why == "help" ? 0 : 2);
}

template <typename T>
std::vector<T> ParseList(const std::string& key, const std::string& val, T lo, T hi) {
  std::vector<T> out;
  for (auto s : absl::StrSplit(val, ',', absl::SkipEmpty())) {
    T v{};
    if (!absl::SimpleAtoi(s, &v) || v < lo || v > hi)
      Usage(absl::StrCat("bad ", key, " value '", s, "' (", lo, "..", hi, ")"));
    out.push_back(v);
  }
  if (out.empty()) Usage(key + " needs a value");
  return out;
}

std::chrono::milliseconds ParseMs(const std::string& key, const std::string& val) {
  int ms = 0;
  if (!absl::SimpleAtoi(val, &ms) || ms < 0) Usage(key + " takes milliseconds (a non-negative integer)");
  return std::chrono::milliseconds(ms);
}

}  // namespace

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  if (const char* d = std::getenv("RXE_VM_DEV"); d && *d) f.device = d;
  if (const char* ip = std::getenv("RXE_VM_SELF_IP"); ip && *ip) f.ip = ip;
  f.progress = isatty(STDERR_FILENO) != 0 || std::getenv("RXE_VM_DEV") != nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    const std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--transport") {
      f.transports = absl::StrSplit(val, ',', absl::SkipEmpty());
      for (const auto& t : f.transports)
        if (t != "rdma" && t != "tcp" && t != "grpc") Usage("--transport takes rdma,tcp,grpc");
      if (f.transports.empty()) Usage("--transport needs a value");
    } else if (key == "--size" || key == "--sizes") {
      f.sizes = ParseList<size_t>("--size", val, 0, size_t{64} << 20);
    } else if (key == "--concurrency") {
      f.concurrency = ParseList<int>("--concurrency", val, 1, 4096);
    } else if (key == "--mode") {
      if (val == "closed") f.mode = Mode::kClosed;
      else if (val == "open") f.mode = Mode::kOpen;
      else Usage("--mode takes closed or open");
    } else if (key == "--rate") {
      if (!absl::SimpleAtod(val, &f.rate) || !(f.rate > 0) || f.rate > 1e8) Usage("--rate takes calls per second (> 0)");
    } else if (key == "--warmup") {
      f.warmup = ParseMs(key, val);
    } else if (key == "--duration") {
      f.duration = ParseMs(key, val);
      if (f.duration.count() == 0) Usage("--duration must be positive");
    } else if (key == "--device") {
      f.device = val;
    } else if (key == "--ip") {
      f.ip = val;
    } else if (key == "--poll") {
      if (auto m = rdma::ParsePollMode(val); !m.ok()) Usage("--poll: " + std::string(m.status().message()));
      f.poll = val;
    } else if (key == "--tcp-poll") {
      if (auto m = transport::tcp::ParsePollMode(val); !m.ok()) Usage("--tcp-poll: " + std::string(m.status().message()));
      f.tcp_poll = val;
    } else if (key == "--spin") {
      f.spin = true;
    } else if (key == "--rtc") {
      f.rtc = true;
    } else if (key == "--handler") {
      if (val != "coroutine" && val != "inline") Usage("--handler takes coroutine or inline");
      f.inline_handler = val == "inline";
    } else if (key == "--json") {
      f.json = true;
    } else if (key == "--no-progress") {
      f.progress = false;
    } else if (key == "--progress") {
      f.progress = true;
    } else if (key == "--with-perftest") {
      f.perftest = true;
    } else if (key == "--alloc-trace") {
      if (!absl::SimpleAtoi(val, &f.alloc_trace) || f.alloc_trace < 0) Usage("--alloc-trace takes a count");
    } else if (key == "--role") {
      if (val == "both") f.role = Role::kBoth;
      else if (val == "server") f.role = Role::kServer;
      else if (val == "client") f.role = Role::kClient;
      else Usage("--role takes both, server or client");
    } else if (key == "--server") {
      if (val.empty()) Usage("--server takes the host running --role=server");
      f.server = val;
    } else if (key == "--port") {
      if (!absl::SimpleAtoi(val, &f.port) || f.port < 1 || f.port > 65533) Usage("--port takes 1..65533");
    } else if (key == "--help" || key == "-h") {
      Usage("help");
    } else {
      Usage("unknown flag '" + a + "'");
    }
  }
  if (f.mode == Mode::kOpen && f.rate <= 0) Usage("--mode=open needs --rate");
  if (f.role == Role::kClient && f.server.empty()) Usage("--role=client needs --server=HOST (where --role=server runs)");
  if (f.role != Role::kClient && !f.server.empty()) Usage("--server is for --role=client");
  if (f.role != Role::kBoth && f.perftest)
    Usage("--with-perftest runs both perftest sides on this host: use it with --role=both, or run "
          "ib_send_lat/ib_write_bw by hand on the two hosts");
  return f;
}

// ---- histogram ---------------------------------------------------------------

size_t Histogram::Index(uint64_t ns) {
  constexpr uint64_t kExact = uint64_t{2} << kSubBits;  // 256: exact below
  if (ns < kExact) return static_cast<size_t>(ns);
  const int msb = 63 - std::countl_zero(ns);
  const int shift = msb - kSubBits;                     // >= 1
  const uint64_t top = ns >> shift;                     // [128, 256)
  return std::min(kBuckets - 1, static_cast<size_t>(shift) * (size_t{1} << kSubBits) + static_cast<size_t>(top));
}

double Histogram::Middle(size_t index) {
  constexpr size_t kExact = size_t{2} << kSubBits;
  if (index < kExact) return static_cast<double>(index);
  const size_t shift = index / (size_t{1} << kSubBits) - 1;
  const size_t top = index - shift * (size_t{1} << kSubBits);
  const double lo = std::ldexp(static_cast<double>(top), static_cast<int>(shift));
  return lo + std::ldexp(0.5, static_cast<int>(shift));
}

void Histogram::Record(uint64_t ns) {
  ++counts_[Index(ns)];
  ++count_;
  sum_ += ns;
  max_ = std::max(max_, ns);
}

void Histogram::Reset() {
  counts_.fill(0);
  count_ = sum_ = max_ = 0;
}

double Histogram::Percentile_us(double p) const {
  if (count_ == 0) return 0;
  const uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(p * static_cast<double>(count_))));
  uint64_t seen = 0;
  for (size_t i = 0; i < kBuckets; ++i) {
    seen += counts_[i];
    if (seen >= rank) return std::min(Middle(i), static_cast<double>(max_)) / 1e3;
  }
  return max_us();
}

// ---- CPU clocks ----------------------------------------------------------------

CpuClock CpuClock::Process() {
  CpuClock c;
  c.id_ = CLOCK_PROCESS_CPUTIME_ID;
  c.valid_ = true;
  return c;
}

CpuClock CpuClock::Thread(pthread_t t) {
  CpuClock c;
  c.valid_ = pthread_getcpuclockid(t, &c.id_) == 0;
  return c;
}

std::chrono::nanoseconds CpuClock::Now() const {
  if (!valid_) return {};
  timespec ts{};
  if (clock_gettime(id_, &ts) != 0) return {};
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

// ---- rows ----------------------------------------------------------------------

std::string RowJson(const Row& r) {
  auto num = [](double v) { return absl::StrFormat("%.3f", v); };
  auto pct = [&](double v) { return v < 0 ? std::string("null") : num(v); };
  return absl::StrCat(
      "{\"transport\":\"", r.transport, "\",\"poll\":\"", r.poll, "\",\"size\":", r.size, ",\"mode\":\"",
      r.mode == Mode::kOpen ? "open" : "closed", "\",\"concurrency\":", r.concurrency,
      ",\"rate\":", num(r.rate), ",\"count\":", r.count, ",\"errors\":", r.errors, ",\"p50_us\":", num(r.p50),
      ",\"p90_us\":", num(r.p90), ",\"p99_us\":", num(r.p99), ",\"p999_us\":", num(r.p999), ",\"max_us\":",
      num(r.max), ",\"mean_us\":", num(r.mean), ",\"rps\":", num(r.rps), ",\"gbps\":", absl::StrFormat("%.4f", r.gbps),
      ",\"client_cpu_pct\":", pct(r.client_cpu_pct), ",\"server_cpu_pct\":", pct(r.server_cpu_pct),
      ",\"process_cpu_pct\":", num(r.process_cpu_pct), ",\"cpu_us_per_call\":", num(r.cpu_us_per_call),
      ",\"allocs_per_call\":", num(r.allocs_per_call), ",\"note\":\"", r.note, "\"}");
}

// ---- load generator ------------------------------------------------------------

LoadGen::LoadGen(const Flags& flags, size_t size, int concurrency, Issue issue)
    : flags_(flags), size_(size), concurrency_(concurrency), issue_(std::move(issue)) {
  sent_at_.resize(static_cast<size_t>(concurrency));
  free_slots_.reserve(static_cast<size_t>(concurrency));
  if (flags_.mode == Mode::kOpen) period_ = std::chrono::duration<double, std::nano>(1e9 / flags_.rate);
}

LoadGen::Snapshot LoadGen::Take() const {
  return Snapshot{process_cpu_.Now(), client_cpu.Now(), server_cpu.Now(), AllocCount()};
}

void LoadGen::Start() {
  const auto now = Clock::now();
  t_start_ = last_progress_ = now;
  t_measure_ = now + flags_.warmup;
  t_end_ = t_measure_ + flags_.duration;
  if (flags_.mode == Mode::kClosed) {
    for (int s = 0; s < concurrency_; ++s) IssueSlot(s, Clock::now());
  } else {
    open_t0_ = now;
    for (int s = concurrency_ - 1; s >= 0; --s) free_slots_.push_back(s);
    PumpOpen(now);
  }
  if (flags_.warmup.count() == 0) Tick();
}

void LoadGen::IssueSlot(int slot, Clock::time_point intended) {
  sent_at_[static_cast<size_t>(slot)] = intended;
  ++in_flight_;
  issue_(slot);
}

void LoadGen::PumpOpen(Clock::time_point now) {
  while (!free_slots_.empty() && (phase_ == Phase::kWarmup || phase_ == Phase::kMeasuring)) {
    const auto due = open_t0_ + std::chrono::duration_cast<Clock::duration>(period_ * static_cast<double>(next_k_));
    if (due > now) break;
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    ++next_k_;
    IssueSlot(slot, due);
  }
}

void LoadGen::Completed(int slot, bool ok) {
  const auto now = Clock::now();
  --in_flight_;
  const auto ns = static_cast<uint64_t>(std::max<int64_t>(
      0, std::chrono::duration_cast<std::chrono::nanoseconds>(now - sent_at_[static_cast<size_t>(slot)]).count()));
  if (phase_ == Phase::kMeasuring) {
    if (ok) hist_.Record(ns);
    else ++errors_;
  }
  if (ok) interval_.Record(ns);
  Tick();
  if (phase_ == Phase::kWarmup || phase_ == Phase::kMeasuring) {
    if (flags_.mode == Mode::kClosed) {
      IssueSlot(slot, now);
    } else {
      free_slots_.push_back(slot);
      PumpOpen(now);
    }
  } else if (in_flight_ == 0) {
    phase_ = Phase::kDone;
  }
}

void LoadGen::Tick() {
  const auto now = Clock::now();
  if (phase_ == Phase::kWarmup && now >= t_measure_) {
    hist_.Reset();
    errors_ = 0;
    at_start_ = Take();
    t_measure_ = now;
    t_end_ = now + flags_.duration;
    phase_ = Phase::kMeasuring;
    if (flags_.alloc_trace > 0) TraceNextAllocs(flags_.alloc_trace);
  }
  if (phase_ == Phase::kMeasuring && now >= t_end_) {
    at_end_ = Take();
    TraceNextAllocs(0);
    t_measured_end_ = now;
    phase_ = Phase::kDraining;
    Progress(now, true);
  }
  if (phase_ == Phase::kDraining && in_flight_ == 0) phase_ = Phase::kDone;
  if (flags_.mode == Mode::kOpen) PumpOpen(now);
  if (now - last_progress_ >= std::chrono::seconds(1)) Progress(now, false);
}

Clock::time_point LoadGen::NextWake() const {
  const auto now = Clock::now();
  auto wake = now + std::chrono::milliseconds(50);
  if (phase_ == Phase::kWarmup) wake = std::min(wake, t_measure_);
  if (phase_ == Phase::kMeasuring) wake = std::min(wake, t_end_);
  if (flags_.mode == Mode::kOpen && !free_slots_.empty() && !draining())
    wake = std::min(wake, open_t0_ + std::chrono::duration_cast<Clock::duration>(period_ * static_cast<double>(next_k_)));
  return wake;
}

void LoadGen::Progress(Clock::time_point now, bool final) {
  const double secs = std::chrono::duration<double>(now - last_progress_).count();
  if (flags_.progress && secs > 0) {
    const bool tty = isatty(STDERR_FILENO) != 0;
    const double total = std::chrono::duration<double>(flags_.warmup + flags_.duration).count();
    const double at = std::chrono::duration<double>(now - t_start_).count();
    std::fprintf(stderr, "%s  %-34s %5.1f/%.1fs %s  %9.0f rps  p99 %9.1f us  in flight %d%s", tty ? "\r" : "",
                 label.c_str(), std::min(at, total), total, phase_ == Phase::kWarmup ? "warmup" : "      ",
                 static_cast<double>(interval_.count()) / secs, interval_.Percentile_us(0.99), in_flight_,
                 tty && !final ? "   " : "\n");
    std::fflush(stderr);
  }
  interval_.Reset();
  last_progress_ = now;
}

Row LoadGen::Result(const std::string& transport, const std::string& poll) const {
  Row r;
  r.transport = transport;
  r.poll = poll;
  r.size = size_;
  r.mode = flags_.mode;
  r.concurrency = concurrency_;
  r.rate = flags_.mode == Mode::kOpen ? flags_.rate : 0;
  r.count = hist_.count();
  r.errors = errors_;
  r.p50 = hist_.Percentile_us(0.50);
  r.p90 = hist_.Percentile_us(0.90);
  r.p99 = hist_.Percentile_us(0.99);
  r.p999 = hist_.Percentile_us(0.999);
  r.max = hist_.max_us();
  r.mean = hist_.mean_us();
  const double wall = std::chrono::duration<double>(t_measured_end_ - t_measure_).count();
  if (wall > 0) {
    r.rps = static_cast<double>(r.count) / wall;
    r.gbps = r.rps * static_cast<double>(size_) * 8 / 1e9;
    auto pct = [&](std::chrono::nanoseconds a, std::chrono::nanoseconds b) {
      return std::chrono::duration<double>(b - a).count() / wall * 100;
    };
    r.process_cpu_pct = pct(at_start_.process, at_end_.process);
    if (client_cpu.valid()) r.client_cpu_pct = pct(at_start_.client, at_end_.client);
    if (server_cpu.valid()) r.server_cpu_pct = pct(at_start_.server, at_end_.server);
  }
  if (r.count > 0) {
    r.cpu_us_per_call =
        std::chrono::duration<double, std::micro>(at_end_.process - at_start_.process).count() / static_cast<double>(r.count);
    r.allocs_per_call = static_cast<double>(at_end_.allocs - at_start_.allocs) / static_cast<double>(r.count);
  }
  if (flags_.mode == Mode::kOpen) {
    // Calls that were due but never sent (every slot busy): the rate was not sustained.
    const double due = std::chrono::duration<double>(t_measured_end_ - open_t0_).count() * flags_.rate;
    const double sent = static_cast<double>(next_k_);
    if (due - sent > 1) r.note = absl::StrFormat("%.0f due calls never sent (all %d slots busy)", due - sent, concurrency_);
  }
  return r;
}

// ---- perftest --------------------------------------------------------------------

Ceiling RunPerftest(const Flags& flags, size_t size) {
  Ceiling c;
  c.size = size;
  const std::string dev = flags.device.empty() ? "" : " -d " + flags.device;
  const std::string s = " -s " + std::to_string(size) + dev;
  // Fewer iterations for large messages: 1 MiB takes ~100 ms per message under emulation.
  const std::string n = size >= 65536 ? " -n 100" : " -n 1000";
  // ib_send_lat columns: #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
  auto lat = perftest::Measure("ib_send_lat -F" + n + s, "ib_send_lat -F" + n + s + " " + flags.ip, size);
  // ib_send_lat prints "inf" when its clock went wrong (seen under TCG): no ceiling then.
  if (lat.size() >= 7 && std::isfinite(lat[3]) && std::isfinite(lat[6])) {
    c.rtt_p50_us = 2 * lat[3];  // one-way x 2 = round trip
    c.rtt_p99_us = 2 * lat[6];
  }
  // ib_write_bw columns: #bytes #iterations BW_peak BW_average MsgRate (MB/s = 2^20 B/s)
  auto bw = perftest::Measure("ib_write_bw -F -n 100" + s, "ib_write_bw -F -n 100" + s + " " + flags.ip, size);
  if (bw.size() >= 3 && std::isfinite(bw[2])) c.bw_gbps = bw[2] * 1048576.0 * 8 / 1e9;
  return c;
}

}  // namespace rdmarpc::bench
