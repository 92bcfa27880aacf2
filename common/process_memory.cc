#include "common/process_memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

namespace lockstep {

ProcessMemory ReadProcessMemory() {
  ProcessMemory memory;
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  memory.peak_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  std::ifstream statm("/proc/self/statm");  // total and resident size, in pages
  int64_t size = 0, resident = 0;
  if (statm >> size >> resident) memory.current_bytes = resident * sysconf(_SC_PAGESIZE);
  return memory;
}

}  // namespace lockstep
