// IDX loading (gzip and plain), its errors, and the host-wide decoded cache.
#include "worker/train/dataset.h"

#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

std::string BigEndian(uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
}

void WriteFile(const std::string& path, const std::string& data, bool gzip) {
  if (gzip) {
    gzFile f = gzopen((path + ".gz").c_str(), "wb");
    gzwrite(f, data.data(), static_cast<unsigned>(data.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << data;
  }
}

// Writes an IDX data set of n_train/n_test 2x3 images; pixel j of sample i is (7i + j) % 256,
// label i % 4.
std::string MakeIdx(int n_train, int n_test, bool gzip) {
  static int counter = 0;
  const std::string dir = absl::StrCat(::testing::TempDir(), "/idx-", getpid(), "-", counter++);
  std::filesystem::create_directories(dir);
  for (auto [prefix, n] : {std::pair<std::string, int>{"train", n_train}, {"t10k", n_test}}) {
    std::string images = BigEndian(0x803) + BigEndian(n) + BigEndian(2) + BigEndian(3);
    std::string labels = BigEndian(0x801) + BigEndian(n);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < 6; ++j) images.push_back(static_cast<char>((7 * i + j) % 256));
      labels.push_back(static_cast<char>(i % 4));
    }
    WriteFile(dir + "/" + prefix + "-images-idx3-ubyte", images, gzip);
    WriteFile(dir + "/" + prefix + "-labels-idx1-ubyte", labels, gzip);
  }
  return dir;
}

void ExpectContents(const Dataset& ds, int n_train, int n_test) {
  EXPECT_EQ(ds.dim, 6);
  EXPECT_EQ(ds.classes, 4);
  ASSERT_EQ(ds.train.samples, n_train);
  ASSERT_EQ(ds.test.samples, n_test);
  std::vector<float> row(6);
  for (int i : {0, 1, n_train - 1}) {
    ds.train.Range(i, 1, 6, row.data());
    for (int j = 0; j < 6; ++j) EXPECT_FLOAT_EQ(row[j], ((7 * i + j) % 256) / 255.0f);
    EXPECT_EQ(ds.train.y[i], i % 4);
  }
  const int64_t idx[2] = {n_test - 1, 2};
  std::vector<float> rows(12);
  ds.test.Gather(idx, 2, 6, rows.data());
  EXPECT_FLOAT_EQ(rows[0], ((7 * (n_test - 1)) % 256) / 255.0f);
  EXPECT_FLOAT_EQ(rows[6], 14 / 255.0f);
}

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ = absl::StrCat(::testing::TempDir(), "/cache-", getpid());
    std::filesystem::remove_all(cache_);
    SetDatasetCacheDir(cache_);
  }
  void TearDown() override {
    SetDatasetCacheDir("");
    std::filesystem::remove_all(cache_);
  }
  std::string cache_;
};

TEST_F(DatasetTest, ReadsGzipAndPlainIdx) {
  for (bool gzip : {true, false}) {
    absl::StatusOr<Dataset> ds = LoadIdxDataset(MakeIdx(50, 20, gzip));
    ASSERT_TRUE(ds.ok()) << ds.status();
    ExpectContents(*ds, 50, 20);
  }
}

TEST_F(DatasetTest, CacheIsWrittenOnceAndSharedAndSurvivesCorruption) {
  const std::string dir = MakeIdx(40, 10, true);
  absl::StatusOr<Dataset> first = LoadIdxDataset(dir);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<std::filesystem::path> entries;
  for (const auto& e : std::filesystem::directory_iterator(cache_)) {
    if (e.path().extension() == ".idx") entries.push_back(e.path());
  }
  ASSERT_EQ(entries.size(), 1u) << "one decoded copy per data set";
  absl::StatusOr<Dataset> second = LoadIdxDataset(dir);
  ASSERT_TRUE(second.ok());
  ExpectContents(*second, 40, 10);
  // A torn cache file (replaced, as every writer does, never truncated in place under the
  // workers that map it) is detected and rebuilt from the source files.
  const std::string torn = entries[0].string() + ".torn";
  std::filesystem::copy_file(entries[0], torn);
  std::filesystem::resize_file(torn, 100);
  std::filesystem::rename(torn, entries[0]);
  absl::StatusOr<Dataset> third = LoadIdxDataset(dir);
  ASSERT_TRUE(third.ok()) << third.status();
  ExpectContents(*third, 40, 10);
  ExpectContents(*first, 40, 10);  // the old mapping stays valid
}

