// A group that trained on without the coordinator. The coordinator is not on the step path:
// when it restarts (or another leader takes over), the workers whose group had trained a step
// keep training and register again saying which generation they train. A restored job that
// was RUNNING awaits its last generation's members for restart_grace: when every one of them
// is back training that generation, the generation is kept as it is (nothing aborted, nothing
// healed, no recovery recorded); otherwise the job re-forms as after any restart, and the
// members still training are aborted first (their state stays with them for the heal).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"

namespace lockstep::coordinator {

using internal::Seconds1;

void Core::NoteRunning(Worker& worker, absl::Time now, Decisions* out) {
  const v1::RunningGeneration& running = worker.info.running();
  const std::string& name = worker.info.name();
  // The restored job that awaits this worker's generation, if it is one of its members.
  JobRecord* awaiting = nullptr;
  if (auto it = awaited_names_.find(name); it != awaited_names_.end()) {
    awaiting = FindJob(it->second);
    if (awaiting != nullptr && awaiting->adopt_generation == 0) awaiting = nullptr;
  }
  if (running.job_id().empty()) {
    if (awaiting != nullptr) {
      GiveUpAdoption(*awaiting, absl::StrCat(name, " came back without its group training"), now,
                     out);
    }
    return;
  }
  JobRecord* job = FindJob(running.job_id());
  const int32_t rank = running.rank();
  if (job != nullptr && job == awaiting && running.generation() == job->adopt_generation &&
      rank >= 0 && static_cast<size_t>(rank) < job->previous_names.size() &&
      static_cast<size_t>(running.world_size()) == job->previous_names.size() &&
      job->previous_names[rank] == name && job->adopters.count(rank) == 0) {
    job->adopters[rank] = worker.id;
    return;
  }
  // Not a generation this coordinator keeps: it stops, and the worker keeps its state (for
  // the job's re-formation, or parked while the job is suspended), unless the job is over or
  // unknown.
  const bool ended = job == nullptr || (IsTerminal(job->job.state()) && job->end_recorded);
  const bool suspended = job != nullptr && job->job.state() == v1::JOB_STATE_SUSPENDED;
  std::string why;
  if (job == nullptr) {
    why = "this coordinator does not know the job";
  } else if (ended) {
    why = absl::StrCat("the job has ended (", v1::JobState_Name(job->job.state()), ")");
  } else {
    why = absl::StrCat("generation ", running.generation(), " is no longer live (",
                       suspended ? std::string("the job is suspended")
                       : job->job.state() == v1::JOB_STATE_RUNNING
                           ? absl::StrCat("the job trains generation ", job->job.generation())
                           : std::string("the job re-forms"),
                       ")");
  }
  out->messages.push_back({worker.id, AbortMessage(running.job_id(), running.generation(), why,
                                                   ended, suspended && !ended)});
  if (awaiting != nullptr) {
    GiveUpAdoption(
        *awaiting,
        absl::StrCat(name, " came back training ", running.job_id(), " generation ",
                     running.generation(), " as rank ", rank, " of ", running.world_size()),
        now, out);
  }
}

bool Core::TryAdopt(JobRecord& job, absl::Time now, Decisions* out) {
  const int64_t generation = job.adopt_generation;
  bool all_back = job.adopters.size() == job.previous_names.size();
  for (const auto& [rank, id] : job.adopters) {
    const Worker* w = FindWorker(id);
    all_back = all_back && w != nullptr && w->state == WorkerState::kIdle &&
               w->reserved_for == job.job.job_id();
  }
  if (!all_back) {
    if (now < job.restart_grace_until) {
      const std::string reason =
          absl::StrCat("waiting up to ", Seconds1(job.restart_grace_until - job.restored_at),
                       " for the members of generation ", generation,
                       " to register again after the coordinator restarted; they may train on (",
                       job.adopters.size(), " of ", job.previous_names.size(), " back training)");
      if (reason != job.job.reason()) {
        job.job.set_reason(reason);
        out->changed_jobs.insert(job.job.job_id());
      }
      return true;
    }
    GiveUpAdoption(job,
                   absl::StrCat(job.adopters.size(), " of its ", job.previous_names.size(),
                                " members came back training it within ",
                                Seconds1(job.restart_grace_until - job.restored_at)),
                   now, out);
    return false;
  }
  std::vector<std::string> ids;
  int64_t step = job.job.step();
  for (const auto& [rank, id] : job.adopters) {
    ids.push_back(id);
    step = std::max(step, workers_.at(id).info.running().step());
  }
  job.adopt_generation = 0;
  job.adopters.clear();
  // The members are in the generation again, no longer kept idle for it.
  ReleaseReserved(job, /*job_ended=*/false, "", out);
  job.members.clear();
  v1::Generation* last = job.job.mutable_generations(job.job.generations_size() - 1);
  last->clear_member_ids();
  for (const std::string& id : ids) {
    Worker& w = workers_.at(id);
    w.state = WorkerState::kBusy;
    w.job_id = job.job.job_id();
    w.generation = generation;
    w.held_step = -1;
    MemberState member;
    member.worker_id = id;
    member.step = w.info.running().step();
    job.members.push_back(std::move(member));
    last->add_member_ids(id);
  }
  job.timeline_ids_stale = false;
  job.job.set_step(step);
  job.last_advance = now;
  job.first_report_of_generation_seen = true;
  job.resumed_report_seen = true;
  out->started_generations.push_back({job.job.job_id(), generation, static_cast<int>(ids.size())});
  SetState(job, v1::JOB_STATE_RUNNING);
  job.job.set_reason(absl::StrCat("generation ", generation, " training on ", ids.size(), " worker",
                                  ids.size() == 1 ? "" : "s"));
  RefreshMembers(job);
  AddEvent(job, v1::JobEvent::STATE,
           absl::StrCat("coordinator restarted; generation ", generation,
                        " trained on without it (", ids.size(), " member",
                        ids.size() == 1 ? "" : "s", ", at step ", step, ") and is kept"),
           now, out);
  return true;
}

void Core::GiveUpAdoption(JobRecord& job, const std::string& why, absl::Time now, Decisions* out) {
  const int64_t generation = job.adopt_generation;
  if (generation == 0) return;
  job.adopt_generation = 0;
  const std::string reason =
      absl::StrCat("coordinator restarted; generation ", generation, " is not kept: ", why);
  for (const auto& [rank, id] : job.adopters) {
    const Worker* w = FindWorker(id);
    if (w == nullptr || w->state == WorkerState::kLost) continue;
    out->messages.push_back({id, AbortMessage(job.job.job_id(), generation, reason)});
  }
  job.adopters.clear();
  AddEvent(job, v1::JobEvent::MEMBERSHIP, reason, now, out);
  // Recorded as the restart's re-formation, from when the job was restored.
  BeginReconfiguration(job, "coordinator restarted", /*scale_up=*/false,
                       /*coordinator_caused=*/true, /*counted=*/false, now, now, out);
  job.reconfigure_since = job.restored_at;
  job.job.mutable_recovery_history(job.open_recovery)
      ->set_detect_unix_ms(ToUnixMillisOrZero(job.restored_at));
}

bool Core::AdoptedRunEnded(const std::string& worker_id, const std::string& job_id,
                           int64_t generation, const std::string& what, bool fatal, absl::Time now,
                           Decisions* out) {
  JobRecord* job = FindJob(job_id);
  if (job == nullptr || job->adopt_generation == 0 || job->adopt_generation != generation) {
    return false;
  }
  for (const auto& [rank, id] : job->adopters) {
    if (id != worker_id) continue;
    Worker& w = workers_.at(id);
    const std::string why = absl::StrCat(w.info.name(), " reported its run ", what);
    if (fatal) {
      // Its own error (its data, its device): never the job's member again, as for a member's
      // fatal report; the job re-forms without it.
      job->excluded.insert(id);
      job->excluded_names.insert(w.info.name());
      if (job->fatal_reports.size() < 4) job->fatal_reports.push_back(why);
      job->reserved.erase(id);
      w.reserved_for.clear();
      w.held_step = -1;
    }
    GiveUpAdoption(*job, why, now, out);
    return true;
  }
  return false;
}

}  // namespace lockstep::coordinator
