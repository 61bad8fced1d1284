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

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::rdma {

class Poller {
 public:
  // Called on the executor with each batch of completions.
  using Sink = std::function<void(std::span<const ibv_wc>)>;

  static absl::StatusOr<std::unique_ptr<Poller>> Start(PollMode mode, asio::any_io_executor ex,
                                                       ibv_cq* cq, ibv_comp_channel* channel,
                                                       int cpu, std::chrono::microseconds spin,
                                                       Sink sink);
  virtual ~Poller() = default;
  // Stops polling; joins the thread if there is one. Call on the executor.
  // The sink is not called after Stop() returns.
  virtual void Stop() = 0;
};

// CPUs local to the device's NUMA node that this process may run on, from
// sysfs (`device/local_cpulist`); all allowed CPUs when unknown.
std::vector<int> LocalCpus(const Device& device);

}  // namespace rdmarpc::rdma
