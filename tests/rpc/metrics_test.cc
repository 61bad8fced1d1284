// Server metrics and the admin endpoint, over tcp:// on loopback: calls made
// through a real channel, then /metrics and /connections scraped over a real
// socket and parsed (Prometheus text format 0.0.4, JSON).
#include <atomic>
#include <cstdlib>
#include <future>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <gtest/gtest.h>

#include "rdmarpc/test/rpc_test.rdmarpc.pb.h"
#include "rpc/admin.h"
#include "rpc/channel.h"
#include "rpc/metrics.h"
#include "rpc/server.h"

// ---- Allocation counting (this binary only) ------------------------------------
// Replacing the basic forms is enough: libstdc++'s array, nothrow and sized
// forms forward to them. GCC sees our delete's free() inlined next to a call
// of operator new and warns of a mismatch that is not one here.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<uint64_t> g_allocations{0};
void* CountedAlloc(std::size_t n, std::size_t align) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  n = n == 0 ? 1 : n;
  void* p = align <= alignof(std::max_align_t) ? std::malloc(n)
                                               : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return CountedAlloc(n, alignof(std::max_align_t)); }
void* operator new(std::size_t n, std::align_val_t a) { return CountedAlloc(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace rdmarpc::testing {
namespace {

namespace asio = boost::asio;
using rdmarpc::test::Empty;
using rdmarpc::test::FailRequest;
using rdmarpc::test::Payload;
using rdmarpc::test::SleepRequest;
using TestSvc = rdmarpc::test::Test;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr seconds kWait{60};

class TestService final : public TestSvc::Service {
 public:
  asio::awaitable<Status> Echo(ServerContext&, const Payload& request, Payload& response) override {
    response = request;
    co_return Status();
  }
  asio::awaitable<Status> Fail(ServerContext&, const FailRequest& request, Empty&) override {
    co_return Status(static_cast<StatusCode>(request.code()), request.message());
  }
  asio::awaitable<Status> Sleep(ServerContext&, const SleepRequest& request, Empty&) override {
    asio::steady_timer timer(co_await asio::this_coro::executor, milliseconds(request.ms()));
    auto [ec] = co_await timer.async_wait(asio::as_tuple(asio::use_awaitable));
    co_return ec ? CancelledError("sleep interrupted") : Status();
  }
  asio::awaitable<Status> Throw(ServerContext&, const Empty&, Empty&) override {
    throw std::runtime_error("boom");
    co_return Status();
  }
};

// ---- A small Prometheus text-format parser ------------------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;  // family -> counter|gauge|histogram|...
  std::vector<std::string> errors;

  // Value of the one sample with this name and these labels (a subset match).
  std::optional<double> Find(const std::string& name, const std::map<std::string, std::string>& labels = {}) const {
    std::optional<double> found;
    for (const auto& s : samples) {
      if (s.name != name) continue;
      bool match = true;
      for (const auto& [k, v] : labels) {
        auto it = s.labels.find(k);
        match = match && it != s.labels.end() && it->second == v;
      }
      if (!match) continue;
      if (found) return std::nullopt;  // ambiguous
      found = s.value;
    }
    return found;
  }
  std::vector<const Sample*> All(const std::string& name, const std::string& key, const std::string& value) const {
    std::vector<const Sample*> out;
    for (const auto& s : samples)
      if (s.name == name && s.labels.count(key) && s.labels.at(key) == value) out.push_back(&s);
    return out;
  }
};

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IsNameChar(char c) { return IsNameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// Reads a metric name at `pos`; empty on failure.
std::string ReadName(const std::string& line, size_t& pos) {
  const size_t start = pos;
  if (pos >= line.size() || !IsNameStart(line[pos])) return "";
  while (pos < line.size() && IsNameChar(line[pos])) ++pos;
  return line.substr(start, pos - start);
}

std::optional<double> ParseValue(const std::string& text) {
  if (text == "+Inf") return HUGE_VAL;
  if (text == "-Inf") return -HUGE_VAL;
  if (text == "NaN") return std::nan("");
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) return std::nullopt;
  return v;
}

std::string Family(const std::string& name, const std::map<std::string, std::string>& types) {
  if (types.count(name)) return name;
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
      const std::string base = name.substr(0, name.size() - s.size());
      if (types.count(base) && types.at(base) == "histogram") return base;
    }
  }
  return "";
}

Exposition ParseExposition(const std::string& text) {
  Exposition e;
  size_t line_start = 0;
  int line_no = 0;
  while (line_start < text.size()) {
    size_t nl = text.find('\n', line_start);
    if (nl == std::string::npos) {
      e.errors.push_back("last line has no newline");
      nl = text.size();
    }
    const std::string line = text.substr(line_start, nl - line_start);
    line_start = nl + 1;
    ++line_no;
    auto error = [&](const std::string& why) { e.errors.push_back("line " + std::to_string(line_no) + ": " + why + ": " + line); };
    if (line.empty()) continue;
    if (line[0] == '#') {
      // "# HELP name text" / "# TYPE name type"; other comments are allowed.
      if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
        size_t pos = 7;
        const std::string name = ReadName(line, pos);
        if (name.empty() || pos >= line.size() || line[pos] != ' ') {
          error("bad HELP/TYPE");
          continue;
        }
        if (line[2] == 'T') {
          const std::string type = line.substr(pos + 1);
          if (type != "counter" && type != "gauge" && type != "histogram" && type != "summary" && type != "untyped")
            error("bad type");
          if (e.types.count(name)) error("TYPE twice");
          e.types[name] = type;
        }
      }
      continue;
    }
    Sample s;
    size_t pos = 0;
    s.name = ReadName(line, pos);
    if (s.name.empty()) {
      error("bad metric name");
      continue;
    }
    bool ok = true;
    if (pos < line.size() && line[pos] == '{') {
      ++pos;
      while (ok && pos < line.size() && line[pos] != '}') {
        size_t key_start = pos;
        if (!IsNameStart(line[pos]) || line[pos] == ':') {
          ok = false;
          break;
        }
        while (pos < line.size() && IsNameChar(line[pos]) && line[pos] != ':') ++pos;
        const std::string key = line.substr(key_start, pos - key_start);
        if (pos + 1 >= line.size() || line[pos] != '=' || line[pos + 1] != '"') {
          ok = false;
          break;
        }
        pos += 2;
        std::string value;
        while (pos < line.size() && line[pos] != '"') {
          if (line[pos] == '\\') {
            if (pos + 1 >= line.size()) break;
            const char c = line[pos + 1];
            if (c == 'n')
              value += '\n';
            else if (c == '\\' || c == '"')
              value += c;
            else
              ok = false;
            pos += 2;
          } else {
            value += line[pos++];
          }
        }
        if (pos >= line.size()) {
          ok = false;
          break;
        }
        ++pos;  // closing quote
        if (s.labels.count(key)) ok = false;
        s.labels[key] = value;
        if (pos < line.size() && line[pos] == ',') ++pos;
      }
      if (!ok || pos >= line.size() || line[pos] != '}') {
        error("bad label set");
        continue;
      }
      ++pos;
    }
    if (pos >= line.size() || line[pos] != ' ') {
      error("no space before the value");
      continue;
    }
    const std::string rest = line.substr(pos + 1);
    const std::string value_text = rest.substr(0, rest.find(' '));  // an optional timestamp may follow
    auto v = ParseValue(value_text);
    if (!v) {
      error("bad value");
      continue;
    }
    s.value = *v;
    if (Family(s.name, e.types).empty()) error("sample without a TYPE line before it");
    e.samples.push_back(std::move(s));
  }
  return e;
}

