// Worker agent: session I/O and threads. Every decision about runs and state is the
// lifecycle's (worker/lifecycle.h); this file only carries them out.
#include "worker/agent.h"

#include <algorithm>
#include <new>
#include <random>
#include <system_error>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "common/process_memory.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/store_client.h"
#include "worker/device.h"
#include "common/test_hooks.h"
#include "worker/train/dataset.h"
#ifdef LOCKSTEP_HAVE_CUDA
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/train/gpu_step.h"
#endif

namespace lockstep::worker {
namespace {

// How long one wait for the channel to (re)connect lasts; gRPC itself retries connecting
// every 250 ms at most (MakeChannel), so a coordinator that serves again is found within that.
constexpr absl::Duration kConnectWait = absl::Milliseconds(250);

// Lets the trainer plan with 90% of the memory free now (the rest covers what the estimate
// leaves out: the CUDA and NCCL runtimes' own buffers, allocator slack) and says so when its
// share goes through in micro-batches (gradient accumulation).
// `margin_percent` of the free memory is left out of the budget: what the estimate does not
// count (the allocator's rounding and fragmentation; on a CPU worker, everything else on the
// host). A GPU's estimate counts the device buffers itself (MemoryEstimate::device).
void SetMemoryBudget(Trainer& trainer, const v1::JobSpec& spec, const v1::Assignment& a,
                     int64_t free_bytes, int margin_percent) {
  trainer.set_memory_budget(free_bytes / 100 * (100 - margin_percent));
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
      incarnation_(std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32)),
      lifecycle_(options_.handover_timeout) {
  channel_ = MakeChannel(options_.coordinator,
                         {options_.token, absl::StrCat("lockstep-worker ", options_.name),
                          options_.credentials, options_.tls_server_name});
  store_stub_ = v1::StoreService::NewStub(channel_);
}

Agent::~Agent() {
  Stop();
  Decide([](WorkerLifecycle& l, absl::Time now) { return l.OnSessionEnded("stopping", now); });
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::map<RunId, std::unique_ptr<RunHandle>>* runs) { return runs->empty(); },
        &runs_));
  }
  JoinEnded();
}

void Agent::Stop() {
  stop_ = true;
  absl::MutexLock lock(&session_mu_);
  if (context_ != nullptr) context_->TryCancel();
}

template <typename Fn>
void Agent::Decide(Fn&& fn) {
  std::vector<v1::WorkerMessage> sends;
  std::vector<std::unique_ptr<Trainer>> dropped;
  {
    absl::MutexLock lock(&mu_);
    LifecycleActions actions = fn(lifecycle_, absl::Now());
    Apply(actions, &sends, &dropped);
  }
  for (const v1::WorkerMessage& m : sends) Send(m);
  dropped.clear();  // a large model's state is freed outside the lock
}

