// The core's registry of workers: registration (and what a returning worker holds), the
// reservation of idle workers for a job that awaits them, heartbeats and losses, a member's
// store activity, the charges against a worker, and the workers' listing.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "common/model_family.h"
#include "common/status_macros.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/eligibility.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

absl::Status ValidateRegistration(const v1::RegisterRequest& request) {
  const std::string& name = request.name();
  if (name.empty()) return absl::InvalidArgumentError("register.name: required");
  if (name.size() > kMaxWorkerNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("register.name: at most ", kMaxWorkerNameBytes, " bytes, got ", name.size()));
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
  LOCKSTEP_RETURN_IF_ERROR(ValidateRegistration(request));
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
  Worker& added = workers_.emplace(id, std::move(worker)).first->second;
  NoteHolder(added, now, out);
  ReserveOrRelease(added, out);
  NoteRunning(added, now, out);
  Schedule(now, out);
  return id;
}

void Core::ReserveOrRelease(Worker& worker, Decisions* out) {
  const v1::HeldState& held = worker.info.held();
  JobRecord* job = held.job_id().empty() ? nullptr : FindJob(held.job_id());
  HeldJob facts;
  facts.holds = !held.job_id().empty();
  facts.known = job != nullptr;
  facts.ended_recorded = job != nullptr && IsTerminal(job->job.state()) && job->end_recorded;
  facts.excluded = job != nullptr && Excluded(*job, worker.id, worker.info.name());
  auto drop = [&](const std::string& why) {
    out->messages.push_back({worker.id, AbortMessage(held.job_id(), 0, why, /*job_ended=*/true)});
  };
  switch (JudgeHeldState(facts)) {
    case HeldVerdict::kNone:
      break;
    case HeldVerdict::kDropUnknown:
      drop("this coordinator does not know the job");
      job = nullptr;
      break;
    case HeldVerdict::kDropEnded:
      drop(absl::StrCat("the job has ended (", v1::JobState_Name(job->job.state()), ")"));
      job = nullptr;
      break;
    case HeldVerdict::kDropExcluded:
      // Never this job's member again: its state is of no use, and it serves other jobs.
      drop("this worker is no longer one of the job's members");
      return;
    case HeldVerdict::kResume:
      // A suspended job's holder serves other jobs meanwhile (NoteHolder counts it).
      if (job->job.state() == v1::JOB_STATE_SUSPENDED) return;
      worker.held_step = held.step();
      break;
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
  job.adopt_generation = 0;
  job.adopters.clear();
}

bool Core::PreviousMembersBack(const JobRecord& job) const {
  for (const std::string& name : job.previous_names) {
    if (live_names_.count(name) == 0) return false;
  }
  return true;
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

void Core::MarkWorkerLost(Worker& worker, const std::string& reason, absl::Time now,
                          Decisions* out) {
  if (worker.state == WorkerState::kLost) return;
  const bool was_busy = worker.state == WorkerState::kBusy;
  worker.state = WorkerState::kLost;
  ++lost_workers_;
  live_names_.erase(worker.info.name());
  if (!worker.reserved_for.empty()) {
    if (JobRecord* job = FindJob(worker.reserved_for)) {
      job->reserved.erase(worker.id);
      // A member back training the awaited generation is gone: its group cannot go on.
      for (const auto& [rank, id] : job->adopters) {
        if (id != worker.id) continue;
        GiveUpAdoption(*job, reason, now, out);
        break;
      }
    }
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
