// SGD with momentum and AdamW through the fused CPU kernels.
#include "worker/train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu_kernels.h"

namespace lockstep::worker {

Optimizer::Optimizer(const v1::OptimizerSpec& spec, size_t num_params, int64_t total_steps)
    : spec_(spec), num_params_(num_params), total_steps_(total_steps) {
  state_.assign(spec_.type() == "adamw" ? 2 * num_params_ : num_params_, 0.0f);
}

double Optimizer::LearningRate(int64_t step) const {
  const double peak = spec_.learning_rate();
  const int64_t warmup = spec_.warmup_steps();
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  if (!spec_.cosine_decay() || total_steps_ <= warmup) return peak;
  const double progress =
      static_cast<double>(step - warmup) / static_cast<double>(total_steps_ - warmup);
  return 0.5 * peak * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

void Optimizer::Step(float* params, const float* grads, int64_t step) {
  UpdateRange(params, grads, 0, num_params_, step);
}

void Optimizer::StepFixedPoint(float* params, const int64_t* fixed_grads, int frac_bits,
                               int64_t step) {
  // 16 KiB of floats: the block's int64 input, its conversion and the parameters and state it
  // updates stay in L1/L2 between the two passes.
  constexpr size_t kBlock = 4096;
  block_.resize(kBlock);
  for (size_t offset = 0; offset < num_params_; offset += kBlock) {
    const size_t count = std::min(kBlock, num_params_ - offset);
    kernels::FromFixedPoint(fixed_grads + offset, count, frac_bits, block_.data());
    UpdateRange(params + offset, block_.data(), offset, count, step);
  }
}

// Updates the `count` parameters at `params` (parameter index `offset` on) with the gradient at
// `grads`: both updates are elementwise, so any split gives the same bits as one call.
void Optimizer::UpdateRange(float* params, const float* grads, size_t offset, size_t count,
                            int64_t step) {
  const float lr = static_cast<float>(LearningRate(step));
  if (spec_.type() == "adamw") {
    kernels::AdamWUpdate(
        params, grads, state_.data() + offset, state_.data() + num_params_ + offset, count, lr,
        static_cast<float>(spec_.beta1()), static_cast<float>(spec_.beta2()),
        static_cast<float>(spec_.epsilon()), static_cast<float>(spec_.weight_decay()), step);
  } else {
    kernels::SgdMomentumUpdate(params, grads, state_.data() + offset, count, lr,
                               static_cast<float>(spec_.momentum()),
                               static_cast<float>(spec_.weight_decay()));
  }
}

}  // namespace lockstep::worker
