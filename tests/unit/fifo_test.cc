// transport::Fifo (transport/common/fifo.h), the queue under the transports'
// hot paths: first in, first out across wrap-around and growth, against
// std::deque as the model; elements only move-constructed, never assigned.
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <random>

#include "transport/common/fifo.h"

namespace rdmarpc::transport {
namespace {

// Move-only and not move-assignable, as any_completion_handler must be
// treated (fifo.h); owns heap memory so a lost or doubled element shows
// under the sanitizers too.
struct Item {
  explicit Item(int v) : value(std::make_unique<int>(v)) {}
  Item(Item&&) noexcept = default;
  Item& operator=(Item&&) = delete;
  std::unique_ptr<int> value;
};

TEST(Fifo, KeepsOrderAcrossWrapAroundAndGrowth) {
  Fifo<Item> fifo;
  std::deque<int> model;
  std::mt19937 rng(7);
  int next = 0;
  for (int step = 0; step < 200000; ++step) {
    // Phases that grow, hover (the index wraps again and again at one
    // capacity) and drain.
    const int phase = (step / 5000) % 3;
    const unsigned push_odds = phase == 0 ? 70 : phase == 1 ? 50 : 30;
    if (model.empty() || rng() % 100 < push_odds) {
      fifo.push_back(Item(next));
      model.push_back(next++);
    } else {
      ASSERT_EQ(*fifo.front().value, model.front()) << "step " << step;
      fifo.pop_front();
      model.pop_front();
    }
    ASSERT_EQ(fifo.size(), model.size());
    if (!model.empty()) {
      ASSERT_EQ(*fifo.back().value, model.back()) << "step " << step;
      const size_t i = rng() % model.size();
      ASSERT_EQ(*fifo[i].value, model[i]) << "step " << step << " index " << i;
    }
  }
  fifo.clear();
  EXPECT_TRUE(fifo.empty());
  // Usable again after clear(), from a fresh head.
  for (int i = 0; i < 20; ++i) fifo.push_back(Item(i));
  for (int i = 0; i < 20; ++i) {
    ASSERT_EQ(*fifo.front().value, i);
    fifo.pop_front();
  }
}

}  // namespace
}  // namespace rdmarpc::transport
