// The training step: MLP gradients against finite differences, and data-parallel training over
// a real in-process Gloo group matching single-worker training (the global batch is fixed, so
// only the float summation order differs). Healing; and a device's engine kept across
// generations, played by a CPU stand-in with the same StateMirror (KeptEngineTest).
#include "worker/train/trainer.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include "common/job_memory.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "tests/testing/gloo_group.h"
#include "tests/testing/mlp_job.h"
#include "tests/testing/solo_communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/step/cpu_step.h"
#include "worker/data/dataset.h"
#include "worker/model/mlp.h"
#include "worker/step/optimizer.h"

namespace lockstep::worker {
namespace {

using testing::SoloCommunicator;

v1::JobSpec SyntheticSpec() { return testing::SyntheticMlpSpec(); }

TEST(MlpTest, GradientMatchesFiniteDifferences) {
  for (auto act : {kernels::Activation::kRelu, kernels::Activation::kGelu}) {
    Mlp mlp({5, 7, 3}, act);
    mlp.Initialize(9);
    const int n = 6;
    std::vector<float> x(n * 5);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(1.7 * i + 0.3);
    std::vector<int32_t> y = {0, 1, 2, 1, 0, 2};
    std::vector<size_t> ready;
    mlp.ForwardBackward(x.data(), y.data(), n, 1.0f, /*chunk_floats=*/10, nullptr,
                        [&](size_t end) { ready.push_back(end); });
    // Last layer (3x7 + 3) first in rows of 1 (10/7), then the first layer (7x5 + 7) in rows
    // of 2: a growing prefix ending at num_params.
    EXPECT_EQ(ready, mlp.ReadyPoints(10));
    EXPECT_EQ(ready, (std::vector<size_t>{7, 14, 21, 24, 34, 44, 54, 59, 66}));
    std::vector<float> analytic(mlp.grads(), mlp.grads() + mlp.num_params());
    double err = 0, norm = 0;
    for (size_t i = 0; i < mlp.num_params(); ++i) {
      const float saved = mlp.params()[i];
      const float h = 1e-2f;
      int64_t c = 0;
      mlp.params()[i] = saved + h;
      const double up = mlp.Evaluate(x.data(), y.data(), n, &c);
      mlp.params()[i] = saved - h;
      const double down = mlp.Evaluate(x.data(), y.data(), n, &c);
      mlp.params()[i] = saved;
      const double numeric = (up - down) / (2 * h);
      err += (numeric - analytic[i]) * (numeric - analytic[i]);
      norm += numeric * numeric;
    }
    // Central differences in float with h = 1e-2 carry O(h^2) truncation plus rounding of the
    // loss difference; 1e-2 relative is far below what a wrong gradient gives (~1).
    EXPECT_LT(std::sqrt(err / norm), 1e-2) << "activation " << static_cast<int>(act);
  }
}

// Gradient accumulation: two micro-batches, the second with `accumulate`, give the gradient of
// the whole batch (to float rounding of the split sums) and the same ready points.
TEST(MlpTest, AccumulatedMicroBatchesMatchOneBatch) {
  Mlp whole({5, 7, 3}, kernels::Activation::kGelu), split({5, 7, 3}, kernels::Activation::kGelu);
  whole.Initialize(9);
  split.Initialize(9);
  const int n = 10, first = 4;
  std::vector<float> x(n * 5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.9 * i + 0.1);
  std::vector<int32_t> y(n);
  for (int i = 0; i < n; ++i) y[i] = (i * 5) % 3;
  const double loss = whole.ForwardBackward(x.data(), y.data(), n, 0.1f, 10, nullptr, nullptr);
  // Stale values must be overwritten by the first pass.
  std::fill(split.grads(), split.grads() + split.num_params(), 123.0f);
  double split_loss = split.ForwardBackward(x.data(), y.data(), first, 0.1f, 10, nullptr, nullptr);
  std::vector<size_t> ready;
  split_loss += split.ForwardBackward(
      x.data() + first * 5, y.data() + first, n - first, 0.1f, 10, nullptr,
      [&](size_t end) { ready.push_back(end); }, /*accumulate=*/true);
  EXPECT_EQ(ready, split.ReadyPoints(10));
  EXPECT_NEAR(split_loss, loss, 1e-12 * loss);
  double err = 0, norm = 0;
  for (size_t i = 0; i < whole.num_params(); ++i) {
    const double d = split.grads()[i] - whole.grads()[i];
    err += d * d;
    norm += static_cast<double>(whole.grads()[i]) * whole.grads()[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-6);
  EXPECT_GT(norm, 0);
}

// The fused fixed-point update gives the bits of FromFixedPoint followed by Step, for both
// optimizers and a size that is not a multiple of its block, including a value above 2^51.
TEST(OptimizerTest, StepFixedPointMatchesConvertThenStep) {
  for (const char* type : {"sgd", "adamw"}) {
    v1::OptimizerSpec spec;
    spec.set_type(type);
    spec.set_learning_rate(0.01);
    spec.set_momentum(0.9);
    spec.set_weight_decay(0.01);
    spec.set_warmup_steps(2);
    const size_t n = 10'000;
    Optimizer fused(spec, n, 100), plain(spec, n, 100);
    std::vector<float> p1(n), p2(n), g(n);
    std::vector<int64_t> fixed(n);
    for (size_t i = 0; i < n; ++i) {
      p1[i] = p2[i] = std::sin(static_cast<float>(i));
      fixed[i] = static_cast<int64_t>((i * 2654435761u) % 2000003) - 1000001;
    }
    fixed[5000] = int64_t{1} << 55;
    for (int64_t step = 1; step <= 3; ++step) {
      fused.StepFixedPoint(p1.data(), fixed.data(), 32, step);
      kernels::FromFixedPoint(fixed.data(), n, 32, g.data());
      plain.Step(p2.data(), g.data(), step);
    }
    EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), n * sizeof(float))) << type;
    EXPECT_EQ(fused.state(), plain.state()) << type;
  }
}

