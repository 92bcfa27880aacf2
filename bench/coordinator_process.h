// A lockstep-coordinator the benchmarks start on loopback (a free port, a directory of its
// own), what /proc says about a process (CPU seconds, resident memory, threads), and the
// benchmarks' lists of sizes (--workers=1000,10000).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lockstep::bench {

struct ProcessStats {
  double cpu_s = 0;  // user + system
  int64_t rss_bytes = 0;
  int64_t threads = 0;
};
ProcessStats Stats(pid_t pid);

// The sizes of a list flag ("1000,8000", empty items skipped), each at least `min`;
// INVALID_ARGUMENT saying "--FLAG: "X" is not a NOUN count of MIN or more".
absl::StatusOr<std::vector<int>> ParseCounts(const std::string& flag, const std::string& text,
                                             int min, const std::string& noun);

// Starts args[0] with `args`, its stdout and stderr written to `log`.
absl::StatusOr<pid_t> Spawn(std::vector<std::string> args, const std::string& log);

// A fresh directory's path in the system's temporary one: lockstep-TAG-PID-N.
std::string TempDir(const std::string& tag, int n);

class CoordinatorProcess {
 public:
  // Starts `binary --listen=127.0.0.1:0` (plus `flags`) with its log in `dir`, and waits until
  // it serves. The process is killed on destruction; `dir` is removed unless keep_logs.
  static absl::StatusOr<std::unique_ptr<CoordinatorProcess>> Start(
      const std::string& binary, const std::string& dir, const std::vector<std::string>& flags,
      bool keep_logs);
  // Start() in TempDir(tag, n).
  static absl::StatusOr<std::unique_ptr<CoordinatorProcess>> StartInTemp(
      const std::string& binary, const std::string& tag, int n, bool keep_logs,
      const std::vector<std::string>& flags = {});
  const std::string& dir() const { return dir_; }
  ~CoordinatorProcess();
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  const std::string& log() const { return log_; }
  // Keep the directory (and say where the log is) whatever keep_logs said: something failed.
  void KeepLog() { keep_ = true; }

 private:
  CoordinatorProcess() = default;
  pid_t pid_ = 0;
  std::string dir_, log_, address_;
  bool keep_ = false;
};

}  // namespace lockstep::bench
