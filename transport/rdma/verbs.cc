#include "transport/rdma/verbs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/common/log.h"

namespace rdmarpc::rdma {
namespace detail {

// Deleters: the library may refuse (EBUSY when a child object still exists).
// That is our bug, not the caller's; log it and carry on rather than throw.
#define RDMARPC_FREE_OR_LOG(call, what)                                              \
  do {                                                                               \
    if (int rc_ = (call); rc_ != 0)                                                  \
      RDMARPC_LOG(kError, "verbs", "event=free_failed what=" what " errno=",         \
                  rc_ > 0 ? rc_ : errno, " (", std::strerror(rc_ > 0 ? rc_ : errno), \
                  ")");                                                              \
  } while (0)

void PdDeleter::operator()(ibv_pd* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_dealloc_pd(p), "pd"); }
void MrDeleter::operator()(ibv_mr* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_dereg_mr(p), "mr"); }
void MwDeleter::operator()(ibv_mw* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_dealloc_mw(p), "mw"); }
void CompChannelDeleter::operator()(ibv_comp_channel* p) const noexcept {
  RDMARPC_FREE_OR_LOG(ibv_destroy_comp_channel(p), "comp_channel");
}
void CqDeleter::operator()(ibv_cq* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_destroy_cq(p), "cq"); }
void SrqDeleter::operator()(ibv_srq* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_destroy_srq(p), "srq"); }
void QpDeleter::operator()(ibv_qp* p) const noexcept { RDMARPC_FREE_OR_LOG(ibv_destroy_qp(p), "qp"); }
void CmEventChannelDeleter::operator()(rdma_event_channel* p) const noexcept {
  rdma_destroy_event_channel(p);  // void: cannot fail visibly.
}
void CmIdDeleter::operator()(rdma_cm_id* p) const noexcept { RDMARPC_FREE_OR_LOG(rdma_destroy_id(p), "cm_id"); }
void CmEventDeleter::operator()(rdma_cm_event* p) const noexcept {
  RDMARPC_FREE_OR_LOG(rdma_ack_cm_event(p), "cm_event_ack");
}
void CmQpDeleter::operator()(rdma_cm_id* id) const noexcept { rdma_destroy_qp(id); }
void DeviceListDeleter::operator()(ibv_context** p) const noexcept { rdma_free_devices(p); }

#undef RDMARPC_FREE_OR_LOG

namespace {
// Devices of this process per librdmacm context (ContextUse). Bookkeeping
// only: it opens, owns and selects nothing.
// Never destroyed: a device removal's release may still run on its own
// thread while the process exits.
std::mutex& UsesMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<ibv_context*, int>& Uses() {
  static auto* uses = new std::map<ibv_context*, int>;
  return *uses;
}
}  // namespace

ContextUse::ContextUse(ibv_context* context) : context_(context) {
  std::lock_guard<std::mutex> lock(UsesMutex());
  ++Uses()[context_];
}

ContextUse& ContextUse::operator=(ContextUse&& other) noexcept {
  if (this != &other) {
    Reset();
    context_ = other.context_;
    other.context_ = nullptr;
  }
  return *this;
}

bool ContextUse::Reset() noexcept {
  if (context_ == nullptr) return false;
  std::lock_guard<std::mutex> lock(UsesMutex());
  auto it = Uses().find(context_);
  context_ = nullptr;
  if (it == Uses().end()) return false;
  if (--it->second > 0) return false;
  Uses().erase(it);
  return true;
}
}  // namespace detail