// ---- A tiny JSON syntax checker -----------------------------------------------

struct JsonChecker {
  const std::string& s;
  size_t i = 0;
  void Ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  }
  bool Lit(const char* w) {
    const std::string t(w);
    if (s.compare(i, t.size(), t) != 0) return false;
    i += t.size();
    return true;
  }
  bool String() {
    if (i >= s.size() || s[i] != '"') return false;
    for (++i; i < s.size(); ++i) {
      if (s[i] == '\\') {
        ++i;
      } else if (s[i] == '"') {
        ++i;
        return true;
      } else if (static_cast<unsigned char>(s[i]) < 0x20) {
        return false;
      }
    }
    return false;
  }
  bool Number() {
    const size_t start = i;
    if (i < s.size() && s[i] == '-') ++i;
    while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.' || s[i] == 'e' ||
                            s[i] == 'E' || s[i] == '+' || s[i] == '-'))
      ++i;
    return i > start;
  }
  bool Value() {
    Ws();
    if (i >= s.size()) return false;
    bool ok = false;
    if (s[i] == '{') {
      ++i;
      Ws();
      if (i < s.size() && s[i] == '}') {
        ++i;
        ok = true;
      } else {
        for (;;) {
          Ws();
          if (!String()) return false;
          Ws();
          if (i >= s.size() || s[i++] != ':') return false;
          if (!Value()) return false;
          Ws();
          if (i < s.size() && s[i] == ',') {
            ++i;
            continue;
          }
          if (i < s.size() && s[i] == '}') {
            ++i;
            ok = true;
          }
          break;
        }
      }
    } else if (s[i] == '[') {
      ++i;
      Ws();
      if (i < s.size() && s[i] == ']') {
        ++i;
        ok = true;
      } else {
        for (;;) {
          if (!Value()) return false;
          Ws();
          if (i < s.size() && s[i] == ',') {
            ++i;
            continue;
          }
          if (i < s.size() && s[i] == ']') {
            ++i;
            ok = true;
          }
          break;
        }
      }
    } else if (s[i] == '"') {
      ok = String();
    } else if (Lit("true") || Lit("false") || Lit("null")) {
      ok = true;
    } else {
      ok = Number();
    }
    Ws();
    return ok;
  }
  bool Document() { return Value() && i == s.size(); }
};

