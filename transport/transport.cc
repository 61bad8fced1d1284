#include "transport/transport.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/completion.h"

namespace rdmarpc::transport {

void Connection::SendCopy(std::span<const std::byte> bytes, SendHandler handler) {
  auto buffer = Prepare(bytes.size());
  if (!buffer.ok()) {
    PostCompletion(get_executor(), std::move(handler), buffer.status());
    return;
  }
  if (!bytes.empty()) std::memcpy(buffer->data().data(), bytes.data(), bytes.size());
  Send(std::move(*buffer), std::move(handler));
}

std::string SummarizeStats(const ConnectionStats& s) {
  std::string out = absl::StrCat("messages_sent=", s.messages_sent, " messages_received=", s.messages_received);
  if (s.wr_posted == 0 && s.qp_state == 0) return out;  // not RDMA
  absl::StrAppend(&out, " wr_posted=", s.wr_posted, " wr_completed=", s.wr_completed,
                  " send_doorbells=", s.send_doorbells, " recv_doorbells=", s.recv_doorbells, " sends_unsignaled=", s.sends_unsignaled,
                  " send_queue_used=", s.send_queue_used, " credits_available=", s.credits_available,
                  " send_waits_for_credit=", s.send_waits_for_credit, " grants_live=", s.grants_live,
                  " grants_windowed=", s.grants_windowed, " invalidations_pending=", s.invalidations_pending,
                  " rendezvous_bytes_held=", s.rendezvous_bytes_held, " rendezvous_deferred=", s.rendezvous_deferred,
                  " wc_errors=", s.wc_errors, " rnr_errors=", s.rnr_errors, " qp_state=", s.qp_state);
  return out;
}

}  // namespace rdmarpc::transport
