// Data set loading. IDX: big-endian header (magic, dims), then unsigned bytes.
#include "worker/data/dataset.h"

#include <fcntl.h>
#include <fnmatch.h>
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
#include <functional>
#include <map>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "absl/synchronization/mutex.h"
#include "common/hash.h"
#include "common/atomic_file.h"
#include "common/utf8.h"
#include "common/status_macros.h"
#include "xxhash.h"
#include "common/random.h"

namespace lockstep::worker {
namespace {

bool Stopped(StopFlag stop) { return stop != nullptr && stop->load(std::memory_order_relaxed); }
absl::Status StoppedError() { return absl::CancelledError("loading stopped: the job has ended"); }

// Reads a whole (possibly gzipped; zlib passes plain files through) file.
absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, StopFlag stop) {
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
    if (Stopped(stop)) {
      gzclose(f);
      return StoppedError();
    }
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
    return absl::DataLossError(absl::StrCat(path, ": not an unsigned-byte IDX file"));
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
    return absl::DataLossError(
        absl::StrCat(path, ": its size does not match the shape its header gives"));
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
                                   const std::string& labels_path, int32_t* dim, StopFlag stop) {
  LOCKSTEP_ASSIGN_OR_RETURN(std::string images, ReadMaybeGzip(images_path, stop));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string labels, ReadMaybeGzip(labels_path, stop));
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

absl::StatusOr<std::string> EncodeIdx(const std::string& dir, CacheHeader* h, StopFlag stop) {
  int32_t dim = 0;
  LOCKSTEP_ASSIGN_OR_RETURN(std::string train_images, FindFile(dir, "train-images-idx3-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string train_labels, FindFile(dir, "train-labels-idx1-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string test_images, FindFile(dir, "t10k-images-idx3-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(std::string test_labels, FindFile(dir, "t10k-labels-idx1-ubyte"));
  LOCKSTEP_ASSIGN_OR_RETURN(RawSplit train, ReadSplit(train_images, train_labels, &dim, stop));
  LOCKSTEP_ASSIGN_OR_RETURN(RawSplit test, ReadSplit(test_images, test_labels, &dim, stop));
  std::memcpy(h->magic, kCacheMagic, sizeof(kCacheMagic));
  h->train_samples = train.samples;
  h->test_samples = test.samples;
  h->dim = dim;
  std::string out(reinterpret_cast<const char*>(h), sizeof(*h));
  out.reserve(CacheBytes(*h));
  absl::StrAppend(&out, train.pixels, train.labels, test.pixels, test.labels);
  return out;
}

// What identifies a file's content without reading it: path, device, inode, size,
// modification and change times. The change time cannot be set by a user: any rewrite or
// replacement moves it.
absl::StatusOr<std::string> FileIdentity(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("cannot stat ", path));
  return absl::StrCat(std::filesystem::absolute(path).string(), ":", st.st_dev, ":", st.st_ino,
                      ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ":",
                      st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec, ";");
}

std::string HexKey(const std::string& identity) {
  return absl::StrFormat("%016x", Fnv1a64(identity.data(), identity.size()));
}

// Cache key of an IDX directory: its four files' identity.
absl::StatusOr<std::string> CacheKey(const std::string& dir) {
  std::string identity;
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    LOCKSTEP_ASSIGN_OR_RETURN(std::string path, FindFile(dir, name));
    LOCKSTEP_ASSIGN_OR_RETURN(std::string id, FileIdentity(path));
    identity += id;
  }
  return HexKey(identity);
}

// A read-only shared mapping of a whole file (what a Dataset's `storage` keeps alive).
struct Mapping {
  const uint8_t* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> storage;
};

// NOT_FOUND when the file is absent; an empty file maps to size 0.
absl::StatusOr<Mapping> MapReadOnly(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::PermissionDeniedError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path));
  }
  Mapping m;
  m.size = static_cast<size_t>(st.st_size);
  if (m.size == 0) {
    close(fd);
    return m;
  }
  void* mapped = mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path));
  const size_t bytes = m.size;
  m.data = static_cast<const uint8_t*>(mapped);
  m.storage = std::shared_ptr<const void>(
      mapped, [bytes](const void* p) { munmap(const_cast<void*>(p), bytes); });
  return m;
}

