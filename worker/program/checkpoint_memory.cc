#include "worker/program/checkpoint_memory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/bytes.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace lockstep::worker {
namespace {

// Little-endian on every platform the worker runs on (x86-64, aarch64).
uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

std::string Readable(const std::string& name) {
  std::string out;
  for (char c : name) out.push_back(isalnum(static_cast<unsigned char>(c)) || c == '-' ? c : '_');
  return out;
}

std::string Bytes(int64_t n) { return absl::StrCat(n, " bytes"); }

// The file a worker holds locked while its checkpoint directory is in use.
constexpr char kLockName[] = ".lock";

}  // namespace

CheckpointSlotHeader ReadCheckpointSlotHeader(int fd) {
  CheckpointSlotHeader h;
  unsigned char buf[40];
  if (pread(fd, buf, sizeof buf, 0) != static_cast<ssize_t>(sizeof buf)) return h;
  h.magic_ok = std::memcmp(buf, kCheckpointSlotMagic, 8) == 0;
  h.sequence = Load64(buf + 8);
  h.step = static_cast<int64_t>(Load64(buf + 16));
  h.payload_bytes = Load64(buf + 24);
  h.checksum = Load64(buf + 32);
  return h;
}

absl::StatusOr<HeldCheckpoint> VerifyCheckpointSlot(const std::string& path, int slot) {
  // The program writes this file: every length is checked before use, and the payload is read
  // with pread (a file truncated meanwhile gives a short read here, never a signal).
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "opening", path);
  absl::Cleanup close_fd = [fd] { close(fd); };
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "reading", path);
  const CheckpointSlotHeader h = ReadCheckpointSlotHeader(fd);
  if (!h.magic_ok || h.sequence == 0) {
    return absl::NotFoundError(absl::StrCat(path, ": no committed save"));
  }
  const uint64_t room = st.st_size > kCheckpointSlotHeaderBytes
                            ? static_cast<uint64_t>(st.st_size - kCheckpointSlotHeaderBytes)
                            : 0;
  if (h.payload_bytes == 0 || h.payload_bytes > room) {
    return absl::DataLossError(absl::StrCat(path, ": payload of ", h.payload_bytes,
                                            " bytes does not fit its ", st.st_size, "-byte slot"));
  }
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState");
  absl::Cleanup free_state = [state] { XXH3_freeState(state); };
  XXH3_64bits_reset(state);
  std::vector<unsigned char> buffer(1 << 20);
  uint64_t done = 0;
  while (done < h.payload_bytes) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buffer.size(), h.payload_bytes - done));
    const ssize_t n = pread(fd, buffer.data(), want,
                            static_cast<off_t>(kCheckpointSlotHeaderBytes + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path, ": the save of step ", h.step,
                                              " ends early (the slot shrank)"));
    }
    XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
  }
  // The sequence again: a writer that began meanwhile zeroed it first.
  const CheckpointSlotHeader after = ReadCheckpointSlotHeader(fd);
  if (XXH3_64bits_digest(state) != h.checksum || after.sequence != h.sequence) {
    return absl::DataLossError(absl::StrCat(path, ": the save of step ", h.step,
                                            " does not match its checksum (torn or corrupted)"));
  }
  HeldCheckpoint held;
  held.slot = slot;
  held.step = h.step;
  held.sequence = h.sequence;
  held.payload_bytes = h.payload_bytes;
  held.checksum = h.checksum;
  held.path = path;
  return held;
}

absl::StatusOr<CheckpointSlotHeader> ReadCheckpointSlotHeader(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "opening", path);
  const CheckpointSlotHeader h = ReadCheckpointSlotHeader(fd);
  close(fd);
  return h;
}

