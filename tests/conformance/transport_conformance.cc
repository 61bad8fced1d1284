#include "tests/conformance/transport_conformance.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/strand.hpp>

#include "absl/strings/str_cat.h"

namespace rdmarpc::conformance {
namespace {

using transport::Connection;
using transport::Message;
using transport::SendBuffer;
using Clock = std::chrono::steady_clock;

// ---- payloads ------------------------------------------------------------------

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Fills `out` with message `index` of stream `seed`: the index in the first 8
// bytes (when they fit), so a reordered or duplicated message says which one
// it is, then bytes that differ per seed, index and offset.
void FillPayload(uint64_t seed, uint64_t index, std::span<std::byte> out) {
  uint64_t state = seed * 0x100000001b3ULL ^ index;
  size_t i = 0;
  if (out.size() >= 8) {
    for (; i < 8; ++i) out[i] = static_cast<std::byte>(index >> (8 * i));
  }
  while (i < out.size()) {
    uint64_t word = SplitMix64(state);
    for (int b = 0; b < 8 && i < out.size(); ++b, ++i) out[i] = static_cast<std::byte>(word >> (8 * b));
  }
}

std::vector<std::byte> Payload(uint64_t seed, uint64_t index, size_t size) {
  std::vector<std::byte> bytes(size);
  FillPayload(seed, index, bytes);
  return bytes;
}

uint64_t Fnv1a(std::span<const std::byte> bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (std::byte b : bytes) h = (h ^ std::to_integer<uint64_t>(b)) * 0x100000001b3ULL;
  return h;
}

// Empty when `got` is message `index` of stream `seed` with `size` bytes;
// otherwise what is wrong with it.
std::string CheckPayload(std::span<const std::byte> got, uint64_t seed, uint64_t index, size_t size) {
  if (got.size() != size) {
    return absl::StrCat("message #", index, ": got ", got.size(), " bytes, expected ", size);
  }
  std::vector<std::byte> want = Payload(seed, index, size);
  const uint64_t got_sum = Fnv1a(got);
  const uint64_t want_sum = Fnv1a(want);
  if (got_sum == want_sum) return "";
  auto [g, w] = std::mismatch(got.begin(), got.end(), want.begin());
  std::string which;
  if (size >= 8) {
    uint64_t got_index = 0;
    for (int i = 0; i < 8; ++i) got_index |= std::to_integer<uint64_t>(got[i]) << (8 * i);
    if (got_index != index) which = absl::StrCat(" (it carries the index of message #", got_index, ")");
  }
  return absl::StrCat("message #", index, " of ", size, " bytes: checksum ", got_sum, " != expected ", want_sum,
                      ", first difference at offset ", g - got.begin(), which);
}

std::string Describe(const absl::Status& status) { return status.ToString(); }

// Tests that need a buffer of max_message_size (+1) bytes skip that part
// above this: a backend may allow messages too big to allocate in a test.
constexpr size_t kLargestMessageToMaterialise = size_t{256} << 20;

// ---- a one-way stream of checked messages ---------------------------------------

// Sends `count` messages from `from` to `to` with up to `window` sends in
// flight and one Receive() pending, checking every arrival (content and order).
// Handlers hold the Flow by shared_ptr, so a handler that runs late is harmless.
struct Flow : std::enable_shared_from_this<Flow> {
  Connection* from = nullptr;
  Connection* to = nullptr;
  uint64_t seed = 0;
  int count = 0;
  int window = 1;
  std::function<size_t(int)> size_of;
  bool zero_copy = false;  // Prepare() + write into data() instead of async_send(span).

  int next_send = 0;
  int sends_done = 0;
  int received = 0;
  std::string failure;  // The first thing that went wrong.

  bool done() const { return !failure.empty() || (sends_done == count && received == count); }

  void Start() {
    for (int i = 0; i < window; ++i) SendNext();
    if (count > 0) ReceiveNext();
  }

  void Fail(std::string what) {
    if (failure.empty()) failure = std::move(what);
  }

  void SendNext() {
    if (next_send >= count || !failure.empty()) return;
    const int i = next_send++;
    const size_t size = size_of(i);
    auto on_sent = [self = shared_from_this(), i](absl::Status s) {
      if (!s.ok()) return self->Fail(absl::StrCat("send #", i, " failed: ", Describe(s)));
      ++self->sends_done;
      self->SendNext();
    };
    if (zero_copy) {
      absl::StatusOr<SendBuffer> buffer = from->Prepare(size);
      if (!buffer.ok()) return Fail(absl::StrCat("Prepare(", size, ") failed: ", Describe(buffer.status())));
      FillPayload(seed, i, buffer->data());
      from->async_send(std::move(*buffer), std::move(on_sent));
    } else {
      std::vector<std::byte> bytes = Payload(seed, i, size);
      from->async_send(std::span<const std::byte>(bytes), std::move(on_sent));
    }
  }

  void ReceiveNext() {
    to->async_receive([self = shared_from_this()](absl::StatusOr<Message> m) {
      const int i = self->received;
      if (!m.ok()) return self->Fail(absl::StrCat("receive #", i, " failed: ", Describe(m.status())));
      std::string wrong = CheckPayload(m->data(), self->seed, i, self->size_of(i));
      if (!wrong.empty()) return self->Fail(wrong);
      if (++self->received < self->count) self->ReceiveNext();
    });
  }
};

std::shared_ptr<Flow> StartFlow(Connection* from, Connection* to, uint64_t seed, int count, int window,
                                std::function<size_t(int)> size_of, bool zero_copy = false) {
  auto flow = std::make_shared<Flow>();
  flow->from = from;
  flow->to = to;
  flow->seed = seed;
  flow->count = count;
  flow->window = window;
  flow->size_of = std::move(size_of);
  flow->zero_copy = zero_copy;
  flow->Start();
  return flow;
}

std::string Progress(const Flow& f) {
  return absl::StrCat("sent ", f.sends_done, "/", f.count, ", received ", f.received, "/", f.count,
                      f.failure.empty() ? "" : ", failure: ", f.failure);
}

// A completion slot: set once, read by the test thread.
template <typename T>
struct Result {
  std::optional<T> value;
  bool inline_call = false;  // The handler ran before its initiating call returned.
  bool has_value() const { return value.has_value(); }
};

}  // namespace

// ---- fixture ---------------------------------------------------------------------

std::string TransportName(const ::testing::TestParamInfo<TransportUnderTest>& info) { return info.param.name; }

void PrintTo(const TransportUnderTest& transport, std::ostream* os) {
  *os << transport.name << " (max_message_size " << transport.max_message_size << ")";
}

void TransportConformance::SetUp() {
  work_ = std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(io_.get_executor());
  auto listener = GetParam().listen(io_.get_executor());
  ASSERT_TRUE(listener.ok()) << listener.status();
  listener_ = std::move(*listener);
}

void TransportConformance::TearDown() {
  for (auto& c : connections_) c->Close();
  if (listener_) listener_->Close();
  // Let the CANCELLED/UNAVAILABLE completions run while everything is alive;
  // the contract asks for that before a connection is destroyed.
  RunFor(std::chrono::milliseconds(20));
  connections_.clear();
  listener_.reset();
  work_.reset();
  io_.restart();
  io_.run_for(std::chrono::seconds(5));
}

bool TransportConformance::RunUntil(const std::function<bool()>& done, Clock::duration limit) {
  const auto deadline = Clock::now() + limit;
  io_.restart();
  while (!done()) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    io_.run_one_for(std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100)));
  }
  return true;
}

absl::StatusOr<TransportConformance::Pair> TransportConformance::ConnectPair() {
  auto accepted = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  auto connected = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  listener_->Accept([accepted](absl::StatusOr<std::unique_ptr<Connection>> c) { accepted->value.emplace(std::move(c)); });
  GetParam().connect(io_.get_executor(), listener_->local_uri(),
                     [connected](absl::StatusOr<std::unique_ptr<Connection>> c) { connected->value.emplace(std::move(c)); });
  const bool finished = RunUntil([&] {
    return connected->has_value() && (accepted->has_value() || !connected->value->ok());
  });
  if (!finished) {
    return absl::DeadlineExceededError(absl::StrCat("connect to ", listener_->local_uri(), ": connect ",
                                                    connected->has_value() ? "done" : "pending", ", accept ",
                                                    accepted->has_value() ? "done" : "pending"));
  }
  if (!connected->value->ok()) return connected->value->status();
  if (!accepted->value->ok()) return accepted->value->status();
  Pair pair{connected->value->value().get(), accepted->value->value().get()};
  connections_.push_back(std::move(**connected->value));
  connections_.push_back(std::move(**accepted->value));
  return pair;
}

