#include "worker/program_generation.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/bytes.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "common/utf8.h"
#include "glog/logging.h"
#include "worker/program/checkpoint_agreement.h"
#include "worker/program/checkpoint_disk.h"
#include "worker/program/supervisor.h"

namespace lockstep::worker {
namespace {

// Kept of a program's standard error for its failure (ProgramExit.stderr_tail: the last lines
// within 2 KiB), and the longest line the worker's log takes whole.
constexpr size_t kStderrKept = 16 << 10;
constexpr size_t kStderrTailBytes = 2 << 10;
constexpr size_t kMaxLogLine = 4 << 10;
constexpr char kMasterKey[] = "program/master";
// The checkpoint agreement's keys: what each rank holds (v1::CheckpointHoldings), and rank 0's
// choice (v1::CheckpointChoice).
constexpr char kHeldKeyPrefix[] = "program/checkpoint/held/";
constexpr char kChosenKey[] = "program/checkpoint/chosen";
constexpr absl::Duration kAgreementWait = absl::Minutes(5);
constexpr int kOutputBatchLines = 256;
constexpr absl::Duration kOutputEvery = absl::Milliseconds(200);

std::string Join(const std::string& dir, const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  return absl::StrCat(absl::StripSuffix(dir, "/"), "/", path);
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// A free TCP port on `address` (bound and released: the program's rank 0 binds it next).
absl::StatusOr<int> ReservePort(const std::string& address) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    length = sizeof(*v4);
  } else if (inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    length = sizeof(*v6);
  } else {
    return absl::FailedPreconditionError(
        absl::StrCat("the worker's communication address \"", address,
                     "\" is not an IP address (--comm_address): MASTER_ADDR needs one"));
  }
  const int fd = socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket for MASTER_PORT");
  absl::Cleanup close_fd = [fd] { close(fd); };
  if (bind(fd, reinterpret_cast<sockaddr*>(&storage), length) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) {
    return absl::UnavailableError(
        absl::StrCat("reserving MASTER_PORT on ", address, ": ", strerror(errno)));
  }
  return ntohs(storage.ss_family == AF_INET ? v4->sin_port : v6->sin6_port);
}

// A program's output, cut into lines: each goes to the worker's log (prefixed with the job
// and rank) and to the coordinator (batched: ProgramOutput).
class LineSink {
 public:
  LineSink(std::string prefix, bool stderr, v1::ProgramOutput* batch)
      : prefix_(std::move(prefix)), stderr_(stderr), batch_(batch) {}
  void Add(const char* data, size_t n) {
    pending_.append(data, n);
    size_t start = 0;
    for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
      Emit(pending_.substr(start, nl - start));
    }
    pending_.erase(0, start);
    if (pending_.size() > kMaxLogLine) {
      Emit(pending_);
      pending_.clear();
    }
  }
  void Flush() {
    if (!pending_.empty()) Emit(pending_);
    pending_.clear();
  }

 private:
  void Emit(std::string line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.size() > kMaxLogLine) line.resize(kMaxLogLine);
    line = ToValidUtf8(line);
    LOG(INFO) << prefix_ << EscapeForTerminal(line);
    v1::OutputLine* out = batch_->add_lines();
    out->set_stderr(stderr_);
    out->set_unix_ms(absl::ToUnixMillis(absl::Now()));
    out->set_text(std::move(line));
  }
  const std::string prefix_;
  const bool stderr_;
  v1::ProgramOutput* const batch_;
  std::string pending_;
};

// The last whole lines of `text` within `limit` bytes.
std::string TailLines(const std::string& text, size_t limit) {
  absl::string_view tail = absl::StripTrailingAsciiWhitespace(text);
  if (tail.size() <= limit) return std::string(tail);
  tail = tail.substr(tail.size() - limit);
  if (const size_t nl = tail.find('\n'); nl != absl::string_view::npos) tail = tail.substr(nl + 1);
  return std::string(tail);
}

absl::Status ExecError(int error, const std::string& executable) {
  const std::string what =
      absl::StrCat("program.argv[0]: cannot run \"", executable, "\": ", strerror(error));
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(what);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(what);
    default:
      return absl::FailedPreconditionError(what);
  }
}

}  // namespace