absl::Status ReadCheckpointPayload(const HeldCheckpoint& held, size_t chunk,
                                   const std::function<absl::Status(const void*, size_t)>& sink) {
  const int fd = open(held.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "opening", held.path);
  absl::Cleanup close_fd = [fd] { close(fd); };
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState");
  absl::Cleanup free_state = [state] { XXH3_freeState(state); };
  XXH3_64bits_reset(state);
  const auto changed = [&] {
    return absl::DataLossError(absl::StrCat(held.path, ": the save of step ", held.step,
                                            " does not match its checksum (overwritten or "
                                            "corrupted while read)"));
  };
  std::vector<unsigned char> buffer(chunk);
  uint64_t done = 0;
  while (done < held.payload_bytes) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(chunk, held.payload_bytes - done));
    const ssize_t n = pread(fd, buffer.data(), want,
                            static_cast<off_t>(kCheckpointSlotHeaderBytes + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return changed();
    XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(n));
    // Checked before the bytes leave: a writer that began meanwhile zeroed the sequence first.
    if (ReadCheckpointSlotHeader(fd).sequence != held.sequence) return changed();
    LOCKSTEP_RETURN_IF_ERROR(sink(buffer.data(), static_cast<size_t>(n)));
    done += static_cast<uint64_t>(n);
  }
  if (XXH3_64bits_digest(state) != held.checksum) return changed();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotWriter>> SlotWriter::Begin(const std::vector<std::string>& pair,
                                                             int64_t step, uint64_t payload_bytes,
                                                             uint64_t checksum) {
  if (pair.size() != 2) return absl::InternalError("a slot pair has two slots");
  uint64_t sequences[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<CheckpointSlotHeader> h = ReadCheckpointSlotHeader(pair[i]);
    if (!h.ok()) return h.status();
    sequences[i] = h->magic_ok ? h->sequence : 0;
  }
  auto writer = std::unique_ptr<SlotWriter>(new SlotWriter());
  writer->slot_ = sequences[0] <= sequences[1] ? 0 : 1;
  writer->path_ = pair[writer->slot_];
  writer->step_ = step;
  writer->payload_bytes_ = payload_bytes;
  writer->checksum_ = checksum;
  writer->sequence_ = std::max(sequences[0], sequences[1]) + 1;
  writer->fd_ = open(writer->path_.c_str(), O_RDWR | O_CLOEXEC);
  if (writer->fd_ < 0) return ErrnoStatus(errno, "opening", writer->path_);
  struct stat st;
  if (fstat(writer->fd_, &st) != 0) return ErrnoStatus(errno, "reading", writer->path_);
  if (static_cast<uint64_t>(st.st_size) < kCheckpointSlotHeaderBytes + payload_bytes) {
    return absl::InternalError(absl::StrCat(writer->path_, ": a ", st.st_size,
                                            "-byte slot cannot hold a payload of ", payload_bytes,
                                            " bytes"));
  }
  unsigned char head[40] = {};
  std::memcpy(head, kCheckpointSlotMagic, 8);  // sequence 0: not committed while written
  if (pwrite(writer->fd_, head, sizeof head, 0) != static_cast<ssize_t>(sizeof head)) {
    return ErrnoStatus(errno, "writing", writer->path_);
  }
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState");
  XXH3_64bits_reset(state);
  writer->hash_ = state;
  return writer;
}

SlotWriter::~SlotWriter() {
  if (fd_ >= 0) close(fd_);
  if (hash_ != nullptr) XXH3_freeState(static_cast<XXH3_state_t*>(hash_));
}

