// The trainer with its steps on the GPU (label gpu; skipped without a device): one rank trains
// the same job on the CPU and on the GPU and must end with the same parameters to FP32
// rounding, for SGD and AdamW, with and without gradient accumulation; the host mirror (what
// healing, checkpoints, evaluation and the checksum read) is current after Train. Deterministic
// mode on the GPU: reproducible to the bit, close to the CPU's, and its fixed-point sums are
// independent of how the micro-shards are split between ranks (what makes it the same bits for
// every world size). The GPT the same way: the CPU's parameters after a job with AdamW, weight
// decay on its matrices only, warm-up, cosine decay, clipping and gradient accumulation;
// deterministic mode reproducible and its fixed-point sums independent of the split. Healing's
// bulk transfer between the device states of a group over NCCL (two ranks on the one GPU,
// where NCCL allows it), and a step kept across generations.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <cstdlib>
#include <iostream>
#include <random>
#include <thread>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/testing/gpt_job.h"
#include "tests/testing/local_store.h"
#include "tests/testing/solo_communicator.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/data/dataset.h"
#include "worker/cuda/gpu_step.h"
#include "worker/model/mlp.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {
namespace {

using testing::SoloCommunicator;

// Before main: NCCL reads its variables once, at its first use in the process.
const bool kSharedGpuVariable = setenv(kNcclSharedGpuVariable, "1", /*overwrite=*/1) == 0;

v1::JobSpec Spec(const std::string& optimizer) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(64);
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(48);
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

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// What a run reported: the loss of each reported step (the first and the last always), and
// the evaluation at the end, on the GPU when it trained there (the engine still attached).
struct TrainRun {
  std::map<int64_t, double> losses;
  v1::EvalResult eval;
};

// Trains `spec` (its data set as a worker loads it) on one rank, on the GPU when `gpu`;
// returns the trainer (host mirror current). With `run`, also what it reported.
std::unique_ptr<Trainer> TrainOne(const v1::JobSpec& spec, bool gpu, absl::Status* status,
                                  TrainRun* run = nullptr) {
  auto data = LoadDataset(spec.dataset());
  if (!data.ok()) {
    *status = data.status();
    return nullptr;
  }
  static SoloCommunicator comm;
  std::atomic<bool> abort{false};
  auto trainer = Trainer::Create("test-job", spec, *data, &comm);
  if (!trainer.ok()) {
    *status = trainer.status();
    return nullptr;
  }
  if (gpu) {
    auto created = GpuStep::Create(spec, (*trainer)->sample_layout(), &(*trainer)->model(),
                                   &(*trainer)->optimizer());
    if (!created.ok()) {
      *status = created.status();
      return nullptr;
    }
    (*trainer)->set_engine(*std::move(created));
  }
  *status = (*trainer)->Train(1, abort, [run](const v1::ProgressReport& report) {
    if (run != nullptr) run->losses[report.step()] = report.loss();
  });
  if (status->ok() && run != nullptr) {
    absl::StatusOr<v1::EvalResult> eval = (*trainer)->Evaluate();
    if (!eval.ok()) *status = eval.status();
    if (eval.ok()) run->eval = *eval;
  }
  (*trainer)->set_engine(nullptr);
  return *std::move(trainer);
}

double RelativeDistance(const Model& a, const Model& b) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.num_params(); ++i) {
    err += (double{a.params()[i]} - b.params()[i]) * (double{a.params()[i]} - b.params()[i]);
    norm += double{a.params()[i]} * a.params()[i];
  }
  return std::sqrt(err / norm);
}