v1::ProgressReport ReportPacer::Next(const v1::Assignment& assignment,
                                     const v1::ProgramReportRequest& request, absl::Time now) {
  v1::ProgressReport p;
  p.set_job_id(assignment.job_id());
  p.set_generation(assignment.generation());
  p.set_step(request.step());
  if (request.has_loss()) p.set_loss(request.loss());
  p.set_first_of_generation(!reported_);
  // Samples per second over the steps since the previous report.
  if (reported_ && request.samples() > 0 && request.step() > last_step_ && now > last_time_) {
    p.set_samples_per_second(static_cast<double>(request.samples()) *
                             static_cast<double>(request.step() - last_step_) /
                             absl::ToDoubleSeconds(now - last_time_));
  }
  reported_ = true;
  last_step_ = request.step();
  last_time_ = now;
  return p;
}

std::string SummarizeStderr(const std::string& tail) {
  const std::vector<absl::string_view> lines = absl::StrSplit(tail, '\n', absl::SkipWhitespace());
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (absl::StrContains(*it, "CUDA out of memory") ||
        absl::StrContains(*it, "OutOfMemoryError")) {
      return absl::StrCat("CUDA out of memory: ", absl::StripAsciiWhitespace(*it));
    }
  }
  // A traceback ends with the exception's line, the first one after it that is not indented.
  for (size_t i = lines.size(); i-- > 0;) {
    if (!absl::StartsWith(lines[i], "Traceback (most recent call last)")) continue;
    absl::string_view last;
    for (size_t j = i + 1; j < lines.size(); ++j) {
      if (!lines[j].empty() && lines[j][0] != ' ' && lines[j][0] != '\t') {
        last = lines[j];
        break;
      }
    }
    if (!last.empty()) return std::string(absl::StripAsciiWhitespace(last));
  }
  return lines.empty() ? "" : std::string(absl::StripAsciiWhitespace(lines.back()));
}

ProgramGeneration::ProgramGeneration(const GenerationContext& context,
                                     const v1::Assignment& assignment,
                                     std::shared_ptr<StoreClient> store,
                                     std::shared_ptr<AbortSignal> abort,
                                     GenerationReporter* reporter)
    : context_(context),
      assignment_(assignment),
      store_(std::move(store)),
      abort_(std::move(abort)),
      reporter_(reporter) {}

std::string ProgramGeneration::Name() const {
  return absl::StrCat(assignment_.job_id(), " generation ", assignment_.generation(), " rank ",
                      assignment_.rank());
}

absl::StatusOr<std::string> ProgramGeneration::Check() const {
  const ProgramSettings& settings = context_.programs;
  const v1::ProgramSpec& program = assignment_.spec().program();
  if (!settings.root.restricted()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", context_.worker_name, " runs no programs (start it with --programs_root)"));
  }
  const std::string& workdir = program.workdir();
  if (absl::Status s = settings.root.CheckOnHost("program.workdir", workdir); !s.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat("worker ", context_.worker_name, ": ", s.message()));
  }
  struct stat st;
  if (stat(workdir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("program.workdir: no directory \"", workdir,
                                            "\" on worker ", context_.worker_name));
  }
  // Where the in-memory saves are persisted: inside this worker's --checkpoint_root.
  if (const std::string& dir = assignment_.spec().checkpoint_dir(); !dir.empty()) {
    if (absl::Status s = context_.checkpoint_roots.CheckOnHost("checkpoint_dir", dir); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", context_.worker_name, ": ", s.message()));
    }
  }
  // The script: argv[0] itself when it is a path inside the root, else the first argument
  // that is not an option (after an interpreter); "-m MODULE" runs a module of the workdir.
  const std::vector<std::string> argv(program.argv().begin(), program.argv().end());
  int script = -1;
  bool module = false;
  if (absl::StrContains(argv[0], '/') &&
      settings.root.CheckOnHost("program.argv[0]", Join(workdir, argv[0])).ok()) {
    script = 0;
  } else {
    for (size_t i = 1; i < argv.size(); ++i) {
      if (argv[i] == "-m") {
        module = true;
        break;
      }
      if (argv[i] == "-c") break;
      if (!absl::StartsWith(argv[i], "-")) {
        script = static_cast<int>(i);
        break;
      }
    }
  }
  if (script < 0 && !module) {
    return absl::PermissionDeniedError(
        absl::StrCat("program.argv: names no script (a file inside --programs_root ",
                     settings.root.Describe(), " on worker ", context_.worker_name,
                     "): give the interpreter and then the script, or the executable's path"));
  }
  if (script >= 0) {
    const std::string field = absl::StrCat("program.argv[", script, "]");
    const std::string path = Join(workdir, argv[script]);
    if (absl::Status s = settings.root.CheckOnHost(field, path); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("worker ", context_.worker_name, ": ", s.message()));
    }
    if (!IsRegularFile(path)) {
      return absl::NotFoundError(
          absl::StrCat(field, ": no file \"", path, "\" on worker ", context_.worker_name));
    }
  }
  // The executable: a path (relative to the workdir), or a name looked up in the program's PATH.
  if (absl::StrContains(argv[0], '/')) return Join(workdir, argv[0]);
  std::string path = "/usr/local/bin:/usr/bin:/bin";
  if (const char* p = getenv("PATH"); p != nullptr) path = p;
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/", argv[0]);
    if (IsRegularFile(candidate) && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("program.argv[0]: \"", argv[0], "\" not found in PATH (",
                                          path, ") on worker ", context_.worker_name));
}

