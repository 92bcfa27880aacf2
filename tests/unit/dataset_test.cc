// IDX loading (gzip and plain), its errors, and the host-wide decoded cache.
#include "worker/data/dataset.h"

#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

std::string TempDir(const std::string& what) {
  static int counter = 0;
  const std::string dir = absl::StrCat(::testing::TempDir(), "/", what, "-", getpid(), "-", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string Tokens(const TokenSplit& split) {
  std::string out;
  for (int64_t i = 0; i < split.tokens; ++i) out.push_back(static_cast<char>(split.At(i)));
  return out;
}

TEST_F(DatasetTest, TextFileIsSplitFromTheEndAndWindowsStrideByContext) {
  const std::string dir = TempDir("text");
  std::string text;
  for (int i = 0; i < 100; ++i) text += static_cast<char>('a' + i % 26);
  WriteFile(dir + "/corpus.txt", text, false);
  absl::StatusOr<Dataset> ds = LoadTextDataset(dir + "/corpus.txt", 0.2);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE(ds->language);
  EXPECT_TRUE(ds->text);
  EXPECT_EQ(Tokens(ds->train_tokens), text.substr(0, 80));
  EXPECT_EQ(Tokens(ds->valid_tokens), text.substr(80));
  EXPECT_EQ(ds->max_token, 'z');
  ASSERT_EQ(ds->parts.size(), 2u);
  EXPECT_NE(ds->parts[0].hash, ds->parts[1].hash);
  // 80 tokens, context 8: windows of 9 at a stride of 8 cover tokens 0..72 (9 windows: each
  // token after the first predicted once).
  EXPECT_EQ(ds->train_tokens.Windows(8), 9);
  std::vector<int32_t> w(9);
  ds->train_tokens.Window(1, 8, w.data());
  for (int i = 0; i < 9; ++i) EXPECT_EQ(w[i], text[8 + i]);
  EXPECT_EQ(ds->train_tokens.Windows(80), 0) << "a text shorter than one window";
}

TEST_F(DatasetTest, TextDirectoryReadsTextFilesInNameOrderAndSkipsTheRest) {
  const std::string dir = TempDir("fortunes");
  WriteFile(dir + "/b", "second file\n%\n", false);
  WriteFile(dir + "/a", "first file \xc3\xa9\n", false);  // UTF-8 é
  WriteFile(dir + "/a.dat", std::string("\x00\x00\x00\x02\x00\x00", 6), false);  // an index
  WriteFile(dir + "/latin1", "caf\xe9\n", false);  // not UTF-8
  std::filesystem::create_symlink(dir + "/b", dir + "/b.u8");
  std::filesystem::create_directories(dir + "/off");
  absl::StatusOr<Dataset> ds = LoadTextDataset(dir, 0.25);
  ASSERT_TRUE(ds.ok()) << ds.status();
  const std::string all = Tokens(ds->train_tokens) + Tokens(ds->valid_tokens);
  EXPECT_EQ(all, "first file \xc3\xa9\nsecond file\n%\n");
  EXPECT_NE(ds->source.find("2 text files"), std::string::npos) << ds->source;
  // Through the host cache: a second load maps the same concatenation.
  absl::StatusOr<Dataset> again = LoadTextDataset(dir, 0.25);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Tokens(again->train_tokens) + Tokens(again->valid_tokens), all);
  EXPECT_EQ(again->parts[0].hash, ds->parts[0].hash);
  // A glob picks files by name.
  absl::StatusOr<Dataset> globbed = LoadTextDataset(dir + "/b*", 0.25);
  ASSERT_TRUE(globbed.ok()) << globbed.status();
  EXPECT_EQ(Tokens(globbed->train_tokens) + Tokens(globbed->valid_tokens), "second file\n%\n");
}

TEST_F(DatasetTest, TextErrorsNameThePathAndTheReason) {
  absl::StatusOr<Dataset> missing = LoadTextDataset("/nonexistent/corpus", 0.05);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/corpus"), std::string::npos);
  const std::string dir = TempDir("binary");
  WriteFile(dir + "/x.dat", std::string("\x01\x00\x02", 3), false);
  absl::StatusOr<Dataset> none = LoadTextDataset(dir, 0.05);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
  EXPECT_NE(none.status().message().find("NUL"), std::string::npos) << none.status();
  absl::StatusOr<Dataset> file = LoadTextDataset(dir + "/x.dat", 0.05);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << file.status();
  EXPECT_NE(file.status().message().find("x.dat"), std::string::npos) << file.status();
}

// llm.c's layout: 256 int32 of header (magic, version, count), then uint16 tokens.
std::string LlmcFile(const std::vector<uint16_t>& tokens, int32_t magic = 20240520,
                     int32_t version = 1, int32_t count = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count >= 0 ? count : static_cast<int32_t>(tokens.size());
  std::string out(reinterpret_cast<const char*>(header.data()), 1024);
  out.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return out;
}

TEST_F(DatasetTest, TokenFilesWithAndWithoutTheLlmcHeader) {
  const std::string dir = TempDir("tokens");
  std::vector<uint16_t> train(300), valid(50);
  for (size_t i = 0; i < train.size(); ++i) train[i] = static_cast<uint16_t>(i * 7 % 50257);
  for (size_t i = 0; i < valid.size(); ++i) valid[i] = static_cast<uint16_t>(60000 + i);
  WriteFile(dir + "/train.bin", LlmcFile(train), false);
  WriteFile(dir + "/val.bin",
            std::string(reinterpret_cast<const char*>(valid.data()), valid.size() * 2), false);
  absl::StatusOr<Dataset> ds = LoadTokenDataset(dir + "/train.bin", dir + "/val.bin");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE(ds->language);
  EXPECT_FALSE(ds->text);
  ASSERT_EQ(ds->train_tokens.tokens, 300);
  ASSERT_EQ(ds->valid_tokens.tokens, 50);
  EXPECT_EQ(ds->train_tokens.At(299), train[299]);
  EXPECT_EQ(ds->valid_tokens.At(3), 60003);
  EXPECT_EQ(ds->max_token, 60049);
  ASSERT_EQ(ds->parts.size(), 2u);
  EXPECT_EQ(ds->parts[0].name, "train.bin");
}

TEST_F(DatasetTest, BadTokenFilesAreDataLossNamingFileAndReason) {
  const std::string dir = TempDir("badtokens");
  const std::vector<uint16_t> t(100, 5);
  WriteFile(dir + "/ok.bin", LlmcFile(t), false);
  struct Case {
    std::string name, contents, reason;
  } cases[] = {
      {"magic.bin", LlmcFile(t, 20240521), "damaged header"},
      {"version.bin", LlmcFile(t, 20240520, 2), "another version"},
      {"count.bin", LlmcFile(t, 20240520, 1, 150), "count does not match"},
      {"odd.bin", std::string(201, 'x'), "odd number of bytes"},
      {"empty.bin", "", "no tokens"},
  };
  for (const Case& c : cases) {
    WriteFile(dir + "/" + c.name, c.contents, false);
    for (bool as_train : {true, false}) {
      absl::StatusOr<Dataset> ds = as_train ? LoadTokenDataset(dir + "/" + c.name, dir + "/ok.bin")
                                            : LoadTokenDataset(dir + "/ok.bin", dir + "/" + c.name);
      EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss) << c.name << ": " << ds.status();
      EXPECT_NE(ds.status().message().find(c.name), std::string::npos) << ds.status();
      EXPECT_NE(ds.status().message().find(c.reason), std::string::npos) << ds.status();
      // What is wrong, never what the file holds or how big it is.
      const std::string message(ds.status().message());
      const std::string after_path = message.substr(message.find(c.name) + c.name.size());
      for (const char* leak : {"20240521", "150", "201", "200", "1224"}) {
        EXPECT_EQ(after_path.find(leak), std::string::npos) << ds.status();
      }
    }
  }
  absl::StatusOr<Dataset> missing = LoadTokenDataset(dir + "/ok.bin", dir + "/none.bin");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("none.bin"), std::string::npos);
  absl::StatusOr<Dataset> no_valid = LoadTokenDataset(dir + "/ok.bin", "");
  EXPECT_EQ(no_valid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_valid.status().message().find("validation_path"), std::string::npos);
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