std::unique_ptr<Connection> TransportConformance::TakeConnection(Connection* connection) {
  auto it = std::find_if(connections_.begin(), connections_.end(),
                         [connection](const std::unique_ptr<Connection>& c) { return c.get() == connection; });
  if (it == connections_.end()) return nullptr;
  std::unique_ptr<Connection> taken = std::move(*it);
  connections_.erase(it);
  return taken;
}

TransportConformance::AuthOutcome TransportConformance::ConnectWithTokens(const std::string& server_token,
                                                                         const std::string& client_token) {
  AuthOutcome out;
  auto listener = GetParam().listen_with_token(io_.get_executor(), server_token);
  if (!listener.ok()) {
    out.accept = out.connect = listener.status();
    return out;
  }
  if (listener_) listener_->Close();
  listener_ = std::move(*listener);
  auto accepted = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  auto connected = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  listener_->Accept([accepted](absl::StatusOr<std::unique_ptr<Connection>> c) { accepted->value.emplace(std::move(c)); });
  GetParam().connect_with_token(io_.get_executor(), listener_->local_uri(), client_token,
                                [connected](absl::StatusOr<std::unique_ptr<Connection>> c) {
                                  connected->value.emplace(std::move(c));
                                });
  if (!RunUntil([&] { return connected->has_value() && accepted->has_value(); })) {
    out.connect = connected->has_value() ? connected->value->status() : absl::DeadlineExceededError("connect pending");
    out.accept = accepted->has_value() ? accepted->value->status() : absl::DeadlineExceededError("accept pending");
    return out;
  }
  out.connect = connected->value->status();
  out.accept = accepted->value->status();
  if (out.connect.ok() && out.accept.ok()) {
    out.pair = Pair{connected->value->value().get(), accepted->value->value().get()};
    connections_.push_back(std::move(**connected->value));
    connections_.push_back(std::move(**accepted->value));
  } else {
    // The side that did connect is closed with the fixture.
    if (out.connect.ok()) connections_.push_back(std::move(**connected->value));
    if (out.accept.ok()) connections_.push_back(std::move(**accepted->value));
  }
  return out;
}

absl::Status TransportConformance::SendAndWait(Connection& connection, std::span<const std::byte> bytes) {
  auto result = std::make_shared<Result<absl::Status>>();
  connection.async_send(bytes, [result](absl::Status s) { result->value.emplace(std::move(s)); });
  if (!RunUntil([&] { return result->has_value(); })) return absl::DeadlineExceededError("send did not complete");
  return *result->value;
}

absl::StatusOr<Message> TransportConformance::ReceiveAndWait(Connection& connection) {
  auto result = std::make_shared<Result<absl::StatusOr<Message>>>();
  connection.async_receive([result](absl::StatusOr<Message> m) { result->value.emplace(std::move(m)); });
  if (!RunUntil([&] { return result->has_value(); })) return absl::DeadlineExceededError("receive did not complete");
  return std::move(*result->value);
}

void TransportConformance::ExpectWorks(const Pair& pair, uint64_t seed) {
  auto there = StartFlow(pair.client, pair.server, seed, 3, 3, [](int i) { return size_t{100} + i; });
  auto back = StartFlow(pair.server, pair.client, seed + 1, 3, 3, [](int i) { return size_t{200} + i; });
  ASSERT_TRUE(RunUntil([&] { return there->done() && back->done(); }))
      << "there: " << Progress(*there) << "; back: " << Progress(*back);
  EXPECT_EQ(there->failure, "");
  EXPECT_EQ(back->failure, "");
}

// ---- 1. integrity ----------------------------------------------------------------

// Every size class boundary a backend might have (cache line, page, eager vs
// rendezvous), both directions at once, checked by content.
TEST_P(TransportConformance, IntegrityBothDirectionsAcrossSizes) {
  std::vector<size_t> sizes;
  for (size_t s : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4095}, size_t{4096},
                   size_t{4097}, size_t{65536}, size_t{1} << 20, size_t{16} << 20}) {
    if (s <= GetParam().max_message_size) sizes.push_back(s);
  }
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  const int n = static_cast<int>(sizes.size());
  auto size_of = [sizes](int i) { return sizes[static_cast<size_t>(i)]; };
  auto there = StartFlow(pair->client, pair->server, 11, n, 2, size_of);
  auto back = StartFlow(pair->server, pair->client, 12, n, 2, size_of);
  ASSERT_TRUE(RunUntil([&] { return there->done() && back->done(); }))
      << "client->server: " << Progress(*there) << "; server->client: " << Progress(*back);
  EXPECT_EQ(there->failure, "");
  EXPECT_EQ(back->failure, "");
}

// ---- 2. order ----------------------------------------------------------------------

TEST_P(TransportConformance, TenThousandMessagesArriveInOrderExactlyOnce) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  constexpr int kCount = 10'000;
  // Sizes vary so that a backend that batches or splits frames is exercised.
  auto flow = StartFlow(pair->client, pair->server, 21, kCount, 64,
                        [](int i) { return size_t{8} + static_cast<size_t>(i * 37 % 300); });
  ASSERT_TRUE(RunUntil([&] { return flow->done(); })) << Progress(*flow);
  ASSERT_EQ(flow->failure, "");
  // Exactly once: the next thing to arrive is a fresh marker, not a duplicate.
  const std::vector<std::byte> marker = Payload(22, 0, 24);
  ASSERT_TRUE(SendAndWait(*pair->client, marker).ok());
  auto next = ReceiveAndWait(*pair->server);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(CheckPayload(next->data(), 22, 0, 24), "");
}

// Sends queued behind a large message (one the socket or the QP does not
// take at once) all leave when it is through, with no later Send() to push
// them: a backend that writes its queue in batches must not stop after one
// (tcp wrote 64 and left the rest for the next Send()).
TEST_P(TransportConformance, BurstQueuedBehindALargeMessageLeavesWithoutAnotherSend) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  constexpr int kSmall = 300;
  const size_t big = std::min<size_t>(GetParam().max_message_size, size_t{4} << 20);
  auto size_of = [big](int i) { return i == 0 ? big : size_t{16} + static_cast<size_t>(i % 50); };
  // As many as Prepare() gives room for at once (all of them over TCP; a
  // backend with a fixed number of send slots refuses the rest).
  int sent = 0, send_done = 0, send_failed = 0;
  for (int i = 0; i <= kSmall; ++i) {
    auto buffer = pair->client->Prepare(size_of(i));
    if (!buffer.ok()) {
      ASSERT_EQ(buffer.status().code(), absl::StatusCode::kResourceExhausted) << buffer.status();
      break;
    }
    FillPayload(41, static_cast<uint64_t>(i), buffer->data());
    pair->client->async_send(std::move(*buffer), [&](absl::Status st) {
      ++send_done;
      if (!st.ok()) ++send_failed;
    });
    ++sent;
  }
  ASSERT_GT(sent, 16) << "the backend took almost nothing behind the large message";
  for (int i = 0; i < sent; ++i) {
    auto m = ReceiveAndWait(*pair->server);
    ASSERT_TRUE(m.ok()) << "message " << i << " of " << sent << ": " << m.status();
    ASSERT_EQ(CheckPayload(m->data(), 41, static_cast<uint64_t>(i), size_of(i)), "") << "message " << i;
  }
  ASSERT_TRUE(RunUntil([&] { return send_done == sent; })) << send_done << " of " << sent << " sends completed";
  EXPECT_EQ(send_failed, 0);
}

// ---- 3. executors --------------------------------------------------------------------

