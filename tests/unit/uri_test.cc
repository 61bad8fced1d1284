#include <gtest/gtest.h>

#include "transport/uri.h"

namespace rdmarpc::transport {
namespace {

TEST(Uri, ParsesBothSchemesAndIpv6) {
  auto a = ParseUri("rdma://10.0.0.1:7000");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->scheme, Uri::Scheme::kRdma);
  EXPECT_EQ(a->host, "10.0.0.1");
  EXPECT_EQ(a->port, 7000);
  auto b = ParseUri("tcp://[::1]:0");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->scheme, Uri::Scheme::kTcp);
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->ToString(), "tcp://[::1]:0");
}

TEST(Uri, RejectsWhatItCannotUseAndSaysWhy) {
  for (const char* text : {"http://x:1", "rdma://x", "rdma://:5", "tcp://h:70000", "tcp://h:-1",
                           "tcp://::1:5", "tcp://[::1:5", "tcp://h:5x", ""}) {
    auto u = ParseUri(text);
    ASSERT_FALSE(u.ok()) << text;
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(u.status().message().find("expected rdma://HOST:PORT"), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace rdmarpc::transport
