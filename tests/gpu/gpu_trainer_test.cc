// The trainer with its steps on the GPU (label gpu; skipped without a device): one rank trains
// the same job on the CPU and on the GPU and must end with the same parameters to FP32
// rounding, for SGD and AdamW; the host mirror (what healing, checkpoints, evaluation and the
// checksum read) is current after Train; deterministic mode is refused with UNIMPLEMENTED.
#include <cuda_runtime_api.h>

#include <cmath>
#include <memory>

#include "gtest/gtest.h"
#include "tests/testing/solo_communicator.h"
#include "worker/train/dataset.h"
#include "worker/train/gpu_step.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {
namespace {

using testing::SoloCommunicator;

v1::JobSpec Spec(const std::string& optimizer) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->add_hidden_widths(64);
  spec.mutable_model()->add_hidden_widths(48);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(4096);
  s->set_test_samples(512);
  s->set_input_dim(20);
  s->set_num_classes(5);
  s->set_seed(3);
  spec.mutable_optimizer()->set_type(optimizer);
  spec.mutable_optimizer()->set_learning_rate(optimizer == "adamw" ? 1e-3 : 0.05);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.mutable_optimizer()->set_beta1(0.9);
  spec.mutable_optimizer()->set_beta2(0.999);
  spec.mutable_optimizer()->set_epsilon(1e-8);
  spec.set_global_batch_size(128);
  spec.set_micro_shards(8);
  spec.set_max_steps(40);
  spec.set_seed(1);
  return spec;
}

TEST(GpuTrainerTest, GpuStepsMatchCpuSteps) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  for (const char* optimizer : {"sgd", "adamw"}) {
    const v1::JobSpec spec = Spec(optimizer);
    auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
    SoloCommunicator comm;
    std::atomic<bool> abort{false};
    auto cpu = Trainer::Create(spec, data, &comm);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE((*cpu)->Train(1, abort, [](const v1::ProgressReport&) {}).ok());

    auto gpu = Trainer::Create(spec, data, &comm);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto step =
        GpuStep::Create(spec, (*gpu)->model().dims(), (*gpu)->model().activation(), nullptr);
    ASSERT_TRUE(step.ok()) << step.status();
    (*gpu)->set_device_step(step->get());
    absl::Status trained = (*gpu)->Train(1, abort, [](const v1::ProgressReport&) {});
    ASSERT_TRUE(trained.ok()) << trained;
    EXPECT_EQ((*gpu)->completed_step(), 40);
    // Evaluated on the GPU (the step is still attached), against the CPU trainer's evaluation.
    auto gpu_eval = (*gpu)->Evaluate();
    ASSERT_TRUE(gpu_eval.ok()) << gpu_eval.status();
    auto cpu_eval = (*cpu)->Evaluate();
    ASSERT_TRUE(cpu_eval.ok()) << cpu_eval.status();
    EXPECT_NEAR(gpu_eval->test_loss(), cpu_eval->test_loss(), 1e-4 * cpu_eval->test_loss());
    EXPECT_NEAR(gpu_eval->test_accuracy(), cpu_eval->test_accuracy(), 2.0 / 512);
    EXPECT_GT(gpu_eval->test_accuracy(), 0.3) << optimizer;
    (*gpu)->set_device_step(nullptr);

    // The host mirror was read back when Train ended.
    const Mlp& a = (*cpu)->model();
    const Mlp& b = (*gpu)->model();
    double err = 0, norm = 0;
    for (size_t i = 0; i < a.num_params(); ++i) {
      err += (double{a.params()[i]} - b.params()[i]) * (double{a.params()[i]} - b.params()[i]);
      norm += double{a.params()[i]} * a.params()[i];
    }
    EXPECT_LT(std::sqrt(err / norm), 1e-4) << optimizer;
  }
}

TEST(GpuTrainerTest, DeterministicModeIsRefusedOnGpu) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = Spec("sgd");
  spec.set_deterministic(true);
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create(spec, data, &comm);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto step =
      GpuStep::Create(spec, (*trainer)->model().dims(), (*trainer)->model().activation(), nullptr);
  ASSERT_TRUE(step.ok()) << step.status();
  (*trainer)->set_device_step(step->get());
  std::atomic<bool> abort{false};
  const absl::Status s = (*trainer)->Train(1, abort, [](const v1::ProgressReport&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  (*trainer)->set_device_step(nullptr);
}

}  // namespace
}  // namespace lockstep::worker
