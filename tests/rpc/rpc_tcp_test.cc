// The RPC runtime suite over tcp:// on loopback.
#include "tests/rpc/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Tcp, RpcSuite,
                         ::testing::Values(RpcTransport{"tcp", "tcp://127.0.0.1:0", [] { return TransportOptions{}; }}),
                         RpcTransportName);

}  // namespace
}  // namespace rdmarpc::testing
