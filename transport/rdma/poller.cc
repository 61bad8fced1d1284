#include "transport/rdma/poller.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>

#include <array>
#include <fstream>

#include <boost/asio/post.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/common/log.h"

namespace rdmarpc::rdma {
namespace {

// Completions taken per ibv_poll_cq call: large enough to amortise the call
// and the hand-off to the executor, small enough to stay in L1.
constexpr int kBatch = 16;

struct Batch {
  std::array<ibv_wc, kBatch> wc;
  int n = 0;
};

// Takes every pending event off a (non-blocking) completion channel. Acking
// takes a mutex in libibverbs, so acks are batched in `unacked`; whoever
// destroys the CQ must ack the rest first.
void TakeCqEvents(ibv_comp_channel* channel, ibv_cq* cq, unsigned& unacked) {
  ibv_cq* ev_cq = nullptr;
  void* ctx = nullptr;
  while (ibv_get_cq_event(channel, &ev_cq, &ctx) == 0) ++unacked;
  if (unacked >= 64) {
    ibv_ack_cq_events(cq, unacked);
    unacked = 0;
  }
}

// Shared between the executor side and a poller thread. `sink` is only ever
// called on the executor, and not once `stopped` is set there.
struct SinkBox {
  Poller::Sink sink;
  bool stopped = false;  // Executor-only.
};

class EventPoller final : public Poller {
 public:
  EventPoller(asio::any_io_executor ex, ibv_cq* cq, ibv_comp_channel* channel, Sink sink)
      : cq_(cq), channel_(channel), fd_(ex, channel->fd), box_(std::make_shared<SinkBox>()) {
    box_->sink = std::move(sink);
  }
  ~EventPoller() override { Stop(); }

  absl::Status Arm() {
    int flags = fcntl(channel_->fd, F_GETFL);
    if (flags < 0 || fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK) < 0)
      return ErrnoStatus(errno, "fcntl(O_NONBLOCK) on the completion channel");
    if (int rc = ibv_req_notify_cq(cq_, 0); rc != 0) return ErrnoStatus(rc, "ibv_req_notify_cq");
    // Completions that landed before the CQ was armed raise no event (the
    // peer may SEND the moment the connection is established): drain once.
    asio::post(fd_.get_executor(), [this, box = box_] {
      if (!box->stopped) DrainToEmpty();
    });
    Wait();
    return absl::OkStatus();
  }

  void Stop() override {
    if (box_->stopped) return;
    box_->stopped = true;
    boost::system::error_code ignored;
    fd_.cancel(ignored);
    fd_.release();  // The fd belongs to the completion channel.
    // Events already taken must be acked before the CQ can be destroyed.
    if (unacked_ > 0) ibv_ack_cq_events(cq_, unacked_);
    unacked_ = 0;
  }

 private:
  void Wait() {
    fd_.async_wait(asio::posix::descriptor_base::wait_read,
                   [this, box = box_](boost::system::error_code ec) {
                     if (box->stopped || ec) return;
                     OnReadable();
                   });
  }

  void OnReadable() {
    TakeCqEvents(channel_, cq_, unacked_);
    // Re-arm first, then drain: a completion that lands between the drain and
    // the arm would otherwise never raise an event.
    ibv_req_notify_cq(cq_, 0);
    if (!DrainToEmpty()) return;
    Wait();
  }

  // False when the sink stopped us (closed the connection) meanwhile.
  bool DrainToEmpty() {
    Batch b;
    auto box = box_;
    while ((b.n = ibv_poll_cq(cq_, kBatch, b.wc.data())) > 0) {
      box->sink({b.wc.data(), static_cast<size_t>(b.n)});
      if (box->stopped) return false;
    }
    return true;
  }

  ibv_cq* cq_;
  ibv_comp_channel* channel_;
  asio::posix::stream_descriptor fd_;
  std::shared_ptr<SinkBox> box_;
  unsigned unacked_ = 0;
};

class ThreadPoller final : public Poller {
 public:
  ThreadPoller(PollMode mode, asio::any_io_executor ex, ibv_cq* cq, ibv_comp_channel* channel,
               std::chrono::microseconds spin, Sink sink)
      : mode_(mode), ex_(std::move(ex)), cq_(cq), channel_(channel), spin_(spin),
        box_(std::make_shared<SinkBox>()) {
    box_->sink = std::move(sink);
  }
  ~ThreadPoller() override { Stop(); }

