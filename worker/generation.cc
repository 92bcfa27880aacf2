#include "worker/generation.h"

#include <algorithm>
#include <new>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_memory.h"
#include "common/process_memory.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/data/dataset.h"
#include "worker/program_generation.h"

namespace lockstep::worker {
namespace {

// An error that fails the job whatever its code was: a data set that cannot be loaded, a
// trainer that cannot be built for the spec. The message stays; the code becomes a fatal one.
absl::Status Final(const absl::Status& status) {
  if (status.ok() || IsFatal(status)) return status;
  return absl::FailedPreconditionError(status.message());
}

// Ends the metrics of a run when the generation ends, however it ends.
struct EndMetrics {
  WorkerMetrics* metrics;
  Trainer* trainer;
  const AbortSignal* abort;
  ~EndMetrics() {
    if (metrics == nullptr) return;
    trainer->set_step_observer(nullptr);
    metrics->EndRun(abort->raised());
  }
};

}  // namespace

bool IsFatal(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kResourceExhausted:
      return true;
    default:
      return false;
  }
}

std::unique_ptr<GenerationRun> MakeGeneration(const GenerationContext& context,
                                              const v1::Assignment& assignment,
                                              std::shared_ptr<StoreClient> store,
                                              std::shared_ptr<AbortSignal> abort,
                                              GenerationReporter* reporter) {
  if (assignment.spec().has_program()) {
    return std::make_unique<ProgramGeneration>(context, assignment, std::move(store),
                                               std::move(abort), reporter);
  }
  return std::make_unique<Generation>(context, assignment, std::move(store), std::move(abort),
                                      reporter);
}

Generation::Generation(const GenerationContext& context, const v1::Assignment& assignment,
                       std::shared_ptr<StoreClient> store, std::shared_ptr<AbortSignal> abort,
                       GenerationReporter* reporter)
    : context_(context),
      assignment_(assignment),
      spec_(assignment.spec()),
      store_(std::move(store)),
      abort_(std::move(abort)),
      reporter_(reporter) {}

std::string Generation::Name() const {
  return absl::StrCat(assignment_.job_id(), " generation ", assignment_.generation());
}

absl::Status Generation::Run(std::unique_ptr<Trainer>& trainer) {
  try {
    // No more BLAS threads than this host has cores, whatever the spec asks.
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    kernels::SetBlasThreads(std::clamp(spec_.threads_per_worker(), 1, cores));
    const absl::Time started = context_.clock->Now();
    LOCKSTEP_RETURN_IF_ERROR(Prepare(trainer));
    LOCKSTEP_RETURN_IF_ERROR(Connect(trainer));
    VLOG(1) << Name() << ": prepared and connected in "
            << absl::FormatDuration(context_.clock->Now() - started);
    LOCKSTEP_RETURN_IF_ERROR(Heal(*trainer));
    EndMetrics end_metrics{context_.metrics, trainer.get(), abort_.get()};
    LOCKSTEP_RETURN_IF_ERROR(Train(*trainer));
    return Finish(*trainer);
  } catch (const std::bad_alloc&) {
    // A job that needs more memory than this worker can get fails with that reason; the
    // worker lives on and takes the next job. What was built for it is dropped (the device's
    // attachment first: the trainer's engine may hold its group until End).
    device_.reset();
    trainer.reset();
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory: worker ", context_.worker_name, " could not allocate what ",
        assignment_.job_id(), " needs (peak resident ", HumanBytes(ReadProcessMemory().peak_bytes),
        "); give it a smaller model, data set or micro_batch_size, or a bigger worker"));
  }
}

