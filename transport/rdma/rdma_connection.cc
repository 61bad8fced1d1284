// The RDMA connection: send path, receive path, rendezvous, credits.
// Layout of this file: resources and setup, send path, receive path,
// completion dispatch, failure and close, then Listen/Connect.
#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <system_error>
#include <thread>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "absl/strings/str_cat.h"
#include "transport/common/auth.h"
#include "transport/common/log.h"
#include "transport/common/fifo.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"
#include "transport/rdma/access.h"
#include "transport/rdma/buffer_pool.h"
#include "transport/rdma/credits.h"
#include "transport/rdma/poller.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {
namespace {

using transport::Message;
using transport::ReceiveHandler;
using transport::SendBuffer;
using transport::SendHandler;

// wr_id layout: kind (8 bits) | WRs covered by this completion (8 bits) | index (48 bits).
// kWrBind (a grant window's BIND_MW) and kWrInval (its LOCAL_INV) are
// signalled local operations, each posted alone on an idle send queue
// (kLocalOpsAlone). kWrCover: a SEND whose slot was freed when it was posted
// (kSelectiveSignalling); when signalled, its completion only accounts for
// itself and the unsignalled SENDs before it.
enum WrKind : uint64_t { kWrSend = 1, kWrRecv = 2, kWrWrite = 3, kWrBind = 4, kWrInval = 5, kWrCover = 6 };
constexpr uint64_t MakeWrId(WrKind kind, uint64_t covered, uint64_t index) {
  return (static_cast<uint64_t>(kind) << 56) | (covered << 48) | index;
}
constexpr WrKind WrKindOf(uint64_t id) { return static_cast<WrKind>(id >> 56); }
constexpr uint64_t WrCovered(uint64_t id) { return (id >> 48) & 0xFF; }
constexpr uint64_t WrIndex(uint64_t id) { return id & ((uint64_t{1} << 48) - 1); }

// kLocalOpsAlone: a BIND_MW or LOCAL_INV is posted only when nothing else is
// outstanding on the send queue, and nothing is posted behind it until it
// completes. rxe (Linux 6.1) executes local operations when the requester
// reaches them but completes them only when the completer reaches them in
// order, and a retransmission rewinds the requester to the oldest uncompleted
// WQE and executes everything from there again, local operations included
// (req_retry skips "done" WQEs, the requester does not). A LOCAL_INV run twice
// finds its window already free and dereferences the MR and QP it no longer
// has; a BIND_MW run twice fails with a bind error. Between two VMs, where the
// UDP wire does drop frames, windowed grants made connections go silent
// (faults_rpc_netem, faults_rpc_poweroff in CI). Alone on an idle queue, a
// signalled local operation is the head WQE when the completer runs, which it
// is scheduled to at once, so no retry can reach it.

// kSelectiveSignalling: an untracked (SendUntracked) DATA frame small enough
// to go inline, posted while a completion batch is handled, is done when it
// is posted: the provider has copied it (IBV_SEND_INLINE), so its slot is free
// at once, and the sink hears of it at the end of the batch. Such SENDs go
// unsignalled, all but one in kUnsignaledRun (and any posted while a local
// operation waits), so a ping-pong answered from the sink costs no send
// completion on either side: no CQE written, polled and dispatched per
// message. A send queue entry is free only when a later signalled WR
// completes (a NIC retires unsignalled WQEs with the next CQE), so sq_used_
// keeps counting them until then: a signalled SEND's completion covers the
// unsignalled ones posted before it (wr_id's covered count). When the queue
// must drain for a local operation and unsignalled SENDs are the only thing
// left on it, nothing would ever report them: a signalled CREDIT frame goes
// behind them (CoverUnsignaled).

// kNoHandlerAssign: Boost 1.81's any_completion_handler move *assignment*
// copies its argument as an lvalue, which re-wraps the handler in itself
// without end (fixed in Boost 1.82). This file therefore never move-assigns a
// handler (swap, construct, or assign nullptr instead) and keeps handlers in
// containers that never shift elements by assignment.

// Buffer tokens (Message/SendBuffer -> BufferOwner::Release).
enum TokenKind : uint64_t { kTokSendSlot = 1, kTokRecvSlot = 2, kTokLargeOut = 3, kTokLargeIn = 4 };
constexpr uint64_t MakeToken(TokenKind k, uint64_t index) { return (static_cast<uint64_t>(k) << 56) | index; }
constexpr TokenKind TokenKindOf(uint64_t t) { return static_cast<TokenKind>(t >> 56); }
constexpr uint64_t TokenIndex(uint64_t t) { return t & ((uint64_t{1} << 56) - 1); }

// Send slots only control frames (RTS/CTS/CREDIT) may take: if messages
// waiting for credits held every slot, the CREDIT frame that would unblock
// the peer (and so us) could never be built.
constexpr uint32_t kControlSlots = 4;

// Slot stride: header + payload rounded to a cache line, so slots never share one.
size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }
size_t RoundDown(size_t v, size_t to) { return v / to * to; }

// The free send slots: a stack of at most `capacity` slot numbers, sized once.
// (std::vector's push_back, with its growth path, was a call of ~23
// instructions, twice a message.)
class SlotStack {
 public:
  void Reset(uint32_t capacity) {
    slots_ = std::make_unique<uint32_t[]>(capacity);
    capacity_ = capacity;
    size_ = 0;
  }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  uint32_t back() const {
    assert(size_ > 0);
    return slots_[size_ - 1];
  }
  void pop_back() {
    assert(size_ > 0);
    --size_;
  }
  void push_back(uint32_t slot) {
    assert(size_ < capacity_);  // a slot freed twice
    slots_[size_++] = slot;
  }

 private:
  std::unique_ptr<uint32_t[]> slots_;
  uint32_t capacity_ = 0;
  uint32_t size_ = 0;
};

// Memory registered for one large message: an exact-size MR, so a grant's
// rkey covers exactly the granted bytes and dies with the deregistration.
struct LargeBuffer {
  std::unique_ptr<std::byte[]> memory;
  size_t size = 0;
  MrPtr mr;
};

}  // namespace

