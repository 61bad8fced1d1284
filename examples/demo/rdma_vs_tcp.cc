// rdmarpc demo, side by side in one run:
//  1. raw ping-pong over RDMA (RC SEND/RECV through rdma_cm) and over TCP
//     (Asio sockets, TCP_NODELAY): what the wire can do;
//  2. the same echo as an rdmarpc RPC (generated stub and service,
//     rdmarpc.examples.Echo) over rdma:// and tcp://: what the framework
//     adds on top.
//
// Both transports run in this process. The raw ping-pong has client and server
// on separate threads; RDMA busy-polls its completion queue, TCP either blocks
// in recv() (row "tcp", what most TCP code does) or spins on a non-blocking
// recv() (row "tcp-spin", like for like with RDMA's polling). The RPCs run
// client and server each on its own thread and io_context, first with both
// transports event-driven (rows "rpc-rdma", "rpc-tcp": the threads sleep
// between messages), then with both spinning (rows ending "-busy": RDMA busy
// polling run to completion, TCP busy polling, TcpOptions::poll_mode). Compare rows
// that wait the same way: the wake-up of a sleeping thread costs more than
// either transport, inside the VM most of all. Absolute numbers inside the
// Soft-RoCE VM mean nothing; the RDMA/TCP ratio of one run does (and
// exaggerates what real NICs show, see README "Without RDMA hardware").
//
//   rdmarpc_demo [--device rxe0] [--ip 10.77.0.1] [--iters 2000] [--sizes 64,4096]
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "rdmarpc/examples/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/rdma/rc_link.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using rdmarpc::rdma::Device;
using rdmarpc::rdma::RcLink;

namespace {

struct Options {
  std::string device;
  std::string ip;
  int iters = 2000;
  std::vector<size_t> sizes = {64, 4096};
};

struct Row {
  std::string transport;
  size_t size;
  std::vector<double> us;
};

double Pct(std::vector<double>& v, double p) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
  return v[i];
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "rdmarpc_demo: %s\n", what.c_str());
  return 1;
}

// Waits (busy) for one completion; returns false on error or after 10 s.
bool WaitWc(RcLink& link, ibv_wc& wc) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (;;) {
    int n = link.Poll({&wc, 1});
    if (n == 1) {
      if (wc.status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "rdmarpc_demo: completion error: %s\n", ibv_wc_status_str(wc.status));
        return false;
      }
      return true;
    }
    if (n < 0 || Clock::now() > deadline) return false;
  }
}

