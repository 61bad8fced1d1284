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
// Credits of both kinds ride back piggybacked on every frame. CTS/WRITE keep
// the last ctrl credit in reserve, so a CREDIT frame can always go out; a
// CREDIT frame is sent when a quarter of the data window or half the ctrl
// window is owed, or once per spell in which we are blocked. A CREDIT frame
// makes the peer owe one ctrl credit, below its threshold (>= 2), so CREDIT
// frames cannot ping-pong; a blocked side's one frame lifts the peer's debt
// to the threshold, so the peer answers. tests/unit/rdma_protocol_test.cc simulates
// random two-sided schedules and checks: no SEND without a RECV, no deadlock.
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
        data_threshold_(std::max<uint32_t>(1, own_data / 4)),
        ctrl_threshold_(std::max<uint32_t>(2, std::min<uint32_t>(own_ctrl - 1, own_ctrl / 2))) {}

  uint32_t data_credits() const { return data_; }
  uint32_t ctrl_credits() const { return ctrl_; }
  // DATA / RTS.
  bool CanSendData() const { return data_ > 0; }
  void ConsumeData() { --data_; }
  // CTS / WRITE_WITH_IMM: all but the last two ctrl credits, which are kept
  // for CREDIT frames (one to ask, one to answer).
  bool CanSendRendezvous() const { return ctrl_ > 2; }
  void ConsumeRendezvous() { --ctrl_; }
  // CREDIT frames may take the reserve. `blocked`: sent to unblock us.
  void ConsumeCreditFrame(bool blocked) {
    --ctrl_;
    poked_ = poked_ || blocked;
  }

  // Credits the peer returned in a header. More than it could owe us is a
  // protocol violation (or corruption): the connection must end.
  absl::Status OnReturned(uint32_t data, uint32_t ctrl) {
    if (data_ + data > peer_data_max_ || ctrl_ + ctrl > peer_ctrl_max_)
      return absl::DataLossError(absl::StrCat("peer returned ", data, "/", ctrl,
                                              " credits but only ", peer_data_max_ - data_, "/",
                                              peer_ctrl_max_ - ctrl_, " were outstanding"));
    data_ += data;
    ctrl_ += ctrl;
    if (data + ctrl > 0) poked_ = false;  // Our poke was answered: may ask again.
    return absl::OkStatus();
  }

  // We reposted a RECV that a frame of `kind` consumed.
  void OnReposted(Kind kind) { kind == Kind::kCtrl ? ++owed_ctrl_ : ++owed_data_; }

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
  uint32_t owed_ctrl() const { return owed_ctrl_; }

  // True when a CREDIT frame should go out now. `blocked`: we have frames
  // waiting for credits of either kind. A blocked side sends one CREDIT frame
  // per spell even when it owes nothing: the peer may owe us credits below its
  // threshold (it cannot know we are stuck), and that frame puts it at or
  // above the threshold, so it answers with everything it owes.
  bool WantsCreditFrame(bool blocked) {
    if (!blocked) poked_ = false;  // The spell is over.
    // Answering (returning what the thresholds say) may take the last credit;
    // asking (the blocked poke) may not, so an answer is always possible.
    if (ctrl_ >= 1 && (owed_data_ >= data_threshold_ || owed_ctrl_ >= ctrl_threshold_)) return true;
    return ctrl_ >= 2 && blocked && !poked_;
  }

 private:
  uint32_t peer_data_max_, peer_ctrl_max_;
  uint32_t data_, ctrl_;
  uint32_t owed_data_ = 0, owed_ctrl_ = 0;
  uint32_t data_threshold_, ctrl_threshold_;
  bool poked_ = false;  // A CREDIT frame went out for the current blocked spell.
};

}  // namespace rdmarpc::rdma