class RdmaConnectionImpl final : public std::enable_shared_from_this<RdmaConnectionImpl>,
                                 public transport::BufferOwner {
 public:
  RdmaConnectionImpl(asio::any_io_executor ex, std::shared_ptr<RdmaContext> ctx, RdmaOptions opt)
      : ex_(std::move(ex)), ctx_(std::move(ctx)), opt_(opt) {}

  ~RdmaConnectionImpl() {
    if (poller_) poller_->Stop();
    sink_ready_.clear();  // Messages point at this: back while the members they touch exist
    poller_.reset();
    if (ep_) {
      // QP, CQ and cm_id go on a thread of their own (QpTeardown).
      ep_->PrepareTeardown();
      auto held = std::make_unique<QpTeardown>();
      held->ctx = ctx_;
      held->channel = std::move(channel_);
      held->cq = std::move(cq_);
      held->ep = std::move(ep_);
      ReleaseOnThread(std::move(held));
    }
  }

  // ---- setup ---------------------------------------------------------------

  // Allocates slots, CQ and QP on `ep` and posts every receive. Executor only.
  absl::Status Init(std::unique_ptr<CmEndpoint> ep) {
    ep_ = std::move(ep);
    const Device& dev = ctx_->device();
    if (opt_.recv_depth < 2 || opt_.ctrl_depth < 3 || opt_.send_depth < 2)
      return absl::InvalidArgumentError("RdmaOptions: recv_depth >= 2, ctrl_depth >= 3, send_depth >= 2");
    if (opt_.eager_limit > (size_t{1} << 30))
      return absl::InvalidArgumentError("RdmaOptions: eager_limit above 1 GiB");
    if (opt_.recv_repost_batch > kMaxRepostBatch)
      return absl::InvalidArgumentError(absl::StrCat("RdmaOptions: recv_repost_batch ", opt_.recv_repost_batch,
                                                     " is above ", kMaxRepostBatch,
                                                     " (0 picks recv_depth / 8; 1 reposts each receive at once)"));
    repost_batch_ = opt_.recv_repost_batch != 0
                        ? std::min<uint32_t>(opt_.recv_repost_batch, opt_.recv_depth)
                        : std::clamp<uint32_t>(opt_.recv_depth / 8, 1, kMaxRepostBatch);
    // One SEND carries an eager message: the device's largest message
    // (max_msg_sz; rxe: 8 MiB) bounds it. Past it a NIC that enforces its
    // limit fails the WR and with it the connection.
    eager_limit_ = opt_.eager_limit;
    if (const size_t dev_max = dev.port().attr.max_msg_sz; dev_max > wire::kHeaderSize &&
                                                            eager_limit_ > dev_max - wire::kHeaderSize) {
      eager_limit_ = RoundDown(dev_max - wire::kHeaderSize, 64);
      RDMARPC_LOG(kInfo, "rdma", "event=eager_limit_clamped device=", dev.name(), " max_msg_sz=", dev_max,
                  " eager_limit=", eager_limit_);
    }
    // The smallest slot must hold a CTS (header + grant).
    slot_bytes_ = RoundUp(wire::kHeaderSize + std::max(eager_limit_, wire::kGrantSize), 64);
    // Twice the SQ depth: messages prepared while the SQ is full (or while
    // waiting for credits) need somewhere to wait that is not the caller.
    send_slots_ = 2u * opt_.send_depth + kControlSlots;
    recv_slots_ = opt_.recv_depth + opt_.ctrl_depth;
    const size_t bytes = slot_bytes_ * (send_slots_ + recv_slots_);
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mmap of ", bytes, " slot bytes"));
    slots_ = SlotMemory(static_cast<std::byte*>(mem), bytes);
    auto mr = dev.RegisterMemory(mem, bytes, access::kLocalOnly);
    if (!mr.ok()) return mr.status();
    slots_mr_ = std::move(*mr);

    // Every WR that can be outstanding may complete at once: the CQ holds them all.
    const int cq_depth = static_cast<int>(opt_.send_depth + recv_slots_);
    if (cq_depth > dev.attr().max_cqe)
      return absl::InvalidArgumentError(absl::StrCat("send_depth + recv_depth + ctrl_depth = ", cq_depth,
                                                     " exceeds ", dev.name(), "'s max CQ size ",
                                                     dev.attr().max_cqe));
    if (opt_.send_depth > dev.attr().max_qp_wr || static_cast<int>(recv_slots_) > dev.attr().max_qp_wr)
      return absl::InvalidArgumentError(absl::StrCat("queue depth exceeds ", dev.name(),
                                                     "'s max_qp_wr ", dev.attr().max_qp_wr));
    auto ch = CreateCompChannel(dev);
    if (!ch.ok()) return ch.status();
    channel_ = std::move(*ch);
    auto cq = CreateCq(dev, cq_depth, channel_.get());
    if (!cq.ok()) return cq.status();
    cq_ = std::move(*cq);

    ibv_qp_init_attr attr{};
    attr.send_cq = cq_.get();
    attr.recv_cq = cq_.get();
    attr.cap.max_send_wr = opt_.send_depth;
    unsignaled_run_ = std::clamp<uint32_t>(opt_.send_depth / 2, 1, kUnsignaledRun);
    attr.cap.max_recv_wr = recv_slots_;
    // Two: a registered Buffer goes out as header (from a send slot) + the
    // application's bytes, gathered by the NIC (SendRegistered).
    attr.cap.max_send_sge = 2;
    attr.cap.max_recv_sge = 1;
    // Header + a small message inline saves the NIC a DMA read of the slot,
    // and lets an untracked one go unsignalled (kSelectiveSignalling). 236
    // bytes (perftest's default for RC) hold a small RPC: a 64-byte protobuf
    // echo is ~114 bytes with the RPC and wire headers. A device that cannot
    // inline that much gets a QP with header + 64 bytes.
    attr.cap.max_inline_data = 236;
    absl::Status qp_st = ep_->CreateQp(dev.pd(), attr);
    if (!qp_st.ok()) {
      attr.cap.max_inline_data = 64 + wire::kHeaderSize;
      qp_st = ep_->CreateQp(dev.pd(), attr);
    }
    if (!qp_st.ok()) return qp_st;
    ibv_qp_attr qattr{};
    ibv_qp_init_attr qinit{};
    if (ibv_query_qp(ep_->qp(), &qattr, IBV_QP_CAP, &qinit) == 0) max_inline_ = qinit.cap.max_inline_data;
    max_write_chunk_ = std::max<size_t>(dev.port().attr.max_msg_sz, 4096);

    free_send_slots_.Reset(send_slots_);
    for (uint32_t i = 0; i < send_slots_; ++i) free_send_slots_.push_back(i);
    slot_handlers_.resize(send_slots_);
    slot_lent_.resize(send_slots_);
    slot_untracked_.resize(send_slots_);
    for (uint32_t i = 0; i < recv_slots_; ++i)
      if (auto st = PostRecv(i); !st.ok()) return st;
    return absl::OkStatus();
  }

  // Our hello for the rdma_cm private data; a connector with an auth token
  // appends its proof (transport/common/auth.h).
  absl::StatusOr<std::string> HelloBytes(bool with_proof) const {
    std::string out(wire::kHelloSize, '\0');
    wire::EncodeHello({opt_.recv_depth, opt_.ctrl_depth, static_cast<uint32_t>(slot_bytes_),
                       opt_.max_message_size,
                       static_cast<uint16_t>((with_proof ? wire::kHelloAuthProof : 0) |
                                             (opt_.data_header_in_immediate ? wire::kHelloImmData : 0))},
                      reinterpret_cast<std::byte*>(out.data()));
    if (with_proof) {
      auto proof = transport::auth::MakeProof(opt_.auth_token);
      if (!proof.ok()) return proof.status();
      out.append(reinterpret_cast<const char*>(proof->data()), proof->size());
    }
    return out;
  }

  // Applies the peer's hello and starts polling. Executor only.
  absl::Status Start(const std::string& peer_hello, std::string peer_uri) {
    auto hello = wire::DecodeHello(
        {reinterpret_cast<const std::byte*>(peer_hello.data()), peer_hello.size()});
    if (!hello.ok()) return hello.status();
    peer_uri_ = std::move(peer_uri);
    ledger_.emplace(hello->recv_data, hello->recv_ctrl, opt_.recv_depth, opt_.ctrl_depth);
    peer_max_message_ = hello->max_message;
    eager_to_peer_ = std::min<size_t>(eager_limit_, hello->recv_slot_bytes - wire::kHeaderSize);
    imm_to_peer_ = opt_.data_header_in_immediate && (hello->flags & wire::kHelloImmData) != 0;
    // Each send slot can hold its sender's handler until the SEND completes,
    // and a starved completer lets them pile up to that bound: make room for
    // them now, so the steady state never meets a new peak on the heap.
    transport::ReserveHandlerMemory(send_slots_ + 16);

    // No reference taken per batch (a weak lock and its release cost ~40
    // instructions a call in bench/cpu_per_call). The poller never calls the
    // sink once Stop() returned, which Fail() and ~RdmaConnectionImpl do, and
    // from Start() until Fail() the CM watcher (WatchCm, started below) holds
    // a reference; its end after Fail() is posted, so it spans every batch. A
    // handler that lets go of the last outside reference inside a batch
    // therefore never destroys `this` under OnCompletions (the conformance
    // tests that destroy a connection from inside its sink and its receive
    // handler check this under ASan).
    Poller::Sink sink = [this](std::span<const ibv_wc> wcs) { OnCompletions(wcs); };
    absl::StatusOr<std::unique_ptr<Poller>> poller;
    if (opt_.shared_pollers > 0) {
      auto group = ctx_->SharedPollers(opt_);
      if (!group.ok()) return group.status();
      poller = (*group)->Add(ex_, cq_.get(), channel_.get(), std::move(sink));
    } else {
      int cpu = opt_.poller_cpu;
      if (cpu < 0 && opt_.poll_mode != PollMode::kEvent && !opt_.run_to_completion) {
        auto cpus = LocalCpus(ctx_->device());
        cpu = cpus.empty() ? -1 : cpus[ctx_->NextPollerSlot() % cpus.size()];
      }
      poller = Poller::Start(opt_.poll_mode, ex_, cq_.get(), channel_.get(), cpu, opt_.adaptive_spin,
                             std::move(sink), opt_.run_to_completion);
    }
    if (!poller.ok()) return poller.status();
    poller_ = std::move(*poller);
    WatchCm();
    RDMARPC_LOG(kInfo, "rdma", "event=established peer=", peer_uri_, " device=", ctx_->device().name(),
                " poll=", PollModeName(opt_.poll_mode),
                opt_.shared_pollers ? " (shared)" : opt_.run_to_completion ? " (run to completion)" : "", " eager_limit=", eager_to_peer_,
                " credits=", hello->recv_data);
    return absl::OkStatus();
  }

  // ---- seam ------------------------------------------------------------------

  const asio::any_io_executor& executor() const { return ex_; }
  std::string peer() const { return peer_uri_; }
  size_t max_message_size() const { return std::min<uint64_t>(opt_.max_message_size, peer_max_message_); }

  absl::Status TooLarge(size_t size) const {
    return absl::InvalidArgumentError(absl::StrCat("message of ", size, " bytes exceeds the limit of ",
                                                   max_message_size(), " bytes on this connection"));
  }

  absl::StatusOr<SendBuffer> Prepare(size_t size) {
    if (!error_.ok()) return error_;
    if (size > max_message_size()) return TooLarge(size);
    if (size <= eager_to_peer_) {
      if (free_send_slots_.size() <= kControlSlots)
        return absl::ResourceExhaustedError(absl::StrCat(
            "all ", send_slots_ - kControlSlots, " send slots are in use; wait for sends to complete or raise "
            "RdmaOptions::send_depth"));
      uint32_t slot = free_send_slots_.back();
      free_send_slots_.pop_back();
      return SendBuffer({SendSlot(slot) + wire::kHeaderSize, size}, this, MakeToken(kTokSendSlot, slot));
    }
    LargeOut out;
    if (auto pool = SendPool(); pool != nullptr && size <= pool->options().class_bytes.back()) {
      if (auto b = pool->Acquire(size); b.ok()) {
        out.data = b->data().data();
        out.lkey = b->lkey();
        out.pooled = std::move(*b);
      }
    }
    if (!out.pooled) {  // Above the largest class, or the pool is at its cap.
      auto large = AllocateLarge(size, access::kLocalOnly);
      if (!large.ok()) return large.status();
      out.data = large->memory.get();
      out.lkey = large->mr->lkey;
      out.own = std::move(*large);
      ++stats_.rendezvous_send_registrations;
    }
    out.size = size;
    uint64_t id = next_large_out_++;
    std::byte* data = out.pooled ? out.pooled.data().data() : out.own.memory.get();
    large_out_.emplace(id, std::move(out));
    return SendBuffer({data, size}, this, MakeToken(kTokLargeOut, id));
  }

  // Zero-copy send of the application's registered bytes: header from a send
  // slot and payload from `buffer`, gathered by one SEND (eager), or RDMA
  // WRITE straight from `buffer` after the peer's grant (rendezvous). The
  // connection keeps `buffer` until the send completes (or until it is
  // destroyed, after a failure).
  void SendRegistered(std::shared_ptr<const Buffer> buffer, SendHandler handler) {
    absl::Status st;
    if (!error_.ok()) {
      st = error_;  // First: after a device removal there is no context to compare with.
    } else if (buffer == nullptr || !*buffer) {
      st = absl::InvalidArgumentError("SendRegistered: empty Buffer");
    } else if (buffer->protection_domain() != ctx_->device().pd()) {
      st = absl::InvalidArgumentError(absl::StrCat(
          "SendRegistered: the Buffer's memory is not registered in this connection's protection domain (",
          ctx_->device().name(), "); take it from a BufferPool made with BufferPool::CreateForDevice on the "
          "device of the RdmaContext this connection was made with"));
    } else if (buffer->size() > max_message_size()) {
      st = TooLarge(buffer->size());
    }
    if (!st.ok()) {
      transport::PostCompletion(ex_, std::move(handler), std::move(st));
      return;
    }
    const size_t size = buffer->size();
    LargeOut out;
    out.data = buffer->data().data();
    out.size = size;
    out.lkey = buffer->lkey();
    out.lent = std::move(buffer);
    const uint64_t id = next_large_out_++;
    if (size <= eager_to_peer_) {
      large_out_.emplace(id, std::move(out));
      pending_.push_back({Op::kDataLent, 0, size, id, std::move(handler)});
    } else {
      out.handler.swap(handler);
      out.queued = true;
      large_out_.emplace(id, std::move(out));
      pending_.push_back({Op::kRts, 0, size, id, {}});
    }
    ++stats_.messages_sent;
    stats_.bytes_sent += size;
    Pump();
  }

  void Send(SendBuffer buffer, SendHandler handler) {
    if (buffer.owner() != this) {
      if (handler)
        transport::PostCompletion(ex_, std::move(handler),
                                  absl::InvalidArgumentError("SendBuffer was not prepared by this connection"));
      return;
    }
    const size_t size = buffer.size();
    const uint64_t token = buffer.Detach();
    if (!error_.ok()) {
      Release(token);
      if (handler) transport::PostCompletion(ex_, std::move(handler), error_);
      return;
    }
    if (TokenKindOf(token) == kTokSendSlot) {
      const auto slot = static_cast<uint32_t>(TokenIndex(token));
      // Onto the QP now if Pump would post it now, without the queue's round
      // trip (the common case: an answer, or a call with few in flight).
      if (PumpWouldPostDataNow()) {
        waiting_for_credit_ = false;  // as Pump's DATA step: a credit is there
        ++stats_.messages_sent;
        stats_.bytes_sent += size;
        if (auto st = PostData(size, handler, slot); !st.ok()) return Fail(st);
        MaybeReturnCredits();
        return;
      }
      pending_.push_back({Op::kData, slot, size, 0, std::move(handler)});
    } else {
      auto& lo = large_out_.at(TokenIndex(token));
      lo.untracked = !handler;
      lo.handler.swap(handler);
      lo.queued = true;
      pending_.push_back({Op::kRts, 0, size, TokenIndex(token), {}});
    }
    ++stats_.messages_sent;
    stats_.bytes_sent += size;
    Pump();
  }

  void Receive(ReceiveHandler handler) {
    if (sink_ != nullptr) {
      transport::PostCompletion(ex_, std::move(handler),
                                absl::StatusOr<transport::Message>(
                                    absl::FailedPreconditionError("Receive() on a connection with a MessageSink")));
      return;
    }
    if (!error_.ok() && ready_.empty()) {
      transport::PostCompletion(ex_, std::move(handler), error_);
      return;
    }
    const uint64_t id = next_receive_id_++;
    auto slot = asio::get_associated_cancellation_slot(handler);
    if (slot.is_connected()) {
      // Runs inside emit(), which Asio requires on the operation's executor
      // (signals and slots are not thread-safe), as the TCP backend does: a
      // cancel emitted before a racing arrival is processed wins. Weak: Asio
      // keeps the handler installed until the slot is reused.
      std::weak_ptr<RdmaConnectionImpl> weak = weak_from_this();
      slot.assign([weak, id](asio::cancellation_type type) {
        if (type == asio::cancellation_type::none) return;
        if (auto self = weak.lock()) self->CancelReceive(id);
      });
    }
    receivers_.push_back({id, std::move(handler)});
    Deliver();
  }

  bool SetSink(transport::MessageSink* sink) {
    if (sink == nullptr || sink_ != nullptr || closed_by_user_ || !receivers_.empty()) return false;
    sink_ = sink;
    if (!ready_.empty() || !error_.ok()) PostSinkDrain();
    return true;
  }

  void Close() {
    if (closed_by_user_) return;
    closed_by_user_ = true;
    sink_ = nullptr;
    sink_ready_.clear();
    Fail(absl::CancelledError("connection closed locally"), /*log=*/false);
  }

  uint64_t frames_received() const { return stats_.frames_received; }

  // Connection::HoldSends/ReleaseSends: the completion path's DoorbellHold,
  // taken by the application around a burst of its own. Executor only.
  void HoldSends() { ++doorbell_hold_; }
  void ReleaseSends() {
    if (doorbell_hold_ == 0) return;  // a release without a hold
    if (--doorbell_hold_ != 0 || held_.sends == 0) return;
    if (auto st = RingDoorbells(); !st.ok()) return Fail(st);
    // SENDs done at their post (only made while a completion batch is
    // handled, so only when this hold was taken inside one's handler and
    // outlived it): reported as the batch would have, never inside this call.
    if (done_at_post_ != 0)
      asio::post(ex_, transport::WithHandlerMemory([self = shared_from_this()] { self->ReportDoneAtPost(); }));
  }

  transport::ConnectionStats stats() const {
    auto s = stats_;
    s.credits_available = ledger_ ? ledger_->data_credits() : 0;
    s.grants_live = grants_.size();
    s.rendezvous_bytes_held = large_in_bytes_;
    s.send_queue_used = sq_used_;
    s.invalidations_pending = invalidations_.size() + (local_op_ == LocalOp::kInvalidate ? 1 : 0);
    if (send_pool_) s.send_pool_registered_bytes = send_pool_->Stats().registered_bytes;
    if (ep_ && ep_->qp() != nullptr) {
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      if (ibv_query_qp(ep_->qp(), &attr, IBV_QP_STATE, &init) == 0) s.qp_state = 1 + static_cast<uint64_t>(attr.qp_state);
    }
    return s;
  }

  // Message / SendBuffer memory coming back. Executor only.
  void Release(uint64_t token) noexcept override {
    const uint64_t index = TokenIndex(token);
    switch (TokenKindOf(token)) {
      case kTokSendSlot:  // A prepared buffer dropped unsent.
        free_send_slots_.push_back(static_cast<uint32_t>(index));
        break;
      case kTokLargeOut:
        large_out_.erase(index);
        break;
      case kTokLargeIn:
        if (auto it = large_in_.find(index); it != large_in_.end()) {
          large_in_bytes_ -= it->second.size;
          large_in_.erase(it);
        }
        if (error_.ok() && !deferred_rts_.empty()) {
          GrantDeferred();
          Pump();
        }
        break;
      case kTokRecvSlot:
        if (error_.ok() && !StalledForTest()) {
          // Back to the receive queue with the next ones (FlushReposts).
          repost_[repost_n_++] = static_cast<uint32_t>(index);
          if (repost_n_ >= repost_batch_ || ledger_->peer_data_estimate() == 0) FlushReposts();
        }
        break;
    }
  }

 private:
  enum class Op { kData, kDataLent, kRts, kCts, kWrite };
  struct PendingOp {
    Op op;
    uint32_t slot;      // kData: the send slot holding header room + payload; kCts: the peer's cookie.
    size_t size;        // kData/kDataLent: payload bytes; kRts: message bytes.
    uint64_t id;        // kDataLent/kRts/kWrite: large_out_ key; kCts: large_in_ key.
    SendHandler handler;  // kData and kDataLent only.
  };
  struct LargeOut {
    // From the connection's send pool, registered for this message alone, or
    // the application's own registered Buffer (SendRegistered, eager or not).
    Buffer pooled;
    LargeBuffer own;
    std::shared_ptr<const Buffer> lent;
    const std::byte* data = nullptr;
    size_t size = 0;
    uint32_t lkey = 0;
    SendHandler handler;
    bool untracked = false;  // SendUntracked(): its completion is counted to the sink
    bool queued = false;
    wire::Grant grant{};
  };
  struct LargeIn {
    // Where the peer writes: a grant-pool buffer with a type-2 window bound
    // over exactly `size` bytes of it, or memory registered for this message.
    LargeBuffer own;
    Buffer pooled;
    MwPtr window;  // Declared after `pooled`: deallocated (unbound) before the buffer goes back.
    std::byte* data = nullptr;
    size_t size = 0;
    uint32_t rkey = 0;
    uint32_t grant_id = 0;
    bool bound = false;  // Its window's BIND_MW completed: the CTS may go.
    bool complete = false;
  };
  struct ReadyEntry {  // Messages in arrival order; rendezvous ones wait for their data.
    bool large;
    uint64_t index;  // Recv slot or large_in_ key.
    size_t size;
    uint32_t body_at;  // Recv slot: where the body starts.
  };
  struct PendingReceive {
    uint64_t id;
    ReceiveHandler handler;
  };
  // Owns the mmap'ed slot area.
  class SlotMemory {
   public:
    SlotMemory() = default;
    SlotMemory(std::byte* p, size_t n) : p_(p), n_(n) {}
    SlotMemory(SlotMemory&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
    SlotMemory& operator=(SlotMemory&& o) noexcept {
      std::swap(p_, o.p_);
      std::swap(n_, o.n_);
      return *this;
    }
    ~SlotMemory() {
      if (p_) munmap(p_, n_);
    }
    std::byte* get() const { return p_; }

   private:
    std::byte* p_ = nullptr;
    size_t n_ = 0;
  };

  std::byte* SendSlot(uint32_t i) const { return slots_.get() + size_t{i} * slot_bytes_; }
  std::byte* RecvSlot(uint32_t i) const { return slots_.get() + size_t{send_slots_ + i} * slot_bytes_; }

  // Registered, NUMA-local memory that outgoing rendezvous messages are
  // written into, so a large send registers nothing once the connection is
  // warm: local access only (a peer can never write it), classes 16 KiB to
  // 1 MiB, one slab registered per class on first use (8 buffers or 2 MiB,
  // whichever is more), at most 64 MiB pinned. It is the connection's, freed
  // with it (`rdma res` counts go back to baseline on close). Null when it
  // cannot be had: sends then register memory per message.
  BufferPool* SendPool() {
    if (!send_pool_ && !send_pool_failed_) {
      BufferPoolOptions o;
      o.class_bytes = {16 << 10, 64 << 10, 256 << 10, 1 << 20};
      o.max_registered_bytes = size_t{64} << 20;
      o.access = access::kLocalOnly;
      o.thread_cache_buffers = 0;  // One executor uses it: no per-thread caches to strand.
      auto pool = BufferPool::CreateForDevice(ctx_->device(), o);
      if (pool.ok()) {
        send_pool_ = std::move(*pool);
      } else {
        send_pool_failed_ = true;
        RDMARPC_LOG(kWarn, "rdma", "event=send_pool_unavailable peer=", peer_uri_, " error=", pool.status().ToString());
      }
    }
    return send_pool_.get();
  }

  // Registered memory that incoming rendezvous messages are written into,
  // opened to the peer one grant at a time by a type-2 memory window (the
  // buffers' own rkeys allow no remote access: access::kGrantPool), 16 KiB
  // to 1 MiB, at most 64 MiB pinned. Null when the device has no type-2 windows,
  // RdmaOptions::grant_windows is off, or the pool cannot be had: grants are
  // then registered per message.
  BufferPool* GrantPool() {
    if (!grant_pool_ && !grant_pool_failed_) {
      grant_pool_failed_ = true;
      if (!opt_.grant_windows || !ctx_->device().SupportsType2Windows()) return nullptr;
      BufferPoolOptions o;
      // One MR per buffer (a slab holds one buffer), so an MR's bounds are
      // its buffer's. A window is bound over exactly the granted bytes, but
      // rxe (Linux 6.1 and later; rxe_resp.c check_rkey) checks a write
      // against the range of the window's MR, never the window's own: over
      // a shared slab, a peer holding one live grant could write any buffer
      // of the slab, including messages delivered and still being read. With
      // an MR per buffer the most such a device lets through is the unused
      // tail of the grant's own buffer; a NIC that enforces window bounds
      // allows exactly the granted bytes. Classes in 2x steps keep that tail
      // under half the buffer. Registration happens once per buffer, when the
      // pool grows; the steady state registers nothing.
      o.class_bytes = {16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20};
      o.slab_bytes = 1;
      o.min_buffers_per_slab = 1;
      o.max_registered_bytes = size_t{64} << 20;
      o.access = access::kGrantPool;
      o.thread_cache_buffers = 0;
      auto pool = BufferPool::CreateForDevice(ctx_->device(), o);
      if (pool.ok()) {
        grant_pool_ = std::move(*pool);
        grant_pool_failed_ = false;
      } else {
        RDMARPC_LOG(kWarn, "rdma", "event=grant_pool_unavailable peer=", peer_uri_, " error=", pool.status().ToString());
      }
    }
    return grant_pool_.get();
  }

  // A type-2 window: an invalidated one of this connection's, or a new one.
  absl::StatusOr<MwPtr> TakeWindow() {
    if (free_windows_.empty()) return ctx_->device().AllocateType2Window();
    MwPtr w = std::move(free_windows_.back());
    free_windows_.pop_back();
    return w;
  }

  // Memory for an incoming rendezvous message of `size` bytes: a grant-pool
  // buffer and a window to bind over it when the CTS goes out, else an MR
  // of its own (the pool at its cap, a window refused, or above 1 MiB).
  absl::Status TakeGrantMemory(LargeIn& in, size_t size) {
    in.size = size;
    if (BufferPool* pool = GrantPool(); pool != nullptr && size <= pool->options().class_bytes.back()) {
      auto b = pool->Acquire(size);
      auto w = b.ok() ? TakeWindow() : absl::StatusOr<MwPtr>(b.status());
      if (b.ok() && w.ok()) {
        in.data = b->data().data();
        in.pooled = std::move(*b);
        in.window = std::move(*w);
        ++stats_.grants_windowed;
        return absl::OkStatus();
      }
      RDMARPC_LOG(kInfo, "rdma", "event=grant_registered peer=", peer_uri_, " bytes=", size, " reason=\"",
                  (b.ok() ? w.status() : b.status()).ToString(), "\"");
    }
    auto buf = AllocateLarge(size, access::kRendezvousReceive);
    if (!buf.ok()) return buf.status();
    in.data = buf->memory.get();
    in.rkey = buf->mr->rkey;
    in.own = std::move(*buf);
    ++stats_.rendezvous_receive_registrations;
    return absl::OkStatus();
  }

  absl::StatusOr<LargeBuffer> AllocateLarge(size_t size, int access) {
    LargeBuffer b;
    b.memory.reset(new (std::nothrow) std::byte[size]);
    if (!b.memory) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes"));
    b.size = size;
    auto mr = ctx_->device().RegisterMemory(b.memory.get(), size, access);
    if (!mr.ok()) return mr.status();
    b.mr = std::move(*mr);
    return b;
  }

  // The test hook RdmaOptions::test_stop_reposting_receives: consumed
  // receives are dropped instead of reposted (the slot is lost for good).
  bool StalledForTest() const {
    return opt_.test_stop_reposting_receives && opt_.test_stop_reposting_receives->load(std::memory_order_relaxed);
  }

  // The RECV of receive slot `slot`: `wr` points at `sge`, ends a chain.
  void FillRecvWr(uint32_t slot, ibv_recv_wr& wr, ibv_sge& sge) const {
    sge = {reinterpret_cast<uint64_t>(RecvSlot(slot)), static_cast<uint32_t>(slot_bytes_), slots_mr_->lkey};
    wr.wr_id = MakeWrId(kWrRecv, 0, slot);
    wr.next = nullptr;
    wr.sg_list = &sge;
    wr.num_sge = 1;
  }

  absl::Status PostRecv(uint32_t slot) {
    ibv_sge sge;
    ibv_recv_wr wr;
    FillRecvWr(slot, wr, sge);
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(ep_->qp(), &wr, &bad); rc != 0) return ErrnoStatus(rc, "ibv_post_recv");
    ++stats_.wr_posted;
    ++stats_.recv_doorbells;
    return absl::OkStatus();
  }

  // Batched reposts. A DATA frame's RECV comes back when the application
  // drops its message (Release); it waits in repost_ until repost_batch_ of
  // them go in one ibv_post_recv chain: on Soft-RoCE ~87 provider
  // instructions a WR in a chain of 8 against ~122 for one posted alone, our
  // per-post bookkeeping (Status, counters, ledger, the credit question) once
  // a batch, and on a NIC one doorbell record write for the chain. The credit is owed (ledger OnReposted) only
  // once the RECV is posted, so the peer is never promised a RECV that is
  // not there. Liveness: a waiting RECV may be the credit a blocked peer
  // needs. The peer holds at most peer_data_estimate() data credits (our
  // count: granted minus DATA/RTS frames arrived), so while that is above 0
  // it can still send, and a frame arrives; nothing waits once it is 0:
  // both the release that finds it 0 and the arrival that makes it 0 flush
  // (OnRecv), and the flush's MaybeReturnCredits sends the CREDIT frame
  // (credits.h rule (d)).
  static constexpr uint32_t kMaxRepostBatch = 16;
  [[gnu::noinline]] void FlushReposts() {
    const uint32_t n = std::exchange(repost_n_, 0);
    if (n == 0 || !error_.ok()) return;
    ibv_sge sges[kMaxRepostBatch];
    ibv_recv_wr wrs[kMaxRepostBatch];
    for (uint32_t i = 0; i < n; ++i) {
      FillRecvWr(repost_[i], wrs[i], sges[i]);
      if (i > 0) wrs[i - 1].next = &wrs[i];
    }
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(ep_->qp(), wrs, &bad); rc != 0) return Fail(ErrnoStatus(rc, "ibv_post_recv"));
    stats_.wr_posted += n;
    ++stats_.recv_doorbells;
    ledger_->OnReposted(CreditLedger::Kind::kData, n);
    // RECVs back are credits owed: all they can change is whether a CREDIT
    // frame should go. Queued frames wait for the peer's credits, send queue
    // room or a drain, none of which this gives.
    MaybeReturnCredits();
  }
  // After a DATA or RTS frame arrived: the flush liveness needs (above).
  void FlushRepostsIfPeerMayBeBlocked() {
    if (repost_n_ != 0 && ledger_->peer_data_estimate() == 0) [[unlikely]]
      FlushReposts();
  }

  // Doorbell batching. While a completion batch is handled (OnCompletions),
  // the SENDs it posts (the responses and next requests its handlers send,
  // credit frames) are collected and posted at its end as one chain: one
  // ibv_post_send, on a NIC one doorbell, on Soft-RoCE one system call, for
  // the batch instead of one per message. RECVs still go at once (no
  // doorbell on the receive queue of a NIC or of rxe, and a SEND may carry
  // credits for them). Any other post (WRITEs, binds, invalidations) rings
  // first, so the SQ keeps the order in which operations were taken.
  static constexpr int kHeldWrs = 32;
  // kSelectiveSignalling: at most this many SENDs in a row go unsignalled
  // (fewer when the send queue is short: at most half of it).
  static constexpr uint32_t kUnsignaledRun = 16;
  // A DATA frame's header for a SEND_WITH_IMM (wire::EncodeImmHeader), in
  // the verbs field's byte order; `on` false: a plain SEND.
  struct ImmHeader {  // (no member initialisers: a default argument below)
    bool on;
    uint32_t value;
  };
  struct HeldPosts {
    HeldPosts() {  // What every held WR shares is written once; the rest per post.
      for (int i = 0; i < kHeldWrs; ++i) send_wr[i].sg_list = send_sge[i];
    }
    int sends = 0;
    ibv_send_wr send_wr[kHeldWrs] = {};
    ibv_sge send_sge[kHeldWrs][2] = {};
    // Slots of held SENDs done at their post (kSelectiveSignalling): free once
    // the chain is posted (the inline copy is made then), not before.
    int done = 0;
    uint32_t done_slots[kHeldWrs] = {};
  };
  class DoorbellHold {
   public:
    explicit DoorbellHold(RdmaConnectionImpl& c) : c_(c) { ++c_.doorbell_hold_; }
    ~DoorbellHold() {
      if (--c_.doorbell_hold_ == 0 && c_.held_.sends != 0)
        if (auto st = c_.RingDoorbells(); !st.ok()) c_.Fail(st);
    }
    DoorbellHold(const DoorbellHold&) = delete;
    DoorbellHold& operator=(const DoorbellHold&) = delete;

   private:
    RdmaConnectionImpl& c_;
  };

  // Posts what is held. Fail() rings before it fails anything; after a
  // failure (or once the QP is gone) nothing is held.
  absl::Status RingDoorbells() {
    const int sends = std::exchange(held_.sends, 0);
    const int done = std::exchange(held_.done, 0);
    if (sends == 0 || !error_.ok() || !ep_ || ep_->qp() == nullptr) return absl::OkStatus();
    for (int i = 0; i + 1 < sends; ++i) held_.send_wr[i].next = &held_.send_wr[i + 1];
    held_.send_wr[sends - 1].next = nullptr;  // (`next` is rewritten at every ring)
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ep_->qp(), held_.send_wr, &bad); rc != 0)
      return ErrnoStatus(rc, absl::StrCat("ibv_post_send(SEND, ", sends, " chained)"));
    ++stats_.send_doorbells;
    for (int i = 0; i < done; ++i) free_send_slots_.push_back(held_.done_slots[i]);
    done_at_post_ += static_cast<size_t>(done);
    return absl::OkStatus();
  }

  // Posts `wrs` (WRITEs, a bind, an invalidation) at once, after whatever is
  // held: the SQ keeps the order in which operations were taken.
  absl::Status PostSendNow(ibv_send_wr* wrs, const char* what) {
    if (auto st = RingDoorbells(); !st.ok()) return st;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ep_->qp(), wrs, &bad); rc != 0) return ErrnoStatus(rc, what);
    ++stats_.send_doorbells;
    return absl::OkStatus();
  }

  // ---- send path -------------------------------------------------------------

  // Posts one SEND of `slot` (header already there) covering `bytes`.
  absl::Status PostSend(uint32_t slot, size_t bytes) {
    ibv_sge sge{reinterpret_cast<uint64_t>(SendSlot(slot)), static_cast<uint32_t>(bytes), slots_mr_->lkey};
    return PostSendSges(slot, &sge, 1, bytes);
  }

  // Posts one signalled SEND, accounted to `slot`, of `n` SGEs holding `bytes`
  // in all (inline when they fit), with a DATA header in its immediate when
  // `imm` has one. Its completion covers the unsignalled SENDs before it
  // (kSelectiveSignalling).
  absl::Status PostSendSges(uint32_t slot, ibv_sge* sges, int n, size_t bytes, ImmHeader imm = {false, 0}) {
    const uint64_t wr_id = MakeWrId(kWrSend, 1 + std::exchange(unsignaled_, 0), slot);
    const unsigned flags = IBV_SEND_SIGNALED | (bytes <= max_inline_ ? IBV_SEND_INLINE : 0);
    return PostSendWr(wr_id, flags, sges, n, imm);
  }

  // An inline untracked DATA frame in `slot`, `bytes` long, sent while a
  // completion batch is handled: done at its post (kSelectiveSignalling).
  absl::Status PostSendDoneAtPost(uint32_t slot, ibv_sge sge, ImmHeader imm) {
    slot_untracked_[slot] = 0;
    // Signalled: one in a run, and while a local operation waits for the
    // queue to drain (the run then ends here, not in a CREDIT frame).
    const bool signal = unsignaled_ + 1 >= unsignaled_run_ || !invalidations_.empty() || !control_.empty() ||
                        local_op_ != LocalOp::kNone;
    const uint64_t wr_id = MakeWrId(kWrCover, signal ? 1 + std::exchange(unsignaled_, 0) : 0, slot);
    if (!signal) {
      ++unsignaled_;
      ++stats_.sends_unsignaled;
    }
    const bool held = doorbell_hold_ > 0;
    if (auto st = PostSendWr(wr_id, unsigned{IBV_SEND_INLINE} | (signal ? unsigned{IBV_SEND_SIGNALED} : 0u), &sge,
                             sge.length == 0 ? 0 : 1, imm);
        !st.ok())
      return st;
    if (held) {
      held_.done_slots[held_.done++] = slot;  // freed when the chain is posted
    } else {
      free_send_slots_.push_back(slot);
      ++done_at_post_;
    }
    return absl::OkStatus();
  }

  // Posts (or, under a DoorbellHold, collects) one SEND work request of `n`
  // SGEs (none for an empty body).
  absl::Status PostSendWr(uint64_t wr_id, unsigned flags, ibv_sge* sges, int n, ImmHeader imm = {false, 0}) {
    if (doorbell_hold_ > 0) {
      assert(n >= 0 && n <= 2);
      if (held_.sends == kHeldWrs)
        if (auto st = RingDoorbells(); !st.ok()) return st;
      const int i = held_.sends++;
      if (n >= 1) held_.send_sge[i][0] = sges[0];
      if (n == 2) held_.send_sge[i][1] = sges[1];
      ibv_send_wr& wr = held_.send_wr[i];  // sg_list: set once (HeldPosts)
      wr.wr_id = wr_id;
      wr.num_sge = n;
      wr.send_flags = flags;
      wr.opcode = imm.on ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
      wr.imm_data = imm.value;
    } else {
      ibv_send_wr& wr = single_send_wr_;  // the zeroed rest: set once
      wr.wr_id = wr_id;
      wr.sg_list = sges;
      wr.num_sge = n;
      wr.send_flags = flags;
      wr.opcode = imm.on ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
      wr.imm_data = imm.value;
      ibv_send_wr* bad = nullptr;
      if (int rc = ibv_post_send(ep_->qp(), &wr, &bad); rc != 0) return ErrnoStatus(rc, "ibv_post_send(SEND)");
      ++stats_.send_doorbells;
    }
    ++sq_used_;
    ++stats_.wr_posted;
    return absl::OkStatus();
  }

  // Posts one SEND gathering `slot`'s header and `bytes` of the application's
  // registered memory at `data` (SendRegistered): no copy unless inline. With
  // the header in the immediate (`imm`), the application's bytes alone.
  absl::Status PostSendGather(uint32_t slot, const std::byte* data, size_t bytes, uint32_t lkey, ImmHeader imm) {
    if (imm.on) {
      ibv_sge sge{reinterpret_cast<uint64_t>(data), static_cast<uint32_t>(bytes), lkey};
      return PostSendSges(slot, &sge, bytes == 0 ? 0 : 1, bytes, imm);
    }
    ibv_sge sge[2] = {{reinterpret_cast<uint64_t>(SendSlot(slot)), static_cast<uint32_t>(wire::kHeaderSize),
                       slots_mr_->lkey},
                      {reinterpret_cast<uint64_t>(data), static_cast<uint32_t>(bytes), lkey}};
    return PostSendSges(slot, sge, bytes == 0 ? 1 : 2, wire::kHeaderSize + bytes);
  }

  // Sends a header-only or header+grant control frame in a fresh slot.
  absl::Status SendControl(wire::Header h, const wire::Grant* grant) {
    uint32_t slot = free_send_slots_.back();
    free_send_slots_.pop_back();
    auto owed = ledger_->TakeOwed();
    h.data_credits = owed.data;
    h.ctrl_credits = owed.ctrl;
    wire::EncodeHeader(h, SendSlot(slot));
    size_t bytes = wire::kHeaderSize;
    stats_.header_bytes_sent += wire::kHeaderSize;
    if (grant != nullptr) {
      wire::EncodeGrant(*grant, SendSlot(slot) + wire::kHeaderSize);
      bytes += wire::kGrantSize;
    }
    slot_handlers_[slot] = nullptr;
    slot_untracked_[slot] = 0;
    return PostSend(slot, bytes);
  }

  // Moves queued operations onto the QP while credits, SQ room and slots
  // allow; then returns credits if nothing carried them. Rendezvous frames
  // (control_) go first and draw on ctrl credits: they must never wait behind
  // messages blocked on data credits (credits.h). Executor only.
  void Pump() {
    // A local operation in flight is alone on the queue (kLocalOpsAlone).
    if (local_op_ != LocalOp::kNone) return;
    // Revocations first: a completed message waits for its window's LOCAL_INV,
    // which waits for the queue to drain; nothing new goes on meanwhile.
    if (error_.ok() && !invalidations_.empty()) {
      if (sq_used_ > 0) {
        if (auto st = CoverUnsignaled(); !st.ok()) Fail(st);
        return;
      }
      const uint64_t id = invalidations_.front();
      invalidations_.pop_front();
      if (auto st = PostInvalidate(id); !st.ok()) return Fail(st);
      if (local_op_ != LocalOp::kNone) return;
    }
    while (error_.ok() && !control_.empty()) {
      absl::Status st;
      const Pumped pumped = PumpControl(control_.front(), st);
      if (pumped != Pumped::kPosted) {
        if (!st.ok()) return Fail(st);
        // A window's bind is posted or waits for the queue to drain: post nothing more.
        if (pumped == Pumped::kHoldQueue) return;
        break;
      }
      control_.pop_front();
      if (!st.ok()) return Fail(st);
    }
    while (error_.ok() && !pending_.empty()) {
      PendingOp& op = pending_.front();
      if (!ledger_->CanSendData()) {
        if (!waiting_for_credit_) ++stats_.send_waits_for_credit;  // Count spells, not retries.
        waiting_for_credit_ = true;
        break;
      }
      waiting_for_credit_ = false;
      absl::Status st;
      if (op.op == Op::kData) {
        if (sq_used_ >= opt_.send_depth) break;
        st = PostData(op.size, op.handler, op.slot);
      } else if (op.op == Op::kDataLent) {
        // A slot for the header only; the payload stays in the caller's Buffer.
        if (sq_used_ >= opt_.send_depth || free_send_slots_.size() <= kControlSlots) break;
        const uint32_t slot = free_send_slots_.back();
        free_send_slots_.pop_back();
        const ImmHeader imm = BeginDataFrame(op.size, op.handler, slot);
        slot_lent_[slot] = op.id;
        const LargeOut& out = large_out_.at(op.id);
        st = PostSendGather(slot, out.data, op.size, out.lkey, imm);
      } else {  // kRts: ordered with DATA, so it shares their queue and credits.
        if (sq_used_ >= opt_.send_depth || free_send_slots_.empty()) break;
        ledger_->ConsumeData();
        st = SendControl({wire::Type::kRts, 0, 0, static_cast<uint32_t>(op.size), static_cast<uint32_t>(op.id)},
                         nullptr);
      }
      pending_.pop_front();
      if (!st.ok()) return Fail(st);
    }
    MaybeReturnCredits();
  }

  // Whether Pump, called now, would post a DATA frame sent now: nothing is
  // queued ahead of it (pending_), Pump would reach its DATA queue (no local
  // operation, revocation or rendezvous frame waiting: stricter than Pump,
  // which lets DATA pass a rendezvous frame short of ctrl credits), and a
  // data credit and SQ room are there, the checks of Pump's DATA step.
  bool PumpWouldPostDataNow() const {
    return pending_.empty() && local_op_ == LocalOp::kNone && invalidations_.empty() && control_.empty() &&
           ledger_->CanSendData() && sq_used_ < opt_.send_depth;
  }

  // Posts the DATA frame of a `size`-byte message in send slot `slot`
  // (Pump's DATA step, and Send's when PumpWouldPostDataNow()).
  absl::Status PostData(size_t size, SendHandler& handler, uint32_t slot) {
    const ImmHeader imm = BeginDataFrame(size, handler, slot);
    // The body sits after the header's room in the slot; the header goes too
    // unless it rides in the immediate.
    const size_t skip = imm.on ? wire::kHeaderSize : 0;
    ibv_sge sge{reinterpret_cast<uint64_t>(SendSlot(slot) + skip), static_cast<uint32_t>(wire::kHeaderSize - skip + size),
                slots_mr_->lkey};
    if ((in_completions_ || in_flush_) && sge.length <= max_inline_ && slot_untracked_[slot] != 0)
      return PostSendDoneAtPost(slot, sge, imm);
    return PostSendSges(slot, &sge, sge.length == 0 ? 0 : 1, sge.length, imm);
  }

  // Takes a data credit for a `size`-byte message and writes its DATA header,
  // carrying the credits we owe, into `slot` (or returns it as an immediate,
  // when the peer takes those), which now answers for `handler` (taken from
  // the caller).
  ImmHeader BeginDataFrame(size_t size, SendHandler& handler, uint32_t slot) {
    ledger_->ConsumeData();
    auto owed = ledger_->TakeOwed();
    ImmHeader imm{false, 0};
    if (imm_to_peer_) {
      imm = {true, htonl(wire::EncodeImmHeader(owed.data, owed.ctrl))};
    } else {
      wire::EncodeHeader({wire::Type::kData, owed.data, owed.ctrl, static_cast<uint32_t>(size), 0}, SendSlot(slot));
      stats_.header_bytes_sent += wire::kHeaderSize;
    }
    slot_handlers_[slot].swap(handler);  // Never move-assign: see kNoHandlerAssign.
    slot_untracked_[slot] = slot_handlers_[slot] ? 0 : 1;  // SendUntracked(): counted to the sink
    stats_.eager_bytes += size;
    return imm;
  }

  // Posts one CTS or WRITE if credits and queue room allow. kHoldQueue: the
  // CTS's window is being bound, or waits for the queue to drain to be bound
  // (kLocalOpsAlone), and nothing else may be posted meanwhile.
  enum class Pumped { kPosted, kNotYet, kHoldQueue };
  Pumped PumpControl(const PendingOp& op, absl::Status& st) {
    if (op.op == Op::kCts) {
      LargeIn& in = large_in_.at(op.id);
      if (in.window && !in.bound) {
        // A windowed grant: bind the window over exactly the granted bytes,
        // remote write only, with a fresh key byte (so no earlier rkey of
        // this window opens it), alone on an idle queue (kLocalOpsAlone); the
        // CTS goes when the bind has completed, so the window is open before
        // the peer can learn its rkey.
        st = sq_used_ == 0 ? PostBind(op.id, in) : CoverUnsignaled();
        return Pumped::kHoldQueue;  // the CTS waits for the bind's completion
      }
      if (!ledger_->CanSendRendezvous()) return Pumped::kNotYet;
      if (sq_used_ + 1 > opt_.send_depth || free_send_slots_.empty()) return Pumped::kNotYet;
      ledger_->ConsumeRendezvous();
      wire::Grant g{reinterpret_cast<uint64_t>(in.data), in.rkey, in.grant_id};
      st = SendControl({wire::Type::kCts, 0, 0, static_cast<uint32_t>(in.size), op.slot}, &g);
      return Pumped::kPosted;
    }
    if (!ledger_->CanSendRendezvous()) return Pumped::kNotYet;
    LargeOut& out = large_out_.at(op.id);
    const size_t chunks = (out.size + max_write_chunk_ - 1) / max_write_chunk_;
    if (chunks > 255 || chunks > opt_.send_depth) {
      st = absl::InvalidArgumentError(absl::StrCat("a ", out.size, "-byte message needs ", chunks,
                                                   " RDMA WRITE chunks; at most min(255, send_depth=",
                                                   opt_.send_depth, ") fit"));
      return Pumped::kPosted;
    }
    if (sq_used_ + chunks > opt_.send_depth) return Pumped::kNotYet;
    ledger_->ConsumeRendezvous();  // WRITE_WITH_IMM consumes one of the peer's ctrl RECVs.
    st = PostWrites(op.id, out, chunks);
    return Pumped::kPosted;
  }

  absl::Status PostWrites(uint64_t id, LargeOut& out, size_t chunks) {
    std::vector<ibv_sge> sges(chunks);
    std::vector<ibv_send_wr> wrs(chunks);
    for (size_t i = 0; i < chunks; ++i) {
      const size_t off = i * max_write_chunk_;
      const size_t len = std::min(max_write_chunk_, out.size - off);
      sges[i] = {reinterpret_cast<uint64_t>(out.data + off), static_cast<uint32_t>(len), out.lkey};
      ibv_send_wr& wr = wrs[i];
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = out.grant.addr + off;
      wr.wr.rdma.rkey = out.grant.rkey;
      const bool last = i + 1 == chunks;
      // Only the last is signalled: RC completes WRs in order, so its
      // completion retires (and frees the SQ slots of) all the chunks.
      wr.opcode = last ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
      wr.send_flags = last ? IBV_SEND_SIGNALED : 0;
      if (last) {
        wr.imm_data = htonl(out.grant.grant_id);
        wr.wr_id = MakeWrId(kWrWrite, chunks, id);
      }
      wr.next = last ? nullptr : &wrs[i + 1];
    }
    if (auto st = PostSendNow(wrs.data(), "ibv_post_send(RDMA WRITE)"); !st.ok()) return st;
    sq_used_ += chunks;
    stats_.wr_posted += chunks;
    stats_.rendezvous_bytes += out.size;
    return absl::OkStatus();
  }

  // The queue must drain for a local operation, and unsignalled SENDs on it
  // would never report (kSelectiveSignalling): a signalled CREDIT frame goes
  // behind them, whose completion accounts for them. It spends a ctrl credit,
  // as a CTS would, never the last one (kept for credits.h's answers); with
  // none to spare, the credits owed to us come back (credits.h) and Pump,
  // which runs on their arrival, calls this again.
  absl::Status CoverUnsignaled() {
    if (unsignaled_ == 0 || !error_.ok() || !ledger_->CanSendRendezvous() || sq_used_ >= opt_.send_depth ||
        free_send_slots_.empty())
      return absl::OkStatus();
    ledger_->ConsumeCreditFrame();
    ++stats_.credit_frames_sent;
    return SendControl({wire::Type::kCredit, 0, 0, 0, 0}, nullptr);
  }

  // Sends a CREDIT frame when credits.h's answer rules say so. One is
  // enough: it carries everything owed.
  // Inline, the question only (asked several times a message); the frame is
  // built out of line, where its registers are saved only when one goes.
  void MaybeReturnCredits() {
    assert(ledger_.has_value());  // from Start() on, before any send or completion
    if (ledger_->WantsCreditFrame()) [[unlikely]]
      ReturnCredits();
  }
  [[gnu::noinline]] void ReturnCredits() {
    if (error_.ok() && sq_used_ < opt_.send_depth && !free_send_slots_.empty()) {
      ledger_->ConsumeCreditFrame();
      ++stats_.credit_frames_sent;
      if (auto st = SendControl({wire::Type::kCredit, 0, 0, 0, 0}, nullptr); !st.ok()) Fail(st);
    }
  }

  // ---- receive path ------------------------------------------------------------

  void OnRecv(const ibv_wc& wc) {
    const uint32_t slot = static_cast<uint32_t>(WrIndex(wc.wr_id));
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      OnWriteArrived(ntohl(wc.imm_data), slot);
      return;
    }
    const std::span<const std::byte> frame(RecvSlot(slot), wc.byte_len);
    wire::Header h;
    uint32_t body_at = wire::kHeaderSize;  // where a DATA frame's body starts in the slot
    if ((wc.wc_flags & IBV_WC_WITH_IMM) != 0) {  // a DATA frame, its header in the immediate
      if (!wire::DecodeImmHeader(ntohl(wc.imm_data), wc.byte_len, h)) {
        Fail(absl::DataLossError(absl::StrCat("malformed frame from ", peer_uri_, ": immediate 0x",
                                              absl::Hex(ntohl(wc.imm_data)), " is not a DATA header")));
        return;
      }
      body_at = 0;
    } else if (!wire::DecodeDataHeader(frame, h)) {  // not the common case: the full check
      auto checked = wire::DecodeHeader(frame);
      if (!checked.ok()) {
        Fail(absl::DataLossError(absl::StrCat("malformed frame from ", peer_uri_, ": ", checked.status().message())));
        return;
      }
      h = *checked;
    }
    if (auto st = ledger_->OnReturned(h.data_credits, h.ctrl_credits); !st.ok()) {
      Fail(st);
      return;
    }
    switch (h.type) {
      case wire::Type::kCredit:
        // Its RECV goes back at once (credits.h explains why).
        if (StalledForTest()) break;
        if (auto st = PostRecv(slot); !st.ok()) return Fail(st);
        ledger_->OnReposted(CreditLedger::Kind::kCtrl);
        break;
      case wire::Type::kData:
        ledger_->OnDataFrameArrived();
        FlushRepostsIfPeerMayBeBlocked();
        ++stats_.messages_received;
        stats_.bytes_received += h.length;
        if (sink_ != nullptr && in_completions_ && ready_.empty()) {
          // Nothing ahead of it: straight into the batch for the sink
          // (Deliver's path, without the ready queue's round trip).
          sink_ready_.push_back(RecvSlotMessage(slot, body_at, h.length));
          break;
        }
        ready_.push_back({false, slot, h.length, body_at});
        Deliver();
        break;
      case wire::Type::kRts:
        ledger_->OnDataFrameArrived();
        FlushRepostsIfPeerMayBeBlocked();
        RepostAfterControl(slot, CreditLedger::Kind::kData);
        OnRts(h);
        break;
      case wire::Type::kCts:
        OnCts(h, slot);
        break;
    }
  }

  // RTS, CTS and WRITE_WITH_IMM RECVs go back at once; RTS counts against
  // data credits (it is a message), the others against ctrl credits.
  void RepostAfterControl(uint32_t slot, CreditLedger::Kind kind) {
    if (StalledForTest()) return;
    if (auto st = PostRecv(slot); !st.ok()) return Fail(st);
    ledger_->OnReposted(kind);
  }

  void OnRts(const wire::Header& h) {
    if (h.length > opt_.max_message_size) {
      Fail(absl::ResourceExhaustedError(absl::StrCat("peer announced a ", h.length,
                                                     "-byte message; the limit is ", opt_.max_message_size)));
      return;
    }
    // The message takes its place in arrival order now; its buffer and grant
    // may wait for the cap (max_rendezvous_bytes_held).
    const uint64_t id = next_large_in_++;
    large_in_.emplace(id, LargeIn{});
    ready_.push_back({true, id, h.length, 0});
    deferred_rts_.push_back({id, h.length, h.cookie});
    if (deferred_rts_.size() > 1 || !MayHold(h.length)) ++stats_.rendezvous_deferred;
    GrantDeferred();
  }

  bool MayHold(size_t bytes) const {
    return large_in_bytes_ == 0 || large_in_bytes_ + bytes <= opt_.max_rendezvous_bytes_held;
  }

  // Grants waiting announcements, in order, while the cap allows.
  void GrantDeferred() {
    while (!deferred_rts_.empty() && MayHold(deferred_rts_.front().length)) {
      const DeferredRts d = deferred_rts_.front();
      deferred_rts_.pop_front();
      LargeIn& in = large_in_.at(d.id);
      if (auto st = TakeGrantMemory(in, d.length); !st.ok()) {
        Fail(st);
        return;
      }
      // Grant ids are never reused on a connection (2^32 grants), so a stale
      // or guessed id cannot name a live grant by accident.
      const uint32_t grant_id = next_grant_id_++;
      in.grant_id = grant_id;
      large_in_bytes_ += d.length;
      grants_.emplace(grant_id, d.id);
      control_.push_back({Op::kCts, d.cookie, 0, d.id, {}});
    }
  }

  void OnCts(const wire::Header& h, uint32_t slot) {
    auto g = wire::DecodeGrant({RecvSlot(slot) + wire::kHeaderSize, wire::kGrantSize});
    RepostAfterControl(slot, CreditLedger::Kind::kCtrl);
    auto it = large_out_.find(h.cookie);
    if (!g.ok() || it == large_out_.end() || !it->second.queued || it->second.size != h.length) {
      Fail(absl::DataLossError(absl::StrCat("peer granted ", h.length, " bytes for unknown message #", h.cookie)));
      return;
    }
    it->second.grant = *g;
    if (opt_.test_rewrite_grant) {
      RdmaOptions::GrantForTest t{g->addr, g->rkey, g->grant_id, h.length};
      opt_.test_rewrite_grant(t);
      it->second.grant = wire::Grant{t.addr, t.rkey, t.grant_id};
    }
    control_.push_back({Op::kWrite, 0, 0, h.cookie, {}});
  }

  void OnWriteArrived(uint32_t grant_id, uint32_t slot) {
    auto git = grants_.find(grant_id);
    if (git == grants_.end()) {
      Fail(absl::PermissionDeniedError(absl::StrCat("peer completed a write for grant ", grant_id,
                                                    " that is not live")));
      return;
    }
    const uint64_t id = git->second;
    LargeIn& in = large_in_.at(id);
    grants_.erase(git);
    RepostAfterControl(slot, CreditLedger::Kind::kCtrl);
    ++stats_.messages_received;
    stats_.bytes_received += in.size;
    // Revoke before anyone reads the data: a window is invalidated (the
    // message is delivered when that LOCAL_INV completes, queued by Pump at
    // the end of this batch); an MR of its own is deregistered now.
    if (in.window) {
      invalidations_.push_back(id);
      return;
    }
    in.own.mr.reset();
    in.complete = true;
    Deliver();
  }

  absl::Status PostBind(uint64_t id, LargeIn& in) {
    const uint32_t rkey = ibv_inc_rkey(in.window->rkey);
    ibv_send_wr bind{};
    bind.wr_id = MakeWrId(kWrBind, 1, id);
    bind.opcode = IBV_WR_BIND_MW;
    bind.send_flags = IBV_SEND_SIGNALED;
    bind.bind_mw.mw = in.window.get();
    bind.bind_mw.rkey = rkey;
    bind.bind_mw.bind_info.mr = in.pooled.memory_region();
    bind.bind_mw.bind_info.addr = reinterpret_cast<uint64_t>(in.data);
    bind.bind_mw.bind_info.length = in.size;
    bind.bind_mw.bind_info.mw_access_flags = access::kGrantWindow;
    if (auto st = PostSendNow(&bind, "ibv_post_send(BIND_MW)"); !st.ok()) return st;
    // The provider reads the window's current rkey from ibv_mw to name it in
    // the bind; for type 2 keeping it current is the caller's job.
    in.window->rkey = rkey;
    in.rkey = rkey;
    ++sq_used_;
    ++stats_.wr_posted;
    local_op_ = LocalOp::kBind;
    return absl::OkStatus();
  }

  absl::Status PostInvalidate(uint64_t id) {
    auto it = large_in_.find(id);
    if (it == large_in_.end() || !it->second.window) return absl::OkStatus();
    ibv_send_wr wr{};
    wr.wr_id = MakeWrId(kWrInval, 1, id);
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = it->second.rkey;
    if (auto st = PostSendNow(&wr, "ibv_post_send(LOCAL_INV)"); !st.ok()) return st;
    ++sq_used_;
    ++stats_.wr_posted;
    local_op_ = LocalOp::kInvalidate;
    return absl::OkStatus();
  }

  // The `size`-byte body at `offset` in receive slot `slot` (after the header,
  // or at 0 when the header was the immediate), lent: the slot's RECV is
  // posted again when the Message is released.
  Message RecvSlotMessage(uint32_t slot, uint32_t offset, size_t size) {
    return Message({RecvSlot(slot) + offset, size}, this, MakeToken(kTokRecvSlot, slot));
  }

  // The message at the front of ready_, if it may be read (a large one once
  // its window is revoked).
  std::optional<Message> TakeReady() {
    if (ready_.empty()) return std::nullopt;
    ReadyEntry e = ready_.front();
    Message msg;
    if (e.large) {
      LargeIn& in = large_in_.at(e.index);
      if (!in.complete) return std::nullopt;
      msg = Message({in.data, e.size}, this, MakeToken(kTokLargeIn, e.index));
    } else {
      msg = RecvSlotMessage(static_cast<uint32_t>(e.index), e.body_at, e.size);
    }
    ready_.pop_front();
    return msg;
  }

  // Hands ready messages, in arrival order, to waiting receivers (or to the
  // sink: collected during a completion batch and handed over at its end, in
  // FlushCompletions, like receive handlers).
  void Deliver() {
    if (sink_ != nullptr) {
      if (!in_completions_) return PostSinkDrain();
      while (std::optional<Message> msg = TakeReady()) sink_ready_.push_back(std::move(*msg));
      if (!error_.ok() && ready_.empty()) PostSinkDrain();
      return;
    }
    for (;;) {
      while (!receivers_.empty() && !receivers_.front().handler) receivers_.pop_front();  // cancelled
      if (receivers_.empty()) break;
      std::optional<Message> msg = TakeReady();
      if (!msg) break;
      ReceiveHandler h = std::move(receivers_.front().handler);
      receivers_.pop_front();
      CompleteReceive(std::move(h), std::move(*msg));
    }
    if (!error_.ok() && ready_.empty()) FailReceivers();
  }

  void CancelReceive(uint64_t id) {
    for (size_t i = 0; i < receivers_.size(); ++i) {
      PendingReceive& r = receivers_[i];
      if (r.id != id || !r.handler) continue;
      ReceiveHandler h = std::move(r.handler);  // the entry stays, empty: Deliver() drops it
      CompleteReceive(std::move(h), absl::CancelledError("receive cancelled"));
      return;
    }
  }

  // ---- completions -------------------------------------------------------------

  // A batch of completions, in CQ order (poller.h). Executor only.
  void OnCompletions(std::span<const ibv_wc> wcs) {
    in_completions_ = true;
    for (const ibv_wc& wc : wcs) {
      ++stats_.wr_completed;
      if (wc.status != IBV_WC_SUCCESS) {
        if (wc.status == IBV_WC_RNR_RETRY_EXC_ERR) ++stats_.rnr_errors;
        if (wc.status != IBV_WC_WR_FLUSH_ERR) ++stats_.wc_errors;
        if (error_.ok()) {
          RDMARPC_LOG(kWarn, "rdma", "event=wc_error peer=", peer_uri_, " status=", ibv_wc_status_str(wc.status),
                      " vendor_err=", wc.vendor_err);
          Fail(WcStatusToStatus(wc.status, wc.vendor_err, absl::StrCat("connection to ", peer_uri_)));
        }
        continue;
      }
      if (!error_.ok()) continue;
      switch (WrKindOf(wc.wr_id)) {
        case kWrRecv:
          ++stats_.frames_received;
          OnRecv(wc);
          break;
        case kWrCover:  // Its slot went back at its post (kSelectiveSignalling).
          sq_used_ -= WrCovered(wc.wr_id);
          break;
        case kWrSend: {
          sq_used_ -= WrCovered(wc.wr_id);
          const uint32_t slot = static_cast<uint32_t>(WrIndex(wc.wr_id));
          free_send_slots_.push_back(slot);
          if (slot_lent_[slot] != 0) large_out_.erase(std::exchange(slot_lent_[slot], 0));
          if (slot_handlers_[slot])
            done_sends_.push_back(std::move(slot_handlers_[slot]));
          else if (std::exchange(slot_untracked_[slot], 0) != 0)
            ++untracked_done_;
          break;
        }
        case kWrInval: {  // A grant window is shut: its message may be read.
          sq_used_ -= WrCovered(wc.wr_id);
          local_op_ = LocalOp::kNone;
          if (auto it = large_in_.find(WrIndex(wc.wr_id)); it != large_in_.end()) {
            free_windows_.push_back(std::move(it->second.window));
            it->second.complete = true;
            Deliver();
          }
          break;
        }
        case kWrBind:  // The window is open: its CTS may go (Pump, below).
          sq_used_ -= WrCovered(wc.wr_id);
          local_op_ = LocalOp::kNone;
          if (auto it = large_in_.find(WrIndex(wc.wr_id)); it != large_in_.end()) it->second.bound = true;
          break;
        case kWrWrite: {
          sq_used_ -= WrCovered(wc.wr_id);
          auto it = large_out_.find(WrIndex(wc.wr_id));
          if (it != large_out_.end()) {
            SendHandler h = std::move(it->second.handler);
            const bool untracked = it->second.untracked;
            large_out_.erase(it);
            if (h)
              done_sends_.push_back(std::move(h));
            else if (untracked)
              ++untracked_done_;
          }
          break;
        }
      }
    }
    // Several messages in the batch (or several sends queued): what Pump and
    // their handlers send shares one doorbell, rung after FlushCompletions.
    // One message (one call in flight) posts at once, as holding would cost
    // more than it saves.
    std::optional<DoorbellHold> hold;
    if (sink_ready_.size() + done_receives_.size() > 1 || pending_.size() > 1) hold.emplace(*this);
    // Once per batch, after every credit, SQ slot and RECV of the batch is
    // accounted: queued frames go out, and one frame carries all owed credits.
    if (error_.ok()) Pump();
    in_completions_ = false;
    RunFlush();
    // SENDs done at their post in this batch (kSelectiveSignalling), counted
    // once their chain is posted: the sink may send again into their slots.
    hold.reset();
    ReportDoneAtPost();
  }

  void RunFlush() {
    in_flush_ = true;
    try {
      FlushCompletions();
    } catch (...) {
      in_flush_ = false;
      PostFlushAfterThrow();
      throw;
    }
    in_flush_ = false;
  }

  void ReportDoneAtPost() {
    if (const size_t n = std::exchange(done_at_post_, 0); n != 0 && sink_ != nullptr && error_.ok())
      sink_->OnSendsCompleted(n);
  }

  // A handler or the sink threw out of FlushCompletions (Asio lets the
  // exception out of run(); the application may run the io_context again).
  // What it took counts as delivered; the batch's other completions (they
  // wait in their queues, popped one at a time) and the SENDs done at their
  // post run from a posted task, as they would have run had it returned.
  void PostFlushAfterThrow() {
    asio::post(ex_, transport::WithHandlerMemory([self = shared_from_this()] {
                 self->RunFlush();
                 self->ReportDoneAtPost();
               }));
  }

  // The batch's completions, run at once (this is a CQ event handler, not the
  // call that started the operations), after the batch's bookkeeping: a
  // handler that sends, receives or closes sees a consistent connection.
  // Kept alive meanwhile (a handler may drop the last outside reference) by
  // the CM watcher's reference (see the poller's sink in Start()).
  void FlushCompletions() {
    if (done_sends_.empty() && done_receives_.empty() && sink_ready_.empty() && untracked_done_ == 0) return;
    while (!done_sends_.empty()) {
      SendHandler h = std::move(done_sends_.front());
      done_sends_.pop_front();
      transport::DispatchCompletion(ex_, std::move(h), absl::OkStatus());
    }
    if (const size_t n = std::exchange(untracked_done_, 0); n != 0 && sink_ != nullptr && error_.ok())
      sink_->OnSendsCompleted(n);
    // Received messages after the sends, as receive handlers.
    HandSinkReady();
    while (!done_receives_.empty()) {
      DoneReceive d = std::move(done_receives_.front());
      done_receives_.pop_front();
      transport::DispatchCompletion(ex_, std::move(d.handler), absl::StatusOr<Message>(std::move(d.message)));
    }
  }

  // ---- failure and close -------------------------------------------------------

  // First error wins; everything pending completes with it, the peer is told.
  void Fail(absl::Status st, bool log = true) {
    if (!error_.ok()) return;
    // SENDs taken before the failure go on the queue first, as they would
    // have without doorbell batching (an error frame sent just before a
    // Close() still has its chance to reach the peer).
    if (held_.sends > 0) (void)RingDoorbells();
    if (st.ok()) st = absl::InternalError("Fail(OK)");
    error_ = st;
    if (log) RDMARPC_LOG(kWarn, "rdma", "event=connection_failed peer=", peer_uri_, " status=\"", st.ToString(), "\"");
    // In-flight sends: their WRs will flush; complete them now with the error.
    for (auto& h : slot_handlers_)
      if (h) transport::PostCompletion(ex_, std::move(h), error_);
    for (auto& [id, lo] : large_out_)
      if (lo.handler) transport::PostCompletion(ex_, std::move(lo.handler), error_);
    for (size_t i = 0; i < pending_.size(); ++i)
      if (pending_[i].handler) transport::PostCompletion(ex_, std::move(pending_[i].handler), error_);
    pending_.clear();
    control_.clear();
    grants_.clear();
    deferred_rts_.clear();
    invalidations_.clear();
    FailReceivers();
    if (ep_) ep_->Disconnect();
    if (ep_) ep_->Cancel();
    if (poller_) poller_->Stop();
  }

  // sink_ready_ to the sink, in order. It may Close() (which empties
  // sink_ready_ and unsets the sink) or drop the connection.
  void HandSinkReady() {
    while (sink_ != nullptr && !sink_ready_.empty()) {
      Message msg = std::move(sink_ready_.front());
      sink_ready_.pop_front();
      sink_->OnMessage(std::move(msg));
    }
  }

  void PostSinkDrain() {
    if (sink_drain_posted_) return;
    sink_drain_posted_ = true;
    asio::post(ex_, transport::WithHandlerMemory([self = shared_from_this()] {
                 self->sink_drain_posted_ = false;
                 self->DrainSink();
               }));
  }

  // Outside a completion batch: what is ready (messages that arrived before
  // the sink was set, or before a failure), then the failure.
  void DrainSink() {
    try {
      HandSinkReady();
      while (sink_ != nullptr) {
        std::optional<Message> msg = TakeReady();
        if (!msg) break;
        sink_->OnMessage(std::move(*msg));
      }
    } catch (...) {
      PostSinkDrain();  // the rest when the io_context runs again
      throw;
    }
    // A large message still unrevoked at a failure never completes.
    if (sink_ != nullptr && !error_.ok()) {
      transport::MessageSink* sink = std::exchange(sink_, nullptr);
      sink->OnConnectionError(error_);
    }
  }

  void FailReceivers() {
    if (sink_ != nullptr) PostSinkDrain();
    while (!receivers_.empty()) {
      ReceiveHandler h = std::move(receivers_.front().handler);
      receivers_.pop_front();
      if (h) CompleteReceive(std::move(h), error_);
    }
  }

  // The one way a receive completes: detach our cancellation handler from the
  // caller's slot (it must not fire after completion), then post the result.
  void CompleteReceive(ReceiveHandler h, absl::StatusOr<Message> result) {
    auto slot = asio::get_associated_cancellation_slot(h);
    if (slot.is_connected()) slot.clear();
    if (in_completions_ && result.ok()) {
      done_receives_.push_back({std::move(h), std::move(*result)});
      return;
    }
    transport::PostCompletion(ex_, std::move(h), std::move(result));
  }

  // RDMA_CM_EVENT_DEVICE_REMOVAL. The kernel's unregistration of a device
  // (`rdma link delete`, a NIC's driver unloaded or its function removed)
  // waits, uninterruptibly, until every object on the device is gone and the
  // device's ibv_context is closed, unless the driver can disassociate
  // contexts (rxe cannot). So everything this connection holds on the device
  // goes now, not when the application lets go of the connection and of the
  // messages it received: poller, QP, cm_id, CQ, completion channel, memory
  // windows, registrations. Memory stays: a message the application holds is
  // still readable. The context is marked removed (RdmaContext::removed) and
  // dropped, so that librdmacm can close the device once its other users
  // have let go too. After Fail(): nothing is posted or polled any more.
  //
  // The destroy calls run on a thread of their own, not on the executor: a
  // destroy may block in the kernel (Debian 6.1's rxe waits up to 50 s for a
  // QP reference it never drops, seen under load), and the executor's other
  // connections, timers and deadlines must not wait with it.
  void ReleaseDevice() {
    if (poller_) poller_->Stop();  // On the executor: the sink must not run after.
    poller_.reset();
    auto held = std::make_unique<DeviceHold>();
    held->ctx = std::move(ctx_);
    held->slots_mr = std::move(slots_mr_);
    held->send_pool = send_pool_;
    held->grant_pool = grant_pool_;
    for (auto& [id, out] : large_out_)
      if (out.own.mr) held->mrs.push_back(std::move(out.own.mr));
    for (auto& [id, in] : large_in_) {
      if (in.own.mr) held->mrs.push_back(std::move(in.own.mr));
      if (in.window) held->windows.push_back(std::move(in.window));
    }
    for (auto& w : free_windows_) held->windows.push_back(std::move(w));
    free_windows_.clear();
    held->channel = std::move(channel_);
    held->cq = std::move(cq_);
    if (ep_) ep_->PrepareTeardown();
    held->ep = std::move(ep_);
    if (held->ctx) held->ctx->MarkRemoved();
    held->peer = peer_uri_;
    ReleaseOnThread(std::move(held));
  }

  // A connection's end, off the executor: destroying a QP may block for tens
  // of seconds on rxe (a QP with packets in flight during an outage), and the
  // cm_id waits for the peer's CM to answer its DREQ, which after a link
  // outage means waiting for the port (CmEndpoint::AwaitDisconnect). The
  // QP, then its CQ and channel, then the id; the context (PD) last. Memory
  // registrations go with the connection: they do not depend on the QP.
  struct QpTeardown {
    std::shared_ptr<RdmaContext> ctx;
    CompChannelPtr channel;
    CqPtr cq;
    std::unique_ptr<CmEndpoint> ep;
    ~QpTeardown() {
      ep->DestroyQp();
      cq.reset();
      channel.reset();
      ep->AwaitDisconnect();
    }
  };

  // Runs `held`'s destructor on a detached thread (inline if no thread can
  // be had, at the cost of blocking the caller).
  template <typename T>
  static void ReleaseOnThread(std::unique_ptr<T> held) {
    try {
      std::thread([h = std::move(held)]() mutable { h.reset(); }).detach();
    } catch (const std::system_error& e) {
      RDMARPC_LOG(kWarn, "rdma", "event=release_inline reason=\"", e.what(), "\"");
      if (held) held.reset();
    }
  }

  // What ReleaseDevice takes from the connection, destroyed in member order
  // reversed: QP and cm_id, CQ, channel, windows (unbound before the MRs they
  // sit on), registrations, the pools' registrations, and the context last.
  struct DeviceHold {
    std::shared_ptr<RdmaContext> ctx;
    std::shared_ptr<BufferPool> send_pool, grant_pool;
    MrPtr slots_mr;
    std::vector<MrPtr> mrs;
    std::vector<MwPtr> windows;
    CompChannelPtr channel;
    CqPtr cq;
    std::unique_ptr<CmEndpoint> ep;
    std::string peer;

    ~DeviceHold() {
      const auto t0 = std::chrono::steady_clock::now();
      ep.reset();
      cq.reset();
      channel.reset();
      windows.clear();
      mrs.clear();
      slots_mr.reset();
      if (grant_pool) grant_pool->Deregister();
      if (send_pool) send_pool->Deregister();
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      RDMARPC_LOG(kInfo, "rdma", "event=device_resources_released peer=", peer, " took_ms=", ms);
    }
  };

  // Watches CM events after establishment: the peer leaving, device removal.
  void WatchCm() {
    asio::co_spawn(ex_, [self = shared_from_this()]() -> asio::awaitable<void> {
      for (;;) {
        auto ev = co_await self->ep_->NextEvent();
        if (!ev.ok()) {
          // Cancelled by Fail/Close (then this does nothing), or the event
          // channel broke: without it a disconnect would go unseen, and the
          // poller's sink counts on this coroutine's reference until Fail().
          self->Fail(absl::UnavailableError(
              absl::StrCat("connection to ", self->peer_uri_, ": CM event channel failed: ", ev.status().message())));
          co_return;
        }
        const auto type = (*ev)->event;
        if (type == RDMA_CM_EVENT_DISCONNECTED || type == RDMA_CM_EVENT_DEVICE_REMOVAL ||
            type == RDMA_CM_EVENT_TIMEWAIT_EXIT) {
          RDMARPC_LOG(kInfo, "rdma", "event=cm peer=", self->peer_uri_, " cm_event=", DescribeCmEvent(**ev));
          ev = absl::StatusOr<CmEventPtr>();  // Ack before tearing down.
          // Before Fail(): whoever learns of the failure may look at the context.
          if (type == RDMA_CM_EVENT_DEVICE_REMOVAL && self->ctx_) self->ctx_->MarkRemoved();
          self->Fail(absl::UnavailableError(absl::StrCat(
                         "connection to ", self->peer_uri_,
                         type == RDMA_CM_EVENT_DEVICE_REMOVAL ? " lost: RDMA device removed" : " closed by the peer")),
                     type != RDMA_CM_EVENT_DISCONNECTED);
          // Posted: the cm_id this coroutine waited on goes with the device.
          if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) asio::post(self->ex_, [self] { self->ReleaseDevice(); });
          co_return;
        }
      }
    }, asio::detached);
  }

  asio::any_io_executor ex_;
  std::shared_ptr<RdmaContext> ctx_;
  RdmaOptions opt_;
  // Verbs resources, in construction order (destroyed in reverse: QP first).
  SlotMemory slots_;
  MrPtr slots_mr_;
  CompChannelPtr channel_;
  CqPtr cq_;
  std::unique_ptr<CmEndpoint> ep_;
  std::unique_ptr<Poller> poller_;  // Stopped before the CQ goes.

  size_t slot_bytes_ = 0;
  uint32_t send_slots_ = 0, recv_slots_ = 0;
  uint32_t max_inline_ = 0;
  size_t max_write_chunk_ = 0;
  size_t eager_limit_ = 0;  // opt_.eager_limit within the device's max message.
  size_t eager_to_peer_ = 0;
  // Both ends offered kHelloImmData: our DATA frames carry their header in
  // the immediate (RdmaOptions::data_header_in_immediate).
  bool imm_to_peer_ = false;
  uint64_t peer_max_message_ = 0;
  std::string peer_uri_;

  std::optional<CreditLedger> ledger_;
  uint32_t sq_used_ = 0;
  bool waiting_for_credit_ = false;
  SlotStack free_send_slots_;
  // Batched reposts (FlushReposts): receive slots given back, not posted yet.
  uint32_t repost_batch_ = 1;
  uint32_t repost_n_ = 0;
  uint32_t repost_[kMaxRepostBatch];
  // PostSendWr's one SEND posted at once: a work request of ~130 bytes, not
  // zeroed again for each post. (Providers read a posted WR, never write it.)
  ibv_send_wr single_send_wr_{};
  std::vector<SendHandler> slot_handlers_;  // By send slot: whom to tell when its SEND completes.
  std::vector<uint64_t> slot_lent_;  // By send slot: the large_out_ key of a lent Buffer it gathers, or 0.
  std::vector<uint8_t> slot_untracked_;  // By send slot: 1 while it carries a SendUntracked() message.
  size_t untracked_done_ = 0;  // SendUntracked() completions of this batch, for the sink.
  // kSelectiveSignalling: SENDs posted unsignalled since the last signalled
  // one; the longest such run plus one; SENDs of this batch done at their
  // post, for the sink; and whether FlushCompletions is running.
  uint32_t unsignaled_ = 0;
  uint32_t unsignaled_run_ = 1;
  size_t done_at_post_ = 0;
  bool in_flush_ = false;
  transport::Fifo<PendingOp> pending_;  // DATA and RTS, in message order.
  transport::Fifo<PendingOp> control_;  // CTS and WRITE: rendezvous progress, first.
  // Before large_out_: its buffers go back to the pool before the pool goes.
  std::shared_ptr<BufferPool> send_pool_;  // Shared: a device removal's release holds it (DeviceHold).
  bool send_pool_failed_ = false;
  // Before large_in_ and free_windows_: windows are unbound and buffers back
  // before the pool's MRs are deregistered.
  std::shared_ptr<BufferPool> grant_pool_;
  bool grant_pool_failed_ = false;
  std::vector<MwPtr> free_windows_;  // Invalidated, ready to bind again.
  std::deque<uint64_t> invalidations_;  // large_in_ keys whose window awaits its LOCAL_INV.
  enum class LocalOp : uint8_t { kNone, kBind, kInvalidate };
  LocalOp local_op_ = LocalOp::kNone;  // On the SQ, alone (kLocalOpsAlone).
  std::map<uint64_t, LargeOut> large_out_;
  std::map<uint64_t, LargeIn> large_in_;
  std::map<uint32_t, uint64_t> grants_;  // Live grant id -> large_in_ key.
  struct DeferredRts {
    uint64_t id;      // large_in_ key
    size_t length;
    uint32_t cookie;  // the sender's message number, echoed in the CTS
  };
  std::deque<DeferredRts> deferred_rts_;  // Announced, not yet granted (cap).
  size_t large_in_bytes_ = 0;             // Sum of large_in_ buffer sizes.
  uint64_t next_large_out_ = 1, next_large_in_ = 1;
  uint32_t next_grant_id_ = 1;
  transport::Fifo<ReadyEntry> ready_;
  // A cancelled receive leaves its entry behind with an empty handler (the
  // Fifo never move-assigns handlers); Deliver() skips such entries.
  transport::Fifo<PendingReceive> receivers_;
  // Completions found while handling a CQ batch, run at its end (FlushCompletions).
  struct DoneReceive {
    ReceiveHandler handler;
    Message message;
  };
  bool in_completions_ = false;
  int doorbell_hold_ = 0;  // > 0: posts are collected in held_ (DoorbellHold)
  HeldPosts held_;
  transport::MessageSink* sink_ = nullptr;  // SetSink(): gets every message instead of receivers_
  transport::Fifo<Message> sink_ready_;      // for the sink at the end of this completion batch
  bool sink_drain_posted_ = false;
  transport::Fifo<SendHandler> done_sends_;
  transport::Fifo<DoneReceive> done_receives_;
  uint64_t next_receive_id_ = 1;
  absl::Status error_;
  bool closed_by_user_ = false;
  transport::ConnectionStats stats_;
};

}  // namespace rdmarpc::rdma

