// The worker's memory for programs' checkpoints (worker/program/checkpoint_memory.h): two slots
// per job within the bound, only committed saves whose checksum matches are held (a torn or
// corrupted one never), newest first; saves after a step can be discarded; one job's slots go
// when another job's are made, and all of them with the memory. Copies of peers' saves are kept
// per source within the same bound, written by a SlotWriter that commits only a matching copy.
#include "worker/program/checkpoint_memory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

// What lockstep.torch.Checkpointer writes: the payload, then the header, the sequence last.
void WriteSave(const std::string& path, uint64_t sequence, int64_t step,
               const std::string& payload, bool corrupt = false) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(pwrite(fd, payload.data(), payload.size(), kCheckpointSlotHeaderBytes),
            static_cast<ssize_t>(payload.size()));
  uint64_t header[5];
  std::memcpy(&header[0], kCheckpointSlotMagic, 8);
  header[1] = sequence;
  header[2] = static_cast<uint64_t>(step);
  header[3] = payload.size();
  header[4] = XXH3_64bits(payload.data(), payload.size()) ^ (corrupt ? 1 : 0);
  ASSERT_EQ(pwrite(fd, header, sizeof(header), 0), static_cast<ssize_t>(sizeof(header)));
  close(fd);
}

class CheckpointMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/lockstep-ckptmem-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    root_ = dir;
    auto memory = CheckpointMemory::Create(root_, "w/0", 1 << 20, static_cast<uid_t>(-1),
                                           static_cast<gid_t>(-1));
    ASSERT_TRUE(memory.ok()) << memory.status();
    memory_ = *std::move(memory);
  }
  void TearDown() override {
    memory_.reset();
    std::filesystem::remove_all(root_);
  }
  std::string root_;
  std::unique_ptr<CheckpointMemory> memory_;
};

TEST_F(CheckpointMemoryTest, SlotsAreTwoPrivateFilesThatGrowWithinTheBound) {
  auto slots = memory_->Slots("job-1", 100000);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_EQ(slots->size(), 2u);
  for (const std::string& path : *slots) {
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_size, 100000);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
    EXPECT_TRUE(absl::StartsWith(path, memory_->dir() + "/")) << path;
  }
  struct stat dir;
  ASSERT_EQ(stat(memory_->dir().c_str(), &dir), 0);
  EXPECT_EQ(dir.st_mode & 0777, 0711u) << "others may not list the slots' names";
  // The same slots, grown; never shrunk.
  auto grown = memory_->Slots("job-1", 200000);
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_EQ(*grown, *slots);
  EXPECT_EQ(memory_->slot_bytes("job-1"), 200000);
  EXPECT_EQ(memory_->Slots("job-1", 10)->size(), 2u);
  EXPECT_EQ(memory_->slot_bytes("job-1"), 200000);
  EXPECT_EQ(memory_->used_bytes(), 400000);
  // Two saves of 600,000 bytes exceed the bound of 1 MiB: refused, with the numbers.
  auto too_big = memory_->Slots("job-1", 600000);
  ASSERT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(too_big.status().message(), "600000 bytes")) << too_big.status();
  EXPECT_TRUE(absl::StrContains(too_big.status().message(),
                                "--checkpoint_memory_bytes is 1048576 bytes"))
      << too_big.status();
  EXPECT_EQ(memory_->slot_bytes("job-1"), 200000);
}

TEST_F(CheckpointMemoryTest, OnlyCommittedSavesThatMatchTheirChecksumAreHeldNewestFirst) {
  auto slots = memory_->Slots("job-1", 8192);
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_TRUE(memory_->Held("job-1").empty()) << "fresh slots hold nothing";
  WriteSave((*slots)[0], 1, 10, "state of step 10");
  WriteSave((*slots)[1], 2, 11, "state of step 11");
  auto held = memory_->Held("job-1");
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].step, 11);
  EXPECT_EQ(held[0].path, (*slots)[1]);
  EXPECT_EQ(held[0].payload_bytes, 16u);
  EXPECT_EQ(held[1].step, 10);
  // A save in progress (sequence 0): the other slot is what is held.
  WriteSave((*slots)[0], 0, 12, "half of step 12");
  held = memory_->Held("job-1");
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 11);
  // A committed save whose bytes do not match its checksum: never held, and said so.
  WriteSave((*slots)[0], 3, 12, "state of step 12", /*corrupt=*/true);
  held = memory_->Held("job-1");
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 11);
  auto verified = VerifyCheckpointSlot((*slots)[0], 0);
  EXPECT_EQ(verified.status().code(), absl::StatusCode::kDataLoss) << verified.status();
  EXPECT_TRUE(absl::StrContains(verified.status().message(), "step 12")) << verified.status();
  // A header that claims more than its slot holds.
  WriteSave((*slots)[0], 3, 12, "state of step 12");
  const int fd = open((*slots)[0].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const uint64_t claimed = 8192;
  ASSERT_EQ(pwrite(fd, &claimed, sizeof(claimed), 24), static_cast<ssize_t>(sizeof(claimed)));
  close(fd);
  verified = VerifyCheckpointSlot((*slots)[0], 0);
  EXPECT_EQ(verified.status().code(), absl::StatusCode::kDataLoss) << verified.status();
  // A length that wraps around when the header's size is added: refused, not read.
  const int fd2 = open((*slots)[0].c_str(), O_RDWR);
  ASSERT_GE(fd2, 0);
  const uint64_t wrapping = ~uint64_t{0} - 4096 + 100;
  ASSERT_EQ(pwrite(fd2, &wrapping, sizeof(wrapping), 24), static_cast<ssize_t>(sizeof(wrapping)));
  close(fd2);
  verified = VerifyCheckpointSlot((*slots)[0], 0);
  EXPECT_EQ(verified.status().code(), absl::StatusCode::kDataLoss) << verified.status();
}

