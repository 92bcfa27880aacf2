// The coordinator's state machine. Invariants:
//  - a worker is kBusy iff it is a member of the current generation of a non-terminal job, or
//    of a job that succeeded and whose end the shell has not saved yet (JobEndRecorded);
//  - a worker is reserved_for a job iff it is idle and in that job's `reserved`;
//  - a job's `members` always describe its current generation (empty when not running);
//  - every state change of a job appends an event and marks the job changed.
#include "coordinator/core/core.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/job_spec.h"
#include "common/clock.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "common/model_family.h"

namespace lockstep::coordinator {
namespace {

// "cuda:3" -> "cuda"; "cpu" -> "cpu".
std::string DeviceKind(const std::string& device) { return device.substr(0, device.find(':')); }

std::string Seconds1(absl::Duration d) {
  return absl::StrFormat("%.1fs", absl::ToDoubleSeconds(d));
}


}  // namespace

void FoldAbortsIntoAssignments(std::vector<Decisions::Outgoing>& messages) {
  // Per worker, the index of its latest message so far.
  absl::flat_hash_map<std::string_view, size_t> latest;
  latest.reserve(messages.size());
  std::vector<bool> folded(messages.size(), false);
  bool any = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    auto [it, inserted] = latest.try_emplace(messages[i].worker_id, i);
    if (inserted) continue;
    Decisions::Outgoing& before = messages[it->second];
    v1::CoordinatorMessage& now = messages[i].message;
    // Only an abort of the same job's generation, not one that ends the job: a worker that
    // does not know abort_previous still gets what it needs from the assignment alone, which
    // supersedes its run of the job's previous generation.
    if (before.message.has_abort() && now.has_assignment() &&
        !now.assignment().has_abort_previous() && !before.message.abort().job_ended() &&
        before.message.abort().job_id() == now.assignment().job_id()) {
      *now.mutable_assignment()->mutable_abort_previous() =
          std::move(*before.message.mutable_abort());
      folded[it->second] = true;
      any = true;
    }
    it->second = i;
  }
  if (!any) return;
  size_t kept = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (folded[i]) continue;
    if (kept != i) messages[kept] = std::move(messages[i]);
    ++kept;
  }
  messages.resize(kept);
}

Core::Core(CoreOptions options) : options_(options) {}

Core::Worker* Core::FindWorker(const std::string& worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

Core::JobRecord* Core::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

absl::Status ValidateRegistration(const v1::RegisterRequest& request) {
  const std::string& name = request.name();
  if (name.empty()) return absl::InvalidArgumentError("register.name: required");
  if (name.size() > kMaxWorkerNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("register.name: at most ", kMaxWorkerNameBytes,
                                                   " bytes, got ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.' &&
        c != '@' && c != ':') {
      return absl::InvalidArgumentError(
          "register.name: letters, digits and - _ . @ : only (e.g. gpu-host-3:0)");
    }
  }
  if (request.device().empty()) return absl::InvalidArgumentError("register.device: required");
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string&>{"register.host", request.host()},
        {"register.device", request.device()},
        {"register.device_name", request.device_name()},
        {"register.device_uuid", request.device_uuid()},
        {"register.comm_address", request.comm_address()}}) {
    if (value.size() > 255) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": at most 255 bytes"));
    }
    for (char c : value) {
      const unsigned char u = static_cast<unsigned char>(c);
      if (u < 0x20 || u == 0x7f) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": holds a control byte"));
      }
    }
  }
  if (request.capabilities_size() > 64) {
    return absl::InvalidArgumentError("register.capabilities: at most 64");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Core::RegisterWorker(const v1::RegisterRequest& request, absl::Time now,
                                                 Decisions* out) {
  ObserveTime(now);
  if (absl::Status s = ValidateRegistration(request); !s.ok()) return s;
  if (auto held = live_names_.find(request.name()); held != live_names_.end()) {
    const Worker& w = workers_.at(held->second);
    return absl::AlreadyExistsError(absl::StrCat("a connected worker is already named \"",
                                                 request.name(), "\" (", w.id, ", host ",
                                                 w.info.host(), ")"));
  }
  Worker worker;
  worker.registration_seq = next_worker_seq_++;
  worker.id = absl::StrCat("w-", worker.registration_seq);
  worker.info = request;
  worker.registered = now;
  worker.last_heartbeat = now;
  std::string id = worker.id;
  live_names_[request.name()] = id;
  ReserveOrRelease(workers_.emplace(id, std::move(worker)).first->second, out);
  Schedule(now, out);
  return id;
}

void Core::ReserveOrRelease(Worker& worker, Decisions* out) {
  const v1::HeldState& held = worker.info.held();
  JobRecord* job = nullptr;
  if (!held.job_id().empty()) {
    job = FindJob(held.job_id());
    if (job == nullptr || (IsTerminal(job->job.state()) && job->end_recorded)) {
      // Its job is over (or was never this coordinator's: job ids do not repeat): nothing
      // will ever resume from that state.
      out->messages.push_back(
          {worker.id, AbortMessage(held.job_id(), 0,
                                   job == nullptr ? "this coordinator does not know the job"
                                                  : absl::StrCat("the job has ended (",
                                                                 v1::JobState_Name(job->job.state()),
                                                                 ")"),
                                   /*job_ended=*/true)});
      job = nullptr;
    } else if (Excluded(*job, worker.id, worker.info.name())) {
      // Never this job's member again: its state is of no use, and it serves other jobs.
      out->messages.push_back(
          {worker.id, AbortMessage(held.job_id(), 0,
                                   "this worker is no longer one of the job's members",
                                   /*job_ended=*/true)});
      return;
    } else {
      worker.held_step = held.step();
    }
  }
  if (job == nullptr) {
    // A member of a job that the restarted coordinator is re-forming, back without state (a
    // restarted worker) or without saying so: still the job's first.
    auto awaited = awaited_names_.find(worker.info.name());
    if (awaited != awaited_names_.end()) job = FindJob(awaited->second);
  }
  if (job == nullptr || Excluded(*job, worker.id, worker.info.name())) return;
  worker.reserved_for = job->job.job_id();
  job->reserved.insert(worker.id);
}

void Core::ReleaseReserved(JobRecord& job, bool job_ended, const std::string& reason,
                           Decisions* out) {
  for (const std::string& id : job.reserved) {
    Worker* w = FindWorker(id);
    if (w == nullptr || w->reserved_for != job.job.job_id()) continue;
    w->reserved_for.clear();
    if (job_ended && w->held_step >= 0 && w->state != WorkerState::kLost) {
      out->messages.push_back({id, AbortMessage(job.job.job_id(), 0, reason, /*job_ended=*/true)});
    }
    w->held_step = -1;
  }
  job.reserved.clear();
  for (const std::string& name : job.previous_names) {
    auto it = awaited_names_.find(name);
    if (it != awaited_names_.end() && it->second == job.job.job_id()) awaited_names_.erase(it);
  }
  job.previous_names.clear();
  job.restart_grace_until = absl::InfinitePast();
}

bool Core::PreviousMembersBack(const JobRecord& job) const {
  for (const std::string& name : job.previous_names) {
    if (live_names_.count(name) == 0) return false;
  }
  return true;
}

bool Core::AtLastStep(const JobRecord& job, const std::string& except) const {
  const int64_t total = job.job.total_steps();
  bool any = false;
  for (const MemberState& m : job.members) {
    if (m.worker_id == except) continue;
    if (!m.finished && (total <= 0 || m.step < total)) return false;
    any = true;
  }
  return any;
}

bool Core::Excluded(const JobRecord& job, const std::string& worker_id, const std::string& name) {
  return job.excluded.count(worker_id) > 0 || job.excluded_names.count(name) > 0;
}

bool Core::ChargeWorker(JobRecord& job, const Worker& worker) {
  const std::string& name = worker.info.name();
  if (++job.charges[name] <= kMaxChargesPerWorker) return true;
  job.excluded_names.insert(name);
  return false;
}

void Core::NoteMemberActivity(const std::string& worker_id, const std::string& job_id,
                              int64_t generation) {
  Worker* w = FindWorker(worker_id);
  if (w == nullptr || w->state != WorkerState::kBusy || w->job_id != job_id ||
      w->generation != generation) {
    return;
  }
  w->spoke_job = job_id;
  w->spoke_generation = generation;
}

std::vector<std::string> Core::SilentMembers(const JobRecord& job) const {
  std::vector<std::string> silent;
  bool anyone_spoke = false;
  for (const MemberState& m : job.members) {
    const auto it = workers_.find(m.worker_id);
    if (it == workers_.end() || it->second.state != WorkerState::kBusy) continue;
    const Worker& w = it->second;
    if (w.spoke_job == job.job.job_id() && w.spoke_generation == job.job.generation()) {
      anyone_spoke = true;
    } else {
      silent.push_back(m.worker_id);
    }
  }
  if (!anyone_spoke) silent.clear();
  return silent;
}

bool Core::AnyMemberAtLastStep(const JobRecord& job) const {
  const int64_t total = job.job.total_steps();
  return std::any_of(job.members.begin(), job.members.end(), [&](const MemberState& m) {
    return m.finished || (total > 0 && m.step >= total);
  });
}

void Core::MarkWorkerLost(Worker& worker, const std::string& reason, absl::Time now,
                          Decisions* out) {
  if (worker.state == WorkerState::kLost) return;
  const bool was_busy = worker.state == WorkerState::kBusy;
  worker.state = WorkerState::kLost;
  ++lost_workers_;
  live_names_.erase(worker.info.name());
  if (!worker.reserved_for.empty()) {
    if (JobRecord* job = FindJob(worker.reserved_for)) job->reserved.erase(worker.id);
    worker.reserved_for.clear();
  }
  out->close_sessions.push_back(worker.id);
  if (was_busy) {
    if (JobRecord* job = FindJob(worker.job_id)) {
      HandleMemberLoss(*job, worker.id, reason, /*fatal=*/false, now, out);
    }
  }
}

void Core::WorkerDisconnected(const std::string& worker_id, const std::string& reason,
                              absl::Time now, Decisions* out) {
  ObserveTime(now);
  Worker* worker = FindWorker(worker_id);
  if (worker == nullptr) return;
  MarkWorkerLost(*worker,
                 absl::StrCat("worker ", worker->info.name(), " (", worker_id, ") lost: ", reason),
                 now, out);
  PruneLostWorkers();
}

absl::Status Core::Heartbeat(const std::string& worker_id, absl::Time now) {
  ObserveTime(now);
  Worker* worker = FindWorker(worker_id);
  if (worker == nullptr || worker->state == WorkerState::kLost) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
  }
  worker->last_heartbeat = now;
  return absl::OkStatus();
}

