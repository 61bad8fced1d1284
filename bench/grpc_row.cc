// The gRPC row: the same echo (same messages, grpc_echo.proto) over Debian's
// libgrpc++, with the async completion-queue API so that, as for rdmarpc, one
// client thread and one server thread drive the calls (gRPC adds its own
// internal threads; their CPU shows in the process figures only).
//
// Tuning: one channel (one HTTP/2 connection, TCP_NODELAY is gRPC's default),
// no message-size limits, server request slots pre-posted for the largest
// concurrency so an arriving call never waits for a slot.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "bench_common.h"
#include "rdmarpc/bench/grpc_echo.grpc.pb.h"

namespace rdmarpc::bench {
namespace {

using EchoGrpc = rdmarpc::bench::grpcsvc::Echo;

// One server call: waiting for a request, then finishing.
struct ServerCall {
  explicit ServerCall(EchoGrpc::AsyncService& service, grpc::ServerCompletionQueue& cq) : responder(&ctx) {
    service.RequestEcho(&ctx, &request, &responder, &cq, &cq, this);
  }
  grpc::ServerContext ctx;
  EchoRequest request;
  EchoResponse response;
  grpc::ServerAsyncResponseWriter<EchoResponse> responder;
  bool finishing = false;
};

// The server's thread: answers every call until the queue shuts down.
void ServeLoop(EchoGrpc::AsyncService& service, grpc::ServerCompletionQueue& cq) {
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
    auto* call = static_cast<ServerCall*>(tag);
    if (call->finishing || !ok) {  // Answered, or cancelled by shutdown.
      delete call;
      continue;
    }
    new ServerCall(service, cq);  // Keep a slot posted for the next call.
    call->response.set_payload(call->request.payload());
    call->finishing = true;
    call->responder.Finish(call->response, grpc::Status::OK, call);
  }
}

std::chrono::system_clock::time_point ToSystem(Clock::time_point t) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
}

class GrpcServerImpl final : public GrpcServer {
 public:
  ~GrpcServerImpl() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    cq_->Shutdown();
    thread_.join();
  }
  const std::string& address() const override { return address_; }
  CpuClock cpu() const override { return cpu_; }

  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const std::string& address, int slots) {
    auto s = std::unique_ptr<GrpcServerImpl>(new GrpcServerImpl);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&s->service_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.SetMaxSendMessageSize(-1);
    s->cq_ = builder.AddCompletionQueue();
    s->server_ = builder.BuildAndStart();
    if (!s->server_ || port == 0) return absl::UnavailableError(absl::StrCat("gRPC server did not start on ", address));
    s->address_ = absl::StrCat(address.substr(0, address.rfind(':')), ":", port);
    for (int i = 0; i < slots + 4; ++i) new ServerCall(s->service_, *s->cq_);
    s->thread_ = std::thread([raw = s.get()] { ServeLoop(raw->service_, *raw->cq_); });
    s->cpu_ = CpuClock::Thread(s->thread_.native_handle());
    return std::unique_ptr<GrpcServer>(std::move(s));
  }

 private:
  GrpcServerImpl() = default;
  EchoGrpc::AsyncService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::thread thread_;
  std::string address_;
  CpuClock cpu_ = CpuClock::None();
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const std::string& address, int slots) {
  return GrpcServerImpl::Start(address, slots);
}

absl::Status RunGrpc(const Flags& f, const std::function<void(const Row&)>& emit) {
  const int max_conc = *std::max_element(f.concurrency.begin(), f.concurrency.end());
  std::unique_ptr<GrpcServer> server;
  std::string target;
  CpuClock server_cpu = CpuClock::None();
  if (f.role == Role::kClient) {
    target = absl::StrCat(f.server, ":", f.port + PortOffset("grpc"));
  } else {
    auto s = GrpcServer::Start("127.0.0.1:0", max_conc);
    if (!s.ok()) return s.status();
    server = std::move(*s);
    target = server->address();
    server_cpu = server->cpu();
  }
  auto stop_server = [&] { server.reset(); };

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    stop_server();
    return absl::UnavailableError(absl::StrCat("gRPC channel to ", target, " did not connect in 10 s"));
  }
  auto stub = EchoGrpc::NewStub(channel);
  grpc::CompletionQueue cq;

  for (size_t size : f.sizes) {
    for (int conc : f.concurrency) {
      struct Slot {
        std::optional<grpc::ClientContext> ctx;  // gRPC contexts are single-use
        EchoRequest req;
        EchoResponse resp;
        grpc::Status status;
        std::unique_ptr<grpc::ClientAsyncResponseReader<EchoResponse>> rpc;
      };
      std::vector<std::unique_ptr<Slot>> slots;
      for (int i = 0; i < conc; ++i) {
        slots.push_back(std::make_unique<Slot>());
        slots.back()->req.set_payload(std::string(size, 'x'));
      }
      LoadGen lg(f, size, conc, [&](int i) {
        Slot& s = *slots[static_cast<size_t>(i)];
        s.rpc.reset();
        s.ctx.emplace();
        s.rpc = stub->AsyncEcho(&*s.ctx, s.req, &cq);
        s.rpc->Finish(&s.resp, &s.status, reinterpret_cast<void*>(static_cast<intptr_t>(i)));
      });
      lg.label = absl::StrCat("grpc ", size, "B c=", conc, f.mode == Mode::kOpen ? " open" : "");
      lg.client_cpu = CpuClock::Thread(pthread_self());
      lg.server_cpu = server_cpu;
      lg.Start();
      std::string last_error;
      while (!lg.done()) {
        void* tag = nullptr;
        bool ok = false;
        switch (cq.AsyncNext(&tag, &ok, ToSystem(lg.NextWake()))) {
          case grpc::CompletionQueue::GOT_EVENT: {
            const int i = static_cast<int>(reinterpret_cast<intptr_t>(tag));
            Slot& s = *slots[static_cast<size_t>(i)];
            const bool good = ok && s.status.ok() && s.resp.payload().size() == size;
            if (!good && last_error.empty()) last_error = s.status.error_message();
            lg.Completed(i, good);
            break;
          }
          case grpc::CompletionQueue::TIMEOUT:
            lg.Tick();
            break;
          case grpc::CompletionQueue::SHUTDOWN:
            return absl::InternalError("gRPC completion queue shut down mid-run");
        }
      }
      Row row = lg.Result("grpc", "-");
      if (row.errors > 0) row.note = last_error;
      emit(row);
    }
  }
  stub.reset();
  channel.reset();
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  stop_server();
  return absl::OkStatus();
}

}  // namespace rdmarpc::bench