TEST_F(CheckpointMemoryTest, AKilledWorkersDirectoryIsRemovedByItsNextStartALiveOnesNever) {
  // A directory left by an earlier run of worker w/0 (nobody holds its lock), and the live one.
  const std::string stale = root_ + "/lockstep-checkpoints-w_0-abcdef";
  std::filesystem::create_directories(stale);
  std::ofstream(stale + "/slot") << "old state";
  const std::string live = memory_->dir();
  auto again = CheckpointMemory::Create(root_, "w/0", 1 << 20, static_cast<uid_t>(-1),
                                        static_cast<gid_t>(-1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live worker's directory was removed";
  EXPECT_NE((*again)->dir(), live);
}

TEST_F(CheckpointMemoryTest, SavesAfterAStepAreDiscarded) {
  auto slots = memory_->Slots("job-1", 8192);
  ASSERT_TRUE(slots.ok()) << slots.status();
  WriteSave((*slots)[0], 1, 10, "state of step 10");
  WriteSave((*slots)[1], 2, 11, "state of step 11");
  memory_->DiscardAfter("job-1", 10);
  auto held = memory_->Held("job-1");
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 10);
  memory_->DiscardAfter("job-1", std::numeric_limits<int64_t>::min());
  EXPECT_TRUE(memory_->Held("job-1").empty());
}

TEST_F(CheckpointMemoryTest, AnotherJobsSlotsReplaceAJobsAndEverythingGoesWithTheMemory) {
  auto first = memory_->Slots("job-1", 8192);
  ASSERT_TRUE(first.ok()) << first.status();
  WriteSave((*first)[0], 1, 10, "job 1's state");
  auto second = memory_->Slots("job-2", 8192);
  ASSERT_TRUE(second.ok()) << second.status();
  for (const std::string& path : *first) {
    EXPECT_FALSE(std::filesystem::exists(path)) << "job-1's slot outlived it: " << path;
    EXPECT_EQ(std::find(second->begin(), second->end(), path), second->end());
  }
  EXPECT_TRUE(memory_->Held("job-1").empty());
  EXPECT_TRUE(memory_->Held("job-2").empty());
  memory_->DropAllBut("job-3");
  EXPECT_EQ(memory_->used_bytes(), 0);
  for (const std::string& path : *second) EXPECT_FALSE(std::filesystem::exists(path)) << path;
  const std::string dir = memory_->dir();
  ASSERT_TRUE(memory_->Slots("job-3", 8192).ok());
  memory_.reset();
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST_F(CheckpointMemoryTest, CopiesOfPeersSavesAreKeptPerSourceWithinTheBoundAndOwnSavesComeFirst) {
  // 1 MiB in all: two copies of each of two sources at 128 KiB, and the job's own two slots.
  auto w1 = memory_->ReplicaSlots("job-1", "w1", 128 << 10);
  ASSERT_TRUE(w1.ok()) << w1.status();
  auto w2 = memory_->ReplicaSlots("job-1", "w2", 128 << 10);
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_NE((*w1)[0], (*w2)[0]);
  WriteSave((*w1)[0], 1, 7, "w1's step 7");
  WriteSave((*w2)[1], 4, 9, "w2's step 9");
  EXPECT_EQ(memory_->Held("job-1", "w1")[0].step, 7);
  EXPECT_EQ(memory_->Held("job-1", "w2")[0].step, 9);
  EXPECT_TRUE(memory_->Held("job-1").empty()) << "copies are not the job's own saves";
  std::vector<std::string> sources = memory_->ReplicaSources("job-1");
  std::sort(sources.begin(), sources.end());
  EXPECT_EQ(sources, (std::vector<std::string>{"w1", "w2"}));
  EXPECT_EQ(memory_->used_bytes(), 4 * (128 << 10));
  // A third source does not fit beside them: refused with the numbers, the others kept.
  auto w3 = memory_->ReplicaSlots("job-1", "w3", 300 << 10);
  EXPECT_EQ(w3.status().code(), absl::StatusCode::kResourceExhausted) << w3.status();
  EXPECT_TRUE(absl::StrContains(w3.status().message(), "w3")) << w3.status();
  EXPECT_TRUE(absl::StrContains(w3.status().message(), "--checkpoint_memory_bytes is 1048576"))
      << w3.status();
  EXPECT_EQ(memory_->ReplicaSources("job-1").size(), 2u);
  // Saves after the agreed step go, the copies' too.
  memory_->DiscardAfter("job-1", 8);
  EXPECT_EQ(memory_->Held("job-1", "w1").size(), 1u);
  EXPECT_TRUE(memory_->Held("job-1", "w2").empty());
  // The job's own saves need the room: the copies make it.
  auto own = memory_->Slots("job-1", 400 << 10);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_TRUE(memory_->ReplicaSources("job-1").empty());
  EXPECT_LE(memory_->used_bytes(), memory_->limit_bytes());
  // Another job's copies replace this job's slots, as its own saves do.
  ASSERT_TRUE(memory_->ReplicaSlots("job-2", "w1", 8192).ok());
  EXPECT_EQ(memory_->slot_bytes("job-1"), 0);
}

TEST_F(CheckpointMemoryTest, ASlotWriterCommitsOnlyACompleteMatchingCopyIntoTheOlderSlot) {
  auto pair = memory_->ReplicaSlots("job-1", "w1", 8192);
  ASSERT_TRUE(pair.ok()) << pair.status();
  WriteSave((*pair)[0], 5, 10, "state of step 10");
  WriteSave((*pair)[1], 6, 11, "state of step 11");
  const std::string payload = "state of step 12, copied";
  const uint64_t checksum = XXH3_64bits(payload.data(), payload.size());
  {
    // Destroyed before its commit: the slot it wrote is not committed, the other is held.
    auto writer = SlotWriter::Begin(*pair, 12, payload.size(), checksum);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(payload.data(), 10).ok());
  }
  auto held = memory_->Held("job-1", "w1");
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 11);
  {
    // Bytes that do not match the checksum: refused, naming the step.
    auto writer = SlotWriter::Begin(*pair, 12, payload.size(), checksum ^ 1);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(payload.data(), payload.size()).ok());
    auto committed = (*writer)->Commit();
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kDataLoss) << committed.status();
    EXPECT_TRUE(absl::StrContains(committed.status().message(), "step 12"));
    // More than the header said: refused.
    EXPECT_EQ((*writer)->Append("x", 1).code(), absl::StatusCode::kDataLoss);
  }
  {
    // Short: refused.
    auto writer = SlotWriter::Begin(*pair, 12, payload.size(), checksum);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Append(payload.data(), payload.size() - 1).ok());
    EXPECT_EQ((*writer)->Commit().status().code(), absl::StatusCode::kDataLoss);
  }
  auto writer = SlotWriter::Begin(*pair, 12, payload.size(), checksum);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Append(payload.data(), 7).ok());
  ASSERT_TRUE((*writer)->Append(payload.data() + 7, payload.size() - 7).ok());
  auto committed = (*writer)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  held = memory_->Held("job-1", "w1");
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].step, 12);
  EXPECT_GT(held[0].sequence, 6u) << "the newest sequence of the pair";
  EXPECT_EQ(held[1].step, 11) << "the previous save stays";
  // Read back whole, in chunks, checked.
  std::string read;
  ASSERT_TRUE(ReadCheckpointPayload(held[0], 5, [&](const void* d, size_t n) {
                read.append(static_cast<const char*>(d), n);
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(read, payload);
  // A save overwritten while it is read: the reader stops with DATA_LOSS.
  int chunks = 0;
  const absl::Status torn = ReadCheckpointPayload(held[0], 5, [&](const void*, size_t) {
    if (++chunks == 2) WriteSave(held[0].path, 0, 13, "someone else's bytes....");
    return absl::OkStatus();
  });
  EXPECT_EQ(torn.code(), absl::StatusCode::kDataLoss) << torn;
}

}  // namespace
}  // namespace lockstep::worker