// ---- HTTP over a real socket ----------------------------------------------------

struct HttpReply {
  int status = 0;
  std::string headers;
  std::string body;
};

// Sends `request` verbatim to the admin endpoint and reads until it closes.
HttpReply RawHttp(const std::string& admin_uri, const std::string& request) {
  // "http://127.0.0.1:PORT"
  const std::string hostport = admin_uri.substr(std::string("http://").size());
  const size_t colon = hostport.rfind(':');
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  socket.connect({asio::ip::make_address(hostport.substr(0, colon)),
                  static_cast<uint16_t>(std::stoi(hostport.substr(colon + 1)))});
  asio::write(socket, asio::buffer(request));
  std::string all;
  boost::system::error_code ec;
  asio::read(socket, asio::dynamic_buffer(all), ec);  // to EOF: the server closes after its response
  EXPECT_EQ(ec, asio::error::eof) << ec.message();
  HttpReply reply;
  const size_t end = all.find("\r\n\r\n");
  if (all.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) {
    ADD_FAILURE() << "not an HTTP response: " << all.substr(0, 200);
    return reply;
  }
  reply.status = std::stoi(all.substr(9, 3));
  reply.headers = all.substr(0, end);
  reply.body = all.substr(end + 4);
  const size_t cl = reply.headers.find("Content-Length: ");
  EXPECT_NE(cl, std::string::npos);
  if (cl != std::string::npos) {
    EXPECT_EQ(std::stoul(reply.headers.substr(cl + 16)), reply.body.size());
  }
  return reply;
}