absl::Status ProgramGeneration::CheckDevice(const v1::ProgramReportRequest& report) const {
  if (!report.has_cuda_device() || report.cuda_device() == assignment_.local_rank()) {
    return absl::OkStatus();
  }
  const std::string own =
      assignment_.local_rank() < assignment_.local_device_uuids_size()
          ? absl::StrCat(" (", assignment_.local_device_uuids(assignment_.local_rank()), ")")
          : "";
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", assignment_.rank(), " (", context_.worker_name, ") computes on cuda:",
      report.cuda_device(), ", not on its own GPU cuda:", assignment_.local_rank(), own,
      ": call torch.cuda.set_device(local_rank) (LOCAL_RANK) before creating tensors or the "
      "process group"));
}

absl::Status ProgramGeneration::Rendezvous(std::string* addr, int* port) {
  if (assignment_.rank() == 0) {
    absl::StatusOr<int> reserved = ReservePort(context_.comm_address);
    if (!reserved.ok()) return reserved.status();
    *addr = context_.comm_address;
    *port = *reserved;
    return store_->Set(kMasterKey, absl::StrCat(*addr, " ", *port));
  }
  absl::StatusOr<std::string> master = store_->Get(kMasterKey, absl::Minutes(5));
  if (!master.ok()) return master.status();
  const std::vector<std::string> parts = absl::StrSplit(*master, ' ');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], port)) {
    return absl::DataLossError(
        absl::StrCat("rank 0 published a malformed MASTER address \"", *master, "\""));
  }
  *addr = parts[0];
  return absl::OkStatus();
}

