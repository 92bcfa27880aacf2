// One generation of one job on this worker, phase by phase:
//   Prepare  the spec's paths on this host (inside the worker's roots) and, for a member that
//            holds no state yet, its data set;
//   Connect  the group: Gloo through the generation's store, shared memory when every rank is
//            on this host, and the device's own (DeviceBackend::Attach: the memory budget, the
//            GPU step and NCCL);
//   Heal     the members agree on the state to resume from and take it;
//   Train    the steps, reporting progress and checkpoints;
//   Finish   the evaluation, rank 0's sample and export, and the finished report.
// The generation decides nothing about the session: its reports leave through a
// GenerationReporter (the agent sends them to the coordinator; tests record them), and its
// outcome is a status whose code says, by the one IsFatal rule, whether the job has failed or
// another generation may succeed. Each producer picks its code; nothing reads message text.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/clock.h"
#include "common/path_roots.h"
#include "lockstep/v1/worker.pb.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/store_client.h"
#include "worker/device/backend.h"
#include "worker/metrics.h"
#include "worker/program/environment.h"
#include "worker/program_service.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {

class WarmStarts;        // worker/program/warm_start.h
class CheckpointMemory;      // worker/program/checkpoint_memory.h
class CheckpointPeerServer;  // worker/program/checkpoint_peer.h

// Whether an error ends the job rather than this generation: a new group would meet it again.
// INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED (the spec, its data or its paths),
// FAILED_PRECONDITION (the members hold different data, a checkpoint write failed under
// checkpoint_failure_policy "fail", init_from_checkpoint unreadable, a device that cannot run
// the job), OUT_OF_RANGE (deterministic mode's range), UNIMPLEMENTED (a mode this device lacks),
// RESOURCE_EXHAUSTED (more memory than the worker can get: a CPU worker's bad_alloc, a GPU's
// out-of-memory during the job, which the worker's memory budget should have prevented). The
// rest (ABORTED, CANCELLED, UNAVAILABLE, DEADLINE_EXCEEDED: the group broke; DATA_LOSS: a heal
// failed its checksum; INTERNAL, UNKNOWN) end only the generation. Producers whose errors are
// not the job's map them before they get here: the store client makes its refusals ABORTED or
// UNAVAILABLE, the CUDA backend a device that is busy now UNAVAILABLE.
bool IsFatal(const absl::Status& status);

// Where a generation's reports go. Called on the generation's thread.
class GenerationReporter {
 public:
  virtual ~GenerationReporter() = default;
  // The members took their state (after Heal, before the first step).
  virtual void Resumed(const v1::ResumedReport& report) = 0;
  virtual void Progress(const v1::ProgressReport& report) = 0;
  virtual void Checkpoint(const v1::CheckpointReport& report) = 0;
  // The job's result as this member holds it (the last thing a generation reports).
  virtual void Finished(const v1::FinishedReport& report) = 0;
  // A program's output lines (program jobs; batched, in order).
  virtual void Output(const v1::ProgramOutput& output) {}
};

// What a generation uses of its worker; the pointers are not owned and outlive it.
struct GenerationContext {
  std::string worker_name;
  // Where peers reach this worker's collectives.
  std::string comm_address;
  // Where a job may read data, and write checkpoints and outputs (checked on this host).
  PathRoots data_roots;
  PathRoots checkpoint_roots;
  // Sum gradients through shared memory when every rank of a group is on this host.
  bool shared_memory_collectives = true;
  DeviceBackend* device = nullptr;
  // Program jobs (--programs_root, --program_user): not restricted() = none here; and the
  // service their lockstep.torch reaches (null: none).
  ProgramSettings programs;
  ProgramServer* program_server = nullptr;
  // Interpreters parked ahead of a program job's next generation (null: always cold).
  WarmStarts* warm_starts = nullptr;
  // Where lockstep.torch.Checkpointer's saves live (null: none on this worker).
  CheckpointMemory* checkpoint_memory = nullptr;
  // Where copies of those saves go to and come from peers (null: nowhere).
  CheckpointPeerServer* checkpoint_peers = nullptr;
  // At most one copy to the peer per this interval (--checkpoint_copy_interval).
  absl::Duration checkpoint_copy_interval = absl::Milliseconds(500);
  WorkerMetrics* metrics = nullptr;  // null: none
  Clock* clock = RealClock::Get();
};

// One generation of one job on this worker: the built-in training (Generation, below) or the
// user's own program (ProgramGeneration, worker/program_generation.h). MakeGeneration picks
// the kind from the spec; the agent only runs it.
class GenerationRun {
 public:
  virtual ~GenerationRun() = default;
  // `trainer` holds the job's state across generations (built-in training; a program keeps
  // none). OK once Finished was reported; otherwise a status whose code says, by IsFatal,
  // whether the job has failed, with a v1::ProgramExit payload (kProgramExitPayload) when a
  // program's process failed.
  virtual absl::Status Run(std::unique_ptr<Trainer>& trainer) = 0;
};

// The type URL of the v1::ProgramExit a failed program's status carries.
inline constexpr char kProgramExitPayload[] = "type.googleapis.com/lockstep.v1.ProgramExit";

std::unique_ptr<GenerationRun> MakeGeneration(const GenerationContext& context,
                                              const v1::Assignment& assignment,
                                              std::shared_ptr<StoreClient> store,
                                              std::shared_ptr<AbortSignal> abort,
                                              GenerationReporter* reporter);

class Generation final : public GenerationRun {
 public:
  // `store` is the generation's scope of the bootstrap store; every wait of the generation
  // watches `abort` (store calls, Gloo, shared memory, NCCL; data loading watches its
  // job_ended()).
  Generation(const GenerationContext& context, const v1::Assignment& assignment,
             std::shared_ptr<StoreClient> store, std::shared_ptr<AbortSignal> abort,
             GenerationReporter* reporter);

  // Runs the phases. `trainer` holds the job's state across generations: null for a member
  // that holds none (Prepare loads the data and Connect builds it), and on return whatever
  // this member still holds (null when building it ran out of memory). OK once Finished was
  // reported.
  absl::Status Run(std::unique_ptr<Trainer>& trainer) override;

 private:
  absl::Status Prepare(const std::unique_ptr<Trainer>& trainer);
  absl::Status Connect(std::unique_ptr<Trainer>& trainer);
  absl::Status Heal(Trainer& trainer);
  absl::Status Train(Trainer& trainer);
  absl::Status Finish(Trainer& trainer);
  // The generation's first words in a log line: "JOB generation N".
  std::string Name() const;

  const GenerationContext& context_;
  const v1::Assignment& assignment_;
  const v1::JobSpec& spec_;
  const std::shared_ptr<StoreClient> store_;
  const std::shared_ptr<AbortSignal> abort_;
  GenerationReporter* const reporter_;

  std::shared_ptr<const Dataset> data_;              // Prepare's, for a member without state
  std::unique_ptr<Communicator> communicator_;       // Gloo, or shared memory over it
  std::unique_ptr<DeviceAttachment> device_;         // after communicator_: goes first
};

}  // namespace lockstep::worker
