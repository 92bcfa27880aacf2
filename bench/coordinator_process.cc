// Starting a coordinator for a benchmark, and reading /proc.
#include "bench/coordinator_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace lockstep::bench {

ProcessStats Stats(pid_t pid) {
  ProcessStats s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() >= 2 && f[0] == "VmRSS:") s.rss_bytes = std::stoll(f[1]) * 1024;
    if (f.size() >= 2 && f[0] == "Threads:") s.threads = std::stoll(f[1]);
  }
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
  std::vector<std::string> f = absl::StrSplit(all.substr(all.rfind(')') + 2), ' ');
  if (f.size() > 12) {
    s.cpu_s = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return s;
}

absl::StatusOr<pid_t> Spawn(std::vector<std::string> args, const std::string& log) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (spawned != 0) return absl::UnavailableError("cannot start " + args.front());
  return pid;
}

absl::StatusOr<std::unique_ptr<CoordinatorProcess>> CoordinatorProcess::Start(
    const std::string& binary, const std::string& dir, const std::vector<std::string>& flags,
    bool keep_logs) {
  std::unique_ptr<CoordinatorProcess> p(new CoordinatorProcess());
  p->dir_ = dir;
  p->log_ = dir + "/coordinator.log";
  p->keep_ = keep_logs;
  std::filesystem::create_directories(dir);
  const std::string port_file = dir + "/port";
  std::vector<std::string> args = {binary, "--listen=127.0.0.1:0", "--port_file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  absl::StatusOr<pid_t> pid = Spawn(std::move(args), p->log_);
  if (!pid.ok()) return pid.status();
  p->pid_ = *pid;
  std::string port;
  for (int i = 0; i < 200 && port.empty(); ++i) {
    std::ifstream(port_file) >> port;
    int parsed = 0;
    if (!absl::SimpleAtoi(port, &parsed) || parsed <= 0) port.clear();
    if (port.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  if (port.empty()) {
    p->KeepLog();
    return absl::UnavailableError("the coordinator wrote no port file; its log: " + p->log_);
  }
  p->address_ = "127.0.0.1:" + port;
  return p;
}

CoordinatorProcess::~CoordinatorProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (keep_) {
    std::cerr << "the coordinator's log: " << log_ << "\n";
  } else {
    std::filesystem::remove_all(dir_);
  }
}

std::string TempDir(const std::string& tag, int n) {
  return absl::StrCat(std::filesystem::temp_directory_path().string(), "/lockstep-", tag, "-",
                      getpid(), "-", n);
}

absl::StatusOr<std::unique_ptr<CoordinatorProcess>> CoordinatorProcess::StartInTemp(
    const std::string& binary, const std::string& tag, int n, bool keep_logs,
    const std::vector<std::string>& flags) {
  return Start(binary, TempDir(tag, n), flags, keep_logs);
}

absl::StatusOr<std::vector<int>> ParseCounts(const std::string& flag, const std::string& text,
                                             int min, const std::string& noun) {
  std::vector<int> counts;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(item, &n) || n < min) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", item, "\" is not a ", noun,
                                                     " count of ", min, " or more"));
    }
    counts.push_back(n);
  }
  return counts;
}

}  // namespace lockstep::bench
