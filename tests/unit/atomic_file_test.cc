// Atomic file replacement: the old or the new contents, never a mix, no temporary file left
// behind, and errors that name the file and carry the system's reason with a fitting code.
#include "common/atomic_file.h"

#include <sys/mount.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lockstep {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int Entries(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++n;
  }
  return n;
}

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/atomic-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  std::string dir_;
};

TEST_F(AtomicFileTest, ReplacesTheWholeFileFromPieces) {
  const std::string path = dir_ + "/f";
  for (Durability d : {Durability::kVisible, Durability::kDurable}) {
    ASSERT_TRUE(WriteFileAtomically(path, {"old ", "contents"}, d).ok());
    ASSERT_TRUE(WriteFileAtomically(path, {"new"}, d).ok());
    EXPECT_EQ(Read(path), "new");
  }
  EXPECT_EQ(Entries(dir_), 1) << "no temporary file is left";
}

TEST_F(AtomicFileTest, StreamsContentsAndAProducersErrorLeavesTheOldFile) {
  const std::string path = dir_ + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "old", Durability::kDurable).ok());
  const absl::Status failed = WriteFileAtomically(
      path,
      [](const AtomicWrite& write) {
        EXPECT_TRUE(write("half of ", 8).ok());
        return absl::DataLossError("the source changed");
      },
      Durability::kDurable);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_EQ(Read(path), "old");
  EXPECT_EQ(Entries(dir_), 1) << "no temporary file is left";
  ASSERT_TRUE(WriteFileAtomically(
                  path,
                  [](const AtomicWrite& write) {
                    for (int i = 0; i < 3; ++i) {
                      if (absl::Status s = write("ab", 2); !s.ok()) return s;
                    }
                    return absl::OkStatus();
                  },
                  Durability::kDurable)
                  .ok());
  EXPECT_EQ(Read(path), "ababab");
}

TEST_F(AtomicFileTest, ErrorsNameTheFileAndTheReason) {
  absl::Status missing = WriteFileAtomically(dir_ + "/no/such/dir/f", "x", Durability::kDurable);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find(dir_ + "/no/such/dir/f"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("No such file or directory"), std::string::npos) << missing;
}

// A full disk: a tiny tmpfs (root only; skipped elsewhere). The write fails with the
// system's reason, the old contents stay, and the partial temporary file is gone.
TEST_F(AtomicFileTest, AFullDiskFailsCleanly) {
  const std::string mnt = dir_ + "/small";
  std::filesystem::create_directories(mnt);
  if (getuid() != 0 || mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  }
  const std::string path = mnt + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "small", Durability::kDurable).ok());
  const std::string big(256 * 1024, 'x');
  absl::Status full = WriteFileAtomically(path, big, Durability::kDurable);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("No space left on device"), std::string::npos) << full;
  EXPECT_EQ(Read(path), "small");
  EXPECT_EQ(Entries(mnt), 1);
  umount(mnt.c_str());
}

}  // namespace
}  // namespace lockstep
