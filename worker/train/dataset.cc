// Data set loading. IDX: big-endian header (magic, dims), then unsigned bytes.
#include "worker/train/dataset.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "xxhash.h"
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

// One split's raw bytes as the IDX files hold them.
struct RawSplit {
  int64_t samples = 0;
  std::string pixels;  // samples * dim
  std::string labels;  // samples
};

absl::StatusOr<RawSplit> ReadSplit(const std::string& images_path,
                                   const std::string& labels_path, int32_t* dim) {
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
  RawSplit split;
  split.samples = image_shape[0];
  split.pixels = images.substr(image_offset);
  split.labels = labels.substr(label_offset);
  return split;
}

// Cache file: a fixed header, then train pixels, train labels, test pixels, test labels.
struct CacheHeader {
  char magic[8];
  int64_t train_samples;
  int64_t test_samples;
  int64_t dim;
};
constexpr char kCacheMagic[8] = {'L', 'S', 'I', 'D', 'X', 'v', '1', '\0'};

size_t CacheBytes(const CacheHeader& h) {
  return sizeof(CacheHeader) +
         static_cast<size_t>((h.train_samples + h.test_samples) * (h.dim + 1));
}

std::string& CacheDir() {
  static std::string* dir = new std::string("/dev/shm/lockstep-cache");
  return *dir;
}

// Builds a Dataset whose pixels point into `base` (which `storage` keeps alive).
Dataset FromLayout(const CacheHeader& h, const uint8_t* base,
                   std::shared_ptr<const void> storage) {
  Dataset ds;
  ds.dim = static_cast<int32_t>(h.dim);
  const uint8_t* p = base + sizeof(CacheHeader);
  auto fill = [&](Split& split, int64_t n) {
    split.samples = n;
    split.bytes = p;
    p += n * h.dim;
    split.y.assign(p, p + n);
    p += n;
  };
  const uint8_t* start = p;
  fill(ds.train, h.train_samples);
  fill(ds.test, h.test_samples);
  // One hash per source file's content (pixels, labels of each split), in the cache's order.
  const int64_t sizes[4] = {h.train_samples * h.dim, h.train_samples, h.test_samples * h.dim,
                            h.test_samples};
  const char* names[4] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                          "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
  for (int i = 0; i < 4; ++i) {
    ds.parts.push_back({names[i], XXH3_64bits(start, static_cast<size_t>(sizes[i]))});
    start += sizes[i];
  }
  int32_t max_label = 0;
  for (int32_t y : ds.train.y) max_label = std::max(max_label, y);
  for (int32_t y : ds.test.y) max_label = std::max(max_label, y);
  ds.classes = std::max(2, max_label + 1);
  ds.storage = std::move(storage);
  return ds;
}

// Maps a complete cache file; NOT_FOUND when it is absent, DATA_LOSS when it is malformed.
absl::StatusOr<Dataset> MapCache(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(path);
  struct stat st {};
  CacheHeader h{};
  const bool ok = fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(h)) &&
                  pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)) &&
                  std::memcmp(h.magic, kCacheMagic, sizeof(kCacheMagic)) == 0 &&
                  h.train_samples > 0 && h.test_samples > 0 && h.dim > 0 &&
                  static_cast<size_t>(st.st_size) == CacheBytes(h);
  if (!ok) {
    close(fd);
    return absl::DataLossError(absl::StrCat("malformed cache file ", path));
  }
  void* mapping = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (mapping == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path));
  const size_t bytes = st.st_size;
  std::shared_ptr<const void> storage(
      mapping, [bytes](const void* m) { munmap(const_cast<void*>(m), bytes); });
  return FromLayout(h, static_cast<const uint8_t*>(mapping), std::move(storage));
}

