// How Channel and Server take a connection's messages: through a
// transport::MessageSink when the backend has one (no handler built, queued and
// dispatched per message), otherwise with one Receive() after another.
#pragma once

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace rdmarpc::internal {

// Forwards to owner->OnReceive(conn, message-or-error), as a Receive() handler
// would, and completions of untracked sends to owner->OnSendsCompleted().
// Holds both weakly: the connection's owner owns the sink, and neither is kept
// alive by the transport (a message for a channel or server that is gone is
// dropped).
template <typename Owner, typename Conn>
class ReceiveSink final : public transport::MessageSink {
 public:
  ReceiveSink(std::weak_ptr<Owner> owner, const std::shared_ptr<Conn>& conn)
      : owner_(std::move(owner)), conn_(conn), raw_conn_(conn.get()) {}

  void OnMessage(transport::Message message) override {
    Forward(absl::StatusOr<transport::Message>(std::move(message)));
  }
  void OnConnectionError(absl::Status status) override {
    Forward(absl::StatusOr<transport::Message>(std::move(status)));
  }
  // The owner's SendUntracked() sends: owner->OnSendsCompleted(conn, count).
  // An owner with a static SendsCompletedWithoutOwner(Conn&, count) gets
  // them there first, without the two weak_ptr locks (~70 instructions a
  // completion batch), and says whether that was all: the sink is the
  // connection's (Conn::sink, declared before Conn::c), so while the
  // transport calls it the Conn is alive.
  void OnSendsCompleted(size_t count) override {
    if constexpr (requires { Owner::SendsCompletedWithoutOwner(*raw_conn_, count); }) {
      if (Owner::SendsCompletedWithoutOwner(*raw_conn_, count)) return;
    }
    std::shared_ptr<Owner> owner = owner_.lock();
    std::shared_ptr<Conn> conn = conn_.lock();
    if (owner && conn) owner->OnSendsCompleted(conn, count);
  }

 private:
  void Forward(absl::StatusOr<transport::Message> message) {
    std::shared_ptr<Owner> owner = owner_.lock();
    std::shared_ptr<Conn> conn = conn_.lock();
    if (owner && conn) owner->OnReceive(conn, std::move(message));
  }

  std::weak_ptr<Owner> owner_;
  std::weak_ptr<Conn> conn_;
  Conn* raw_conn_;  // OnSendsCompleted's owner-free path only
};

// Installs a ReceiveSink on conn->c, kept in conn->sink; false when the
// transport has none (then the caller loops on Receive()).
template <typename Owner, typename Conn>
bool InstallReceiveSink(const std::shared_ptr<Owner>& owner, const std::shared_ptr<Conn>& conn) {
  auto sink = std::make_unique<ReceiveSink<Owner, Conn>>(owner, conn);
  if (!conn->c->SetSink(sink.get())) return false;
  conn->sink = std::move(sink);
  return true;
}

}  // namespace rdmarpc::internal
