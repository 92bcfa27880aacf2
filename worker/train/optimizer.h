// Optimizers over the flat parameter buffer, and the learning-rate schedule.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/v1/job.pb.h"

namespace lockstep::worker {

// Not thread-safe.
class Optimizer {
 public:
  Optimizer(const v1::OptimizerSpec& spec, size_t num_params, int64_t total_steps);

  // Learning rate of 1-based step `step`: linear warm-up, then constant or cosine to zero.
  double LearningRate(int64_t step) const;
  // Applies one update with the already-reduced gradient.
  void Step(float* params, const float* grads, int64_t step);

  // Optimizer state (momentum buffer, or AdamW's m then v), for healing and checkpoints.
  std::vector<float>& state() { return state_; }

 private:
  const v1::OptimizerSpec spec_;
  const size_t num_params_;
  const int64_t total_steps_;
  std::vector<float> state_;
};

}  // namespace lockstep::worker