absl::Status ProgramGeneration::AgreeOnCheckpoint() {
  CheckpointMemory* const memory = context_.checkpoint_memory;
  const std::string& job = assignment_.job_id();
  if (memory != nullptr) memory->DropAllBut(job);  // a worker keeps one job's saves
  // A job's first generation: nobody can hold a save of it.
  if (assignment_.generation() <= 1 && assignment_.restart_count() == 0) return absl::OkStatus();
  const absl::Time start = absl::Now();
  // What this member holds: its own saves, and the copies it keeps of other workers'.
  v1::CheckpointHoldings mine;
  mine.set_worker(context_.worker_name);
  std::vector<HeldCheckpoint> held;
  if (memory != nullptr) {
    std::vector<std::string> refused;
    held = memory->Held(job, "", &refused);
    for (const HeldCheckpoint& h : held) mine.add_own_steps(h.step);
    for (const std::string& source : memory->ReplicaSources(job)) {
      v1::ReplicaHolding* copy = mine.add_replicas();
      copy->set_source_worker(source);
      for (const HeldCheckpoint& h : memory->Held(job, source, &refused)) {
        copy->add_steps(h.step);
      }
    }
    for (std::string& r : refused) mine.add_refused(std::move(r));
    // What the job's checkpoint_dir holds (as this host sees it).
    if (const std::string& dir = assignment_.spec().checkpoint_dir(); !dir.empty()) {
      std::set<int64_t> steps;
      for (const DiskCheckpoint& f : ListDiskCheckpoints(dir, job)) steps.insert(f.step);
      for (int64_t s : steps) mine.add_disk_steps(s);
    }
    if (peer_registration_ != nullptr) mine.set_peer_address(context_.checkpoint_peers->address());
    mine.set_joined(assignment_.joined());
  }
  LOCKSTEP_RETURN_IF_ERROR(
      store_->Set(absl::StrCat(kHeldKeyPrefix, assignment_.rank()), mine.SerializeAsString()));
  if (assignment_.rank() == 0) {
    std::vector<v1::CheckpointHoldings> by_rank(assignment_.world_size());
    by_rank[0] = mine;
    for (int rank = 1; rank < assignment_.world_size(); ++rank) {
      absl::StatusOr<std::string> theirs =
          store_->Get(absl::StrCat(kHeldKeyPrefix, rank), kAgreementWait);
      if (!theirs.ok()) return theirs.status();
      if (!by_rank[rank].ParseFromString(*theirs)) {
        return absl::DataLossError(absl::StrCat("rank ", rank, " published malformed holdings"));
      }
    }
    LOCKSTEP_RETURN_IF_ERROR(
        store_->Set(kChosenKey, ChooseCheckpoint(by_rank).SerializeAsString()));
  }
  absl::StatusOr<std::string> chosen_text = store_->Get(kChosenKey, kAgreementWait);
  if (!chosen_text.ok()) return chosen_text.status();
  v1::CheckpointChoice chosen;
  if (!chosen.ParseFromString(*chosen_text)) {
    return absl::DataLossError("rank 0 published a malformed checkpoint choice");
  }
  const int64_t step = chosen.step();
  const int64_t keep_up_to = chosen.found() ? step : std::numeric_limits<int64_t>::min();
  if (memory != nullptr) memory->DiscardAfter(job, keep_up_to);
  if (const std::string& dir = assignment_.spec().checkpoint_dir();
      !dir.empty() && assignment_.rank() == 0) {
    DiscardDiskAfter(dir, job, keep_up_to);
  }
  restored_from_ = chosen.restored_from();
  restore_detail_ = chosen.detail();
  if (!chosen.found()) {
    agreement_time_ = absl::Now() - start;
    LOG(INFO) << Name() << ": restores no checkpoint from memory"
              << (chosen.detail().empty() ? "" : absl::StrCat(": ", chosen.detail()));
    return absl::OkStatus();
  }
  for (const HeldCheckpoint& h : held) {
    if (h.step == step) restore_ = h;
  }
  for (const v1::CheckpointFetchPlan& fetch : chosen.fetches()) {
    if (fetch.rank() != assignment_.rank() || restore_.has_value()) continue;
    if (memory == nullptr) break;
    if (fetch.from_disk()) {
      LOCKSTEP_RETURN_IF_ERROR(RestoreDiskStep(step));
      continue;
    }
    // Before the program starts: its Checkpointer finds the save in its own slots.
    const absl::Time fetch_start = absl::Now();
    absl::StatusOr<HeldCheckpoint> fetched = FetchCheckpoint(
        memory, fetch.holder_address(), fetch.holder_worker(), assignment_.checkpoint_secret(), job,
        fetch.holders_own() ? "" : fetch.source_worker(), step, &abort_->flag());
    if (!fetched.ok()) {
      // The group restarts (the coordinator re-forms it); the copy is never half-used.
      return absl::Status(fetched.status().code(),
                          absl::StrCat(Name(), ": ", fetched.status().message()));
    }
    restore_ = *std::move(fetched);
    restore_source_ = absl::StrCat("peer ", fetch.holder_worker());
    LOG(INFO) << Name() << ": fetched " << fetch.source_worker() << "'s checkpoint of step " << step
              << " (" << HumanBytes(static_cast<int64_t>(restore_->payload_bytes)) << ") from "
              << fetch.holder_worker() << " in " << absl::FormatDuration(absl::Now() - fetch_start);
  }
  if (!restore_.has_value()) {
    return absl::DataLossError(absl::StrCat("rank 0 chose the checkpoint of step ", step,
                                            ", which worker ", context_.worker_name,
                                            " neither holds nor can fetch"));
  }
  agreement_time_ = absl::Now() - start;
  LOG(INFO) << Name() << ": restores step " << step << " from " << chosen.restored_from()
            << (chosen.detail().empty() ? "" : absl::StrCat(" (", chosen.detail(), ")"))
            << "; agreed in " << absl::FormatDuration(agreement_time_);
  return absl::OkStatus();
}

absl::Status ProgramGeneration::RestoreDiskStep(int64_t step) {
  // This rank's file of the step first, then any other rank's (the model and optimizer are
  // the same under DDP; only `extra` is the other rank's).
  std::vector<DiskCheckpoint> files;
  for (DiskCheckpoint& f :
       ListDiskCheckpoints(assignment_.spec().checkpoint_dir(), assignment_.job_id())) {
    if (f.step == step) files.push_back(std::move(f));
  }
  std::stable_partition(files.begin(), files.end(),
                        [&](const DiskCheckpoint& f) { return f.rank == assignment_.rank(); });
  absl::Status last = absl::NotFoundError(absl::StrCat("no file of step ", step, " in ",
                                                       assignment_.spec().checkpoint_dir(),
                                                       " on worker ", context_.worker_name));
  const absl::Time start = absl::Now();
  for (const DiskCheckpoint& f : files) {
    absl::StatusOr<HeldCheckpoint> restored =
        RestoreFromDisk(context_.checkpoint_memory, assignment_.job_id(), f);
    if (restored.ok()) {
      restore_ = *std::move(restored);
      restore_source_ = "disk";
      LOG(INFO) << Name() << ": read step " << step << " from " << f.path << " ("
                << HumanBytes(static_cast<int64_t>(restore_->payload_bytes)) << ") in "
                << absl::FormatDuration(absl::Now() - start);
      return absl::OkStatus();
    }
    LOG(WARNING) << Name() << ": " << restored.status();
    last = restored.status();
  }
  // The group restarts (the coordinator re-forms it); a refused file is not offered again.
  return absl::Status(last.code(), absl::StrCat(Name(), ": ", last.message()));
}

