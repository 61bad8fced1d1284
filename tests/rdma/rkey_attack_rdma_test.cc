// A peer that misuses rkeys (issue 8, scenario 10), on a real device: the
// attacker is an ordinary rdmarpc connection whose grants are rewritten just
// before it RDMA WRITEs (RdmaOptions::test_rewrite_grant), so it writes with
// a grant whose transfer already completed, with an rkey it was not given,
// or with neighbours of a real rkey (rxe's rkeys are an MR index << 8 | an
// 8-bit key: guessable). Each attempt must end in a remote access error for
// the attacker, no byte of the victim's memory may change, nothing wrong may
// be delivered, and the victim's other connections carry on.
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/rdma_env.h"
#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::rdma {
namespace {

namespace asio = boost::asio;
using transport::Connection;
using transport::Message;
// Rendezvous (above the eager limit), and exactly a grant-pool class: a
// window then covers its whole buffer, whose MR ends where the grant does.
constexpr size_t kSize = size_t{256} << 10;

std::shared_ptr<RdmaContext> OpenContext() {
  auto ctx = RdmaContext::Open({.name = testing::TestDevice()});
  EXPECT_TRUE(ctx.ok()) << ctx.status();
  return ctx.ok() ? *ctx : nullptr;
}

class Rig {
 public:
  Rig(RdmaOptions attacker_options, RdmaOptions server_options) : ctx_(OpenContext()) {
    if (!ctx_) return;
    auto listener = Listen(io_.get_executor(), ctx_, testing::TestIp(), 0, std::move(server_options));
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return;
    listener_ = std::move(*listener);
    const std::string uri = listener_->local_uri();
    port_ = static_cast<uint16_t>(std::stoi(uri.substr(uri.rfind(':') + 1)));
    attacker_ = ConnectOne(std::move(attacker_options), &victim_);
    bystander_ = ConnectOne(RdmaOptions{}, &bystander_server_);
  }
  bool ok() const { return attacker_ && victim_ && bystander_ && bystander_server_; }

  template <typename Done>
  bool RunUntil(Done done, std::chrono::seconds limit = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) io_.run_one_for(std::chrono::milliseconds(50));
    return done();
  }

  // Sends `size` bytes of `fill` from `from`; the status once the send completes.
  absl::Status SendFill(Connection& from, size_t size, uint8_t fill) {
    auto buf = from.Prepare(size);
    if (!buf.ok()) return buf.status();
    std::memset(buf->data().data(), fill, size);
    std::optional<absl::Status> sent;
    from.Send(std::move(*buf), [&](absl::Status st) { sent = st; });
    RunUntil([&] { return sent.has_value(); });
    return sent.value_or(absl::DeadlineExceededError("send never completed"));
  }
  // The next message on `to`, or its error, within `limit`.
  std::optional<absl::StatusOr<Message>> ReceiveOne(Connection& to, std::chrono::seconds limit) {
    std::optional<absl::StatusOr<Message>> got;
    to.Receive([&](absl::StatusOr<Message> m) { got = std::move(m); });
    RunUntil([&] { return got.has_value(); }, limit);
    return got;
  }

  Connection& attacker() { return *attacker_; }
  Connection& victim() { return *victim_; }
  Connection& bystander() { return *bystander_; }
  Connection& bystander_server() { return *bystander_server_; }

 private:
  std::unique_ptr<Connection> ConnectOne(RdmaOptions options, std::unique_ptr<Connection>* server_side) {
    std::unique_ptr<Connection> client;
    bool accepted = false, connected = false;
    listener_->Accept([&](absl::StatusOr<std::unique_ptr<Connection>> c) {
      accepted = true;
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) *server_side = std::move(*c);
    });
    Connect(io_.get_executor(), ctx_, testing::TestIp(), port_, std::move(options),
            [&](absl::StatusOr<std::unique_ptr<Connection>> c) {
              connected = true;
              EXPECT_TRUE(c.ok()) << c.status();
              if (c.ok()) client = std::move(*c);
            });
    RunUntil([&] { return accepted && connected; });
    return client;
  }

  asio::io_context io_;
  std::shared_ptr<RdmaContext> ctx_;
  std::unique_ptr<transport::Listener> listener_;
  uint16_t port_ = 0;
  std::unique_ptr<Connection> attacker_, victim_, bystander_, bystander_server_;
};

bool AllBytesAre(const Message& m, uint8_t fill) {
  for (std::byte b : m.data())
    if (b != std::byte(fill)) return false;
  return true;
}

using Rewrite = std::function<void(const RdmaOptions::GrantForTest& first, RdmaOptions::GrantForTest& second)>;

