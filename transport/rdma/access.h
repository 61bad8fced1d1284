// The verbs access flags rdmarpc registers memory with, in one place, so the
// rule can be read and tested (tests/unit/access_flags_test.cc): no memory is
// remotely readable or atomically accessible, and the only remotely writable
// memory is a rendezvous receive buffer -- an exact-size MR per granted
// message, deregistered (its rkey revoked) when the WRITE_WITH_IMM completing
// it arrives, before the message is delivered. A feature that needs more adds
// a named set here, to kInUse, and to the test's expectations.
#pragma once

#include <array>
#include <string_view>

#include <infiniband/verbs.h>

namespace rdmarpc::rdma::access {

// Memory only the local NIC touches: receive and send slots, send-side
// rendezvous buffers (the NIC reads them for the RDMA WRITE), rc_link rings,
// buffer pools by default. LOCAL_WRITE lets RECVs land in it.
inline constexpr int kLocalOnly = IBV_ACCESS_LOCAL_WRITE;

// A rendezvous receive buffer: the peer RDMA WRITEs one granted message into
// it, using the rkey from our CTS.
inline constexpr int kRendezvousReceive = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

// Flags no registration of ours may carry.
inline constexpr int kForbidden = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

struct Use {
  std::string_view what;  // Which memory is registered with `flags`.
  int flags;
};

// Every registration the library makes, by the set it uses.
inline constexpr std::array<Use, 5> kInUse = {{
    {"rdma connection send/receive slots", kLocalOnly},
    {"rdma connection send-side rendezvous buffer", kLocalOnly},
    {"rdma connection rendezvous receive buffer (granted)", kRendezvousReceive},
    {"rc_link ring", kLocalOnly},
    {"buffer pool default (BufferPoolOptions::access)", kLocalOnly},
}};

}  // namespace rdmarpc::rdma::access
