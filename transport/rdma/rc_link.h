// RcLink: one reliable-connected QP with its own CQ and a registered slab of
// fixed-size send and receive slots. It is the smallest unit that moves bytes
// between two processes over RDMA, set up through rdma_cm on Asio.
//
// It does no flow control and no framing: the caller decides when to post.
// The message transport (credits, rendezvous, pollers) is built on top of it;
// the smoke test and the demo use it directly.
//
// Threading: setup coroutines run on the caller's executor; Post*/Poll may be
// called from one thread at a time (the poller's).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "transport/rdma/cm.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

struct RcLinkOptions {
  size_t slot_size = 4096;  // Bytes per slot: one message per slot.
  int send_slots = 64;
  int recv_slots = 64;
  CmOptions cm;
};

class RcLink {
 public:
  static asio::awaitable<absl::StatusOr<std::unique_ptr<RcLink>>> Connect(
      asio::any_io_executor ex, const Device& dev, std::string host, uint16_t port,
      RcLinkOptions options);
  // Accepts the next connection on `listener`. All receive slots are posted
  // before the accept completes, so the peer may SEND at once.
  static asio::awaitable<absl::StatusOr<std::unique_ptr<RcLink>>> Accept(
      CmListener& listener, const Device& dev, RcLinkOptions options);

  std::span<std::byte> send_slot(int i);
  std::span<std::byte> recv_slot(int i);
  uint32_t max_inline() const { return max_inline_; }
  CmEndpoint& endpoint() { return *endpoint_; }

  // wr_id of completions: slot index for sends, recv_slots + index for receives.
  absl::Status PostSend(int slot, size_t len);
  absl::Status PostRecv(int slot);
  bool IsRecv(const ibv_wc& wc) const { return wc.wr_id >= static_cast<uint64_t>(options_.send_slots); }
  int SlotOf(const ibv_wc& wc) const {
    return IsRecv(wc) ? static_cast<int>(wc.wr_id) - options_.send_slots : static_cast<int>(wc.wr_id);
  }
  // Non-blocking: returns completions drained from the CQ (0 when empty).
  int Poll(std::span<ibv_wc> out);

 private:
  RcLink(const Device& dev, RcLinkOptions options) : dev_(dev), options_(options) {}
  absl::Status Init(std::unique_ptr<CmEndpoint> ep);

  const Device& dev_;
  RcLinkOptions options_;
  // Destruction order (reverse of declaration): QP via endpoint, CQ, MR, memory.
  std::vector<std::byte> memory_;
  MrPtr mr_;
  CqPtr cq_;
  std::unique_ptr<CmEndpoint> endpoint_;
  uint32_t max_inline_ = 0;
};

}  // namespace rdmarpc::rdma
