// Render: a Report as aligned text for people, or as one JSON document.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/doctor/doctor.h"

namespace rdmarpc::doctor {
namespace {

std::string Pad(const std::string& s, size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

// Rows of cells printed with every column padded to its widest cell.
std::string Table(const std::vector<std::vector<std::string>>& rows, const std::string& indent) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    if (width.size() < r.size()) width.resize(r.size(), 0);
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line = indent;
    for (size_t i = 0; i < r.size(); ++i) line += i + 1 == r.size() ? r[i] : Pad(r[i], width[i] + 2);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string Str(const std::string& s) { return "\"" + JsonEscape(s) + "\""; }
std::string Num(uint64_t v) { return std::to_string(v); }
std::string Int(long long v) { return std::to_string(v); }
std::string Bool(bool b) { return b ? "true" : "false"; }

// A JSON object built field by field, keeping the order given.
class Obj {
 public:
  Obj& Add(const std::string& key, const std::string& raw_json) {
    body_ += (body_.empty() ? "" : ",") + Str(key) + ":" + raw_json;
    return *this;
  }
  std::string Done() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

template <typename T, typename F>
std::string Array(const std::vector<T>& items, F&& each) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? "," : "") + each(items[i]);
  return out + "]";
}

}  // namespace

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);  // UTF-8 passes through unchanged.
        }
    }
  }
  return out;
}

std::string RenderText(const Report& r) {
  const Facts& f = r.facts;
  std::string out = "rdmarpc doctor: " + std::to_string(f.devices.size()) + " device(s) examined";
  if (f.devices.empty())
    out += "\n";
  else
    out += f.sample_ms > 0 ? ", counters sampled over " + std::to_string(f.sample_ms) + " ms\n"
                           : ", counters read once (--sample-ms 0)\n";

  for (const DeviceFacts& d : f.devices) {
    std::string head = "\n" + d.name;
    head += d.has_parent_device ? "  " + d.parent_bus_id + (d.parent_driver.empty() ? "" : " (" + d.parent_driver + ")")
                                : "  no PCI device";
    if (!d.node_desc.empty()) head += "  node_desc \"" + d.node_desc + "\"";
    head += "  NUMA node " + (d.numa_source.empty() || d.numa_node < 0 ? std::string("unknown")
                                                                        : std::to_string(d.numa_node));
    if (!d.local_cpus.empty()) head += " (CPUs " + d.local_cpus + ")";
    out += head + "\n";
    for (const PortFacts& p : d.ports) {
      std::string line = "  port " + std::to_string(p.port) + "  " + p.state + " (" + p.phys_state + ")  " +
                         p.link_layer;
      if (p.active_mtu > 0) line += "  MTU " + std::to_string(p.active_mtu) + "/" + std::to_string(p.max_mtu);
      if (!p.netdev.empty())
        line += "  netdev " + p.netdev + (p.netdev_mtu > 0 ? " (mtu " + std::to_string(p.netdev_mtu) + ")" : "");
      if (!p.rate.empty()) line += "  " + p.rate;
      out += line + "\n";
      std::vector<std::vector<std::string>> gids;
      for (const Gid& g : p.gids)
        gids.push_back({"GID " + std::to_string(g.index), g.type.empty() ? "-" : g.type,
                        g.netdev.empty() ? "-" : g.netdev, g.gid});
      out += Table(gids, "    ");
      std::vector<std::string> errs;
      size_t others = 0;
      for (const Counter& c : p.counters) {
        if (!c.error_like) {
          ++others;
          continue;
        }
        errs.push_back(c.name + " " + std::to_string(c.after) + " (+" + std::to_string(c.delta()) + ")");
      }
      if (p.counters.empty()) {
        out += "    counters: none exposed\n";
      } else {
        out += "    error counters:";
        size_t col = 20;
        for (const std::string& e : errs) {
          if (col + e.size() + 2 > 100) {
            out += "\n      ";
            col = 6;
          } else {
            out += " ";
          }
          out += e;
          col += e.size() + 2;
        }
        if (errs.empty()) out += " none";
        out += "\n    (" + std::to_string(others) + " other counters in --json)\n";
      }
    }
  }

  out += "\n";
  const size_t w0 = 6;  // "STATUS", wider than "warn".
  size_t w1 = 5, w2 = 7;
  for (const Finding& x : r.findings) {
    w1 = std::max(w1, x.check.size());
    w2 = std::max(w2, x.subject.size());
  }
  const std::string fix_indent(w0 + 2 + w1 + 2 + w2 + 2, ' ');
  out += Pad("STATUS", w0 + 2) + Pad("CHECK", w1 + 2) + Pad("SUBJECT", w2 + 2) + "FINDING\n";
  int counts[3] = {0, 0, 0};
  for (const Finding& x : r.findings) {
    ++counts[static_cast<int>(x.status)];
    out += Pad(SeverityName(x.status), w0 + 2) + Pad(x.check, w1 + 2) + Pad(x.subject, w2 + 2) + x.message + "\n";
    if (!x.fix.empty()) out += fix_indent + "fix: " + x.fix + "\n";
  }
  out += "\nresult: " + std::string(r.worst() == Severity::kFail ? "FAIL" : r.worst() == Severity::kWarn ? "WARN" : "OK") +
         " (" + std::to_string(counts[0]) + " ok, " + std::to_string(counts[1]) + " warn, " +
         std::to_string(counts[2]) + " fail)\n";
  return out;
}