// ---- public surface ------------------------------------------------------------

namespace rdmarpc::rdma {
namespace {

class RdmaConnection final : public transport::Connection {
 public:
  explicit RdmaConnection(std::shared_ptr<RdmaConnectionImpl> impl) : impl_(std::move(impl)) {}
  ~RdmaConnection() override { impl_->Close(); }

  asio::any_io_executor get_executor() const override { return impl_->executor(); }
  size_t max_message_size() const override { return impl_->max_message_size(); }
  std::string peer() const override { return impl_->peer(); }
  absl::StatusOr<transport::SendBuffer> Prepare(size_t size) override { return impl_->Prepare(size); }
  void Send(transport::SendBuffer buffer, transport::SendHandler handler) override {
    impl_->Send(std::move(buffer), std::move(handler));
  }
  void Receive(transport::ReceiveHandler handler) override { impl_->Receive(std::move(handler)); }
  bool SetSink(transport::MessageSink* sink) override { return impl_->SetSink(sink); }
  void Close() override { impl_->Close(); }
  transport::ConnectionStats stats() const override { return impl_->stats(); }
  uint64_t frames_received() const override { return impl_->frames_received(); }
  void HoldSends() override { impl_->HoldSends(); }
  void ReleaseSends() override { impl_->ReleaseSends(); }
  void SendRegistered(std::shared_ptr<const Buffer> buffer, transport::SendHandler handler) {
    impl_->SendRegistered(std::move(buffer), std::move(handler));
  }