TEST(TrainerTest, SoloTrainingReducesLossAndCountsSteps) {
  v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_EQ((*trainer)->total_steps(), 60);
  std::vector<v1::ProgressReport> reports;
  std::atomic<bool> abort{false};
  ASSERT_TRUE((*trainer)
                  ->Train(
                      1, abort, [&](const v1::ProgressReport& r) { reports.push_back(r); },
                      nullptr, absl::ZeroDuration())
                  .ok());
  ASSERT_EQ(reports.size(), 60u);
  EXPECT_EQ(reports.back().step(), 60);
  EXPECT_EQ(reports.back().total_steps(), 60);
  EXPECT_LT(reports.back().loss(), 0.8 * reports.front().loss());
  auto eval = (*trainer)->Evaluate();
  ASSERT_TRUE(eval.ok());
  EXPECT_EQ(eval->test_samples(), 512);
  EXPECT_GT(eval->test_accuracy(), 0.4) << "4 classes: chance is 0.25";
}

TEST(TrainerTest, AdamWWithWarmupAndCosineDecayTrains) {
  v1::JobSpec spec = SyntheticSpec();
  spec.mutable_optimizer()->set_type("adamw");
  spec.mutable_optimizer()->set_learning_rate(0.01);
  spec.mutable_optimizer()->set_beta1(0.9);
  spec.mutable_optimizer()->set_beta2(0.999);
  spec.mutable_optimizer()->set_epsilon(1e-8);
  spec.mutable_optimizer()->set_weight_decay(0.01);
  spec.mutable_optimizer()->set_warmup_steps(10);
  spec.mutable_optimizer()->set_cosine_decay(true);
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm).value();
  std::vector<double> losses;
  std::atomic<bool> abort{false};
  ASSERT_TRUE(trainer
                  ->Train(
                      1, abort, [&](const v1::ProgressReport& r) { losses.push_back(r.loss()); },
                      nullptr, absl::ZeroDuration())
                  .ok());
  ASSERT_EQ(losses.size(), 60u);
  EXPECT_LT(losses.back(), 0.7 * losses.front());
  Optimizer schedule(spec.optimizer(), 1, 60);
  EXPECT_DOUBLE_EQ(schedule.LearningRate(5), 0.005);     // warm-up: 5/10 of the peak
  EXPECT_DOUBLE_EQ(schedule.LearningRate(10), 0.01);     // peak
  EXPECT_NEAR(schedule.LearningRate(35), 0.005, 1e-12);  // half-way down the cosine
  EXPECT_NEAR(schedule.LearningRate(60), 0.0, 1e-12);
}