void Core::NoteHeartbeat(const std::string& worker_id, absl::Time at) {
  Worker* worker = FindWorker(worker_id);
  if (worker == nullptr || worker->state == WorkerState::kLost) return;
  worker->last_heartbeat = std::max(worker->last_heartbeat, at);
}

const Core::JobRecord* Core::FencedJob(const std::string& job_id, int64_t generation,
                                       const std::string& worker_id, absl::Status* status) const {
  const Worker* worker = nullptr;
  if (!worker_id.empty()) {
    auto w = workers_.find(worker_id);
    if (w == workers_.end() || w->second.state == WorkerState::kLost) {
      *status = absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
      return nullptr;
    }
    worker = &w->second;
  }
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    *status = absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
    return nullptr;
  }
  const JobRecord& job = it->second;
  if (IsTerminal(job.job.state())) {
    *status = absl::AbortedError(
        absl::StrCat("job ", job_id, " has ended (", v1::JobState_Name(job.job.state()), ")"));
    return nullptr;
  }
  if (generation != job.job.generation() || job.job.state() != v1::JOB_STATE_RUNNING) {
    *status = absl::AbortedError(
        absl::StrCat("generation ", generation, " of job ", job_id, " is not live (current ",
                     job.job.generation(),
                     job.job.state() == v1::JOB_STATE_RUNNING ? "" : ", being re-formed", ")"));
    return nullptr;
  }
  if (worker != nullptr && (worker->state != WorkerState::kBusy || worker->job_id != job_id)) {
    // Not this job's at all (a member of an older generation that was dropped is lost, so
    // this is someone else): refused, and nothing is fenced.
    *status = absl::PermissionDeniedError(
        absl::StrCat("worker ", worker_id, " is not a member of job ", job_id));
    return nullptr;
  }
  if (worker != nullptr && worker->generation != generation) {
    *status = absl::AbortedError(absl::StrCat("worker ", worker_id, " is not a member of generation ",
                                              generation, " of job ", job_id));
    return nullptr;
  }
  *status = absl::OkStatus();
  return &job;
}

absl::Status Core::Fence(const std::string& job_id, int64_t generation,
                         const std::string& worker_id) const {
  absl::Status status;
  FencedJob(job_id, generation, worker_id, &status);
  return status;
}

absl::StatusOr<Core::JobRecord*> Core::MemberJob(const std::string& worker_id,
                                                 const std::string& job_id, int64_t generation) {
  absl::Status status;
  const JobRecord* job = FencedJob(job_id, generation, worker_id, &status);
  if (job == nullptr) return status;
  // A member that reports takes part in its generation.
  NoteMemberActivity(worker_id, job_id, generation);
  return const_cast<JobRecord*>(job);
}

v1::CoordinatorMessage Core::AbortMessage(const std::string& job_id, int64_t generation,
                                          const std::string& reason, bool job_ended) {
  v1::CoordinatorMessage message;
  v1::Abort* abort = message.mutable_abort();
  abort->set_job_id(job_id);
  abort->set_generation(generation);
  abort->set_reason(reason);
  abort->set_job_ended(job_ended);
  return message;
}

void Core::ObserveTime(absl::Time now) {
  if (options_.tick_interval <= absl::ZeroDuration()) return;
  const absl::Time last = last_input_;
  last_input_ = std::max(last_input_, now);
  // Ticks come every tick_interval and heartbeats every half second per worker: a gap of a
  // second without any input means the whole coordinator was stopped or starved, not just one
  // of its threads.
  if (last == absl::InfinitePast() ||
      now - last <= std::max(options_.tick_interval * 10, absl::Seconds(1))) {
    return;
  }
  const absl::Duration gap = now - last;
  // Nobody could reach the coordinator during the gap, and it could not hear anyone: shift
  // every clock that measures a worker's or a job's silence by it.
  const absl::Duration credit = gap - options_.tick_interval;
  for (auto& [id, w] : workers_) {
    if (w.state != WorkerState::kLost) w.last_heartbeat = std::min(now, w.last_heartbeat + credit);
  }
  // (Every live job: an absence is rare, and this is the one cost that grows with them.)
  for (const std::set<JobKey>* index : {&active_, &pending_}) {
    for (const auto& [seq, id] : *index) {
      JobRecord& job = jobs_.at(id);
      if (job.last_advance != absl::InfinitePast()) {
        job.last_advance = std::min(now, job.last_advance + credit);
      }
      if (job.reconfigure_since != absl::InfinitePast()) {
        job.reconfigure_since = std::min(now, job.reconfigure_since + credit);
      }
      job.pending_since = std::min(now, job.pending_since + credit);
    }
  }
  pending_deadlines_.clear();
  for (const auto& [seq, id] : pending_) {
    JobRecord& job = jobs_.at(id);
    if (job.pending_deadline == absl::InfiniteFuture()) continue;
    job.pending_deadline =
        job.pending_since + absl::Milliseconds(job.job.spec().rendezvous_timeout_ms());
    pending_deadlines_.emplace(job.pending_deadline, id);
  }
  last_absence_ = gap;
  // Sessions that broke during the absence (their keepalives went unanswered) are heard of
  // within moments of its end; losses until then are the coordinator's doing.
  away_grace_until_ = now + absl::Seconds(2);
}

bool Core::CoordinatorWasAway(absl::Time now) const { return now < away_grace_until_; }

absl::Status Core::ReportProgress(const std::string& worker_id, const v1::ProgressReport& report,
                                  absl::Time now, Decisions* out) {
  ObserveTime(now);
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok()) return job_or.status();
  JobRecord& job = **job_or;
  for (MemberState& m : job.members) {
    if (m.worker_id != worker_id) continue;
    m.step = std::max(m.step, report.step());
    m.peak_memory_bytes = std::max(m.peak_memory_bytes, report.peak_memory_bytes());
  }
  if (report.total_steps() > 0) job.job.set_total_steps(report.total_steps());
  if (job.job.first_step_latency_ms() == 0 && report.step() > 0) {
    job.job.set_first_step_latency_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(now - job.submitted)));
  }
  if (report.first_of_generation() && !job.first_report_of_generation_seen) {
    // The first step of a new generation: detection-to-first-step ends here.
    job.first_report_of_generation_seen = true;
    job.last_advance = now;
    job.benched.clear();
    CloseRecovery(job, now, "", out);
  }
  if (report.step() > job.job.step()) {
    job.job.set_step(report.step());
    job.last_advance = now;
  }
  // Rank 0 speaks for the group's loss and throughput (all ranks see the same reduced loss).
  if (!job.members.empty() && job.members.front().worker_id == worker_id) {
    job.job.set_loss(report.loss());
    job.job.set_samples_per_second(report.samples_per_second());
    job.job.set_tokens_per_second(report.tokens_per_second());
    v1::TrainingPoint point;
    point.set_step(report.step());
    point.set_time_unix_ms(ToUnixMillisOrZero(now));
    point.set_loss(report.loss());
    point.set_samples_per_second(report.samples_per_second());
    point.set_tokens_per_second(report.tokens_per_second());
    job.curve.Add(point);
    bool evaluated = false;
    if (report.has_eval()) {
      // A group that resumed from an older state evaluates those steps again: the newer
      // evaluation replaces the old ones from that step on.
      auto* history = job.job.mutable_validation_history();
      while (!history->empty() && history->rbegin()->step() >= report.step()) {
        history->RemoveLast();
      }
      v1::ValidationPoint* point = history->Add();
      point->set_step(report.step());
      *point->mutable_eval() = report.eval();
      evaluated = true;
    }
    const int64_t remaining = job.job.total_steps() - job.job.step();
    const double sps = report.samples_per_second();
    if (sps > 0 && remaining >= 0) {
      job.job.set_eta_ms(static_cast<int64_t>(
          1000.0 * static_cast<double>(remaining * job.job.spec().global_batch_size()) / sps));
    }
    RefreshMembers(job);
    if (evaluated || now - job.last_progress_event >= options_.progress_event_interval ||
        job.job.step() == job.job.total_steps()) {
      job.last_progress_event = now;
      std::string message = absl::StrCat("step ", job.job.step(), "/", job.job.total_steps());
      if (evaluated) {
        absl::StrAppend(&message, absl::StrFormat("; validation loss %.4f", report.eval().test_loss()));
        if (report.eval().bits_per_byte() > 0) {
          absl::StrAppend(&message, absl::StrFormat(" (%.3f bits per byte)", report.eval().bits_per_byte()));
        }
      }
      AddEvent(job, v1::JobEvent::PROGRESS, message, now, out);
    }
  } else {
    RefreshMembers(job);
  }
  return absl::OkStatus();
}

