// What every row of the RPC benchmark shares, whatever carries the calls:
// flags, the latency histogram, the load generator (closed and open loop), the
// CPU and allocation meters and the row that comes out.
//
// Threads: a LoadGen, its histograms and its Meter belong to the client's
// event-loop thread; only the progress counters are read from elsewhere.
#pragma once

#include <pthread.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/alloc_hooks.h"

namespace rdmarpc::bench {

using Clock = std::chrono::steady_clock;


enum class Mode { kClosed, kOpen };
// both: server and client in this process (loopback). server/client: the two
// halves on two hosts; the client connects to --server at fixed ports.
enum class Role { kBoth, kServer, kClient };

// --role=server listens, and --role=client connects, at --port + this.
inline int PortOffset(const std::string& transport) {
  return transport == "rdma" ? 0 : transport == "tcp" ? 1 : 2;
}

struct Flags {
  std::vector<std::string> transports = {"tcp"};
  std::vector<size_t> sizes = {64};
  std::vector<int> concurrency = {1};
  Mode mode = Mode::kClosed;
  double rate = 0;  // Calls per second for --mode=open (all slots together).
  std::chrono::milliseconds warmup{500};
  std::chrono::milliseconds duration{3000};
  std::string device, ip;
  std::string poll = "event";
  bool spin = false;       // Poll the io_contexts instead of sleeping in epoll (rdmarpc rows).
  bool rtc = false;        // RdmaOptions::run_to_completion (busy/adaptive).
  std::string tcp_poll = "event";  // TcpOptions::poll_mode.
  bool inline_handler = false;  // The server answers from EchoInline (the inline fast path).
  bool json = false;
  bool perftest = false;
  bool progress = true;
  int alloc_trace = 0;     // Print the stacks of this many steady-phase allocations per row.
  Role role = Role::kBoth;
  std::string server;      // --role=client: the host running --role=server.
  int port = 7470;         // rdma on port, tcp on port+1, grpc on port+2 (two-host roles).
};

// Parses argv; prints usage and exits on a bad flag.
Flags ParseFlags(int argc, char** argv);

// Log-linear histogram of nanoseconds: exact below 256 ns, then 128 buckets
// per power of two (at most 0.8% error), up to ~18 minutes. Fixed size, so
// recording never allocates.
class Histogram {
 public:
  void Record(uint64_t ns);
  void Reset();
  uint64_t count() const { return count_; }
  double mean_us() const { return count_ ? static_cast<double>(sum_) / static_cast<double>(count_) / 1e3 : 0; }
  double max_us() const { return static_cast<double>(max_) / 1e3; }
  // The p-quantile (0 < p <= 1) in microseconds: the middle of its bucket.
  double Percentile_us(double p) const;

 private:
  static constexpr int kSubBits = 7;
  static constexpr size_t kBuckets = 64 * (size_t{1} << kSubBits);
  static size_t Index(uint64_t ns);
  static double Middle(size_t index);
  std::array<uint64_t, kBuckets> counts_{};
  uint64_t count_ = 0, sum_ = 0, max_ = 0;
};

// CPU time of a thread (pthread_getcpuclockid) or of the process.
class CpuClock {
 public:
  static CpuClock Process();
  static CpuClock Thread(pthread_t t);
  static CpuClock None() { return CpuClock(); }
  std::chrono::nanoseconds Now() const;  // 0 for None()
  bool valid() const { return valid_; }

