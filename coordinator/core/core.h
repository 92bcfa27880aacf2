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
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_memory.h"
#include "common/job_state.h"
#include "common/path_roots.h"
#include "coordinator/core/event_history.h"
#include "coordinator/core/ranks.h"
#include "coordinator/core/training_curve.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::coordinator {

struct CoreOptions {
  // Silence after which a worker is declared lost, unless its job sets its own timeout.
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  // Finished workers (lost ones) kept in the registry for display: once there are twice this
  // many, the earliest registered go, down to this many (so a mass disconnect costs one pass
  // over the registry per this many losses, not one per loss).
  size_t max_lost_workers = 64;
  // Events kept per job; older ones are dropped (the job snapshot stays current).
  size_t max_events_per_job = 5000;
  // Progress events are recorded at most this often per job.
  absl::Duration progress_event_interval = absl::Milliseconds(200);
  // Appended to every new job id ("job-7-3fa9c1"), so ids never repeat across coordinator
  // incarnations, even one that lost its state: a worker's kept state, and a checkpoint, belong
  // to exactly one job. The shell passes its cluster's id (kept in --state_dir) or a random one.
  std::string job_id_suffix;
  // How often the shell calls Tick (zero: the core does not watch its own liveness). When no
  // input at all (ticks, heartbeats, reports) arrived for ten intervals (at least a second),
  // the coordinator itself was away (frozen, starved, paused by a debugger): the silence it
  // caused is not held against the workers (their heartbeats and the jobs' step timers are
  // credited), and member losses reported in the two seconds after it (the sessions that broke
  // meanwhile) are recovered without counting against max_restarts.
  absl::Duration tick_interval = absl::ZeroDuration();
  // Where jobs may read data and write checkpoints and outputs (CheckJobPaths); unrestricted
  // when empty.
  PathRoots data_roots;
  PathRoots checkpoint_roots;
  // After a member's fatal report, the job waits this long before it re-forms without the
  // reporter, so the other members' reports of the same error (a data set none of them can
  // load) arrive first and fail the job together (see HandleMemberLoss).
  absl::Duration fatal_report_grace = absl::Seconds(2);
  // After RestoreJobs, a running job waits up to this long for the members of its last
  // generation to register again before it re-forms without them (so one coordinator restart
  // is one re-formation, not one per worker that comes back late). A job whose previous
  // members are all back re-forms at once.
  absl::Duration restart_grace = absl::Seconds(5);
  // A queued job's priority grows by one for each this long it has waited, up to kMaxPriority
  // (zero: never), so that a stream of higher-priority jobs cannot starve it. Only the queue's
  // order ages: preemption goes by the priorities the jobs declared.
  absl::Duration priority_aging = absl::Minutes(5);
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
  // (job_id, generation) pairs that started and ended: the shell opens and closes their
  // bootstrap-store scopes, under its lock, before the decisions' messages can be read.
  struct StartedGeneration {
    std::string job_id;
    int64_t generation = 0;
    int world_size = 0;  // sizes the generation's store scope (ScopeLimits)
  };
  std::vector<StartedGeneration> started_generations;
  std::vector<std::pair<std::string, int64_t>> ended_generations;
  std::set<std::string> changed_jobs;
  // Jobs that succeeded in this decision: once the shell has saved them (changed_jobs), it
  // calls Core::JobEndRecorded for each, which lets their members drop their state.
  std::vector<std::string> ends_to_record;
};

// Folds each Abort that is followed, in the same decisions and with nothing for that worker
// between them, by an Assignment of the same job to the same worker into that assignment
// (Assignment.abort_previous), and drops the separate message. An abort that ends the job
// (job_ended), or one followed by another job's assignment, stays a message of its own. What
// each worker receives, and in which order, is unchanged; a re-formation of N survivors
// becomes N messages instead of 2N. The shell calls it just before queuing a decision's
// messages.
void FoldAbortsIntoAssignments(std::vector<Decisions::Outgoing>& messages);

inline constexpr size_t kMaxWorkerNameBytes = 64;
// A registration's fields: a name of letters, digits and - _ . @ : (at most
// kMaxWorkerNameBytes), and host, device and addresses of at most 255 bytes without control
// bytes. INVALID_ARGUMENT naming the field.
absl::Status ValidateRegistration(const v1::RegisterRequest& request);

