// libFuzzer target: the TCP transport's stream framing (transport/tcp): the
// read loop that cuts a byte stream into length-prefixed messages. Each input
// is written by a plain socket to a connection accepted by a real tcp Listener
// on 127.0.0.1; the writer then half-closes.
//
// Input: byte 0 says how to deliver, the rest is the stream.
//   bit 7:    the receiver keeps a Receive() pending while the bytes arrive
//             (else it starts receiving only after the half-close, so the
//             connection's queue limit stops and restarts its read loop);
//   bits 0-6: chunk size; each chunk is written and the io_context polled
//             before the next, so frames straddle reads. 0: all at once.
//
// Invariant: the messages received are exactly those a reference parser
// finds in the stream (frames up to the first incomplete or oversized one),
// in order, byte for byte, and then Receive() fails with UNAVAILABLE.
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include "transport/tcp/tcp_transport.h"
#include "transport/uri.h"
#include "tests/fuzz/fuzz_support.h"

namespace rdmarpc::fuzz {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

// Small limits so fuzz inputs reach them: a frame longer than kMaxMessage
// ends the connection; more than kMaxQueued unreceived messages pause reading.
// (Frames above 64 KiB take the large-frame path; kMaxMessage lets a length
// prefix reach it.)
constexpr size_t kMaxMessage = 100'000;
constexpr size_t kMaxQueued = 3;
constexpr size_t kMaxInput = 1 << 20;  // a write of more could fill the socket buffers

transport::tcp::TcpOptions Options() {
  transport::tcp::TcpOptions o;
  o.max_message_size = kMaxMessage;
  o.max_queued_messages = kMaxQueued;
  o.max_queued_bytes = 4096;
  o.pooled_buffers = 4;
  o.pooled_buffer_max_bytes = 2048;
  return o;
}

struct World {
  asio::io_context io;
  std::unique_ptr<transport::Listener> listener;
  tcp::endpoint endpoint;
};
World* world = nullptr;

std::string Frame(const std::string& body) {
  std::string out;
  PutLe(out, body.size(), 4);
  return out + body;
}

std::vector<Seed> Seeds() {
  std::vector<Seed> seeds;
  const std::string three = Frame("one") + Frame("") + Frame(std::string(300, 't'));
  seeds.push_back({"three-at-once", std::string(1, '\0') + three});
  seeds.push_back({"three-byte-by-byte", std::string(1, '\x01') + three});
  seeds.push_back({"three-eager-chunks-of-5", std::string(1, '\x85') + three});
  std::string many;
  for (int i = 0; i < 10; ++i) many += Frame(std::string(static_cast<size_t>(i * 7), static_cast<char>('a' + i)));
  seeds.push_back({"ten-lazy", std::string(1, '\x10') + many});
  seeds.push_back({"ten-eager", std::string(1, '\x90') + many});
  seeds.push_back({"truncated-body", std::string(1, '\0') + Frame("complete") + Frame("cut short").substr(0, 8)});
  seeds.push_back({"truncated-length", std::string(1, '\0') + Frame("x") + std::string("\x05\x00", 2)});
  std::string big;
  PutLe(big, kMaxMessage + 1, 4);
  seeds.push_back({"oversized", std::string(1, '\0') + Frame("before") + big + "ignored"});
  std::string large;  // takes the large-frame path, then the stream ends
  PutLe(large, 70'000, 4);
  seeds.push_back({"large-frame-cut", std::string(1, '\x20') + Frame("before") + large + std::string(100, 'L')});
  seeds.push_back({"empty-stream", std::string(1, '\0')});
  return seeds;
}

// The reference: complete frames in order, up to the first bad or incomplete one.
std::vector<std::string> Expected(std::string_view stream) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (stream.size() - pos >= 4) {
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(stream[pos + i])) << (8 * i);
    if (n > kMaxMessage || stream.size() - pos - 4 < n) break;
    out.emplace_back(stream.substr(pos + 4, n));
    pos += 4 + n;
  }
  return out;
}

struct Received {
  std::vector<std::string> messages;
  std::optional<absl::Status> end;  // the first failed Receive()
  bool pending = false;
};

void ReceiveLoop(transport::Connection* c, std::shared_ptr<Received> r) {
  r->pending = true;
  c->Receive([c, r](absl::StatusOr<transport::Message> m) {
    r->pending = false;
    if (!m.ok()) {
      r->end = m.status();
      return;
    }
    r->messages.emplace_back(reinterpret_cast<const char*>(m->data().data()), m->size());
    m->Reset();
    ReceiveLoop(c, r);
  });
}

// Runs an async read or write of a whole buffer on the io_context until it
// completes: the error, or success.
template <typename Start>
boost::system::error_code Transfer(boost::asio::io_context& io, const char* what, Start start) {
  std::optional<boost::system::error_code> result;
  start([&](boost::system::error_code e, size_t) { result = e; });
  FUZZ_CHECK(RunUntil(io, [&] { return result.has_value(); }), what, " did not complete");
  return *result;
}