void ProgramGeneration::StartCopies() {
  CheckpointMemory* const memory = context_.checkpoint_memory;
  if (memory == nullptr) return;
  const v1::JobSpec& spec = assignment_.spec();
  if (spec.program().persist_every_saves() > 0 && !spec.checkpoint_dir().empty()) {
    const std::string dir = spec.checkpoint_dir();
    const std::string job = assignment_.job_id();
    const int rank = assignment_.rank();
    const int keep = spec.keep_checkpoints() > 0 ? spec.keep_checkpoints() : 3;
    persister_ = std::make_unique<SaveFollower>(
        memory, job, absl::StrCat("checkpoint writes to ", dir),
        SaveFollower::Options{spec.program().persist_every_saves()},
        [dir, job, rank, keep](const HeldCheckpoint& save) {
          std::error_code error;
          std::filesystem::create_directories(dir, error);
          return PersistCheckpoint(save, dir, job, rank, keep).status();
        });
  }
  const v1::CheckpointPeer& peer = assignment_.checkpoint_peer();
  if (peer.address().empty() || assignment_.checkpoint_secret().empty()) return;
  replicator_ = std::make_unique<CheckpointReplicator>(
      memory, assignment_.job_id(), context_.worker_name, peer.worker_name(), peer.address(),
      assignment_.checkpoint_secret(), context_.checkpoint_copy_interval);
}

absl::StatusOr<v1::CheckpointSlotsResponse> ProgramGeneration::OnCheckpointSlots(int64_t bytes) {
  // A generation being stopped saves nothing more (its successor may already use the slots).
  if (abort_->raised()) return absl::AbortedError(absl::StrCat(Name(), ": stopping"));
  CheckpointMemory* const memory = context_.checkpoint_memory;
  if (memory == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", context_.worker_name,
                     " keeps no checkpoint memory for programs (--checkpoint_memory_bytes=0)"));
  }
  absl::StatusOr<std::vector<std::string>> paths = memory->Slots(assignment_.job_id(), bytes);
  if (!paths.ok()) {
    return absl::Status(paths.status().code(), absl::StrCat("worker ", context_.worker_name, ": ",
                                                            paths.status().message()));
  }
  v1::CheckpointSlotsResponse response;
  for (const std::string& path : *paths) response.add_paths(path);
  response.set_bytes(memory->slot_bytes(assignment_.job_id()));
  return response;
}

absl::StatusOr<v1::CheckpointRestoreResponse> ProgramGeneration::OnCheckpointRestore(
    const v1::CheckpointRestoreRequest& request) {
  if (abort_->raised()) return absl::AbortedError(absl::StrCat(Name(), ": stopping"));
  v1::CheckpointRestoreResponse response;
  if (restore_.has_value()) {
    response.set_found(true);
    response.set_step(restore_->step);
    response.set_path(restore_->path);
    response.set_payload_bytes(static_cast<int64_t>(restore_->payload_bytes));
    response.set_source(restore_source_);
  }
  if (!request.loaded()) return response;
  if (!restore_.has_value() || request.step() != restore_->step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: this member restores ",
        restore_.has_value() ? absl::StrCat("step ", restore_->step) : std::string("nothing"),
        ", not step ", request.step()));
  }
  if (!restore_reported_) {
    restore_reported_ = true;
    v1::ResumedReport resumed;
    resumed.set_resumed_from_step(restore_->step);
    resumed.set_source_rank(-1);  // each member from its own worker
    resumed.set_heal_ms(absl::ToInt64Milliseconds(agreement_time_) + request.loaded_ms());
    resumed.set_restored_from(restored_from_);
    resumed.set_restore_detail(restore_detail_);
    reporter_->Resumed(resumed);
  }
  return response;
}

