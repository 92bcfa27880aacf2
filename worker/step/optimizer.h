// Optimizers over the trainable ranges of the flat parameter buffer, gradient clipping, and the
// learning-rate schedule.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/v1/job.pb.h"
#include "worker/model/model.h"

namespace lockstep::worker {

// Not thread-safe.
class Optimizer {
 public:
  // Trains the model's segments (frozen tensors have none); the gradient and the state of a
  // segment sit at its grad_offset. Weight decay applies to segments marked decay, and to
  // embeddings when spec.decay_embeddings.
  Optimizer(const v1::OptimizerSpec& spec, const std::vector<Model::Segment>& segments,
            int64_t total_steps);
  // One segment of num_params, decayed.
  Optimizer(const v1::OptimizerSpec& spec, size_t num_params, int64_t total_steps);

  // Learning rate of 1-based step `step`: linear warm-up, then constant or cosine to zero.
  double LearningRate(int64_t step) const;
  // Applies one update with the already-reduced gradient (num_grads values; with
  // grad_clip_norm, scaled in place first, as torch.nn.utils.clip_grad_norm_ does).
  void Step(float* params, float* grads, int64_t step);
  // The same update with the gradient in fixed point (deterministic mode): converted with
  // kernels::FromFixedPoint block by block and applied while the block is in cache, so the
  // result is bitwise that of FromFixedPoint over everything followed by Step, in one pass.
  void StepFixedPoint(float* params, const int64_t* fixed_grads, int frac_bits, int64_t step);

  // The factor the gradient is scaled by for a global norm `norm`: min(1, clip / (norm +
  // 1e-6)), PyTorch's; 1 without clipping.
  double ClipScale(double norm) const;
  // The last step's global gradient norm (before clipping).
  double last_grad_norm() const { return last_norm_; }

  // What it trains, with weight decay resolved (decay_embeddings applied): a device's update
  // applies the same per segment.
  const std::vector<Model::Segment>& segments() const { return segments_; }

  // Optimizer state (momentum buffer, or AdamW's m then v), for healing and checkpoints.
  std::vector<float>& state() { return state_; }

 private:
  // `params` and `grads` point at the segment's values from `offset` on (a gradient offset, which
  // indexes the state too).
  void UpdateRange(float* params, const float* grads, size_t offset, size_t count, bool decay,
                   int64_t step);

  const v1::OptimizerSpec spec_;
  std::vector<Model::Segment> segments_;
  size_t num_grads_ = 0;
  const int64_t total_steps_;
  std::vector<float> state_;
  std::vector<float> block_;  // one block of converted gradient (StepFixedPoint)
  double last_norm_ = 0;
};

}  // namespace lockstep::worker
