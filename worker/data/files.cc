#include "worker/data/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "xxhash.h"

namespace lockstep::worker {

bool Stopped(StopFlag stop) { return stop != nullptr && stop->load(std::memory_order_relaxed); }

absl::Status StoppedError() { return absl::CancelledError("loading stopped: the job has ended"); }

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

std::string& CacheDir() {
  static std::string* dir = new std::string("/dev/shm/lockstep-cache");
  return *dir;
}

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

}  // namespace lockstep::worker
