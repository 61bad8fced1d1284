// Collect: the facts, read from sysfs, /proc, rlimits and libibverbs. Nothing
// here decides what is good or bad (that is checks.cc); a fact that cannot be
// read is left at its "unknown" value.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tools/doctor/doctor.h"

namespace rdmarpc::doctor {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> ReadLine(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ' || line.back() == '\r'))
    line.pop_back();
  return line;
}

std::string ReadOr(const fs::path& path, std::string fallback = "") {
  return ReadLine(path).value_or(std::move(fallback));
}

std::optional<long long> ReadInt(const fs::path& path) {
  auto line = ReadLine(path);
  if (!line || line->empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(line->c_str(), &end, 0);
  if (errno != 0 || end == line->c_str()) return std::nullopt;
  return v;
}

std::optional<uint64_t> ReadU64(const fs::path& path) {
  auto line = ReadLine(path);
  if (!line || line->empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(line->c_str(), &end, 10);
  if (errno != 0 || end == line->c_str()) return std::nullopt;
  return v;
}

// Entry names of a directory, sorted; numeric names sort by value.
std::vector<std::string> ListDir(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    auto numeric = [](const std::string& s) {
      return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
    };
    const bool na = numeric(a);
    const bool nb = numeric(b);
    if (na && nb && a.size() != b.size()) return a.size() < b.size();
    return a < b;
  });
  return names;
}

// "4: ACTIVE" -> "ACTIVE".
std::string AfterColon(const std::string& s) {
  auto pos = s.find(": ");
  return pos == std::string::npos ? s : s.substr(pos + 2);
}

// sysfs prints GIDs as eight groups of four hex digits. Returns "" for the
// all-zero (empty) entry or junk.
std::string GidText(const std::string& raw) {
  std::string hex;
  for (char c : raw)
    if (c != ':') hex.push_back(c);
  if (hex.size() != 32) return "";
  in6_addr addr{};
  bool zero = true;
  for (size_t i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1) return "";
    addr.s6_addr[i] = static_cast<uint8_t>(v);
    zero = zero && v == 0;
  }
  if (zero) return "";
  char buf[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(AF_INET6, &addr, buf, sizeof buf) == nullptr) return "";
  return buf;
}

int MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 0;
}