// Defect 8: a long-lived worker served a data set whose files had been replaced. A file
// rewritten with the same size and modification time (cp -p, touch -r) is a new identity: the
// process's copy and the host cache are both rebuilt, and the parts' hashes tell them apart.
TEST_F(DatasetTest, ReplacedFilesAreReloadedEvenWithTheSameSizeAndMtime) {
  const std::string dir = MakeIdx(40, 10, false);
  v1::DatasetSpec spec;
  spec.set_type("idx");
  spec.set_path(dir);
  absl::StatusOr<std::shared_ptr<const Dataset>> first = LoadDataset(spec);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(LoadDataset(spec).value(), *first) << "unchanged files: the same copy";
  ASSERT_EQ((*first)->parts.size(), 4u);
  EXPECT_EQ((*first)->source, dir);
  const std::string labels = dir + "/train-labels-idx1-ubyte";
  const auto mtime = std::filesystem::last_write_time(labels);
  {
    std::fstream f(labels, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);  // the first label
    f.put('\x03');
  }
  std::filesystem::last_write_time(labels, mtime);
  absl::StatusOr<std::shared_ptr<const Dataset>> second = LoadDataset(spec);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(*second, *first);
  EXPECT_EQ((*second)->train.y[0], 3);
  EXPECT_NE((*second)->parts[1].hash, (*first)->parts[1].hash) << "train labels changed";
  EXPECT_EQ((*second)->parts[0].hash, (*first)->parts[0].hash) << "train images did not";
}

TEST_F(DatasetTest, MissingDirectoryAndFilesAreNamed) {
  absl::StatusOr<Dataset> ds = LoadIdxDataset("/nonexistent/lockstep");
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(ds.status().message().find("/nonexistent/lockstep"), std::string::npos);
  const std::string dir = MakeIdx(10, 5, true);
  std::filesystem::remove(dir + "/t10k-labels-idx1-ubyte.gz");
  ds = LoadIdxDataset(dir);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(ds.status().message().find("t10k-labels-idx1-ubyte"), std::string::npos);
}

TEST_F(DatasetTest, CorruptFilesAreDataLossNamingTheFile) {
  const std::string dir = MakeIdx(10, 5, false);
  // Truncate the training images: the header promises more bytes than there are.
  std::filesystem::resize_file(dir + "/train-images-idx3-ubyte", 30);
  absl::StatusOr<Dataset> ds = LoadIdxDataset(dir);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(ds.status().message().find("train-images-idx3-ubyte"), std::string::npos)
      << ds.status();
  const std::string other = MakeIdx(10, 5, false);
  WriteFile(other + "/t10k-labels-idx1-ubyte", BigEndian(0x801) + BigEndian(4) + "abcd", false);
  ds = LoadIdxDataset(other);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(ds.status().message().find("labels"), std::string::npos) << ds.status();
}

TEST(SyntheticDatasetTest, SameSeedSameDataAndAllClassesAppear) {
  v1::SyntheticDatasetSpec spec;
  spec.set_train_samples(2000);
  spec.set_test_samples(100);
  spec.set_input_dim(8);
  spec.set_num_classes(3);
  spec.set_seed(4);
  Dataset a = MakeSyntheticDataset(spec), b = MakeSyntheticDataset(spec);
  EXPECT_EQ(a.train.x, b.train.x);
  EXPECT_EQ(a.train.y, b.train.y);
  std::vector<int> counts(3);
  for (int32_t y : a.train.y) ++counts[y];
  for (int c : counts) EXPECT_GT(c, 100);
  spec.set_seed(5);
  EXPECT_NE(MakeSyntheticDataset(spec).train.x, a.train.x);
}

}  // namespace
}  // namespace lockstep::worker
