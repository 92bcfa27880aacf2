// Elastic recovery with real processes: workers killed (SIGKILL) or frozen (SIGSTOP) mid-run,
// spares and restarted workers joining. Each test checks what a user would: the job
// succeeded, it ran exactly the requested number of optimizer steps, survivors healed from
// memory (no committed step redone), and every member holds identical parameters.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/job_state.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::SyntheticJob;

constexpr int64_t kSteps = 6000;

v1::JobSpec ElasticJob(int min_workers, int max_workers) {
  v1::JobSpec spec = SyntheticJob(min_workers, max_workers, kSteps);
  spec.set_heartbeat_timeout_ms(1500);
  spec.set_collective_timeout_ms(5000);
  return spec;
}

std::unique_ptr<Cluster> StartCluster(int workers) {
  auto cluster = Cluster::Start();
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return nullptr;
  EXPECT_TRUE((*cluster)->StartWorkers(workers).ok());
  return *std::move(cluster);
}

absl::StatusOr<v1::Job> WaitForStep(Cluster& cluster, const std::string& id, int64_t step) {
  return cluster.WaitFor(
      id, [&](const v1::Job& j) { return j.step() >= step; }, absl::Seconds(60));
}

// The job succeeded with exactly `steps` steps and identical parameters on every member.
void ExpectCompletedSteps(Cluster& cluster, const v1::Job& job, int64_t steps) {
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << cluster.Logs();
  EXPECT_EQ(job.step(), steps);
  ASSERT_GE(job.members_size(), 1);
  for (const v1::Member& m : job.members()) {
    EXPECT_EQ(m.step(), steps) << m.worker_name();
    EXPECT_EQ(m.parameter_checksum().size(), 16u);
    EXPECT_EQ(m.parameter_checksum(), job.members(0).parameter_checksum())
        << "rank " << m.rank() << " (" << m.worker_name() << ") holds different parameters";
  }
}

void ExpectCompleted(Cluster& cluster, const v1::Job& job) {
  ExpectCompletedSteps(cluster, job, kSteps);
  EXPECT_EQ(job.total_steps(), kSteps);
  EXPECT_GT(job.eval().test_accuracy(), 0.6);
}

// Every re-formation that got to train (one interrupted by a further failure before its
// first step is superseded by the next) resumed from memory with nothing redone.
void ExpectHealedWithoutRedo(const v1::Job& job) {
  ASSERT_GE(job.recovery_history_size(), 1);
  EXPECT_GT(job.recovery_history(job.recovery_history_size() - 1).first_step_unix_ms(), 0);
  for (const v1::Recovery& r : job.recovery_history()) {
    if (r.first_step_unix_ms() == 0) continue;
    EXPECT_EQ(r.steps_redone(), 0) << r.reason();
    EXPECT_GE(r.resumed_from_step(), r.step_at_detection()) << r.reason();
  }
}

// Submits `spec`, waits until the job has passed step 200, calls disturb(running job) (kill a
// member, start a spare, ...), and returns the job once it has ended.
absl::StatusOr<v1::Job> RunDisturbed(Cluster& cluster, const v1::JobSpec& spec,
                                     const std::function<void(const v1::Job&)>& disturb) {
  auto job = cluster.Submit(spec);
  if (!job.ok()) return job.status();
  auto running = WaitForStep(cluster, job->job_id(), 200);
  if (!running.ok()) return running.status();
  disturb(*running);
  return cluster.WaitForEnd(job->job_id(), absl::Seconds(120));
}

// The coordinator is killed mid-run and restarted on the same port with the same --state_dir:
// it reloads the job, and the group, which trained on meanwhile (the coordinator is not on the
// step path), registers again and is kept as it is: one generation, nothing re-formed, and the
// job succeeds with exactly its steps.
TEST(ElasticTest, CoordinatorRestartKeepsTheGroupThatTrainedOn) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  std::string job_id;
  auto done = RunDisturbed(*cluster, ElasticJob(2, 2), [&](const v1::Job& running) {
    job_id = running.job_id();
    ASSERT_TRUE(cluster->RestartCoordinator().ok()) << cluster->Logs();
    // Both workers come back (their backoff) and the job takes them again.
    EXPECT_TRUE(cluster->WaitForWorker("w0", "busy", absl::Seconds(30)).ok());
    EXPECT_TRUE(cluster->WaitForWorker("w1", "busy", absl::Seconds(30)).ok());
  });
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(*cluster, *done);
  EXPECT_EQ(done->job_id(), job_id);
  EXPECT_EQ(done->recoveries(), 0) << "a coordinator restart is not a worker failure";
  EXPECT_EQ(done->recovery_history_size(), 0) << cluster->Logs();
  EXPECT_EQ(done->generations_size(), 1) << cluster->Logs();
  // Ids continue after the restored job.
  auto next = cluster->Submit(SyntheticJob(2, 2, 20));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_NE(next->job_id(), job_id);
}