TEST_P(TransportConformance, HandlersRunOnTheirAssociatedExecutorNeverInline) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;

  // (a) Default: the connection's executor (io_ here), after the call returned.
  // A message is already waiting, the case most tempting to complete inline.
  ASSERT_TRUE(SendAndWait(client, Payload(31, 0, 10)).ok());
  RunFor(std::chrono::milliseconds(50));
  {
    auto r = std::make_shared<Result<bool>>();
    auto returned = std::make_shared<bool>(false);
    server.async_receive([r, returned, ex = io_.get_executor()](absl::StatusOr<Message> m) {
      r->inline_call = !*returned;
      r->value = m.ok() && ex.running_in_this_thread();
    });
    *returned = true;
    ASSERT_TRUE(RunUntil([&] { return r->has_value(); }));
    EXPECT_FALSE(r->inline_call) << "Receive() ran its handler inline";
    EXPECT_TRUE(*r->value);
  }

  // (b) A strand: the handler runs inside it.
  auto strand = asio::make_strand(io_);
  {
    auto sent = std::make_shared<Result<bool>>();
    auto got = std::make_shared<Result<bool>>();
    auto returned = std::make_shared<bool>(false);
    server.async_receive(asio::bind_executor(strand, [got, returned, strand](absl::StatusOr<Message> m) {
      got->inline_call = !*returned;
      got->value = m.ok() && strand.running_in_this_thread();
    }));
    std::vector<std::byte> bytes = Payload(31, 1, 10);
    client.async_send(std::span<const std::byte>(bytes),
                      asio::bind_executor(strand, [sent, returned, strand](absl::Status s) {
                        sent->inline_call = !*returned;
                        sent->value = s.ok() && strand.running_in_this_thread();
                      }));
    *returned = true;
    ASSERT_TRUE(RunUntil([&] { return sent->has_value() && got->has_value(); }));
    EXPECT_FALSE(sent->inline_call);
    EXPECT_FALSE(got->inline_call);
    EXPECT_TRUE(*sent->value) << "send handler not on its strand (or failed)";
    EXPECT_TRUE(*got->value) << "receive handler not on its strand (or failed)";
  }

  // (c) Another io_context run by another thread: the handler runs there,
  // for a receive, a send, and a send that fails before touching the wire.
  asio::io_context other;
  auto other_work = asio::make_work_guard(other);
  std::thread other_thread([&] { other.run(); });
  const std::thread::id other_id = other_thread.get_id();
  std::atomic<int> on_other{0}, elsewhere{0};
  auto check = [&] {
    const bool ok = other.get_executor().running_in_this_thread() && std::this_thread::get_id() == other_id;
    (ok ? on_other : elsewhere).fetch_add(1);
  };
  int expected = 2;
  server.async_receive(asio::bind_executor(other, [&check](absl::StatusOr<Message>) { check(); }));
  std::vector<std::byte> bytes = Payload(31, 2, 10);
  client.async_send(std::span<const std::byte>(bytes), asio::bind_executor(other, [&check](absl::Status) { check(); }));
  const bool try_oversized = GetParam().max_message_size < kLargestMessageToMaterialise;
  if (try_oversized) {
    ++expected;
    std::vector<std::byte> too_big(GetParam().max_message_size + 1);
    client.async_send(std::span<const std::byte>(too_big), asio::bind_executor(other, [&check](absl::Status) { check(); }));
  }
  const bool all_ran = RunUntil([&] { return on_other.load() + elsewhere.load() == expected; });
  if (!all_ran) {
    // Complete whatever is stuck while `other` still exists to run it.
    client.Close();
    server.Close();
    RunFor(std::chrono::milliseconds(200));
  }
  other_work.reset();
  other_thread.join();
  ASSERT_TRUE(all_ran) << "handlers bound to another io_context did not all run";
  EXPECT_EQ(on_other.load(), expected);
  EXPECT_EQ(elsewhere.load(), 0);

  // (d) An error completion is not inline either.
  if (try_oversized) {
    auto r = std::make_shared<Result<bool>>();
    auto returned = std::make_shared<bool>(false);
    std::vector<std::byte> too_big(GetParam().max_message_size + 1);
    client.async_send(std::span<const std::byte>(too_big), [r, returned](absl::Status s) {
      r->inline_call = !*returned;
      r->value = !s.ok();
    });
    *returned = true;
    ASSERT_TRUE(RunUntil([&] { return r->has_value(); }));
    EXPECT_FALSE(r->inline_call) << "a failing Send() ran its handler inline";
    EXPECT_TRUE(*r->value);
  }

  // (e) A Send() made inside a receive handler (an RPC server answering): the
  // transport may finish the write at once (TCP writes with sendmsg() there),
  // but the send handler still runs after Send() returned, and runs once.
  {
    auto sent = std::make_shared<Result<bool>>();
    auto sent_runs = std::make_shared<int>(0);
    auto echoed = std::make_shared<Result<bool>>();
    server.async_receive([&server, sent, sent_runs](absl::StatusOr<Message> m) {
      ASSERT_TRUE(m.ok()) << m.status();
      std::vector<std::byte> answer(m->data().begin(), m->data().end());
      auto returned = std::make_shared<bool>(false);
      server.async_send(std::span<const std::byte>(answer), [sent, sent_runs, returned](absl::Status s) {
        sent->inline_call = !*returned;
        sent->value = s.ok();
        ++*sent_runs;
      });
      *returned = true;
    });
    client.async_receive([echoed](absl::StatusOr<Message> m) {
      echoed->value = m.ok() && m->size() == 77 && std::to_integer<uint8_t>(m->data()[76]) == 76;
    });
    std::vector<std::byte> request(77);
    for (size_t i = 0; i < request.size(); ++i) request[i] = std::byte(static_cast<uint8_t>(i));
    client.async_send(std::span<const std::byte>(request), [](absl::Status) {});
    ASSERT_TRUE(RunUntil([&] { return sent->has_value() && echoed->has_value(); }));
    RunFor(std::chrono::milliseconds(20));
    EXPECT_FALSE(sent->inline_call) << "a Send() from a receive handler ran its handler inside Send()";
    EXPECT_TRUE(*sent->value);
    EXPECT_EQ(*sent_runs, 1);
    EXPECT_TRUE(*echoed->value) << "the echo did not arrive intact";
  }
  ExpectWorks(*pair, 32);
}

// ---- 3b. message sink -----------------------------------------------------------------

namespace {

// Records what a MessageSink is given; optionally answers or closes from inside.
struct RecordingSink final : transport::MessageSink {
  std::vector<std::vector<std::byte>> messages;
  std::vector<absl::Status> errors;
  bool set_returned = false;
  bool called_before_set_returned = false;
  bool after_error = false;  // a message came after the error
  std::function<void(transport::Message&)> on_message;
  size_t sends_completed = 0;  // OnSendsCompleted() counts
  std::function<void()> on_sends_completed;
  void OnSendsCompleted(size_t count) override {
    sends_completed += count;
    if (on_sends_completed) on_sends_completed();
  }
  void OnMessage(transport::Message message) override {
    called_before_set_returned |= !set_returned;
    after_error |= !errors.empty();
    messages.emplace_back(message.data().begin(), message.data().end());
    if (on_message) on_message(message);
  }
  void OnConnectionError(absl::Status status) override {
    called_before_set_returned |= !set_returned;
    errors.push_back(std::move(status));
  }
};

}  // namespace

