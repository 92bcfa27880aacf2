// Jobs: admission (validation, memory), submission, restore, cancel, the state and the view
// of a job, its listing and counts, its event history (AddEvent, EventsSince) and its end.
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
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

using internal::DeviceKind;
using internal::Seconds1;

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
  LOCKSTEP_RETURN_IF_ERROR(ValidateJobSpec(spec));
  LOCKSTEP_RETURN_IF_ERROR(CheckJobPaths(spec, options_.data_roots, options_.checkpoint_roots));
  // With gradient accumulation a worker needs room for one micro-batch, not its whole share.
  const MemoryEstimate memory = EstimateWorkerMemory(spec, MinMicroBatch(spec));
  LOCKSTEP_RETURN_IF_ERROR(CheckMemoryFits(memory, spec.device()));
  JobRecord record;
  record.memory_needed = memory.total();
  const std::string id = absl::StrCat(
      "job-", next_job_seq_++, options_.job_id_suffix.empty() ? "" : "-", options_.job_id_suffix);
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
      // Time suspended does not count against max_wall_time_ms.
      record.started = absl::FromUnixMillis(record.job.start_time_unix_ms()) +
                       absl::Milliseconds(record.job.suspended_ms());
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
    if (job.job.state() == v1::JOB_STATE_SUSPENDED) {
      // Its holders tell whether they still keep its state when they register again: it waits
      // for them as long as a running job waits for its members.
      job.restart_grace_until = now + options_.restart_grace;
      SetState(job, v1::JOB_STATE_SUSPENDED);
      AddEvent(job, v1::JobEvent::STATE, "coordinator restarted; still suspended", now, out);
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
    const bool trained_on = job.job.state() == v1::JOB_STATE_RUNNING && !job.finishing &&
                            job.job.generations_size() > 0 &&
                            job.job.generations().rbegin()->ended_unix_ms() == 0 &&
                            job.job.generations().rbegin()->generation() == job.job.generation() &&
                            !job.previous_names.empty() &&
                            static_cast<int>(job.previous_names.size()) ==
                                job.job.generations().rbegin()->members_size();
    if (trained_on) {
      // Its group may train on without the coordinator (adoption.cc): kept if every member
      // comes back training it.
      job.adopt_generation = job.job.generation();
      job.restored_at = now;
      job.reform_after = now;
      job.reconfigure_since = now;
      SetState(job, v1::JOB_STATE_RECONFIGURING);
      RefreshMembers(job);
      AddEvent(job, v1::JobEvent::STATE,
               absl::StrCat("coordinator restarted; waiting for generation ", job.adopt_generation,
                            "'s members, which may train on"),
               now, out);
      continue;
    }
    BeginReconfiguration(job, "coordinator restarted", /*scale_up=*/false,
                         /*coordinator_caused=*/true, /*counted=*/false, now, now, out);
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

const Core::JobRecord* Core::QueueHead() const {
  return pending_.empty() ? nullptr : &jobs_.at(std::get<2>(*pending_.begin()));
}

void Core::AgeQueue(absl::Time now) {
  while (!aging_deadlines_.empty() && aging_deadlines_.begin()->first <= now) {
    JobRecord& job = jobs_.at(aging_deadlines_.begin()->second);
    const absl::Time due = aging_deadlines_.begin()->first;
    aging_deadlines_.erase(aging_deadlines_.begin());
    pending_.erase(QueueKeyOf(job));
    ++job.queue_priority;
    pending_.insert(QueueKeyOf(job));
    job.next_aging = absl::InfiniteFuture();
    if (job.queue_priority < kMaxPriority) {
      job.next_aging = due + options_.priority_aging;  // a long gap ages it by all of it
      aging_deadlines_.emplace(job.next_aging, job.job.job_id());
    }
  }
}

v1::Job Core::View(const JobRecord& job) const {
  v1::Job view = job.job;
  const JobRecord* head = QueueHead();
  if (view.state() == v1::JOB_STATE_PENDING && head != nullptr && head != &job) {
    view.set_reason(absl::StrCat("queued behind ", head->job.job_id(),
                                 job.queue_priority < head->queue_priority
                                     ? absl::StrCat(" (priority ", head->queue_priority, ")")
                                     : "",
                                 ", which is ", head->job.reason()));
  }
  if (view.state() == v1::JOB_STATE_PENDING && job.queue_priority != job.job.spec().priority()) {
    view.set_reason(absl::StrCat(view.reason(), "; priority ", job.queue_priority,
                                 " after waiting (declared ", job.job.spec().priority(), ")"));
  }
  return view;
}

void Core::SetState(JobRecord& job, v1::JobState state) {
  const JobKey key = KeyOf(job);
  if (job.pending_deadline != absl::InfiniteFuture()) {
    pending_deadlines_.erase({job.pending_deadline, job.job.job_id()});
    job.pending_deadline = absl::InfiniteFuture();
  }
  if (Queued(job)) pending_.erase(QueueKeyOf(job));
  if (job.job.state() == v1::JOB_STATE_SUSPENDED) suspended_.erase(job.job.job_id());
  if (job.next_aging != absl::InfiniteFuture()) {
    aging_deadlines_.erase({job.next_aging, job.job.job_id()});
    job.next_aging = absl::InfiniteFuture();
  }
  active_.erase(key);
  job.job.set_state(state);
  if (state == v1::JOB_STATE_PENDING) {
    // Queued at its declared priority; it ages from its submission (a job restored by a
    // restarted coordinator catches up on what it waited before at the next tick).
    job.queue_priority = job.job.spec().priority();
    pending_.insert(QueueKeyOf(job));
    if (options_.priority_aging > absl::ZeroDuration() && job.queue_priority < kMaxPriority) {
      job.next_aging = job.submitted + options_.priority_aging;
      aging_deadlines_.emplace(job.next_aging, job.job.job_id());
    }
    if (job.job.spec().rendezvous_timeout_ms() > 0) {
      job.pending_deadline =
          job.pending_since + absl::Milliseconds(job.job.spec().rendezvous_timeout_ms());
      pending_deadlines_.emplace(job.pending_deadline, job.job.job_id());
    }
  } else if (state == v1::JOB_STATE_SUSPENDED) {
    // Queued at its declared priority (it does not age: it has run), unless a user holds it.
    suspended_.insert(job.job.job_id());
    if (Queued(job)) {
      job.queue_priority = job.job.spec().priority();
      pending_.insert(QueueKeyOf(job));
    }
  } else if (!IsTerminal(state)) {
    active_.insert(key);
  }
}

absl::StatusOr<v1::ListJobsResponse> Core::ListJobs(const v1::ListJobsRequest& request) const {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_size is ", request.page_size(),
                                                   "; it must be 0 (the default, ",
                                                   kDefaultJobsPerPage, ") or more"));
  }
  // The token is the submission number of the previous page's last job: the page goes on
  // with older ones.
  uint64_t before = std::numeric_limits<uint64_t>::max();
  if (!request.page_token().empty() && (!absl::SimpleAtoi(request.page_token(), &before) ||
                                        before == 0 || before >= next_job_seq_)) {
    return absl::InvalidArgumentError(
        "page_token is not one this coordinator issued (pass a next_page_token of ListJobs)");
  }
  const size_t page_size = request.page_size() == 0
                               ? kDefaultJobsPerPage
                               : std::min(request.page_size(), kMaxJobsPerPage);
  v1::ListJobsResponse page;
  page.set_total_jobs(static_cast<int64_t>(order_.size()));
  size_t bytes = 0;
  if (request.queue()) {
    if (!request.page_token().empty()) {
      return absl::InvalidArgumentError("the queue is one page: it takes no page_token");
    }
    for (const auto& [priority, seq, id] : pending_) {
      const JobRecord& record = jobs_.at(id);
      const size_t size = record.job.ByteSizeLong();
      if (static_cast<size_t>(page.jobs_size()) == page_size ||
          (page.jobs_size() > 0 && bytes + size > kMaxJobsPageBytes)) {
        break;
      }
      bytes += size;
      v1::Job* view = page.add_jobs();
      *view = View(record);
      if (page.jobs_size() <= kPlannedQueueJobs) {
        // What it would take at the head now (each plan looks at every running job).
        const v1::JobSpec& spec = record.job.spec();
        const std::vector<RankCandidate> idle = OneRankPerGpu(
            {}, IdleWorkers(spec.device(), record.memory_needed, &record), record.memory_needed);
        if (static_cast<int64_t>(idle.size()) < spec.min_workers()) {
          view->set_would_preempt(DescribePlan(PlanPreemption(record, idle)));
        }
      }
    }
    return page;
  }
  uint64_t last = 0;
  for (auto it = std::make_reverse_iterator(order_.lower_bound({before, ""})); it != order_.rend();
       ++it) {
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
  return it->second.events.Since(from_sequence);
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
  // Its holders (suspended, or resumed without them) may drop the state they keep for it.
  std::vector<std::string> holders = std::move(job.parked_elsewhere);
  job.parked_elsewhere.clear();
  if (job.job.state() == v1::JOB_STATE_SUSPENDED) {
    holders.insert(holders.end(), job.job.suspension().holders().begin(),
                   job.job.suspension().holders().end());
    job.job.clear_suspension();
  }
  for (const std::string& name : holders) {
    auto it = live_names_.find(name);
    if (it == live_names_.end()) continue;
    const Worker& w = workers_.at(it->second);
    if (w.job_id == job.job.job_id()) continue;  // a member: told below (or once recorded)
    out->messages.push_back(
        {it->second, AbortMessage(job.job.job_id(), 0, reason, /*job_ended=*/true)});
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

void Core::AddEvent(JobRecord& job, v1::JobEvent::Kind kind, const std::string& message,
                    absl::Time now, Decisions* out) {
  v1::JobEvent event;
  event.set_kind(kind);
  event.set_time_unix_ms(ToUnixMillisOrZero(now));
  event.set_message(message);
  if (IsTerminal(job.job.state())) {
    *event.mutable_job() = job.job;  // the result, whole: once per job
  } else {
    SnapshotForEvent(job.job, event.mutable_job());
  }
  job.events.Add(std::move(event), options_.max_events_per_job);
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

}  // namespace lockstep::coordinator