void Device::ReleaseRemoved() noexcept {
  if (context_ == nullptr) return;
  const bool last = use_.Reset();
  // The context's files, identified by inode: after the list goes,
  // librdmacm may have closed them and the numbers may name other files.
  struct Held {
    int fd;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  Held held[2] = {{context_->cmd_fd}, {context_->async_fd}};
  for (Held& h : held) {
    struct stat st {};
    if (h.fd < 0 || fstat(h.fd, &st) != 0) {
      h.fd = -1;
      continue;
    }
    h.dev = st.st_dev;
    h.ino = st.st_ino;
  }
  pd_.reset();
  // librdmacm learns that a device was removed only when it re-reads the
  // kernel's list (rdma_get_devices does, if some device is left); it then
  // closes the device's context when its last reference goes, which may be
  // the one dropped here.
  int n = 0;
  if (ibv_context** fresh = rdma_get_devices(&n); fresh != nullptr) rdma_free_devices(fresh);
  list_.reset();
  context_ = nullptr;
  if (!last) {
    RDMARPC_LOG(kInfo, "verbs", "event=removed_device_released device=", name_,
                " note=\"another RdmaContext of this process still holds it\"");
    return;
  }
  int taken = 0;
  int null_fd = -1;
  for (const Held& h : held) {
    struct stat st {};
    if (h.fd < 0 || fstat(h.fd, &st) != 0 || st.st_dev != h.dev || st.st_ino != h.ino) continue;
    if (null_fd < 0) null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null_fd < 0 || dup3(null_fd, h.fd, O_CLOEXEC) < 0) {
      RDMARPC_LOG(kError, "verbs", "event=removed_device_fd_kept device=", name_, " fd=", h.fd, " errno=", errno,
                  " (", std::strerror(errno), ") the kernel's removal of the device waits for this process");
      continue;
    }
    ++taken;
  }
  if (null_fd >= 0) close(null_fd);
  RDMARPC_LOG(kInfo, "verbs", "event=removed_device_released device=", name_, " files_closed_for_librdmacm=", taken);
}

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err), " (errno ", err, ")");
  switch (err) {
    case ENOENT:
    case ENODEV:
      return absl::NotFoundError(msg);
    case EINVAL:
      return absl::InvalidArgumentError(msg);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(msg);
    case EPERM:
    case EACCES:
      return absl::PermissionDeniedError(msg);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_err, absl::string_view what) {
  if (status == IBV_WC_SUCCESS) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": work completion failed: ", ibv_wc_status_str(status),
                                 " (status ", static_cast<int>(status), ", vendor_err 0x",
                                 absl::Hex(vendor_err), ")");
  switch (status) {
    case IBV_WC_WR_FLUSH_ERR:       // The QP went to error; the WR never ran.
      return absl::CancelledError(msg);
    case IBV_WC_RETRY_EXC_ERR:      // Peer unreachable: retry on a new connection.
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
      return absl::UnavailableError(msg);
    case IBV_WC_REM_ACCESS_ERR:     // Bad rkey / out of granted range.
    case IBV_WC_LOC_PROT_ERR:
      return absl::PermissionDeniedError(msg);
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

namespace {

std::string HumanBytes(unsigned long long v) {
  if (v == RLIM_INFINITY) return "unlimited";
  if (v >= (1ull << 30) && v % (1ull << 30) == 0) return absl::StrCat(v >> 30, " GiB");
  if (v >= (1ull << 20) && v % (1ull << 20) == 0) return absl::StrCat(v >> 20, " MiB");
  if (v >= (1ull << 10) && v % (1ull << 10) == 0) return absl::StrCat(v >> 10, " KiB");
  return absl::StrCat(v, " bytes");
}

std::string ReadSysfsLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}

const char* PortStateName(ibv_port_state s) { return ibv_port_state_str(s); }

// First RoCE v2 GID of the port, or -1. Empty entries return an error from
// ibv_query_gid_ex and are skipped.
int FindRoceV2Gid(ibv_context* ctx, uint8_t port, int table_len) {
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(ctx, port, static_cast<uint32_t>(i), &entry, 0) != 0) continue;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2) return i;
  }
  return -1;
}

