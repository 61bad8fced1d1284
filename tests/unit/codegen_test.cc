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

// ---- Generated Service / Stub / mocks (golden compile checks) ---------------

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "bare.rdmarpc.pb.h"
#include "other/deep/pkg/deep.rdmarpc.pb.h"
#include "rdmarpc/test/echo_mock.rdmarpc.pb.h"

namespace {

namespace asio = boost::asio;
using rdmarpc::ServerContext;
using rdmarpc::Status;
using rdmarpc::test::Payload;

template <typename End>
struct EndHandler {
  void operator()(boost::system::error_code, End) const {}
};

template <typename T>
constexpr bool kHasServerStreamInline = requires { &T::ServerStreamInline; };

TEST(Codegen, ServiceBaseHasOneCoroutinePerMethodWithTheRightShape) {
  using S = Echo::Service;
  static_assert(std::is_same_v<decltype(&S::Unary),
                               asio::awaitable<Status> (S::*)(ServerContext&, const Payload&, Payload&)>);
  static_assert(std::is_same_v<decltype(&S::ServerStream),
                               asio::awaitable<Status> (S::*)(ServerContext&, const Payload&,
                                                              rdmarpc::ServerWriter<Payload>&)>);
  static_assert(std::is_same_v<decltype(&S::ClientStream),
                               asio::awaitable<Status> (S::*)(ServerContext&, rdmarpc::ServerReader<Payload>&,
                                                              Payload&)>);
  static_assert(std::is_same_v<decltype(&S::Bidi),
                               asio::awaitable<Status> (S::*)(ServerContext&,
                                                              rdmarpc::ServerReaderWriter<Payload, Payload>&)>);
  // Unary methods also get the inline fast path, tried first (std::nullopt: the coroutine runs).
  static_assert(std::is_same_v<decltype(&S::UnaryInline),
                               std::optional<Status> (S::*)(ServerContext&, const Payload&, Payload&)>);
  static_assert(!kHasServerStreamInline<S>);
  static_assert(std::is_base_of_v<rdmarpc::Service, S>);
  // The stub opens streams: the completion carries the typed client end.
  static_assert(requires(Echo::Stub s, rdmarpc::ClientContext& c, const Payload& p) {
    s.async_ServerStream(c, p, EndHandler<rdmarpc::ClientReader<Payload>>{});
    s.async_ClientStream(c, EndHandler<rdmarpc::ClientWriter<Payload, Payload>>{});
    s.async_Bidi(c, EndHandler<rdmarpc::ClientReaderWriter<Payload, Payload>>{});
  });
  struct Impl final : S {};
  Impl impl;
  EXPECT_EQ(impl.service_name(), "rdmarpc.test.Echo");
  ASSERT_EQ(impl.methods().size(), 5u);
  EXPECT_NE(impl.methods()[0].invoke, nullptr);   // unary: a unary trampoline and the inline one
  EXPECT_NE(impl.methods()[0].invoke_inline, nullptr);
  EXPECT_EQ(impl.methods()[0].invoke_stream, nullptr);
  for (size_t i = 2; i < 5; ++i) {                 // streaming: a stream trampoline
    EXPECT_EQ(impl.methods()[i].invoke, nullptr) << i;
    EXPECT_EQ(impl.methods()[i].invoke_inline, nullptr) << i;
    EXPECT_NE(impl.methods()[i].invoke_stream, nullptr) << i;
  }
  // Not overridden: the inline trampoline declines, so the coroutine runs.
  rdmarpc::ServerContext ctx;
  Payload request, response;
  EXPECT_FALSE(impl.methods()[0].invoke_inline(impl, ctx, request, response).has_value());
  EXPECT_EQ(&impl.methods()[1].request_prototype(), &rdmarpc::test::Payload_Meta::default_instance());
}

struct OuterHandler {
  void operator()(boost::system::error_code, other::deep::pkg::Outer) const {}
};

TEST(Codegen, NoPackageDeepPackagesSeveralServicesAndKeywordMethods) {
  EXPECT_EQ(::Bare::kServiceName, "Bare");  // global namespace
  static_assert(std::is_same_v<::Bare::PingRequest, ::BareMessage>);
  EXPECT_EQ(other::deep::pkg::First::kServiceName, "other.deep.pkg.First");
  EXPECT_EQ(other::deep::pkg::Second::kServiceName, "other.deep.pkg.Second");
  static_assert(std::is_same_v<other::deep::pkg::First::GetRequest, other::deep::pkg::Outer_Inner_Innermost>);
  static_assert(std::is_same_v<other::deep::pkg::First::GetResponse, rdmarpc::test::Payload>);
  // `new` is a C++ keyword: the handler is new_, the stub method async_new.
  using Second = other::deep::pkg::Second;
  static_assert(std::is_member_function_pointer_v<decltype(&Second::Service::new_)>);
  static_assert(requires(Second::Stub s, rdmarpc::ClientContext& c, const other::deep::pkg::Outer& o) {
    s.async_new(c, o, OuterHandler{});
  });
  // Same method name in two services of one file: different ids.
  EXPECT_NE(other::deep::pkg::First::kGetId, other::deep::pkg::Second::kGetId);
}

TEST(Codegen, MocksAreGeneratedOnRequest) {
  static_assert(std::is_base_of_v<rdmarpc::ChannelInterface, rdmarpc::test::MockEchoStub>);
  static_assert(std::is_base_of_v<rdmarpc::ChannelInterface, rdmarpc::test::MockclassStub>);
}

// The plugin refuses what it cannot generate, with a message naming the cause.
std::string RunPlugin(const std::string& proto_text, int* exit_code) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("rdmarpc_codegen_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "bad.proto") << proto_text;
  std::string cmd = std::string(RDMARPC_PROTOC) + " -I" + dir.string() + " --plugin=protoc-gen-rdmarpc=" +
                    RDMARPC_PLUGIN + " --rdmarpc_out=" + dir.string() + " " + (dir / "bad.proto").string() +
                    " > " + (dir / "err.txt").string() + " 2>&1";
  int rc = std::system(cmd.c_str());
  *exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream in(dir / "err.txt");
  std::string err((std::istreambuf_iterator<char>(in)), {});
  fs::remove_all(dir);
  return err;
}

TEST(Codegen, PluginRejectsMethodsThatWouldCollideWithGeneratedMembers) {
  int rc = 0;
  std::string err = RunPlugin(
      "syntax = \"proto3\"; message M {} service S { rpc Stub(M) returns (M); }", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("may not be named Stub"), std::string::npos) << err;
  // AInline would be A's inline fast path (A unary); beside a streaming A it is free.
  err = RunPlugin("syntax = \"proto3\"; message M {} service S { rpc A(M) returns (M); rpc AInline(M) returns (M); }",
                  &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("may not be named AInline"), std::string::npos) << err;
  err = RunPlugin("syntax = \"proto3\"; message M {} service S { rpc A(M) returns (stream M); rpc AInline(M) returns (M); }",
                  &rc);
  EXPECT_EQ(rc, 0) << err;
  err = RunPlugin("syntax = \"proto3\"; message M {} service S { rpc A(M) returns (M); }", &rc);
  EXPECT_EQ(rc, 0) << err;
}

}  // namespace
