// Shared-memory float allreduce. Protocol of one sum (op k, W ranks, target W*k):
//   copy own data into slot[rank]; arrive (counter += 1, the last arrival wakes all);
//   wait for W*k arrivals; sum chunk `rank` of all slots into result (slot order 0..W-1, so
//   every rank computes bit-identical sums); reduced += 1; wait for W*k; copy result out.
// Reuse is safe: a rank writes its slot for op k+1 only after every rank finished reading
// slots of op k (the reduced barrier), and nobody writes result for op k+1 before every rank
// has arrived at k+1, which each does only after copying result of op k out.
#include "worker/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "glog/logging.h"

namespace lockstep::worker {
namespace {

constexpr uint64_t kMagic = 0x4c4f434b53544550ULL;  // "LOCKSTEP"
constexpr size_t kHeaderBytes = 4096;
// Larger groups or models go through Gloo rather than pin this much of /dev/shm.
constexpr size_t kMaxMappingBytes = size_t{1} << 30;

long Futex(std::atomic<uint32_t>* addr, int op, uint32_t value, const timespec* timeout) {
  // Shared (not FUTEX_PRIVATE) because waiters live in different processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, value, timeout, nullptr, 0);
}

// a >= b for counters that may wrap.
bool Reached(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

struct Handshake {
  char name[64];
  uint64_t token;
  int64_t ok;
};

// Names live only for the seconds a setup takes; one this old was left by a killed process.
constexpr auto kStaleAge = std::chrono::minutes(10);

// This process's pid namespace (the inode of /proc/self/ns/pid), so that a sweep tells its own
// namespace's dead pids from live processes of another container sharing /dev/shm.
uint64_t PidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Whether `pid` (of this pid namespace) is gone: no such process, or a zombie whose parent has
// not reaped it yet (it will never run again).
bool ProcessGone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  // "PID (COMM) STATE ...": COMM may hold spaces and parentheses; STATE follows the last ')'.
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

// Unlinks rank 0's segment name when it goes out of scope (every path out of Wrap).
struct UnlinkName {
  const char* name = nullptr;
  ~UnlinkName() {
    if (name != nullptr) shm_unlink(name);
  }
};

}  // namespace

struct ShmCommunicator::Header {
  uint64_t magic;
  uint64_t token;
  uint64_t world;
  uint64_t max_bytes;
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> reduced;
};

int ShmCommunicator::SweepStaleSegments() {
  const uint64_t own_ns = PidNamespace();
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    // lockstep-PID-NS-TOKEN, or lockstep-PID-TOKEN as earlier versions named them (those only
    // by age). The data set cache, /dev/shm/lockstep-cache, does not match.
    std::vector<std::string> parts = absl::StrSplit(name, '-');
    int64_t pid = 0;
    uint64_t ns = 0;
    const bool named = parts.size() >= 3 && parts.size() <= 4 && parts[0] == "lockstep" &&
                       absl::SimpleAtoi(parts[1], &pid) && parts.back().size() == 16 &&
                       (parts.size() == 3 || absl::SimpleAtoi(parts[2], &ns));
    if (!named || !entry.is_regular_file(ec)) continue;
    if (parts.size() == 3) ns = ~own_ns;  // unknown namespace: never judged by its pid
    const bool dead = ns == own_ns && pid > 0 && ProcessGone(static_cast<pid_t>(pid));
    const auto age = std::filesystem::file_time_type::clock::now() -
                     std::filesystem::last_write_time(entry.path(), ec);
    if (!dead && (ec || age < kStaleAge)) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) {
      LOG(INFO) << "removed /dev/shm/" << name << ", left by a process that died setting it up";
      ++removed;
    }
  }
  return removed;
}