HttpReply Get(const std::string& admin_uri, const std::string& path) {
  return RawHttp(admin_uri, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nUser-Agent: metrics_test\r\n\r\n");
}

// ---- Environment --------------------------------------------------------------

class Env {
 public:
  explicit Env(std::string admin_listen = "127.0.0.1:0") : work_(asio::make_work_guard(io_)) {
    thread_ = std::thread([this] { io_.run(); });
    start_status_ = OnIo([&] {
      ServerOptions options;
      options.listen = {"tcp://127.0.0.1:0"};
      options.admin_listen = admin_listen;
      server_ = std::make_unique<Server>(io_.get_executor(), options);
      EXPECT_TRUE(server_->AddService(service_).ok());
      return server_->Start();
    });
  }
  ~Env() {
    OnIo([this] {
      channel_.reset();
      server_.reset();
      return 0;
    });
    work_.reset();
    auto stopper = std::async(std::launch::async, [this] {
      std::this_thread::sleep_for(milliseconds(200));
      io_.stop();
    });
    thread_.join();
  }

  template <typename F>
  auto OnIo(F f) -> decltype(f()) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto fut = task.get_future();
    asio::post(io_, [&task] { task(); });
    if (fut.wait_for(kWait) != std::future_status::ready) {
      ADD_FAILURE() << "io thread stuck";
      std::abort();
    }
    return fut.get();
  }

  const Status& start_status() const { return start_status_; }
  Server& server() { return *server_; }
  std::string admin_uri() {
    return OnIo([this] { return server_->admin_uri(); });
  }
  void CloseChannel() {
    OnIo([this] {
      channel_->Close();
      return 0;
    });
  }
  std::shared_ptr<Channel> channel() { return channel_; }
  TestSvc::Stub Stub() {
    return OnIo([this] {
      auto ch = Channel::Create(io_.get_executor(), server_->local_uris().at(0));
      EXPECT_TRUE(ch.ok());
      channel_ = *ch;
      return TestSvc::Stub(channel_);
    });
  }

 private:
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  TestService service_;
  std::unique_ptr<Server> server_;
  std::shared_ptr<Channel> channel_;
  Status start_status_;
};

template <typename Resp, typename Start>
StatusCode Sync(Start&& start) {
  auto promise = std::make_shared<std::promise<StatusCode>>();
  auto fut = promise->get_future();
  start([promise](boost::system::error_code ec, Resp) { promise->set_value(ToStatusCode(ec)); });
  if (fut.wait_for(kWait) != std::future_status::ready) {
    ADD_FAILURE() << "call stuck";
    std::abort();
  }
  return fut.get();
}

constexpr char kEcho[] = "rdmarpc.test.Test/Echo";
constexpr char kFail[] = "rdmarpc.test.Test/Fail";

// Checks one method's histogram: cumulative, monotone, +Inf == _count, and
// returns _count.
double CheckHistogram(const Exposition& e, const std::string& method) {
  const std::string base = "rdmarpc_server_call_duration_microseconds";
  auto buckets = e.All(base + "_bucket", "method", method);
  EXPECT_EQ(buckets.size(), kLatencyBucketBoundsUs.size() + 1);
  double prev_le = -1, prev_count = 0;
  for (const Sample* b : buckets) {
    EXPECT_TRUE(b->labels.count("le"));
    const double le = *ParseValue(b->labels.at("le"));
    EXPECT_GT(le, prev_le) << "le out of order";
    EXPECT_GE(b->value, prev_count) << "buckets not cumulative at le=" << b->labels.at("le");
    prev_le = le;
    prev_count = b->value;
  }
  EXPECT_EQ(buckets.back()->labels.at("le"), "+Inf");
  auto count = e.Find(base + "_count", {{"method", method}});
  auto sum = e.Find(base + "_sum", {{"method", method}});
  EXPECT_TRUE(count && sum);
  if (!count) return -1;
  EXPECT_EQ(*count, buckets.back()->value);
  return *count;
}

