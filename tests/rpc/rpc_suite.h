// The RPC runtime suite: Channel, Server, generated stubs and services, run
// against every transport (tcp:// on the host, rdma:// inside the Soft-RoCE
// VM). A transport's binary links rdmarpc_rpc_suite and instantiates
//
//   INSTANTIATE_TEST_SUITE_P(Tcp, RpcSuite, ::testing::Values(RpcTransport{...}), RpcTransportName);
//
// Every wait is bounded and fails the test instead of hanging.
#pragma once

#include <chrono>
#include <functional>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "rpc/endpoint.h"

namespace rdmarpc::testing {

struct RpcTransport {
  std::string name;
  // "tcp://127.0.0.1:0", "rdma://10.77.0.1:0"
  std::string listen_uri;
  // Options for both ends (device, poll mode, message limits).
  std::function<TransportOptions()> options;
};

std::string RpcTransportName(const ::testing::TestParamInfo<RpcTransport>& info);
void PrintTo(const RpcTransport& t, std::ostream* os);

inline constexpr std::chrono::seconds kRpcWait{60};

class RpcSuite : public ::testing::TestWithParam<RpcTransport> {};

}  // namespace rdmarpc::testing
