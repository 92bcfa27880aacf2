#include "worker/program/environment.h"

#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace lockstep::worker {

absl::StatusOr<ProgramSettings> ResolveProgramSettings(const std::string& root,
                                                       const std::string& user,
                                                       bool allow_root) {
  ProgramSettings settings;
  if (root.empty()) {
    if (!user.empty()) {
      return absl::InvalidArgumentError("--program_user: set --programs_root too (without it "
                                        "this worker runs no programs)");
    }
    return settings;
  }
  absl::StatusOr<PathRoots> roots = PathRoots::Parse(root);
  if (!roots.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--programs_root: ", roots.status().message()));
  }
  if (roots->allows_any_path()) {
    return absl::InvalidArgumentError(
        "--programs_root: \"/\" would let a job run any file of this host; name the "
        "directories that hold the programs");
  }
  settings.root = *std::move(roots);
  const uid_t self = geteuid();
  if (user.empty()) {
    if (self == 0 && !allow_root) {
      return absl::InvalidArgumentError(
          "--program_user: required when the worker runs as root (programs would run as root; "
          "--allow_programs_as_root says that is meant)");
    }
    if (const passwd* pw = getpwuid(self); pw != nullptr) {
      settings.user = pw->pw_name;
      settings.home = pw->pw_dir;
    }
    return settings;
  }
  const passwd* pw = getpwnam(user.c_str());
  if (pw == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--program_user: no user \"", user, "\" on this host"));
  }
  if (pw->pw_uid == 0 && !allow_root) {
    return absl::InvalidArgumentError(
        "--program_user: root; programs run as root only with --allow_programs_as_root");
  }
  settings.user = pw->pw_name;
  settings.home = pw->pw_dir;
  if (pw->pw_uid != self) {
    if (self != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--program_user: this worker runs as uid ", self, " and cannot run programs as ",
          user, " (uid ", pw->pw_uid, "); start it as root, or as ", user));
    }
    settings.credentials.switch_user = true;
    settings.credentials.uid = pw->pw_uid;
    settings.credentials.gid = pw->pw_gid;
    int count = 64;
    std::vector<gid_t> groups(count);
    while (getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &count) < 0) {
      groups.resize(count);
    }
    groups.resize(count);
    settings.credentials.groups = std::move(groups);
  }
  return settings;
}

bool InheritedVariable(const std::string& name) {
  for (const char* exact : {"PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH",
                            "PYTHONPATH"}) {
    if (name == exact) return true;
  }
  if (name == "CUDA_VISIBLE_DEVICES") return false;
  return absl::StartsWith(name, "LC_") || absl::StartsWith(name, "NCCL_") ||
         absl::StartsWith(name, "CUDA_");
}

bool PerGenerationVariable(const std::string& name) {
  for (const char* varies :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "LOCKSTEP_GENERATION", "CUDA_VISIBLE_DEVICES", "LOCKSTEP_AGENT_ADDRESS",
        "LOCKSTEP_AGENT_TOKEN"}) {
    if (name == varies) return true;
  }
  return false;
}

std::map<std::string, std::string> CurrentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return env;
}

std::vector<std::string> ProgramEnvironment(const v1::Assignment& a,
                                            const std::map<std::string, std::string>& worker_env,
                                            const ProgramSettings& settings,
                                            const std::string& worker_name,
                                            const std::string& master_addr, int master_port,
                                            const std::map<std::string, std::string>& extra) {
  const v1::JobSpec& spec = a.spec();
  std::map<std::string, std::string> env;
  for (const auto& [name, value] : worker_env) {
    if (InheritedVariable(name)) env[name] = value;
  }
  // A worker run from a bundle (scripts/bundle.sh) finds its libraries through
  // LD_LIBRARY_PATH, which its launcher points at them: a program (Python, PyTorch) must load
  // its own, the host's (an older libstdc++ of the bundle's build host loaded first fails
  // them), so the launcher's folder is taken out again.
  if (const auto bundle = worker_env.find("LOCKSTEP_BUNDLE_LIB");
      bundle != worker_env.end() && env.count("LD_LIBRARY_PATH") != 0) {
    std::vector<std::string> kept;
    for (absl::string_view dir : absl::StrSplit(env["LD_LIBRARY_PATH"], ':')) {
      if (dir != bundle->second) kept.emplace_back(dir);
    }
    if (kept.empty()) {
      env.erase("LD_LIBRARY_PATH");
    } else {
      env["LD_LIBRARY_PATH"] = absl::StrJoin(kept, ":");
    }
  }
  if (env.count("PATH") == 0) env["PATH"] = "/usr/local/bin:/usr/bin:/bin";
  if (!settings.home.empty()) env["HOME"] = settings.home;
  if (!settings.user.empty()) {
    env["USER"] = settings.user;
    env["LOGNAME"] = settings.user;
  }
  env["OMP_NUM_THREADS"] = absl::StrCat(std::max(1, spec.threads_per_worker()));
  for (const auto& [name, value] : spec.program().env()) env[name] = value;
  const int max_restarts = spec.has_max_restarts() ? spec.max_restarts() : 10;
  const std::pair<const char*, std::string> torchrun[] = {
      {"RANK", absl::StrCat(a.rank())},
      {"WORLD_SIZE", absl::StrCat(a.world_size())},
      {"LOCAL_RANK", absl::StrCat(a.local_rank())},
      {"LOCAL_WORLD_SIZE", absl::StrCat(std::max(1, a.local_world_size()))},
      {"GROUP_RANK", absl::StrCat(a.host_rank())},
      {"GROUP_WORLD_SIZE", absl::StrCat(std::max(1, a.host_count()))},
      {"ROLE_NAME", "default"},
      {"ROLE_RANK", absl::StrCat(a.rank())},
      {"ROLE_WORLD_SIZE", absl::StrCat(a.world_size())},
      {"MASTER_ADDR", master_addr},
      {"MASTER_PORT", absl::StrCat(master_port)},
      {"TORCHELASTIC_RUN_ID", a.job_id()},
      {"TORCHELASTIC_RESTART_COUNT", absl::StrCat(a.restart_count())},
      {"TORCHELASTIC_MAX_RESTARTS", absl::StrCat(max_restarts)},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"LOCKSTEP_JOB_ID", a.job_id()},
      {"LOCKSTEP_GENERATION", absl::StrCat(a.generation())},
      {"LOCKSTEP_WORKER", worker_name},
  };
  for (const auto& [name, value] : torchrun) env[name] = value;
  if (!a.local_device_uuids().empty()) {
    env["CUDA_VISIBLE_DEVICES"] = absl::StrJoin(a.local_device_uuids(), ",");
  }
  for (const auto& [name, value] : extra) env[name] = value;
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [name, value] : env) out.push_back(absl::StrCat(name, "=", value));
  return out;
}

std::vector<std::string> ProgramArgv(const v1::Assignment& a) {
  const v1::ProgramSpec& program = a.spec().program();
  std::vector<std::string> argv(program.argv().begin(), program.argv().end());
  if (!program.local_rank_arg().empty()) {
    argv.push_back(absl::StrCat(program.local_rank_arg(), "=", a.local_rank()));
  }
  return argv;
}

}  // namespace lockstep::worker
