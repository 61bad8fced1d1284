// Market-data fanout benchmark (issue 6): one publisher, 1/4/16 subscribers,
// 64-byte ticks, RDMA and TCP side by side in one run. Prints, does not assert.
//
//   fanout_bench [--transport rdma,tcp] [--ip LOCAL_IP] [--device NAME]
//                [--subscribers 1,4,16] [--rate 10000] [--seconds 2]
//                [--ticks 50000] [--tick-bytes 64] [--poll event|adaptive|busy]
//                [--shared-pollers N]   (busy/adaptive: N poller threads for all connections)
//
// Two runs per row:
//  - latency: ticks at a steady --rate (1 ms batches) for --seconds, policy
//    block; per-subscriber P50/P99/P99.9 of publish-to-receipt latency
//    (shown: the mean of the subscribers' P50, the worst P99 and P99.9).
//  - throughput: --ticks as fast as the slowest subscriber takes them
//    (block); aggregate ticks/s delivered = subscribers x ticks / time.
//  - stalled subscriber (--stall yes): 4 subscribers at --rate, one reading
//    nothing until the feed ends under drop_oldest or conflate (queue 64,
//    window 8), against none: the other three's worst P99 and max latency.
// rdma:// needs a local address on an RDMA device (tools/rxe-vm exports
// RXE_VM_SELF_IP and RXE_VM_DEV); absolute numbers from a VM mean little,
// the tcp/rdma ratios of one run do.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "examples/common/flags.h"
#include "examples/market_data/market_data.h"

namespace md = rdmarpc::examples::md;

