// A FIFO that does not allocate once warm, for completion handlers and the
// work queued behind them on the transports' hot paths.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

namespace rdmarpc::transport {

// Elements are only move-constructed and destroyed, never move-assigned: in
// Asio 1.81 any_completion_handler's move assignment wraps the source instead
// of moving it (fixed in 1.82). Unlike std::deque, which frees and allocates
// blocks as a FIFO walks through it, push/pop never allocate after warm-up.
template <typename T>
class Fifo {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return *slots_[head_]; }
  T& operator[](size_t i) { return *slots_[(head_ + i) & mask_]; }

  void push_back(T&& value) {
    if (size_ == slots_.size()) Grow();
    slots_[(head_ + size_) & mask_].emplace(std::move(value));
    ++size_;
  }
  T& back() { return *slots_[(head_ + size_ - 1) & mask_]; }
  void pop_front() {
    slots_[head_].reset();
    head_ = (head_ + 1) & mask_;
    --size_;
  }
  // Destroys every element; keeps the capacity.
  void clear() {
    while (size_ > 0) pop_front();
    head_ = 0;
  }

 private:
  void Grow() {
    std::vector<std::optional<T>> bigger(std::max<size_t>(8, slots_.size() * 2));
    for (size_t i = 0; i < size_; ++i) bigger[i].emplace(std::move((*this)[i]));
    slots_.swap(bigger);
    mask_ = slots_.size() - 1;
    head_ = 0;
  }

  // Capacity: 0 or a power of two, so an index wraps with a mask, not a
  // division.
  std::vector<std::optional<T>> slots_;
  size_t mask_ = 0;
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace rdmarpc::transport