absl::Status RunRdma(const Options& opt, std::vector<Row>& rows) {
  auto dev = Device::Open({.name = opt.device});
  if (!dev.ok()) return dev.status();
  std::printf("RDMA device %s port %u (%s), max inline asked 64\n", dev->name().c_str(),
              dev->port().port_num, dev->port().attr.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB");
  asio::io_context io;
  auto listener = rdmarpc::rdma::CmListener::Listen(io.get_executor(), opt.ip, 0, {});
  if (!listener.ok()) return listener.status();
  size_t max_size = *std::max_element(opt.sizes.begin(), opt.sizes.end());
  rdmarpc::rdma::RcLinkOptions lo;
  lo.slot_size = std::max<size_t>(max_size, 64);
  lo.send_slots = 4;
  lo.recv_slots = 4;
  absl::StatusOr<std::unique_ptr<RcLink>> server = absl::UnknownError("no accept");
  absl::StatusOr<std::unique_ptr<RcLink>> client = absl::UnknownError("no connect");
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    server = co_await RcLink::Accept(**listener, *dev, lo);
  }, asio::detached);
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    client = co_await RcLink::Connect(io.get_executor(), *dev, opt.ip, (*listener)->port(), lo);
  }, asio::detached);
  io.run_for(std::chrono::seconds(30));
  if (!client.ok()) return client.status();
  if (!server.ok()) return server.status();

  const int total = opt.iters * static_cast<int>(opt.sizes.size()) + 100 * static_cast<int>(opt.sizes.size());
  std::atomic<bool> server_ok{true};
  std::thread echo([&] {
    RcLink& s = **server;
    // A send slot is reused only after its completion is reaped; the client
    // sends its next message only after our echo arrived, so while we wait for
    // a slot no new RECV can complete.
    constexpr int kSlots = 4;
    bool busy[kSlots] = {};
    ibv_wc wc{};
    for (int i = 0; i < total; ++i) {
      do {
        if (!WaitWc(s, wc)) { server_ok = false; return; }
        if (!s.IsRecv(wc)) busy[s.SlotOf(wc)] = false;
      } while (!s.IsRecv(wc));
      const int out = i % kSlots;
      while (busy[out]) {
        ibv_wc sent{};
        if (!WaitWc(s, sent) || s.IsRecv(sent)) { server_ok = false; return; }
        busy[s.SlotOf(sent)] = false;
      }
      const int slot = s.SlotOf(wc);
      std::memcpy(s.send_slot(out).data(), s.recv_slot(slot).data(), wc.byte_len);
      if (!s.PostRecv(slot).ok() || !s.PostSend(out, wc.byte_len).ok()) { server_ok = false; return; }
      busy[out] = true;
    }
  });

  RcLink& c = **client;
  for (size_t size : opt.sizes) {
    Row row{"rdma", size, {}};
    std::memset(c.send_slot(0).data(), 0x5a, size);
    for (int i = -100; i < opt.iters; ++i) {  // 100 warm-up round trips.
      auto t0 = Clock::now();
      if (auto st = c.PostSend(0, size); !st.ok()) { echo.join(); return st; }
      // The echo and our send's completion may be reaped in either order.
      ibv_wc wc{}, echoed{};
      bool got_echo = false, sent = false;
      while (!(got_echo && sent)) {
        if (!WaitWc(c, wc)) { echo.join(); return absl::UnavailableError("RDMA ping-pong stalled"); }
        if (c.IsRecv(wc)) { echoed = wc; got_echo = true; } else { sent = true; }
      }
      auto t1 = Clock::now();
      if (echoed.byte_len != size) { echo.join(); return absl::DataLossError("echo size differs"); }
      if (auto st = c.PostRecv(c.SlotOf(echoed)); !st.ok()) { echo.join(); return st; }
      if (i >= 0) row.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    rows.push_back(std::move(row));
  }
  echo.join();
  if (!server_ok) return absl::UnavailableError("RDMA echo server failed");
  return absl::OkStatus();
}

// Reads exactly buf.size() bytes: blocking in recv(), or spinning on a
// non-blocking one.
void ReadAll(asio::ip::tcp::socket& s, asio::mutable_buffer buf, bool spin, boost::system::error_code& ec) {
  if (!spin) {
    asio::read(s, buf, ec);
    return;
  }
  auto* p = static_cast<char*>(buf.data());
  size_t left = buf.size();
  while (left > 0) {
    const ssize_t n = ::recv(s.native_handle(), p, left, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      left -= static_cast<size_t>(n);
    } else if (n == 0) {
      ec = asio::error::eof;
      return;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      ec = boost::system::error_code(errno, boost::system::system_category());
      return;
    }
  }
}

