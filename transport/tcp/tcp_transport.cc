#include "transport/tcp/tcp_transport.h"

#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <bit>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <variant>
#include <vector>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/bind_allocator.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/str_cat.h"
#include "transport/common/auth.h"
#include "transport/common/log.h"
#include "transport/common/fifo.h"
#include "transport/common/little_endian.h"
#include "transport/completion.h"
#include "transport/handler_memory.h"
#include "transport/poll_group.h"
#include "transport/uri.h"

namespace rdmarpc::transport::tcp {
namespace {

using asio::ip::tcp;
using boost::system::error_code;
using ConnectResult = absl::StatusOr<std::unique_ptr<Connection>>;

// recv(), send() and sendmsg() as bare system calls. libc's wrappers are
// cancellation points: in a process with more than one thread each call
// switches asynchronous cancellation on and off around the syscall (~36
// instructions each, four such calls a unary call, docs/benchmarks.md).
// A transport's read and write are no place for pthread_cancel anyway.
ssize_t RecvNow(int fd, std::byte* buf, size_t len) {
  return ::syscall(SYS_recvfrom, fd, buf, len, MSG_DONTWAIT, nullptr, nullptr);
}
ssize_t SendmsgNow(int fd, const msghdr* msg) { return ::syscall(SYS_sendmsg, fd, msg, MSG_NOSIGNAL | MSG_DONTWAIT); }
ssize_t SendNow(int fd, const std::byte* buf, size_t len) {
  return ::syscall(SYS_sendto, fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT, nullptr, 0);
}

// Frame header: the payload length, 32-bit little-endian.
constexpr size_t kHeaderBytes = 4;
// Per-connection read buffer: frames up to this size (with header) are read
// together with their neighbours, larger ones straight into their own buffer.
constexpr size_t kReadBuffer = 64 * 1024;
// SO_RCVLOWAT while the read loop polls: a pass takes everything up to the
// read buffer's size, so more than that piling up between passes is rare (and
// then only wakes the reactor as it would anyway). No larger: Linux grows the
// receive buffer to fit twice the low-water mark.
constexpr size_t kMutedLowWater = kReadBuffer;
// A send buffer keeps its frame header just in front of the payload, so a
// queued message is one contiguous iovec and a gather write carries twice as
// many messages per writev as header+payload pairs would. The payload starts 8
// bytes in so serialisers writing into data() keep 8-byte alignment.
constexpr size_t kSendPrefix = 8;
// Queued sends coalesced into one gather write. Asio hands at most 64 buffers
// to one writev (buffer_sequence_adapter::max_buffers), so a bigger batch
// would not save a syscall.
constexpr size_t kMaxBatch = 64;
// Smallest pooled buffer. Rounding small messages up to one size class lets a
// buffer freed by one message serve the next without growing.
constexpr size_t kMinBufferBytes = 512;

void EncodeLength(uint32_t n, std::byte* out) { wire_bytes::StoreLE(out, n); }

uint32_t DecodeLength(const std::byte* in) { return wire_bytes::LoadLE<uint32_t>(in); }

absl::Status ValidateOptions(const TcpOptions& options) {
  if (options.max_message_size > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("TcpOptions.max_message_size ", options.max_message_size,
                                                   " does not fit the 32-bit frame length (max ",
                                                   std::numeric_limits<uint32_t>::max(), ")"));
  }
  return absl::OkStatus();
}

std::string TcpUri(const tcp::endpoint& ep) {
  return Uri{Uri::Scheme::kTcp, ep.address().to_string(), ep.port()}.ToString();
}

// ---- handshake (tcp_transport.h) -----------------------------------------------

constexpr uint8_t kHandshakeVersion = 1;
constexpr std::array<char, 4> kHelloMagic = {'r', 'R', 'P', 'C'};
constexpr std::array<char, 4> kVerdictMagic = {'r', 'R', 'P', 'S'};
constexpr uint8_t kHelloHasProof = 1;

struct ClientHello {
  uint32_t max_message = 0;
  std::optional<auth::Proof> proof;
};

std::array<std::byte, kServerVerdictBytes> EncodeVerdict(auth::Verdict verdict, uint32_t max_message) {
  std::array<std::byte, kServerVerdictBytes> out{};
  std::memcpy(out.data(), kVerdictMagic.data(), 4);
  out[4] = std::byte{kHandshakeVersion};
  out[5] = static_cast<std::byte>(verdict);
  EncodeLength(max_message, out.data() + 8);
  return out;
}

absl::StatusOr<ClientHello> DecodeClientHello(const std::array<std::byte, kClientHelloBytes>& in) {
  if (std::memcmp(in.data(), kHelloMagic.data(), 4) != 0)
    return absl::InvalidArgumentError("not an rdmarpc client (bad hello magic)");
  if (std::to_integer<uint8_t>(in[4]) != kHandshakeVersion)
    return absl::FailedPreconditionError(absl::StrCat("client speaks handshake version ",
                                                      std::to_integer<int>(in[4]), ", we speak ",
                                                      kHandshakeVersion));
  ClientHello hello;
  hello.max_message = DecodeLength(in.data() + 8);
  if ((std::to_integer<uint8_t>(in[5]) & kHelloHasProof) != 0) {
    hello.proof.emplace();
    std::memcpy(hello.proof->data(), in.data() + 12, auth::kProofBytes);
  }
  return hello;
}

// The client's reading of the server's answer: the server's message limit,
// or why the connection was refused.
absl::StatusOr<uint32_t> DecodeVerdict(const std::array<std::byte, kServerVerdictBytes>& in,
                                       const std::string& server) {
  if (std::memcmp(in.data(), kVerdictMagic.data(), 4) != 0 || std::to_integer<uint8_t>(in[4]) != kHandshakeVersion)
    return absl::FailedPreconditionError(
        absl::StrCat(server, " answered the handshake with bytes that are not an rdmarpc server's"));
  const uint8_t verdict = std::to_integer<uint8_t>(in[5]);
  if (verdict > static_cast<uint8_t>(auth::Verdict::kTokenMismatch))
    return absl::FailedPreconditionError(absl::StrCat(server, " refused the connection (verdict ", verdict, ")"));
  if (absl::Status st = auth::RefusedStatus(static_cast<auth::Verdict>(verdict), server); !st.ok()) return st;
  return DecodeLength(in.data() + 8);
}

// ---- pooled buffers ------------------------------------------------------------

// Receive and send memory of one connection, lent to Messages and SendBuffers
// and given back through Release(). Returned buffers are kept (up to a count
// and a size) and reused, so a steady stream of similar messages does not
// allocate. Thread: the connection's executor.
class BufferPool final : public BufferOwner {
 public:
  struct Lease {
    std::byte* memory;
    uint64_t token;
  };

  BufferPool(size_t keep_count, size_t keep_max_bytes)
      : keep_count_(keep_count),
        keep_max_bytes_(keep_max_bytes),
        // Kept buffers are powers of two from kMinBufferBytes to the largest
        // one keep_max_bytes admits: one free list per size.
        kept_(keep_max_bytes < kMinBufferBytes
                  ? 0
                  : static_cast<size_t>(std::bit_width(keep_max_bytes) - std::bit_width(kMinBufferBytes)) + 1) {
    for (auto& list : kept_) list.reserve(std::min<size_t>(keep_count_, 64));
  }
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  ~BufferPool() = default;

