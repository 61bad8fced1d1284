// RAII ownership for libibverbs and librdmacm handles.
//
// Every handle is a move-only std::unique_ptr with a noexcept deleter that logs
// (never throws) when the library refuses to free it. Factories return
// absl::StatusOr so that callers see *why* a resource could not be made: the
// device, the port and the errno text are part of every message.
//
// Destruction order is carried by declaration order in the owning structs:
// declare the context first, then PD, CQ, QP ... and C++ tears them down in
// reverse, which is what the verbs API requires.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc::rdma {

namespace detail {
struct PdDeleter { void operator()(ibv_pd* p) const noexcept; };
struct MrDeleter { void operator()(ibv_mr* p) const noexcept; };
struct MwDeleter { void operator()(ibv_mw* p) const noexcept; };
struct CompChannelDeleter { void operator()(ibv_comp_channel* p) const noexcept; };
struct CqDeleter { void operator()(ibv_cq* p) const noexcept; };
struct SrqDeleter { void operator()(ibv_srq* p) const noexcept; };
struct QpDeleter { void operator()(ibv_qp* p) const noexcept; };
struct CmEventChannelDeleter { void operator()(rdma_event_channel* p) const noexcept; };
struct CmIdDeleter { void operator()(rdma_cm_id* p) const noexcept; };
struct CmEventDeleter { void operator()(rdma_cm_event* p) const noexcept; };
// A QP created through rdma_create_qp belongs to its cm_id: freed by rdma_destroy_qp.
struct CmQpDeleter { void operator()(rdma_cm_id* id) const noexcept; };
struct DeviceListDeleter { void operator()(ibv_context** p) const noexcept; };

// One Device's use of a librdmacm device context, counted per process so that
// the last user of a removed device can tell it is the last
// (Device::ReleaseRemoved). Move-only.
class ContextUse {
 public:
  ContextUse() = default;
  explicit ContextUse(ibv_context* context);
  ContextUse(ContextUse&& other) noexcept : context_(other.context_) { other.context_ = nullptr; }
  ContextUse& operator=(ContextUse&& other) noexcept;
  ~ContextUse() { Reset(); }
  // Drops this use; true if it was the last one of the process on the context.
  bool Reset() noexcept;

 private:
  ibv_context* context_ = nullptr;
};
}  // namespace detail

using PdPtr = std::unique_ptr<ibv_pd, detail::PdDeleter>;
using MrPtr = std::unique_ptr<ibv_mr, detail::MrDeleter>;
// A memory window. Deallocating a bound window unbinds it; it must go before
// the MR it is bound over (rxe refuses to deregister an MR with windows bound).
using MwPtr = std::unique_ptr<ibv_mw, detail::MwDeleter>;
using CompChannelPtr = std::unique_ptr<ibv_comp_channel, detail::CompChannelDeleter>;
using CqPtr = std::unique_ptr<ibv_cq, detail::CqDeleter>;
using SrqPtr = std::unique_ptr<ibv_srq, detail::SrqDeleter>;
using QpPtr = std::unique_ptr<ibv_qp, detail::QpDeleter>;
using CmEventChannelPtr = std::unique_ptr<rdma_event_channel, detail::CmEventChannelDeleter>;
using CmIdPtr = std::unique_ptr<rdma_cm_id, detail::CmIdDeleter>;
// Acks the event when it goes out of scope: every CM event is acked exactly once.
using CmEventPtr = std::unique_ptr<rdma_cm_event, detail::CmEventDeleter>;
// Owns "the QP hanging off this cm_id"; must be declared after the CmIdPtr it uses.
using CmQpPtr = std::unique_ptr<rdma_cm_id, detail::CmQpDeleter>;

// How to pick a device. Exactly one criterion is used, in this order:
// `name` (e.g. "rxe0", "mlx5_0"), else `local_ip` (resolved through rdma_cm),
// else the first device with an ACTIVE port.
struct DeviceSelector {
  std::string name;
  std::string local_ip;
  // RoCEv2 GID index to use; nullopt = chosen automatically (first RoCE v2 GID).
  std::optional<int> gid_index;
  uint8_t port = 0;  // 0 = first ACTIVE port.
};