TEST_P(TransportConformance, SinkGetsEveryMessageInOrderOnceIncludingThoseBeforeIt) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  // Some messages arrive before the sink is set; they must come first.
  constexpr int kEarly = 5, kLate = 300;
  for (int i = 0; i < kEarly; ++i) ASSERT_TRUE(SendAndWait(client, Payload(41, i, 10 + i)).ok());
  RunFor(std::chrono::milliseconds(50));
  RecordingSink sink;
  ASSERT_TRUE(server.SetSink(&sink)) << "backend has no MessageSink";
  sink.set_returned = true;
  // Receive() is refused from now on, clearly.
  auto refused = std::make_shared<std::optional<absl::Status>>();
  server.async_receive([refused](absl::StatusOr<Message> m) { *refused = m.status(); });
  // The rest while the sink runs, one send after another (a backend may
  // refuse sends beyond its slots), sizes across the eager limit.
  auto sends_done = std::make_shared<int>(0);
  const size_t large = std::min<size_t>(100'000, GetParam().max_message_size);
  auto size_of = [large](int i) {
    return i < kEarly ? size_t(10 + i) : i % 50 == 0 ? large : size_t{1} + static_cast<size_t>(i * 13 % 500);
  };
  std::function<void(int)> send_from = [&](int i) {
    if (i == kEarly + kLate) return;
    std::vector<std::byte> bytes = Payload(41, i, size_of(i));
    client.async_send(std::span<const std::byte>(bytes), [&, i](absl::Status st) {
      EXPECT_TRUE(st.ok()) << st;
      ++*sends_done;
      send_from(i + 1);
    });
  };
  send_from(kEarly);
  ASSERT_TRUE(RunUntil([&] { return sink.messages.size() >= size_t{kEarly + kLate} && refused->has_value(); }))
      << sink.messages.size() << " messages";
  RunFor(std::chrono::milliseconds(50));  // nothing more may come
  ASSERT_EQ(sink.messages.size(), size_t{kEarly + kLate}) << "duplicates";
  for (int i = 0; i < kEarly + kLate; ++i)
    ASSERT_EQ(CheckPayload(sink.messages[i], 41, i, size_of(i)), "") << "message " << i;
  EXPECT_FALSE(sink.called_before_set_returned) << "SetSink() delivered inside the call";
  EXPECT_TRUE(sink.errors.empty());
  EXPECT_EQ((*refused)->code(), absl::StatusCode::kFailedPrecondition) << **refused;
  EXPECT_EQ(*sends_done, kLate);
  EXPECT_FALSE(server.SetSink(&sink)) << "a second sink was accepted";
}

// SendUntracked(): no handler; the sink hears how many completed, never
// inside the call, and gets more send space that way (a backend that refuses
// Prepare() while its slots are busy).
TEST_P(TransportConformance, UntrackedSendsAreCountedToTheSinkAndArriveIntact) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  RecordingSink sink;
  ASSERT_TRUE(client.SetSink(&sink)) << "backend has no MessageSink";
  sink.set_returned = true;
  constexpr int kCount = 500;
  const size_t large = std::min<size_t>(200'000, GetParam().max_message_size);
  auto size_of = [large](int i) { return i % 100 == 7 ? large : static_cast<size_t>(i * 29 % 700); };
  int next = 0;
  bool in_send = false, completed_inside = false;
  // Sends what Prepare() has room for; the rest when the sink hears of completions.
  auto send_more = [&] {
    while (next < kCount) {
      auto buffer = client.Prepare(size_of(next));
      if (!buffer.ok()) {
        ASSERT_EQ(buffer.status().code(), absl::StatusCode::kResourceExhausted) << buffer.status();
        return;
      }
      FillPayload(51, static_cast<uint64_t>(next), buffer->data());
      in_send = true;
      client.SendUntracked(std::move(*buffer));
      in_send = false;
      ++next;
    }
  };
  sink.on_sends_completed = [&] {
    completed_inside |= in_send;
    send_more();
  };
  send_more();
  for (int i = 0; i < kCount; ++i) {
    auto m = ReceiveAndWait(*pair->server);
    ASSERT_TRUE(m.ok()) << "message " << i << ": " << m.status() << " (" << next << " sent)";
    ASSERT_EQ(CheckPayload(m->data(), 51, static_cast<uint64_t>(i), size_of(i)), "") << "message " << i;
  }
  ASSERT_TRUE(RunUntil([&] { return sink.sends_completed >= size_t{kCount}; })) << sink.sends_completed;
  RunFor(std::chrono::milliseconds(20));
  EXPECT_EQ(sink.sends_completed, size_t{kCount});
  EXPECT_FALSE(completed_inside) << "OnSendsCompleted() ran inside SendUntracked()";
  EXPECT_TRUE(sink.errors.empty());
  EXPECT_EQ(client.stats().messages_sent, uint64_t{kCount});
}

TEST_P(TransportConformance, SinkAnswersFromInsideAndHearsThePeerLeaveOnce) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  RecordingSink sink;
  auto answered = std::make_shared<int>(0);
  auto inline_send = std::make_shared<bool>(false);
  // An echo server: Send() from inside OnMessage, as an RPC server answers.
  sink.on_message = [&server, answered, inline_send](transport::Message& m) {
    std::vector<std::byte> copy(m.data().begin(), m.data().end());
    auto returned = std::make_shared<bool>(false);
    server.async_send(std::span<const std::byte>(copy), [answered, inline_send, returned](absl::Status st) {
      *inline_send |= !*returned;
      if (st.ok()) ++*answered;
    });
    *returned = true;
  };
  ASSERT_TRUE(server.SetSink(&sink));
  sink.set_returned = true;
  constexpr int kRounds = 200;
  int echoed = 0;
  std::string failure;
  std::function<void(int)> round = [&](int i) {
    if (i == kRounds) return;
    std::vector<std::byte> bytes = Payload(43, i, 32 + i);
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
    client.async_receive([&, i](absl::StatusOr<Message> m) {
      if (!m.ok()) {
        failure = m.status().ToString();
        return;
      }
      if (auto bad = CheckPayload(m->data(), 43, i, 32 + i); !bad.empty() && failure.empty()) failure = bad;
      ++echoed;
      round(i + 1);
    });
  };
  round(0);
  ASSERT_TRUE(RunUntil([&] { return echoed == kRounds || !failure.empty(); })) << echoed << " echoed";
  ASSERT_EQ(failure, "");
  ASSERT_TRUE(RunUntil([&] { return *answered == kRounds; }));
  EXPECT_FALSE(*inline_send) << "a send handler ran inside Send() from the sink";
  // The peer leaves: one error, nothing after it.
  client.Close();
  ASSERT_TRUE(RunUntil([&] { return !sink.errors.empty(); })) << "the sink never heard the peer leave";
  RunFor(std::chrono::milliseconds(100));
  ASSERT_EQ(sink.errors.size(), 1u);
  EXPECT_FALSE(sink.errors[0].ok());
  EXPECT_FALSE(sink.after_error);
  EXPECT_FALSE(sink.called_before_set_returned);
}

TEST_P(TransportConformance, SinkThatClosesTheConnectionHearsNothingMore) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  RecordingSink sink;
  // Closes at the third message while more are queued behind it.
  sink.on_message = [&server, &sink](transport::Message&) {
    if (sink.messages.size() == 3) server.Close();
  };
  ASSERT_TRUE(server.SetSink(&sink));
  sink.set_returned = true;
  for (int i = 0; i < 20; ++i) {
    std::vector<std::byte> bytes = Payload(44, i, 16);
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
  }
  ASSERT_TRUE(RunUntil([&] { return sink.messages.size() >= 3; }));
  RunFor(std::chrono::milliseconds(200));
  EXPECT_EQ(sink.messages.size(), 3u) << "messages after Close() from inside the sink";
  EXPECT_TRUE(sink.errors.empty()) << "OnConnectionError after the consumer's own Close(): " << sink.errors[0];
}

// A consumer may destroy its connection from inside the sink, while more
// messages of the same arrival wait behind the one in hand (a server dropping
// a peer that broke its protocol). Nothing more reaches the sink, no error
// either, the destroyed connection is not touched again (the sanitizer build
// runs this), and the peer hears it leave.
TEST_P(TransportConformance, SinkThatDestroysItsConnectionHearsNothingMoreAndThePeerHearsItLeave) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  std::unique_ptr<Connection> server = TakeConnection(pair->server);
  ASSERT_NE(server, nullptr);
  RecordingSink sink;
  sink.on_message = [&server, &sink](transport::Message& m) {
    if (sink.messages.size() != 3) return;
    m.Reset();  // messages go back before their connection does
    server.reset();
  };
  ASSERT_TRUE(server->SetSink(&sink));
  sink.set_returned = true;
  for (int i = 0; i < 20; ++i) {
    std::vector<std::byte> bytes = Payload(45, i, 16);
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
  }
  ASSERT_TRUE(RunUntil([&] { return server == nullptr; })) << sink.messages.size() << " messages";
  auto gone = ReceiveAndWait(client);
  EXPECT_FALSE(gone.ok()) << "the peer of a destroyed connection received a message";
  EXPECT_NE(gone.status().code(), absl::StatusCode::kDeadlineExceeded) << "the peer never heard it leave";
  RunFor(std::chrono::milliseconds(100));
  EXPECT_EQ(sink.messages.size(), 3u) << "messages after the connection was destroyed from inside the sink";
  EXPECT_TRUE(sink.errors.empty()) << "OnConnectionError after the consumer destroyed its connection";
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(CheckPayload(sink.messages[i], 45, static_cast<uint64_t>(i), 16), "") << "message " << i;
}

