// libFuzzer target: the server's request dispatcher. One real rdmarpc::Server
// serving rdmarpc.test.Test (tests/protos/rdmarpc/test/rpc_test.proto) on
// tcp://127.0.0.1:0, made once; everything runs on the fuzzing thread's
// io_context. Per input:
//   1. a raw transport connection sends the input's messages, then a barrier
//      (an Echo with call id kBarrierId) that the server answers after them;
//   2. it reads until the barrier's answer or until the server closes it;
//   3. a fresh Channel makes a well-formed Echo call;
//   4. both close, and the server must get back to no connections and no
//      calls in flight.
//
// Input: messages, each a 2-byte little-endian length then that many bytes
// (the last one is cut short at the end of the input).
//
// Invariants: everything the server sends decodes (rpc::DecodeFrame) and is a
// RESPONSE or PONG; no call id is answered more often than it was asked (a
// PONG not more often than PING was sent); the barrier is answered OK with its
// payload unless the connection was closed; step 3 succeeds; step 4 happens
// within a bound (no leaked connection or call).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "absl/container/flat_hash_map.h"
#include "rdmarpc/test/rpc_test.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/frame.h"
#include "rpc/server.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/uri.h"
#include "tests/fuzz/fuzz_support.h"

namespace rdmarpc::fuzz {
namespace {

namespace asio = boost::asio;
using rdmarpc::test::Empty;
using rdmarpc::test::FailRequest;
using rdmarpc::test::MetadataReply;
using rdmarpc::test::Payload;
using rdmarpc::test::SleepRequest;
using TestSvc = rdmarpc::test::Test;

constexpr uint64_t kBarrierId = 0xB0A1'2D00'0000'0001;
// Low, so inputs reach the RESOURCE_EXHAUSTED path with a few Sleeps.
constexpr size_t kMaxCalls = 8;

// Like the RPC suite's service (tests/rpc/rpc_suite.cc).
class FuzzService final : public TestSvc::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext&, const Payload& request, Payload& response) override {
    response = request;
    co_return Status();
  }
  asio::awaitable<Status> Sleep(ServerContext&, const SleepRequest& request, Empty&) override {
    asio::steady_timer timer(co_await asio::this_coro::executor, std::chrono::milliseconds(request.ms()));
    auto [ec] = co_await timer.async_wait(asio::as_tuple(asio::use_awaitable));
    if (ec) co_return CancelledError("sleep interrupted");
    co_return Status();
  }
  asio::awaitable<Status> Metadata(ServerContext& ctx, const Empty&, MetadataReply& reply) override {
    for (const auto& [k, v] : ctx.metadata()) reply.add_entries(k + "=" + v);
    reply.set_peer(ctx.peer());
    reply.set_has_deadline(ctx.deadline().has_value());
    co_return Status();
  }
  asio::awaitable<Status> Fail(ServerContext&, const FailRequest& request, Empty&) override {
    co_return Status(static_cast<StatusCode>(request.code()), request.message());
  }
  asio::awaitable<Status> Throw(ServerContext&, const Empty&, Empty&) override {
    throw std::runtime_error("boom from the handler");
    co_return Status();
  }
};

struct World {
  asio::io_context io;
  FuzzService service;
  std::unique_ptr<Server> server;
  std::string uri;
  transport::Uri raw_uri;
};
World* world = nullptr;

// ---- seeds -----------------------------------------------------------------

std::string Frame(rpc::FrameHeader h, const std::string& payload, const rpc::Metadata& metadata = {}) {
  h.metadata_length = static_cast<uint16_t>(rpc::MetadataWireSize(metadata));
  h.payload_length = static_cast<uint32_t>(payload.size());
  std::string out(rpc::kFrameHeaderSize + h.metadata_length, '\0');
  rpc::EncodeFrameHead(h, metadata, AsWritableBytes(out));
  return out + payload;
}
std::string Request(uint32_t method, uint64_t call_id, const google::protobuf::MessageLite& m,
                    uint64_t timeout_us = 0, const rpc::Metadata& metadata = {}) {
  return Frame({.type = rpc::FrameType::kRequest, .method_id = method, .call_id = call_id, .timeout_us = timeout_us},
               m.SerializeAsString(), metadata);
}
// The input format: each message behind its 2-byte length.
std::string Input(const std::vector<std::string>& messages) {
  std::string out;
  for (const auto& m : messages) {
    PutLe(out, m.size(), 2);
    out += m;
  }
  return out;
}

