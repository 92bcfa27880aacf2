// Data sets: the split accessors, and LoadDataset over the formats (worker/data/idx.cc,
// synthetic.cc, text.cc, tokens.cc), one line each in its table.
#include "worker/data/dataset.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/data/files.h"

namespace lockstep::worker {
namespace {

// A format as the worker loads it (its validation and defaults: common/data_format.cc).
struct FormatLoader {
  const char* name;  // dataset.type
  // What identifies the spec's files (appended to the process cache's key); null: generated.
  std::string (*identity)(const v1::DatasetSpec& spec);
  absl::StatusOr<Dataset> (*load)(const v1::DatasetSpec& spec, StopFlag stop);
};

absl::StatusOr<Dataset> LoadIdx(const v1::DatasetSpec& spec, StopFlag stop) {
  return LoadIdxDataset(spec.path(), stop);
}
absl::StatusOr<Dataset> LoadSynthetic(const v1::DatasetSpec& spec, StopFlag stop) {
  return MakeSyntheticDataset(spec.synthetic(), stop);
}
absl::StatusOr<Dataset> LoadText(const v1::DatasetSpec& spec, StopFlag stop) {
  return LoadTextDataset(
      spec.path(), spec.validation_fraction() > 0 ? spec.validation_fraction() : 0.05, stop);
}
absl::StatusOr<Dataset> LoadTokens(const v1::DatasetSpec& spec, StopFlag /*stop*/) {
  return LoadTokenDataset(spec.path(), spec.validation_path());
}

constexpr FormatLoader kFormats[] = {{"fashion_mnist", IdxIdentity, LoadIdx},
                                     {"idx", IdxIdentity, LoadIdx},
                                     {"synthetic", nullptr, LoadSynthetic},
                                     {"text", TextIdentity, LoadText},
                                     {"tokens", TokensIdentity, LoadTokens}};

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

absl::StatusOr<std::shared_ptr<const Dataset>> LoadDataset(const v1::DatasetSpec& spec,
                                                           StopFlag stop) {
  const FormatLoader* format = nullptr;
  for (const FormatLoader& f : kFormats) {
    if (spec.type() == f.name) format = &f;
  }
  if (format == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dataset type \"", spec.type(), "\""));
  }
  static absl::Mutex mu(absl::kConstInit);
  // One entry: a worker trains one job at a time, usually on the same data again.
  static std::string* cached_key = new std::string;
  static std::shared_ptr<const Dataset>* cached = new std::shared_ptr<const Dataset>;
  // The spec, and for files their identity: a worker never serves data whose files changed.
  std::string key = spec.SerializeAsString();
  if (format->identity != nullptr) {
    const std::string identity = format->identity(spec);
    if (!identity.empty()) absl::StrAppend(&key, "@", identity);
  }
  absl::MutexLock lock(&mu);
  if (*cached != nullptr && *cached_key == key) return *cached;
  absl::StatusOr<Dataset> loaded = format->load(spec, stop);
  if (!loaded.ok()) return loaded.status();
  *cached_key = key;
  *cached = std::make_shared<Dataset>(*std::move(loaded));
  return *cached;
}

}  // namespace lockstep::worker
