// Market-data fanout over every transport: Publisher<Tick> behind the
// example's MarketData service, subscribers on their own connections (one
// process: server thread and client thread; examples/market_data).
#include "examples/market_data/market_data.h"
#include "tests/rpc/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

namespace md = rdmarpc::examples::md;

// On rdma the suite runs with event pollers and with adaptive pollers shared
// by every connection (rpc_rdma_test.cc). Adaptive pollers with a thread per
// QP are not used here: 8 subscribers are 16 spinning threads (both ends in
// this process) on the VM's 2 vCPUs, and 800,000 ticks took over 3 minutes
// against 74 s with event pollers. Shared pollers are the answer to that.

md::LocalRunOptions Base(const RpcTransport& t, int subscribers, uint64_t ticks) {
  md::LocalRunOptions o;
  o.listen_uri = t.listen_uri;
  o.transport = t.options();
  o.subscribers = subscribers;
  o.feed.ticks = ticks;
  o.feed.rate = 0;  // as fast as the subscribers take them
  o.feed.symbols = 10;
  return o;
}

void ExpectEveryTickInOrder(const md::SubscriberResult& s, uint64_t ticks, int index) {
  EXPECT_EQ(s.ticks, ticks) << "subscriber " << index;
  EXPECT_EQ(s.missed, 0u) << "subscriber " << index;
  EXPECT_EQ(s.out_of_order, 0u) << "subscriber " << index;
  EXPECT_EQ(s.first_sequence, 1u) << "subscriber " << index;
  EXPECT_EQ(s.last_sequence, ticks) << "subscriber " << index;
  EXPECT_TRUE(s.status.ok()) << "subscriber " << index << ": " << s.status.ToString();
}

TEST_P(RpcSuite, FanoutEightSubscribersEachGetEveryTickInOrder) {
  constexpr uint64_t kTicks = 100'000;
  auto r = md::RunLocal(Base(GetParam(), 8, kTicks));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.feed.published, kTicks);
  ASSERT_EQ(r.subscribers.size(), 8u);
  for (int i = 0; i < 8; ++i) ExpectEveryTickInOrder(r.subscribers[size_t(i)], kTicks, i);
  // Serialised once per tick, one copy per subscriber.
  EXPECT_EQ(r.publisher.sent, 8 * kTicks);
  EXPECT_EQ(r.publisher.dropped, 0u);
}

// A subscriber that reads nothing until the feed is over: it holds its
// window (8), its queue keeps the newest 16, the rest is dropped for it
// alone; the others get everything and the publisher never waits.
TEST_P(RpcSuite, FanoutDropOldestSparesTheOthersFromAStalledSubscriber) {
  constexpr uint64_t kTicks = 20'000;
  auto o = Base(GetParam(), 4, kTicks);
  md::SubscriberOptions stalled;
  stalled.policy = "drop_oldest";
  stalled.queue_limit = 16;
  stalled.window = 8;
  stalled.stall_until_feed_done = true;
  o.overrides = {stalled};
  o.subscriber.queue_limit = 1'000'000;  // the others never drop (block: and never fall that far behind)
  auto r = md::RunLocal(o);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const auto& s = r.subscribers.at(0);
  EXPECT_EQ(s.ticks, 8u + 16u) << "window + queue";
  EXPECT_EQ(s.first_sequence, 1u);
  EXPECT_EQ(s.last_sequence, kTicks) << "drop_oldest keeps the newest";
  EXPECT_EQ(s.missed, kTicks - 24) << "the gaps are visible in the sequence";
  EXPECT_EQ(s.out_of_order, 0u);
  EXPECT_EQ(r.publisher.dropped, kTicks - 24) << "only the stalled subscriber lost ticks";
  EXPECT_EQ(r.publisher.publishes_blocked, 0u);
  for (int i = 1; i < 4; ++i) ExpectEveryTickInOrder(r.subscribers[size_t(i)], kTicks, i);
}

// Conflate: at most one queued tick per key (10 symbols): after its window,
// the stalled subscriber gets the latest tick of each symbol, in order.
TEST_P(RpcSuite, FanoutConflateKeepsTheLatestTickPerSymbolForAStalledSubscriber) {
  constexpr uint64_t kTicks = 20'000;
  auto o = Base(GetParam(), 3, kTicks);
  md::SubscriberOptions stalled;
  stalled.policy = "conflate";
  stalled.queue_limit = 1024;
  stalled.window = 8;
  stalled.stall_until_feed_done = true;
  o.overrides = {stalled};
  o.subscriber.queue_limit = 1'000'000;
  auto r = md::RunLocal(o);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const auto& s = r.subscribers.at(0);
  EXPECT_EQ(s.ticks, 8u + 10u) << "window + one per symbol";
  EXPECT_EQ(s.last_sequence, kTicks);
  EXPECT_EQ(s.missed, kTicks - 18);
  EXPECT_EQ(s.out_of_order, 0u) << "conflation keeps the sequence order";
  EXPECT_EQ(r.publisher.dropped, kTicks - 18);
  for (int i = 1; i < 3; ++i) ExpectEveryTickInOrder(r.subscribers[size_t(i)], kTicks, i);
}

// Block: a subscriber that stalls for a while holds the publisher back (its
// queue stays at its limit, nothing grows), then everyone gets everything.
TEST_P(RpcSuite, FanoutBlockBackpressuresThePublisherWithBoundedMemory) {
  constexpr uint64_t kTicks = 5'000;
  auto o = Base(GetParam(), 3, kTicks);
  o.subscriber.queue_limit = 64;
  o.subscriber.window = 8;
  md::SubscriberOptions stalled = o.subscriber;
  stalled.stall = std::chrono::milliseconds(500);
  o.overrides = {stalled};
  auto r = md::RunLocal(o);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_GE(r.publisher.publishes_blocked, 1u) << "the publisher never waited for the stalled subscriber";
  EXPECT_LE(r.publisher.max_queued, 64u) << "a blocking subscriber's queue grew past its limit";
  EXPECT_EQ(r.publisher.dropped, 0u);
  for (int i = 0; i < 3; ++i) ExpectEveryTickInOrder(r.subscribers[size_t(i)], kTicks, i);
}

// One subscriber leaves after 1,000 ticks: the publisher drops it and goes on.
TEST_P(RpcSuite, FanoutASubscriberThatLeavesIsDroppedAndTheRestGoOn) {
  constexpr uint64_t kTicks = 20'000;
  auto o = Base(GetParam(), 4, kTicks);
  o.subscriber.queue_limit = 64;
  md::SubscriberOptions leaver = o.subscriber;
  leaver.stop_after = 1'000;
  o.overrides = {leaver};
  auto r = md::RunLocal(o);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.subscribers.at(0).ticks, 1'000u);
  EXPECT_EQ(r.subscribers.at(0).status.code(), StatusCode::kCancelled);
  EXPECT_EQ(r.feed.published, kTicks) << "the publisher stalled on the subscriber that left";
  EXPECT_EQ(r.publisher.subscribed, 4u);
  for (int i = 1; i < 4; ++i) ExpectEveryTickInOrder(r.subscribers[size_t(i)], kTicks, i);
}

}  // namespace
}  // namespace rdmarpc::testing
