// The worker daemon's session with the coordinator: registers, sends heartbeats, receives
// assignments and aborts, runs each assignment on a job thread, and reconnects with backoff
// whenever the session breaks.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"
#include "worker/comm/communicator.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {

struct AgentOptions {
  std::string coordinator;  // host:port
  std::string name;
  std::string host;
  std::string device = "cpu";
  // N for --device=cuda:N (already selected by the caller), -1 for CPU workers.
  int cuda_device = -1;
  std::string comm_address;  // where peers reach this worker's collectives
  int64_t free_memory_bytes = 0;
  int64_t total_memory_bytes = 0;
  std::string device_name;  // "NVIDIA H200", or "cpu"
  // Shared token sent on every call; empty sends none.
  std::string token;
  absl::Duration max_backoff = absl::Seconds(5);
  // Run() returns UNAVAILABLE once the coordinator has been unreachable this long (zero: retry
  // forever). Lets a service manager see, log and back off a misconfigured address.
  absl::Duration give_up_after = absl::ZeroDuration();
  // If set, the worker's state ("connecting", "registered", "training", "rejected", ...) and
  // its reason are written here on every change: a container health check reads it.
  std::string status_file;
  // Sum gradients through shared memory when every rank of a group is on this host.
  bool shared_memory_collectives = true;
};

// Run() is called by one thread; Stop() may be called from any thread (e.g. a signal watcher).
class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();

  // Connects, serves sessions and reconnects until Stop() (then OK). Returns early with
  // UNAUTHENTICATED when the coordinator rejects the token (retrying cannot help), or with
  // UNAVAILABLE after `give_up_after` without a session.
  absl::Status Run();
  void Stop();

 private:
  // One training assignment, owned by its job thread and the agent together. Buffers live as
  // long as either holds it, so an abandoned thread never touches freed memory.
  struct JobRun {
    v1::Assignment assignment;
    std::atomic<bool> abort{false};
    std::atomic<bool> done{false};
    std::thread thread;
    // The run of the previous generation of the same job, if any: this run starts only once
    // that one has stopped and handed over its state.
    std::shared_ptr<JobRun> previous;
    absl::Notification finished;
    // The generation's communicator while it exists, so an abort can interrupt collectives;
    // GPU workers also get their NCCL communicator aborted through device_abort.
    std::mutex comm_mu;
    Communicator* comm = nullptr;
    std::function<void()> device_abort;
  };

  // Serves one session; returns why it ended. Sets *registered once the coordinator took us.
  absl::Status RunSession(bool* registered);
  // Writes options_.status_file (if set): "STATE detail".
  void WriteStatus(const std::string& state, const std::string& detail);
  // Thread-safe; drops the message when no session is open.
  void Send(const v1::WorkerMessage& message);
  void StartJob(const v1::Assignment& assignment);
  void AbortJobs(const std::string& job_id, int64_t generation, const std::string& reason);
  void RunJob(std::shared_ptr<JobRun> run);
  // Trains one generation; `trainer` holds the job's state across generations.
  absl::Status TrainGeneration(JobRun& run, std::unique_ptr<Trainer>& trainer, bool* fatal);
  void ReapJobs(bool wait);

  const AgentOptions options_;
  const uint64_t incarnation_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::StoreService::StubInterface> store_stub_;

  std::atomic<bool> stop_{false};
  std::mutex session_mu_;  // guards stream_, context_ and writes to the stream
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream_ = nullptr;
  grpc::ClientContext* context_ = nullptr;

  std::mutex jobs_mu_;
  std::vector<std::shared_ptr<JobRun>> jobs_;  // current and abandoned job threads
  // State kept after an aborted generation (parameters, optimizer, step) so the next
  // generation of the same job heals from memory. At most one job's state is kept.
  std::string retained_job_;
  std::unique_ptr<Trainer> retained_;
};

}  // namespace lockstep::worker