// The same from a receive handler, with two more receives waiting behind it:
// each completes once, after the handler returned, with the next message in
// order if it had one already or else an error; the peer hears it leave.
TEST_P(TransportConformance, ReceiveHandlerThatDestroysItsConnectionLeavesTheOtherReceivesFailedOnce) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  std::unique_ptr<Connection> server = TakeConnection(pair->server);
  ASSERT_NE(server, nullptr);
  std::vector<absl::Status> results;
  std::vector<std::string> payload_errors;
  bool in_first = false, ran_inside_first = false;
  server->async_receive([&](absl::StatusOr<Message> m) {
    results.push_back(m.status());
    if (m.ok()) {
      payload_errors.push_back(CheckPayload(m->data(), 46, 0, 24));
      m->Reset();
    }
    in_first = true;
    server.reset();
    in_first = false;
  });
  for (int i = 0; i < 2; ++i)
    server->async_receive([&](absl::StatusOr<Message> m) {
      ran_inside_first |= in_first;
      if (m.ok()) payload_errors.push_back(CheckPayload(m->data(), 46, results.size(), 24));
      results.push_back(m.status());
    });
  for (int i = 0; i < 5; ++i) {
    std::vector<std::byte> bytes = Payload(46, i, 24);
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
  }
  ASSERT_TRUE(RunUntil([&] { return results.size() >= 3; })) << results.size() << " receives completed";
  RunFor(std::chrono::milliseconds(100));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok()) << results[0];
  // Once one has failed, none after it succeeds.
  EXPECT_FALSE(!results[1].ok() && results[2].ok()) << results[1] << " then " << results[2];
  for (const std::string& e : payload_errors) EXPECT_EQ(e, "");
  EXPECT_FALSE(ran_inside_first) << "a receive completed inside the handler that destroyed its connection";
  auto gone = ReceiveAndWait(client);
  EXPECT_FALSE(gone.ok());
  EXPECT_NE(gone.status().code(), absl::StatusCode::kDeadlineExceeded) << "the peer never heard it leave";
}

// ---- 3c. handlers that throw --------------------------------------------------------

namespace {

struct Thrown : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

// Runs until `done`, as RunUntil, catching Thrown out of the io_context as an
// application that runs it again would; returns how many times it caught one
// (-1 on timeout).
int TransportConformance::RunCatching(const std::function<bool()>& done) {
  int caught = 0;
  for (;;) {
    try {
      return RunUntil(done) ? caught : -1;
    } catch (const Thrown&) {
      ++caught;
    }
  }
}

// Asio lets an exception out of a handler through run(), and the io_context
// may be run again. A connection whose sink threw goes on as if the sink had
// returned: the message it threw on counts as delivered, the ones queued
// behind it and later ones arrive in order, once each, and it still sends.
// It throws on a message that arrived before it was set (a backend may hand
// those over its own way), on a large one (the same) and on a small one.
TEST_P(TransportConformance, SinkThatThrowsLeavesItsConnectionWorking) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  RecordingSink sink;
  constexpr int kEarly = 4, kBurst = 10, kAll = 20;  // sent before SetSink, then with it, then after
  constexpr int kEarlyThrow = 1, kLargeThrow = 5, kSmallThrow = 7;
  sink.on_message = [&sink](transport::Message&) {
    const size_t i = sink.messages.size() - 1;
    if (i == kEarlyThrow || i == kLargeThrow || i == kSmallThrow) throw Thrown("from the sink");
  };
  const size_t large = std::min<size_t>(100'000, GetParam().max_message_size);
  auto size_of = [large](int i) { return i == kLargeThrow ? large : size_t(16 + i); };
  auto send = [&client, &size_of](int i) {
    std::vector<std::byte> bytes = Payload(45, i, size_of(i));
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
  };
  for (int i = 0; i < kEarly; ++i) send(i);
  RunFor(std::chrono::milliseconds(100));
  ASSERT_TRUE(server.SetSink(&sink));
  sink.set_returned = true;
  for (int i = kEarly; i < kBurst; ++i) send(i);
  EXPECT_EQ(RunCatching([&] { return sink.messages.size() >= size_t{kBurst}; }), 3) << sink.messages.size();
  for (int i = kBurst; i < kAll; ++i) send(i);
  ASSERT_EQ(RunCatching([&] { return sink.messages.size() >= size_t{kAll}; }), 0) << sink.messages.size();
  RunFor(std::chrono::milliseconds(50));  // nothing more may come
  ASSERT_EQ(sink.messages.size(), size_t{kAll}) << "duplicates";
  for (int i = 0; i < kAll; ++i) EXPECT_EQ(CheckPayload(sink.messages[i], 45, i, size_of(i)), "") << "message " << i;
  EXPECT_TRUE(sink.errors.empty()) << sink.errors[0];
  // It still sends, and the client still hears it.
  ASSERT_TRUE(SendAndWait(server, Payload(46, 0, 100)).ok());
  auto back = ReceiveAndWait(client);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(CheckPayload(back->data(), 46, 0, 100), "");
}

// The same for a Receive() handler and a send handler that throw: the
// connection goes on, both ways.
TEST_P(TransportConformance, HandlersThatThrowLeaveTheConnectionWorking) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  // A receive handler throws on the first of two messages sent together.
  auto first = std::make_shared<std::vector<std::byte>>();
  server.async_receive([first](absl::StatusOr<Message> m) {
    if (m.ok()) first->assign(m->data().begin(), m->data().end());
    throw Thrown("from a receive handler");
  });
  for (int i = 0; i < 2; ++i) {
    std::vector<std::byte> bytes = Payload(47, i, 40 + i);
    client.async_send(std::span<const std::byte>(bytes), [](absl::Status) {});
  }
  EXPECT_EQ(RunCatching([&] { return !first->empty(); }), 1);
  EXPECT_EQ(CheckPayload(*first, 47, 0, 40), "");
  auto second = ReceiveAndWait(server);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(CheckPayload(second->data(), 47, 1, 41), "");
  // Of two sends, the first one's handler throws; the second's still runs.
  auto sent = std::make_shared<std::vector<absl::Status>>();
  for (int i = 0; i < 2; ++i) {
    std::vector<std::byte> bytes = Payload(48, i, 64);
    server.async_send(std::span<const std::byte>(bytes), [sent, i](absl::Status st) {
      sent->push_back(st);
      if (i == 0) throw Thrown("from a send handler");
    });
  }
  EXPECT_EQ(RunCatching([&] { return sent->size() == 2; }), 1) << sent->size() << " send handlers ran";
  for (const absl::Status& st : *sent) EXPECT_TRUE(st.ok()) << st;
  for (int i = 0; i < 2; ++i) {
    auto got = ReceiveAndWait(client);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(CheckPayload(got->data(), 48, i, 64), "");
  }
  ExpectWorks(*pair, 49);
}

