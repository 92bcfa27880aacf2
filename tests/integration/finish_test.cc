// A finished job stays finished: each test holds a daemon inside one window at the end of a job
// (rank 0 writing its sample, the coordinator about to save the job's end) and registers a
// spare, kills a finished member, or kills or freezes the coordinator there. The job must end
// SUCCEEDED with exactly its steps, the checksum of an undisturbed run, and nothing trained
// again: members keep what they trained until the coordinator has recorded the end.
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/exact.h"
#include "tests/testing/gpt_job.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::ReferenceChecksum;

constexpr absl::Duration kHookWait = absl::Seconds(90);
constexpr absl::Duration kJobWait = absl::Seconds(180);

// Deterministic jobs: the checksum is the same for any world size and failure schedule. The
// timeouts are ones a loaded machine meets.
v1::JobSpec MlpJob(int min_workers, int max_workers, int64_t steps) {
  return testing::DeterministicJob(min_workers, max_workers, steps, 5000, 20000);
}

v1::JobSpec GptJob(int min_workers, int max_workers) {
  v1::JobSpec spec = testing::SmallGptSpec();
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  spec.set_deterministic(true);
  spec.mutable_sample()->set_max_tokens(64);
  spec.set_heartbeat_timeout_ms(5000);
  spec.set_collective_timeout_ms(20000);
  return spec;
}

std::unique_ptr<Cluster> StartCluster(const std::vector<std::string>& coordinator_flags = {}) {
  auto cluster = Cluster::Start(coordinator_flags);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

// SUCCEEDED with exactly `steps`, every final member holding `checksum`, and no step trained
// twice: every re-formation (if any) that resumed did so from the last step.
void ExpectFinishedOnce(Cluster& cluster, const v1::Job& job, int64_t steps,
                        const std::string& checksum) {
  testing::ExpectExact(cluster, job, steps, checksum);
  for (const v1::Recovery& r : job.recovery_history()) {
    if (r.first_step_unix_ms() == 0) continue;  // superseded before it resumed
    EXPECT_EQ(r.steps_redone(), 0) << r.reason();
    EXPECT_FALSE(r.steps_redone_lower_bound()) << r.reason();
    EXPECT_EQ(r.resumed_from_step(), steps) << "trained again after: " << r.reason() << "\n"
                                            << cluster.Logs();
  }
}

// The job's rank 0 once it runs on `n` members.
absl::StatusOr<std::string> RankZero(Cluster& cluster, const std::string& id, int n) {
  auto running = cluster.WaitFor(
      id, [&](const v1::Job& j) { return j.members_size() == n; }, kHookWait);
  if (!running.ok()) return running.status();
  return running->members(0).worker_name();
}

// The others have reported Finished (their checksum is listed) while rank 0 is held.
absl::Status OthersFinished(Cluster& cluster, const std::string& id) {
  return cluster
      .WaitFor(
          id,
          [](const v1::Job& j) {
            for (int i = 1; i < j.members_size(); ++i) {
              if (j.members(i).parameter_checksum().empty()) return false;
            }
            return j.members_size() > 1;
          },
          kHookWait)
      .status();
}

// Defect: a spare that registered while rank 0 wrote its sample scaled the job up; rank 0's
// run, aborted inside the sample, still finished and dropped its state, and the next
// generation trained every step again.
TEST(FinishTest, ASpareRegisteringWhileRankZeroSamplesDoesNotScaleUp) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  const v1::JobSpec spec = GptJob(1, 2);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  cluster->worker("w0")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(20)).ok());
  ASSERT_TRUE(cluster->StartWorker("w0", {"--test_hooks=before_sample"}).ok());
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "before_sample", kHookWait).ok());
  ASSERT_TRUE(cluster->StartWorker("w1").ok());
  ASSERT_TRUE(cluster->WaitForWorker("w1", "idle", absl::Seconds(20)).ok());
  // Ticks pass with the spare idle beside a job at its last step.
  absl::SleepFor(absl::Seconds(1));
  auto held = cluster->Get(job->job_id());
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(held->generation(), 1) << "a spare never joins a job that trained every step";
  cluster->ReleaseHook("w0", "before_sample");
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectFinishedOnce(*cluster, *done, spec.max_steps(), reference);
  EXPECT_EQ(done->recovery_history_size(), 0);
  EXPECT_FALSE(done->sample().text().empty()) << done->sample_error();
}

// Defect: a member that had finished was lost while rank 0 wrote its sample; the job aborted
// rank 0, then sat at its last step waiting for workers to re-form (or, when rank 0's run
// finished anyway, trained every step again).
TEST(FinishTest, AFinishedMemberKilledWhileRankZeroSamplesCostsNothing) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(3).ok());
  const v1::JobSpec spec = GptJob(3, 3);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  for (const char* name : {"w0", "w1", "w2"}) {
    cluster->worker(name)->Signal(SIGKILL);
    ASSERT_TRUE(cluster->WaitForWorker(name, "lost", absl::Seconds(20)).ok());
    ASSERT_TRUE(cluster->StartWorker(name, {"--test_hooks=before_sample"}).ok());
  }
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto rank0 = RankZero(*cluster, job->job_id(), 3);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(cluster->WaitForHook(*rank0, "before_sample", kHookWait).ok());
  ASSERT_TRUE(OthersFinished(*cluster, job->job_id()).ok());
  auto finished = cluster->Get(job->job_id());
  ASSERT_TRUE(finished.ok());
  const std::string victim = finished->members(1).worker_name();
  cluster->worker(victim)->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker(victim, "lost", absl::Seconds(20)).ok());
  // Rank 0 is not disturbed: it is still held, and the job still runs its generation.
  auto after = cluster->Get(job->job_id());
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->state(), v1::JOB_STATE_RUNNING) << after->reason();
  EXPECT_EQ(after->generation(), 1);
  cluster->ReleaseHook(*rank0, "before_sample");
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectFinishedOnce(*cluster, *done, spec.max_steps(), reference);
  EXPECT_EQ(done->recovery_history_size(), 0);
  EXPECT_EQ(done->members_size(), 3) << "every member finished, the lost one too";
  EXPECT_FALSE(done->sample().text().empty()) << done->sample_error();
}

