// Priorities with real workers (docs/scheduling.md): an urgent job takes workers from a running
// job of a lower priority by shrinking it toward its min_workers, and the shrunk job grows back
// once the urgent one has ended, finishing with exactly its steps and the bits of an
// undisturbed run, no step redone. When shrinking is not enough the lower job is suspended
// whole, its state kept in its workers' memory (through a coordinator restart, and through a
// suspend and resume by hand), and it ends with the same bits. Bad priorities are refused with
// INVALID_ARGUMENT; suspend and resume of the wrong jobs with FAILED_PRECONDITION.
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
  const std::string checksum = testing::ReferenceChecksumOnOneWorker(cluster, low_spec);
  ASSERT_FALSE(checksum.empty());

  // The low job's members hold before step kHeldAt (test hooks), so it is still training when
  // the urgent job ends, however fast or slow the machine.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        cluster
            .StartWorker(absl::StrCat("w", i), {absl::StrCat("--test_hooks=before_step@", kHeldAt)})
            .ok())
        << cluster.Logs();
  }
  auto low = cluster.Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  ASSERT_TRUE(cluster
                  .WaitFor(
                      low->job_id(),
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
  EXPECT_TRUE(
      absl::StrContains(preempted.reason(), "preempted by " + urgent->job_id() + " (priority 10)"))
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

// Runs lockstepctl against the cluster; the exit code and what it printed.
testing::CommandResult Ctl(Cluster& cluster, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address()};
  argv.insert(argv.end(), args.begin(), args.end());
  auto result = testing::RunCommand(argv, absl::Seconds(30));
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : testing::CommandResult{};
}

// Suspended for an urgent job needing both its workers; then held by a user too, the
// coordinator restarted while it is suspended, its workers back with its state, resumed by hand:
// it ends with the bits of an undisturbed run, nothing redone.
TEST(PriorityTest, ASuspendedJobKeepsItsStateThroughARestartAndEndsWithTheSameBits) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  v1::JobSpec low_spec = testing::DeterministicJob(2, 2, kLowSteps, 0, 120000);
  low_spec.set_step_timeout_ms(120000);
  const std::string checksum = testing::ReferenceChecksumOnOneWorker(cluster, low_spec);
  ASSERT_FALSE(checksum.empty());

  // w0 holds low before its step 1000 (it is still training when the urgent job comes; the
  // suspension lets it go); w1 holds the urgent job before its step 1500.
  ASSERT_TRUE(cluster.StartWorker("w0", {"--test_hooks=before_step@1000"}).ok()) << cluster.Logs();
  ASSERT_TRUE(cluster.StartWorker("w1", {"--test_hooks=before_step@1500"}).ok()) << cluster.Logs();
  auto low = cluster.Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  ASSERT_TRUE(cluster.WaitForHook("w0", "before_step", kWait).ok()) << cluster.Logs();

  // An urgent job needs both workers; low is at its min_workers: it is suspended whole.
  v1::JobSpec urgent_spec = testing::DeterministicJob(2, 2, 2000, 0, 120000);
  urgent_spec.set_step_timeout_ms(120000);
  urgent_spec.set_priority(10);
  auto urgent = cluster.Submit(urgent_spec);
  ASSERT_TRUE(urgent.ok()) << urgent.status();
  ASSERT_TRUE(cluster.WaitForHook("w1", "before_step", kWait).ok()) << cluster.Logs();
  auto suspended = cluster.Get(low->job_id());
  ASSERT_TRUE(suspended.ok()) << suspended.status();
  ASSERT_EQ(suspended->state(), v1::JOB_STATE_SUSPENDED) << suspended->reason();
  EXPECT_TRUE(
      absl::StrContains(suspended->reason(), "preempted by " + urgent->job_id() + " (priority 10)"))
      << suspended->reason();
  EXPECT_EQ(suspended->suspension().holders_size(), 2) << suspended->DebugString();

  // By hand: the wrong jobs are refused; low, suspended for the urgent job, is now also held
  // by a user (it waits for `resume`, not for workers).
  const testing::CommandResult running = Ctl(cluster, {"resume", urgent->job_id()});
  EXPECT_EQ(running.exit_code, 3) << running.output;
  EXPECT_TRUE(absl::StrContains(running.output, "FAILED_PRECONDITION")) << running.output;
  EXPECT_TRUE(absl::StrContains(running.output, "is not suspended")) << running.output;
  const testing::CommandResult suspend = Ctl(cluster, {"suspend", low->job_id()});
  ASSERT_EQ(suspend.exit_code, 0) << suspend.output;
  EXPECT_TRUE(absl::StartsWith(suspend.output, "suspended " + low->job_id())) << suspend.output;

  // The coordinator restarts while low is suspended; the urgent job re-forms on its workers
  // and ends; they come back keeping low's state aside, and low is still suspended.
  ASSERT_TRUE(cluster.RestartCoordinator().ok()) << cluster.Logs();
  cluster.ReleaseHook("w1", "before_step");
  auto urgent_done = cluster.WaitForEnd(urgent->job_id(), kWait);
  ASSERT_TRUE(urgent_done.ok()) << urgent_done.status();
  ASSERT_EQ(urgent_done->state(), v1::JOB_STATE_SUCCEEDED) << urgent_done->reason();
  auto after = cluster.WaitFor(
      low->job_id(),
      [](const v1::Job& j) {
        return j.state() == v1::JOB_STATE_SUSPENDED && j.suspension().holders_size() == 2;
      },
      kWait);
  ASSERT_TRUE(after.ok()) << after.status() << cluster.Logs();
  EXPECT_TRUE(after->suspension().by_user());
  const testing::CommandResult status = Ctl(cluster, {"status", low->job_id()});
  EXPECT_TRUE(absl::StrContains(status.output, "Suspended:")) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "state kept by w0, w1")) << status.output;
  const testing::CommandResult ended = Ctl(cluster, {"suspend", urgent->job_id()});
  EXPECT_EQ(ended.exit_code, 3) << ended.output;
  EXPECT_TRUE(absl::StrContains(ended.output, "has already ended")) << ended.output;

  // Resumed by hand: from its workers' memory, nothing trained again, the same bits.
  const testing::CommandResult resume = Ctl(cluster, {"resume", low->job_id()});
  ASSERT_EQ(resume.exit_code, 0) << resume.output;
  auto done = cluster.WaitForEnd(low->job_id(), kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  testing::ExpectExact(cluster, *done, kLowSteps, checksum);
  EXPECT_EQ(done->recoveries(), 0);
  int resumes = 0;
  for (const v1::Recovery& r : done->recovery_history()) {
    resumes += absl::StartsWith(r.reason(), "resumed after");
    EXPECT_FALSE(r.counted()) << r.reason();
    EXPECT_GT(r.first_step_unix_ms(), 0) << r.DebugString();
    EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
  }
  EXPECT_EQ(resumes, 1) << done->DebugString();
  EXPECT_GE(done->suspended_ms(), 1);
}