TEST(TrainerTest, AbortStopsBetweenSteps) {
  v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm).value();
  std::atomic<bool> abort{false};
  absl::Status s = trainer->Train(
      1, abort,
      [&](const v1::ProgressReport& r) {
        if (r.step() == 5) abort = true;
      },
      nullptr, absl::ZeroDuration());
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(trainer->completed_step(), 5);
}

TEST(TrainerTest, BatchLargerThanDataIsAPreconditionFailure) {
  v1::JobSpec spec = SyntheticSpec();
  spec.set_global_batch_size(4096);
  spec.set_micro_shards(8);
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm);
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(trainer.status().message().find("4096"), std::string::npos);
}

// Trains the job on `world` ranks of an in-process Gloo group; returns rank 0's parameters
// and every rank's checksum.
std::pair<std::vector<float>, std::vector<std::string>> TrainOnGloo(const v1::JobSpec& spec,
                                                                    int world, bool shm) {
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  std::vector<std::vector<float>> params(world);
  std::vector<std::string> checksums(world);
  testing::RunInGlooGroup(world, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    auto trainer = Trainer::Create("test-job", spec, data, gloo.get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    std::unique_ptr<Communicator> comm = std::move(gloo);
    if (shm) {
      auto wrapped = ShmCommunicator::Wrap(std::move(comm), (*trainer)->largest_collective_bytes(),
                                           std::chrono::milliseconds(20000));
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      comm = *std::move(wrapped);
    }
    (*trainer)->set_communicator(comm.get());
    std::atomic<bool> abort{false};
    ASSERT_TRUE((*trainer)->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
    auto eval = (*trainer)->Evaluate();
    ASSERT_TRUE(eval.ok()) << eval.status();
    Model& m = (*trainer)->model();
    params[r].assign(m.params(), m.params() + m.num_params());
    checksums[r] = (*trainer)->ParameterChecksum();
  });
  return {params[0], checksums};
}

TEST(TrainerTest, DataParallelMatchesSingleWorker) {
  const v1::JobSpec spec = SyntheticSpec();
  auto [solo, solo_sums] = TrainOnGloo(spec, 1, false);
  for (auto [world, shm] : {std::pair{2, false}, {3, false}, {2, true}, {3, true}}) {
    auto [params, sums] = TrainOnGloo(spec, world, shm);
    ASSERT_EQ(params.size(), solo.size());
    for (int r = 1; r < world; ++r) {
      EXPECT_EQ(sums[r], sums[0]) << "rank " << r << " diverged from rank 0 (world " << world
                                  << ")";
    }
    double err = 0, norm = 0;
    for (size_t i = 0; i < solo.size(); ++i) {
      err += (params[i] - solo[i]) * (params[i] - solo[i]);
      norm += solo[i] * solo[i];
    }
    // Same samples, same global batch: only the summation order of the gradient differs, which
    // over 60 steps of SGD with momentum stays at float rounding scale.
    EXPECT_LT(std::sqrt(err / norm), 1e-4) << "world " << world << " shm " << shm;
  }
}

// Gradient accumulation: micro-batches of one micro-shard train the same model as the whole
// share at once (to float rounding), for one and for two workers.
TEST(TrainerTest, GradientAccumulationMatchesWholeShare) {
  const v1::JobSpec spec = SyntheticSpec();  // batch 64 in 8 micro-shards of 8
  auto [whole, whole_sums] = TrainOnGloo(spec, 1, false);
  v1::JobSpec accumulated = spec;
  accumulated.set_micro_batch_size(8);
  for (int world : {1, 2}) {
    auto [params, sums] = TrainOnGloo(accumulated, world, false);
    ASSERT_EQ(params.size(), whole.size());
    double err = 0, norm = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      err += (params[i] - whole[i]) * (params[i] - whole[i]);
      norm += whole[i] * whole[i];
    }
    EXPECT_LT(std::sqrt(err / norm), 1e-4) << "world " << world;
    if (world == 2) {
      EXPECT_EQ(sums[0], sums[1]);
    }
  }
}

