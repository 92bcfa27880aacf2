// lockstepctl against a real cluster: submit, status, list, workers, watch and cancel, their
// exit codes, JSON output, and one-line errors naming the gRPC code; the shared token; export of
// a checkpoint the cluster wrote.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::CommandResult;
using testing::RunCommand;

constexpr char kShortJob[] = R"json({
  "name": "cli-short",
  "model": {"type": "mlp", "hiddenWidths": [32]},
  "dataset": {"type": "synthetic",
              "synthetic": {"trainSamples": 4096, "testSamples": 512, "inputDim": 16,
                            "numClasses": 3, "seed": 1}},
  "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
  "globalBatchSize": 64,
  "maxSteps": 150,
  "minWorkers": 2,
  "maxWorkers": 2
})json";

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = Cluster::Start();
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ASSERT_TRUE(cluster_->StartWorkers(2).ok());
  }
  CommandResult Ctl(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(60)) {
    std::vector<std::string> argv = {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster_->address()};
    argv.insert(argv.end(), args.begin(), args.end());
    auto result = RunCommand(argv, timeout);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.value_or(CommandResult{});
  }
  std::string WriteSpec(const std::string& name, const std::string& text) {
    const std::string path = absl::StrCat(cluster_->dir(), "/", name);
    std::ofstream(path) << text;
    return path;
  }
  static std::string JobIdFrom(const std::string& output) {
    // `submit` prints the job id on a line of its own, e.g. "job-1".
    size_t pos = output.find("job-");
    if (pos == std::string::npos) return "";
    size_t end = output.find_first_of(" \n\t", pos);
    return output.substr(pos, end - pos);
  }
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(CliTest, SubmitStatusWatchListAndWorkers) {
  const std::string spec = WriteSpec("job.json", kShortJob);
  CommandResult submit = Ctl({"submit", spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::string id = JobIdFrom(submit.output);
  ASSERT_FALSE(id.empty()) << submit.output;

  CommandResult watch = Ctl({"watch", id}, absl::Seconds(180));
  EXPECT_EQ(watch.exit_code, 0) << watch.output;
  EXPECT_TRUE(absl::StrContains(watch.output, "SUCCEEDED")) << watch.output;
  EXPECT_TRUE(absl::StrContains(watch.output, "test accuracy")) << watch.output;
  EXPECT_TRUE(absl::StrContains(watch.output, "generation 1 formed")) << watch.output;

  CommandResult status = Ctl({"status", id, "--output=json"});
  ASSERT_EQ(status.exit_code, 0) << status.output;
  v1::Job job;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(status.output, &job).ok())
      << status.output;
  EXPECT_EQ(job.job_id(), id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.step(), 150);
  ASSERT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.members(0).parameter_checksum(), job.members(1).parameter_checksum());

  CommandResult table = Ctl({"status", id});
  EXPECT_EQ(table.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(table.output, "SUCCEEDED")) << table.output;

  CommandResult list = Ctl({"list", "--output=json"});
  ASSERT_EQ(list.exit_code, 0) << list.output;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(list.output, &jobs).ok()) << list.output;
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).job_id(), id);
  EXPECT_TRUE(absl::StrContains(Ctl({"list"}).output, id));

  CommandResult workers = Ctl({"workers", "--output=json"});
  ASSERT_EQ(workers.exit_code, 0) << workers.output;
  v1::ListWorkersResponse listed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(workers.output, &listed).ok());
  EXPECT_EQ(listed.workers_size(), 2);
  CommandResult workers_table = Ctl({"workers"});
  EXPECT_TRUE(absl::StrContains(workers_table.output, "w0")) << workers_table.output;
  EXPECT_TRUE(absl::StrContains(workers_table.output, "idle")) << workers_table.output;
}

