#include "rpc/endpoint.h"

#include "rpc/status.h"
#include "transport/common/log.h"
#include "transport/completion.h"

namespace rdmarpc {
namespace {

// The per-transport options with TransportOptions-level settings applied.
transport::tcp::TcpOptions TcpFor(const TransportOptions& options) {
  transport::tcp::TcpOptions tcp = options.tcp;
  if (!options.auth_token.empty()) tcp.auth_token = options.auth_token;
  return tcp;
}
rdma::RdmaOptions RdmaFor(const TransportOptions& options) {
  rdma::RdmaOptions r = options.rdma;
  if (!options.auth_token.empty()) r.auth_token = options.auth_token;
  return r;
}

}  // namespace

bool ForgetRemovedRdmaContext(TransportOptions& options) {
  if (!options.rdma_context || !options.rdma_context->removed()) return false;
  RDMARPC_LOG(kWarn, "rdma", "event=context_dropped device=", options.rdma_context->device().name(),
              " reason=\"device removed\" action=\"reopen on the next connect or listen\"");
  options.rdma_context.reset();
  return true;
}

absl::StatusOr<std::shared_ptr<rdma::RdmaContext>> RdmaContextFor(TransportOptions& options,
                                                                  const std::string& local_ip) {
  ForgetRemovedRdmaContext(options);
  if (options.rdma_context) return options.rdma_context;
  rdma::DeviceSelector selector = options.rdma_device;
  const bool unspecified = local_ip.empty() || local_ip == "0.0.0.0" || local_ip == "::";
  if (selector.name.empty() && selector.local_ip.empty() && !unspecified) selector.local_ip = local_ip;
  auto context = rdma::RdmaContext::Open(selector);
  if (!context.ok()) return context.status();
  options.rdma_context = *context;
  return options.rdma_context;
}

absl::StatusOr<std::unique_ptr<transport::Listener>> ListenOn(asio::any_io_executor ex,
                                                             const transport::Uri& uri,
                                                             TransportOptions& options) {
  if (uri.scheme == transport::Uri::Scheme::kTcp)
    return transport::tcp::Listen(std::move(ex), uri.host, uri.port, TcpFor(options));
  auto context = RdmaContextFor(options, uri.host);
  if (!context.ok()) return context.status();
  return rdma::Listen(std::move(ex), *context, uri.host, uri.port, RdmaFor(options));
}

void ConnectTo(asio::any_io_executor ex, const transport::Uri& uri, TransportOptions& options,
               transport::Listener::AcceptHandler handler) {
  if (uri.scheme == transport::Uri::Scheme::kTcp) {
    transport::tcp::Connect(std::move(ex), uri.host, uri.port, TcpFor(options), std::move(handler));
    return;
  }
  auto context = RdmaContextFor(options, "");
  if (!context.ok()) {
    auto ex_copy = ex;
    transport::PostCompletion(ex_copy, std::move(handler),
                              absl::StatusOr<std::unique_ptr<transport::Connection>>(context.status()));
    return;
  }
  rdma::Connect(std::move(ex), *context, uri.host, uri.port, RdmaFor(options), std::move(handler));
}

}  // namespace rdmarpc
