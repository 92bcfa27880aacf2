// Recovery inside its windows: each test holds a worker at a test hook (common/test_hooks.h)
// inside one failure window (a heal broadcast, a group that is connecting, the final
// evaluation, a coordinator that is away or lost its state, ...) and kills or freezes a real
// process there. The invariant is the user's: the job ends with exactly its steps and one
// parameter checksum equal to an undisturbed run's (deterministic mode makes that checksum
// independent of the world size), or fails with a clear reason; never SUCCEEDED with wrong bits.
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/exact.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::ExpectExact;
using testing::ReferenceChecksum;

constexpr absl::Duration kHookWait = absl::Seconds(60);

// A deterministic job: its checksum is the same for every world size and failure schedule.
v1::JobSpec DeterministicJob(int min_workers, int max_workers, int64_t steps) {
  return testing::DeterministicJob(min_workers, max_workers, steps, 1500, 5000);
}

std::unique_ptr<Cluster> StartCluster() {
  auto cluster = Cluster::Start();
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

absl::StatusOr<v1::Job> WaitForStep(Cluster& cluster, const std::string& id, int64_t step) {
  return cluster.WaitFor(
      id, [&](const v1::Job& j) { return j.step() >= step; }, absl::Seconds(60));
}

// Defect: a coordinator restarted without its state numbered jobs from job-1 again, and a
// worker that still held the old job-1's state trained the new job-1 from it.
TEST(RecoveryWindowsTest, CoordinatorRestartedWithoutStateNeverReusesAnotherJobsState) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  v1::JobSpec old_spec = DeterministicJob(2, 2, 20000);
  auto old_job = cluster->Submit(old_spec);
  ASSERT_TRUE(old_job.ok()) << old_job.status();
  ASSERT_TRUE(WaitForStep(*cluster, old_job->job_id(), 300).ok());
  ASSERT_TRUE(cluster->RestartCoordinator(/*keep_state=*/false).ok()) << cluster->Logs();
  ASSERT_TRUE(cluster->WaitForWorker("w0", "idle", absl::Seconds(30)).ok());
  ASSERT_TRUE(cluster->WaitForWorker("w1", "idle", absl::Seconds(30)).ok());
  // Another job: same data, another model and seed.
  v1::JobSpec spec = DeterministicJob(2, 2, 600);
  spec.mutable_model()->mutable_mlp()->set_hidden_widths(1, 48);
  spec.set_seed(99);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_NE(job->job_id(), old_job->job_id()) << "job ids must not repeat across coordinators";
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  // The same job again, on workers that hold nobody's state: the reference.
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  ExpectExact(*cluster, *done, 600, reference);
}

// Defect: the heal source died between the two halves of its broadcast (parameters, then
// optimizer state); the receiver kept new parameters with its old optimizer state, trained
// on, and the job succeeded with wrong bits.
TEST(RecoveryWindowsTest, HealSourceKilledMidBroadcastLeavesNoMixedState) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  const v1::JobSpec spec = DeterministicJob(1, 2, 1500);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_EQ(reference.size(), 16u);
  // w0 is the source of the next heal; it holds between the two halves of its broadcast. It
  // also holds before step 300 until the spare's scale-up aborts that generation, so the job
  // cannot end before the spare has joined, however loaded the machine is.
  cluster->worker("w0")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(
      cluster->StartWorker("w0", {"--test_hooks=heal_broadcast,before_step@300"}).ok());
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "before_step", kHookWait).ok());
  ASSERT_TRUE(cluster->StartWorker("w1").ok());  // a spare: the group grows and heals it
  ASSERT_TRUE(cluster->WaitForHook("w0", "heal_broadcast", kHookWait).ok());
  cluster->worker("w0")->Signal(SIGKILL);
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectExact(*cluster, *done, 1500, reference);
}

