// How backends complete operations: never inline, always through the
// handler's associated executor (falling back to the connection's).
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/append.hpp>
#include <boost/asio/associated_executor.hpp>
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
namespace detail {

// True when `handler` may run right here: its associated executor is an
// io_context executor of `ioc`'s context and this thread is running that
// context. This is what asio::dispatch would decide, without the type-erased
// function object (one heap allocation per completion through
// any_completion_executor in Boost 1.81) that it builds to get there.
template <typename Handler>
bool MayRunInline(const Handler& handler, const boost::asio::io_context::executor_type& ioc) {
  namespace asio = boost::asio;
  using Plain = asio::io_context::executor_type;
  using Tracked = asio::io_context::basic_executor_type<std::allocator<void>, 4>;
  const auto hex = asio::get_associated_executor(handler, ioc);
  using HEx = std::decay_t<decltype(hex)>;
  auto same = [&](const auto& e) { return &e.context() == &ioc.context() && e.running_in_this_thread(); };
  if constexpr (std::is_same_v<HEx, Plain> || std::is_same_v<HEx, Tracked>) {
    return same(hex);
  } else if constexpr (requires { hex.template target<Plain>(); }) {
    if (const auto* e = hex.template target<Plain>()) return same(*e);
    if (const auto* e = hex.template target<Tracked>()) return same(*e);
    return false;
  } else {
    return false;
  }
}

}  // namespace detail

template <typename Handler, typename... Args>
void DispatchCompletion(const boost::asio::any_io_executor& io_ex, Handler&& handler, Args&&... args) {
  if (const auto* ioc = io_ex.target<boost::asio::io_context::executor_type>()) {
    if (detail::MayRunInline(handler, *ioc)) {
      std::decay_t<Handler> h(std::forward<Handler>(handler));
      std::move(h)(std::forward<Args>(args)...);
      return;
    }
    boost::asio::dispatch(*ioc, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
    return;
  }
  boost::asio::dispatch(io_ex, boost::asio::append(std::forward<Handler>(handler), std::forward<Args>(args)...));
}

}  // namespace rdmarpc::transport
