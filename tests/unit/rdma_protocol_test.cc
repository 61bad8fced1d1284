// The RDMA transport's protocol logic without a device: frame validation and
// credit flow control (simulated two-sided traffic).
#include <gtest/gtest.h>

#include <deque>
#include <random>
#include <vector>

#include "transport/rdma/credits.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {
namespace {

std::vector<std::byte> Frame(const wire::Header& h, size_t body) {
  std::vector<std::byte> f(wire::kHeaderSize + body);
  wire::EncodeHeader(h, f.data());
  return f;
}

TEST(Wire, HeaderRoundTrips) {
  wire::Header h{wire::Type::kData, 513, 3, 5, 0xABCDEF01u};
  auto f = Frame(h, 5);
  auto d = wire::DecodeHeader(f);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->type, wire::Type::kData);
  EXPECT_EQ(d->data_credits, 513);
  EXPECT_EQ(d->ctrl_credits, 3);
  EXPECT_EQ(d->length, 5u);
  EXPECT_EQ(d->cookie, 0xABCDEF01u);
}

TEST(Wire, RejectsMalformedFrames) {
  wire::Header h{wire::Type::kData, 0, 0, 10, 0};
  auto f = Frame(h, 10);
  EXPECT_FALSE(wire::DecodeHeader(std::span(f).first(15)).ok());  // Short.
  auto bad_magic = f;
  bad_magic[0] = std::byte{0};
  EXPECT_FALSE(wire::DecodeHeader(bad_magic).ok());
  auto bad_version = f;
  bad_version[1] = std::byte{0x21};
  EXPECT_EQ(wire::DecodeHeader(bad_version).status().code(), absl::StatusCode::kFailedPrecondition);
  auto bad_type = f;
  bad_type[1] = std::byte{0x1F};
  EXPECT_FALSE(wire::DecodeHeader(bad_type).ok());
  auto reserved = f;
  reserved[4] = std::byte{1};
  EXPECT_FALSE(wire::DecodeHeader(reserved).ok());
  // Length that disagrees with what arrived (a lie, or an overflow attempt).
  wire::Header lie{wire::Type::kData, 0, 0, 0xFFFFFFFFu, 0};
  EXPECT_FALSE(wire::DecodeHeader(Frame(lie, 10)).ok());
  wire::Header cts{wire::Type::kCts, 0, 0, 100, 1};
  EXPECT_FALSE(wire::DecodeHeader(Frame(cts, 3)).ok());
  EXPECT_TRUE(wire::DecodeHeader(Frame(cts, wire::kGrantSize)).ok());
  wire::Header credit{wire::Type::kCredit, 4, 0, 0, 0};
  EXPECT_FALSE(wire::DecodeHeader(Frame(credit, 1)).ok());
}

TEST(Wire, HelloValidatesThePeer) {
  std::vector<std::byte> b(wire::kHelloSize);
  wire::EncodeHello({64, 3, 4096 + 16, 1u << 26}, b.data());
  auto h = wire::DecodeHello(b);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->recv_data, 64);
  EXPECT_EQ(h->recv_ctrl, 3);
  EXPECT_EQ(h->recv_slot_bytes, 4096u + 16);
  EXPECT_EQ(h->max_message, 1u << 26);
  EXPECT_FALSE(wire::DecodeHello(std::span(b).first(10)).ok());
  wire::EncodeHello({1, 2, 4096, 1}, b.data());
  EXPECT_FALSE(wire::DecodeHello(b).ok());  // Too few receives to make progress.
}

TEST(Credits, PeerReturningMoreThanOutstandingIsAProtocolError) {
  CreditLedger l(8, 2, 8, 2);
  EXPECT_FALSE(l.OnReturned(1, 0).ok());
  l.ConsumeData();
  EXPECT_TRUE(l.OnReturned(1, 0).ok());
  EXPECT_FALSE(l.OnReturned(0, 1).ok());
}

TEST(Credits, RendezvousKeepsTheLastTwoCtrlCreditsForCreditFrames) {
  CreditLedger l(8, 4, 8, 4);
  EXPECT_TRUE(l.CanSendRendezvous());
  l.ConsumeRendezvous();
  EXPECT_TRUE(l.CanSendRendezvous());
  l.ConsumeRendezvous();
  EXPECT_FALSE(l.CanSendRendezvous());  // Two left: reserved for CREDIT frames.
  l.OnReposted(CreditLedger::Kind::kData);
  EXPECT_TRUE(l.WantsCreditFrame(/*blocked=*/true));
}

// Two endpoints exchanging frames through in-flight queues. Each side posts
// R data + C ctrl receives. Data frames wait for the application, which
// releases them after a random delay; rendezvous frames (CTS/WRITE) and
// CREDIT frames are reposted on arrival. Invariants: nobody ever sends
// without a RECV of the right kind posted (no RNR), every message and every
// rendezvous frame is delivered, and the run ends (no deadlock).
struct Side {
  Side(uint16_t r, uint16_t c) : ledger(r, c, r, c), posted_data(r), posted_ctrl(c) {}
  CreditLedger ledger;
  int posted_data, posted_ctrl;  // RECVs available to the peer (ground truth).
  int to_send = 0, rdv_to_send = 0, delivered = 0, rdv_delivered = 0, credit_frames = 0;
  std::deque<int> held;  // Data RECVs consumed, not yet released by the application.
  bool Blocked() const {
    return (to_send > 0 && !ledger.CanSendData()) || (rdv_to_send > 0 && !ledger.CanSendRendezvous());
  }
};