TEST(ElasticTest, KilledWorkerTwoToOne) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto done = RunDisturbed(*cluster, ElasticJob(1, 2),
                           [&](const v1::Job&) { cluster->worker("w1")->Signal(SIGKILL); });
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(*cluster, *done);
  EXPECT_EQ(done->recoveries(), 1);
  EXPECT_EQ(done->generation(), 2);
  EXPECT_EQ(done->members_size(), 1);
  ASSERT_EQ(done->recovery_history_size(), 1);
  EXPECT_NE(done->recovery_history(0).reason().find("w1"), std::string::npos);
  ExpectHealedWithoutRedo(*done);
  // What the user sees: the recovery in `status` and in the replayed `watch` history.
  auto status = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "status", done->job_id()},
      absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_NE(status->output.find("Membership changes"), std::string::npos) << status->output;
  EXPECT_NE(status->output.find("1->2  recovery"), std::string::npos) << status->output;
  auto watch = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "watch", done->job_id()},
      absl::Seconds(30));
  ASSERT_TRUE(watch.ok());
  EXPECT_EQ(watch->exit_code, 0);
  EXPECT_NE(watch->output.find("lost: connection lost"), std::string::npos) << watch->output;
  EXPECT_NE(watch->output.find("0 steps redone"), std::string::npos) << watch->output;
}

TEST(ElasticTest, KilledWorkerThreeToTwo) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto done = RunDisturbed(*cluster, ElasticJob(1, 3), [&](const v1::Job&) {
    cluster->worker("w0")->Signal(SIGKILL);  // rank 0
  });
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(*cluster, *done);
  EXPECT_EQ(done->members_size(), 2);
  EXPECT_EQ(done->recoveries(), 1);
  ExpectHealedWithoutRedo(*done);
}

TEST(ElasticTest, TwoWorkersKilledAtOnce) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  auto done = RunDisturbed(*cluster, ElasticJob(1, 3), [&](const v1::Job&) {
    cluster->worker("w1")->Signal(SIGKILL);
    cluster->worker("w2")->Signal(SIGKILL);
  });
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(*cluster, *done);
  EXPECT_EQ(done->members_size(), 1);
  ExpectHealedWithoutRedo(*done);
}

// The spare joins while the only member is held before a step (a test hook), so the job cannot
// end before the spare has registered, however loaded the machine is.
TEST(ElasticTest, SpareJoinsMidRun) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->StartWorker("w0", {"--test_hooks=before_step@400"}).ok());
  auto job = (*cluster)->Submit(ElasticJob(1, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE((*cluster)->WaitForHook("w0", "before_step", absl::Seconds(60)).ok());
  ASSERT_TRUE((*cluster)->StartWorker("w1").ok());
  // The scale-up aborts the held generation, which releases the hook.
  auto done = (*cluster)->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(**cluster, *done);
  EXPECT_EQ(done->members_size(), 2) << "the spare joined";
  EXPECT_EQ(done->recoveries(), 0);
  ASSERT_EQ(done->recovery_history_size(), 1);
  EXPECT_TRUE(done->recovery_history(0).scale_up());
  ExpectHealedWithoutRedo(*done);
}

// The survivor holds before a late step (a test hook) until the restarted worker's scale-up
// aborts that generation (or the test sees it rejoined): the job cannot end before it
// rejoins, however loaded the machine.
TEST(ElasticTest, KilledWorkerRestartedRejoins) {
  auto cluster = Cluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)
                  ->StartWorker("w0", {absl::StrCat("--test_hooks=before_step@", kSteps - 100)})
                  .ok());
  ASSERT_TRUE((*cluster)->StartWorker("w1").ok());
  v1::JobSpec spec = ElasticJob(1, 2);
  spec.set_heartbeat_timeout_ms(5000);  // the kill is seen by the stream; no false losses
  auto job = (*cluster)->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Cluster& c = **cluster;
  ASSERT_TRUE(WaitForStep(c, job->job_id(), 200).ok());
  c.worker("w1")->Signal(SIGKILL);
  ASSERT_TRUE(c.WaitFor(
                   job->job_id(),
                   [](const v1::Job& j) {
                     return j.generation() >= 2 && j.state() == v1::JOB_STATE_RUNNING;
                   },
                   absl::Seconds(30))
                  .ok());
  // Its service manager restarts it: a new incarnation under the same name.
  ASSERT_TRUE(c.StartWorker("w1").ok());
  ASSERT_TRUE(c.WaitFor(
                   job->job_id(),
                   [](const v1::Job& j) { return j.generation() >= 3 && j.members_size() == 2; },
                   absl::Seconds(120))
                  .ok());
  // Rejoined (the hook, if reached, was released by the scale-up): it must not hold later.
  c.ReleaseHook("w0", "before_step");
  auto done = c.WaitForEnd(job->job_id(), absl::Seconds(180));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(c, *done);
  EXPECT_EQ(done->members_size(), 2) << "the restarted worker rejoined";
  EXPECT_EQ(done->recoveries(), 1);
  ExpectHealedWithoutRedo(*done);
}

