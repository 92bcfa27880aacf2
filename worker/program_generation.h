// One generation of a program job on this worker (docs/programs.md), phase by phase:
//   Check      the workdir and the script resolve inside --programs_root; the executable exists;
//   Rendezvous rank 0 reserves MASTER_PORT on its communication address and publishes it in
//              the generation's store; the others read it;
//   Agree      the members agree on the newest lockstep.torch checkpoint every one of them can
//              obtain: from its worker's memory (worker/program/checkpoint_memory.h), else from
//              the copy a peer keeps (worker/program/checkpoint_peer.h), fetched now;
//   Launch     the program under its supervisor (worker/program/supervisor.h), with torchrun's
//              environment, as --program_user;
//   Watch      its output (each line to the worker's log with a "[job rank N]:" prefix; the
//              last of standard error kept), its end, and the generation's abort.
// Exit 0 reports Finished. Another end is a failure with a v1::ProgramExit payload: fatal
// (FAILED_PRECONDITION) for an exit code in fatal_exit_codes, otherwise UNAVAILABLE, so the
// coordinator restarts the group. An abort stops the program (SIGTERM, stop_grace_ms, SIGKILL
// of its group) and returns ABORTED once nothing of it is left.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lockstep/v1/program.pb.h"
#include "worker/generation.h"
#include "worker/program/checkpoint_memory.h"
#include "worker/program/checkpoint_peer.h"
#include "worker/program/supervisor.h"
#include "worker/program/warm_start.h"

namespace lockstep::worker {

// A program's reports (lockstep.torch.report) as the coordinator takes them: the first of the
// generation marked, samples per second from the samples per step and the time between them.
class ReportPacer {
 public:
  v1::ProgressReport Next(const v1::Assignment& assignment, const v1::ProgramReportRequest& request,
                          absl::Time now);
  // The step of the previous report (0: none yet).
  int64_t last_step() const { return last_step_; }

 private:
  bool reported_ = false;
  int64_t last_step_ = 0;
  absl::Time last_time_;
};

class ProgramGeneration final : public GenerationRun {
 public:
  ProgramGeneration(const GenerationContext& context, const v1::Assignment& assignment,
                    std::shared_ptr<StoreClient> store, std::shared_ptr<AbortSignal> abort,
                    GenerationReporter* reporter);
  ~ProgramGeneration() override;
  absl::Status Run(std::unique_ptr<Trainer>& trainer) override;

 private:
  // What the watch saw: the main process's end (none when the supervisor said nothing), whether
  // the worker stopped the program, and why when a report came from the wrong GPU.
  struct Watched {
    std::optional<ProcessEnd> end;
    bool stopping = false;
    absl::Status supervisor;
    absl::Status device_error;
  };
  // Check, Rendezvous, the ProgramServer endpoint, and what to launch.
  absl::StatusOr<LaunchSpec> Prepare();
  // Until the supervisor has ended: output to the log and the coordinator, the end, an abort
  // or a report from the wrong GPU (which stop the program).
  // Parks a warm interpreter for the next generation once this one is under way (its first
  // report, or WarmStarts::kParkAfter).
  Watched Watch(SupervisedProgram& program, const LaunchSpec& launch);
  // The generation's status from what the watch saw (see the file comment).
  absl::Status Outcome(Watched watched, const std::string& executable);
  v1::ProgramExit ExitRecord(const std::optional<ProcessEnd>& end, std::string summary) const;
  // A lockstep.torch report (on a gRPC thread).
  absl::Status OnReport(const v1::ProgramReportRequest& report);
  void Wake() const;
  // The executable's path for execve. NOT_FOUND / PERMISSION_DENIED naming the field.
  absl::StatusOr<std::string> Check() const;
  // A report from a process that computes on another GPU than its own (cuda:LOCAL_RANK):
  // FAILED_PRECONDITION naming both, and what to call.
  absl::Status CheckDevice(const v1::ProgramReportRequest& report) const;
  // MASTER_ADDR and MASTER_PORT of this generation.
  absl::Status Rendezvous(std::string* addr, int* port);
  // The members agree, through the generation's store, on the newest checkpoint step every one
  // of them holds in its worker's memory (restore_; none: a fresh start), and each discards
  // what it holds after it (another history's saves are never restored later).
  absl::Status AgreeOnCheckpoint();
  // lockstep.torch.Checkpointer's calls (on a gRPC thread).
  absl::StatusOr<v1::CheckpointSlotsResponse> OnCheckpointSlots(int64_t bytes);
  absl::StatusOr<v1::CheckpointRestoreResponse> OnCheckpointRestore(
      const v1::CheckpointRestoreRequest& request);
  // The copies of this member's saves to its checkpoint peer (Assignment.checkpoint_peer), and
  // to the job's checkpoint_dir (ProgramSpec.persist_every_saves).
  void StartCopies();
  // Reads the agreed step from the job's checkpoint_dir into this worker's slots.
  absl::Status RestoreDiskStep(int64_t step);
  std::string Name() const;

  const GenerationContext& context_;
  const v1::Assignment& assignment_;
  const std::shared_ptr<StoreClient> store_;
  const std::shared_ptr<AbortSignal> abort_;
  GenerationReporter* const reporter_;

  int wake_[2] = {-1, -1};  // the watch's wake-up pipe
  std::string err_kept_;    // the end of the program's stderr
  // The checkpoint this member restores (set before the program starts), how long the
  // agreement took, and whether its restore was reported.
  std::optional<HeldCheckpoint> restore_;
  std::string restore_source_ = "memory";  // or "peer WORKER"
  // The group's, from rank 0's choice (v1::CheckpointChoice), for the recovery in status.
  std::string restored_from_;
  std::string restore_detail_;
  absl::Duration agreement_time_;
  bool restore_reported_ = false;  // on the ProgramServer's threads (one at a time)
  ReportPacer pacer_;       // reports, on the ProgramServer's threads (one at a time)
  std::atomic<bool> reported_{false};
  absl::Mutex wrong_device_mu_;
  absl::Status wrong_device_ ABSL_GUARDED_BY(wrong_device_mu_);
  // Peers' calls for this generation, and the copies of its saves.
  std::unique_ptr<CheckpointPeerServer::Registration> peer_registration_;
  std::unique_ptr<CheckpointReplicator> replicator_;
  std::unique_ptr<SaveFollower> persister_;
  // Last: destroyed first, it waits for a report in progress.
  std::unique_ptr<ProgramServer::Registration> registration_;
};

// What a program's standard error says in one line: a CUDA out-of-memory error, else a Python
// traceback's last line, else its last non-empty line ("" for none).
std::string SummarizeStderr(const std::string& tail);

}  // namespace lockstep::worker
