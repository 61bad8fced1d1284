// The doctor's rules (Evaluate) on hand-made facts, its sysfs reader on a fake
// tree, and its small parsers. No device needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tools/doctor/doctor.h"
#include "transport/rdma/buffer_pool.h"

namespace rdmarpc::doctor {
namespace {

namespace fs = std::filesystem;

// A healthy Soft-RoCE host as the VM harness makes it.
Facts HealthyRxe() {
  Facts f;
  f.present = {"rxe0"};
  f.sample_ms = 100;
  f.numa_nodes = 1;
  f.allowed_cpus = "0-1";
  DeviceFacts d;
  d.name = "rxe0";
  d.node_desc = "rxe";
  d.verbs_ok = true;
  d.vendor_id = 0xFFFFFF;
  PortFacts p;
  p.port = 1;
  p.state = "ACTIVE";
  p.phys_state = "LinkUp";
  p.link_layer = "Ethernet";
  p.active_mtu = 4096;
  p.max_mtu = 4096;
  p.netdev = "rxevm0";
  p.netdev_mtu = 9000;
  p.gids = {{0, "fe80::1", "RoCE v2", "rxevm0"}, {1, "::ffff:10.77.0.1", "RoCE v2", "rxevm0"}};
  p.counters = {{"rcvd_pkts", "hw_counters", 10, 20, false}, {"rcvd_seq_err", "hw_counters", 3, 3, true}};
  d.ports.push_back(p);
  f.devices.push_back(d);
  f.memlock.soft_unlimited = f.memlock.hard_unlimited = true;
  f.memlock_need = MemlockNeedFromDefaults();
  f.hugepages.supported = true;
  f.hugepages.total_2m = f.hugepages.free_2m = 512;
  return f;
}

const Finding* Find(const std::vector<Finding>& all, const std::string& check, const std::string& subject) {
  auto it = std::find_if(all.begin(), all.end(),
                         [&](const Finding& x) { return x.check == check && x.subject == subject; });
  return it == all.end() ? nullptr : &*it;
}

TEST(DoctorChecks, HealthySoftRoceIsOkExceptTheSoftRoceWarning) {
  const auto findings = Evaluate(HealthyRxe());
  for (const Finding& x : findings) {
    if (x.check == "soft_roce") continue;
    EXPECT_EQ(x.status, Severity::kOk) << x.check << " " << x.subject << ": " << x.message;
    EXPECT_TRUE(x.fix.empty()) << x.check;
  }
  const Finding* port = Find(findings, "port", "rxe0/1");
  ASSERT_NE(port, nullptr);
  EXPECT_NE(port->message.find("ACTIVE"), std::string::npos);
  const Finding* soft = Find(findings, "soft_roce", "rxe0");
  ASSERT_NE(soft, nullptr);
  EXPECT_EQ(soft->status, Severity::kWarn);
  EXPECT_NE(soft->message.find("Soft-RoCE"), std::string::npos);
  EXPECT_FALSE(soft->fix.empty());
  const Finding* gid = Find(findings, "gid", "rxe0/1");
  ASSERT_NE(gid, nullptr);
  EXPECT_NE(gid->message.find("index 1 = 10.77.0.1 on rxevm0"), std::string::npos) << gid->message;
  const Finding* counters = Find(findings, "counters", "rxe0/1");
  ASSERT_NE(counters, nullptr);
  EXPECT_NE(counters->message.find("rcvd_seq_err=3"), std::string::npos) << counters->message;
  ASSERT_NE(Find(findings, "memlock", "host"), nullptr);
  ASSERT_NE(Find(findings, "hugepages", "host"), nullptr);
  Report r{HealthyRxe(), findings};
  EXPECT_EQ(r.worst(), Severity::kWarn);
}

TEST(DoctorChecks, HardwareNicIsNotSoftRoceEvenIfNamedLikeOne) {
  Facts f = HealthyRxe();
  f.devices[0].has_parent_device = true;
  f.devices[0].parent_bus_id = "0000:3b:00.0";
  f.devices[0].numa_source = "device";
  f.devices[0].numa_node = 0;
  f.devices[0].local_cpus = "0-1";
  const auto findings = Evaluate(f);
  EXPECT_EQ(Find(findings, "soft_roce", "rxe0")->status, Severity::kOk);
  EXPECT_NE(Find(findings, "numa", "rxe0")->message.find("NUMA node 0, local CPUs 0-1"), std::string::npos);
}

TEST(DoctorChecks, NumaWarnsWhenTheProcessCannotRunNearTheNic) {
  Facts f = HealthyRxe();
  f.numa_nodes = 2;
  f.allowed_cpus = "8-15";
  DeviceFacts& d = f.devices[0];
  d.has_parent_device = true;
  d.numa_source = "device";
  d.numa_node = 0;
  d.local_cpus = "0-7";
  auto findings = Evaluate(f);
  const Finding* numa = Find(findings, "numa", "rxe0");
  ASSERT_NE(numa, nullptr);
  EXPECT_EQ(numa->status, Severity::kWarn);
  EXPECT_NE(numa->fix.find("numactl --cpunodebind=0"), std::string::npos);
  // Unknown node on a two-node host: warn, with the override knobs.
  d.has_parent_device = false;
  d.numa_source.clear();
  findings = Evaluate(f);
  numa = Find(findings, "numa", "rxe0");
  ASSERT_NE(numa, nullptr);
  EXPECT_EQ(numa->status, Severity::kWarn);
  EXPECT_NE(numa->message.find("no PCI device (Soft-RoCE)"), std::string::npos) << numa->message;
}

TEST(DoctorChecks, MemlockBelowTheDefaultNeedFailsWithTheFix) {
  Facts f = HealthyRxe();
  f.memlock.soft_unlimited = f.memlock.hard_unlimited = false;
  f.memlock.soft = f.memlock.hard = 64 << 10;
  const auto findings = Evaluate(f);
  const Finding* m = Find(findings, "memlock", "host");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->status, Severity::kFail);
  EXPECT_NE(m->message.find("RLIMIT_MEMLOCK 64 KiB"), std::string::npos) << m->message;
  EXPECT_NE(m->fix.find("ulimit -l unlimited"), std::string::npos) << m->fix;
  EXPECT_NE(m->fix.find("LimitMEMLOCK=infinity"), std::string::npos) << m->fix;
  EXPECT_EQ((Report{f, findings}.worst()), Severity::kFail);

