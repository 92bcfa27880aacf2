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
  // The same update with the gradient in fixed point (deterministic mode): converted with
  // kernels::FromFixedPoint block by block and applied while the block is in cache, so the
  // result is bitwise that of FromFixedPoint over everything followed by Step, in one pass.
  void StepFixedPoint(float* params, const int64_t* fixed_grads, int frac_bits, int64_t step);

  // Optimizer state (momentum buffer, or AdamW's m then v), for healing and checkpoints.
  std::vector<float>& state() { return state_; }

 private:
  // `params` and `grads` point at parameter `offset`; state is indexed from `offset`.
  void UpdateRange(float* params, const float* grads, size_t offset, size_t count, int64_t step);

  const v1::OptimizerSpec spec_;
  const size_t num_params_;
  const int64_t total_steps_;
  std::vector<float> state_;
  std::vector<float> block_;  // one block of converted gradient (StepFixedPoint)
};

}  // namespace lockstep::worker