boost::system::error_code WriteAll(boost::asio::io_context& io, tcp::socket& socket, boost::asio::const_buffer b) {
  return Transfer(io, "write", [&](auto done) { boost::asio::async_write(socket, b, done); });
}

boost::system::error_code ReadAll(boost::asio::io_context& io, tcp::socket& socket, boost::asio::mutable_buffer b) {
  return Transfer(io, "read", [&](auto done) { boost::asio::async_read(socket, b, done); });
}

std::string Printable(const std::string& s) {
  return absl::StrCat(s.size(), " bytes");
}

}  // namespace
}  // namespace rdmarpc::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  using namespace rdmarpc::fuzz;
  MaybeWriteSeeds(argc, argv, Seeds);
  QuietLogs();
  world = new World;  // never freed: lives as long as the process
  auto listener = rdmarpc::transport::tcp::Listen(world->io.get_executor(), "127.0.0.1", 0, Options());
  FUZZ_CHECK(listener.ok(), listener.status().ToString());
  world->listener = std::move(*listener);
  auto uri = rdmarpc::transport::ParseUri(world->listener->local_uri());
  FUZZ_CHECK(uri.ok(), uri.status().ToString());
  world->endpoint = tcp::endpoint(boost::asio::ip::make_address(uri->host), uri->port);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdmarpc;
  using namespace rdmarpc::fuzz;
  if (size == 0 || size > kMaxInput) return -1;  // -1: not added to the corpus
  const bool eager = (data[0] & 0x80) != 0;
  const size_t chunk = data[0] & 0x7f;
  const std::string stream(reinterpret_cast<const char*>(data + 1), size - 1);
  boost::asio::io_context& io = world->io;

  std::unique_ptr<transport::Connection> conn;
  bool accepted = false;
  world->listener->Accept([&](absl::StatusOr<std::unique_ptr<transport::Connection>> c) {
    FUZZ_CHECK(c.ok(), c.status().ToString());
    conn = std::move(*c);
    accepted = true;
  });
  // The writer's operations are asynchronous, run to completion here: a
  // blocking connect/read/write fails with EINTR when libFuzzer's SIGALRM
  // arrives mid-call (a false finding, seen in CI); the io_context retries.
  tcp::socket writer(io);
  boost::system::error_code ec;
  std::optional<boost::system::error_code> connected;
  writer.async_connect(world->endpoint, [&](boost::system::error_code e) { connected = e; });
  FUZZ_CHECK(RunUntil(io, [&] { return connected.has_value(); }), "connect did not complete");
  FUZZ_CHECK(!*connected, "connect: ", connected->message());
  // The handshake (tcp_transport.h) first; the fuzzed bytes are the frames after it.
  auto hello = transport::tcp::EncodeClientHello("", 0xFFFFFFFFu);
  FUZZ_CHECK(hello.ok(), hello.status().ToString());
  ec = WriteAll(io, writer, boost::asio::buffer(*hello));
  FUZZ_CHECK(!ec, "hello: ", ec.message());
  FUZZ_CHECK(RunUntil(io, [&] { return accepted; }), "no connection accepted");
  std::array<std::byte, transport::tcp::kServerVerdictBytes> verdict;
  ec = ReadAll(io, writer, boost::asio::buffer(verdict));
  FUZZ_CHECK(!ec, "verdict: ", ec.message());

  auto received = std::make_shared<Received>();
  if (eager) ReceiveLoop(conn.get(), received);
  for (size_t pos = 0; pos < stream.size();) {
    const size_t n = chunk == 0 ? stream.size() - pos : std::min(chunk, stream.size() - pos);
    ec = WriteAll(io, writer, boost::asio::buffer(stream.data() + pos, n));
    if (ec) break;  // the connection gave up on an oversized frame and reset
    pos += n;
    io.poll();
    if (io.stopped()) io.restart();
  }
  writer.shutdown(tcp::socket::shutdown_send, ec);
  if (!eager) ReceiveLoop(conn.get(), received);
  FUZZ_CHECK(RunUntil(io, [&] { return received->end.has_value(); }),
             "Receive() neither delivered nor failed after the stream ended (", received->messages.size(),
             " messages so far)");

  const std::vector<std::string> expected = Expected(stream);
  FUZZ_CHECK(received->messages.size() == expected.size(), "received ", received->messages.size(),
             " messages, the stream holds ", expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    FUZZ_CHECK(received->messages[i] == expected[i], "message ", i, " differs: got ",
               Printable(received->messages[i]), ", sent ", Printable(expected[i]));
  FUZZ_CHECK(received->end->code() == absl::StatusCode::kUnavailable, "stream end reported as ",
             received->end->ToString());
  const auto stats = conn->stats();
  FUZZ_CHECK(stats.messages_received == expected.size(), "stats say ", stats.messages_received, " messages");

  conn->Close();
  conn.reset();
  writer.close(ec);
  io.poll();
  if (io.stopped()) io.restart();
  return 0;
}