  absl::Status Run(int cpu) {
    if (mode_ == PollMode::kAdaptive) {
      int flags = fcntl(channel_->fd, F_GETFL);
      if (flags < 0 || fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return ErrnoStatus(errno, "fcntl(O_NONBLOCK) on the completion channel");
    }
    thread_ = std::thread([this] { Loop(); });
    pthread_setname_np(thread_.native_handle(), "rdmarpc-poll");
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      if (int rc = pthread_setaffinity_np(thread_.native_handle(), sizeof set, &set); rc != 0)
        RDMARPC_LOG(kWarn, "poller", "event=pin_failed cpu=", cpu, " error=", std::strerror(rc));
    }
    return absl::OkStatus();
  }

  void Stop() override {
    if (box_->stopped) return;
    box_->stopped = true;
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
    if (unacked_ > 0) ibv_ack_cq_events(cq_, unacked_);
    unacked_ = 0;
  }

 private:
  void Deliver(const Batch& b) {
    asio::post(ex_, [box = box_, b] {
      if (!box->stopped) box->sink({b.wc.data(), static_cast<size_t>(b.n)});
    });
  }

  // Returns true when at least one completion was delivered.
  bool Drain() {
    bool any = false;
    Batch b;
    while ((b.n = ibv_poll_cq(cq_, kBatch, b.wc.data())) > 0) {
      Deliver(b);
      any = true;
    }
    return any;
  }

  void Loop() {
    using Clock = std::chrono::steady_clock;
    auto idle_since = Clock::now();
    uint32_t empty_polls = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (Drain()) {
        idle_since = Clock::now();
        empty_polls = 0;
        continue;
      }
      if (mode_ == PollMode::kBusy) {
        // On a core of its own this returns at once. When pollers outnumber
        // cores (many connections, a small VM) it lets the others, and the
        // io_context threads they feed, run: pure spinning starved them
        // (8 busy connections on 2 vCPUs stalled for a minute).
        if (++empty_polls % kPollsPerYield == 0) sched_yield();
        continue;
      }
      if (Clock::now() - idle_since < spin_) continue;
      // Adaptive: arm, drain once more (closes the race), then sleep.
      ibv_req_notify_cq(cq_, 0);
      if (Drain()) {
        idle_since = Clock::now();
        continue;
      }
      pollfd pfd{channel_->fd, POLLIN, 0};
      // Wake up now and then to notice Stop(); completions wake us at once.
      if (::poll(&pfd, 1, 20) > 0) TakeCqEvents(channel_, cq_, unacked_);
      idle_since = Clock::now();
    }
  }

  static constexpr uint32_t kPollsPerYield = 256;  // empty polls between sched_yield()s (busy mode)
  PollMode mode_;
  asio::any_io_executor ex_;
  ibv_cq* cq_;
  ibv_comp_channel* channel_;
  std::chrono::microseconds spin_;
  std::shared_ptr<SinkBox> box_;
  std::atomic<bool> stop_{false};
  unsigned unacked_ = 0;  // Poller thread only, until joined.
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Poller>> Poller::Start(PollMode mode, asio::any_io_executor ex,
                                                      ibv_cq* cq, ibv_comp_channel* channel, int cpu,
                                                      std::chrono::microseconds spin, Sink sink) {
  if (mode == PollMode::kEvent) {
    auto p = std::make_unique<EventPoller>(std::move(ex), cq, channel, std::move(sink));
    if (auto st = p->Arm(); !st.ok()) return st;
    return std::unique_ptr<Poller>(std::move(p));
  }
  auto p = std::make_unique<ThreadPoller>(mode, std::move(ex), cq, channel, spin, std::move(sink));
  if (auto st = p->Run(cpu); !st.ok()) return st;
  return std::unique_ptr<Poller>(std::move(p));
}

std::vector<int> LocalCpus(const Device& device) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof allowed, &allowed);
  std::vector<int> cpus;
  std::ifstream in(absl::StrCat("/sys/class/infiniband/", device.name(), "/device/local_cpulist"));
  std::string list;
  if (in && std::getline(in, list)) {
    for (absl::string_view range : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      std::pair<absl::string_view, absl::string_view> ab = absl::StrSplit(range, '-');
      int a = 0, b = 0;
      if (!absl::SimpleAtoi(ab.first, &a)) continue;
      if (ab.second.empty() || !absl::SimpleAtoi(ab.second, &b)) b = a;
      for (int c = a; c <= b; ++c)
        if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  if (cpus.empty())
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  return cpus;
}

}  // namespace rdmarpc::rdma
