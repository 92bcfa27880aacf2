// Worker agent: session I/O and threads. Every decision about runs and state is the
// lifecycle's (worker/lifecycle.h); this file only carries them out.
#include "worker/agent.h"

#include <algorithm>
#include <new>
#include <random>
#include <system_error>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/coordinators.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/program.h"
#include "glog/logging.h"
#include "worker/comm/store_client.h"
#include "worker/program/checkpoint_memory.h"
#include "worker/program/checkpoint_peer.h"
#include "worker/program/warm_start.h"

namespace lockstep::worker {
namespace {

// How long one wait for the channel to (re)connect lasts; gRPC itself retries connecting
// every 250 ms at most (MakeChannel), so a coordinator that serves again is found within that.
constexpr absl::Duration kConnectWait = absl::Milliseconds(250);

}  // namespace

Agent::Agent(AgentOptions options)
    : options_(std::move(options)),
      incarnation_(std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32)),
      lifecycle_(options_.handover_timeout, options_.keep_training_for) {
  generation_context_.worker_name = options_.name;
  generation_context_.comm_address = options_.comm_address;
  generation_context_.data_roots = options_.data_roots;
  generation_context_.checkpoint_roots = options_.checkpoint_roots;
  generation_context_.shared_memory_collectives = options_.shared_memory_collectives;
  generation_context_.device = options_.device.get();
  generation_context_.metrics = options_.metrics;
  generation_context_.programs = options_.programs;
  generation_context_.program_server = options_.program_server;
  generation_context_.warm_starts = options_.warm_starts;
  generation_context_.checkpoint_memory = options_.checkpoint_memory;
  generation_context_.checkpoint_peers = options_.checkpoint_peers;
  generation_context_.checkpoint_copy_interval = options_.checkpoint_copy_interval;
  absl::StatusOr<std::vector<std::string>> coordinators = SplitCoordinators(options_.coordinator);
  coordinators_ =
      coordinators.ok() ? *std::move(coordinators) : std::vector<std::string>{options_.coordinator};
  configured_coordinators_ = coordinators_.size();
  UseCoordinator(coordinators_.front());
}

void Agent::UseCoordinator(const std::string& address) {
  if (std::find(coordinators_.begin(), coordinators_.end(), address) == coordinators_.end()) {
    coordinators_.push_back(address);  // a leader a standby named
  }
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    channel = MakeChannel(address, {options_.token, absl::StrCat("lockstep-worker ", options_.name),
                                    options_.credentials, options_.tls_server_name});
  }
  if (coordinator_ != address && !coordinator_.empty()) {
    LOG(INFO) << "coordinator " << coordinator_ << " -> " << address;
  }
  coordinator_ = address;
  channel_ = channel;
}

void Agent::NextCoordinator() {
  if (coordinators_.size() < 2) return;
  auto it = std::find(coordinators_.begin(), coordinators_.end(), coordinator_);
  size_t index = it - coordinators_.begin();
  // A leader a standby named that does not answer (an address not reachable from here): on
  // from that standby through the configured list, never round the named ones alone.
  if (index >= configured_coordinators_) index = named_by_;
  UseCoordinator(coordinators_[(index + 1) % configured_coordinators_]);
}

