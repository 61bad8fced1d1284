// The transport conformance suite: the contracts at the top of
// transport/transport.h, checked against a backend through the seam alone (no
// sockets, no verbs), so one suite covers every transport. A backend's test
// binary links rdmarpc_conformance and instantiates it:
//
//   INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
//                            ::testing::Values(TransportUnderTest{...}), TransportName);
//
// Every wait is bounded (kConformanceWait and friends) and fails the test
// instead of hanging; the bounds are generous because the RDMA instantiation
// runs inside a slow emulated VM.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace rdmarpc::conformance {

namespace asio = boost::asio;

struct TransportUnderTest {
  std::string name;  // Test-name suffix: letters, digits, underscores.
  // Creates a listener on a free port.
  std::function<absl::StatusOr<std::unique_ptr<transport::Listener>>(asio::any_io_executor)> listen;
  // Connects to listener->local_uri().
  std::function<void(asio::any_io_executor, const std::string& uri, transport::Listener::AcceptHandler)> connect;
  size_t max_message_size;
  // Each connection end has a thread spinning on its completions (RDMA busy
  // polling): tests with many connections must not assume spare cores.
  bool busy_polling = false;
  // The fixture's io_context's concurrency hint. 1 says one thread runs it,
  // which lets polling connections (TCP poll modes, RDMA run to completion)
  // share one pass a turn (transport/poll_group.h).
  int io_concurrency_hint = BOOST_ASIO_CONCURRENCY_HINT_DEFAULT;
  // listen/connect with a shared-secret auth token (empty: none), for the
  // authentication tests (transport/common/auth.h); they skip when unset.
  std::function<absl::StatusOr<std::unique_ptr<transport::Listener>>(asio::any_io_executor, const std::string& token)>
      listen_with_token;
  std::function<void(asio::any_io_executor, const std::string& uri, const std::string& token,
                     transport::Listener::AcceptHandler)>
      connect_with_token;
};

// For INSTANTIATE_TEST_SUITE_P's name generator argument.
std::string TransportName(const ::testing::TestParamInfo<TransportUnderTest>& info);
// gtest prints parameters of failing tests; the default would dump raw bytes.
void PrintTo(const TransportUnderTest& transport, std::ostream* os);

// Bound for one step (connect, one exchange, one close). A minute is far
// beyond what a healthy run needs even under Soft-RoCE in a VM, and short
// enough that a hang fails the test instead of the ctest timeout.
inline constexpr std::chrono::seconds kConformanceWait{60};

class TransportConformance : public ::testing::TestWithParam<TransportUnderTest> {
 protected:
  struct Pair {
    transport::Connection* client = nullptr;
    transport::Connection* server = nullptr;
  };

  void SetUp() override;
  void TearDown() override;

  // Runs io_ until `done()` holds or `limit` passes; false on timeout.
  // `done` is checked after every handler (and at least every 100 ms, for
  // conditions set from other threads).
  bool RunUntil(const std::function<bool()>& done,
                std::chrono::steady_clock::duration limit = kConformanceWait);
  // RunUntil, catching the exception the handlers-that-throw tests throw;
  // how many it caught, or -1 on timeout.
  int RunCatching(const std::function<bool()>& done);
  // Runs io_ for `d` (lets in-flight work progress without waiting for anything).
  void RunFor(std::chrono::steady_clock::duration d) {
    RunUntil([] { return false; }, d);
  }
  // Accepts one connection while connecting to the listener. The fixture owns
  // both connections; TearDown closes them and lets their handlers run.
  absl::StatusOr<Pair> ConnectPair();
  // Hands one of the fixture's connections to the test, which then decides
  // when it is destroyed (from inside its own handlers, say).
  std::unique_ptr<transport::Connection> TakeConnection(transport::Connection* connection);
  // Replaces listener_ with one that requires `server_token` and connects to
  // it with `client_token`; waits for both the connect and the accept.
  struct AuthOutcome {
    absl::Status connect;
    absl::Status accept;
    Pair pair;  // Both set when both succeeded.
  };
  AuthOutcome ConnectWithTokens(const std::string& server_token, const std::string& client_token);
  // One message each way, checked: the connection still works.
  void ExpectWorks(const Pair& pair, uint64_t seed);
  // Synchronous helpers built on RunUntil: a timeout becomes DEADLINE_EXCEEDED.
  absl::Status SendAndWait(transport::Connection& connection, std::span<const std::byte> bytes);
  absl::StatusOr<transport::Message> ReceiveAndWait(transport::Connection& connection);

  asio::io_context io_{GetParam().io_concurrency_hint};
  std::unique_ptr<transport::Listener> listener_;

 private:
  std::unique_ptr<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::vector<std::unique_ptr<transport::Connection>> connections_;
};

}  // namespace rdmarpc::conformance