TEST_F(CliTest, CancelEndsARunningJobAndWatchExitsNonZero) {
  std::string long_job = kShortJob;
  long_job.replace(long_job.find("\"maxSteps\": 150"), 15, "\"maxSteps\": 900000");
  CommandResult submit = Ctl({"submit", WriteSpec("long.json", long_job)});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::string id = JobIdFrom(submit.output);
  auto running = cluster_->WaitFor(
      id, [](const v1::Job& j) { return j.step() > 5; }, absl::Seconds(60));
  ASSERT_TRUE(running.ok()) << running.status();
  CommandResult cancel = Ctl({"cancel", id});
  EXPECT_EQ(cancel.exit_code, 0) << cancel.output;
  auto job = cluster_->Get(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_CANCELLED);
  CommandResult watch = Ctl({"watch", id});
  EXPECT_EQ(watch.exit_code, 1) << watch.output;
  EXPECT_TRUE(absl::StrContains(watch.output, "CANCELLED")) << watch.output;
  CommandResult again = Ctl({"cancel", id});
  EXPECT_EQ(again.exit_code, 3) << again.output;
  EXPECT_TRUE(absl::StrContains(again.output, "FAILED_PRECONDITION")) << again.output;
  // Both workers are free again.
  auto workers = cluster_->Workers();
  ASSERT_TRUE(workers.ok());
  auto idle = cluster_->WaitFor(
      id,
      [&](const v1::Job&) {
        auto w = cluster_->Workers();
        return w.ok() && w->size() == 2 && (*w)[0].state() == "idle" && (*w)[1].state() == "idle";
      },
      absl::Seconds(10));
  EXPECT_TRUE(idle.ok()) << idle.status();
}