TEST(GpuTrainerTest, GpuStepsMatchCpuSteps) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  for (const char* optimizer : {"sgd", "adamw"}) {
    const v1::JobSpec spec = Spec(optimizer);
    auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
    SoloCommunicator comm;
    std::atomic<bool> abort{false};
    auto cpu = Trainer::Create("test-job", spec, data, &comm);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE((*cpu)->Train(1, abort, [](const v1::ProgressReport&) {}).ok());

    auto gpu = Trainer::Create("test-job", spec, data, &comm);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto step = GpuStep::Create(spec, (*gpu)->sample_layout(), &(*gpu)->model(),
                                &(*gpu)->optimizer());
    ASSERT_TRUE(step.ok()) << step.status();
    GpuStep* const engine = step->get();
    (*gpu)->set_engine(*std::move(step));
    absl::Status trained = (*gpu)->Train(1, abort, [](const v1::ProgressReport&) {});
    ASSERT_TRUE(trained.ok()) << trained;
    EXPECT_EQ((*gpu)->completed_step(), 40);
    EXPECT_TRUE(engine->pinned()) << "the batch was not in pinned memory";
    // Evaluated on the GPU (the step is still attached), against the CPU trainer's evaluation.
    auto gpu_eval = (*gpu)->Evaluate();
    ASSERT_TRUE(gpu_eval.ok()) << gpu_eval.status();
    auto cpu_eval = (*cpu)->Evaluate();
    ASSERT_TRUE(cpu_eval.ok()) << cpu_eval.status();
    EXPECT_NEAR(gpu_eval->test_loss(), cpu_eval->test_loss(), 1e-4 * cpu_eval->test_loss());
    EXPECT_NEAR(gpu_eval->test_accuracy(), cpu_eval->test_accuracy(), 2.0 / 512);
    EXPECT_GT(gpu_eval->test_accuracy(), 0.3) << optimizer;
    (*gpu)->set_engine(nullptr);

    // The host mirror was read back when Train ended.
    EXPECT_LT(RelativeDistance((*cpu)->model(), (*gpu)->model()), 1e-4) << optimizer;
  }
}

// Gradient accumulation on the GPU (4 micro-batches of 32, through both upload slots) trains the
// same model as the CPU with the whole batch at once.
TEST(GpuTrainerTest, GradientAccumulationMatchesCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  const v1::JobSpec spec = Spec("sgd");
  v1::JobSpec accumulated = spec;
  accumulated.set_micro_batch_size(32);
  absl::Status cpu_status, gpu_status;
  std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &cpu_status);
  ASSERT_TRUE(cpu_status.ok()) << cpu_status;
  std::unique_ptr<Trainer> gpu = TrainOne(accumulated, true, &gpu_status);
  ASSERT_TRUE(gpu_status.ok()) << gpu_status;
  EXPECT_EQ(gpu->micro_batch(), 32);
  EXPECT_LT(RelativeDistance(cpu->model(), gpu->model()), 1e-4);
}

// Global-norm clipping on the GPU (ClipByGlobalNorm before the update) trains the CPU's model,
// in the default mode and in deterministic mode, with a limit low enough that every step clips.
TEST(GpuTrainerTest, GradientClippingMatchesCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  for (bool deterministic : {false, true}) {
    // SGD: its step is proportional to the gradient, so clipping shows (Adam's would hide it).
    v1::JobSpec spec = Spec("sgd");
    spec.set_deterministic(deterministic);
    v1::JobSpec clipped = spec;
    clipped.mutable_optimizer()->set_grad_clip_norm(0.01);
    absl::Status s1, s2, s3;
    std::unique_ptr<Trainer> cpu_plain = TrainOne(spec, false, &s1);
    ASSERT_TRUE(s1.ok()) << s1;
    std::unique_ptr<Trainer> cpu = TrainOne(clipped, false, &s2);
    ASSERT_TRUE(s2.ok()) << s2;
    std::unique_ptr<Trainer> gpu = TrainOne(clipped, true, &s3);
    ASSERT_TRUE(s3.ok()) << s3;
    EXPECT_GT(RelativeDistance(cpu_plain->model(), cpu->model()), 1e-3)
        << "the limit must change the training for this test to mean anything";
    EXPECT_LT(RelativeDistance(cpu->model(), gpu->model()), 1e-4)
        << "deterministic " << deterministic;
  }
}