absl::Status SlotWriter::Append(const void* data, size_t n) {
  if (written_ + n > payload_bytes_) {
    return absl::DataLossError(absl::StrCat("the copy of step ", step_, " is longer than its ",
                                            payload_bytes_, "-byte payload"));
  }
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t w = pwrite(fd_, p + done, n - done,
                             static_cast<off_t>(kCheckpointSlotHeaderBytes + written_ + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return ErrnoStatus(errno, "writing", path_);
    done += static_cast<size_t>(w);
  }
  XXH3_64bits_update(static_cast<XXH3_state_t*>(hash_), data, n);
  written_ += n;
  return absl::OkStatus();
}

absl::StatusOr<HeldCheckpoint> SlotWriter::Commit() {
  if (written_ != payload_bytes_ ||
      XXH3_64bits_digest(static_cast<XXH3_state_t*>(hash_)) != checksum_) {
    return absl::DataLossError(absl::StrCat(
        "the copy of step ", step_, " does not match its checksum (", written_, " of ",
        payload_bytes_, " bytes received)"));
  }
  unsigned char fields[24];
  const uint64_t step = static_cast<uint64_t>(step_);
  std::memcpy(fields, &step, 8);
  std::memcpy(fields + 8, &payload_bytes_, 8);
  std::memcpy(fields + 16, &checksum_, 8);
  if (pwrite(fd_, fields, sizeof fields, 16) != static_cast<ssize_t>(sizeof fields) ||
      pwrite(fd_, &sequence_, sizeof sequence_, 8) != static_cast<ssize_t>(sizeof sequence_)) {
    return ErrnoStatus(errno, "committing", path_);
  }
  HeldCheckpoint held;
  held.slot = slot_;
  held.step = step_;
  held.sequence = sequence_;
  held.payload_bytes = payload_bytes_;
  held.checksum = checksum_;
  held.path = path_;
  return held;
}

absl::StatusOr<std::unique_ptr<CheckpointMemory>> CheckpointMemory::Create(
    const std::string& dir, const std::string& worker, int64_t limit_bytes, uid_t owner_uid,
    gid_t owner_gid) {
  const std::string prefix = absl::StrCat("lockstep-checkpoints-", Readable(worker), "-");
  // What an earlier run of this worker left behind when it was killed (its lock is free): its
  // saves can only be restored by the run that made them, and they hold the tmpfs's memory.
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename();
    if (name.rfind(prefix, 0) != 0 || name.size() != prefix.size() + 6) continue;
    const int lock = open((entry.path() / kLockName).c_str(), O_RDONLY | O_CLOEXEC);
    const bool free = lock < 0 || flock(lock, LOCK_EX | LOCK_NB) == 0;
    if (lock >= 0) close(lock);
    if (free) std::filesystem::remove_all(entry.path(), error);
  }
  std::string pattern = absl::StrCat(dir, "/", prefix, "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return ErrnoStatus(errno, "creating the checkpoint memory directory under", dir);
  }
  // Others may pass through to a slot whose name they were given, never list the names.
  chmod(pattern.c_str(), 0711);
  // Held while this worker lives: the next run of it removes the directory only when free.
  const std::string lock_path = absl::StrCat(pattern, "/", kLockName);
  const int lock = open(lock_path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
  if (lock < 0 || flock(lock, LOCK_EX | LOCK_NB) != 0) {
    const absl::Status s = ErrnoStatus(errno, "locking", lock_path);
    if (lock >= 0) close(lock);
    std::filesystem::remove_all(pattern, error);
    return s;
  }
  auto memory = std::unique_ptr<CheckpointMemory>(
      new CheckpointMemory(pattern, limit_bytes, owner_uid, owner_gid));
  memory->lock_fd_ = lock;
  return memory;
}

CheckpointMemory::~CheckpointMemory() {
  absl::MutexLock lock(&mu_);
  for (JobSlots& job : jobs_) DropLocked(job);
  jobs_.clear();
  unlink(absl::StrCat(dir_, "/", kLockName).c_str());
  rmdir(dir_.c_str());
  if (lock_fd_ >= 0) close(lock_fd_);
}

void CheckpointMemory::DropLocked(JobSlots& job) {
  for (const std::string& path : job.paths) unlink(path.c_str());
  job.paths.clear();
  job.bytes = 0;
}

CheckpointMemory::JobSlots& CheckpointMemory::FindOrAddLocked(const std::string& job_id,
                                                             const std::string& source) {
  for (JobSlots& job : jobs_) {
    if (job.job_id == job_id && job.source == source) return job;
  }
  jobs_.push_back(JobSlots{job_id, source, {}, 0});
  return jobs_.back();
}

int64_t CheckpointMemory::UsedLocked() const {
  int64_t used = 0;
  for (const JobSlots& job : jobs_) used += static_cast<int64_t>(job.paths.size()) * job.bytes;
  return used;
}

absl::StatusOr<std::vector<std::string>> CheckpointMemory::Slots(const std::string& job_id,
                                                                 int64_t bytes) {
  absl::MutexLock lock(&mu_);
  DropAllButLocked(job_id);  // one job's slots at a time: a worker serves one job
  JobSlots& job = FindOrAddLocked(job_id, "");
  const int64_t want = std::max(bytes, job.bytes);
  if (want > limit_bytes_ / 2) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a checkpoint of ", Bytes(bytes), " does not fit in this worker's checkpoint memory: ",
        "it keeps two saves, ", Bytes(2 * want), ", and --checkpoint_memory_bytes is ",
        Bytes(limit_bytes_)));
  }
  // The job's own saves come first: copies of peers' saves make room.
  if (UsedLocked() + 2 * (want - job.bytes) > limit_bytes_) {
    for (JobSlots& other : jobs_) {
      if (!other.source.empty()) DropLocked(other);
    }
    jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(),
                               [](const JobSlots& j) { return !j.source.empty(); }),
                jobs_.end());
  }
  return SlotsLocked(FindOrAddLocked(job_id, ""), bytes);
}