// Decoded data shared by the processes of a host: maps cache_dir/name when it exists and
// `valid` accepts it; otherwise one process builds it under an exclusive lock while the others
// wait for it, and everyone maps the same file. UNAVAILABLE when the cache itself fails (the
// caller may build privately); the builder's errors as they are.
absl::StatusOr<Mapping> ThroughCache(const std::string& cache_dir, const std::string& name,
                                     const std::function<bool(const Mapping&)>& valid,
                                     const std::function<absl::StatusOr<std::string>()>& build) {
  const std::string path = absl::StrCat(cache_dir, "/", name);
  auto map_valid = [&]() -> absl::StatusOr<Mapping> {
    absl::StatusOr<Mapping> m = MapReadOnly(path);
    if (m.ok() && !valid(*m)) return absl::DataLossError(absl::StrCat("malformed cache file ", path));
    return m;
  };
  if (absl::StatusOr<Mapping> hit = map_valid(); hit.ok()) return hit;
  std::error_code ec;
  std::filesystem::create_directories(cache_dir, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cache dir ", cache_dir, ": ", ec.message()));
  }
  const int lock = open(absl::StrCat(path, ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return absl::UnavailableError(absl::StrCat("cannot lock ", path));
  flock(lock, LOCK_EX);
  absl::StatusOr<Mapping> result = map_valid();
  if (!result.ok()) {
    absl::StatusOr<std::string> built = build();
    if (!built.ok()) {
      result = built.status();
    } else if (absl::Status w = WriteFileAtomically(path, *built, Durability::kVisible); !w.ok()) {
      // A cache is rebuilt when lost: visible atomically is enough, no fsync.
      result = absl::UnavailableError(absl::StrCat("writing the data set cache: ", w.message()));
    } else {
      result = map_valid();
      if (!result.ok()) result = absl::UnavailableError(result.status().message());
    }
  }
  flock(lock, LOCK_UN);
  close(lock);
  return result;
}

bool IdxCacheValid(const Mapping& m) {
  CacheHeader h{};
  if (m.size < sizeof(h)) return false;
  std::memcpy(&h, m.data, sizeof(h));
  return std::memcmp(h.magic, kCacheMagic, sizeof(kCacheMagic)) == 0 && h.train_samples > 0 &&
         h.test_samples > 0 && h.dim > 0 && m.size == CacheBytes(h);
}

Dataset FromIdxMapping(Mapping m) {
  CacheHeader h{};
  std::memcpy(&h, m.data, sizeof(h));
  return FromLayout(h, m.data, std::move(m.storage));
}

absl::StatusOr<Dataset> LoadThroughCache(const std::string& dir, const std::string& cache_dir,
                                         StopFlag stop) {
  LOCKSTEP_ASSIGN_OR_RETURN(std::string key, CacheKey(dir));
  LOCKSTEP_ASSIGN_OR_RETURN(Mapping m, ThroughCache(cache_dir, key + ".idx", IdxCacheValid, [&] {
                              CacheHeader h{};
                              return EncodeIdx(dir, &h, stop);
                            }));
  return FromIdxMapping(std::move(m));
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

absl::StatusOr<Dataset> LoadIdxDataset(const std::string& dir, StopFlag stop) {
  const std::string cache_dir = CacheDir();
  if (!cache_dir.empty()) {
    absl::StatusOr<Dataset> cached = LoadThroughCache(dir, cache_dir, stop);
    // Data problems are final; cache problems (permissions, a full /dev/shm) fall back to
    // decoding privately.
    if (cached.ok()) cached->source = dir;
    if (cached.ok() || absl::IsNotFound(cached.status()) || absl::IsDataLoss(cached.status()) ||
        absl::IsCancelled(cached.status())) {
      return cached;
    }
    LOG(WARNING) << "dataset cache unavailable (" << cached.status() << "); decoding " << dir;
  }
  CacheHeader h{};
  LOCKSTEP_ASSIGN_OR_RETURN(std::string encoded, EncodeIdx(dir, &h, stop));
  auto storage = std::make_shared<const std::string>(std::move(encoded));
  const auto* base = reinterpret_cast<const uint8_t*>(storage->data());
  Dataset ds = FromLayout(h, base, storage);
  ds.source = dir;
  return ds;
}

Dataset MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec) {
  return MakeSyntheticDataset(spec, nullptr).value();
}

absl::StatusOr<Dataset> MakeSyntheticDataset(const v1::SyntheticDatasetSpec& spec, StopFlag stop) {
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
      // Every sample: with wide inputs and many classes one takes milliseconds (a check every
      // 1,024 of them let a cancelled job hold its worker for 20 s).
      if (Stopped(stop)) return std::optional<Split>();
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
    return std::optional<Split>(std::move(split));
  };
  Dataset ds;
  ds.dim = dim;
  ds.classes = classes;
  std::optional<Split> train = make_split(spec.train_samples());
  if (!train.has_value()) return StoppedError();
  std::optional<Split> test = make_split(spec.test_samples());
  if (!test.has_value()) return StoppedError();
  ds.train = *std::move(train);
  ds.test = *std::move(test);
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

namespace {

// Text read from a directory, concatenated: a header, then the bytes.
struct TextCacheHeader {
  char magic[8];
  uint64_t bytes;
  uint64_t files;
};
constexpr char kTextCacheMagic[8] = {'L', 'S', 'T', 'X', 'T', 'v', '1', '\0'};

// Why `data` is not text we train on, or empty.
std::string NotText(std::string_view data) {
  if (const size_t nul = data.find('\0'); nul != std::string_view::npos) {
    return absl::StrCat("a NUL byte at offset ", nul, " (binary data)");
  }
  if (const size_t bad = FirstInvalidUtf8(data); bad != std::string_view::npos) {
    return absl::StrCat("not UTF-8 text (byte ", bad, ")");
  }
  return "";
}

bool HasGlob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// The files a text source names: `path` itself, the entries of a directory, or those of its
// directory matching its last component's glob; regular files only, in name order.
struct TextSource {
  std::vector<std::string> files;
  std::vector<std::string> skipped;  // "name: why"
  bool single_file = false;
};

absl::StatusOr<TextSource> ListTextSource(const std::string& path) {
  TextSource source;
  std::error_code ec;
  std::filesystem::path dir = path, pattern;
  if (HasGlob(dir.filename().string())) {
    pattern = dir.filename();
    dir = dir.parent_path();
  } else if (std::filesystem::is_regular_file(path, ec)) {
    source.files.push_back(path);
    source.single_file = true;
    return source;
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("text data set ", path, " does not exist"));
  }
  std::vector<std::filesystem::directory_entry> entries;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) entries.push_back(entry);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir.string(), ": ", ec.message()));
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string();
    if (!pattern.empty() && fnmatch(pattern.c_str(), name.c_str(), 0) != 0) continue;
    if (entry.is_symlink(ec)) {
      source.skipped.push_back(name + ": a link");
    } else if (!entry.is_regular_file(ec)) {
      source.skipped.push_back(name + ": not a regular file");
    } else {
      source.files.push_back(entry.path().string());
    }
  }
  return source;
}

