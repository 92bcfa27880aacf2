// What members report to the core: progress, failures, heals, checkpoints and their results;
// a job's result only from members that finished and agree (Disagreement, FinishAgreed).
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
#include "coordinator/core/agreement.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

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
    if (job.job.spec().has_program()) {
      // A program says where it resumed only by the step it reports first (from its own
      // checkpoint, or from the start): the job's step follows it.
      const int64_t resumed = std::max<int64_t>(0, report.step() - 1);
      job.job.set_step(resumed);
      if (job.open_recovery >= 0) {
        v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
        r->set_resumed_from_step(resumed);
        r->set_steps_redone(std::max<int64_t>(0, r->step_at_detection() - resumed));
        r->set_steps_redone_lower_bound(true);
        if (r->restore_detail().empty()) r->set_restore_detail(report.restore_detail());
      }
    }
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
      std::string message = job.job.total_steps() > 0
                                ? absl::StrCat("step ", job.job.step(), "/", job.job.total_steps())
                                : absl::StrCat("step ", job.job.step());
      if (evaluated) {
        absl::StrAppend(&message,
                        absl::StrFormat("; validation loss %.4f", report.eval().test_loss()));
        if (report.eval().bits_per_byte() > 0) {
          absl::StrAppend(&message,
                          absl::StrFormat(" (%.3f bits per byte)", report.eval().bits_per_byte()));
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
  if (AdoptedRunEnded(worker_id, report.job_id(), report.generation(),
                      absl::StrCat("failed: ", report.message()), report.fatal(), now, out)) {
    return absl::OkStatus();
  }
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
  if (report.has_program_exit()) {
    // A program's process failed: recorded (the latest few) for status, watch and the
    // dashboard. An exit code the spec names fatal fails the job at once; any other failure
    // re-forms the group like a collective error (the worker itself is healthy).
    JobRecord& job = **job_or;
    v1::ProgramExit* exit = job.job.add_program_exits();
    *exit = report.program_exit();
    exit->set_worker(worker->info.name());
    exit->set_generation(report.generation());
    exit->set_unix_ms(ToUnixMillisOrZero(now));
    constexpr int kKeptExits = 16;
    if (job.job.program_exits_size() > kKeptExits) {
      job.job.mutable_program_exits()->DeleteSubrange(0, job.job.program_exits_size() - kKeptExits);
    }
    out->changed_jobs.insert(job.job.job_id());
    if (report.fatal()) {
      AddEvent(job, v1::JobEvent::MEMBERSHIP, reason, now, out);
      FinishJob(job, v1::JOB_STATE_FAILED, reason, now, out);
      return absl::OkStatus();
    }
    // A process killed from outside (kill -9, the OOM killer; SIGTERM) was not brought down
    // by a peer's failure, and its worker is alive (it reports): the group re-forms at once.
    // An exit code may be a peer's death seen through a collective: the usual grace.
    const std::string& signal = report.program_exit().signal();
    HandleMemberLoss(job, /*worker_id=*/"", reason, /*fatal=*/false, now, out,
                     /*no_culprit_behind=*/signal == "SIGKILL" || signal == "SIGTERM");
    return absl::OkStatus();
  }
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
  if (AdoptedRunEnded(worker_id, report.job_id(), report.generation(), "finished",
                      /*fatal=*/false, now, out)) {
    return absl::OkStatus();
  }
  auto job_or = MemberJob(worker_id, report.job_id(), report.generation());
  if (!job_or.ok()) return job_or.status();
  JobRecord& job = **job_or;
  bool all_finished = true;
  for (MemberState& m : job.members) {
    if (m.worker_id == worker_id && !m.finished) {
      // Kept as reported: nothing of it is the job's until the members agree (FinishAgreed).
      m.finished = true;
      // (A program's exit carries no step: its member keeps the last one it reported.)
      m.step = job.job.spec().has_program() ? std::max(m.step, report.step()) : report.step();
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
  std::vector<FinishedResult> results;
  for (const MemberState& m : job.members) {
    if (m.worker_id == except || !m.finished) continue;
    const auto it = workers_.find(m.worker_id);
    results.push_back(
        {it == workers_.end() ? m.worker_id : it->second.info.name(), m.step, m.checksum, m.eval});
  }
  return coordinator::Disagreement(results);
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
    // (A program's members report no step of their own when they exit: its step stays the
    // last one it reported.)
    job.job.set_step(std::max(agreed->step, job.job.spec().has_program() ? job.job.step() : 0));
    if (!agreed->eval.empty()) job.job.mutable_eval()->ParseFromString(agreed->eval);
  }
  const MemberState* rank0 = !job.members.empty() && job.members.front().worker_id == rank0_id &&
                                     job.members.front().finished
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
  std::string reason =
      job.job.spec().has_program()
          ? absl::StrCat("the program exited 0 on all ", job.members.size(), " members",
                         job.job.step() > 0
                             ? absl::StrCat(" (last reported step ", job.job.step(), ")")
                             : "")
          : absl::StrCat("trained ", job.job.step(), " steps");
  if (job.job.has_eval() && IsLanguageModel(job.job.spec().model())) {
    absl::StrAppend(&reason, absl::StrFormat("; validation loss %.4f", job.job.eval().test_loss()));
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
    r->set_restored_from(report.restored_from());
    r->set_restore_detail(report.restore_detail());
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

void Core::CloseRecovery(JobRecord& job, absl::Time now, const std::string& note, Decisions* out) {
  if (job.open_recovery < 0) return;
  v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
  r->set_first_step_unix_ms(ToUnixMillisOrZero(now));
  std::string source =
      r->restored_from().empty()
          ? absl::StrFormat("source rank %d, heal %d ms", r->source_rank(), r->heal_ms())
          : absl::StrFormat("restored from %s in %d ms", r->restored_from(), r->heal_ms());
  if (!r->restore_detail().empty()) absl::StrAppend(&source, ": ", r->restore_detail());
  AddEvent(
      job, v1::JobEvent::MEMBERSHIP,
      absl::StrFormat("generation %d resumed after step %d (%s, %d ms "
                      "after detection, %s%d steps redone)%s",
                      r->to_generation(), r->resumed_from_step(), source,
                      r->first_step_unix_ms() - r->detect_unix_ms(),
                      r->steps_redone_lower_bound() ? "at least " : "", r->steps_redone(), note),
      now, out);
  job.open_recovery = -1;
  // A resumed job has trained a step: the holders it resumed without may drop its state.
  for (const std::string& name : job.parked_elsewhere) {
    const auto live = live_names_.find(name);
    const Worker* w = live == live_names_.end() ? nullptr : FindWorker(live->second);
    if (w == nullptr || (w->state == WorkerState::kBusy && w->job_id == job.job.job_id())) {
      continue;
    }
    v1::CoordinatorMessage drop = AbortMessage(job.job.job_id(), 0, "it resumed on other workers");
    drop.mutable_abort()->set_drop_parked(true);
    out->messages.push_back({w->id, std::move(drop)});
  }
  job.parked_elsewhere.clear();
}

}  // namespace lockstep::coordinator
