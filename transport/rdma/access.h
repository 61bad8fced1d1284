// The verbs access flags rdmarpc registers memory with, in one place, so the
// rule can be read and tested (tests/unit/access_flags_test.cc): no memory is
// remotely readable or atomically accessible, and the only remotely writable
// memory is a rendezvous receive buffer -- a type-2 memory window bound over
// exactly the granted bytes of a grant-pool buffer, or (no windows on the
// device, or above the pool's largest class) an exact-size MR per granted
// message -- revoked (window invalidated, MR deregistered) when the
// WRITE_WITH_IMM completing it arrives, before the message is delivered. A feature that needs more adds
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

// A slab of a connection's grant pool: registered once, not remotely
// accessible through its own rkey (no REMOTE_* flag). Each rendezvous grant
// binds a type-2 memory window over exactly the granted bytes of one buffer
// (kGrantWindow) and invalidates it when the transfer completes. LOCAL_WRITE
// is required to bind a window with REMOTE_WRITE (IB spec C10-74).
inline constexpr int kGrantPool = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND;

// What a bound grant window allows: the peer's RDMA WRITE, nothing else.
inline constexpr int kGrantWindow = IBV_ACCESS_REMOTE_WRITE;

// Flags no registration of ours may carry.
inline constexpr int kForbidden = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

struct Use {
  std::string_view what;  // Which memory is registered with `flags`.
  int flags;
};

// Every registration the library makes, by the set it uses.
inline constexpr std::array<Use, 7> kInUse = {{
    {"rdma connection send/receive slots", kLocalOnly},
    {"rdma connection send-side rendezvous buffer", kLocalOnly},
    {"rdma connection rendezvous receive buffer (granted, one MR per message)", kRendezvousReceive},
    {"rdma connection grant pool slab (windows are bound over it)", kGrantPool},
    {"rdma connection rendezvous receive buffer (granted, type-2 window over the grant pool)", kGrantWindow},
    {"rc_link ring", kLocalOnly},
    {"buffer pool default (BufferPoolOptions::access)", kLocalOnly},
}};

}  // namespace rdmarpc::rdma::access