std::string CpuListText(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

struct DeviceListDeleter {
  void operator()(ibv_device** list) const noexcept { ibv_free_device_list(list); }
};
struct ContextDeleter {
  void operator()(ibv_context* ctx) const noexcept { ibv_close_device(ctx); }
};

// What libibverbs says about one device: ids and per-port MTUs.
void QueryVerbs(ibv_device* device, DeviceFacts& dev, std::map<int, std::pair<int, int>>& mtus) {
  std::unique_ptr<ibv_context, ContextDeleter> ctx(ibv_open_device(device));
  if (!ctx) {
    dev.verbs_error = std::string("ibv_open_device: ") + std::strerror(errno);
    return;
  }
  ibv_device_attr attr{};
  if (int rc = ibv_query_device(ctx.get(), &attr); rc != 0) {
    dev.verbs_error = std::string("ibv_query_device: ") + std::strerror(rc);
    return;
  }
  dev.verbs_ok = true;
  dev.vendor_id = attr.vendor_id;
  dev.vendor_part_id = attr.vendor_part_id;
  for (int p = 1; p <= attr.phys_port_cnt; ++p) {
    ibv_port_attr pattr{};
    if (ibv_query_port(ctx.get(), static_cast<uint8_t>(p), &pattr) != 0) continue;
    mtus[p] = {MtuBytes(pattr.active_mtu), MtuBytes(pattr.max_mtu)};
  }
}

// First pass: every readable counter of the port. Second pass: re-read the
// same files (a counter that vanished keeps its first value).
void ReadCounters(const fs::path& port_dir, std::vector<Counter>& counters, bool first) {
  if (!first) {
    for (Counter& c : counters) c.after = ReadU64(port_dir / c.group / c.name).value_or(c.before);
    return;
  }
  for (const char* group : {"counters", "hw_counters"}) {
    for (const std::string& name : ListDir(port_dir / group)) {
      // lifespan is hw_counters' refresh interval in ms (a setting, not a count).
      if (name == "lifespan") continue;
      auto v = ReadU64(port_dir / group / name);
      if (!v) continue;
      counters.push_back({.name = name, .group = group, .before = *v, .after = *v,
                          .error_like = IsErrorCounter(name)});
    }
  }
}

PortFacts CollectPort(const fs::path& sys, const fs::path& port_dir, int port) {
  PortFacts pf;
  pf.port = port;
  pf.state = AfterColon(ReadOr(port_dir / "state", "?"));
  pf.phys_state = AfterColon(ReadOr(port_dir / "phys_state", "?"));
  pf.link_layer = ReadOr(port_dir / "link_layer", "InfiniBand");
  pf.rate = ReadOr(port_dir / "rate");
  for (const std::string& idx : ListDir(port_dir / "gids")) {
    std::string text = GidText(ReadOr(port_dir / "gids" / idx));
    if (text.empty()) continue;
    Gid g;
    g.index = std::atoi(idx.c_str());
    g.gid = text;
    g.type = ReadOr(port_dir / "gid_attrs" / "types" / idx);
    g.netdev = ReadOr(port_dir / "gid_attrs" / "ndevs" / idx);
    if (pf.netdev.empty()) pf.netdev = g.netdev;
    pf.gids.push_back(std::move(g));
  }
  if (!pf.netdev.empty()) {
    if (auto mtu = ReadInt(sys / "class" / "net" / pf.netdev / "mtu")) pf.netdev_mtu = static_cast<int>(*mtu);
  }
  return pf;
}

DeviceFacts CollectDevice(const fs::path& sys, const std::string& name, ibv_device* verbs_device) {
  DeviceFacts dev;
  dev.name = name;
  const fs::path dir = sys / "class" / "infiniband" / name;
  dev.node_desc = ReadOr(dir / "node_desc");
  dev.node_type = AfterColon(ReadOr(dir / "node_type"));
  dev.fw_ver = ReadOr(dir / "fw_ver");
  std::error_code ec;
  if (fs::exists(dir / "device", ec)) {
    dev.has_parent_device = true;
    dev.parent_bus_id = fs::canonical(dir / "device", ec).filename().string();
    if (fs::exists(dir / "device" / "driver", ec))
      dev.parent_driver = fs::canonical(dir / "device" / "driver", ec).filename().string();
    auto node = ReadInt(dir / "device" / "numa_node");
    dev.local_cpus = ReadOr(dir / "device" / "local_cpulist");
    dev.numa_node = node ? static_cast<int>(*node) : -1;
    dev.numa_source = "device";
  }

  std::map<int, std::pair<int, int>> mtus;
  if (verbs_device != nullptr) {
    QueryVerbs(verbs_device, dev, mtus);
  } else {
    dev.verbs_error = "libibverbs does not list it (no provider for its driver?)";
  }

  for (const std::string& p : ListDir(dir / "ports")) {
    PortFacts pf = CollectPort(sys, dir / "ports" / p, std::atoi(p.c_str()));
    if (auto it = mtus.find(pf.port); it != mtus.end()) {
      pf.active_mtu = it->second.first;
      pf.max_mtu = it->second.second;
    }
    dev.ports.push_back(std::move(pf));
  }

  // Soft-RoCE has no device of its own: the NIC under its netdev decides
  // where packets (and so the work) land.
  if (dev.numa_source.empty() || dev.numa_node < 0) {
    for (const PortFacts& pf : dev.ports) {
      if (pf.netdev.empty()) continue;
      const fs::path nd = sys / "class" / "net" / pf.netdev / "device";
      if (!fs::exists(nd, ec)) continue;
      auto node = ReadInt(nd / "numa_node");
      dev.numa_node = node ? static_cast<int>(*node) : -1;
      dev.local_cpus = ReadOr(nd / "local_cpulist");
      dev.numa_source = "netdev " + pf.netdev;
      break;
    }
  }
  return dev;
}

MemlockFacts CollectMemlock(const fs::path& proc) {
  MemlockFacts m;
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0) {
    m.soft_unlimited = lim.rlim_cur == RLIM_INFINITY;
    m.hard_unlimited = lim.rlim_max == RLIM_INFINITY;
    m.soft = m.soft_unlimited ? 0 : lim.rlim_cur;
    m.hard = m.hard_unlimited ? 0 : lim.rlim_max;
  }
  std::ifstream status(proc / "self" / "status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    constexpr int kCapIpcLock = 14;  // linux/capability.h
    m.cap_ipc_lock = (caps >> kCapIpcLock) & 1u;
  }
  return m;
}

