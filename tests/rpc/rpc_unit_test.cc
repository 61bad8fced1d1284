// The RPC layer without a network: status and its error category, the frame
// codec's validation, registration errors, and generated gmock mocks driving
// a real generated Stub.
#include <functional>
#include <future>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_future.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "rdmarpc/test/rpc_test_mock.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/frame.h"
#include "rpc/keepalive.h"
#include "rpc/server.h"
#include "rpc/status.h"

namespace rdmarpc {
namespace {

namespace asio = boost::asio;
using rpc::DecodedFrame;
using rpc::DecodeFrame;
using rpc::EncodeFrameHead;
using rpc::FrameHeader;
using rpc::FrameType;
using ::testing::_;
using ::testing::HasSubstr;

TEST(Status, CodesUseTheCanonicalNumberingAndNames) {
  EXPECT_EQ(static_cast<int>(StatusCode::kDeadlineExceeded), 4);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(StatusCodeName(StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(200)), "UNKNOWN_CODE");
  EXPECT_EQ(Status().ToString(), "OK");
  EXPECT_EQ(NotFoundError("key k").ToString(), "NOT_FOUND: key k");
}

TEST(Status, RoundTripsThroughAbsl) {
  for (int c = 0; c <= kMaxStatusCode; ++c) {
    Status s(static_cast<StatusCode>(c), c == 0 ? "" : "why");
    absl::Status a = s.ToAbsl();
    EXPECT_EQ(static_cast<int>(a.code()), c);
    EXPECT_EQ(Status::FromAbsl(a), s);
  }
  EXPECT_EQ(Status::FromAbsl(absl::DeadlineExceededError("late")).code(), StatusCode::kDeadlineExceeded);
}

// Status keeps its message behind a pointer (cheap moves on the call path):
// copies are deep and independent, a moved-to status has the message, and
// one without a message reads as empty.
TEST(Status, CopiesAreIndependentAndMovesKeepTheMessage) {
  Status a = UnavailableError("connection to rdma://x:1 lost: peer closed");
  Status b = a;
  EXPECT_EQ(b, a);
  EXPECT_NE(&b.message(), &a.message());
  b = InternalError("other");
  EXPECT_EQ(a.message(), "connection to rdma://x:1 lost: peer closed");
  EXPECT_EQ(a.code(), StatusCode::kUnavailable);
  Status c = std::move(a);
  EXPECT_EQ(c.message(), "connection to rdma://x:1 lost: peer closed");
  Status d;
  d = c;
  d = d;  // self-assignment keeps it
  EXPECT_EQ(d.ToString(), "UNAVAILABLE: connection to rdma://x:1 lost: peer closed");
  EXPECT_EQ(Status().message(), "");
  EXPECT_EQ(Status(StatusCode::kAborted, "").message(), "");
  EXPECT_EQ(Status(StatusCode::kAborted, ""), Status(StatusCode::kAborted, ""));
  EXPECT_FALSE(Status(StatusCode::kAborted, "x") == Status(StatusCode::kAborted, "y"));
  EXPECT_LE(sizeof(Status), 2 * sizeof(void*));
}

TEST(Status, ErrorCategoryWorksForBoostAndStdErrorCodes) {
  boost::system::error_code ec = StatusCode::kUnavailable;  // is_error_code_enum
  EXPECT_EQ(ec.category(), rpc_category());
  EXPECT_STREQ(ec.category().name(), "rdmarpc");
  EXPECT_EQ(ec.message(), "UNAVAILABLE");
  EXPECT_TRUE(static_cast<bool>(ec));
  EXPECT_FALSE(static_cast<bool>(make_error_code(StatusCode::kOk)));
  // OK is the empty error_code (as Asio reports success), equal to kOk both ways.
  EXPECT_EQ(make_error_code(StatusCode::kOk), boost::system::error_code());
  EXPECT_TRUE(boost::system::error_code() == StatusCode::kOk);
  EXPECT_EQ(ToStatusCode(make_error_code(StatusCode::kOk)), StatusCode::kOk);
  std::error_code std_ec = ec;
  EXPECT_EQ(std_ec.value(), 14);
  EXPECT_EQ(std_ec.message(), "UNAVAILABLE");
  EXPECT_EQ(ToStatusCode(ec), StatusCode::kUnavailable);
  EXPECT_EQ(ToStatusCode(asio::error::operation_aborted), StatusCode::kCancelled);
  EXPECT_EQ(ToStatusCode(asio::error::connection_reset), StatusCode::kUnknown);
}

std::vector<std::byte> Frame(const FrameHeader& h, const rpc::Metadata& md, std::string_view payload) {
  FrameHeader copy = h;
  copy.metadata_length = static_cast<uint16_t>(rpc::MetadataWireSize(md));
  copy.payload_length = static_cast<uint32_t>(payload.size());
  std::vector<std::byte> out(rpc::kFrameHeaderSize + copy.metadata_length + payload.size());
  EncodeFrameHead(copy, md, out);
  std::memcpy(out.data() + rpc::kFrameHeaderSize + copy.metadata_length, payload.data(), payload.size());
  return out;
}

FrameHeader Request() {
  FrameHeader h;
  h.type = FrameType::kRequest;
  h.method_id = 0xdeadbeef;
  h.call_id = 42;
  h.timeout_us = 1'500'000;
  return h;
}

TEST(Frame, RoundTripsEveryFieldAndMetadata) {
  auto bytes = Frame(Request(), {{"tenant", "acme"}, {"k", ""}}, "payload!");
  DecodedFrame f;
  ASSERT_TRUE(DecodeFrame(bytes, f).ok());
  EXPECT_EQ(f.header.type, FrameType::kRequest);
  EXPECT_EQ(f.header.method_id, 0xdeadbeefu);
  EXPECT_EQ(f.header.call_id, 42u);
  EXPECT_EQ(f.header.timeout_us, 1'500'000u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.payload.data()), f.payload.size()), "payload!");
  rpc::Metadata md;
  rpc::ParseMetadata(f.metadata, md);
  ASSERT_EQ(md.size(), 2u);
  EXPECT_EQ(md[0], (rpc::MetadataEntry{"tenant", "acme"}));
  EXPECT_EQ(md[1], (rpc::MetadataEntry{"k", ""}));
  // Little-endian on the wire, whatever the host: magic "RR", version 1.
  EXPECT_EQ(bytes[0], std::byte{0x52});
  EXPECT_EQ(bytes[2], std::byte{1});
  EXPECT_EQ(bytes[16], std::byte{42});
}

