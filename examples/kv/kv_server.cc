// kv_server: a small in-memory key-value store served over rdmarpc.
//
//   kv_server --listen tcp://0.0.0.0:7100 [--listen rdma://10.0.0.1:7101] [--device rxe0] [--uri-file F]
//
// Get/Put/Delete with versions: every Put bumps the key's version; a Put with
// if_version set is a compare-and-set (FAILED_PRECONDITION when it lost).
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include <cstdio>
#include <fstream>
#include <map>

#include "examples/common/flags.h"
#include "rdmarpc/examples/kv.rdmarpc.pb.h"
#include "rpc/server.h"

namespace asio = boost::asio;
using namespace rdmarpc;
namespace ex = rdmarpc::examples;

namespace {

constexpr const char* kUsage =
    "usage: kv_server --listen URI [--listen URI]... [--device NAME] [--uri-file FILE]\n";
constexpr size_t kMaxKey = 1024;

class KvImpl final : public ex::Kv::Service {
 public:
  asio::awaitable<Status> Get(ServerContext&, const ex::GetRequest& req, ex::GetReply& reply) override {
    auto it = data_.find(req.key());
    if (it == data_.end()) co_return NotFoundError("no key '" + req.key() + "'");
    reply.set_value(it->second.value);
    reply.set_version(it->second.version);
    co_return Status();
  }
  asio::awaitable<Status> Put(ServerContext&, const ex::PutRequest& req, ex::PutReply& reply) override {
    if (req.key().empty() || req.key().size() > kMaxKey)
      co_return InvalidArgumentError("key must be 1.." + std::to_string(kMaxKey) + " bytes");
    Entry& e = data_[req.key()];
    if (req.if_version() != 0 && req.if_version() != e.version)
      co_return Status(StatusCode::kFailedPrecondition,
                       "version is " + std::to_string(e.version) + ", not " + std::to_string(req.if_version()));
    e.value = req.value();
    reply.set_version(++e.version);
    co_return Status();
  }
  asio::awaitable<Status> Delete(ServerContext&, const ex::DeleteRequest& req, ex::DeleteReply& reply) override {
    reply.set_existed(data_.erase(req.key()) > 0);
    co_return Status();
  }

 private:
  struct Entry {
    std::string value;
    uint64_t version = 0;
  };
  std::map<std::string, Entry> data_;  // one executor: no lock needed
};

}  // namespace

int main(int argc, char** argv) {
  rdmarpc::examples::Flags flags;
  if (!flags.Parse(argc, argv, {"listen", "device", "uri-file"}, kUsage)) return flags.help() ? 0 : 2;
  if (flags.All("listen").empty()) {
    std::fprintf(stderr, "kv_server: give at least one --listen URI\n%s", kUsage);
    return 2;
  }
  ServerOptions options;
  options.listen = flags.All("listen");
  options.transport.rdma_device.name = flags.Get("device");
  asio::io_context io;
  KvImpl service;
  Server server(io.get_executor(), options);
  Status st = server.AddService(service);
  if (st.ok()) st = server.Start();
  if (!st.ok()) {
    std::fprintf(stderr, "kv_server: %s\n", st.ToString().c_str());
    return 1;
  }
  std::ofstream uri_file;
  if (auto f = flags.Get("uri-file"); !f.empty()) uri_file.open(f);
  for (const auto& uri : server.local_uris()) {
    std::printf("kv_server: listening on %s\n", uri.c_str());
    if (uri_file.is_open()) uri_file << uri << "\n";
  }
  uri_file.close();
  std::fflush(stdout);
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](boost::system::error_code ec, int) {
    if (!ec) server.async_shutdown(std::chrono::seconds(5), [&] { io.stop(); });
  });
  io.run();
  return 0;
}