HugepageFacts CollectHugepages(const fs::path& sys, const fs::path& proc) {
  HugepageFacts h;
  const fs::path two_mb = sys / "kernel" / "mm" / "hugepages" / "hugepages-2048kB";
  std::error_code ec;
  h.supported = fs::exists(two_mb, ec);
  h.total_2m = ReadU64(two_mb / "nr_hugepages").value_or(0);
  h.free_2m = ReadU64(two_mb / "free_hugepages").value_or(0);
  std::ifstream meminfo(proc / "meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    auto value = [&](const char* key) -> std::optional<uint64_t> {
      if (line.rfind(key, 0) != 0) return std::nullopt;
      return std::strtoull(line.c_str() + std::strlen(key), nullptr, 10);
    };
    if (auto v = value("HugePages_Total:")) h.meminfo_total = *v;
    if (auto v = value("HugePages_Free:")) h.meminfo_free = *v;
    if (auto v = value("Hugepagesize:")) h.default_kb = *v;
  }
  return h;
}

}  // namespace

Facts Collect(const CollectOptions& options) {
  Facts facts;
  const fs::path sys = options.sysfs;
  facts.requested_device = options.device;
  facts.sample_ms = std::max(options.sample_ms, 0);
  facts.present = ListDir(sys / "class" / "infiniband");

  int n = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&n));
  std::map<std::string, ibv_device*> verbs_devices;
  for (int i = 0; list && i < n; ++i) verbs_devices[ibv_get_device_name(list.get()[i])] = list.get()[i];

  for (const std::string& name : facts.present) {
    if (!options.device.empty() && name != options.device) continue;
    auto it = verbs_devices.find(name);
    facts.devices.push_back(CollectDevice(sys, name, it == verbs_devices.end() ? nullptr : it->second));
  }

  // Counters: every port read, one sleep, every port read again, so the
  // sample costs sample_ms however many ports there are.
  const fs::path ib = sys / "class" / "infiniband";
  for (DeviceFacts& dev : facts.devices)
    for (PortFacts& pf : dev.ports)
      ReadCounters(ib / dev.name / "ports" / std::to_string(pf.port), pf.counters, true);
  if (facts.sample_ms > 0 && !facts.devices.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(facts.sample_ms));
    for (DeviceFacts& dev : facts.devices)
      for (PortFacts& pf : dev.ports)
        ReadCounters(ib / dev.name / "ports" / std::to_string(pf.port), pf.counters, false);
  }

  facts.numa_nodes = std::max<int>(
      1, static_cast<int>(ParseCpuList(ReadOr(sys / "devices" / "system" / "node" / "online", "0")).size()));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    facts.allowed_cpus = CpuListText(cpus);
  }
  facts.memlock = CollectMemlock(options.proc);
  facts.memlock_need = MemlockNeedFromDefaults();
  facts.hugepages = CollectHugepages(sys, options.proc);
  return facts;
}

}  // namespace rdmarpc::doctor