 private:
  std::shared_ptr<RdmaConnectionImpl> impl_;
};

std::string UriOf(rdma_cm_id* id, bool peer) {
  sockaddr* sa = peer ? rdma_get_peer_addr(id) : rdma_get_local_addr(id);
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    return absl::StrCat("rdma://", host, ":", port);
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(sa);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
  return absl::StrCat("rdma://[", host, "]:", ntohs(in6->sin6_port));
}

// Adapts a setup coroutine's (exception_ptr, result) completion to the
// seam's handler, completing through the handler's associated executor.
auto Finish(asio::any_io_executor ex, transport::Listener::AcceptHandler handler) {
  return [ex, h = std::move(handler)](std::exception_ptr e,
                                      absl::StatusOr<std::unique_ptr<transport::Connection>> r) mutable {
    if (e) r = absl::InternalError("connection setup threw an exception");
    transport::PostCompletion(ex, std::move(h), std::move(r));
  };
}

absl::Status CheckDevice(const RdmaContext& ctx, const CmEndpoint& ep) {
  if (ep.verbs() == nullptr || ep.verbs()->device != ctx.device().context()->device)
    return absl::FailedPreconditionError(absl::StrCat(
        "the peer is reached through RDMA device ",
        ep.verbs() ? ibv_get_device_name(ep.verbs()->device) : "(none)", " but this context uses ",
        ctx.device().name(), "; open an RdmaContext for that device or fix the routing"));
  return absl::OkStatus();
}

class RdmaListener final : public transport::Listener {
 public:
  RdmaListener(asio::any_io_executor ex, std::shared_ptr<RdmaContext> ctx, RdmaOptions opt,
               std::unique_ptr<CmListener> cm, std::string host)
      : ex_(std::move(ex)),
        ctx_(std::move(ctx)),
        opt_(opt),
        cm_(std::move(cm)),
        host_(std::move(host)),
        port_(cm_->port()) {}

