// What the data formats share (worker/data/*.cc): reading and mapping files, a file's
// identity, the host's cache of decoded data, the loading's stop flag, and token statistics.
// Internal to worker/data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/data/dataset.h"

namespace lockstep::worker {

bool Stopped(StopFlag stop);
// CANCELLED: the job has ended.
absl::Status StoppedError();

// Reads a whole (possibly gzipped; zlib passes plain files through) file.
absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, StopFlag stop);

// The host's cache directory (SetDatasetCacheDir; empty: no cache).
std::string& CacheDir();

// What identifies a file's content without reading it: path, device, inode, size,
// modification and change times. The change time cannot be set by a user: any rewrite or
// replacement moves it.
absl::StatusOr<std::string> FileIdentity(const std::string& path);
// A cache file's name for an identity: 16 hex digits.
std::string HexKey(const std::string& identity);

// A read-only shared mapping of a whole file (what a Dataset's `storage` keeps alive).
struct Mapping {
  const uint8_t* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> storage;
};

// NOT_FOUND when the file is absent; an empty file maps to size 0.
absl::StatusOr<Mapping> MapReadOnly(const std::string& path);

// Decoded data shared by the processes of a host: maps cache_dir/name when it exists and
// `valid` accepts it; otherwise one process builds it under an exclusive lock while the others
// wait for it, and everyone maps the same file. UNAVAILABLE when the cache itself fails (the
// caller may build privately); the builder's errors as they are.
absl::StatusOr<Mapping> ThroughCache(const std::string& cache_dir, const std::string& name,
                                     const std::function<bool(const Mapping&)>& valid,
                                     const std::function<absl::StatusOr<std::string>()>& build);

// A token split's content hash, and its largest token (-1 when empty).
uint64_t HashTokens(const TokenSplit& split);
int32_t MaxToken(const TokenSplit& split);

// The formats, for LoadDataset's table (dataset.cc): what identifies a spec's files (appended to
// the process cache's key; empty for generated data) and the loading.
std::string IdxIdentity(const v1::DatasetSpec& spec);
std::string TextIdentity(const v1::DatasetSpec& spec);
std::string TokensIdentity(const v1::DatasetSpec& spec);

}  // namespace lockstep::worker