void Agent::Apply(LifecycleActions& actions, std::vector<v1::WorkerMessage>* sends,
                  std::vector<std::unique_ptr<Trainer>>* dropped) {
  for (const std::string& line : actions.log) LOG(INFO) << line;
  for (const LifecycleActions::Abort& a : actions.abort) {
    auto it = runs_.find(a.run);
    if (it == runs_.end()) continue;
    LOG(INFO) << "aborting " << it->second->assignment.job_id() << " generation "
              << it->second->assignment.generation() << ": " << a.reason;
    // Wakes every wait of the run at once: store calls, Gloo, shared memory, NCCL (and, when
    // the job is over, its data loading).
    if (a.job_ended) {
      it->second->abort->RaiseJobEnded();
    } else {
      it->second->abort->Raise();
    }
  }
  if (actions.drop_kept_state && kept_ != nullptr) dropped->push_back(std::move(kept_));
  if (actions.keep_state_of.has_value()) {
    auto it = runs_.find(*actions.keep_state_of);
    if (it != runs_.end()) kept_ = std::move(it->second->state);
  }
  for (LifecycleActions::Start& start : actions.start) {
    auto run = std::make_unique<RunHandle>();
    run->id = start.run;
    run->assignment = std::move(start.assignment);
    std::unique_ptr<Trainer> state;
    if (start.with_kept_state) state = std::move(kept_);
    const v1::Assignment& a = run->assignment;
    LOG(INFO) << "assigned " << a.job_id() << " generation " << a.generation() << " rank "
              << a.rank() << "/" << a.world_size() << " ("
              << absl::StrJoin(a.member_names(), ", ")
              << (a.member_names_size() < a.world_size()
                      ? absl::StrCat(", ... ", a.world_size(), " members")
                      : std::string())
              << ")"
              << (state != nullptr ? absl::StrCat(", with its state of step ",
                                                  state->completed_step())
                                   : std::string());
    RunHandle* raw = run.get();
    try {
      run->thread = std::thread([this, raw, s = std::move(state)]() mutable {
        RunJob(raw, std::move(s));
      });
    } catch (const std::system_error& e) {
      // No thread for the run (the process is out of threads or address space): the run
      // fails, saying so, and the worker goes on.
      LOG(ERROR) << "cannot start " << a.job_id() << " generation " << a.generation() << ": "
                 << e.what();
      RunResult result;
      result.kind = RunResult::kFailed;
      result.message = absl::StrCat("worker ", options_.name,
                                    " could not start a thread for the run: ", e.what());
      LifecycleActions ended = lifecycle_.OnRunEnded(start.run, result, absl::Now());
      Apply(ended, sends, dropped);
      continue;
    }
    runs_.emplace(start.run, std::move(run));
  }
  for (v1::WorkerMessage& m : actions.send) sends->push_back(std::move(m));
}

absl::Status Agent::Run() {
  absl::Duration backoff = absl::Milliseconds(50);
  absl::Time last_session = absl::Now();  // start of the outage we are in
  WriteStatus("connecting", options_.coordinator);
  absl::Status status = absl::UnavailableError("not connected yet");
  absl::Time name_refused_since = absl::InfiniteFuture();  // refused for its name since then
  while (!stop_) {
    JoinEnded();
    if (options_.give_up_after > absl::ZeroDuration() &&
        absl::Now() - last_session >= options_.give_up_after) {
      const std::string why = absl::StrCat("no session with coordinator ", options_.coordinator,
                                           " for ", absl::FormatDuration(options_.give_up_after),
                                           " (--give_up_after); last error: ", StatusLine(status));
      WriteStatus("unreachable", why);
      return absl::UnavailableError(why);
    }
    // Waits for gRPC's own reconnection (at most 250 ms apart), so a coordinator that serves
    // again is found at once, however long it was away.
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + kConnectWait))) continue;
    const absl::Time started = absl::Now();
    bool registered = false;
    status = RunSession(&registered);
    Decide([&](WorkerLifecycle& l, absl::Time now) {
      return l.OnSessionEnded(absl::StrCat("session with the coordinator ended: ",
                                           StatusLine(status)),
                              now);
    });
    if (stop_) break;
    if (registered) last_session = absl::Now();
    if (absl::IsUnauthenticated(status) || absl::IsPermissionDenied(status) ||
        (!registered && absl::IsInvalidArgument(status))) {
      // The token, the role or the registration itself: retrying cannot help.
      const std::string why = absl::StrCat("coordinator ", options_.coordinator,
                                           " rejected this worker: ", status.message());
      WriteStatus("rejected", why);
      return absl::Status(status.code(), why);
    }
    if (absl::IsAlreadyExists(status)) {
      name_refused_since = std::min(name_refused_since, started);
      if (absl::Now() - name_refused_since >= options_.name_conflict_timeout) {
        const std::string why = absl::StrCat(
            "another live worker holds the name ", options_.name, " on coordinator ",
            options_.coordinator, " (refused for ",
            absl::FormatDuration(options_.name_conflict_timeout), "): ", status.message(),
            "; give this worker another --name");
        WriteStatus("rejected", why);
        return absl::AlreadyExistsError(why);
      }
    } else {
      name_refused_since = absl::InfiniteFuture();
    }
    // A session that lasted was healthy: its end is no reason to wait. One refused at once
    // (e.g. the name is still held by our previous session) backs off a little.
    if (absl::Now() - started > absl::Seconds(2)) backoff = absl::Milliseconds(50);
    WriteStatus("connecting", absl::StrCat(options_.coordinator, ": ", StatusLine(status)));
    LOG(WARNING) << "session with coordinator " << options_.coordinator
                 << " ended: " << StatusLine(status) << "; reconnecting";
    const absl::Time until = absl::Now() + backoff;
    while (!stop_ && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  WriteStatus("stopped", "");
  return absl::OkStatus();
}