Agent::~Agent() {
  Stop();
  Decide([](WorkerLifecycle& l, absl::Time now) {
    return l.OnSessionEnded("stopping", now, /*keep_training=*/false);
  });
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::map<RunId, std::unique_ptr<RunHandle>>* runs) { return runs->empty(); }, &runs_));
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
  if (actions.drop_parked_state && parked_ != nullptr) dropped->push_back(std::move(parked_));
  if (actions.swap_kept_and_parked) std::swap(kept_, parked_);
  if (actions.park_kept_state) parked_ = std::move(kept_);
  if (actions.keep_state_of.has_value()) {
    auto it = runs_.find(*actions.keep_state_of);
    if (it != runs_.end()) kept_ = std::move(it->second->state);
  }
  if (actions.park_state_of.has_value()) {
    auto it = runs_.find(*actions.park_state_of);
    if (it != runs_.end()) parked_ = std::move(it->second->state);
  }
  for (LifecycleActions::Start& start : actions.start) {
    auto run = std::make_unique<RunHandle>();
    run->id = start.run;
    run->assignment = std::move(start.assignment);
    std::unique_ptr<Trainer> state;
    if (start.with_kept_state) state = std::move(kept_);
    if (start.with_parked_state) state = std::move(parked_);
    const v1::Assignment& a = run->assignment;
    LOG(INFO) << "assigned " << a.job_id() << " generation " << a.generation() << " rank "
              << a.rank() << "/" << a.world_size() << " (" << absl::StrJoin(a.member_names(), ", ")
              << (a.member_names_size() < a.world_size()
                      ? absl::StrCat(", ... ", a.world_size(), " members")
                      : std::string())
              << ")"
              << (state != nullptr
                      ? absl::StrCat(", with its state of step ", state->completed_step())
                      : std::string());
    RunHandle* raw = run.get();
    try {
      run->thread =
          std::thread([this, raw, s = std::move(state)]() mutable { RunJob(raw, std::move(s)); });
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
  if (actions.park_state_after_start_of.has_value()) {
    auto it = runs_.find(*actions.park_state_after_start_of);
    if (it != runs_.end()) parked_ = std::move(it->second->state);
  }
  for (v1::WorkerMessage& m : actions.send) sends->push_back(std::move(m));
}

absl::Status Agent::Run() {
  absl::Duration backoff = absl::Milliseconds(50);
  absl::Time last_session = absl::Now();  // start of the outage we are in
  WriteStatus("connecting", coordinator_);
  absl::Status status = absl::UnavailableError("not connected yet");
  absl::Time name_refused_since = absl::InfiniteFuture();  // refused for its name since then
  while (!stop_) {
    JoinEnded();
    // A group that trained on without a coordinator stops after keep_training_for.
    Decide([](WorkerLifecycle& l, absl::Time now) { return l.Tick(now); });
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
    // With several coordinators, one that does not answer is passed over for the next.
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + kConnectWait))) {
      NextCoordinator();
      continue;
    }
    const absl::Time started = absl::Now();
    bool registered = false;
    leader_named_.clear();
    status = RunSession(&registered);
    Decide([&](WorkerLifecycle& l, absl::Time now) {
      return l.OnSessionEnded(
          absl::StrCat("session with the coordinator ended: ", StatusLine(status)), now);
    });
    if (stop_) break;
    if (registered) last_session = absl::Now();
    if (absl::IsUnauthenticated(status) || absl::IsPermissionDenied(status) ||
        (!registered && absl::IsInvalidArgument(status))) {
      // The token, the role or the registration itself: retrying cannot help.
      const std::string why =
          absl::StrCat("coordinator ", coordinator_, " rejected this worker: ", status.message());
      WriteStatus("rejected", why);
      return absl::Status(status.code(), why);
    }
    if (absl::IsAlreadyExists(status)) {
      name_refused_since = std::min(name_refused_since, started);
      if (absl::Now() - name_refused_since >= options_.name_conflict_timeout) {
        const std::string why = absl::StrCat(
            "another live worker holds the name ", options_.name, " on coordinator ", coordinator_,
            " (refused for ", absl::FormatDuration(options_.name_conflict_timeout),
            "): ", status.message(), "; give this worker another --name");
        WriteStatus("rejected", why);
        return absl::AlreadyExistsError(why);
      }
    } else {
      name_refused_since = absl::InfiniteFuture();
    }
    // A session that lasted was healthy: its end is no reason to wait. One refused at once
    // (e.g. the name is still held by our previous session) backs off a little.
    if (absl::Now() - started > absl::Seconds(2)) backoff = absl::Milliseconds(50);
    WriteStatus("connecting", absl::StrCat(coordinator_, ": ", StatusLine(status)));
    LOG(WARNING) << "session with coordinator " << coordinator_ << " ended: " << StatusLine(status)
                 << "; reconnecting";
    // A standby named the leader: straight there. Any other coordinator that is unavailable
    // may have lost the leadership: the next one is asked.
    if (!leader_named_.empty() && leader_named_ != coordinator_) {
      auto named_by = std::find(coordinators_.begin(), coordinators_.end(), coordinator_);
      named_by_ = std::min<size_t>(named_by - coordinators_.begin(), configured_coordinators_ - 1);
      UseCoordinator(leader_named_);
      continue;
    }
    if (absl::IsUnavailable(status)) NextCoordinator();
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
  const DeviceInfo& device = options_.device->info();
  reg->set_name(options_.name);
  reg->set_host(options_.host);
  reg->set_device(device.device);
  reg->set_free_memory_bytes(device.free_memory_bytes);
  reg->set_total_memory_bytes(device.total_memory_bytes);
  reg->set_device_name(device.name);
  reg->set_device_uuid(device.uuid);
  reg->add_capabilities("gloo");
  if (options_.programs.root.restricted()) reg->add_capabilities(kProgramCapability);
  for (const std::string& capability : options_.device->capabilities()) {
    reg->add_capabilities(capability);
  }
  reg->set_incarnation(incarnation_);
  reg->set_comm_address(options_.comm_address);
  if (options_.checkpoint_peers != nullptr) {
    reg->set_peer_address(options_.checkpoint_peers->address());
  }
  {
    // What this worker keeps for a job: the coordinator keeps it for that job, or tells it to
    // drop the state when the job has ended.
    absl::MutexLock lock(&mu_);
    if (kept_ != nullptr && lifecycle_.kept().has_value()) {
      reg->mutable_held()->set_job_id(lifecycle_.kept()->job_id);
      reg->mutable_held()->set_step(kept_->completed_step());
    }
    if (parked_ != nullptr && lifecycle_.parked().has_value()) {
      reg->mutable_parked()->set_job_id(lifecycle_.parked()->job_id);
      reg->mutable_parked()->set_step(parked_->completed_step());
    }
    // A group that trained on while this worker had no coordinator: kept or aborted by it.
    if (const auto training = lifecycle_.training(); training.has_value()) {
      auto run = runs_.find(training->run);
      if (run != runs_.end()) {
        const v1::Assignment& a = training->assignment;
        v1::RunningGeneration* running = reg->mutable_running();
        running->set_job_id(a.job_id());
        running->set_generation(a.generation());
        running->set_rank(a.rank());
        running->set_world_size(a.world_size());
        running->set_step(run->second->step.load());
        // Its run holds the job's state: the coordinator keeps this worker for the job as it
        // keeps any holder, also when it does not keep the generation.
        if (reg->held().job_id() != a.job_id() || reg->held().step() < running->step()) {
          reg->mutable_held()->set_job_id(a.job_id());
          reg->mutable_held()->set_step(running->step());
        }
      }
    }
  }

  absl::Status result;
  v1::CoordinatorMessage message;
  if (!stream->Write(hello) || !stream->Read(&message) || !message.has_registered()) {
    result = ToAbslStatus(stream->Finish());
    if (result.ok()) result = absl::UnavailableError("coordinator closed the session");
    leader_named_ = LeaderNamedBy(context);
    absl::MutexLock lock(&session_mu_);
    context_ = nullptr;
    return result;
  }
  // A leader of an older term than one already obeyed has been deposed: passed over.
  if (const int64_t term = message.registered().term(); term > 0) {
    if (term < term_) {
      context.TryCancel();
      (void)stream->Finish();
      absl::MutexLock lock(&session_mu_);
      context_ = nullptr;
      return absl::UnavailableError(absl::StrCat("coordinator ", coordinator_, " leads term ", term,
                                                 ", older than term ", term_, ": it was deposed"));
    }
    term_ = term;
  }
  const std::string worker_id = message.registered().worker_id();
  {
    absl::MutexLock lock(&session_key_mu_);
    session_key_ = message.registered().session_key();
    // The store of the coordinator that gave the key: a run never pairs one coordinator's
    // store with another's key.
    store_stub_ = v1::StoreService::NewStub(channel_);
  }
  *registered = true;
  WriteStatus("registered", absl::StrCat("as ", worker_id, " with ", coordinator_));
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, message.registered().heartbeat_interval_ms()));
  LOG(INFO) << "registered with " << coordinator_ << " as " << worker_id << " (" << options_.name
            << ", " << device.device << ")";
  {
    absl::MutexLock lock(&session_mu_);
    stream_ = stream.get();
    for (const v1::WorkerMessage& m : unsent_) stream_->Write(m);
    unsent_.clear();
  }
  Decide([](WorkerLifecycle& l, absl::Time now) { return l.OnRegistered(now); });

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
            return l.OnAbort(a.job_id(), a.generation(), a.reason(), a.job_ended(), now,
                             a.suspended(), a.drop_parked());
          });
          if (a.job_ended()) ForgetProgramJob(a.job_id());
        }
        Decide([&](WorkerLifecycle& l, absl::Time now) {
          return l.OnAssignment(message.assignment(), now);
        });
        break;
      case v1::CoordinatorMessage::kAbort: {
        const v1::Abort& a = message.abort();
        Decide([&](WorkerLifecycle& l, absl::Time now) {
          return l.OnAbort(a.job_id(), a.generation(), a.reason(), a.job_ended(), now,
                           a.suspended(), a.drop_parked());
        });
        if (a.job_ended()) ForgetProgramJob(a.job_id());
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

void Agent::ForgetProgramJob(const std::string& job_id) {
  if (options_.checkpoint_memory != nullptr) options_.checkpoint_memory->Drop(job_id);
  if (options_.warm_starts != nullptr) options_.warm_starts->Discard(job_id);
}

void Agent::Send(const v1::WorkerMessage& message) {
  absl::MutexLock lock(&session_mu_);
  if (stream_ != nullptr) {
    stream_->Write(message);
  } else if (message.has_failure() || message.has_finished()) {
    unsent_.push_back(message);
    while (unsent_.size() > 4) unsent_.pop_front();
  }
}

void Agent::JoinEnded() {
  std::vector<std::thread> ended;
  {
    absl::MutexLock lock(&mu_);
    ended.swap(ended_);
  }
  for (std::thread& t : ended) t.join();
}

class Agent::RunReporter final : public GenerationReporter {
 public:
  RunReporter(Agent* agent, RunHandle* run) : agent_(agent), handle_(run), run_(run->id) {}

  void Resumed(const v1::ResumedReport& report) override {
    agent_->Decide(
        [&](WorkerLifecycle& l, absl::Time now) { return l.OnHealed(run_, report, now); });
  }
  void Progress(const v1::ProgressReport& report) override {
    handle_->step.store(report.step());
    if (!handle_->trains.exchange(true)) {
      agent_->Decide([&](WorkerLifecycle& l, absl::Time now) { return l.OnTraining(run_, now); });
    }
    v1::WorkerMessage m;
    *m.mutable_progress() = report;
    agent_->Send(m);
  }
  void Checkpoint(const v1::CheckpointReport& report) override {
    v1::WorkerMessage m;
    *m.mutable_checkpoint() = report;
    agent_->Send(m);
  }
  void Finished(const v1::FinishedReport& report) override {
    v1::WorkerMessage m;
    *m.mutable_finished() = report;
    agent_->Send(m);
  }
  void Output(const v1::ProgramOutput& output) override {
    v1::WorkerMessage m;
    *m.mutable_output() = output;
    agent_->Send(m);
  }

 private:
  Agent* const agent_;
  RunHandle* const handle_;
  const RunId run_;
};

void Agent::RunJob(RunHandle* run, std::unique_ptr<Trainer> trainer) {
  const v1::Assignment& a = run->assignment;
  absl::Status status;
  try {
    // Every wait of the generation on its peers watches the run's abort signal: the store
    // client cancels its call, Gloo's calls are abandoned, shared-memory waits woken, NCCL
    // aborted.
    std::string session_key;
    std::shared_ptr<v1::StoreService::StubInterface> store_stub;
    {
      absl::MutexLock lock(&session_key_mu_);
      session_key = session_key_;
      store_stub = store_stub_;
    }
    auto store = std::make_shared<CoordinatorStoreClient>(store_stub, session_key, a.job_id(),
                                                          a.generation(), run->abort);
    RunReporter reporter(this, run);
    // Destroyed before the state is handed on: it lets go of the device and the group.
    std::unique_ptr<GenerationRun> generation =
        MakeGeneration(generation_context_, a, std::move(store), run->abort, &reporter);
    status = generation->Run(trainer);
  } catch (const std::bad_alloc&) {
    // Generation::Run catches its own; this is the run's setup (the store client).
    status = absl::ResourceExhaustedError(absl::StrCat("out of memory: worker ", options_.name,
                                                       " could not start a run of ", a.job_id()));
  }
  const bool fatal = !status.ok() && IsFatal(status);
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
  if (absl::optional<absl::Cord> exit = status.GetPayload(kProgramExitPayload)) {
    result.program_exit.emplace();
    result.program_exit->ParseFromString(std::string(*exit));
  }
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

}  // namespace lockstep::worker
