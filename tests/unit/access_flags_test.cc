// Issue 8 item 10: the verbs access flags the library registers memory with.
// The sets live in transport/rdma/access.h; this test holds them to the rule
// (no remote read, no atomics, remote write only for granted rendezvous
// receive buffers) and checks the sources register with nothing else.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "transport/rdma/access.h"
#include "transport/rdma/buffer_pool.h"

namespace rdmarpc::rdma {
namespace {

std::string Describe(int flags) {
  std::string s;
  auto add = [&](int bit, const char* name) {
    if ((flags & bit) != 0) s += std::string(s.empty() ? "" : "|") + name;
  };
  add(IBV_ACCESS_LOCAL_WRITE, "LOCAL_WRITE");
  add(IBV_ACCESS_REMOTE_WRITE, "REMOTE_WRITE");
  add(IBV_ACCESS_REMOTE_READ, "REMOTE_READ");
  add(IBV_ACCESS_REMOTE_ATOMIC, "REMOTE_ATOMIC");
  add(IBV_ACCESS_MW_BIND, "MW_BIND");
  return s.empty() ? "0" : s;
}

TEST(AccessFlags, ListsEveryRegistration) {
  for (const access::Use& use : access::kInUse) std::cout << "  " << use.what << ": " << Describe(use.flags) << "\n";
  EXPECT_EQ(access::kLocalOnly, IBV_ACCESS_LOCAL_WRITE);
  EXPECT_EQ(access::kRendezvousReceive, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(access::kGrantPool, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  EXPECT_EQ(access::kGrantWindow, IBV_ACCESS_REMOTE_WRITE);
}

// The grant pool's slabs may have windows bound over them, but their own
// rkey opens nothing: no remote flag on the MR.
TEST(AccessFlags, OnlyTheGrantPoolAllowsWindowBindingAndItsMrIsNotRemote) {
  int bindable = 0;
  for (const access::Use& use : access::kInUse) {
    if ((use.flags & IBV_ACCESS_MW_BIND) == 0) continue;
    ++bindable;
    EXPECT_EQ(use.flags, access::kGrantPool) << use.what;
    EXPECT_EQ(use.flags & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC), 0)
        << use.what;
  }
  EXPECT_EQ(bindable, 1);
}

TEST(AccessFlags, NothingIsRemotelyReadableOrAtomic) {
  for (const access::Use& use : access::kInUse)
    EXPECT_EQ(use.flags & (IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC), 0)
        << use.what << " is registered with " << Describe(use.flags);
  EXPECT_EQ(access::kForbidden, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
}

TEST(AccessFlags, OnlyRendezvousReceiveBuffersAreRemotelyWritable) {
  int writable = 0;
  for (const access::Use& use : access::kInUse) {
    if ((use.flags & IBV_ACCESS_REMOTE_WRITE) == 0) continue;
    ++writable;
    EXPECT_TRUE(use.flags == access::kRendezvousReceive || use.flags == access::kGrantWindow)
        << use.what << ": " << Describe(use.flags);
    EXPECT_NE(use.what.find("rendezvous receive buffer"), std::string_view::npos)
        << use.what << " is remotely writable but is not a rendezvous receive buffer";
  }
  EXPECT_EQ(writable, 2);  // the per-message MR and the grant window
  EXPECT_EQ(BufferPoolOptions{}.access, access::kLocalOnly) << "a pool must not be remotely writable by default";
}

// The named sets are only a rule if the code uses them: no source outside
// access.h spells a flag, except buffer_pool.cc, which validates the flags a
// user passes in BufferPoolOptions::access (it registers nothing of its own).
TEST(AccessFlags, SourcesRegisterOnlyWithTheNamedSets) {
  namespace fs = std::filesystem;
  const fs::path root = RDMARPC_SOURCE_DIR;
  const std::vector<std::string> allowed = {"transport/rdma/access.h", "transport/rdma/buffer_pool.cc"};
  int scanned = 0;
  for (const char* dir : {"transport", "rpc"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const fs::path& p = entry.path();
      if (!entry.is_regular_file() || (p.extension() != ".cc" && p.extension() != ".h")) continue;
      const std::string rel = fs::relative(p, root).generic_string();
      ++scanned;
      std::ifstream in(p);
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        if (line.find("IBV_ACCESS_") == std::string::npos) continue;
        if (std::find(allowed.begin(), allowed.end(), rel) != allowed.end()) continue;
        ADD_FAILURE() << rel << ":" << n << " spells a verbs access flag; use a set from "
                      << "transport/rdma/access.h: " << line;
      }
    }
  }
  EXPECT_GT(scanned, 20) << "source tree not found at " << root;
}

}  // namespace
}  // namespace rdmarpc::rdma
