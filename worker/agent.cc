// Worker agent. The session thread reads coordinator messages; a heartbeat thread and the job
// threads write through Send(), which serializes writes on the stream.
#include "worker/agent.h"

#include <cstdio>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "common/job_memory.h"
#include "common/grpc_status.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/device.h"
#include "worker/train/dataset.h"
#include "worker/train/trainer.h"
#ifdef LOCKSTEP_HAVE_CUDA
#include "kernels/gpu_check.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/train/gpu_step.h"
#endif

namespace lockstep::worker {
namespace {

// Lets the trainer plan with 90% of the memory free now (the rest covers what the estimate
// leaves out: the CUDA and NCCL runtimes' own buffers, allocator slack) and says so when its
// share goes through in micro-batches (gradient accumulation).
void SetMemoryBudget(Trainer& trainer, const v1::JobSpec& spec, const v1::Assignment& a,
                     int64_t free_bytes) {
  trainer.set_memory_budget(free_bytes / 10 * 9);
  const int64_t share = ShareSamples(spec, a.world_size());
  if (!spec.deterministic() && trainer.micro_batch() < share) {
    LOG(INFO) << a.job_id() << " generation " << a.generation() << ": micro-batches of "
              << trainer.micro_batch() << " samples with gradient accumulation ("
              << (spec.micro_batch_size() > 0
                      ? std::string("micro_batch_size")
                      : absl::StrCat("the share of ", share, " would need about ",
                                     HumanBytes(EstimateWorkerMemory(spec, share).total()), ", ",
                                     HumanBytes(free_bytes), " is free"))
              << ")";
  }
}

}  // namespace

Agent::Agent(AgentOptions options)
    : options_(std::move(options)),
      incarnation_(std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32)) {
  channel_ = MakeChannel(options_.coordinator,
                         {options_.token, absl::StrCat("lockstep-worker ", options_.name)});
  store_stub_ = v1::StoreService::NewStub(channel_);
}

Agent::~Agent() {
  Stop();
  ReapJobs(/*wait=*/true);
}

void Agent::Stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(session_mu_);
  if (context_ != nullptr) context_->TryCancel();
}

absl::Status Agent::Run() {
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Time last_session = absl::Now();  // start of the outage we are in
  WriteStatus("connecting", options_.coordinator);
  while (!stop_) {
    const absl::Time started = absl::Now();
    bool registered = false;
    absl::Status status = RunSession(&registered);
    AbortJobs("", 0, "session with the coordinator ended");
    ReapJobs(/*wait=*/false);
    if (stop_) break;
    if (registered) last_session = absl::Now();
    if (absl::IsUnauthenticated(status)) {
      const std::string why = absl::StrCat("coordinator ", options_.coordinator,
                                           " rejected this worker: ", status.message());
      WriteStatus("rejected", why);
      return absl::UnauthenticatedError(why);
    }
    if (options_.give_up_after > absl::ZeroDuration() &&
        absl::Now() - last_session >= options_.give_up_after) {
      const std::string why = absl::StrCat("no session with coordinator ", options_.coordinator,
                                           " for ", absl::FormatDuration(options_.give_up_after),
                                           " (--give_up_after); last error: ", StatusLine(status));
      WriteStatus("unreachable", why);
      return absl::UnavailableError(why);
    }
    // A session that lasted a while was healthy: start the backoff over.
    if (absl::Now() - started > absl::Seconds(10)) backoff = absl::Milliseconds(100);
    WriteStatus("connecting", absl::StrCat(options_.coordinator, ": ", StatusLine(status)));
    LOG(WARNING) << "session with coordinator " << options_.coordinator
                 << " ended: " << StatusLine(status) << "; reconnecting in "
                 << absl::FormatDuration(backoff);
    const absl::Time until = absl::Now() + backoff;
    while (!stop_ && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  WriteStatus("stopped", "");
  return absl::OkStatus();
}

void Agent::WriteStatus(const std::string& state, const std::string& detail) {
  if (options_.status_file.empty()) return;
  const std::string tmp = options_.status_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << state << (detail.empty() ? "" : " ") << detail << "\n";
    if (!out) return;  // best effort: a health check then sees the previous state
  }
  std::rename(tmp.c_str(), options_.status_file.c_str());
}

absl::Status Agent::RunSession(bool* registered) {
  auto stub = v1::WorkerService::NewStub(channel_);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream =
      stub->Session(&context);
  {
    std::lock_guard<std::mutex> lock(session_mu_);
    if (stop_) return absl::CancelledError("stopping");
    context_ = &context;
  }
  v1::WorkerMessage hello;
  v1::RegisterRequest* reg = hello.mutable_register_();
  reg->set_name(options_.name);
  reg->set_host(options_.host);
  reg->set_device(options_.device);
  reg->set_free_memory_bytes(options_.free_memory_bytes);
  reg->set_total_memory_bytes(options_.total_memory_bytes);
  reg->set_device_name(options_.device_name);
  reg->add_capabilities("gloo");
  reg->set_incarnation(incarnation_);
  reg->set_comm_address(options_.comm_address);

  absl::Status result;
  v1::CoordinatorMessage message;
  if (!stream->Write(hello) || !stream->Read(&message) || !message.has_registered()) {
    result = ToAbslStatus(stream->Finish());
    if (result.ok()) result = absl::UnavailableError("coordinator closed the session");
    std::lock_guard<std::mutex> lock(session_mu_);
    context_ = nullptr;
    return result;
  }
  const std::string worker_id = message.registered().worker_id();
  *registered = true;
  WriteStatus("registered", absl::StrCat("as ", worker_id, " with ", options_.coordinator));
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, message.registered().heartbeat_interval_ms()));
  LOG(INFO) << "registered with " << options_.coordinator << " as " << worker_id << " ("
            << options_.name << ", " << options_.device << ")";
  {
    std::lock_guard<std::mutex> lock(session_mu_);
    stream_ = stream.get();
  }

  std::atomic<bool> session_over{false};
  std::thread heartbeats([&] {
    v1::WorkerMessage beat;
    beat.mutable_heartbeat();
    while (!session_over) {
      Send(beat);
      const absl::Time until = absl::Now() + interval;
      while (!session_over && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    }
  });

  while (stream->Read(&message)) {
    switch (message.kind_case()) {
      case v1::CoordinatorMessage::kAssignment:
        StartJob(message.assignment());
        break;
      case v1::CoordinatorMessage::kAbort:
        AbortJobs(message.abort().job_id(), message.abort().generation(), message.abort().reason());
        break;
      default:
        LOG(WARNING) << "ignoring unexpected coordinator message " << message.kind_case();
    }
    ReapJobs(/*wait=*/false);
  }
  session_over = true;
  heartbeats.join();
  {
    std::lock_guard<std::mutex> lock(session_mu_);
    stream_ = nullptr;
    context_ = nullptr;
  }
  result = ToAbslStatus(stream->Finish());
  if (result.ok()) result = absl::UnavailableError("coordinator ended the session");
  return result;
}

