// perftest (ib_send_lat, ib_write_bw) as ceiling rows: run a server/client
// pair on this host and read the numbers of one table line. Shared by
// transport_bench and rdmarpc_bench.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace rdmarpc::bench::perftest {

// Runs `server_cmd` in the background and, `server_start_s` seconds later,
// `client_cmd` (each bounded by `timeout 120`); returns the client's output
// ("" if it could not start).
std::string RunPair(const std::string& server_cmd, const std::string& client_cmd, int server_start_s);

// The numbers after `size` on the all-numeric table line that starts with it;
// empty if there is none.
std::vector<double> TableLine(const std::string& out, size_t size);

// RunPair + TableLine, retried with a longer head start for the server (2, 5,
// then 10 s) when the client printed no table line: under emulation (the
// Soft-RoCE VM) a server can take seconds to listen, and the client then
// fails to connect. Empty after three failures.
std::vector<double> Measure(const std::string& server_cmd, const std::string& client_cmd, size_t size);

}  // namespace rdmarpc::bench::perftest