// The memory budget decides the micro-batch: the whole share when it fits, else whole
// micro-shards; micro_batch_size overrides it.
TEST(TrainerTest, MemoryBudgetChoosesTheMicroBatch) {
  v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm).value();
  EXPECT_EQ(trainer->micro_batch(), 64);
  const int64_t fixed = EstimateWorkerMemory(spec, 0).total();
  const int64_t per_shard = EstimateWorkerMemory(spec, 8).total() - fixed;
  trainer->set_memory_budget(fixed + 3 * per_shard);
  EXPECT_EQ(trainer->micro_batch(), 24);
  trainer->set_memory_budget(int64_t{1} << 40);
  EXPECT_EQ(trainer->micro_batch(), 64);
  std::atomic<bool> abort{false};
  trainer->set_memory_budget(fixed + per_shard);
  ASSERT_EQ(trainer->micro_batch(), 8);
  ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
  EXPECT_EQ(trainer->completed_step(), 60);
}

// Deterministic mode: the same bits for any world size and either transport.
TEST(TrainerTest, DeterministicModeIsBitwiseIdenticalForEveryWorldSize) {
  v1::JobSpec spec = SyntheticSpec();
  spec.set_deterministic(true);
  auto [solo, solo_sums] = TrainOnGloo(spec, 1, false);
  for (auto [world, shm] : {std::pair{2, false}, {3, false}, {4, false}, {2, true}, {3, true}}) {
    auto [params, sums] = TrainOnGloo(spec, world, shm);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(sums[r], solo_sums[0]) << "world " << world << " rank " << r << " shm " << shm;
    }
  }
  // The default (float) mode differs from it, so the comparison above is not vacuous.
  auto [float_params, float_sums] = TrainOnGloo(SyntheticSpec(), 1, false);
  EXPECT_NE(float_sums[0], solo_sums[0]);
}

TEST(TrainerTest, DeterministicModeReportsOutOfRangeGradients) {
  v1::JobSpec spec = SyntheticSpec();
  spec.set_deterministic(true);
  spec.mutable_optimizer()->set_learning_rate(1e3);  // diverges within a few steps
  spec.mutable_optimizer()->set_momentum(0.99);
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator comm;
  auto trainer = Trainer::Create("test-job", spec, data, &comm).value();
  std::atomic<bool> abort{false};
  absl::Status s = trainer->Train(1, abort, [](const v1::ProgressReport&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("fixed-point range"), std::string::npos) << s;
}

}  // namespace
}  // namespace lockstep::worker

namespace lockstep::worker {
namespace {

// A communicator whose broadcasts fail from the `fail_at`-th on, after aborting the real one:
// a heal source that dies part-way through sending its state.
class DiesMidBroadcast final : public Communicator {
 public:
  DiesMidBroadcast(std::unique_ptr<GlooCommunicator> base, int fail_at)
      : base_(std::move(base)), fail_at_(fail_at) {}
  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  absl::Status AllreduceSum(float* d, size_t n) override { return base_->AllreduceSum(d, n); }
  absl::Status AllreduceSum(double* d, size_t n) override { return base_->AllreduceSum(d, n); }
  absl::Status AllreduceSum(int64_t* d, size_t n) override { return base_->AllreduceSum(d, n); }
  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    if (++broadcasts_ >= fail_at_) {
      base_.reset();  // its sockets close, as a killed process's do
      return absl::UnavailableError("the source died");
    }
    return base_->Broadcast(data, bytes, root);
  }
  absl::Status Barrier() override { return base_->Barrier(); }