  void Accept(AcceptHandler handler) override {
    asio::co_spawn(ex_, AcceptOne(), Finish(ex_, std::move(handler)));
  }
  std::string local_uri() const override {
    const bool v6 = host_.find(':') != std::string::npos;
    return absl::StrCat("rdma://", v6 ? "[" : "", host_, v6 ? "]" : "", ":", port_);
  }
  void Close() override {
    if (cm_) cm_->Cancel();
  }
  bool broken() const override { return cm_ == nullptr; }

 private:
  // One connection request to a running connection; a request that fails
  // setup is rejected and reported (the listener keeps going). After the
  // device went away (a listener bound to one address gets
  // RDMA_CM_EVENT_DEVICE_REMOVAL; one on 0.0.0.0 does not and keeps
  // listening on the devices that come and go), the listener lets go of its
  // cm_id and of the context at once, as a connection does
  // (RdmaConnectionImpl::ReleaseDevice), and every Accept fails UNAVAILABLE:
  // listen again once the device is back (rdmarpc::Server does).
  asio::awaitable<absl::StatusOr<std::unique_ptr<transport::Connection>>> AcceptOne() {
    if (!cm_) co_return RemovedError();
    auto ep = co_await cm_->Accept();
    if (!ep.ok()) {
      if (cm_ && cm_->device_removed()) {
        RDMARPC_LOG(kWarn, "rdma", "event=listener_device_removed listener=", local_uri(),
                    " action=\"released its cm_id and context; listen again once the device is back\"");
        cm_.reset();
        if (ctx_) ctx_->MarkRemoved();
        ctx_.reset();
        co_return RemovedError();
      }
      co_return ep.status();
    }
    if (auto st = CheckDevice(*ctx_, **ep); !st.ok()) {
      (void)(*ep)->Reject(st.message());
      co_return st;
    }
    std::string peer_hello = (*ep)->peer_private_data();
    std::string peer_uri = UriOf((*ep)->id(), true);
    // Authentication comes first: a refused client costs no QP, no memory.
    if (auto st = Authenticate(peer_hello, peer_uri); !st.ok()) {
      (void)(*ep)->Reject(st.code() == absl::StatusCode::kUnauthenticated
                              ? absl::StrCat(kRejectUnauthenticated, st.message())
                              : std::string(st.message()));
      co_return st;
    }
    auto impl = std::make_shared<RdmaConnectionImpl>(ex_, ctx_, opt_);
    CmEndpoint* raw = ep->get();
    if (auto st = impl->Init(std::move(*ep)); !st.ok()) {
      (void)raw->Reject(st.message());
      co_return st;
    }
    if (auto st = wire::DecodeHello({reinterpret_cast<const std::byte*>(peer_hello.data()), peer_hello.size()});
        !st.ok()) {
      (void)raw->Reject(st.status().message());
      co_return st.status();
    }
    auto hello = impl->HelloBytes(false);
    if (!hello.ok()) {
      (void)raw->Reject(hello.status().message());
      co_return hello.status();
    }
    if (auto st = co_await raw->Accept(std::move(*hello)); !st.ok()) co_return st;
    if (auto st = impl->Start(peer_hello, peer_uri); !st.ok()) co_return st;
    co_return std::unique_ptr<transport::Connection>(new RdmaConnection(std::move(impl)));
  }