 private:
  clockid_t id_{};
  bool valid_ = false;
};

// One row of output.
struct Row {
  std::string transport;
  std::string poll;  // "event" etc. for rdma, "-" otherwise
  size_t size = 0;
  Mode mode = Mode::kClosed;
  int concurrency = 1;
  double rate = 0;
  uint64_t count = 0, errors = 0;
  double p50 = 0, p90 = 0, p99 = 0, p999 = 0, max = 0, mean = 0;
  double rps = 0, gbps = 0;
  // Percent of one core over the measured phase; < 0 when not separable (gRPC
  // runs its I/O on its own threads).
  double client_cpu_pct = -1, server_cpu_pct = -1;
  double process_cpu_pct = 0;
  double cpu_us_per_call = 0;  // Whole process (client + server + pollers): they share it.
  double allocs_per_call = 0;  // Whole process.
  std::string note;
};

std::string RowJson(const Row& r);

// Drives calls: closed loop (every slot reissues as soon as its call
// completes) or open loop (call k is due at t0 + k/rate; its latency counts
// from then, so a slow server cannot hide queueing: no coordinated omission).
// The transport supplies `issue(slot)`; it calls Completed() from its loop.
class LoadGen {
 public:
  using Issue = std::function<void(int slot)>;
  LoadGen(const Flags& flags, size_t size, int concurrency, Issue issue);

  // Phases: warmup (calls run, nothing recorded), measuring, draining (no new
  // calls; waits for the ones in flight).
  void Start();                           // Issues the first calls; at the start of warmup.
  void Completed(int slot, bool ok);      // On the client loop, once per call.
  void Tick();                            // On the client loop, at least every ~50 ms, and at NextWake().
  Clock::time_point NextWake() const;     // When Tick() must run next (open loop: the next due call).
  bool done() const { return phase_ == Phase::kDone; }
  bool draining() const { return phase_ == Phase::kDraining || phase_ == Phase::kDone; }
  int in_flight() const { return in_flight_; }

  // CPU clocks to read at the edges of the measured phase.
  CpuClock client_cpu, server_cpu;
  Row Result(const std::string& transport, const std::string& poll) const;
  std::string label;  // For the progress line.

 private:
  enum class Phase { kWarmup, kMeasuring, kDraining, kDone };
  void IssueSlot(int slot, Clock::time_point intended);
  void PumpOpen(Clock::time_point now);
  void Progress(Clock::time_point now, bool final);

  const Flags& flags_;
  size_t size_;
  int concurrency_;
  Issue issue_;
  Phase phase_ = Phase::kWarmup;
  Clock::time_point t_start_, t_measure_, t_end_, t_measured_end_;
  std::vector<Clock::time_point> sent_at_;  // Per slot: intended (open) or actual (closed) start.
  std::vector<int> free_slots_;
  int in_flight_ = 0;
  // Open loop: call k is due at open_t0_ + k * period_.
  Clock::time_point open_t0_;
  std::chrono::duration<double, std::nano> period_{0};
  uint64_t next_k_ = 0;

  Histogram hist_, interval_;
  uint64_t errors_ = 0;
  Clock::time_point last_progress_;
  uint64_t interval_start_count_ = 0;
  // Meters at the start and end of the measured phase.
  struct Snapshot {
    std::chrono::nanoseconds process{}, client{}, server{};
    uint64_t allocs = 0;
  };
  Snapshot Take() const;
  Snapshot at_start_, at_end_;
  CpuClock process_cpu_ = CpuClock::Process();
};

// perftest's ceilings on `device` for `size`: round trip = 2 x ib_send_lat
// (typical and 99%), ib_write_bw's average. Zero when perftest gave no row.
struct Ceiling {
  size_t size = 0;
  double rtt_p50_us = 0, rtt_p99_us = 0, bw_gbps = 0;
};
Ceiling RunPerftest(const Flags& flags, size_t size);

// Every row of the gRPC echo (grpc_row.cc; only when built with gRPC).
absl::Status RunGrpc(const Flags& flags, const std::function<void(const Row&)>& emit);

// The gRPC echo server on its own completion-queue thread (grpc_row.cc),
// listening on `address` ("host:port", port 0 picks one) with request slots
// pre-posted for `slots` concurrent calls. Stops when destroyed.
class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const std::string& address, int slots);
  virtual ~GrpcServer() = default;
  virtual const std::string& address() const = 0;  // with the port resolved
  virtual CpuClock cpu() const = 0;
};

}  // namespace rdmarpc::bench