 private:
  std::unique_ptr<GlooCommunicator> base_;
  const int fail_at_;
  int broadcasts_ = 0;
};

// Defect 2: the heal source dies after sending part of its state (the header and the
// parameters, not the optimizer state). The receiver must keep exactly its previous state.
TEST(HealTest, ASourceLostMidBroadcastLeavesTheReceiversStateUntouched) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  std::string receiver_before, receiver_after;
  int64_t receiver_step = -1;
  absl::Status receiver_heal;
  testing::RunInGlooGroup(2, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    SoloCommunicator solo;
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    std::atomic<bool> abort{false};
    if (r == 0) {  // the source: 10 steps ahead
      ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
      DiesMidBroadcast dying(std::move(gloo), /*fail_at=*/3);
      trainer->set_communicator(&dying);
      EXPECT_FALSE(trainer->Heal({"w0", "w1"}).ok());
    } else {
      receiver_before = trainer->ParameterChecksum();
      trainer->set_communicator(gloo.get());
      receiver_heal = trainer->Heal({"w0", "w1"}).status();
      receiver_after = trainer->ParameterChecksum();
      receiver_step = trainer->completed_step();
    }
  });
  EXPECT_FALSE(receiver_heal.ok());
  EXPECT_EQ(receiver_after, receiver_before) << "a half-received state must not be committed";
  EXPECT_EQ(receiver_step, 0);
}

// A complete heal commits the source's state: same checksum, same step, on every member.
TEST(HealTest, ACompleteHealCommitsTheSourcesState) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  std::vector<std::string> sums(3);
  std::vector<Trainer::HealInfo> infos(3);
  testing::RunInGlooGroup(3, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    SoloCommunicator solo;
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    std::atomic<bool> abort{false};
    if (r == 1) {
      ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
    }
    trainer->set_communicator(gloo.get());
    auto info = trainer->Heal({"w0", "w1", "w2"});
    ASSERT_TRUE(info.ok()) << info.status();
    infos[r] = *info;
    sums[r] = trainer->ParameterChecksum();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(sums[r], sums[1]) << "rank " << r;
    EXPECT_EQ(infos[r].source_rank, 1);
    EXPECT_EQ(infos[r].resumed_from_step, 60);
  }
}

// Two members at the same step with other bits (a step trained again after a rollback, in
// another world size): the lower rank's state wins, and both end identical.
TEST(HealTest, MembersAtTheSameStepWithOtherBitsAreHealed) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  std::vector<std::string> sums(2);
  std::vector<Trainer::HealInfo> infos(2);
  testing::RunInGlooGroup(2, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    SoloCommunicator solo;
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    std::atomic<bool> abort{false};
    ASSERT_TRUE(trainer->Train(1, abort, [](const v1::ProgressReport&) {}).ok());
    if (r == 1) trainer->model().params()[3] += 0.5f;
    trainer->set_communicator(gloo.get());
    auto info = trainer->Heal({"w0", "w1"});
    ASSERT_TRUE(info.ok()) << info.status();
    infos[r] = *info;
    sums[r] = trainer->ParameterChecksum();
  });
  EXPECT_EQ(sums[0], sums[1]);
  EXPECT_EQ(infos[1].source_rank, 0);
  EXPECT_EQ(infos[1].resumed_from_step, 60);
}