void Agent::WriteStatus(const std::string& state, const std::string& detail) {
  if (options_.status_file.empty()) return;
  // Best effort: a health check then sees the previous state.
  (void)WriteFileAtomically(options_.status_file,
                            absl::StrCat(state, detail.empty() ? "" : " ", detail, "\n"),
                            Durability::kVisible);
}

absl::Status Agent::RunSession(bool* registered) {
  auto stub = v1::WorkerService::NewStub(channel_);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream =
      stub->Session(&context);
  {
    absl::MutexLock lock(&session_mu_);
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
  reg->set_device_uuid(options_.device_uuid);
  reg->add_capabilities("gloo");
#ifdef LOCKSTEP_HAVE_CUDA
  // The coordinator puts another rank of a group on this GPU only when NCCL lets it.
  if (options_.cuda_device >= 0 && NcclSharedGpuAllowed()) {
    reg->add_capabilities(kSharedGpuCapability);
  }
#endif
  reg->set_incarnation(incarnation_);
  reg->set_comm_address(options_.comm_address);
  {
    // What this worker keeps for a job: the coordinator keeps it for that job, or tells it to
    // drop the state when the job has ended.
    absl::MutexLock lock(&mu_);
    if (kept_ != nullptr && lifecycle_.kept().has_value()) {
      reg->mutable_held()->set_job_id(lifecycle_.kept()->job_id);
      reg->mutable_held()->set_step(kept_->completed_step());
    }
  }

  absl::Status result;
  v1::CoordinatorMessage message;
  if (!stream->Write(hello) || !stream->Read(&message) || !message.has_registered()) {
    result = ToAbslStatus(stream->Finish());
    if (result.ok()) result = absl::UnavailableError("coordinator closed the session");
    absl::MutexLock lock(&session_mu_);
    context_ = nullptr;
    return result;
  }
  const std::string worker_id = message.registered().worker_id();
  {
    absl::MutexLock lock(&session_key_mu_);
    session_key_ = message.registered().session_key();
  }
  *registered = true;
  WriteStatus("registered", absl::StrCat("as ", worker_id, " with ", options_.coordinator));
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, message.registered().heartbeat_interval_ms()));
  LOG(INFO) << "registered with " << options_.coordinator << " as " << worker_id << " ("
            << options_.name << ", " << options_.device << ")";
  {
    absl::MutexLock lock(&session_mu_);
    stream_ = stream.get();
  }

  std::atomic<bool> session_over{false};
  std::thread heartbeats([&] {
    v1::WorkerMessage beat;
    beat.mutable_heartbeat();
    while (!session_over) {
      Send(beat);
      Decide([](WorkerLifecycle& l, absl::Time now) { return l.Tick(now); });
      JoinEnded();
      const absl::Time until = absl::Now() + interval;
      while (!session_over && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    }
  });

  while (stream->Read(&message)) {
    switch (message.kind_case()) {
      case v1::CoordinatorMessage::kAssignment:
        if (message.assignment().has_abort_previous()) {
          // Decided together with this assignment: handled as the Abort just before it, and
          // not kept with the assignment.
          const v1::Abort a = std::move(*message.mutable_assignment()->mutable_abort_previous());
          message.mutable_assignment()->clear_abort_previous();
          Decide([&](WorkerLifecycle& l, absl::Time now) {
            return l.OnAbort(a.job_id(), a.generation(), a.reason(), a.job_ended(), now);
          });
        }
        Decide([&](WorkerLifecycle& l, absl::Time now) {
          return l.OnAssignment(message.assignment(), now);
        });
        break;
      case v1::CoordinatorMessage::kAbort: {
        const v1::Abort& a = message.abort();
        Decide([&](WorkerLifecycle& l, absl::Time now) {
          return l.OnAbort(a.job_id(), a.generation(), a.reason(), a.job_ended(), now);
        });
        break;
      }
      default:
        LOG(WARNING) << "ignoring unexpected coordinator message " << message.kind_case();
    }
  }
  session_over = true;
  heartbeats.join();
  {
    absl::MutexLock lock(&session_mu_);
    stream_ = nullptr;
    context_ = nullptr;
  }
  result = ToAbslStatus(stream->Finish());
  if (result.ok()) result = absl::UnavailableError("coordinator ended the session");
  return result;
}

