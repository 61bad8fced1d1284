// perftest (ib_send_lat, ib_write_bw) as ceiling rows: run a server/client
// pair on this host and read the numbers of one table line. Shared by
// transport_bench and rdmarpc_bench.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace rdmarpc::bench::perftest {

// Runs `server_cmd` in the background and `client_cmd` after it (each bounded
// by `timeout 120`); returns the client's output ("" if it could not start).
std::string RunPair(const std::string& server_cmd, const std::string& client_cmd);

// The numbers after `size` on the all-numeric table line that starts with it;
// empty if there is none.
std::vector<double> TableLine(const std::string& out, size_t size);

}  // namespace rdmarpc::bench::perftest
