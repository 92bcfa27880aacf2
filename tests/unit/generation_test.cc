// The generation runner in-process: ranks on threads, formed through the coordinator's own
// bootstrap store (no gRPC), on the CPU backend, reporting to a recorder. What the agent adds
// (the session, heartbeats, the lifecycle) is not here.
#include "worker/generation.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/store/bootstrap_store.h"
#include "gtest/gtest.h"
#include "tests/testing/local_store.h"
#include "tests/testing/mlp_job.h"
#include "worker/device/backend.h"

namespace lockstep::worker {
namespace {

// What one member reported, in order.
class Recorder final : public GenerationReporter {
 public:
  // `on_progress` runs on the generation's thread after each progress report is recorded.
  explicit Recorder(std::function<void(const v1::ProgressReport&)> on_progress = nullptr)
      : on_progress_(std::move(on_progress)) {}

  void Resumed(const v1::ResumedReport& r) override {
    absl::MutexLock lock(&mu_);
    resumed.push_back(r);
    order.push_back("resumed");
  }
  void Progress(const v1::ProgressReport& r) override {
    {
      absl::MutexLock lock(&mu_);
      progress.push_back(r);
      if (order.empty() || order.back() != "progress") order.push_back("progress");
    }
    if (on_progress_) on_progress_(r);
  }
  void Checkpoint(const v1::CheckpointReport& r) override {
    absl::MutexLock lock(&mu_);
    checkpoints.push_back(r);
  }
  void Finished(const v1::FinishedReport& r) override {
    absl::MutexLock lock(&mu_);
    finished.push_back(r);
    order.push_back("finished");
  }

  std::vector<v1::ResumedReport> resumed;
  std::vector<v1::ProgressReport> progress;
  std::vector<v1::CheckpointReport> checkpoints;
  std::vector<v1::FinishedReport> finished;
  std::vector<std::string> order;  // "resumed", "progress" (once per run of them), "finished"

 private:
  absl::Mutex mu_;
  std::function<void(const v1::ProgressReport&)> on_progress_;
};

// The trainer tests' job, deterministic (the same bits at any world size) and shorter.
v1::JobSpec DeterministicSpec() {
  v1::JobSpec spec = testing::SyntheticMlpSpec();
  spec.set_deterministic(true);
  spec.set_max_steps(40);
  spec.set_collective_timeout_ms(20000);
  return spec;
}

class GenerationTest : public ::testing::Test {
 protected:
  GenerationTest() {
    DeviceInfo cpu;
    cpu.device = "cpu";
    cpu.name = "cpu";
    backend_ = MakeCpuBackend(cpu);
    context_.worker_name = "test-worker";
    context_.comm_address = "127.0.0.1";
    context_.data_roots = PathRoots::Parse(::testing::TempDir()).value();
    context_.checkpoint_roots = PathRoots::Parse(::testing::TempDir()).value();
    context_.shared_memory_collectives = false;
    context_.device = backend_.get();
  }

  v1::Assignment Assign(const v1::JobSpec& spec, int generation, int rank, int world) {
    v1::Assignment a;
    a.set_job_id("job-1");
    a.set_generation(generation);
    a.set_rank(rank);
    a.set_world_size(world);
    for (int r = 0; r < world; ++r) a.add_member_names(absl::StrCat("w", r));
    *a.mutable_spec() = spec;
    return a;
  }

  // Runs generation `generation` of `world` ranks on threads; trainers[r] is rank r's state
  // (in and out), statuses[r] what its Run returned. One abort signal for the group, as the
  // coordinator aborts every member at once.
  void RunGroup(const v1::JobSpec& spec, int generation, int world,
                std::vector<std::unique_ptr<Trainer>>& trainers, std::vector<Recorder*> reporters,
                std::vector<absl::Status>& statuses,
                std::shared_ptr<AbortSignal> abort = std::make_shared<AbortSignal>()) {
    const coordinator::StoreScope scope{"job-1", generation};
    store_.Open(scope, coordinator::ScopeLimits::ForWorld(world));
    trainers.resize(world);
    statuses.assign(world, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        const v1::Assignment a = Assign(spec, generation, r, world);
        Generation g(context_, a, std::make_shared<testing::LocalStoreClient>(&store_, scope, abort),
                     abort, reporters[r]);
        statuses[r] = g.Run(trainers[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    store_.Close(scope);
  }

  coordinator::BootstrapStore store_;
  std::unique_ptr<DeviceBackend> backend_;
  GenerationContext context_;
};

TEST(IsFatalTest, TheCodeDecidesWhetherTheJobOrOnlyTheGenerationEnds) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kPermissionDenied, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kOutOfRange, absl::StatusCode::kUnimplemented,
        absl::StatusCode::kResourceExhausted}) {
    EXPECT_TRUE(IsFatal(absl::Status(code, "x"))) << code;
  }
  for (absl::StatusCode code :
       {absl::StatusCode::kAborted, absl::StatusCode::kCancelled,
        absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded,
        absl::StatusCode::kDataLoss, absl::StatusCode::kInternal, absl::StatusCode::kUnknown}) {
    EXPECT_FALSE(IsFatal(absl::Status(code, "x"))) << code;
  }
}

TEST_F(GenerationTest, TwoRanksTrainAndReportTheBitsOfOne) {
  const v1::JobSpec spec = DeterministicSpec();
  std::vector<std::unique_ptr<Trainer>> solo, pair;
  std::vector<absl::Status> statuses;
  Recorder one;
  RunGroup(spec, 1, 1, solo, {&one}, statuses);
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];
  Recorder r0, r1;
  RunGroup(spec, 1, 2, pair, {&r0, &r1}, statuses);
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;

