// echo_client: calls rdmarpc.examples.Echo and prints latency percentiles.
//
//   echo_client --target tcp://127.0.0.1:7000 [--count 1000] [--size 64]
//               [--concurrency 1] [--timeout-ms 5000] [--device rxe0]
//
// Exit status 0 if every call succeeded; otherwise 1, with the first error.
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "examples/common/flags.h"
#include "rdmarpc/examples/echo.rdmarpc.pb.h"
#include "rpc/channel.h"

namespace asio = boost::asio;
using namespace rdmarpc;
using rdmarpc::examples::Echo;
using rdmarpc::examples::EchoReply;
using rdmarpc::examples::EchoRequest;

namespace {

constexpr const char* kUsage =
    "usage: echo_client --target URI [--count N] [--size BYTES] [--concurrency N] [--timeout-ms MS]\n"
    "                   [--delay-ms MS] [--device NAME]\n";

struct Run {
  unsigned long long count, size, concurrency, timeout_ms, delay_ms;
  std::vector<double> us;
  unsigned long long failed = 0;
  std::string first_error;
};

asio::awaitable<void> Worker(Echo::Stub& stub, Run& run, unsigned long long& next) {
  EchoRequest req;
  req.set_payload(std::string(run.size, 'x'));
  req.set_delay_ms(static_cast<uint32_t>(run.delay_ms));
  EchoReply reply;
  while (next < run.count) {
    ++next;
    ClientContext ctx;
    ctx.set_timeout(std::chrono::milliseconds(run.timeout_ms));
    auto t0 = Clock::now();
    auto [ec] = co_await stub.async_Echo(ctx, req, reply, asio::as_tuple(asio::use_awaitable));
    auto t1 = Clock::now();
    if (ec || reply.payload().size() != run.size) {
      if (run.failed++ == 0) run.first_error = ec ? ctx.status().ToString() : "payload size mismatch";
      continue;
    }
    run.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
}

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv, {"target", "count", "size", "concurrency", "timeout-ms", "delay-ms", "device"}, kUsage))
    return flags.help() ? 0 : 2;
  Run run{};
  if (!flags.GetUint("count", 1000, &run.count) || !flags.GetUint("size", 64, &run.size) ||
      !flags.GetUint("concurrency", 1, &run.concurrency) || !flags.GetUint("timeout-ms", 5000, &run.timeout_ms) ||
      !flags.GetUint("delay-ms", 0, &run.delay_ms))
    return 2;
  if (flags.Get("target").empty() || run.concurrency == 0) {
    std::fprintf(stderr, "echo_client: --target is required and --concurrency must be > 0\n%s", kUsage);
    return 2;
  }
  asio::io_context io;
  ChannelOptions options;
  options.transport.rdma_device.name = flags.Get("device");
  auto channel = Channel::Create(io.get_executor(), flags.Get("target"), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "echo_client: %s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  Echo::Stub stub(*channel);
  unsigned long long next = 0, running = run.concurrency;
  for (unsigned long long i = 0; i < run.concurrency; ++i)
    asio::co_spawn(io, Worker(stub, run, next), [&](std::exception_ptr) {
      if (--running == 0) (*channel)->Close();  // lets io.run() return
    });
  auto start = Clock::now();
  io.run();
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  if (!run.us.empty()) {
    std::sort(run.us.begin(), run.us.end());
    auto pct = [&](double p) { return run.us[static_cast<size_t>(p * static_cast<double>(run.us.size() - 1))]; };
    std::printf("echo_client: %s  %zu calls of %llu B, concurrency %llu: p50 %.1f us  p99 %.1f us  max %.1f us  "
                "%.0f calls/s\n",
                flags.Get("target").c_str(), run.us.size(), run.size, run.concurrency, pct(0.5), pct(0.99),
                run.us.back(), static_cast<double>(run.us.size()) / secs);
  }
  if (run.failed > 0) {
    std::fprintf(stderr, "echo_client: %llu of %llu calls failed; first: %s\n", run.failed, run.count,
                 run.first_error.c_str());
    return 1;
  }
  return 0;
}
