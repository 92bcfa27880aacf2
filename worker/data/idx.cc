// IDX data sets (MNIST's format): a big-endian header (magic, dims), then unsigned bytes; four
// files per data set, decoded once per host into the cache.
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "worker/data/files.h"
#include "xxhash.h"

namespace lockstep::worker {
namespace {

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

std::string IdxIdentity(const v1::DatasetSpec& spec) {
  absl::StatusOr<std::string> identity = CacheKey(spec.path());
  return identity.ok() ? *identity : "";
}

}  // namespace lockstep::worker
