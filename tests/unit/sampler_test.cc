// The sampler's contract: every sample exactly once per epoch, and one global order whatever
// the world size.
#include "worker/data/sampler.h"

#include <algorithm>
#include <map>
#include <set>

#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

TEST(RankShardsTest, PartitionsContiguouslyAndCompletely) {
  for (int64_t m : {1, 4, 7, 64}) {
    for (int w = 1; w <= m && w <= 9; ++w) {
      int64_t expected_begin = 0;
      for (int r = 0; r < w; ++r) {
        ShardRange s = RankShards(m, r, w);
        EXPECT_EQ(s.begin, expected_begin) << "m=" << m << " w=" << w << " r=" << r;
        EXPECT_GT(s.end, s.begin) << "every rank gets a shard when w <= m";
        expected_begin = s.end;
      }
      EXPECT_EQ(expected_begin, m);
    }
  }
}

TEST(EpochPermutationTest, IsAPermutationThatDependsOnSeedAndEpoch) {
  std::vector<int64_t> p = EpochPermutation(7, 0, 1000);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(p, EpochPermutation(7, 0, 1000));
  EXPECT_NE(p, EpochPermutation(7, 1, 1000));
  EXPECT_NE(p, EpochPermutation(8, 0, 1000));
}

// Concatenating the ranks' indices for each step, for world sizes 1, 2 and 3, gives the same
// global sequence, and each epoch touches every sample at most once (exactly once for the
// samples that fit in full steps).
TEST(SamplerTest, EverySampleOncePerEpochAndSameOrderForEveryWorldSize) {
  const int64_t n = 1000, batch = 96, shards = 12;
  std::vector<int64_t> reference;
  for (int world : {1, 2, 3}) {
    std::vector<std::unique_ptr<Sampler>> samplers;
    for (int r = 0; r < world; ++r) {
      samplers.push_back(std::make_unique<Sampler>(n, batch, shards, /*seed=*/42));
    }
    const int64_t spe = samplers[0]->steps_per_epoch();
    ASSERT_EQ(spe, n / batch);
    std::vector<int64_t> global;
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::set<int64_t> seen;
      for (int64_t s = epoch * spe; s < (epoch + 1) * spe; ++s) {
        for (int r = 0; r < world; ++r) {
          std::vector<int64_t> idx;
          samplers[r]->Indices(s, RankShards(shards, r, world), &idx);
          for (int64_t i : idx) {
            ASSERT_TRUE(seen.insert(i).second) << "sample " << i << " twice in epoch " << epoch;
            global.push_back(i);
          }
        }
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), spe * batch);
    }
    if (world == 1) {
      reference = global;
    } else {
      EXPECT_EQ(global, reference) << "world size " << world << " changed the data order";
    }
  }
}

TEST(SamplerTest, DivisibleEpochCoversEverySample) {
  Sampler sampler(240, 48, 6, 3);
  std::multiset<int64_t> seen;
  for (int64_t s = 0; s < sampler.steps_per_epoch(); ++s) {
    std::vector<int64_t> idx;
    sampler.Indices(s, RankShards(6, 0, 1), &idx);
    seen.insert(idx.begin(), idx.end());
  }
  ASSERT_EQ(seen.size(), 240u);
  for (int64_t i = 0; i < 240; ++i) EXPECT_EQ(seen.count(i), 1u) << i;
}

}  // namespace
}  // namespace lockstep::worker
