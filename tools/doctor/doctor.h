// rdmarpc doctor: finds the configuration problems that break or slow RDMA
// (a port down, no RoCE v2 GID, a small MTU, a memlock limit, a NIC on the
// other NUMA node, error counters climbing) and says how to fix each one.
//
// Three stages, each testable on its own:
//   Collect   reads sysfs, /proc, rlimits and libibverbs into Facts. The only
//             stage that touches the machine; it judges nothing.
//   Evaluate  turns Facts into Findings (ok / warn / fail, a one-line message,
//             a one-line fix). Pure: unit tests feed it hand-made Facts.
//   Render*   prints a Report for people (aligned text) or machines (JSON).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rdmarpc::doctor {

enum class Severity { kOk = 0, kWarn = 1, kFail = 2 };
const char* SeverityName(Severity s);  // "ok" | "warn" | "fail"

struct Finding {
  std::string check;    // Stable id: devices, device, soft_roce, port, mtu, gid, numa, counters, memlock, hugepages.
  std::string subject;  // "rxe0/1" (a port), "rxe0" (a device) or "host".
  Severity status = Severity::kOk;
  std::string message;  // One line: what was found.
  std::string fix;      // One line: what to do. Empty when status is ok.
};

struct Gid {
  int index = 0;
  std::string gid;     // Compressed text form (inet_ntop), e.g. "::ffff:10.77.0.1".
  std::string type;    // gid_attrs/types: "RoCE v2", "IB/RoCE v1", or "" (IB ports).
  std::string netdev;  // gid_attrs/ndevs; "" when none.
};

struct Counter {
  std::string name;
  std::string group;  // "counters" (IB PMA) or "hw_counters" (driver-specific).
  uint64_t before = 0;
  uint64_t after = 0;  // Equal to `before` when the sample time is 0.
  bool error_like = false;
  uint64_t delta() const { return after >= before ? after - before : 0; }
};

struct PortFacts {
  int port = 0;
  std::string state;       // "ACTIVE", "DOWN", "INIT", "ARMED", ...
  std::string phys_state;  // "LinkUp", "Disabled", "Polling", ...
  std::string link_layer;  // "Ethernet" or "InfiniBand".
  std::string rate;        // "100 Gb/sec (4X EDR)".
  int active_mtu = 0;      // Bytes; 0 when libibverbs could not be asked.
  int max_mtu = 0;
  std::string netdev;      // From the GID table; "" for IB ports.
  int netdev_mtu = 0;      // /sys/class/net/<netdev>/mtu; 0 unknown.
  std::vector<Gid> gids;   // Non-zero entries only.
  std::vector<Counter> counters;
};

struct DeviceFacts {
  std::string name;
  std::string node_desc;
  std::string node_type;
  std::string fw_ver;
  // The kernel device behind the RDMA device (a PCI function on a NIC);
  // Soft-RoCE and Soft-iWARP devices are virtual and have none.
  bool has_parent_device = false;
  std::string parent_driver;  // device/driver link, e.g. "mlx5_core"; "" when none.
  std::string parent_bus_id;  // e.g. "0000:3b:00.0".
  // libibverbs' view. verbs_ok is false when the device is in sysfs but
  // libibverbs cannot list or open it (no provider, /dev permissions).
  bool verbs_ok = false;
  std::string verbs_error;
  uint32_t vendor_id = 0;
  uint32_t vendor_part_id = 0;
  // NUMA placement: from device/numa_node, else from the netdev's device.
  int numa_node = -1;
  std::string local_cpus;   // cpulist text, e.g. "0-15,32-47"; "" unknown.
  std::string numa_source;  // Where numa_node came from: "device", "netdev <if>", "".
  std::vector<PortFacts> ports;
};

struct MemlockFacts {
  bool soft_unlimited = false;
  bool hard_unlimited = false;
  uint64_t soft = 0;  // Bytes.
  uint64_t hard = 0;
  bool cap_ipc_lock = false;  // CAP_IPC_LOCK in the effective set: the kernel skips the limit.
};

struct HugepageFacts {
  bool supported = false;    // /sys/kernel/mm/hugepages/hugepages-2048kB exists.
  uint64_t total_2m = 0;     // nr_hugepages of the 2 MiB size.
  uint64_t free_2m = 0;
  uint64_t default_kb = 0;   // Hugepagesize from /proc/meminfo.
  uint64_t meminfo_total = 0;
  uint64_t meminfo_free = 0;
};

// What a default rdmarpc process registers (computed from BufferPoolOptions{}
// and RdmaOptions{}; see MemlockNeedFromDefaults).
struct MemlockNeed {
  uint64_t connection_slots = 0;  // One connection's send + receive slots.
  uint64_t pool_first_slabs = 0;  // One slab of every default BufferPool class.
  uint64_t pool_cap = 0;          // BufferPoolOptions::max_registered_bytes.
  uint64_t minimum() const { return connection_slots + pool_first_slabs; }
  uint64_t full() const { return connection_slots + pool_cap; }
};
MemlockNeed MemlockNeedFromDefaults();

struct Facts {
  std::string requested_device;            // --device; "" = all devices.
  std::vector<std::string> present;        // Every RDMA device in sysfs, sorted.
  std::vector<DeviceFacts> devices;        // The examined ones (all, or the requested one).
  int sample_ms = 0;
  int numa_nodes = 1;                      // Online NUMA nodes on this host.
  std::string allowed_cpus;                // This process's affinity as a cpulist.
  MemlockFacts memlock;
  MemlockNeed memlock_need;
  HugepageFacts hugepages;
};

struct CollectOptions {
  std::string device;  // "" = every device.
  int sample_ms = 1000;
  std::string sysfs = "/sys";  // Roots, so that a test can point them at a fake tree.
  std::string proc = "/proc";
};

Facts Collect(const CollectOptions& options);
std::vector<Finding> Evaluate(const Facts& facts);

struct Report {
  Facts facts;
  std::vector<Finding> findings;
  Severity worst() const;
};

std::string RenderText(const Report& report);
std::string RenderJson(const Report& report);

// Helpers shared by the stages, exposed for tests.
bool IsErrorCounter(const std::string& name);
std::string CounterFix(const std::string& name);
std::vector<int> ParseCpuList(const std::string& list);  // "0-3,8" -> {0,1,2,3,8}; {} on junk.
std::string HumanBytes(uint64_t bytes);
std::string JsonEscape(const std::string& s);

}  // namespace rdmarpc::doctor