// A sink may keep the Messages it is given while later ones arrive, and give
// them back in any order: none changes under it. (The TCP backend lends a
// sink small frames straight out of its read buffer; a buffer a kept message
// points into must not be read into or compacted over. Bursts put several
// frames, and frames split across reads, into one buffer; kept messages pin
// more buffers than the backend lends before it copies instead.)
TEST_P(TransportConformance, SinkMayKeepMessagesWhileLaterOnesArrive) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  struct KeepingSink final : transport::MessageSink {
    std::vector<Message> kept;
    std::vector<uint64_t> index;  // kept[i] is message index[i]
    std::vector<absl::Status> errors;
    uint64_t next = 0;
    void OnMessage(Message message) override {
      kept.push_back(std::move(message));
      index.push_back(next++);
    }
    void OnConnectionError(absl::Status status) override { errors.push_back(std::move(status)); }
  } sink;
  ASSERT_TRUE(server.SetSink(&sink)) << "backend has no MessageSink";
  auto size_of = [](uint64_t i) { return size_t{1} + static_cast<size_t>(i * 1009 % 7000); };
  auto check_kept = [&](const char* when) {
    for (size_t k = 0; k < sink.kept.size(); ++k) {
      if (sink.kept[k].size() == 0) continue;  // given back (every size here is >= 1)
      ASSERT_EQ(CheckPayload(sink.kept[k].data(), 95, sink.index[k], size_of(sink.index[k])), "")
          << "kept message " << sink.index[k] << " " << when;
    }
  };
  constexpr int kBurst = 16;
  uint64_t sent = 0;
  for (int round = 0; round < 4; ++round) {
    // A burst, then one message at a time.
    for (int i = 0; i < kBurst; ++i, ++sent) {
      std::vector<std::byte> bytes = Payload(95, sent, size_of(sent));
      client.async_send(std::span<const std::byte>(bytes), [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; });
    }
    ASSERT_TRUE(RunUntil([&] { return sink.next == sent; })) << sink.next << " of " << sent << " arrived";
    for (int i = 0; i < 4; ++i, ++sent) {
      ASSERT_TRUE(SendAndWait(client, Payload(95, sent, size_of(sent))).ok());
      ASSERT_TRUE(RunUntil([&] { return sink.next == sent + 1; })) << "message " << sent;
    }
    check_kept("while later ones arrived");
    // Give back two of every three of this round's, keep the rest.
    for (size_t k = 0; k < sink.kept.size(); ++k)
      if (sink.index[k] + kBurst + 4 >= sent && sink.index[k] % 3 != 0) sink.kept[k].Reset();
  }
  check_kept("after the last round");
  // Back in a scrambled order; the connection still delivers.
  for (size_t k = 0; k < sink.kept.size(); ++k) sink.kept[(k * 7) % sink.kept.size()].Reset();
  ASSERT_TRUE(SendAndWait(client, Payload(95, sent, 300)).ok());
  ASSERT_TRUE(RunUntil([&] { return sink.next == sent + 1; }));
  EXPECT_EQ(CheckPayload(sink.kept.back().data(), 95, sent, 300), "");
  EXPECT_TRUE(sink.errors.empty());
}

// ---- 4. receive cancellation ------------------------------------------------------------

TEST_P(TransportConformance, CancelledReceiveCompletesCancelledAndLosesNothing) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;

  // The plain case: nothing in flight, cancel, then the message sent
  // afterwards goes to the next Receive().
  {
    // The handler keeps its signal alive: Asio requires the signal to outlive
    // the operation, even if this test fails half way.
    auto signal = std::make_shared<asio::cancellation_signal>();
    auto r = std::make_shared<Result<absl::StatusOr<Message>>>();
    server.async_receive(asio::bind_cancellation_slot(
        signal->slot(), [r, signal](absl::StatusOr<Message> m) { r->value.emplace(std::move(m)); }));
    RunFor(std::chrono::milliseconds(20));
    signal->emit(asio::cancellation_type::terminal);
    ASSERT_TRUE(RunUntil([&] { return r->has_value(); }));
    ASSERT_FALSE(r->value->ok()) << "a cancelled Receive() returned a message nobody sent";
    EXPECT_EQ(r->value->status().code(), absl::StatusCode::kCancelled) << r->value->status();
    ASSERT_TRUE(SendAndWait(client, Payload(41, 0, 33)).ok());
    auto next = ReceiveAndWait(server);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(CheckPayload(next->data(), 41, 0, 33), "");
  }

  // Races: cancel at varying points while a message is on its way. Either the
  // Receive() got it, or it completed CANCELLED and the next one gets it.
  int cancelled = 0, delivered = 0;
  const asio::cancellation_type kinds[] = {asio::cancellation_type::terminal, asio::cancellation_type::partial,
                                           asio::cancellation_type::total};
  for (int i = 1; i <= 200; ++i) {
    auto signal = std::make_shared<asio::cancellation_signal>();
    auto r = std::make_shared<Result<absl::StatusOr<Message>>>();
    server.async_receive(asio::bind_cancellation_slot(
        signal->slot(), [r, signal](absl::StatusOr<Message> m) { r->value.emplace(std::move(m)); }));
    auto sent = std::make_shared<Result<absl::Status>>();
    std::vector<std::byte> bytes = Payload(41, static_cast<uint64_t>(i), 40);
    client.async_send(std::span<const std::byte>(bytes), [sent](absl::Status s) { sent->value.emplace(std::move(s)); });
    io_.restart();
    for (int k = 0; k < i % 7; ++k) io_.poll_one();
    signal->emit(kinds[i % 3]);
    ASSERT_TRUE(RunUntil([&] { return r->has_value() && sent->has_value(); })) << "iteration " << i;
    ASSERT_TRUE(sent->value->ok()) << *sent->value;
    if (r->value->ok()) {
      ++delivered;
      ASSERT_EQ(CheckPayload((*r->value)->data(), 41, static_cast<uint64_t>(i), 40), "") << "iteration " << i;
      continue;
    }
    ++cancelled;
    ASSERT_EQ(r->value->status().code(), absl::StatusCode::kCancelled) << r->value->status();
    auto next = ReceiveAndWait(server);
    ASSERT_TRUE(next.ok()) << "iteration " << i << ": " << next.status();
    ASSERT_EQ(CheckPayload(next->data(), 41, static_cast<uint64_t>(i), 40), "")
        << "iteration " << i << ": the message sent around the cancellation was lost or replaced";
  }
  RecordProperty("cancelled", cancelled);
  RecordProperty("delivered", delivered);
  EXPECT_GT(cancelled, 0) << "no iteration exercised the cancelled path";
  ExpectWorks(*pair, 42);
}

// ---- 5. close ----------------------------------------------------------------------------

TEST_P(TransportConformance, CloseCancelsLocallyAndEndsThePeer) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  Connection& client = *pair->client;
  Connection& server = *pair->server;
  ExpectWorks(*pair, 51);

  auto local = std::make_shared<Result<absl::StatusOr<Message>>>();
  auto remote = std::make_shared<Result<absl::StatusOr<Message>>>();
  server.async_receive([local](absl::StatusOr<Message> m) { local->value.emplace(std::move(m)); });
  client.async_receive([remote](absl::StatusOr<Message> m) { remote->value.emplace(std::move(m)); });
  // Sends queued at the moment of Close() must complete too (OK if they
  // already finished, CANCELLED if they were still pending).
  auto sends = std::make_shared<std::vector<absl::Status>>();
  for (int i = 0; i < 8; ++i) {
    std::vector<std::byte> bytes = Payload(52, static_cast<uint64_t>(i), 1000);
    server.async_send(std::span<const std::byte>(bytes), [sends](absl::Status s) { sends->push_back(std::move(s)); });
  }
  server.Close();
  server.Close();  // Idempotent.

  ASSERT_TRUE(RunUntil([&] { return local->has_value() && remote->has_value() && sends->size() == 8; }))
      << "local receive " << (local->has_value() ? "done" : "pending") << ", peer receive "
      << (remote->has_value() ? "done" : "pending") << ", sends done " << sends->size() << "/8";
  ASSERT_FALSE(local->value->ok());
  EXPECT_EQ(local->value->status().code(), absl::StatusCode::kCancelled) << local->value->status();
  for (const absl::Status& s : *sends) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled) << s;
  }
  // The peer may first receive messages that made it out before the close;
  // after those it must see the connection end.
  absl::StatusOr<Message> peer_end = std::move(*remote->value);
  for (int drained = 0; peer_end.ok() && drained < 8; ++drained) peer_end = ReceiveAndWait(client);
  ASSERT_FALSE(peer_end.ok()) << "the peer never saw the connection end";
  EXPECT_EQ(peer_end.status().code(), absl::StatusCode::kUnavailable) << peer_end.status();

  // Later operations fail: on the closed side CANCELLED, on the peer UNAVAILABLE.
  absl::Status after = SendAndWait(server, Payload(53, 0, 10));
  EXPECT_EQ(after.code(), absl::StatusCode::kCancelled) << after;
  auto receive_after = ReceiveAndWait(server);
  ASSERT_FALSE(receive_after.ok());
  EXPECT_EQ(receive_after.status().code(), absl::StatusCode::kCancelled) << receive_after.status();
  absl::Status peer_send = SendAndWait(client, Payload(53, 1, 10));
  EXPECT_EQ(peer_send.code(), absl::StatusCode::kUnavailable) << peer_send;
  auto peer_receive = ReceiveAndWait(client);
  ASSERT_FALSE(peer_receive.ok());
  EXPECT_EQ(peer_receive.status().code(), absl::StatusCode::kUnavailable) << peer_receive.status();
}