TEST_F(CliTest, ErrorsAreOneLineWithTheCode) {
  CommandResult missing = Ctl({"status", "job-404"});
  EXPECT_EQ(missing.exit_code, 3);
  EXPECT_TRUE(absl::StrContains(missing.output, "NOT_FOUND")) << missing.output;

  std::string bad = kShortJob;
  bad.replace(bad.find("\"globalBatchSize\": 64"), 21, "\"globalBatchSize\": -8");
  CommandResult invalid = Ctl({"submit", WriteSpec("bad.json", bad)});
  EXPECT_EQ(invalid.exit_code, 3) << invalid.output;
  EXPECT_TRUE(absl::StrContains(invalid.output, "INVALID_ARGUMENT")) << invalid.output;
  EXPECT_TRUE(absl::StrContains(invalid.output, "global_batch_size")) << invalid.output;

  CommandResult malformed = Ctl({"submit", WriteSpec("broken.json", "{ not json")});
  EXPECT_EQ(malformed.exit_code, 2) << malformed.output;
  EXPECT_TRUE(absl::StrContains(malformed.output, "broken.json")) << malformed.output;

  CommandResult unknown = Ctl({"frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;

  auto unreachable =
      RunCommand({LOCKSTEP_CTL_BIN, "--coordinator=127.0.0.1:1", "--timeout_ms=2000", "list"},
                 absl::Seconds(30));
  ASSERT_TRUE(unreachable.ok());
  EXPECT_EQ(unreachable->exit_code, 3) << unreachable->output;
  EXPECT_TRUE(absl::StrContains(unreachable->output, "UNAVAILABLE") ||
              absl::StrContains(unreachable->output, "DEADLINE_EXCEEDED"))
      << unreachable->output;
}

// export through the real binary: a checkpoint a job wrote becomes model.safetensors and
// config.json; a second export refuses to replace them until --force; a crafted 200-byte file
// that announces 2^34 parameters is refused with exit 4 and DATA_LOSS, not a crash.
TEST_F(CliTest, ExportConvertsACheckpointAndReplacesFilesOnlyWithForce) {
  v1::JobSpec spec = testing::SyntheticJob(2, 2, 40);
  spec.set_checkpoint_dir(cluster_->dir() + "/ckpt");
  spec.set_checkpoint_every_steps(20);
  absl::StatusOr<v1::Job> job = cluster_->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<v1::Job> ended = cluster_->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << ended.status();
  ASSERT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason();
  std::string checkpoint;
  for (const auto& entry : std::filesystem::directory_iterator(cluster_->dir() + "/ckpt")) {
    if (absl::EndsWith(entry.path().string(), ".ckpt")) checkpoint = entry.path().string();
  }
  ASSERT_FALSE(checkpoint.empty());
  const std::string model = cluster_->dir() + "/export/model.safetensors";

  CommandResult first = Ctl({"export", checkpoint, "-o", model});
  EXPECT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(absl::StrContains(first.output, "wrote " + model)) << first.output;
  ASSERT_TRUE(std::filesystem::exists(model));
  const auto written = std::filesystem::last_write_time(model);

  CommandResult again = Ctl({"export", checkpoint, "-o", model});
  EXPECT_EQ(again.exit_code, 4) << again.output;
  EXPECT_TRUE(absl::StrContains(again.output, "ALREADY_EXISTS")) << again.output;
  EXPECT_TRUE(absl::StrContains(again.output, "--force")) << again.output;
  EXPECT_EQ(std::filesystem::last_write_time(model), written);

  CommandResult forced = Ctl({"export", checkpoint, "-o", model, "--force"});
  EXPECT_EQ(forced.exit_code, 0) << forced.output;

  std::string crafted(200, '\0');
  std::memcpy(crafted.data(), "LSCKPT3", 8);
  const uint64_t huge = uint64_t{1} << 34;
  std::memcpy(crafted.data() + 96, &huge, sizeof(huge));  // the header's parameter count
  const std::string crafted_path = cluster_->dir() + "/crafted.ckpt";
  std::ofstream(crafted_path, std::ios::binary) << crafted;
  CommandResult refused = Ctl({"export", crafted_path, "-o", cluster_->dir() + "/c.safetensors"});
  EXPECT_EQ(refused.exit_code, 4) << refused.output;
  EXPECT_TRUE(absl::StrContains(refused.output, "DATA_LOSS: " + crafted_path)) << refused.output;

  CommandResult misplaced = Ctl({"list", "--force"});
  EXPECT_EQ(misplaced.exit_code, 2) << misplaced.output;
}

// A coordinator with a token: workers and lockstepctl without it, or with a wrong one, are turned
// away with UNAUTHENTICATED; a rejected worker exits (code 3) and says why in its status file;
// the coordinator lists who it rejected; the health check needs no token; jobs still run.
TEST(AuthTest, TokenIsRequiredAndRejectionsAreVisible) {
  auto started = Cluster::Start({}, "correct-horse");
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  ASSERT_TRUE(cluster.StartWorkers(2).ok()) << cluster.Logs();

  const std::string bad_token = cluster.dir() + "/bad-token";
  std::ofstream(bad_token) << "battery-staple\n";
  const std::string status_file = cluster.dir() + "/intruder.status";
  auto intruder =
      RunCommand({LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster.address(), "--name=intruder",
                  "--token_file=" + bad_token, "--status_file=" + status_file},
                 absl::Seconds(30));
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  EXPECT_EQ(intruder->exit_code, 3) << intruder->output;
  EXPECT_TRUE(absl::StrContains(intruder->output, "wrong token")) << intruder->output;
  std::ifstream status_in(status_file);
  std::string status_line;
  std::getline(status_in, status_line);
  EXPECT_TRUE(absl::StartsWith(status_line, "rejected ")) << status_line;

  const std::vector<std::string> ctl = {LOCKSTEP_CTL_BIN, "--coordinator=" + cluster.address()};
  auto run_ctl = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = ctl;
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, absl::Seconds(30)).value_or(CommandResult{});
  };
  CommandResult anonymous = run_ctl({"list"});
  EXPECT_EQ(anonymous.exit_code, 3) << anonymous.output;
  EXPECT_TRUE(absl::StrContains(anonymous.output, "UNAUTHENTICATED: missing token"))
      << anonymous.output;
  CommandResult health = run_ctl({"health"});
  EXPECT_EQ(health.exit_code, 0) << health.output;
  EXPECT_TRUE(absl::StrContains(health.output, "SERVING")) << health.output;

  CommandResult workers = run_ctl({"--token_file=" + cluster.token_file(), "workers"});
  EXPECT_EQ(workers.exit_code, 0) << workers.output;
  EXPECT_TRUE(absl::StrContains(workers.output, "Rejected clients")) << workers.output;
  EXPECT_TRUE(absl::StrContains(workers.output, "lockstep-worker intruder")) << workers.output;
  EXPECT_TRUE(absl::StrContains(workers.output, "wrong token")) << workers.output;
  EXPECT_TRUE(absl::StrContains(workers.output, "lockstepctl")) << workers.output;

  auto job = cluster.Submit(testing::SyntheticJob(2, 2, 40));
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = cluster.WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster.Logs();
}

// A worker that cannot reach its coordinator gives up after --give_up_after with exit code 4
// and the address in its last log line, instead of retrying silently forever.
TEST(AuthTest, UnreachableCoordinatorEndsTheWorkerWhenAsked) {
  const std::string status_file = ::testing::TempDir() + "/unreachable.status";
  auto worker = RunCommand({LOCKSTEP_WORKER_BIN, "--coordinator=127.0.0.1:1", "--name=lonely",
                            "--give_up_after=1s", "--status_file=" + status_file},
                           absl::Seconds(30));
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->exit_code, 4) << worker->output;
  EXPECT_TRUE(absl::StrContains(worker->output, "no session with coordinator 127.0.0.1:1"))
      << worker->output;
  std::ifstream status_in(status_file);
  std::string status_line;
  std::getline(status_in, status_line);
  EXPECT_TRUE(absl::StartsWith(status_line, "unreachable ")) << status_line;
}

}  // namespace
}  // namespace lockstep
