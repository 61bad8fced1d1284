// Completion pollers: how a connection's CQ is drained (see PollMode).
//
// Whatever the mode, completions are handed to `sink` on the connection's
// executor, in CQ order, in batches, and the CQ is drained to empty on every
// pass. Thread pollers only touch the CQ (ibv_poll_cq is thread-safe against
// ibv_post_* on the executor thread); all connection state stays on the
// executor.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::rdma {

class Poller {
 public:
  // Called on the executor with each batch of completions.
  using Sink = std::function<void(std::span<const ibv_wc>)>;

  // run_to_completion (busy/adaptive): no thread; the executor's thread
  // polls the CQ itself and handles completions where it polled them
  // (RdmaOptions::run_to_completion). cpu is then unused.
  static absl::StatusOr<std::unique_ptr<Poller>> Start(PollMode mode, asio::any_io_executor ex,
                                                       ibv_cq* cq, ibv_comp_channel* channel,
                                                       int cpu, std::chrono::microseconds spin,
                                                       Sink sink, bool run_to_completion = false);
  virtual ~Poller() = default;
  // Stops polling; joins the thread if there is one. Call on the executor.
  // The sink is not called after Stop() returns.
  virtual void Stop() = 0;
};

// Poller threads shared by many connections (RdmaOptions::shared_pollers).
// Each thread owns a set of CQs and drains every one of them to empty on each
// pass, in turn; busy threads spin over their set, adaptive ones spin for
// `spin` after the last completion of any of their CQs, then arm them all and
// sleep in poll(2) on their completion channels. A CQ joins the thread with
// the fewest CQs. With N threads, M connections cost N cores instead of M:
// what a small machine with many connections (fanout) needs.
//
// Add() and Poller::Stop() are called on connection executors; they take the
// thread's lock, so a CQ is never polled after its Stop() returns.
class PollerGroup : public std::enable_shared_from_this<PollerGroup> {
 public:
  static constexpr unsigned kMaxSharedPollers = 256;
  // mode: kBusy or kAdaptive. Thread i is pinned to cpus[i % cpus.size()]
  // (unpinned when cpus is empty).
  static absl::StatusOr<std::shared_ptr<PollerGroup>> Start(PollMode mode, unsigned threads,
                                                            std::vector<int> cpus,
                                                            std::chrono::microseconds spin);
  ~PollerGroup();  // Joins the threads. Every Poller from Add() holds the group.
  PollerGroup(const PollerGroup&) = delete;
  PollerGroup& operator=(const PollerGroup&) = delete;

  // Starts polling `cq` on the least loaded thread; the sink runs on `ex`.
  absl::StatusOr<std::unique_ptr<Poller>> Add(asio::any_io_executor ex, ibv_cq* cq,
                                              ibv_comp_channel* channel, Poller::Sink sink);
  PollMode mode() const { return mode_; }
  unsigned threads() const;
  std::chrono::microseconds spin() const { return spin_; }
  // CQs per thread, now.
  std::vector<size_t> Load() const;

  class Worker;

 private:
  PollerGroup(PollMode mode, std::chrono::microseconds spin);
  PollMode mode_;
  std::chrono::microseconds spin_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

// CPUs local to the device's NUMA node that this process may run on, from
// sysfs (`device/local_cpulist`); all allowed CPUs when unknown.
std::vector<int> LocalCpus(const Device& device);

}  // namespace rdmarpc::rdma
