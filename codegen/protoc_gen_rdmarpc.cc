// protoc-gen-rdmarpc: X.proto -> X.rdmarpc.pb.h / X.rdmarpc.pb.cc.
//
// Per service: the method table the runtime dispatches on (full names, stable
// ids, streaming kinds), a Service base with one virtual coroutine per method
// (plus, per unary method, an optional inline fast path tried first),
// a Stub with async_<Method> for any Asio completion token, and (parameter
// "mocks") X_mock.rdmarpc.pb.h with a gmock Mock<Service>Stub. Id collisions
// inside a file are rejected.
#include <google/protobuf/compiler/code_generator.h>
#include <google/protobuf/compiler/plugin.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/printer.h>
#include <google/protobuf/io/zero_copy_stream.h>

#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "rpc/method_id.h"

namespace {

namespace pb = google::protobuf;

const std::set<std::string>& CppKeywords() {
  static const std::set<std::string> kw = {
      "alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break",
      "case", "catch", "char", "char8_t", "char16_t", "char32_t", "class", "compl", "concept",
      "const", "consteval", "constexpr", "constinit", "const_cast", "continue", "co_await",
      "co_return", "co_yield", "decltype", "default", "delete", "do", "double", "dynamic_cast",
      "else", "enum", "explicit", "export", "extern", "false", "float", "for", "friend", "goto",
      "if", "inline", "int", "long", "mutable", "namespace", "new", "noexcept", "not", "not_eq",
      "nullptr", "operator", "or", "or_eq", "private", "protected", "public", "register",
      "reinterpret_cast", "requires", "return", "short", "signed", "sizeof", "static",
      "static_assert", "static_cast", "struct", "switch", "template", "this", "thread_local",
      "throw", "true", "try", "typedef", "typeid", "typename", "union", "unsigned", "using",
      "virtual", "void", "volatile", "wchar_t", "while", "xor", "xor_eq"};
  return kw;
}

// Same rule protoc's C++ generator uses: a trailing underscore.
std::string SafeIdent(const std::string& name) {
  return CppKeywords().count(name) ? name + "_" : name;
}

std::string StripProto(const std::string& file) {
  return file.size() > 6 && file.ends_with(".proto") ? file.substr(0, file.size() - 6) : file;
}

std::string CppNamespace(const std::string& package) {
  std::string out;
  for (auto part : absl::StrSplit(package, '.', absl::SkipEmpty()))
    absl::StrAppend(&out, out.empty() ? "" : "::", SafeIdent(std::string(part)));
  return out;
}

std::string CppType(const pb::Descriptor* d) {
  return absl::StrCat("::", absl::StrReplaceAll(d->full_name(), {{".", "::"}}));
}

// Which of the four shapes a method has.
enum class Shape { kUnary, kServerStream, kClientStream, kBidi };
Shape ShapeOf(const pb::MethodDescriptor* m) {
  if (m->client_streaming()) return m->server_streaming() ? Shape::kBidi : Shape::kClientStream;
  return m->server_streaming() ? Shape::kServerStream : Shape::kUnary;
}

std::map<std::string, std::string> Vars(const pb::ServiceDescriptor* svc, const pb::MethodDescriptor* m, int index) {
  return {{"service", SafeIdent(svc->name())},
          {"svcraw", svc->name()},
          {"method", m->name()},
          {"handler", SafeIdent(m->name())},
          {"full", absl::StrCat(svc->full_name(), "/", m->name())},
          {"index", absl::StrCat(index)},
          {"req", CppType(m->input_type())},
          {"resp", CppType(m->output_type())}};
}

class Generator final : public pb::compiler::CodeGenerator {
 public:
  bool Generate(const pb::FileDescriptor* file, const std::string& parameter,
                pb::compiler::GeneratorContext* ctx, std::string* error) const override {
    bool mocks = false;
    for (auto opt : absl::StrSplit(parameter, ',', absl::SkipEmpty())) {
      if (opt == "mocks") {
        mocks = true;
      } else {
        *error = absl::StrCat("unknown option '", opt, "' (known: mocks)");
        return false;
      }
    }
    std::map<uint32_t, std::string> ids;
    for (int s = 0; s < file->service_count(); ++s) {
      const pb::ServiceDescriptor* svc = file->service(s);
      for (int m = 0; m < svc->method_count(); ++m) {
        const std::string& name = svc->method(m)->name();
        if (name == "Service" || name == "Stub") {
          *error = absl::StrCat(svc->full_name(), "/", name, ": a method may not be named ", name,
                                " (the generated class has a member of that name)");
          return false;
        }
        if (name.size() > 6 && name.ends_with("Inline")) {
          const pb::MethodDescriptor* base = svc->FindMethodByName(name.substr(0, name.size() - 6));
          if (base != nullptr && ShapeOf(base) == Shape::kUnary) {
            *error = absl::StrCat(svc->full_name(), "/", name, ": a method may not be named ", name, " (the generated Service ",
                                  "has a member of that name: the inline fast path of ", base->name(), ")");
            return false;
          }
        }
        std::string full = absl::StrCat(svc->full_name(), "/", name);
        auto [it, inserted] = ids.emplace(rdmarpc::MethodId(full), full);
        if (!inserted) {
          *error = absl::StrCat("method id collision between ", it->second, " and ", full,
                                ": rename one of them");
          return false;
        }
      }
    }
    const std::string base = StripProto(file->name());
    WriteHeader(file, base, ctx);
    WriteSource(file, base, ctx);
    if (mocks) WriteMocks(file, base, ctx);
    return true;
  }

