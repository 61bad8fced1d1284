// Evaluate: Facts -> Findings. Pure functions of the facts, so every rule is
// unit-tested with hand-made Facts (tests/doctor/doctor_checks_test.cc).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "transport/rdma/buffer_pool.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/wire.h"
#include "tools/doctor/doctor.h"

namespace rdmarpc::doctor {
namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr uint64_t kPage = 4096;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

std::string Join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// "::ffff:10.77.0.1" -> "10.77.0.1": how people know the address.
std::string GidForPeople(const std::string& gid) {
  constexpr const char* kMapped = "::ffff:";
  if (gid.rfind(kMapped, 0) == 0 && gid.find('.') != std::string::npos) return gid.substr(7);
  return gid;
}

bool IsLinkLocal(const std::string& gid) { return gid.rfind("fe80:", 0) == 0; }

bool IsSoftRoce(const DeviceFacts& d, std::vector<std::string>* why) {
  std::vector<std::string> reasons;
  if (d.name.rfind("rxe", 0) == 0) reasons.push_back("ibv device name " + d.name);
  if (d.node_desc.rfind("rxe", 0) == 0) reasons.push_back("node_desc \"" + d.node_desc + "\"");
  if (d.parent_driver == "rdma_rxe") reasons.push_back("driver rdma_rxe");
  if (d.verbs_ok && d.vendor_id == 0xFFFFFF && !d.has_parent_device)
    reasons.push_back("vendor_id 0xffffff");
  // A name or node_desc alone could be a user's choice of name; a virtual
  // device (no PCI function) is what makes it software.
  const bool soft = !reasons.empty() && !d.has_parent_device;
  if (soft && why != nullptr) {
    reasons.push_back("no PCI device");
    *why = std::move(reasons);
  }
  return soft;
}

std::string Netdevs(const DeviceFacts& d) {
  std::vector<std::string> names;
  for (const PortFacts& p : d.ports)
    if (!p.netdev.empty() && std::find(names.begin(), names.end(), p.netdev) == names.end())
      names.push_back(p.netdev);
  return Join(names, ", ");
}

void CheckDevice(const DeviceFacts& d, int numa_nodes, const std::string& allowed_cpus,
                 std::vector<Finding>& out) {
  const std::string netdevs = Netdevs(d);
  if (!d.verbs_ok) {
    out.push_back({"device", d.name, Severity::kFail,
                   "libibverbs cannot use " + d.name + ": " + d.verbs_error,
                   "install the provider (`apt install ibverbs-providers rdma-core`) and check "
                   "/dev/infiniband/uverbs* permissions (group rdma, or run as root)"});
  } else {
    std::string what = d.has_parent_device
                           ? "device " + d.parent_bus_id +
                                 (d.parent_driver.empty() ? "" : " (driver " + d.parent_driver + ")")
                           : std::string("virtual device (no PCI function)");
    char ids[64];
    std::snprintf(ids, sizeof ids, "vendor 0x%x part %u", d.vendor_id, d.vendor_part_id);
    out.push_back({"device", d.name, Severity::kOk,
                   d.name + ": " + what + ", " + ids + ", fw " + (d.fw_ver.empty() ? "-" : d.fw_ver) +
                       ", " + std::to_string(d.ports.size()) + " port(s)",
                   ""});
  }

  std::vector<std::string> why;
  if (IsSoftRoce(d, &why)) {
    out.push_back({"soft_roce", d.name, Severity::kWarn,
                   d.name + " is Soft-RoCE (rdma_rxe: RoCE v2 in the kernel" +
                       (netdevs.empty() ? std::string() : " over netdev " + netdevs) +
                       "; detected by " + Join(why, ", ") + ")",
                   "fine for development and CI; its latency means nothing in absolute terms: "
                   "use a RoCE or InfiniBand NIC for real numbers"});
  } else if (d.name.rfind("siw", 0) == 0 && !d.has_parent_device) {
    out.push_back({"soft_roce", d.name, Severity::kWarn,
                   d.name + " is Soft-iWARP (siw), software RDMA over TCP",
                   "fine for development; use an RDMA NIC for real numbers"});
  } else {
    out.push_back({"soft_roce", d.name, Severity::kOk,
                   d.name + " is a hardware device, not Soft-RoCE", ""});
  }

  // NUMA placement of pollers and buffers.
  const std::string one_node = "this host has 1 NUMA node, so placement cannot be wrong";
  if (d.numa_source.empty()) {
    std::string msg = d.name + " has no PCI device (" +
                      (IsSoftRoce(d, nullptr) ? std::string("Soft-RoCE") : std::string("virtual")) + ")";
    msg += netdevs.empty() ? std::string("; no netdev to fall back to")
                           : "; its netdev " + netdevs + " has no device either";
    msg += ": NUMA node unknown";
    if (numa_nodes <= 1) {
      out.push_back({"numa", d.name, Severity::kOk, msg + "; " + one_node, ""});
    } else {
      out.push_back({"numa", d.name, Severity::kWarn,
                     msg + "; this host has " + std::to_string(numa_nodes) + " NUMA nodes",
                     "set RdmaOptions::poller_cpu and VerbsSlabOptions::numa_node to the node of the "
                     "NIC under " + (netdevs.empty() ? std::string("the device") : netdevs)});
    }
    return;
  }
  const std::string from = d.numa_source == "device" ? std::string() : " (from " + d.numa_source + ")";
  if (d.numa_node < 0) {
    const std::string msg = d.name + " reports no NUMA node (numa_node -1" + from + ")";
    if (numa_nodes <= 1) {
      out.push_back({"numa", d.name, Severity::kOk, msg + "; " + one_node, ""});
    } else {
      out.push_back({"numa", d.name, Severity::kWarn,
                     msg + " on a host with " + std::to_string(numa_nodes) + " NUMA nodes",
                     "enable NUMA/SRAT reporting in the BIOS (or the VM), or set "
                     "VerbsSlabOptions::numa_node and RdmaOptions::poller_cpu by hand"});
    }
    return;
  }
  const std::string node = std::to_string(d.numa_node);
  std::string msg = "NUMA node " + node + from + ", local CPUs " +
                    (d.local_cpus.empty() ? std::string("unknown") : d.local_cpus);
  const std::vector<int> local = ParseCpuList(d.local_cpus);
  const std::vector<int> allowed = ParseCpuList(allowed_cpus);
  if (!local.empty() && !allowed.empty()) {
    const bool overlap = std::any_of(allowed.begin(), allowed.end(), [&](int c) {
      return std::find(local.begin(), local.end(), c) != local.end();
    });
    if (!overlap) {
      out.push_back({"numa", d.name, Severity::kWarn,
                     msg + "; this process may run only on CPUs " + allowed_cpus + ", none of them local",
                     "run it on the NIC's node: `numactl --cpunodebind=" + node + " --membind=" + node +
                         " CMD` (or taskset -c " + d.local_cpus + ")"});
      return;
    }
  }
  out.push_back({"numa", d.name, Severity::kOk, msg, ""});
}

std::string PortStateFix(const PortFacts& p) {
  if (p.state == "INIT" || p.state == "ARMED")
    return "no subnet manager has activated the port: run opensm on one node of the fabric "
           "(`systemctl start opensm`) and check `ibstat`";
  if (p.phys_state == "Disabled")
    return "the port is administratively disabled: enable it on the NIC/switch (`ibportstate` or "
           "the switch CLI)";
  if (p.link_layer == "Ethernet")
    return "bring the link up: `ip link set " + (p.netdev.empty() ? std::string("<netdev>") : p.netdev) +
           " up`, then check the cable and the switch port (`ethtool`, `rdma link show`)";
  return "check the cable and the switch port (`ibstat`, `rdma link show`)";
}

void CheckPort(const DeviceFacts& d, const PortFacts& p, bool any_active, int sample_ms,
               std::vector<Finding>& out) {
  const std::string subject = d.name + "/" + std::to_string(p.port);
  const bool active = p.state == "ACTIVE";
  std::string where = p.link_layer;
  if (!p.rate.empty()) where += ", " + p.rate;
  if (!p.netdev.empty()) where += ", netdev " + p.netdev;
  if (active) {
    out.push_back({"port", subject, Severity::kOk, "ACTIVE (" + p.phys_state + "), " + where, ""});
  } else {
    // A second, unused port being down is normal; no usable port at all is not.
    out.push_back({"port", subject, any_active ? Severity::kWarn : Severity::kFail,
                   p.state + " (" + p.phys_state + "), " + where +
                       (any_active ? "; another port is ACTIVE" : "; no ACTIVE port anywhere"),
                   PortStateFix(p)});
  }

  if (active && p.active_mtu > 0 && p.max_mtu > 0) {
    const std::string mtus = "active MTU " + std::to_string(p.active_mtu) + ", max " + std::to_string(p.max_mtu);
    if (p.active_mtu >= p.max_mtu) {
      out.push_back({"mtu", subject, Severity::kOk, mtus, ""});
    } else if (p.link_layer == "Ethernet") {
      const std::string nd = p.netdev.empty() ? std::string("<netdev>") : p.netdev;
      out.push_back({"mtu", subject, Severity::kWarn,
                     mtus + (p.netdev_mtu > 0 ? " (netdev " + nd + " MTU " + std::to_string(p.netdev_mtu) + ")" : "") +
                         ": more packets per message than needed",
                     "raise the netdev MTU so a " + std::to_string(p.max_mtu) + "-byte RoCE MTU fits: `ip link set " +
                         nd + " mtu 9000` (jumbo frames on the switch too), or at least mtu " +
                         std::to_string(p.max_mtu + 100)});
    } else {
      out.push_back({"mtu", subject, Severity::kWarn, mtus,
                     "raise the partition MTU on the subnet manager (opensm partitions.conf: mtu=5 is 4096)"});
    }
  }

  if (p.link_layer == "Ethernet") {
    std::vector<const Gid*> v2, v2_routable;
    for (const Gid& g : p.gids) {
      if (g.type != "RoCE v2") continue;
      v2.push_back(&g);
      if (!IsLinkLocal(g.gid)) v2_routable.push_back(&g);
    }
    const std::string nd = p.netdev.empty() ? std::string("<netdev>") : p.netdev;
    const std::string add_ip = "give " + nd + " an IP address (`ip addr add <addr>/<len> dev " + nd +
                               "`): the RoCE GID table follows the netdev's addresses";
    const std::string count = std::to_string(p.gids.size()) + " GID(s), " + std::to_string(v2.size()) + " RoCE v2";
    if (v2.empty()) {
      out.push_back({"gid", subject, Severity::kFail,
                     "no RoCE v2 GID (" + count + "): rdmarpc connects over RoCE v2", add_ip});
    } else if (v2_routable.empty()) {
      out.push_back({"gid", subject, Severity::kWarn,
                     "only link-local RoCE v2 GIDs (" + count + "): rdma_cm resolves peers by IP address", add_ip});
    } else {
      const Gid& g = *v2_routable.front();
      out.push_back({"gid", subject, Severity::kOk,
                     "RoCE v2 GID index " + std::to_string(g.index) + " = " + GidForPeople(g.gid) +
                         (g.netdev.empty() ? std::string() : " on " + g.netdev) + " (" + count + ")",
                     ""});
    }
  } else if (!p.gids.empty()) {
    out.push_back({"gid", subject, Severity::kOk,
                   p.link_layer + " port, GID[" + std::to_string(p.gids.front().index) + "] " + p.gids.front().gid, ""});
  }

  // Counters: climbing error counters matter; old totals are context.
  if (p.counters.empty()) {
    out.push_back({"counters", subject, Severity::kOk,
                   d.name + " exposes no port counters (ports/" + std::to_string(p.port) +
                       "/counters, hw_counters): nothing to watch",
                   ""});
    return;
  }
  std::vector<std::string> climbing, nonzero;
  std::string fix;
  for (const Counter& c : p.counters) {
    if (!c.error_like) continue;
    if (c.delta() > 0) {
      climbing.push_back(c.name + " +" + std::to_string(c.delta()) + " (now " + std::to_string(c.after) + ")");
      if (fix.empty()) fix = CounterFix(c.name);
    } else if (c.after > 0) {
      nonzero.push_back(c.name + "=" + std::to_string(c.after));
    }
  }
  const std::string over = " over " + std::to_string(sample_ms) + " ms";
  if (!climbing.empty()) {
    out.push_back({"counters", subject, Severity::kWarn, "error counters climbing" + over + ": " + Join(climbing, ", "),
                   fix});
    return;
  }
  std::string msg = sample_ms > 0 ? "no error counter climbed" + over
                                  : std::string("not sampled (--sample-ms 0)");
  msg += " (" + std::to_string(p.counters.size()) + " counters read)";
  msg += nonzero.empty() ? std::string("; every error counter is 0")
                         : "; nonzero since reset: " + Join(nonzero, ", ");
  out.push_back({"counters", subject, Severity::kOk, msg, ""});
}

void CheckMemlock(const Facts& f, std::vector<Finding>& out) {
  const MemlockFacts& m = f.memlock;
  const MemlockNeed& need = f.memlock_need;
  const std::string limit =
      m.soft_unlimited ? std::string("unlimited") : HumanBytes(m.soft);
  const std::string hard = m.hard_unlimited ? std::string("unlimited") : HumanBytes(m.hard);
  const std::string parts = "one connection's slots " + HumanBytes(need.connection_slots) +
                            " + the default BufferPool's first slab per class " +
                            HumanBytes(need.pool_first_slabs);
  const std::string cap_note =
      m.cap_ipc_lock ? "; this process has CAP_IPC_LOCK and is exempt, a service without it is not" : "";
  const bool hard_ok = m.hard_unlimited || m.hard >= need.full();
  const std::string fix =
      std::string(hard_ok ? "raise it: `ulimit -l unlimited` in the launching shell, "
                          : "raise it, the hard limit too (as root): `ulimit -l unlimited`, ") +
      "LimitMEMLOCK=infinity in the systemd unit, `* - memlock unlimited` in "
      "/etc/security/limits.conf, or `--ulimit memlock=-1` for containers";
  if (m.soft_unlimited || m.soft >= need.full()) {
    out.push_back({"memlock", "host", Severity::kOk,
                   "RLIMIT_MEMLOCK " + limit + ": covers a default process (" + HumanBytes(need.minimum()) +
                       ") and a default pool grown to its cap (" + HumanBytes(need.full()) + ")",
                   ""});
  } else if (m.soft >= need.minimum()) {
    out.push_back({"memlock", "host", Severity::kWarn,
                   "RLIMIT_MEMLOCK " + limit + " (hard " + hard + ") covers a default process (" +
                       HumanBytes(need.minimum()) + ") but not a default pool at its cap (" +
                       HumanBytes(need.full()) + "): registration fails as the pool grows" + cap_note,
                   fix});
  } else {
    out.push_back({"memlock", "host", Severity::kFail,
                   "RLIMIT_MEMLOCK " + limit + " (hard " + hard + ") is below the " + HumanBytes(need.minimum()) +
                       " a default setup locks (" + parts +
                       "): ibv_reg_mr will fail with ENOMEM" + cap_note,
                   fix});
  }
}

void CheckHugepages(const Facts& f, std::vector<Finding>& out) {
  const HugepageFacts& h = f.hugepages;
  const uint64_t want_first = f.memlock_need.pool_first_slabs / kHugePage;
  const uint64_t want_cap = f.memlock_need.pool_cap / kHugePage;
  const std::string reserve = "reserve them: `echo " + std::to_string(want_cap) +
                              " > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages` (the default pool's "
                              "cap; persist with vm.nr_hugepages in /etc/sysctl.d)";
  if (!h.supported) {
    out.push_back({"hugepages", "host", Severity::kWarn,
                   "no 2 MiB hugetlb pages in this kernel (/sys/kernel/mm/hugepages/hugepages-2048kB missing): "
                   "pool slabs use 4 KiB pages",
                   "use a kernel with CONFIG_HUGETLBFS, or accept 4 KiB pages (512x more translations for the NIC)"});
    return;
  }
  const std::string counts = std::to_string(h.free_2m) + " of " + std::to_string(h.total_2m) +
                             " 2 MiB hugepages free; the default pool's first slabs want " +
                             std::to_string(want_first) + ", its cap " + std::to_string(want_cap);
  if (h.total_2m == 0) {
    out.push_back({"hugepages", "host", Severity::kWarn,
                   "no 2 MiB hugepages reserved: pool slabs fall back to 4 KiB pages (512x more translations "
                   "for the NIC)",
                   reserve});
  } else if (h.free_2m < want_first) {
    out.push_back({"hugepages", "host", Severity::kWarn, counts, reserve});
  } else {
    out.push_back({"hugepages", "host", Severity::kOk, counts, ""});
  }
}

}  // namespace