absl::StatusOr<std::unique_ptr<Communicator>> ShmCommunicator::Wrap(
    std::unique_ptr<Communicator> base, size_t max_bytes, std::chrono::milliseconds timeout,
    std::shared_ptr<AbortSignal> abort) {
  static_assert(sizeof(Header) <= kHeaderBytes);
  const int world = base->size();
  if (world == 1 || max_bytes == 0) return base;
  max_bytes = (max_bytes + 63) / 64 * 64;  // keep every slot cache-line aligned
  const size_t bytes = kHeaderBytes + (static_cast<size_t>(world) + 1) * max_bytes;

  Handshake hs{};
  void* mapping = MAP_FAILED;
  UnlinkName unlink_name;
  if (base->rank() == 0 && bytes <= kMaxMappingBytes) {
    std::random_device rd;
    hs.token = (uint64_t{rd()} << 32) ^ rd();
    absl::SNPrintF(hs.name, sizeof(hs.name), "/lockstep-%d-%d-%016x", getpid(), PidNamespace(),
                   hs.token);
    const int fd = shm_open(hs.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) unlink_name.name = hs.name;
    // posix_fallocate reserves the pages now: a full /dev/shm fails here, not as SIGBUS later.
    if (fd >= 0 && posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0) {
      mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (fd >= 0) close(fd);
    if (mapping != MAP_FAILED) {
      auto* header = new (mapping) Header();
      header->magic = kMagic;
      header->token = hs.token;
      header->world = static_cast<uint64_t>(world);
      header->max_bytes = max_bytes;
      hs.ok = 1;
    } else {
      LOG(WARNING) << "no shared-memory fast path (" << strerror(errno) << "); using Gloo";
    }
  }
  // From here on, every return path of rank 0 unlinks the name (unlink_name).
  struct UnmapOnError {
    void** mapping;
    size_t bytes;
    bool keep = false;
    ~UnmapOnError() {
      if (!keep && *mapping != MAP_FAILED) munmap(*mapping, bytes);
    }
  } unmap{&mapping, bytes};
  const std::atomic<bool>* aborted = abort != nullptr ? &abort->flag() : nullptr;
  if (base->rank() == 0) test_hooks::Reach("shm_setup", -1, aborted);
  LOCKSTEP_RETURN_IF_ERROR(base->Broadcast(&hs, sizeof(hs), 0));
  if (base->rank() != 0) test_hooks::Reach("shm_setup", -1, aborted);
  int64_t ok = 0;
  if (hs.ok != 0) {
    if (base->rank() == 0) {
      ok = 1;
    } else {
      // Fails when the peers do not share this host's /dev/shm (other machine or container).
      const int fd = shm_open(hs.name, O_RDWR, 0);
      struct stat st {};
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes) {
        mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      }
      if (fd >= 0) close(fd);
      if (mapping != MAP_FAILED) {
        const auto* header = static_cast<const Header*>(mapping);
        ok = header->magic == kMagic && header->token == hs.token ? 1 : 0;
      }
    }
  }
  // Every rank contributes only after it tried to map, so once the sum is done on rank 0 nobody
  // needs the name any more; rank 0 unlinks it right here (mappings outlive the name).
  absl::Status agreed = base->AllreduceSum(&ok, 1);
  if (unlink_name.name != nullptr) {
    shm_unlink(unlink_name.name);
    unlink_name.name = nullptr;
  }
  if (!agreed.ok()) return agreed;
  if (ok != world) return base;
  unmap.keep = true;
  return std::unique_ptr<Communicator>(new ShmCommunicator(std::move(base), mapping, bytes,
                                                           max_bytes, timeout, std::move(abort)));
}

ShmCommunicator::ShmCommunicator(std::unique_ptr<Communicator> base, void* mapping,
                                 size_t mapping_bytes, size_t max_bytes,
                                 std::chrono::milliseconds timeout,
                                 std::shared_ptr<AbortSignal> abort)
    : base_(std::move(base)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      header_(static_cast<Header*>(mapping)),
      slots_(static_cast<char*>(mapping) + kHeaderBytes),
      result_(slots_ + static_cast<size_t>(base_->size()) * max_bytes),
      max_bytes_(max_bytes),
      timeout_(timeout),
      abort_(std::move(abort)) {
  if (abort_ != nullptr) on_abort_ = abort_->OnRaise([this] { Abort(); });
}

ShmCommunicator::~ShmCommunicator() {
  on_abort_.Reset();
  munmap(mapping_, mapping_bytes_);
}

void ShmCommunicator::Abort() {
  aborted_ = true;
  // Wake our own waiters; they re-check aborted_. (Peers are woken by their own agents.)
  Futex(&header_->arrived, FUTEX_WAKE, INT_MAX, nullptr);
  Futex(&header_->reduced, FUTEX_WAKE, INT_MAX, nullptr);
  base_->Abort();
}

absl::Status ShmCommunicator::WaitFor(std::atomic<uint32_t>& counter, uint32_t target,
                                      const char* phase) {
  // A short spin catches peers that are a few microseconds behind; then sleep in the kernel,
  // because spinning on an oversubscribed host steals the very CPU the peer needs.
  for (int i = 0; i < 2000; ++i) {
    if (Reached(counter.load(std::memory_order_acquire), target)) return absl::OkStatus();
    __builtin_ia32_pause();
  }
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout_);
  while (true) {
    const uint32_t seen = counter.load(std::memory_order_acquire);
    if (Reached(seen, target)) return absl::OkStatus();
    if (aborted_.load(std::memory_order_relaxed)) {
      return absl::AbortedError(absl::StrCat("shared-memory allreduce aborted while ", phase));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("shared-memory allreduce: peers did not arrive within ", timeout_.count(),
                       " ms while ", phase));
    }
    // Re-check every 50 ms even without a wake-up, for the abort flag and the deadline.
    const timespec wait{0, 50'000'000};
    Futex(&counter, FUTEX_WAIT, seen, &wait);
  }
}