// Defect 8's safety net: members that hold different data (another file behind the same path
// on another host) fail the job, naming the members, the data and the part that differs.
TEST(HealTest, MembersWithDifferentDataFailNamingThem) {
  v1::JobSpec spec = SyntheticSpec();
  auto mine = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  auto other = std::make_shared<Dataset>(*mine);
  other->train.y[7] = (other->train.y[7] + 1) % 4;
  other->parts[0].hash ^= 1;  // what hashing the changed labels gives: another value
  std::vector<absl::Status> heals(2);
  testing::RunInGlooGroup(2, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    auto trainer = Trainer::Create("test-job", spec, r == 0 ? mine : other, gloo.get()).value();
    heals[r] = trainer->Heal({"w0", "w1"}).status();
  });
  for (const absl::Status& s : heals) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("different data"), std::string::npos) << s;
    EXPECT_NE(s.message().find("w1 (rank 1)"), std::string::npos) << s;
    EXPECT_NE(s.message().find("synthetic data set"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace lockstep::worker

namespace lockstep::worker {
namespace {

// A device's group played on the CPU: a communicator of its own (GpuStep's is NCCL's).
struct HostDeviceGroup final : DeviceGroup {
  explicit HostDeviceGroup(Communicator* c) : comm(c) {}
  Communicator* const comm;
};

// A device's engine (GpuStep) played on the CPU: a copy of the state of its own (the "device
// memory"), trained by a CpuStep, mirrored with the host's by the StateMirror that GpuStep
// uses, and healing over the device group the trainer hands it (a HostDeviceGroup). What these tests check is the trainer's side
// of the contract (an engine kept across generations is told when the host's state is
// rewritten; a heal goes through it): an engine that trained on a stale copy would end with
// other bits than the plain CPU trainer's.
class MirroredEngine final : public StepEngine {
 public:
  MirroredEngine(const v1::JobSpec& spec, const Dataset& data, Trainer& host)
      : host_(&host),
        model_(CreateModel(spec.model(), DataShape{data.dim, data.classes}).value()),
        optimizer_(std::make_unique<Optimizer>(spec.optimizer(), model_->segments(),
                                               host.total_steps())),
        step_(spec, model_.get(), optimizer_.get(), SampleLayout{data.dim, 0}) {}

  int uploads = 0, pieces_from_device = 0, pieces_into_device = 0;
  bool fail_downloads = false;  // as a device whose copies back fail

  const char* device() const override { return "mirrored"; }
  absl::Status Begin(const StepGroup& group) override {
    if (mirror_.upload_needed()) {
      Copy(host_->model(), host_->optimizer(), *model_, *optimizer_);
      mirror_.Copied();
      ++uploads;
    }
    return step_.Begin(group);
  }
  absl::Status Sync() override {
    if (mirror_.download_needed() && fail_downloads) {
      return absl::InternalError("the copy back failed");
    }
    if (mirror_.download_needed()) {
      Copy(*model_, *optimizer_, host_->model(), host_->optimizer());
      mirror_.Copied();
    }
    return absl::OkStatus();
  }
  absl::Status End() override {
    absl::Status ended = step_.End();
    absl::Status synced = Sync();
    if (!synced.ok()) mirror_.Diverged();  // as GpuStep: the trainer goes back to the host's
    return ended.ok() ? synced : ended;
  }
  absl::StatusOr<HostBatch> HostBuffers(int n) override { return step_.HostBuffers(n); }
  absl::StatusOr<StepResult> TakeStep(const StepArgs& args) override {
    absl::StatusOr<StepResult> r = step_.TakeStep(args);
    if (r.ok() && r->rejected == 0) mirror_.Stepped();
    return r;
  }
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return step_.Evaluate(batch, correct);
  }
  absl::Status BroadcastState(const StepGroup& group, StatePart part, size_t offset,
                              size_t count, float* host, int root, bool take) override {
    const auto* device = static_cast<const HostDeviceGroup*>(group.device);
    Communicator* const transport = device != nullptr ? device->comm : nullptr;
    if (transport == nullptr || transport->size() <= 1) {
      return absl::UnimplementedError("no transport");
    }
    float* const state =
        (part == StatePart::kParams ? model_->params() : optimizer_->state().data()) + offset;
    const bool sending = transport->rank() == root;
    const bool from_device = sending && mirror_.holds_host();
    const bool into_device = !sending && take;
    if (into_device) mirror_.Diverged();
    std::vector<float> scratch(from_device || into_device ? 0 : count);
    if (sending && !from_device) std::copy(host, host + count, scratch.data());
    float* const buffer = from_device || into_device ? state : scratch.data();
    LOCKSTEP_RETURN_IF_ERROR(transport->Broadcast(buffer, count * sizeof(float), root));
    if (into_device) std::copy(state, state + count, host);
    pieces_from_device += from_device;
    pieces_into_device += into_device;
    return absl::OkStatus();
  }
  void HostStateChanged(bool engine_has_it) override {
    engine_has_it ? mirror_.Copied() : mirror_.Diverged();
  }

 private:
  static void Copy(Model& from_model, Optimizer& from_opt, Model& to_model, Optimizer& to_opt) {
    std::copy(from_model.params(), from_model.params() + from_model.num_params(),
              to_model.params());
    to_opt.state() = from_opt.state();
  }

  Trainer* const host_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  CpuStep step_;
  StateMirror mirror_;
};

MirroredEngine* KeepMirroredEngine(Trainer& trainer, const v1::JobSpec& spec,
                                   const Dataset& data) {
  auto engine = std::make_unique<MirroredEngine>(spec, data, trainer);
  MirroredEngine* kept = engine.get();
  trainer.set_engine(std::move(engine));
  return kept;
}

// Trains from `start` and stops after step `stop` (an abort between steps, as a generation
// ends), or at the end.
absl::Status TrainUntil(Trainer& trainer, int64_t start, int64_t stop) {
  std::atomic<bool> abort{false};
  absl::Status s = trainer.Train(
      start, abort,
      [&](const v1::ProgressReport& r) {
        if (r.step() == stop) abort.store(true);
      },
      nullptr, absl::ZeroDuration());
  return absl::IsAborted(s) && trainer.completed_step() == stop ? absl::OkStatus() : s;
}

std::string PlainRunChecksum(const v1::JobSpec& spec, std::shared_ptr<const Dataset> data) {
  SoloCommunicator solo;
  auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
  EXPECT_TRUE(TrainUntil(*trainer, 1, trainer->total_steps()).ok());
  return trainer->ParameterChecksum();
}

// A kept engine's copy outlives the generation: the second generation uploads nothing, and
// the job ends with the plain trainer's bits.
TEST(KeptEngineTest, ASurvivorUploadsOnceAcrossGenerations) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator solo;
  auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
  MirroredEngine* engine = KeepMirroredEngine(*trainer, spec, *data);
  ASSERT_TRUE(TrainUntil(*trainer, 1, 25).ok());
  ASSERT_TRUE(trainer->Heal({"w0"}).ok());
  ASSERT_TRUE(TrainUntil(*trainer, 26, 60).ok());
  EXPECT_EQ(engine->uploads, 1);
  EXPECT_EQ(trainer->ParameterChecksum(), PlainRunChecksum(spec, data));
}

// A heal between kept engines: the source sends its engine's copy, the taker receives into
// its engine's (and uploads nothing after), and the group ends with the bits of the same
// job healed between plain trainers over Gloo.
TEST(KeptEngineTest, AHealGoesFromTheSourcesCopyIntoTheTakersCopy) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  int uploads[2] = {-1, -1}, from_device[2] = {0, 0}, into_device[2] = {0, 0};
  auto run = [&](bool engines) {
    std::vector<std::string> sums(2);
    testing::RunInGlooGroup(2, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
      SoloCommunicator solo;
      auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
      MirroredEngine* engine = engines ? KeepMirroredEngine(*trainer, spec, *data) : nullptr;
      if (r == 0) {  // the source
        ASSERT_TRUE(TrainUntil(*trainer, 1, 30).ok());
      }
      trainer->set_communicator(gloo.get());
      HostDeviceGroup group(gloo.get());
      if (engine != nullptr) trainer->set_device_group(&group);
      auto info = trainer->Heal({"w0", "w1"});
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->source_rank, 0);
      ASSERT_TRUE(TrainUntil(*trainer, 31, 60).ok());
      sums[r] = trainer->ParameterChecksum();
      if (engine != nullptr) {
        trainer->set_device_group(nullptr);
        // Counted before the trainer (and its engine) go.
        uploads[r] = engine->uploads;
        from_device[r] = engine->pieces_from_device;
        into_device[r] = engine->pieces_into_device;
      }
    });
    return sums;
  };
  const std::vector<std::string> plain = run(false);
  const std::vector<std::string> mirrored = run(true);
  ASSERT_EQ(plain[0], plain[1]);
  EXPECT_EQ(mirrored[0], plain[0]);
  EXPECT_EQ(mirrored[1], plain[0]);
  EXPECT_EQ(uploads[0], 1) << "the source uploaded once, for its first generation";
  EXPECT_EQ(uploads[1], 0) << "the taker trained on what it received";
  EXPECT_EQ(from_device[0], 2) << "the parameters and the optimizer state, one piece each";
  EXPECT_EQ(into_device[1], from_device[0]) << "every piece went from copy to copy";
}