TEST(RpcMetrics, ScrapeMatchesTheCallsMade) {
  Env env;
  ASSERT_TRUE(env.start_status().ok()) << env.start_status().ToString();
  const std::string admin = env.admin_uri();
  ASSERT_EQ(admin.rfind("http://127.0.0.1:", 0), 0u) << admin;
  auto stub = env.Stub();

  constexpr int kEchoes = 37, kNotFound = 5, kAborted = 3;
  for (int i = 0; i < kEchoes; ++i) {
    Payload req;
    req.set_data(std::string(static_cast<size_t>(i * 10), 'x'));
    ClientContext ctx;
    ASSERT_EQ(Sync<Payload>([&](auto t) { stub.async_Echo(ctx, req, t); }), StatusCode::kOk);
  }
  for (auto [code, n] : {std::pair{StatusCode::kNotFound, kNotFound}, std::pair{StatusCode::kAborted, kAborted}}) {
    for (int i = 0; i < n; ++i) {
      FailRequest req;
      req.set_code(static_cast<uint32_t>(code));
      req.set_message("as asked");
      ClientContext ctx;
      ASSERT_EQ(Sync<Empty>([&](auto t) { stub.async_Fail(ctx, req, t); }), code);
    }
  }

  HttpReply reply = Get(admin, "/metrics");
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_NE(reply.headers.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << reply.headers;
  const Exposition e = ParseExposition(reply.body);
  for (const auto& err : e.errors) ADD_FAILURE() << err;
  ASSERT_TRUE(e.errors.empty()) << reply.body;

  EXPECT_EQ(e.types.at("rdmarpc_server_calls_total"), "counter");
  EXPECT_EQ(e.types.at("rdmarpc_server_call_duration_microseconds"), "histogram");
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", kEcho}, {"code", "OK"}}), kEchoes);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", kFail}, {"code", "NOT_FOUND"}}), kNotFound);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", kFail}, {"code", "ABORTED"}}), kAborted);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", kFail}, {"code", "OK"}}), 0);
  // Nothing else was counted for these methods.
  double echo_total = 0, fail_total = 0;
  for (const Sample* s : e.All("rdmarpc_server_calls_total", "method", kEcho)) echo_total += s->value;
  for (const Sample* s : e.All("rdmarpc_server_calls_total", "method", kFail)) fail_total += s->value;
  EXPECT_EQ(echo_total, kEchoes);
  EXPECT_EQ(fail_total, kNotFound + kAborted);

  EXPECT_EQ(CheckHistogram(e, kEcho), kEchoes);
  EXPECT_EQ(CheckHistogram(e, kFail), kNotFound + kAborted);
  EXPECT_EQ(CheckHistogram(e, "rdmarpc.test.Test/Sleep"), 0);  // registered, never called

  EXPECT_EQ(e.Find("rdmarpc_server_connections_open"), 1);
  EXPECT_EQ(e.Find("rdmarpc_server_connections_accepted_total"), 1);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_started_total"), kEchoes + kNotFound + kAborted);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_in_flight"), 0);
  // The connection's transport counters: every request was received on it.
  auto received = e.Find("rdmarpc_connection_messages_received_total", {{"transport", "tcp"}});
  ASSERT_TRUE(received) << reply.body;
  EXPECT_GE(*received, kEchoes + kNotFound + kAborted);
  auto sent = e.Find("rdmarpc_connection_messages_sent_total", {{"transport", "tcp"}});
  ASSERT_TRUE(sent);
  EXPECT_GE(*sent, kEchoes + kNotFound + kAborted);
  for (const char* name : {"rdmarpc_connection_wr_posted_total", "rdmarpc_connection_wr_completed_total",
                           "rdmarpc_connection_credits_available", "rdmarpc_connection_rnr_errors_total",
                           "rdmarpc_connection_wc_errors_total", "rdmarpc_connection_grants_live",
                           "rdmarpc_connection_eager_bytes_total", "rdmarpc_connection_rendezvous_bytes_total",
                           "rdmarpc_connection_bytes_received_total", "rdmarpc_connection_frames_received_total",
                           "rdmarpc_connection_calls_in_flight"})
    EXPECT_TRUE(e.Find(name, {{"transport", "tcp"}}).has_value()) << name;
  // The registry agrees with the page.
  env.OnIo([&] {
    const MethodMetrics* echo = env.server().metrics().Find(kEcho);
    EXPECT_NE(echo, nullptr);
    if (echo) {
      EXPECT_EQ(echo->calls(), static_cast<uint64_t>(kEchoes));
    }
    return 0;
  });
}

