#include "worker/program/supervisor.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace lockstep::worker {
namespace {

// What the status pipe carries: the supervisor's and the program child's messages.
struct Message {
  int32_t kind;
  int32_t value;
};
constexpr int32_t kStarted = 1;     // value: the program's pid
constexpr int32_t kExecFailed = 2;  // value: errno
constexpr int32_t kEnded = 3;       // value: the wait status

// Everything below until Launch runs in a forked copy of a multi-threaded process: only
// async-signal-safe calls, no allocation, no locks.
void WriteMessage(int fd, int32_t kind, int32_t value) {
  const Message m{kind, value};
  ssize_t n;
  do {
    n = write(fd, &m, sizeof(m));  // 8 bytes < PIPE_BUF: atomic
  } while (n < 0 && errno == EINTR);
}

int64_t MonotonicMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

void CloseRange(int first, unsigned last) {
  if (static_cast<unsigned>(first) > last) return;
  if (syscall(SYS_close_range, first, last, 0) == 0) return;
  for (unsigned fd = first; fd <= last && fd < 65536; ++fd) close(static_cast<int>(fd));
}

void CloseFrom(int first) { CloseRange(first, ~0U); }

// Closes every descriptor from 3 on but the four in `keep` (-1: none).
void CloseAllBut(int a, int b, int c, int d) {
  int keep[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    for (int j = i + 1; j < 4; ++j) {
      if (keep[j] < keep[i]) {
        const int t = keep[i];
        keep[i] = keep[j];
        keep[j] = t;
      }
    }
  }
  int next = 3;
  for (int fd : keep) {
    if (fd >= next) CloseRange(next, static_cast<unsigned>(fd - 1));
    if (fd + 1 > next) next = fd + 1;
  }
  CloseFrom(next);
}

[[noreturn]] void RunProgram(const LaunchSpec& spec, char* const* argv, char* const* envp,
                             int out_w, int err_w, int status_w) {
  // Default dispositions and an empty mask: the worker ignores SIGPIPE, and the supervisor
  // blocks what it waits for.
  struct sigaction dfl;
  memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  for (int s = 1; s < NSIG; ++s) {
    if (s != SIGKILL && s != SIGSTOP) sigaction(s, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  setpgid(0, 0);
  const int null_fd = open("/dev/null", O_RDONLY);
  if (null_fd < 0 || dup2(null_fd, 0) < 0 || dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0) {
    WriteMessage(status_w, kExecFailed, errno);
    _exit(127);
  }
  // The handoff, if any, out of the way of fd 3 first (fcntl picks a free descriptor).
  int handoff = -1;
  if (spec.handoff_fd >= 0 && (handoff = fcntl(spec.handoff_fd, F_DUPFD, 10)) < 0) {
    WriteMessage(status_w, kExecFailed, errno);
    _exit(127);
  }
  // The status pipe stays open (close-on-exec) to say why exec failed; nothing else of the
  // worker's (its sockets, its files) reaches the program, but the handoff as fd 4.
  if (status_w != 3 && dup3(status_w, 3, O_CLOEXEC) < 0) {
    WriteMessage(status_w, kExecFailed, errno);
    _exit(127);
  }
  if (handoff >= 0 && dup2(handoff, 4) < 0) {
    WriteMessage(3, kExecFailed, errno);
    _exit(127);
  }
  CloseFrom(handoff >= 0 ? 5 : 4);
  const ProgramCredentials& c = spec.credentials;
  if (c.switch_user &&
      (setgroups(c.groups.size(), c.groups.data()) != 0 || setgid(c.gid) != 0 ||
       setuid(c.uid) != 0)) {
    WriteMessage(3, kExecFailed, errno);
    _exit(127);
  }
  if (chdir(spec.workdir.c_str()) != 0) {
    WriteMessage(3, kExecFailed, errno);
    _exit(127);
  }
  execve(spec.executable.c_str(), argv, envp);
  WriteMessage(3, kExecFailed, errno);
  _exit(127);
}

[[noreturn]] void Supervise(const LaunchSpec& spec, char* const* argv, char* const* envp,
                            pid_t worker, int out_w, int err_w, int status_w) {
  sigset_t waited;
  sigemptyset(&waited);
  sigaddset(&waited, SIGTERM);
  sigaddset(&waited, SIGCHLD);
  sigprocmask(SIG_BLOCK, &waited, nullptr);
  // The worker's death, however it dies, is a stop request.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  bool stopping = getppid() != worker;
  // None of the worker's sockets and files: its session must break the moment it dies.
  CloseAllBut(out_w, err_w, status_w, spec.handoff_fd);
  setpgid(0, 0);  // out of the worker's group: a terminal's ^C is the worker's business
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const pid_t program = fork();
  if (program < 0) {
    WriteMessage(status_w, kExecFailed, errno);
    _exit(1);
  }
  if (program == 0) RunProgram(spec, argv, envp, out_w, err_w, status_w);
  setpgid(program, program);  // also done by the child: whichever runs first
  close(out_w);
  close(err_w);
  if (spec.handoff_fd >= 0) close(spec.handoff_fd);
  WriteMessage(status_w, kStarted, program);
  const int64_t grace_ms = absl::ToInt64Milliseconds(spec.stop_grace);
  bool main_exited = false;
  bool killed = false;
  int64_t kill_at = 0;
  auto begin_stop = [&] {
    if (stopping && kill_at != 0) return;
    stopping = true;
    kill(-program, SIGTERM);
    kill_at = MonotonicMs() + grace_ms;
  };
  if (stopping) begin_stop();
  for (;;) {
    timespec tick{0, 20 * 1000 * 1000};
    const int sig = sigtimedwait(&waited, nullptr, &tick);
    if (sig == SIGTERM || getppid() != worker) begin_stop();
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      if (pid == program) {
        main_exited = true;
        WriteMessage(status_w, kEnded, status);
        // What the program left in its group goes too (SIGTERM, then SIGKILL after the grace).
        begin_stop();
      }
    }
    if (stopping && !killed && MonotonicMs() >= kill_at) {
      kill(-program, SIGKILL);
      killed = true;
    }
    // Done once the main process is reaped and its group is empty (zombies of it that were
    // reparented here are reaped above).
    if (main_exited && kill(-program, 0) != 0 && errno == ESRCH) _exit(0);
  }
}

// argv or envp as execve wants them (pointers into `strings`).
std::vector<char*> CStrings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", signal);
}

absl::StatusOr<std::unique_ptr<SupervisedProgram>> SupervisedProgram::Launch(
    const LaunchSpec& spec) {
  int out[2], err[2], status[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
  if (pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    close(out[0]);
    close(out[1]);
    return absl::ErrnoToStatus(e, "pipe");
  }
  if (pipe2(status, O_CLOEXEC) != 0) {
    const int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
    return absl::ErrnoToStatus(e, "pipe");
  }
  std::vector<char*> argv = CStrings(spec.argv);
  std::vector<char*> envp = CStrings(spec.env);
  const pid_t worker = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], status[0], status[1]}) close(fd);
    return absl::ErrnoToStatus(e, "fork");
  }
  if (pid == 0) {
    close(out[0]);
    close(err[0]);
    close(status[0]);
    Supervise(spec, argv.data(), envp.data(), worker, out[1], err[1], status[1]);
  }
  close(out[1]);
  close(err[1]);
  close(status[1]);
  auto program = std::unique_ptr<SupervisedProgram>(new SupervisedProgram());
  program->supervisor_pid_ = pid;
  program->grace_ = spec.stop_grace;
  program->out_fd_ = out[0];
  program->err_fd_ = err[0];
  program->status_fd_ = status[0];
  program->exit_fd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  // The supervisor says it started the program; the program's own word that exec failed may
  // come first (it is kept for ReadEnd).
  for (;;) {
    Message m{};
    ssize_t n;
    do {
      n = read(status[0], &m, sizeof(m));
    } while (n < 0 && errno == EINTR);
    if (n != sizeof(m)) {
      return program->exec_errno_ != 0
                 ? absl::ErrnoToStatus(program->exec_errno_, "forking the program")
                 : absl::InternalError("the program's supervisor ended before starting it");
    }
    if (m.kind == kExecFailed) {
      program->exec_errno_ = m.value;
    } else if (m.kind == kStarted) {
      program->program_pid_ = m.value;
      break;
    }
  }
  for (int fd : {out[0], err[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return program;
}

absl::StatusOr<ProcessEnd> SupervisedProgram::ReadEnd() {
  ProcessEnd end;
  if (exec_errno_ != 0) {
    end.exec_failed = true;
    end.exec_errno = exec_errno_;
  }
  for (;;) {
    Message m{};
    ssize_t n;
    do {
      n = read(status_fd_, &m, sizeof(m));
    } while (n < 0 && errno == EINTR);
    if (n != sizeof(m)) {
      return absl::UnavailableError("the program's supervisor ended without its exit status");
    }
    if (m.kind == kExecFailed) {
      end.exec_failed = true;
      end.exec_errno = m.value;
    } else if (m.kind == kEnded) {
      if (WIFSIGNALED(m.value)) {
        end.signaled = true;
        end.signal = WTERMSIG(m.value);
      } else {
        end.exit_code = WEXITSTATUS(m.value);
      }
      return end;
    }
  }
}

void SupervisedProgram::Stop() {
  if (stopped_ || reaped_) return;
  stopped_ = true;
  kill(supervisor_pid_, SIGTERM);
}

bool SupervisedProgram::Reaped() {
  if (reaped_) return true;
  int status = 0;
  const pid_t r = waitpid(supervisor_pid_, &status, WNOHANG);
  if (r == supervisor_pid_ || (r < 0 && errno == ECHILD)) reaped_ = true;
  return reaped_;
}

bool SupervisedProgram::WaitReaped(absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (!Reaped()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

SupervisedProgram::~SupervisedProgram() {
  Stop();
  if (!WaitReaped(grace_ + absl::Seconds(10))) {
    kill(-program_pid_, SIGKILL);
    kill(supervisor_pid_, SIGKILL);
    WaitReaped(absl::InfiniteDuration());
  }
  for (int fd : {out_fd_, err_fd_, status_fd_, exit_fd_}) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace lockstep::worker