// Every way a peer can lie, each rejected with a message naming the field.
TEST(Frame, RejectsMalformedInputNamingTheField) {
  struct Case {
    const char* what;
    std::function<void(std::vector<std::byte>&)> mutate;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"short", [](auto& b) { b.resize(31); }, "shorter than"},
      {"magic", [](auto& b) { b[0] = std::byte{'G'}; }, "magic"},
      {"version", [](auto& b) { b[2] = std::byte{2}; }, "version 2"},
      {"type 0", [](auto& b) { b[3] = std::byte{0}; }, "unknown frame type 0"},
      {"type 99", [](auto& b) { b[3] = std::byte{99}; }, "unknown frame type 99"},
      {"flags", [](auto& b) { b[4] = std::byte{1}; }, "flags"},
      {"status range", [](auto& b) { b[5] = std::byte{17}; }, "status code 17"},
      {"status on request", [](auto& b) { b[5] = std::byte{3}; }, "not a response or cancel"},
      {"payload too long", [](auto& b) { b[12] = std::byte{0xff}; b[13] = std::byte{0xff}; b[14] = std::byte{0xff}; b[15] = std::byte{0xff}; }, "header says"},
      {"payload too short", [](auto& b) { b.push_back(std::byte{0}); }, "message has"},
      {"metadata past end", [](auto& b) { b[6] = std::byte{0xff}; b[7] = std::byte{0xff}; }, "header says"},
      {"call id 0", [](auto& b) { for (int i = 16; i < 24; ++i) b[i] = std::byte{0}; }, "call id 0"},
      {"metadata entry overrun", [](auto& b) { b[32] = std::byte{0xff}; }, "runs past"},
      {"metadata empty key", [](auto& b) { b[32] = std::byte{0}; }, "empty key"},
  };
  for (const auto& c : cases) {
    auto bytes = Frame(Request(), {{"tenant", "acme"}}, "xyz");
    c.mutate(bytes);
    DecodedFrame f;
    absl::Status st = DecodeFrame(bytes, f);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.expect)) << c.what;
  }
}

// A CANCEL may carry why the client gave up, and nothing else.
TEST(Frame, CancelCarriesOnlyCancelledOrDeadlineExceeded) {
  FrameHeader cancel;
  cancel.type = FrameType::kCancel;
  cancel.call_id = 5;
  DecodedFrame f;
  for (StatusCode ok : {StatusCode::kOk, StatusCode::kCancelled, StatusCode::kDeadlineExceeded}) {
    cancel.status = ok;
    ASSERT_TRUE(DecodeFrame(Frame(cancel, {}, ""), f).ok()) << StatusCodeName(ok);
    EXPECT_EQ(f.header.status, ok);
  }
  cancel.status = StatusCode::kInternal;
  EXPECT_THAT(std::string(DecodeFrame(Frame(cancel, {}, ""), f).message()), HasSubstr("cancel reason INTERNAL"));
}