 private:
  static void OpenNamespace(pb::io::Printer& p, const pb::FileDescriptor* file) {
    const std::string ns = CppNamespace(file->package());
    if (!ns.empty()) p.Print("namespace $ns$ {\n\n", "ns", ns);
  }
  static void CloseNamespace(pb::io::Printer& p, const pb::FileDescriptor* file) {
    const std::string ns = CppNamespace(file->package());
    if (!ns.empty()) p.Print("}  // namespace $ns$\n", "ns", ns);
  }

  static void WriteHeader(const pb::FileDescriptor* file, const std::string& base,
                          pb::compiler::GeneratorContext* ctx) {
    std::unique_ptr<pb::io::ZeroCopyOutputStream> out(ctx->Open(base + ".rdmarpc.pb.h"));
    pb::io::Printer p(out.get(), '$');
    p.Print("// Generated by protoc-gen-rdmarpc from $file$. DO NOT EDIT.\n#pragma once\n\n",
            "file", file->name());
    p.Print("#include <cstdint>\n#include <memory>\n#include <optional>\n#include <span>\n#include <string_view>\n#include <utility>\n\n");
    p.Print("#include <boost/asio/awaitable.hpp>\n\n#include \"$base$.pb.h\"\n", "base", base);
    p.Print("#include \"rpc/call.h\"\n#include \"rpc/context.h\"\n#include \"rpc/method_id.h\"\n"
            "#include \"rpc/service.h\"\n#include \"rpc/status.h\"\n#include \"rpc/stream.h\"\n"
            "#include \"rpc/stub_support.h\"\n\n");
    OpenNamespace(p, file);
    for (int s = 0; s < file->service_count(); ++s) {
      const pb::ServiceDescriptor* svc = file->service(s);
      p.Print("class $name$ final {\n public:\n", "name", SafeIdent(svc->name()));
      p.Print("  static constexpr std::string_view kServiceName = \"$full$\";\n", "full",
              svc->full_name());
      p.Print("  // Method ids: rdmarpc::MethodId(\"$full$/<Method>\").\n", "full", svc->full_name());
      p.Print("  enum MethodIds : uint32_t {\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        const std::string full = absl::StrCat(svc->full_name(), "/", svc->method(m)->name());
        p.Print("    k$m$Id = $id$u,\n", "m", svc->method(m)->name(), "id",
                absl::StrCat(rdmarpc::MethodId(full)));
      }
      p.Print("  };\n  static constexpr ::rdmarpc::MethodInfo kMethods[] = {\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        const pb::MethodDescriptor* md = svc->method(m);
        p.Print("    {\"$full$\", k$m$Id, $cs$, $ss$},\n", "full",
                absl::StrCat(svc->full_name(), "/", md->name()), "m", md->name(), "cs",
                md->client_streaming() ? "true" : "false", "ss",
                md->server_streaming() ? "true" : "false");
      }
      p.Print("  };\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        const pb::MethodDescriptor* md = svc->method(m);
        p.Print("  using $m$Request = $req$;\n  using $m$Response = $resp$;\n", "m", md->name(),
                "req", CppType(md->input_type()), "resp", CppType(md->output_type()));
      }

      // Service base: one virtual coroutine per method, UNIMPLEMENTED unless overridden.
      p.Print("\n  // Derive, override the methods you serve, and add to an rdmarpc::Server.\n"
              "  class Service : public ::rdmarpc::Service {\n   public:\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        auto v = Vars(svc, svc->method(m), m);
        switch (ShapeOf(svc->method(m))) {
          case Shape::kUnary:
            p.Print(v, "    virtual ::boost::asio::awaitable<::rdmarpc::Status> $handler$(\n"
                       "        ::rdmarpc::ServerContext& context, const $req$& request, $resp$& response);\n"
                       "    // Tried first for every call, inline on the server's executor: return a\n"
                       "    // Status to answer the call at once (no coroutine, no timer); return\n"
                       "    // std::nullopt (the default) to run $handler$() for it. Must not block.\n"
                       "    virtual std::optional<::rdmarpc::Status> $method$Inline(\n"
                       "        ::rdmarpc::ServerContext& context, const $req$& request, $resp$& response);\n");
            break;
          case Shape::kServerStream:
            p.Print(v, "    virtual ::boost::asio::awaitable<::rdmarpc::Status> $handler$(\n"
                       "        ::rdmarpc::ServerContext& context, const $req$& request,\n"
                       "        ::rdmarpc::ServerWriter<$resp$>& writer);\n");
            break;
          case Shape::kClientStream:
            p.Print(v, "    virtual ::boost::asio::awaitable<::rdmarpc::Status> $handler$(\n"
                       "        ::rdmarpc::ServerContext& context, ::rdmarpc::ServerReader<$req$>& reader,\n"
                       "        $resp$& response);\n");
            break;
          case Shape::kBidi:
            p.Print(v, "    virtual ::boost::asio::awaitable<::rdmarpc::Status> $handler$(\n"
                       "        ::rdmarpc::ServerContext& context,\n"
                       "        ::rdmarpc::ServerReaderWriter<$resp$, $req$>& stream);\n");
            break;
        }
      }
      p.Print("\n    std::string_view service_name() const override { return kServiceName; }\n"
              "    std::span<const ::rdmarpc::Service::Method> methods() const override;\n  };\n");

      // Stub: async_<Method> for any completion token.
      p.Print("\n  // Client side. Any Asio completion token: use_awaitable, deferred, use_future,\n"
              "  // a callback, as_tuple(...), bind_cancellation_slot(...). The context must stay\n"
              "  // alive until the call completes; the request until the operation is launched\n"
              "  // (at once, or when a deferred operation is started).\n"
              "  class Stub {\n   public:\n"
              "    explicit Stub(std::shared_ptr<::rdmarpc::ChannelInterface> channel) : channel_(std::move(channel)) {}\n"
              "    const std::shared_ptr<::rdmarpc::ChannelInterface>& channel() const { return channel_; }\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        auto v = Vars(svc, svc->method(m), m);
        switch (ShapeOf(svc->method(m))) {
          case Shape::kUnary:
            p.Print(v,
                    "\n    // $full$: completes with (error_code, $resp$).\n"
                    "    template <typename CompletionToken>\n"
                    "    auto async_$method$(::rdmarpc::ClientContext& context, const $req$& request,\n"
                    "                        CompletionToken&& token) {\n"
                    "      return ::rdmarpc::internal::AsyncUnary<$resp$>(channel_, context, kMethods[$index$], request,\n"
                    "                                                      std::forward<CompletionToken>(token));\n"
                    "    }\n"
                    "    // Into a response object the caller owns: completes with (error_code).\n"
                    "    template <typename CompletionToken>\n"
                    "    auto async_$method$(::rdmarpc::ClientContext& context, const $req$& request,\n"
                    "                        $resp$& response, CompletionToken&& token) {\n"
                    "      return ::rdmarpc::internal::AsyncUnaryInto(channel_, context, kMethods[$index$], request,\n"
                    "                                                  response, std::forward<CompletionToken>(token));\n"
                    "    }\n");
            break;
          case Shape::kServerStream:
            p.Print(v,
                    "\n    // $full$ (server streaming): completes with (error_code, ClientReader<$resp$>)\n"
                    "    // once the stream is open; read until eof (rpc/stream.h).\n"
                    "    template <typename CompletionToken>\n"
                    "    auto async_$method$(::rdmarpc::ClientContext& context, const $req$& request,\n"
                    "                        CompletionToken&& token) {\n"
                    "      return ::rdmarpc::internal::AsyncOpenStream<::rdmarpc::ClientReader<$resp$>>(\n"
                    "          channel_, context, kMethods[$index$], &request, std::forward<CompletionToken>(token));\n"
                    "    }\n");
            break;
          case Shape::kClientStream:
            p.Print(v,
                    "\n    // $full$ (client streaming): completes with (error_code, ClientWriter<$req$, $resp$>).\n"
                    "    template <typename CompletionToken>\n"
                    "    auto async_$method$(::rdmarpc::ClientContext& context, CompletionToken&& token) {\n"
                    "      return ::rdmarpc::internal::AsyncOpenStream<::rdmarpc::ClientWriter<$req$, $resp$>>(\n"
                    "          channel_, context, kMethods[$index$], nullptr, std::forward<CompletionToken>(token));\n"
                    "    }\n");
            break;
          case Shape::kBidi:
            p.Print(v,
                    "\n    // $full$ (bidirectional): completes with (error_code, ClientReaderWriter<$req$, $resp$>).\n"
                    "    template <typename CompletionToken>\n"
                    "    auto async_$method$(::rdmarpc::ClientContext& context, CompletionToken&& token) {\n"
                    "      return ::rdmarpc::internal::AsyncOpenStream<\n"
                    "          ::rdmarpc::ClientReaderWriter<$req$, $resp$>>(\n"
                    "          channel_, context, kMethods[$index$], nullptr, std::forward<CompletionToken>(token));\n"
                    "    }\n");
            break;
        }
      }
      p.Print("\n   private:\n    std::shared_ptr<::rdmarpc::ChannelInterface> channel_;\n  };\n");
      p.Print("};\n\n");
    }
    CloseNamespace(p, file);
  }