TEST(RpcMetrics, ConnectionsPageIsJsonAndShowsTheConnection) {
  Env env;
  ASSERT_TRUE(env.start_status().ok());
  auto stub = env.Stub();
  Payload req;
  req.set_data("hello");
  ClientContext ctx;
  ASSERT_EQ(Sync<Payload>([&](auto t) { stub.async_Echo(ctx, req, t); }), StatusCode::kOk);

  HttpReply reply = Get(env.admin_uri(), "/connections");
  ASSERT_EQ(reply.status, 200);
  EXPECT_NE(reply.headers.find("Content-Type: application/json"), std::string::npos);
  JsonChecker json{reply.body};
  EXPECT_TRUE(json.Document()) << "not JSON (stopped at " << json.i << "): " << reply.body;
  for (const char* field : {"\"id\":1", "\"peer\":\"tcp://127.0.0.1:", "\"transport\":\"tcp\"", "\"calls_in_flight\":0",
                            "\"messages_received\":", "\"messages_sent\":", "\"bytes_received\":", "\"wr_posted\":",
                            "\"wr_completed\":", "\"credits_available\":", "\"rnr_errors\":", "\"wc_errors\":",
                            "\"grants_live\":", "\"eager_bytes\":", "\"rendezvous_bytes\":"})
    EXPECT_NE(reply.body.find(field), std::string::npos) << field << " missing: " << reply.body;
  EXPECT_EQ(reply.body.find("\"id\":2"), std::string::npos) << "one connection only: " << reply.body;

  // Closed connections leave the page.
  env.CloseChannel();
  std::string body;
  for (int i = 0; i < 500; ++i) {
    body = Get(env.admin_uri(), "/connections").body;
    if (body.find("\"id\":1") == std::string::npos) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(body, "{\"connections\":[\n]}\n");
  JsonChecker empty{body};
  EXPECT_TRUE(empty.Document());
}

// Calls that end without a normal answer are counted under the code the
// client saw: deadline, handler exception; unknown methods
// only in their own counter.
TEST(RpcMetrics, AbnormalEndsAreCountedUnderTheirCode) {
  Env env;
  ASSERT_TRUE(env.start_status().ok());
  auto stub = env.Stub();
  {
    SleepRequest req;
    req.set_ms(60'000);
    ClientContext ctx;
    ctx.set_timeout(milliseconds(50));
    EXPECT_EQ(Sync<Empty>([&](auto t) { stub.async_Sleep(ctx, req, t); }), StatusCode::kDeadlineExceeded);
  }
  {
    ClientContext ctx;
    EXPECT_EQ(Sync<Empty>([&](auto t) { stub.async_Throw(ctx, Empty(), t); }), StatusCode::kInternal);
  }
  {
    rdmarpc::test::Unserved::Stub unserved(env.channel());
    ClientContext ctx;
    EXPECT_EQ(Sync<Empty>([&](auto t) { unserved.async_Nothing(ctx, Empty(), t); }), StatusCode::kUnimplemented);
  }
  // The deadline's answer goes out before the handler unwinds: wait for it.
  Exposition e;
  for (int i = 0; i < 500; ++i) {
    e = ParseExposition(Get(env.admin_uri(), "/metrics").body);
    if (e.Find("rdmarpc_server_call_duration_microseconds_count", {{"method", "rdmarpc.test.Test/Sleep"}}) == 1) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_TRUE(e.errors.empty());
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", "rdmarpc.test.Test/Sleep"}, {"code", "DEADLINE_EXCEEDED"}}), 1);
  EXPECT_EQ(CheckHistogram(e, "rdmarpc.test.Test/Sleep"), 1);
  // It ran for about its deadline: nothing at or below 20 ms.
  EXPECT_EQ(e.Find("rdmarpc_server_call_duration_microseconds_bucket",
                   {{"method", "rdmarpc.test.Test/Sleep"}, {"le", "20000"}}), 0);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_total", {{"method", "rdmarpc.test.Test/Throw"}, {"code", "INTERNAL"}}), 1);
  EXPECT_EQ(e.Find("rdmarpc_server_unknown_method_calls_total"), 1);
  EXPECT_EQ(e.Find("rdmarpc_server_calls_cancelled_total"), 1);
  EXPECT_TRUE(e.All("rdmarpc_server_calls_total", "method", "rdmarpc.test.Unserved/Nothing").empty());
}

TEST(RpcMetrics, UnknownPathIs404AndOtherMethodsAre405) {
  Env env;
  ASSERT_TRUE(env.start_status().ok());
  const std::string admin = env.admin_uri();
  EXPECT_EQ(Get(admin, "/").status, 404);
  EXPECT_EQ(Get(admin, "/metricsx").status, 404);
  EXPECT_EQ(Get(admin, "/metrics?format=text").status, 200);
  EXPECT_EQ(RawHttp(admin, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").status, 405);
  EXPECT_EQ(RawHttp(admin, "garbage\r\n\r\n").status, 400);
  // A request head larger than the limit is refused, not buffered.
  const std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(AdminServer::kMaxRequestBytes, 'a') + "\r\n\r\n";
  EXPECT_EQ(RawHttp(admin, big).status, 431);
  // Still serving afterwards.
  EXPECT_EQ(Get(admin, "/metrics").status, 200);
}

TEST(RpcMetrics, AdminBindsLoopbackByDefault) {
  for (const char* listen : {":0", "0"}) {
    Env env(listen);
    ASSERT_TRUE(env.start_status().ok()) << listen << ": " << env.start_status().ToString();
    EXPECT_EQ(env.admin_uri().rfind("http://127.0.0.1:", 0), 0u) << env.admin_uri();
    EXPECT_EQ(Get(env.admin_uri(), "/metrics").status, 200);
  }
  auto ep = ParseAdminListen("[::1]:9100");
  ASSERT_TRUE(ep.ok());
  EXPECT_TRUE(ep->address().is_v6());
  EXPECT_EQ(ep->port(), 9100);
  for (const char* bad : {"", "localhost:80", "127.0.0.1:", "127.0.0.1:70000", "[::1]", "1.2.3.4:x"})
    EXPECT_FALSE(ParseAdminListen(bad).ok()) << bad;
}

TEST(RpcMetrics, NoAdminEndpointUnlessAsked) {
  Env env("");
  ASSERT_TRUE(env.start_status().ok());
  EXPECT_EQ(env.admin_uri(), "");
}

TEST(RpcMetrics, BadAdminListenFailsStart) {
  Env env("not-an-address:1");
  EXPECT_EQ(env.start_status().code(), StatusCode::kInvalidArgument) << env.start_status().ToString();
  EXPECT_EQ(env.admin_uri(), "");
}

TEST(RpcMetrics, GracefulShutdownClosesTheAdminEndpoint) {
  // No work guard: io.run() returns only if shutdown leaves nothing pending.
  asio::io_context io;
  TestService service;
  ServerOptions options;
  options.listen = {"tcp://127.0.0.1:0"};
  options.admin_listen = "127.0.0.1:0";
  auto server = std::make_unique<Server>(io.get_executor(), options);
  ASSERT_TRUE(server->AddService(service).ok());
  ASSERT_TRUE(server->Start().ok());
  bool done = false;
  server->async_shutdown(milliseconds(100), [&] { done = true; });
  auto runner = std::async(std::launch::async, [&] { io.run(); });
  if (runner.wait_for(seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "io_context still has work after shutdown (admin endpoint left open?)";
    io.stop();
  }
  runner.get();
  EXPECT_TRUE(done);
}

// Recording a call is increments into a pre-created entry: no allocation.
TEST(RpcMetrics, RecordingACallDoesNotAllocate) {
  ServerMetrics metrics;
  MethodMetrics* m = metrics.AddMethod(MethodInfo{kEcho, MethodId(kEcho), false, false});
  m->Record(StatusCode::kOk, std::chrono::microseconds(3));  // warm-up
  const uint64_t before = g_allocations.load();
  for (int i = 0; i < 100'000; ++i)
    m->Record(static_cast<StatusCode>(i % (kMaxStatusCode + 1)), std::chrono::microseconds(i * 97));
  m->Record(static_cast<StatusCode>(200), std::chrono::seconds(100));  // out of range code, +Inf bucket
  m->Record(StatusCode::kOk, std::chrono::microseconds(-5));           // clock oddity: counted as 0
  EXPECT_EQ(g_allocations.load() - before, 0u);
  EXPECT_EQ(m->calls(), 100'003u);
  EXPECT_EQ(m->latency.count(), 100'003u);
  EXPECT_EQ(m->latency.counts().back(), 1u);  // only the 100 s one passes 10 s (i*97 us < 10 s)
  EXPECT_EQ(m->latency.counts().front(), 2u);      // 3 us warm-up is in le=5; 0 us twice: i=0 and -5
}

TEST(RpcMetrics, HistogramBucketsAreInclusiveUpperBounds) {
  LatencyHistogram h;
  h.Record(0);
  h.Record(1);
  h.Record(2);
  h.Record(3);
  h.Record(10'000'000);
  h.Record(10'000'001);
  EXPECT_EQ(h.counts()[0], 2u);  // 0, 1
  EXPECT_EQ(h.counts()[1], 1u);  // 2
  EXPECT_EQ(h.counts()[2], 1u);  // 3 -> le=5
  EXPECT_EQ(h.counts()[kLatencyBucketBoundsUs.size() - 1], 1u);
  EXPECT_EQ(h.counts().back(), 1u);
  EXPECT_EQ(h.count(), 6u);
  EXPECT_EQ(h.sum_us(), 0u + 1 + 2 + 3 + 10'000'000 + 10'000'001);
}

// BucketOf starts from a table by bit width: it must agree with the
// definition (the first bound >= the value) everywhere, in particular at every
// bound and power of two and either side of them.
TEST(RpcMetrics, HistogramBucketOfAgreesWithTheBoundsEverywhere) {
  auto by_definition = [](uint64_t us) {
    size_t i = 0;
    while (i < kLatencyBucketBoundsUs.size() && us > kLatencyBucketBoundsUs[i]) ++i;
    return i;
  };
  std::vector<uint64_t> values;
  for (uint64_t us = 0; us <= 20'000; ++us) values.push_back(us);
  for (uint64_t b : kLatencyBucketBoundsUs)
    for (uint64_t d : {b - 1, b, b + 1}) values.push_back(d);
  for (int w = 1; w < 64; ++w)
    for (uint64_t d : {(uint64_t{1} << w) - 1, uint64_t{1} << w, (uint64_t{1} << w) + 1}) values.push_back(d);
  values.push_back(~uint64_t{0});
  for (uint64_t us : values) ASSERT_EQ(LatencyHistogram::BucketOf(us), by_definition(us)) << us << " us";
}

TEST(RpcMetrics, ExpositionParserRejectsBadLines) {
  EXPECT_TRUE(ParseExposition("# TYPE a counter\na 1\n").errors.empty());
  EXPECT_FALSE(ParseExposition("a 1\n").errors.empty());                                // no TYPE
  EXPECT_FALSE(ParseExposition("# TYPE a counter\na{x=\"1} 1\n").errors.empty());      // open quote
  EXPECT_FALSE(ParseExposition("# TYPE a counter\na{x=1} 1\n").errors.empty());        // unquoted
  EXPECT_FALSE(ParseExposition("# TYPE a counter\na one\n").errors.empty());           // value
  EXPECT_FALSE(ParseExposition("# TYPE a countr\na 1\n").errors.empty());              // type
  EXPECT_TRUE(ParseExposition("# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n").errors.empty());
  const std::string escaped = "# TYPE a gauge\na{p=\"x\\\"y\\\\z\\n\"} 2\n";
  const auto e = ParseExposition(escaped);
  ASSERT_TRUE(e.errors.empty());
  EXPECT_EQ(e.samples.at(0).labels.at("p"), "x\"y\\z\n");
  EXPECT_EQ(metrics_internal::EscapeLabel("x\"y\\z\n"), "x\\\"y\\\\z\\n");
}

}  // namespace
}  // namespace rdmarpc::testing
