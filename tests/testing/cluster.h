// A real local cluster for integration tests: one lockstep-coordinator on 127.0.0.1:0 and
// worker processes started with posix_spawn, each with its own log file. Every wait is bounded.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/tls.h"
#include "lockstep/v1/job.grpc.pb.h"

namespace lockstep::testing {

// A child process; killed (SIGKILL) and reaped on destruction if still running.
class Process {
 public:
  // Starts argv[0] with stdout and stderr appended to `log_path`.
  static absl::StatusOr<std::unique_ptr<Process>> Spawn(const std::vector<std::string>& argv,
                                                        const std::string& log_path);
  ~Process();
  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits up to `timeout` for the exit; returns the exit code (128 + signal when killed), or
  // DEADLINE_EXCEEDED.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool running();

 private:
  explicit Process(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  bool reaped_ = false;
  int status_ = 0;
};

// Runs a command to completion with a time limit; returns exit code and combined output.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout,
                                         const std::string& stdin_data = "");

// A small synthetic classification job (MLP 32-64-64-4, batch 120 in 12 micro-shards) that
// trains `steps` steps on between min_workers and max_workers workers.
v1::JobSpec SyntheticJob(int min_workers, int max_workers, int64_t steps);
// SyntheticJob in deterministic mode, so its checksum is the same for any world size and
// failure schedule, with these timeouts (0: the spec's defaults).
v1::JobSpec DeterministicJob(int min_workers, int max_workers, int64_t steps,
                             int64_t heartbeat_timeout_ms = 0, int64_t collective_timeout_ms = 0);

class Cluster {
 public:
  // Starts the coordinator (extra flags appended) and waits until it serves. With a `token`,
  // the coordinator requires it, and the cluster's own stub and StartWorker send it.
  // `client_tls`: the credentials the cluster's own stub uses (a coordinator with TLS).
  // `test_roots`: the coordinator and every worker get TestRootFlags() (before the test's own
  // flags, which override them); without, the daemons' own defaults apply.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(
      const std::vector<std::string>& coordinator_flags = {}, const std::string& token = "",
      const TlsFiles& client_tls = {}, bool test_roots = true);
  // Coordinators on etcd (--state_backend=etcd): `coordinators` of them, started in order
  // (the first leads), each on its own port, all with `coordinator_flags`; workers are given
  // every address. The cluster's own calls follow the leader (FollowLeader).
  static absl::StatusOr<std::unique_ptr<Cluster>> StartOnEtcd(
      const std::string& etcd_endpoints, int coordinators,
      const std::vector<std::string>& coordinator_flags = {});
  // --data_root and --checkpoint_root for tests: the test temporary directory (where they
  // write their data, checkpoints and exports) and the Debian data the examples use.
  static std::vector<std::string> TestRootFlags();
  ~Cluster();

  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  // The file holding the token ("" without one).
  const std::string& token_file() const { return token_file_; }
  v1::JobService::Stub& jobs() { return *jobs_; }

  // Starts lockstep-worker --name=NAME (plus `flags`) and waits until the coordinator lists
  // it as registered (idle, or busy if a running job took it at once). Every worker gets
  // --test_hooks_dir=DIR/hooks/NAME (emptied first) and the cluster's own data cache
  // (--data_cache_dir=DIR/cache, shared by its workers as a host's are).
  // `launcher` runs the worker (e.g. {"/usr/bin/prlimit", "--as=3000000000"}).
  absl::Status StartWorker(const std::string& name, const std::vector<std::string>& flags = {},
                           const std::vector<std::string>& launcher = {});
  // Waits until a worker named `name` is listed in `state` ("idle", "busy", "lost").
  absl::Status WaitForWorker(const std::string& name, const std::string& state,
                             absl::Duration timeout);
  // Kills the coordinator (SIGKILL) and starts a new one on the same port, with the same
  // --state_dir (keep_state) or with that directory wiped first (a coordinator that lost its
  // state, or runs without one).
  absl::Status RestartCoordinator(bool keep_state = true);
  // The flags the coordinator is started with from now on (a restart), after the cluster's own.
  void set_coordinator_flags(std::vector<std::string> flags) {
    coordinator_flags_ = std::move(flags);
  }
  Process* coordinator() { return coordinator_.get(); }
  // Coordinators on etcd: the i-th, its address, and the index of the one that serves now
  // (asked through gRPC's health check, for up to `timeout`; the cluster's calls go there).
  Process* coordinator(int i) { return i == 0 ? coordinator_.get() : standbys_.at(i - 1).get(); }
  const std::string& coordinator_address(int i) const { return addresses_.at(i); }
  absl::StatusOr<int> FollowLeader(absl::Duration timeout);
  absl::Status StartWorkers(int n);  // w0 .. w{n-1}
  // Test hooks (common/test_hooks.h) of a worker started with --test_hooks=...: waits until it
  // holds at `hook`, and lets it go on. The coordinator's (its flag --test_hooks=...) go by the
  // name "coordinator".
  absl::Status WaitForHook(const std::string& worker, const std::string& hook,
                           absl::Duration timeout);
  void ReleaseHook(const std::string& worker, const std::string& hook);
  Process* worker(const std::string& name) { return workers_.at(name).get(); }

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec);
  // Coordinators on etcd: submits to the i-th coordinator itself, whether it leads or not (a
  // standby's answer is returned as it is), within `timeout`.
  absl::StatusOr<v1::Job> SubmitTo(int i, const v1::JobSpec& spec, absl::Duration timeout);
  // The term the i-th coordinator on etcd gives in its answers (kTermMetadataKey; 0 without),
  // asked with ListJobs.
  absl::StatusOr<int64_t> TermOf(int i);
  // Every job the coordinator lists (one page).
  absl::StatusOr<std::vector<v1::Job>> List();
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  // Polls until pred(job) holds (asking again while the coordinator is unavailable, e.g.
  // restarting); DEADLINE_EXCEEDED (with the job's last state) otherwise.
  absl::StatusOr<v1::Job> WaitFor(const std::string& job_id,
                                  const std::function<bool(const v1::Job&)>& pred,
                                  absl::Duration timeout);
  absl::StatusOr<v1::Job> WaitForEnd(const std::string& job_id, absl::Duration timeout);
  // The job's whole event history (it must have ended).
  absl::StatusOr<std::vector<v1::JobEvent>> History(const std::string& job_id);
  absl::StatusOr<std::vector<v1::WorkerInfo>> Workers();

  // The tail of every process log, for failure messages.
  std::string Logs() const;

 private:
  Cluster() = default;
  absl::Status StartCoordinator(const std::string& listen);
  // Starts one more coordinator on etcd (the i-th, i >= 1) and waits until it listens.
  absl::Status StartStandby(int i);
  // The address workers are given: the coordinator's, or every coordinator's on etcd.
  std::string WorkerCoordinatorFlag() const;
  std::vector<std::string> coordinator_flags_;
  std::vector<std::string> addresses_;              // coordinators on etcd, in start order
  std::vector<std::unique_ptr<Process>> standbys_;  // coordinators 1.. on etcd
  ClientAuth client_auth_;
  bool test_roots_ = true;
  std::string dir_;
  std::string token_file_;
  std::string address_;
  std::unique_ptr<Process> coordinator_;
  std::map<std::string, std::unique_ptr<Process>> workers_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

}  // namespace lockstep::testing
