// The directories a job's paths may lie in (--data_root, --checkpoint_root on the coordinator
// and the workers): a spec's data, checkpoint and output paths must resolve inside them, so a
// job can read and write only where the operator allows, whatever it asks for.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lockstep {

// The daemons' defaults (--data_root, --checkpoint_root): Lockstep's own directories, and the
// Debian data the examples use (Fashion-MNIST from dataset-fashion-mnist, the fortunes text).
// Out of the box a job reads and writes nowhere else; "/" opts out, on purpose.
inline constexpr char kDefaultDataRoots[] =
    "/var/lib/lockstep/data,/usr/share/datasets,/usr/share/games/fortunes";
inline constexpr char kDefaultCheckpointRoots[] = "/var/lib/lockstep/checkpoints";

class PathRoots {
 public:
  // From a flag: comma-separated absolute directories. Empty: no restriction. INVALID_ARGUMENT
  // for a relative or malformed entry.
  static absl::StatusOr<PathRoots> Parse(const std::string& flag);

  bool restricted() const { return !roots_.empty(); }
  // A root is "/": any absolute path is allowed.
  bool allows_any_path() const;
  const std::vector<std::string>& roots() const { return roots_; }
  // "/data, /srv/lockstep" (for messages).
  std::string Describe() const;

  // What the coordinator can check: `path` is absolute, has no ".." component, and lies in a
  // root (by its components). INVALID_ARGUMENT naming `field` otherwise; OK when unrestricted
  // or `path` is empty.
  absl::Status Check(const std::string& field, const std::string& path) const;
  // What a worker checks on its host before it opens `path`: the same, and the path's real
  // location (symlinks resolved; for a path that does not exist yet, its nearest existing
  // ancestor's) lies in a root's real location. PERMISSION_DENIED naming `field` for an escape.
  absl::Status CheckOnHost(const std::string& field, const std::string& path) const;

 private:
  std::vector<std::string> roots_;  // normalized: absolute, no trailing '/'
};

// Both daemons' --data_root and --checkpoint_root, parsed into `data` and `checkpoints`;
// INVALID_ARGUMENT naming the flag, also for an empty one (a daemon always has roots: "/" is
// how an operator allows any path).
absl::Status ParseRootFlags(const std::string& data_root_flag,
                            const std::string& checkpoint_root_flag, PathRoots* data,
                            PathRoots* checkpoints);

// Whether `path` is `root` or below it, comparing whole components ("/data2" is not in "/data").
bool PathIsWithin(const std::string& path, const std::string& root);

}  // namespace lockstep
