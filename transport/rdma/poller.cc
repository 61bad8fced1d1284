#include "transport/rdma/poller.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <mutex>

#include <boost/asio/post.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/common/log.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"
#include "transport/poll_group.h"

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
  // The operations of EventPoller's spin pass (PostSpin) and its wait for a
  // completion event (Wait), one of each at a time: here, not in the poller,
  // because one may still be queued when the poller is gone.
  transport::OpMemory spin_memory;
  transport::OpMemory wait_memory;
  // EventPoller's spin pass is in its executor's PollGroup list for the
  // next turn (here for the same reason).
  bool enlisted = false;
};

// Hands a batch to the sink on `ex`, unless the poller was stopped meanwhile.
void Deliver(const asio::any_io_executor& ex, const std::shared_ptr<SinkBox>& box, const Batch& b) {
  asio::post(ex, [box, b] {
    if (!box->stopped) box->sink({b.wc.data(), static_cast<size_t>(b.n)});
  });
}

// Drains `cq` to empty, handing each batch to the sink on `ex`; true when
// anything was there. For the poller threads (per QP and shared). A poll that
// returns less than a batch found the CQ empty behind its last completion: no
// second poll to be told so (see EventPoller::DrainToEmpty).
bool DrainTo(ibv_cq* cq, const asio::any_io_executor& ex, const std::shared_ptr<SinkBox>& box) {
  bool any = false;
  Batch b;
  while ((b.n = ibv_poll_cq(cq, kBatch, b.wc.data())) > 0) {
    Deliver(ex, box, b);
    any = true;
    if (b.n < kBatch) break;
  }
  return any;
}

// How long polling has found nothing, without a clock read on every poll.
// Where the kernel has no vDSO clock (Soft-RoCE's VM runs on hpet) every
// steady_clock::now() is a syscall that costs more than the poll: the
// adaptive pollers read it once per kPollsPerClockRead empty polls, and a
// poll that finds work costs no clock read at all. Spinning lasts `limit`
// plus at most that many polls.
class QuietTimer {
 public:
  explicit QuietTimer(std::chrono::microseconds limit) : limit_(limit) {}
  void Activity() { empty_ = 0; }
  // Counts `polls` empty polls; true once polls have been empty for `limit`.
  bool Expired(uint64_t polls = 1) {
    if (limit_.count() <= 0) return true;
    const uint64_t before = empty_;
    empty_ += polls;
    if (before / kPollsPerClockRead == empty_ / kPollsPerClockRead) return false;
    const auto now = Clock::now();
    if (before < kPollsPerClockRead) {
      since_ = now;
      return false;
    }
    return now - since_ >= limit_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr uint64_t kPollsPerClockRead = 64;
  const std::chrono::microseconds limit_;
  uint64_t empty_ = 0;
  Clock::time_point since_{};
};

void PinThread(std::thread& t, int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (int rc = pthread_setaffinity_np(t.native_handle(), sizeof set, &set); rc != 0)
    RDMARPC_LOG(kWarn, "poller", "event=pin_failed cpu=", cpu, " error=", std::strerror(rc));
}

absl::Status MakeNonBlocking(int fd, const char* what) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return ErrnoStatus(errno, absl::StrCat("fcntl(O_NONBLOCK) on ", what));
  return absl::OkStatus();
}

// Polls on the connection's executor, no thread of its own. Plain event mode
// sleeps on the completion channel in the reactor between batches. With
// `spin` (run to completion, busy or adaptive) the executor's thread polls
// the CQ itself: after a completion it keeps draining from a task it posts
// again after every pass (other handlers, timers and sockets still run
// between passes), forever in busy mode, or until `spin` has passed without
// a completion in adaptive mode, when it arms the CQ and goes back to the
// channel. Completions are handled where they were polled: no hand-off.
class EventPoller final : public Poller {
 public:
  enum class Spin { kNone, kAdaptive, kBusy };
  EventPoller(asio::any_io_executor ex, ibv_cq* cq, ibv_comp_channel* channel, Spin spin,
              std::chrono::microseconds spin_for, Sink sink)
      : cq_(cq), channel_(channel), fd_(ex, channel->fd), box_(std::make_shared<SinkBox>()), spin_(spin),
        quiet_(spin_for) {
    box_->sink = std::move(sink);
  }
  ~EventPoller() override { Stop(); }

