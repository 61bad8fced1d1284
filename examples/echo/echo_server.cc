// echo_server: serves rdmarpc.examples.Echo on every --listen URI.
//
//   echo_server --listen tcp://0.0.0.0:7000 [--listen rdma://10.0.0.1:7001]
//               [--device rxe0] [--poll event|adaptive|busy] [--uri-file F]
//
// Prints the URIs it listens on (ports resolved when 0 was asked for), writes
// them to --uri-file if given (one per line, for scripts and tests), and shuts
// down gracefully on SIGINT/SIGTERM: in-flight calls finish, new ones are
// refused, then it exits 0.
#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstdio>
#include <fstream>

#include "examples/common/flags.h"
#include "rdmarpc/examples/echo.rdmarpc.pb.h"
#include "rpc/server.h"

namespace asio = boost::asio;
using namespace rdmarpc;
using rdmarpc::examples::EchoReply;
using rdmarpc::examples::EchoRequest;

namespace {

constexpr const char* kUsage =
    "usage: echo_server --listen URI [--listen URI]... [--device NAME] [--poll event|adaptive|busy]\n"
    "                   [--uri-file FILE]\n"
    "  URI: tcp://HOST:PORT or rdma://HOST:PORT (PORT 0 picks a free port)\n";

class EchoImpl final : public rdmarpc::examples::Echo::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext& ctx, const EchoRequest& req, EchoReply& reply) override {
    if (req.delay_ms() > 0) {
      asio::steady_timer timer(co_await asio::this_coro::executor, std::chrono::milliseconds(req.delay_ms()));
      co_await timer.async_wait(asio::use_awaitable);  // throws if the call is cancelled
    }
    reply.set_payload(req.payload());
    reply.set_served_by(ctx.peer());
    co_return Status();
  }
};

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv, {"listen", "device", "poll", "uri-file"}, kUsage)) return flags.help() ? 0 : 2;
  if (flags.All("listen").empty()) {
    std::fprintf(stderr, "echo_server: give at least one --listen URI\n%s", kUsage);
    return 2;
  }
  ServerOptions options;
  options.listen = flags.All("listen");
  options.transport.rdma_device.name = flags.Get("device");
  if (auto poll = flags.Get("poll"); !poll.empty()) {
    auto mode = rdma::ParsePollMode(poll);
    if (!mode.ok()) {
      std::fprintf(stderr, "echo_server: --poll: %s\n", std::string(mode.status().message()).c_str());
      return 2;
    }
    options.transport.rdma.poll_mode = *mode;
  }

  asio::io_context io;
  EchoImpl service;
  Server server(io.get_executor(), options);
  if (Status st = server.AddService(service); !st.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", st.ToString().c_str());
    return 1;
  }
  if (Status st = server.Start(); !st.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", st.ToString().c_str());
    return 1;
  }
  std::ofstream uri_file;
  if (auto f = flags.Get("uri-file"); !f.empty()) uri_file.open(f + ".tmp");
  for (const auto& uri : server.local_uris()) {
    std::printf("echo_server: listening on %s\n", uri.c_str());
    if (uri_file.is_open()) uri_file << uri << "\n";
  }
  std::fflush(stdout);
  if (uri_file.is_open()) {
    uri_file.close();
    std::rename((flags.Get("uri-file") + ".tmp").c_str(), flags.Get("uri-file").c_str());  // appears whole
  }

  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    std::printf("echo_server: signal %d, draining\n", sig);
    server.async_shutdown(std::chrono::seconds(5), [&] {
      std::printf("echo_server: stopped\n");
      io.stop();
    });
  });
  io.run();
  return 0;
}
