// Program jobs' saves on disk (worker/program/checkpoint_disk.h): written whole and named after
// the job, step and rank; listed only when sound; pruned to the newest steps per rank; read
// back into a worker's slots checked end to end, a corrupted file refused and renamed; files
// of steps after an agreed one removed.
#include "worker/program/checkpoint_disk.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

class CheckpointDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/lockstep-ckptdisk-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    root_ = dir;
    disk_ = root_ + "/disk";
    std::filesystem::create_directories(disk_);
    auto memory = CheckpointMemory::Create(root_, "w0", 1 << 20, static_cast<uid_t>(-1),
                                           static_cast<gid_t>(-1));
    ASSERT_TRUE(memory.ok()) << memory.status();
    memory_ = *std::move(memory);
    auto slots = memory_->Slots("job-1", 8192);
    ASSERT_TRUE(slots.ok()) << slots.status();
    slots_ = *slots;
  }
  void TearDown() override {
    memory_.reset();
    std::filesystem::remove_all(root_);
  }
  // Commits `payload` as the save of `step` through a SlotWriter, as the program would.
  HeldCheckpoint Save(int64_t step, const std::string& payload) {
    auto writer = SlotWriter::Begin(slots_, step, payload.size(),
                                    XXH3_64bits(payload.data(), payload.size()));
    EXPECT_TRUE(writer.ok()) << writer.status();
    EXPECT_TRUE((*writer)->Append(payload.data(), payload.size()).ok());
    auto held = (*writer)->Commit();
    EXPECT_TRUE(held.ok()) << held.status();
    return *held;
  }
  std::string root_, disk_;
  std::unique_ptr<CheckpointMemory> memory_;
  std::vector<std::string> slots_;
};

TEST_F(CheckpointDiskTest, SavesArePersistedPrunedAndReadBackChecked) {
  for (int64_t step : {5, 10, 15, 20}) {
    auto path = PersistCheckpoint(Save(step, absl::StrCat("state of step ", step)), disk_,
                                  "job-1", 1, /*keep=*/2);
    ASSERT_TRUE(path.ok()) << path.status();
    EXPECT_EQ(*path, DiskCheckpointPath(disk_, "job-1", step, 1));
  }
  // Another job's file in the same directory, and debris: never listed, never pruned.
  std::ofstream(disk_ + "/job-2.step-99.rank-0.lsckpt") << "not ours";
  std::ofstream(disk_ + "/job-1.step-30.rank-0.lsckpt.tmp.1.0") << "a write in progress";
  std::vector<DiskCheckpoint> files = ListDiskCheckpoints(disk_, "job-1");
  ASSERT_EQ(files.size(), 2u) << "the newest 2 steps are kept";
  EXPECT_EQ(files[0].step, 20);
  EXPECT_EQ(files[0].rank, 1);
  EXPECT_EQ(files[1].step, 15);
  EXPECT_TRUE(std::filesystem::exists(disk_ + "/job-2.step-99.rank-0.lsckpt"));

  // A worker whose memory is new reads step 20 into its own slots.
  auto fresh = CheckpointMemory::Create(root_, "w1", 1 << 20, static_cast<uid_t>(-1),
                                        static_cast<gid_t>(-1));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto restored = RestoreFromDisk(fresh->get(), "job-1", files[0]);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step, 20);
  auto held = (*fresh)->Held("job-1");
  ASSERT_EQ(held.size(), 1u);
  std::string back;
  ASSERT_TRUE(ReadCheckpointPayload(held[0], 4, [&](const void* d, size_t n) {
                back.append(static_cast<const char*>(d), n);
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(back, "state of step 20");

  // A file corrupted on disk: refused by its checksum, renamed, never listed again.
  {
    std::fstream f(files[1].path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(kCheckpointSlotHeaderBytes + 2);
    f.put('X');
  }
  auto refused = RestoreFromDisk(fresh->get(), "job-1", files[1]);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "step 15")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "does not match its checksum"))
      << refused.status();
  EXPECT_TRUE(std::filesystem::exists(files[1].path + ".refused"));
  EXPECT_EQ(ListDiskCheckpoints(disk_, "job-1").size(), 1u);
  EXPECT_EQ((*fresh)->Held("job-1")[0].step, 20) << "the refused copy committed nothing";

  // A truncated file (a disk that lost its tail) is not listed.
  std::filesystem::resize_file(files[0].path, kCheckpointSlotHeaderBytes + 3);
  EXPECT_TRUE(ListDiskCheckpoints(disk_, "job-1").empty());
}

TEST_F(CheckpointDiskTest, FilesAfterTheAgreedStepAreRemoved) {
  for (int64_t step : {4, 8}) {
    for (int rank : {0, 1}) {
      ASSERT_TRUE(PersistCheckpoint(Save(step, "s"), disk_, "job-1", rank, 10).ok());
    }
  }
  DiscardDiskAfter(disk_, "job-1", 4);
  std::vector<DiskCheckpoint> files = ListDiskCheckpoints(disk_, "job-1");
  ASSERT_EQ(files.size(), 2u);
  for (const DiskCheckpoint& f : files) EXPECT_EQ(f.step, 4);
  auto missing = PersistCheckpoint(Save(9, "s"), root_ + "/no/such/dir", "job-1", 0, 3);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
}

}  // namespace
}  // namespace lockstep::worker