// Deterministic mode on the GPU: the same bits on every run, the CPU's result to float
// rounding (GPU products sum in another order), and a refusal of out-of-range gradients.
TEST(GpuTrainerTest, DeterministicModeIsReproducibleAndCloseToCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = Spec("adamw");
  spec.set_deterministic(true);
  absl::Status s1, s2, s3;
  std::unique_ptr<Trainer> first = TrainOne(spec, true, &s1);
  ASSERT_TRUE(s1.ok()) << s1;
  std::unique_ptr<Trainer> second = TrainOne(spec, true, &s2);
  ASSERT_TRUE(s2.ok()) << s2;
  EXPECT_EQ(first->ParameterChecksum(), second->ParameterChecksum());
  std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &s3);
  ASSERT_TRUE(s3.ok()) << s3;
  EXPECT_LT(RelativeDistance(cpu->model(), first->model()), 1e-4);

  v1::JobSpec diverging = Spec("sgd");
  diverging.set_deterministic(true);
  diverging.mutable_optimizer()->set_learning_rate(1e3);
  diverging.mutable_optimizer()->set_momentum(0.99);
  absl::Status s4;
  TrainOne(diverging, true, &s4);
  EXPECT_EQ(s4.code(), absl::StatusCode::kOutOfRange) << s4;
  EXPECT_NE(s4.message().find("fixed-point range"), std::string::npos) << s4;
}

// A split of 8 micro-shards between two ranks (0-2 and 3-7): their fixed-point sums add up,
// integer for integer, to one rank's sum of all 8 (what NCCL's int64 sum relies on). Returns
// that sum; `fixed_sum(first, count)` computes the shards [first, first + count).
std::vector<int64_t> ExpectSplitSumsAdd(
    size_t num_params, const std::function<std::vector<int64_t>(int, int)>& fixed_sum) {
  const std::vector<int64_t> all = fixed_sum(0, 8);
  const std::vector<int64_t> rank0 = fixed_sum(0, 3);
  const std::vector<int64_t> rank1 = fixed_sum(3, 5);
  EXPECT_EQ(all.size(), num_params + 2);
  if (rank0.size() != all.size() || rank1.size() != all.size()) {
    ADD_FAILURE() << "sums of " << rank0.size() << " and " << rank1.size() << " values, not "
                  << all.size();
    return all;
  }
  size_t nonzero = 0, wrong = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (rank0[i] + rank1[i] != all[i] && wrong++ == 0) {
      ADD_FAILURE() << "value " << i << " of " << all.size() << ": " << rank0[i] << " + "
                    << rank1[i] << " != " << all[i];
    }
    nonzero += all[i] != 0;
  }
  EXPECT_EQ(wrong, 0u);
  if (!all.empty()) {
    EXPECT_EQ(all.back(), 0) << "rejected values";
  }
  EXPECT_GT(nonzero, all.size() / 2);
  return all;
}

// Why deterministic mode gives the same bits for any world size: a rank's fixed-point sum
// depends only on which micro-shards it holds, not on where they sit in its share, so the
// integer sum over ranks (what NCCL computes, exactly) equals one rank's sum of all shards.
// Here two GpuSteps stand in for the ranks of a 2-worker group: shards 0-2 and 3-7 of 8.
TEST(GpuTrainerTest, DeterministicFixedPointSumIsIndependentOfTheSplit) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = Spec("sgd");
  spec.set_deterministic(true);
  const std::vector<int> dims = {20, 64, 48, 5};
  Mlp model(dims, kernels::Activation::kRelu);
  model.Initialize(7);
  const int shard = 16, shards = 8, n = shard * shards;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n) * dims.front());
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> y(n);
  for (int i = 0; i < n; ++i) y[i] = (i * 3) % dims.back();
  const float scale = 1.0f / n;
  Optimizer optimizer(spec.optimizer(), model.segments(), spec.max_steps());
  auto fixed_sum = [&](int first_shard, int count) -> std::vector<int64_t> {
    auto step =
        GpuStep::Create(spec, SampleLayout{dims.front(), 0}, &model, &optimizer);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    EXPECT_TRUE((*step)->Begin({}).ok());  // uploads the host's state
    const size_t at = static_cast<size_t>(first_shard) * shard;
    Batch batch;
    batch.n = count * shard;
    batch.features = x.data() + at * dims.front();
    batch.feature_stride = dims.front();
    batch.labels = y.data() + at;
    auto sum = (*step)->FixedPointGradient(batch, shard, scale, Trainer::kFixedPointFracBits);
    EXPECT_TRUE(sum.ok()) << sum.status();
    return sum.value_or(std::vector<int64_t>{});
  };
  ExpectSplitSumsAdd(model.num_params(), fixed_sum);
}