TEST(Frame, RejectsMoreThanTheMetadataEntryLimit) {
  rpc::Metadata md;
  for (size_t i = 0; i <= rpc::kMaxMetadataEntries; ++i) md.emplace_back("k" + std::to_string(i), "v");
  auto bytes = Frame(Request(), md, "");
  DecodedFrame f;
  EXPECT_THAT(std::string(DecodeFrame(bytes, f).message()), HasSubstr("metadata entries"));
}

TEST(Frame, ControlFramesNeedNoCallIdButResponsesDo) {
  FrameHeader goaway;
  goaway.type = FrameType::kGoaway;
  DecodedFrame f;
  EXPECT_TRUE(DecodeFrame(Frame(goaway, {}, ""), f).ok());
  FrameHeader resp;
  resp.type = FrameType::kResponse;
  resp.status = StatusCode::kNotFound;
  EXPECT_FALSE(DecodeFrame(Frame(resp, {}, "missing"), f).ok());
  resp.call_id = 9;
  ASSERT_TRUE(DecodeFrame(Frame(resp, {}, "missing"), f).ok());
  EXPECT_EQ(f.header.status, StatusCode::kNotFound);
}

class NullService final : public test::Test::Service {};

TEST(Server, RegistrationAndStartErrorsNameTheCause) {
  asio::io_context io;
  NullService a, b;
  {
    Server server(io.get_executor(), {.listen = {"tcp://127.0.0.1:0"}});
    EXPECT_TRUE(server.AddService(a).ok());
    Status dup = server.AddService(b);
    EXPECT_EQ(dup.code(), StatusCode::kAlreadyExists);
    EXPECT_THAT(dup.message(), HasSubstr("rdmarpc.test.Test/Echo"));
  }
  {
    Server server(io.get_executor(), {});
    EXPECT_EQ(server.Start().code(), StatusCode::kInvalidArgument);
  }
  {
    Server server(io.get_executor(), {.listen = {"tcp://127.0.0.1:0", "udp://1.2.3.4:5"}});
    Status st = server.Start();
    EXPECT_FALSE(st.ok());
    EXPECT_THAT(st.message(), HasSubstr("udp://1.2.3.4:5"));
  }
  {
    // Without an RDMA device (the host) the error says so; in the VM it listens.
    Server server(io.get_executor(), {.listen = {"rdma://127.0.0.1:0"}});
    Status st = server.Start();
    if (!st.ok()) {
      EXPECT_THAT(st.message(), HasSubstr("rdma://127.0.0.1:0"));
    }
  }
  io.run_for(std::chrono::milliseconds(50));
}

TEST(Channel, CreateValidatesTheTargetAndOptions) {
  asio::io_context io;
  EXPECT_FALSE(Channel::Create(io.get_executor(), "http://x:1").ok());
  EXPECT_FALSE(Channel::Create(io.get_executor(), "tcp://host").ok());
  EXPECT_FALSE(Channel::Create(io.get_executor(), "tcp://host:0").ok());
  EXPECT_FALSE(Channel::Create(io.get_executor(), "tcp://host:1", {.initial_backoff = std::chrono::milliseconds(0)}).ok());
  auto ok = Channel::Create(io.get_executor(), "tcp://127.0.0.1:1");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)->state(), Channel::State::kIdle);  // lazy: nothing happens until a call
}

TEST(Channel, RefusedConnectionFailsFastWithTheReason) {
  asio::io_context io;
  // Port 1 on loopback: nobody listens (connection refused).
  auto ch = Channel::Create(io.get_executor(), "tcp://127.0.0.1:1");
  ASSERT_TRUE(ch.ok());
  test::Test::Stub stub(*ch);
  ClientContext ctx;
  boost::system::error_code got;
  bool ran = false;
  Channel::State state_then = Channel::State::kIdle;
  stub.async_Echo(ctx, test::Payload(), [&](boost::system::error_code ec, test::Payload) {
    got = ec;
    ran = true;
    state_then = (*ch)->state();
  });
  EXPECT_FALSE(ran) << "handler ran inside the initiating call";
  io.run_for(std::chrono::seconds(5));
  ASSERT_TRUE(ran);
  EXPECT_EQ(ToStatusCode(got), StatusCode::kUnavailable);
  EXPECT_THAT(ctx.status().message(), HasSubstr("cannot connect to tcp://127.0.0.1:1"));
  EXPECT_EQ(state_then, Channel::State::kBackoff);
  // The backoff ran out and nobody is waiting: back to idle (lazy reconnect).
  EXPECT_EQ((*ch)->state(), Channel::State::kIdle);
}

