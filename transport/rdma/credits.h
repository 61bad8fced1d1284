// Credit-based flow control for one RC connection. Pure bookkeeping, no verbs,
// so it is unit-tested without a device.
//
// A credit is a RECV the peer has posted for us. We never post a SEND (or a
// WRITE_WITH_IMM, which also consumes a RECV) without one, so the peer never
// answers Receiver-Not-Ready: RNR cannot happen by design.
//
// Two pools, split by *who gives the RECV back*:
//  - data credits: DATA and RTS frames, which define message order. A DATA
//    frame's RECV returns only when the application releases the message.
//  - ctrl credits: CTS, WRITE_WITH_IMM and CREDIT frames. The transport
//    reposts their RECVs the moment they arrive, whatever the application does.
// Rendezvous (CTS, WRITE) must never wait for data credits: the application
// may be holding every data RECV behind an undelivered rendezvous message at
// the head of its queue, which only that CTS/WRITE can complete (the
// conformance suite's eight-connection test deadlocked exactly so).
//
// Credits of both kinds ride back piggybacked on every frame with a header.
// A CREDIT frame (which itself costs the peer a ctrl RECV) goes out only as
// an *answer* that returns something the peer needs:
//  (c) ctrl: when at least `ctrl_threshold` = max(2, own_ctrl / 2) ctrl
//      credits are owed. It may take our last ctrl credit.
//  (d) data: when a quarter of the data window is owed, or when the peer has
//      (by our count) no data credit left and we owe at least one. It must
//      leave one ctrl credit, so (c) stays possible.
// Rendezvous frames also leave one ctrl credit. There are no "asks": a side
// never sends a CREDIT frame because *it* is blocked. (An earlier version
// did; two blocked sides then answered each other's asks one credit at a
// time, thousands of CREDIT frames with neither side ever holding the three
// credits a CTS needed -- the thread-poller stall of the eight-connection
// conformance test.) Why this is enough, with Wc = own_ctrl >= 3 and every
// frame arrived:
//  - A side blocked on rendezvous holds <= 1 ctrl credit, so the peer owes
//    it >= Wc - 1 >= ctrl_threshold and answers by (c) -- if the peer has a
//    ctrl credit. Only a (c) answer can take a side's last ctrl credit, and
//    it hands the other side >= 2 credits; so both sides are never at 0, and
//    a side at 0 is owed Wc by a side that can answer.
//  - A side blocked on data holds 0 data credits, which the peer sees
//    exactly (`peer_data_estimate`: credits granted minus data frames
//    received), so it answers by (d) as soon as it owes one -- at once, or
//    when the application releases a message.
//  - No ping-pong: a CREDIT frame makes the peer owe 1 ctrl credit, below
//    ctrl_threshold, and returns no data; so CREDIT frames are bounded by
//    the traffic that made credits owed (at most one per ctrl_threshold - 1
//    rendezvous frames, plus one per data frame in the worst case).
// tests/unit/rdma_protocol_test.cc simulates random two-sided schedules, with
// and without transit lag, and checks: no SEND without a RECV, no deadlock,
// CREDIT frames within that bound.
#pragma once

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

class CreditLedger {
 public:
  enum class Kind { kData, kCtrl };

  // `peer_data`/`peer_ctrl`: RECVs the peer keeps posted (from its hello).
  // `own_data`/`own_ctrl`: RECVs we keep posted, for the return thresholds.
  CreditLedger(uint16_t peer_data, uint16_t peer_ctrl, uint16_t own_data, uint16_t own_ctrl)
      : peer_data_max_(peer_data), peer_ctrl_max_(peer_ctrl), data_(peer_data), ctrl_(peer_ctrl),
        peer_data_estimate_(own_data),
        data_threshold_(std::max<uint32_t>(1, own_data / 4)),
        ctrl_threshold_(std::max<uint32_t>(2, own_ctrl / 2)) {}

  uint32_t data_credits() const { return data_; }
  uint32_t ctrl_credits() const { return ctrl_; }
  // DATA / RTS.
  bool CanSendData() const { return data_ > 0; }
  void ConsumeData() { --data_; }
  // CTS / WRITE_WITH_IMM: all but the last ctrl credit, which is kept so a
  // CREDIT frame can always answer.
  bool CanSendRendezvous() const { return ctrl_ > 1; }
  void ConsumeRendezvous() { --ctrl_; }
  void ConsumeCreditFrame() { --ctrl_; }

  // Credits the peer returned in a header. More than it could owe us is a
  // protocol violation (or corruption): the connection must end.
  absl::Status OnReturned(uint32_t data, uint32_t ctrl) {
    if (data_ + data > peer_data_max_ || ctrl_ + ctrl > peer_ctrl_max_) [[unlikely]]
      return OverReturned(data, ctrl);
    data_ += data;
    ctrl_ += ctrl;
    return absl::OkStatus();
  }

  // A DATA or RTS frame arrived: the peer spent one of its data credits.
  void OnDataFrameArrived() {
    if (peer_data_estimate_ > 0) --peer_data_estimate_;
  }
  // We reposted a RECV that a frame of `kind` consumed.
  void OnReposted(Kind kind, uint32_t count = 1) { (kind == Kind::kCtrl ? owed_ctrl_ : owed_data_) += count; }

  // What to piggyback on the frame being sent now; clears what is owed.
  struct Owed {
    uint16_t data;
    uint8_t ctrl;
  };
  Owed TakeOwed() {
    Owed o{static_cast<uint16_t>(std::min<uint32_t>(owed_data_, UINT16_MAX)),
           static_cast<uint8_t>(std::min<uint32_t>(owed_ctrl_, UINT8_MAX))};
    owed_data_ -= o.data;
    owed_ctrl_ -= o.ctrl;
    peer_data_estimate_ += o.data;
    return o;
  }
  uint32_t owed_data() const { return owed_data_; }
  uint32_t owed_ctrl() const { return owed_ctrl_; }
  // Data credits the peer holds by our count (it may hold fewer: frames in flight).
  uint32_t peer_data_estimate() const { return peer_data_estimate_; }

  // True when a CREDIT frame should go out now (rules (c) and (d) above).
  bool WantsCreditFrame() const {
    if (ctrl_ >= 1 && owed_ctrl_ >= ctrl_threshold_) return true;
    return ctrl_ >= 2 && owed_data_ > 0 && (owed_data_ >= data_threshold_ || peer_data_estimate_ == 0);
  }

 private:
  // The error out of line: OnReturned, inline on every receive, stays a few
  // instructions with no registers to save for a message it never builds.
  [[gnu::noinline, gnu::cold]] absl::Status OverReturned(uint32_t data, uint32_t ctrl) const {
    return absl::DataLossError(absl::StrCat("peer returned ", data, "/", ctrl, " credits but only ",
                                            peer_data_max_ - data_, "/", peer_ctrl_max_ - ctrl_,
                                            " were outstanding"));
  }

  uint32_t peer_data_max_, peer_ctrl_max_;
  uint32_t data_, ctrl_;
  uint32_t owed_data_ = 0, owed_ctrl_ = 0;
  uint32_t peer_data_estimate_;
  uint32_t data_threshold_, ctrl_threshold_;
};

}  // namespace rdmarpc::rdma