std::string RenderJson(const Report& r) {
  const Facts& f = r.facts;
  auto counter = [](const Counter& c) {
    return Obj()
        .Add("name", Str(c.name))
        .Add("group", Str(c.group))
        .Add("before", Num(c.before))
        .Add("after", Num(c.after))
        .Add("delta", Num(c.delta()))
        .Add("error", Bool(c.error_like))
        .Done();
  };
  auto gid = [](const Gid& g) {
    return Obj().Add("index", Int(g.index)).Add("gid", Str(g.gid)).Add("type", Str(g.type)).Add("netdev", Str(g.netdev)).Done();
  };
  auto port = [&](const PortFacts& p) {
    return Obj()
        .Add("port", Int(p.port))
        .Add("state", Str(p.state))
        .Add("phys_state", Str(p.phys_state))
        .Add("link_layer", Str(p.link_layer))
        .Add("rate", Str(p.rate))
        .Add("active_mtu", Int(p.active_mtu))
        .Add("max_mtu", Int(p.max_mtu))
        .Add("netdev", Str(p.netdev))
        .Add("netdev_mtu", Int(p.netdev_mtu))
        .Add("gids", Array(p.gids, gid))
        .Add("counters", Array(p.counters, counter))
        .Done();
  };
  auto device = [&](const DeviceFacts& d) {
    return Obj()
        .Add("name", Str(d.name))
        .Add("node_desc", Str(d.node_desc))
        .Add("node_type", Str(d.node_type))
        .Add("fw_ver", Str(d.fw_ver))
        .Add("pci_device", d.has_parent_device ? Str(d.parent_bus_id) : "null")
        .Add("driver", Str(d.parent_driver))
        .Add("verbs_ok", Bool(d.verbs_ok))
        .Add("verbs_error", Str(d.verbs_error))
        .Add("vendor_id", Num(d.vendor_id))
        .Add("vendor_part_id", Num(d.vendor_part_id))
        .Add("numa_node", Int(d.numa_node))
        .Add("numa_source", Str(d.numa_source))
        .Add("local_cpus", Str(d.local_cpus))
        .Add("ports", Array(d.ports, port))
        .Done();
  };
  auto finding = [](const Finding& x) {
    return Obj()
        .Add("check", Str(x.check))
        .Add("subject", Str(x.subject))
        .Add("status", Str(SeverityName(x.status)))
        .Add("message", Str(x.message))
        .Add("fix", Str(x.fix))
        .Done();
  };
  const MemlockFacts& m = f.memlock;
  const std::string memlock =
      Obj()
          .Add("soft", m.soft_unlimited ? Str("unlimited") : Num(m.soft))
          .Add("hard", m.hard_unlimited ? Str("unlimited") : Num(m.hard))
          .Add("cap_ipc_lock", Bool(m.cap_ipc_lock))
          .Add("need_min", Num(f.memlock_need.minimum()))
          .Add("need_full", Num(f.memlock_need.full()))
          .Add("connection_slots", Num(f.memlock_need.connection_slots))
          .Add("pool_first_slabs", Num(f.memlock_need.pool_first_slabs))
          .Add("pool_cap", Num(f.memlock_need.pool_cap))
          .Done();
  const HugepageFacts& h = f.hugepages;
  const std::string huge = Obj()
                               .Add("supported_2m", Bool(h.supported))
                               .Add("total_2m", Num(h.total_2m))
                               .Add("free_2m", Num(h.free_2m))
                               .Add("default_kb", Num(h.default_kb))
                               .Add("meminfo_total", Num(h.meminfo_total))
                               .Add("meminfo_free", Num(h.meminfo_free))
                               .Done();
  int counts[3] = {0, 0, 0};
  for (const Finding& x : r.findings) ++counts[static_cast<int>(x.status)];
  return Obj()
             .Add("tool", Str("rdmarpc doctor"))
             .Add("version", Int(1))
             .Add("status", Str(SeverityName(r.worst())))
             .Add("summary", Obj().Add("ok", Int(counts[0])).Add("warn", Int(counts[1])).Add("fail", Int(counts[2])).Done())
             .Add("sample_ms", Int(f.sample_ms))
             .Add("requested_device", f.requested_device.empty() ? "null" : Str(f.requested_device))
             .Add("present", Array(f.present, [](const std::string& s) { return Str(s); }))
             .Add("devices", Array(f.devices, device))
             .Add("host", Obj()
                              .Add("numa_nodes", Int(f.numa_nodes))
                              .Add("allowed_cpus", Str(f.allowed_cpus))
                              .Add("memlock", memlock)
                              .Add("hugepages", huge)
                              .Done())
             .Add("findings", Array(r.findings, finding))
             .Done() +
         "\n";
}

}  // namespace rdmarpc::doctor
