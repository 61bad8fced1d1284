// One polling task a turn for all the connections of a one-thread io_context.
//
// A polling connection (TCP poll_mode busy/adaptive, RDMA run to completion)
// polls from its executor's thread: after each pass it queues the next one.
// Queued one per connection, each pass is a scheduler operation: a post under
// the scheduler's lock, a run under it again, the outstanding-work count up
// and down, the operation's memory, a reference to the connection; ~280
// instructions (bench/cpu_per_call, docs/benchmarks.md). A PollGroup queues
// one task a turn that runs the pass of every connection that asked for one.
// With the client and the server of a call on one thread two passes a call
// become one; a server polling many connections posts one task a turn, not
// one per connection.
//
// One per io_context (an Asio service), used only when Asio was told that one
// thread runs that io_context (concurrency hint 1, or an UNSAFE hint: the test
// Asio uses for its own one-thread shortcuts): its lists are not locked. A
// strand, another kind of executor, or an io_context more threads may run
// gets no group (For() is null) and the connection queues its own passes.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/execution_context.hpp>
#include <boost/asio/io_context.hpp>

#include "transport/handler_memory.h"

namespace rdmarpc::transport {

namespace asio = boost::asio;

class PollGroup final : public asio::execution_context::service {
 public:
  using key_type = PollGroup;
  static inline asio::execution_context::id id;

  // A pass: `target` is what enlisted, `held` what its hold points at. When
  // they differ, target may be gone (the hold is what the pass can trust).
  using Pass = void (*)(void* target, void* held);

  explicit PollGroup(asio::io_context& io) : service(io), io_(io) {}

  // The group of ex's io_context, or null (see above).
  static PollGroup* For(const asio::any_io_executor& ex);

  // pass(target, held) runs on the next turn; `make_hold()` returns a
  // shared_ptr to `held` that keeps it alive until then. Called from the
  // same target's pass (same target and held), the running turn's hold moves
  // over and make_hold() is not called: no reference count up and down. A
  // target enlists once a turn (its own flag); a pass that wants another
  // enlists again.
  template <typename MakeHold>
  void Enlist(void* target, void* held, Pass pass, MakeHold&& make_hold) {
    if (passing_ != nullptr && passing_->target == target && passing_->hold.get() == held) {
      next_.push_back(std::move(*passing_));
    } else {
      next_.push_back(Entry{std::shared_ptr<void>(make_hold()), pass, target});
    }
    if (!posted_ && !running_) Post();
  }

 private:
  struct Entry {
    std::shared_ptr<void> hold;
    Pass pass;
    void* target;
  };

  void shutdown() override;
  void Post();
  void Run();
  void EndTurn();

  asio::io_context& io_;
  std::vector<Entry> next_;  // passes for the next turn
  std::vector<Entry> now_;   // this turn's, while Run() runs them
  Entry* passing_ = nullptr;  // the now_ entry whose pass runs
  bool posted_ = false;
  bool running_ = false;
  OpMemory memory_;
};

}  // namespace rdmarpc::transport
