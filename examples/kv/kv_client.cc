// kv_client: one command against a kv_server.
//
//   kv_client --target URI put KEY VALUE [--if-version N]
//   kv_client --target URI get KEY
//   kv_client --target URI delete KEY
//
// Prints the result; exit status 0 on OK, 1 on an RPC error (printed with its
// status code, e.g. NOT_FOUND), 2 on bad usage.
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstdio>

#include "examples/common/flags.h"
#include "rdmarpc/examples/kv.rdmarpc.pb.h"
#include "rpc/channel.h"

namespace asio = boost::asio;
using namespace rdmarpc;
namespace ex = rdmarpc::examples;

namespace {

constexpr const char* kUsage =
    "usage: kv_client --target URI (get KEY | put KEY VALUE [--if-version N] | delete KEY)\n"
    "                 [--timeout-ms MS] [--device NAME]\n";

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv, {"target", "if-version", "timeout-ms", "device"}, kUsage)) return flags.help() ? 0 : 2;
  const auto& args = flags.positional();
  unsigned long long if_version = 0, timeout_ms = 0;
  if (!flags.GetUint("if-version", 0, &if_version) || !flags.GetUint("timeout-ms", 5000, &timeout_ms)) return 2;
  const bool ok_shape = !args.empty() && ((args[0] == "get" && args.size() == 2) ||
                                          (args[0] == "put" && args.size() == 3) ||
                                          (args[0] == "delete" && args.size() == 2));
  if (flags.Get("target").empty() || !ok_shape) {
    std::fprintf(stderr, "kv_client: bad command line\n%s", kUsage);
    return 2;
  }
  asio::io_context io;
  ChannelOptions options;
  options.transport.rdma_device.name = flags.Get("device");
  auto channel = Channel::Create(io.get_executor(), flags.Get("target"), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "kv_client: %s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  ex::Kv::Stub stub(*channel);
  int rc = 0;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        ClientContext ctx;
        ctx.set_timeout(std::chrono::milliseconds(timeout_ms));
        boost::system::error_code ec;
        if (args[0] == "get") {
          ex::GetRequest req;
          req.set_key(args[1]);
          auto [e, reply] = co_await stub.async_Get(ctx, req, asio::as_tuple(asio::use_awaitable));
          ec = e;
          if (!ec) std::printf("%s (version %llu)\n", reply.value().c_str(), static_cast<unsigned long long>(reply.version()));
        } else if (args[0] == "put") {
          ex::PutRequest req;
          req.set_key(args[1]);
          req.set_value(args[2]);
          req.set_if_version(if_version);
          auto [e, reply] = co_await stub.async_Put(ctx, req, asio::as_tuple(asio::use_awaitable));
          ec = e;
          if (!ec) std::printf("ok (version %llu)\n", static_cast<unsigned long long>(reply.version()));
        } else {
          ex::DeleteRequest req;
          req.set_key(args[1]);
          auto [e, reply] = co_await stub.async_Delete(ctx, req, asio::as_tuple(asio::use_awaitable));
          ec = e;
          if (!ec) std::printf("%s\n", reply.existed() ? "deleted" : "absent");
        }
        if (ec) {
          std::fprintf(stderr, "kv_client: %s\n", ctx.status().ToString().c_str());
          rc = 1;
        }
        (*channel)->Close();
      },
      [](std::exception_ptr) {});
  io.run();
  return rc;
}