  // OK, or why the client is refused (logged; its text goes to the client in
  // the reject's private data).
  absl::Status Authenticate(const std::string& peer_hello, const std::string& peer_uri) const {
    auto proof = wire::DecodeHelloProof({reinterpret_cast<const std::byte*>(peer_hello.data()), peer_hello.size()});
    if (!proof.ok()) return proof.status();
    const transport::auth::Verdict verdict =
        transport::auth::Check(opt_.auth_token, proof->has_value() ? &**proof : nullptr);
    if (verdict == transport::auth::Verdict::kOk) return absl::OkStatus();
    RDMARPC_LOG(kWarn, "rdma", "event=auth_refused listener=", local_uri(), " peer=", peer_uri, " reason=\"",
                transport::auth::VerdictReason(verdict), "\"");
    return absl::UnauthenticatedError(transport::auth::VerdictReason(verdict));
  }

  absl::Status RemovedError() const {
    return absl::UnavailableError(absl::StrCat("RDMA device removed under the listener ", local_uri(),
                                               "; listen again once the device is back"));
  }

  asio::any_io_executor ex_;
  std::shared_ptr<RdmaContext> ctx_;  // Null once the device was removed.
  RdmaOptions opt_;
  std::unique_ptr<CmListener> cm_;    // Likewise.
  std::string host_;
  uint16_t port_;
};

asio::awaitable<absl::StatusOr<std::unique_ptr<transport::Connection>>> ConnectImpl(
    asio::any_io_executor ex, std::shared_ptr<RdmaContext> ctx, std::string host, uint16_t port,
    RdmaOptions opt) {
  auto ep = co_await CmEndpoint::Resolve(ex, host, port, opt.cm);
  if (!ep.ok()) co_return ep.status();
  if (auto st = CheckDevice(*ctx, **ep); !st.ok()) co_return st;
  std::string peer_uri = UriOf((*ep)->id(), true);
  auto impl = std::make_shared<RdmaConnectionImpl>(ex, ctx, opt);
  CmEndpoint* raw = ep->get();
  if (auto st = impl->Init(std::move(*ep)); !st.ok()) co_return st;
  auto hello = impl->HelloBytes(!opt.auth_token.empty());
  if (!hello.ok()) co_return hello.status();
  if (auto st = co_await raw->Connect(std::move(*hello)); !st.ok()) {
    if (st.code() == absl::StatusCode::kUnauthenticated)
      RDMARPC_LOG(kWarn, "rdma", "event=auth_refused_by_server server=", peer_uri, " reason=\"", st.message(), "\"");
    co_return st;
  }
  if (auto st = impl->Start(raw->peer_private_data(), peer_uri); !st.ok()) co_return st;
  co_return std::unique_ptr<transport::Connection>(new RdmaConnection(std::move(impl)));
}

}  // namespace

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name) {
  if (name == "event") return PollMode::kEvent;
  if (name == "adaptive") return PollMode::kAdaptive;
  if (name == "busy") return PollMode::kBusy;
  return absl::InvalidArgumentError(absl::StrCat("unknown poll mode '", name, "' (busy|adaptive|event)"));
}