  // Between a default process's need and a full pool: warn.
  f.memlock.soft = f.memlock.hard = f.memlock_need.minimum();
  EXPECT_EQ(Find(Evaluate(f), "memlock", "host")->status, Severity::kWarn);
  f.memlock.soft = f.memlock.hard = f.memlock_need.full();
  EXPECT_EQ(Find(Evaluate(f), "memlock", "host")->status, Severity::kOk);
}

TEST(DoctorChecks, MemlockNeedFollowsTheLibraryDefaults) {
  const MemlockNeed need = MemlockNeedFromDefaults();
  const rdma::BufferPoolOptions pool;
  EXPECT_EQ(need.pool_cap, pool.max_registered_bytes);
  // At least one slab of every class, each at least slab_bytes.
  EXPECT_GE(need.pool_first_slabs, pool.slab_bytes * pool.class_bytes.size());
  EXPECT_GT(need.connection_slots, 0u);
  EXPECT_EQ(need.connection_slots % 4096, 0u);
  EXPECT_LT(need.minimum(), need.full());
}

TEST(DoctorChecks, ClimbingErrorCountersWarnAndNameTheCounter) {
  Facts f = HealthyRxe();
  f.devices[0].ports[0].counters.push_back({"port_rcv_errors", "counters", 5, 9, true});
  f.devices[0].ports[0].counters.push_back({"rnr_nak_retry_err", "hw_counters", 0, 2, true});
  const auto findings = Evaluate(f);
  const Finding* c = Find(findings, "counters", "rxe0/1");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status, Severity::kWarn);
  EXPECT_NE(c->message.find("port_rcv_errors +4 (now 9)"), std::string::npos) << c->message;
  EXPECT_NE(c->message.find("rnr_nak_retry_err +2"), std::string::npos) << c->message;
  EXPECT_EQ(c->fix, CounterFix("port_rcv_errors"));
  // Packet counters climbing is traffic, not trouble.
  f = HealthyRxe();
  f.devices[0].ports[0].counters[0].after = 1'000'000;
  EXPECT_EQ(Find(Evaluate(f), "counters", "rxe0/1")->status, Severity::kOk);
}

TEST(DoctorChecks, ErrorCounterClassification) {
  for (const char* name : {"port_rcv_errors", "port_xmit_discards", "port_xmit_wait", "rnr_nak_retry_err",
                           "local_ack_timeout_err", "out_of_sequence", "rcvd_seq_err", "retry_exceeded_err",
                           "link_downed", "duplicate_request", "out_of_seq_request"})
    EXPECT_TRUE(IsErrorCounter(name)) << name;
  for (const char* name : {"rcvd_pkts", "sent_pkts", "port_xmit_data", "port_rcv_packets", "rdma_sends",
                           "ack_deferred", "np_cnp_sent"})
    EXPECT_FALSE(IsErrorCounter(name)) << name;
  EXPECT_NE(CounterFix("port_xmit_discards").find("congestion"), std::string::npos);
  EXPECT_NE(CounterFix("out_of_sequence").find("PFC"), std::string::npos);
}

