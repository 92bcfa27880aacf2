#include "common/program.h"

#include "absl/strings/match.h"

namespace lockstep {

bool IsReservedProgramVariable(const std::string& name) {
  for (const char* reserved :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES"}) {
    if (name == reserved) return true;
  }
  return absl::StartsWith(name, "TORCHELASTIC_") || absl::StartsWith(name, "LOCKSTEP_");
}

}  // namespace lockstep
