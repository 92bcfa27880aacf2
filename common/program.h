// Program jobs (JobSpec.program): what the coordinator and the workers agree on. The
// coordinator validates a program spec and places it on workers that run programs; such a
// worker starts the program once per generation with torchrun's environment
// (worker/program/).
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

// The capability a worker started with --programs_root registers (RegisterRequest).
inline constexpr char kProgramCapability[] = "program";

// ProgramSpec bounds and defaults (docs/programs.md).
inline constexpr int64_t kDefaultStopGraceMs = 5000;
inline constexpr int64_t kMaxStopGraceMs = 600000;
inline constexpr int kMaxProgramArgs = 256;
inline constexpr int kMaxProgramEnv = 256;
inline constexpr size_t kMaxProgramEnvValueBytes = 32 << 10;
inline constexpr int kMaxFatalExitCodes = 64;

// The variables the worker sets itself (torchrun's and Lockstep's): a spec may not set them.
// True for RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES,
// and every TORCHELASTIC_* and LOCKSTEP_* name.
bool IsReservedProgramVariable(const std::string& name);

}  // namespace lockstep
