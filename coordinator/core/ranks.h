// Deterministic rank assignment for a new generation.
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
};

// Orders the members of a new generation. Survivors (given in their old rank order) keep their
// relative order; newcomers go after them, ordered by registration; and all workers of one host
// are contiguous, hosts ordered by their first appearance in that sequence, so a host's
// survivors stay in front of its newcomers. Returns worker ids in rank order.
std::vector<std::string> AssignRanks(const std::vector<RankCandidate>& survivors,
                                     std::vector<RankCandidate> newcomers);

}  // namespace lockstep::coordinator