  absl::Status Arm() {
    if (auto st = MakeNonBlocking(channel_->fd, "the completion channel"); !st.ok()) return st;
    if (spin_ != Spin::kNone) {
      // Start spinning: the peer may SEND the moment the connection is up.
      quiet_.Activity();
      PostSpin();
      return absl::OkStatus();
    }
    if (int rc = ibv_req_notify_cq(cq_, 0); rc != 0) return ErrnoStatus(rc, "ibv_req_notify_cq");
    // Completions that landed before the CQ was armed raise no event (the
    // peer may SEND the moment the connection is established): drain once.
    asio::post(fd_.get_executor(), transport::WithHandlerMemory([this, box = box_] {
      if (!box->stopped) DrainToEmpty(*box);
    }));
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
    waiting_ = true;
    // The box's own operation memory, not Asio's recycling cache: that
    // cache's two blocks are shared with every other default-allocated
    // operation on the thread, so when another one held them this wait
    // allocated (a heap allocation now and then in steady state, seen by
    // rpc_alloc_rdma_test in CI). A lean handler: no executor of its own for
    // Asio to build and compare when the wait completes.
    fd_.async_wait(asio::posix::descriptor_base::wait_read,
                   transport::WithOpMemory(box_->wait_memory, [this, box = box_](boost::system::error_code ec) {
                     if (box->stopped || ec) return;
                     waiting_ = false;
                     OnReadable(*box);
                   }));
  }

  void OnReadable(SinkBox& box) {
    TakeCqEvents(channel_, cq_, unacked_);
    if (spin_ != Spin::kNone) {
      // Traffic again: poll from the executor until it is quiet.
      quiet_.Activity();
      SpinPass(box);
      return;
    }
    // Re-arm first, then drain: a completion that lands between the drain and
    // the arm would otherwise never raise an event.
    ibv_req_notify_cq(cq_, 0);
    if (!DrainToEmpty(box)) return;
    Wait();
  }

  // One pass per turn of the executor while spinning. On an io_context one
  // thread runs, its PollGroup runs the passes of all its connections as one
  // task a turn (transport/poll_group.h). Otherwise each pass is posted to the
  // io_context's own executor when it is one (the type-erased post costs
  // ~350 instructions more a pass, most of an empty pass).
  // Its operation lives in the box (spin_memory), not in the per-thread
  // handler cache. A lean handler (handler_memory.h): ~120 instructions less
  // a pass than one wrapped by bind_allocator or append, which Asio posts through a
  // work_dispatcher.
  void PostSpin() {
    if (group_ != nullptr) {
      if (!box_->enlisted) {
        box_->enlisted = true;
        group_->Enlist(this, box_.get(), &GroupSpin, [this] { return box_; });
      }
      return;
    }
    auto pass = transport::WithOpMemory(box_->spin_memory, [this, box = box_] {
      if (!box->stopped) SpinPass(*box);
    });
    if (const auto* ioc = spin_ex_.target<asio::io_context::executor_type>()) {
      asio::post(*ioc, std::move(pass));
      return;
    }
    asio::post(spin_ex_, std::move(pass));
  }

  // From group_: the pass of the turn. `held` is the box; the poller may be
  // gone when the box says stopped.
  static void GroupSpin(void* poller, void* held) {
    auto* box = static_cast<SinkBox*>(held);
    box->enlisted = false;
    if (!box->stopped) static_cast<EventPoller*>(poller)->SpinPass(*box);
  }

  // Polls per pass while the CQ stays empty. A pass costs a post through the
  // io_context, and every other pass the reactor's epoll_wait: in the
  // Soft-RoCE VM a pass took ~2 us against ~0.1 us for an empty poll, so a
  // completion waited on average half a pass to be seen. Polling several
  // times per pass puts the spinning where completions are seen; a pass that
  // finds one ends at once. Other handlers on the executor wait for at most
  // this many empty polls.
  static constexpr int kSpinPollsPerPass = 64;