  // Memory for at least `size` bytes. Allocates only when no kept buffer fits.
  Lease Acquire(size_t size) {
    // Best fit, from the free list of the size that fits upwards: a big
    // buffer is not spent on a small message. (A scan of every kept buffer
    // cost ~430 instructions a call with 32 calls in flight, cpu_per_call.)
    if (size <= keep_max_bytes_) {
      for (size_t c = SizeClass(size); c < kept_.size(); ++c) {
        if (kept_[c].empty()) continue;
        const uint32_t index = kept_[c].back();
        kept_[c].pop_back();
        --kept_count_;
        return {slots_[index].memory.get(), index};
      }
    }
    uint32_t index;
    if (!empty_.empty()) {
      index = empty_.back();
      empty_.pop_back();
    } else if (kept_count_ != 0) {
      // Every kept buffer is too small: grow one of them.
      auto list = std::find_if(kept_.begin(), kept_.end(), [](const auto& l) { return !l.empty(); });
      index = list->back();
      list->pop_back();
      --kept_count_;
    } else {
      index = static_cast<uint32_t>(slots_.size());
      slots_.emplace_back();
      empty_.reserve(slots_.capacity());
    }
    Slot& slot = slots_[index];
    // Sizes we keep are rounded up to a power of two so one buffer serves a
    // range of message sizes; bigger ones are freed on return, so exact.
    size_t capacity = size <= keep_max_bytes_ ? std::max(kMinBufferBytes, std::bit_ceil(size)) : size;
    slot.memory = std::make_unique_for_overwrite<std::byte[]>(capacity);
    slot.capacity = capacity;
    return {slot.memory.get(), index};
  }

  std::byte* memory(uint64_t token) const { return slots_[token].memory.get(); }
  size_t lent() const { return slots_.size() - kept_count_ - empty_.size(); }

  void Release(uint64_t token) noexcept override {
    Slot& slot = slots_[token];
    if (slot.capacity <= keep_max_bytes_ && kept_count_ < keep_count_) {
      kept_[SizeClass(slot.capacity)].push_back(static_cast<uint32_t>(token));
      ++kept_count_;
    } else {
      slot.memory.reset();
      slot.capacity = 0;
      empty_.push_back(static_cast<uint32_t>(token));
    }
  }

 private:
  struct Slot {
    std::unique_ptr<std::byte[]> memory;
    size_t capacity = 0;
  };
  // The free list of buffers of max(kMinBufferBytes, bit_ceil(size)) bytes.
  static size_t SizeClass(size_t size) {
    return size <= kMinBufferBytes ? 0 : static_cast<size_t>(std::bit_width(size - 1) - std::bit_width(kMinBufferBytes - 1));
  }
  const size_t keep_count_;
  const size_t keep_max_bytes_;
  std::vector<Slot> slots_;                   // Index = token.
  std::vector<std::vector<uint32_t>> kept_;   // Free slots holding memory, by SizeClass.
  size_t kept_count_ = 0;
  std::vector<uint32_t> empty_;               // Free slots without memory.
};

// The connection's read buffers. A small frame delivered to a sink is lent
// straight out of the buffer it was read into (no copy into a pooled buffer,
// no pool bookkeeping: ~210 instructions a call over both ends,
// bench/cpu_per_call); the Message pins its buffer. Reading goes on after
// the bytes it holds; when a partial frame would be moved to the front of a
// pinned buffer, reading moves to another buffer instead, and the pinned one
// is reused once its Messages are gone. At most kMaxRetired pinned buffers
// besides the current one: beyond that frames are copied, so a consumer that
// keeps Messages costs their size, not 64 KiB each. Thread: the executor.
class ReadBuffers final : public BufferOwner {
 public:
  ReadBuffers() = default;
  ReadBuffers(const ReadBuffers&) = delete;
  ReadBuffers& operator=(const ReadBuffers&) = delete;

  std::byte* Start() {
    bufs_.push_back({std::make_unique_for_overwrite<std::byte[]>(kReadBuffer), 0});
    cur_ = 0;
    return bufs_[0].memory.get();
  }
  bool MayLend() const { return retired_ < kMaxRetired; }
  // The current buffer's token, with one more pin.
  uint64_t Pin() {
    ++bufs_[cur_].pins;
    return cur_;
  }
  bool pinned() const { return bufs_[cur_].pins != 0; }
  size_t pins() const {
    size_t n = 0;
    for (const Buf& b : bufs_) n += b.pins;
    return n;
  }
  // Leaves the current (pinned) buffer for one nobody pins, with the `n`
  // bytes at `from` copied to its front.
  std::byte* Switch(const std::byte* from, size_t n) {
    uint32_t next;
    if (!free_.empty()) {
      next = free_.back();
      free_.pop_back();
    } else {
      next = static_cast<uint32_t>(bufs_.size());
      bufs_.push_back({std::make_unique_for_overwrite<std::byte[]>(kReadBuffer), 0});
    }
    ++retired_;
    cur_ = next;
    std::byte* to = bufs_[next].memory.get();
    if (n > 0) std::memcpy(to, from, n);
    return to;
  }

  void Release(uint64_t token) noexcept override {
    Buf& b = bufs_[token];
    if (--b.pins == 0 && token != cur_) {
      --retired_;
      free_.push_back(static_cast<uint32_t>(token));
    }
  }

 private:
  static constexpr size_t kMaxRetired = 4;
  struct Buf {
    std::unique_ptr<std::byte[]> memory;
    size_t pins = 0;
  };
  std::vector<Buf> bufs_;       // Index = token.
  std::vector<uint32_t> free_;  // Neither current nor pinned.
  uint32_t cur_ = 0;
  size_t retired_ = 0;  // Pinned, not current.
};

// ---- one connection ------------------------------------------------------------

// Everything a connection owns that its in-flight socket operations touch. The
// operations hold a shared_ptr, so the core outlives the public TcpConnection
// until they have completed (after Close() they complete promptly with
// operation_aborted). Thread: the connection's executor, except stats().
class ConnectionCore final : public std::enable_shared_from_this<ConnectionCore> {
 public:
  ConnectionCore(tcp::socket socket, std::string peer, const TcpOptions& options, uint32_t peer_max_message)
      : ex_(socket.get_executor()),
        options_(options),
        peer_max_message_(peer_max_message),
        socket_(std::move(socket)),
        peer_(std::move(peer)),
        pool_(options.pooled_buffers, options.pooled_buffer_max_bytes) {
    in_flight_.reserve(kMaxBatch);
    written_.reserve(kMaxBatch);
  }
  ConnectionCore(const ConnectionCore&) = delete;
  ConnectionCore& operator=(const ConnectionCore&) = delete;

  ~ConnectionCore() {
    // Messages and SendBuffers point at pool_; outliving the connection is a
    // caller bug (transport.h) that would otherwise be a silent use-after-free.
    body_.Reset();
    while (!ready_.empty()) ready_.pop_front();
    size_t lent = pool_.lent() - in_flight_.size() - send_queue_.size() + reads_.pins();
    if (lent != 0) {
      RDMARPC_LOG(kError, "tcp", "event=buffers_outstanding peer=", peer_, " count=", lent,
                  " reason=Messages or SendBuffers outlive their connection");
    }
  }

  const asio::any_io_executor& executor() const { return ex_; }
  // What both ends accept: a larger message is refused here, not by the peer
  // dropping the connection.
  size_t max_message_size() const { return std::min<size_t>(options_.max_message_size, peer_max_message_); }
  const std::string& peer() const { return peer_; }

  void Start() {
    rbuf_ = reads_.Start();
    ReadLoop();
  }

  absl::StatusOr<SendBuffer> Prepare(size_t size) {
    if (size > max_message_size()) {
      return absl::ResourceExhaustedError(absl::StrCat("message of ", size, " bytes exceeds max_message_size ",
                                                       max_message_size(), " of the connection to ", peer_,
                                                       size > options_.max_message_size ? "" : " (the peer's limit)"));
    }
    BufferPool::Lease lease = pool_.Acquire(kSendPrefix + size);
    return SendBuffer(std::span<std::byte>(lease.memory + kSendPrefix, size), &pool_, lease.token);
  }

