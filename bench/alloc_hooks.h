// Heap allocations made by the whole process (malloc family, so operator new
// too), counted by bench/alloc_hooks.cc when it is linked in.
#pragma once

#include <cstdint>

namespace rdmarpc::bench {

uint64_t AllocCount();
// Prints the stack of the next `n` allocations to stderr (0: stop).
void TraceNextAllocs(int n);
// Loads what backtrace() needs now, so tracing later allocates nothing extra.
void WarmAllocTracing();

}  // namespace rdmarpc::bench
