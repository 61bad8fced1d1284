// The RDMA backend of the transport seam (transport/transport.h).
//
// One RC queue pair per connection, set up through rdma_cm on Asio. Messages
// up to the eager limit travel in one SEND (inline when the device allows)
// into a pre-posted, registered receive slot; larger ones by rendezvous: RTS,
// the receiver grants a buffer registered for REMOTE_WRITE of exactly that
// message (CTS), the sender RDMA WRITEs it (WRITE_WITH_IMM on the last chunk,
// imm = grant id), and the receiver deregisters the grant -- revoking the
// rkey -- before delivering the message. Credit-based flow control
// (credits.h) means no SEND is posted without a RECV waiting for it.
//
// Threading: each connection lives on the executor it was made with (use a
// strand if the io_context runs on several threads). Completions are
// harvested by the connection's poller (PollMode) and processed on that
// executor. Message/SendBuffer objects must be released on that executor.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/rdma/buffer_pool.h"
#include "transport/rdma/cm.h"
#include "transport/rdma/verbs.h"
#include "transport/transport.h"

namespace rdmarpc::rdma {

class PollerGroup;  // poller.h

enum class PollMode {
  // The completion channel's fd sits in the Asio reactor: no extra thread,
  // a syscall and a wake-up per batch. The default: it costs no core.
  kEvent,
  // A poller thread spins for `adaptive_spin`, then arms the CQ and sleeps on
  // the completion channel. Low latency under load, no burnt core when idle.
  kAdaptive,
  // A poller thread pinned to one core drains the CQ forever: lowest latency,
  // one core per connection. It calls sched_yield() every 256 empty polls, so
  // that pollers sharing a core (more connections than cores) still progress.
  kBusy,
};

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name);  // "busy|adaptive|event"
const char* PollModeName(PollMode mode);