// Defect: a second member died or froze while the new group was connecting; the survivor's
// connect and first collective could not be interrupted, and the next generation waited for
// that thread up to the collective timeout. Generation 2 (w0, w1) forms after w2 is killed;
// w1 holds right after publishing its address, and is then killed or frozen.
TEST(RecoveryWindowsTest, SecondMemberLostWhileTheNewGroupConnects) {
  for (int sig : {SIGKILL, SIGSTOP}) {
    SCOPED_TRACE(sig == SIGKILL ? "killed" : "frozen");
    auto cluster = StartCluster();
    ASSERT_NE(cluster, nullptr);
    ASSERT_TRUE(cluster->StartWorker("w0").ok());
    v1::JobSpec spec = DeterministicJob(1, 3, 3000);
    const std::string reference = ReferenceChecksum(*cluster, spec);
    ASSERT_EQ(reference.size(), 16u);
    // Long enough that waiting it out would exceed the test's bound below.
    spec.set_collective_timeout_ms(90000);
    ASSERT_TRUE(cluster->StartWorker("w1", {"--test_hooks=store_set_1@2"}).ok());
    ASSERT_TRUE(cluster->StartWorker("w2").ok());
    auto job = cluster->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_TRUE(WaitForStep(*cluster, job->job_id(), 300).ok());
    cluster->worker("w2")->Signal(SIGKILL);
    ASSERT_TRUE(cluster->WaitForHook("w1", "store_set_1", kHookWait).ok());
    absl::SleepFor(absl::Milliseconds(100));  // w0 connects to w1 and starts on the group
    cluster->worker("w1")->Signal(sig);
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(45));
    ASSERT_TRUE(done.ok()) << done.status() << "\n" << cluster->Logs();
    ExpectExact(*cluster, *done, 3000, reference);
  }
}

// Defect: a job found another job's newer checkpoint in its directory and ended "trained 3000
// steps" without training, or continued from another job's parameters (the check covered only
// the model's shapes).
TEST(RecoveryWindowsTest, AnotherJobsCheckpointsAreNeverLoaded) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  const std::string dir = cluster->dir() + "/shared-checkpoints";
  v1::JobSpec writer = DeterministicJob(2, 2, 3000);
  writer.set_checkpoint_every_steps(500);
  writer.set_checkpoint_dir(dir);
  ASSERT_EQ(ReferenceChecksum(*cluster, writer).size(), 16u);

  // Fewer steps than the checkpoints in the directory, another seed and learning rate.
  v1::JobSpec shorter = DeterministicJob(2, 2, 1000);
  shorter.set_seed(7);
  shorter.mutable_optimizer()->set_learning_rate(0.02);
  // More steps than the checkpoints, another seed.
  v1::JobSpec longer = DeterministicJob(2, 2, 4000);
  longer.set_seed(8);
  for (const v1::JobSpec& clean : {shorter, longer}) {
    SCOPED_TRACE(absl::StrCat(clean.max_steps(), " steps"));
    const std::string reference = ReferenceChecksum(*cluster, clean);
    v1::JobSpec sharing = clean;
    sharing.set_checkpoint_every_steps(500);
    sharing.set_checkpoint_dir(dir);
    auto job = cluster->Submit(sharing);
    ASSERT_TRUE(job.ok()) << job.status();
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
    ASSERT_TRUE(done.ok()) << done.status();
    ExpectExact(*cluster, *done, clean.max_steps(), reference);
  }
}

// A checkpoint directory on a tmpfs with room for two of the test model's checkpoints (about
// 52 KiB each): the third write meets a full disk. Needs root; the test skips elsewhere.
class FullDisk {
 public:
  explicit FullDisk(const std::string& dir) : dir_(dir) {
    std::filesystem::create_directories(dir);
    mounted_ = getuid() == 0 && mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=128k") == 0;
  }
  ~FullDisk() {
    if (mounted_) umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }

 private:
  const std::string dir_;
  bool mounted_ = false;
};

