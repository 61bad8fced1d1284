// Per-call contexts: what the caller sets (deadline, metadata) and learns
// (status, peer), and what a handler sees (deadline, metadata, peer,
// cancellation).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <boost/asio/cancellation_signal.hpp>

#include "rpc/frame.h"
#include "rpc/status.h"

namespace rdmarpc {

using Clock = std::chrono::steady_clock;

// One call at a time: reuse it for another call only after the previous one
// completed. It must outlive the call (as must the request).
class ClientContext {
 public:
  ClientContext() = default;
  ClientContext(const ClientContext&) = delete;
  ClientContext& operator=(const ClientContext&) = delete;

  // The call fails with DEADLINE_EXCEEDED at this time, whatever the peer
  // does; the server is told the remaining time and stops the handler then.
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }
  template <typename Rep, typename Period>
  void set_timeout(std::chrono::duration<Rep, Period> timeout) {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  }
  std::optional<Clock::time_point> deadline() const { return deadline_; }

  // Sent with the request; the handler reads it from ServerContext. Keys are
  // non-empty, keys and values at most 65535 bytes, at most 64 entries.
  void AddMetadata(std::string key, std::string value) { metadata_.emplace_back(std::move(key), std::move(value)); }
  const rpc::Metadata& metadata() const { return metadata_; }

  // Default false: a call made while the channel cannot connect fails at once
  // with UNAVAILABLE. True: it waits for a connection until its deadline.
  void set_wait_for_ready(bool wait) { wait_for_ready_ = wait; }
  bool wait_for_ready() const { return wait_for_ready_; }

  // Streams: messages this end lets the server send ahead of its reads
  // (0: ChannelOptions::stream_window).
  void set_stream_window(uint32_t messages) { stream_window_ = messages; }
  uint32_t stream_window() const { return stream_window_; }

  // After completion: the call's full status (code and message) and the peer.
  const Status& status() const { return status_; }
  const std::string& peer() const {
    static const std::string kNone;
    return peer_ ? *peer_ : kNone;
  }

  // For the runtime.
  void SetResult(Status status) { status_ = std::move(status); }
  // Shared with the connection: no string copy per call, and no count
  // changed when a reused context's last call went to the same connection
  // (two atomic operations, ~25 instructions a call in bench/cpu_per_call).
  void SetPeer(const std::shared_ptr<const std::string>& peer) {
    if (peer_ != peer) peer_ = peer;
  }

 private:
  std::optional<Clock::time_point> deadline_;
  rpc::Metadata metadata_;
  bool wait_for_ready_ = false;
  uint32_t stream_window_ = 0;
  Status status_;
  std::shared_ptr<const std::string> peer_;
};

// What a handler sees. Cancellation (the client cancelled, the deadline
// passed, the connection died, or the server is shutting down past its drain
// time) is delivered two ways: as a terminal cancellation of whatever the
// handler coroutine is awaiting, and as is_cancelled() for CPU-bound loops.
class ServerContext {
 public:
  std::optional<Clock::time_point> deadline() const { return deadline_; }
  const rpc::Metadata& metadata() const { return metadata_; }
  // Value of the first metadata entry with this key, if any.
  std::optional<std::string_view> FindMetadata(std::string_view key) const {
    for (const auto& [k, v] : metadata_)
      if (k == key) return v;
    return std::nullopt;
  }
  const std::string& peer() const { return *peer_; }
  bool is_cancelled() const { return cancelled_; }
  // Why the call was cancelled (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE);
  // OK while it is not.
  StatusCode cancel_reason() const { return cancel_reason_; }

  // For the runtime.
  void Reset(const std::string* peer) {
    deadline_.reset();
    metadata_.clear();
    peer_ = peer;
    cancelled_ = false;
    cancel_reason_ = StatusCode::kOk;
  }
  void set_deadline(Clock::time_point d) { deadline_ = d; }
  rpc::Metadata& mutable_metadata() { return metadata_; }
  void MarkCancelled(StatusCode reason) {
    if (!cancelled_) {
      cancelled_ = true;
      cancel_reason_ = reason;
    }
  }

 private:
  std::optional<Clock::time_point> deadline_;
  rpc::Metadata metadata_;
  const std::string* peer_ = nullptr;
  bool cancelled_ = false;
  StatusCode cancel_reason_ = StatusCode::kOk;
};

}  // namespace rdmarpc