absl::Status RunTcp(const Options& opt, bool spin, std::vector<Row>& rows) {
  using asio::ip::tcp;
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  tcp::socket client(io);
  client.connect(acceptor.local_endpoint());
  tcp::socket server = acceptor.accept();
  client.set_option(tcp::no_delay(true));
  server.set_option(tcp::no_delay(true));
  const int total = (opt.iters + 100) * static_cast<int>(opt.sizes.size());
  std::thread echo([&] {
    std::vector<char> buf(1 << 20);
    boost::system::error_code ec;
    for (int i = 0; i < total; ++i) {
      uint32_t len = 0;
      ReadAll(server, asio::buffer(&len, 4), spin, ec);
      if (!ec) ReadAll(server, asio::buffer(buf.data(), len), spin, ec);
      std::array<asio::const_buffer, 2> out{asio::buffer(&len, 4), asio::buffer(buf.data(), len)};
      if (!ec) asio::write(server, out, ec);
      if (ec) return;
    }
  });
  std::vector<char> msg(1 << 20, 0x5a), in(1 << 20);
  absl::Status result;
  for (size_t size : opt.sizes) {
    Row row{spin ? "tcp-spin" : "tcp", size, {}};
    for (int i = -100; i < opt.iters && result.ok(); ++i) {
      uint32_t len = static_cast<uint32_t>(size), back = 0;
      auto t0 = Clock::now();
      std::array<asio::const_buffer, 2> out{asio::buffer(&len, 4), asio::buffer(msg.data(), size)};
      boost::system::error_code ec;
      asio::write(client, out, ec);
      if (!ec) ReadAll(client, asio::buffer(&back, 4), spin, ec);
      if (!ec) ReadAll(client, asio::buffer(in.data(), back), spin, ec);
      auto t1 = Clock::now();
      if (ec || back != len) result = absl::UnavailableError("TCP ping-pong failed: " + ec.message());
      if (i >= 0) row.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    rows.push_back(std::move(row));
  }
  echo.join();
  return result;
}

class EchoImpl final : public rdmarpc::examples::Echo::Service {
 public:
  asio::awaitable<rdmarpc::Status> Echo(rdmarpc::ServerContext&, const rdmarpc::examples::EchoRequest& req,
                                        rdmarpc::examples::EchoReply& reply) override {
    reply.set_payload(req.payload());
    co_return rdmarpc::Status();
  }
};

// Unary echo RPCs through the generated stub, client and server each on its
// own thread and io_context (as two processes would be): event-driven (each
// thread sleeps in epoll between messages), or busy (each thread polls its
// CQ, RDMA run to completion, or its socket, TCP busy polling, and never
// sleeps).
absl::Status RunRpc(const Options& opt, const std::string& scheme, bool busy, std::vector<Row>& rows) {
  asio::io_context io;   // the client's: this thread
  asio::io_context sio;  // the server's: its own thread
  EchoImpl service;
  rdmarpc::TransportOptions topts;
  topts.rdma_device.name = opt.device;
  if (busy) {
    topts.rdma.poll_mode = rdmarpc::rdma::PollMode::kBusy;
    topts.rdma.run_to_completion = true;
    topts.tcp.poll_mode = rdmarpc::transport::tcp::PollMode::kBusy;
  }
  rdmarpc::ServerOptions so;
  so.listen = {scheme + "://" + (scheme == "tcp" ? std::string("127.0.0.1") : opt.ip) + ":0"};
  so.transport = topts;
  rdmarpc::Server server(sio.get_executor(), so);
  if (auto st = server.AddService(service); !st.ok()) return st.ToAbsl();
  if (auto st = server.Start(); !st.ok()) return st.ToAbsl();
  rdmarpc::ChannelOptions co;
  co.transport = topts;
  auto channel = rdmarpc::Channel::Create(io.get_executor(), server.local_uris().at(0), co);
  if (!channel.ok()) return channel.status();
  rdmarpc::examples::Echo::Stub stub(*channel);
  auto server_work = asio::make_work_guard(sio);
  std::thread server_thread([&sio] { sio.run(); });
  absl::Status result;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        for (size_t size : opt.sizes) {
          Row row{"rpc-" + scheme + (busy ? "-busy" : ""), size, {}};
          rdmarpc::examples::EchoRequest req;
          req.set_payload(std::string(size, 'r'));
          rdmarpc::examples::EchoReply reply;
          for (int i = -100; i < opt.iters; ++i) {
            rdmarpc::ClientContext ctx;
            ctx.set_timeout(std::chrono::seconds(10));
            auto t0 = Clock::now();
            auto [ec] = co_await stub.async_Echo(ctx, req, reply, asio::as_tuple(asio::use_awaitable));
            auto t1 = Clock::now();
            if (ec || reply.payload().size() != size) {
              result = ec ? ctx.status().ToAbsl() : absl::DataLossError("echo payload size differs");
              co_return;
            }
            if (i >= 0) row.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          }
          rows.push_back(std::move(row));
        }
      },
      [&](std::exception_ptr error) {
        if (error) {
          try {
            std::rethrow_exception(error);
          } catch (const std::exception& e) {
            result = absl::InternalError(std::string("echo loop threw: ") + e.what());
          }
        }
        (*channel)->Close();
        // A busy-polling thread never runs out of work by itself: both stop
        // when the server has shut down.
        asio::post(sio, [&] {
          server.async_shutdown(std::chrono::seconds(1), [&] {
            server_work.reset();
            sio.stop();
            io.stop();
          });
        });
      });
  io.run();
  server_thread.join();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  opt.device = std::getenv("RXE_VM_DEV") ? std::getenv("RXE_VM_DEV") : "";
  opt.ip = std::getenv("RXE_VM_SELF_IP") ? std::getenv("RXE_VM_SELF_IP") : "";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) { std::fprintf(stderr, "rdmarpc_demo: %s needs a value\n", flag); std::exit(2); }
      return argv[++i];
    };
    if (a == "--device") opt.device = value("--device");
    else if (a == "--ip") opt.ip = value("--ip");
    else if (a == "--iters") {
      if (!absl::SimpleAtoi(value("--iters"), &opt.iters) || opt.iters <= 0)
        return Fail("--iters needs a positive integer");
    } else if (a == "--sizes") {
      opt.sizes.clear();
      for (auto part : absl::StrSplit(value("--sizes"), ',')) {
        size_t s = 0;
        if (!absl::SimpleAtoi(part, &s) || s == 0 || s > (1u << 20))
          return Fail("--sizes takes comma-separated sizes in 1..1048576 bytes");
        opt.sizes.push_back(s);
      }
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: rdmarpc_demo [--device NAME] [--ip LOCAL_IP] [--iters N] [--sizes 64,4096]\n"
                  "Raw ping-pong and echo RPCs over RDMA and TCP in one run; prints P50/P99 per size.\n"
                  "Without an RDMA NIC run it under tools/rxe-vm (Soft-RoCE).\n");
      return 0;
    } else {
      return Fail("unknown flag '" + a + "' (see --help)");
    }
  }
  if (opt.ip.empty())
    return Fail("--ip is required: a local address on the RDMA device's netdev (tools/rxe-vm exports RXE_VM_SELF_IP)");

  std::vector<Row> rows;
  auto phase = [](const char* what) {
    std::printf("running: %s\n", what);
    std::fflush(stdout);
  };
  phase("raw RDMA SEND/RECV ping-pong");
  if (auto st = RunRdma(opt, rows); !st.ok()) return Fail("RDMA: " + st.ToString());
  phase("raw TCP ping-pong, blocking recv()");
  if (auto st = RunTcp(opt, false, rows); !st.ok()) return Fail("TCP: " + st.ToString());
  phase("raw TCP ping-pong, spinning on a non-blocking recv()");
  if (auto st = RunTcp(opt, true, rows); !st.ok()) return Fail("TCP (spinning): " + st.ToString());
  for (bool busy : {false, true}) {
    phase(busy ? "echo RPCs over rdma://, busy polling (run to completion)" : "echo RPCs over rdma://, event-driven");
    if (auto st = RunRpc(opt, "rdma", busy, rows); !st.ok()) return Fail("RPC over rdma://: " + st.ToString());
    phase(busy ? "echo RPCs over tcp://, busy polling" : "echo RPCs over tcp://, event-driven");
    if (auto st = RunRpc(opt, "tcp", busy, rows); !st.ok()) return Fail("RPC over tcp://: " + st.ToString());
  }

  std::printf("\n%-13s %8s %8s %10s %10s %10s\n", "", "size_B", "iters", "p50_us", "p99_us", "max_us");
  for (auto& r : rows) {
    double p50 = Pct(r.us, 0.50), p99 = Pct(r.us, 0.99), mx = r.us.back();
    std::printf("%-13s %8zu %8zu %10.1f %10.1f %10.1f\n", r.transport.c_str(), r.size, r.us.size(), p50, p99, mx);
  }
  // Rows: rdma, tcp, tcp-spin, rpc-rdma, rpc-tcp, rpc-rdma-busy, rpc-tcp-busy;
  // each a block of one row per size.
  const size_t n = opt.sizes.size();
  struct Ratio {
    const char* what;
    size_t tcp_block, rdma_block;
  };
  const Ratio ratios[] = {
      {"raw ping-pong P50, tcp (blocking recv) / rdma (busy poll):", 1, 0},
      {"raw ping-pong P50, tcp-spin / rdma, both spinning:", 2, 0},
      {"echo RPC P50, tcp:// / rdma://, both event-driven:", 4, 3},
      {"echo RPC P50, tcp:// / rdma://, both busy polling:", 6, 5},
  };
  std::printf("\n");
  for (const Ratio& r : ratios) {
    std::printf("%s", r.what);
    for (size_t i = 0; i < n; ++i) {
      double rdma = Pct(rows[r.rdma_block * n + i].us, 0.5), tcp = Pct(rows[r.tcp_block * n + i].us, 0.5);
      std::printf("  %zu B: %.2fx", opt.sizes[i], tcp / rdma);
    }
    std::printf("\n");
  }
  return 0;
}
