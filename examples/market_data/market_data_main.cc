// Market-data fanout over rdmarpc: one publisher, many subscribers.
//
//   market_data [--transport tcp,rdma] [--subscribers 4] [--ticks 100000]
//               [--rate 20000] [--burst 0] [--symbols 100] [--policy block]
//       both ends in this process (the default): per-subscriber latency
//       (publish to receipt) and gaps, for each transport, side by side.
//   market_data --role publisher --listen tcp://0.0.0.0:7100 --wait-subscribers 2 [feed flags]
//   market_data --role subscriber --connect tcp://host:7100 [--policy drop_oldest]
//               [--queue-limit 1024] [--pause-us 0] [--stop-after 0]
//
// rdma:// needs a local address on an RDMA device's netdev: --ip (tools/rxe-vm
// exports RXE_VM_SELF_IP, and the VM's device as RXE_VM_DEV).
#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <future>
#include <thread>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include "absl/strings/str_split.h"
#include "examples/common/flags.h"
#include "examples/market_data/market_data.h"

namespace md = rdmarpc::examples::md;
namespace asio = boost::asio;

namespace {

const char kUsage[] =
    "usage: market_data [--role local|publisher|subscriber] [--transport tcp,rdma] [--ip LOCAL_IP]\n"
    "         [--device NAME] [--subscribers N] [--ticks N] [--rate TICKS_PER_S] [--burst N]\n"
    "         [--symbols N] [--tick-bytes 64] [--policy block|drop_oldest|conflate] [--queue-limit N]\n"
    "         [--listen URI] [--wait-subscribers N] [--connect URI] [--pause-us N] [--stop-after N]\n";

int Fail(const std::string& what) {
  std::fprintf(stderr, "market_data: %s\n", what.c_str());
  return 1;
}

void PrintSubscriber(const char* label, int i, md::SubscriberResult& r) {
  const double p50 = md::PercentileUs(r.latency_ns, 0.50), p99 = md::PercentileUs(r.latency_ns, 0.99),
               p999 = md::PercentileUs(r.latency_ns, 0.999), max = md::PercentileUs(r.latency_ns, 1.0);
  std::printf("%-5s %4d %10llu %8llu %6llu %9.1f %9.1f %9.1f %9.1f  %s\n", label, i,
              (unsigned long long)r.ticks, (unsigned long long)r.missed, (unsigned long long)r.out_of_order, p50,
              p99, p999, max, r.status.ok() ? "OK" : r.status.ToString().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv,
                   {"role", "transport", "ip", "device", "subscribers", "ticks", "rate", "burst", "symbols",
                    "tick-bytes", "policy", "queue-limit", "listen", "wait-subscribers", "connect", "pause-us",
                    "stop-after"},
                   kUsage))
    return flags.help() ? 0 : 2;
  unsigned long long subscribers, ticks, rate, burst, symbols, tick_bytes, queue_limit, wait_subs, pause_us, stop_after;
  if (!flags.GetUint("subscribers", 4, &subscribers) || !flags.GetUint("ticks", 100'000, &ticks) ||
      !flags.GetUint("rate", 20'000, &rate) || !flags.GetUint("burst", 0, &burst) ||
      !flags.GetUint("symbols", 100, &symbols) || !flags.GetUint("tick-bytes", 64, &tick_bytes) ||
      !flags.GetUint("queue-limit", 1024, &queue_limit) || !flags.GetUint("wait-subscribers", 1, &wait_subs) ||
      !flags.GetUint("pause-us", 0, &pause_us) || !flags.GetUint("stop-after", 0, &stop_after))
    return 2;
  const std::string policy = flags.Get("policy", "block");
  if (auto p = rdmarpc::ParseSlowConsumerPolicy(policy); !p.ok()) return Fail(std::string(p.status().message()));
  md::FeedOptions feed;
  feed.symbols = uint32_t(symbols);
  feed.ticks = ticks;
  feed.rate = rate;
  feed.burst = uint32_t(burst);
  feed.tick_bytes = tick_bytes;
  md::SubscriberOptions sub;
  sub.policy = policy;
  sub.queue_limit = uint32_t(queue_limit);
  sub.pause = std::chrono::microseconds(pause_us);
  sub.stop_after = stop_after;
  const char* env_ip = std::getenv("RXE_VM_SELF_IP");
  const char* env_dev = std::getenv("RXE_VM_DEV");
  const std::string ip = flags.Get("ip", env_ip ? env_ip : "");
  rdmarpc::TransportOptions transport;
  transport.rdma_device.name = flags.Get("device", env_dev ? env_dev : "");
  const std::string role = flags.Get("role", "local");

  if (role == "local") {
    std::vector<std::string> transports =
        absl::StrSplit(flags.Get("transport", ip.empty() ? "tcp" : "rdma,tcp"), ',', absl::SkipEmpty());
    std::printf("market data: 1 publisher, %llu subscribers, %llu ticks of %llu B over %llu symbols, %s, policy %s\n",
                subscribers, ticks, tick_bytes, symbols,
                rate == 0 ? "as fast as backpressure allows" : (std::to_string(rate) + " ticks/s").c_str(),
                policy.c_str());
    std::printf("latency = publisher's clock at publish to the subscriber's read completion, us\n\n");
    std::printf("%-5s %4s %10s %8s %6s %9s %9s %9s %9s  %s\n", "via", "sub", "ticks", "missed", "order", "p50",
                "p99", "p99.9", "max", "end");
    for (const std::string& t : transports) {
      md::LocalRunOptions o;
      if (t == "tcp") {
        o.listen_uri = "tcp://127.0.0.1:0";
      } else if (t == "rdma") {
        if (ip.empty()) return Fail("--transport rdma needs --ip (a local address on the RDMA device's netdev)");
        o.listen_uri = "rdma://" + ip + ":0";
      } else {
        return Fail("--transport: unknown '" + t + "' (tcp, rdma)");
      }
      o.transport = transport;
      o.subscribers = int(subscribers);
      o.feed = feed;
      o.subscriber = sub;
      o.queue_limit = uint32_t(queue_limit);
      auto r = md::RunLocal(o);
      if (!r.status.ok()) return Fail(t + ": " + r.status.ToString());
      for (size_t i = 0; i < r.subscribers.size(); ++i) PrintSubscriber(t.c_str(), int(i), r.subscribers[i]);
      std::printf("%-5s publisher: %llu ticks in %.2f s (%.0f ticks/s), %llu copies sent, %llu dropped, "
                  "%llu publishes waited for a blocking subscriber\n\n",
                  t.c_str(), (unsigned long long)r.feed.published, r.feed.seconds,
                  r.feed.seconds > 0 ? double(r.feed.published) / r.feed.seconds : 0.0,
                  (unsigned long long)r.publisher.sent, (unsigned long long)r.publisher.dropped,
                  (unsigned long long)r.publisher.publishes_blocked);
    }
    return 0;
  }

  asio::io_context io;
  if (role == "publisher") {
    const std::string listen = flags.Get("listen");
    if (listen.empty()) return Fail("--role publisher needs --listen URI (tcp://0.0.0.0:7100, rdma://IP:7100)");
    rdmarpc::Publisher<rdmarpc::examples::Tick> publisher(io.get_executor());
    md::Service service(publisher, uint32_t(queue_limit));
    rdmarpc::ServerOptions so;
    so.listen = {listen};
    so.transport = transport;
    rdmarpc::Server server(io.get_executor(), so);
    if (auto st = server.AddService(service); !st.ok()) return Fail(st.ToString());
    if (auto st = server.Start(); !st.ok()) return Fail(st.ToString());
    std::printf("publishing on %s once %llu subscribers are attached\n", server.local_uris().at(0).c_str(), wait_subs);
    std::fflush(stdout);
    std::future<md::FeedResult> result;
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      asio::steady_timer t(io);
      while (publisher.stats().subscribers < wait_subs) {
        t.expires_after(std::chrono::milliseconds(10));
        co_await t.async_wait(asio::use_awaitable);
      }
      auto r = co_await md::RunFeed(publisher, feed);
      std::printf("published %llu ticks in %.2f s; %llu copies sent, %llu dropped\n", (unsigned long long)r.published,
                  r.seconds, (unsigned long long)publisher.stats().sent, (unsigned long long)publisher.stats().dropped);
      publisher.Close();
      co_await server.async_shutdown(std::chrono::seconds(5), asio::use_awaitable);
    }, asio::detached);
    io.run();
    return 0;
  }
  if (role == "subscriber") {
    const std::string connect = flags.Get("connect");
    if (connect.empty()) return Fail("--role subscriber needs --connect URI");
    rdmarpc::ChannelOptions co;
    co.transport = transport;
    auto channel = rdmarpc::Channel::Create(io.get_executor(), connect, co);
    if (!channel.ok()) return Fail(channel.status().ToString());
    auto fut = asio::co_spawn(io, md::RunSubscriber(*channel, sub), asio::use_future);
    std::thread t([&] { io.run(); });
    auto r = fut.get();
    (*channel)->Close();
    t.join();
    std::printf("%-5s %4s %10s %8s %6s %9s %9s %9s %9s  %s\n", "via", "sub", "ticks", "missed", "order", "p50",
                "p99", "p99.9", "max", "end");
    PrintSubscriber(connect.substr(0, connect.find(':')).c_str(), 0, r);
    return r.status.ok() || r.status.code() == rdmarpc::StatusCode::kCancelled ? 0 : 1;
  }
  return Fail("--role: unknown '" + role + "' (local, publisher, subscriber)");
}