absl::StatusOr<std::vector<std::string>> CheckpointMemory::ReplicaSlots(
    const std::string& job_id, const std::string& source_worker, int64_t bytes) {
  if (source_worker.empty()) return absl::InvalidArgumentError("source_worker: required");
  absl::MutexLock lock(&mu_);
  DropAllButLocked(job_id);
  JobSlots& job = FindOrAddLocked(job_id, source_worker);
  const int64_t grow = 2 * std::max<int64_t>(0, bytes - job.bytes);
  if (UsedLocked() + grow > limit_bytes_) {
    const int64_t used = UsedLocked();
    if (job.paths.empty()) {
      jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(),
                                 [&](const JobSlots& j) {
                                   return j.job_id == job_id && j.source == source_worker;
                                 }),
                  jobs_.end());
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "a copy of ", source_worker, "'s checkpoint of ", Bytes(bytes),
        " does not fit in this worker's checkpoint memory: ", Bytes(used), " are kept, two ",
        "copies take ", Bytes(grow), " more, and --checkpoint_memory_bytes is ",
        Bytes(limit_bytes_)));
  }
  return SlotsLocked(job, bytes);
}

absl::StatusOr<std::vector<std::string>> CheckpointMemory::SlotsLocked(JobSlots& job,
                                                                       int64_t bytes) {
  const int64_t want = std::max(bytes, job.bytes);
  if (job.paths.empty()) {
    for (int i = 0; i < 2; ++i) {
      // ".slot": the job's own saves, which its program maps; ".copy": a peer's.
      const std::string path =
          absl::StrCat(dir_, "/", RandomSecret(), job.source.empty() ? ".slot" : ".copy");
      const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) {
        const absl::Status s = ErrnoStatus(errno, "creating", path);
        DropLocked(job);
        return s;
      }
      close(fd);
      job.paths.push_back(path);
    }
  }
  if (want > job.bytes) {
    for (const std::string& path : job.paths) {
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      // Allocated now, so that a full tmpfs is this error and not a SIGBUS in the program.
      const int err = fd < 0 ? errno : posix_fallocate(fd, 0, want);
      if (fd >= 0) close(fd);
      if (err != 0) {
        // The slots' sizes are what they were before (fallocate does not shrink).
        return ErrnoStatus(err, absl::StrCat("reserving ", Bytes(want), " of checkpoint memory in"),
                           path);
      }
    }
    job.bytes = want;
  }
  // The program maps its own slots; copies of peers' saves stay the worker's.
  for (const std::string& path : job.paths) {
    if (job.source.empty() &&
        (uid_ != static_cast<uid_t>(-1) || gid_ != static_cast<gid_t>(-1)) &&
        chown(path.c_str(), uid_, gid_) != 0) {
      return ErrnoStatus(errno, "handing to the programs' user", path);
    }
  }
  return job.paths;
}