// Not thread-safe: the shell serializes all calls under one mutex.
class Core {
 public:
  // Generations kept in a job's timeline (Job.generations): at most this many, and older ones
  // go while the records hold more than kMaxGenerationMembers members in all (so a job of
  // 10,000 workers keeps its last 10 or so, not 256 copies of its member list). The latest
  // two always stay: the next one's joined and left come from them.
  static constexpr int kMaxGenerations = 256;
  static constexpr int kMaxGenerationMembers = 100'000;
  // Member names an assignment carries (for logs and errors; ranks beyond go by number).
  static constexpr size_t kMaxAssignmentNames = 16;
  // ListJobs pages: the default and largest job counts, and the bytes a page stays under.
  static constexpr int kDefaultJobsPerPage = 100;
  static constexpr int kMaxJobsPerPage = 1000;
  // Re-formations one worker (by name) may cost a job's max_restarts: a worker lost more often
  // than this, or left out this often for saying nothing in a generation that failed, is no
  // longer one of the job's members (other jobs still take it), and its further losses are
  // not charged, so one failing or malicious worker cannot use up a job's restarts.
  static constexpr int kMaxChargesPerWorker = 3;
  static constexpr size_t kMaxJobsPageBytes = 4 << 20;
  // A queue listing says what this many queued jobs would preempt (Job.would_preempt).
  static constexpr int kPlannedQueueJobs = 32;

  explicit Core(CoreOptions options = {});