// The source's text files concatenated behind a TextCacheHeader; the files that are not text
// are left out and named in `skipped`.
absl::StatusOr<std::string> ConcatenateText(TextSource* source, StopFlag stop) {
  std::string out(sizeof(TextCacheHeader), '\0');
  TextCacheHeader h{};
  std::memcpy(h.magic, kTextCacheMagic, sizeof(h.magic));
  for (const std::string& file : source->files) {
    if (Stopped(stop)) return StoppedError();
    std::ifstream in(file, std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) return absl::DataLossError(absl::StrCat("cannot read ", file));
    if (std::string why = NotText(data); !why.empty()) {
      source->skipped.push_back(absl::StrCat(std::filesystem::path(file).filename().string(), ": ", why));
      continue;
    }
    out += data;
    ++h.files;
  }
  h.bytes = out.size() - sizeof(h);
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

bool TextCacheValid(const Mapping& m) {
  TextCacheHeader h{};
  if (m.size < sizeof(h)) return false;
  std::memcpy(&h, m.data, sizeof(h));
  return std::memcmp(h.magic, kTextCacheMagic, sizeof(h.magic)) == 0 &&
         m.size == sizeof(h) + h.bytes;
}

uint64_t HashTokens(const TokenSplit& split) {
  return split.ids != nullptr ? XXH3_64bits(split.ids, split.tokens * sizeof(uint16_t))
                              : XXH3_64bits(split.bytes, split.tokens);
}

int32_t MaxToken(const TokenSplit& split) {
  int32_t best = -1;
  if (split.ids != nullptr) {
    uint16_t m = 0;
    for (int64_t i = 0; i < split.tokens; ++i) m = std::max(m, split.ids[i]);
    if (split.tokens > 0) best = m;
  } else {
    uint8_t m = 0;
    for (int64_t i = 0; i < split.tokens; ++i) m = std::max(m, split.bytes[i]);
    if (split.tokens > 0) best = m;
  }
  return best;
}

// llm.c's token files: 256 int32 (magic, version, token count, unused), then uint16 tokens.
constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

absl::StatusOr<TokenSplit> MapTokenFile(const std::string& path, std::shared_ptr<const void>* storage) {
  absl::StatusOr<Mapping> m = MapReadOnly(path);
  if (!m.ok()) {
    return absl::IsNotFound(m.status())
               ? absl::NotFoundError(absl::StrCat("token file ", path, " does not exist"))
               : m.status();
  }
  TokenSplit split;
  int32_t header[3] = {0, 0, 0};
  if (m->size >= kLlmcHeaderBytes) std::memcpy(header, m->data, sizeof(header));
  if (header[0] == kLlmcMagic) {
    if (header[1] != 1) {
      return absl::DataLossError(
          absl::StrCat(path, ": an llm.c token file of another version (expected 1)"));
    }
    const size_t payload = m->size - kLlmcHeaderBytes;
    if (header[2] < 0 || payload != static_cast<size_t>(header[2]) * sizeof(uint16_t)) {
      return absl::DataLossError(absl::StrCat(
          path, ": the llm.c header's token count does not match the file's size (2 bytes a "
                "token)"));
    }
    split.ids = reinterpret_cast<const uint16_t*>(m->data + kLlmcHeaderBytes);
    split.tokens = header[2];
  } else {
    // A header in llm.c's shape (version 1, a count that matches the size) with another magic
    // is a damaged or foreign header, not tokens.
    if (m->size >= kLlmcHeaderBytes && header[1] == 1 && header[2] > 0 &&
        m->size - kLlmcHeaderBytes == static_cast<size_t>(header[2]) * sizeof(uint16_t)) {
      return absl::DataLossError(
          absl::StrCat(path, ": a damaged header (its magic is not llm.c's 20240520)"));
    }
    if (m->size % sizeof(uint16_t) != 0) {
      return absl::DataLossError(absl::StrCat(
          path, ": an odd number of bytes: not uint16 tokens, and no llm.c header (magic "
                "20240520)"));
    }
    split.ids = reinterpret_cast<const uint16_t*>(m->data);
    split.tokens = static_cast<int64_t>(m->size / sizeof(uint16_t));
  }
  if (split.tokens == 0) return absl::DataLossError(absl::StrCat(path, ": holds no tokens"));
  *storage = m->storage;
  return split;
}

}  // namespace

