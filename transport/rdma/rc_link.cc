#include "transport/rdma/rc_link.h"

#include "absl/strings/str_cat.h"
#include "transport/rdma/access.h"

namespace rdmarpc::rdma {

namespace {
// Inline data we ask the QP for: small eager messages skip the DMA read of the
// payload. 64 B covers a frame header plus a small body on most NICs (rxe
// supports far more); the QP reports what it really granted.
constexpr uint32_t kRequestedInline = 64;
}  // namespace

absl::Status RcLink::Init(std::unique_ptr<CmEndpoint> ep) {
  if (options_.slot_size == 0 || options_.send_slots <= 0 || options_.recv_slots <= 0)
    return absl::InvalidArgumentError("RcLinkOptions: slot_size and slot counts must be positive");
  endpoint_ = std::move(ep);
  const size_t total = options_.slot_size * static_cast<size_t>(options_.send_slots + options_.recv_slots);
  memory_.resize(total);
  auto mr = dev_.RegisterMemory(memory_.data(), total, access::kLocalOnly);
  if (!mr.ok()) return mr.status();
  mr_ = std::move(*mr);
  // Every posted WR can complete once: the CQ holds all of them at the same time.
  auto cq = CreateCq(dev_, options_.send_slots + options_.recv_slots, nullptr);
  if (!cq.ok()) return cq.status();
  cq_ = std::move(*cq);
  ibv_qp_init_attr attr{};
  attr.send_cq = cq_.get();
  attr.recv_cq = cq_.get();
  attr.cap.max_send_wr = static_cast<uint32_t>(options_.send_slots);
  attr.cap.max_recv_wr = static_cast<uint32_t>(options_.recv_slots);
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  attr.cap.max_inline_data = kRequestedInline;
  attr.sq_sig_all = 1;
  if (auto st = endpoint_->CreateQp(dev_.pd(), attr); !st.ok()) return st;
  ibv_qp_attr qattr{};
  ibv_qp_init_attr qinit{};
  if (ibv_query_qp(endpoint_->qp(), &qattr, IBV_QP_CAP, &qinit) == 0)
    max_inline_ = qinit.cap.max_inline_data;
  for (int i = 0; i < options_.recv_slots; ++i)
    if (auto st = PostRecv(i); !st.ok()) return st;
  return absl::OkStatus();
}

asio::awaitable<absl::StatusOr<std::unique_ptr<RcLink>>> RcLink::Connect(
    asio::any_io_executor ex, const Device& dev, std::string host, uint16_t port,
    RcLinkOptions options) {
  auto ep = co_await CmEndpoint::Resolve(ex, host, port, options.cm);
  if (!ep.ok()) co_return ep.status();
  std::unique_ptr<RcLink> link(new RcLink(dev, options));
  if (auto st = link->Init(std::move(*ep)); !st.ok()) co_return st;
  if (auto st = co_await link->endpoint_->Connect({}); !st.ok()) co_return st;
  co_return link;
}

asio::awaitable<absl::StatusOr<std::unique_ptr<RcLink>>> RcLink::Accept(
    CmListener& listener, const Device& dev, RcLinkOptions options) {
  auto ep = co_await listener.Accept();
  if (!ep.ok()) co_return ep.status();
  std::unique_ptr<RcLink> link(new RcLink(dev, options));
  if (auto st = link->Init(std::move(*ep)); !st.ok()) {
    (void)link->endpoint_->Reject(st.message());
    co_return st;
  }
  if (auto st = co_await link->endpoint_->Accept({}); !st.ok()) co_return st;
  co_return link;
}

std::span<std::byte> RcLink::send_slot(int i) {
  return {memory_.data() + static_cast<size_t>(i) * options_.slot_size, options_.slot_size};
}

std::span<std::byte> RcLink::recv_slot(int i) {
  return {memory_.data() + static_cast<size_t>(options_.send_slots + i) * options_.slot_size,
          options_.slot_size};
}

absl::Status RcLink::PostSend(int slot, size_t len) {
  if (slot < 0 || slot >= options_.send_slots || len > options_.slot_size)
    return absl::InvalidArgumentError(absl::StrCat("PostSend: slot ", slot, " len ", len,
                                                   " outside the link's slots"));
  ibv_sge sge{reinterpret_cast<uint64_t>(send_slot(slot).data()), static_cast<uint32_t>(len),
              mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = static_cast<uint64_t>(slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | (len <= max_inline_ ? IBV_SEND_INLINE : 0);
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(endpoint_->qp(), &wr, &bad); rc != 0)
    return ErrnoStatus(rc, "ibv_post_send(SEND)");
  return absl::OkStatus();
}

absl::Status RcLink::PostRecv(int slot) {
  if (slot < 0 || slot >= options_.recv_slots)
    return absl::InvalidArgumentError(absl::StrCat("PostRecv: slot ", slot, " out of range"));
  ibv_sge sge{reinterpret_cast<uint64_t>(recv_slot(slot).data()),
              static_cast<uint32_t>(options_.slot_size), mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = static_cast<uint64_t>(options_.send_slots + slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(endpoint_->qp(), &wr, &bad); rc != 0)
    return ErrnoStatus(rc, "ibv_post_recv");
  return absl::OkStatus();
}

int RcLink::Poll(std::span<ibv_wc> out) {
  return ibv_poll_cq(cq_.get(), static_cast<int>(out.size()), out.data());
}

}  // namespace rdmarpc::rdma