TEST(ElasticTest, FrozenWorkerIsExcludedByHeartbeatAndFencedWhenContinued) {
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  v1::JobSpec spec = ElasticJob(1, 2);  // the third worker stays a spare
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForStep(*cluster, job->job_id(), 200).ok());
  auto running = cluster->Get(job->job_id());
  ASSERT_TRUE(running.ok());
  const std::string frozen = running->members(1).worker_name();
  cluster->worker(frozen)->Signal(SIGSTOP);
  // Detected by heartbeat silence (1.5 s), replaced by the spare.
  auto reformed = cluster->WaitFor(
      job->job_id(),
      [](const v1::Job& j) { return j.generation() >= 2 && j.state() == v1::JOB_STATE_RUNNING; },
      absl::Seconds(30));
  ASSERT_TRUE(reformed.ok()) << reformed.status();
  EXPECT_NE(reformed->recovery_history(0).reason().find("no heartbeat"), std::string::npos)
      << reformed->recovery_history(0).reason();
  cluster->worker(frozen)->Signal(SIGCONT);
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectCompleted(*cluster, *done);
  EXPECT_EQ(done->members_size(), 2);
  EXPECT_GE(done->generation(), 2);
  ExpectHealedWithoutRedo(*done);
  // The continued process is alive and back as a new registration (its old one is lost).
  EXPECT_TRUE(cluster->worker(frozen)->running());
}

TEST(ElasticTest, BelowMinWorkersFailsAfterRendezvousTimeout) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  v1::JobSpec spec = ElasticJob(2, 2);
  spec.set_rendezvous_timeout_ms(2000);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForStep(*cluster, job->job_id(), 100).ok());
  cluster->worker("w1")->Signal(SIGKILL);
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(done->reason().find("rendezvous_timeout_ms"), std::string::npos) << done->reason();
}

// Deterministic mode: world sizes 1-4 and a run that loses a member mid-way all end with
// bitwise-identical parameters, and report the same evaluation to the last bit.
TEST(ElasticTest, DeterministicModeIsBitwiseIdenticalAcrossWorldSizesAndFailures) {
  auto cluster = StartCluster(4);
  ASSERT_NE(cluster, nullptr);
  auto run = [&](v1::JobSpec spec, bool kill_one) -> std::string {
    spec.set_deterministic(true);
    auto job = cluster->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return "";
    if (kill_one) {
      auto running = WaitForStep(*cluster, job->job_id(), 200);
      EXPECT_TRUE(running.ok() && running->members_size() == 3) << running.status();
      if (!running.ok() || running->members_size() != 3) return "";
      cluster->worker(running->members(1).worker_name())->Signal(SIGKILL);
    }
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(180));
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return "";
    EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
    EXPECT_EQ(done->step(), spec.max_steps());
    if (kill_one) {
      EXPECT_EQ(done->recoveries(), 1);
      ExpectHealedWithoutRedo(*done);
    }
    for (const v1::Member& m : done->members()) {
      EXPECT_EQ(m.parameter_checksum(), done->members(0).parameter_checksum());
    }
    if (done->members_size() == 0) return "";
    // Hexadecimal floats: every bit of the evaluation.
    return absl::StrFormat("%s, test loss %a, accuracy %a over %d",
                           done->members(0).parameter_checksum(), done->eval().test_loss(),
                           done->eval().test_accuracy(), done->eval().test_samples());
  };
  const std::string reference = run(SyntheticJob(1, 1, 1500), false);
  ASSERT_NE(reference.find("over 2048"), std::string::npos) << reference;
  for (int world = 2; world <= 4; ++world) {
    EXPECT_EQ(run(SyntheticJob(world, world, 1500), false), reference) << "world " << world;
  }
  v1::JobSpec elastic = SyntheticJob(1, 3, 1500);
  elastic.set_collective_timeout_ms(5000);
  EXPECT_EQ(run(elastic, true), reference) << "3 workers, one killed mid-run";
}