absl::StatusOr<Dataset> LoadTextDataset(const std::string& path, double validation_fraction,
                                        StopFlag stop) {
  if (!(validation_fraction > 0 && validation_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.validation_fraction must be in (0, 1), got ", validation_fraction));
  }
  LOCKSTEP_ASSIGN_OR_RETURN(TextSource source, ListTextSource(path));
  Mapping text;
  size_t files = source.files.size();
  if (source.single_file) {
    LOCKSTEP_ASSIGN_OR_RETURN(text, MapReadOnly(path));
    const std::string_view data(reinterpret_cast<const char*>(text.data), text.size);
    if (std::string why = NotText(data); !why.empty()) {
      return absl::DataLossError(absl::StrCat(path, ": ", why));
    }
  } else {
    // The directory's text is concatenated once per host, in the cache, and mapped by every
    // worker; keyed by the identity of every file considered.
    std::string identity = std::filesystem::absolute(path).string() + "|";
    for (const std::string& f : source.files) {
      LOCKSTEP_ASSIGN_OR_RETURN(std::string id, FileIdentity(f));
      identity += id;
    }
    bool built_here = false;
    auto build = [&]() {
      built_here = true;
      return ConcatenateText(&source, stop);
    };
    absl::StatusOr<Mapping> mapped = absl::UnavailableError("no cache");
    if (!CacheDir().empty()) {
      mapped = ThroughCache(CacheDir(), HexKey(identity) + ".txt", TextCacheValid, build);
      if (!mapped.ok() && !absl::IsUnavailable(mapped.status())) return mapped.status();
    }
    if (!mapped.ok()) {
      if (!CacheDir().empty()) {
        LOG(WARNING) << "dataset cache unavailable (" << mapped.status() << "); reading " << path;
      }
      LOCKSTEP_ASSIGN_OR_RETURN(std::string concatenated, build());
      auto storage = std::make_shared<const std::string>(std::move(concatenated));
      mapped = Mapping{reinterpret_cast<const uint8_t*>(storage->data()), storage->size(), storage};
    }
    TextCacheHeader h{};
    std::memcpy(&h, mapped->data, sizeof(h));
    files = h.files;
    text = *std::move(mapped);
    text.data += sizeof(h);
    text.size -= sizeof(h);
    // When another process of the host built the cache, it checked the files and logged what
    // it left out; this one only knows how many.
    if (!built_here && files < source.files.size()) {
      source.skipped.push_back(absl::StrCat(source.files.size() - files,
                                            " files that are not UTF-8 text"));
    }
    if (files == 0 || text.size == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "text data set ", path, " holds no UTF-8 text (", source.skipped.size(),
          " entries skipped", source.skipped.empty() ? "" : ": " + source.skipped.front(), ")"));
    }
  }
  if (!source.skipped.empty()) {
    LOG(INFO) << path << ": read " << files << " text files; skipped " << source.skipped.size()
              << " (" << absl::StrJoin(source.skipped.begin(),
                                        source.skipped.begin() +
                                            std::min<size_t>(5, source.skipped.size()),
                                        "; ")
              << (source.skipped.size() > 5 ? "; ..." : "") << ")";
  }
  Dataset ds;
  ds.language = true;
  ds.text = true;
  const int64_t total = static_cast<int64_t>(text.size);
  const int64_t held_out = static_cast<int64_t>(std::llround(total * validation_fraction));
  ds.train_tokens.bytes = text.data;
  ds.train_tokens.tokens = total - held_out;
  ds.valid_tokens.bytes = text.data + (total - held_out);
  ds.valid_tokens.tokens = held_out;
  ds.max_token = std::max(MaxToken(ds.train_tokens), MaxToken(ds.valid_tokens));
  ds.parts.push_back({"training text", HashTokens(ds.train_tokens)});
  ds.parts.push_back({"validation text", HashTokens(ds.valid_tokens)});
  ds.source = absl::StrCat(path, " (", files, files == 1 ? " text file, " : " text files, ",
                           total, " bytes)");
  ds.storage = std::move(text.storage);
  return ds;
}

