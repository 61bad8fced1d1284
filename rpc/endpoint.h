// URI -> transport: how Channel and Server open rdma:// and tcp:// endpoints.
#pragma once

#include <memory>
#include <string>

#include <boost/asio/any_io_executor.hpp>

#include "absl/status/statusor.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/transport.h"
#include "transport/uri.h"

namespace rdmarpc {

namespace asio = boost::asio;

struct TransportOptions {
  rdma::RdmaOptions rdma;
  transport::tcp::TcpOptions tcp;
  // The RDMA device to use. Null: opened on first use from `rdma_device`;
  // when that is empty too, a listener on a specific address uses the device
  // that owns it and everything else the first ACTIVE port.
  std::shared_ptr<rdma::RdmaContext> rdma_context;
  rdma::DeviceSelector rdma_device;
  // Shared secret for both transports (transport/common/auth.h); when
  // non-empty it replaces rdma.auth_token and tcp.auth_token. A server with a
  // token refuses clients without a matching one before anything else happens
  // on their connection (the client's connect fails UNAUTHENTICATED: "server
  // requires an auth token" / "auth token mismatch"); a server without one
  // accepts every client, with or without a token. Keep it out of logs and
  // command lines: read it from a file or the environment.
  std::string auth_token;
};

// Opens (once) and returns the RDMA context for `options`; `local_ip` picks the
// device when neither a context nor a selector was given.
absl::StatusOr<std::shared_ptr<rdma::RdmaContext>> RdmaContextFor(TransportOptions& options,
                                                                  const std::string& local_ip);

// When options.rdma_context's device was removed (RdmaContext::removed()),
// lets go of it, so that the kernel's removal is not kept waiting by this
// reference and the next RdmaContextFor opens the device afresh (chosen by
// rdma_device or the address, as the first time); true if it did. Channel and
// Server call it when a connection or listener reports the removal.
bool ForgetRemovedRdmaContext(TransportOptions& options);

absl::StatusOr<std::unique_ptr<transport::Listener>> ListenOn(asio::any_io_executor ex,
                                                             const transport::Uri& uri,
                                                             TransportOptions& options);

void ConnectTo(asio::any_io_executor ex, const transport::Uri& uri, TransportOptions& options,
               transport::Listener::AcceptHandler handler);

}  // namespace rdmarpc