// A job that ended stops its workers' loading: the flag is watched inside the loops, and a
// stopped load leaves nothing behind that a later load would serve.
TEST(DatasetStopTest, LoadingStopsWhenTheFlagIsSet) {
  v1::SyntheticDatasetSpec big;
  big.set_train_samples(4'000'000);
  big.set_test_samples(1000);
  big.set_input_dim(16);
  big.set_num_classes(3);
  std::atomic<bool> stop{false};
  std::thread stopper([&] { stop.store(true); });
  absl::StatusOr<Dataset> stopped = MakeSyntheticDataset(big, &stop);
  stopper.join();
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();

  // Wide samples take milliseconds each: the flag is seen within a sample, not 1,024 of them
  // (fewer than that here, so a coarser check would build the whole set and succeed).
  v1::SyntheticDatasetSpec wide;
  wide.set_train_samples(1000);
  wide.set_test_samples(10);
  wide.set_input_dim(65536);
  wide.set_num_classes(65536);
  std::atomic<bool> soon{false};
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(50));
    soon.store(true);
  });
  stopped = MakeSyntheticDataset(wide, &soon);
  later.join();
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();

  v1::DatasetSpec spec;
  spec.set_type("synthetic");
  spec.mutable_synthetic()->set_train_samples(500);
  spec.mutable_synthetic()->set_test_samples(50);
  spec.mutable_synthetic()->set_input_dim(4);
  spec.mutable_synthetic()->set_num_classes(2);
  spec.mutable_synthetic()->set_seed(77);
  EXPECT_EQ(LoadDataset(spec, &stop).status().code(), absl::StatusCode::kCancelled);
  absl::StatusOr<std::shared_ptr<const Dataset>> loaded = LoadDataset(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->train.samples, 500);

  const std::string dir = ::testing::TempDir() + "/stop-text";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const char* name : {"a.txt", "b.txt"}) std::ofstream(dir + "/" + name) << "some text\n";
  EXPECT_EQ(LoadTextDataset(dir, 0.2, &stop).status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(LoadTextDataset(dir, 0.2).ok());
}

}  // namespace
}  // namespace lockstep::worker