ProgramGeneration::~ProgramGeneration() {
  registration_.reset();  // first: it waits for a report in progress, which uses the rest
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

absl::StatusOr<LaunchSpec> ProgramGeneration::Prepare() {
  const v1::ProgramSpec& spec = assignment_.spec().program();
  absl::StatusOr<std::string> executable = Check();
  if (!executable.ok()) return executable.status();
  std::string master_addr;
  int master_port = 0;
  LOCKSTEP_RETURN_IF_ERROR(Rendezvous(&master_addr, &master_port));
  // Copies of this generation's saves arrive here, and members fetch what they lack, under
  // the generation's secret.
  if (context_.checkpoint_peers != nullptr && !assignment_.checkpoint_secret().empty()) {
    peer_registration_ =
        context_.checkpoint_peers->Serve(assignment_.job_id(), assignment_.checkpoint_secret());
  }
  LOCKSTEP_RETURN_IF_ERROR(AgreeOnCheckpoint());
  StartCopies();
  // The wake-up of the watch: an abort, or a report from the wrong GPU.
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) return absl::ErrnoToStatus(errno, "pipe");
  // lockstep.torch's way in: the generation's store and progress reports, under a secret
  // that only the program's environment holds.
  std::map<std::string, std::string> lockstep_env;
  if (context_.program_server != nullptr) {
    registration_ = context_.program_server->Register(
        {store_, [this](const v1::ProgramReportRequest& r) { return OnReport(r); },
         [this](int64_t bytes) { return OnCheckpointSlots(bytes); },
         [this](const v1::CheckpointRestoreRequest& r) { return OnCheckpointRestore(r); }});
    lockstep_env = {{"LOCKSTEP_AGENT_ADDRESS", context_.program_server->address()},
                    {"LOCKSTEP_AGENT_TOKEN", registration_->token()}};
  }
  LaunchSpec launch;
  launch.executable = *executable;
  launch.argv = ProgramArgv(assignment_);
  launch.env = ProgramEnvironment(assignment_, CurrentEnvironment(), context_.programs,
                                  context_.worker_name, master_addr, master_port, lockstep_env);
  launch.workdir = spec.workdir();
  launch.credentials = context_.programs.credentials;
  launch.stop_grace = absl::Milliseconds(spec.stop_grace_ms());
  LOG(INFO) << Name() << ": MASTER_ADDR " << master_addr << ":" << master_port;
  return launch;
}

absl::Status ProgramGeneration::OnReport(const v1::ProgramReportRequest& report) {
  if (absl::Status s = CheckDevice(report); !s.ok()) {
    // The watch stops the program: it would train on another member's GPU.
    {
      absl::MutexLock lock(&wrong_device_mu_);
      if (wrong_device_.ok()) wrong_device_ = s;
    }
    Wake();
    return s;
  }
  reported_ = true;
  const int64_t before = pacer_.last_step();
  v1::ProgressReport progress = pacer_.Next(assignment_, report, context_.clock->Now());
  // Nothing restored from memory although members held saves: why, for the recovery.
  if (progress.first_of_generation() && !restore_.has_value()) {
    progress.set_restore_detail(restore_detail_);
  }
  if (context_.metrics != nullptr) {
    context_.metrics->ObserveProgramReport(progress, progress.step() - before, report.has_loss());
  }
  reporter_->Progress(progress);
  return absl::OkStatus();
}

void ProgramGeneration::Wake() const {
  const char byte = 1;
  (void)!write(wake_[1], &byte, 1);
}