  void Send(SendBuffer buffer, SendHandler handler) {
    if (buffer.owner() != &pool_) {
      if (handler)
        PostCompletion(ex_, std::move(handler),
                       absl::InvalidArgumentError("Send() takes a SendBuffer from this connection's Prepare()"));
      return;
    }
    if (!status_.ok()) {
      if (handler) PostCompletion(ex_, std::move(handler), status_);
      return;
    }
    const size_t size = buffer.size();
    const uint64_t token = buffer.Detach();
    EncodeLength(static_cast<uint32_t>(size), pool_.memory(token) + kSendPrefix - kHeaderBytes);
    if (!writing_ && send_queue_.empty() && send_hold_ == 0)
      return SendOne(PendingSend{token, size, std::move(handler)});
    send_queue_.push_back(PendingSend{token, size, std::move(handler)});
    if (!writing_ && send_hold_ == 0) WriteBatch();
  }

  // Connection::HoldSends/ReleaseSends: what Send() queues meanwhile leaves
  // in one sendmsg() at the release (WriteBatch), not one send() each.
  void HoldSends() { ++send_hold_; }
  void ReleaseSends() {
    if (send_hold_ == 0) return;  // a release without a hold
    if (--send_hold_ == 0 && !writing_ && !send_queue_.empty() && status_.ok()) WriteBatch();
  }

  void Receive(ReceiveHandler handler) {
    if (sink_ != nullptr) {
      PostCompletion(ex_, std::move(handler),
                     absl::StatusOr<Message>(absl::FailedPreconditionError("Receive() on a connection with a MessageSink")));
      return;
    }
    if (!ready_.empty()) {
      Message message = std::move(ready_.front());
      ready_.pop_front();
      ready_bytes_ -= message.size();
      if (!reading_ && status_.ok() && HasQueueRoom()) ReadLoop();
      PostCompletion(ex_, std::move(handler), absl::StatusOr<Message>(std::move(message)));
      return;
    }
    if (!status_.ok()) {
      PostCompletion(ex_, std::move(handler), absl::StatusOr<Message>(status_));
      return;
    }
    const uint64_t id = next_receive_id_++;
    auto slot = asio::get_associated_cancellation_slot(handler);
    if (slot.is_connected()) slot.emplace<ReceiveCanceller>(weak_from_this(), id);
    receivers_.push_back(PendingReceive{std::move(handler), id});
  }

  bool SetSink(MessageSink* sink) {
    if (sink == nullptr || sink_ != nullptr || closed_ || !receivers_.empty()) return false;
    sink_ = sink;
    if (!ready_.empty() || !status_.ok()) PostDrainToSink();
    return true;
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    sink_ = nullptr;
    status_ = absl::CancelledError(absl::StrCat("connection to ", peer_, " was closed locally"));
    ShutDownSocket();
    FailWaiting();
    // Close() means the application is done: messages nobody received go back.
    while (!ready_.empty()) ready_.pop_front();
    ready_bytes_ = 0;
  }

  ConnectionStats stats() const {
    ConnectionStats s;
    s.messages_sent = messages_sent_.load(std::memory_order_relaxed);
    s.messages_received = messages_received_.load(std::memory_order_relaxed);
    s.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    s.bytes_received = bytes_received_.load(std::memory_order_relaxed);
    s.frames_received = frames_received();
    s.send_doorbells = writes_started_.load(std::memory_order_relaxed);
    return s;
  }
  // TCP has no frames of its own below the messages.
  uint64_t frames_received() const { return messages_received_.load(std::memory_order_relaxed); }

 private:
  struct PendingSend {
    uint64_t token;
    size_t size;
    SendHandler handler;
  };
  // A handler whose Receive() was cancelled stays in the FIFO, empty, until it
  // reaches the front (removing from the middle would need move assignment).
  struct PendingReceive {
    ReceiveHandler handler;
    uint64_t id;
  };

  // Installed in a Receive() handler's cancellation slot. Holds the core
  // weakly: Asio keeps a slot's handler installed until the slot is reused,
  // which may be after the connection is gone.
  struct ReceiveCanceller {
    // Spelled out: clang before 16 has no parenthesised aggregate init (emplace()).
    ReceiveCanceller(std::weak_ptr<ConnectionCore> c, uint64_t i) : core(std::move(c)), id(i) {}
    std::weak_ptr<ConnectionCore> core;
    uint64_t id;
    void operator()(asio::cancellation_type type) const {
      if (type == asio::cancellation_type::none) return;
      if (auto c = core.lock()) c->CancelReceive(id);
    }
  };

  bool HasQueueRoom() const {
    return ready_.empty() ||
           (ready_.size() < options_.max_queued_messages && ready_bytes_ < options_.max_queued_bytes);
  }

  // ---- receive path

  // Reads go through a per-connection buffer: one read_some usually brings a
  // whole small frame (often several), where reading the length and then the
  // body would cost two syscalls per message. A small frame goes to a sink
  // lent from that buffer (ReadBuffers pins it), otherwise it is copied into a
  // pooled buffer; a frame larger than the buffer has only its first bytes
  // copied and the rest read straight into its own buffer.
  void ReadLoop() {
    reading_ = true;
    for (;;) {
      if (!status_.ok()) {
        reading_ = false;
        return;
      }
      const size_t avail = rend_ - rpos_;
      if (avail < kHeaderBytes) break;
      const uint32_t size = DecodeLength(rbuf_ + rpos_);
      if (size > options_.max_message_size) {
        reading_ = false;
        RDMARPC_LOG(kWarn, "tcp", "event=bad_frame peer=", peer_, " length=", size,
                    " limit=", options_.max_message_size);
        Fail(absl::UnavailableError(absl::StrCat("peer ", peer_, " sent a ", size, "-byte frame, limit ",
                                                 options_.max_message_size, "; connection closed")));
        return;
      }
      if (kHeaderBytes + size > kReadBuffer) return ReadLarge(size);
      if (avail < kHeaderBytes + size) break;
      Message message;
      if (size > 0 && SinkTakesNow() && reads_.MayLend()) {
        // Straight to the sink (Deliver), lent from the read buffer.
        message = Message(std::span<const std::byte>(rbuf_ + rpos_ + kHeaderBytes, size), &reads_, reads_.Pin());
      } else if (size > 0) {
        BufferPool::Lease lease = pool_.Acquire(size);
        std::memcpy(lease.memory, rbuf_ + rpos_ + kHeaderBytes, size);
        message = Message(std::span<const std::byte>(lease.memory, size), &pool_, lease.token);
      }
      rpos_ += kHeaderBytes + size;
      try {
        Deliver(std::move(message));
      } catch (...) {
        ResumeReadAfterThrow();
        throw;
      }
      if (!HasQueueRoom()) {
        reading_ = false;  // Receive() resumes once the application catches up.
        return;
      }
    }
    // Need more bytes: keep the partial frame at the front and read after it.
    Compact();
    if (spinning_) {
      if (!read_muted_) MuteReadWakeups();
      return PostReadPass();
    }
    if (read_muted_ && !UnmuteReadWakeups()) return;
    // Wait for readability, then recv() ourselves: async_read_some would first
    // try a recv() that finds nothing (we just drained the socket), and costs
    // a reactor operation more per message.
    socket_.async_wait(tcp::socket::wait_read, transport::WithOpMemory(read_memory_, [self = shared_from_this()](error_code ec) {
                         if (ec || !self->status_.ok()) return self->OnReadError(ec);
                         // Bytes again: adaptive polling resumes (busy never stops).
                         self->spinning_ = self->options_.poll_mode != PollMode::kEvent;
                         self->quiet_passes_ = 0;
                         self->OnReadable();
                       }));
  }

  // kAdaptive/kBusy: one non-blocking recv() per turn of the executor, from a
  // task posted to the io_context's own executor when it is one (the
  // type-erased post costs a few hundred instructions more). Its operation
  // memory is the read's: a pass and a wait are never pending together.
  void PostReadPass() {
    if (group_ != nullptr) {
      if (!enlisted_) {
        enlisted_ = true;
        group_->Enlist(this, this, &GroupPass, [this] { return shared_from_this(); });
      }
      return;
    }
    auto pass = transport::WithOpMemory(read_memory_, [self = shared_from_this()] {
      if (!self->status_.ok()) return self->OnReadError(asio::error::operation_aborted);
      self->OnReadPass();
    });
    if (const auto* ioc = ex_.target<asio::io_context::executor_type>()) {
      asio::post(*ioc, std::move(pass));
      return;
    }
    asio::post(ex_, std::move(pass));
  }