absl::StatusOr<ibv_context*> ContextForLocalIp(const std::string& ip) {
  CmEventChannelPtr channel(rdma_create_event_channel());
  if (!channel) return ErrnoStatus(errno, "rdma_create_event_channel");
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(channel.get(), &raw, nullptr, RDMA_PS_TCP) != 0)
    return ErrnoStatus(errno, "rdma_create_id");
  CmIdPtr id(raw);
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(ip.c_str(), nullptr, &hints, &res); rc != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("local IP '", ip, "' is not a numeric address: ", gai_strerror(rc)));
  int bind_rc = rdma_bind_addr(id.get(), res->ai_addr);
  int bind_errno = errno;
  freeaddrinfo(res);
  if (bind_rc != 0)
    return ErrnoStatus(bind_errno, absl::StrCat("rdma_bind_addr(", ip,
                                                ") - is the address on an RDMA-capable netdev?"));
  if (id->verbs == nullptr)
    return absl::NotFoundError(absl::StrCat("local IP ", ip, " is not on an RDMA device's netdev"));
  return id->verbs;
}

}  // namespace

std::string MemlockAdvice(size_t needed_bytes) {
  rlimit lim{};
  getrlimit(RLIMIT_MEMLOCK, &lim);
  return absl::StrCat(
      "RLIMIT_MEMLOCK is ", HumanBytes(lim.rlim_cur), " (hard ", HumanBytes(lim.rlim_max),
      ") and this registration needs ", HumanBytes(needed_bytes),
      " locked. Raise it: `ulimit -l unlimited` in the launching shell, "
      "LimitMEMLOCK=infinity in the systemd unit, /etc/security/limits.conf `* - memlock "
      "unlimited`, or for containers `--ulimit memlock=-1` / CAP_IPC_LOCK.");
}

std::vector<std::string> Device::ListNames() {
  std::vector<std::string> names;
  int n = 0;
  std::unique_ptr<ibv_context*, detail::DeviceListDeleter> list(rdma_get_devices(&n));
  for (int i = 0; list && i < n; ++i) names.emplace_back(ibv_get_device_name(list.get()[i]->device));
  return names;
}

absl::StatusOr<Device> Device::Open(const DeviceSelector& sel) {
  Device dev;
  int n = 0;
  dev.list_.reset(rdma_get_devices(&n));
  if (!dev.list_ || n == 0) {
    return absl::NotFoundError(
        "no RDMA device found (librdmacm lists none). Without an RDMA NIC, run under the "
        "Soft-RoCE harness (`tools/rxe-vm -- CMD`) or create a device with "
        "`rdma link add rxe0 type rxe netdev <interface>` on a kernel with rdma_rxe.");
  }
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.emplace_back(ibv_get_device_name(dev.list_.get()[i]->device));
  const std::string available = absl::StrJoin(names, ", ");

  if (!sel.name.empty()) {
    for (int i = 0; i < n; ++i)
      if (names[i] == sel.name) dev.context_ = dev.list_.get()[i];
    if (dev.context_ == nullptr)
      return absl::NotFoundError(
          absl::StrCat("RDMA device '", sel.name, "' not found; available: ", available));
  } else if (!sel.local_ip.empty()) {
    auto ctx = ContextForLocalIp(sel.local_ip);
    if (!ctx.ok()) return ctx.status();
    // rdma_cm hands back a context from the same list rdma_get_devices returns.
    for (int i = 0; i < n; ++i)
      if (dev.list_.get()[i]->device == (*ctx)->device) dev.context_ = dev.list_.get()[i];
    if (dev.context_ == nullptr)
      return absl::InternalError(absl::StrCat("rdma_cm resolved ", sel.local_ip,
                                              " to a device outside its own list"));
  }

  // Scan devices (all of them in automatic mode) for a usable port.
  std::string why_not;
  for (int i = 0; i < n; ++i) {
    ibv_context* ctx = dev.list_.get()[i];
    if (dev.context_ != nullptr && ctx != dev.context_) continue;
    ibv_device_attr attr{};
    if (int rc = ibv_query_device(ctx, &attr); rc != 0) {
      absl::StrAppend(&why_not, " ", names[i], ": ibv_query_device: ", std::strerror(rc), ";");
      continue;
    }
    for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
      if (sel.port != 0 && p != sel.port) continue;
      ibv_port_attr pattr{};
      if (ibv_query_port(ctx, p, &pattr) != 0) continue;
      if (pattr.state != IBV_PORT_ACTIVE) {
        absl::StrAppend(&why_not, " ", names[i], " port ", p, " is ", PortStateName(pattr.state),
                        ";");
        continue;
      }
      dev.context_ = ctx;
      dev.name_ = names[i];
      dev.attr_ = attr;
      dev.port_.port_num = p;
      dev.port_.attr = pattr;
      break;
    }
    if (dev.port_.port_num != 0) break;
  }
  if (dev.port_.port_num == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no ACTIVE port on ", sel.name.empty() ? "any RDMA device" : sel.name,
        " (devices: ", available, ";", why_not,
        "). Check the cable/link (`rdma link show`, `ibv_devinfo`) and the netdev under rxe."));
  }

  if (dev.port_.attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
    if (sel.gid_index.has_value()) {
      ibv_gid_entry entry{};
      if (ibv_query_gid_ex(dev.context_, dev.port_.port_num, static_cast<uint32_t>(*sel.gid_index),
                           &entry, 0) != 0)
        return absl::InvalidArgumentError(absl::StrCat("GID index ", *sel.gid_index, " on ",
                                                       dev.name_, " port ", dev.port_.port_num,
                                                       " is empty or invalid"));
      dev.port_.roce_v2_gid_index = *sel.gid_index;
    } else {
      dev.port_.roce_v2_gid_index =
          FindRoceV2Gid(dev.context_, dev.port_.port_num, dev.port_.attr.gid_tbl_len);
      if (dev.port_.roce_v2_gid_index < 0)
        return absl::FailedPreconditionError(absl::StrCat(
            dev.name_, " port ", dev.port_.port_num,
            " has no RoCE v2 GID: give its netdev an IP address (the GID table is derived from it)"));
    }
  }

  std::string numa = ReadSysfsLine(absl::StrCat("/sys/class/infiniband/", dev.name_, "/device/numa_node"));
  dev.numa_node_ = numa.empty() ? -1 : std::atoi(numa.c_str());

  dev.pd_.reset(ibv_alloc_pd(dev.context_));
  if (!dev.pd_) return ErrnoStatus(errno, absl::StrCat("ibv_alloc_pd on ", dev.name_));
  dev.use_ = detail::ContextUse(dev.context_);
  return dev;
}