void Agent::Send(const v1::WorkerMessage& message) {
  std::lock_guard<std::mutex> lock(session_mu_);
  if (stream_ != nullptr) stream_->Write(message);
}

void Agent::StartJob(const v1::Assignment& assignment) {
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    for (const auto& run : jobs_) {
      if (run->assignment.job_id() == assignment.job_id() &&
          run->assignment.generation() >= assignment.generation()) {
        LOG(WARNING) << "ignoring assignment to " << assignment.job_id() << " generation "
                     << assignment.generation() << ": generation " << run->assignment.generation()
                     << " was already assigned";
        return;
      }
    }
  }
  // One job at a time: a new assignment supersedes whatever ran before.
  AbortJobs("", 0, "superseded by a new assignment");
  auto run = std::make_shared<JobRun>();
  run->assignment = assignment;
  LOG(INFO) << "assigned " << assignment.job_id() << " generation " << assignment.generation()
            << " rank " << assignment.rank() << "/" << assignment.world_size() << " ("
            << absl::StrJoin(assignment.member_names(), ", ") << ")";
  std::lock_guard<std::mutex> lock(jobs_mu_);
  for (auto it = jobs_.rbegin(); it != jobs_.rend(); ++it) {
    if ((*it)->assignment.job_id() == assignment.job_id()) {
      run->previous = *it;
      break;
    }
  }
  run->thread = std::thread([this, run] { RunJob(run); });
  jobs_.push_back(run);
}

void Agent::AbortJobs(const std::string& job_id, int64_t generation, const std::string& reason) {
  std::lock_guard<std::mutex> lock(jobs_mu_);
  for (auto& run : jobs_) {
    const v1::Assignment& a = run->assignment;
    const bool match = job_id.empty() || (a.job_id() == job_id && a.generation() == generation);
    if (match && !run->done && !run->abort.exchange(true)) {
      LOG(INFO) << "aborting " << a.job_id() << " generation " << a.generation() << ": " << reason;
      std::lock_guard<std::mutex> comm_lock(run->comm_mu);
      if (run->comm != nullptr) run->comm->Abort();
      if (run->device_abort) run->device_abort();
    }
  }
}

void Agent::ReapJobs(bool wait) {
  std::vector<std::shared_ptr<JobRun>> finished;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (wait || (*it)->done) {
        finished.push_back(*it);
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& run : finished) {
    if (run->thread.joinable()) run->thread.join();
  }
}