// The window inside a resume: the suspended job resumes on one holder and a new worker, and
// the holder is killed while it broadcasts the state to the new one. The other holder (busy
// with the urgent job meanwhile) still keeps it: the job re-forms on it once the urgent job
// ends, and ends with the bits of an undisturbed run, nothing redone.
TEST(PriorityTest, AHolderKilledWhileItHealsTheResumedGroupLosesNothing) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  v1::JobSpec low_spec = testing::DeterministicJob(2, 2, 1500, 0, 5000);
  low_spec.set_collective_timeout_ms(120000);  // w0 waits for the held w1
  low_spec.set_step_timeout_ms(120000);
  const std::string checksum = testing::ReferenceChecksumOnOneWorker(cluster, low_spec);
  ASSERT_FALSE(checksum.empty());

  // w0 holds when it first broadcasts a heal; w1 holds low before its step 1000 (so that it
  // is still training when the urgent job comes; the suspension lets it go), w2 the urgent
  // job before its step 50.
  ASSERT_TRUE(cluster.StartWorker("w0", {"--test_hooks=heal_broadcast"}).ok()) << cluster.Logs();
  ASSERT_TRUE(cluster.StartWorker("w1", {"--test_hooks=before_step@1000"}).ok()) << cluster.Logs();
  auto low = cluster.Submit(low_spec);
  ASSERT_TRUE(low.ok()) << low.status();
  ASSERT_TRUE(cluster.WaitForHook("w1", "before_step", kWait).ok()) << cluster.Logs();
  ASSERT_TRUE(cluster.StartWorker("w2", {"--test_hooks=before_step@50"}).ok()) << cluster.Logs();
  // Needs 2: w2 and one of low's (at its min_workers): low is suspended, w1 taken.
  v1::JobSpec urgent_spec = testing::DeterministicJob(2, 2, 300, 0, 5000);
  urgent_spec.set_priority(10);
  urgent_spec.set_collective_timeout_ms(120000);  // w1 waits for the held w2
  urgent_spec.set_step_timeout_ms(120000);
  auto urgent = cluster.Submit(urgent_spec);
  ASSERT_TRUE(urgent.ok()) << urgent.status();
  if (!cluster.WaitForHook("w2", "before_step", kWait).ok()) {
    auto u = cluster.Get(urgent->job_id());
    auto l = cluster.Get(low->job_id());
    FAIL() << "w2 never held in the urgent job: urgent " << (u.ok() ? u->DebugString() : "?")
           << "\nlow " << (l.ok() ? l->DebugString() : "?") << cluster.Logs();
  }
  auto suspended = cluster.Get(low->job_id());
  ASSERT_TRUE(suspended.ok()) << suspended.status();
  ASSERT_EQ(suspended->state(), v1::JOB_STATE_SUSPENDED) << suspended->reason();
  ASSERT_EQ(suspended->suspension().holders_size(), 2) << suspended->DebugString();

  // A fourth worker: low resumes on w0 (a holder) and w3, and w0 heals w3; killed there.
  ASSERT_TRUE(cluster.StartWorker("w3").ok()) << cluster.Logs();
  ASSERT_TRUE(cluster.WaitForHook("w0", "heal_broadcast", kWait).ok()) << cluster.Logs();
  cluster.worker("w0")->Signal(SIGKILL);
  // The urgent job goes on and ends; its workers free, low re-forms on w1, which kept its state.
  cluster.ReleaseHook("w2", "before_step");
  auto urgent_done = cluster.WaitForEnd(urgent->job_id(), kWait);
  ASSERT_TRUE(urgent_done.ok()) << urgent_done.status();
  EXPECT_EQ(urgent_done->state(), v1::JOB_STATE_SUCCEEDED) << urgent_done->reason();
  auto done = cluster.WaitForEnd(low->job_id(), kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  testing::ExpectExact(cluster, *done, 1500, checksum);
  // The resume's generation never trained (w0 was killed inside its heal); the next one
  // healed from w1, which had kept the state while it ran the urgent job.
  ASSERT_GE(done->recovery_history_size(), 2) << done->DebugString();
  EXPECT_TRUE(absl::StartsWith(done->recovery_history(0).reason(), "resumed after"))
      << done->DebugString();
  EXPECT_EQ(done->recovery_history(0).first_step_unix_ms(), 0) << done->DebugString();
  bool from_w1 = false;
  for (const v1::Generation& g : done->generations()) {
    if (g.generation() != done->generation()) continue;
    for (const std::string& m : g.members()) from_w1 = from_w1 || m == "w1";
  }
  EXPECT_TRUE(from_w1) << done->DebugString();
  for (const v1::Recovery& r : done->recovery_history()) {
    if (r.first_step_unix_ms() > 0) {
      EXPECT_EQ(r.steps_redone(), 0) << r.DebugString();
    }
  }
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
  // Two workers, held by a job of priority 9: a job of the same priority cannot take them
  // (nor suspend it), and the queue lists the waiting jobs in their order with why.
  ASSERT_TRUE(cluster.StartWorker("w1", {"--test_hooks=before_step@50"}).ok());
  v1::JobSpec busy = testing::SyntheticJob(2, 2, 100);
  busy.set_priority(9);
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
  EXPECT_TRUE(absl::StrContains(out, "queued behind " + second->job_id() + " (priority 9)")) << out;
  cluster.ReleaseHook("w1", "before_step");
  for (const auto* job : {&*running, &*second, &*first}) {
    auto done = cluster.WaitForEnd(job->job_id(), kWait);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  }
}

}  // namespace
}  // namespace lockstep
