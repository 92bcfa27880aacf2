// The worker's lifecycle rules as a pure object, like the coordinator's core: no threads, no
// sockets, no clock reads. The agent feeds it what happens (assignments and aborts from the
// coordinator, the session ending, its runs healing and ending, time passing) and carries out
// the actions it returns (start or abort a run, keep or drop state, report to the coordinator).
//
// A "run" is one generation of one job on this worker, trained on a thread of its own. The
// "state" is what a run trains (parameters, optimizer state, step): the agent holds at most one
// job's state between runs (the kept state) so that the next generation heals from memory.
//
// Rules (each one a case of tests/unit/lifecycle_test.cc):
//  1. One job at a time: an assignment aborts every other run. A new run starts once no other
//     run is active, or `handover_timeout` after it was assigned, whichever comes first.
//  2. An assignment whose generation is not newer than one already assigned for that job is
//     stale and ignored.
//  3. State is only ever used by the job it belongs to: same job id (unique across coordinator
//     incarnations) and same training fingerprint (JobKey). A run starts with the kept state
//     when the keys match; state of another job is dropped when an assignment arrives.
//  4. A run that ends without a fatal error (finished, aborted, or failed, e.g. a peer died)
//     hands its state on: to the run of the same job that waits for it, else to the kept slot.
//     A finished run's state too: the coordinator may lose the job's end before it is durable
//     (a restart), and then finishes the job from its members' memory. A fatal failure, or an
//     abort saying the job ended (sent once the end is recorded), drops it; so does a newer
//     run of the same job that had to start without it (rule 1's timeout): then it is stale.
//  5. A run's failure is reported to the coordinator unless the run was aborted (the
//     coordinator already knows why it stopped). Its heal result is reported unless aborted.
//  6. The session ending aborts every run whose group has not trained a step yet (forming a
//     group and healing it need the coordinator's store); their state is kept as rule 4 says.
//     A run whose group trains goes on without the coordinator, which is not on the step path
//     (unless the agent is stopping, or the run is a program's: its process uses the
//     coordinator's store through the session): the worker registers again saying so
//     (training()), and the coordinator keeps that generation or aborts it. Without a
//     registration within `keep_training_for` (zero: never kept) the run is aborted: a group
//     cut off from every coordinator does not train on beside the one it may have started
//     elsewhere. A new session is a new registration: the
//     coordinator (perhaps restarted, perhaps from older saved state) may assign a generation
//     number again, so the stale-assignment memory is cleared.
//  7. A suspended job's state is parked, not dropped: once the coordinator has aborted a job
//     saying it is suspended (Abort.suspended), its state, kept or handed on when its run
//     ends, is set aside when another job is assigned (where rules 3 and 4 would drop it), and
//     stays while the worker serves other jobs. One parked state at a time: a newer one
//     replaces it, except that a job assigned again keeps its parked state: it swaps places
//     with a suspended job's kept state, or a run of another suspended job ending meanwhile
//     parks its state once the job's run has taken the parked one. The job's next assignment
//     starts with it (it is no longer suspended); its end drops it, and so does an abort
//     saying it resumed elsewhere.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/job_identity.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::worker {

using RunId = uint64_t;

// How a run ended, as its thread saw it.
struct RunResult {
  enum Kind {
    kFinished,  // trained every step and reported Finished
    kStopped,   // returned because it was aborted
    kFailed,    // failed on its own; another group may succeed (a peer died, a heal failed)
    kFatal,     // failed in a way no group can avoid (the data do not load, a bad spec)
  };
  Kind kind = kStopped;
  // The run still holds consistent state (parameters and optimizer state of one step).
  bool holds_state = false;
  int64_t step = 0;     // the step that state belongs to
  std::string message;  // why it failed
  // A program's process failed (sent with the failure report).
  std::optional<v1::ProgramExit> program_exit;
};

struct LifecycleActions {
  struct Start {
    RunId run = 0;
    v1::Assignment assignment;
    bool with_kept_state = false;    // the run takes the kept state
    bool with_parked_state = false;  // the run takes the parked state (rule 7)
  };
  struct Abort {
    RunId run = 0;
    std::string reason;
    bool job_ended = false;  // the job is over: the run may stop loading its data too
  };
  std::vector<Abort> abort;
  // Applied in this order: drop the kept state, drop the parked state, swap the kept and
  // parked states, park the kept state, keep or park the ended run's state, start runs, park
  // the ended run's state (park_state_after_start_of).
  bool drop_kept_state = false;
  bool drop_parked_state = false;
  bool park_kept_state = false;        // the kept state becomes the parked one (rule 7)
  bool swap_kept_and_parked = false;   // rule 7: the parked state is to be used now
  std::optional<RunId> keep_state_of;  // the run that just ended (its state becomes the kept one)
  std::optional<RunId> park_state_of;  // the run that just ended (its state becomes the parked one)
  // The same, once the runs started (one of them took the parked state): applied last.
  std::optional<RunId> park_state_after_start_of;
  std::vector<Start> start;
  std::vector<v1::WorkerMessage> send;  // failure and heal reports
  std::vector<std::string> log;         // decisions worth a log line (ignored assignments, ...)
};

