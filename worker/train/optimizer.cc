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
  const float lr = static_cast<float>(LearningRate(step));
  if (spec_.type() == "adamw") {
    kernels::AdamWUpdate(params, grads, state_.data(), state_.data() + num_params_, num_params_,
                         lr, static_cast<float>(spec_.beta1()), static_cast<float>(spec_.beta2()),
                         static_cast<float>(spec_.epsilon()),
                         static_cast<float>(spec_.weight_decay()), step);
  } else {
    kernels::SgdMomentumUpdate(params, grads, state_.data(), num_params_, lr,
                               static_cast<float>(spec_.momentum()),
                               static_cast<float>(spec_.weight_decay()));
  }
}

}  // namespace lockstep::worker
