// In-memory data sets: for classifiers, IDX files (MNIST format, optionally gzipped) and a
// synthetic generator (features float32 in row-major [samples x dim]); for language models,
// the bytes of a text file or a file of uint16 token ids.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::worker {

struct Split {
  int64_t samples = 0;
  // Features: IDX pixels stay bytes (4x less memory, and several workers can share one mapped
  // copy) and are scaled to [0, 1] as rows are read; synthetic features are floats.
  const uint8_t* bytes = nullptr;  // samples * dim, or null
  std::vector<float> x;            // samples * dim, when bytes is null
  std::vector<int32_t> y;          // samples, each in [0, classes)

  // Writes the features of samples idx[0..count) to out (count x dim).
  void Gather(const int64_t* idx, int count, int dim, float* out) const;
  // Writes the features of samples [begin, begin + count) to out (count x dim).
  void Range(int64_t begin, int count, int dim, float* out) const;
};

// A sequence of tokens, for language models: the bytes of a text (tokens 0-255) or uint16 token
// ids. Its samples are windows of context + 1 tokens at a stride of context, so every token
// after the first is predicted exactly once per epoch.
struct TokenSplit {
  int64_t tokens = 0;
  const uint8_t* bytes = nullptr;  // text
  const uint16_t* ids = nullptr;   // token files
  int32_t At(int64_t i) const { return ids != nullptr ? ids[i] : bytes[i]; }
  int64_t Windows(int context) const {
    return context > 0 && tokens > context ? (tokens - 1) / context : 0;
  }
  // Writes window w's context + 1 tokens to out.
  void Window(int64_t w, int context, int32_t* out) const {
    const int64_t first = w * context;
    for (int i = 0; i <= context; ++i) out[i] = At(first + i);
  }
};

struct Dataset {
  // Classifiers (IDX, synthetic): dim, classes, train, test. Language models (text, token
  // files): language, train_tokens, valid_tokens, max_token, bytes.
  int32_t dim = 0;
  int32_t classes = 0;
  Split train;
  Split test;
  bool language = false;
  TokenSplit train_tokens;
  TokenSplit valid_tokens;
  int32_t max_token = -1;  // the largest token id in either split
  bool text = false;       // tokens are bytes of text (so a loss per token is a loss per byte)
  // What the data are, so that the members of a group can confirm they all hold the same:
  // a content hash (XXH3 64) per part (IDX: one per file; synthetic: one for the whole set),
  // and where the data came from ("/data/fashion-mnist", "synthetic data set (seed 5)").
  struct Part {
    std::string name;
    uint64_t hash = 0;
  };
  std::vector<Part> parts;
  std::string source;
  // Owns the memory `bytes` points into (a vector or a shared mapping).
  std::shared_ptr<const void> storage;
};

// Directory where decoded IDX data sets are cached as plain files that every worker of the
// host maps (default /dev/shm/lockstep-cache; empty disables the cache). A cache entry is
// keyed by the source files' identity: path, device, inode, size, modification and change
// times (a file rewritten in place, or replaced by another with the same size and mtime, has
// another change time).
void SetDatasetCacheDir(const std::string& dir);

// Loading watches this flag (when given) and gives up with CANCELLED once it is set: a job that
// ended (cancelled, failed) stops its workers' loading at once.
using StopFlag = const std::atomic<bool>*;

// Reads train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
// t10k-labels-idx1-ubyte (each with or without .gz) from `dir`, through the cache when one is
// set: the first worker of a host decodes, the others wait for it and map its result.
// NOT_FOUND names the missing file; DATA_LOSS names the file and what is wrong with it.
absl::StatusOr<Dataset> LoadIdxDataset(const std::string& dir, StopFlag stop = nullptr);

// Samples x ~ N(0, 1) and labels them with a fixed random teacher network, so the task is
// learnable and the same seed gives the same data on every worker.
Dataset MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec);
absl::StatusOr<Dataset> MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec, StopFlag stop);

// Byte-level text: `path` is a file, or a directory of text files (read in name order; files
// that are not UTF-8 text, or hold a NUL byte, are skipped with a logged reason); the last
// `validation_fraction` of the bytes is held out. NOT_FOUND names a missing path;
// FAILED_PRECONDITION a directory with no text in it.
absl::StatusOr<Dataset> LoadTextDataset(const std::string& path, double validation_fraction,
                                        StopFlag stop = nullptr);
// Token files (see DatasetSpec.path): mapped, not copied, so the workers of a host share one copy
// in the page cache. DATA_LOSS names the file and what is wrong (a bad magic or version, a
// header whose token count disagrees with the size, an odd length).
absl::StatusOr<Dataset> LoadTokenDataset(const std::string& train_path,
                                         const std::string& validation_path);

// Loads the data set a job names, sharing one copy between jobs of this process that name the
// same data (workers are long-lived and usually train the same data again): the copy is reused
// only while the files' identity is unchanged. Thread-safe.
absl::StatusOr<std::shared_ptr<const Dataset>> LoadDataset(const v1::DatasetSpec& spec,
                                                           StopFlag stop = nullptr);

}  // namespace lockstep::worker
