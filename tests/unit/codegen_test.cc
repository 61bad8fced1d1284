// What protoc-gen-rdmarpc emits for tests/protos: method tables, stable ids,
// streaming kinds, imports, nested types and C++ keyword names.
#include <gtest/gtest.h>

#include <set>
#include <type_traits>

#include "rdmarpc/test/echo.rdmarpc.pb.h"

namespace {

using rdmarpc::test::Echo;

TEST(Codegen, MethodIdsAreTheFnv1aOfTheFullName) {
  // Independent reference values: FNV-1a-32 computed by hand-checked Python
  // (hash of "rdmarpc.test.Echo/Unary"), not by the function under test.
  EXPECT_EQ(rdmarpc::MethodId(""), 2166136261u);
  EXPECT_EQ(rdmarpc::MethodId("a"), 0xe40c292cu);
  EXPECT_EQ(Echo::kUnaryId, rdmarpc::MethodId("rdmarpc.test.Echo/Unary"));
  EXPECT_EQ(Echo::kServiceName, "rdmarpc.test.Echo");
}

TEST(Codegen, MethodTableListsEveryMethodWithItsStreamingKind) {
  ASSERT_EQ(std::size(Echo::kMethods), 5u);
  EXPECT_EQ(Echo::kMethods[0].full_name, "rdmarpc.test.Echo/Unary");
  EXPECT_FALSE(Echo::kMethods[0].client_streaming);
  EXPECT_FALSE(Echo::kMethods[0].server_streaming);
  EXPECT_TRUE(Echo::kMethods[2].server_streaming);
  EXPECT_FALSE(Echo::kMethods[2].client_streaming);
  EXPECT_TRUE(Echo::kMethods[3].client_streaming);
  EXPECT_FALSE(Echo::kMethods[3].server_streaming);
  EXPECT_TRUE(Echo::kMethods[4].client_streaming && Echo::kMethods[4].server_streaming);
  std::set<uint32_t> ids;
  for (const auto& m : Echo::kMethods) {
    EXPECT_EQ(m.id, rdmarpc::MethodId(m.full_name));
    ids.insert(m.id);
  }
  EXPECT_EQ(ids.size(), std::size(Echo::kMethods));
}

TEST(Codegen, RequestAndResponseTypesResolveAcrossImportsAndNesting) {
  static_assert(std::is_same_v<Echo::UnaryRequest, rdmarpc::test::Payload>);
  static_assert(std::is_same_v<Echo::NestedResponse, rdmarpc::test::Payload_Meta>);
  Echo::NestedRequest meta;
  meta.set_seq(42);
  EXPECT_EQ(meta.seq(), 42u);
}

TEST(Codegen, KeywordNamesGetATrailingUnderscore) {
  EXPECT_EQ(rdmarpc::test::class_::kServiceName, "rdmarpc.test.class");
  EXPECT_EQ(rdmarpc::test::class_::kdeleteId, rdmarpc::MethodId("rdmarpc.test.class/delete"));
}

}  // namespace