  // From group_: this connection's pass of the turn (target and held: the core).
  static void GroupPass(void* core, void*) {
    auto* self = static_cast<ConnectionCore*>(core);
    self->enlisted_ = false;
    if (!self->status_.ok()) return self->OnReadError(asio::error::operation_aborted);
    self->OnReadPass();
  }

  void OnReadPass() {
    if (options_.poll_mode == PollMode::kAdaptive && quiet_passes_ > 0 && Quiet()) {
      spinning_ = false;  // Quiet for adaptive_spin: back to the reactor.
      return ReadLoop();
    }
    const ssize_t n = RecvNow(socket_.native_handle(), rbuf_ + rend_, kReadBuffer - rend_);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (quiet_passes_++ == 0) quiet_since_ = std::chrono::steady_clock::now();
      return PostReadPass();
    }
    quiet_passes_ = 0;
    OnRecv(n);
  }

  // While the read loop polls, the socket stays quiet: SO_RCVLOWAT above what
  // a pass leaves behind means arriving bytes do not wake the socket's wait
  // queue (tcp_data_ready checks the low-water mark), so the reactor's
  // epoll_wait reports nothing and runs no descriptor operation per message
  // (~300 instructions a call in bench/cpu_per_call, docs/benchmarks.md).
  // recv() is unaffected: a non-blocking recv returns whatever is there.
  // Anything that waits in the reactor for bytes (the wait when adaptive
  // polling goes quiet, a large frame's async_read) sets it back to 1 first;
  // Asio re-arms the registration on every wait (EPOLL_CTL_MOD), which
  // reports bytes that came while muted. A kernel without the low-water check
  // in its wake-up path just wakes as before.
  // A socket that refuses it is left as it is (and not asked again every pass).
  void MuteReadWakeups() {
    if (mute_refused_) return;
    const int lowat = static_cast<int>(kMutedLowWater);
    read_muted_ = ::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat) == 0;
    mute_refused_ = !read_muted_;
  }
  bool UnmuteReadWakeups() {
    const int lowat = 1;
    if (::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat) != 0) {
      // A wait for bytes would never be woken: fail rather than stall.
      reading_ = false;
      Fail(absl::InternalError(absl::StrCat("setsockopt(SO_RCVLOWAT, 1) on the connection to ", peer_,
                                            " failed: ", std::strerror(errno), "; connection closed")));
      return false;
    }
    read_muted_ = false;
    return true;
  }

  // Whether polling has found nothing for adaptive_spin; the clock is read
  // every 16 empty passes only.
  bool Quiet() const {
    return quiet_passes_ % 16 == 0 && std::chrono::steady_clock::now() - quiet_since_ >= options_.adaptive_spin;
  }

  // Moves the undelivered bytes [rpos_, rend_) to the front of a read buffer:
  // this one, or another when a lent Message still points into this one.
  void Compact() {
    if (rpos_ == 0) return;  // Nothing delivered from this buffer: nothing pinned in it either.
    const size_t left = rend_ - rpos_;
    if (reads_.pinned()) {
      rbuf_ = reads_.Switch(rbuf_ + rpos_, left);
    } else if (left > 0) {
      std::memmove(rbuf_, rbuf_ + rpos_, left);
    }
    rpos_ = 0;
    rend_ = left;
  }

  void OnReadable() { OnRecv(RecvNow(socket_.native_handle(), rbuf_ + rend_, kReadBuffer - rend_)); }

  // What recv() returned: bytes to frame, the peer's EOF, or an error.
  [[gnu::always_inline]] void OnRecv(ssize_t n) {  // (its two callers: one call a read)
    if (n <= 0) {
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ReadLoop();  // spurious
      return OnReadError(n == 0 ? error_code(asio::error::eof) : error_code(errno, boost::system::system_category()));
    }
    rend_ += static_cast<size_t>(n);
    in_io_handler_ = true;
    in_read_handler_ = true;
    // Two frames or more in this read: what the consumer sends while it
    // takes them (a server's answers) leaves in one sendmsg() at the end, as
    // RDMA's completion batches post one chain. One frame (one call in
    // flight) is not held: SendOne's single send() is cheaper, and this
    // function stays small enough to inline (the held loop out of line).
    if (SeveralFramesBuffered()) {
      ReadLoopHeld();
    } else {
      ReadLoop();
    }
    in_io_handler_ = false;
    in_read_handler_ = false;
    if (HasWritten()) CompleteWritten();
  }

  // ReadLoop with sends held, released however it ends (a sink or handler
  // may throw out of it).
  [[gnu::noinline]] void ReadLoopHeld() {
    struct Hold {
      explicit Hold(ConnectionCore& c) : core(c) { core.HoldSends(); }
      ~Hold() { core.ReleaseSends(); }
      Hold(const Hold&) = delete;
      Hold& operator=(const Hold&) = delete;
      ConnectionCore& core;
    } hold(*this);
    ReadLoop();
  }

  // Whether the read buffer holds more than its first frame (most often a
  // second whole one; a partial one is held for nothing, at no harm).
  bool SeveralFramesBuffered() const {
    const size_t avail = rend_ - rpos_;
    return avail > kHeaderBytes && avail > kHeaderBytes + size_t{DecodeLength(rbuf_ + rpos_)};
  }

  void ReadLarge(uint32_t size) {
    BufferPool::Lease lease = pool_.Acquire(size);
    const size_t have = std::min<size_t>(rend_ - rpos_ - kHeaderBytes, size);
    std::memcpy(lease.memory, rbuf_ + rpos_ + kHeaderBytes, have);
    rpos_ = rend_;  // everything buffered belonged to this frame
    Compact();
    // Owned as a Message from here on, so a failed read gives the buffer back.
    body_ = Message(std::span<const std::byte>(lease.memory, size), &pool_, lease.token);
    if (read_muted_ && !UnmuteReadWakeups()) return body_.Reset();  // the body's tail would not wake the read
    asio::async_read(socket_, asio::buffer(lease.memory + have, size - have),
                     transport::WithOpMemory(read_memory_, [self = shared_from_this()](error_code body_ec, size_t) {
                       self->OnBody(body_ec);
                     }));
  }

  void OnBody(error_code ec) {
    if (ec || !status_.ok()) {
      body_.Reset();
      return OnReadError(ec);
    }
    in_io_handler_ = true;
    in_read_handler_ = true;
    try {
      Deliver(std::move(body_));
    } catch (...) {
      ResumeReadAfterThrow();
      throw;
    }
    if (HasQueueRoom()) {
      ReadLoop();
    } else {
      reading_ = false;
    }
    in_io_handler_ = false;
    in_read_handler_ = false;
    if (HasWritten()) CompleteWritten();
  }

  // A receive handler or the sink threw out of the read loop (Asio lets the
  // exception out of run(); the application may run the io_context again).
  // The message it threw on counts as delivered; the read handler we were in
  // ends here, and a posted task goes on as it would have: the frames behind,
  // the next read (or pass), the written sends' handlers. Nothing else reads
  // meanwhile (reading_ was set: no wait or pass is pending).
  void ResumeReadAfterThrow() {
    reading_ = false;
    in_io_handler_ = false;
    in_read_handler_ = false;
    asio::post(ex_, transport::WithHandlerMemory([self = shared_from_this()] {
                 if (!self->reading_) self->ReadLoop();
                 if (self->HasWritten()) self->CompleteWritten();
               }));
  }

  void OnReadError(error_code ec) {
    reading_ = false;
    if (!status_.ok()) return;  // Closed or failed already; this is the consequence.
    if (ec == asio::error::eof) {
      Fail(absl::UnavailableError(absl::StrCat("peer ", peer_, " closed the connection")));
    } else {
      Fail(absl::UnavailableError(absl::StrCat("read from ", peer_, " failed: ", ec.message())));
    }
  }

  // Whether Deliver() hands the next message to the sink at once. The read
  // loop lends a frame from its read buffer only then: a lent message parked
  // in ready_ would keep the buffer pinned for as long as it waits.
  bool SinkTakesNow() const { return sink_ != nullptr && ready_.empty(); }

  void Deliver(Message message) {
    messages_received_.fetch_add(1, std::memory_order_relaxed);
    bytes_received_.fetch_add(message.size(), std::memory_order_relaxed);
    if (SinkTakesNow()) {
      // Only ever from the read handler or DrainToSink, never inside a call
      // the consumer made (Receive() is refused once a sink is set).
      sink_->OnMessage(std::move(message));
      return;
    }
    if (std::optional<ReceiveHandler> receiver = PopReceiver()) {
      // From the read handler: run the receiver now instead of queueing it
      // behind a reactor pass (one event-loop turn less per message). Not
      // reentrant: what it starts (another Receive()) completes by posting.
      const bool now = in_io_handler_;
      in_io_handler_ = false;
      CompleteReceive(std::move(*receiver), std::move(message), now);
      in_io_handler_ = now;
    } else {
      ready_bytes_ += message.size();
      ready_.push_back(std::move(message));
    }
  }

  void PostDrainToSink() {
    if (drain_posted_) return;
    drain_posted_ = true;
    asio::post(ex_, transport::WithOpMemory(drain_memory_, [self = shared_from_this()] {
                 self->drain_posted_ = false;
                 self->DrainToSink();
               }));
  }

  // Messages that arrived before the sink was set (or while it was being
  // drained), then the connection's error, if any.
  void DrainToSink() {
    while (sink_ != nullptr && !ready_.empty()) {
      Message message = std::move(ready_.front());
      ready_.pop_front();
      ready_bytes_ -= message.size();
      try {
        sink_->OnMessage(std::move(message));
      } catch (...) {
        PostDrainToSink();  // the rest (and the read loop) when run again
        throw;
      }
    }
    if (sink_ == nullptr) return;
    if (!status_.ok()) {
      MessageSink* sink = std::exchange(sink_, nullptr);
      sink->OnConnectionError(status_);
      return;
    }
    if (!reading_) ReadLoop();  // paused while ready_ was full
  }

  std::optional<ReceiveHandler> PopReceiver() {
    while (!receivers_.empty()) {
      PendingReceive& front = receivers_.front();
      if (front.handler) {
        std::optional<ReceiveHandler> handler(std::move(front.handler));
        receivers_.pop_front();
        return handler;
      }
      receivers_.pop_front();
    }
    return std::nullopt;
  }

  void CompleteReceive(ReceiveHandler handler, absl::StatusOr<Message> result, bool dispatch = false) {
    // Detach our canceller so a late emit() cannot reach this operation.
    auto slot = asio::get_associated_cancellation_slot(handler);
    if (slot.is_connected()) slot.clear();
    if (dispatch) {
      DispatchCompletion(ex_, std::move(handler), std::move(result));
    } else {
      PostCompletion(ex_, std::move(handler), std::move(result));
    }
  }

  // Runs inside the cancellation slot's handler, so it must not clear the slot.
  void CancelReceive(uint64_t id) {
    for (size_t i = 0; i < receivers_.size(); ++i) {
      PendingReceive& r = receivers_[i];
      if (r.id != id || !r.handler) continue;
      ReceiveHandler handler(std::move(r.handler));
      PostCompletion(ex_, std::move(handler), absl::StatusOr<Message>(absl::CancelledError("Receive() cancelled")));
      break;
    }
    while (!receivers_.empty() && !receivers_.front().handler) receivers_.pop_front();
  }

  // ---- send path

  // Writes the queued frames (up to kMaxBatch) with one sendmsg() straight
  // away: the socket almost always has room, and a write that takes all of
  // them costs one syscall instead of a reactor operation and an event-loop
  // turn (~1,200 instructions a message over loopback, bench/cpu_per_call).
  // Their handlers run later, never inside Send(): at the end of the read
  // handler we are in, or from one posted operation (CompleteWritten). What
  // the socket does not take goes through async_write. A queue longer than
  // one batch (sends that piled up behind an async_write) goes batch after
  // batch while the socket takes them: no frame waits for a later Send().
  void WriteBatch() {
    writing_ = true;
    for (;;) {
      size_t n = 0;
      size_t total = 0;
      while (!send_queue_.empty() && n < kMaxBatch) {
        PendingSend& s = send_queue_.front();
        iov_[n++] = asio::const_buffer(pool_.memory(s.token) + kSendPrefix - kHeaderBytes, kHeaderBytes + s.size);
        total += kHeaderBytes + s.size;
        in_flight_.push_back(std::move(s));
        send_queue_.pop_front();
      }
      std::array<iovec, kMaxBatch> vec;
      for (size_t i = 0; i < n; ++i) vec[i] = iovec{const_cast<void*>(iov_[i].data()), iov_[i].size()};
      msghdr msg{};
      msg.msg_iov = vec.data();
      msg.msg_iovlen = n;
      const ssize_t w = SendmsgNow(socket_.native_handle(), &msg);
      writes_started_.fetch_add(1, std::memory_order_relaxed);
      if (w >= 0 && static_cast<size_t>(w) == total) {
        if (send_queue_.empty()) return OnWrittenNow();
        ReleaseBatch();
        continue;
      }
      if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        const error_code ec(errno, boost::system::system_category());
        Fail(absl::UnavailableError(absl::StrCat("write to ", peer_, " failed: ", ec.message())));
        return OnWrittenNow();
      }
      // Partly written (or not at all): the reactor writes the rest.
      size_t skip = w > 0 ? static_cast<size_t>(w) : 0;
      size_t first = 0;
      while (skip >= iov_[first].size()) skip -= iov_[first++].size();
      iov_[first] += skip;
      return WriteRest(first, n);
    }
  }

  // One frame with nothing queued or in flight before it (a unary call's
  // request or response, usually): one send() straight from its buffer,
  // without WriteBatch's gather bookkeeping (~100 instructions a message
  // less, bench/cpu_per_call). A frame the socket does not take whole is
  // WriteBatch's case again, or async_write's for the rest of it.
  void SendOne(PendingSend s) {
    const std::byte* frame = pool_.memory(s.token) + kSendPrefix - kHeaderBytes;
    const size_t total = kHeaderBytes + s.size;
    const ssize_t w = SendNow(socket_.native_handle(), frame, total);
    writes_started_.fetch_add(1, std::memory_order_relaxed);
    if (w >= 0 && static_cast<size_t>(w) == total) {
      Sent(s);
      ScheduleCompleteWritten();
      return;
    }
    if (w <= 0) {
      // Nothing taken (or an error): WriteBatch tries once more, and fails
      // the connection with the error if there is one.
      send_queue_.push_back(std::move(s));
      return WriteBatch();
    }
    writing_ = true;
    in_flight_.push_back(std::move(s));
    iov_[0] = asio::const_buffer(frame + w, total - static_cast<size_t>(w));
    WriteRest(0, 1);
  }

  // async_write of iov_[first, n), the rest of the frames in in_flight_.
  void WriteRest(size_t first, size_t n) {
    writes_started_.fetch_add(1, std::memory_order_relaxed);
    asio::async_write(socket_, BufferView{iov_.data() + first, iov_.data() + n},
                      transport::WithOpMemory(write_memory_, [self = shared_from_this()](error_code ec, size_t) {
                        self->OnWritten(ec);
                      }));
  }

  // The batch left with sendmsg() (or failed): the socket is free again, the
  // buffers go back now, the handlers run later (see WriteBatch).
  void OnWrittenNow() {
    ReleaseBatch();
    writing_ = false;
    ScheduleCompleteWritten();
  }

  // Written sends' handlers run at the end of the read handler we are in,
  // or from one posted operation.
  void ScheduleCompleteWritten() {
    if (!in_read_handler_ && !complete_posted_) {
      complete_posted_ = true;
      asio::post(ex_, transport::WithOpMemory(complete_memory_, [self = shared_from_this()] {
                   self->complete_posted_ = false;
                   self->CompleteWritten();
                 }));
    }
  }

  // The batch is written (or failed): its buffers go back, its handlers wait
  // in written_ for CompleteWritten (untracked sends only count).
  void ReleaseBatch() {
    for (PendingSend& s : in_flight_) Sent(s);
    in_flight_.clear();
  }

  // One send is written: its buffer goes back, its handler (if any) waits in
  // written_.
  void Sent(PendingSend& s) {
    pool_.Release(s.token);
    if (s.handler) {
      written_.push_back(std::move(s));
    } else {
      ++untracked_written_;
      untracked_written_bytes_ += s.size;
    }
  }

  bool HasWritten() const { return !written_.empty() || untracked_written_ != 0; }

  void CompleteWritten() {
    // OK unless the connection failed or was closed meanwhile (then the
    // contract says the pending send completes with that status).
    const absl::Status result = status_;
    if (!written_.empty()) {
      std::vector<PendingSend> done;
      done.swap(written_);
      for (size_t i = 0; i < done.size(); ++i) {
        if (result.ok()) {
          messages_sent_.fetch_add(1, std::memory_order_relaxed);
          bytes_sent_.fetch_add(done[i].size, std::memory_order_relaxed);
        }
        try {
          DispatchCompletion(ex_, std::move(done[i].handler), result);
        } catch (...) {
          // The handler threw (Asio lets it out of run()): the ones after it,
          // and the untracked count, complete from a posted task, ahead of
          // sends written meanwhile.
          written_.insert(written_.begin(), std::make_move_iterator(done.begin() + static_cast<ptrdiff_t>(i) + 1),
                          std::make_move_iterator(done.end()));
          ScheduleCompleteWritten();
          throw;
        }
      }
      done.clear();
      if (written_.empty()) written_.swap(done);  // keep the capacity
    }
    const size_t untracked = std::exchange(untracked_written_, 0);
    const size_t untracked_bytes = std::exchange(untracked_written_bytes_, 0);
    if (result.ok() && untracked != 0) {
      messages_sent_.fetch_add(untracked, std::memory_order_relaxed);
      bytes_sent_.fetch_add(untracked_bytes, std::memory_order_relaxed);
    }
    // Last: the sink may Close() the connection (the core stays alive: our caller holds it).
    if (untracked != 0 && result.ok() && sink_ != nullptr) sink_->OnSendsCompleted(untracked);
  }

  void OnWritten(error_code ec) {
    if (ec && status_.ok()) {
      Fail(absl::UnavailableError(absl::StrCat("write to ", peer_, " failed: ", ec.message())));
    }
    ReleaseBatch();
    // Run the handlers now (we are in the write handler, not in Send()); a
    // Send() they make is queued (writing_ is still set) and written below,
    // or before the exception goes on when one throws.
    auto write_next = [this] {
      writing_ = false;
      if (status_.ok() && !send_queue_.empty()) WriteBatch();
    };
    try {
      CompleteWritten();
    } catch (...) {
      write_next();
      throw;
    }
    write_next();
  }

  // ---- failure

  // A transport failure: later operations fail with `status`. Messages that
  // arrived before it stay receivable.
  void Fail(absl::Status status) {
    status_ = std::move(status);
    RDMARPC_LOG(kInfo, "tcp", "event=connection_failed peer=", peer_, " reason=", status_.message());
    ShutDownSocket();
    FailWaiting();
  }

  // In-flight socket operations complete with operation_aborted and see status_.
  void ShutDownSocket() {
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);  // The peer sees EOF, not a silent stall.
    socket_.close(ignored);
  }

  void FailWaiting() {
    if (sink_ != nullptr) PostDrainToSink();
    while (std::optional<ReceiveHandler> receiver = PopReceiver()) {
      CompleteReceive(std::move(*receiver), status_);
    }
    while (!send_queue_.empty()) {
      PendingSend& s = send_queue_.front();
      pool_.Release(s.token);
      if (s.handler) PostCompletion(ex_, std::move(s.handler), status_);
      send_queue_.pop_front();
    }
  }

  // A buffer sequence over iov_ that async_write can copy without allocating.
  struct BufferView {
    using value_type = asio::const_buffer;
    using const_iterator = const asio::const_buffer*;
    const asio::const_buffer* first;
    const asio::const_buffer* last;
    const_iterator begin() const { return first; }
    const_iterator end() const { return last; }
  };

  // Declaration order is construction order; destruction runs backwards, so
  // everything holding pool_ or reads_ buffers (body_, ready_) goes before them.
  asio::any_io_executor ex_;
  const TcpOptions options_;
  const uint32_t peer_max_message_;  // From the handshake.
  tcp::socket socket_;
  const std::string peer_;
  BufferPool pool_;
  ReadBuffers reads_;
  transport::OpMemory read_memory_;
  transport::OpMemory write_memory_;
  // Polling (options_.poll_mode): whether the read loop polls the socket now
  // rather than waiting in the reactor, and the empty passes since the last
  // bytes (and when the first of them was).
  bool spinning_ = options_.poll_mode != PollMode::kEvent;
  bool read_muted_ = false;    // SO_RCVLOWAT is kMutedLowWater (MuteReadWakeups)
  bool mute_refused_ = false;  // setsockopt(SO_RCVLOWAT) failed once: polling goes on unmuted
  uint32_t quiet_passes_ = 0;
  std::chrono::steady_clock::time_point quiet_since_{};
  // Passes run by the io_context's PollGroup (transport/poll_group.h; null:
  // each pass posts itself).
  PollGroup* const group_ = options_.poll_mode == PollMode::kEvent ? nullptr : PollGroup::For(ex_);
  bool enlisted_ = false;  // in group_'s list for the next turn

  // Receive path.
  std::byte* rbuf_ = nullptr;  // reads_'s current buffer, kReadBuffer bytes; [rpos_, rend_) not yet delivered
  size_t rpos_ = 0;
  size_t rend_ = 0;
  Message body_;                  // A large frame being read straight into its buffer.
  Fifo<Message> ready_;           // Received, waiting for Receive().
  size_t ready_bytes_ = 0;
  Fifo<PendingReceive> receivers_;  // Receive()s waiting for a message.
  uint64_t next_receive_id_ = 1;
  bool reading_ = false;
  bool in_io_handler_ = false;  // inside the socket read handler: completions may run at once
  bool in_read_handler_ = false;  // the same, for the whole handler: written_ completes at its end
  MessageSink* sink_ = nullptr;  // SetSink(): gets every message instead of receivers_
  bool drain_posted_ = false;
  transport::OpMemory drain_memory_;

  // Send path.
  Fifo<PendingSend> send_queue_;
  std::vector<PendingSend> in_flight_;  // The batch being written.
  std::array<asio::const_buffer, kMaxBatch> iov_{};
  bool writing_ = false;
  std::vector<PendingSend> written_;  // Written by WriteBatch() itself; handlers not run yet.
  size_t untracked_written_ = 0;        // SendUntracked() messages written, not yet told to the sink.
  size_t untracked_written_bytes_ = 0;
  bool complete_posted_ = false;
  transport::OpMemory complete_memory_;

  // OK while usable; the first failure, or CANCELLED after Close().
  absl::Status status_;
  bool closed_ = false;

  std::atomic<uint64_t> messages_sent_{0};
  std::atomic<uint64_t> messages_received_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  // ConnectionStats::send_doorbells: send()/sendmsg() calls and async_writes.
  std::atomic<uint64_t> writes_started_{0};
  int send_hold_ = 0;  // > 0: Send() queues, ReleaseSends() writes (HoldSends)
};