int64_t CheckpointMemory::slot_bytes(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  for (const JobSlots& job : jobs_) {
    if (job.job_id == job_id && job.source.empty()) return job.bytes;
  }
  return 0;
}

std::vector<std::string> CheckpointMemory::ReplicaSources(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> sources;
  for (const JobSlots& job : jobs_) {
    if (job.job_id == job_id && !job.source.empty() && !job.paths.empty()) {
      sources.push_back(job.source);
    }
  }
  return sources;
}

std::vector<std::string> CheckpointMemory::PathsOf(const std::string& job_id,
                                                  const std::string& source) const {
  absl::MutexLock lock(&mu_);
  for (const JobSlots& job : jobs_) {
    if (job.job_id == job_id && job.source == source) return job.paths;
  }
  return {};
}

namespace {
void NewestFirst(std::vector<HeldCheckpoint>& held) {
  std::sort(held.begin(), held.end(), [](const HeldCheckpoint& a, const HeldCheckpoint& b) {
    return a.sequence > b.sequence;
  });
}
}  // namespace

std::vector<HeldCheckpoint> CheckpointMemory::Held(const std::string& job_id,
                                                   const std::string& source_worker,
                                                   std::vector<std::string>* refused) const {
  const std::vector<std::string> paths = PathsOf(job_id, source_worker);
  std::vector<HeldCheckpoint> held;
  for (int i = 0; i < static_cast<int>(paths.size()); ++i) {
    absl::StatusOr<HeldCheckpoint> h = VerifyCheckpointSlot(paths[i], i);
    if (h.ok()) {
      held.push_back(*std::move(h));
    } else if (!absl::IsNotFound(h.status())) {
      LOG(WARNING) << "checkpoint memory: " << h.status().message();
      if (refused != nullptr) {
        // Without the slot's path: its name is not for the job's readers.
        const absl::string_view why =
            absl::StripPrefix(h.status().message(), absl::StrCat(paths[i], ": "));
        refused->push_back(source_worker.empty()
                               ? absl::StrCat("its own save: ", why)
                               : absl::StrCat("its copy of ", source_worker, "'s save: ", why));
      }
    }
  }
  NewestFirst(held);
  return held;
}

std::vector<HeldCheckpoint> CheckpointMemory::Committed(const std::string& job_id,
                                                        const std::string& source_worker) const {
  const std::vector<std::string> paths = PathsOf(job_id, source_worker);
  std::vector<HeldCheckpoint> held;
  for (int i = 0; i < static_cast<int>(paths.size()); ++i) {
    absl::StatusOr<CheckpointSlotHeader> h = ReadCheckpointSlotHeader(paths[i]);
    if (!h.ok() || !h->magic_ok || h->sequence == 0) continue;
    HeldCheckpoint c;
    c.slot = i;
    c.step = h->step;
    c.sequence = h->sequence;
    c.payload_bytes = h->payload_bytes;
    c.checksum = h->checksum;
    c.path = paths[i];
    held.push_back(std::move(c));
  }
  NewestFirst(held);
  return held;
}

void CheckpointMemory::DiscardAfter(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  for (const JobSlots& job : jobs_) {
    if (job.job_id != job_id) continue;
    for (const std::string& path : job.paths) {
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      const CheckpointSlotHeader h = ReadCheckpointSlotHeader(fd);
      if (h.magic_ok && h.sequence != 0 && h.step > step) {
        const uint64_t zero = 0;
        (void)!pwrite(fd, &zero, sizeof zero, 8);
      }
      close(fd);
    }
  }
}

