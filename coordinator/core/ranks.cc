// Rank assignment: a stable grouping by host; GPU placement.
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

std::vector<RankCandidate> OneRankPerGpu(const std::vector<RankCandidate>& members,
                                         std::vector<RankCandidate> candidates,
                                         int64_t memory_needed,
                                         std::vector<RankCandidate>* left_out) {
  // Per GPU: its ranks so far, whether all of them may share it, the least free memory known.
  struct Gpu {
    int64_t ranks = 0;
    bool shared = true;
    int64_t free = 0;
  };
  absl::flat_hash_map<std::string, Gpu> gpus;  // own keys: the candidates move out
  auto add = [&](Gpu& gpu, const RankCandidate& c) {
    ++gpu.ranks;
    gpu.shared = gpu.shared && c.may_share_gpu;
    if (c.free_memory_bytes > 0 && (gpu.free == 0 || c.free_memory_bytes < gpu.free)) {
      gpu.free = c.free_memory_bytes;
    }
  };
  for (const RankCandidate& m : members) {
    if (!m.gpu_uuid.empty()) add(gpus[m.gpu_uuid], m);
  }
  std::vector<RankCandidate> kept;
  kept.reserve(candidates.size());
  for (RankCandidate& c : candidates) {
    if (!c.gpu_uuid.empty()) {
      Gpu& gpu = gpus[c.gpu_uuid];
      if (gpu.ranks > 0) {
        Gpu with = gpu;
        add(with, c);
        const bool fits = memory_needed <= 0 || with.free == 0 ||
                          with.free / with.ranks >= memory_needed;
        if (!with.shared || !fits) {
          if (left_out != nullptr) left_out->push_back(std::move(c));
          continue;
        }
        gpu = with;
      } else {
        add(gpu, c);
      }
    }
    kept.push_back(std::move(c));
  }
  return kept;
}

}  // namespace lockstep::coordinator
