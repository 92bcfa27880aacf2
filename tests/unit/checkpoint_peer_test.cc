// Copies of program jobs' checkpoints between workers (worker/program/checkpoint_peer.h), over
// real gRPC on loopback: a member's newest save reaches its peer whole and checked; a member
// that lost its memory fetches it back into its own slots; a copy corrupted at the holder, a
// wrong secret, or a job the holder does not serve are refused with their reasons.
#include "worker/program/checkpoint_peer.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

// A committed save as lockstep.torch.Checkpointer leaves it (sequence last).
void WriteSave(const std::string& path, uint64_t sequence, int64_t step,
               const std::string& payload) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(pwrite(fd, payload.data(), payload.size(), kCheckpointSlotHeaderBytes),
            static_cast<ssize_t>(payload.size()));
  uint64_t header[5];
  std::memcpy(&header[0], kCheckpointSlotMagic, 8);
  header[1] = sequence;
  header[2] = static_cast<uint64_t>(step);
  header[3] = payload.size();
  header[4] = XXH3_64bits(payload.data(), payload.size());
  ASSERT_EQ(pwrite(fd, header, sizeof(header), 0), static_cast<ssize_t>(sizeof(header)));
  close(fd);
}

std::string Payload(const HeldCheckpoint& held) {
  std::string out;
  EXPECT_TRUE(ReadCheckpointPayload(held, 1 << 16, [&](const void* d, size_t n) {
                out.append(static_cast<const char*>(d), n);
                return absl::OkStatus();
              }).ok());
  return out;
}

class CheckpointPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/lockstep-ckptpeer-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    root_ = dir;
    for (const char* name : {"w0", "w1"}) {
      auto memory = CheckpointMemory::Create(root_, name, 64 << 20, static_cast<uid_t>(-1),
                                             static_cast<gid_t>(-1));
      ASSERT_TRUE(memory.ok()) << memory.status();
      auto server = CheckpointPeerServer::Start("127.0.0.1", memory->get());
      ASSERT_TRUE(server.ok()) << server.status();
      memories_.push_back(*std::move(memory));
      servers_.push_back(*std::move(server));
    }
  }
  void TearDown() override {
    servers_.clear();
    memories_.clear();
    std::filesystem::remove_all(root_);
  }
  std::string root_;
  std::vector<std::unique_ptr<CheckpointMemory>> memories_;
  std::vector<std::unique_ptr<CheckpointPeerServer>> servers_;
};

TEST_F(CheckpointPeerTest, TheNewestSaveIsCopiedToThePeerAndFetchedBackAfterTheMemoryIsLost) {
  // w1's saves go to w0, under the generation's secret.
  auto w0_serves = servers_[0]->Serve("job-1", "secret-g2");
  auto w1_serves = servers_[1]->Serve("job-1", "secret-g2");
  auto slots = memories_[1]->Slots("job-1", kCheckpointSlotHeaderBytes + (3 << 20));
  ASSERT_TRUE(slots.ok()) << slots.status();
  std::string big(3 << 20, '\0');  // three chunks and a bit: the stream's chunking is exercised
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + i / 4096);
  big += "tail";
  slots = memories_[1]->Slots("job-1", kCheckpointSlotHeaderBytes + big.size());
  ASSERT_TRUE(slots.ok()) << slots.status();
  WriteSave((*slots)[0], 1, 5, "w1's step 5");
  {
    CheckpointReplicator copies(memories_[1].get(), "job-1", "w1", "w0",
                                servers_[0]->address(), "secret-g2", absl::ZeroDuration());
    copies.Wake();
    ASSERT_TRUE(copies.WaitCopied(5, absl::Seconds(30)));
    WriteSave((*slots)[1], 2, 6, big);
    copies.Wake();
    ASSERT_TRUE(copies.WaitCopied(6, absl::Seconds(30)));
    EXPECT_EQ(copies.stats().failed, 0);
    EXPECT_EQ(copies.stats().last_step, 6);
  }
  auto kept = memories_[0]->Held("job-1", "w1");
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept[0].step, 6);
  EXPECT_EQ(Payload(kept[0]), big);
  EXPECT_EQ(kept[1].step, 5);
  EXPECT_TRUE(memories_[0]->Held("job-1").empty()) << "a copy is not w0's own save";

  // w1's worker restarts: its memory is new and empty. It fetches step 6 into its own slots.
  w1_serves.reset();
  servers_[1].reset();
  memories_[1].reset();
  auto fresh = CheckpointMemory::Create(root_, "w1", 64 << 20, static_cast<uid_t>(-1),
                                        static_cast<gid_t>(-1));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto fetched = FetchCheckpoint(fresh->get(), servers_[0]->address(), "w0", "secret-g2",
                                 "job-1", "w1", 6);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->step, 6);
  auto own = (*fresh)->Held("job-1");
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].path, fetched->path);
  EXPECT_EQ(Payload(own[0]), big);
}

TEST_F(CheckpointPeerTest, ACorruptedCopyAWrongSecretAndAnUnservedJobAreRefused) {
  auto serves = servers_[0]->Serve("job-1", "right");
  auto pair = memories_[0]->ReplicaSlots("job-1", "w1", 8192);
  ASSERT_TRUE(pair.ok()) << pair.status();
  WriteSave((*pair)[0], 1, 9, "w1's step 9, as kept by w0");
  // The kept copy's bytes change at the holder (a bad page, a stray write).
  {
    const int fd = open((*pair)[0].c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pwrite(fd, "X", 1, kCheckpointSlotHeaderBytes + 3), 1);
    close(fd);
  }
  EXPECT_TRUE(memories_[0]->Held("job-1", "w1").empty()) << "a corrupted copy is never offered";
  auto fetched = FetchCheckpoint(memories_[1].get(), servers_[0]->address(), "w0", "right",
                                 "job-1", "w1", 9);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kDataLoss) << fetched.status();
  EXPECT_TRUE(absl::StrContains(fetched.status().message(), "from w0")) << fetched.status();
  EXPECT_TRUE(memories_[1]->Held("job-1").empty()) << "nothing half-fetched is committed";

  auto wrong = FetchCheckpoint(memories_[1].get(), servers_[0]->address(), "w0", "wrong",
                               "job-1", "w1", 9);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied) << wrong.status();
  auto missing = FetchCheckpoint(memories_[1].get(), servers_[0]->address(), "w0", "right",
                                 "job-1", "w1", 10);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  serves.reset();
  auto unserved = FetchCheckpoint(memories_[1].get(), servers_[0]->address(), "w0", "right",
                                  "job-1", "w1", 9);
  EXPECT_EQ(unserved.status().code(), absl::StatusCode::kFailedPrecondition)
      << unserved.status();

  // A copy sent under a wrong secret is not kept.
  auto w1_slots = memories_[1]->Slots("job-2", 8192);
  ASSERT_TRUE(w1_slots.ok());
  WriteSave((*w1_slots)[0], 1, 3, "w1's step 3 of job 2");
  auto job2 = servers_[0]->Serve("job-2", "job-2's");
  CheckpointReplicator copies(memories_[1].get(), "job-2", "w1", "w0", servers_[0]->address(),
                              "not job-2's", absl::ZeroDuration());
  copies.Wake();
  ASSERT_TRUE(copies.WaitCopied(3, absl::Seconds(30)));
  EXPECT_GE(copies.stats().failed, 1);
  EXPECT_EQ(copies.stats().done, 0);
  EXPECT_TRUE(memories_[0]->Held("job-2", "w1").empty());
}

}  // namespace
}  // namespace lockstep::worker
