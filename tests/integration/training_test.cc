// End to end: a real coordinator on 127.0.0.1:0 and real worker processes train jobs; the
// tests check what a user would: the job succeeded, the step count is exact, the loss fell,
// every rank holds identical parameters, and bad input fails the job with a clear reason.
#include <signal.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep {
namespace {

using testing::Cluster;

v1::JobSpec SyntheticJob(int workers, int64_t steps) {
  return testing::SyntheticJob(workers, workers, steps);
}

// Loss of the first and last progress events in the job's history.
std::pair<double, double> FirstAndLastLoss(const std::vector<v1::JobEvent>& events) {
  double first = -1, last = -1;
  for (const v1::JobEvent& e : events) {
    if (e.kind() != v1::JobEvent::PROGRESS) continue;
    if (first < 0) first = e.job().loss();
    last = e.job().loss();
  }
  return {first, last};
}

// Trains the synthetic job; returns the common parameter checksum.
std::string ExpectTrainedTogether(Cluster& cluster, int workers, int64_t steps) {
  auto submitted = cluster.Submit(SyntheticJob(workers, steps));
  EXPECT_TRUE(submitted.ok()) << submitted.status();
  if (!submitted.ok()) return "";
  auto job = cluster.WaitForEnd(submitted->job_id(), absl::Seconds(240));
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return "";
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->reason() << "\n" << cluster.Logs();
  if (job->state() != v1::JOB_STATE_SUCCEEDED) return "";
  EXPECT_EQ(job->step(), steps);
  EXPECT_EQ(job->total_steps(), steps);
  EXPECT_EQ(job->generation(), 1);
  EXPECT_EQ(job->members_size(), workers);
  if (job->members_size() != workers) return "";
  for (const v1::Member& m : job->members()) {
    EXPECT_EQ(m.step(), steps) << m.worker_name();
    EXPECT_EQ(m.parameter_checksum().size(), 16u) << m.worker_name();
    EXPECT_EQ(m.parameter_checksum(), job->members(0).parameter_checksum())
        << "rank " << m.rank() << " (" << m.worker_name() << ") holds different parameters";
  }
  EXPECT_GT(job->eval().test_accuracy(), 0.6) << "4 classes: chance is 0.25";
  EXPECT_EQ(job->eval().test_samples(), 2048);
  EXPECT_GT(job->first_step_latency_ms(), 0);
  auto history = cluster.History(job->job_id());
  EXPECT_TRUE(history.ok()) << history.status();
  if (history.ok()) {
    auto [first, last] = FirstAndLastLoss(*history);
    EXPECT_GT(first, 1.0) << "the untrained loss of 4 classes is about ln 4";
    EXPECT_LT(last, 0.6 * first) << "loss did not fall: " << first << " -> " << last;
  }
  return job->members(0).parameter_checksum();
}

TEST(TrainingIntegrationTest, TwoWorkersTrainSyntheticDataToIdenticalParameters) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(2).ok());
  ExpectTrainedTogether(**cluster, 2, 300);
}

TEST(TrainingIntegrationTest, ThreeWorkersTrainSyntheticDataToIdenticalParameters) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(3).ok());
  ExpectTrainedTogether(**cluster, 3, 300);
  // Workers are long-lived: the same cluster trains a second job right after.
  ExpectTrainedTogether(**cluster, 3, 100);
}

// The same job over Gloo's TCP transport (shared memory off) and over shared memory: with two
// ranks every sum is a + b either way, so the parameters must be bitwise identical.
TEST(TrainingIntegrationTest, GlooTcpAndSharedMemoryGiveIdenticalParameters) {
  std::string checksums[2];
  for (int shm = 0; shm < 2; ++shm) {
    auto cluster = Cluster::Start();
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    for (const char* name : {"w0", "w1"}) {
      ASSERT_TRUE((*cluster)
                      ->StartWorker(name, {shm ? "--shared_memory_collectives=true"
                                               : "--shared_memory_collectives=false"})
                      .ok());
    }
    checksums[shm] = ExpectTrainedTogether(**cluster, 2, 200);
  }
  EXPECT_FALSE(checksums[0].empty());
  EXPECT_EQ(checksums[0], checksums[1]);
}

TEST(TrainingIntegrationTest, WorkersReconnectAfterCoordinatorRestart) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(2).ok());
  ASSERT_TRUE((*cluster)->RestartCoordinator().ok());
  // The new coordinator knows nobody until the workers' backoff brings them back.
  ASSERT_TRUE((*cluster)->WaitForWorker("w0", "idle", absl::Seconds(30)).ok());
  ASSERT_TRUE((*cluster)->WaitForWorker("w1", "idle", absl::Seconds(30)).ok());
  EXPECT_TRUE((*cluster)->worker("w0")->running());
  ExpectTrainedTogether(**cluster, 2, 50);
}