class TcpConnection final : public Connection {
 public:
  explicit TcpConnection(std::shared_ptr<ConnectionCore> core) : core_(std::move(core)) {}
  // Closing here (idempotent) cancels the socket operations that keep core_
  // alive, so it is freed soon after, once they have run.
  ~TcpConnection() override { core_->Close(); }

  asio::any_io_executor get_executor() const override { return core_->executor(); }
  size_t max_message_size() const override { return core_->max_message_size(); }
  std::string peer() const override { return core_->peer(); }
  absl::StatusOr<SendBuffer> Prepare(size_t size) override { return core_->Prepare(size); }
  void Send(SendBuffer buffer, SendHandler handler) override { core_->Send(std::move(buffer), std::move(handler)); }
  void Receive(ReceiveHandler handler) override { core_->Receive(std::move(handler)); }
  bool SetSink(MessageSink* sink) override { return core_->SetSink(sink); }
  void Close() override { core_->Close(); }
  ConnectionStats stats() const override { return core_->stats(); }
  uint64_t frames_received() const override { return core_->frames_received(); }
  void HoldSends() override { core_->HoldSends(); }
  void ReleaseSends() override { core_->ReleaseSends(); }

 private:
  std::shared_ptr<ConnectionCore> core_;
};

ConnectResult MakeConnection(tcp::socket socket, const TcpOptions& options, uint32_t peer_max_message) {
  error_code ec;
  socket.set_option(tcp::no_delay(true), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("setting TCP_NODELAY failed: ", ec.message()));
  tcp::endpoint remote = socket.remote_endpoint(ec);
  if (ec) return absl::UnavailableError(absl::StrCat("peer left during connection setup: ", ec.message()));
  auto core = std::make_shared<ConnectionCore>(std::move(socket), TcpUri(remote), options, peer_max_message);
  core->Start();
  return std::unique_ptr<Connection>(new TcpConnection(std::move(core)));
}