// Defect 6: on a full disk every checkpoint write failed in a log line only, and the job
// "succeeded" with no checkpoint behind it. Now status and watch show the last good checkpoint
// and the failures with the system's reason, and checkpoint_failure_policy "fail" fails the job.
TEST(RecoveryWindowsTest, CheckpointWriteFailuresAreVisibleAndCanFailTheJob) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  FullDisk disk(cluster->dir() + "/small-disk");
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  v1::JobSpec spec = DeterministicJob(1, 1, 1000);
  spec.set_checkpoint_every_steps(200);
  spec.set_checkpoint_dir(cluster->dir() + "/small-disk/ckpt");
  spec.set_keep_checkpoints(5);
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  // "warn", the default: the job trains on, and says what happened.
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  EXPECT_EQ(done->checkpoints().last_good_step(), 400);
  EXPECT_EQ(done->checkpoints().failed_writes(), 3);
  EXPECT_EQ(done->checkpoints().last_failed_step(), 1000);
  EXPECT_NE(done->checkpoints().last_error().find("No space left on device"), std::string::npos)
      << done->checkpoints().last_error();
  auto status = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "status", job->job_id()},
      absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_NE(status->output.find("Checkpoints:"), std::string::npos) << status->output;
  EXPECT_NE(status->output.find("last good at step 400"), std::string::npos) << status->output;
  EXPECT_NE(status->output.find("3 writes failed"), std::string::npos) << status->output;
  auto watch = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster->address(), "watch", job->job_id()},
      absl::Seconds(30));
  ASSERT_TRUE(watch.ok());
  EXPECT_NE(watch->output.find("checkpoint at step 600 not written"), std::string::npos)
      << watch->output;
  EXPECT_NE(watch->output.find("No space left on device"), std::string::npos) << watch->output;

  // "fail": the first failed write ends the job, naming the file and the reason.
  spec.set_checkpoint_failure_policy("fail");
  job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(done->reason().find("No space left on device"), std::string::npos) << done->reason();
  EXPECT_NE(done->reason().find("checkpoint_failure_policy"), std::string::npos)
      << done->reason();
}

// Continuing from another job's checkpoint is explicit: init_from_checkpoint loads its
// parameters and optimizer state, and the job trains its own steps from step 0.
TEST(RecoveryWindowsTest, InitFromCheckpointStartsFromAnotherJobsWeights) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  const std::string dir = cluster->dir() + "/pretrained";
  v1::JobSpec pretrain = DeterministicJob(2, 2, 1500);
  pretrain.set_checkpoint_every_steps(1500);
  pretrain.set_checkpoint_dir(dir);
  ASSERT_EQ(ReferenceChecksum(*cluster, pretrain).size(), 16u);

  // The first loss each job reports: a job that starts from trained weights starts low.
  auto first_loss = [&](const v1::JobSpec& spec) -> double {
    auto job = cluster->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return 0;
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
    EXPECT_TRUE(done.ok() && done->state() == v1::JOB_STATE_SUCCEEDED)
        << (done.ok() ? done->reason() : done.status().ToString());
    if (done.ok()) {
      EXPECT_EQ(done->step(), spec.max_steps());
    }
    auto history = cluster->History(job->job_id());
    EXPECT_TRUE(history.ok());
    for (const v1::JobEvent& e : *history) {
      if (e.kind() == v1::JobEvent::PROGRESS && e.job().loss() > 0) return e.job().loss();
    }
    return 0;
  };
  v1::JobSpec fine_tune = DeterministicJob(2, 2, 300);
  fine_tune.set_seed(23);
  const double fresh = first_loss(fine_tune);
  fine_tune.mutable_init_from_checkpoint()->set_path(dir);
  fine_tune.mutable_init_from_checkpoint()->set_load_optimizer_state(true);
  const double initialized = first_loss(fine_tune);
  EXPECT_GT(fresh, 0);
  EXPECT_LT(initialized, 0.7 * fresh) << "fresh " << fresh << ", initialized " << initialized;

  // A path with no checkpoint of this model fails the job and says why.
  v1::JobSpec wrong = fine_tune;
  wrong.mutable_model()->mutable_mlp()->set_hidden_widths(0, 40);
  auto job = cluster->Submit(wrong);
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(done->reason().find("init_from_checkpoint"), std::string::npos) << done->reason();
}