absl::StatusOr<Dataset> LoadTokenDataset(const std::string& train_path,
                                         const std::string& validation_path) {
  if (validation_path.empty()) {
    return absl::InvalidArgumentError("dataset.validation_path is required for token files");
  }
  std::shared_ptr<const void> train_storage, valid_storage;
  Dataset ds;
  ds.language = true;
  LOCKSTEP_ASSIGN_OR_RETURN(ds.train_tokens, MapTokenFile(train_path, &train_storage));
  LOCKSTEP_ASSIGN_OR_RETURN(ds.valid_tokens, MapTokenFile(validation_path, &valid_storage));
  ds.max_token = std::max(MaxToken(ds.train_tokens), MaxToken(ds.valid_tokens));
  ds.parts.push_back({std::filesystem::path(train_path).filename().string(),
                      HashTokens(ds.train_tokens)});
  ds.parts.push_back({std::filesystem::path(validation_path).filename().string(),
                      HashTokens(ds.valid_tokens)});
  ds.source = absl::StrCat(train_path, " and ", validation_path);
  // One owner keeping both mappings alive.
  ds.storage = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(
      std::move(train_storage), std::move(valid_storage));
  return ds;
}

absl::StatusOr<std::shared_ptr<const Dataset>> LoadDataset(const v1::DatasetSpec& spec,
                                                           StopFlag stop) {
  static absl::Mutex mu(absl::kConstInit);
  // One entry: a worker trains one job at a time, usually on the same data again.
  static std::string* cached_key = new std::string;
  static std::shared_ptr<const Dataset>* cached = new std::shared_ptr<const Dataset>;
  // The spec, and for files their identity: a worker never serves data whose files changed.
  std::string key = spec.SerializeAsString();
  if (spec.type() == "idx" || spec.type() == "fashion_mnist") {
    absl::StatusOr<std::string> identity = CacheKey(spec.path());
    if (identity.ok()) absl::StrAppend(&key, "@", *identity);
  } else if (spec.type() == "text") {
    // The directory's listing and each file's identity.
    if (absl::StatusOr<TextSource> source = ListTextSource(spec.path()); source.ok()) {
      for (const std::string& f : source->files) {
        if (absl::StatusOr<std::string> id = FileIdentity(f); id.ok()) absl::StrAppend(&key, "@", *id);
      }
    }
  } else if (spec.type() == "tokens") {
    for (const std::string& f : {spec.path(), spec.validation_path()}) {
      if (absl::StatusOr<std::string> id = FileIdentity(f); id.ok()) absl::StrAppend(&key, "@", *id);
    }
  }
  absl::MutexLock lock(&mu);
  if (*cached != nullptr && *cached_key == key) return *cached;
  std::shared_ptr<Dataset> ds;
  if (spec.type() == "synthetic") {
    absl::StatusOr<Dataset> made = MakeSyntheticDataset(spec.synthetic(), stop);
    if (!made.ok()) return made.status();
    ds = std::make_shared<Dataset>(*std::move(made));
  } else if (spec.type() == "idx" || spec.type() == "fashion_mnist") {
    absl::StatusOr<Dataset> loaded = LoadIdxDataset(spec.path(), stop);
    if (!loaded.ok()) return loaded.status();
    ds = std::make_shared<Dataset>(*std::move(loaded));
  } else if (spec.type() == "text") {
    absl::StatusOr<Dataset> loaded = LoadTextDataset(
        spec.path(), spec.validation_fraction() > 0 ? spec.validation_fraction() : 0.05, stop);
    if (!loaded.ok()) return loaded.status();
    ds = std::make_shared<Dataset>(*std::move(loaded));
  } else if (spec.type() == "tokens") {
    absl::StatusOr<Dataset> loaded = LoadTokenDataset(spec.path(), spec.validation_path());
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