// ---- listener ------------------------------------------------------------------

// Accepts sockets while someone waits in Accept(), runs each one's handshake
// concurrently (a silent client must not hold up the others), and hands out
// the outcomes in the order handshakes finish. Thread: the listener's executor.
class TcpListener final : public Listener {
 public:
  TcpListener(tcp::acceptor acceptor, std::string uri, const TcpOptions& options)
      : core_(std::make_shared<Core>(std::move(acceptor), std::move(uri), options)) {}
  ~TcpListener() override { Close(); }

  void Accept(AcceptHandler handler) override {
    const asio::any_io_executor ex = core_->acceptor.get_executor();
    if (core_->closed) {
      PostCompletion(ex, std::move(handler), ConnectResult(absl::CancelledError("listener was closed")));
      return;
    }
    if (!core_->ready.empty()) {
      ConnectResult result = std::move(core_->ready.front());
      core_->ready.pop_front();
      PostCompletion(ex, std::move(handler), std::move(result));
      return;
    }
    core_->waiting.push_back(std::move(handler));
    Core::MaybeAccept(core_);
  }

  std::string local_uri() const override { return core_->uri; }

  void Close() override {
    if (core_->closed) return;
    core_->closed = true;
    error_code ignored;
    core_->acceptor.close(ignored);
    core_->closing.cancel();  // Handshakes in progress give up now.
    const asio::any_io_executor ex = core_->acceptor.get_executor();
    while (!core_->waiting.empty()) {
      PostCompletion(ex, std::move(core_->waiting.front()), ConnectResult(absl::CancelledError("listener was closed")));
      core_->waiting.pop_front();
    }
    while (!core_->ready.empty()) core_->ready.pop_front();
  }

