// Error reporting of the verbs layer that needs no device: every message a
// user can hit names the cause and the fix.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include "absl/strings/str_cat.h"
#include "transport/rdma/poller.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {
namespace {

bool Contains(absl::string_view hay, absl::string_view needle) {
  return hay.find(needle) != absl::string_view::npos;
}

TEST(VerbsErrors, NoDevicePointsToTheSoftRoceHarness) {
  if (!Device::ListNames().empty()) GTEST_SKIP() << "this host has an RDMA device";
  auto dev = Device::Open({});
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(dev.status().message(), "tools/rxe-vm")) << dev.status();
  EXPECT_TRUE(Contains(dev.status().message(), "rdma link add")) << dev.status();
}

TEST(VerbsErrors, SharedPollersRejectEventModeAndBadThreadCounts) {
  auto event = PollerGroup::Start(PollMode::kEvent, 2, {}, std::chrono::microseconds(50));
  ASSERT_FALSE(event.ok());
  EXPECT_EQ(event.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(event.status().message(), "busy or adaptive")) << event.status();
  for (unsigned n : {0u, PollerGroup::kMaxSharedPollers + 1}) {
    auto bad = PollerGroup::Start(PollMode::kAdaptive, n, {}, std::chrono::microseconds(50));
    ASSERT_FALSE(bad.ok()) << n;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(bad.status().message(), absl::StrCat("got ", n))) << bad.status();
  }
  // A good group starts its threads with no CQ, and reports their load.
  auto ok = PollerGroup::Start(PollMode::kBusy, 3, {}, std::chrono::microseconds(50));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->threads(), 3u);
  EXPECT_EQ((*ok)->Load(), (std::vector<size_t>{0, 0, 0}));
}

TEST(VerbsErrors, MemlockAdviceNamesTheLimitTheNeedAndTheFixes) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &old), 0);
  rlimit low = old;
  low.rlim_cur = 64 * 1024;  // Soft limit only: we can raise it back.
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &low), 0);
  std::string advice = MemlockAdvice(8u << 20);
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &old), 0);
  EXPECT_TRUE(Contains(advice, "RLIMIT_MEMLOCK is 64 KiB")) << advice;
  EXPECT_TRUE(Contains(advice, "needs 8 MiB")) << advice;
  EXPECT_TRUE(Contains(advice, "ulimit -l")) << advice;
  EXPECT_TRUE(Contains(advice, "LimitMEMLOCK")) << advice;
  EXPECT_TRUE(Contains(advice, "IPC_LOCK")) << advice;
}

TEST(VerbsErrors, WorkCompletionErrorsMapToCanonicalCodesAndKeepTheVerbsText) {
  auto st = WcStatusToStatus(IBV_WC_RETRY_EXC_ERR, 0x81, "conn 7");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(st.message(), ibv_wc_status_str(IBV_WC_RETRY_EXC_ERR))) << st;
  EXPECT_TRUE(Contains(st.message(), "conn 7")) << st;
  EXPECT_TRUE(Contains(st.message(), "0x81")) << st;
  EXPECT_EQ(WcStatusToStatus(IBV_WC_REM_ACCESS_ERR, 0, "x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(WcStatusToStatus(IBV_WC_WR_FLUSH_ERR, 0, "x").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(WcStatusToStatus(IBV_WC_LOC_LEN_ERR, 0, "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(WcStatusToStatus(IBV_WC_SUCCESS, 0, "x").ok());
}

TEST(VerbsErrors, ErrnoStatusKeepsTheCallAndTheErrnoText) {
  auto st = ErrnoStatus(ENOMEM, "ibv_create_cq(4096) on rxe0");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(st.message(), "ibv_create_cq(4096) on rxe0")) << st;
  EXPECT_TRUE(Contains(st.message(), "Cannot allocate memory")) << st;
  EXPECT_EQ(ErrnoStatus(ENODEV, "x").code(), absl::StatusCode::kNotFound);
}

// Device::ReleaseRemoved closes a removed device's files behind librdmacm only
// when it drops the process's last use of that context; an earlier one must
// leave them to the RdmaContexts still holding it.
TEST(VerbsErrors, OnlyTheLastUseOfADeviceContextIsTheLast) {
  // Identities only: ContextUse never dereferences the pointer.
  auto* a = reinterpret_cast<ibv_context*>(uintptr_t{0x1000});
  auto* b = reinterpret_cast<ibv_context*>(uintptr_t{0x2000});
  detail::ContextUse a1(a), b1(b);
  detail::ContextUse a2(a);
  detail::ContextUse moved(std::move(a2));  // A move carries the use, it does not add one.
  EXPECT_FALSE(a2.Reset()) << "a moved-from use holds nothing";
  EXPECT_FALSE(a1.Reset()) << "another use of a is still alive";
  EXPECT_TRUE(b1.Reset()) << "b had one use";
  EXPECT_TRUE(moved.Reset()) << "the last use of a";
  EXPECT_FALSE(moved.Reset()) << "idempotent";
  {
    detail::ContextUse again(a);  // Counting starts afresh once all uses went.
    EXPECT_TRUE(again.Reset());
  }
}

}  // namespace
}  // namespace rdmarpc::rdma