// IDX files with `labels_offset` added to every label (mod 4), written with fixed times.
void WriteIdx(const std::string& dir, int labels_offset) {
  std::filesystem::create_directories(dir);
  auto be32 = [](std::ofstream& out, uint32_t v) {
    const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                       static_cast<char>(v >> 8), static_cast<char>(v)};
    out.write(b, 4);
  };
  for (const auto& [prefix, n] : {std::pair<std::string, int>{"train", 2400}, {"t10k", 400}}) {
    std::ofstream images(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary);
    be32(images, 0x803);
    be32(images, n);
    be32(images, 4);
    be32(images, 4);
    std::ofstream labels(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary);
    be32(labels, 0x801);
    be32(labels, n);
    for (int i = 0; i < n; ++i) {
      int sum = 0;
      for (int p = 0; p < 16; ++p) {
        const int v = (i * 37 + p * 11 + (i * p) % 7) % 256;
        images.put(static_cast<char>(v));
        sum += v;
      }
      labels.put(static_cast<char>((sum / 512 + labels_offset) % 4));
    }
  }
  // The same modification time for every version, so a cache keyed by size and mtime alone
  // cannot tell them apart.
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::filesystem::last_write_time(
        e.path(), std::filesystem::file_time_type(std::chrono::seconds(1'700'000'000)));
  }
}

v1::JobSpec IdxJob(const std::string& dir) {
  v1::JobSpec spec = DeterministicJob(2, 2, 400);
  spec.mutable_dataset()->set_type("idx");
  spec.mutable_dataset()->set_path(dir);
  spec.mutable_dataset()->clear_synthetic();
  return spec;
}

// Defect: a long-lived worker kept serving a data set after its files were replaced; an old
// and a fresh worker trained on different labels and "succeeded".
TEST(RecoveryWindowsTest, DataReplacedUnderALongLivedWorker) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  const std::string data = cluster->dir() + "/idx";
  WriteIdx(data, 0);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  ASSERT_EQ(ReferenceChecksum(*cluster, IdxJob(data)).size(), 16u);  // both hold the data now
  WriteIdx(data, 1);  // new labels, same sizes and times
  cluster->worker("w1")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w1", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->StartWorker("w2").ok());  // fresh; w0 is the long-lived one
  auto job = cluster->Submit(IdxJob(data));
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  // Reference: two workers that never saw the old files, with a cache of their own.
  cluster->worker("w0")->Signal(SIGKILL);
  cluster->worker("w2")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->WaitForWorker("w2", "lost", absl::Seconds(10)).ok());
  const std::string fresh_cache = "--data_cache_dir=" + cluster->dir() + "/fresh-cache";
  ASSERT_TRUE(cluster->StartWorker("w3", {fresh_cache}).ok());
  ASSERT_TRUE(cluster->StartWorker("w4", {fresh_cache}).ok());
  const std::string reference = ReferenceChecksum(*cluster, IdxJob(data));
  ExpectExact(*cluster, *done, 400, reference);
}

// Defect: after a 4-10 s SIGSTOP of the coordinator, every run was charged recoveries for the
// silence the coordinator itself caused.
TEST(RecoveryWindowsTest, PausedCoordinatorIsNotChargedToTheWorkers) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  v1::JobSpec spec = DeterministicJob(2, 2, 20000);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  spec.set_max_restarts(0);  // any failure recovery charged to the job fails it
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForStep(*cluster, job->job_id(), 300).ok());
  cluster->coordinator()->Signal(SIGSTOP);
  absl::SleepFor(absl::Seconds(8));
  cluster->coordinator()->Signal(SIGCONT);
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectExact(*cluster, *done, 20000, reference);
  EXPECT_EQ(done->recoveries(), 0);
  ASSERT_GE(done->recovery_history_size(), 1) << "the workers' sessions broke meanwhile";
  for (const v1::Recovery& r : done->recovery_history()) {
    EXPECT_TRUE(r.coordinator_caused()) << r.reason();
    EXPECT_NE(r.reason().find("unresponsive"), std::string::npos) << r.reason();
    if (r.first_step_unix_ms() > 0) {
      EXPECT_EQ(r.steps_redone(), 0) << r.reason();
    }
  }
}