// The small GPT job of tests/testing/gpt_job.h, 30 steps.
v1::JobSpec GptSpec() {
  v1::JobSpec spec = testing::SmallGptSpec();
  spec.set_max_steps(30);
  return spec;
}

// The reported losses of two runs agree: the first step's to float rounding (the same
// parameters), the last's to `tolerance` (relative).
void ExpectLossesClose(const TrainRun& cpu, const TrainRun& gpu, double tolerance) {
  ASSERT_FALSE(cpu.losses.empty());
  ASSERT_EQ(gpu.losses.count(1), 1u);
  ASSERT_EQ(gpu.losses.count(cpu.losses.rbegin()->first), 1u);
  EXPECT_NEAR(gpu.losses.at(1), cpu.losses.at(1), 1e-5 * cpu.losses.at(1));
  EXPECT_NEAR(gpu.losses.rbegin()->second, cpu.losses.rbegin()->second,
              tolerance * cpu.losses.rbegin()->second);
  EXPECT_LT(cpu.losses.rbegin()->second, cpu.losses.at(1)) << "it learned";
}

// Per tensor, so a wrong piece (or a tensor decayed that should not be) is named.
void ExpectTensorsClose(const Model& cpu, const Model& gpu, double tolerance) {
  for (const Tensor& t : cpu.tensors()) {
    double err = 0, norm = 0;
    for (size_t i = t.offset; i < t.offset + t.count; ++i) {
      const double d = double{cpu.params()[i]} - gpu.params()[i];
      err += d * d;
      norm += double{cpu.params()[i]} * cpu.params()[i];
    }
    EXPECT_LE(std::sqrt(err), tolerance * std::sqrt(norm) + 1e-6) << t.name;
  }
}

TEST(GpuTrainerTest, GptOnTheGpuTrainsTheCpuModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  const v1::JobSpec spec = GptSpec();
  absl::Status cpu_status, gpu_status, accumulated_status;
  TrainRun cpu_run, gpu_run, micro_run;
  std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &cpu_status, &cpu_run);
  ASSERT_TRUE(cpu_status.ok()) << cpu_status;
  std::unique_ptr<Trainer> gpu = TrainOne(spec, true, &gpu_status, &gpu_run);
  ASSERT_TRUE(gpu_status.ok()) << gpu_status;
  EXPECT_EQ(gpu->completed_step(), 30);
  EXPECT_LT(RelativeDistance(cpu->model(), gpu->model()), 1e-3);
  ExpectTensorsClose(cpu->model(), gpu->model(), 1e-2);
  ExpectLossesClose(cpu_run, gpu_run, 1e-3);
  // Micro-batches of 4 on the GPU against the whole batch on the CPU: the loss is summed over
  // them, and the evaluation (on the GPU) runs in pieces of 4 windows.
  v1::JobSpec accumulated = spec;
  accumulated.set_micro_batch_size(4);
  std::unique_ptr<Trainer> micro = TrainOne(accumulated, true, &accumulated_status, &micro_run);
  ASSERT_TRUE(accumulated_status.ok()) << accumulated_status;
  EXPECT_EQ(micro->micro_batch(), 4);
  EXPECT_LT(RelativeDistance(cpu->model(), micro->model()), 1e-3);
  ExpectTensorsClose(cpu->model(), micro->model(), 1e-2);
  ExpectLossesClose(cpu_run, micro_run, 1e-3);
  // The validation on the GPU, against the CPU's on its own parameters.
  for (const TrainRun* run : {&gpu_run, &micro_run}) {
    EXPECT_EQ(run->eval.test_samples(), cpu_run.eval.test_samples());
    EXPECT_NEAR(run->eval.test_loss(), cpu_run.eval.test_loss(), 1e-3 * cpu_run.eval.test_loss());
    EXPECT_NEAR(run->eval.test_accuracy(), cpu_run.eval.test_accuracy(), 0.01);
  }
  EXPECT_LT(cpu_run.eval.test_loss(), std::log(256.0));
}