absl::Status ProgramGeneration::Run(std::unique_ptr<Trainer>& trainer) {
  trainer.reset();  // a program keeps no state in the worker
  absl::StatusOr<LaunchSpec> launch = Prepare();
  if (!launch.ok()) return launch.status();
  AbortSignal::Subscription on_abort = abort_->OnRaise([this] { Wake(); });
  if (abort_->raised()) return absl::AbortedError(absl::StrCat(Name(), ": aborted"));
  // In the interpreter parked for it (torch imported already), else cold.
  WarmStarts* const warm = context_.warm_starts;
  std::unique_ptr<SupervisedProgram> program = warm != nullptr ? warm->Start(*launch) : nullptr;
  const bool cold = program == nullptr;
  if (cold) {
    absl::StatusOr<std::unique_ptr<SupervisedProgram>> launched =
        SupervisedProgram::Launch(*launch);
    if (!launched.ok()) {
      return absl::UnavailableError(
          absl::StrCat("worker ", context_.worker_name,
                       " could not start the program: ", launched.status().message()));
    }
    program = *std::move(launched);
  }
  if (context_.metrics != nullptr) {
    context_.metrics->BeginRun(assignment_.job_id(), assignment_.rank(), assignment_.world_size(),
                               0);
  }
  absl::Cleanup end_metrics = [&] {
    if (context_.metrics != nullptr) context_.metrics->EndRun(abort_->raised());
  };
  LOG(INFO) << Name() << ": started " << launch->executable << " (pid " << program->program_pid()
            << (cold ? ")" : ", in a warm interpreter)");
  absl::Status outcome = Outcome(Watch(*program, *launch), launch->executable);
  // What was parked serves the next generation of this job: none comes after a success or a
  // failure of the job, nor after its end.
  if (warm != nullptr && (outcome.ok() || IsFatal(outcome) || abort_->job_ended())) {
    warm->Discard(assignment_.job_id());
  }
  // The saves stay after an exit 0 too (another member may yet fail and the group restart);
  // the job's end drops them (Agent, on the coordinator's word).
  if (context_.checkpoint_memory != nullptr && (IsFatal(outcome) || abort_->job_ended())) {
    context_.checkpoint_memory->Drop(assignment_.job_id());
  }
  return outcome;
}

ProgramGeneration::Watched ProgramGeneration::Watch(SupervisedProgram& program,
                                                    const LaunchSpec& launch) {
  const absl::Time park_at = absl::Now() + WarmStarts::kParkAfter;
  bool parked = context_.warm_starts == nullptr;
  const std::string prefix =
      absl::StrCat("[", assignment_.job_id(), " rank ", assignment_.rank(), "]: ");
  // Output goes to the coordinator in batches: every 200 ms, or sooner when one is large.
  v1::ProgramOutput batch;
  batch.set_job_id(assignment_.job_id());
  batch.set_generation(assignment_.generation());
  absl::Time flushed = absl::Now();
  auto send_output = [&](bool now) {
    if (batch.lines().empty()) return;
    if (!now && batch.lines_size() < kOutputBatchLines && absl::Now() - flushed < kOutputEvery) {
      return;
    }
    reporter_->Output(batch);
    batch.clear_lines();
    flushed = absl::Now();
  };
  LineSink out_lines(prefix, false, &batch), err_lines(prefix, true, &batch);
  int out_fd = program.stdout_fd(), err_fd = program.stderr_fd(), status_fd = program.status_fd();
  char buffer[64 << 10];
  auto drain = [&](int& fd, LineSink& sink, bool keep) {
    for (;;) {
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n > 0) {
        sink.Add(buffer, static_cast<size_t>(n));
        if (keep) {
          err_kept_.append(buffer, static_cast<size_t>(n));
          if (err_kept_.size() > kStderrKept) err_kept_.erase(0, err_kept_.size() - kStderrKept);
        }
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EINTR)) fd = -1;  // EOF: every writer is gone
      return;
    }
  };
  Watched w;
  while (!program.Reaped()) {
    // The supervisor's exit wakes the watch at once (its end, and a stop, are seen without
    // waiting for the timeout: the group's restart waits on them).
    pollfd fds[5] = {{out_fd, POLLIN, 0},
                     {err_fd, POLLIN, 0},
                     {status_fd, POLLIN, 0},
                     {wake_[0], POLLIN, 0},
                     {program.exit_fd(), POLLIN, 0}};
    poll(fds, 5, 100);
    if (!parked && (reported_ || absl::Now() >= park_at) && !abort_->raised()) {
      context_.warm_starts->Park(launch, assignment_.job_id());
      parked = true;
    }
    if (fds[0].revents != 0) drain(out_fd, out_lines, false);
    if (fds[1].revents != 0) drain(err_fd, err_lines, true);
    send_output(false);
    // Tests hold here, the program's output read but not its status, while the program and
    // its supervisor end: the loop then ends with the status unread (read below).
    if (fds[0].revents != 0) test_hooks::Reach("program_output_read", -1, &abort_->flag());
    if (fds[2].revents != 0) {
      absl::StatusOr<ProcessEnd> end = program.ReadEnd();
      if (end.ok()) {
        w.end = *end;
      } else {
        w.supervisor = end.status();
      }
      status_fd = -1;
    }
    if (fds[3].revents == 0 && (!abort_->raised() || w.stopping)) continue;
    char sink[16];
    while (read(wake_[0], sink, sizeof(sink)) > 0) {
    }
    {
      absl::MutexLock lock(&wrong_device_mu_);
      if (!wrong_device_.ok() && w.device_error.ok()) w.device_error = wrong_device_;
    }
    if (!w.stopping && (abort_->raised() || !w.device_error.ok())) {
      w.stopping = true;
      LOG(INFO) << Name() << ": stopping the program (SIGTERM, then SIGKILL after "
                << assignment_.spec().program().stop_grace_ms() << " ms)";
      program.Stop();
    }
  }
  // The supervisor wrote the program's end before it exited, and may have been reaped before
  // a poll saw that: the status is still in the pipe (its writer is gone, so this never
  // blocks).
  if (status_fd >= 0 && !w.end.has_value()) {
    absl::StatusOr<ProcessEnd> end = program.ReadEnd();
    if (end.ok()) {
      w.end = *end;
    } else {
      w.supervisor = end.status();
    }
  }
  // What the group wrote before it ended.
  if (out_fd >= 0) drain(out_fd, out_lines, false);
  if (err_fd >= 0) drain(err_fd, err_lines, true);
  out_lines.Flush();
  err_lines.Flush();
  send_output(true);
  return w;
}