absl::StatusOr<MrPtr> Device::RegisterMemory(void* addr, size_t len, int access) const {
  MrPtr mr(ibv_reg_mr(pd_.get(), addr, len, access));
  if (mr) return mr;
  const int err = errno;
  std::string what = absl::StrCat("ibv_reg_mr of ", len, " bytes on ", name_);
  absl::Status st = ErrnoStatus(err, what);
  if (err == ENOMEM || err == EPERM || err == EFAULT || err == EAGAIN)
    return absl::ResourceExhaustedError(absl::StrCat(st.message(), ". ", MemlockAdvice(len)));
  return st;
}

bool Device::SupportsType2Windows() const {
  return (attr_.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0 &&
         attr_.max_mw > 0;
}

absl::StatusOr<MwPtr> Device::AllocateType2Window() const {
  MwPtr mw(ibv_alloc_mw(pd_.get(), IBV_MW_TYPE_2));
  if (!mw) return ErrnoStatus(errno, absl::StrCat("ibv_alloc_mw(type 2) on ", name_));
  return mw;
}

absl::StatusOr<CompChannelPtr> CreateCompChannel(const Device& dev) {
  CompChannelPtr ch(ibv_create_comp_channel(dev.context()));
  if (!ch) return ErrnoStatus(errno, absl::StrCat("ibv_create_comp_channel on ", dev.name()));
  return ch;
}

absl::StatusOr<CqPtr> CreateCq(const Device& dev, int depth, ibv_comp_channel* channel) {
  if (depth <= 0 || depth > dev.attr().max_cqe)
    return absl::InvalidArgumentError(absl::StrCat("CQ depth ", depth, " outside 1..",
                                                   dev.attr().max_cqe, " on ", dev.name()));
  CqPtr cq(ibv_create_cq(dev.context(), depth, nullptr, channel, 0));
  if (!cq) return ErrnoStatus(errno, absl::StrCat("ibv_create_cq(", depth, ") on ", dev.name()));
  return cq;
}

}  // namespace rdmarpc::rdma