absl::StatusOr<std::string> EncodeIdx(const std::string& dir, CacheHeader* h) {
  int32_t dim = 0;
  LOCKSTEP_ASSIGN_OR_RETURN(std::string train_images, FindFile(dir, "train-images-idx3-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string train_labels, FindFile(dir, "train-labels-idx1-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string test_images, FindFile(dir, "t10k-images-idx3-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string test_labels, FindFile(dir, "t10k-labels-idx1-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(RawSplit train, ReadSplit(train_images, train_labels, &dim));
  LOCKSTEP_ASSIGN_OR_RETURN(RawSplit test, ReadSplit(test_images, test_labels, &dim));
  std::memcpy(h->magic, kCacheMagic, sizeof(kCacheMagic));
  h->train_samples = train.samples;
  h->test_samples = test.samples;
  h->dim = dim;
  std::string out(reinterpret_cast<const char*>(h), sizeof(*h));
  out.reserve(CacheBytes(*h));
  absl::StrAppend(&out, train.pixels, train.labels, test.pixels, test.labels);
  return out;
}

// Cache key: the four source files' identity (path, device, inode, size, modification and
// change times). The change time cannot be set by a user: any rewrite or replacement moves it.
absl::StatusOr<std::string> CacheKey(const std::string& dir) {
  std::string identity;
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    LOCKSTEP_ASSIGN_OR_RETURN(std::string path, FindFile(dir, name));
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot stat ", path));
    }
    absl::StrAppend(&identity, std::filesystem::absolute(path).string(), ":", st.st_dev, ":",
                    st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec,
                    ":", st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec, ";");
  }
  return absl::StrFormat("%016x", kernels::Fnv1a64(identity.data(), identity.size()));
}

// Decodes through the host-wide cache: one process decodes under an exclusive lock while the
// others wait for it, then everyone maps the same file.
absl::StatusOr<Dataset> LoadThroughCache(const std::string& dir, const std::string& cache_dir) {
  LOCKSTEP_ASSIGN_OR_RETURN(std::string key, CacheKey(dir));
  const std::string path = absl::StrCat(cache_dir, "/", key, ".idx");
  if (absl::StatusOr<Dataset> hit = MapCache(path); hit.ok()) return hit;
  std::error_code ec;
  std::filesystem::create_directories(cache_dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cache dir ", cache_dir, ": ", ec.message()));
  }
  const int lock = open(absl::StrCat(path, ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return absl::UnavailableError(absl::StrCat("cannot lock ", path));
  flock(lock, LOCK_EX);
  absl::StatusOr<Dataset> result = MapCache(path);
  if (!result.ok()) {
    CacheHeader h{};
    absl::StatusOr<std::string> encoded = EncodeIdx(dir, &h);
    if (!encoded.ok()) {
      result = encoded.status();
    } else {
      // A cache is rebuilt when lost: visible atomically is enough, no fsync.
      if (absl::Status w = WriteFileAtomically(path, *encoded, Durability::kVisible); !w.ok()) {
        result = absl::UnavailableError(absl::StrCat("writing the data set cache: ", w.message()));
      } else {
        result = MapCache(path);
      }
    }
  }
  flock(lock, LOCK_UN);
  close(lock);
  return result;
}

}  // namespace

void Split::Gather(const int64_t* idx, int count, int dim, float* out) const {
  for (int i = 0; i < count; ++i) Range(idx[i], 1, dim, out + static_cast<size_t>(i) * dim);
}

void Split::Range(int64_t begin, int count, int dim, float* out) const {
  const size_t n = static_cast<size_t>(count) * dim;
  const size_t first = static_cast<size_t>(begin) * dim;
  if (bytes != nullptr) {
    // Divide in float, as torchvision's ToTensor does, so both systems see the same inputs.
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(bytes[first + i]) / 255.0f;
  } else {
    std::memcpy(out, x.data() + first, n * sizeof(float));
  }
}

void SetDatasetCacheDir(const std::string& dir) { CacheDir() = dir; }

absl::StatusOr<Dataset> LoadIdxDataset(const std::string& dir) {
  const std::string cache_dir = CacheDir();
  if (!cache_dir.empty()) {
    absl::StatusOr<Dataset> cached = LoadThroughCache(dir, cache_dir);
    // Data problems are final; cache problems (permissions, a full /dev/shm) fall back to
    // decoding privately.
    if (cached.ok()) cached->source = dir;
    if (cached.ok() || absl::IsNotFound(cached.status()) || absl::IsDataLoss(cached.status())) {
      return cached;
    }
    LOG(WARNING) << "dataset cache unavailable (" << cached.status() << "); decoding " << dir;
  }
  CacheHeader h{};
  LOCKSTEP_ASSIGN_OR_RETURN(std::string encoded, EncodeIdx(dir, &h));
  auto storage = std::make_shared<const std::string>(std::move(encoded));
  const auto* base = reinterpret_cast<const uint8_t*>(storage->data());
  Dataset ds = FromLayout(h, base, storage);
  ds.source = dir;
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
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const Split* split : {&ds.train, &ds.test}) {
    XXH3_64bits_update(state, split->x.data(), split->x.size() * sizeof(float));
    XXH3_64bits_update(state, split->y.data(), split->y.size() * sizeof(int32_t));
  }
  ds.parts.push_back({"synthetic", XXH3_64bits_digest(state)});
  XXH3_freeState(state);
  ds.source = absl::StrCat("synthetic data set (seed ", spec.seed(), ")");
  return ds;
}

absl::StatusOr<std::shared_ptr<const Dataset>> LoadDataset(const v1::DatasetSpec& spec) {
  static absl::Mutex mu(absl::kConstInit);
  // One entry: a worker trains one job at a time, usually on the same data again.
  static std::string* cached_key = new std::string;
  static std::shared_ptr<const Dataset>* cached = new std::shared_ptr<const Dataset>;
  // The spec, and for files their identity: a worker never serves data whose files changed.
  std::string key = spec.SerializeAsString();
  if (spec.type() == "idx" || spec.type() == "fashion_mnist") {
    absl::StatusOr<std::string> identity = CacheKey(spec.path());
    if (identity.ok()) absl::StrAppend(&key, "@", *identity);
  }
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
