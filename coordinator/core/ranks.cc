// Rank assignment: a stable grouping by host.
#include "coordinator/core/ranks.h"

#include <algorithm>
#include <map>

namespace lockstep::coordinator {

std::vector<std::string> AssignRanks(const std::vector<RankCandidate>& survivors,
                                     std::vector<RankCandidate> newcomers) {
  std::stable_sort(newcomers.begin(), newcomers.end(),
                   [](const RankCandidate& a, const RankCandidate& b) {
                     return a.registration_seq < b.registration_seq;
                   });
  std::vector<const RankCandidate*> sequence;
  for (const RankCandidate& c : survivors) sequence.push_back(&c);
  for (const RankCandidate& c : newcomers) sequence.push_back(&c);

  std::map<std::string, size_t> host_order;
  for (const RankCandidate* c : sequence) host_order.emplace(c->host, host_order.size());
  std::stable_sort(sequence.begin(), sequence.end(),
                   [&](const RankCandidate* a, const RankCandidate* b) {
                     return host_order[a->host] < host_order[b->host];
                   });
  std::vector<std::string> ids;
  ids.reserve(sequence.size());
  for (const RankCandidate* c : sequence) ids.push_back(c->worker_id);
  return ids;
}

}  // namespace lockstep::coordinator