v1::ProgramExit ProgramGeneration::ExitRecord(const std::optional<ProcessEnd>& end,
                                              std::string summary) const {
  v1::ProgramExit exit;
  exit.set_rank(assignment_.rank());
  exit.set_worker(context_.worker_name);
  exit.set_generation(assignment_.generation());
  if (end.has_value() && end->signaled) {
    exit.set_signal(SignalName(end->signal));
  } else if (end.has_value()) {
    exit.set_exit_code(end->exit_code);
  }
  exit.set_stderr_tail(TailLines(err_kept_, kStderrTailBytes));
  if (absl::StartsWith(summary, "CUDA out of memory") && context_.device != nullptr &&
      context_.device->info().cuda_index >= 0) {
    // The GPU it ran out of, as this worker knows it.
    const DeviceInfo& gpu = context_.device->info();
    absl::StrAppend(&summary, " [", gpu.device, ", ", gpu.name, ", ",
                    HumanBytes(gpu.total_memory_bytes), " in all]");
  }
  exit.set_summary(std::move(summary));
  return exit;
}

absl::Status ProgramGeneration::Outcome(Watched w, const std::string& executable) {
  if (!w.device_error.ok()) {
    // The script's own bug, the same on every try: the job fails at once, saying what to fix.
    const v1::ProgramExit exit = ExitRecord(w.end, std::string(w.device_error.message()));
    LOG(WARNING) << Name() << ": " << w.device_error.message();
    w.device_error.SetPayload(kProgramExitPayload, absl::Cord(exit.SerializeAsString()));
    return w.device_error;
  }
  if (!w.end.has_value()) {
    if (w.stopping) return absl::AbortedError(absl::StrCat(Name(), ": stopped"));
    return absl::UnavailableError(absl::StrCat(
        "worker ", context_.worker_name, ": the program's supervisor ended without its status",
        w.supervisor.ok() ? "" : absl::StrCat(" (", w.supervisor.message(), ")")));
  }
  const ProcessEnd& end = *w.end;
  if (end.exec_failed) return ExecError(end.exec_errno, executable);
  if (!end.signaled && end.exit_code == 0) {
    LOG(INFO) << Name() << ": the program exited 0";
    v1::FinishedReport finished;
    finished.set_job_id(assignment_.job_id());
    finished.set_generation(assignment_.generation());
    reporter_->Finished(finished);
    return absl::OkStatus();
  }
  if (w.stopping) return absl::AbortedError(absl::StrCat(Name(), ": stopped"));
  const v1::ProgramExit exit = ExitRecord(w.end, SummarizeStderr(err_kept_));
  const auto& fatal_codes = assignment_.spec().program().fatal_exit_codes();
  const bool fatal = !end.signaled && std::find(fatal_codes.begin(), fatal_codes.end(),
                                                end.exit_code) != fatal_codes.end();
  const std::string message = absl::StrCat(
      "rank ", assignment_.rank(), " (", context_.worker_name, ") ",
      end.signaled ? absl::StrCat("was killed by ", exit.signal())
                   : absl::StrCat("exited with code ", end.exit_code),
      fatal ? " (a fatal exit code)" : "", exit.summary().empty() ? "" : ": ", exit.summary());
  LOG(WARNING) << Name() << ": " << message;
  absl::Status failed =
      fatal ? absl::FailedPreconditionError(message) : absl::UnavailableError(message);
  failed.SetPayload(kProgramExitPayload, absl::Cord(exit.SerializeAsString()));
  return failed;
}

}  // namespace lockstep::worker