const char* PollModeName(PollMode mode) {
  switch (mode) {
    case PollMode::kEvent: return "event";
    case PollMode::kAdaptive: return "adaptive";
    case PollMode::kBusy: return "busy";
  }
  return "?";
}

RdmaContext::~RdmaContext() {
  if (!removed()) return;
  RDMARPC_LOG(kInfo, "rdma", "event=context_closed device=", device_.name(), " reason=\"device removed\"");
  // Shared pollers first: their threads must be gone before the device is.
  shared_.clear();
  device_.ReleaseRemoved();
}

absl::StatusOr<std::shared_ptr<PollerGroup>> RdmaContext::SharedPollers(const RdmaOptions& options) {
  std::lock_guard lock(shared_mu_);
  for (const Shared& s : shared_)
    if (s.mode == options.poll_mode && s.threads == options.shared_pollers && s.cpu == options.poller_cpu &&
        s.spin == options.adaptive_spin)
      return s.group;
  std::vector<int> cpus;
  if (options.poller_cpu >= 0) cpus.push_back(options.poller_cpu);
  else cpus = LocalCpus(device_);
  auto group = PollerGroup::Start(options.poll_mode, options.shared_pollers, std::move(cpus), options.adaptive_spin);
  if (!group.ok()) return group.status();
  shared_.push_back({options.poll_mode, options.shared_pollers, options.poller_cpu, options.adaptive_spin, *group});
  RDMARPC_LOG(kInfo, "rdma", "event=shared_pollers device=", device_.name(), " poll=", PollModeName(options.poll_mode),
              " threads=", options.shared_pollers);
  return *group;
}