  static void WriteSource(const pb::FileDescriptor* file, const std::string& base,
                          pb::compiler::GeneratorContext* ctx) {
    std::unique_ptr<pb::io::ZeroCopyOutputStream> out(ctx->Open(base + ".rdmarpc.pb.cc"));
    pb::io::Printer p(out.get(), '$');
    p.Print("// Generated by protoc-gen-rdmarpc from $file$. DO NOT EDIT.\n", "file", file->name());
    p.Print("#include \"$base$.rdmarpc.pb.h\"\n\n", "base", base);
    OpenNamespace(p, file);
    for (int s = 0; s < file->service_count(); ++s) {
      const pb::ServiceDescriptor* svc = file->service(s);
      p.Print("namespace {\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        auto v = Vars(svc, svc->method(m), m);
        p.Print(v, "const ::google::protobuf::MessageLite& $svcraw$_$method$_Request() { return $req$::default_instance(); }\n"
                   "const ::google::protobuf::MessageLite& $svcraw$_$method$_Response() { return $resp$::default_instance(); }\n");
        if (ShapeOf(svc->method(m)) == Shape::kUnary)
          p.Print(v, "::boost::asio::awaitable<::rdmarpc::Status> $svcraw$_$method$_Invoke(\n"
                     "    ::rdmarpc::Service& service, ::rdmarpc::ServerContext& context,\n"
                     "    const ::google::protobuf::MessageLite& request, ::google::protobuf::MessageLite& response) {\n"
                     "  return static_cast<$service$::Service&>(service).$handler$(\n"
                     "      context, static_cast<const $req$&>(request), static_cast<$resp$&>(response));\n"
                     "}\n"
                     "std::optional<::rdmarpc::Status> $svcraw$_$method$_Inline(\n"
                     "    ::rdmarpc::Service& service, ::rdmarpc::ServerContext& context,\n"
                     "    const ::google::protobuf::MessageLite& request, ::google::protobuf::MessageLite& response) {\n"
                     "  return static_cast<$service$::Service&>(service).$method$Inline(\n"
                     "      context, static_cast<const $req$&>(request), static_cast<$resp$&>(response));\n"
                     "}\n");
        const char* stream_head =
            "::boost::asio::awaitable<::rdmarpc::Status> $svcraw$_$method$_Stream(\n"
            "    ::rdmarpc::Service& service, ::rdmarpc::ServerContext& context,\n"
            "    [[maybe_unused]] const ::google::protobuf::MessageLite& request,\n"
            "    [[maybe_unused]] ::google::protobuf::MessageLite& response,\n"
            "    std::shared_ptr<::rdmarpc::internal::StreamCore> stream) {\n";
        switch (ShapeOf(svc->method(m))) {
          case Shape::kUnary:
            break;
          case Shape::kServerStream:
            p.Print(v, stream_head);
            p.Print(v, "  ::rdmarpc::ServerWriter<$resp$> writer(std::move(stream));\n"
                       "  co_return co_await static_cast<$service$::Service&>(service).$handler$(\n"
                       "      context, static_cast<const $req$&>(request), writer);\n}\n");
            break;
          case Shape::kClientStream:
            p.Print(v, stream_head);
            p.Print(v, "  ::rdmarpc::ServerReader<$req$> reader(std::move(stream));\n"
                       "  co_return co_await static_cast<$service$::Service&>(service).$handler$(\n"
                       "      context, reader, static_cast<$resp$&>(response));\n}\n");
            break;
          case Shape::kBidi:
            p.Print(v, stream_head);
            p.Print(v, "  ::rdmarpc::ServerReaderWriter<$resp$, $req$> rw(std::move(stream));\n"
                       "  co_return co_await static_cast<$service$::Service&>(service).$handler$(context, rw);\n}\n");
            break;
        }
      }
      p.Print("}  // namespace\n\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        auto v = Vars(svc, svc->method(m), m);
        switch (ShapeOf(svc->method(m))) {
          case Shape::kUnary:
            p.Print(v, "::boost::asio::awaitable<::rdmarpc::Status> $service$::Service::$handler$(\n"
                       "    ::rdmarpc::ServerContext&, const $req$&, $resp$&) {\n");
            break;
          case Shape::kServerStream:
            p.Print(v, "::boost::asio::awaitable<::rdmarpc::Status> $service$::Service::$handler$(\n"
                       "    ::rdmarpc::ServerContext&, const $req$&, ::rdmarpc::ServerWriter<$resp$>&) {\n");
            break;
          case Shape::kClientStream:
            p.Print(v, "::boost::asio::awaitable<::rdmarpc::Status> $service$::Service::$handler$(\n"
                       "    ::rdmarpc::ServerContext&, ::rdmarpc::ServerReader<$req$>&, $resp$&) {\n");
            break;
          case Shape::kBidi:
            p.Print(v, "::boost::asio::awaitable<::rdmarpc::Status> $service$::Service::$handler$(\n"
                       "    ::rdmarpc::ServerContext&, ::rdmarpc::ServerReaderWriter<$resp$, $req$>&) {\n");
            break;
        }
        p.Print(v, "  co_return ::rdmarpc::UnimplementedError(\"$full$ is not implemented by this server\");\n}\n\n");
        if (ShapeOf(svc->method(m)) == Shape::kUnary)
          p.Print(v, "std::optional<::rdmarpc::Status> $service$::Service::$method$Inline(\n"
                     "    ::rdmarpc::ServerContext&, const $req$&, $resp$&) {\n  return std::nullopt;\n}\n\n");
      }
      p.Print("std::span<const ::rdmarpc::Service::Method> $service$::Service::methods() const {\n"
              "  static const ::rdmarpc::Service::Method kTable[] = {\n",
              "service", SafeIdent(svc->name()));
      for (int m = 0; m < svc->method_count(); ++m) {
        auto v = Vars(svc, svc->method(m), m);
        const bool unary = ShapeOf(svc->method(m)) == Shape::kUnary;
        v["invoke"] = unary ? absl::StrCat("&", svc->name(), "_", svc->method(m)->name(), "_Invoke") : "nullptr";
        v["stream"] = unary ? "nullptr" : absl::StrCat("&", svc->name(), "_", svc->method(m)->name(), "_Stream");
        v["inline"] = unary ? absl::StrCat("&", svc->name(), "_", svc->method(m)->name(), "_Inline") : "nullptr";
        p.Print(v, "      {kMethods[$index$], &$svcraw$_$method$_Request, &$svcraw$_$method$_Response, $invoke$, $stream$,\n"
                   "       $inline$},\n");
      }
      p.Print("  };\n  return kTable;\n}\n\n");
    }
    CloseNamespace(p, file);
  }

