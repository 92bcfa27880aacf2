// Replacing a file atomically: a reader (or a crash) sees the old contents or the new ones,
// never a mix. The one place that writes files this way: job records, checkpoints, the data
// set cache, status and port files.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lockstep {

enum class Durability {
  // Temporary file, rename. Enough for files that are rewritten often and whose loss in a
  // power failure costs nothing (status files, caches that are rebuilt).
  kVisible,
  // Temporary file, fsync, rename, fsync of the directory: once this returns OK the new
  // contents survive a crash of the machine (job records, checkpoints).
  kDurable,
};

// Writes the concatenation of `pieces` to `path`. Errors name the file and the system call
// and carry errno's text: RESOURCE_EXHAUSTED for a full disk or quota (ENOSPC, EDQUOT, EFBIG),
// PERMISSION_DENIED (EACCES, EPERM, EROFS), NOT_FOUND (the directory is missing), INTERNAL
// otherwise. The temporary file is removed on every failure.
absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<absl::string_view> pieces,
                                 Durability durability);
inline absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes,
                                        Durability durability) {
  return WriteFileAtomically(path, {bytes}, durability);
}

// The same for contents too large to hold at once: `produce` calls `write` with the contents
// in order; its error (or write's) removes the temporary file and is returned.
using AtomicWrite = std::function<absl::Status(const void* data, size_t n)>;
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(const AtomicWrite&)>& produce,
                                 Durability durability);

// The status for a failed system call `what` on `path` with `err` (an errno value), with the
// code chosen as above: "writing /d/f.tmp: No space left on device".
absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path);

}  // namespace lockstep
