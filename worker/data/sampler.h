// The data order of a job. The global batch B is fixed; epoch e is a permutation seeded by
// (seed, e); step s (0-based) consumes positions [s*B, (s+1)*B) of its epoch's permutation, cut
// into M micro-shards of B/M samples; rank r of W takes micro-shards [r*M/W, (r+1)*M/W). So the
// global order does not depend on W, and the data position is just the step number.
#pragma once

#include <cstdint>
#include <vector>

namespace lockstep::worker {

// Micro-shards [begin, end) of rank `rank` among `world` (world <= micro_shards).
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
};
ShardRange RankShards(int64_t micro_shards, int rank, int world);

// Fisher-Yates permutation of [0, n) seeded by (seed, epoch).
std::vector<int64_t> EpochPermutation(uint64_t seed, int64_t epoch, int64_t n);

// Not thread-safe (caches the current epoch's permutation).
class Sampler {
 public:
  // Requires global_batch % micro_shards == 0 and global_batch <= samples.
  Sampler(int64_t samples, int64_t global_batch, int64_t micro_shards, uint64_t seed);

  // Full steps per epoch; the remainder of each epoch (< B samples) is dropped.
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t micro_shard_size() const { return shard_size_; }

  // Sample indices of micro-shards [shards.begin, shards.end) of 0-based global step `step`.
  void Indices(int64_t step, ShardRange shards, std::vector<int64_t>* out);

 private:
  const int64_t samples_;
  const int64_t global_batch_;
  const int64_t shard_size_;
  const uint64_t seed_;
  const int64_t steps_per_epoch_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> permutation_;
};

}  // namespace lockstep::worker