// Defect: a member lost during the final evaluation was recorded as "resumed from step 0,
// source -1".
TEST(RecoveryWindowsTest, MemberLostDuringTheFinalEvaluation) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  const v1::JobSpec spec = DeterministicJob(1, 2, 800);
  const std::string reference = ReferenceChecksum(*cluster, spec);
  ASSERT_TRUE(cluster->StartWorker("w1").ok());
  cluster->worker("w0")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->StartWorker("w0", {"--test_hooks=before_evaluation"}).ok());
  cluster->worker("w1")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w1", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->StartWorker("w1", {"--test_hooks=before_evaluation"}).ok());
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "before_evaluation", kHookWait).ok());
  ASSERT_TRUE(cluster->WaitForHook("w1", "before_evaluation", kHookWait).ok());
  auto running = cluster->Get(job->job_id());
  ASSERT_TRUE(running.ok());
  const std::string survivor = running->members(0).worker_name();
  const std::string victim = running->members(1).worker_name();
  cluster->worker(victim)->Signal(SIGKILL);
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectExact(*cluster, *done, 800, reference);
  ASSERT_EQ(done->recovery_history_size(), 1);
  const v1::Recovery& r = done->recovery_history(0);
  EXPECT_EQ(r.resumed_from_step(), 800) << r.reason();
  EXPECT_EQ(r.source_rank(), 0);
  EXPECT_EQ(r.steps_redone(), 0);
  EXPECT_GT(r.first_step_unix_ms(), 0);
  EXPECT_GT(done->eval().test_samples(), 0);
}

// Shared-memory segments in /dev/shm named after process `pid` ("lockstep-PID-...").
int ShmSegmentsOf(pid_t pid) {
  int n = 0;
  const std::string prefix = absl::StrCat("lockstep-", pid, "-");
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

// Defect: shared-memory segments leaked when a peer died during the segment's setup.
TEST(RecoveryWindowsTest, SharedMemorySegmentsDoNotLeakWhenSetupFails) {
  auto cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  // Rank 0 holds after creating the segment and rank 1 is killed: rank 0 must unlink it.
  ASSERT_TRUE(cluster->StartWorker("w0", {"--test_hooks=shm_setup"}).ok());
  ASSERT_TRUE(cluster->StartWorker("w1").ok());
  auto job = cluster->Submit(DeterministicJob(1, 2, 300));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "shm_setup", kHookWait).ok());
  const pid_t rank0 = cluster->worker("w0")->pid();
  EXPECT_EQ(ShmSegmentsOf(rank0), 1);
  cluster->worker("w1")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w1", "lost", absl::Seconds(10)).ok());
  cluster->ReleaseHook("w0", "shm_setup");
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  EXPECT_EQ(ShmSegmentsOf(rank0), 0) << "rank 0 unlinks the segment when setup fails";

  // Rank 0 itself is killed with the segment created: the next worker to start sweeps it.
  cluster->worker("w0")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->StartWorker("w0", {"--test_hooks=shm_setup"}).ok());
  ASSERT_TRUE(cluster->StartWorker("w1").ok());
  job = cluster->Submit(DeterministicJob(2, 2, 300));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "shm_setup", kHookWait).ok());
  const pid_t killed = cluster->worker("w0")->pid();
  cluster->worker("w0")->Signal(SIGKILL);
  ASSERT_TRUE(cluster->WaitForWorker("w0", "lost", absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster->worker("w0")->Wait(absl::Seconds(10)).ok());  // reaped, as a supervisor does
  EXPECT_EQ(ShmSegmentsOf(killed), 1);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  EXPECT_EQ(ShmSegmentsOf(killed), 0) << "a starting worker sweeps dead processes' segments";
}

}  // namespace
}  // namespace lockstep
