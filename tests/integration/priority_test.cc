// Priorities with real workers (docs/scheduling.md): an urgent job takes workers from a running
// job of a lower priority by shrinking it toward its min_workers, and the shrunk job grows back
// once the urgent one has ended, finishing with exactly its steps and the bits of an
// undisturbed run, no step redone. Bad priorities are refused with INVALID_ARGUMENT.
#include <signal.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/exact.h"

namespace lockstep {
namespace {

using testing::Cluster;

constexpr int64_t kLowSteps = 3000;
constexpr int64_t kHeldAt = 2500;  // the low job's members hold before this step
constexpr absl::Duration kWait = absl::Seconds(180);

TEST(PriorityTest, AnUrgentJobShrinksALowerOneWhichGrowsBackAndEndsWithTheSameBits) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  const v1::JobSpec low_spec = testing::DeterministicJob(1, 3, kLowSteps, 0, 5000);
  // The undisturbed run's bits, on a worker of its own that then leaves.
  ASSERT_TRUE(cluster.StartWorker("ref").ok());
  v1::JobSpec reference = low_spec;
  reference.set_min_workers(1);
  reference.set_max_workers(1);
  const std::string checksum = testing::ReferenceChecksum(cluster, reference);
  ASSERT_FALSE(checksum.empty());
  cluster.worker("ref")->Signal(SIGTERM);
  ASSERT_TRUE(cluster.worker("ref")->Wait(absl::Seconds(30)).ok());

  // The low job's members hold before step kHeldAt (test hooks), so it is still training when
  // the urgent job ends, however fast or slow the machine.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(cluster
                    .StartWorker(absl::StrCat("w", i),
                                 {absl::StrCat("--test_hooks=before_step@", kHeldAt)})
                    .ok())
        << cluster.Logs();
  }
  auto low = cluster.Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  ASSERT_TRUE(cluster
                  .WaitFor(low->job_id(),
                           [](const v1::Job& j) { return j.step() >= 200 && j.members_size() == 3; },
                           kWait)
                  .ok())
      << cluster.Logs();

  v1::JobSpec urgent_spec = testing::DeterministicJob(2, 2, 300, 0, 5000);
  urgent_spec.set_priority(10);
  auto urgent = cluster.Submit(urgent_spec);
  ASSERT_TRUE(urgent.ok()) << urgent.status();
  auto urgent_done = cluster.WaitForEnd(urgent->job_id(), kWait);
  ASSERT_TRUE(urgent_done.ok()) << urgent_done.status();
  ASSERT_EQ(urgent_done->state(), v1::JOB_STATE_SUCCEEDED) << urgent_done->reason();
  EXPECT_EQ(urgent_done->step(), 300);
  EXPECT_EQ(urgent_done->recovery_history_size(), 0) << urgent_done->DebugString();

  // Meanwhile the low job trained on one worker, the one it kept.
  auto shrunk = cluster.Get(low->job_id());
  ASSERT_TRUE(shrunk.ok()) << shrunk.status();
  ASSERT_GE(shrunk->recovery_history_size(), 1) << shrunk->DebugString();
  const v1::Recovery& preempted = shrunk->recovery_history(0);
  EXPECT_TRUE(absl::StrContains(preempted.reason(),
                                "preempted by " + urgent->job_id() + " (priority 10)"))
      << preempted.reason();
  EXPECT_FALSE(preempted.counted());
  EXPECT_EQ(shrunk->recoveries(), 0);
  std::string kept;
  for (const v1::Generation& g : shrunk->generations()) {
    EXPECT_GE(g.members_size(), low_spec.min_workers()) << "below min_workers";
    if (g.generation() == preempted.to_generation()) {
      ASSERT_EQ(g.members_size(), 1);
      kept = g.members(0);
    }
  }
  ASSERT_FALSE(kept.empty()) << shrunk->DebugString();
  // Its members may go on past kHeldAt now (the one it kept, if held there, is also let go by
  // the growth's abort).
  for (int i = 0; i < 3; ++i) cluster.ReleaseHook(absl::StrCat("w", i), "before_step");

  // The low job grows back to 3 (the growth aborts its held generation) and ends exact.
  auto done = cluster.WaitForEnd(low->job_id(), kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  testing::ExpectExact(cluster, *done, kLowSteps, checksum);
  EXPECT_EQ(done->members_size(), 3) << "it grew back";
  EXPECT_EQ(done->recoveries(), 0);
  bool grew = false;
  for (const v1::Recovery& r : done->recovery_history()) {
    grew = grew || r.scale_up();
    if (r.first_step_unix_ms() > 0) {
      EXPECT_EQ(r.steps_redone(), 0) << r.reason();
    }
  }
  EXPECT_TRUE(grew) << done->DebugString();

  // `lockstepctl status` and `list` show the priority; the queue is empty now.
  auto status = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address(), "status", urgent->job_id()},
      absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  bool shown = false;
  for (absl::string_view line : absl::StrSplit(status->output, '\n')) {
    shown = shown || (absl::StartsWith(line, "Priority:") && absl::EndsWith(line, " 10"));
  }
  EXPECT_TRUE(shown) << status->output;
  auto queue = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address(), "queue"}, absl::Seconds(30));
  ASSERT_TRUE(queue.ok()) << queue.status();
  EXPECT_TRUE(absl::StrContains(queue->output, "No queued jobs.")) << queue->output;
}

TEST(PriorityTest, AQueuedJobSaysWhyItWaitsAndABadPriorityIsRefused) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  ASSERT_TRUE(cluster.StartWorker("w0").ok());
  v1::JobSpec bad = testing::SyntheticJob(1, 1, 100);
  bad.set_priority(1001);
  auto refused = cluster.Submit(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "priority")) << refused.status();
  // One worker, held by a job of priority 5 at its min_workers: a job of priority 9 cannot
  // take it, and the queue lists the waiting jobs in their order with why.
  ASSERT_TRUE(cluster.StartWorker("w1", {"--test_hooks=before_step@50"}).ok());
  v1::JobSpec busy = testing::SyntheticJob(2, 2, 100);
  busy.set_priority(5);
  busy.set_collective_timeout_ms(120000);  // w0 waits for the held w1 in a collective
  auto running = cluster.Submit(busy);
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_TRUE(cluster.WaitForHook("w1", "before_step", kWait).ok()) << cluster.Logs();
  v1::JobSpec later = testing::SyntheticJob(1, 1, 100);
  auto first = cluster.Submit(later);
  later.set_priority(9);
  auto second = cluster.Submit(later);
  ASSERT_TRUE(first.ok() && second.ok());
  auto queue = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address(), "queue"}, absl::Seconds(30));
  ASSERT_TRUE(queue.ok()) << queue.status();
  const std::string& out = queue->output;
  const size_t a = out.find(second->job_id()), b = out.find(first->job_id());
  ASSERT_NE(a, std::string::npos) << out;
  ASSERT_NE(b, std::string::npos) << out;
  EXPECT_LT(a, b) << "priority 9 starts first\n" << out;
  EXPECT_TRUE(absl::StrContains(out, "waiting for 1 idle")) << out;
  EXPECT_TRUE(absl::StrContains(out, "queued behind " + second->job_id() + " (priority 9)"))
      << out;
  cluster.ReleaseHook("w1", "before_step");
  for (const auto* job : {&*running, &*second, &*first}) {
    auto done = cluster.WaitForEnd(job->job_id(), kWait);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  }
}

}  // namespace
}  // namespace lockstep
