// Checkpoint files: round trip, keep-N per job, every kind of damage detected and skipped, a
// checkpoint used only by the job that wrote it, init_from_checkpoint's explicit loading, write
// errors that carry the system's reason, and crafted or randomly mutated files (the reader is
// what lockstepctl export points at untrusted files) refused without a crash or a huge
// allocation.
#include "common/hash.h"
#include "common/checkpoint.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"

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
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);  // a failure's stays to be looked at
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
  EXPECT_NE(wrong.status().message().find("another model"), std::string::npos) << wrong.status();
  EXPECT_EQ(LoadCheckpointForInit(dir_ + "/nothing", kModel, 100, 200).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, WriteErrorsNameTheFileAndTheSystemsReason) {
  std::filesystem::create_directories(dir_);
  std::ofstream(dir_ + "/file") << "not a directory";
  absl::StatusOr<std::string> path = WriteCheckpoint(dir_ + "/file/ckpt", Make(10), 3);
  ASSERT_FALSE(path.ok());
  EXPECT_NE(path.status().message().find(dir_ + "/file/ckpt"), std::string::npos) << path.status();
  EXPECT_NE(path.status().message().find("Not a directory"), std::string::npos) << path.status();
  EXPECT_EQ(WriteCheckpoint(dir_, Make(10, "../escape"), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The version-3 layout, as WriteCheckpoint lays it out: the fields' byte offsets in the header,
// then the manifest's length. The checksum covers the file with its own field zeroed.
constexpr size_t kNumParamsAt = 96;
constexpr size_t kOptimizerFloatsAt = 104;
constexpr size_t kChecksumAt = 112;
constexpr size_t kManifestLengthAt = 120;
constexpr size_t kHeaderBytes = 128;  // with the manifest's length

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}
void Put64(std::string& bytes, size_t at, uint64_t value) {
  std::memcpy(bytes.data() + at, &value, sizeof(value));
}
// Recomputes the checksum, so that a crafted file gets past it to the checks behind it.
void Seal(std::string& bytes) {
  if (bytes.size() < kChecksumAt + 8) return;
  Put64(bytes, kChecksumAt, 0);
  Put64(bytes, kChecksumAt, Fnv1a64(bytes.data(), bytes.size()));
}

class CraftedCheckpointTest : public CheckpointTest {
 protected:
  // A small valid checkpoint with a manifest: 4 parameters, 8 optimizer values.
  std::string Valid() {
    CheckpointData d;
    d.step = 7;
    d.job_id = kJob;
    d.manifest = "manifest bytes";
    d.params = {1, 2, 3, 4};
    d.optimizer_state = {5, 6, 7, 8, 9, 10, 11, 12};
    absl::StatusOr<std::string> path = WriteCheckpoint(dir_, d, 1);
    EXPECT_TRUE(path.ok()) << path.status();
    return path.ok() ? ReadBytes(*path) : "";
  }
  absl::StatusOr<CheckpointData> ReadCrafted(const std::string& bytes) {
    const std::string path = dir_ + "/crafted.ckpt";
    WriteBytes(path, bytes);
    return ReadCheckpoint(path);
  }
};

TEST_F(CraftedCheckpointTest, CraftedFilesAreRefusedNamingTheFileAndTheProblem) {
  const std::string valid = Valid();
  ASSERT_EQ(valid.size(), kHeaderBytes + 14 + 12 * sizeof(float));
  ASSERT_TRUE(ReadCrafted(valid).ok()) << "the layout above is WriteCheckpoint's";
  struct Case {
    std::string what;
    std::string bytes;
    std::string problem;
  };
  std::vector<Case> cases;
  cases.push_back({"empty", "", "truncated header"});
  cases.push_back({"cut in the header", valid.substr(0, 100), "truncated header"});
  cases.push_back({"cut in the manifest length", valid.substr(0, kHeaderBytes - 3),
                   "truncated model manifest"});
  cases.push_back({"cut in the values", valid.substr(0, valid.size() - 5), "truncated"});
  cases.push_back({"garbage", std::string(200, '\x5a'), "not a Lockstep checkpoint"});
  cases.push_back({"trailing bytes", valid + "xyz", "trailing bytes"});
  // A 200-byte file that announces 2^34 parameters (64 GiB) and 2^35 optimizer values: the
  // reader used to allocate them before noticing the file is short, and died of it.
  std::string huge = valid.substr(0, 200);
  Put64(huge, kNumParamsAt, uint64_t{1} << 34);
  Put64(huge, kOptimizerFloatsAt, uint64_t{1} << 35);
  cases.push_back({"gigabytes announced", huge, "truncated"});
  Seal(huge);
  cases.push_back({"gigabytes announced, sealed", huge, "truncated"});
  std::string wrap = valid;
  Put64(wrap, kNumParamsAt, ~uint64_t{0} / 4 + 1);  // times 4 bytes wraps to 0
  Seal(wrap);
  cases.push_back({"counts whose byte size wraps", wrap, "implausible header"});
  std::string manifest_huge = valid;
  Put64(manifest_huge, kManifestLengthAt, uint64_t{1} << 62);
  Seal(manifest_huge);
  cases.push_back({"a manifest of 2^62 bytes", manifest_huge, "implausible model manifest"});
  std::string manifest_long = valid;
  Put64(manifest_long, kManifestLengthAt, 1 << 20);
  Seal(manifest_long);
  cases.push_back({"a manifest past the end", manifest_long, "truncated model manifest"});
  std::string job = valid;
  std::memset(job.data() + 16, 'j', 64);
  Seal(job);
  cases.push_back({"an unterminated job id", job, "job id not terminated"});
  std::string flipped = valid;
  flipped[valid.size() - 1] ^= 1;
  cases.push_back({"a flipped bit", flipped, "checksum mismatch"});
  for (const Case& c : cases) {
    absl::StatusOr<CheckpointData> read = ReadCrafted(c.bytes);
    ASSERT_FALSE(read.ok()) << c.what;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << c.what << ": " << read.status();
    EXPECT_NE(read.status().message().find(dir_ + "/crafted.ckpt"), std::string::npos)
        << c.what << ": " << read.status();
    EXPECT_NE(read.status().message().find(c.problem), std::string::npos)
        << c.what << ": " << read.status();
  }
}

TEST_F(CraftedCheckpointTest, ADirectoryOrAFifoIsNotReadAsACheckpoint) {
  std::filesystem::create_directories(dir_ + "/dir.ckpt");
  EXPECT_EQ(ReadCheckpoint(dir_ + "/dir.ckpt").status().code(), absl::StatusCode::kDataLoss);
  // Opening a FIFO blocks until a writer comes: the reader must not even open it.
  ASSERT_EQ(mkfifo((dir_ + "/fifo.ckpt").c_str(), 0600), 0);
  absl::StatusOr<CheckpointData> fifo = ReadCheckpoint(dir_ + "/fifo.ckpt");
  EXPECT_EQ(fifo.status().code(), absl::StatusCode::kDataLoss) << fifo.status();
  EXPECT_NE(fifo.status().message().find("not a regular file"), std::string::npos) << fifo.status();
  EXPECT_EQ(ReadCheckpoint(dir_ + "/missing.ckpt").status().code(), absl::StatusCode::kNotFound);
}

// A few thousand random mutations of a valid file, half of them re-sealed so that they reach the
// checks behind the checksum: the reader returns a checkpoint that agrees with the file's size,
// or DATA_LOSS, and never crashes. Deterministic: a fixed seed.
TEST_F(CraftedCheckpointTest, MutatedFilesNeverCrashTheReader) {
  const std::string valid = Valid();
  ASSERT_FALSE(valid.empty());
  std::mt19937_64 rng(20240611);
  const uint64_t interesting[] = {0,
                                  1,
                                  4,
                                  8,
                                  12,
                                  255,
                                  uint64_t{1} << 31,
                                  uint64_t{1} << 32,
                                  uint64_t{1} << 34,
                                  uint64_t{1} << 35,
                                  uint64_t{1} << 62,
                                  ~uint64_t{0} / 4 + 1,
                                  ~uint64_t{0}};
  const size_t fields[] = {8, kNumParamsAt, kOptimizerFloatsAt, kChecksumAt, kManifestLengthAt};
  int ok = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = valid;
    const int mutations = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      const size_t at = bytes.empty() ? 0 : rng() % bytes.size();
      switch (rng() % 6) {
        case 0:  // flip a bit
          if (!bytes.empty()) bytes[at] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 1:  // a random byte
          if (!bytes.empty()) bytes[at] = static_cast<char>(rng());
          break;
        case 2: {  // a header field set to a value that has broken readers before
          const size_t field = fields[rng() % std::size(fields)];
          if (bytes.size() >= field + 8) {
            Put64(bytes, field, interesting[rng() % std::size(interesting)]);
          }
          break;
        }
        case 3:  // truncated
          bytes.resize(at);
          break;
        case 4:  // bytes inserted
          bytes.insert(at, std::string(1 + rng() % 9, static_cast<char>(rng())));
          break;
        case 5:  // bytes removed
          bytes.erase(at, 1 + rng() % 9);
          break;
      }
    }
    if (rng() % 2 == 0) Seal(bytes);
    absl::StatusOr<CheckpointData> read = ReadCrafted(bytes);
    if (read.ok()) {
      ++ok;
      EXPECT_EQ(kHeaderBytes + read->manifest.size() +
                    (read->params.size() + read->optimizer_state.size()) * sizeof(float),
                bytes.size())
          << "mutation " << i;
    } else {
      ++refused;
      EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss)
          << "mutation " << i << ": " << read.status();
    }
  }
  // Both outcomes happen, or the loop tested less than it seems to.
  EXPECT_GT(ok, 30);
  EXPECT_GT(refused, 1500);
}

}  // namespace
}  // namespace lockstep::worker