void Agent::Send(const v1::WorkerMessage& message) {
  absl::MutexLock lock(&session_mu_);
  if (stream_ != nullptr) stream_->Write(message);
}

void Agent::JoinEnded() {
  std::vector<std::thread> ended;
  {
    absl::MutexLock lock(&mu_);
    ended.swap(ended_);
  }
  for (std::thread& t : ended) t.join();
}

void Agent::RunJob(RunHandle* run, std::unique_ptr<Trainer> trainer) {
  const v1::Assignment& a = run->assignment;
  bool fatal = false;
  absl::Status status;
  try {
    status = TrainGeneration(*run, trainer, &fatal);
  } catch (const std::bad_alloc&) {
    // A job that needs more memory than this worker can get fails with that reason; the
    // worker lives on and takes the next job. What was built for it is dropped.
    trainer.reset();
    fatal = true;
    status = absl::ResourceExhaustedError(absl::StrCat(
        "out of memory: worker ", options_.name, " could not allocate what ", a.job_id(),
        " needs (peak resident ", HumanBytes(ReadProcessMemory().peak_bytes),
        "); give it a smaller model, data set or micro_batch_size, or a bigger worker"));
  }
  RunResult result;
  // A fatal error is fatal even when an abort came meanwhile (the next generation would only
  // meet it again); the lifecycle does not report it for an aborted run.
  result.kind = status.ok()            ? RunResult::kFinished
                : fatal                ? RunResult::kFatal
                : run->abort->raised() ? RunResult::kStopped
                                       : RunResult::kFailed;
  result.holds_state = trainer != nullptr;
  result.step = trainer != nullptr ? trainer->completed_step() : 0;
  result.message = std::string(status.message());
  if (result.kind == RunResult::kStopped) {
    LOG(INFO) << a.job_id() << " generation " << a.generation() << " stopped: " << status;
  } else if (!status.ok()) {
    LOG(WARNING) << a.job_id() << " generation " << a.generation()
                 << (fatal ? " failed (fatal): " : " failed: ") << status;
  }
  const RunId id = run->id;
  std::vector<v1::WorkerMessage> sends;
  std::vector<std::unique_ptr<Trainer>> dropped;
  {
    absl::MutexLock lock(&mu_);
    run->state = std::move(trainer);
    LifecycleActions actions = lifecycle_.OnRunEnded(id, result, absl::Now());
    Apply(actions, &sends, &dropped);
    // Whatever the lifecycle did not keep goes; the handle goes, its thread is joined later.
    auto it = runs_.find(id);
    if (it != runs_.end()) {
      if (it->second->state != nullptr) dropped.push_back(std::move(it->second->state));
      ended_.push_back(std::move(it->second->thread));
      runs_.erase(it);
    }
  }
  for (const v1::WorkerMessage& m : sends) Send(m);
  dropped.clear();
}

