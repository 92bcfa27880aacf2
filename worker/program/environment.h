// What a program job's process gets from its worker: torchrun's environment (and Lockstep's),
// its command line, and who it runs as (docs/programs.md).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/path_roots.h"
#include "lockstep/v1/worker.pb.h"
#include "worker/program/supervisor.h"

namespace lockstep::worker {

// A worker's program settings (--programs_root, --program_user).
struct ProgramSettings {
  // Where workdirs and scripts must lie (symbolic links resolved); not restricted() = this
  // worker does not run programs.
  PathRoots root;
  // Who programs run as ("" and no switch: the worker's own user), and that user's home.
  std::string user;
  std::string home;
  ProgramCredentials credentials;
};

// --program_user NAME resolved to ids (getpwnam, getgrouplist). `allow_root`: the worker runs
// as root and may run programs as root (--allow_programs_as_root); otherwise a root worker
// needs a user. INVALID_ARGUMENT naming the flag.
absl::StatusOr<ProgramSettings> ResolveProgramSettings(const std::string& root,
                                                       const std::string& user,
                                                       bool allow_root);

// The worker's own variables a program inherits (the rest, its token included, never reach
// it): PATH, LANG, LANGUAGE, LC_*, TZ, TMPDIR, LD_LIBRARY_PATH, PYTHONPATH, NCCL_*, CUDA_*
// (but CUDA_VISIBLE_DEVICES, which the worker sets). ProgramEnvironment takes a bundle's
// library folder (LOCKSTEP_BUNDLE_LIB, scripts/bundle.sh) out of LD_LIBRARY_PATH.
bool InheritedVariable(const std::string& name);

// The program's environment as "NAME=value", sorted: the inherited variables of `worker_env`,
// HOME, USER and LOGNAME of the program's user, OMP_NUM_THREADS (threads_per_worker, unless
// the spec sets it), the spec's env, then torchrun's variables for this member (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME,
// ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID,
// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE), on GPU
// workers CUDA_VISIBLE_DEVICES (the host's members' GPUs in local-rank order), and
// LOCKSTEP_JOB_ID, LOCKSTEP_GENERATION, LOCKSTEP_WORKER plus `extra` (Lockstep's own).
std::vector<std::string> ProgramEnvironment(const v1::Assignment& assignment,
                                            const std::map<std::string, std::string>& worker_env,
                                            const ProgramSettings& settings,
                                            const std::string& worker_name,
                                            const std::string& master_addr, int master_port,
                                            const std::map<std::string, std::string>& extra = {});

// Whether ProgramEnvironment's value for `name` may differ between generations of one job on
// one worker (ranks, sizes, MASTER_*, the restart count, the generation, the GPUs, the
// lockstep.torch endpoint): what a warm interpreter learns only when its generation starts.
bool PerGenerationVariable(const std::string& name);

// The spec's argv, with "--local_rank=N" appended when local_rank_arg asks for it.
std::vector<std::string> ProgramArgv(const v1::Assignment& assignment);

// The process's own environment as a map.
std::map<std::string, std::string> CurrentEnvironment();

}  // namespace lockstep::worker
