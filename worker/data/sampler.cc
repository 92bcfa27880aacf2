// Sampler: world-size-independent data order.
#include "worker/data/sampler.h"

#include <numeric>

#include "common/random.h"

namespace lockstep::worker {

ShardRange RankShards(int64_t micro_shards, int rank, int world) {
  return {micro_shards * rank / world, micro_shards * (rank + 1) / world};
}

std::vector<int64_t> EpochPermutation(uint64_t seed, int64_t epoch, int64_t n) {
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  SplitMix64 rng(MixSeed(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

Sampler::Sampler(int64_t samples, int64_t global_batch, int64_t micro_shards, uint64_t seed)
    : samples_(samples),
      global_batch_(global_batch),
      shard_size_(global_batch / micro_shards),
      seed_(seed),
      steps_per_epoch_(samples / global_batch) {}

void Sampler::Indices(int64_t step, ShardRange shards, std::vector<int64_t>* out) {
  const int64_t epoch = step / steps_per_epoch_;
  const int64_t in_epoch = step % steps_per_epoch_;
  if (epoch != cached_epoch_) {
    permutation_ = EpochPermutation(seed_, epoch, samples_);
    cached_epoch_ = epoch;
  }
  const int64_t first = in_epoch * global_batch_ + shards.begin * shard_size_;
  const int64_t last = in_epoch * global_batch_ + shards.end * shard_size_;
  out->assign(permutation_.begin() + first, permutation_.begin() + last);
}

}  // namespace lockstep::worker