// Asio lets an exception thrown by a completion handler out of run(), and the
// application may run the io_context again. Where the channel ends several
// calls at once, the calls after a handler that throws still complete, each
// once: `calls` calls on `stub`, the first handler throws, `act` (if any) runs
// on the io_context once they are started.
struct ThrowingFirstHandler {
  int completed = 0;
  int thrown = 0;
  std::vector<StatusCode> codes;

  void Run(asio::io_context& io, test::Test::Stub& stub, std::vector<ClientContext>& ctxs,
           const std::function<void()>& act) {
    for (size_t i = 0; i < ctxs.size(); ++i)
      stub.async_Echo(ctxs[i], test::Payload(), [this, i](boost::system::error_code ec, test::Payload) {
        ++completed;
        codes.push_back(ToStatusCode(ec));
        if (i == 0) throw std::runtime_error("handler of the first call");
      });
    if (act) asio::post(io, act);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!io.stopped() && std::chrono::steady_clock::now() < until) {
      try {
        io.run_for(until - std::chrono::steady_clock::now());
      } catch (const std::runtime_error&) {
        ++thrown;
      }
    }
  }
};

TEST(Channel, AHandlerThatThrowsOnARefusedConnectLeavesTheOtherCallsCompleted) {
  asio::io_context io;
  auto ch = Channel::Create(io.get_executor(), "tcp://127.0.0.1:1");  // nobody listens
  ASSERT_TRUE(ch.ok());
  test::Test::Stub stub(*ch);
  std::vector<ClientContext> ctxs(3);
  ThrowingFirstHandler h;
  h.Run(io, stub, ctxs, nullptr);
  EXPECT_EQ(h.thrown, 1);
  ASSERT_EQ(h.completed, 3) << "calls after the throwing handler were left uncompleted";
  for (StatusCode c : h.codes) EXPECT_EQ(c, StatusCode::kUnavailable);
  EXPECT_EQ((*ch)->state(), Channel::State::kIdle) << "nobody waits any more: no reconnect";
}

TEST(Channel, AHandlerThatThrowsOnCloseLeavesTheOtherCallsCompleted) {
  asio::io_context io;
  auto ch = Channel::Create(io.get_executor(), "tcp://127.0.0.1:1");
  ASSERT_TRUE(ch.ok());
  test::Test::Stub stub(*ch);
  // wait_for_ready: the refusals keep them queued until Close().
  std::vector<ClientContext> ctxs(3);
  for (auto& c : ctxs) c.set_wait_for_ready(true);
  ThrowingFirstHandler h;
  asio::steady_timer close_later(io, std::chrono::milliseconds(100));
  h.Run(io, stub, ctxs, [&] {
    close_later.async_wait([&](boost::system::error_code) { (*ch)->Close(); });
  });
  EXPECT_EQ(h.thrown, 1);
  ASSERT_EQ(h.completed, 3) << "calls after the throwing handler were left uncompleted";
  for (StatusCode c : h.codes) EXPECT_EQ(c, StatusCode::kCancelled);
  EXPECT_EQ((*ch)->state(), Channel::State::kClosed);
}

// The generated mock is a ChannelInterface: a real Stub drives it, with any token.
TEST(GeneratedMock, DrivesARealStubWithExpectations) {
  asio::io_context io;
  auto mock = std::make_shared<test::MockTestStub>(io.get_executor());
  test::Test::Stub stub(mock);
  EXPECT_CALL(*mock, Echo(_, _, _))
      .WillOnce([](ClientContext&, const test::Payload& req, test::Payload* resp) {
        resp->set_data("mocked:" + req.data());
        return Status();
      });
  EXPECT_CALL(*mock, Fail(_, _, _)).WillOnce(::testing::Return(Status(StatusCode::kPermissionDenied, "denied by the mock")));
  test::Payload req;
  req.set_data("hi");
  ClientContext c1, c2;
  std::string echoed;
  StatusCode failed = StatusCode::kOk;
  stub.async_Echo(c1, req, [&](boost::system::error_code ec, test::Payload r) { echoed = ec ? "error" : r.data(); });
  stub.async_Fail(c2, test::FailRequest(), [&](boost::system::error_code ec, test::Empty) { failed = ToStatusCode(ec); });
  io.run();
  EXPECT_EQ(echoed, "mocked:hi");
  EXPECT_EQ(failed, StatusCode::kPermissionDenied);
  EXPECT_EQ(c2.status().message(), "denied by the mock");
}

