// Shared by the libFuzzer targets in tests/fuzz (docs/fuzzing.md).
//
//  - FUZZ_CHECK(cond, message...): an invariant. On failure prints the message
//    and aborts, which libFuzzer reports as a crash and saves the input.
//  - Seeds: every target can write its seed corpus, made by the real encoders,
//    with `<target> --write-seeds=DIR` (handled in LLVMFuzzerInitialize, before
//    libFuzzer parses its own flags); tests/fuzz/<target>/corpus is that output.
//  - RunUntil(): drives an io_context on the fuzzing thread until a condition
//    holds, with a bound, for the targets that talk to a real server/socket.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "absl/strings/str_cat.h"
#include "transport/common/log.h"

namespace rdmarpc::fuzz {

[[noreturn]] inline void CheckFailed(const char* cond, const char* file, int line, const std::string& message) {
  std::fprintf(stderr, "\n==== fuzz invariant violated at %s:%d: %s\n     %s\n", file, line, cond, message.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_CHECK(cond, ...)                                                                \
  do {                                                                                       \
    if (!(cond)) ::rdmarpc::fuzz::CheckFailed(#cond, __FILE__, __LINE__, absl::StrCat(__VA_ARGS__)); \
  } while (0)

inline std::span<const std::byte> AsBytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}
inline std::span<const std::byte> AsBytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline std::span<std::byte> AsWritableBytes(std::string& s) {
  return {reinterpret_cast<std::byte*>(s.data()), s.size()};
}
// True if `inner` lies within `outer` (an empty span anywhere in [begin, end]).
inline bool Within(std::span<const std::byte> inner, std::span<const std::byte> outer) {
  const auto* b = outer.data();
  const auto* e = outer.data() + outer.size();
  return inner.data() >= b && inner.data() <= e && inner.size() <= static_cast<size_t>(e - inner.data());
}

inline void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

struct Seed {
  std::string name;   // file name in the corpus directory
  std::string bytes;
};

// If argv has --write-seeds=DIR: writes `make()`'s seeds there and exits.
inline void MaybeWriteSeeds(int* argc, char*** argv, const std::function<std::vector<Seed>()>& make) {
  static constexpr char kFlag[] = "--write-seeds=";
  for (int i = 1; i < *argc; ++i) {
    const char* arg = (*argv)[i];
    if (std::strncmp(arg, kFlag, sizeof(kFlag) - 1) != 0) continue;
    const std::filesystem::path dir(arg + sizeof(kFlag) - 1);
    std::filesystem::create_directories(dir);
    std::vector<Seed> seeds = make();
    for (const Seed& s : seeds) {
      std::ofstream f(dir / s.name, std::ios::binary | std::ios::trunc);
      f.write(s.bytes.data(), static_cast<std::streamsize>(s.bytes.size()));
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", (dir / s.name).c_str());
        std::exit(1);
      }
    }
    std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
    std::exit(0);
  }
}

// Every bad input would log a warning (bad_frame, disconnected): errors only,
// unless RDMARPC_LOG asks for more.
inline void QuietLogs() {
  if (std::getenv("RDMARPC_LOG") == nullptr) log::SetThreshold(log::Level::kError);
}

// Runs handlers on this thread until done() or `limit` passed; false on timeout.
inline bool RunUntil(boost::asio::io_context& io, const std::function<bool()>& done,
                     std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) return false;
    if (io.stopped()) io.restart();
    io.run_one_for(std::min<std::chrono::steady_clock::duration>(end - now, std::chrono::milliseconds(50)));
  }
  return true;
}

}  // namespace rdmarpc::fuzz