enum class FrameKind { kData, kRendezvous, kCredit };
struct InFlight {
  FrameKind kind;
  CreditLedger::Owed owed;
};

void Simulate(int a_msgs, int b_msgs, int a_rdv, int b_rdv, uint16_t r, uint16_t c, uint32_t seed) {
  Side s[2] = {Side(r, c), Side(r, c)};
  s[0].to_send = a_msgs;
  s[1].to_send = b_msgs;
  s[0].rdv_to_send = a_rdv;
  s[1].rdv_to_send = b_rdv;
  std::deque<InFlight> wire[2];  // wire[i]: frames travelling from i to 1-i.
  std::mt19937 rng(seed);
  auto finished = [&] {
    return s[0].to_send == 0 && s[1].to_send == 0 && s[0].rdv_to_send == 0 && s[1].rdv_to_send == 0 &&
           wire[0].empty() && wire[1].empty() && s[0].delivered == b_msgs && s[1].delivered == a_msgs;
  };
  for (int step = 0; step < 10'000'000 && !finished(); ++step) {
    const int i = static_cast<int>(rng() % 2);
    Side& me = s[i];
    Side& peer = s[1 - i];
    switch (rng() % 5) {
      case 0:  // A message (DATA/RTS) if a data credit allows.
        if (me.to_send > 0 && me.ledger.CanSendData()) {
          me.ledger.ConsumeData();
          wire[i].push_back({FrameKind::kData, me.ledger.TakeOwed()});
          --me.to_send;
        }
        break;
      case 1:  // A rendezvous frame (CTS/WRITE_WITH_IMM).
        if (me.rdv_to_send > 0 && me.ledger.CanSendRendezvous()) {
          me.ledger.ConsumeRendezvous();
          // Half the rendezvous frames are WRITE_WITH_IMM, which has no header:
          // they carry no credits back.
          const bool write = rng() % 2 == 0;
          wire[i].push_back({FrameKind::kRendezvous, write ? CreditLedger::Owed{0, 0} : me.ledger.TakeOwed()});
          --me.rdv_to_send;
        }
        break;
      case 2:  // A frame arrives at the peer and consumes one of its RECVs.
        if (!wire[i].empty()) {
          InFlight f = wire[i].front();
          wire[i].pop_front();
          int& pool = f.kind == FrameKind::kData ? peer.posted_data : peer.posted_ctrl;
          ASSERT_GT(pool, 0) << "frame arrived with no RECV of its kind posted: RNR (seed " << seed << ")";
          --pool;
          ASSERT_TRUE(peer.ledger.OnReturned(f.owed.data, f.owed.ctrl).ok());
          if (f.kind == FrameKind::kData) {
            peer.held.push_back(0);
            ++peer.delivered;
          } else {  // The transport reposts at once.
            ++pool;
            peer.ledger.OnReposted(CreditLedger::Kind::kCtrl);
            if (f.kind == FrameKind::kRendezvous) ++peer.rdv_delivered;
          }
        }
        break;
      case 3:  // The application releases a message: RECV reposted, credit owed.
        if (!me.held.empty()) {
          me.held.pop_front();
          ++me.posted_data;
          me.ledger.OnReposted(CreditLedger::Kind::kData);
        }
        break;
      case 4:  // The transport returns credits if the rules say so.
        if (me.ledger.WantsCreditFrame(me.Blocked())) {
          me.ledger.ConsumeCreditFrame(me.Blocked());
          wire[i].push_back({FrameKind::kCredit, me.ledger.TakeOwed()});
          ++me.credit_frames;
        }
        break;
    }
  }
  EXPECT_TRUE(finished()) << "deadlock (seed " << seed << "): A sent " << a_msgs - s[0].to_send << "/" << a_msgs
                          << ", B sent " << b_msgs - s[1].to_send << "/" << b_msgs << ", rendezvous left "
                          << s[0].rdv_to_send << "/" << s[1].rdv_to_send;
  EXPECT_EQ(s[1].rdv_delivered, a_rdv);
  EXPECT_EQ(s[0].rdv_delivered, b_rdv);
  // CREDIT frames are bounded by traffic (each returns at least one credit).
  EXPECT_LE(s[0].credit_frames + s[1].credit_frames, 2 * (a_msgs + b_msgs + a_rdv + b_rdv) + 2);
}

TEST(Credits, OneWayTrafficNeverSendsWithoutACreditAndNeverDeadlocks) {
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(5000, 0, 0, 0, 8, 3, seed);
}

TEST(Credits, TwoWayTrafficWithTinyWindowsNeverDeadlocks) {
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(3000, 3000, 0, 0, 2, 3, seed);
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(3000, 100, 0, 0, 16, 4, seed);
}

TEST(Credits, RendezvousAndDataTrafficTogetherNeverDeadlock) {
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(2000, 2000, 1500, 1500, 4, 3, seed);
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(2000, 2000, 1500, 1500, 2, 8, seed);
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(500, 0, 0, 3000, 8, 8, seed);
}

}  // namespace
}  // namespace rdmarpc::rdma
