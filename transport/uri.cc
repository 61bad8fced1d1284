#include "transport/uri.h"

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::transport {

std::string Uri::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return absl::StrCat(scheme == Scheme::kRdma ? "rdma://" : "tcp://", v6 ? "[" : "", host,
                      v6 ? "]" : "", ":", port);
}

absl::StatusOr<Uri> ParseUri(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("bad endpoint URI '", text, "': ", why,
                                                   " (expected rdma://HOST:PORT or tcp://HOST:PORT)"));
  };
  Uri uri;
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "rdma://")) {
    uri.scheme = Uri::Scheme::kRdma;
  } else if (absl::ConsumePrefix(&rest, "tcp://")) {
    uri.scheme = Uri::Scheme::kTcp;
  } else {
    return bad("unknown scheme");
  }
  absl::string_view port_text;
  if (absl::ConsumePrefix(&rest, "[")) {
    size_t close = rest.find(']');
    if (close == absl::string_view::npos) return bad("unclosed '['");
    uri.host = std::string(rest.substr(0, close));
    rest.remove_prefix(close + 1);
    if (!absl::ConsumePrefix(&rest, ":")) return bad("missing :PORT");
    port_text = rest;
  } else {
    size_t colon = rest.rfind(':');
    if (colon == absl::string_view::npos) return bad("missing :PORT");
    uri.host = std::string(rest.substr(0, colon));
    port_text = rest.substr(colon + 1);
    if (uri.host.find(':') != std::string::npos) return bad("IPv6 hosts need brackets");
  }
  if (uri.host.empty()) return bad("empty host");
  uint32_t port = 0;
  if (!absl::SimpleAtoi(port_text, &port) || port > 65535) return bad("port is not 0..65535");
  uri.port = static_cast<uint16_t>(port);
  return uri;
}

}  // namespace rdmarpc::transport