// Not thread-safe: the agent calls it under its mutex.
class WorkerLifecycle {
 public:
  explicit WorkerLifecycle(absl::Duration handover_timeout = absl::Seconds(10),
                           absl::Duration keep_training_for = absl::Seconds(60))
      : handover_timeout_(handover_timeout), keep_training_for_(keep_training_for) {}

  LifecycleActions OnAssignment(const v1::Assignment& assignment, absl::Time now);
  // The coordinator aborted (job, generation); `job_ended`: the job is over, its state can go;
  // `suspended`: the job is suspended, its state is parked when another job comes (rule 7);
  // `drop_parked`: it resumed elsewhere, what this worker keeps or parks of it can go.
  LifecycleActions OnAbort(const std::string& job_id, int64_t generation, const std::string& reason,
                           bool job_ended, absl::Time now, bool suspended = false,
                           bool drop_parked = false);
  // `keep_training`: runs whose group trains go on (rule 6); false when the agent stops.
  LifecycleActions OnSessionEnded(const std::string& reason, absl::Time now,
                                  bool keep_training = true);
  // The run's group completed a step: it no longer needs the coordinator (rule 6).
  LifecycleActions OnTraining(RunId run, absl::Time now);
  // A new session registered: the coordinator decides about the run that trained on (rule 6).
  LifecycleActions OnRegistered(absl::Time now);
  // The run's group agreed on its state (report: its resumed report, without job and generation).
  LifecycleActions OnHealed(RunId run, const v1::ResumedReport& report, absl::Time now);
  LifecycleActions OnRunEnded(RunId run, const RunResult& result, absl::Time now);
  // Starts runs whose predecessor did not stop within handover_timeout; aborts a run that
  // trained on without a coordinator for keep_training_for (rule 6).
  LifecycleActions Tick(absl::Time now);

  // Introspection for the agent's status and for tests.
  size_t active_runs() const { return runs_.size(); }
  std::optional<JobKey> kept() const { return kept_; }
  std::optional<JobKey> parked() const { return parked_; }
  // The run whose group trains (rule 6), if any: what a new registration reports.
  struct Training {
    RunId run = 0;
    v1::Assignment assignment;
  };
  std::optional<Training> training() const;

 private:
  enum class Phase {
    kWaiting,   // assigned, waiting for the runs before it to stop
    kRunning,   // its thread trains
    kStopping,  // aborted; its thread has not returned yet
  };
  struct Run {
    v1::Assignment assignment;
    JobKey key;
    Phase phase = Phase::kWaiting;
    absl::Time assigned;
    // A newer run of its job started without this run's state (the handover timed out): this
    // run's state, when it ends, is stale.
    bool stale = false;
    bool training = false;  // its group completed a step (OnTraining)
  };

  // Aborts every run but `except` that is not already stopping; forgets waiting ones.
  void AbortOthers(RunId except, const std::string& reason, LifecycleActions* out);
  // A running run is told to stop; one already stopping is told again when the job ended.
  void AbortRun(RunId id, Run& run, const std::string& reason, LifecycleActions* out,
                bool job_ended = false);
  // Starts waiting runs that may start now (nobody else active, or timed out).
  void StartReady(absl::Time now, LifecycleActions* out);
  bool JobEnded(const std::string& job_id) const;
  bool Suspended(const std::string& job_id) const;
  // Rule 7: `key`'s state becomes the parked one (a parked state of another job is dropped).
  void Park(const JobKey& key, LifecycleActions* out);

  const absl::Duration handover_timeout_;
  const absl::Duration keep_training_for_;
  // Since when a run trains on with no session (rule 6); InfiniteFuture while registered.
  absl::Time unregistered_since_ = absl::InfiniteFuture();
  RunId next_run_ = 1;
  std::map<RunId, Run> runs_;
  std::optional<JobKey> kept_;
  std::optional<JobKey> parked_;
  // Highest generation assigned per job, for the stale-assignment rule; and jobs that ended.
  // Both bounded: a worker serves one job at a time, so only recent jobs matter.
  std::map<std::string, int64_t> newest_generation_;
  std::deque<std::string> recent_jobs_;
  std::deque<std::string> ended_jobs_;
  std::deque<std::string> suspended_jobs_;  // aborted as suspended, not assigned since
};

}  // namespace lockstep::worker
