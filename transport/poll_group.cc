#include "transport/poll_group.h"

#include <boost/asio/post.hpp>

namespace rdmarpc::transport {

PollGroup* PollGroup::For(const asio::any_io_executor& ex) {
  const auto* io_ex = ex.target<asio::io_context::executor_type>();
  if (io_ex == nullptr) return nullptr;
  asio::io_context& io = io_ex->context();
  // The hint the io_context was made with, tested as Asio's scheduler tests
  // it for its one_thread_ shortcuts (scheduler.ipp).
  const int hint = asio::use_service<asio::detail::scheduler>(io).concurrency_hint();
  const bool one_thread = hint == 1 || !BOOST_ASIO_CONCURRENCY_HINT_IS_LOCKING(SCHEDULER, hint) ||
                          !BOOST_ASIO_CONCURRENCY_HINT_IS_LOCKING(REACTOR_IO, hint);
  if (!one_thread) return nullptr;
  return &asio::use_service<PollGroup>(io);
}

void PollGroup::shutdown() {
  next_.clear();
  now_.clear();
}

void PollGroup::Post() {
  posted_ = true;
  asio::post(io_, WithOpMemory(memory_, [this] { Run(); }));
}

void PollGroup::Run() {
  posted_ = false;
  running_ = true;
  now_.swap(next_);  // passes that enlist again go to next_, for the next turn
  size_t i = 0;
  try {
    for (; i < now_.size(); ++i) {
      passing_ = &now_[i];
      now_[i].pass(now_[i].target, now_[i].hold.get());  // may leave the hold empty (moved on by Enlist)
    }
  } catch (...) {
    // A handler threw out of a pass (Asio lets it out of run()). The
    // connections after it keep their turn; the one whose pass threw loses
    // its next pass unless it enlisted already, as when it posted its own.
    for (++i; i < now_.size(); ++i) next_.push_back(std::move(now_[i]));
    EndTurn();
    throw;
  }
  EndTurn();
}

void PollGroup::EndTurn() {
  passing_ = nullptr;
  now_.clear();
  running_ = false;
  if (!next_.empty()) Post();
}

}  // namespace rdmarpc::transport