// ---- 6. oversized sends --------------------------------------------------------------------

TEST_P(TransportConformance, OversizedSendFailsClearlyAndTheConnectionSurvives) {
  const size_t max = GetParam().max_message_size;
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ(pair->client->max_message_size(), max);
  EXPECT_EQ(pair->server->max_message_size(), max);

  auto prepared = pair->client->Prepare(max + 1);
  ASSERT_FALSE(prepared.ok()) << "Prepare(max_message_size + 1) succeeded";
  EXPECT_TRUE(prepared.status().code() == absl::StatusCode::kInvalidArgument ||
              prepared.status().code() == absl::StatusCode::kResourceExhausted)
      << prepared.status();

  // The copying send path, and a message of exactly the limit, where the
  // limit is small enough to allocate in a test.
  if (max <= kLargestMessageToMaterialise) {
    std::vector<std::byte> too_big(max + 1);
    absl::Status s = SendAndWait(*pair->client, too_big);
    EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kResourceExhausted)
        << s;
    too_big = {};
    auto flow = StartFlow(pair->client, pair->server, 61, 1, 1, [max](int) { return max; });
    ASSERT_TRUE(RunUntil([&] { return flow->done(); })) << Progress(*flow);
    EXPECT_EQ(flow->failure, "");
  }
  ExpectWorks(*pair, 62);
}

// ---- 7. isolation ---------------------------------------------------------------------------

TEST_P(TransportConformance, ClosingOneConnectionLeavesAnotherAlone) {
  auto a = ConnectPair();
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = ConnectPair();
  ASSERT_TRUE(b.ok()) << b.status();
  // Traffic on b is in flight while a goes away.
  auto there = StartFlow(b->client, b->server, 71, 500, 16, [](int i) { return size_t{1} + i % 2000; });
  auto back = StartFlow(b->server, b->client, 72, 500, 16, [](int i) { return size_t{3000} - i % 2000; });
  auto a_server = std::make_shared<Result<absl::StatusOr<Message>>>();
  a->server->async_receive([a_server](absl::StatusOr<Message> m) { a_server->value.emplace(std::move(m)); });
  a->client->Close();
  ASSERT_TRUE(RunUntil([&] { return a_server->has_value() && there->done() && back->done(); }))
      << "b there: " << Progress(*there) << "; b back: " << Progress(*back);
  ASSERT_FALSE(a_server->value->ok());
  EXPECT_EQ(a_server->value->status().code(), absl::StatusCode::kUnavailable) << a_server->value->status();
  EXPECT_EQ(there->failure, "");
  EXPECT_EQ(back->failure, "");
  ExpectWorks(*b, 73);
}

// ---- 8. many connections ------------------------------------------------------------------------

TEST_P(TransportConformance, EightConnectionsExchangeInParallel) {
  constexpr int kConnections = 8;
  std::vector<Pair> pairs;
  for (int c = 0; c < kConnections; ++c) {
    auto p = ConnectPair();
    ASSERT_TRUE(p.ok()) << "connection " << c << ": " << p.status();
    pairs.push_back(*p);
  }
  // Busy polling spins a thread per connection end: 16 here. Where they
  // outnumber the cores (the 2-vCPU VM) they share them with the io_context
  // thread that consumes the messages, and 200 messages per flow took over a
  // minute under load. The check is isolation, not throughput: fewer messages.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int messages = GetParam().busy_polling && 2u * kConnections > cores ? 40 : 200;
  std::vector<std::shared_ptr<Flow>> flows;
  for (int c = 0; c < kConnections; ++c) {
    // Distinct seeds: a message crossing to the wrong connection fails its check.
    auto size_of = [c](int i) { return size_t{16} + static_cast<size_t>((i * 131 + c * 17) % 9000); };
    flows.push_back(StartFlow(pairs[c].client, pairs[c].server, 800 + 2 * c, messages, 8, size_of));
    flows.push_back(StartFlow(pairs[c].server, pairs[c].client, 801 + 2 * c, messages, 8, size_of));
  }
  const bool finished =
      RunUntil([&] { return std::all_of(flows.begin(), flows.end(), [](const auto& f) { return f->done(); }); });
  for (size_t f = 0; f < flows.size(); ++f) {
    EXPECT_EQ(flows[f]->failure, "") << "flow " << f;
    EXPECT_TRUE(flows[f]->done()) << "flow " << f << ": " << Progress(*flows[f]);
  }
  ASSERT_TRUE(finished);
}

// ---- 9. held messages ------------------------------------------------------------------------------

TEST_P(TransportConformance, HeldMessagesAreNotOverwrittenByLaterOnes) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  constexpr int kHeld = 16;
  auto size_of = [](int i) { return size_t{100} + static_cast<size_t>(i * 997 % 5000); };
  std::vector<Message> held;
  for (int i = 0; i < 2 * kHeld; ++i) {
    ASSERT_TRUE(SendAndWait(*pair->client, Payload(91, static_cast<uint64_t>(i), size_of(i))).ok());
    auto m = ReceiveAndWait(*pair->server);
    ASSERT_TRUE(m.ok()) << "message " << i << ": " << m.status();
    held.push_back(std::move(*m));
    if (i + 1 == kHeld) {
      // Give back every other one of the first batch, so later messages land
      // in recycled memory right next to held memory.
      for (int j = 0; j < kHeld; j += 2) held[j].Reset();
    }
  }
  for (int i = 0; i < 2 * kHeld; ++i) {
    if (i < kHeld && i % 2 == 0) continue;
    EXPECT_EQ(CheckPayload(held[i].data(), 91, static_cast<uint64_t>(i), size_of(i)), "") << "held message " << i;
  }
  // Release in a scrambled order, then the connection still works.
  for (int i = 0; i < 2 * kHeld; ++i) held[static_cast<size_t>((i * 7) % (2 * kHeld))].Reset();
  ExpectWorks(*pair, 92);
}

// ---- 10. zero-copy sends ------------------------------------------------------------------------------

TEST_P(TransportConformance, PreparedBuffersDeliverWhatWasWrittenIntoThem) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  // Buffers dropped unsent go back without harm.
  for (int i = 0; i < 100; ++i) {
    auto dropped = pair->client->Prepare(static_cast<size_t>(i) * 50);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    ASSERT_EQ(dropped->size(), static_cast<size_t>(i) * 50);
  }
  std::vector<size_t> sizes;
  for (size_t s : {size_t{0}, size_t{1}, size_t{4096}, size_t{100'000}, size_t{1} << 20}) {
    if (s <= GetParam().max_message_size) sizes.push_back(s);
  }
  auto size_of = [sizes](int i) { return sizes[static_cast<size_t>(i) % sizes.size()]; };
  const int n = static_cast<int>(sizes.size()) * 4;
  auto there = StartFlow(pair->client, pair->server, 101, n, 4, size_of, /*zero_copy=*/true);
  auto back = StartFlow(pair->server, pair->client, 102, n, 4, size_of, /*zero_copy=*/true);
  ASSERT_TRUE(RunUntil([&] { return there->done() && back->done(); }))
      << "there: " << Progress(*there) << "; back: " << Progress(*back);
  EXPECT_EQ(there->failure, "");
  EXPECT_EQ(back->failure, "");
}

// ---- stats ------------------------------------------------------------------------------------------------

TEST_P(TransportConformance, StatsCountMessagesAndBytes) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_FALSE(pair->client->peer().empty());
  EXPECT_FALSE(pair->server->peer().empty());
  const transport::ConnectionStats client_before = pair->client->stats();
  const transport::ConnectionStats server_before = pair->server->stats();
  auto size_of = [](int i) { return size_t{1} + static_cast<size_t>(i * 313 % 3000); };
  constexpr int kCount = 50;
  uint64_t bytes = 0;
  for (int i = 0; i < kCount; ++i) bytes += size_of(i);
  auto flow = StartFlow(pair->client, pair->server, 111, kCount, 8, size_of);
  ASSERT_TRUE(RunUntil([&] { return flow->done(); })) << Progress(*flow);
  ASSERT_EQ(flow->failure, "");
  const transport::ConnectionStats c = pair->client->stats();
  const transport::ConnectionStats s = pair->server->stats();
  EXPECT_EQ(c.messages_sent - client_before.messages_sent, uint64_t{kCount});
  EXPECT_EQ(c.bytes_sent - client_before.bytes_sent, bytes);
  EXPECT_EQ(s.messages_received - server_before.messages_received, uint64_t{kCount});
  EXPECT_EQ(s.bytes_received - server_before.bytes_received, bytes);
}