  void SpinPass(SinkBox& box) {
    bool any = false;
    int polls = 0;
    do {
      if (!DrainToEmpty(box, &any)) return;
    } while (!any && ++polls < kSpinPollsPerPass);
    if (any) quiet_.Activity();
    if (spin_ == Spin::kBusy || any || !quiet_.Expired(static_cast<uint64_t>(polls))) {
      PostSpin();
      return;
    }
    // Quiet for spin_for: arm, drain once more (closes the race), sleep.
    ibv_req_notify_cq(cq_, 0);
    any = false;
    if (!DrainToEmpty(box, &any)) return;
    if (any) {
      quiet_.Activity();
      PostSpin();
      return;
    }
    Wait();
  }

  // False when the sink stopped us (closed the connection, perhaps destroyed
  // this poller) meanwhile. `box` is box_, held by the calling handler, so it
  // outlives this poller: nothing of `this` is touched once it says stopped.
  // Spinning, a poll that returns less than a batch ends the drain: the CQ was
  // empty behind it, and polling again only to be told so cost an empty
  // ibv_poll_cq a pass (~60 instructions on rxe, ~120 a call in
  // bench/cpu_per_call); what lands meanwhile is the next pass's, and a spin
  // waits only after a drain that found nothing. In event mode the drain goes
  // on to an empty poll before the wait: a completion that lands after a short
  // poll would cost a wake-up (event read, re-arm, epoll_wait), far more than
  // the poll (docs/transport.md, "Pollers").
  bool DrainToEmpty(SinkBox& box, bool* any = nullptr) {
    Batch b;
    while ((b.n = ibv_poll_cq(cq_, kBatch, b.wc.data())) > 0) {
      if (any) *any = true;
      try {
        box.sink({b.wc.data(), static_cast<size_t>(b.n)});
      } catch (...) {
        if (!box.stopped) ResumeAfterThrow();
        throw;
      }
      if (box.stopped) return false;
      if (b.n < kBatch && spin_ != Spin::kNone) break;
    }
    return true;
  }

  // A handler threw out of the sink (Asio lets the exception out of run()):
  // the batch is the connection's (it goes on with it), the CQ behind it is
  // ours. Spinning, the next pass; on events, a drain from a posted task (the
  // CQ was armed before this drain: what is left in it raises no event), then
  // the wait, unless one is pending (the drain after Arm()).
  void ResumeAfterThrow() {
    if (spin_ != Spin::kNone) {
      quiet_.Activity();
      PostSpin();
      return;
    }
    asio::post(fd_.get_executor(), transport::WithHandlerMemory([this, box = box_] {
      if (box->stopped || !DrainToEmpty(*box)) return;
      if (!waiting_) Wait();
    }));
  }

