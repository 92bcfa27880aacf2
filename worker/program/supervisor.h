// A program's processes, supervised so that none outlives its stop or its worker.
//
// Launch forks a supervisor (a copy of the worker that never returns to the worker's code and
// uses only async-signal-safe calls), which forks the program into a process group of its own
// and stays as its subreaper. The supervisor ends the whole group, grandchildren included:
//   - when the worker asks (Stop): SIGTERM to the group, SIGKILL after the grace;
//   - when the worker dies, however (PR_SET_PDEATHSIG): the same;
//   - when the program's main process exits: whatever it left behind in its group gets the
//     same treatment.
// It reports the main process's end (or why exec failed) on a pipe and exits once the group
// is empty. A process that leaves the group on purpose (setsid) escapes it; the worker's
// service manager (KillMode=control-group) is the backstop for those.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lockstep::worker {

// Who the program runs as: its ids and home (unset uid: the worker's own user).
struct ProgramCredentials {
  bool switch_user = false;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
};

struct LaunchSpec {
  std::string executable;          // the resolved path given to execve
  std::vector<std::string> argv;   // argv[0] as the user wrote it
  std::vector<std::string> env;    // "NAME=value"
  std::string workdir;
  ProgramCredentials credentials;
  absl::Duration stop_grace = absl::Seconds(5);
  // A descriptor the program gets as its fd 4 (-1: none): how a warm interpreter
  // (worker/program/warm_start.h) learns what to run. Launch leaves it open; the caller closes
  // its copy.
  int handoff_fd = -1;
};

// How the program's main process ended.
struct ProcessEnd {
  bool exec_failed = false;  // it never ran: exec_errno says why
  int exec_errno = 0;
  bool signaled = false;
  int exit_code = 0;  // when it exited
  int signal = 0;     // when a signal ended it
};

class SupervisedProgram {
 public:
  // Starts the supervisor and the program. Its standard output and error come on
  // stdout_fd() and stderr_fd() (non-blocking; the caller reads them), standard input is
  // /dev/null.
  static absl::StatusOr<std::unique_ptr<SupervisedProgram>> Launch(const LaunchSpec& spec);
  // Stops what still runs and waits for the supervisor: the grace and 10 s more, then the
  // group and the supervisor get SIGKILL from here (a supervisor that cannot run, stopped by
  // a debugger, say).
  ~SupervisedProgram();
  SupervisedProgram(const SupervisedProgram&) = delete;
  SupervisedProgram& operator=(const SupervisedProgram&) = delete;

  int stdout_fd() const { return out_fd_; }
  int stderr_fd() const { return err_fd_; }
  // Readable when the supervisor reports the main process's end (then call ReadEnd).
  int status_fd() const { return status_fd_; }
  // Readable once the supervisor has exited (a pidfd; -1 where the kernel has none): a watch
  // polls it to call Reaped() at once instead of at its next timeout.
  int exit_fd() const { return exit_fd_; }
  pid_t program_pid() const { return program_pid_; }
  pid_t supervisor_pid() const { return supervisor_pid_; }

  // After status_fd() polled readable: the main process's end. UNAVAILABLE when the
  // supervisor died without saying (it was killed).
  absl::StatusOr<ProcessEnd> ReadEnd();
  // Asks the supervisor to stop the group (SIGTERM, grace, SIGKILL). Idempotent.
  void Stop();
  // Whether the supervisor has exited (its group is empty); reaps it.
  bool Reaped();
  // Blocks until it has (Stop first, or the program's end), at most `timeout`; whether it has.
  bool WaitReaped(absl::Duration timeout);

 private:
  SupervisedProgram() = default;
  pid_t supervisor_pid_ = -1;
  pid_t program_pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  int status_fd_ = -1;
  int exit_fd_ = -1;
  absl::Duration grace_;
  int exec_errno_ = 0;  // exec failed, said before the supervisor's start
  bool stopped_ = false;
  bool reaped_ = false;
};

// "SIGKILL" for 9, "signal 77" for what has no name.
std::string SignalName(int signal);

}  // namespace lockstep::worker
