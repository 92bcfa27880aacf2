// The process's resident memory, now and at its peak.
#pragma once

#include <cstdint>

namespace lockstep {

struct ProcessMemory {
  int64_t current_bytes = 0;  // resident set now (/proc/self/statm)
  int64_t peak_bytes = 0;     // largest resident set so far (getrusage)
};
ProcessMemory ReadProcessMemory();

}  // namespace lockstep
