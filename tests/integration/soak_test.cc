// A bounded randomized soak of recovery: trials of random kill schedules (single kills, double
// kills a few milliseconds apart, kills of the member that is healing a rejoined worker, kills
// and spares at the job's last step, coordinator restarts mid-run or at the end) on a
// deterministic job, whose parameters must then be bitwise those of an undisturbed run. Every
// trial ends SUCCEEDED with exactly its steps and that one checksum on every member, or FAILED
// with a reason; never SUCCEEDED with other bits, and a job that had trained its last step is
// never trained again while a member holds its state. LOCKSTEP_SOAK_TRIALS=N runs more (30 in
// CI).
#include <signal.h>

#include <cstdlib>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/job_state.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep {
namespace {

using testing::Cluster;

constexpr int64_t kSteps = 1500;

v1::JobSpec SoakJob() {
  v1::JobSpec spec = testing::DeterministicJob(1, 3, kSteps, 3000, 5000);
  spec.set_max_restarts(20);
  return spec;
}

TEST(SoakTest, RandomKillSchedulesNeverSucceedWithWrongBits) {
  const char* env = std::getenv("LOCKSTEP_SOAK_TRIALS");
  const int trials = env != nullptr ? std::atoi(env) : 30;
  const uint64_t seed = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  SCOPED_TRACE(absl::StrCat("soak seed ", seed, ", trials ", trials));
  std::mt19937_64 rng(seed);
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  ASSERT_TRUE(cluster.StartWorker("w0").ok());
  const v1::JobSpec spec = SoakJob();
  std::string reference;
  {
    auto job = cluster.Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    auto done = cluster.WaitForEnd(job->job_id(), absl::Seconds(120));
    ASSERT_TRUE(done.ok() && done->state() == v1::JOB_STATE_SUCCEEDED) << cluster.Logs();
    reference = done->members(0).parameter_checksum();
  }
  for (const char* name : {"w1", "w2", "w3"}) ASSERT_TRUE(cluster.StartWorker(name).ok());

  std::map<std::string, int> outcomes;
  for (int trial = 0; trial < trials; ++trial) {
    const int kind = static_cast<int>(rng() % 6);
    const char* kinds[] = {"single kill",           "double kill",
                           "heal-source kill",      "kill at the last step",
                           "spares at the last step", "coordinator restart"};
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": ", kinds[kind]));
    if (kind == 4) {
      // Two members only: the others come back as spares once the last step is done.
      for (const char* name : {"w2", "w3"}) {
        cluster.worker(name)->Signal(SIGKILL);
        ASSERT_TRUE(cluster.WaitForWorker(name, "lost", absl::Seconds(30)).ok()) << name;
      }
    }
    auto job = cluster.Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    // The end-of-job kinds act once the last step is done (the members are evaluating, or
    // have reported Finished), the restart half the time there and half mid-run.
    const bool at_end = kind == 3 || kind == 4 || (kind == 5 && rng() % 2 == 0);
    const int64_t at = at_end ? kSteps : 100 + static_cast<int64_t>(rng() % 900);
    auto running = cluster.WaitFor(
        job->job_id(), [&](const v1::Job& j) { return j.step() >= at; }, absl::Seconds(60));
    ASSERT_TRUE(running.ok()) << running.status();
    std::vector<std::string> victims;
    if (kind == 4) {
      for (const char* name : {"w2", "w3"}) {
        ASSERT_TRUE(cluster.StartWorker(name).ok()) << name << " did not come back";
      }
    } else if (kind == 5) {
      ASSERT_TRUE(cluster.RestartCoordinator(/*keep_state=*/true).ok()) << cluster.Logs();
    } else if (running->state() == v1::JOB_STATE_RUNNING && running->members_size() > 0) {
      const int n = running->members_size();
      const std::string first = running->members(static_cast<int>(rng() % n)).worker_name();
      cluster.worker(first)->Signal(SIGKILL);
      victims.push_back(first);
      if (kind == 1 && n > 1) {
        // A second member a few milliseconds later: inside the re-formation the first opened.
        absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 60)));
        std::string second = first;
        while (second == first) {
          second = running->members(static_cast<int>(rng() % n)).worker_name();
        }
        cluster.worker(second)->Signal(SIGKILL);
        victims.push_back(second);
      }
    }
    for (const std::string& v : victims) {
      absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 100)));
      ASSERT_TRUE(cluster.StartWorker(v).ok()) << v << " did not come back";
    }
    if (kind == 2 && !victims.empty()) {
      // The restarted worker is healed by the most advanced member: kill that one a moment
      // after the restart, while the group grows and heals.
      absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 40)));
      auto now = cluster.Get(job->job_id());
      if (now.ok() && now->members_size() > 1 && !IsTerminal(now->state())) {
        const std::string source = now->members(0).worker_name();
        if (source != victims.front()) {
          cluster.worker(source)->Signal(SIGKILL);
          absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 100)));
          ASSERT_TRUE(cluster.StartWorker(source).ok()) << source << " did not come back";
        }
      }
    }
    auto done = cluster.WaitForEnd(job->job_id(), absl::Seconds(120));
    ASSERT_TRUE(done.ok()) << done.status() << "\n" << cluster.Logs();
    // A re-formation after the last step resumes from it, unless nobody held the state (one
    // superseded before it resumed has nothing to say).
    for (const v1::Recovery& r : done->recovery_history()) {
      if (r.step_at_detection() < kSteps || r.steps_redone_lower_bound() ||
          r.first_step_unix_ms() == 0) {
        continue;
      }
      EXPECT_EQ(r.resumed_from_step(), kSteps)
          << "trained again after the last step: " << r.reason() << "\n" << cluster.Logs();
    }
    if (done->state() == v1::JOB_STATE_SUCCEEDED) {
      ++outcomes["succeeded"];
      EXPECT_EQ(done->step(), kSteps);
      ASSERT_GE(done->members_size(), 1);
      for (const v1::Member& m : done->members()) {
        EXPECT_EQ(m.step(), kSteps) << m.worker_name();
        EXPECT_EQ(m.parameter_checksum(), reference)
            << m.worker_name() << ": SUCCEEDED with other bits than an undisturbed run\n"
            << cluster.Logs();
      }
    } else {
      ++outcomes["failed"];
      EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
      EXPECT_FALSE(done->reason().empty()) << "a failure names its reason";
    }
    // Every worker is back and idle before the next trial.
    for (const char* name : {"w0", "w1", "w2", "w3"}) {
      ASSERT_TRUE(cluster.WaitForWorker(name, "idle", absl::Seconds(30)).ok()) << name;
    }
  }
  std::cout << "soak: " << trials << " trials, " << outcomes["succeeded"] << " succeeded with "
            << "the reference bits, " << outcomes["failed"] << " failed with a reason\n";
  EXPECT_GE(outcomes["succeeded"], trials / 2) << "recovery should usually succeed";
}

}  // namespace
}  // namespace lockstep
