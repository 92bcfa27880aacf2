// Checkpoint files: round trip, keep-N, and every kind of damage detected and skipped.
#include "worker/train/checkpoint.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/ckpt-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  CheckpointData Make(int64_t step) {
    CheckpointData d;
    d.step = step;
    d.fingerprint = 42;
    for (int i = 0; i < 100; ++i) d.params.push_back(0.25f * i + step);
    for (int i = 0; i < 200; ++i) d.optimizer_state.push_back(-0.5f * i - step);
    return d;
  }
  std::string PathOf(int64_t step) { return absl::StrFormat("%s/step-%012d.ckpt", dir_, step); }
  std::string dir_;
};

TEST_F(CheckpointTest, RoundTripKeepsTheNewestN) {
  for (int64_t step : {10, 20, 30, 40}) ASSERT_TRUE(WriteCheckpoint(dir_, Make(step), 2).ok());
  EXPECT_FALSE(std::filesystem::exists(PathOf(10)));
  EXPECT_FALSE(std::filesystem::exists(PathOf(20)));
  EXPECT_TRUE(std::filesystem::exists(PathOf(30)));
  auto loaded = LoadLatestCheckpoint(dir_, 42, 100, 200, 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 40);
  EXPECT_EQ(loaded->params, Make(40).params);
  EXPECT_EQ(loaded->optimizer_state, Make(40).optimizer_state);
  // Only checkpoints newer than what the caller holds are of interest.
  EXPECT_EQ(LoadLatestCheckpoint(dir_, 42, 100, 200, 40).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, CorruptTruncatedAndForeignCheckpointsAreSkipped) {
  for (int64_t step : {10, 20, 30, 40}) ASSERT_TRUE(WriteCheckpoint(dir_, Make(step), 10).ok());
  {  // flip one payload byte of step 40
    std::fstream f(PathOf(40), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  std::filesystem::resize_file(PathOf(30), 200);  // torn write
  CheckpointData foreign = Make(20);
  foreign.fingerprint = 7;  // another model, same directory
  std::filesystem::remove(PathOf(20));
  ASSERT_TRUE(WriteCheckpoint(dir_, foreign, 10).ok());
  std::vector<std::string> skipped;
  auto loaded = LoadLatestCheckpoint(dir_, 42, 100, 200, 0, &skipped);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, 10);
  ASSERT_EQ(skipped.size(), 3u);
  EXPECT_NE(skipped[0].find("checksum mismatch"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find("truncated"), std::string::npos) << skipped[1];
  EXPECT_NE(skipped[2].find("another model"), std::string::npos) << skipped[2];
  // Wrong sizes are refused too.
  EXPECT_FALSE(LoadLatestCheckpoint(dir_, 42, 101, 200, 0).ok());
}

TEST_F(CheckpointTest, EmptyOrMissingDirectoryIsNotFound) {
  EXPECT_EQ(LoadLatestCheckpoint(dir_, 42, 100, 200, 0).status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::create_directories(dir_);
  std::ofstream(PathOf(5) + ".tmp.123") << "partial";  // a crashed writer's leftover
  EXPECT_EQ(LoadLatestCheckpoint(dir_, 42, 100, 200, 0).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lockstep::worker