// frames_received is what the RPC keepalive reads as a sign of life
// (rpc/keepalive.h): every arrival bumps it, a large message's too.
TEST_P(TransportConformance, FramesReceivedGrowWithEveryArrival) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  auto frames = [&] { return pair->server->frames_received(); };
  uint64_t last = frames();
  // The large one: rendezvous on RDMA, a body read of its own on TCP.
  const size_t large = std::min<size_t>(size_t{1} << 20, pair->client->max_message_size());
  for (size_t size : {size_t{64}, large, size_t{64}}) {
    auto flow = StartFlow(pair->client, pair->server, 7 + size, 1, 1, [size](int) { return size; });
    ASSERT_TRUE(RunUntil([&] { return flow->done(); })) << Progress(*flow);
    ASSERT_EQ(flow->failure, "");
    EXPECT_GT(frames(), last) << "a " << size << "-byte message arrived uncounted";
    last = frames();
  }
  EXPECT_EQ(pair->server->stats().frames_received, frames());
}

// ---- send batches (Connection::HoldSends, transport::SendBatch) --------------------------------------------

// A burst sent under a SendBatch (nested, as Channel::Batch inside a channel's
// own would be) leaves at the outer batch's end with one doorbell (RDMA: one
// ibv_post_send; TCP: one sendmsg), not one a message, and arrives whole and
// in order; every send completes. A release without a hold changes nothing.
TEST_P(TransportConformance, SendBatchSendsABurstWithOneDoorbell) {
  auto pair = ConnectPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  ExpectWorks(*pair, 131);
  constexpr int kBurst = 8;
  auto size_of = [](int i) { return size_t{16} + static_cast<size_t>(i) * 24; };
  auto completed = std::make_shared<int>(0);
  auto failed = std::make_shared<std::string>();
  auto send = [&](int i) {
    auto buffer = pair->client->Prepare(size_of(i));
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    FillPayload(132, static_cast<uint64_t>(i), buffer->data());
    pair->client->Send(std::move(*buffer), [completed, failed](absl::Status st) {
      ++*completed;
      if (!st.ok()) *failed = st.ToString();
    });
  };
  const uint64_t before = pair->client->stats().send_doorbells;
  {
    transport::SendBatch outer(*pair->client);
    {
      transport::SendBatch inner(*pair->client);
      for (int i = 0; i < kBurst / 2; ++i) send(i);
    }
    EXPECT_EQ(pair->client->stats().send_doorbells, before) << "the inner batch's end sent";
    for (int i = kBurst / 2; i < kBurst; ++i) send(i);
    EXPECT_EQ(pair->client->stats().send_doorbells, before) << "sent before the batch ended";
  }
  EXPECT_EQ(pair->client->stats().send_doorbells - before, uint64_t{1}) << "the burst did not share a doorbell";
  for (int i = 0; i < kBurst; ++i) {
    auto m = ReceiveAndWait(*pair->server);
    ASSERT_TRUE(m.ok()) << "message " << i << ": " << m.status();
    EXPECT_EQ(CheckPayload(m->data(), 132, static_cast<uint64_t>(i), size_of(i)), "") << "message " << i;
  }
  ASSERT_TRUE(RunUntil([&] { return *completed == kBurst; })) << *completed << " of " << kBurst << " sends completed";
  EXPECT_EQ(*failed, "");
  pair->client->ReleaseSends();  // no hold: ignored (a held send below would never complete)
  ExpectWorks(*pair, 134);
}

// ---- authentication (transport/common/auth.h) ---------------------------------------------------------

#define SKIP_WITHOUT_AUTH()                                                        \
  if (!GetParam().listen_with_token || !GetParam().connect_with_token) {           \
    GTEST_SKIP() << "this backend's instantiation does not configure auth tokens"; \
  }

TEST_P(TransportConformance, AuthMatchingTokenConnects) {
  SKIP_WITHOUT_AUTH();
  AuthOutcome o = ConnectWithTokens("correct horse battery staple", "correct horse battery staple");
  ASSERT_TRUE(o.connect.ok()) << o.connect;
  ASSERT_TRUE(o.accept.ok()) << o.accept;
  ExpectWorks(o.pair, 71);
}

TEST_P(TransportConformance, AuthWrongTokenIsRefusedWithTheReasonAndTheListenerGoesOn) {
  SKIP_WITHOUT_AUTH();
  AuthOutcome o = ConnectWithTokens("server-secret", "guessed-secret");
  EXPECT_EQ(o.connect.code(), absl::StatusCode::kUnauthenticated) << o.connect;
  EXPECT_NE(o.connect.message().find("auth token mismatch"), absl::string_view::npos) << o.connect;
  EXPECT_EQ(o.accept.code(), absl::StatusCode::kUnauthenticated) << "the listener reports the refusal: " << o.accept;
  // The same listener still serves a client with the right token.
  auto accepted = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  auto connected = std::make_shared<Result<absl::StatusOr<std::unique_ptr<Connection>>>>();
  listener_->Accept([accepted](absl::StatusOr<std::unique_ptr<Connection>> c) { accepted->value.emplace(std::move(c)); });
  GetParam().connect_with_token(io_.get_executor(), listener_->local_uri(), "server-secret",
                                [connected](absl::StatusOr<std::unique_ptr<Connection>> c) {
                                  connected->value.emplace(std::move(c));
                                });
  ASSERT_TRUE(RunUntil([&] { return connected->has_value() && accepted->has_value(); }));
  ASSERT_TRUE(connected->value->ok()) << connected->value->status();
  ASSERT_TRUE(accepted->value->ok()) << accepted->value->status();
  std::unique_ptr<Connection> client = std::move(**connected->value);
  std::unique_ptr<Connection> server = std::move(**accepted->value);
  ExpectWorks(Pair{client.get(), server.get()}, 72);
  client->Close();
  server->Close();
  RunFor(std::chrono::milliseconds(50));
}

TEST_P(TransportConformance, AuthMissingTokenIsRefused) {
  SKIP_WITHOUT_AUTH();
  AuthOutcome o = ConnectWithTokens("server-secret", "");
  EXPECT_EQ(o.connect.code(), absl::StatusCode::kUnauthenticated) << o.connect;
  EXPECT_NE(o.connect.message().find("server requires an auth token"), absl::string_view::npos) << o.connect;
  EXPECT_EQ(o.accept.code(), absl::StatusCode::kUnauthenticated) << o.accept;
}

// A listener without a token accepts everyone; a client's proof is ignored
// (so clients can be given the token before the servers require it).
TEST_P(TransportConformance, AuthClientTokenIsIgnoredByAListenerWithout) {
  SKIP_WITHOUT_AUTH();
  AuthOutcome o = ConnectWithTokens("", "client-secret");
  ASSERT_TRUE(o.connect.ok()) << o.connect;
  ASSERT_TRUE(o.accept.ok()) << o.accept;
  ExpectWorks(o.pair, 73);
}

}  // namespace rdmarpc::conformance