  // gmock mocks: Mock<Service>Stub is a ChannelInterface whose unary methods
  // are MOCK_METHODs; give it to a real Stub to test client code offline.
  static void WriteMocks(const pb::FileDescriptor* file, const std::string& base,
                         pb::compiler::GeneratorContext* ctx) {
    std::unique_ptr<pb::io::ZeroCopyOutputStream> out(ctx->Open(base + "_mock.rdmarpc.pb.h"));
    pb::io::Printer p(out.get(), '$');
    p.Print("// Generated by protoc-gen-rdmarpc from $file$. DO NOT EDIT.\n#pragma once\n\n", "file", file->name());
    p.Print("#include <string>\n#include <utility>\n\n#include <boost/asio/any_io_executor.hpp>\n"
            "#include <boost/asio/post.hpp>\n#include <gmock/gmock.h>\n\n#include \"$base$.rdmarpc.pb.h\"\n\n",
            "base", base);
    OpenNamespace(p, file);
    for (int s = 0; s < file->service_count(); ++s) {
      const pb::ServiceDescriptor* svc = file->service(s);
      p.Print("// Use as: auto mock = std::make_shared<Mock$svc$Stub>(executor); $service$::Stub stub(mock);\n"
              "class Mock$svc$Stub : public ::rdmarpc::ChannelInterface {\n public:\n"
              "  explicit Mock$svc$Stub(::boost::asio::any_io_executor executor) : executor_(std::move(executor)) {}\n\n",
              "svc", svc->name(), "service", SafeIdent(svc->name()));
      for (int m = 0; m < svc->method_count(); ++m) {
        if (ShapeOf(svc->method(m)) != Shape::kUnary) continue;
        p.Print(Vars(svc, svc->method(m), m),
                "  MOCK_METHOD(::rdmarpc::Status, $handler$,\n"
                "              (::rdmarpc::ClientContext& context, const $req$& request, $resp$* response));\n");
      }
      p.Print("\n  void StartCall(::rdmarpc::ClientContext& context, const ::rdmarpc::MethodInfo& method,\n"
              "                 const ::google::protobuf::MessageLite& request, ::rdmarpc::CallHandler handler) override {\n"
              "    ::rdmarpc::Status status;\n    std::string bytes;\n    switch (method.id) {\n");
      for (int m = 0; m < svc->method_count(); ++m) {
        if (ShapeOf(svc->method(m)) != Shape::kUnary) continue;
        p.Print(Vars(svc, svc->method(m), m),
                "      case $service$::k$method$Id: {\n"
                "        $resp$ response;\n"
                "        status = $handler$(context, static_cast<const $req$&>(request), &response);\n"
                "        if (status.ok()) bytes = response.SerializeAsString();\n"
                "        break;\n      }\n");
      }
      p.Print("      default:\n"
              "        status = ::rdmarpc::UnimplementedError(std::string(method.full_name) + \" is not mocked\");\n"
              "    }\n"
              "    ::boost::asio::post(executor_, [&context, status = std::move(status), bytes = std::move(bytes),\n"
              "                                    h = std::move(handler)]() mutable {\n"
              "      context.SetResult(status);\n"
              "      std::move(h)(::rdmarpc::make_error_code(status.code()), ::rdmarpc::ResponsePayload(std::move(bytes)));\n"
              "    });\n  }\n"
              "  ::boost::asio::any_io_executor get_executor() const override { return executor_; }\n\n"
              " private:\n  ::boost::asio::any_io_executor executor_;\n};\n\n");
    }
    CloseNamespace(p, file);
  }
};

}  // namespace

int main(int argc, char* argv[]) {
  Generator generator;
  return pb::compiler::PluginMain(argc, argv, &generator);
}
