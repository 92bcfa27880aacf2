// The coordinator's pure state machine: worker registry, job queue, gang scheduling,
// generations, failure detection and job states. No threads, sockets or clock reads: every
// input carries `now`, and every decision comes back in a Decisions value with a reason.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_memory.h"
#include "coordinator/core/ranks.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::coordinator {

struct CoreOptions {
  // How often workers must send heartbeats (told to them at registration).
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // Silence after which a worker is declared lost, unless its job sets its own timeout.
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  // Finished workers (lost ones) kept in the registry for display.
  size_t max_lost_workers = 64;
  // Events kept per job; older ones are dropped (the job snapshot stays current).
  size_t max_events_per_job = 5000;
  // Progress events are recorded at most this often per job.
  absl::Duration progress_event_interval = absl::Milliseconds(200);
};

// What the shell must do after an input: messages to push to workers, sessions to close
// (declared dead), generations whose bootstrap keys can be dropped, jobs to persist.
struct Decisions {
  struct Outgoing {
    std::string worker_id;
    v1::CoordinatorMessage message;
  };
  std::vector<Outgoing> messages;
  std::vector<std::string> close_sessions;
  // (job_id, generation) pairs that ended.
  std::vector<std::pair<std::string, int64_t>> ended_generations;
  std::set<std::string> changed_jobs;
};

// Not thread-safe: the shell serializes all calls under one mutex.
class Core {
 public:
  explicit Core(CoreOptions options = {});

  // --- Workers ---
  // A new session registered. Returns the new worker id; ALREADY_EXISTS when a connected worker
  // already uses the name; INVALID_ARGUMENT for an empty name or device.
  absl::StatusOr<std::string> RegisterWorker(const v1::RegisterRequest& request, absl::Time now,
                                             Decisions* out);
  // The worker's session ended (stream closed or broken). Unknown ids are ignored.
  void WorkerDisconnected(const std::string& worker_id, const std::string& reason, absl::Time now,
                          Decisions* out);
  // NOT_FOUND for an unknown or lost worker (its session must end).
  absl::Status Heartbeat(const std::string& worker_id, absl::Time now);
  // Member reports. ABORTED when (job, generation) is not the worker's current assignment:
  // the shell answers with an Abort and the report changes nothing.
  absl::Status ReportProgress(const std::string& worker_id, const v1::ProgressReport& report,
                              absl::Time now, Decisions* out);
  absl::Status ReportFailure(const std::string& worker_id, const v1::FailureReport& report,
                             absl::Time now, Decisions* out);
  absl::Status ReportFinished(const std::string& worker_id, const v1::FinishedReport& report,
                              absl::Time now, Decisions* out);