// Every worker killed, then new ones started: the job resumes from the newest disk checkpoint
// (or, when that one is corrupt, the one before), and in deterministic mode still ends with the
// same bits as an uninterrupted run.
TEST(ElasticTest, AllWorkersKilledResumeFromLastGoodCheckpoint) {
  for (bool corrupt_latest : {false, true}) {
    SCOPED_TRACE(corrupt_latest ? "latest checkpoint corrupted" : "checkpoints intact");
    auto cluster = StartCluster(2);
    ASSERT_NE(cluster, nullptr);
    v1::JobSpec spec = SyntheticJob(1, 2, 6000);
    spec.set_deterministic(true);
    spec.set_collective_timeout_ms(5000);
    auto reference = cluster->Submit(spec);  // uninterrupted, no checkpoints
    ASSERT_TRUE(reference.ok());
    auto ref_done = cluster->WaitForEnd(reference->job_id(), absl::Seconds(120));
    ASSERT_TRUE(ref_done.ok() && ref_done->state() == v1::JOB_STATE_SUCCEEDED);

    const std::string dir = cluster->dir() + "/checkpoints";
    spec.set_checkpoint_every_steps(100);
    spec.set_checkpoint_dir(dir);
    spec.set_keep_checkpoints(3);
    auto job = cluster->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE(WaitForStep(*cluster, job->job_id(), 650).ok());
    cluster->worker("w0")->Signal(SIGKILL);
    cluster->worker("w1")->Signal(SIGKILL);
    auto waiting = cluster->WaitFor(
        job->job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RECONFIGURING; },
        absl::Seconds(10));
    ASSERT_TRUE(waiting.ok()) << waiting.status();
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".ckpt") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    // keep_checkpoints 3; a kill between writing the newest and pruning the oldest leaves one
    // more, which is harmless.
    ASSERT_GE(files.size(), 3u);
    ASSERT_LE(files.size(), 4u);
    // JOB.step-NNNNNNNNNNNN.ckpt
    auto step_of = [](const std::filesystem::path& p) {
      const std::string name = p.filename().string();
      return std::stoll(name.substr(name.rfind(".step-") + 6, 12));
    };
    int64_t expected = step_of(files.back());
    if (corrupt_latest) {
      std::fstream f(files.back(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(200);
      f.put('\x55');
      expected = step_of(files[files.size() - 2]);
    }
    ASSERT_TRUE(cluster->StartWorker("w2").ok());
    ASSERT_TRUE(cluster->StartWorker("w3").ok());
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
    ASSERT_TRUE(done.ok()) << done.status();
    ExpectCompletedSteps(*cluster, *done, 6000);
    // The first re-formation that trained after the kills is the one that read the disk (a
    // later one may be the second new worker joining).
    const v1::Recovery* resumed = nullptr;
    for (const v1::Recovery& r : done->recovery_history()) {
      if (!r.scale_up() && r.first_step_unix_ms() > 0) resumed = &r;
    }
    ASSERT_NE(resumed, nullptr);
    EXPECT_EQ(resumed->resumed_from_step(), expected);
    EXPECT_EQ(resumed->steps_redone(),
              std::max<int64_t>(0, resumed->step_at_detection() - expected));
    EXPECT_EQ(done->members(0).parameter_checksum(), ref_done->members(0).parameter_checksum())
        << "resuming from a checkpoint must not change a deterministic result";
  }
}