absl::Status Core::ReportFailure(const std::string& worker_id, const v1::FailureReport& report,
                                 absl::Time now, Decisions* out) {
  ObserveTime(now);
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok() && report.fatal() && absl::IsAborted(job_or.status())) {
    // While the job re-forms after a member's fatal report, the others' fatal reports of the
    // generation that ended still count (they are why the job fails, when all say so).
    JobRecord* job = FindJob(report.job_id());
    const Worker* w = FindWorker(worker_id);
    if (job != nullptr && job->job.state() == v1::JOB_STATE_RECONFIGURING &&
        job->job.generation() == report.generation() && w != nullptr &&
        w->state == WorkerState::kBusy && w->job_id == report.job_id() &&
        w->generation == report.generation()) {
      job_or = job;
    }
  }
  if (!job_or.ok()) return job_or.status();
  Worker* worker = FindWorker(worker_id);
  const std::string reason = absl::StrCat("worker ", worker->info.name(), " (", worker_id,
                                          ") reported: ", report.message());
  // A fatal error is the reporter's own (its data, its device, its memory): it leaves the job.
  // Otherwise the reporter itself is healthy (it is talking to us); the peer behind a
  // collective error is left to its own detection, so nobody is removed here.
  HandleMemberLoss(**job_or, report.fatal() ? worker_id : std::string(), reason, report.fatal(),
                   now, out);
  return absl::OkStatus();
}

absl::Status Core::ReportFinished(const std::string& worker_id, const v1::FinishedReport& report,
                                  absl::Time now, Decisions* out) {
  ObserveTime(now);
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok()) return job_or.status();
  JobRecord& job = **job_or;
  bool all_finished = true;
  for (MemberState& m : job.members) {
    if (m.worker_id == worker_id && !m.finished) {
      // Kept as reported: nothing of it is the job's until the members agree (FinishAgreed).
      m.finished = true;
      m.step = report.step();
      m.checksum = report.parameter_checksum();
      m.peak_memory_bytes = std::max(m.peak_memory_bytes, report.peak_memory_bytes());
      m.eval = report.has_eval() ? report.eval().SerializeAsString() : "";
      m.report = report;
    }
    all_finished = all_finished && m.finished;
  }
  RefreshMembers(job);
  out->changed_jobs.insert(job.job.job_id());
  // The result stands only when every member of the generation reported it, and they agree.
  if (all_finished) FinishAgreed(job, /*except=*/"", "", now, out);
  return absl::OkStatus();
}

std::string Core::Disagreement(const JobRecord& job, const std::string& except) const {
  const MemberState* first = nullptr;
  bool agree = true;
  for (const MemberState& m : job.members) {
    if (m.worker_id == except || !m.finished) continue;
    if (first == nullptr) {
      first = &m;
      continue;
    }
    agree = agree && m.step == first->step && m.checksum == first->checksum &&
            m.eval == first->eval;
  }
  if (agree) return "";
  std::vector<std::string> parts;
  for (const MemberState& m : job.members) {
    if (m.worker_id == except || !m.finished) continue;
    const auto it = workers_.find(m.worker_id);
    parts.push_back(absl::StrCat(it == workers_.end() ? m.worker_id : it->second.info.name(),
                                 ": step ", m.step, ", parameters ", m.checksum,
                                 m.eval == first->eval ? "" : ", a different evaluation"));
  }
  return absl::StrCat("the members disagree on the result (", absl::StrJoin(parts, "; "), ")");
}

void Core::FinishAgreed(JobRecord& job, const std::string& except, const std::string& note,
                        absl::Time now, Decisions* out) {
  if (std::string disagreement = Disagreement(job, except); !disagreement.empty()) {
    return FinishJob(job, v1::JOB_STATE_FAILED, disagreement + note, now, out);
  }
  // Every field of the outcome comes from the members that finished and agree: the step and
  // the evaluation are theirs (equal by Disagreement), throughput, sample and export rank 0's,
  // the only one that writes them, when it is among them. A member left out (lost before it
  // reported) is no final member.
  const std::string rank0_id = job.members.empty() ? "" : job.members.front().worker_id;
  std::string rank0_name = rank0_id;
  if (const auto it = workers_.find(rank0_id); it != workers_.end()) {
    rank0_name = absl::StrCat(it->second.info.name(), " (", rank0_id, ")");
  }
  if (!except.empty()) EraseMember(job, except);
  const MemberState* agreed = nullptr;
  for (const MemberState& m : job.members) {
    if (m.finished) {
      agreed = &m;
      break;
    }
  }
  job.job.clear_eval();
  if (agreed != nullptr) {
    job.job.set_step(agreed->step);
    if (!agreed->eval.empty()) job.job.mutable_eval()->ParseFromString(agreed->eval);
  }
  const MemberState* rank0 =
      !job.members.empty() && job.members.front().worker_id == rank0_id && job.members.front().finished
          ? &job.members.front()
          : nullptr;
  const std::string rank0_lost =
      absl::StrCat("not written: rank 0, ", rank0_name, ", was lost before writing it");
  job.job.set_train_samples_per_second(rank0 ? rank0->report.train_samples_per_second() : 0);
  job.job.set_train_tokens_per_second(rank0 ? rank0->report.train_tokens_per_second() : 0);
  job.job.clear_sample();
  job.job.clear_sample_error();
  if (job.job.spec().sample().max_tokens() > 0) {
    if (rank0 == nullptr) {
      job.job.set_sample_error(rank0_lost);
    } else if (rank0->report.has_sample()) {
      *job.job.mutable_sample() = rank0->report.sample();
    } else {
      job.job.set_sample_error(rank0->report.sample_error().empty()
                                   ? "not written: rank 0 reported no sample"
                                   : rank0->report.sample_error());
    }
  }
  job.job.clear_export_path();
  job.job.clear_export_error();
  if (!job.job.spec().output_dir().empty()) {
    if (rank0 == nullptr) {
      job.job.set_export_error(rank0_lost);
    } else if (!rank0->report.export_path().empty()) {
      job.job.set_export_path(rank0->report.export_path());
    } else {
      job.job.set_export_error(rank0->report.export_error().empty()
                                   ? "not written: rank 0 reported no export"
                                   : rank0->report.export_error());
    }
  }
  RefreshMembers(job);
  std::string reason = absl::StrCat("trained ", job.job.step(), " steps");
  if (job.job.has_eval() && IsLanguageModel(job.job.spec().model())) {
    absl::StrAppend(&reason,
                    absl::StrFormat("; validation loss %.4f", job.job.eval().test_loss()));
    if (job.job.eval().bits_per_byte() > 0) {
      absl::StrAppend(&reason,
                      absl::StrFormat(" (%.3f bits per byte)", job.job.eval().bits_per_byte()));
    }
  } else if (job.job.has_eval()) {
    absl::StrAppend(&reason,
                    absl::StrFormat("; test accuracy %.4f", job.job.eval().test_accuracy()));
  }
  FinishJob(job, v1::JOB_STATE_SUCCEEDED, reason + note, now, out);
}

absl::Status Core::ReportResumed(const std::string& worker_id, const v1::ResumedReport& report,
                                 absl::Time now, Decisions* out) {
  ObserveTime(now);
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok()) return job_or.status();
  JobRecord& job = **job_or;
  // Each member holds the state it resumed from (a finishing generation reports no step).
  for (MemberState& m : job.members) {
    if (m.worker_id == worker_id) m.step = std::max(m.step, report.resumed_from_step());
  }
  // Every member reports the same agreement; the first one speaks for the group.
  if (job.resumed_report_seen) return absl::OkStatus();
  job.resumed_report_seen = true;
  // The group may have resumed from an older state than the coordinator last saw (nobody
  // held the newest): the job's step follows it.
  job.job.set_step(report.resumed_from_step());
  job.last_advance = now;
  if (job.open_recovery >= 0) {
    v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
    r->set_resumed_from_step(report.resumed_from_step());
    r->set_source_rank(report.source_rank());
    r->set_heal_ms(report.heal_ms());
    r->set_steps_redone(std::max<int64_t>(0, r->step_at_detection() - report.resumed_from_step()));
    // State from a member's memory is that member's last committed step; state from a disk
    // checkpoint (or none) means every member that held later steps is gone, and what they
    // completed after their last report is unknown.
    r->set_steps_redone_lower_bound(report.from_checkpoint() || report.source_rank() < 0);
    if (job.job.total_steps() > 0 && report.resumed_from_step() >= job.job.total_steps()) {
      CloseRecovery(job, now, "; no step was left to train", out);
    }
  }
  RefreshMembers(job);
  out->changed_jobs.insert(job.job.job_id());
  return absl::OkStatus();
}

absl::Status Core::ReportCheckpoint(const std::string& worker_id,
                                    const v1::CheckpointReport& report, absl::Time now,
                                    Decisions* out) {
  ObserveTime(now);
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok()) return job_or.status();
  JobRecord& job = **job_or;
  v1::CheckpointStatus* c = job.job.mutable_checkpoints();
  if (report.error().empty()) {
    c->set_last_good_step(report.step());
    c->set_last_good_path(report.path());
    c->set_last_good_unix_ms(ToUnixMillisOrZero(now));
    out->changed_jobs.insert(job.job.job_id());
  } else {
    c->set_failed_writes(c->failed_writes() + 1);
    c->set_last_failed_step(report.step());
    c->set_last_error(report.error());
    AddEvent(job, v1::JobEvent::CHECKPOINT,
             absl::StrCat("checkpoint at step ", report.step(), " not written: ", report.error()),
             now, out);
  }
  return absl::OkStatus();
}

