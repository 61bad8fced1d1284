// The RDMA transport's protocol logic without a device: frame validation and
// credit flow control (simulated two-sided traffic).
#include <gtest/gtest.h>

#include <algorithm>
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

// The receive path decodes DATA headers inline (DecodeDataHeader) and sends
// everything else to DecodeHeader: the two must agree on every DATA frame,
// valid or not. Every frame type and body size, with every header byte
// replaced by a spread of values.
TEST(Wire, InlineDataHeaderDecodeAgreesWithTheFullCheck) {
  int accepted = 0;
  auto check = [&](const std::vector<std::byte>& f) {
    wire::Header fast;
    const bool took = wire::DecodeDataHeader(f, fast);
    auto full = wire::DecodeHeader(f);
    const bool data = full.ok() && full->type == wire::Type::kData;
    ASSERT_EQ(took, data) << "frame of " << f.size() << " bytes, header byte 1 = "
                          << std::to_integer<int>(f.size() > 1 ? f[1] : std::byte{0});
    if (!took) return;
    ++accepted;
    EXPECT_EQ(fast.type, full->type);
    EXPECT_EQ(fast.data_credits, full->data_credits);
    EXPECT_EQ(fast.ctrl_credits, full->ctrl_credits);
    EXPECT_EQ(fast.length, full->length);
    EXPECT_EQ(fast.cookie, full->cookie);
  };
  const uint8_t values[] = {0x00, 0x01, 0x02, 0x04, 0x10, 0x11, 0x12, 0x14, 0x15, 0x21, 0x7F, 0x80, 0xD7, 0xFE, 0xFF};
  for (auto type : {wire::Type::kData, wire::Type::kRts, wire::Type::kCts, wire::Type::kCredit}) {
    for (size_t body : {size_t{0}, size_t{1}, wire::kGrantSize, size_t{64}}) {
      for (uint32_t length : {uint32_t{0}, uint32_t{1}, static_cast<uint32_t>(wire::kGrantSize), uint32_t{64}}) {
        auto f = Frame({type, 513, 3, length, 0xABCDEF01u}, body);
        check(f);
        if (HasFatalFailure()) return;
        for (size_t at = 0; at < wire::kHeaderSize; ++at) {
          for (uint8_t v : values) {
            auto g = f;
            g[at] = std::byte{v};
            check(g);
            if (HasFatalFailure()) return;
          }
        }
        check(std::vector<std::byte>(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize - 1)));
        if (HasFatalFailure()) return;
      }
    }
  }
  EXPECT_GT(accepted, 100);  // the valid DATA frames and their harmless mutations (credits, cookie) among them
}

