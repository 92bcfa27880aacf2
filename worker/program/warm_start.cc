#include "worker/program/warm_start.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/test_hooks.h"
#include "glog/logging.h"
#include "worker/program/environment.h"

namespace lockstep::worker {
namespace {

// The parked interpreter's command line (short, for ps) runs its program from the environment,
// which the handoff then replaces.
constexpr char kParkedCommand[] = "import os; exec(os.environ['LOCKSTEP_PARKED_PROGRAM'])";

// The parked interpreter's program: imports argv[1]'s modules, reads what to run
// from fd 4 ("COUNT\0ARGV...\0NAME=VALUE\0...END"; anything else: discarded), then becomes that script
// (or module) as `python3 ARGV[1:]` would have run it. Tracebacks start with one frame of this.
constexpr char kParkedProgram[] = R"py(import os, sys
def _lockstep_preload(names):
    for name in names.split(","):
        if name:
            try:
                __import__(name)
            except BaseException:
                pass  # the script's own import says what is wrong
def _lockstep_parked():
    _lockstep_preload(sys.argv[1])
    data = bytearray()
    while True:
        chunk = os.read(4, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(4)
    parts = bytes(data).split(b"\0")
    if len(parts) < 3 or parts[-1] != b"END":
        os._exit(0)  # discarded (nothing, or not all of it, came)
    parts.pop()
    count = int(parts[0])
    os.environ.clear()
    for entry in parts[1 + count:]:
        name, eq, value = entry.partition(b"=")
        if eq:
            os.environb[name] = value
    return [os.fsdecode(a) for a in parts[1:1 + count]]
_lockstep_argv = _lockstep_parked()
del _lockstep_parked, _lockstep_preload
# sys.path[0] is -c's "" (none with PYTHONSAFEPATH): it becomes what the script's start puts.
_lockstep_safe = getattr(sys.flags, "safe_path", False)
if _lockstep_argv[1] == "-m":
    import builtins, runpy, types
    sys.argv = ["-m"] + _lockstep_argv[3:]
    if not _lockstep_safe:
        sys.path[0] = os.getcwd()
    _lockstep_main = types.ModuleType("__main__")  # a fresh one, as `python3 -m` runs in
    _lockstep_main.__builtins__ = builtins
    sys.modules["__main__"] = _lockstep_main
    runpy._run_module_as_main(_lockstep_argv[2])  # what `python3 -m` itself runs
else:
    import builtins, importlib.machinery, io, types
    sys.argv = _lockstep_argv[1:]
    _lockstep_path = os.path.abspath(sys.argv[0])
    if not _lockstep_safe:
        sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    _lockstep_main = types.ModuleType("__main__")
    _lockstep_main.__file__ = _lockstep_path
    _lockstep_main.__cached__ = None
    _lockstep_main.__builtins__ = builtins
    _lockstep_main.__loader__ = importlib.machinery.SourceFileLoader("__main__", _lockstep_path)
    sys.modules["__main__"] = _lockstep_main
    with io.open_code(_lockstep_path) as _lockstep_file:
        _lockstep_code = compile(_lockstep_file.read(), _lockstep_path, "exec")
    exec(_lockstep_code, _lockstep_main.__dict__)
)py";

bool IsPython(const std::string& executable) {
  const size_t slash = executable.rfind('/');
  return absl::StartsWith(slash == std::string::npos ? executable : executable.substr(slash + 1),
                          "python");
}

// What the parked interpreter reads from fd 4.
std::string Handoff(const LaunchSpec& launch) {
  std::string out = absl::StrCat(launch.argv.size());
  out.push_back('\0');
  for (const std::string& a : launch.argv) absl::StrAppend(&out, a, std::string(1, '\0'));
  for (const std::string& e : launch.env) absl::StrAppend(&out, e, std::string(1, '\0'));
  out += "END";
  return out;
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Still parked: its supervisor has said nothing since the start (no end, no failed exec).
bool StillParked(SupervisedProgram& program) {
  pollfd p{program.status_fd(), POLLIN, 0};
  return poll(&p, 1, 0) == 0 && !program.Reaped();
}

}  // namespace

WarmStarts::WarmStarts(std::vector<std::string> preload)
    : preload_(std::move(preload)), thread_([this] { Loop(); }) {}

WarmStarts::~WarmStarts() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::optional<std::string> WarmStarts::KeyOf(const LaunchSpec& launch) {
  const std::vector<std::string>& argv = launch.argv;
  if (!IsPython(launch.executable) || argv.size() < 2) return std::nullopt;
  const bool module = argv[1] == "-m" && argv.size() >= 3 && !absl::StartsWith(argv[2], "-");
  // A script is Python source (a zip app or a .pyc starts cold).
  if (!module && (absl::StartsWith(argv[1], "-") || !absl::EndsWith(argv[1], ".py"))) {
    return std::nullopt;
  }
  const ProgramCredentials& c = launch.credentials;
  std::string key = absl::StrCat(launch.executable, std::string(1, '\0'), launch.workdir,
                                 std::string(1, '\0'), c.switch_user, ":", c.uid, ":", c.gid, ":",
                                 absl::StrJoin(c.groups, ","), std::string(1, '\0'),
                                 absl::ToInt64Milliseconds(launch.stop_grace));
  for (const std::string& entry : launch.env) {
    if (PerGenerationVariable(entry.substr(0, entry.find('=')))) continue;
    absl::StrAppend(&key, std::string(1, '\0'), entry);
  }
  return key;
}

std::unique_ptr<SupervisedProgram> WarmStarts::Start(const LaunchSpec& launch) {
  const std::optional<std::string> key = KeyOf(launch);
  std::optional<Parked> parked;
  {
    absl::MutexLock lock(&mu_);
    to_park_.reset();  // for a launch before this one, as is a park in progress
    ++epoch_;
    if (parked_.has_value()) {
      if (key.has_value() && parked_->key == *key) {
        parked = std::move(parked_);
      } else {
        to_end_.push_back(*std::move(parked_));
      }
      parked_.reset();
    }
  }
  if (!parked.has_value()) return nullptr;
  // Written whole or not at all: the pipe is empty and holds it (else the start is cold).
  const std::string handoff = Handoff(launch);
  const int capacity = fcntl(parked->handoff, F_GETPIPE_SZ);
  if (capacity < 0 || handoff.size() > static_cast<size_t>(capacity)) {
    LOG(WARNING) << "the program's argv and environment (" << handoff.size()
                 << " bytes) exceed the warm interpreter's pipe; starting the program cold";
    absl::MutexLock lock(&mu_);
    to_end_.push_back(*std::move(parked));
    return nullptr;
  }
  if (!StillParked(*parked->program) || !WriteAll(parked->handoff, handoff)) {
    LOG(WARNING) << "the warm interpreter (pid " << parked->program->program_pid()
                 << ") ended while parked; starting the program cold";
    absl::MutexLock lock(&mu_);
    to_end_.push_back(*std::move(parked));
    return nullptr;
  }
  close(parked->handoff);
  absl::MutexLock lock(&mu_);
  ++warm_starts_;
  return std::move(parked->program);
}

void WarmStarts::Park(const LaunchSpec& launch, const std::string& job_id) {
  if (!KeyOf(launch).has_value()) return;
  absl::MutexLock lock(&mu_);
  to_park_ = launch;
  to_park_job_ = job_id;
}

void WarmStarts::Discard(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (to_park_.has_value() && to_park_job_ == job_id) to_park_.reset();
  if (parking_job_ == job_id) ++epoch_;
  if (parked_.has_value() && parked_->job_id == job_id) {
    to_end_.push_back(*std::move(parked_));
    parked_.reset();
  }
}

int WarmStarts::warm_starts() const {
  absl::MutexLock lock(&mu_);
  return warm_starts_;
}

pid_t WarmStarts::parked_pid() const {
  absl::MutexLock lock(&mu_);
  return parked_.has_value() ? parked_->program->program_pid() : -1;
}

void WarmStarts::End(Parked& parked) {
  // Without a handoff the interpreter exits 0 once its imports are done; the supervisor's
  // stop (SIGTERM, the grace, SIGKILL) does not wait for them.
  if (parked.handoff >= 0) close(parked.handoff);
  parked.handoff = -1;
  parked.program.reset();
}

void WarmStarts::Loop() {
  for (bool stop = false; !stop;) {
    std::optional<LaunchSpec> park;
    std::string job_id;
    uint64_t epoch = 0;
    std::vector<Parked> end;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || to_park_.has_value() || !to_end_.empty();
      };
      mu_.AwaitWithTimeout(absl::Condition(&work), absl::Seconds(1));
      stop = stop_;
      if (!stop) park = std::exchange(to_park_, std::nullopt);
      job_id = park.has_value() ? to_park_job_ : std::string();
      parking_job_ = job_id;
      epoch = epoch_;
      end = std::exchange(to_end_, {});
      if (parked_.has_value() && (stop || absl::Now() - parked_->since >= kIdleLimit)) {
        end.push_back(*std::move(parked_));
        parked_.reset();
      }
    }
    for (Parked& p : end) End(p);
    if (!park.has_value()) continue;
    int handoff[2];
    if (pipe2(handoff, O_CLOEXEC) != 0) {
      PLOG(WARNING) << "warm start: pipe";
      continue;
    }
    // Room for a large environment (best effort), and a write that never blocks the
    // generation (the interpreter reads only once its imports are done).
    fcntl(handoff[1], F_SETPIPE_SZ, 1 << 20);
    fcntl(handoff[1], F_SETFL, O_NONBLOCK);
    LaunchSpec spec = *std::move(park);
    const std::string key = *KeyOf(spec);
    spec.argv = {spec.argv[0], "-c", kParkedCommand, absl::StrJoin(preload_, ",")};
    std::vector<std::string> env = {absl::StrCat("LOCKSTEP_PARKED_PROGRAM=", kParkedProgram)};
    for (std::string& entry : spec.env) {
      if (!PerGenerationVariable(entry.substr(0, entry.find('=')))) env.push_back(std::move(entry));
    }
    spec.env = std::move(env);
    spec.handoff_fd = handoff[0];
    absl::StatusOr<std::unique_ptr<SupervisedProgram>> launched = SupervisedProgram::Launch(spec);
    close(handoff[0]);
    if (!launched.ok()) {
      LOG(WARNING) << "warm start: could not park an interpreter: " << launched.status();
      close(handoff[1]);
      continue;
    }
    LOG(INFO) << "warm interpreter parked (pid " << (*launched)->program_pid() << ", importing "
              << (preload_.empty() ? "nothing" : absl::StrJoin(preload_, ", "))
              << ") for the next generation";
    {
      absl::MutexLock lock(&mu_);
      parking_job_.clear();
      Parked parked{key, job_id, *std::move(launched), handoff[1], absl::Now()};
      if (epoch != epoch_) {
        // Discarded, or overtaken by a start, while it launched.
        to_end_.push_back(std::move(parked));
        continue;
      }
      if (parked_.has_value()) to_end_.push_back(*std::move(parked_));
      parked_ = std::move(parked);
    }
    // Tests kill the worker here, while an interpreter is parked.
    test_hooks::Reach("warm_interpreter_parked");
  }
}

}  // namespace lockstep::worker