 private:
  // Shared with the pending accept and the handshakes, so destroying the
  // listener with them in flight is safe (they complete and find it closed).
  struct Core {
    Core(tcp::acceptor a, std::string u, const TcpOptions& o)
        : acceptor(std::move(a)), uri(std::move(u)), options(o), closing(acceptor.get_executor()) {
      closing.expires_at(asio::steady_timer::time_point::max());
    }
    tcp::acceptor acceptor;
    const std::string uri;
    const TcpOptions options;
    asio::steady_timer closing;  // Never fires; Close() cancels its waits.
    Fifo<AcceptHandler> waiting;
    Fifo<ConnectResult> ready;   // Handshakes that finished with nobody waiting.
    size_t handshaking = 0;
    bool accepting = false;
    bool closed = false;

    static void MaybeAccept(const std::shared_ptr<Core>& core) {
      if (core->closed || core->accepting || core->waiting.empty() || core->handshaking >= kMaxHandshakes) return;
      core->accepting = true;
      core->acceptor.async_accept([core](error_code ec, tcp::socket socket) {
        core->accepting = false;
        if (core->closed) return;
        if (ec) {
          RDMARPC_LOG(kWarn, "tcp", "event=accept_failed listener=", core->uri, " reason=", ec.message());
          core->Deliver(ConnectResult(
              absl::UnavailableError(absl::StrCat("accept on ", core->uri, " failed: ", ec.message()))));
          return;  // The next Accept() tries again.
        }
        ++core->handshaking;
        asio::co_spawn(core->acceptor.get_executor(), Handshake(core, std::move(socket)),
                       [core](std::exception_ptr e, ConnectResult result) {
                         --core->handshaking;
                         if (e) result = absl::ResourceExhaustedError("handshake failed: out of memory");
                         core->Deliver(std::move(result));
                         MaybeAccept(core);
                       });
        MaybeAccept(core);
      });
    }

    void Deliver(ConnectResult result) {
      if (closed) return;  // The connection (if any) closes as it is dropped.
      if (waiting.empty()) {
        ready.push_back(std::move(result));
        return;
      }
      PostCompletion(acceptor.get_executor(), std::move(waiting.front()), std::move(result));
      waiting.pop_front();
    }

    // Reads the client's hello, checks its auth proof, answers with the
    // verdict; the connection exists only after kOk.
    static asio::awaitable<ConnectResult> Handshake(std::shared_ptr<Core> core, tcp::socket socket) {
      using namespace asio::experimental::awaitable_operators;
      error_code ec;
      const tcp::endpoint remote = socket.remote_endpoint(ec);
      const std::string peer = ec ? std::string("tcp://?") : TcpUri(remote);
      asio::steady_timer deadline(socket.get_executor(), core->options.handshake_timeout);
      std::array<std::byte, kClientHelloBytes> hello_bytes;
      auto outcome = co_await (asio::async_read(socket, asio::buffer(hello_bytes), asio::as_tuple(asio::use_awaitable)) ||
                               deadline.async_wait(asio::as_tuple(asio::use_awaitable)) ||
                               core->closing.async_wait(asio::as_tuple(asio::use_awaitable)));
      if (core->closed || outcome.index() == 2) co_return absl::CancelledError("listener was closed");
      absl::Status failed;
      if (outcome.index() == 1) {
        failed = absl::DeadlineExceededError(absl::StrCat("client ", peer, " sent no hello within ",
                                                          core->options.handshake_timeout.count(), " ms"));
      } else if (error_code read_ec = std::get<0>(std::get<0>(outcome))) {
        failed = absl::UnavailableError(absl::StrCat("client ", peer, " left during the handshake: ", read_ec.message()));
      }
      absl::StatusOr<ClientHello> hello =
          failed.ok() ? DecodeClientHello(hello_bytes) : absl::StatusOr<ClientHello>(failed);
      if (!hello.ok()) {
        RDMARPC_LOG(kWarn, "tcp", "event=handshake_failed listener=", core->uri, " peer=", peer,
                    " reason=\"", hello.status().message(), "\"");
        co_return hello.status();
      }
      const auth::Verdict verdict = auth::Check(core->options.auth_token, hello->proof ? &*hello->proof : nullptr);
      const auto answer = EncodeVerdict(verdict, static_cast<uint32_t>(core->options.max_message_size));
      // 12 bytes into a fresh socket's empty send buffer: completes at once.
      auto [write_ec, written] = co_await asio::async_write(socket, asio::buffer(answer), asio::as_tuple(asio::use_awaitable));
      (void)written;
      if (verdict != auth::Verdict::kOk) {
        RDMARPC_LOG(kWarn, "tcp", "event=auth_refused listener=", core->uri, " peer=", peer, " reason=\"",
                    auth::VerdictReason(verdict), "\"");
        socket.shutdown(tcp::socket::shutdown_send, ec);  // The client reads the verdict, then EOF.
        co_return absl::UnauthenticatedError(
            absl::StrCat("refused client ", peer, ": ", auth::VerdictReason(verdict)));
      }
      if (write_ec)
        co_return absl::UnavailableError(absl::StrCat("client ", peer, " left during the handshake: ", write_ec.message()));
      if (core->closed) co_return absl::CancelledError("listener was closed");
      co_return MakeConnection(std::move(socket), core->options, hello->max_message);
    }
  };
  std::shared_ptr<Core> core_;
};

