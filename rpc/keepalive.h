// Keepalive: finding a peer that is gone without a disconnect reaching us.
//
// A client whose host powers off, or whose disconnect was lost on the wire,
// leaves its connection open on the server forever: an idle RC QP (or TCP
// socket) sends nothing, so nothing fails. The same holds for a client waiting
// on calls to a server that vanished after taking them. Both ends therefore
// probe a connection that has been silent for `interval`: they send a PING
// (the peer's runtime answers PONG), and a connection from which nothing at all
// arrives within `timeout` of the PING is closed as dead. Any frame counts as
// a sign of life, so a busy connection never pings: the RPC frames, and the
// frames the transport takes in below them (ConnectionStats::frames_received:
// RDMA's RTS, CTS, CREDIT and WRITE-with-immediate). Without the latter a
// connection working through a backlog was declared dead: its PING queued
// behind its own messages, the peer's answers behind rendezvous progress that
// arrived all along (a 350-call burst, half of them 64 KiB, over Soft-RoCE
// with a 300/500 ms keepalive).
//
// The hot path only bumps a counter per received frame; a sweep every
// Keepalive::Tick() reads the clock. A dead peer is found at most
// interval + timeout + 2 ticks after its last frame.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>

namespace rdmarpc {

struct KeepaliveOptions {
  // Silence after which a PING goes out; zero turns keepalive off.
  std::chrono::milliseconds interval{10'000};
  // Silence after the PING after which the connection is closed as dead.
  std::chrono::milliseconds timeout{10'000};
};

namespace internal {

class Keepalive {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Action { kNone, kPing, kDead };

  static bool Enabled(const KeepaliveOptions& o) { return o.interval.count() > 0 && o.timeout.count() > 0; }
  // How often to sweep: a quarter of the shorter period, at least 10 ms.
  static std::chrono::milliseconds Tick(const KeepaliveOptions& o) {
    return std::max(std::chrono::milliseconds(10), std::min(o.interval, o.timeout) / 4);
  }

  explicit Keepalive(Clock::time_point now) : last_activity_(now) {}

  // Per received frame (the only hot-path cost).
  void OnFrame() { ++frames_; }

  // `transport_frames`: the connection's ConnectionStats::frames_received.
  Action Sweep(Clock::time_point now, const KeepaliveOptions& o, uint64_t transport_frames) {
    if (frames_ != frames_seen_ || transport_frames != transport_seen_) {
      frames_seen_ = frames_;
      transport_seen_ = transport_frames;
      last_activity_ = now;
      ping_sent_.reset();
      return Action::kNone;
    }
    if (ping_sent_) return now - *ping_sent_ >= o.timeout ? Action::kDead : Action::kNone;
    if (now - last_activity_ >= o.interval) {
      ping_sent_ = now;
      return Action::kPing;
    }
    return Action::kNone;
  }

  uint64_t frames() const { return frames_; }

 private:
  uint64_t frames_ = 0;
  uint64_t frames_seen_ = 0;
  uint64_t transport_seen_ = 0;
  Clock::time_point last_activity_;
  std::optional<Clock::time_point> ping_sent_;
};

}  // namespace internal
}  // namespace rdmarpc