absl::Status Generation::Prepare(const std::unique_ptr<Trainer>& trainer) {
  // The spec's paths, on this host: inside the directories this worker allows, even through
  // symbolic links (the coordinator checked them by name only).
  for (const auto& [field, path, roots] :
       {std::tuple<const char*, const std::string&, const PathRoots&>{
            "dataset.path", spec_.dataset().path(), context_.data_roots},
        {"dataset.validation_path", spec_.dataset().validation_path(), context_.data_roots},
        {"checkpoint_dir", spec_.checkpoint_dir(), context_.checkpoint_roots},
        {"output_dir", spec_.output_dir(), context_.checkpoint_roots}}) {
    if (absl::Status s = roots.CheckOnHost(field, path); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", context_.worker_name, ": ", s.message()));
    }
  }
  if (const std::string& init = spec_.init_from_checkpoint().path(); !init.empty()) {
    const absl::Status in_checkpoints =
        context_.checkpoint_roots.CheckOnHost("init_from_checkpoint.path", init);
    if (!in_checkpoints.ok() &&
        !context_.data_roots.CheckOnHost("init_from_checkpoint.path", init).ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", context_.worker_name, ": ", in_checkpoints.message()));
    }
  }
  if (trainer != nullptr) return absl::OkStatus();  // the state it holds has its data
  test_hooks::Reach("before_loading", -1, &abort_->job_ended());
  absl::StatusOr<std::shared_ptr<const Dataset>> loaded =
      LoadDataset(spec_.dataset(), &abort_->job_ended());
  if (!loaded.ok() && abort_->job_ended().load()) {
    return absl::CancelledError("the job ended while its data set was loading");
  }
  if (!loaded.ok()) {
    // A data set this worker cannot load fails the job: another group would read the same.
    const std::string where = spec_.dataset().type() == "synthetic"
                                  ? std::string("synthetic data set")
                                  : absl::StrCat("data set at ", spec_.dataset().path());
    return Final(absl::Status(loaded.status().code(),
                              absl::StrCat("loading ", where, ": ", loaded.status().message())));
  }
  data_ = *std::move(loaded);
  return absl::OkStatus();
}

absl::Status Generation::Connect(std::unique_ptr<Trainer>& trainer) {
  const v1::Assignment& a = assignment_;
  const auto collective_timeout = std::chrono::milliseconds(spec_.collective_timeout_ms());
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> gloo =
      GlooCommunicator::Create(a.rank(), a.world_size(), store_, context_.comm_address,
                               collective_timeout, abort_);
  if (!gloo.ok()) return gloo.status();
  if (trainer == nullptr) {
    absl::StatusOr<std::unique_ptr<Trainer>> created =
        Trainer::Create(a.job_id(), spec_, data_, gloo->get());
    if (!created.ok()) return Final(created.status());
    trainer = *std::move(created);
  }
  trainer->set_communicator(gloo->get());
  // Ranks on one host sum gradients through shared memory; Gloo stays underneath.
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      context_.shared_memory_collectives
          ? ShmCommunicator::Wrap(*std::move(gloo), trainer->largest_collective_bytes(),
                                  collective_timeout, abort_)
          : absl::StatusOr<std::unique_ptr<Communicator>>(*std::move(gloo));
  if (!comm.ok()) return comm.status();
  communicator_ = *std::move(comm);
  trainer->set_communicator(communicator_.get());
  absl::StatusOr<std::unique_ptr<DeviceAttachment>> attached =
      context_.device->Attach(a, *trainer, *store_, abort_);
  if (!attached.ok()) return attached.status();
  device_ = *std::move(attached);
  trainer->set_device_group(device_->group());
  return absl::OkStatus();
}

absl::Status Generation::Heal(Trainer& trainer) {
  const v1::Assignment& a = assignment_;
  std::vector<std::string> members(a.member_names().begin(), a.member_names().end());
  absl::StatusOr<Trainer::HealInfo> heal = trainer.Heal(members);
  if (!heal.ok()) return heal.status();
  if (heal->source_rank >= 0) {
    LOG(INFO) << Name() << " resumes after step " << heal->resumed_from_step
              << " (state of rank " << heal->source_rank
              << (heal->from_checkpoint ? ", read from a disk checkpoint" : "") << ", "
              << absl::FormatDuration(heal->took) << ")";
  }
  v1::ResumedReport resumed;
  resumed.set_resumed_from_step(heal->resumed_from_step);
  resumed.set_source_rank(heal->source_rank);
  resumed.set_heal_ms(absl::ToInt64Milliseconds(heal->took));
  resumed.set_from_checkpoint(heal->from_checkpoint);
  reporter_->Resumed(resumed);
  return absl::OkStatus();
}