// Rank 0 reads a newer checkpoint of the job than its engine's copy: the engine is told, and
// uploads the checkpoint's state before training on.
TEST(KeptEngineTest, ACheckpointReadFromDiskReplacesTheEnginesCopy) {
  v1::JobSpec spec = SyntheticSpec();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/kept-engine-", getpid());
  std::filesystem::remove_all(dir);
  spec.set_checkpoint_dir(dir);
  spec.set_checkpoint_every_steps(10);
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator solo;
  auto kept = Trainer::Create("test-job", spec, data, &solo).value();
  MirroredEngine* engine = KeepMirroredEngine(*kept, spec, *data);
  ASSERT_TRUE(TrainUntil(*kept, 1, 20).ok());
  // Another member of the job went on to step 40 and checkpointed it.
  auto other = Trainer::Create("test-job", spec, data, &solo).value();
  ASSERT_TRUE(TrainUntil(*other, 1, 40).ok());
  auto info = kept->Heal({"w0"});
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->resumed_from_step, 40);
  ASSERT_TRUE(TrainUntil(*kept, 41, 60).ok());
  EXPECT_EQ(engine->uploads, 2);
  ASSERT_TRUE(TrainUntil(*other, 41, 60).ok());
  EXPECT_EQ(kept->ParameterChecksum(), other->ParameterChecksum());
  std::filesystem::remove_all(dir);
}