// Defect: the coordinator was lost after the members reported Finished (and dropped their
// state) but before it saved the job's end; the restarted coordinator re-formed the job and
// trained every step again. Here it is held just before that save and killed, or frozen.
class EndNotSavedTest : public ::testing::TestWithParam<bool> {};

TEST_P(EndNotSavedTest, TheMembersFinishTheJobFromTheirMemory) {
  const bool kill = GetParam();
  // job-2's end is held (job-1 is the reference).
  auto cluster = StartCluster({"--test_hooks=save_end@2"});
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  const v1::JobSpec spec = MlpJob(2, 2, 800);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(absl::StartsWith(job->job_id(), "job-2-")) << job->job_id();
  ASSERT_TRUE(cluster->WaitForHook("coordinator", "save_end", kHookWait).ok());
  if (kill) {
    // The restarted coordinator holds at the same end again: let that one save it.
    ASSERT_TRUE(cluster->RestartCoordinator(/*keep_state=*/true).ok()) << cluster->Logs();
    ASSERT_TRUE(cluster->WaitForHook("coordinator", "save_end", kHookWait).ok())
        << "the restarted coordinator finishes the job from the members' memory";
    cluster->ReleaseHook("coordinator", "save_end");
  } else {
    // Frozen long enough that every session breaks.
    cluster->coordinator()->Signal(SIGSTOP);
    absl::SleepFor(absl::Seconds(8));
    cluster->coordinator()->Signal(SIGCONT);
    cluster->ReleaseHook("coordinator", "save_end");
  }
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectFinishedOnce(*cluster, *done, 800, reference);
  if (kill) {
    ASSERT_EQ(done->recovery_history_size(), 1) << "one re-formation for one restart";
    EXPECT_TRUE(done->recovery_history(0).coordinator_caused());
  }
  // The workers were told the end is recorded: both serve the next job, from scratch.
  ASSERT_TRUE(cluster->WaitForWorker("w0", "idle", absl::Seconds(30)).ok());
  ASSERT_TRUE(cluster->WaitForWorker("w1", "idle", absl::Seconds(30)).ok());
  auto again = cluster->Submit(spec);
  ASSERT_TRUE(again.ok()) << again.status();
  auto second = cluster->WaitForEnd(again->job_id(), kJobWait);
  ASSERT_TRUE(second.ok()) << second.status();
  ExpectFinishedOnce(*cluster, *second, 800, reference);
}

INSTANTIATE_TEST_SUITE_P(KilledOrFrozen, EndNotSavedTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Killed" : "Frozen";
                         });

// The coordinator killed, or frozen long enough that every session breaks, while rank 0 writes
// its sample and the other member has finished: a restarted coordinator waits for both, and
// they finish the job without training; a resumed one finishes it as the members come back.
class CoordinatorLostWhileRankZeroSamplesTest : public ::testing::TestWithParam<bool> {};

TEST_P(CoordinatorLostWhileRankZeroSamplesTest, TheJobFinishesWithoutTraining) {
  const bool kill = GetParam();
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  const v1::JobSpec spec = GptJob(2, 2);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  for (const char* name : {"w0", "w1"}) {
    cluster->worker(name)->Signal(SIGKILL);
    ASSERT_TRUE(cluster->WaitForWorker(name, "lost", absl::Seconds(20)).ok());
    ASSERT_TRUE(cluster->StartWorker(name, {"--test_hooks=before_sample"}).ok());
  }
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto rank0 = RankZero(*cluster, job->job_id(), 2);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(cluster->WaitForHook(*rank0, "before_sample", kHookWait).ok());
  ASSERT_TRUE(OthersFinished(*cluster, job->job_id()).ok());
  if (kill) {
    ASSERT_TRUE(cluster->RestartCoordinator(/*keep_state=*/true).ok()) << cluster->Logs();
  } else {
    cluster->coordinator()->Signal(SIGSTOP);
    absl::SleepFor(absl::Seconds(8));
    cluster->coordinator()->Signal(SIGCONT);
  }
  // Whichever is rank 0 of the generation that finishes writes the sample without holding.
  for (const char* name : {"w0", "w1"}) cluster->ReleaseHook(name, "before_sample");
  auto done = cluster->WaitForEnd(job->job_id(), kJobWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectFinishedOnce(*cluster, *done, spec.max_steps(), reference);
  if (kill) {
    ASSERT_EQ(done->recovery_history_size(), 1) << "one re-formation for one restart";
  }
  EXPECT_FALSE(done->sample().text().empty()) << done->sample_error();
}

INSTANTIATE_TEST_SUITE_P(KilledOrFrozen, CoordinatorLostWhileRankZeroSamplesTest,
                         ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Killed" : "Frozen";
                         });

}  // namespace
}  // namespace lockstep