TEST(TrainingIntegrationTest, FashionMnistShortRunReachesSaneAccuracy) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (Debian package dataset-fashion-mnist)";
  }
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(2).ok());
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(128);
  spec.mutable_dataset()->set_type("fashion_mnist");
  spec.mutable_optimizer()->set_learning_rate(0.05);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_global_batch_size(256);
  spec.set_max_steps(300);
  spec.set_min_workers(2);
  spec.set_max_workers(2);
  auto submitted = (*cluster)->Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  EXPECT_EQ(submitted->spec().dataset().path(), dir) << "fashion_mnist defaults to Debian's path";
  auto job = (*cluster)->WaitForEnd(submitted->job_id(), absl::Seconds(240));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->reason();
  EXPECT_EQ(job->step(), 300);
  EXPECT_EQ(job->eval().test_samples(), 10000);
  EXPECT_GT(job->eval().test_accuracy(), 0.75);
  EXPECT_EQ(job->members(0).parameter_checksum(), job->members(1).parameter_checksum());
}

TEST(TrainingIntegrationTest, MissingDatasetFailsTheJobNotTheWorker) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(1).ok());
  v1::JobSpec spec = SyntheticJob(1, 10);
  spec.mutable_dataset()->set_type("idx");
  // Inside the data roots (the test's temporary directory), but not there.
  const std::string missing = (*cluster)->dir() + "/nonexistent/lockstep-data";
  spec.mutable_dataset()->set_path(missing);
  auto submitted = (*cluster)->Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  auto job = (*cluster)->WaitForEnd(submitted->job_id(), absl::Seconds(60));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job->reason().find(missing), std::string::npos) << job->reason();
  EXPECT_TRUE((*cluster)->worker("w0")->running()) << "the worker must survive bad input";
  // The same worker trains the next, valid job.
  auto next = (*cluster)->Submit(SyntheticJob(1, 20));
  ASSERT_TRUE(next.ok());
  auto done = (*cluster)->WaitForEnd(next->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
}

TEST(TrainingIntegrationTest, BatchLargerThanDatasetFailsWithReason) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(1).ok());
  v1::JobSpec spec = SyntheticJob(1, 10);
  spec.mutable_dataset()->mutable_synthetic()->set_train_samples(100);
  auto submitted = (*cluster)->Submit(spec);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  auto job = (*cluster)->WaitForEnd(submitted->job_id(), absl::Seconds(60));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job->reason().find("exceeds the 100 training samples"), std::string::npos)
      << job->reason();
}

TEST(TrainingIntegrationTest, InvalidSpecIsRefusedAtSubmit) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  v1::JobSpec spec = SyntheticJob(2, 10);
  spec.set_min_workers(3);
  auto submitted = (*cluster)->Submit(spec);
  EXPECT_EQ(submitted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(submitted.status().message().find("max_workers"), std::string::npos);
  EXPECT_EQ((*cluster)->Get("job-404").status().code(), absl::StatusCode::kNotFound);
}

// With recovery disabled (max_restarts 0), a member killed mid-run fails the job at once with
// a reason that names it; the survivor is freed and stays usable.
TEST(TrainingIntegrationTest, KilledWorkerWithRecoveryOffFailsJobClearly) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorkers(2).ok());
  v1::JobSpec spec = SyntheticJob(2, 100000);
  spec.set_max_restarts(0);
  auto submitted = (*cluster)->Submit(spec);
  ASSERT_TRUE(submitted.ok());
  auto running = (*cluster)->WaitFor(
      submitted->job_id(), [](const v1::Job& j) { return j.step() >= 20; }, absl::Seconds(60));
  ASSERT_TRUE(running.ok()) << running.status();
  (*cluster)->worker("w1")->Signal(SIGKILL);
  auto job = (*cluster)->WaitForEnd(submitted->job_id(), absl::Seconds(30));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job->reason().find("w1"), std::string::npos) << job->reason();
  auto workers = (*cluster)->Workers();
  ASSERT_TRUE(workers.ok());
  for (const v1::WorkerInfo& w : *workers) {
    EXPECT_EQ(w.state(), w.name() == "w1" ? "lost" : "idle") << w.name();
  }
  auto next = (*cluster)->Submit(SyntheticJob(1, 20));
  ASSERT_TRUE(next.ok());
  auto done = (*cluster)->WaitForEnd(next->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
}

}  // namespace
}  // namespace lockstep