TEST(Keepalive, PingsAfterSilenceDeclaresDeadAfterTimeoutAndAnyFrameResets) {
  using internal::Keepalive;
  using ms = std::chrono::milliseconds;
  const KeepaliveOptions o{ms(1000), ms(500)};
  const auto t0 = Keepalive::Clock::now();
  Keepalive k(t0);
  EXPECT_EQ(k.Sweep(t0 + ms(999), o, 0), Keepalive::Action::kNone);   // not silent long enough
  EXPECT_EQ(k.Sweep(t0 + ms(1000), o, 0), Keepalive::Action::kPing);  // silent for interval
  EXPECT_EQ(k.Sweep(t0 + ms(1200), o, 0), Keepalive::Action::kNone);  // one PING, not one per sweep
  k.OnFrame();                                                      // the PONG (or any frame)
  EXPECT_EQ(k.Sweep(t0 + ms(1400), o, 0), Keepalive::Action::kNone);
  EXPECT_EQ(k.Sweep(t0 + ms(2399), o, 0), Keepalive::Action::kNone);  // silence counts from the frame
  EXPECT_EQ(k.Sweep(t0 + ms(2400), o, 0), Keepalive::Action::kPing);
  EXPECT_EQ(k.Sweep(t0 + ms(2899), o, 0), Keepalive::Action::kNone);
  EXPECT_EQ(k.Sweep(t0 + ms(2900), o, 0), Keepalive::Action::kDead);  // nothing within timeout of the PING
}

// Frames the transport takes in below the RPC layer (RDMA's CTS, CREDIT,
// WRITE-with-immediate) are signs of life too: a connection working through
// a backlog, whose PING waits behind its own messages and whose peer's
// answers wait behind rendezvous progress, is not declared dead.
TEST(Keepalive, TransportFramesCountAsLifeWithoutAnyRpcFrame) {
  using internal::Keepalive;
  using ms = std::chrono::milliseconds;
  const KeepaliveOptions o{ms(300), ms(500)};
  const auto t0 = Keepalive::Clock::now();
  Keepalive k(t0);
  uint64_t transport = 0;
  for (int i = 1; i <= 100; ++i) {
    transport += 3;  // CTS and CREDIT frames arrive; no RPC frame does
    EXPECT_EQ(k.Sweep(t0 + ms(100 * i), o, transport), Keepalive::Action::kNone) << i;
  }
  // Then nothing at all: the usual PING, and dead after the timeout.
  EXPECT_EQ(k.Sweep(t0 + ms(10'000 + 300), o, transport), Keepalive::Action::kPing);
  EXPECT_EQ(k.Sweep(t0 + ms(10'000 + 800), o, transport), Keepalive::Action::kDead);
  // A transport frame after a PING answers it as a PONG would.
  Keepalive k2(t0);
  EXPECT_EQ(k2.Sweep(t0 + ms(300), o, 0), Keepalive::Action::kPing);
  EXPECT_EQ(k2.Sweep(t0 + ms(700), o, 1), Keepalive::Action::kNone);
  EXPECT_EQ(k2.Sweep(t0 + ms(1000), o, 1), Keepalive::Action::kPing);
}

TEST(Keepalive, BusyConnectionNeverPingsAndZeroTurnsItOff) {
  using internal::Keepalive;
  using ms = std::chrono::milliseconds;
  const KeepaliveOptions o{ms(100), ms(100)};
  const auto t0 = Keepalive::Clock::now();
  Keepalive k(t0);
  for (int i = 1; i <= 100; ++i) {
    k.OnFrame();
    EXPECT_EQ(k.Sweep(t0 + ms(50 * i), o, 0), Keepalive::Action::kNone) << i;
  }
  EXPECT_TRUE(Keepalive::Enabled(o));
  EXPECT_FALSE(Keepalive::Enabled(KeepaliveOptions{ms(0), ms(100)}));
  EXPECT_FALSE(Keepalive::Enabled(KeepaliveOptions{ms(100), ms(0)}));
  EXPECT_EQ(Keepalive::Tick(KeepaliveOptions{ms(10'000), ms(2'000)}), ms(500));
  EXPECT_EQ(Keepalive::Tick(KeepaliveOptions{ms(20), ms(20)}), ms(10));
}

}  // namespace
}  // namespace rdmarpc