struct PortInfo {
  uint8_t port_num = 0;
  ibv_port_attr attr{};
  int roce_v2_gid_index = -1;  // -1 when the port has no RoCE v2 GID (IB link layer).
};

// An opened device as librdmacm sees it. The ibv_context objects are owned by
// librdmacm's device list (rdma_get_devices), which is the only way to get PDs
// that rdma_cm ids resolved to this device can use. Move-only; not thread-safe
// to move while in use. Several Devices may coexist (no globals).
class Device {
 public:
  static absl::StatusOr<Device> Open(const DeviceSelector& selector);

  // Names of all devices librdmacm can see (for error messages and `doctor`).
  static std::vector<std::string> ListNames();

  ibv_context* context() const { return context_; }
  ibv_pd* pd() const { return pd_.get(); }
  const std::string& name() const { return name_; }
  const ibv_device_attr& attr() const { return attr_; }
  const PortInfo& port() const { return port_; }
  // NUMA node of the device's PCI function from sysfs; -1 when unknown (Soft-RoCE).
  int numa_node() const { return numa_node_; }

  // Registers [addr, addr+len) with `access`. On failure the status names the
  // device, the size, errno, and -- for ENOMEM/EPERM/EFAULT -- RLIMIT_MEMLOCK's
  // value with how to raise it.
  absl::StatusOr<MrPtr> RegisterMemory(void* addr, size_t len, int access) const;

  // Whether the device binds type-2 memory windows (IBV_DEVICE_MEM_WINDOW_TYPE_2A
  // or 2B and max_mw > 0): rxe in Linux 6.1 does, so do ConnectX NICs.
  bool SupportsType2Windows() const;
  // A type-2 memory window in the device's PD, unbound. Bind it with an
  // IBV_WR_BIND_MW work request on a QP of the same PD.
  absl::StatusOr<MwPtr> AllocateType2Window() const;

  // The device was removed (RDMA_CM_EVENT_DEVICE_REMOVAL) and nothing made
  // from it is left: frees the PD and this Device's hold on librdmacm's device
  // context, after which the Device is empty. The kernel's removal then still
  // waits for that context's file descriptors to close, and librdmacm (44 and
  // later alike) closes a removed device's context only when its device list
  // shows some *other* device: with the one device gone it keeps the files
  // open until the process exits, and `rdma link delete` hangs that long. So
  // when no other Device of this process uses the context, its descriptors
  // are pointed at /dev/null (dup3), which closes the device's files and
  // keeps the numbers librdmacm will close later taken. Drivers that can
  // disassociate contexts (mlx5) do not wait for the files; rxe and siw do.
  void ReleaseRemoved() noexcept;

 private:
  Device() = default;

  std::unique_ptr<ibv_context*, detail::DeviceListDeleter> list_;
  ibv_context* context_ = nullptr;  // Owned by list_.
  PdPtr pd_;
  std::string name_;
  ibv_device_attr attr_{};
  PortInfo port_;
  int numa_node_ = -1;
  detail::ContextUse use_;  // Last: dropped first.
};

// Makes a completion channel and a CQ of `depth` entries on `dev`.
absl::StatusOr<CompChannelPtr> CreateCompChannel(const Device& dev);
absl::StatusOr<CqPtr> CreateCq(const Device& dev, int depth, ibv_comp_channel* channel);

// errno-style failure from a verbs/rdma_cm call, with context.
absl::Status ErrnoStatus(int err, absl::string_view what);

// Maps an ibv_wc_status onto a canonical status code, keeping ibv_wc_status_str
// in the message. The single place where completion errors are classified.
absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_err, absl::string_view what);

// The message used when memory registration fails; exposed for tests.
std::string MemlockAdvice(size_t needed_bytes);

}  // namespace rdmarpc::rdma