// Frozen tensors on the GPU: the device's gradient buffer holds them (kept zero), the update
// and the optimizer's state (the host's layout, trainable values only) skip them. A GPT with
// its embedding and first block frozen (AdamW, clipping: the norm must leave them out), and an
// MLP in deterministic mode with its first layer frozen (the fixed-point sum must count no
// rejection there), end near the CPU's parameters, and their frozen tensors keep their
// initial bits.
TEST(GpuTrainerTest, FrozenTensorsTrainOnTheGpuAsOnTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec gpt = GptSpec();
  gpt.mutable_model()->add_frozen_parameters("wte.weight");
  gpt.mutable_model()->add_frozen_parameters("h.0.*");
  v1::JobSpec mlp = Spec("adamw");
  mlp.set_deterministic(true);
  mlp.mutable_model()->add_frozen_parameters("fc1.*");
  for (const v1::JobSpec& spec : {gpt, mlp}) {
    SCOPED_TRACE(spec.model().type());
    absl::Status cpu_status, gpu_status;
    auto data = LoadDataset(spec.dataset());
    ASSERT_TRUE(data.ok()) << data.status();
    SoloCommunicator solo;
    auto fresh = Trainer::Create("test-job", spec, *data, &solo);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    ASSERT_GT((*fresh)->model().num_frozen_params(), 0u);
    TrainRun cpu_run, gpu_run;
    std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &cpu_status, &cpu_run);
    ASSERT_TRUE(cpu_status.ok()) << cpu_status;
    std::unique_ptr<Trainer> gpu = TrainOne(spec, true, &gpu_status, &gpu_run);
    ASSERT_TRUE(gpu_status.ok()) << gpu_status;
    ExpectTensorsClose(cpu->model(), gpu->model(), 1e-2);
    ExpectLossesClose(cpu_run, gpu_run, 1e-3);
    const Model& before = (*fresh)->model();
    for (size_t t = 0; t < before.tensors().size(); ++t) {
      if (!before.frozen(t)) continue;
      const Tensor& tensor = before.tensors()[t];
      EXPECT_TRUE(std::equal(before.params() + tensor.offset,
                             before.params() + tensor.offset + tensor.count,
                             gpu->model().params() + tensor.offset))
          << tensor.name << " changed on the GPU";
    }
  }
}

// bf16 products (FP32 master weights, sums and optimizer state) train the GPT as the CPU does,
// to bf16's precision: the first step's loss close (the same parameters), the last close, and
// the parameters near the CPU's but not equal to TF32's or FP32's rounding (bf16 really ran).
TEST(GpuTrainerTest, GptInBf16TrainsCloseToCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = GptSpec();
  absl::Status cpu_status, bf16_status;
  TrainRun cpu_run, bf16_run;
  std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &cpu_status, &cpu_run);
  ASSERT_TRUE(cpu_status.ok()) << cpu_status;
  spec.set_precision("bf16");
  std::unique_ptr<Trainer> bf16 = TrainOne(spec, true, &bf16_status, &bf16_run);
  ASSERT_TRUE(bf16_status.ok()) << bf16_status;
  EXPECT_EQ(bf16->completed_step(), 30);
  ASSERT_EQ(bf16_run.losses.count(1), 1u);
  EXPECT_NEAR(bf16_run.losses.at(1), cpu_run.losses.at(1), 1e-2 * cpu_run.losses.at(1));
  EXPECT_NEAR(bf16_run.losses.rbegin()->second, cpu_run.losses.rbegin()->second,
              5e-2 * cpu_run.losses.rbegin()->second);
  EXPECT_NEAR(bf16_run.eval.test_loss(), cpu_run.eval.test_loss(), 5e-2 * cpu_run.eval.test_loss());
  const double distance = RelativeDistance(cpu->model(), bf16->model());
  EXPECT_LT(distance, 5e-2);
  // Further from the CPU than the same job in FP32 on the GPU: the products were rounded.
  spec.set_precision("fp32");
  absl::Status fp32_status;
  std::unique_ptr<Trainer> fp32 = TrainOne(spec, true, &fp32_status);
  ASSERT_TRUE(fp32_status.ok()) << fp32_status;
  EXPECT_GT(distance, 3 * RelativeDistance(cpu->model(), fp32->model()))
      << "as close as FP32: were the products rounded to bf16?";
}

