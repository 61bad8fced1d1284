#include "rpc/fanout.h"

#include <algorithm>

#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>

#include "absl/strings/str_cat.h"
#include "transport/completion.h"

namespace rdmarpc {

absl::StatusOr<SlowConsumerPolicy> ParseSlowConsumerPolicy(std::string_view name) {
  if (name == "block") return SlowConsumerPolicy::kBlock;
  if (name == "drop_oldest") return SlowConsumerPolicy::kDropOldest;
  if (name == "conflate") return SlowConsumerPolicy::kConflate;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown slow-consumer policy '", internal::Sv(name), "' (block, drop_oldest, conflate)"));
}

std::string_view SlowConsumerPolicyName(SlowConsumerPolicy policy) {
  switch (policy) {
    case SlowConsumerPolicy::kBlock:
      return "block";
    case SlowConsumerPolicy::kDropOldest:
      return "drop_oldest";
    case SlowConsumerPolicy::kConflate:
      return "conflate";
  }
  return "?";
}

namespace internal {

// One subscription: its stream, its queue, and the serve operation to
// complete when it ends. It observes its stream (writable again, ended).
struct FanoutCore::Sub final : StreamObserver {
  FanoutCore* owner = nullptr;
  std::shared_ptr<StreamCore> stream;
  SubscriptionOptions options;
  // Ticks not yet taken by the stream, in sequence order. Conflate: a key's
  // newer tick replaces its queued one by leaving a hole (null) there and
  // going to the back, so the order stays the sequence order; `position`
  // maps each key to its queued tick's index counted from `base` (ticks
  // ever popped). Holes are compacted once they outnumber the live ticks.
  std::deque<std::shared_ptr<const Tick>> queue;
  absl::flat_hash_map<uint64_t, uint64_t> position;
  uint64_t base = 0;
  size_t holes = 0;
  size_t live() const { return queue.size() - holes; }
  bool closing = false;
  bool ended = false;  // its stream ended: removal is posted
  uint64_t id = 0;
  StreamHandler done;
  asio::cancellation_slot slot;

