// Credit-based flow control for one RC connection. Pure bookkeeping, no verbs,
// so it is unit-tested without a device.
//
// A credit is a RECV the peer has posted for us. We never post a SEND (or a
// WRITE_WITH_IMM, which also consumes a RECV) without one, so the peer never
// answers Receiver-Not-Ready: RNR cannot happen by design.
//
// Two pools, so that returning credits can never deadlock:
//  - data credits: DATA, RTS, CTS frames and WRITE_WITH_IMM;
//  - ctrl credits: CREDIT frames only.
// Credits of both kinds ride back piggybacked on every frame. A CREDIT frame
// goes out when enough data credits are owed and nothing else is going out,
// or when we are blocked on data credits and owe the peer something (see
// WantsCreditFrame). A CREDIT frame that only returns ctrl credits is never
// sent by an unblocked side, so CREDIT frames cannot ping-pong.
// A CREDIT frame's RECV is reposted by the transport the moment it arrives
// (only messages wait for the application); without that, the simulation in
// tests/unit/rdma_protocol_test.cc deadlocks with both sides' ctrl credits
// owed and neither able to send.
#pragma once

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::rdma {

class CreditLedger {
 public:
  // `peer_data`/`peer_ctrl`: RECVs the peer keeps posted (from its hello).
  // `own_data_recvs`: RECVs we keep posted for data frames; a CREDIT frame is
  // worth sending once a quarter of them are owed (fewer frames, and the peer
  // still has three quarters in hand).
  CreditLedger(uint16_t peer_data, uint16_t peer_ctrl, uint16_t own_data_recvs)
      : peer_data_max_(peer_data), peer_ctrl_max_(peer_ctrl), data_(peer_data), ctrl_(peer_ctrl),
        threshold_(std::max<uint16_t>(1, own_data_recvs / 4)) {}

  uint32_t data_credits() const { return data_; }
  uint32_t ctrl_credits() const { return ctrl_; }
  bool CanSendData() const { return data_ > 0; }
  bool CanSendCtrl() const { return ctrl_ > 0; }
  void ConsumeData() { --data_; }
  void ConsumeCtrl() { --ctrl_; }

  // Credits the peer returned in a header. More than it could owe us is a
  // protocol violation (or corruption): the connection must end.
  absl::Status OnReturned(uint32_t data, uint32_t ctrl) {
    if (data_ + data > peer_data_max_ || ctrl_ + ctrl > peer_ctrl_max_)
      return absl::DataLossError(absl::StrCat("peer returned ", data, "/", ctrl,
                                              " credits but only ", peer_data_max_ - data_, "/",
                                              peer_ctrl_max_ - ctrl_, " were outstanding"));
    data_ += data;
    ctrl_ += ctrl;
    return absl::OkStatus();
  }

  // We reposted a RECV consumed by a data frame (or a CREDIT frame).
  void OnReposted(bool was_credit_frame) { was_credit_frame ? ++owed_ctrl_ : ++owed_data_; }

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
    return o;
  }
  uint32_t owed_data() const { return owed_data_; }

  // True when a CREDIT frame should go out now (a ctrl credit must be free):
  //  - enough data credits are owed, or
  //  - we are blocked for lack of data credits and owe the peer anything: the
  //    peer may be holding our data credits until its ctrl credit comes back
  //    (it has no other frame to carry it). One such frame per blocked spell.
  bool WantsCreditFrame(bool blocked_on_data) const {
    if (ctrl_ == 0) return false;
    return owed_data_ >= threshold_ || (blocked_on_data && (owed_ctrl_ > 0 || owed_data_ > 0));
  }

 private:
  uint32_t peer_data_max_, peer_ctrl_max_;
  uint32_t data_, ctrl_;
  uint32_t owed_data_ = 0, owed_ctrl_ = 0;
  uint32_t threshold_;
};

}  // namespace rdmarpc::rdma