struct RdmaOptions {
  PollMode poll_mode = PollMode::kEvent;
  // Core for busy/adaptive pollers; -1 = a core on the device's NUMA node
  // (any allowed core when the node is unknown, as on Soft-RoCE).
  int poller_cpu = -1;
  // How long an adaptive poller spins before sleeping: about one small-message
  // round trip on a real NIC, so a ping-pong never sleeps.
  std::chrono::microseconds adaptive_spin{50};
  // Busy/adaptive only: 0 gives every connection its own poller thread (the
  // lowest latency while there are cores for them); N > 0 makes connections
  // of the same RdmaContext share N poller threads (RdmaContext::SharedPollers),
  // each draining its CQs in turn: many connections on few cores, as in
  // fanout to many subscribers. poller_cpu >= 0 pins them all to that core;
  // otherwise thread i goes to the i-th local core.
  unsigned shared_pollers = 0;
  // Busy/adaptive only: run to completion. No poller thread: the thread that
  // runs the connection's executor polls the CQ itself and handles each
  // completion where it polled it, with no hand-off between threads and no
  // syscall while traffic flows. After a completion it keeps polling from a
  // task it re-posts after every pass (other handlers, timers and sockets run
  // in between), forever in busy mode (that thread never sleeps while the
  // connection lives: run the io_context on a core of its own), or for
  // adaptive_spin after the last completion in adaptive mode, then it sleeps
  // on the completion channel as in event mode. Not with shared_pollers.
  bool run_to_completion = false;
  // RECVs kept posted for data frames: the peer's send window. 64 x 4 KiB
  // slots = 256 KiB registered per connection, enough to cover the
  // bandwidth-delay product of 100 Gb/s x 20 us.
  uint16_t recv_depth = 64;
  // RECVs of data frames given back (the application dropped the message)
  // are posted in chains of this many, one ibv_post_recv each, instead of
  // one call each (docs/transport.md, "Receives go back in batches"): 0
  // picks recv_depth / 8, at most 16; 1 posts each one at once. The peer is
  // told of a RECV only once it is posted, and none waits while the peer may
  // be out of credits by our count, so a batch never stalls a sender.
  uint16_t recv_repost_batch = 0;
  // RECVs for rendezvous (CTS, WRITE_WITH_IMM) and CREDIT frames, which the
  // transport reposts on arrival (credits.h); at least 3. 8 lets 6 large
  // messages be in their CTS/WRITE phase at once, with two credits kept for
  // CREDIT frames.
  uint16_t ctrl_depth = 8;
  // Send WRs outstanding on the QP at most (SQ depth), and send slots.
  uint16_t send_depth = 64;
  // Largest message sent eagerly (one SEND). Above it, rendezvous. A 4 KiB
  // payload (one RoCE MTU: beyond that a copy costs more than the RTS/CTS
  // round trip saves on real NICs) plus 256 bytes for the headers of the
  // layers above: the RPC frame (32 B) and protobuf's field framing, so a
  // 4 KiB RPC payload is still one SEND (without the room it took the
  // rendezvous path: 3x the latency in the VM). Clamped to what the peer's
  // receive slots hold.
  size_t eager_limit = 4096 + 256;
  // Largest message accepted in either direction.
  size_t max_message_size = size_t{256} << 20;
  // Registered memory one connection may hold for incoming rendezvous
  // messages: granted, being written, or delivered and not yet released by
  // the application. An announcement (RTS) that would pass it waits, in order,
  // until earlier ones are released: the peer's send stalls, nothing fails.
  // A message is always admitted when nothing else is held, so messages up to
  // max_message_size still pass. Without it a peer's 64 RTS credits could make
  // us register 64 x max_message_size at once.
  size_t max_rendezvous_bytes_held = size_t{64} << 20;
  // Grant rendezvous receives from a pool of pre-registered memory, opening
  // exactly the granted bytes with a type-2 memory window that is bound for
  // the grant (a BIND_MW work request, no syscall, posted alone on an idle
  // send queue; the CTS follows its completion) and invalidated (LOCAL_INV,
  // likewise alone) when the transfer completes, before the message is
  // delivered. Off, or on a device without type-2 windows, every grant is an
  // MR registered for that message and deregistered at completion
  // (ibv_reg_mr + ibv_dereg_mr, two syscalls that pin and unpin pages).
  // Either way a grant allows REMOTE_WRITE only, over exactly the granted
  // length, for one transfer (docs/transport.md, "Rendezvous grants").
  bool grant_windows = true;
  // Offer the peer DATA frames whose 16-byte header rides in the SEND's
  // 32-bit immediate (SEND_WITH_IMM of the body alone); used only when both
  // ends offer it, so a peer from before it still gets headers. A 64-byte
  // message then puts 64 bytes on the wire, not 80 (on Soft-RoCE a frame
  // past 64 bytes costs ~5 us more a round trip; docs/transport.md).
  bool data_header_in_immediate = true;
  // Tests only (tests/rdma/rkey_attack_rdma_test.cc): called with every grant
  // this end receives, before it RDMA WRITEs into it; it may rewrite the grant
  // to play an attacker (an rkey it was not given, a guessed one, a grant
  // whose transfer already completed). Null in production.
  struct GrantForTest {
    uint64_t addr;
    uint32_t rkey;
    uint32_t grant_id;
    uint64_t length;
  };
  std::function<void(GrantForTest&)> test_rewrite_grant;
  // Tests only: while it holds true, this end stops reposting the receives
  // it consumes (a peer that stopped servicing its receive queue; issue 8
  // scenario 7). Its sender sees no credits come back and waits; RNR cannot
  // happen because nothing is sent without a credit. Null in production.
  std::shared_ptr<std::atomic<bool>> test_stop_reposting_receives;
  // Shared secret (transport/common/auth.h), checked in the rdma_cm connect
  // before the listener creates a QP or registers memory. Listener: non-empty
  // rejects clients without a matching proof (they see UNAUTHENTICATED);
  // empty accepts anyone. Connector: non-empty sends a proof (a listener
  // without a token ignores it). TransportOptions::auth_token sets it.
  std::string auth_token;
  CmOptions cm;
};

// What a process needs to use one RDMA device: the opened device and its PD.
// Shared by the connections and listeners made from it; not a global.
//
// fork(): registered memory and fork() do not mix on kernels before 5.13
// (the child's copy-on-write can leave the NIC writing into pages the parent
// no longer sees). Open() makes the process fork-safe: where the kernel
// protects pinned pages itself rdma-core reports IBV_FORK_UNNEEDED and nothing
// is done; otherwise it calls ibv_fork_init(), which must happen before any
// memory is registered (if it is too late, Open() fails and says so).
class RdmaContext {
 public:
  static absl::StatusOr<std::shared_ptr<RdmaContext>> Open(const DeviceSelector& selector);
  ~RdmaContext();
  const Device& device() const { return device_; }
  // "kernel" (fork-safe without help), "ibv_fork_init", as found at Open().
  const char* fork_protection() const { return fork_protection_; }
  // Spreads pollers of successive connections over the local cores.
  unsigned NextPollerSlot() { return next_poller_slot_.fetch_add(1, std::memory_order_relaxed); }
  // The shared poller threads for options.poll_mode/shared_pollers/
  // poller_cpu/adaptive_spin, started by the first connection that asks and
  // kept until the context goes (they sleep while they have no CQs).
  // Connections with the same settings share them. Thread-safe.
  absl::StatusOr<std::shared_ptr<PollerGroup>> SharedPollers(const RdmaOptions& options);