TEST(GpuTrainerTest, GptDeterministicModeIsReproducibleAndCloseToCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = GptSpec();
  spec.set_deterministic(true);
  absl::Status s1, s2, s3;
  TrainRun first_run, second_run, cpu_run;
  std::unique_ptr<Trainer> first = TrainOne(spec, true, &s1, &first_run);
  ASSERT_TRUE(s1.ok()) << s1;
  std::unique_ptr<Trainer> second = TrainOne(spec, true, &s2, &second_run);
  ASSERT_TRUE(s2.ok()) << s2;
  EXPECT_EQ(first->ParameterChecksum(), second->ParameterChecksum());
  EXPECT_EQ(first_run.losses, second_run.losses);
  std::unique_ptr<Trainer> cpu = TrainOne(spec, false, &s3, &cpu_run);
  ASSERT_TRUE(s3.ok()) << s3;
  EXPECT_LT(RelativeDistance(cpu->model(), first->model()), 1e-3);
  ExpectLossesClose(cpu_run, first_run, 1e-3);
}

// The GPT's fixed-point sums, as DeterministicFixedPointSumIsIndependentOfTheSplit.
TEST(GpuTrainerTest, GptFixedPointSumIsIndependentOfTheSplit) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = GptSpec();
  spec.set_deterministic(true);
  auto data = LoadDataset(spec.dataset());
  ASSERT_TRUE(data.ok()) << data.status();
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, *data, &comm);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Model& model = (*trainer)->model();
  const int stride = spec.model().gpt().context_length() + 1;
  const int shard = 2, shards = 8, n = shard * shards;
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(static_cast<size_t>(n) * stride);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 256);
  auto fixed_sum = [&](int first_shard, int count) -> std::vector<int64_t> {
    auto step = GpuStep::Create(spec, (*trainer)->sample_layout(), &model,
                                &(*trainer)->optimizer());
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    EXPECT_TRUE((*step)->Begin({}).ok());  // uploads the host's state
    Batch batch;
    batch.n = count * shard;
    batch.tokens = tokens.data() + static_cast<size_t>(first_shard) * shard * stride;
    batch.token_stride = stride;
    auto sum = (*step)->FixedPointGradient(batch, shard, 1.0f / n, Trainer::kFixedPointFracBits);
    EXPECT_TRUE(sum.ok()) << sum.status();
    return sum.value_or(std::vector<int64_t>{});
  };
  const std::vector<int64_t> all = ExpectSplitSumsAdd(model.num_params(), fixed_sum);
  ASSERT_EQ(all.size(), model.num_params() + 2);
  // The loss in fixed point: the mean over the 16 windows, as the CPU model computes it.
  Batch batch;
  batch.n = n;
  batch.tokens = tokens.data();
  batch.token_stride = stride;
  int64_t correct = 0;
  const double cpu_loss = model.Evaluate(batch, &correct) / n;
  EXPECT_NEAR(std::ldexp(static_cast<double>(all[all.size() - 2]), -Trainer::kFixedPointFracBits),
              cpu_loss, 1e-5 * cpu_loss);
}