void Agent::RunJob(std::shared_ptr<JobRun> run) {
  const v1::Assignment& a = run->assignment;
  // The previous generation's thread stops promptly once aborted (a blocked Gloo operation
  // only at its collective timeout); its state is handed over through retained_.
  if (run->previous != nullptr) {
    run->previous->finished.WaitForNotification();
    run->previous.reset();
  }
  std::unique_ptr<Trainer> trainer;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    if (retained_job_ == a.job_id()) trainer = std::move(retained_);
    retained_.reset();
    retained_job_.clear();
  }
  bool fatal = false;
  absl::Status status = TrainGeneration(*run, trainer, &fatal);
  if (!status.ok()) {
    if (run->abort) {
      LOG(INFO) << a.job_id() << " generation " << a.generation() << " stopped: " << status;
    } else {
      LOG(WARNING) << a.job_id() << " generation " << a.generation() << " failed: " << status;
      v1::WorkerMessage m;
      v1::FailureReport* f = m.mutable_failure();
      f->set_job_id(a.job_id());
      f->set_generation(a.generation());
      f->set_message(std::string(status.message()));
      f->set_fatal(fatal);
      if (trainer != nullptr) f->set_step(trainer->completed_step());
      Send(m);
    }
    if (!fatal && trainer != nullptr) {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      retained_job_ = a.job_id();
      retained_ = std::move(trainer);
    }
  }
  run->done = true;
  run->finished.Notify();
}

absl::Status Agent::TrainGeneration(JobRun& run, std::unique_ptr<Trainer>& trainer, bool* fatal) {
  const v1::Assignment& a = run.assignment;
  const v1::JobSpec& spec = a.spec();
  kernels::SetBlasThreads(std::max(1, spec.threads_per_worker()));
  std::shared_ptr<const Dataset> data;
  if (trainer == nullptr) {
    absl::StatusOr<std::shared_ptr<const Dataset>> loaded = LoadDataset(spec.dataset());
    if (!loaded.ok()) {
      *fatal = true;
      const std::string where = spec.dataset().type() == "synthetic"
                                    ? std::string("synthetic data set")
                                    : absl::StrCat("data set at ", spec.dataset().path());
      return absl::Status(loaded.status().code(),
                          absl::StrCat("loading ", where, ": ", loaded.status().message()));
    }
    data = *std::move(loaded);
  }

  CoordinatorStore store(store_stub_, a.job_id(), a.generation(),
                         std::chrono::milliseconds(spec.collective_timeout_ms()));
  const auto collective_timeout = std::chrono::milliseconds(spec.collective_timeout_ms());
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> gloo = GlooCommunicator::Create(
      a.rank(), a.world_size(), store, options_.comm_address, collective_timeout);
  if (!gloo.ok()) return gloo.status();

  if (trainer == nullptr) {
    absl::StatusOr<std::unique_ptr<Trainer>> created = Trainer::Create(spec, data, gloo->get());
    if (!created.ok()) {
      *fatal = true;
      return created.status();
    }
    trainer = *std::move(created);
  }
  trainer->set_communicator(gloo->get());
  // Ranks on one host sum gradients through shared memory; Gloo stays underneath.
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      options_.shared_memory_collectives
          ? ShmCommunicator::Wrap(*std::move(gloo), trainer->largest_collective_bytes(),
                                  collective_timeout)
          : absl::StatusOr<std::unique_ptr<Communicator>>(*std::move(gloo));
  if (!comm.ok()) return comm.status();
  trainer->set_communicator(comm->get());
  {
    std::lock_guard<std::mutex> lock(run.comm_mu);
    run.comm = comm->get();
    if (run.abort) run.comm->Abort();
  }
  struct ClearComm {
    JobRun* run;
    ~ClearComm() {
      std::lock_guard<std::mutex> lock(run->comm_mu);
      run->comm = nullptr;
    }
  } clear_comm{&run};

  if (options_.cuda_device < 0) {
    absl::StatusOr<DeviceInfo> host = OpenDevice("cpu");
    // The model is allocated by now, so this counts it twice: a margin, on the safe side.
    if (host.ok()) SetMemoryBudget(*trainer, spec, a, host->free_memory_bytes);
  }

#ifdef LOCKSTEP_HAVE_CUDA
  // GPU workers: the steps run on the GPU with NCCL (formed through the same store, under its
  // own key); Gloo stays for healing, evaluation and the small agreements.
  // Declared in this order so that NCCL is torn down (finalized, or aborted if it failed) before
  // the step frees device memory that its kernels might still use.
  std::unique_ptr<GpuStep> gpu_step;
  std::unique_ptr<NcclCommunicator> nccl;
  if (options_.cuda_device >= 0) {
    // The current device is per host thread: this job thread must select it itself, or its
    // first CUDA call would create a context on GPU 0.
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_device));
    // Measured before this generation allocates anything: the estimate counts it all.
    size_t free_bytes = 0, total_bytes = 0;
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    SetMemoryBudget(*trainer, spec, a, static_cast<int64_t>(free_bytes));
    if (a.world_size() > 1) {
      NcclCommunicator::Options nccl_options;
      nccl_options.init_timeout = absl::FromChrono(collective_timeout);
      nccl_options.collective_timeout = absl::FromChrono(collective_timeout);
      nccl_options.cancel = &run.abort;
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> created =
          NcclCommunicator::Create(store, a.rank(), a.world_size(), nccl_options);
      if (!created.ok()) return created.status();
      nccl = *std::move(created);
    }
    absl::StatusOr<std::unique_ptr<GpuStep>> step =
        GpuStep::Create(spec, trainer->model().dims(), trainer->model().activation(), nccl.get());
    if (!step.ok()) return step.status();
    gpu_step = *std::move(step);
    trainer->set_device_step(gpu_step.get());
    std::lock_guard<std::mutex> lock(run.comm_mu);
    NcclCommunicator* raw = nccl.get();
    run.device_abort = [raw] {
      if (raw != nullptr) raw->Abort();
    };
    if (run.abort && raw != nullptr) raw->Abort();
  }
  // Declared after them, so it runs before the step and the communicator go.
  struct ClearDevice {
    JobRun* run;
    std::unique_ptr<Trainer>* trainer;
    ~ClearDevice() {
      if (*trainer != nullptr) (*trainer)->set_device_step(nullptr);
      std::lock_guard<std::mutex> lock(run->comm_mu);
      run->device_abort = nullptr;
    }
  } clear_device{&run, &trainer};