  // True once a connection or listener made from this context saw its device
  // go away (RDMA_CM_EVENT_DEVICE_REMOVAL: `rdma link delete`, a driver
  // unloaded, a NIC unplugged). Such a context is dead for good. Connections
  // and listeners release what they hold on the device at once and drop
  // their references; the kernel's removal then waits only for the holders
  // of the context itself: drop every reference you hold (librdmacm closes
  // the device when the last goes) and Open() a new context once the device
  // is back. rdmarpc::Server and Channel do both for the contexts they open.
  // Thread-safe.
  bool removed() const { return removed_.load(std::memory_order_acquire); }
  // Called by the transport when it sees the removal.
  void MarkRemoved() { removed_.store(true, std::memory_order_release); }

 private:
  explicit RdmaContext(Device device) : device_(std::move(device)) {}
  Device device_;
  std::atomic<bool> removed_{false};
  const char* fork_protection_ = "";
  std::atomic<unsigned> next_poller_slot_{0};
  struct Shared {
    PollMode mode;
    unsigned threads;
    int cpu;
    std::chrono::microseconds spin;
    std::shared_ptr<PollerGroup> group;
  };
  std::mutex shared_mu_;
  std::vector<Shared> shared_;  // Under shared_mu_.
};

// Listens on host:port (port 0: any). local_uri() is "rdma://host:port".
absl::StatusOr<std::unique_ptr<transport::Listener>> Listen(asio::any_io_executor ex,
                                                            std::shared_ptr<RdmaContext> context,
                                                            const std::string& host, uint16_t port,
                                                            RdmaOptions options = {});

// Connects to host:port. The peer must be reachable through the context's
// device (else FAILED_PRECONDITION naming both devices).
void Connect(asio::any_io_executor ex, std::shared_ptr<RdmaContext> context, const std::string& host,
             uint16_t port, RdmaOptions options, transport::Listener::AcceptHandler handler);

// Zero-copy send of the application's own registered memory: `buffer`
// (taken from a BufferPool made with BufferPool::CreateForDevice on the
// device of the RdmaContext the connection was made with) goes out as it is:
// up to the eager limit in one SEND that gathers a transport header and the
// buffer's bytes, above it by RDMA WRITE from the buffer into the peer's
// grant. Nothing is copied, so the bytes must not change until `handler`
// runs; the connection holds a reference to `buffer` until then (or, after a
// failure, until it is destroyed), so one Buffer can go to many connections
// at once (fanout) and returns to its pool when the last send is done. The
// pool must outlive the connections it sends on. Same ordering, credits and
// errors as Connection::Send. A Buffer registered in another protection
// domain is refused with INVALID_ARGUMENT (posting it would fail the
// connection with a local protection error). On a non-RDMA connection (TCP)
// the bytes are copied into a prepared buffer and sent: the same code runs on
// both transports.
void SendRegistered(transport::Connection& connection, std::shared_ptr<const Buffer> buffer,
                    transport::SendHandler handler);

template <typename Token>
auto AsyncSendRegistered(transport::Connection& connection, std::shared_ptr<const Buffer> buffer, Token&& token) {
  return asio::async_initiate<Token, void(absl::Status)>(
      [&connection](auto handler, std::shared_ptr<const Buffer> b) {
        SendRegistered(connection, std::move(b), std::move(handler));
      },
      token, std::move(buffer));
}

template <typename Token>
auto AsyncConnect(asio::any_io_executor ex, std::shared_ptr<RdmaContext> context, std::string host,
                  uint16_t port, RdmaOptions options, Token&& token) {
  return asio::async_initiate<Token, void(absl::StatusOr<std::unique_ptr<transport::Connection>>)>(
      [](auto handler, asio::any_io_executor e, std::shared_ptr<RdmaContext> c, std::string h,
         uint16_t p, RdmaOptions o) { Connect(std::move(e), std::move(c), h, p, o, std::move(handler)); },
      token, std::move(ex), std::move(context), std::move(host), port, options);
}

}  // namespace rdmarpc::rdma