void CheckpointMemory::Drop(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (JobSlots& job : jobs_) {
    if (job.job_id == job_id) DropLocked(job);
  }
  jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(),
                             [&](const JobSlots& j) { return j.job_id == job_id; }),
              jobs_.end());
}

void CheckpointMemory::DropAllBut(const std::string& keep_job_id) {
  absl::MutexLock lock(&mu_);
  DropAllButLocked(keep_job_id);
}

void CheckpointMemory::DropAllButLocked(const std::string& keep_job_id) {
  for (JobSlots& job : jobs_) {
    if (job.job_id != keep_job_id) DropLocked(job);
  }
  jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(),
                             [&](const JobSlots& j) { return j.job_id != keep_job_id; }),
              jobs_.end());
}

int64_t CheckpointMemory::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return UsedLocked();
}

SaveFollower::SaveFollower(CheckpointMemory* memory, std::string job_id, std::string what,
                           Options options,
                           std::function<absl::Status(const HeldCheckpoint&)> act,
                           std::function<void()> cancel)
    : memory_(memory),
      job_id_(std::move(job_id)),
      what_(std::move(what)),
      options_{std::max(1, options.every), options.interval,
               std::clamp(options.duty, 0.01, 1.0)},
      act_(std::move(act)),
      cancel_(std::move(cancel)) {
  thread_ = std::thread([this] { Loop(); });
}

SaveFollower::~SaveFollower() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (cancel_) cancel_();
  thread_.join();
}

void SaveFollower::Wake() {
  absl::MutexLock lock(&mu_);
  woken_ = true;
}

SaveFollower::Stats SaveFollower::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

bool SaveFollower::WaitDone(int64_t step, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const auto done = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return done_ >= step || stopping();
  };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout) && done_ >= step;
}

void SaveFollower::Loop() {
  uint64_t seen = 0;   // the newest commit sequence seen
  int64_t counted = 0; // saves since the last action
  absl::Time not_before = absl::InfinitePast();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping() || woken_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), kPoll);
      if (stopping()) return;
      woken_ = false;
    }
    // Each save commits one more than the pair's sequence: the saves made since the last look.
    const std::vector<HeldCheckpoint> saves = memory_->Committed(job_id_);
    if (saves.empty()) continue;
    const uint64_t sequence = saves.front().sequence;
    if (sequence != seen) {
      counted += seen != 0 && sequence > seen ? static_cast<int64_t>(sequence - seen) : 1;
      seen = sequence;
    }
    // Due: enough saves since the last action, and its share of the time left.
    if (counted < options_.every || absl::Now() < not_before) continue;
    const HeldCheckpoint& newest = saves.front();
    const absl::Time start = absl::Now();
    const absl::Status acted = act_(newest);
    const absl::Time end = absl::Now();
    not_before = std::max(start + options_.interval,
                          end + (end - start) * (1.0 / options_.duty - 1.0));
    // A failed action is tried again (on the newest save then), not left for the next save.
    counted = acted.ok() || stopping() ? 0 : options_.every;
    absl::MutexLock lock(&mu_);
    if (acted.ok()) {
      ++stats_.done;
      stats_.last_step = newest.step;
      stats_.last_bytes = newest.payload_bytes;
      stats_.last_time = end - start;
      if (stats_.done == 1) {
        LOG(INFO) << what_ << " of job " << job_id_ << ": step " << stats_.last_step << ", "
                  << HumanBytes(static_cast<int64_t>(stats_.last_bytes)) << " in "
                  << absl::FormatDuration(stats_.last_time);
      }
    } else if (!stopping()) {
      ++stats_.failed;
      LOG_EVERY_N(WARNING, 20) << what_ << " of job " << job_id_ << " failed: " << acted;
    }
    done_ = std::max(done_, newest.step);
  }
}

}  // namespace lockstep::worker
