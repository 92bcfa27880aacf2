// Warm starts: a Python interpreter started ahead of a program job's next generation, with the
// slow imports done (torch: most of a restart's time), parked until the generation begins.
//
// A restart of a program job's group costs, cold, an interpreter's start and `import torch`
// (about 0.8 s of a 1.4 s restart on two cores). So once a generation is under way (its first
// report, or kParkAfter without one), the worker launches the next generation's process the
// usual way (its supervisor, process group, user, workdir and the job's environment), but as
//   python3 -c <the warm-start program> MODULES
// which imports MODULES and then waits on fd 4 (LaunchSpec::handoff_fd). When the next
// generation starts, the worker writes its argv and whole environment there: the interpreter
// sets os.environ to exactly that, sys.argv and sys.path[0] as the interpreter would for the
// script (or "-m module"), and runs it as __main__.
//
// Only what cannot change between generations is decided at park time: the executable, the
// workdir, the user, and the environment without PerGenerationVariable()s (so whatever
// Python or torch read while starting is the same). A launch that differs in any of these, or
// that is not "python… SCRIPT|-m MODULE [ARGS]", starts cold, as does one with nothing parked.
// A parked interpreter is discarded when the job ends, when another job's launch comes, after
// kIdleLimit unused, and with its worker (it is a supervised program like any other).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/program/supervisor.h"

namespace lockstep::worker {

class WarmStarts {
 public:
  static constexpr absl::Duration kParkAfter = absl::Seconds(2);
  static constexpr absl::Duration kIdleLimit = absl::Minutes(10);

  // `preload`: the modules a parked interpreter imports (none: it only starts Python).
  explicit WarmStarts(std::vector<std::string> preload);
  // Discards what is parked (waits for it to end).
  ~WarmStarts();
  WarmStarts(const WarmStarts&) = delete;
  WarmStarts& operator=(const WarmStarts&) = delete;

  // What a parked interpreter must match to run `launch` (see the file comment); nullopt when
  // `launch` cannot run in one.
  static std::optional<std::string> KeyOf(const LaunchSpec& launch);

  // The interpreter parked for launches like `launch`, now running it; null when none is
  // (then whatever is parked is discarded, and the caller starts `launch` cold).
  std::unique_ptr<SupervisedProgram> Start(const LaunchSpec& launch) ABSL_LOCKS_EXCLUDED(mu_);
  // Parks an interpreter for the next launch like `launch` (of job `job_id`), in the
  // background (replacing what is parked). Does nothing when `launch` cannot run in one.
  void Park(const LaunchSpec& launch, const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Discards what is parked, or being parked, for `job_id`, in the background (the job is
  // over).
  void Discard(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  // How many launches ran warm, for logs and tests.
  int warm_starts() const ABSL_LOCKS_EXCLUDED(mu_);
  // The interpreter parked now (-1: none).
  pid_t parked_pid() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Parked {
    std::string key;
    std::string job_id;
    std::unique_ptr<SupervisedProgram> program;
    int handoff = -1;  // the write end of its fd 4
    absl::Time since;
  };
  // The thread that forks and ends parked interpreters: a supervisor's parent-death signal
  // follows the thread that forked it, so that thread must outlive what it parks.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  static void End(Parked& parked);

  const std::vector<std::string> preload_;
  mutable absl::Mutex mu_;
  std::optional<LaunchSpec> to_park_ ABSL_GUARDED_BY(mu_);
  std::string to_park_job_ ABSL_GUARDED_BY(mu_);
  // The job of the park in progress (Loop), and a count that Start and Discard bump to cancel
  // it: a park that finds it changed ends what it launched.
  std::string parking_job_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Parked> to_end_ ABSL_GUARDED_BY(mu_);
  std::optional<Parked> parked_ ABSL_GUARDED_BY(mu_);
  int warm_starts_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace lockstep::worker
