#include "worker/program/checkpoint_agreement.h"

#include <algorithm>
#include <functional>
#include <set>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lockstep::worker {
namespace {

bool Has(const google::protobuf::RepeatedField<int64_t>& steps, int64_t step) {
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

// Where `rank` obtains `step`: -1 from its own saves; else the plan to fetch it (rank unset
// when it cannot). `claimed` holds the departed workers' copies already taken by spares.
struct Source {
  bool own = false;
  bool found = false;
  v1::CheckpointFetchPlan fetch;  // a copy, or the disk (fetch.from_disk)
};

// Whether any member keeps a copy of `worker`'s saves (of any step).
bool KeptAnywhere(const std::vector<v1::CheckpointHoldings>& by_rank, const std::string& worker) {
  for (const v1::CheckpointHoldings& h : by_rank) {
    for (const v1::ReplicaHolding& copy : h.replicas()) {
      if (copy.source_worker() == worker && !copy.steps().empty()) return true;
    }
  }
  return false;
}

Source Find(const std::vector<v1::CheckpointHoldings>& by_rank, int rank, int64_t step,
            const absl::flat_hash_set<std::string>& members, std::set<std::string>* claimed) {
  Source source;
  const v1::CheckpointHoldings& me = by_rank[rank];
  if (Has(me.own_steps(), step)) {
    source.own = source.found = true;
    return source;
  }
  // A copy of this worker's own saves first, then a departed worker's (for a spare).
  for (int pass = 0; pass < 2 && !source.found; ++pass) {
    for (int holder = 0; holder < static_cast<int>(by_rank.size()) && !source.found; ++holder) {
      const v1::CheckpointHoldings& h = by_rank[holder];
      if (holder == rank || h.peer_address().empty()) continue;
      for (const v1::ReplicaHolding& copy : h.replicas()) {
        const bool mine = copy.source_worker() == me.worker();
        const bool departed = members.count(copy.source_worker()) == 0 &&
                              claimed->count(copy.source_worker()) == 0;
        if (!(pass == 0 ? mine : departed) || !Has(copy.steps(), step)) continue;
        if (pass == 1) claimed->insert(copy.source_worker());
        source.found = true;
        source.fetch.set_rank(rank);
        source.fetch.set_holder_address(h.peer_address());
        source.fetch.set_holder_worker(h.worker());
        source.fetch.set_source_worker(copy.source_worker());
        break;
      }
    }
  }
  // The slowest source of its own: the job's checkpoint_dir.
  if (!source.found && Has(me.disk_steps(), step)) {
    source.found = true;
    source.fetch.set_rank(rank);
    source.fetch.set_from_disk(true);
  }
  // A member that joined (a scale-up, a job growing back after a preemption; its own saves, if
  // any, are of the time before it left), or that has nothing of its own anywhere, takes
  // another member's own save of the step: data-parallel replicas hold the same model and
  // optimizer state. A member that stayed keeps to its own saves' history.
  if (!source.found &&
      (me.joined() || (me.own_steps().empty() && me.disk_steps().empty() &&
                       !KeptAnywhere(by_rank, me.worker())))) {
    for (int holder = 0; holder < static_cast<int>(by_rank.size()); ++holder) {
      const v1::CheckpointHoldings& h = by_rank[holder];
      if (holder == rank || h.peer_address().empty() || !Has(h.own_steps(), step)) continue;
      source.found = true;
      source.fetch.set_rank(rank);
      source.fetch.set_holder_address(h.peer_address());
      source.fetch.set_holder_worker(h.worker());
      source.fetch.set_source_worker(h.worker());
      source.fetch.set_holders_own(true);
      break;
    }
  }
  return source;
}

}  // namespace

v1::CheckpointChoice ChooseCheckpoint(const std::vector<v1::CheckpointHoldings>& by_rank) {
  v1::CheckpointChoice choice;
  std::set<int64_t, std::greater<int64_t>> candidates;
  absl::flat_hash_set<std::string> members;
  for (const v1::CheckpointHoldings& h : by_rank) {
    members.insert(h.worker());
    candidates.insert(h.own_steps().begin(), h.own_steps().end());
    candidates.insert(h.disk_steps().begin(), h.disk_steps().end());
    for (const v1::ReplicaHolding& copy : h.replicas()) {
      candidates.insert(copy.steps().begin(), copy.steps().end());
    }
  }
  std::vector<std::string> refused;
  for (const v1::CheckpointHoldings& h : by_rank) {
    for (const std::string& r : h.refused()) refused.push_back(absl::StrCat(h.worker(), ": ", r));
  }
  const std::string refused_text =
      refused.empty() ? "" : absl::StrCat("refused: ", absl::StrJoin(refused, "; "));
  std::string why_not;  // for the newest step: the first member that cannot obtain it
  for (const int64_t step : candidates) {
    std::set<std::string> claimed;
    std::vector<v1::CheckpointFetchPlan> fetches;
    bool every = true;
    for (int rank = 0; rank < static_cast<int>(by_rank.size()); ++rank) {
      const Source source = Find(by_rank, rank, step, members, &claimed);
      if (!source.found) {
        if (why_not.empty()) {
          why_not = absl::StrCat("no step every member can obtain: ", by_rank[rank].worker(),
                                 " (rank ", rank, ") holds no save of step ", step,
                                 ", no member keeps a copy of it, and it is not on disk");
        }
        every = false;
        break;
      }
      if (!source.own) fetches.push_back(source.fetch);
    }
    if (!every) continue;
    choice.set_found(true);
    choice.set_step(step);
    std::vector<std::string> copies;
    const bool memory = fetches.size() < by_rank.size();
    bool peers = false, disk = false;
    for (v1::CheckpointFetchPlan& f : fetches) {
      const std::string& who = by_rank[f.rank()].worker();
      if (f.from_disk()) {
        disk = true;
        copies.push_back(absl::StrCat(who, " from disk"));
      } else {
        peers = true;
        copies.push_back(f.source_worker() == who
                             ? absl::StrCat(who, " from ", f.holder_worker())
                             : absl::StrCat(who, " took ", f.source_worker(), "'s from ",
                                            f.holder_worker()));
      }
      *choice.add_fetches() = std::move(f);
    }
    std::vector<std::string> sources;
    if (memory) sources.push_back("memory");
    if (peers) sources.push_back("peers' copies");
    if (disk) sources.push_back("disk");
    // "memory", "memory and disk", "memory, peers' copies and disk".
    std::string from = sources.back();
    if (sources.size() > 1) {
      from = absl::StrCat(absl::StrJoin(sources.begin(), sources.end() - 1, ", "), " and ", from);
    }
    choice.set_restored_from(from);
    std::vector<std::string> detail;
    if (!copies.empty()) detail.push_back(absl::StrJoin(copies, ", "));
    if (!refused_text.empty()) detail.push_back(refused_text);
    choice.set_detail(absl::StrJoin(detail, "; "));
    return choice;
  }
  std::vector<std::string> detail;
  if (!why_not.empty()) detail.push_back(why_not);
  if (!refused_text.empty()) detail.push_back(refused_text);
  choice.set_detail(absl::StrJoin(detail, "; "));
  return choice;
}

}  // namespace lockstep::worker
