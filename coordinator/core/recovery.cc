// Recovery: a member lost, a re-formation (with the members that remain, the members that
// come back after a coordinator restart, or more workers), the restart budget, and the end of
// a generation.
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
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

using internal::DeviceKind;
using internal::Seconds1;

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

bool Core::AnyMemberAtLastStep(const JobRecord& job) const {
  const int64_t total = job.job.total_steps();
  return std::any_of(job.members.begin(), job.members.end(), [&](const MemberState& m) {
    return m.finished || (total > 0 && m.step >= total);
  });
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
                            bool fatal, absl::Time now, Decisions* out, bool no_culprit_behind) {
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
  // (A program's failure names its member, and its members need not use the store at all.)
  if (charged && worker_id.empty() && !job.job.spec().has_program() &&
      LeaveOutSilentMembers(job, reason, &why_not_charged, out)) {
    charged = false;
  }
  if (charged && job.job.recoveries() >= MaxRestarts(job)) {
    return FinishJob(job, v1::JOB_STATE_FAILED,
                     absl::StrCat(reason, " (max_restarts ", MaxRestarts(job),
                                  job.job.recoveries() > 0 ? " used up)" : ": recovery disabled)"),
                     now, out);
  }
  EraseMember(job, worker_id);
  BeginReconfiguration(job,
                       coordinator_caused
                           ? absl::StrCat(reason, " (the coordinator had been unresponsive for ",
                                          Seconds1(last_absence_), "; not counted)")
                           : reason + why_not_charged,
                       /*scale_up=*/false, coordinator_caused, charged,
                       no_culprit_behind ? now : ReformAfter(worker_id, fatal, now), now, out);
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
  BeginReconfiguration(job,
                       absl::StrCat(reason, " after the last step (the members that hold the "
                                            "final state finish the job)"),
                       /*scale_up=*/false, coordinator_caused, charged,
                       ReformAfter(worker_id, fatal, now), now, out);
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
                     Decisions* out, bool job_ended, bool suspended) {
  out->messages.push_back({worker_id, AbortMessage(job.job.job_id(), job.job.generation(), reason,
                                                   job_ended, suspended)});
}

void Core::BeginReconfiguration(JobRecord& job, const std::string& reason, bool scale_up,
                                bool coordinator_caused, bool counted, absl::Time reform_after,
                                absl::Time now, Decisions* out) {
  if (counted) job.job.set_recoveries(job.job.recoveries() + 1);
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
  r->set_counted(counted);
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

void Core::TryReform(JobRecord& job, absl::Time now, Decisions* out) {
  if (now < job.reform_after) return;
  if (job.adopt_generation > 0 && TryAdopt(job, now, out)) return;
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

}  // namespace lockstep::coordinator
