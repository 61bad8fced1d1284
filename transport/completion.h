// How backends complete operations: never inline, always through the
// handler's associated executor (falling back to the connection's).
#pragma once

#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/append.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

namespace rdmarpc::transport {

// Posts `handler(args...)` to `io_ex`; Asio then runs it on the handler's
// associated executor, with its associated allocator. When `io_ex` is a plain
// io_context executor we post to that concrete type: in Boost 1.81 going
// through any_io_executor converts it to any_completion_executor twice per
// completion, and each conversion heap-allocates (measured by
// tests/unit/tcp_transport_test.cc's allocation test).
template <typename Handler, typename... Args>
void PostCompletion(const boost::asio::any_io_executor& io_ex, Handler&& handler, Args&&... args) {
  if (const auto* ioc = io_ex.target<boost::asio::io_context::executor_type>()) {
    boost::asio::post(*ioc, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
    return;
  }
  boost::asio::post(io_ex, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
}

// Like PostCompletion, but runs `handler` at once when the caller is already
// on `io_ex` (and the handler's executor allows it). Only for completions
// found while handling an I/O event, never inside the call that started the
// operation: that must post.
template <typename Handler, typename... Args>
void DispatchCompletion(const boost::asio::any_io_executor& io_ex, Handler&& handler, Args&&... args) {
  if (const auto* ioc = io_ex.target<boost::asio::io_context::executor_type>()) {
    boost::asio::dispatch(*ioc, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
    return;
  }
  boost::asio::dispatch(io_ex, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
}

}  // namespace rdmarpc::transport
