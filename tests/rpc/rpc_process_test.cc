// The RPC runtime against a real server process (examples/echo/echo_server):
// killed with SIGKILL mid-call, restarted, and stopped with SIGTERM while a
// call is in flight. tcp:// on the host (label unit), rdma:// in the VM
// (label rdma).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <gtest/gtest.h>

#include "rdmarpc/examples/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "tests/support/rdma_env.h"

namespace rdmarpc {
namespace {

namespace asio = boost::asio;
using rdmarpc::examples::Echo;
using rdmarpc::examples::EchoReply;
using rdmarpc::examples::EchoRequest;
using std::chrono::milliseconds;
using std::chrono::seconds;

class ServerProcess {
 public:
  // Starts echo_server on `uri`; returns the URI it listens on ("" on failure).
  std::string Start(const std::string& uri) {
    uri_file_ = std::filesystem::temp_directory_path() / ("rdmarpc_echo_" + std::to_string(::getpid()) + ".uri");
    std::filesystem::remove(uri_file_);
    pid_ = ::fork();
    if (pid_ == 0) {
      int devnull = ::open("/dev/null", O_WRONLY);
      ::dup2(devnull, 1);
      std::vector<std::string> args = {RDMARPC_ECHO_SERVER, "--listen", uri, "--uri-file", uri_file_.string()};
      if (auto dev = testing::TestDevice(); !dev.empty()) {
        args.push_back("--device");
        args.push_back(dev);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 600; ++i) {
      std::ifstream in(uri_file_);
      std::string line;
      if (std::getline(in, line) && !line.empty()) return line;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return "";
      }
      std::this_thread::sleep_for(milliseconds(100));
    }
    return "";
  }
  void Signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  // Exit status after the process ended (-1: killed by a signal / not running).
  int Wait() {
    if (pid_ <= 0) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  ~ServerProcess() {
    Signal(SIGKILL);
    Wait();
    std::filesystem::remove(uri_file_);
  }

 private:
  pid_t pid_ = -1;
  std::filesystem::path uri_file_;
};

class RpcProcess : public ::testing::TestWithParam<std::string> {
 protected:
  RpcProcess() : work_(asio::make_work_guard(io_)) { thread_ = std::thread([this] { io_.run(); }); }
  ~RpcProcess() override {
    asio::post(io_, [this] { channel_.reset(); });
    work_.reset();
    std::this_thread::sleep_for(milliseconds(200));
    io_.stop();
    thread_.join();
  }
  std::string ListenUri() const {
    return GetParam() == "tcp" ? "tcp://127.0.0.1:0" : "rdma://" + testing::TestIp() + ":0";
  }
  Echo::Stub Connect(const std::string& uri) {
    ChannelOptions options;
    options.initial_backoff = milliseconds(20);
    options.max_backoff = milliseconds(200);
    options.transport.rdma_device.name = testing::TestDevice();
    auto ch = Channel::Create(io_.get_executor(), uri, options);
    EXPECT_TRUE(ch.ok()) << ch.status();
    channel_ = *ch;
    return Echo::Stub(channel_);
  }
  // One call from the test thread; returns its status code.
  StatusCode Call(Echo::Stub& stub, uint32_t delay_ms, ClientContext& ctx) {
    EchoRequest req;
    req.set_payload("ping");
    req.set_delay_ms(delay_ms);
    auto p = std::make_shared<std::promise<StatusCode>>();
    auto f = p->get_future();
    stub.async_Echo(ctx, req, [p](boost::system::error_code ec, EchoReply) { p->set_value(ToStatusCode(ec)); });
    if (f.wait_for(seconds(90)) != std::future_status::ready) {
      ADD_FAILURE() << "call did not complete";
      std::abort();
    }
    return f.get();
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  std::shared_ptr<Channel> channel_;
};

TEST_P(RpcProcess, ServerKilledMidCallFailsTheCallFastAndTheChannelReconnectsToItsSuccessor) {
  ServerProcess server;
  std::string uri = server.Start(ListenUri());
  ASSERT_FALSE(uri.empty()) << "echo_server did not start";
  auto stub = Connect(uri);
  ClientContext warm;
  ASSERT_EQ(Call(stub, 0, warm), StatusCode::kOk) << warm.status().ToString();

  // A call the server holds for 30 s; SIGKILL the server while it does.
  ClientContext ctx;
  ctx.set_timeout(seconds(60));
  std::thread killer([&] {
    std::this_thread::sleep_for(milliseconds(500));
    server.Signal(SIGKILL);
  });
  const auto start = Clock::now();
  StatusCode code = Call(stub, 30'000, ctx);
  const double detect_s = std::chrono::duration<double>(Clock::now() - start).count() - 0.5;
  killer.join();
  server.Wait();
  EXPECT_EQ(code, StatusCode::kUnavailable) << ctx.status().ToString();
  EXPECT_LT(detect_s, 10.0) << "the client noticed the dead server only after " << detect_s << " s";
  std::printf("[ measured ] %s: dead server detected %.3f s after SIGKILL\n", GetParam().c_str(), detect_s);

  // A new server on the same address: the same channel reaches it.
  ServerProcess successor;
  ASSERT_EQ(successor.Start(uri), uri);
  StatusCode last = StatusCode::kUnknown;
  for (int i = 0; i < 100 && last != StatusCode::kOk; ++i) {
    ClientContext c;
    last = Call(stub, 0, c);
    if (last != StatusCode::kOk) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_EQ(last, StatusCode::kOk);
}

TEST_P(RpcProcess, SigtermDrainsTheCallInFlightAndExitsZero) {
  ServerProcess server;
  std::string uri = server.Start(ListenUri());
  ASSERT_FALSE(uri.empty());
  auto stub = Connect(uri);
  ClientContext warm;
  ASSERT_EQ(Call(stub, 0, warm), StatusCode::kOk);
  ClientContext ctx;
  std::thread stopper([&] {
    std::this_thread::sleep_for(milliseconds(300));
    server.Signal(SIGTERM);
  });
  EXPECT_EQ(Call(stub, 1000, ctx), StatusCode::kOk) << ctx.status().ToString();
  stopper.join();
  EXPECT_EQ(server.Wait(), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, RpcProcess, ::testing::Values("tcp", "rdma"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace rdmarpc
