// How backends complete operations: never inline, always through the
// handler's associated executor (falling back to the connection's).
#pragma once

#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/append.hpp>
#include <boost/asio/post.hpp>

namespace rdmarpc::transport {

// Posts `handler(args...)` to `io_ex`; Asio then runs it on the handler's
// associated executor, with its associated allocator.
template <typename Handler, typename... Args>
void PostCompletion(const boost::asio::any_io_executor& io_ex, Handler&& handler, Args&&... args) {
  boost::asio::post(io_ex, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
}

}  // namespace rdmarpc::transport
