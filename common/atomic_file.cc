// Atomic file replacement with errno kept in every error.
#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace lockstep {
namespace {

// Unique per call, so concurrent writers of one path (two threads, two processes sharing a
// directory) never share a temporary file.
std::string TempName(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", getpid(), ".", counter.fetch_add(1));
}

std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<absl::string_view> pieces,
                                 Durability durability) {
  return WriteFileAtomically(
      path,
      [&](const AtomicWrite& write) {
        for (absl::string_view piece : pieces) {
          if (absl::Status s = write(piece.data(), piece.size()); !s.ok()) return s;
        }
        return absl::OkStatus();
      },
      durability);
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(const AtomicWrite&)>& produce,
                                 Durability durability) {
  const std::string tmp = TempName(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "creating", tmp);
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, what, tmp);
  };
  const absl::Status produced = produce([&](const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    size_t written = 0;
    while (written < size) {
      const ssize_t n = ::write(fd, bytes + written, size - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return ErrnoStatus(n < 0 ? errno : EIO, "writing", tmp);
      written += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  });
  if (!produced.ok()) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return produced;
  }
  // The data must be on disk before the name says it exists.
  if (durability == Durability::kDurable && ::fsync(fd) != 0) return fail("fsync of");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, "closing", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, "renaming to", path);
  }
  if (durability == Durability::kDurable) {
    // The rename itself must be on disk before callers act on it (delete older checkpoints).
    const std::string dir = Directory(path);
    const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return ErrnoStatus(errno, "opening directory", dir);
    const int rc = ::fsync(dir_fd);
    const int err = errno;
    ::close(dir_fd);
    if (rc != 0) return ErrnoStatus(err, "fsync of directory", dir);
  }
  return absl::OkStatus();
}

}  // namespace lockstep
