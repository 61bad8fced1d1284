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
  wire::EncodeHello({64, 2, 4096 + 16, 1u << 26}, b.data());
  auto h = wire::DecodeHello(b);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->recv_data, 64);
  EXPECT_EQ(h->recv_ctrl, 2);
  EXPECT_EQ(h->recv_slot_bytes, 4096u + 16);
  EXPECT_EQ(h->max_message, 1u << 26);
  EXPECT_FALSE(wire::DecodeHello(std::span(b).first(10)).ok());
  wire::EncodeHello({1, 2, 4096, 1}, b.data());
  EXPECT_FALSE(wire::DecodeHello(b).ok());  // Too few receives to make progress.
}

TEST(Credits, PeerReturningMoreThanOutstandingIsAProtocolError) {
  CreditLedger l(8, 2, 8);
  EXPECT_FALSE(l.OnReturned(1, 0).ok());
  l.ConsumeData();
  EXPECT_TRUE(l.OnReturned(1, 0).ok());
  EXPECT_FALSE(l.OnReturned(0, 1).ok());
}

// Two endpoints exchanging frames through in-flight queues. Each side posts
// R data + C ctrl receives; the application releases received messages after
// a random delay. Invariants: nobody ever sends without a credit (a RECV is
// always waiting: no RNR), every message is delivered, and the run ends (no
// deadlock), for one-way and two-way traffic.
struct Side {
  Side(uint16_t r, uint16_t c) : ledger(r, c, r), posted_data(r), posted_ctrl(c) {}
  CreditLedger ledger;
  int posted_data, posted_ctrl;  // RECVs available to the peer (ground truth).
  int to_send = 0, delivered = 0, credit_frames = 0;
  std::deque<bool> held;  // Consumed RECVs not yet reposted (true = CREDIT frame).
};

struct InFlight {
  bool credit_frame;
  CreditLedger::Owed owed;
};

void Simulate(int a_msgs, int b_msgs, uint16_t r, uint16_t c, uint32_t seed) {
  Side s[2] = {Side(r, c), Side(r, c)};
  s[0].to_send = a_msgs;
  s[1].to_send = b_msgs;
  std::deque<InFlight> wire[2];  // wire[i]: frames travelling from i to 1-i.
  std::mt19937 rng(seed);
  for (int step = 0; step < 10'000'000; ++step) {
    const int i = static_cast<int>(rng() % 2);
    Side& me = s[i];
    Side& peer = s[1 - i];
    switch (rng() % 4) {
      case 0:  // Application sends a message if a credit allows.
        if (me.to_send > 0 && me.ledger.CanSendData()) {
          me.ledger.ConsumeData();
          ASSERT_GT(peer.posted_data + peer.posted_ctrl, 0) << "SEND without a posted RECV";
          wire[i].push_back({false, me.ledger.TakeOwed()});
          --me.to_send;
        }
        break;
      case 1:  // A frame arrives at the peer (consumes one of its RECVs).
        if (!wire[i].empty()) {
          InFlight f = wire[i].front();
          wire[i].pop_front();
          int& pool = f.credit_frame ? peer.posted_ctrl : peer.posted_data;
          ASSERT_GT(pool, 0) << "frame arrived with no RECV of its kind posted: RNR";
          --pool;
          if (f.credit_frame) {
            // The transport reposts a CREDIT frame's RECV at once; only
            // messages wait for the application.
            ++pool;
            peer.ledger.OnReposted(true);
          } else {
            peer.held.push_back(false);
            ++peer.delivered;
          }
          ASSERT_TRUE(peer.ledger.OnReturned(f.owed.data, f.owed.ctrl).ok());
        }
        break;
      case 2:  // Application releases a message: RECV reposted, credit owed.
        if (!me.held.empty()) {
          bool credit_frame = me.held.front();
          me.held.pop_front();
          (credit_frame ? me.posted_ctrl : me.posted_data)++;
          me.ledger.OnReposted(credit_frame);
        }
        break;
      case 3:  // Idle: the transport returns credits if nothing else will.
        if (me.ledger.WantsCreditFrame(me.to_send > 0 && !me.ledger.CanSendData()) &&
            !(me.to_send > 0 && me.ledger.CanSendData())) {
          me.ledger.ConsumeCtrl();
          wire[i].push_back({true, me.ledger.TakeOwed()});
          ++me.credit_frames;
        }
        break;
    }
    if (s[0].to_send == 0 && s[1].to_send == 0 && wire[0].empty() && wire[1].empty() &&
        s[0].delivered == b_msgs && s[1].delivered == a_msgs)
      break;
  }
  EXPECT_EQ(s[1].delivered, a_msgs) << "deadlock: A's messages stuck (seed " << seed << ")";
  EXPECT_EQ(s[0].delivered, b_msgs) << "deadlock: B's messages stuck (seed " << seed << ")";
  // CREDIT frames are bounded by traffic: at most one per quarter window
  // returned plus one per blocked spell (each spell moves >= 1 message).
  EXPECT_LE(s[0].credit_frames + s[1].credit_frames, 2 * (a_msgs + b_msgs) + 2);
}

TEST(Credits, OneWayTrafficNeverSendsWithoutACreditAndNeverDeadlocks) {
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(5000, 0, 8, 1, seed);
}

TEST(Credits, TwoWayTrafficWithTinyWindowsNeverDeadlocks) {
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(3000, 3000, 2, 1, seed);
  for (uint32_t seed = 1; seed <= 20; ++seed) Simulate(3000, 100, 16, 2, seed);
}

}  // namespace
}  // namespace rdmarpc::rdma