void Core::CloseRecovery(JobRecord& job, absl::Time now, const std::string& note,
                         Decisions* out) {
  if (job.open_recovery < 0) return;
  v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
  r->set_first_step_unix_ms(ToUnixMillisOrZero(now));
  AddEvent(job, v1::JobEvent::MEMBERSHIP,
           absl::StrFormat("generation %d resumed after step %d (source rank %d, heal %d ms, %d ms "
                           "after detection, %s%d steps redone)%s",
                           r->to_generation(), r->resumed_from_step(), r->source_rank(),
                           r->heal_ms(), r->first_step_unix_ms() - r->detect_unix_ms(),
                           r->steps_redone_lower_bound() ? "at least " : "", r->steps_redone(),
                           note),
           now, out);
  job.open_recovery = -1;
}

absl::Status Core::CheckMemoryFits(const MemoryEstimate& memory, const std::string& device) const {
  // Refuse only what no registered worker can hold; with no workers yet, or one that reports
  // no figure, the job waits (and the scheduler still skips workers that are too small).
  const Worker* roomiest = nullptr;
  for (const auto& [id, w] : workers_) {
    if (w.state == WorkerState::kLost || DeviceKind(w.info.device()) != device) continue;
    if (w.info.free_memory_bytes() == 0) return absl::OkStatus();
    if (roomiest == nullptr || w.info.free_memory_bytes() > roomiest->info.free_memory_bytes()) {
      roomiest = &w;
    }
  }
  if (roomiest == nullptr || roomiest->info.free_memory_bytes() >= memory.total()) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "each worker would need about ", memory.ToString(), ", but the most free memory any ",
      "registered worker reports is ", HumanBytes(roomiest->info.free_memory_bytes()), " (",
      roomiest->info.name(), " on ", roomiest->info.device(),
      "); use more micro_shards (a worker needs room for one at a time), a smaller "
      "micro_batch_size, or a smaller model"));
}

absl::StatusOr<v1::Job> Core::SubmitJob(v1::JobSpec spec, absl::Time now, Decisions* out,
                                        bool schedule) {
  ObserveTime(now);
  ApplyJobSpecDefaults(&spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) return s;
  if (absl::Status s = CheckJobPaths(spec, options_.data_roots, options_.checkpoint_roots);
      !s.ok()) {
    return s;
  }
  // With gradient accumulation a worker needs room for one micro-batch, not its whole share.
  const MemoryEstimate memory = EstimateWorkerMemory(spec, MinMicroBatch(spec));
  if (absl::Status s = CheckMemoryFits(memory, spec.device()); !s.ok()) return s;
  JobRecord record;
  record.memory_needed = memory.total();
  const std::string id =
      absl::StrCat("job-", next_job_seq_++,
                   options_.job_id_suffix.empty() ? "" : "-", options_.job_id_suffix);
  record.job.set_job_id(id);
  *record.job.mutable_spec() = std::move(spec);
  record.job.set_submit_time_unix_ms(ToUnixMillisOrZero(now));
  record.submitted = now;
  record.pending_since = now;
  record.submit_seq = next_job_seq_ - 1;
  JobRecord& job = jobs_.emplace(id, std::move(record)).first->second;
  order_.insert(KeyOf(job));
  SetState(job, v1::JOB_STATE_PENDING);
  AddEvent(job, v1::JobEvent::STATE, "submitted", now, out);
  if (schedule) Schedule(now, out);
  return View(job);
}

int Core::RestoreJobs(std::vector<v1::Job> jobs, absl::Time now, Decisions* out) {
  // "job-N" or "job-N-SUFFIX".
  auto seq_of = [](const v1::Job& job) {
    uint64_t seq = 0;
    if (!absl::StartsWith(job.job_id(), "job-")) return uint64_t{0};
    const std::string rest = job.job_id().substr(4);
    return absl::SimpleAtoi(rest.substr(0, rest.find('-')), &seq) ? seq : uint64_t{0};
  };
  std::sort(jobs.begin(), jobs.end(),
            [&](const v1::Job& a, const v1::Job& b) { return seq_of(a) < seq_of(b); });
  int resuming = 0;
  for (v1::Job& saved : jobs) {
    const std::string id = saved.job_id();
    if (id.empty() || jobs_.count(id) > 0) continue;
    next_job_seq_ = std::max(next_job_seq_, seq_of(saved) + 1);
    JobRecord record;
    record.job = std::move(saved);
    ApplyJobSpecDefaults(record.job.mutable_spec());  // fields added since it was saved
    record.submitted = absl::FromUnixMillis(record.job.submit_time_unix_ms());
    record.pending_since = now;  // the time the coordinator was down is not the job's wait
    if (record.job.start_time_unix_ms() > 0) {
      record.started = absl::FromUnixMillis(record.job.start_time_unix_ms());
    }
    record.submit_seq = seq_of(record.job);
    record.last_advance = now;
    record.memory_needed =
        EstimateWorkerMemory(record.job.spec(), MinMicroBatch(record.job.spec())).total();
    record.timeline_ids_stale = true;
    JobRecord& job = jobs_.emplace(id, std::move(record)).first->second;
    order_.insert(KeyOf(job));
    if (IsTerminal(job.job.state())) continue;
    ++resuming;
    if (job.job.state() == v1::JOB_STATE_PENDING) {
      SetState(job, v1::JOB_STATE_PENDING);
      AddEvent(job, v1::JobEvent::STATE, "coordinator restarted; queued again", now, out);
      continue;
    }
    // Its members are unknown to this coordinator until they register again: the job waits a
    // while for those of its last generation (they keep its state), so that one restart costs
    // one re-formation. A job that had trained its last step only finishes.
    job.members.clear();
    if (job.job.generations_size() > 0) {
      const v1::Generation& last = *job.job.generations().rbegin();
      for (const std::string& name : last.members()) {
        if (awaited_names_.emplace(name, id).second) job.previous_names.push_back(name);
      }
    }
    job.restart_grace_until = now + options_.restart_grace;
    job.finishing = job.job.total_steps() > 0 && job.job.step() >= job.job.total_steps();
    BeginReconfiguration(job, "coordinator restarted", /*scale_up=*/false,
                         /*coordinator_caused=*/true, now, now, out);
  }
  Schedule(now, out);
  return resuming;
}

absl::StatusOr<v1::Job> Core::CancelJob(const std::string& job_id, absl::Time now, Decisions* out) {
  ObserveTime(now);
  JobRecord* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  if (IsTerminal(job->job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has already ended (",
                                                      v1::JobState_Name(job->job.state()), ")"));
  }
  FinishJob(*job, v1::JOB_STATE_CANCELLED, "cancelled by user", now, out);
  return View(*job);
}

absl::StatusOr<v1::Job> Core::GetJob(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  return View(it->second);
}

v1::Job Core::View(const JobRecord& job) const {
  v1::Job view = job.job;
  if (view.state() == v1::JOB_STATE_PENDING && !pending_.empty() &&
      pending_.begin()->second != view.job_id()) {
    const JobRecord& head = jobs_.at(pending_.begin()->second);
    view.set_reason(absl::StrCat("queued behind ", head.job.job_id(), ", which is ",
                                 head.job.reason()));
  }
  return view;
}

void Core::SetState(JobRecord& job, v1::JobState state) {
  const JobKey key = KeyOf(job);
  if (job.pending_deadline != absl::InfiniteFuture()) {
    pending_deadlines_.erase({job.pending_deadline, job.job.job_id()});
    job.pending_deadline = absl::InfiniteFuture();
  }
  pending_.erase(key);
  active_.erase(key);
  job.job.set_state(state);
  if (state == v1::JOB_STATE_PENDING) {
    pending_.insert(key);
    if (job.job.spec().rendezvous_timeout_ms() > 0) {
      job.pending_deadline =
          job.pending_since + absl::Milliseconds(job.job.spec().rendezvous_timeout_ms());
      pending_deadlines_.emplace(job.pending_deadline, job.job.job_id());
    }
  } else if (!IsTerminal(state)) {
    active_.insert(key);
  }
}

absl::StatusOr<v1::ListJobsResponse> Core::ListJobs(const v1::ListJobsRequest& request) const {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size is ", request.page_size(), "; it must be 0 (the default, ",
                     kDefaultJobsPerPage, ") or more"));
  }
  // The token is the submission number of the previous page's last job: the page goes on
  // with older ones.
  uint64_t before = std::numeric_limits<uint64_t>::max();
  if (!request.page_token().empty() &&
      (!absl::SimpleAtoi(request.page_token(), &before) || before == 0 ||
       before >= next_job_seq_)) {
    return absl::InvalidArgumentError(
        "page_token is not one this coordinator issued (pass a next_page_token of ListJobs)");
  }
  const size_t page_size = request.page_size() == 0
                               ? kDefaultJobsPerPage
                               : std::min(request.page_size(), kMaxJobsPerPage);
  v1::ListJobsResponse page;
  page.set_total_jobs(static_cast<int64_t>(order_.size()));
  size_t bytes = 0;
  uint64_t last = 0;
  for (auto it = std::make_reverse_iterator(order_.lower_bound({before, ""}));
       it != order_.rend(); ++it) {
    const JobRecord& record = jobs_.at(it->second);
    const size_t size = record.job.ByteSizeLong();
    if (page.jobs_size() > 0 &&
        (static_cast<size_t>(page.jobs_size()) == page_size || bytes + size > kMaxJobsPageBytes)) {
      page.set_next_page_token(absl::StrCat(last));
      break;
    }
    bytes += size;
    last = record.submit_seq;
    *page.add_jobs() = View(record);
  }
  return page;
}