  void OnWritable() override { owner->Pump(*this); }
  // Inside the stream's own call chain (maybe inside our TryWriteBytes):
  // removal happens later, on the executor.
  void OnStreamEnded(const Status& why) override {
    ended = true;
    asio::post(owner->ex_, [core = owner->shared_from_this(), id = id,
                            ec = why.ok() ? boost::system::error_code() : make_error_code(why.code())] {
      core->Remove(id, ec);
    });
  }
  // Drops holes at the front; the queue is then empty or starts with a tick.
  void SkipHoles() {
    while (!queue.empty() && queue.front() == nullptr) {
      queue.pop_front();
      ++base;
      --holes;
    }
  }
  void PopFront() {
    SkipHoles();
    if (queue.empty()) return;
    if (options.policy == SlowConsumerPolicy::kConflate) {
      auto it = position.find(queue.front()->key);
      if (it != position.end() && it->second == base) position.erase(it);
    }
    queue.pop_front();
    ++base;
    SkipHoles();
  }
  void Compact() {
    std::deque<std::shared_ptr<const Tick>> kept;
    for (auto& t : queue)
      if (t != nullptr) kept.push_back(std::move(t));
    base = 0;
    holes = 0;
    queue = std::move(kept);
    position.clear();
    for (size_t i = 0; i < queue.size(); ++i) position[queue[i]->key] = i;
  }
};

namespace {
struct ServeCanceller {
  std::weak_ptr<FanoutCore> core;
  StreamCore* stream;
  void operator()(asio::cancellation_type type) const {
    if ((type & (asio::cancellation_type::terminal | asio::cancellation_type::partial)) == asio::cancellation_type::none)
      return;
    // The handler was cancelled: its stream ends with it (the server aborts
    // the stream too); removal happens through OnStreamEnded.
    if (auto c = core.lock()) {
      asio::post(c->executor(), [s = stream->shared_from_this()] { s->StartCancel(); });
    }
  }
};
}  // namespace

FanoutCore::FanoutCore(asio::any_io_executor ex) : ex_(std::move(ex)) {}

FanoutCore::~FanoutCore() {
  for (auto& s : subs_) s->stream->SetObserver(nullptr);
}

void FanoutCore::StartPublish(uint64_t key, std::string bytes, StreamHandler handler) {
  asio::dispatch(ex_, [self = shared_from_this(), key, b = std::move(bytes), h = std::move(handler)]() mutable {
    self->Publish(key, std::move(b), std::move(h));
  });
}

void FanoutCore::StartServe(std::shared_ptr<StreamCore> stream, SubscriptionOptions options, StreamHandler done) {
  asio::dispatch(ex_, [self = shared_from_this(), s = std::move(stream), options, d = std::move(done)]() mutable {
    self->Serve(std::move(s), options, std::move(d));
  });
}

void FanoutCore::StartClose() {
  asio::dispatch(ex_, [self = shared_from_this()] { self->Close(); });
}

bool FanoutCore::Blocked() const {
  for (const auto& s : subs_)
    if (s->options.policy == SlowConsumerPolicy::kBlock && !s->closing && s->queue.size() >= s->options.queue_limit)
      return true;
  return false;
}

void FanoutCore::Publish(uint64_t key, std::string bytes, StreamHandler handler) {
  if (closed_) return transport::PostCompletion(ex_, std::move(handler), make_error_code(StatusCode::kCancelled));
  if (blocked_publish_)  // one publish at a time
    return transport::PostCompletion(ex_, std::move(handler), make_error_code(StatusCode::kFailedPrecondition));
  auto tick = std::make_shared<Tick>(Tick{std::move(bytes), ++sequence_, key});
  ++stats_.published;
  // Enqueue may remove a subscriber whose stream failed: iterate over a copy.
  for (auto& s : subs_)  // removals are posted: the vector holds still
    if (!s->closing) Enqueue(*s, tick);
  if (Blocked()) {
    ++stats_.publishes_blocked;
    blocked_publish_.swap(handler);
    return;
  }
  transport::PostCompletion(ex_, std::move(handler), boost::system::error_code());
}

void FanoutCore::Enqueue(Sub& sub, const std::shared_ptr<const Tick>& tick) {
  if (sub.ended) return;
  if (sub.queue.empty() && sub.stream->TryWriteBytes(std::as_bytes(std::span(tick->bytes)), tick->sequence)) {
    ++stats_.sent;
    return;
  }
  if (sub.ended) return;
  switch (sub.options.policy) {
    case SlowConsumerPolicy::kBlock:
      break;  // the publisher waits (Blocked())
    case SlowConsumerPolicy::kDropOldest:
      while (sub.live() >= sub.options.queue_limit && sub.live() > 0) {
        sub.PopFront();
        ++stats_.dropped;
      }
      break;
    case SlowConsumerPolicy::kConflate: {
      if (auto it = sub.position.find(tick->key); it != sub.position.end()) {
        sub.queue[it->second - sub.base] = nullptr;  // superseded: a hole
        ++sub.holes;
        sub.position.erase(it);
        ++stats_.dropped;
        sub.SkipHoles();
      }
      while (sub.live() >= sub.options.queue_limit && sub.live() > 0) {
        sub.PopFront();
        ++stats_.dropped;
      }
      if (sub.holes > 16 && sub.holes > sub.live()) sub.Compact();
      sub.position[tick->key] = sub.base + sub.queue.size();
      break;
    }
  }
  sub.queue.push_back(tick);
  stats_.max_queued = std::max<uint64_t>(stats_.max_queued, sub.live());
}

void FanoutCore::Pump(Sub& sub) {
  sub.SkipHoles();
  while (!sub.queue.empty() && !sub.ended) {
    const Tick& t = *sub.queue.front();
    if (!sub.stream->TryWriteBytes(std::as_bytes(std::span(t.bytes)), t.sequence)) break;
    ++stats_.sent;
    sub.PopFront();
  }
  if (sub.ended) return;
  if (sub.queue.empty() && sub.closing) return Remove(sub.id, {});
  MaybeUnblock();
}

void FanoutCore::MaybeUnblock() {
  if (blocked_publish_ && !Blocked()) {
    StreamHandler h;
    h.swap(blocked_publish_);
    transport::PostCompletion(ex_, std::move(h), boost::system::error_code());
  }
}

void FanoutCore::Serve(std::shared_ptr<StreamCore> stream, SubscriptionOptions options, StreamHandler done) {
  if (options.queue_limit == 0) options.queue_limit = 1;
  if (closed_) return transport::PostCompletion(ex_, std::move(done), boost::system::error_code());
  if (stream->ended())
    return transport::PostCompletion(ex_, std::move(done), make_error_code(stream->end_status().code()));
  auto sub = std::make_unique<Sub>();
  sub->owner = this;
  sub->id = ++next_sub_id_;
  sub->stream = std::move(stream);
  sub->options = options;
  sub->done.swap(done);
  sub->slot = asio::get_associated_cancellation_slot(sub->done);
  if (sub->slot.is_connected())
    sub->slot.template emplace<ServeCanceller>(ServeCanceller{weak_from_this(), sub->stream.get()});
  sub->stream->SetObserver(sub.get());
  ++stats_.subscribers;
  ++stats_.subscribed;
  subs_.push_back(std::move(sub));
}

void FanoutCore::Remove(uint64_t id, boost::system::error_code ec) {
  auto it = std::find_if(subs_.begin(), subs_.end(), [&](const auto& s) { return s->id == id; });
  if (it == subs_.end()) return;
  std::unique_ptr<Sub> gone = std::move(*it);
  subs_.erase(it);
  --stats_.subscribers;
  gone->stream->SetObserver(nullptr);
  if (gone->slot.is_connected()) gone->slot.clear();
  transport::PostCompletion(ex_, std::move(gone->done), ec);
  MaybeUnblock();
}

void FanoutCore::Close() {
  if (closed_) return;
  closed_ = true;
  std::vector<uint64_t> ids;
  for (auto& s : subs_) ids.push_back(s->id);
  for (uint64_t id : ids) {
    auto it = std::find_if(subs_.begin(), subs_.end(), [&](const auto& s) { return s->id == id; });
    if (it == subs_.end()) continue;
    (*it)->closing = true;
    Pump(**it);  // removes it if nothing is queued
  }
  if (blocked_publish_) {
    StreamHandler h;
    h.swap(blocked_publish_);
    transport::PostCompletion(ex_, std::move(h), make_error_code(StatusCode::kCancelled));
  }
}

}  // namespace internal
}  // namespace rdmarpc