// The device's state cannot be read back when a generation ends: Train fails with it, the
// trainer claims the host's older step, and the next generation uploads that and trains on to
// the plain trainer's bits.
TEST(KeptEngineTest, AFailedReadBackFailsTrainAndGoesBackToTheHostsStep) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  SoloCommunicator solo;
  auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
  MirroredEngine* engine = KeepMirroredEngine(*trainer, spec, *data);
  ASSERT_TRUE(TrainUntil(*trainer, 1, 25).ok());
  engine->fail_downloads = true;
  absl::Status failed = TrainUntil(*trainer, 26, 60);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("reading the device's state back"), std::string::npos) << failed;
  EXPECT_EQ(trainer->completed_step(), 25);
  engine->fail_downloads = false;
  ASSERT_TRUE(trainer->Heal({"w0"}).ok());
  ASSERT_TRUE(TrainUntil(*trainer, 26, 60).ok());
  EXPECT_EQ(engine->uploads, 2);
  EXPECT_EQ(trainer->ParameterChecksum(), PlainRunChecksum(spec, data));
}

// The source dies after its first piece: the taker keeps its own state on the host, and its
// engine, whose copy was partly overwritten, uploads the host's again before training on.
TEST(KeptEngineTest, AHealLostMidwayMakesTheTakersEngineUploadAgain) {
  const v1::JobSpec spec = SyntheticSpec();
  auto data = std::make_shared<Dataset>(MakeSyntheticDataset(spec.dataset().synthetic()));
  std::string taker_sum;
  int taker_uploads = 0;
  testing::RunInGlooGroup(2, [&](int r, std::unique_ptr<GlooCommunicator> gloo) {
    SoloCommunicator solo;
    auto trainer = Trainer::Create("test-job", spec, data, &solo).value();
    MirroredEngine* engine = KeepMirroredEngine(*trainer, spec, *data);
    ASSERT_TRUE(TrainUntil(*trainer, 1, r == 0 ? 30 : 10).ok());
    if (r == 0) {
      DiesMidBroadcast dying(std::move(gloo), /*fail_at=*/3);  // the header, one piece, then dead
      trainer->set_communicator(&dying);
      HostDeviceGroup group(&dying);
      trainer->set_device_group(&group);
      EXPECT_FALSE(trainer->Heal({"w0", "w1"}).ok());
      trainer->set_device_group(nullptr);
      return;
    }
    trainer->set_communicator(gloo.get());
    HostDeviceGroup group(gloo.get());
    trainer->set_device_group(&group);
    EXPECT_FALSE(trainer->Heal({"w0", "w1"}).ok());
    trainer->set_device_group(nullptr);
    EXPECT_GE(engine->pieces_into_device, 1) << "the test must overwrite part of the copy";
    ASSERT_EQ(trainer->completed_step(), 10);
    trainer->set_communicator(&solo);
    ASSERT_TRUE(TrainUntil(*trainer, 11, 60).ok());
    taker_uploads = engine->uploads;
    taker_sum = trainer->ParameterChecksum();
  });
  EXPECT_EQ(taker_uploads, 2);
  EXPECT_EQ(taker_sum, PlainRunChecksum(spec, data));
}

}  // namespace
}  // namespace lockstep::worker