std::map<v1::JobState, int64_t> Core::JobCounts() const {
  std::map<v1::JobState, int64_t> counts;
  for (const auto& [id, job] : jobs_) ++counts[job.job.state()];
  return counts;
}

std::vector<v1::WorkerInfo> Core::ListWorkers() const {
  std::vector<const Worker*> sorted;
  for (const auto& [id, w] : workers_) sorted.push_back(&w);
  std::sort(sorted.begin(), sorted.end(), [](const Worker* a, const Worker* b) {
    return a->registration_seq < b->registration_seq;
  });
  std::vector<v1::WorkerInfo> out;
  for (const Worker* w : sorted) {
    v1::WorkerInfo info;
    info.set_worker_id(w->id);
    info.set_name(w->info.name());
    info.set_host(w->info.host());
    info.set_device(w->info.device());
    info.set_free_memory_bytes(w->info.free_memory_bytes());
    info.set_device_name(w->info.device_name());
    info.set_total_memory_bytes(w->info.total_memory_bytes());
    info.set_device_uuid(w->info.device_uuid());
    info.set_state(w->state == WorkerState::kIdle   ? "idle"
                   : w->state == WorkerState::kBusy ? "busy"
                                                    : "lost");
    if (w->state == WorkerState::kBusy) info.set_job_id(w->job_id);
    info.set_last_heartbeat_unix_ms(ToUnixMillisOrZero(w->last_heartbeat));
    info.set_registered_unix_ms(ToUnixMillisOrZero(w->registered));
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<v1::TrainingCurve> Core::GetTrainingCurve(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  v1::TrainingCurve curve;
  curve.set_job_id(job_id);
  for (const v1::TrainingPoint& point : it->second.curve.points()) *curve.add_points() = point;
  return curve;
}

absl::StatusOr<std::vector<v1::JobEvent>> Core::EventsSince(const std::string& job_id,
                                                            int64_t from_sequence) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  std::vector<v1::JobEvent> events;
  for (const v1::JobEvent& e : it->second.events) {
    if (e.sequence() >= from_sequence) events.push_back(e);
  }
  return events;
}

void Core::Tick(absl::Time now, Decisions* out) {
  ObserveTime(now);
  // Heartbeat silence: the job's own timeout applies to its members (looked up once per run
  // of workers of the same job, not once per worker).
  std::string timeout_job;  // a copy: a loss below may re-assign the workers after this one
  absl::Duration job_timeout;
  for (auto& [id, w] : workers_) {
    if (w.state == WorkerState::kLost) continue;
    absl::Duration timeout = options_.heartbeat_timeout;
    if (w.state == WorkerState::kBusy) {
      if (timeout_job.empty() || timeout_job != w.job_id) {
        const JobRecord* job = FindJob(w.job_id);
        job_timeout = job && job->job.spec().heartbeat_timeout_ms() > 0
                          ? absl::Milliseconds(job->job.spec().heartbeat_timeout_ms())
                          : options_.heartbeat_timeout;
        timeout_job = w.job_id;
      }
      timeout = job_timeout;
    }
    if (now - w.last_heartbeat > timeout) {
      MarkWorkerLost(w,
                     absl::StrCat("worker ", w.info.name(), " (", id, ") lost: no heartbeat for ",
                                  Seconds1(now - w.last_heartbeat)),
                     now, out);
    }
  }
  // Running and re-forming jobs (a copy: a job that ends here leaves active_).
  const std::vector<JobKey> active(active_.begin(), active_.end());
  for (const auto& [seq, id] : active) {
    JobRecord& job = jobs_.at(id);
    if (IsTerminal(job.job.state())) continue;
    const v1::JobSpec& spec = job.job.spec();
    if (job.job.state() == v1::JOB_STATE_RUNNING) {
      const absl::Duration step_timeout = absl::Milliseconds(spec.step_timeout_ms());
      // After the last step no step is left to complete: the evaluation, the sample and the
      // export take what they take (a hung member is found by its heartbeats, a dead one by
      // its peers' collective errors).
      if (now - job.last_advance > step_timeout && !job.finishing && !AtLastStep(job)) {
        // Nobody is known to be at fault (members still heartbeat): abort and re-form the
        // group, which max_restarts bounds like any other recovery.
        HandleMemberLoss(job, /*worker_id=*/"",
                         absl::StrCat("no step completed for ", Seconds1(now - job.last_advance),
                                      " (step_timeout_ms ", spec.step_timeout_ms(), ") at step ",
                                      job.job.step()),
                         /*fatal=*/false, now, out);
      }
    } else if (job.job.state() == v1::JOB_STATE_RECONFIGURING && spec.rendezvous_timeout_ms() > 0 &&
               now - job.reconfigure_since > absl::Milliseconds(spec.rendezvous_timeout_ms())) {
      FinishJob(job, v1::JOB_STATE_FAILED,
                absl::StrCat("waited ", Seconds1(now - job.reconfigure_since), " to re-form with ",
                             spec.min_workers(), " workers (rendezvous_timeout_ms ",
                             spec.rendezvous_timeout_ms(), "); ", job.job.reason()),
                now, out);
    }
  }
  // Queued jobs whose rendezvous_timeout passed: only those, in deadline order.
  while (!pending_deadlines_.empty() && pending_deadlines_.begin()->first < now) {
    JobRecord& job = jobs_.at(pending_deadlines_.begin()->second);
    const v1::JobSpec& spec = job.job.spec();
    FinishJob(job, v1::JOB_STATE_FAILED,
              absl::StrCat("waited ", Seconds1(now - job.pending_since), " for ",
                           spec.min_workers(), " workers (rendezvous_timeout_ms ",
                           spec.rendezvous_timeout_ms(), "); ", View(job).reason()),
              now, out);
  }
  PruneLostWorkers();
  Schedule(now, out);
}

RankCandidate Core::Candidate(const Worker& w) {
  bool may_share = false;
  for (const std::string& c : w.info.capabilities()) {
    may_share = may_share || c == kSharedGpuCapability;
  }
  return {w.id, w.info.host(), w.registration_seq, w.info.device_uuid(), may_share,
          w.info.free_memory_bytes()};
}

std::string Core::SharedGpuNote(size_t left_out) {
  if (left_out == 0) return "";
  return absl::StrCat(", ", left_out, " left out for a GPU that another one uses (several ranks "
                      "on one GPU need NCCL 2.30.3 or later with NCCL_MULTI_RANK_GPU_ENABLE=1 on "
                      "every worker there, and the GPU's memory for all of them)");
}

std::vector<RankCandidate> Core::IdleWorkers(const std::string& device, int64_t memory_needed,
                                             const JobRecord* job) const {
  std::vector<RankCandidate> idle;
  for (const auto& [id, w] : workers_) {
    const int64_t free = w.info.free_memory_bytes();
    const bool kept_elsewhere =
        !w.reserved_for.empty() && (job == nullptr || w.reserved_for != job->job.job_id());
    if (w.state == WorkerState::kIdle && !kept_elsewhere &&
        (job == nullptr ||
         (!Excluded(*job, id, w.info.name()) && job->benched.count(id) == 0)) &&
        (device.empty() || DeviceKind(w.info.device()) == device) &&
        (free == 0 || free >= memory_needed)) {
      idle.push_back(Candidate(w));
    }
  }
  std::sort(idle.begin(), idle.end(), [](const RankCandidate& a, const RankCandidate& b) {
    return a.registration_seq < b.registration_seq;
  });
  return idle;
}

void Core::Schedule(absl::Time now, Decisions* out) {
  // What follows costs the running and re-forming jobs and the head of the queue, never the
  // jobs queued behind it or the ones that ended.
  // 1. Jobs that lost members come first: they hold state and committed steps. (A copy: a job
  // that fails while re-forming leaves active_.)
  const std::vector<JobKey> active(active_.begin(), active_.end());
  for (const auto& [seq, id] : active) {
    JobRecord& job = jobs_.at(id);
    if (job.job.state() == v1::JOB_STATE_RECONFIGURING) TryReform(job, now, out);
  }
  // 2. Strict FIFO gang scheduling: the head job waits until its min_workers are idle, and
  // later jobs wait behind it so that a large job cannot starve (View says so for them).
  while (!pending_.empty()) {
    JobRecord& job = jobs_.at(pending_.begin()->second);
    const v1::JobSpec& spec = job.job.spec();
    std::vector<RankCandidate> left_out;
    const std::vector<RankCandidate> fitting =
        IdleWorkers(spec.device(), job.memory_needed, &job);
    const size_t fitting_count = fitting.size();
    std::vector<RankCandidate> idle = OneRankPerGpu({}, fitting, job.memory_needed, &left_out);
    if (static_cast<int64_t>(idle.size()) < spec.min_workers()) {
      const size_t all_idle = IdleWorkers(spec.device()).size();
      std::string reason =
          absl::StrCat("waiting for ", spec.min_workers(), " idle ", spec.device(), " worker",
                       spec.min_workers() == 1 ? "" : "s", " (", all_idle, " idle");
      if (all_idle > fitting_count) {
        absl::StrAppend(&reason, ", ", fitting_count, " with the ", HumanBytes(job.memory_needed),
                        " free that each worker needs");
      }
      reason += SharedGpuNote(left_out.size()) + ")";
      if (reason != job.job.reason()) {
        job.job.set_reason(reason);
        out->changed_jobs.insert(job.job.job_id());
      }
      break;  // nothing may overtake the head job
    }
    idle.resize(std::min<size_t>(idle.size(), spec.max_workers()));
    StartGeneration(job, AssignRanks({}, std::move(idle)), now, out);
  }
  // 3. Spares: a running job below max_workers grows onto idle workers, once its current
  // generation has completed a step (so every re-formation is followed by progress), and
  // never once it has trained its last step (there is nothing left to share).
  for (const auto& [seq, id] : active) {
    JobRecord& job = jobs_.at(id);
    if (job.job.state() != v1::JOB_STATE_RUNNING || !job.first_report_of_generation_seen ||
        static_cast<int>(job.members.size()) >= job.job.spec().max_workers() || job.finishing ||
        AnyMemberAtLastStep(job)) {
      continue;
    }
    std::vector<RankCandidate> idle =
        OneRankPerGpu(MemberCandidates(job), IdleWorkers(job.job.spec().device(),
                                                         job.memory_needed, &job),
                      job.memory_needed);
    if (idle.empty()) continue;
    std::vector<std::string> names;
    for (size_t i = 0; i < idle.size() &&
                       job.members.size() + i < static_cast<size_t>(job.job.spec().max_workers());
         ++i) {
      names.push_back(workers_.at(idle[i].worker_id).info.name());
    }
    BeginReconfiguration(job, absl::StrCat("scale-up: ", absl::StrJoin(names, ", "), " joined"),
                         /*scale_up=*/true, /*coordinator_caused=*/false, now, now, out);
    TryReform(job, now, out);
  }
}

void Core::StartGeneration(JobRecord& job, std::vector<std::string> worker_ids, absl::Time now,
                           Decisions* out) {
  // The workers kept for the job are in this generation now, or free for other jobs.
  ReleaseReserved(job, /*job_ended=*/false, "", out);
  const int64_t generation = job.job.generation() + 1;
  job.job.set_generation(generation);
  job.members.clear();
  std::vector<std::string> names;
  for (const std::string& id : worker_ids) {
    job.members.push_back({id});
    names.push_back(workers_.at(id).info.name());
  }
  if (job.started == absl::InfinitePast()) {
    job.started = now;
    job.job.set_start_time_unix_ms(ToUnixMillisOrZero(now));
  }
  job.last_advance = now;
  job.first_report_of_generation_seen = false;
  job.resumed_report_seen = false;
  out->started_generations.push_back(
      {job.job.job_id(), generation, static_cast<int>(worker_ids.size())});
  SetState(job, v1::JOB_STATE_RUNNING);
  job.job.set_reason(absl::StrCat("generation ", generation, " training on ", worker_ids.size(),
                                  " worker", worker_ids.size() == 1 ? "" : "s"));
  // Every member's assignment is this one but for its rank.
  v1::CoordinatorMessage assignment;
  {
    v1::Assignment* a = assignment.mutable_assignment();
    a->set_job_id(job.job.job_id());
    a->set_generation(generation);
    a->set_world_size(static_cast<int32_t>(worker_ids.size()));
    *a->mutable_spec() = job.job.spec();
    // The names are for logs and errors: a bounded few, so N assignments stay O(N) in all.
    for (size_t i = 0; i < names.size() && i < kMaxAssignmentNames; ++i) {
      a->add_member_names(names[i]);
    }
    a->set_start_step(job.job.step() + 1);
    a->set_source_rank(-1);
  }
  // Ranks per GPU: a member shares its GPU's memory with the others on it.
  absl::flat_hash_map<std::string_view, int32_t> ranks_on_gpu;
  for (const std::string& id : worker_ids) {
    const std::string& uuid = workers_.at(id).info.device_uuid();
    if (!uuid.empty()) ++ranks_on_gpu[uuid];
  }
  for (size_t rank = 0; rank < worker_ids.size(); ++rank) {
    Worker& w = workers_.at(worker_ids[rank]);
    w.state = WorkerState::kBusy;
    w.job_id = job.job.job_id();
    w.generation = generation;
    out->messages.push_back({w.id, assignment});
    v1::Assignment* mine = out->messages.back().message.mutable_assignment();
    mine->set_rank(static_cast<int32_t>(rank));
    const std::string& uuid = w.info.device_uuid();
    mine->set_ranks_on_device(uuid.empty() ? 1 : ranks_on_gpu.at(uuid));
  }
  RefreshMembers(job);
  // The timeline: who joined and who left since the previous generation, by worker id (a
  // worker back under its old name is a new incarnation), or by name when the previous
  // generation was a previous coordinator's.
  const bool by_name = job.timeline_ids_stale;
  job.timeline_ids_stale = false;
  const std::vector<std::string>& keys = by_name ? names : worker_ids;
  absl::flat_hash_set<std::string_view> before, after(keys.begin(), keys.end());
  if (job.job.generations_size() > 0) {
    EndGeneration(job, "re-formed", now);
    const v1::Generation& previous = *job.job.generations().rbegin();
    const auto& previous_keys = by_name ? previous.members() : previous.member_ids();
    before.insert(previous_keys.begin(), previous_keys.end());
  }
  v1::Generation* record = job.job.add_generations();
  record->set_generation(generation);
  record->set_formed_unix_ms(ToUnixMillisOrZero(now));
  for (size_t rank = 0; rank < worker_ids.size(); ++rank) {
    record->add_member_ids(worker_ids[rank]);
    record->add_members(names[rank]);
    if (before.count(keys[rank]) == 0) record->add_joined(names[rank]);
  }
  if (job.job.generations_size() > 1) {
    const v1::Generation& previous = job.job.generations(job.job.generations_size() - 2);
    const auto& previous_keys = by_name ? previous.members() : previous.member_ids();
    for (int i = 0; i < previous.members_size() && i < previous_keys.size(); ++i) {
      if (after.count(previous_keys[i]) == 0) record->add_left(previous.members(i));
    }
  }
  // Bounded: a job that re-forms without end keeps its latest generations.
  int keep = 0;
  int64_t members_kept = 0;
  for (int i = job.job.generations_size() - 1; i >= 0; --i) {
    members_kept += job.job.generations(i).member_ids_size();
    if (keep >= 2 && (keep >= kMaxGenerations || members_kept > kMaxGenerationMembers)) break;
    ++keep;
  }
  if (job.job.generations_size() > keep) {
    job.job.mutable_generations()->DeleteSubrange(0, job.job.generations_size() - keep);
  }
  AddEvent(job, v1::JobEvent::STATE, "running", now, out);
  // Names the first kMaxAssignmentNames members: an event stays O(1) whatever the size (the
  // generation's record above lists them all).
  const size_t named = std::min(names.size(), kMaxAssignmentNames);
  AddEvent(job, v1::JobEvent::MEMBERSHIP,
           absl::StrCat("generation ", generation, " formed: ",
                        absl::StrJoin(names.begin(), names.begin() + named, ", "),
                        named < names.size() ? absl::StrCat(" and ", names.size() - named, " more")
                                             : "",
                        " (", names.size(), " worker", names.size() == 1 ? "" : "s", ")"),
           now, out);
}

int64_t Core::MaxRestarts(const JobRecord& job) const {
  return job.job.spec().has_max_restarts() ? job.job.spec().max_restarts() : 10;
}

void Core::EraseMember(JobRecord& job, const std::string& worker_id) {
  job.members.erase(std::remove_if(job.members.begin(), job.members.end(),
                                   [&](const MemberState& m) { return m.worker_id == worker_id; }),
                    job.members.end());
}

absl::Time Core::ReformAfter(const std::string& worker_id, bool fatal, absl::Time now) const {
  // After a reported collective error give the culprit a moment to be detected (its stream
  // closes within milliseconds when it died), so the next generation does not include it.
  // After a fatal report, the others' reports of the same error come first (see
  // CoreOptions::fatal_report_grace).
  return worker_id.empty() ? now + absl::Milliseconds(300)
         : fatal           ? now + options_.fatal_report_grace
                           : now;
}

void Core::HandleMemberLoss(JobRecord& job, const std::string& worker_id, const std::string& reason,
                            bool fatal, absl::Time now, Decisions* out) {
  if (IsTerminal(job.job.state())) return;
  AddEvent(job, v1::JobEvent::MEMBERSHIP, reason, now, out);
  if (fatal) {
    job.excluded.insert(worker_id);
    if (const Worker* w = FindWorker(worker_id)) job.excluded_names.insert(w->info.name());
    if (job.fatal_reports.size() < 4) job.fatal_reports.push_back(reason);
    const bool others_left = std::any_of(job.members.begin(), job.members.end(),
                                         [&](const MemberState& m) { return m.worker_id != worker_id; });
    if (!others_left) {
      // Nobody left who could train on: every member of the generation said the same, or the
      // job had this one member.
      return FinishJob(job, v1::JOB_STATE_FAILED, FatalReason(job, reason), now, out);
    }
    job.reforming_after_fatal = true;
    // The reporter dropped its run: free it for other jobs (never this one again).
    if (Worker* w = FindWorker(worker_id); w != nullptr && w->job_id == job.job.job_id()) {
      if (w->state == WorkerState::kBusy) w->state = WorkerState::kIdle;
      w->job_id.clear();
      w->generation = 0;
    }
    // From here on like the loss of the reporter.
  }
  // After the last step (every member but the lost one has completed it, or the generation only
  // finishes) the job is never trained again; it finishes. A lone Finished, true or forged,
  // before the others reach the last step decides nothing: the job re-forms below like after
  // any loss, without it.
  if (job.job.state() == v1::JOB_STATE_RUNNING && (job.finishing || AtLastStep(job, worker_id))) {
    return HandleLossAfterLastStep(job, worker_id, reason, fatal, now, out);
  }
  if (job.job.state() == v1::JOB_STATE_RECONFIGURING) {
    // Lost while re-forming: drop it from the survivors and carry on with the same recovery.
    EraseMember(job, worker_id);
    RefreshMembers(job);
    return TryReform(job, now, out);
  }
  // Losses the coordinator's own absence caused are recovered, but not charged to the job; nor
  // is a fatal report (the reporter leaves the job for good); nor a worker's loss beyond its
  // own kMaxChargesPerWorker (it leaves the job instead); nor a failure whose culprit took no
  // part in the generation (LeaveOutSilentMembers).
  const bool coordinator_caused = CoordinatorWasAway(now);
  bool charged = !coordinator_caused && !fatal;
  std::string why_not_charged;
  if (charged && !worker_id.empty()) {
    if (const Worker* w = FindWorker(worker_id); w != nullptr && !ChargeWorker(job, *w)) {
      charged = false;
      why_not_charged = absl::StrCat("; ", w->info.name(), " was lost ", kMaxChargesPerWorker,
                                     " times before in this job: no longer one of its members, "
                                     "and not counted");
    }
  }
  if (charged && worker_id.empty() && LeaveOutSilentMembers(job, reason, &why_not_charged, out)) {
    charged = false;
  }
  if (charged && job.job.recoveries() >= MaxRestarts(job)) {
    return FinishJob(job, v1::JOB_STATE_FAILED,
                     absl::StrCat(reason, " (max_restarts ", MaxRestarts(job),
                                  job.job.recoveries() > 0 ? " used up)" : ": recovery disabled)"),
                     now, out);
  }
  EraseMember(job, worker_id);
  if (charged) job.job.set_recoveries(job.job.recoveries() + 1);
  BeginReconfiguration(job,
                       coordinator_caused
                           ? absl::StrCat(reason, " (the coordinator had been unresponsive for ",
                                          Seconds1(last_absence_), "; not counted)")
                           : reason + why_not_charged,
                       /*scale_up=*/false, coordinator_caused, ReformAfter(worker_id, fatal, now),
                       now, out);
  TryReform(job, now, out);
}

void Core::HandleLossAfterLastStep(JobRecord& job, const std::string& worker_id,
                                   const std::string& reason, bool fatal, absl::Time now,
                                   Decisions* out) {
  const auto lost = std::find_if(job.members.begin(), job.members.end(),
                                 [&](const MemberState& m) { return m.worker_id == worker_id; });
  const bool lost_finished = lost != job.members.end() && lost->finished;
  // At least one other member, and every other one finished (a lone member's loss leaves no
  // result to stand).
  const bool others_finished =
      !worker_id.empty() &&
      std::any_of(job.members.begin(), job.members.end(),
                  [&](const MemberState& m) { return m.worker_id != worker_id; }) &&
      std::all_of(job.members.begin(), job.members.end(), [&](const MemberState& m) {
        return m.finished || m.worker_id == worker_id;
      });
  if (lost_finished) {
    // Its report stands (it came from a member); the others are past every collective it took
    // part in and finish without it.
    if (others_finished) {
      FinishAgreed(job, /*except=*/"", absl::StrCat("; ", reason, " after it finished"), now, out);
    }
    return;
  }
  if (others_finished && !CoordinatorWasAway(now)) {
    // Lost before it reported (rank 0 writing the sample or the export, say): the others' result
    // stands, and what only rank 0 writes says it was not written. (A loss the coordinator's own
    // absence caused is no reason to go without them: the members come back holding the final
    // state, and the finishing generation below writes them.)
    return FinishAgreed(job, /*except=*/worker_id,
                        absl::StrCat("; ", reason, " after the last step"), now, out);
  }
  // The others may wait in an evaluation's collective with it: they form the next generation by
  // themselves, which heals from their memory, trains nothing and finishes. Bounded like any
  // recovery (a generation whose evaluation fails every time must not re-form for ever); a fatal
  // report is its reporter's own here too.
  const bool coordinator_caused = CoordinatorWasAway(now);
  const bool charged = !coordinator_caused && !fatal;
  if (charged && job.job.recoveries() >= MaxRestarts(job)) {
    return FinishJob(job, v1::JOB_STATE_FAILED,
                     absl::StrCat(reason, " after the last step (max_restarts ", MaxRestarts(job),
                                  " used up)"),
                     now, out);
  }
  job.finishing = true;
  EraseMember(job, worker_id);
  if (charged) job.job.set_recoveries(job.job.recoveries() + 1);
  BeginReconfiguration(job,
                       absl::StrCat(reason, " after the last step (the members that hold the "
                                            "final state finish the job)"),
                       /*scale_up=*/false, coordinator_caused, ReformAfter(worker_id, fatal, now),
                       now, out);
  TryReform(job, now, out);
}

bool Core::LeaveOutSilentMembers(JobRecord& job, const std::string& reason, std::string* why,
                                 Decisions* out) {
  // Nobody is known to be at fault, but a member that took no part at all in a generation where
  // the others did (it never wrote to the generation's store, never reported) is what the
  // others waited for: it is left out of the next generation, and the failure is its own.
  std::vector<std::string> names;
  for (const std::string& id : SilentMembers(job)) {
    Worker* w = FindWorker(id);
    if (w == nullptr) continue;
    names.push_back(w->info.name());
    if (ChargeWorker(job, *w) && job.charges[w->info.name()] == kMaxChargesPerWorker) {
      job.excluded_names.insert(w->info.name());
    }
    job.benched.insert(id);
    PushAbort(job, id, absl::StrCat(reason, "; this worker took no part in the generation"), out);
    w->state = WorkerState::kIdle;
    w->job_id.clear();
    w->generation = 0;
    EraseMember(job, id);
  }
  if (names.empty()) return false;
  *why = absl::StrCat("; left out, not counted: ", absl::StrJoin(names, ", "),
                      " took no part in the generation while the others did");
  return true;
}

void Core::PushAbort(const JobRecord& job, const std::string& worker_id, const std::string& reason,
                     Decisions* out, bool job_ended) {
  out->messages.push_back(
      {worker_id, AbortMessage(job.job.job_id(), job.job.generation(), reason, job_ended)});
}

void Core::BeginReconfiguration(JobRecord& job, const std::string& reason, bool scale_up,
                                bool coordinator_caused, absl::Time reform_after, absl::Time now,
                                Decisions* out) {
  for (const MemberState& m : job.members) {
    Worker* w = FindWorker(m.worker_id);
    if (w == nullptr || w->state != WorkerState::kBusy) continue;
    PushAbort(job, w->id, reason, out);
  }
  out->ended_generations.emplace_back(job.job.job_id(), job.job.generation());
  EndGeneration(job, reason, now);
  v1::Recovery* r = job.job.add_recovery_history();
  r->set_from_generation(job.job.generation());
  r->set_reason(reason);
  r->set_scale_up(scale_up);
  r->set_coordinator_caused(coordinator_caused);
  r->set_detect_unix_ms(ToUnixMillisOrZero(now));
  r->set_step_at_detection(job.job.step());
  r->set_source_rank(-1);
  job.open_recovery = job.job.recovery_history_size() - 1;
  job.reform_after = reform_after;
  job.reconfigure_since = now;
  SetState(job, v1::JOB_STATE_RECONFIGURING);
  job.job.set_reason(absl::StrCat("re-forming: ", reason));
  RefreshMembers(job);
  AddEvent(job, v1::JobEvent::STATE, job.job.reason(), now, out);
}

std::string Core::FatalReason(const JobRecord& job, const std::string& last) const {
  std::vector<std::string> earlier;
  for (const std::string& r : job.fatal_reports) {
    if (r != last) earlier.push_back(r);
  }
  return earlier.empty() ? last
                         : absl::StrCat(last, " (before it, ", absl::StrJoin(earlier, "; "), ")");
}

std::vector<RankCandidate> Core::MemberCandidates(const JobRecord& job) const {
  std::vector<RankCandidate> members;
  for (const MemberState& m : job.members) {
    auto it = workers_.find(m.worker_id);
    if (it != workers_.end() && it->second.state == WorkerState::kBusy &&
        it->second.job_id == job.job.job_id()) {
      members.push_back(Candidate(it->second));
    }
  }
  return members;
}

void Core::TryReform(JobRecord& job, absl::Time now, Decisions* out) {
  if (now < job.reform_after) return;
  const v1::JobSpec& spec = job.job.spec();
  if (now < job.restart_grace_until && !PreviousMembersBack(job)) {
    size_t back = 0;
    for (const std::string& name : job.previous_names) back += live_names_.count(name);
    const std::string reason = absl::StrCat(
        "waiting up to ", Seconds1(job.restart_grace_until - job.reconfigure_since),
        " for the members of its last generation to register again after the coordinator "
        "restarted (", back, " of ", job.previous_names.size(), " back)");
    if (reason != job.job.reason()) {
      job.job.set_reason(reason);
      out->changed_jobs.insert(job.job.job_id());
    }
    return;
  }
  if (job.finishing) {
    // Only the workers that hold the final state: the survivors, or after a restart those that
    // came back with it. Spares would only be healed to that state; min_workers no longer
    // matters, as nothing is trained.
    std::vector<RankCandidate> survivors = MemberCandidates(job);
    std::vector<RankCandidate> back;
    if (survivors.empty()) {
      for (const std::string& id : job.reserved) {
        const Worker* w = FindWorker(id);
        if (w != nullptr && w->state == WorkerState::kIdle && job.job.total_steps() > 0 &&
            w->held_step >= job.job.total_steps()) {
          back.push_back(Candidate(*w));
        }
      }
    }
    if (!survivors.empty() || !back.empty()) {
      StartGeneration(job, AssignRanks(survivors, std::move(back)), now, out);
      if (job.open_recovery >= 0) {
        v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
        r->set_to_generation(job.job.generation());
        r->set_reformed_unix_ms(ToUnixMillisOrZero(now));
      }
      return;
    }
    // Nobody is known to hold the final state any more: the job recovers like any other, with
    // min_workers, healing from what its members hold (else from its last checkpoint).
    job.finishing = false;
    AddEvent(job, v1::JobEvent::MEMBERSHIP,
             "no worker is known to hold the state of the last step: the job re-forms with "
             "min_workers and heals from what its members hold, else from its last checkpoint",
             now, out);
  }
  const std::vector<RankCandidate> survivors = MemberCandidates(job);
  std::vector<RankCandidate> left_out;
  std::vector<RankCandidate> idle = OneRankPerGpu(
      survivors, IdleWorkers(spec.device(), job.memory_needed, &job), job.memory_needed, &left_out);
  if (static_cast<int64_t>(survivors.size() + idle.size()) < spec.min_workers() &&
      !job.benched.empty()) {
    // Without the members left out for silence the job cannot re-form: they were slow, not
    // absent (their charge stands), and the job must not wait beside them.
    job.benched.clear();
    left_out.clear();
    idle = OneRankPerGpu(survivors, IdleWorkers(spec.device(), job.memory_needed, &job),
                         job.memory_needed, &left_out);
  }
  const size_t room = static_cast<size_t>(spec.max_workers()) -
                      std::min<size_t>(survivors.size(), spec.max_workers());
  idle.resize(std::min(idle.size(), room));
  if (static_cast<int64_t>(survivors.size() + idle.size()) < spec.min_workers()) {
    if (job.reforming_after_fatal) {
      // Without the workers that reported a fatal error the job could not re-form even once
      // every other worker of its device is free: it fails with their reports, instead of
      // waiting for workers that do not exist.
      int64_t could = 0;
      for (const auto& [id, w] : workers_) {
        could += w.state != WorkerState::kLost && !Excluded(job, id, w.info.name()) &&
                 (spec.device().empty() || DeviceKind(w.info.device()) == spec.device());
      }
      if (could < spec.min_workers()) {
        return FinishJob(job, v1::JOB_STATE_FAILED,
                         absl::StrCat(FatalReason(job, job.fatal_reports.back()),
                                      "; without it the job cannot re-form (min_workers ",
                                      spec.min_workers(), ", ", could, " other worker",
                                      could == 1 ? "" : "s", " of its device)"),
                         now, out);
      }
    }
    std::string reason =
        absl::StrCat("waiting for ", spec.min_workers(), " workers to re-form (", survivors.size(),
                     " survivor", survivors.size() == 1 ? "" : "s", ", ", idle.size(), " idle",
                     SharedGpuNote(left_out.size()), ")");
    if (reason != job.job.reason()) {
      job.job.set_reason(reason);
      out->changed_jobs.insert(job.job.job_id());
    }
    return;
  }
  job.reforming_after_fatal = false;
  // Those kept for the job (after a coordinator restart) come first: they hold its state.
  std::stable_partition(idle.begin(), idle.end(), [&](const RankCandidate& c) {
    return job.reserved.count(c.worker_id) > 0;
  });
  StartGeneration(job, AssignRanks(survivors, std::move(idle)), now, out);
  if (job.open_recovery >= 0) {
    v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
    r->set_to_generation(job.job.generation());
    r->set_reformed_unix_ms(ToUnixMillisOrZero(now));
  }
}

void Core::FinishJob(JobRecord& job, v1::JobState state, const std::string& reason, absl::Time now,
                     Decisions* out) {
  // A job that succeeded keeps its members, and their trained state, until the shell has saved
  // its end (JobEndRecorded): a coordinator lost before that finishes the job from them. Any
  // other end stops the members now, and they may drop what they keep for the job.
  const bool succeeded = state == v1::JOB_STATE_SUCCEEDED;
  for (const MemberState& m : job.members) {
    Worker* w = FindWorker(m.worker_id);
    if (succeeded || w == nullptr || w->job_id != job.job.job_id()) continue;
    if (w->state == WorkerState::kBusy) {
      PushAbort(job, w->id, reason, out, /*job_ended=*/true);
      w->state = WorkerState::kIdle;
    }
    w->job_id.clear();
    w->generation = 0;
  }
  if (succeeded) {
    job.end_recorded = false;
    out->ends_to_record.push_back(job.job.job_id());
  } else {
    ReleaseReserved(job, /*job_ended=*/true, reason, out);
  }
  job.finishing = false;
  if (job.job.generation() > 0) {
    out->ended_generations.emplace_back(job.job.job_id(), job.job.generation());
  }
  EndGeneration(job, reason, now);
  SetState(job, state);
  job.job.set_reason(reason);
  job.job.set_end_time_unix_ms(ToUnixMillisOrZero(now));
  job.job.set_eta_ms(0);
  RefreshMembers(job);
  AddEvent(job, v1::JobEvent::STATE, reason, now, out);
  Schedule(now, out);
}

void Core::JobEndRecorded(const std::string& job_id, absl::Time now, Decisions* out) {
  ObserveTime(now);
  JobRecord* job = FindJob(job_id);
  if (job == nullptr || job->end_recorded || !IsTerminal(job->job.state())) return;
  job->end_recorded = true;
  for (const MemberState& m : job->members) {
    Worker* w = FindWorker(m.worker_id);
    if (w == nullptr || w->job_id != job_id) continue;
    if (w->state == WorkerState::kBusy) {
      PushAbort(*job, w->id, job->job.reason(), out, /*job_ended=*/true);
      w->state = WorkerState::kIdle;
    }
    w->job_id.clear();
    w->generation = 0;
  }
  ReleaseReserved(*job, /*job_ended=*/true, job->job.reason(), out);
  Schedule(now, out);
}

void Core::EndGeneration(JobRecord& job, const std::string& reason, absl::Time now) {
  if (job.job.generations_size() == 0) return;
  v1::Generation* last = job.job.mutable_generations(job.job.generations_size() - 1);
  if (last->ended_unix_ms() != 0) return;
  last->set_ended_unix_ms(ToUnixMillisOrZero(now));
  last->set_end_reason(reason);
}

void Core::RefreshMembers(JobRecord& job) {
  job.job.clear_members();
  for (size_t rank = 0; rank < job.members.size(); ++rank) {
    const MemberState& m = job.members[rank];
    v1::Member* member = job.job.add_members();
    member->set_worker_id(m.worker_id);
    if (const Worker* w = FindWorker(m.worker_id)) {
      member->set_worker_name(w->info.name());
      member->set_host(w->info.host());
    }
    member->set_rank(static_cast<int32_t>(rank));
    member->set_step(m.step);
    member->set_parameter_checksum(m.checksum);
    member->set_peak_memory_bytes(m.peak_memory_bytes);
  }
}

void Core::AddEvent(JobRecord& job, v1::JobEvent::Kind kind, const std::string& message,
                    absl::Time now, Decisions* out) {
  v1::JobEvent event;
  event.set_kind(kind);
  event.set_time_unix_ms(ToUnixMillisOrZero(now));
  event.set_message(message);
  event.set_sequence(job.next_sequence++);
  if (IsTerminal(job.job.state())) {
    *event.mutable_job() = job.job;  // the result, whole: once per job
  } else {
    SnapshotForEvent(job.job, event.mutable_job());
  }
  job.events.push_back(std::move(event));
  while (job.events.size() > options_.max_events_per_job) job.events.pop_front();
  out->changed_jobs.insert(job.job.job_id());
}

void Core::SnapshotForEvent(v1::Job& job, v1::Job* snapshot) {
  // What grows with the members, the restarts or the evaluations is set aside while the rest
  // is copied (and put back as it was, present or absent), so an event costs the same whatever
  // the job's size.
  std::unique_ptr<v1::JobSpec> spec(job.has_spec() ? job.release_spec() : nullptr);
  std::unique_ptr<v1::Sample> sample(job.has_sample() ? job.release_sample() : nullptr);
  google::protobuf::RepeatedPtrField<v1::Member> members;
  google::protobuf::RepeatedPtrField<v1::Recovery> recoveries;
  google::protobuf::RepeatedPtrField<v1::ValidationPoint> validations;
  google::protobuf::RepeatedPtrField<v1::Generation> generations;
  members.Swap(job.mutable_members());
  recoveries.Swap(job.mutable_recovery_history());
  validations.Swap(job.mutable_validation_history());
  generations.Swap(job.mutable_generations());
  *snapshot = job;
  if (spec != nullptr) snapshot->mutable_spec()->set_name(spec->name());
  if (!validations.empty()) *snapshot->add_validation_history() = *validations.rbegin();
  members.Swap(job.mutable_members());
  recoveries.Swap(job.mutable_recovery_history());
  validations.Swap(job.mutable_validation_history());
  generations.Swap(job.mutable_generations());
  if (spec != nullptr) job.set_allocated_spec(spec.release());
  if (sample != nullptr) job.set_allocated_sample(sample.release());
}

void Core::PruneLostWorkers() {
  if (lost_workers_ < 2 * std::max<size_t>(options_.max_lost_workers, 1)) return;
  std::vector<const Worker*> lost;
  for (const auto& [id, w] : workers_) {
    if (w.state == WorkerState::kLost) lost.push_back(&w);
  }
  std::sort(lost.begin(), lost.end(), [](const Worker* a, const Worker* b) {
    return a->registration_seq < b->registration_seq;
  });
  std::vector<std::string> drop;
  for (size_t i = 0; i + options_.max_lost_workers < lost.size(); ++i) drop.push_back(lost[i]->id);
  for (const std::string& id : drop) workers_.erase(id);
  lost_workers_ -= drop.size();
}

}  // namespace lockstep::coordinator
