// Synthetic data sets: samples labelled by a fixed random teacher network.
#include <cmath>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "worker/data/files.h"
#include "xxhash.h"

namespace lockstep::worker {

Dataset MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec) {
  return MakeSyntheticDataset(spec, nullptr).value();
}

absl::StatusOr<Dataset> MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec, StopFlag stop) {
  // Teacher: logits = W2 * tanh(W1 x), hidden width 32. Non-linear, so depth helps, but
  // smooth enough that a small MLP learns it well within a few hundred steps.
  constexpr int kHidden = 32;
  const int32_t dim = spec.input_dim();
  const int32_t classes = spec.num_classes();
  SplitMix64 rng(spec.seed() ^ 0x5eed5eed5eedULL);
  std::vector<float> w1(static_cast<size_t>(kHidden) * dim), w2(kHidden * classes);
  const float s1 = 1.0f / std::sqrt(static_cast<float>(dim));
  for (float& w : w1) w = static_cast<float>(rng.Normal()) * s1 * 2.0f;
  for (float& w : w2) w = static_cast<float>(rng.Normal());

  auto make_split = [&](int64_t n) {
    Split split;
    split.samples = n;
    split.x.resize(static_cast<size_t>(n) * dim);
    split.y.resize(n);
    std::vector<float> h(kHidden), logits(classes);
    for (int64_t i = 0; i < n; ++i) {
      // Every sample: with wide inputs and many classes one takes milliseconds (a check every
      // 1,024 of them let a cancelled job hold its worker for 20 s).
      if (Stopped(stop)) return std::optional<Split>();
      float* x = &split.x[static_cast<size_t>(i) * dim];
      for (int32_t j = 0; j < dim; ++j) x[j] = static_cast<float>(rng.Normal());
      for (int k = 0; k < kHidden; ++k) {
        float acc = 0;
        for (int32_t j = 0; j < dim; ++j) acc += w1[static_cast<size_t>(k) * dim + j] * x[j];
        h[k] = std::tanh(acc);
      }
      int32_t best = 0;
      for (int32_t c = 0; c < classes; ++c) {
        float acc = 0;
        for (int k = 0; k < kHidden; ++k) acc += w2[k * classes + c] * h[k];
        logits[c] = acc;
        if (acc > logits[best]) best = c;
      }
      split.y[i] = best;
    }
    return std::optional<Split>(std::move(split));
  };
  Dataset ds;
  ds.dim = dim;
  ds.classes = classes;
  std::optional<Split> train = make_split(spec.train_samples());
  if (!train.has_value()) return StoppedError();
  std::optional<Split> test = make_split(spec.test_samples());
  if (!test.has_value()) return StoppedError();
  ds.train = *std::move(train);
  ds.test = *std::move(test);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const Split* split : {&ds.train, &ds.test}) {
    XXH3_64bits_update(state, split->x.data(), split->x.size() * sizeof(float));
    XXH3_64bits_update(state, split->y.data(), split->y.size() * sizeof(int32_t));
  }
  ds.parts.push_back({"synthetic", XXH3_64bits_digest(state)});
  XXH3_freeState(state);
  ds.source = absl::StrCat("synthetic data set (seed ", spec.seed(), ")");
  return ds;
}

}  // namespace lockstep::worker
