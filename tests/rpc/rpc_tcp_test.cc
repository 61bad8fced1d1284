// The RPC runtime suite over tcp:// on loopback.
#include "tests/rpc/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

TransportOptions TcpPolling(transport::tcp::PollMode mode) {
  TransportOptions o;
  o.tcp.poll_mode = mode;
  return o;
}

// The reactor (default), and the executor's thread polling the sockets
// (TcpOptions::poll_mode) until quiet, or for as long as a connection lives.
INSTANTIATE_TEST_SUITE_P(Tcp, RpcSuite,
                         ::testing::Values(RpcTransport{"tcp", "tcp://127.0.0.1:0", [] { return TransportOptions{}; }},
                                           RpcTransport{"tcp_adaptive", "tcp://127.0.0.1:0",
                                                        [] { return TcpPolling(transport::tcp::PollMode::kAdaptive); }},
                                           RpcTransport{"tcp_busy", "tcp://127.0.0.1:0",
                                                        [] { return TcpPolling(transport::tcp::PollMode::kBusy); }}),
                         RpcTransportName);

}  // namespace
}  // namespace rdmarpc::testing