// A DATA header in a SEND's immediate: every credit value survives the trip;
// the body's length is the RECV's byte count; an immediate whose low byte is
// not DATA of our version (a CREDIT, RTS or CTS type, another version, an
// unrelated 32-bit value) is refused, whatever its other bits say.
TEST(Wire, ImmediateDataHeaderRoundTripsAndRefusesAnythingElse) {
  for (uint16_t data : {uint16_t{0}, uint16_t{1}, uint16_t{513}, uint16_t{0xFFFF}}) {
    for (uint8_t ctrl : {uint8_t{0}, uint8_t{3}, uint8_t{0xFF}}) {
      wire::Header h;
      ASSERT_TRUE(wire::DecodeImmHeader(wire::EncodeImmHeader(data, ctrl), 77, h));
      EXPECT_EQ(h.type, wire::Type::kData);
      EXPECT_EQ(h.data_credits, data);
      EXPECT_EQ(h.ctrl_credits, ctrl);
      EXPECT_EQ(h.length, 77u);
      EXPECT_EQ(h.cookie, 0u);
    }
  }
  int accepted = 0;
  for (uint32_t low = 0; low < 256; ++low) {
    wire::Header h;
    if (wire::DecodeImmHeader(0xABCD'1200u | low, 5, h)) ++accepted;
  }
  EXPECT_EQ(accepted, 1) << "only DATA, version 1, in the low byte";
  wire::Header h;
  EXPECT_FALSE(wire::DecodeImmHeader(0, 5, h));
  EXPECT_FALSE(wire::DecodeImmHeader(0xFFFF'FFFFu, 5, h));
  EXPECT_FALSE(wire::DecodeImmHeader(wire::EncodeImmHeader(1, 1) ^ 0x01u, 5, h));  // type 0
  EXPECT_FALSE(wire::DecodeImmHeader(wire::EncodeImmHeader(1, 1) ^ 0x30u, 5, h));  // version 2
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

// The auth proof rides after the hello in the connect's private data
// (transport/common/auth.h); the listener checks it before it creates a QP.
TEST(Wire, HelloCarriesAnAuthProofThatOnlyTheRightTokenVerifies) {
  namespace auth = transport::auth;
  std::vector<std::byte> b(wire::kHelloWithProofSize);
  EXPECT_EQ(b.size(), 56u) << "rdma_cm's RC connect private data limit";
  wire::EncodeHello({64, 8, 4096 + 256 + 16, 1u << 26, wire::kHelloAuthProof}, b.data());
  auto made = auth::MakeProof("token-a");
  ASSERT_TRUE(made.ok()) << made.status();
  std::copy(made->begin(), made->end(), b.begin() + wire::kHelloSize);

  auto proof = wire::DecodeHelloProof(b);
  ASSERT_TRUE(proof.ok()) << proof.status();
  ASSERT_TRUE(proof->has_value());
  EXPECT_EQ(auth::Check("token-a", &**proof), auth::Verdict::kOk);
  EXPECT_EQ(auth::Check("token-b", &**proof), auth::Verdict::kTokenMismatch);
  EXPECT_EQ(auth::Check("", &**proof), auth::Verdict::kOk) << "no token on the listener: anyone";
  EXPECT_EQ(auth::Check("token-a", nullptr), auth::Verdict::kTokenRequired);
  for (size_t i = 0; i < auth::kProofBytes; ++i) {  // Any flipped bit, nonce or MAC, fails.
    auth::Proof bad = **proof;
    bad[i] ^= std::byte{0x01};
    EXPECT_EQ(auth::Check("token-a", &bad), auth::Verdict::kTokenMismatch) << "byte " << i;
  }
  auto again = auth::MakeProof("token-a");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *made) << "each proof has a fresh nonce";

  // Without the flag there is no proof, whatever follows; with the flag but
  // truncated bytes the hello is refused.
  wire::EncodeHello({64, 8, 4096 + 256 + 16, 1u << 26}, b.data());
  auto none = wire::DecodeHelloProof(b);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  wire::EncodeHello({64, 8, 4096 + 256 + 16, 1u << 26, wire::kHelloAuthProof}, b.data());
  EXPECT_FALSE(wire::DecodeHelloProof(std::span(b).first(wire::kHelloSize + 8)).ok());
  EXPECT_EQ(auth::RefusedStatus(auth::Verdict::kTokenMismatch, "rdma://x:1").code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(Credits, PeerReturningMoreThanOutstandingIsAProtocolError) {
  CreditLedger l(8, 2, 8, 2);
  EXPECT_FALSE(l.OnReturned(1, 0).ok());
  l.ConsumeData();
  EXPECT_TRUE(l.OnReturned(1, 0).ok());
  EXPECT_FALSE(l.OnReturned(0, 1).ok());
}

TEST(Credits, RendezvousKeepsTheLastCtrlCreditForACreditFrame) {
  CreditLedger l(8, 4, 8, 4);
  EXPECT_TRUE(l.CanSendRendezvous());
  for (int i = 0; i < 3; ++i) l.ConsumeRendezvous();
  EXPECT_FALSE(l.CanSendRendezvous());  // One left: reserved for an answer.
  EXPECT_FALSE(l.WantsCreditFrame());   // Nothing owed: nothing to answer.
  l.OnReposted(CreditLedger::Kind::kCtrl);
  EXPECT_FALSE(l.WantsCreditFrame());   // One owed ctrl credit is below the threshold (2)...
  l.OnReposted(CreditLedger::Kind::kCtrl);
  EXPECT_TRUE(l.WantsCreditFrame());    // ...two are not, and may take the last credit.
}

// The thread-poller stall: two sides blocked on rendezvous frames used to
// "ask" for credits with CREDIT frames, and each ask returned the one credit
// the previous ask had cost, so the asks bounced forever with neither side
// reaching the credits a CTS needs. Now a CREDIT frame is only an answer,
// and a single CREDIT frame (one ctrl credit owed) never triggers another.
TEST(Credits, ACreditFrameAloneNeverTriggersAnother) {
  for (uint16_t c : {3, 4, 8, 16}) {
    CreditLedger l(64, c, 64, c);
    l.OnReposted(CreditLedger::Kind::kCtrl);  // The peer's CREDIT frame arrived.
    EXPECT_FALSE(l.WantsCreditFrame()) << "ctrl window " << c;
  }
}

// The peer has spent every data credit and we owe one: we answer at once,
// even below the data threshold (the application may be holding the rest).
TEST(Credits, ReturnsDataCreditsAtOnceWhenThePeerHasNoneLeft) {
  CreditLedger l(64, 8, 64, 8);
  for (int i = 0; i < 63; ++i) l.OnDataFrameArrived();
  l.OnReposted(CreditLedger::Kind::kData);
  EXPECT_FALSE(l.WantsCreditFrame());  // The peer still holds one: wait for more to return.
  l.OnDataFrameArrived();
  EXPECT_EQ(l.peer_data_estimate(), 0u);
  EXPECT_TRUE(l.WantsCreditFrame());
  l.ConsumeCreditFrame();
  EXPECT_EQ(l.TakeOwed().data, 1);
  EXPECT_EQ(l.peer_data_estimate(), 1u);
  EXPECT_FALSE(l.WantsCreditFrame());
}

// Two endpoints exchanging frames through in-flight queues. Each side posts
// R data + C ctrl receives. Data frames wait for the application, which
// releases them after a random delay; rendezvous frames (CTS/WRITE) and
// CREDIT frames are reposted on arrival. A frame becomes deliverable `lag`
// steps after it was sent (in order, as on an RC QP), which models the
// poller's hand-off to the executor: many frames in flight at once.
// Invariants: nobody ever sends without a RECV of the right kind posted (no
// RNR), every message and every rendezvous frame is delivered, the run ends
// (no deadlock or livelock), and CREDIT frames stay within the bound
// credits.h derives.
struct Side {
  Side(uint16_t r, uint16_t c) : ledger(r, c, r, c), posted_data(r), posted_ctrl(c) {}
  CreditLedger ledger;
  int posted_data, posted_ctrl;  // RECVs available to the peer (ground truth).
  int to_send = 0, rdv_to_send = 0, delivered = 0, rdv_delivered = 0, credit_frames = 0;
  std::deque<int> held;  // Data RECVs consumed, not yet released by the application.
};

enum class FrameKind { kData, kRendezvous, kCredit };
struct InFlight {
  FrameKind kind;
  CreditLedger::Owed owed;
  long deliverable_at;
};

struct SimResult {
  int credit_frames = 0;
};

SimResult Simulate(int a_msgs, int b_msgs, int a_rdv, int b_rdv, uint16_t r, uint16_t c, uint32_t seed,
                   int lag = 0) {
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
  long step = 0;
  auto send = [&](int i, FrameKind kind, CreditLedger::Owed owed) {
    const long delay = lag > 0 ? static_cast<long>(rng() % static_cast<unsigned>(lag + 1)) : 0;
    // In order: never deliverable before the frame ahead of it.
    const long at = std::max(step + delay, wire[i].empty() ? 0 : wire[i].back().deliverable_at);
    wire[i].push_back({kind, owed, at});
  };
  SimResult result;
  for (; step < 10'000'000 && !finished(); ++step) {
    const int i = static_cast<int>(rng() % 2);
    Side& me = s[i];
    Side& peer = s[1 - i];
    switch (rng() % 5) {
      case 0:  // A message (DATA/RTS) if a data credit allows.
        if (me.to_send > 0 && me.ledger.CanSendData()) {
          me.ledger.ConsumeData();
          send(i, FrameKind::kData, me.ledger.TakeOwed());
          --me.to_send;
        }
        break;
      case 1:  // A rendezvous frame (CTS/WRITE_WITH_IMM).
        if (me.rdv_to_send > 0 && me.ledger.CanSendRendezvous()) {
          me.ledger.ConsumeRendezvous();
          // Half the rendezvous frames are WRITE_WITH_IMM, which has no header:
          // they carry no credits back.
          const bool write = rng() % 2 == 0;
          send(i, FrameKind::kRendezvous, write ? CreditLedger::Owed{0, 0} : me.ledger.TakeOwed());
          --me.rdv_to_send;
        }
        break;
      case 2:  // A frame arrives at the peer and consumes one of its RECVs.
        if (!wire[i].empty() && wire[i].front().deliverable_at <= step) {
          InFlight f = wire[i].front();
          wire[i].pop_front();
          int& pool = f.kind == FrameKind::kData ? peer.posted_data : peer.posted_ctrl;
          EXPECT_GT(pool, 0) << "frame arrived with no RECV of its kind posted: RNR (seed " << seed << ")";
          if (pool <= 0) return result;
          --pool;
          EXPECT_TRUE(peer.ledger.OnReturned(f.owed.data, f.owed.ctrl).ok());
          if (f.kind == FrameKind::kData) {
            peer.ledger.OnDataFrameArrived();
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
        if (me.ledger.WantsCreditFrame()) {
          me.ledger.ConsumeCreditFrame();
          send(i, FrameKind::kCredit, me.ledger.TakeOwed());
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
  // credits.h: data answers <= data frames D; ctrl answers <= (R + D) / (T - 1)
  // with T = max(2, C / 2) owed ctrl credits per answer.
  const int d = a_msgs + b_msgs, rdv = a_rdv + b_rdv, t = std::max(2, c / 2);
  result.credit_frames = s[0].credit_frames + s[1].credit_frames;
  EXPECT_LE(result.credit_frames, d + (rdv + d) / (t - 1) + 2) << "seed " << seed;
  return result;
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

// Frames in flight for a long time (a busy poller's batches queued behind a
// starved executor thread). Rendezvous-heavy traffic both ways with the
// default windows: the old "ask" rule sent more CREDIT frames than
// rendezvous frames here; the answer-only rules stay within (R + D) / 3 + D.
TEST(Credits, TransitLagDoesNotMakeCreditFramesBounce) {
  for (int lag : {10, 100, 1000}) {
    for (uint32_t seed = 1; seed <= 10; ++seed) {
      SimResult r = Simulate(200, 200, 2000, 2000, 64, 8, seed, lag);
      EXPECT_LE(r.credit_frames, 2000) << "lag " << lag << " seed " << seed;
    }
  }
  for (uint32_t seed = 1; seed <= 10; ++seed) Simulate(2000, 2000, 1500, 1500, 2, 3, seed, 200);
  for (uint32_t seed = 1; seed <= 10; ++seed) Simulate(3000, 3000, 0, 0, 4, 3, seed, 200);
}

}  // namespace
}  // namespace rdmarpc::rdma