const char* SeverityName(Severity s) {
  switch (s) {
    case Severity::kOk: return "ok";
    case Severity::kWarn: return "warn";
    case Severity::kFail: return "fail";
  }
  return "?";
}

Severity Report::worst() const {
  Severity w = Severity::kOk;
  for (const Finding& f : findings) w = std::max(w, f.status);
  return w;
}

MemlockNeed MemlockNeedFromDefaults() {
  MemlockNeed need;
  // The pool's slab sizing (buffer_pool.cc, BufferPool::Create): per class
  // max(slab_bytes, class * min_buffers_per_slab), rounded up to 2 MiB once
  // it reaches 2 MiB. The first Acquire of each class registers one slab.
  const rdma::BufferPoolOptions pool;
  for (size_t bytes : pool.class_bytes) {
    uint64_t slab = std::max<uint64_t>(pool.slab_bytes, bytes * std::max<size_t>(pool.min_buffers_per_slab, 1));
    if (slab >= kHugePage) slab = RoundUp(slab, kHugePage);
    need.pool_first_slabs += slab;
  }
  need.pool_cap = pool.max_registered_bytes;
  // A connection's slot memory (rdma_connection.cc, RdmaConnectionImpl::Init):
  // (2 * send_depth + control slots) send slots and recv_depth + ctrl_depth
  // receive slots of header + eager limit, cache-line rounded; registration
  // pins whole pages. kControlSlots is private to the connection (4).
  constexpr uint64_t kControlSlots = 4;
  const rdma::RdmaOptions conn;
  const uint64_t slot = RoundUp(rdma::wire::kHeaderSize + std::max(conn.eager_limit, rdma::wire::kGrantSize), 64);
  const uint64_t slots = 2u * conn.send_depth + kControlSlots + conn.recv_depth + conn.ctrl_depth;
  need.connection_slots = RoundUp(slot * slots, kPage);
  return need;
}

