// Rank assignment: a stable grouping by host.
#include "coordinator/core/ranks.h"

#include <algorithm>
#include <string_view>

#include "absl/container/flat_hash_map.h"

namespace lockstep::coordinator {

std::vector<std::string> AssignRanks(const std::vector<RankCandidate>& survivors,
                                     std::vector<RankCandidate> newcomers) {
  std::stable_sort(newcomers.begin(), newcomers.end(),
                   [](const RankCandidate& a, const RankCandidate& b) {
                     return a.registration_seq < b.registration_seq;
                   });
  // One bucket per host in order of first appearance, each in sequence order: a stable
  // grouping in O(N), whatever the number of hosts.
  absl::flat_hash_map<std::string_view, size_t> bucket_of;
  std::vector<std::vector<const RankCandidate*>> buckets;
  auto place = [&](const RankCandidate& c) {
    auto [it, added] = bucket_of.try_emplace(c.host, buckets.size());
    if (added) buckets.emplace_back();
    buckets[it->second].push_back(&c);
  };
  for (const RankCandidate& c : survivors) place(c);
  for (const RankCandidate& c : newcomers) place(c);
  std::vector<std::string> ids;
  ids.reserve(survivors.size() + newcomers.size());
  for (const auto& bucket : buckets) {
    for (const RankCandidate* c : bucket) ids.push_back(c->worker_id);
  }
  return ids;
}

}  // namespace lockstep::coordinator