// What Trainer::Heal hands the engine, between two ranks on one GPU over NCCL: the source
// sends its device state when that is the host's (shown by changing its host copy behind the
// engine's back: the receiver still gets the device's bits), and the host's through scratch
// memory once told its host state changed (a small piece, then the whole); a taker receives into its device state and its staging, a non-taker into scratch
// only; a taker told it has the state uploads nothing at its next Begin. Without a group the
// trainer is told to use its communicator (UNIMPLEMENTED).
TEST(GpuTrainerTest, HealGoesBetweenDeviceStatesOverNccl) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  const v1::JobSpec spec = Spec("adamw");
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  using Part = StepEngine::StatePart;
  {
    SoloCommunicator solo;
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    auto alone = GpuStep::Create(spec, trainer->sample_layout(), &trainer->model(),
                                 &trainer->optimizer());
    ASSERT_TRUE(alone.ok()) << alone.status();
    std::vector<float> piece(8);
    EXPECT_TRUE(absl::IsUnimplemented(
        (*alone)->BroadcastState({}, Part::kParams, 0, piece.size(), piece.data(), 0, true)));
  }
  ASSERT_TRUE(kSharedGpuVariable);
  if (!NcclSharedGpuAllowed()) {
    // nccl_communicator_test's TwoRanksOnOneGpu checks the refusal; a one-GPU host can do no more.
    std::cout << "NCCL " << NcclVersionName(NcclRuntimeVersion())
              << " refuses two ranks on one GPU: the group part is not run" << std::endl;
    return;
  }
  coordinator::BootstrapStore store;
  const coordinator::StoreScope scope{"job-1", 1};
  store.Open(scope);
  absl::Status status[2];
  std::vector<float> source_device;  // rank 0's parameters as its device holds them
  std::vector<float> received, device_after, untouched, from_host, device_after_host;
  std::vector<float> optimizer_received, optimizer_device;
  int64_t taker_uploads = -1;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      status[rank] = [&]() -> absl::Status {
        cudaSetDevice(0);
        SoloCommunicator solo;
        auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
        Model& model = trainer->model();
        const size_t n = model.num_params();
        std::vector<float>& opt = trainer->optimizer().state();
        opt.assign(2 * n, 0.0f);
        if (rank == 1) {  // the taker starts from other parameters and optimizer state
          for (size_t i = 0; i < n; ++i) model.params()[i] += 1.0f;
          std::fill(opt.begin(), opt.end(), 3.0f);
        } else {
          for (size_t i = 0; i < opt.size(); ++i) opt[i] = 0.001f * static_cast<float>(i % 97);
        }
        testing::LocalStoreClient client(&store, scope);
        auto comm = NcclCommunicator::Create(client, rank, 2, {});
        if (!comm.ok()) return comm.status();
        auto step =
            GpuStep::Create(spec, trainer->sample_layout(), &model, &trainer->optimizer());
        if (!step.ok()) return step.status();
        GpuStep& engine = **step;
        const StepGroup group{nullptr, comm->get()};
        LOCKSTEP_RETURN_IF_ERROR(engine.Begin(group));  // uploads the host's
        std::vector<float> staging(n, -1.0f), opt_staging(2 * n, -1.0f);
        if (rank == 0) {
          source_device.assign(model.params(), model.params() + n);
          // Behind the engine's back: what goes out must still be the device's copy.
          for (size_t i = 0; i < n; ++i) model.params()[i] = -5.0f;
          std::fill(opt.begin(), opt.end(), -7.0f);
        }
        float* const params_piece = rank == 0 ? model.params() : staging.data();
        // 1. From rank 0's device state into rank 1's: the parameters, then the optimizer state.
        LOCKSTEP_RETURN_IF_ERROR(
            engine.BroadcastState(group, Part::kParams, 0, n, params_piece, 0, true));
        LOCKSTEP_RETURN_IF_ERROR(engine.BroadcastState(
            group, Part::kOptimizer, 0, 2 * n, rank == 0 ? opt.data() : opt_staging.data(), 0, true));
        std::vector<float> device_params(n), device_opt;
        if (rank == 1) {
          received = staging;
          optimizer_received = opt_staging;
          LOCKSTEP_RETURN_IF_ERROR(engine.DownloadState(device_params.data(), &device_opt));
          device_after = device_params;
          optimizer_device = device_opt;
          // The trainer commits and says so: no upload at the next Begin.
          engine.HostStateChanged(true);
          LOCKSTEP_RETURN_IF_ERROR(engine.Begin(group));
          taker_uploads = engine.uploads();
        }
        // 2. Rank 0's host copy, once it is told its host state changed: 100 values, then all;
        //    rank 1 does not take it (its device state stays).
        if (rank == 0) {
          for (size_t i = 0; i < n; ++i) model.params()[i] = 0.25f * static_cast<float>(i % 13);
          engine.HostStateChanged(false);
        }
        std::vector<float> discard(n, 9.0f);
        float* const host_piece = rank == 0 ? model.params() : discard.data();
        for (size_t count : {size_t{100}, n}) {
          LOCKSTEP_RETURN_IF_ERROR(
              engine.BroadcastState(group, Part::kParams, 0, count, host_piece, 0, false));
        }
        if (rank == 1) {
          untouched = discard;
          LOCKSTEP_RETURN_IF_ERROR(engine.DownloadState(device_params.data(), &device_opt));
          device_after_host = device_params;
        }
        // 3. Taken, that host copy arrives whole.
        LOCKSTEP_RETURN_IF_ERROR(
            engine.BroadcastState(group, Part::kParams, 0, n, host_piece, 0, true));
        if (rank == 1) from_host = discard;
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int rank = 0; rank < 2; ++rank) ASSERT_TRUE(status[rank].ok()) << rank << ": " << status[rank];
  const size_t n = source_device.size();
  EXPECT_EQ(received, source_device) << "the taker's staging holds the source's device copy";
  EXPECT_EQ(device_after, source_device) << "and so does its device state";
  std::vector<float> want_opt(2 * n);
  for (size_t i = 0; i < want_opt.size(); ++i) want_opt[i] = 0.001f * static_cast<float>(i % 97);
  EXPECT_EQ(optimizer_received, want_opt);
  EXPECT_EQ(optimizer_device, want_opt);
  EXPECT_EQ(taker_uploads, 1) << "only the first Begin uploaded";
  EXPECT_EQ(untouched, std::vector<float>(n, 9.0f)) << "a non-taker's staging is left alone";
  EXPECT_EQ(device_after_host, source_device) << "and so is its device state";
  std::vector<float> want_host(n);
  for (size_t i = 0; i < n; ++i) want_host[i] = 0.25f * static_cast<float>(i % 13);
  EXPECT_EQ(from_host, want_host) << "after HostStateChanged(false) the source sends its host's";
}

