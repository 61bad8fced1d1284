// Where RDMA tests find their device and address: the Soft-RoCE harness
// exports RXE_VM_DEV / RXE_VM_SELF_IP; on a host with a NIC, set
// RDMARPC_TEST_DEVICE / RDMARPC_TEST_IP instead.
#pragma once

#include <cstdlib>
#include <string>

namespace rdmarpc::testing {

inline std::string EnvOr(const char* a, const char* b, const char* fallback) {
  if (const char* v = std::getenv(a); v && *v) return v;
  if (const char* v = std::getenv(b); v && *v) return v;
  return fallback;
}
inline std::string TestDevice() { return EnvOr("RDMARPC_TEST_DEVICE", "RXE_VM_DEV", ""); }
inline std::string TestIp() { return EnvOr("RDMARPC_TEST_IP", "RXE_VM_SELF_IP", "127.0.0.1"); }

}  // namespace rdmarpc::testing