TEST(DoctorChecks, PortDownFailsUnlessAnotherPortIsActive) {
  Facts f = HealthyRxe();
  f.devices[0].ports[0].state = "DOWN";
  f.devices[0].ports[0].phys_state = "Disabled";
  auto down = Evaluate(f);
  const Finding* p = Find(down, "port", "rxe0/1");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->status, Severity::kFail);
  EXPECT_FALSE(p->fix.empty());

  f = HealthyRxe();
  PortFacts second = f.devices[0].ports[0];
  second.port = 2;
  second.state = "DOWN";
  second.phys_state = "Polling";
  f.devices[0].ports.push_back(second);
  const auto findings = Evaluate(f);
  EXPECT_EQ(Find(findings, "port", "rxe0/1")->status, Severity::kOk);
  EXPECT_EQ(Find(findings, "port", "rxe0/2")->status, Severity::kWarn);
  EXPECT_NE(Find(findings, "port", "rxe0/2")->fix.find("ip link set rxevm0 up"), std::string::npos);
}

TEST(DoctorChecks, SmallMtuWarnsWithTheNetdevFix) {
  Facts f = HealthyRxe();
  f.devices[0].ports[0].active_mtu = 1024;
  f.devices[0].ports[0].netdev_mtu = 1500;
  const auto findings = Evaluate(f);
  const Finding* m = Find(findings, "mtu", "rxe0/1");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->status, Severity::kWarn);
  EXPECT_NE(m->message.find("active MTU 1024, max 4096"), std::string::npos) << m->message;
  EXPECT_NE(m->fix.find("ip link set rxevm0 mtu"), std::string::npos) << m->fix;
}

TEST(DoctorChecks, GidTable) {
  Facts f = HealthyRxe();
  f.devices[0].ports[0].gids = {{0, "fe80::1", "RoCE v2", "rxevm0"}};
  EXPECT_EQ(Find(Evaluate(f), "gid", "rxe0/1")->status, Severity::kWarn);
  f.devices[0].ports[0].gids = {{0, "fe80::1", "IB/RoCE v1", "rxevm0"}};
  const auto findings = Evaluate(f);
  const Finding* g = Find(findings, "gid", "rxe0/1");
  EXPECT_EQ(g->status, Severity::kFail);
  EXPECT_NE(g->fix.find("ip addr add"), std::string::npos);
}

TEST(DoctorChecks, NoDeviceFailsAndPointsToTheHarness) {
  Facts f = HealthyRxe();
  f.present.clear();
  f.devices.clear();
  const auto findings = Evaluate(f);
  const Finding* d = Find(findings, "devices", "host");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->status, Severity::kFail);
  EXPECT_NE(d->message.find("no RDMA device"), std::string::npos);
  EXPECT_NE(d->fix.find("tools/rxe-vm"), std::string::npos);
  EXPECT_NE(d->fix.find("rdma link add rxe0 type rxe netdev"), std::string::npos);
  // The host-wide checks still run.
  EXPECT_NE(Find(findings, "memlock", "host"), nullptr);

  f.present = {"mlx5_0"};
  f.requested_device = "rxe9";
  const auto missing = Evaluate(f);
  d = Find(missing, "devices", "host");
  EXPECT_EQ(d->status, Severity::kFail);
  EXPECT_NE(d->message.find("'rxe9' not found; present: mlx5_0"), std::string::npos);
}

TEST(DoctorText, FindingsAreAlignedAndFixesIndented) {
  Facts f = HealthyRxe();
  f.memlock.soft_unlimited = f.memlock.hard_unlimited = false;
  f.memlock.soft = f.memlock.hard = 64 << 10;
  Report r{f, Evaluate(f)};
  const std::string text = RenderText(r);
  EXPECT_NE(text.find("\nok      port       rxe0/1   ACTIVE (LinkUp)"), std::string::npos) << text;
  EXPECT_NE(text.find("\nfail    memlock    host     RLIMIT_MEMLOCK 64 KiB"), std::string::npos) << text;
  EXPECT_NE(text.find("\n                            fix: raise it"), std::string::npos) << text;
  EXPECT_NE(text.find("GID 1  RoCE v2  rxevm0  ::ffff:10.77.0.1"), std::string::npos) << text;
  EXPECT_NE(text.find("result: FAIL"), std::string::npos);
}

TEST(DoctorJson, EscapesStrings) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\nd\\u0001");
  Facts f = HealthyRxe();
  f.devices[0].node_desc = "quote\" and\ttab";
  const std::string json = RenderJson({f, Evaluate(f)});
  EXPECT_NE(json.find("\"node_desc\":\"quote\\\" and\\ttab\""), std::string::npos) << json;
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.substr(json.size() - 2), "}\n");
}

