// The RPC runtime suite over rdma:// on a real device (Soft-RoCE in the VM).
#include <memory>

#include "tests/rpc/rpc_suite.h"
#include "tests/support/rdma_env.h"

namespace rdmarpc::testing {
namespace {

// One device context per process, shared by every server and channel.
std::shared_ptr<rdma::RdmaContext> Context() {
  static auto ctx = rdma::RdmaContext::Open({.name = TestDevice()});
  return ctx.ok() ? *ctx : nullptr;
}

TransportOptions RdmaOptions(rdma::PollMode mode) {
  TransportOptions o;
  o.rdma_context = Context();
  o.rdma.poll_mode = mode;
  o.rdma.max_message_size = size_t{32} << 20;  // the suite's 16 MiB echo, no more
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Rdma, RpcSuite,
    ::testing::Values(RpcTransport{"rdma_event", "rdma://" + TestIp() + ":0",
                                   [] { return RdmaOptions(rdma::PollMode::kEvent); }},
                      RpcTransport{"rdma_adaptive", "rdma://" + TestIp() + ":0",
                                   [] { return RdmaOptions(rdma::PollMode::kAdaptive); }}),
    RpcTransportName);

}  // namespace
}  // namespace rdmarpc::testing