bool IsErrorCounter(const std::string& name) {
  static const std::set<std::string> kExact = {
      "port_xmit_wait", "port_xmit_discards", "port_rcv_errors", "symbol_error",
      "link_error_recovery", "link_downed", "port_rcv_remote_physical_errors",
      "port_rcv_switch_relay_errors", "local_link_integrity_errors",
      "excessive_buffer_overrun_errors", "port_rcv_constraint_errors",
      "port_xmit_constraint_errors", "VL15_dropped", "duplicate_request", "out_of_sequence",
      "out_of_seq_request", "out_of_buffer", "implied_nak_seq_err", "packet_seq_err"};
  if (kExact.count(name) != 0) return true;
  // Driver-specific names (hw_counters) vary: match whole '_'-separated
  // words, so that "ack_deferred" is not an "err".
  static const std::set<std::string> kWords = {
      "err", "error", "errors", "discard", "discards", "drop", "drops", "dropped", "timeout",
      "retry", "retries", "retrans", "rnr", "overrun", "nak"};
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('_', start);
    if (end == std::string::npos) end = name.size();
    if (kWords.count(name.substr(start, end - start)) != 0) return true;
    start = end + 1;
  }
  return false;
}

std::string CounterFix(const std::string& n) {
  if (Contains(n, "rnr"))
    return "a receiver had no RECV posted: rdmarpc's credits prevent this, so look for another "
           "application on the device or a peer that stopped draining its queue";
  if (Contains(n, "ack_timeout") || Contains(n, "retry") || Contains(n, "retrans"))
    return "packets were lost or the peer stopped answering: check PFC/ECN on NICs and switches, "
           "the route, and the peer";
  if (Contains(n, "seq") || Contains(n, "duplicate") || Contains(n, "nak"))
    return "packet loss on a lossy fabric: enable PFC (or ECN/DCQCN) for the RoCE traffic class on "
           "NICs and switches";
  if (n == "port_xmit_wait" || Contains(n, "discard") || Contains(n, "out_of_buffer") || Contains(n, "drop") ||
      Contains(n, "overrun"))
    return "congestion: the port waited or dropped for lack of buffers or credits: enable PFC/ECN, "
           "check for a slow receiver or an oversubscribed link";
  if (Contains(n, "rcv_err") || Contains(n, "symbol") || Contains(n, "link_") || Contains(n, "integrity") ||
      Contains(n, "physical"))
    return "physical-layer errors: reseat or replace the cable/transceiver and check the switch port "
           "(`ethtool -S <netdev>`, `ibqueryerrors`)";
  return "look the counter up in the NIC vendor's reference (`rdma statistic show`) and watch whether it "
         "keeps climbing";
}

