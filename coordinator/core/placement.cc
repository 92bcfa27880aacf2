// Placement: which idle workers a job may take (device, memory, GPU sharing), the queue's
// scheduling, and the start of a generation.
#include <algorithm>
#include <limits>
#include <optional>
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
#include "common/program.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/eligibility.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

using internal::DeviceKind;
using internal::Seconds1;

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

bool Core::RunsPrograms(const Worker& w) {
  const auto& caps = w.info.capabilities();
  return std::find(caps.begin(), caps.end(), kProgramCapability) != caps.end();
}

std::vector<RankCandidate> Core::IdleWorkers(const std::string& device, int64_t memory_needed,
                                             const JobRecord* job) const {
  std::vector<RankCandidate> idle;
  const std::string job_id = job == nullptr ? "" : job->job.job_id();
  const bool programs = job != nullptr && job->job.spec().has_program();
  for (const auto& [id, w] : workers_) {
    PlacementView view;
    view.idle = w.state == WorkerState::kIdle;
    view.reserved_for = w.reserved_for;
    view.excluded = job != nullptr && Excluded(*job, id, w.info.name());
    view.benched = job != nullptr && job->benched.count(id) > 0;
    view.device = DeviceKind(w.info.device());
    view.free_memory = w.info.free_memory_bytes();
    view.runs_programs = RunsPrograms(w);
    if (MayTakeRank(view, job_id, device, memory_needed, programs)) idle.push_back(Candidate(w));
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
  // 2. Gang scheduling in the queue's order (priority, aged; then first come first served):
  // the head job starts once its min_workers are idle, or once shrinking running jobs of a
  // lower priority frees them; later jobs wait behind it so that a large job cannot starve
  // (View says so for them).
  while (!pending_.empty()) {
    JobRecord& job = jobs_.at(std::get<2>(*pending_.begin()));
    const v1::JobSpec& spec = job.job.spec();
    std::vector<RankCandidate> left_out;
    std::vector<RankCandidate> fitting = IdleWorkers(spec.device(), job.memory_needed, &job);
    // The workers kept for it first (those it preempted for), and a suspended job's holders
    // before all, before one rank per GPU drops any.
    std::stable_partition(fitting.begin(), fitting.end(), [&](const RankCandidate& c) {
      return job.reserved.count(c.worker_id) > 0;
    });
    const bool suspended = job.job.state() == v1::JOB_STATE_SUSPENDED;
    if (suspended) HoldersFirst(job, fitting);
    const size_t fitting_count = fitting.size();
    std::vector<RankCandidate> idle = OneRankPerGpu({}, fitting, job.memory_needed, &left_out);
    std::string holder_wait;
    if (suspended && WaitsForHolder(job, idle, now, &holder_wait)) {
      if (FreeHolder(job, now, out)) continue;  // a holder is kept for it: the next pass
      const std::string reason = absl::StrCat(job.job.suspension().reason(), "; ", holder_wait);
      if (reason != job.job.reason()) {
        job.job.set_reason(reason);
        out->changed_jobs.insert(job.job.job_id());
      }
      break;  // nothing may overtake the head job
    }
    std::string preemption;
    if (static_cast<int64_t>(idle.size()) < spec.min_workers() &&
        PreemptFor(job, idle, now, out, &preemption)) {
      continue;  // the workers are kept for it: the next pass starts it
    }
    if (static_cast<int64_t>(idle.size()) < spec.min_workers()) {
      const size_t all_idle = IdleWorkers(spec.device()).size();
      std::string reason =
          absl::StrCat("waiting for ", spec.min_workers(), " idle ", spec.device(), " worker",
                       spec.min_workers() == 1 ? "" : "s", " (", all_idle, " idle");
      if (spec.has_program()) {
        absl::StrAppend(&reason, ", ", fitting_count,
                        " that run programs (lockstep-worker --programs_root)");
      } else if (all_idle > fitting_count) {
        absl::StrAppend(&reason, ", ", fitting_count, " with the ", HumanBytes(job.memory_needed),
                        " free that each worker needs");
      }
      reason += SharedGpuNote(left_out.size()) + ")" + preemption;
      if (suspended) reason = absl::StrCat(job.job.suspension().reason(), "; ", reason);
      if (reason != job.job.reason()) {
        job.job.set_reason(reason);
        out->changed_jobs.insert(job.job.job_id());
      }
      break;  // nothing may overtake the head job
    }
    idle.resize(std::min<size_t>(idle.size(), spec.max_workers()));
    if (suspended) {
      Resume(job, AssignRanks({}, std::move(idle)), now, out);
    } else {
      StartGeneration(job, AssignRanks({}, std::move(idle)), now, out);
    }
  }
  // 3. Spares: a running job below max_workers grows onto idle workers, once its current
  // generation has completed a step (so every re-formation is followed by progress), and
  // never once it has trained its last step (there is nothing left to share), nor while the
  // job at the head of the queue has a higher priority and could use idle workers (they are
  // its to gather; a job shrunk for it grows back after it).
  const JobRecord* head = QueueHead();
  std::optional<bool> head_gathers;  // looked up once, only when a lower job would grow
  for (const auto& [seq, id] : active) {
    JobRecord& job = jobs_.at(id);
    if (job.job.state() != v1::JOB_STATE_RUNNING || !job.first_report_of_generation_seen ||
        static_cast<int>(job.members.size()) >= job.job.spec().max_workers() || job.finishing ||
        AnyMemberAtLastStep(job)) {
      continue;
    }
    if (head != nullptr && job.job.spec().priority() < head->job.spec().priority()) {
      if (!head_gathers.has_value()) {
        head_gathers =
            !IdleWorkers(head->job.spec().device(), head->memory_needed, head).empty();
      }
      if (*head_gathers) continue;
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
                         /*scale_up=*/true, /*coordinator_caused=*/false, /*counted=*/false, now,
                         now, out);
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
    a->set_restart_count(job.job.recoveries());
  }
  // Ranks per GPU: a member shares its GPU's memory with the others on it.
  absl::flat_hash_map<std::string_view, int32_t> ranks_on_gpu;
  for (const std::string& id : worker_ids) {
    const std::string& uuid = workers_.at(id).info.device_uuid();
    if (!uuid.empty()) ++ranks_on_gpu[uuid];
  }
  // Each member's place on its host (ranks are host-contiguous, AssignRanks): torchrun's local
  // rank and the host's index; a program job's members also learn their host's GPUs.
  struct HostRanks {
    int32_t index = 0;
    int32_t members = 0;
    std::vector<std::string> gpus;  // program jobs: UUIDs in local-rank order
  };
  absl::flat_hash_map<std::string_view, HostRanks> hosts;
  std::vector<int32_t> local_rank(worker_ids.size());
  for (size_t rank = 0; rank < worker_ids.size(); ++rank) {
    const v1::RegisterRequest& info = workers_.at(worker_ids[rank]).info;
    auto [it, added] = hosts.try_emplace(info.host());
    if (added) it->second.index = static_cast<int32_t>(hosts.size() - 1);
    local_rank[rank] = it->second.members++;
    if (job.job.spec().has_program()) it->second.gpus.push_back(info.device_uuid());
  }
  // Program jobs: whose copies of its lockstep.torch checkpoints each member keeps, a ring over
  // the hosts (the member at the same local rank, modulo, of the next host), so that losing a
  // host loses no save; on one host, the next rank's worker.
  std::vector<std::vector<size_t>> ranks_of_host(hosts.size());
  for (size_t rank = 0; rank < worker_ids.size(); ++rank) {
    ranks_of_host[hosts.at(workers_.at(worker_ids[rank]).info.host()).index].push_back(rank);
  }
  const auto checkpoint_peer = [&](size_t rank) -> size_t {
    if (hosts.size() == 1) return (rank + 1) % worker_ids.size();
    const int32_t index = hosts.at(workers_.at(worker_ids[rank]).info.host()).index;
    const std::vector<size_t>& next = ranks_of_host[(index + 1) % ranks_of_host.size()];
    return next[static_cast<size_t>(local_rank[rank]) % next.size()];
  };
  const bool copies = job.job.spec().has_program() && worker_ids.size() > 1;
  // Program jobs: who was a member of the previous generation (by id; by name when that one
  // was a previous coordinator's). The others joined (Assignment.joined).
  absl::flat_hash_set<std::string> previous;
  const bool has_previous = job.job.spec().has_program() && job.job.generations_size() > 0;
  if (has_previous) {
    const v1::Generation& last = *job.job.generations().rbegin();
    const auto& ids = job.timeline_ids_stale ? last.members() : last.member_ids();
    previous.insert(ids.begin(), ids.end());
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
    const HostRanks& host = hosts.at(w.info.host());
    mine->set_local_rank(local_rank[rank]);
    mine->set_local_world_size(host.members);
    mine->set_host_rank(host.index);
    mine->set_host_count(static_cast<int32_t>(hosts.size()));
    if (!uuid.empty()) {
      for (const std::string& gpu : host.gpus) mine->add_local_device_uuids(gpu);
    }
    if (has_previous) {
      mine->set_joined(previous.count(job.timeline_ids_stale ? w.info.name() : w.id) == 0);
    }
    if (copies) {
      const v1::RegisterRequest& peer = workers_.at(worker_ids[checkpoint_peer(rank)]).info;
      if (!peer.peer_address().empty()) {
        mine->mutable_checkpoint_peer()->set_worker_name(peer.name());
        mine->mutable_checkpoint_peer()->set_address(peer.peer_address());
      }
    }
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

std::vector<RankCandidate> Core::TakeableMembers(const JobRecord& victim,
                                                 const JobRecord& job) const {
  std::vector<RankCandidate> takeable;
  const v1::JobSpec& spec = job.job.spec();
  for (auto m = victim.members.rbegin(); m != victim.members.rend(); ++m) {
    auto it = workers_.find(m->worker_id);
    if (it == workers_.end()) continue;
    const Worker& w = it->second;
    if (w.state != WorkerState::kBusy || w.job_id != victim.job.job_id()) continue;
    PlacementView view;  // as it will be once the victim lets it go
    view.idle = true;
    view.excluded = Excluded(job, w.id, w.info.name());
    view.benched = job.benched.count(w.id) > 0;
    view.device = DeviceKind(w.info.device());
    view.free_memory = w.info.free_memory_bytes();
    view.runs_programs = RunsPrograms(w);
    if (MayTakeRank(view, job.job.job_id(), spec.device(), job.memory_needed,
                    spec.has_program())) {
      takeable.push_back(Candidate(w));
    }
  }
  return takeable;
}

Core::PreemptionPlan Core::PlanPreemption(const JobRecord& job,
                                           const std::vector<RankCandidate>& idle) const {
  PreemptionPlan plan;
  const v1::JobSpec& spec = job.job.spec();
  const int32_t priority = spec.priority();
  // Running jobs of a lower declared priority at a step boundary (their current generation has
  // completed a step), lowest first, then the newest first (it has the least to lose); never
  // one re-forming, finishing or at its last step.
  struct Candidate {
    const JobRecord* job;
    std::vector<RankCandidate> all;       // every member `job` could use
    std::vector<RankCandidate> takeable;  // those above its min_workers
    bool suspend = false;                 // shrinking is not enough: it is suspended whole
  };
  std::vector<Candidate> victims;
  for (const auto& [seq, id] : active_) {
    const JobRecord& v = jobs_.at(id);
    if (v.job.state() != v1::JOB_STATE_RUNNING || v.job.spec().priority() >= priority ||
        !v.first_report_of_generation_seen || v.finishing || AnyMemberAtLastStep(v)) {
      continue;
    }
    std::vector<RankCandidate> all = TakeableMembers(v, job);
    if (all.empty()) continue;
    const int64_t spare = std::max<int64_t>(
        0, static_cast<int64_t>(v.members.size()) - v.job.spec().min_workers());
    std::vector<RankCandidate> takeable(
        all.begin(), all.begin() + static_cast<ptrdiff_t>(std::min<size_t>(all.size(), spare)));
    victims.push_back({&v, std::move(all), std::move(takeable)});
  }
  if (victims.empty()) return plan;
  std::sort(victims.begin(), victims.end(), [](const Candidate& a, const Candidate& b) {
    const int32_t pa = a.job->job.spec().priority(), pb = b.job->job.spec().priority();
    return pa != pb ? pa < pb : a.job->submit_seq > b.job->submit_seq;
  });
  // What the job could have, in that order, with one rank per GPU as it will start: first by
  // shrinking every victim toward its min_workers; when that is not enough, by suspending
  // victims whole as well, in the same order, until it is.
  std::vector<RankCandidate> usable;
  const auto pool = [&] {
    std::vector<RankCandidate> all = idle;
    for (const Candidate& v : victims) {
      const std::vector<RankCandidate>& given = v.suspend ? v.all : v.takeable;
      all.insert(all.end(), given.begin(), given.end());
    }
    usable = OneRankPerGpu({}, all, job.memory_needed);
  };
  pool();
  for (size_t i = 0; static_cast<int64_t>(usable.size()) < spec.min_workers() && i < victims.size();
       ++i) {
    victims[i].suspend = true;
    pool();
  }
  if (static_cast<int64_t>(usable.size()) < spec.min_workers()) {
    plan.could = usable.size() - std::min(usable.size(), idle.size());
    return plan;
  }
  plan.enough = true;
  // The workers it starts with: every idle one it can use (up to max_workers), and from the
  // victims what min_workers still lacks.
  absl::flat_hash_set<std::string_view> idle_ids;
  for (const RankCandidate& c : idle) idle_ids.insert(c.worker_id);
  size_t from_victims = static_cast<size_t>(spec.min_workers()) -
                        std::min<size_t>(idle.size(), spec.min_workers());
  for (const RankCandidate& c : usable) {
    const bool was_idle = idle_ids.count(c.worker_id) > 0;
    if (was_idle ? plan.chosen.size() < static_cast<size_t>(spec.max_workers())
                 : from_victims > 0) {
      plan.chosen.insert(c.worker_id);
      if (was_idle) {
        plan.idle.push_back(c.worker_id);
      } else {
        --from_victims;
      }
    }
  }
  for (const Candidate& v : victims) {
    PreemptionPlan::Victim victim{v.job->job.job_id(), v.suspend, {}};
    for (const RankCandidate& c : v.suspend ? v.all : v.takeable) {
      if (plan.chosen.count(c.worker_id) > 0) victim.taken.push_back(c.worker_id);
    }
    // A victim nobody is taken from after all (the others sufficed) is left alone.
    if (!victim.taken.empty()) plan.victims.push_back(std::move(victim));
  }
  return plan;
}

std::string Core::DescribePlan(const PreemptionPlan& plan) const {
  if (!plan.enough) {
    return plan.could > 0
               ? absl::StrCat("not enough: shrinking or suspending lower-priority jobs would free "
                              "only ", plan.could)
               : std::string();
  }
  std::vector<std::string> parts;
  for (const PreemptionPlan::Victim& v : plan.victims) {
    const JobRecord& victim = jobs_.at(v.job_id);
    parts.push_back(v.suspend ? absl::StrCat("suspend ", v.job_id, " (priority ",
                                             victim.job.spec().priority(), ")")
                              : absl::StrCat("shrink ", v.job_id, " (priority ",
                                             victim.job.spec().priority(), ") by ",
                                             v.taken.size()));
  }
  return absl::StrJoin(parts, ", ");
}

bool Core::PreemptFor(JobRecord& job, const std::vector<RankCandidate>& idle, absl::Time now,
                      Decisions* out, std::string* why) {
  const PreemptionPlan plan = PlanPreemption(job, idle);
  if (!plan.enough) {
    if (plan.could > 0) {
      *why = absl::StrCat("; shrinking or suspending lower-priority jobs would free only ",
                          plan.could);
    }
    return false;
  }
  ApplyPreemption(job, plan, now, out);
  return true;
}

void Core::ApplyPreemption(JobRecord& job, const PreemptionPlan& plan, absl::Time now,
                           Decisions* out) {
  const auto keep = [&](Worker& w) {
    w.reserved_for = job.job.job_id();
    job.reserved.insert(w.id);
  };
  for (const std::string& id : plan.idle) keep(workers_.at(id));
  const std::string by = absl::StrCat(job.job.job_id(), " (priority ", job.job.spec().priority(),
                                      ")");
  for (const PreemptionPlan::Victim& v : plan.victims) {
    JobRecord& victim = jobs_.at(v.job_id);
    std::vector<std::string> names;
    for (const std::string& id : v.taken) names.push_back(workers_.at(id).info.name());
    const std::string taken = absl::StrJoin(names, ", ");
    if (v.suspend) {
      // Stopped whole: its members keep its state while they serve others; it resumes from
      // them when workers free up (suspension.cc).
      Suspend(victim, absl::StrCat("preempted by ", by), job.job.job_id(), /*by_user=*/false, now,
              out);
      for (const std::string& id : v.taken) keep(workers_.at(id));
      AddEvent(job, v1::JobEvent::MEMBERSHIP,
               absl::StrCat("took ", taken, " from ", v.job_id, " (priority ",
                            victim.job.spec().priority(), "), suspended"),
               now, out);
      continue;
    }
    for (const std::string& id : v.taken) {
      Worker& w = workers_.at(id);
      PushAbort(victim, w.id, absl::StrCat("preempted by ", by), out);
      EraseMember(victim, w.id);
      w.state = WorkerState::kIdle;
      w.job_id.clear();
      w.generation = 0;
      keep(w);
    }
    AddEvent(job, v1::JobEvent::MEMBERSHIP,
             absl::StrCat("took ", taken, " from ", v.job_id, " (priority ",
                          victim.job.spec().priority(), "), shrunk toward its min_workers"),
             now, out);
    // The rest re-form at once (the workers kept for `job` are not theirs to take); the job
    // grows back onto idle workers when no job of a higher priority can use them.
    BeginReconfiguration(victim, absl::StrCat("preempted by ", by, ": ", taken, " taken"),
                         /*scale_up=*/false, /*coordinator_caused=*/false, /*counted=*/false,
                         now, now, out);
    TryReform(victim, now, out);
  }
}

bool Core::FreeHolder(JobRecord& job, absl::Time now, Decisions* out) {
  for (const std::string& name : job.job.suspension().holders()) {
    const auto live = live_names_.find(name);
    if (live == live_names_.end()) continue;
    const Worker& w = workers_.at(live->second);
    if (w.state != WorkerState::kBusy || Excluded(job, w.id, name)) continue;
    const JobRecord* busy = FindJob(w.job_id);
    if (busy == nullptr || busy->job.state() != v1::JOB_STATE_RUNNING ||
        busy->job.spec().priority() >= job.job.spec().priority() ||
        !busy->first_report_of_generation_seen || busy->finishing ||
        AnyMemberAtLastStep(*busy)) {
      continue;
    }
    PreemptionPlan plan;
    plan.enough = true;
    plan.victims.push_back(
        {busy->job.job_id(),
         /*suspend=*/static_cast<int64_t>(busy->members.size()) <= busy->job.spec().min_workers(),
         {w.id}});
    plan.chosen.insert(w.id);
    ApplyPreemption(job, plan, now, out);
    return true;
  }
  return false;
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

}  // namespace lockstep::coordinator