namespace {

const char kUsage[] =
    "usage: fanout_bench [--transport rdma,tcp] [--ip LOCAL_IP] [--device NAME] [--subscribers 1,4,16]\n"
          "         [--rate 10000] [--seconds 2] [--ticks 50000] [--tick-bytes 64] [--poll event|adaptive|busy]\n"
    "         [--shared-pollers N] [--stall yes|no]\n";

struct Row {
  std::string transport;
  int subscribers = 0;
  double p50 = 0, p99 = 0, p999 = 0;  // us
  double ticks_per_s = 0;             // aggregate, throughput run
  uint64_t missed = 0;
  std::string error;
};

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv, {"transport", "ip", "device", "subscribers", "rate", "seconds", "ticks", "tick-bytes", "poll", "shared-pollers", "stall"},
                   kUsage))
    return flags.help() ? 0 : 2;
  unsigned long long rate, seconds, ticks, tick_bytes, shared_pollers;
  if (!flags.GetUint("rate", 10'000, &rate) || !flags.GetUint("seconds", 2, &seconds) ||
      !flags.GetUint("ticks", 50'000, &ticks) || !flags.GetUint("tick-bytes", 64, &tick_bytes) ||
      !flags.GetUint("shared-pollers", 0, &shared_pollers))
    return 2;
  const char* env_ip = std::getenv("RXE_VM_SELF_IP");
  const char* env_dev = std::getenv("RXE_VM_DEV");
  const std::string ip = flags.Get("ip", env_ip ? env_ip : "");
  std::vector<std::string> transports =
      absl::StrSplit(flags.Get("transport", ip.empty() ? "tcp" : "rdma,tcp"), ',', absl::SkipEmpty());
  std::vector<int> counts;
  for (auto part : absl::StrSplit(flags.Get("subscribers", "1,4,16"), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n <= 0) {
      std::fprintf(stderr, "fanout_bench: --subscribers: '%s' is not a positive number\n", std::string(part).c_str());
      return 2;
    }
    counts.push_back(n);
  }
  rdmarpc::TransportOptions transport;
  transport.rdma_device.name = flags.Get("device", env_dev ? env_dev : "");
  const bool stall_rows = flags.Get("stall", "yes") != "no";
  const std::string poll = flags.Get("poll", "event");
  if (poll == "event") transport.rdma.poll_mode = rdmarpc::rdma::PollMode::kEvent;
  else if (poll == "adaptive") transport.rdma.poll_mode = rdmarpc::rdma::PollMode::kAdaptive;
  else if (poll == "busy") transport.rdma.poll_mode = rdmarpc::rdma::PollMode::kBusy;
  else {
    std::fprintf(stderr, "fanout_bench: --poll: unknown '%s' (event, adaptive, busy)\n", poll.c_str());
    return 2;
  }

  if (shared_pollers > 0 && transport.rdma.poll_mode == rdmarpc::rdma::PollMode::kEvent) {
    std::fprintf(stderr, "fanout_bench: --shared-pollers needs --poll adaptive or busy (event mode has no poller threads)\n");
    return 2;
  }
  transport.rdma.shared_pollers = static_cast<unsigned>(shared_pollers);
  std::printf("fanout: %llu-byte ticks, latency run %llu ticks/s for %llu s, throughput run %llu ticks, policy block, "
              "rdma poll %s%s\n\n",
              tick_bytes, rate, seconds, ticks, poll.c_str(),
              shared_pollers ? (" (" + std::to_string(shared_pollers) + " shared poller threads)").c_str() : "");
  std::printf("%-5s %4s %10s %10s %10s %14s %7s\n", "via", "subs", "p50 us", "p99 us", "p99.9 us", "ticks/s (agg)",
              "missed");
  std::vector<Row> rows;
  for (int n : counts) {
    for (const std::string& t : transports) {
      Row row{t, n};
      md::LocalRunOptions o;
      if (t == "tcp") {
        o.listen_uri = "tcp://127.0.0.1:0";
      } else if (t == "rdma") {
        if (ip.empty()) {
          std::fprintf(stderr, "fanout_bench: rdma needs --ip (a local address on the RDMA device's netdev)\n");
          return 2;
        }
        o.listen_uri = "rdma://" + ip + ":0";
      } else {
        std::fprintf(stderr, "fanout_bench: --transport: unknown '%s' (rdma, tcp)\n", t.c_str());
        return 2;
      }
      o.transport = transport;
      o.subscribers = n;
      o.feed.tick_bytes = tick_bytes;
      o.feed.symbols = 100;
      // Latency at a steady rate.
      o.feed.rate = rate;
      o.feed.ticks = rate * seconds;
      auto lat = md::RunLocal(o);
      if (!lat.status.ok()) row.error = lat.status.ToString();
      double p50 = 0;
      for (auto& s : lat.subscribers) {
        p50 += md::PercentileUs(s.latency_ns, 0.50);
        row.p99 = std::max(row.p99, md::PercentileUs(s.latency_ns, 0.99));
        row.p999 = std::max(row.p999, md::PercentileUs(s.latency_ns, 0.999));
        row.missed += s.missed;
        if (!s.status.ok() && row.error.empty()) row.error = s.status.ToString();
      }
      row.p50 = lat.subscribers.empty() ? 0 : p50 / double(lat.subscribers.size());
      // Throughput: as fast as the slowest subscriber takes them.
      o.feed.rate = 0;
      o.feed.ticks = ticks;
      auto thr = md::RunLocal(o);
      if (!thr.status.ok() && row.error.empty()) row.error = thr.status.ToString();
      uint64_t delivered = 0;
      for (auto& s : thr.subscribers) delivered += s.ticks;
      row.ticks_per_s = thr.delivery_seconds > 0 ? double(delivered) / thr.delivery_seconds : 0;
      std::printf("%-5s %4d %10.1f %10.1f %10.1f %14.0f %7llu %s\n", t.c_str(), n, row.p50, row.p99, row.p999,
                  row.ticks_per_s, (unsigned long long)row.missed, row.error.c_str());
      std::fflush(stdout);
      rows.push_back(row);
    }
  }
  // A stalled subscriber: subscriber 0 reads nothing until the feed is over
  // while 3 others read; their latency next to a run without the staller.
  if (stall_rows) {
    std::printf("\nstalled subscriber: 4 subscribers at %llu ticks/s, subscriber 0 reads nothing until the feed ends;\n"
                "latency of the other 3 (worst P99, max), us; the staller's received/missed ticks\n",
                rate);
    std::printf("%-5s %-12s %10s %10s %10s %10s\n", "via", "staller", "p99", "max", "stall got", "stall miss");
    for (const std::string& t : transports) {
      for (const char* policy : {"none", "drop_oldest", "conflate"}) {
        md::LocalRunOptions o;
        o.listen_uri = t == "tcp" ? "tcp://127.0.0.1:0" : "rdma://" + ip + ":0";
        o.transport = transport;
        o.subscribers = 4;
        o.feed.tick_bytes = tick_bytes;
        o.feed.symbols = 100;
        o.feed.rate = rate;
        o.feed.ticks = rate * seconds;
        o.subscriber.queue_limit = 1'000'000;  // the readers never drop
        if (std::string(policy) != "none") {
          md::SubscriberOptions stalled;
          stalled.policy = policy;
          stalled.queue_limit = 64;
          stalled.window = 8;
          stalled.stall_until_feed_done = true;
          o.overrides = {stalled};
        }
        auto r = md::RunLocal(o);
        double p99 = 0, max = 0;
        for (size_t i = 1; i < r.subscribers.size(); ++i) {
          p99 = std::max(p99, md::PercentileUs(r.subscribers[i].latency_ns, 0.99));
          max = std::max(max, md::PercentileUs(r.subscribers[i].latency_ns, 1.0));
        }
        const auto& s0 = r.subscribers.empty() ? md::SubscriberResult{} : r.subscribers[0];
        std::printf("%-5s %-12s %10.1f %10.1f %10llu %10llu %s\n", t.c_str(), policy, p99, max,
                    (unsigned long long)s0.ticks, (unsigned long long)s0.missed,
                    r.status.ok() ? "" : r.status.ToString().c_str());
        std::fflush(stdout);
      }
    }
  }

  // Ratios where both transports ran.
  bool header = false;
  for (int n : counts) {
    const Row *r = nullptr, *tc = nullptr;
    for (const Row& row : rows) {
      if (row.subscribers != n) continue;
      if (row.transport == "rdma") r = &row;
      if (row.transport == "tcp") tc = &row;
    }
    if (r == nullptr || tc == nullptr || r->p50 <= 0 || tc->ticks_per_s <= 0) continue;
    if (!header) {
      std::printf("\ntcp / rdma, same run (latency: >1 means rdma is faster; throughput: <1 means rdma is faster)\n");
      header = true;
    }
    std::printf("  %2d subscribers: p50 %.2fx  p99 %.2fx  p99.9 %.2fx  ticks/s %.2fx\n", n, tc->p50 / r->p50,
                tc->p99 / r->p99, tc->p999 / r->p999, tc->ticks_per_s / r->ticks_per_s);
  }
  return 0;
}
