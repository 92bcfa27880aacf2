// The worker daemon's session with the coordinator: registers, sends heartbeats, receives
// assignments and aborts, and reconnects as soon as the coordinator serves again. What to do
// with each message is decided by the pure WorkerLifecycle (worker/lifecycle.h); the agent
// carries out its decisions: it runs each generation on a thread of its own, raises a run's
// abort signal, moves the job's state between runs, and sends reports.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/path_roots.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"
#include "worker/comm/abort_signal.h"
#include "worker/device/backend.h"
#include "worker/generation.h"
#include "worker/lifecycle.h"
#include "worker/metrics.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {

struct AgentOptions {
  // host:port, or several comma-separated (coordinators on etcd, one leading): the worker
  // registers with the one that leads, following the leader a standby names.
  std::string coordinator;
  std::string name;
  std::string host;
  // The worker's device (--device, opened): registered with the coordinator, and what each
  // generation budgets on and attaches to (worker/device/backend.h). Required.
  std::shared_ptr<DeviceBackend> device;
  std::string comm_address;  // where peers reach this worker's collectives
  // Shared token sent on every call; empty sends none.
  std::string token;
  // TLS to the coordinator (common/tls.h); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_server_name;
  // Longest pause between attempts to register while the coordinator is reachable but refuses
  // (e.g. the old session of this name is not yet known to be gone). An unreachable
  // coordinator is retried as fast as gRPC reconnects (every 250 ms at most).
  absl::Duration max_backoff = absl::Seconds(1);
  // Run() returns UNAVAILABLE once the coordinator has been unreachable this long (zero: retry
  // forever). Lets a service manager see, log and back off a misconfigured address.
  absl::Duration give_up_after = absl::ZeroDuration();
  // Run() returns ALREADY_EXISTS once the coordinator has refused this worker's name this long
  // in a row: the name is held by another live worker, not by this worker's previous session
  // (which the coordinator declares lost within its heartbeat timeout).
  absl::Duration name_conflict_timeout = absl::Seconds(15);
  // If set, the worker's state ("connecting", "registered", "training", "rejected", ...) and
  // its reason are written here on every change: a container health check reads it.
  std::string status_file;
  // Sum gradients through shared memory when every rank of a group is on this host.
  bool shared_memory_collectives = true;
  // Where a job may read data and write checkpoints and outputs, checked on this host before
  // any is opened (symlinks resolved); unrestricted when empty.
  PathRoots data_roots;
  PathRoots checkpoint_roots;
  // How long a new generation waits for the previous run to stop and hand over its state.
  absl::Duration handover_timeout = absl::Seconds(10);
  // How long a group that has trained a step trains on with no coordinator (lifecycle rule 6).
  absl::Duration keep_training_for = absl::Seconds(60);
  // Program jobs: where their files must lie and who they run as (--programs_root,
  // --program_user); a worker without a root runs none.
  ProgramSettings programs;
  ProgramServer* program_server = nullptr;           // not owned
  WarmStarts* warm_starts = nullptr;                 // not owned; null: programs always start cold
  CheckpointMemory* checkpoint_memory = nullptr;     // not owned; null: no Checkpointer saves
  CheckpointPeerServer* checkpoint_peers = nullptr;  // not owned; null: no copies to peers
  absl::Duration checkpoint_copy_interval = absl::Milliseconds(500);
  // Prometheus metrics of the runs (not owned; null: none).
  WorkerMetrics* metrics = nullptr;
};