// ---- connect -------------------------------------------------------------------

// async_connect leaves EPOLLOUT in the socket's epoll registration for good
// (Asio never takes it out), and every later async_wait re-arms that
// registration with EPOLL_CTL_MOD, which reports the writable socket again:
// one more reactor wake-up per received message on the client, for nothing
// (ReadLoop waits for reads only; writes go by sendmsg and only wait when the
// socket is full). Handing the connected descriptor back to the reactor
// registers it afresh, for reads.
error_code Reregister(tcp::socket& socket, const tcp::endpoint& peer) {
  error_code ec;
  const tcp::socket::native_handle_type fd = socket.release(ec);
  if (ec) return ec;
  socket.assign(peer.protocol(), fd, ec);
  if (ec) ::close(fd);
  return ec;
}

asio::awaitable<error_code> ResolveAndConnect(tcp::resolver& resolver, tcp::socket& socket, std::string host,
                                              uint16_t port) {
  auto [resolve_ec, endpoints] =
      co_await resolver.async_resolve(host, std::to_string(port), asio::as_tuple(asio::use_awaitable));
  if (resolve_ec) co_return resolve_ec;
  auto [connect_ec, endpoint] = co_await asio::async_connect(socket, endpoints, asio::as_tuple(asio::use_awaitable));
  if (connect_ec) co_return connect_ec;
  co_return Reregister(socket, endpoint);
}

// Connect, then the handshake: our hello out, the server's verdict in.
// Returns the server's message limit.
asio::awaitable<absl::StatusOr<uint32_t>> ConnectAndGreet(tcp::resolver& resolver, tcp::socket& socket,
                                                          std::string host, uint16_t port, std::string target,
                                                          std::string hello) {
  if (error_code ec = co_await ResolveAndConnect(resolver, socket, std::move(host), port))
    co_return absl::UnavailableError(absl::StrCat("connect to ", target, " failed: ", ec.message()));
  auto [write_ec, written] = co_await asio::async_write(socket, asio::buffer(hello), asio::as_tuple(asio::use_awaitable));
  (void)written;
  std::array<std::byte, kServerVerdictBytes> verdict;
  auto [read_ec, read] = co_await asio::async_read(socket, asio::buffer(verdict), asio::as_tuple(asio::use_awaitable));
  (void)read;
  // A failed write is reported through the read: a verdict that did arrive
  // (a refusal) says more than the write error.
  (void)write_ec;
  if (read_ec) {
    co_return absl::UnavailableError(absl::StrCat(
        target, " closed the connection during the handshake (", read_ec.message(),
        "): not an rdmarpc tcp server, or it refused the client"));
  }
  co_return DecodeVerdict(verdict, target);
}

asio::awaitable<ConnectResult> ConnectTask(asio::any_io_executor ex, std::string host, uint16_t port,
                                           TcpOptions options) {
  using namespace asio::experimental::awaitable_operators;
  const std::string target = Uri{Uri::Scheme::kTcp, host, port}.ToString();
  auto hello = EncodeClientHello(options.auth_token, static_cast<uint32_t>(options.max_message_size));
  if (!hello.ok()) co_return hello.status();
  tcp::resolver resolver(ex);
  tcp::socket socket(ex);
  asio::steady_timer deadline(ex, options.connect_timeout);
  // Whichever finishes first cancels the other.
  auto outcome = co_await (ConnectAndGreet(resolver, socket, host, port, target, std::move(*hello)) ||
                           deadline.async_wait(asio::as_tuple(asio::use_awaitable)));
  if (outcome.index() == 1) {
    co_return absl::DeadlineExceededError(
        absl::StrCat("connect to ", target, " timed out after ", options.connect_timeout.count(), " ms"));
  }
  absl::StatusOr<uint32_t> server_max = std::move(std::get<0>(outcome));
  if (!server_max.ok()) {
    if (server_max.status().code() == absl::StatusCode::kUnauthenticated)
      RDMARPC_LOG(kWarn, "tcp", "event=auth_refused_by_server server=", target, " reason=\"",
                  server_max.status().message(), "\"");
    co_return server_max.status();
  }
  co_return MakeConnection(std::move(socket), options, *server_max);
}

}  // namespace

const char* PollModeName(PollMode mode) {
  switch (mode) {
    case PollMode::kEvent: return "event";
    case PollMode::kAdaptive: return "adaptive";
    case PollMode::kBusy: return "busy";
  }
  return "unknown";
}

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name) {
  if (name == "event") return PollMode::kEvent;
  if (name == "adaptive") return PollMode::kAdaptive;
  if (name == "busy") return PollMode::kBusy;
  return absl::InvalidArgumentError(absl::StrCat("unknown tcp poll mode '", name, "' (event|adaptive|busy)"));
}

absl::StatusOr<std::string> EncodeClientHello(const std::string& auth_token, uint32_t max_message) {
  std::string out(kClientHelloBytes, '\0');
  auto* p = reinterpret_cast<std::byte*>(out.data());
  std::memcpy(p, kHelloMagic.data(), 4);
  p[4] = std::byte{kHandshakeVersion};
  EncodeLength(max_message, p + 8);
  if (!auth_token.empty()) {
    auto proof = auth::MakeProof(auth_token);
    if (!proof.ok()) return proof.status();
    p[5] = std::byte{kHelloHasProof};
    std::memcpy(p + 12, proof->data(), auth::kProofBytes);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Listener>> Listen(asio::any_io_executor ex, const std::string& host, uint16_t port,
                                                 TcpOptions options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  const std::string target = Uri{Uri::Scheme::kTcp, host, port}.ToString();
  error_code ec;
  tcp::resolver resolver(ex);
  auto endpoints = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot listen on ", target, ": address does not resolve (",
                                                   ec ? ec.message() : "no addresses", ")"));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  tcp::acceptor acceptor(ex);
  auto fail = [&](absl::string_view step) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", target, ": ", step, ": ", ec.message()));
  };
  if (acceptor.open(endpoint.protocol(), ec); ec) return fail("socket");
  // Restarted servers rebind at once instead of waiting out TIME_WAIT.
  if (acceptor.set_option(tcp::acceptor::reuse_address(true), ec); ec) return fail("SO_REUSEADDR");
  if (acceptor.bind(endpoint, ec); ec) return fail("bind");
  if (acceptor.listen(tcp::acceptor::max_listen_connections, ec); ec) return fail("listen");
  const tcp::endpoint local = acceptor.local_endpoint(ec);
  if (ec) return fail("getsockname");
  return std::unique_ptr<Listener>(new TcpListener(std::move(acceptor), TcpUri(local), options));
}

void Connect(asio::any_io_executor ex, const std::string& host, uint16_t port, TcpOptions options,
             ConnectHandler handler) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) {
    PostCompletion(ex, std::move(handler), ConnectResult(std::move(s)));
    return;
  }
  asio::co_spawn(ex, ConnectTask(ex, host, port, options),
                 [ex, h = std::move(handler)](std::exception_ptr e, ConnectResult result) mutable {
                   // Only an allocation failure can throw in there.
                   if (e) result = absl::ResourceExhaustedError("connect failed: out of memory");
                   PostCompletion(ex, std::move(h), std::move(result));
                 });
}

}  // namespace rdmarpc::transport::tcp