template <typename T>
absl::Status ShmCommunicator::ReduceSlots(size_t offset, size_t count) {
  const uint32_t world = static_cast<uint32_t>(size());
  const size_t r = static_cast<size_t>(rank());
  const uint32_t target = world * ++ops_;
  if (header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
    Futex(&header_->arrived, FUTEX_WAKE, INT_MAX, nullptr);
  }
  LOCKSTEP_RETURN_IF_ERROR(WaitFor(header_->arrived, target, "gathering"));
  // Each rank sums its share of the range, adding the slots in rank order.
  const size_t begin = offset + count * r / world, end = offset + count * (r + 1) / world;
  T* out = reinterpret_cast<T*>(result_) + begin;
  std::memcpy(out, reinterpret_cast<const T*>(slots_) + begin, (end - begin) * sizeof(T));
  for (uint32_t j = 1; j < world; ++j) {
    const T* in = reinterpret_cast<const T*>(slots_ + j * max_bytes_) + begin;
    for (size_t i = 0; i < end - begin; ++i) out[i] += in[i];
  }
  if (header_->reduced.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
    Futex(&header_->reduced, FUTEX_WAKE, INT_MAX, nullptr);
  }
  return WaitFor(header_->reduced, target, "reducing");
}

template <typename T>
absl::Status ShmCommunicator::Sum(T* data, size_t count) {
  if (count == 0) return absl::OkStatus();
  std::memcpy(slots_ + static_cast<size_t>(rank()) * max_bytes_, data, count * sizeof(T));
  LOCKSTEP_RETURN_IF_ERROR(ReduceSlots<T>(0, count));
  std::memcpy(data, result_, count * sizeof(T));
  return absl::OkStatus();
}

int64_t* ShmCommunicator::StagingInt64(size_t count) {
  if (count * sizeof(int64_t) > max_bytes_) return nullptr;
  return reinterpret_cast<int64_t*>(slots_ + static_cast<size_t>(rank()) * max_bytes_);
}

absl::Status ShmCommunicator::SumStagedInt64(size_t offset, size_t count) {
  if ((offset + count) * sizeof(int64_t) > max_bytes_) {
    return absl::InvalidArgumentError("staged sum beyond the shared-memory segment");
  }
  if (count == 0) return absl::OkStatus();
  return ReduceSlots<int64_t>(offset, count);
}

const int64_t* ShmCommunicator::StagedResultInt64() const {
  return reinterpret_cast<const int64_t*>(result_);
}

absl::Status ShmCommunicator::AllreduceSum(float* data, size_t count) {
  if (count * sizeof(float) > max_bytes_) return base_->AllreduceSum(data, count);
  return Sum(data, count);
}
absl::Status ShmCommunicator::AllreduceSum(double* data, size_t count) {
  return base_->AllreduceSum(data, count);
}
// Integer sums are exact in any order, so they may take either path.
absl::Status ShmCommunicator::AllreduceSum(int64_t* data, size_t count) {
  if (count * sizeof(int64_t) > max_bytes_) return base_->AllreduceSum(data, count);
  return Sum(data, count);
}
absl::Status ShmCommunicator::Broadcast(void* data, size_t bytes, int root) {
  return base_->Broadcast(data, bytes, root);
}
absl::Status ShmCommunicator::Barrier() { return base_->Barrier(); }

}  // namespace lockstep::worker