absl::Status Agent::TrainGeneration(RunHandle& run, std::unique_ptr<Trainer>& trainer,
                                    bool* fatal) {
  const v1::Assignment& a = run.assignment;
  const v1::JobSpec& spec = a.spec();
  const std::shared_ptr<AbortSignal>& abort = run.abort;
  // No more BLAS threads than this host has cores, whatever the spec asks.
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  kernels::SetBlasThreads(std::clamp(spec.threads_per_worker(), 1, cores));
  std::shared_ptr<const Dataset> data;
  // The spec's paths, on this host: inside the directories this worker allows, even through
  // symbolic links (the coordinator checked them by name only).
  for (const auto& [field, path, roots] :
       {std::tuple<const char*, const std::string&, const PathRoots&>{
            "dataset.path", spec.dataset().path(), options_.data_roots},
        {"dataset.validation_path", spec.dataset().validation_path(), options_.data_roots},
        {"checkpoint_dir", spec.checkpoint_dir(), options_.checkpoint_roots},
        {"output_dir", spec.output_dir(), options_.checkpoint_roots}}) {
    if (absl::Status s = roots.CheckOnHost(field, path); !s.ok()) {
      *fatal = true;
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", options_.name, ": ", s.message()));
    }
  }
  if (const std::string& init = spec.init_from_checkpoint().path(); !init.empty()) {
    absl::Status in_checkpoints = options_.checkpoint_roots.CheckOnHost("init_from_checkpoint.path", init);
    if (!in_checkpoints.ok() && !options_.data_roots.CheckOnHost("init_from_checkpoint.path", init).ok()) {
      *fatal = true;
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", options_.name, ": ", in_checkpoints.message()));
    }
  }
  if (trainer == nullptr) {
    test_hooks::Reach("before_loading", -1, &abort->job_ended());
    absl::StatusOr<std::shared_ptr<const Dataset>> loaded =
        LoadDataset(spec.dataset(), &abort->job_ended());
    if (!loaded.ok() && abort->job_ended().load()) {
      return absl::CancelledError("the job ended while its data set was loading");
    }
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

  // Every wait below on the generation's peers watches `abort`: the store client cancels its
  // call, Gloo's calls are abandoned, shared-memory waits woken, NCCL aborted.
  std::string session_key;
  {
    absl::MutexLock lock(&session_key_mu_);
    session_key = session_key_;
  }
  auto store = std::make_shared<CoordinatorStoreClient>(store_stub_, session_key, a.job_id(),
                                                        a.generation(),
                                                        abort);
  const auto collective_timeout = std::chrono::milliseconds(spec.collective_timeout_ms());
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> gloo = GlooCommunicator::Create(
      a.rank(), a.world_size(), store, options_.comm_address, collective_timeout, abort);
  if (!gloo.ok()) return gloo.status();

  if (trainer == nullptr) {
    absl::StatusOr<std::unique_ptr<Trainer>> created =
        Trainer::Create(a.job_id(), spec, data, gloo->get());
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
                                  collective_timeout, abort)
          : absl::StatusOr<std::unique_ptr<Communicator>>(*std::move(gloo));
  if (!comm.ok()) return comm.status();
  trainer->set_communicator(comm->get());

  if (options_.cuda_device < 0) {
    absl::StatusOr<DeviceInfo> host = OpenDevice("cpu");
    // The model is allocated by now, so this counts it twice: a margin, on the safe side.
    if (host.ok()) SetMemoryBudget(*trainer, spec, a, host->free_memory_bytes, 10);
  }

#ifdef LOCKSTEP_HAVE_CUDA
  // GPU workers: the steps run on the GPU with NCCL (formed through the same store, under its
  // own key); Gloo stays for healing, evaluation and the small agreements.
  // The trainer keeps its GPU step (and the device's copy of the state) across generations;
  // this generation's NCCL communicator is the step's until the guard below takes it back.
  std::unique_ptr<NcclCommunicator> nccl;
  GpuStep* gpu_step = dynamic_cast<GpuStep*>(trainer->device_engine());
  if (options_.cuda_device >= 0) {
    // The current device is per host thread: this job thread must select it itself, or its
    // first CUDA call would create a context on GPU 0.
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_device));
    // Measured before this generation allocates anything: the estimate counts it all. Ranks
    // that share the GPU (tests) share what is free: the ones that allocated first are
    // counted in it already, so this is on the safe side.
    size_t free_bytes = 0, total_bytes = 0;
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    // A step kept from an earlier generation holds its memory already, and reuses it: the
    // budget is what is free plus what this worker holds (the kept step's; the last
    // generation's communicator is gone, and a dropped job's state is being freed).
    const int64_t held = kernels::cuda::DeviceBytesInUse();
    const int64_t sharing = std::max<int32_t>(1, a.ranks_on_device());
    if (sharing > 1) {
      LOG(INFO) << a.job_id() << " generation " << a.generation() << ": " << sharing
                << " ranks share this GPU; budgeting 1/" << sharing << " of its "
                << HumanBytes(static_cast<int64_t>(free_bytes)) << " free";
    }
    SetMemoryBudget(*trainer, spec, a, static_cast<int64_t>(free_bytes) / sharing + held, 3);
    if (a.world_size() > 1) {
      NcclCommunicator::Options nccl_options;
      nccl_options.init_timeout = absl::FromChrono(collective_timeout);
      nccl_options.collective_timeout = absl::FromChrono(collective_timeout);
      nccl_options.abort = abort;
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> created =
          NcclCommunicator::Create(*store, a.rank(), a.world_size(), nccl_options);
      if (!created.ok()) {
        // Several ranks on one GPU that NCCL refuses: no new generation would fare better.
        *fatal = absl::IsFailedPrecondition(created.status()) &&
                 absl::StrContains(created.status().message(), kNcclSharedGpuVariable);
        return created.status();
      }
      nccl = *std::move(created);
      // What the memory estimate assumes for NCCL (kGpuNcclBufferBytes), against what its
      // init took (NCCL connects lazily: the buffers of its connections come with the first
      // collectives, on top; on a GPU shared with other ranks their allocations count too).
      size_t free_after = 0;
      if (cudaMemGetInfo(&free_after, &total_bytes) == cudaSuccess && free_after <= free_bytes) {
        LOG(INFO) << a.job_id() << " generation " << a.generation() << ": NCCL's init took "
                  << HumanBytes(static_cast<int64_t>(free_bytes - free_after))
                  << " of device memory for " << a.world_size() << " ranks (estimated "
                  << HumanBytes(kGpuNcclBufferBytes) << " with its connections)";
      }
    }
    if (gpu_step == nullptr) {
      absl::StatusOr<std::unique_ptr<GpuStep>> step =
          GpuStep::ForHost(spec, &trainer->model(), &trainer->optimizer(), nccl.get());
      if (!step.ok()) {
        *fatal = absl::IsUnimplemented(step.status()) || absl::IsInvalidArgument(step.status());
        return step.status();
      }
      gpu_step = step->get();
      trainer->set_device_engine(*std::move(step));
    }
    gpu_step->set_nccl(nccl.get());
  }
  // Declared after the communicator, so the step lets go of it before it goes.
  struct ReleaseNccl {
    GpuStep* step;
    ~ReleaseNccl() {
      if (step != nullptr) step->set_nccl(nullptr);
    }
  } release_nccl{gpu_step};
