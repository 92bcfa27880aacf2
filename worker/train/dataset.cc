// Data set loading. IDX: big-endian header (magic, dims), then unsigned bytes.
#include "worker/train/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/train/random.h"

namespace lockstep::worker {
namespace {

// Reads a whole (possibly gzipped; zlib passes plain files through) file.
absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  gzbuffer(f, 1 << 20);
  std::string data;
  char buf[1 << 16];
  while (true) {
    int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      int err = 0;
      std::string msg = gzerror(f, &err);
      gzclose(f);
      return absl::DataLossError(absl::StrCat(path, ": ", msg));
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  gzclose(f);
  return data;
}

absl::StatusOr<std::string> FindFile(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {absl::StrCat(dir, "/", name, ".gz"),
                                       absl::StrCat(dir, "/", name)}) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec)) return candidate;
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("dataset directory ", dir, " does not exist"));
  }
  return absl::NotFoundError(absl::StrCat("dataset file ", dir, "/", name, "[.gz] not found"));
}

uint32_t BigEndian32(const std::string& data, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data()) + offset;
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Parses an IDX file of unsigned bytes; returns dims and the payload offset.
absl::StatusOr<std::vector<uint32_t>> ParseIdxHeader(const std::string& path,
                                                     const std::string& data, int want_dims,
                                                     size_t* payload) {
  if (data.size() < 4) return absl::DataLossError(absl::StrCat(path, ": file too short"));
  const uint32_t magic = BigEndian32(data, 0);
  if ((magic >> 8) != 0x08) {
    return absl::DataLossError(absl::StrCat(path, ": not an unsigned-byte IDX file (magic 0x",
                                            absl::Hex(magic), ")"));
  }
  const int dims = static_cast<int>(magic & 0xff);
  if (dims != want_dims) {
    return absl::DataLossError(
        absl::StrCat(path, ": expected ", want_dims, " dimensions, found ", dims));
  }
  if (data.size() < 4 + 4 * static_cast<size_t>(dims)) {
    return absl::DataLossError(absl::StrCat(path, ": truncated header"));
  }
  std::vector<uint32_t> shape;
  uint64_t count = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(BigEndian32(data, 4 + 4 * i));
    count *= shape.back();
  }
  *payload = 4 + 4 * static_cast<size_t>(dims);
  if (data.size() - *payload != count) {
    return absl::DataLossError(absl::StrCat(path, ": expected ", count, " data bytes, found ",
                                            data.size() - *payload));
  }
  return shape;
}

absl::StatusOr<Split> LoadSplit(const std::string& dir, const std::string& prefix,
                                int32_t* dim) {
  LOCKSTEP_ASSIGN_OR_RETURN(std::string images_path,
                            FindFile(dir, absl::StrCat(prefix, "-images-idx3-ubyte")));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string labels_path,
                            FindFile(dir, absl::StrCat(prefix, "-labels-idx1-ubyte")));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string images, ReadMaybeGzip(images_path));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string labels, ReadMaybeGzip(labels_path));
  size_t image_offset = 0, label_offset = 0;
  LOCKSTEP_ASSIGN_OR_RETURN(std::vector<uint32_t> image_shape,
                            ParseIdxHeader(images_path, images, 3, &image_offset));
  LOCKSTEP_ASSIGN_OR_RETURN(std::vector<uint32_t> label_shape,
                            ParseIdxHeader(labels_path, labels, 1, &label_offset));
  if (image_shape[0] != label_shape[0]) {
    return absl::DataLossError(absl::StrCat(images_path, " holds ", image_shape[0],
                                            " images but ", labels_path, " holds ",
                                            label_shape[0], " labels"));
  }
  if (image_shape[0] == 0) return absl::DataLossError(absl::StrCat(images_path, ": no samples"));
  const int32_t d = static_cast<int32_t>(image_shape[1] * image_shape[2]);
  if (*dim != 0 && *dim != d) {
    return absl::DataLossError(
        absl::StrCat(images_path, ": ", d, " features per sample, expected ", *dim));
  }
  *dim = d;
  Split split;
  split.samples = image_shape[0];
  split.x.resize(static_cast<size_t>(split.samples) * d);
  const auto* px = reinterpret_cast<const unsigned char*>(images.data()) + image_offset;
  for (size_t i = 0; i < split.x.size(); ++i) split.x[i] = static_cast<float>(px[i]) / 255.0f;
  split.y.resize(split.samples);
  const auto* py = reinterpret_cast<const unsigned char*>(labels.data()) + label_offset;
  for (int64_t i = 0; i < split.samples; ++i) split.y[i] = py[i];
  return split;
}

}  // namespace