// One attack: message 1 goes through honestly and the victim keeps it (its
// buffer stays allocated, its grant revoked); message 2's grant is rewritten
// by `rewrite` (given message 1's grant). Checks everything the scenario asks.
// The victim grants through type-2 memory windows over its grant pool
// (`windows`, the default) or with an MR per message (devices without them).
void AttackOnce(const char* what, bool windows, const Rewrite& rewrite) {
  SCOPED_TRACE(absl::StrCat(what, windows ? ", grants are windows over a pool" : ", grants are MRs of their own"));
  std::vector<RdmaOptions::GrantForTest> seen;
  RdmaOptions evil;
  evil.test_rewrite_grant = [&](RdmaOptions::GrantForTest& g) {
    seen.push_back(g);
    if (seen.size() == 2) rewrite(seen[0], g);
  };
  RdmaOptions server;
  server.grant_windows = windows;
  Rig rig(std::move(evil), std::move(server));
  ASSERT_TRUE(rig.ok());

  ASSERT_TRUE(rig.SendFill(rig.attacker(), kSize, 0xA1).ok());
  auto first = rig.ReceiveOne(rig.victim(), std::chrono::seconds(60));
  ASSERT_TRUE(first && first->ok()) << (first ? first->status().ToString() : "nothing arrived");
  Message held = std::move(**first);  // the victim keeps message 1 in its memory
  ASSERT_TRUE(AllBytesAre(held, 0xA1));

  const absl::Status attack = rig.SendFill(rig.attacker(), kSize, 0x66);
  EXPECT_FALSE(attack.ok()) << "the rewritten RDMA WRITE succeeded";
  EXPECT_NE(std::string(attack.message()).find("remote access error"), std::string::npos) << attack;

  // Nothing of the attacker's reaches the victim's application.
  auto second = rig.ReceiveOne(rig.victim(), std::chrono::seconds(5));
  if (second && second->ok()) {
    ADD_FAILURE() << "the victim delivered a message after the attack: " << (*second)->size() << " bytes, "
                  << (AllBytesAre(**second, 0x66) ? "the attacker's" : "other") << " data";
  }
  // The victim's memory is byte-identical.
  EXPECT_TRUE(AllBytesAre(held, 0xA1)) << "the attacker changed memory it had no live grant for";
  held.Reset();
  // The grants were of the kind this round is about.
  const auto vs = rig.victim().stats();
  EXPECT_EQ(vs.grants_windowed, windows ? 2u : 0u);
  EXPECT_EQ(vs.rendezvous_receive_registrations, windows ? 0u : 2u);

  // Another client of the same listener is untouched.
  ASSERT_TRUE(rig.SendFill(rig.bystander(), kSize, 0x5B).ok());
  auto other = rig.ReceiveOne(rig.bystander_server(), std::chrono::seconds(60));
  ASSERT_TRUE(other && other->ok()) << (other ? other->status().ToString() : "nothing arrived");
  EXPECT_TRUE(AllBytesAre(**other, 0x5B));
}

void Attack(const char* what, const Rewrite& rewrite) {
  for (bool windows : {true, false}) AttackOnce(what, windows, rewrite);
}

TEST(RdmaRkeyAttack, AGrantWhoseTransferCompletedIsRevoked) {
  Attack("stale grant", [](const auto& first, auto& second) {
    second.addr = first.addr;
    second.rkey = first.rkey;
    second.grant_id = first.grant_id;
  });
}

TEST(RdmaRkeyAttack, TheStaleRkeyAimedAtTheLiveGrantsAddressFails) {
  Attack("stale rkey, live address", [](const auto& first, auto& second) { second.rkey = first.rkey; });
}

TEST(RdmaRkeyAttack, GuessedNeighboursOfALiveRkeyFail) {
  // rxe: rkey = (MR index << 8) | key. The same MR with another key, and the
  // MRs registered just before and after it.
  for (int64_t delta : {1, -1, 256, -256, 512}) {
    Attack(("rkey " + std::to_string(delta)).c_str(), [delta](const auto&, auto& second) {
      second.rkey = static_cast<uint32_t>(static_cast<int64_t>(second.rkey) + delta);
    });
  }
}

TEST(RdmaRkeyAttack, WritingPastTheGrantedLengthFails) {
  // The grant (its window, or its MR) is exactly the granted length: one
  // byte further is outside it.
  Attack("past the end", [](const auto&, auto& second) { second.addr += 1; });
}

TEST(RdmaRkeyAttack, TheLiveRkeyAimedAtAHeldMessageFails) {
  // The attacker has a live grant and aims it at the buffer of message 1,
  // which the victim's application is still reading. A window is bound over
  // one grant-pool buffer, and rxe checks a window's writes against its MR's
  // range only (not the window's own): the pool must therefore give every
  // buffer its own MR, or this write would land (it did, in a first version
  // whose pool carved buffers from shared slabs).
  Attack("live rkey, a held message's address", [](const auto& first, auto& second) { second.addr = first.addr; });
}

}  // namespace
}  // namespace rdmarpc::rdma