// Random kills at random steps, each victim restarted by "its service manager" shortly after,
// so the job keeps shrinking and growing. Small in CI; LOCKSTEP_SOAK_ROUNDS=N runs longer.
TEST(ElasticTest, RandomizedKillSoak) {
  const char* env = std::getenv("LOCKSTEP_SOAK_ROUNDS");
  const int rounds = env != nullptr ? std::atoi(env) : 4;
  const uint64_t seed = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  SCOPED_TRACE(absl::StrCat("soak seed ", seed, ", rounds ", rounds));
  std::mt19937_64 rng(seed);
  auto cluster = StartCluster(3);
  ASSERT_NE(cluster, nullptr);
  v1::JobSpec spec = SyntheticJob(1, 3, 2000 + 2000 * static_cast<int64_t>(rounds));
  // Ten times the usual batch: a step long enough that the time a kill, restart and
  // re-formation take is hundreds of steps, not thousands (the job must not end before the
  // last kill lands).
  spec.set_global_batch_size(1200);
  spec.set_heartbeat_timeout_ms(1500);
  spec.set_collective_timeout_ms(5000);
  spec.set_max_restarts(rounds + 2);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  int64_t next_kill = 0;
  int kills = 0;
  for (int round = 0; round < rounds; ++round) {
    next_kill += 500 + static_cast<int64_t>(rng() % 1000);
    // Past the step, and running again: a kill lands on a running generation, not inside the
    // re-formation after the previous one (on a loaded machine that can take longer than the
    // next 1,000 steps took before it).
    auto running = cluster->WaitFor(
        job->job_id(),
        [&](const v1::Job& j) {
          return IsTerminal(j.state()) ||
                 (j.step() >= next_kill && j.state() == v1::JOB_STATE_RUNNING &&
                  j.members_size() > 0);
        },
        absl::Seconds(60));
    ASSERT_TRUE(running.ok()) << running.status();
    if (running->state() != v1::JOB_STATE_RUNNING || running->members_size() == 0) continue;
    const std::string victim =
        running->members(static_cast<int>(rng() % running->members_size())).worker_name();
    cluster->worker(victim)->Signal(SIGKILL);
    ++kills;
    absl::SleepFor(absl::Milliseconds(static_cast<int64_t>(rng() % 200)));
    ASSERT_TRUE(cluster->StartWorker(victim).ok())
        << "round " << round << ": " << victim << " did not come back";
  }
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(180));
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << cluster->Logs();
  EXPECT_EQ(done->step(), spec.max_steps());
  EXPECT_GE(kills, rounds - 1) << "the job ended before the kills";
  // One re-formation per kill, each counted against max_restarts unless the coordinator detected
  // it right after its own absence (its threads starved for a second on a loaded machine), or
  // the victim had already been lost kMaxChargesPerWorker times (random picks can choose one
  // worker every round): it then leaves the job, and its loss is not counted.
  std::string history;
  int losses = 0, counted = 0;
  for (const v1::Recovery& r : done->recovery_history()) {
    absl::StrAppend(&history, "\n  ", r.from_generation(), " -> ", r.to_generation(), ": ",
                    r.reason(), r.scale_up() ? " (scale-up)" : "", r.counted() ? " (counted)" : "");
    if (r.scale_up()) {
      EXPECT_FALSE(r.counted()) << r.reason();
      continue;
    }
    ++losses;
    if (r.counted()) {
      ++counted;
    } else {
      EXPECT_TRUE(r.coordinator_caused() || absl::StrContains(r.reason(), "not counted"))
          << "a loss not counted must say why: " << r.reason();
    }
  }
  EXPECT_EQ(losses, kills) << "one re-formation per kill; recoveries:" << history;
  EXPECT_EQ(done->recoveries(), counted) << "recoveries:" << history;
  for (const v1::Member& m : done->members()) {
    EXPECT_EQ(m.step(), spec.max_steps());
    EXPECT_EQ(m.parameter_checksum(), done->members(0).parameter_checksum());
  }
  for (const v1::Recovery& r : done->recovery_history()) {
    if (r.first_step_unix_ms() > 0) {
      EXPECT_EQ(r.steps_redone(), 0) << r.reason();
    }
  }
}

}  // namespace
}  // namespace lockstep