absl::StatusOr<Dataset> LoadIdxDataset(const std::string& dir) {
  Dataset ds;
  LOCKSTEP_ASSIGN_OR_RETURN(ds.train, LoadSplit(dir, "train", &ds.dim));
  LOCKSTEP_ASSIGN_OR_RETURN(ds.test, LoadSplit(dir, "t10k", &ds.dim));
  int32_t max_label = 0;
  for (int32_t y : ds.train.y) max_label = std::max(max_label, y);
  for (int32_t y : ds.test.y) max_label = std::max(max_label, y);
  ds.classes = std::max(2, max_label + 1);
  return ds;
}

Dataset MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec) {
  // Teacher: logits = W2 * tanh(W1 x), hidden width 32. Non-linear, so depth helps, but
  // smooth enough that a small MLP learns it well within a few hundred steps.
  constexpr int kHidden = 32;
  const int32_t dim = spec.input_dim();
  const int32_t classes = spec.num_classes();
  SplitMix64 rng(spec.seed() ^ 0x5eed5eed5eedULL);
  std::vector<float> w1(static_cast<size_t>(kHidden) * dim), w2(kHidden * classes);
  const float s1 = 1.0f / std::sqrt(static_cast<float>(dim));
  for (float& w : w1) w = static_cast<float>(rng.Normal()) * s1 * 2.0f;
  for (float& w : w2) w = static_cast<float>(rng.Normal());

  auto make_split = [&](int64_t n) {
    Split split;
    split.samples = n;
    split.x.resize(static_cast<size_t>(n) * dim);
    split.y.resize(n);
    std::vector<float> h(kHidden), logits(classes);
    for (int64_t i = 0; i < n; ++i) {
      float* x = &split.x[static_cast<size_t>(i) * dim];
      for (int32_t j = 0; j < dim; ++j) x[j] = static_cast<float>(rng.Normal());
      for (int k = 0; k < kHidden; ++k) {
        float acc = 0;
        for (int32_t j = 0; j < dim; ++j) acc += w1[static_cast<size_t>(k) * dim + j] * x[j];
        h[k] = std::tanh(acc);
      }
      int32_t best = 0;
      for (int32_t c = 0; c < classes; ++c) {
        float acc = 0;
        for (int k = 0; k < kHidden; ++k) acc += w2[k * classes + c] * h[k];
        logits[c] = acc;
        if (acc > logits[best]) best = c;
      }
      split.y[i] = best;
    }
    return split;
  };
  Dataset ds;
  ds.dim = dim;
  ds.classes = classes;
  ds.train = make_split(spec.train_samples());
  ds.test = make_split(spec.test_samples());
  return ds;
}

absl::StatusOr<std::shared_ptr<const Dataset>> LoadDataset(const v1::DatasetSpec& spec) {
  static absl::Mutex mu(absl::kConstInit);
  // One entry: a worker trains one job at a time, usually on the same data again.
  static std::string* cached_key = new std::string;
  static std::shared_ptr<const Dataset>* cached = new std::shared_ptr<const Dataset>;
  const std::string key = spec.SerializeAsString();
  absl::MutexLock lock(&mu);
  if (*cached != nullptr && *cached_key == key) return *cached;
  std::shared_ptr<Dataset> ds;
  if (spec.type() == "synthetic") {
    ds = std::make_shared<Dataset>(MakeSyntheticDataset(spec.synthetic()));
  } else if (spec.type() == "idx" || spec.type() == "fashion_mnist") {
    absl::StatusOr<Dataset> loaded = LoadIdxDataset(spec.path());
    if (!loaded.ok()) return loaded.status();
    ds = std::make_shared<Dataset>(*std::move(loaded));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown dataset type \"", spec.type(), "\""));
  }
  *cached_key = key;
  *cached = ds;
  return *cached;
}

}  // namespace lockstep::worker
