// Checkpoint files: round trip, keep-N per job, every kind of damage detected and skipped, a
// checkpoint used only by the job that wrote it, init_from_checkpoint's explicit loading, and
// write errors that carry the system's reason.
#include "worker/train/checkpoint.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

constexpr char kJob[] = "job-3-a1b2c3";
constexpr uint64_t kSpec = 42;  // the job's training fingerprint
constexpr uint64_t kModel = 9;  // its model's shapes

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/ckpt-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  CheckpointData Make(int64_t step, const std::string& job = kJob, uint64_t spec = kSpec) {
    CheckpointData d;
    d.step = step;
    d.job_id = job;
    d.training_fingerprint = spec;
    d.model_fingerprint = kModel;
    for (int i = 0; i < 100; ++i) d.params.push_back(0.25f * i + step);
    for (int i = 0; i < 200; ++i) d.optimizer_state.push_back(-0.5f * i - step);
    return d;
  }
  std::string PathOf(int64_t step, const std::string& job = kJob) {
    return absl::StrFormat("%s/%s.step-%012d.ckpt", dir_, job, step);
  }
  absl::StatusOr<CheckpointData> Load(int64_t after, int64_t max_step = 1000,
                                      std::vector<std::string>* skipped = nullptr) {
    return LoadLatestCheckpoint(dir_, kJob, kSpec, 100, 200, after, max_step, skipped);
  }
  std::string dir_;
};

TEST_F(CheckpointTest, RoundTripKeepsTheJobsNewestN) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(10, "job-9-a1b2c3"), 1).ok());  // another job's
  for (int64_t step : {10, 20, 30, 40}) {
    absl::StatusOr<std::string> path = WriteCheckpoint(dir_, Make(step), 2);
    ASSERT_TRUE(path.ok()) << path.status();
    EXPECT_EQ(*path, PathOf(step));
  }
  EXPECT_FALSE(std::filesystem::exists(PathOf(10)));
  EXPECT_FALSE(std::filesystem::exists(PathOf(20)));
  EXPECT_TRUE(std::filesystem::exists(PathOf(30)));
  EXPECT_TRUE(std::filesystem::exists(PathOf(10, "job-9-a1b2c3")))
      << "pruning touches only the job's own checkpoints";
  auto loaded = Load(0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 40);
  EXPECT_EQ(loaded->job_id, kJob);
  EXPECT_EQ(loaded->params, Make(40).params);
  EXPECT_EQ(loaded->optimizer_state, Make(40).optimizer_state);
  // Only checkpoints newer than what the caller holds are of interest.
  EXPECT_EQ(Load(40).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, CorruptTruncatedForeignAndStaleCheckpointsAreSkipped) {
  for (int64_t step : {10, 20, 30, 40, 50}) ASSERT_TRUE(WriteCheckpoint(dir_, Make(step), 10).ok());
  {  // flip one payload byte of step 40
    std::fstream f(PathOf(40), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  std::filesystem::resize_file(PathOf(30), 200);  // torn write
  // Step 20 of this job id, but written for another spec (a restored id with other fields).
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(20, kJob, 7), 10).ok());
  // Another job's newer checkpoint, renamed to look like this job's.
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(60, "job-1-ffffff"), 10).ok());
  std::filesystem::rename(PathOf(60, "job-1-ffffff"), PathOf(60));
  std::vector<std::string> skipped;
  auto loaded = Load(0, /*max_step=*/45, &skipped);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 10);
  ASSERT_EQ(skipped.size(), 5u);
  EXPECT_NE(skipped[0].find("beyond the job's 45 steps"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find("beyond the job's 45 steps"), std::string::npos) << skipped[1];
  EXPECT_NE(skipped[2].find("checksum mismatch"), std::string::npos) << skipped[2];
  EXPECT_NE(skipped[3].find("truncated"), std::string::npos) << skipped[3];
  EXPECT_NE(skipped[4].find("another spec"), std::string::npos) << skipped[4];
  skipped.clear();
  ASSERT_TRUE(Load(0, 1000, &skipped).ok());
  EXPECT_NE(skipped[0].find("written by job job-1-ffffff"), std::string::npos) << skipped[0];
  // Wrong sizes are refused too.
  EXPECT_FALSE(LoadLatestCheckpoint(dir_, kJob, kSpec, 101, 200, 0, 1000).ok());
}

TEST_F(CheckpointTest, EmptyOrMissingDirectoryIsNotFound) {
  EXPECT_EQ(Load(0).status().code(), absl::StatusCode::kNotFound);
  std::filesystem::create_directories(dir_);
  std::ofstream(PathOf(5) + ".tmp.123.0") << "partial";  // a crashed writer's leftover
  EXPECT_EQ(Load(0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, InitFromAFileOrTheNewestMatchingCheckpointOfADirectory) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(30, "job-1-aaaaaa"), 3).ok());
  CheckpointData other_model = Make(90, "job-2-aaaaaa");
  other_model.model_fingerprint = kModel + 1;
  ASSERT_TRUE(WriteCheckpoint(dir_, other_model, 3).ok());
  auto from_dir = LoadCheckpointForInit(dir_, kModel, 100, 200);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->job_id, "job-1-aaaaaa") << "the newest checkpoint of this model";
  EXPECT_EQ(from_dir->params, Make(30).params);
  auto from_file = LoadCheckpointForInit(PathOf(30, "job-1-aaaaaa"), kModel, 100, 200);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->step, 30);
  auto wrong = LoadCheckpointForInit(PathOf(90, "job-2-aaaaaa"), kModel, 100, 200);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("another model"), std::string::npos)
      << wrong.status();
  EXPECT_EQ(LoadCheckpointForInit(dir_ + "/nothing", kModel, 100, 200).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, WriteErrorsNameTheFileAndTheSystemsReason) {
  std::filesystem::create_directories(dir_);
  std::ofstream(dir_ + "/file") << "not a directory";
  absl::StatusOr<std::string> path = WriteCheckpoint(dir_ + "/file/ckpt", Make(10), 3);
  ASSERT_FALSE(path.ok());
  EXPECT_NE(path.status().message().find(dir_ + "/file/ckpt"), std::string::npos)
      << path.status();
  EXPECT_NE(path.status().message().find("Not a directory"), std::string::npos) << path.status();
  EXPECT_EQ(WriteCheckpoint(dir_, Make(10, "../escape"), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lockstep::worker