std::vector<Seed> Seeds() {
  Payload hello;
  hello.set_data("hello");
  hello.mutable_meta()->set_seq(1);
  SleepRequest nap;
  nap.set_ms(20);
  SleepRequest long_nap;
  long_nap.set_ms(60'000);
  FailRequest fail;
  fail.set_code(static_cast<uint32_t>(StatusCode::kNotFound));
  fail.set_message("no such thing");
  FailRequest fail_ok;
  fail_ok.set_message("ok with a message");
  const Empty empty;
  const std::string cancel3 = Frame({.type = rpc::FrameType::kCancel, .call_id = 3}, "");
  const std::string ping = Frame({.type = rpc::FrameType::kPing}, "");

  std::vector<Seed> seeds;
  seeds.push_back({"echo", Input({Request(TestSvc::kEchoId, 1, hello)})});
  seeds.push_back({"echo-same-id-twice", Input({Request(TestSvc::kEchoId, 1, hello), Request(TestSvc::kEchoId, 1, hello)})});
  seeds.push_back({"metadata-with-timeout",
                   Input({Request(TestSvc::kMetadataId, 2, empty, 5'000'000, {{"authorization", "t"}, {"x-trace", "42"}})})});
  seeds.push_back({"sleep-then-cancel", Input({Request(TestSvc::kSleepId, 3, long_nap), cancel3})});
  seeds.push_back({"sleep-then-cancel-deadline",
                   Input({Request(TestSvc::kSleepId, 3, long_nap),
                          Frame({.type = rpc::FrameType::kCancel, .status = StatusCode::kDeadlineExceeded, .call_id = 3}, "")})});
  seeds.push_back({"sleep-past-deadline", Input({Request(TestSvc::kSleepId, 4, long_nap, 1'000)})});
  seeds.push_back({"sleep-short", Input({Request(TestSvc::kSleepId, 4, nap)})});
  std::vector<std::string> crowd;
  for (uint64_t id = 10; id < 10 + kMaxCalls + 2; ++id) crowd.push_back(Request(TestSvc::kSleepId, id, long_nap));
  seeds.push_back({"too-many-calls", Input(crowd)});
  seeds.push_back({"sleep-id-reused-in-flight",
                   Input({Request(TestSvc::kSleepId, 5, long_nap), Request(TestSvc::kEchoId, 5, hello)})});
  seeds.push_back({"fail", Input({Request(TestSvc::kFailId, 6, fail), Request(TestSvc::kFailId, 7, fail_ok)})});
  seeds.push_back({"throw", Input({Request(TestSvc::kThrowId, 8, empty)})});
  seeds.push_back({"streaming-method", Input({Request(TestSvc::kStreamId, 9, hello)})});
  seeds.push_back({"stream-frames", Input({Request(TestSvc::kStreamId, 9, hello),
                                           Frame({.type = rpc::FrameType::kWindow, .method_id = 8, .call_id = 9}, ""),
                                           Frame({.type = rpc::FrameType::kStreamMessage, .call_id = 9}, "x"),
                                           Frame({.type = rpc::FrameType::kHalfClose, .call_id = 9}, ""),
                                           Request(TestSvc::kEchoId, 10, hello)})});
  seeds.push_back({"unknown-method", Input({Request(0x1234'5678, 9, empty)})});
  seeds.push_back({"unparseable-request", Input({Frame({.type = rpc::FrameType::kRequest, .method_id = TestSvc::kEchoId,
                                                        .call_id = 11},
                                                       std::string("\xff\xff\xff\xff\xff", 5))})});
  seeds.push_back({"ping-pong", Input({ping, Frame({.type = rpc::FrameType::kPong}, ""), ping})});
  seeds.push_back({"cancel-unknown-call", Input({cancel3, Request(TestSvc::kEchoId, 3, hello)})});
  seeds.push_back({"client-sends-response",
                   Input({Frame({.type = rpc::FrameType::kResponse, .call_id = 1}, ""), Request(TestSvc::kEchoId, 2, hello)})});
  seeds.push_back({"client-sends-goaway", Input({Frame({.type = rpc::FrameType::kGoaway}, "")})});
  seeds.push_back({"garbage-http", Input({"GET / HTTP/1.1\r\nHost: rdmarpc\r\n\r\n"})});
  seeds.push_back({"empty-message", Input({""})});
  seeds.push_back({"everything",
                   Input({Request(TestSvc::kEchoId, 1, hello), Request(TestSvc::kSleepId, 3, long_nap),
                          Request(TestSvc::kMetadataId, 2, empty, 0, {{"k", "v"}}), Request(TestSvc::kFailId, 6, fail),
                          Request(TestSvc::kThrowId, 8, empty), ping, cancel3, Request(TestSvc::kStreamId, 9, hello)})});
  return seeds;
}

// ---- one input -------------------------------------------------------------

std::vector<std::string> Split(const uint8_t* data, size_t size) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < size) {
    size_t n = data[pos];
    if (pos + 1 < size) n |= size_t{data[pos + 1]} << 8;
    pos += 2;
    if (pos > size) break;
    n = std::min(n, size - pos);
    out.emplace_back(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
  }
  return out;
}

struct RawResult {
  bool connected = false;
  bool barrier_answered = false;
  bool closed = false;
  Payload barrier_payload;
  StatusCode barrier_status = StatusCode::kOk;
};

// Reads the server's answers on `c`, checking each, until the barrier is
// answered or the connection fails.
void ReadAnswers(transport::Connection* c, std::shared_ptr<RawResult> r,
                 std::shared_ptr<absl::flat_hash_map<uint64_t, int>> asked, std::shared_ptr<int> pings) {
  c->Receive([=](absl::StatusOr<transport::Message> m) {
    if (!m.ok()) {
      r->closed = true;
      return;
    }
    rpc::DecodedFrame f;
    const absl::Status st = rpc::DecodeFrame(m->data(), f);
    FUZZ_CHECK(st.ok(), "the server sent a frame that does not decode: ", st.ToString());
    switch (f.header.type) {
      case rpc::FrameType::kResponse: {
        auto it = asked->find(f.header.call_id);
        FUZZ_CHECK(it != asked->end() && it->second > 0, "answer to call id ", f.header.call_id,
                   " that was not asked (or answered twice)");
        --it->second;
        if (f.header.call_id == kBarrierId && it->second == 0) {
          r->barrier_answered = true;
          r->barrier_status = f.header.status;
          if (f.header.status == StatusCode::kOk)
            r->barrier_payload.ParseFromArray(f.payload.data(), static_cast<int>(f.payload.size()));
          return;
        }
        break;
      }
      case rpc::FrameType::kPong:
        FUZZ_CHECK(*pings > 0, "PONG without a PING");
        --*pings;
        break;
      default:
        FUZZ_CHECK(false, "the server sent a frame of type ", static_cast<int>(f.header.type));
    }
    m->Reset();
    ReadAnswers(c, r, asked, pings);
  });
}

}  // namespace
}  // namespace rdmarpc::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  using namespace rdmarpc;
  using namespace rdmarpc::fuzz;
  MaybeWriteSeeds(argc, argv, Seeds);
  QuietLogs();
  world = new World;  // never freed: lives as long as the process
  ServerOptions options;
  options.listen = {"tcp://127.0.0.1:0"};
  options.max_calls_per_connection = kMaxCalls;
  world->server = std::make_unique<Server>(world->io.get_executor(), options);
  FUZZ_CHECK(world->server->AddService(world->service).ok());
  Status st = world->server->Start();
  FUZZ_CHECK(st.ok(), st.ToString());
  world->uri = world->server->local_uris().at(0);
  auto uri = transport::ParseUri(world->uri);
  FUZZ_CHECK(uri.ok(), uri.status().ToString());
  world->raw_uri = *uri;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmarpc;
  using namespace rdmarpc::fuzz;
  asio::io_context& io = world->io;
  const std::vector<std::string> messages = Split(data, size);

  // What the input asks, by the harness's own reading of it.
  auto asked = std::make_shared<absl::flat_hash_map<uint64_t, int>>();
  auto pings = std::make_shared<int>(0);
  for (const auto& m : messages) {
    rpc::DecodedFrame f;
    if (!rpc::DecodeFrame(AsBytes(m), f).ok()) continue;
    if (f.header.type == rpc::FrameType::kRequest) ++(*asked)[f.header.call_id];
    if (f.header.type == rpc::FrameType::kPing) ++*pings;
  }
  const bool barrier_reused = asked->contains(kBarrierId);
  ++(*asked)[kBarrierId];
  Payload barrier;
  barrier.set_data("barrier");
  const std::string barrier_frame = Frame({.type = rpc::FrameType::kRequest, .method_id = TestSvc::kEchoId,
                                           .call_id = kBarrierId},
                                          barrier.SerializeAsString());

  // 1-2. The raw connection.
  std::unique_ptr<transport::Connection> raw;
  auto result = std::make_shared<RawResult>();
  transport::tcp::Connect(io.get_executor(), world->raw_uri.host, world->raw_uri.port, {},
                          [&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
                            FUZZ_CHECK(c.ok(), "raw connect: ", c.status().ToString());
                            raw = std::move(*c);
                            result->connected = true;
                          });
  FUZZ_CHECK(RunUntil(io, [&] { return result->connected; }), "raw connect did not complete");
  for (const auto& m : messages) raw->async_send(AsBytes(m), [](absl::Status) {});
  raw->async_send(AsBytes(barrier_frame), [](absl::Status) {});
  ReadAnswers(raw.get(), result, asked, pings);
  FUZZ_CHECK(RunUntil(io, [&] { return result->barrier_answered || result->closed; }, std::chrono::seconds(10)),
             "the server neither answered the barrier nor closed the connection");
  if (result->barrier_answered && !barrier_reused) {
    FUZZ_CHECK(result->barrier_status == StatusCode::kOk || result->barrier_status == StatusCode::kResourceExhausted,
               "barrier answered ", std::string(StatusCodeName(result->barrier_status)));
    if (result->barrier_status == StatusCode::kOk)
      FUZZ_CHECK(result->barrier_payload.data() == "barrier", "barrier echo differs");
  }

  // 3. A fresh channel is served.
  auto channel = Channel::Create(io.get_executor(), world->uri);
  FUZZ_CHECK(channel.ok(), channel.status().ToString());
  {
    TestSvc::Stub stub(*channel);
    ClientContext ctx;
    ctx.set_timeout(std::chrono::seconds(10));
    Payload req;
    req.set_data("after the fuzz input");
    std::optional<boost::system::error_code> done;
    Payload resp;
    stub.async_Echo(ctx, req, [&](boost::system::error_code ec, Payload r) {
      done = ec;
      resp = std::move(r);
    });
    FUZZ_CHECK(RunUntil(io, [&] { return done.has_value(); }, std::chrono::seconds(15)), "fresh call never completed");
    FUZZ_CHECK(!*done, "fresh call failed: ", ctx.status().ToString());
    FUZZ_CHECK(resp.data() == req.data(), "fresh call's echo differs");
  }
  (*channel)->Close();
  channel->reset();

  // 4. Nothing left behind.
  raw->Close();
  raw.reset();
  FUZZ_CHECK(RunUntil(io, [&] {
               const ServerStats s = world->server->stats();
               return s.connections_open == 0 && s.calls_in_flight == 0;
             }),
             "the server kept ", world->server->stats().connections_open, " connections and ",
             world->server->stats().calls_in_flight, " calls after both clients left");
  return 0;
}
