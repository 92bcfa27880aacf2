// Deterministic rank assignment for a new generation, and which GPU workers may be in one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::coordinator {

struct RankCandidate {
  std::string worker_id;
  std::string host;
  // Registration order; breaks ties among newcomers.
  uint64_t registration_seq = 0;
  // GPU workers: the GPU's UUID (empty for CPU workers), whether the worker may share it with
  // other ranks of its group (kSharedGpuCapability), and the memory it reported free (0:
  // unknown).
  std::string gpu_uuid;
  bool may_share_gpu = false;
  int64_t free_memory_bytes = 0;
};

// Orders the members of a new generation. Survivors (given in their old rank order) keep their
// relative order; newcomers go after them, ordered by registration; and all workers of one host
// are contiguous, hosts ordered by their first appearance in that sequence, so a host's
// survivors stay in front of its newcomers. Returns worker ids in rank order.
std::vector<std::string> AssignRanks(const std::vector<RankCandidate>& survivors,
                                     std::vector<RankCandidate> newcomers);

// The candidates, in their order, that can join `members` without two ranks of the group on
// one GPU: a candidate whose GPU a member or an earlier kept candidate already uses stays out,
// unless every worker on that GPU may share it and the GPU holds `memory_needed` for each of
// them (k ranks need k times it within the least free memory they reported). Candidates
// without a UUID (CPU workers) always stay. What stays out goes to `left_out`.
std::vector<RankCandidate> OneRankPerGpu(const std::vector<RankCandidate>& members,
                                         std::vector<RankCandidate> candidates,
                                         int64_t memory_needed,
                                         std::vector<RankCandidate>* left_out = nullptr);

}  // namespace lockstep::coordinator