std::vector<int> ParseCpuList(const std::string& list) {
  std::vector<int> cpus;
  size_t i = 0;
  auto number = [&](int& v) {
    if (i >= list.size() || !std::isdigit(static_cast<unsigned char>(list[i]))) return false;
    v = 0;
    while (i < list.size() && std::isdigit(static_cast<unsigned char>(list[i]))) {
      v = v * 10 + (list[i++] - '0');
      if (v > 1 << 20) return false;
    }
    return true;
  };
  while (i < list.size()) {
    int lo = 0, hi = 0;
    if (!number(lo)) return {};
    hi = lo;
    if (i < list.size() && list[i] == '-') {
      ++i;
      if (!number(hi) || hi < lo) return {};
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    if (i < list.size()) {
      if (list[i] != ',') return {};
      ++i;
    }
  }
  return cpus;
}

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0 || v == static_cast<double>(static_cast<uint64_t>(v)))
    std::snprintf(buf, sizeof buf, "%llu %s", static_cast<unsigned long long>(v), kUnits[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[u]);
  return buf;
}

std::vector<Finding> Evaluate(const Facts& f) {
  std::vector<Finding> out;
  if (f.present.empty()) {
    out.push_back({"devices", "host", Severity::kFail,
                   "no RDMA device found (/sys/class/infiniband is empty or missing; libibverbs lists none)",
                   "no RDMA NIC here: run under the Soft-RoCE harness (`tools/rxe-vm -- rdmarpc doctor`), or "
                   "create a device: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <if>`"});
  } else if (f.devices.empty()) {
    out.push_back({"devices", "host", Severity::kFail,
                   "RDMA device '" + f.requested_device + "' not found; present: " + Join(f.present, ", "),
                   "pick one of them with --device (`rdma link show` lists devices and their netdevs)"});
  } else {
    out.push_back({"devices", "host", Severity::kOk,
                   std::to_string(f.present.size()) + " RDMA device(s): " + Join(f.present, ", ") +
                       (f.requested_device.empty() ? std::string() : "; examining " + f.requested_device),
                   ""});
  }
  bool any_active = false;
  for (const DeviceFacts& d : f.devices)
    for (const PortFacts& p : d.ports) any_active = any_active || p.state == "ACTIVE";
  for (const DeviceFacts& d : f.devices) {
    CheckDevice(d, f.numa_nodes, f.allowed_cpus, out);
    if (d.ports.empty())
      out.push_back({"port", d.name, Severity::kFail, d.name + " has no ports in sysfs",
                     "reload the driver (or `rdma link delete` and re-add a Soft-RoCE link)"});
    for (const PortFacts& p : d.ports) CheckPort(d, p, any_active, f.sample_ms, out);
  }
  CheckMemlock(f, out);
  CheckHugepages(f, out);
  return out;
}

}  // namespace rdmarpc::doctor