TEST(DoctorParse, CpuListAndBytes) {
  EXPECT_EQ(ParseCpuList("0-3,8"), (std::vector<int>{0, 1, 2, 3, 8}));
  EXPECT_EQ(ParseCpuList("5"), (std::vector<int>{5}));
  EXPECT_TRUE(ParseCpuList("").empty());
  EXPECT_TRUE(ParseCpuList("3-1").empty());
  EXPECT_TRUE(ParseCpuList("x").empty());
  EXPECT_EQ(HumanBytes(64 << 10), "64 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(512), "512 B");
}

// Collect reads a sysfs tree: a fake one (libibverbs knows no such device, so
// the device itself is reported unusable, but ports, GIDs and counters are read).
class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("doctor_sysfs_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
             std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::remove_all(root_);
    const fs::path port = root_ / "class/infiniband/fake9/ports/1";
    Write(root_ / "class/infiniband/fake9/node_desc", "fake node");
    Write(port / "state", "4: ACTIVE");
    Write(port / "phys_state", "5: LinkUp");
    Write(port / "link_layer", "Ethernet");
    Write(port / "gids/0", "fe80:0000:0000:0000:d4c2:99ff:feb8:3366");
    Write(port / "gid_attrs/types/0", "RoCE v2");
    Write(port / "gid_attrs/ndevs/0", "fakeif0");
    Write(port / "gids/1", "0000:0000:0000:0000:0000:ffff:0a4d:0001");
    Write(port / "gid_attrs/types/1", "RoCE v2");
    Write(port / "gid_attrs/ndevs/1", "fakeif0");
    Write(port / "gids/2", "0000:0000:0000:0000:0000:0000:0000:0000");
    Write(port / "hw_counters/out_of_seq_request", "7");
    Write(port / "hw_counters/lifespan", "10");
    Write(port / "counters/port_rcv_errors", "0");
    Write(root_ / "class/net/fakeif0/mtu", "1500");
    Write(root_ / "devices/system/node/online", "0-1");
  }
  void TearDown() override { fs::remove_all(root_); }
  static void Write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  fs::path root_;
};

TEST_F(FakeSysfs, ReadsPortsGidsAndCounters) {
  const Facts f = Collect({.device = "", .sample_ms = 0, .sysfs = root_.string(), .proc = "/proc"});
  ASSERT_EQ(f.present, std::vector<std::string>{"fake9"});
  ASSERT_EQ(f.devices.size(), 1u);
  EXPECT_EQ(f.numa_nodes, 2);
  const DeviceFacts& d = f.devices[0];
  EXPECT_EQ(d.node_desc, "fake node");
  EXPECT_FALSE(d.verbs_ok);
  EXPECT_FALSE(d.has_parent_device);
  ASSERT_EQ(d.ports.size(), 1u);
  const PortFacts& p = d.ports[0];
  EXPECT_EQ(p.state, "ACTIVE");
  EXPECT_EQ(p.phys_state, "LinkUp");
  EXPECT_EQ(p.netdev, "fakeif0");
  EXPECT_EQ(p.netdev_mtu, 1500);
  ASSERT_EQ(p.gids.size(), 2u);  // The all-zero entry is skipped.
  EXPECT_EQ(p.gids[0].gid, "fe80::d4c2:99ff:feb8:3366");
  EXPECT_EQ(p.gids[1].gid, "::ffff:10.77.0.1");
  EXPECT_EQ(p.gids[1].type, "RoCE v2");
  ASSERT_EQ(p.counters.size(), 2u);  // lifespan is a setting, not a counter.
  EXPECT_EQ(p.counters[0].name, "port_rcv_errors");
  EXPECT_EQ(p.counters[1].name, "out_of_seq_request");
  EXPECT_EQ(p.counters[1].after, 7u);
  EXPECT_TRUE(p.counters[1].error_like);

  const auto findings = Evaluate(f);
  EXPECT_EQ(Find(findings, "device", "fake9")->status, Severity::kFail);
  EXPECT_EQ(Find(findings, "port", "fake9/1")->status, Severity::kOk);
  EXPECT_EQ(Find(findings, "gid", "fake9/1")->status, Severity::kOk);
  // Unknown node on a two-node host.
  EXPECT_EQ(Find(findings, "numa", "fake9")->status, Severity::kWarn);
}

TEST_F(FakeSysfs, RequestedDeviceThatIsNotThere) {
  const Facts f = Collect({.device = "rxe0", .sample_ms = 0, .sysfs = root_.string(), .proc = "/proc"});
  EXPECT_TRUE(f.devices.empty());
  EXPECT_EQ(Find(Evaluate(f), "devices", "host")->status, Severity::kFail);
}

}  // namespace
}  // namespace rdmarpc::doctor
