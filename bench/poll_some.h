// Running an event loop from a benchmark's own spin loop.
#pragma once

#include <cstddef>

#include <boost/asio/io_context.hpp>

namespace rdmarpc::bench {

// Runs the ready handlers, at most 64, without blocking. Not io.poll(): a
// polling connection (TCP adaptive/busy, RDMA run to completion) posts its
// next pass from every pass, so poll() would never return to the caller's
// loop and its deadline and done() checks.
inline size_t PollSome(boost::asio::io_context& io) {
  size_t n = 0;
  while (n < 64 && io.poll_one() > 0) ++n;
  return n;
}

}  // namespace rdmarpc::bench