absl::StatusOr<std::shared_ptr<RdmaContext>> RdmaContext::Open(const DeviceSelector& selector) {
  const char* fork = "kernel";
  if (ibv_is_fork_initialized() == IBV_FORK_DISABLED) {
    if (int rc = ibv_fork_init(); rc != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ibv_fork_init failed (", std::strerror(rc < 0 ? -rc : rc),
          "): this kernel needs it to keep registered memory safe across fork(), and it must run before any "
          "memory is registered; open the RdmaContext before other verbs users register memory, or start the "
          "process with RDMAV_FORK_SAFE=1"));
    }
    fork = "ibv_fork_init";
  }
  auto dev = Device::Open(selector);
  if (!dev.ok()) return dev.status();
  auto context = std::shared_ptr<RdmaContext>(new RdmaContext(std::move(*dev)));
  context->fork_protection_ = fork;
  RDMARPC_LOG(kInfo, "rdma", "event=context device=", context->device_.name(), " fork_protection=", fork);
  return context;
}

namespace {

// Options that cannot work, refused before anything is set up.
absl::Status CheckOptions(const RdmaOptions& o) {
  if (o.shared_pollers > 0 && o.poll_mode == PollMode::kEvent)
    return absl::InvalidArgumentError(
        "shared_pollers needs poll mode busy or adaptive (event mode polls on the connection's executor, "
        "with no poller thread to share); set poll_mode or leave shared_pollers at 0");
  if (o.shared_pollers > 0 && o.run_to_completion)
    return absl::InvalidArgumentError(
        "run_to_completion and shared_pollers exclude each other (run to completion polls on the connection's "
        "own executor thread, shared pollers on threads of their own); pick one");
  if (o.shared_pollers > PollerGroup::kMaxSharedPollers)
    return absl::InvalidArgumentError(absl::StrCat("shared_pollers must be at most ", PollerGroup::kMaxSharedPollers,
                                                   ", got ", o.shared_pollers));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<transport::Listener>> Listen(asio::any_io_executor ex,
                                                            std::shared_ptr<RdmaContext> context,
                                                            const std::string& host, uint16_t port,
                                                            RdmaOptions options) {
  if (auto st = CheckOptions(options); !st.ok()) return st;
  auto cm = CmListener::Listen(ex, host, port, options.cm);
  if (!cm.ok()) return cm.status();
  return std::unique_ptr<transport::Listener>(
      new RdmaListener(std::move(ex), std::move(context), options, std::move(*cm), host));
}

void Connect(asio::any_io_executor ex, std::shared_ptr<RdmaContext> context, const std::string& host,
             uint16_t port, RdmaOptions options, transport::Listener::AcceptHandler handler) {
  if (auto st = CheckOptions(options); !st.ok()) {
    asio::post(ex, [h = std::move(handler), st]() mutable {
      std::move(h)(absl::StatusOr<std::unique_ptr<transport::Connection>>(st));
    });
    return;
  }
  asio::co_spawn(ex, ConnectImpl(ex, std::move(context), host, port, options), Finish(ex, std::move(handler)));
}

void SendRegistered(transport::Connection& connection, std::shared_ptr<const Buffer> buffer,
                    transport::SendHandler handler) {
  if (auto* rdma = dynamic_cast<RdmaConnection*>(&connection)) {
    rdma->SendRegistered(std::move(buffer), std::move(handler));
    return;
  }
  // Another backend: the bytes are copied into its send memory.
  if (buffer == nullptr || !*buffer) {
    transport::PostCompletion(connection.get_executor(), std::move(handler),
                              absl::InvalidArgumentError("SendRegistered: empty Buffer"));
    return;
  }
  auto out = connection.Prepare(buffer->size());
  if (!out.ok()) {
    transport::PostCompletion(connection.get_executor(), std::move(handler), out.status());
    return;
  }
  if (buffer->size() > 0) std::memcpy(out->data().data(), buffer->data().data(), buffer->size());
  connection.Send(std::move(*out), std::move(handler));
}

}  // namespace rdmarpc::rdma