// A GpuStep kept across generations (as the trainer keeps it): the second generation uploads
// nothing and the job ends with the parameters of one uninterrupted GPU run, to the bit.
TEST(GpuTrainerTest, AKeptStepTrainsOnAcrossGenerationsWithoutUploading) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable GPU";
  v1::JobSpec spec = Spec("adamw");
  spec.set_deterministic(true);  // bits to compare across runs
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator solo;
  std::string checksum[2];
  int64_t uploads = 0;
  for (int kept = 0; kept < 2; ++kept) {
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    auto step = GpuStep::Create(spec, trainer->sample_layout(), &trainer->model(),
                                &trainer->optimizer());
    ASSERT_TRUE(step.ok()) << step.status();
    GpuStep* engine = step->get();
    trainer->set_engine(*std::move(step));
    std::atomic<bool> abort{false};
    const int64_t stop = kept == 1 ? 17 : trainer->total_steps();
    absl::Status s = trainer->Train(
        1, abort,
        [&](const v1::ProgressReport& r) {
          if (r.step() == stop) abort.store(true);
        },
        nullptr, absl::ZeroDuration());
    if (kept == 1) {
      ASSERT_TRUE(absl::IsAborted(s)) << s;
      ASSERT_EQ(trainer->completed_step(), 17);
      ASSERT_TRUE(trainer->Heal({"w0"}).ok());
      abort.store(false);
      s = trainer->Train(18, abort, [](const v1::ProgressReport&) {});
      uploads = engine->uploads();
    }
    ASSERT_TRUE(s.ok()) << s;
    checksum[kept] = trainer->ParameterChecksum();
  }
  EXPECT_EQ(uploads, 1);
  EXPECT_EQ(checksum[1], checksum[0]);
}

}  // namespace
}  // namespace lockstep::worker