#endif

  std::vector<std::string> members(a.member_names().begin(), a.member_names().end());
  absl::StatusOr<Trainer::HealInfo> heal = trainer->Heal(members);
  if (!heal.ok()) {
    *fatal = Trainer::IsFatal(heal.status());
    return heal.status();
  }
  if (heal->source_rank >= 0) {
    LOG(INFO) << a.job_id() << " generation " << a.generation() << " resumes after step "
              << heal->resumed_from_step << " (state of rank " << heal->source_rank
              << (heal->from_checkpoint ? ", read from a disk checkpoint" : "") << ", "
              << absl::FormatDuration(heal->took) << ")";
  }
  v1::ResumedReport resumed;
  resumed.set_resumed_from_step(heal->resumed_from_step);
  resumed.set_source_rank(heal->source_rank);
  resumed.set_heal_ms(absl::ToInt64Milliseconds(heal->took));
  resumed.set_from_checkpoint(heal->from_checkpoint);
  Decide([&](WorkerLifecycle& l, absl::Time now) { return l.OnHealed(run.id, resumed, now); });

  WorkerMetrics* const metrics = options_.metrics;
  if (metrics != nullptr) {
    metrics->BeginRun(a.job_id(), a.rank(), a.world_size(), trainer->ReducedBytesPerStep());
    trainer->set_step_observer([metrics](const StepResult& r) { metrics->ObserveStep(r); });
  }
  struct EndMetrics {
    WorkerMetrics* metrics;
    Trainer* trainer;
    const AbortSignal* abort;
    ~EndMetrics() {
      if (metrics == nullptr) return;
      trainer->set_step_observer(nullptr);
      metrics->EndRun(abort->raised());
    }
  } end_metrics{metrics, trainer.get(), abort.get()};
  bool first = true;
  absl::Status trained = trainer->Train(
      trainer->completed_step() + 1, abort->flag(),
      [&](const v1::ProgressReport& progress) {
        v1::WorkerMessage m;
        v1::ProgressReport* p = m.mutable_progress();
        *p = progress;
        p->set_job_id(a.job_id());
        p->set_generation(a.generation());
        p->set_first_of_generation(first);
        first = false;
        if (metrics != nullptr) metrics->ObserveProgress(progress);
        Send(m);
      },
      [&](const v1::CheckpointReport& checkpoint) {
        v1::WorkerMessage m;
        *m.mutable_checkpoint() = checkpoint;
        m.mutable_checkpoint()->set_job_id(a.job_id());
        m.mutable_checkpoint()->set_generation(a.generation());
        Send(m);
      });
  if (!trained.ok()) {
    *fatal = Trainer::IsFatal(trained);
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
    test_hooks::Reach("before_evaluation", -1, &abort->flag());
    if (abort->raised()) return absl::AbortedError("aborted before the evaluation");
    absl::StatusOr<v1::EvalResult> eval = trainer->Evaluate();
    if (!eval.ok()) return eval.status();
    *f->mutable_eval() = *eval;
  }
  // Rank 0 writes what the job asked for beyond the parameters: a sample of the language
  // model's text, and the export. Neither fails the job: the trained state is what matters, and
  // its checksum is reported either way.
  if (a.rank() == 0 && spec.sample().max_tokens() > 0) {
    test_hooks::Reach("before_sample", -1, &abort->flag());
    if (abort->raised()) return absl::AbortedError("aborted before the sample");
    absl::StatusOr<v1::Sample> sample = trainer->GenerateSample();
    if (sample.ok()) {
      *f->mutable_sample() = *std::move(sample);
    } else {
      f->set_sample_error(std::string(sample.status().message()));
      LOG(WARNING) << a.job_id() << ": no sample: " << sample.status();
    }
  }
  if (a.rank() == 0 && !spec.output_dir().empty()) {
    absl::StatusOr<std::string> exported = trainer->Export();
    if (exported.ok()) {
      f->set_export_path(*exported);
      LOG(INFO) << a.job_id() << ": wrote " << *exported;
    } else {
      f->set_export_error(std::string(exported.status().message()));
      LOG(WARNING) << a.job_id() << ": export failed: " << exported.status();
    }
  }
  f->set_job_id(a.job_id());
  f->set_generation(a.generation());
  f->set_step(trainer->completed_step());
  f->set_parameter_checksum(trainer->ParameterChecksum());
  f->set_train_samples_per_second(trainer->TrainSamplesPerSecond());
  f->set_train_tokens_per_second(trainer->TrainTokensPerSecond());
  LOG(INFO) << a.job_id() << " finished at step " << f->step() << " parameters "
            << f->parameter_checksum()
            << (f->has_eval() ? absl::StrCat(" held-out loss ", f->eval().test_loss(), " accuracy ",
                                             f->eval().test_accuracy())
                              : "");
  Send(m);
  return absl::OkStatus();
}

}  // namespace lockstep::worker