  // --- Workers ---
  // A new session registered. Returns the new worker id; ALREADY_EXISTS when a connected worker
  // already uses the name; INVALID_ARGUMENT for an empty name or device. A worker that keeps
  // state for a live job (RegisterRequest.held), or that was a member of a job this
  // coordinator restored and is re-forming, is kept for that job: no other job gets it until
  // the job re-forms or ends. One that keeps state for a job that has ended, or that this
  // coordinator does not know, is told to drop it (Abort.job_ended).
  absl::StatusOr<std::string> RegisterWorker(const v1::RegisterRequest& request, absl::Time now,
                                             Decisions* out);
  // The worker's session ended (stream closed or broken). Unknown ids are ignored.
  void WorkerDisconnected(const std::string& worker_id, const std::string& reason, absl::Time now,
                          Decisions* out);
  // NOT_FOUND for an unknown or lost worker (its session must end).
  absl::Status Heartbeat(const std::string& worker_id, absl::Time now);
  // A heartbeat that arrived at `at` (the shell collects them between ticks): keeps the
  // worker alive without counting as an input of its own; older than the last one changes
  // nothing, and an unknown or lost worker is ignored.
  void NoteHeartbeat(const std::string& worker_id, absl::Time at);
  // Member reports. ABORTED when (job, generation) is not the worker's current assignment (the
  // generation fence, Fence below): the shell answers with AbortMessage and the report changes
  // nothing.
  absl::Status ReportProgress(const std::string& worker_id, const v1::ProgressReport& report,
                              absl::Time now, Decisions* out);
  absl::Status ReportFailure(const std::string& worker_id, const v1::FailureReport& report,
                             absl::Time now, Decisions* out);
  absl::Status ReportFinished(const std::string& worker_id, const v1::FinishedReport& report,
                              absl::Time now, Decisions* out);
  // The group agreed on its state: records where the open recovery resumed (and closes it at
  // once when no step is left to train).
  absl::Status ReportResumed(const std::string& worker_id, const v1::ResumedReport& report,
                             absl::Time now, Decisions* out);
  // The worker took part in (job, generation) through the shell (a bootstrap-store write):
  // recorded so that, when the generation fails and nobody is known to be at fault, a member
  // that said nothing at all while the others did is the one left out (HandleMemberLoss).
  // Reports count too. Anything but a current member is ignored.
  void NoteMemberActivity(const std::string& worker_id, const std::string& job_id,
                          int64_t generation);
  // Rank 0 wrote (or failed to write) a checkpoint; a failure is an event of the job.
  absl::Status ReportCheckpoint(const std::string& worker_id, const v1::CheckpointReport& report,
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
  // Without `schedule` the job only joins the queue: the next Tick starts it (the shell's
  // submit RPC returns once the job is validated and stored, before the work of starting it).
  absl::StatusOr<v1::Job> SubmitJob(v1::JobSpec spec, absl::Time now, Decisions* out,
                                    bool schedule = true);
  // NOT_FOUND, or FAILED_PRECONDITION when the job already finished.
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, absl::Time now, Decisions* out);
  // A user suspends a pending, running or re-forming job (suspension.cc): its members stop and
  // keep its state in memory while they serve other jobs; it waits for ResumeJob. NOT_FOUND;
  // FAILED_PRECONDITION when it has ended, is already suspended by a user, or has trained its
  // last step (it is finishing).
  absl::StatusOr<v1::Job> SuspendJob(const std::string& job_id, absl::Time now, Decisions* out);
  // Queues a job a user suspended: it resumes from its members' memory when workers free up.
  // NOT_FOUND; FAILED_PRECONDITION when it is not suspended, or was suspended for another job
  // (it resumes by itself).
  absl::StatusOr<v1::Job> ResumeJob(const std::string& job_id, absl::Time now, Decisions* out);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  // A page of jobs, newest first (see ListJobsRequest); INVALID_ARGUMENT for a negative page
  // size or a token this coordinator did not issue.
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request = {}) const;
  std::vector<v1::WorkerInfo> ListWorkers() const;
  // The job's loss and throughput since this coordinator started (TrainingCurve); NOT_FOUND
  // for an unknown job.
  absl::StatusOr<v1::TrainingCurve> GetTrainingCurve(const std::string& job_id) const;
  // How many jobs are in each state (for metrics: no job is copied).
  std::map<v1::JobState, int64_t> JobCounts() const;
  // Events of the job with sequence >= from_sequence (older ones may have been dropped).
  absl::StatusOr<std::vector<v1::JobEvent>> EventsSince(const std::string& job_id,
                                                        int64_t from_sequence) const;
  // The generation fence, the one place that decides whether (job_id, generation) is live: OK
  // when it is the job's current generation and the job is RUNNING, and (with a worker id) the
  // worker is a member of it; ABORTED when it is older, being re-formed or the job has ended
  // (or the worker is the job's, in another generation); PERMISSION_DENIED when the worker is
  // not the job's at all; NOT_FOUND for an unknown job (or an unknown or lost worker).
  absl::Status Fence(const std::string& job_id, int64_t generation,
                     const std::string& worker_id = "") const;

  // The rank and name `worker_id` had in (job_id, generation), by the job's timeline (so also
  // after that generation ended: its last output lines arrive then). NOT_FOUND for an unknown
  // job or a generation no longer in the timeline, PERMISSION_DENIED for a worker that was not
  // one of its members.
  absl::StatusOr<std::pair<int32_t, std::string>> GenerationMember(
      const std::string& job_id, int64_t generation, const std::string& worker_id) const;

  // The message that tells a worker to stop (job, generation), with the reason; `job_ended`
  // lets it drop what it kept for the job; `suspended` that it parks the job's state while it
  // serves other jobs (worker lifecycle rule 7).
  static v1::CoordinatorMessage AbortMessage(const std::string& job_id, int64_t generation,
                                             const std::string& reason, bool job_ended = false,
                                             bool suspended = false);

  // The shell has saved a job that succeeded (Decisions::ends_to_record). Until then its final
  // members keep the trained state in memory and stay the job's (busy), so a coordinator lost
  // before the end was durable finishes the job from their memory instead of training it
  // again; now they are told the job ended (Abort.job_ended) and freed. Unknown jobs and ends
  // already recorded change nothing.
  void JobEndRecorded(const std::string& job_id, absl::Time now, Decisions* out);

  // Timeouts (heartbeat, step, rendezvous) and scheduling. Call periodically.
  void Tick(absl::Time now, Decisions* out);

 private:
  enum class WorkerState { kIdle, kBusy, kLost };
  // A job in the indices by state: (submission number, id).
  using JobKey = std::pair<uint64_t, std::string>;
  // A queued job: (minus its aged priority, submission number, id): the order it starts in.
  using QueueKey = std::tuple<int64_t, uint64_t, std::string>;
  struct Worker {
    v1::RegisterRequest info;
    std::string id;
    uint64_t registration_seq = 0;
    WorkerState state = WorkerState::kIdle;
    absl::Time registered;
    absl::Time last_heartbeat;
    std::string job_id;
    int64_t generation = 0;
    // Idle, but kept for this job (RegisterWorker): it holds the job's state (of step
    // held_step, -1 when unknown) or was a member of the job before the coordinator restarted.
    std::string reserved_for;
    int64_t held_step = -1;
    // The last (job, generation) it took part in (NoteMemberActivity).
    std::string spoke_job;
    int64_t spoke_generation = 0;
  };
  struct MemberState {
    std::string worker_id;
    int64_t step = 0;
    bool finished = false;
    std::string checksum;
    int64_t peak_memory_bytes = 0;
    // The evaluation this member reported with Finished (serialized; every rank reports the
    // same reduced one, so they must be equal byte for byte).
    std::string eval;
    // Its FinishedReport: the job's outcome is taken from the agreeing members' reports (and
    // rank 0's, for what only rank 0 writes) when the job ends, never as a report arrives.
    v1::FinishedReport report;
  };
  struct JobRecord {
    v1::Job job;                       // state, reason, spec and the reported metrics
    std::vector<MemberState> members;  // rank order, current generation
    absl::Time submitted;
    // What a pending job's rendezvous_timeout counts from: the submission, moved on by any
    // time the coordinator itself was away.
    absl::Time pending_since;
    // pending_since + rendezvous_timeout while PENDING (its key in pending_deadlines_), else
    // InfiniteFuture.
    absl::Time pending_deadline = absl::InfiniteFuture();
    // While PENDING: its priority in the queue (the declared one, aged: priority_aging), and
    // when it ages next (its key in aging_deadlines_; InfiniteFuture when it does not).
    int64_t queue_priority = 0;
    absl::Time next_aging = absl::InfiniteFuture();
    absl::Time started = absl::InfinitePast();
    absl::Time last_advance = absl::InfinitePast();
    absl::Time last_progress_event = absl::InfinitePast();
    EventHistory events;
    uint64_t submit_seq = 0;
    // RECONFIGURING: the next generation forms no earlier than this (a grace period after a
    // collective-error report, so the peer that caused it can be detected first).
    absl::Time reform_after = absl::InfinitePast();
    absl::Time reconfigure_since = absl::InfinitePast();
    // Index in job.recovery_history() of the re-formation whose first step is awaited.
    int open_recovery = -1;
    bool first_report_of_generation_seen = false;
    bool resumed_report_seen = false;
    // Estimated peak memory of one worker (EstimateWorkerMemory at MinMicroBatch): workers that
    // report less free memory are never given this job.
    int64_t memory_needed = 0;
    TrainingCurve curve;
    // Restored: the timeline's worker ids are a previous coordinator's (ids start again at w-1
    // in every incarnation), so the next generation's joined and left compare names.
    bool timeline_ids_stale = false;
    // Workers that reported a fatal error for this job: never its members again (this
    // incarnation; a restarted worker has a new id). Their reports, first ones kept, name the
    // reason when nobody is left.
    std::set<std::string> excluded;
    // Names never taken again either (a worker back under its name is a new id), and the
    // re-formations charged to each name (kMaxChargesPerWorker).
    std::set<std::string> excluded_names;
    std::map<std::string, int> charges;
    // Left out for taking no part in a failed generation: not in the re-formation that
    // follows; a spare again once the job has completed a step without it.
    std::set<std::string> benched;
    std::vector<std::string> fatal_reports;
    // RECONFIGURING because of a fatal report: fails when the rest cannot re-form (TryReform).
    bool reforming_after_fatal = false;
    // RECONFIGURING after the last step (AtLastStep): the next generation is formed only of
    // the workers that hold the final state, whatever min_workers says, and trains nothing
    // (it evaluates, and rank 0 writes the sample and the export). Cleared when nobody holding
    // that state is left (the job then recovers like any other, from a checkpoint).
    bool finishing = false;
    // SUCCEEDED, but the shell has not saved it yet (JobEndRecorded): its members keep their
    // state and stay busy.
    bool end_recorded = true;
    // Idle workers kept for this job (Worker::reserved_for).
    std::set<std::string> reserved;
    // Resumed from a suspension: holders it resumed without (by name), told to drop its state
    // once the resumed generation has trained a step (CloseRecovery).
    std::vector<std::string> parked_elsewhere;
    // Restored by a restarted coordinator: the names of its last generation's members, awaited
    // until restart_grace_until (CoreOptions::restart_grace).
    std::vector<std::string> previous_names;
    absl::Time restart_grace_until = absl::InfinitePast();
    // Restored RUNNING: the generation whose group may have trained on without the coordinator
    // (0: none), when the job was restored, and the ids (by rank) of its members back training
    // it. Kept (Adopt) once every member in previous_names is back training it; else the job
    // re-forms as after any restart (GiveUpAdoption).
    int64_t adopt_generation = 0;
    absl::Time restored_at = absl::InfinitePast();
    std::map<int32_t, std::string> adopters;
  };

  // RESOURCE_EXHAUSTED with the numbers when every registered worker reports less free memory
  // than the estimate.
  absl::Status CheckMemoryFits(const MemoryEstimate& memory, const std::string& device) const;
  Worker* FindWorker(const std::string& worker_id);
  JobRecord* FindJob(const std::string& job_id);
  // The job record behind Fence (which says when there is none).
  const JobRecord* FencedJob(const std::string& job_id, int64_t generation,
                             const std::string& worker_id, absl::Status* status) const;
  absl::StatusOr<JobRecord*> MemberJob(const std::string& worker_id, const std::string& job_id,
                                       int64_t generation);
  // Notices that the coordinator itself was away (see CoreOptions::tick_interval) and credits
  // the silence it caused. Called first by every input that carries `now`.
  void ObserveTime(absl::Time now);
  // Whether a member loss at `now` may have been caused by the coordinator's own absence.
  bool CoordinatorWasAway(absl::Time now) const;
  void Schedule(absl::Time now, Decisions* out);
  // The job's state, keeping the indices (pending_, active_, pending_deadlines_) in step.
  void SetState(JobRecord& job, v1::JobState state);
  static JobKey KeyOf(const JobRecord& job) { return {job.submit_seq, job.job.job_id()}; }
  static QueueKey QueueKeyOf(const JobRecord& job) {
    return {-job.queue_priority, job.submit_seq, job.job.job_id()};
  }
  // In the queue (pending_): a pending job, or one suspended for another job.
  static bool Queued(const JobRecord& job) {
    return job.job.state() == v1::JOB_STATE_PENDING ||
           (job.job.state() == v1::JOB_STATE_SUSPENDED && !job.job.suspension().by_user());
  }
  // The head of the queue, or nullptr.
  const JobRecord* QueueHead() const;
  // Suspends a running or re-forming job (suspension.cc): its busy members are aborted as
  // suspended (they park its state) and freed, and listed as its holders; it leaves nothing
  // reserved. Queued unless `by_user`.
  void Suspend(JobRecord& job, const std::string& reason, const std::string& by_job, bool by_user,
               absl::Time now, Decisions* out);
  // A suspended job at the queue's head whose `idle` (holders first) starts with no holder:
  // true (and `why`) when it must wait because its live holders are busy or kept for another
  // job, or, after a coordinator restart, while its holders may still register again (it
  // resumes from one of them, not from nothing, unless none is left to wait for).
  bool WaitsForHolder(const JobRecord& job, const std::vector<RankCandidate>& idle, absl::Time now,
                      std::string* why) const;
  // Whether the candidate is one of the suspended job's holders; holders first (stable).
  bool Holds(const JobRecord& job, const RankCandidate& c) const;
  void HoldersFirst(const JobRecord& job, std::vector<RankCandidate>& idle) const;
  // Starts the suspended job's next generation on `worker_ids`, recorded as a recovery (its
  // first step says what was redone), and stops counting the time suspended.
  void Resume(JobRecord& job, std::vector<std::string> worker_ids, absl::Time now, Decisions* out);
  // A registering worker's parked and kept states, for the suspended jobs' holder lists: a
  // holder back without the job's state leaves the list; one with it joins. A parked state of
  // an ended or unknown job is dropped (Abort.job_ended).
  void NoteHolder(const Worker& worker, absl::Time now, Decisions* out);
  // `name` no longer keeps the state of suspended jobs other than `except` and `keep` (it
  // parks one; `keep` is the job it is taken for, which resumes from its parked state).
  void ForgetHolder(const std::string& name, const std::string& except, const std::string& keep,
                    absl::Time now, Decisions* out);
  // Ages the queued jobs whose next aging is due (priority_aging).
  void AgeQueue(absl::Time now);
  // Preemption for the queued `job`, which has only `idle` (fitting, one rank per GPU) of its
  // min_workers: takes the rest from running jobs of a lower declared priority that have
  // completed a step in their current generation, each shrunk toward its min_workers (an
  // elastic re-formation: nothing lost), lowest priority first, then the newest. The idle
  // workers and those taken are kept for `job` until it starts (the victims' re-formations
  // cannot take them). Only when enough can be taken, GPU sharing counted; else nothing
  // changes and `why` says what shrinking could free.
  // What preempting for `job` would do (PreemptFor carries it out; the queue shows it).
  struct PreemptionPlan {
    struct Victim {
      std::string job_id;
      bool suspend = false;            // suspended whole, else shrunk
      std::vector<std::string> taken;  // worker ids `job` takes from it
    };
    bool enough = false;                      // it frees enough for `job`'s min_workers
    size_t could = 0;                         // when not: how many it could free
    std::vector<Victim> victims;              // when enough: in the order they give
    std::vector<std::string> idle;            // when enough: the idle workers it starts with
    absl::flat_hash_set<std::string> chosen;  // every worker id it starts with
  };
  PreemptionPlan PlanPreemption(const JobRecord& job, const std::vector<RankCandidate>& idle) const;
  // "shrink job-3 (priority 0) by 1, suspend job-5 (priority 0)"; why not when it is not
  // enough; "" when nothing would be preempted.
  std::string DescribePlan(const PreemptionPlan& plan) const;
  void ApplyPreemption(JobRecord& job, const PreemptionPlan& plan, absl::Time now, Decisions* out);
  // A suspended job whose holders are all busy: takes one back from a running job of a lower
  // declared priority at a step boundary (shrunk when above its min_workers, else suspended),
  // kept for `job`. False when no holder can be taken.
  bool FreeHolder(JobRecord& job, absl::Time now, Decisions* out);
  bool PreemptFor(JobRecord& job, const std::vector<RankCandidate>& idle, absl::Time now,
                  Decisions* out, std::string* why);
  // Members of `victim` that `job` could take (device, memory, programs; not excluded), from
  // the highest rank down.
  std::vector<RankCandidate> TakeableMembers(const JobRecord& victim, const JobRecord& job) const;
  // The job as a reader sees it: a queued job that is not the head says what it waits for
  // (computed here, so the head's changing reason costs nothing per queued job).
  v1::Job View(const JobRecord& job) const;
  void StartGeneration(JobRecord& job, std::vector<std::string> worker_ids, absl::Time now,
                       Decisions* out);
  // A member is gone (`worker_id`), or a member reported a failure (`worker_id` empty: nobody
  // is removed, the culprit is left to its own detection). Aborts the generation and re-forms
  // it from the survivors and spares, or fails the job (max_restarts used up). `fatal`: the
  // member `worker_id` reported an error that retrying cannot help; it leaves the job for good
  // (idle, free for other jobs), and the job fails only when no member is left, so a lone
  // report, true or forged, never fails a job for the others.
  // `no_culprit_behind`: the failure is known not to come from a dead peer (a program's process
  // killed from outside, reported by its own live worker), so the job re-forms without the
  // grace ReformAfter gives a dead peer's stream to close.
  void HandleMemberLoss(JobRecord& job, const std::string& worker_id, const std::string& reason,
                        bool fatal, absl::Time now, Decisions* out, bool no_culprit_behind = false);
  // HandleMemberLoss once every other member has completed the last step: finish the job, or
  // re-form the members that hold the final state (a finishing generation).
  void HandleLossAfterLastStep(JobRecord& job, const std::string& worker_id,
                               const std::string& reason, bool fatal, absl::Time now,
                               Decisions* out);
  // Leaves the members that took no part in the failed generation out of the next one (charged
  // to them, not the job). False when there are none; else `why` says who, for the reason.
  bool LeaveOutSilentMembers(JobRecord& job, const std::string& reason, std::string* why,
                             Decisions* out);
  static void EraseMember(JobRecord& job, const std::string& worker_id);
  // When the next generation may form after a loss (a grace after reports, see below).
  absl::Time ReformAfter(const std::string& worker_id, bool fatal, absl::Time now) const;
  // Aborts the current generation's members (they stay reserved for the job) and records a
  // re-formation, `counted` against max_restarts or not; the job is RECONFIGURING until
  // TryReform succeeds.
  void BeginReconfiguration(JobRecord& job, const std::string& reason, bool scale_up,
                            bool coordinator_caused, bool counted, absl::Time reform_after,
                            absl::Time now, Decisions* out);
  // Forms the next generation when enough workers are available.
  void TryReform(JobRecord& job, absl::Time now, Decisions* out);
  // Every member of the current generation but `except` has completed the job's last step
  // (by its own progress, heal or Finished report). From then on the job is never trained
  // again: no scale-up, no step timeout, and a loss re-forms only the members (finishing).
  bool AtLastStep(const JobRecord& job, const std::string& except = "") const;
  // Some member reported the last step (or Finished): spares wait (a forged report only
  // delays a scale-up).
  bool AnyMemberAtLastStep(const JobRecord& job) const;
  // Whether `worker` may never serve `job` again (a fatal report, or too many charges).
  static bool Excluded(const JobRecord& job, const std::string& worker_id, const std::string& name);
  // Charges one re-formation of `job` to `worker` (by name): false once it has had
  // kMaxChargesPerWorker, when it is excluded from the job instead (the job is not charged).
  bool ChargeWorker(JobRecord& job, const Worker& worker);
  // Members of the current generation that took no part in it (NoteMemberActivity) while
  // another member did; empty when nobody did (a stall says nothing about anyone).
  std::vector<std::string> SilentMembers(const JobRecord& job) const;
  // RegisterWorker's part for what the worker keeps: reserve it for a live job, or tell it to
  // drop the state of a job that ended.
  void ReserveOrRelease(Worker& worker, Decisions* out);
  // Frees the workers kept for `job` (Worker::reserved_for); with `job_ended`, those that
  // hold its state are told to drop it.
  void ReleaseReserved(JobRecord& job, bool job_ended, const std::string& reason, Decisions* out);
  // Every previous member of a restored job (previous_names) is registered again.
  bool PreviousMembersBack(const JobRecord& job) const;
  // A group that trained on without the coordinator (adoption.cc). RegisterWorker's part for
  // a worker that says its group trains (RegisterRequest.running): a member of a restored
  // job's awaited generation is noted as back; any other generation is aborted, and a member
  // of the awaited one back without it, or training another, ends the wait.
  void NoteRunning(Worker& worker, absl::Time now, Decisions* out);
  // TryReform's part while a restored job awaits its generation: true when it was kept, or is
  // still awaited (nothing else to do now).
  bool TryAdopt(JobRecord& job, absl::Time now, Decisions* out);
  // The awaited generation is not kept (`why`): its members back training it are aborted, and
  // the job re-forms as after any restart.
  void GiveUpAdoption(JobRecord& job, const std::string& why, absl::Time now, Decisions* out);
  // A member back training the awaited generation reported its run's end (failed, or
  // finished): the generation is not kept; a fatal failure also excludes the reporter from the
  // job. False when the report is not one of those.
  bool AdoptedRunEnded(const std::string& worker_id, const std::string& job_id, int64_t generation,
                       const std::string& what, bool fatal, absl::Time now, Decisions* out);
  // The job as an event records it (JobEvent.job): everything but what grows with its size
  // (spec but its name, members, recoveries, generations, sample; the latest validation only).
  // `job` is only borrowed: it is the same again on return.
  static void SnapshotForEvent(v1::Job& job, v1::Job* snapshot);
  // A job's reason after fatal reports: `last`, then the earlier reports.
  std::string FatalReason(const JobRecord& job, const std::string& last) const;
  // Idle workers of `device` ("cpu", "cuda"; empty: any) in registration order; with
  // `memory_needed`, only those that report at least that much free memory (or report none:
  // 0 means unknown); with `job`, not the workers it excluded; never a worker kept for another
  // job (Worker::reserved_for).
  std::vector<RankCandidate> IdleWorkers(const std::string& device = "", int64_t memory_needed = 0,
                                         const JobRecord* job = nullptr) const;
  // A worker as rank assignment and GPU placement see it.
  static RankCandidate Candidate(const Worker& w);
  // It registered kProgramCapability (--programs_root).
  static bool RunsPrograms(const Worker& w);
  // The current generation's members that still serve the job, in rank order.
  std::vector<RankCandidate> MemberCandidates(const JobRecord& job) const;
  // What a waiting job's reason adds for candidates OneRankPerGpu left out ("" for none).
  static std::string SharedGpuNote(size_t left_out);
  int64_t MaxRestarts(const JobRecord& job) const;
  // Ends the job. SUCCEEDED: the members stay the job's, holding the final state, until
  // JobEndRecorded. Otherwise: aborts the members that are still connected (job_ended), frees
  // them and the workers kept for the job.
  void FinishJob(JobRecord& job, v1::JobState state, const std::string& reason, absl::Time now,
                 Decisions* out);
  // Records the end of the job's current generation in its timeline (job.generations).
  void EndGeneration(JobRecord& job, const std::string& reason, absl::Time now);
  // The members that finished disagree (step, parameter checksum or evaluation): the
  // description for the job's reason; "" when they all agree. `except`: a member to leave out.
  std::string Disagreement(const JobRecord& job, const std::string& except = "") const;
  // Every member that speaks for the result has finished: SUCCEEDED when they agree, else
  // FAILED naming the disagreement. `note` is added to the reason.
  void FinishAgreed(JobRecord& job, const std::string& except, const std::string& note,
                    absl::Time now, Decisions* out);
  // Ends the open recovery: the new generation completed its first step (or has none left).
  void CloseRecovery(JobRecord& job, absl::Time now, const std::string& note, Decisions* out);
  // Tells one member to stop the job's current generation.
  void PushAbort(const JobRecord& job, const std::string& worker_id, const std::string& reason,
                 Decisions* out, bool job_ended = false, bool suspended = false);
  void MarkWorkerLost(Worker& worker, const std::string& reason, absl::Time now, Decisions* out);
  void RefreshMembers(JobRecord& job);
  void AddEvent(JobRecord& job, v1::JobEvent::Kind kind, const std::string& message, absl::Time now,
                Decisions* out);
  void PruneLostWorkers();

  const CoreOptions options_;
  // Liveness of the coordinator itself (tick_interval): the last input, until when member
  // losses are blamed on an absence that just ended, and how long it was.
  absl::Time last_input_ = absl::InfinitePast();
  absl::Time away_grace_until_ = absl::InfinitePast();
  absl::Duration last_absence_;
  uint64_t next_worker_seq_ = 1;
  uint64_t next_job_seq_ = 1;
  std::map<std::string, Worker> workers_;  // by worker id
  // Name -> id of every worker not lost: a name is held by one live worker at a time.
  std::map<std::string, std::string> live_names_;
  size_t lost_workers_ = 0;  // workers_ in kLost
  // Jobs indexed by state, so that submit, cancel and the tick cost what they change, not the
  // number of jobs. Keys are JobKeys: submission order.
  std::map<std::string, JobRecord> jobs_;  // by job id
  std::set<JobKey> order_;                 // every job
  std::set<QueueKey> pending_;             // PENDING: the queue, in the order jobs start
  // Queued jobs by when their priority ages next (JobRecord::next_aging).
  std::set<std::pair<absl::Time, std::string>> aging_deadlines_;
  std::set<JobKey> active_;  // RUNNING or RECONFIGURING
  // PENDING jobs with a rendezvous_timeout, by when it expires (JobRecord::pending_deadline).
  std::set<std::pair<absl::Time, std::string>> pending_deadlines_;
  // SUSPENDED jobs, by id (for the holder lists at registration).
  std::set<std::string> suspended_;
  // Name -> id of a restored job that awaits a member of that name (previous_names).
  std::map<std::string, std::string> awaited_names_;
};

}  // namespace lockstep::coordinator