#endif

  absl::StatusOr<Trainer::HealInfo> heal = trainer->Heal();
  if (!heal.ok()) return heal.status();
  if (heal->source_rank >= 0) {
    LOG(INFO) << a.job_id() << " generation " << a.generation() << " resumes after step "
              << heal->resumed_from_step << " (state of rank " << heal->source_rank
              << (heal->from_checkpoint ? ", read from a disk checkpoint" : "") << ", "
              << absl::FormatDuration(heal->took) << ")";
  }

  bool first = true;
  absl::Status trained = trainer->Train(trainer->completed_step() + 1, run.abort,
                                        [&](const v1::ProgressReport& progress) {
                                          v1::WorkerMessage m;
                                          v1::ProgressReport* p = m.mutable_progress();
                                          *p = progress;
                                          p->set_job_id(a.job_id());
                                          p->set_generation(a.generation());
                                          if (first) {
                                            first = false;
                                            p->set_first_of_generation(true);
                                            p->set_resumed_from_step(heal->resumed_from_step);
                                            p->set_heal_source_rank(heal->source_rank);
                                            p->set_heal_ms(absl::ToInt64Milliseconds(heal->took));
                                          }
                                          Send(m);
                                        });
  if (!trained.ok()) {
    // A deterministic-mode range error recurs in any group, and so does a mode this device
    // does not implement: fail the job.
    if (absl::IsOutOfRange(trained) || absl::IsUnimplemented(trained)) *fatal = true;
    return trained;
  }
  if (const Trainer::Timing& t = trainer->timing(); t.steps > 0) {
    const double per_step = 1e3 / static_cast<double>(t.steps);
    LOG(INFO) << absl::StrFormat(
        "%s: %d steps; per step %.2f ms compute, %.2f ms waiting for allreduce, %.2f ms update",
        a.job_id(), t.steps, absl::ToDoubleSeconds(t.compute) * per_step,
        absl::ToDoubleSeconds(t.exposed_comm) * per_step,
        absl::ToDoubleSeconds(t.update) * per_step);
  }

  v1::WorkerMessage m;
  v1::FinishedReport* f = m.mutable_finished();
  if (!spec.skip_evaluation()) {
    absl::StatusOr<v1::EvalResult> eval = trainer->Evaluate();
    if (!eval.ok()) return eval.status();
    *f->mutable_eval() = *eval;
  }
  f->set_job_id(a.job_id());
  f->set_generation(a.generation());
  f->set_step(trainer->completed_step());
  f->set_parameter_checksum(trainer->ParameterChecksum());
  f->set_train_samples_per_second(trainer->TrainSamplesPerSecond());
  LOG(INFO) << a.job_id() << " finished at step " << f->step() << " parameters "
            << f->parameter_checksum()
            << (f->has_eval() ? absl::StrCat(" test accuracy ", f->eval().test_accuracy()) : "");
  Send(m);
  trainer.reset();
  return absl::OkStatus();
}

}  // namespace lockstep::worker