  for (Recorder* r : {&one, &r0, &r1}) {
    EXPECT_EQ(r->order, (std::vector<std::string>{"resumed", "progress", "finished"}));
    ASSERT_EQ(r->resumed.size(), 1u);
    EXPECT_EQ(r->resumed[0].source_rank(), -1);  // a fresh start: nobody's state
    ASSERT_FALSE(r->progress.empty());
    EXPECT_TRUE(r->progress.front().first_of_generation());
    for (size_t i = 1; i < r->progress.size(); ++i) {
      EXPECT_FALSE(r->progress[i].first_of_generation());
    }
    EXPECT_EQ(r->progress.back().job_id(), "job-1");
    EXPECT_EQ(r->progress.back().generation(), 1);
    ASSERT_EQ(r->finished.size(), 1u);
    EXPECT_EQ(r->finished[0].job_id(), "job-1");
    EXPECT_EQ(r->finished[0].step(), 40);
    EXPECT_TRUE(r->finished[0].has_eval());
  }
  // Deterministic mode: the same parameters and evaluation whatever the world size.
  EXPECT_EQ(r0.finished[0].parameter_checksum(), one.finished[0].parameter_checksum());
  EXPECT_EQ(r1.finished[0].parameter_checksum(), one.finished[0].parameter_checksum());
  EXPECT_EQ(r0.finished[0].eval().test_loss(), one.finished[0].eval().test_loss());
  EXPECT_EQ(pair[0]->completed_step(), 40);
}

TEST_F(GenerationTest, AnAbortedGenerationKeepsItsStateAndTheNextOneFinishesTheJobExactly) {
  const v1::JobSpec spec = DeterministicSpec();
  std::vector<std::unique_ptr<Trainer>> reference, trainers;
  std::vector<absl::Status> statuses;
  Recorder undisturbed;
  RunGroup(spec, 1, 1, reference, {&undisturbed}, statuses);
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];

  // Generation 1 of two ranks is aborted at its first progress report (a member was lost).
  auto abort = std::make_shared<AbortSignal>();
  Recorder a0([&](const v1::ProgressReport&) { abort->Raise(); }), a1;
  RunGroup(spec, 1, 2, trainers, {&a0, &a1}, statuses, abort);
  for (const absl::Status& s : statuses) {
    EXPECT_FALSE(s.ok());
    EXPECT_FALSE(IsFatal(s)) << s;  // the generation ended, not the job
  }
  ASSERT_NE(trainers[0], nullptr);
  EXPECT_TRUE(a0.finished.empty());
  const int64_t held = trainers[0]->completed_step();
  EXPECT_LT(held, 40);

  // Generation 2: rank 0's survivor alone, with the state it kept.
  std::vector<std::unique_ptr<Trainer>> survivor;
  survivor.push_back(std::move(trainers[0]));
  Recorder s0;
  RunGroup(spec, 2, 1, survivor, {&s0}, statuses);
  ASSERT_TRUE(statuses[0].ok()) << statuses[0];
  ASSERT_EQ(s0.resumed.size(), 1u);
  EXPECT_EQ(s0.resumed[0].resumed_from_step(), held);
  ASSERT_FALSE(s0.progress.empty());
  EXPECT_EQ(s0.progress.front().generation(), 2);
  ASSERT_EQ(s0.finished.size(), 1u);
  EXPECT_EQ(s0.finished[0].step(), 40);
  EXPECT_EQ(s0.finished[0].parameter_checksum(), undisturbed.finished[0].parameter_checksum());
}

TEST_F(GenerationTest, APathOutsideTheWorkersRootsFailsTheJobBeforeAnythingIsRead) {
  v1::JobSpec spec = DeterministicSpec();
  spec.set_checkpoint_dir("/etc/lockstep-checkpoints");
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<absl::Status> statuses;
  Recorder r;
  RunGroup(spec, 1, 1, trainers, {&r}, statuses);
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kPermissionDenied) << statuses[0];
  EXPECT_TRUE(IsFatal(statuses[0]));
  EXPECT_NE(statuses[0].message().find("checkpoint_dir"), std::string::npos) << statuses[0];
  EXPECT_NE(statuses[0].message().find("test-worker"), std::string::npos) << statuses[0];
  EXPECT_EQ(trainers[0], nullptr);
  EXPECT_TRUE(r.order.empty());
}

TEST_F(GenerationTest, ADataSetThatCannotBeLoadedFailsTheJobNamingIt) {
  v1::JobSpec spec = DeterministicSpec();
  spec.mutable_dataset()->set_type("idx");
  spec.mutable_dataset()->clear_synthetic();
  spec.mutable_dataset()->set_path(::testing::TempDir() + "/no-such-data");
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<absl::Status> statuses;
  Recorder r;
  RunGroup(spec, 1, 1, trainers, {&r}, statuses);
  EXPECT_TRUE(IsFatal(statuses[0])) << statuses[0];
  EXPECT_NE(statuses[0].message().find("loading data set at"), std::string::npos) << statuses[0];
  EXPECT_NE(statuses[0].message().find("no-such-data"), std::string::npos) << statuses[0];
  EXPECT_EQ(trainers[0], nullptr);
  EXPECT_TRUE(r.order.empty());
}

}  // namespace
}  // namespace lockstep::worker