absl::Status Generation::Train(Trainer& trainer) {
  const v1::Assignment& a = assignment_;
  WorkerMetrics* const metrics = context_.metrics;
  if (metrics != nullptr) {
    metrics->BeginRun(a.job_id(), a.rank(), a.world_size(), trainer.ReducedBytesPerStep());
    trainer.set_step_observer([metrics](const StepResult& r) { metrics->ObserveStep(r); });
  }
  bool first = true;
  absl::Status trained = trainer.Train(
      trainer.completed_step() + 1, abort_->flag(),
      [&](const v1::ProgressReport& progress) {
        v1::ProgressReport p = progress;
        p.set_job_id(a.job_id());
        p.set_generation(a.generation());
        p.set_first_of_generation(first);
        first = false;
        if (metrics != nullptr) metrics->ObserveProgress(progress);
        reporter_->Progress(p);
      },
      [&](const v1::CheckpointReport& checkpoint) {
        v1::CheckpointReport c = checkpoint;
        c.set_job_id(a.job_id());
        c.set_generation(a.generation());
        reporter_->Checkpoint(c);
      });
  if (!trained.ok()) return trained;
  if (const Trainer::Timing& t = trainer.timing(); t.steps > 0) {
    const double per_step = 1e3 / static_cast<double>(t.steps);
    LOG(INFO) << absl::StrFormat(
        "%s: %d steps; per step %.2f ms compute, %.2f ms waiting for allreduce, %.2f ms update",
        a.job_id(), t.steps, absl::ToDoubleSeconds(t.compute) * per_step,
        absl::ToDoubleSeconds(t.exposed_comm) * per_step,
        absl::ToDoubleSeconds(t.update) * per_step);
  }
  return absl::OkStatus();
}

absl::Status Generation::Finish(Trainer& trainer) {
  const v1::Assignment& a = assignment_;
  v1::FinishedReport f;
  if (!spec_.skip_evaluation()) {
    test_hooks::Reach("before_evaluation", -1, &abort_->flag());
    if (abort_->raised()) return absl::AbortedError("aborted before the evaluation");
    absl::StatusOr<v1::EvalResult> eval = trainer.Evaluate();
    if (!eval.ok()) return eval.status();
    *f.mutable_eval() = *eval;
  }
  // Rank 0 writes what the job asked for beyond the parameters: a sample of the language
  // model's text, and the export. Neither fails the job: the trained state is what matters, and
  // its checksum is reported either way.
  if (a.rank() == 0 && spec_.sample().max_tokens() > 0) {
    test_hooks::Reach("before_sample", -1, &abort_->flag());
    if (abort_->raised()) return absl::AbortedError("aborted before the sample");
    absl::StatusOr<v1::Sample> sample = trainer.GenerateSample();
    if (sample.ok()) {
      *f.mutable_sample() = *std::move(sample);
    } else {
      f.set_sample_error(std::string(sample.status().message()));
      LOG(WARNING) << a.job_id() << ": no sample: " << sample.status();
    }
  }
  if (a.rank() == 0 && !spec_.output_dir().empty()) {
    absl::StatusOr<std::string> exported = trainer.Export();
    if (exported.ok()) {
      f.set_export_path(*exported);
      LOG(INFO) << a.job_id() << ": wrote " << *exported;
    } else {
      f.set_export_error(std::string(exported.status().message()));
      LOG(WARNING) << a.job_id() << ": export failed: " << exported.status();
    }
  }
  f.set_job_id(a.job_id());
  f.set_generation(a.generation());
  f.set_step(trainer.completed_step());
  f.set_parameter_checksum(trainer.ParameterChecksum());
  f.set_train_samples_per_second(trainer.TrainSamplesPerSecond());
  f.set_train_tokens_per_second(trainer.TrainTokensPerSecond());
  LOG(INFO) << a.job_id() << " finished at step " << f.step() << " parameters "
            << f.parameter_checksum()
            << (f.has_eval() ? absl::StrCat(" held-out loss ", f.eval().test_loss(), " accuracy ",
                                            f.eval().test_accuracy())
                             : "");
  reporter_->Finished(f);
  return absl::OkStatus();
}

}  // namespace lockstep::worker