// Run() is called by one thread; Stop() may be called from any thread (e.g. a signal watcher).
// Threads: the session thread (Run) reads the coordinator's messages; a heartbeat thread; one
// thread per run. All of them decide through lifecycle_ under mu_; the gRPC writes happen under
// session_mu_, never under mu_.
class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();

  // Connects, serves sessions and reconnects until Stop() (then OK). Returns early with
  // UNAUTHENTICATED when the coordinator rejects the token (retrying cannot help), or with
  // UNAVAILABLE after `give_up_after` without a session, or with ALREADY_EXISTS when another
  // live worker holds the name (name_conflict_timeout).
  absl::Status Run();
  void Stop();

 private:
  // One generation of one job, trained on its own thread.
  struct RunHandle {
    RunId id = 0;
    v1::Assignment assignment;
    // Shared with whatever may outlive the thread (an abandoned Gloo call's store client).
    std::shared_ptr<AbortSignal> abort = std::make_shared<AbortSignal>();
    // The job's state, handed back by the thread when it ends (under mu_).
    std::unique_ptr<Trainer> state;
    std::thread thread;
    // The last step its group completed (its progress reports), and whether it has reported
    // one: a run that trains goes on without the coordinator (lifecycle rule 6).
    std::atomic<int64_t> step{0};
    std::atomic<bool> trains{false};
  };

  // Feeds one event to the lifecycle (fn(lifecycle, now) -> LifecycleActions) and carries out
  // the decision: under mu_ for the runs and the kept state, then the reports and the
  // destruction of dropped state after unlocking.
  template <typename Fn>
  void Decide(Fn&& fn) ABSL_LOCKS_EXCLUDED(mu_, session_mu_);
  void Apply(LifecycleActions& actions, std::vector<v1::WorkerMessage>* sends,
             std::vector<std::unique_ptr<Trainer>>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Serves one session; returns why it ended. Sets *registered once the coordinator took us.
  absl::Status RunSession(bool* registered) ABSL_LOCKS_EXCLUDED(mu_, session_mu_);
  // Writes options_.status_file (if set): "STATE detail".
  void WriteStatus(const std::string& state, const std::string& detail);
  // A program job ended (the coordinator said so): its saves in memory and any interpreter
  // parked for it go.
  void ForgetProgramJob(const std::string& job_id);
  // Thread-safe; drops the message when no session is open.
  void Send(const v1::WorkerMessage& message) ABSL_LOCKS_EXCLUDED(session_mu_);
  // The body of a run's thread: runs its Generation (worker/generation.h).
  void RunJob(RunHandle* run, std::unique_ptr<Trainer> state) ABSL_LOCKS_EXCLUDED(mu_);
  // Joins the threads of runs that ended.
  void JoinEnded() ABSL_LOCKS_EXCLUDED(mu_);

  // A run's reports: the heal through the lifecycle, the rest to the coordinator.
  class RunReporter;

  const AgentOptions options_;
  // What every generation of this worker uses (the options' roots, device and metrics).
  GenerationContext generation_context_;
  const uint64_t incarnation_;
  // The coordinators (AgentOptions::coordinator, and any leader a standby named), a channel
  // each, and the one sessions go to now: Run's thread alone changes them.
  void UseCoordinator(const std::string& address) ABSL_LOCKS_EXCLUDED(session_key_mu_);
  void NextCoordinator();
  std::vector<std::string> coordinators_;
  size_t configured_coordinators_ = 1;  // the first ones: AgentOptions::coordinator's
  size_t named_by_ = 0;                 // the configured coordinator that named the leader in use
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
  std::string coordinator_;
  std::shared_ptr<grpc::Channel> channel_;
  // The leader the last session's coordinator named (a standby's answer), or empty.
  std::string leader_named_;
  // The latest leader's term this worker registered under (Registered.term).
  int64_t term_ = 0;
  // The current session's key (Registered.session_key) and the store of its coordinator, for
  // the store calls of its runs.
  absl::Mutex session_key_mu_;
  std::string session_key_ ABSL_GUARDED_BY(session_key_mu_);
  std::shared_ptr<v1::StoreService::StubInterface> store_stub_ ABSL_GUARDED_BY(session_key_mu_);

  std::atomic<bool> stop_{false};
  absl::Mutex session_mu_ ABSL_ACQUIRED_AFTER(mu_);  // the stream and writes to it
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream_
      ABSL_GUARDED_BY(session_mu_) = nullptr;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(session_mu_) = nullptr;
  // Failure and finished reports of runs that ended with no session (a group that trained on
  // without the coordinator): sent first on the next session, so that a coordinator never
  // keeps a generation whose run has ended. The newest few.
  std::deque<v1::WorkerMessage> unsent_ ABSL_GUARDED_BY(session_mu_);

  absl::Mutex mu_;
  WorkerLifecycle lifecycle_ ABSL_GUARDED_BY(mu_);
  std::map<RunId, std::unique_ptr<RunHandle>> runs_ ABSL_GUARDED_BY(mu_);
  // The state kept between runs of one job (lifecycle_.kept() says whose).
  std::unique_ptr<Trainer> kept_ ABSL_GUARDED_BY(mu_);
  // A suspended job's state, set aside while other jobs run (lifecycle_.parked() says whose).
  // On a GPU worker it stays in the GPU's memory.
  std::unique_ptr<Trainer> parked_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> ended_ ABSL_GUARDED_BY(mu_);  // threads of ended runs, to join
};

}  // namespace lockstep::worker