  // --- Jobs ---
  // Jobs saved by a previous coordinator, before any worker registers. Ended jobs are listed as
  // they were; pending ones queue again in submission order; running ones re-form from the
  // workers that register (RECONFIGURING, with a recovery entry "coordinator restarted" that
  // is not counted against max_restarts): their state heals from the workers' memory, else
  // from the last disk checkpoint, within rendezvous_timeout. New job ids continue after the
  // highest restored one. Returns how many jobs will run again.
  int RestoreJobs(std::vector<v1::Job> jobs, absl::Time now, Decisions* out);
  // INVALID_ARGUMENT naming the field for a bad spec.
  absl::StatusOr<v1::Job> SubmitJob(v1::JobSpec spec, absl::Time now, Decisions* out);
  // NOT_FOUND, or FAILED_PRECONDITION when the job already finished.
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, absl::Time now, Decisions* out);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  std::vector<v1::Job> ListJobs() const;
  std::vector<v1::WorkerInfo> ListWorkers() const;
  // Events of the job with sequence >= from_sequence (older ones may have been dropped).
  absl::StatusOr<std::vector<v1::JobEvent>> EventsSince(const std::string& job_id,
                                                        int64_t from_sequence) const;
  // OK when (job_id, generation) is the job's current, live generation; ABORTED when it is an
  // older one or the job has ended; NOT_FOUND for an unknown job.
  absl::Status CheckGeneration(const std::string& job_id, int64_t generation) const;

  // Timeouts (heartbeat, step, rendezvous) and scheduling. Call periodically.
  void Tick(absl::Time now, Decisions* out);

  static bool IsTerminal(v1::JobState state);

 private:
  enum class WorkerState { kIdle, kBusy, kLost };
  struct Worker {
    v1::RegisterRequest info;
    std::string id;
    uint64_t registration_seq = 0;
    WorkerState state = WorkerState::kIdle;
    absl::Time registered;
    absl::Time last_heartbeat;
    std::string job_id;
    int64_t generation = 0;
  };
  struct MemberState {
    std::string worker_id;
    int64_t step = 0;
    bool finished = false;
    std::string checksum;
    int64_t peak_memory_bytes = 0;
  };
  struct JobRecord {
    v1::Job job;                       // state, reason, spec and the reported metrics
    std::vector<MemberState> members;  // rank order, current generation
    absl::Time submitted;
    absl::Time started = absl::InfinitePast();
    absl::Time last_advance = absl::InfinitePast();
    absl::Time last_progress_event = absl::InfinitePast();
    std::deque<v1::JobEvent> events;
    int64_t next_sequence = 0;
    uint64_t submit_seq = 0;
    // RECONFIGURING: the next generation forms no earlier than this (a grace period after a
    // collective-error report, so the peer that caused it can be detected first).
    absl::Time reform_after = absl::InfinitePast();
    absl::Time reconfigure_since = absl::InfinitePast();
    // Index in job.recovery_history() of the re-formation whose first step is awaited.
    int open_recovery = -1;
    bool first_report_of_generation_seen = false;
    // Estimated peak memory of one worker (EstimateWorkerMemory at MinMicroBatch): workers that
    // report less free memory are never given this job.
    int64_t memory_needed = 0;
  };

  // RESOURCE_EXHAUSTED with the numbers when every registered worker reports less free memory
  // than the estimate.
  absl::Status CheckMemoryFits(const MemoryEstimate& memory, const std::string& device) const;
  Worker* FindWorker(const std::string& worker_id);
  JobRecord* FindJob(const std::string& job_id);
  // The worker's job record when (job, generation) is its current assignment, else ABORTED.
  absl::StatusOr<JobRecord*> MemberJob(const std::string& worker_id, const std::string& job_id,
                                       int64_t generation);
  void Schedule(absl::Time now, Decisions* out);
  void StartGeneration(JobRecord& job, std::vector<std::string> worker_ids, absl::Time now,
                       Decisions* out);
  // A member is gone (`worker_id`), or a member reported a failure (`worker_id` empty: nobody
  // is removed, the culprit is left to its own detection). Aborts the generation and re-forms
  // it from the survivors and spares, or fails the job (fatal failure, max_restarts used up).
  void HandleMemberLoss(JobRecord& job, const std::string& worker_id, const std::string& reason,
                        bool fatal, absl::Time now, Decisions* out);
  // Aborts the current generation's members (they stay reserved for the job) and records a
  // re-formation; the job is RECONFIGURING until TryReform succeeds.
  void BeginReconfiguration(JobRecord& job, const std::string& reason, bool scale_up,
                            absl::Time reform_after, absl::Time now, Decisions* out);
  // Forms the next generation when enough workers are available.
  void TryReform(JobRecord& job, absl::Time now, Decisions* out);
  // Idle workers of `device` ("cpu", "cuda"; empty: any) in registration order; with
  // `memory_needed`, only those that report at least that much free memory (or report none:
  // 0 means unknown).
  std::vector<RankCandidate> IdleWorkers(const std::string& device = "",
                                         int64_t memory_needed = 0) const;
  int64_t MaxRestarts(const JobRecord& job) const;
  // Ends the job: aborts the current generation's members that are still connected, frees them.
  void FinishJob(JobRecord& job, v1::JobState state, const std::string& reason, absl::Time now,
                 Decisions* out);
  // Tells one member to stop the job's current generation.
  void PushAbort(const JobRecord& job, const std::string& worker_id, const std::string& reason,
                 Decisions* out);
  void MarkWorkerLost(Worker& worker, const std::string& reason, absl::Time now, Decisions* out);
  void RefreshMembers(JobRecord& job);
  void AddEvent(JobRecord& job, v1::JobEvent::Kind kind, const std::string& message, absl::Time now,
                Decisions* out);
  void PruneLostWorkers();

  const CoreOptions options_;
  uint64_t next_worker_seq_ = 1;
  uint64_t next_job_seq_ = 1;
  std::map<std::string, Worker> workers_;  // by worker id
  std::map<std::string, JobRecord> jobs_;  // by job id
  std::vector<std::string> pending_;       // FIFO of pending job ids
  std::vector<std::string> order_;         // every job id in submission order
};

}  // namespace lockstep::coordinator
