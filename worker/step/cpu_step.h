// The CPU's step engine: the model's forward and backward through the CPU kernels, bucketed sums
// on a reducer thread as backward produces them, the optimizer update over the flat buffer. In
// deterministic mode each micro-shard's gradient goes to 64-bit fixed point and the integers
// are summed (in the communicator's shared memory when it has some), so the update is the same
// bits for any world size.
#pragma once

#include <memory>
#include <vector>

#include "lockstep/v1/job.pb.h"
#include "worker/step/bucket_plan.h"
#include "worker/step/gradient_reducer.h"
#include "worker/step/optimizer.h"
#include "worker/step/step_engine.h"

namespace lockstep::worker {

class CpuStep final : public StepEngine {
 public:
  // `model` and `optimizer` are the state it trains (not owned); `layout`: what a sample holds
  // (a classifier's features and label, or a language model's tokens).
  CpuStep(const v1::JobSpec& spec, Model* model, Optimizer* optimizer, const SampleLayout& layout);

  const char* device() const override { return "cpu"; }
  absl::Status Begin(const StepGroup& group) override;
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::Status End() override;
  absl::StatusOr<HostBatch> HostBuffers(int n) override;
  absl::StatusOr<StepResult> TakeStep(const StepArgs& args) override;
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return model_->Evaluate(batch, correct);
  }

  // The largest sum a CpuStep for `spec` and `model` asks of its communicator in one call, in
  // bytes (a bucket, or in deterministic mode the whole fixed-point gradient).
  static size_t LargestCollectiveBytes(const v1::JobSpec& spec, const Model& model);

 private:
  absl::StatusOr<StepResult> Step(const StepArgs& args);
  absl::StatusOr<StepResult> StepDeterministic(const StepArgs& args);

  const bool deterministic_;
  Model* const model_;
  Optimizer* const optimizer_;
  const SampleLayout layout_;
  // Backward produces weight gradients in row blocks of about this many values.
  const size_t chunk_floats_;
  // Default mode: the loss rides in the last bucket; deterministic mode: the loss and the
  // out-of-range count.
  const BucketPlan plan_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<GradientReducer> reducer_;  // between Begin and End
  std::vector<int64_t> fixed_sum_;  // deterministic mode without staging memory
  std::vector<float> features_;
  std::vector<int32_t> labels_;
  std::vector<int32_t> tokens_;
};

}  // namespace lockstep::worker
