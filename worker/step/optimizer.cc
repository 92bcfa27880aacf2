// SGD with momentum and AdamW through the fused CPU kernels.
#include "worker/step/optimizer.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu_kernels.h"

namespace lockstep::worker {

Optimizer::Optimizer(const v1::OptimizerSpec& spec, const std::vector<Model::Segment>& segments,
                     int64_t total_steps)
    : spec_(spec), segments_(segments), total_steps_(total_steps) {
  for (Model::Segment& s : segments_) {
    num_grads_ = std::max(num_grads_, s.grad_offset + s.count);
    s.decay = s.decay || (s.embedding && spec_.decay_embeddings());
  }
  state_.assign(spec_.type() == "adamw" ? 2 * num_grads_ : num_grads_, 0.0f);
}

Optimizer::Optimizer(const v1::OptimizerSpec& spec, size_t num_params, int64_t total_steps)
    : Optimizer(spec, {Model::Segment{0, 0, num_params, true, false}}, total_steps) {}

double Optimizer::LearningRate(int64_t step) const {
  const double peak = spec_.learning_rate();
  const int64_t warmup = spec_.warmup_steps();
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  if (!spec_.cosine_decay() || total_steps_ <= warmup) return peak;
  const double progress =
      static_cast<double>(step - warmup) / static_cast<double>(total_steps_ - warmup);
  return 0.5 * peak * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

double Optimizer::ClipScale(double norm) const {
  if (spec_.grad_clip_norm() <= 0) return 1.0;
  return std::min(1.0, spec_.grad_clip_norm() / (norm + 1e-6));
}

void Optimizer::Step(float* params, float* grads, int64_t step) {
  if (spec_.grad_clip_norm() > 0) {
    // In index order, in double: every rank holds the same summed gradient, so every rank
    // computes the same norm and scales identically.
    double sum = 0;
    for (size_t i = 0; i < num_grads_; ++i) sum += static_cast<double>(grads[i]) * grads[i];
    last_norm_ = std::sqrt(sum);
    const float scale = static_cast<float>(ClipScale(last_norm_));
    if (scale < 1.0f) {
      for (size_t i = 0; i < num_grads_; ++i) grads[i] *= scale;
    }
  }
  for (const Model::Segment& s : segments_) {
    UpdateRange(params + s.param_offset, grads + s.grad_offset, s.grad_offset, s.count,
                s.decay, step);
  }
}

void Optimizer::StepFixedPoint(float* params, const int64_t* fixed_grads, int frac_bits,
                               int64_t step) {
  float scale = 1.0f;
  if (spec_.grad_clip_norm() > 0) {
    // From the integers, which are the same on every rank and for every world size.
    const double unit = std::ldexp(1.0, -frac_bits);
    double sum = 0;
    for (size_t i = 0; i < num_grads_; ++i) {
      const double g = static_cast<double>(fixed_grads[i]) * unit;
      sum += g * g;
    }
    last_norm_ = std::sqrt(sum);
    scale = static_cast<float>(ClipScale(last_norm_));
  }
  // 16 KiB of floats: the block's int64 input, its conversion and the parameters and state it
  // updates stay in L1/L2 between the two passes.
  constexpr size_t kBlock = 4096;
  block_.resize(kBlock);
  for (const Model::Segment& s : segments_) {
    for (size_t done = 0; done < s.count; done += kBlock) {
      const size_t count = std::min(kBlock, s.count - done);
      const size_t g = s.grad_offset + done;
      kernels::FromFixedPoint(fixed_grads + g, count, frac_bits, block_.data());
      if (scale < 1.0f) {
        for (size_t i = 0; i < count; ++i) block_[i] *= scale;
      }
      UpdateRange(params + s.param_offset + done, block_.data(), g, count, s.decay, step);
    }
  }
}

// Updates the `count` parameters at `params` with the gradient at `grads`, whose optimizer
// state starts at gradient offset `offset`: both updates are elementwise, so any split gives
// the same bits as one call.
void Optimizer::UpdateRange(float* params, const float* grads, size_t offset, size_t count,
                            bool decay, int64_t step) {
  const float lr = static_cast<float>(LearningRate(step));
  const float weight_decay = decay ? static_cast<float>(spec_.weight_decay()) : 0.0f;
  if (spec_.type() == "adamw") {
    kernels::AdamWUpdate(params, grads, state_.data() + offset,
                         state_.data() + num_grads_ + offset, count, lr,
                         static_cast<float>(spec_.beta1()), static_cast<float>(spec_.beta2()),
                         static_cast<float>(spec_.epsilon()), weight_decay, step);
  } else {
    kernels::SgdMomentumUpdate(params, grads, state_.data() + offset, count, lr,
                               static_cast<float>(spec_.momentum()), weight_decay);
  }
}

}  // namespace lockstep::worker