  ibv_cq* cq_;
  ibv_comp_channel* channel_;
  asio::posix::stream_descriptor fd_;
  std::shared_ptr<SinkBox> box_;
  asio::any_io_executor spin_ex_{fd_.get_executor()};
  unsigned unacked_ = 0;
  bool waiting_ = false;  // Wait()'s async_wait is pending
  const Spin spin_;
  QuietTimer quiet_;
  // Spinning on an io_context one thread runs: its group runs the passes.
  transport::PollGroup* const group_ = spin_ == Spin::kNone ? nullptr : transport::PollGroup::For(spin_ex_);
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
      if (auto st = MakeNonBlocking(channel_->fd, "the completion channel"); !st.ok()) return st;
    }
    thread_ = std::thread([this] { Loop(); });
    pthread_setname_np(thread_.native_handle(), "rdmarpc-poll");
    PinThread(thread_, cpu);
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
  // Returns true when at least one completion was delivered.
  bool Drain() { return DrainTo(cq_, ex_, box_); }

  void Loop() {
    QuietTimer quiet(spin_);
    uint32_t empty_polls = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (Drain()) {
        quiet.Activity();
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
      if (!quiet.Expired()) continue;
      // Adaptive: arm, drain once more (closes the race), then sleep.
      ibv_req_notify_cq(cq_, 0);
      if (Drain()) {
        quiet.Activity();
        continue;
      }
      pollfd pfd{channel_->fd, POLLIN, 0};
      // Wake up now and then to notice Stop(); completions wake us at once.
      if (::poll(&pfd, 1, 20) > 0) TakeCqEvents(channel_, cq_, unacked_);
      quiet.Activity();
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
                                                      std::chrono::microseconds spin, Sink sink,
                                                      bool run_to_completion) {
  if (mode == PollMode::kEvent || run_to_completion) {
    const auto how = mode == PollMode::kEvent      ? EventPoller::Spin::kNone
                     : mode == PollMode::kAdaptive ? EventPoller::Spin::kAdaptive
                                                   : EventPoller::Spin::kBusy;
    auto p = std::make_unique<EventPoller>(std::move(ex), cq, channel, how, spin, std::move(sink));
    if (auto st = p->Arm(); !st.ok()) return st;
    return std::unique_ptr<Poller>(std::move(p));
  }
  auto p = std::make_unique<ThreadPoller>(mode, std::move(ex), cq, channel, spin, std::move(sink));
  if (auto st = p->Run(cpu); !st.ok()) return st;
  return std::unique_ptr<Poller>(std::move(p));
}

// ---- shared pollers ----------------------------------------------------------

namespace {

// One CQ polled by a group thread. Owned by its GroupMember handle; the
// thread sees it only through Worker::members_, under the worker's lock.
struct Member {
  ibv_cq* cq;
  ibv_comp_channel* channel;
  asio::any_io_executor ex;
  std::shared_ptr<SinkBox> box;
  unsigned unacked = 0;  // Under the worker's lock.
};

}  // namespace

class PollerGroup::Worker {
 public:
  Worker(PollMode mode, std::chrono::microseconds spin) : mode_(mode), spin_(spin) {}
  ~Worker() {
    stop_.store(true, std::memory_order_relaxed);
    Wake();
    if (thread_.joinable()) thread_.join();
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  absl::Status Run(int cpu) {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return ErrnoStatus(errno, "eventfd for a shared poller");
    thread_ = std::thread([this] { Loop(); });
    pthread_setname_np(thread_.native_handle(), "rdmarpc-poll");
    PinThread(thread_, cpu);
    return absl::OkStatus();
  }

  size_t load() const { return load_.load(std::memory_order_relaxed); }

  void Add(Member* m) {
    {
      std::lock_guard lock(mu_);
      members_.push_back(m);
      ++generation_;
    }
    load_.fetch_add(1, std::memory_order_relaxed);
    // A sleeping thread must arm the new CQ and watch its channel; one
    // that completions would never wake must be told.
    Wake();
  }

  // After this returns the thread never touches m's CQ again.
  void Remove(Member* m) {
    std::lock_guard lock(mu_);
    auto it = std::find(members_.begin(), members_.end(), m);
    if (it == members_.end()) return;
    members_.erase(it);
    ++generation_;
    load_.fetch_sub(1, std::memory_order_relaxed);
    // Events taken must be acked before the CQ can be destroyed.
    if (m->unacked > 0) ibv_ack_cq_events(m->cq, m->unacked);
    m->unacked = 0;
  }

 private:
  void Wake() {
    if (wake_fd_ < 0) return;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  // Every member's CQ to empty. Under the lock.
  bool DrainAll() {
    bool any = false;
    for (Member* m : members_) any |= DrainTo(m->cq, m->ex, m->box);
    return any;
  }

  void Loop() {
    QuietTimer quiet(spin_);
    uint32_t empty_polls = 0;
    std::vector<pollfd> fds;
    std::vector<Member*> watched;
    uint64_t watched_generation = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      bool any = false, empty = false;
      {
        std::lock_guard lock(mu_);
        any = DrainAll();
        empty = members_.empty();
      }
      if (any) {
        quiet.Activity();
        empty_polls = 0;
        continue;
      }
      const bool sleep = empty || (mode_ == PollMode::kAdaptive && quiet.Expired());
      if (!sleep) {
        if (mode_ == PollMode::kBusy && ++empty_polls % kPollsPerYield == 0) sched_yield();
        continue;
      }
      // Arm every CQ, drain once more (closes the race), then sleep on the
      // channels and the wake-up fd. Busy threads with no CQs sleep too.
      {
        std::lock_guard lock(mu_);
        if (mode_ == PollMode::kAdaptive)
          for (Member* m : members_) ibv_req_notify_cq(m->cq, 0);
        any = DrainAll();
        fds.clear();
        fds.push_back({wake_fd_, POLLIN, 0});
        watched.clear();
        if (mode_ == PollMode::kAdaptive) {
          for (Member* m : members_) {
            fds.push_back({m->channel->fd, POLLIN, 0});
            watched.push_back(m);
          }
        }
        watched_generation = generation_;
      }
      if (any) {
        quiet.Activity();
        continue;
      }
      // The timeout only bounds a missed wake-up; completions and Add() wake us.
      if (::poll(fds.data(), fds.size(), 100) > 0) {
        if (fds[0].revents & POLLIN) {
          uint64_t v;
          [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof v);
        }
        std::lock_guard lock(mu_);
        if (generation_ == watched_generation) {
          for (size_t i = 0; i < watched.size(); ++i)
            if (fds[i + 1].revents) TakeCqEvents(watched[i]->channel, watched[i]->cq, watched[i]->unacked);
        } else if (mode_ == PollMode::kAdaptive) {
          // Members came or went while we slept: their channels are
          // non-blocking, so taking from all of them is safe.
          for (Member* m : members_) TakeCqEvents(m->channel, m->cq, m->unacked);
        }
      }
      quiet.Activity();
    }
  }

  static constexpr uint32_t kPollsPerYield = 256;
  const PollMode mode_;
  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::vector<Member*> members_;  // Under mu_.
  uint64_t generation_ = 0;       // Under mu_; bumped on every Add/Remove.
  std::atomic<size_t> load_{0};
  std::atomic<bool> stop_{false};
  int wake_fd_ = -1;
  std::thread thread_;
};

namespace {

class GroupMember final : public Poller {
 public:
  GroupMember(std::shared_ptr<PollerGroup> group, PollerGroup::Worker* worker, std::unique_ptr<Member> m)
      : group_(std::move(group)), worker_(worker), member_(std::move(m)) {}
  ~GroupMember() override { Stop(); }
  void Stop() override {
    if (member_->box->stopped) return;
    member_->box->stopped = true;
    worker_->Remove(member_.get());
  }

 private:
  std::shared_ptr<PollerGroup> group_;  // Keeps the worker thread alive.
  PollerGroup::Worker* worker_;
  std::unique_ptr<Member> member_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<PollerGroup>> PollerGroup::Start(PollMode mode, unsigned threads,
                                                                std::vector<int> cpus,
                                                                std::chrono::microseconds spin) {
  if (mode == PollMode::kEvent)
    return absl::InvalidArgumentError(
        "shared pollers need poll mode busy or adaptive (event mode polls on the connection's executor, "
        "with no poller thread to share)");
  if (threads == 0 || threads > kMaxSharedPollers)
    return absl::InvalidArgumentError(
        absl::StrCat("shared_pollers must be between 1 and ", kMaxSharedPollers, ", got ", threads));
  auto group = std::shared_ptr<PollerGroup>(new PollerGroup(mode, spin));
  for (unsigned i = 0; i < threads; ++i) {
    group->workers_.push_back(std::make_unique<Worker>(mode, spin));
    if (auto st = group->workers_.back()->Run(cpus.empty() ? -1 : cpus[i % cpus.size()]); !st.ok()) return st;
  }
  return group;
}

PollerGroup::PollerGroup(PollMode mode, std::chrono::microseconds spin) : mode_(mode), spin_(spin) {}
PollerGroup::~PollerGroup() = default;

unsigned PollerGroup::threads() const { return static_cast<unsigned>(workers_.size()); }

std::vector<size_t> PollerGroup::Load() const {
  std::vector<size_t> out;
  for (const auto& w : workers_) out.push_back(w->load());
  return out;
}

absl::StatusOr<std::unique_ptr<Poller>> PollerGroup::Add(asio::any_io_executor ex, ibv_cq* cq,
                                                         ibv_comp_channel* channel, Poller::Sink sink) {
  if (mode_ == PollMode::kAdaptive)
    if (auto st = MakeNonBlocking(channel->fd, "the completion channel"); !st.ok()) return st;
  Worker* least = workers_.front().get();
  for (const auto& w : workers_)
    if (w->load() < least->load()) least = w.get();
  auto box = std::make_shared<SinkBox>();
  box->sink = std::move(sink);
  auto m = std::make_unique<Member>(Member{cq, channel, std::move(ex), std::move(box)});
  least->Add(m.get());
  return std::unique_ptr<Poller>(new GroupMember(shared_from_this(), least, std::move(m)));
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
