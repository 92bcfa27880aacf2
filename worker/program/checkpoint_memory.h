// The worker's memory for program jobs' checkpoints (lockstep.torch.Checkpointer,
// docs/programs.md): two slots per job, files in a directory of the worker's own on a tmpfs
// (--checkpoint_memory_dir), so a save outlives the process that made it. The process writes a
// slot through a shared mapping; the worker reads its header and checks its checksum, never
// trusting the process.
//
// A slot's layout (little-endian):
//   [0, 8)      magic "LSCKPT01"
//   [8, 16)     commit sequence: 0 while the slot is written; set last, to one more than
//               either slot's, when the save is complete
//   [16, 24)    step (signed)
//   [24, 32)    payload length
//   [32, 40)    XXH3-64 of the payload
//   [4096, ...) payload: a safetensors file (an 8-byte header length, a JSON header, raw data)
// A save the process did not finish has sequence 0, or a checksum that does not match: it is
// never restored, and the other slot (the previous save) is.
//
// The worker also keeps copies of its checkpoint peers' saves (worker/program/checkpoint_peer.h):
// two slots per job and source worker, in the same layout, written by SlotWriter, within the
// same --checkpoint_memory_bytes (a job's own saves come first: their growth drops copies).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lockstep::worker {

inline constexpr char kCheckpointSlotMagic[] = "LSCKPT01";
inline constexpr int64_t kCheckpointSlotHeaderBytes = 4096;

// A slot's header as read (not yet checked against its payload).
struct CheckpointSlotHeader {
  bool magic_ok = false;
  uint64_t sequence = 0;
  int64_t step = 0;
  uint64_t payload_bytes = 0;
  uint64_t checksum = 0;
};

// A committed save: its slot, step and sequence, its checksum verified.
struct HeldCheckpoint {
  int slot = 0;
  int64_t step = 0;
  uint64_t sequence = 0;
  uint64_t payload_bytes = 0;
  uint64_t checksum = 0;
  std::string path;
};

class CheckpointMemory {
 public:
  // Creates DIR/lockstep-checkpoints-WORKER-XXXXXX (mode 0711: files are reached by name only),
  // locked while this object lives, after removing those of WORKER's earlier runs whose lock is
  // free (a killed worker's); `limit_bytes` the most its slots may take together. Slots are handed to `owner_uid` /
  // `owner_gid` (the programs' user; -1: the worker's own).
  static absl::StatusOr<std::unique_ptr<CheckpointMemory>> Create(const std::string& dir,
                                                                  const std::string& worker,
                                                                  int64_t limit_bytes,
                                                                  uid_t owner_uid, gid_t owner_gid);
  ~CheckpointMemory();  // removes the directory and every slot

  // The job's two slots, each grown to at least `bytes` (header included); a worker keeps one
  // job's slots, so another job's go first. RESOURCE_EXHAUSTED naming the numbers when they
  // would exceed the limit; INTERNAL with the system's reason when a file cannot be made.
  absl::StatusOr<std::vector<std::string>> Slots(const std::string& job_id, int64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t slot_bytes(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Two slots for copies of `source_worker`'s saves of the job (grown to at least `bytes`).
  // RESOURCE_EXHAUSTED naming the numbers when they do not fit beside what is kept.
  absl::StatusOr<std::vector<std::string>> ReplicaSlots(const std::string& job_id,
                                                        const std::string& source_worker,
                                                        int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // The job's committed saves whose payload matches its checksum, newest first: its own, or
  // the copies kept of `source_worker`'s.
  // `refused` (if given) gets, in words, the committed ones that do not match.
  std::vector<HeldCheckpoint> Held(const std::string& job_id,
                                   const std::string& source_worker = "",
                                   std::vector<std::string>* refused = nullptr) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same without reading the payloads: the slots' headers that say committed, newest
  // first (a reader checks the checksum as it reads, ReadCheckpointPayload).
  std::vector<HeldCheckpoint> Committed(const std::string& job_id,
                                        const std::string& source_worker = "") const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The source workers whose saves of the job this worker keeps copies of.
  std::vector<std::string> ReplicaSources(const std::string& job_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Marks every save of the job after `step` as not committed, its own and the copies (a group
  // that resumed from `step` never restores a later state of another history).
  void DiscardAfter(const std::string& job_id, int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the job's slots (the job ended); every job's other than `keep_job_id`'s.
  void Drop(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  void DropAllBut(const std::string& keep_job_id) ABSL_LOCKS_EXCLUDED(mu_);

  int64_t limit_bytes() const { return limit_bytes_; }
  int64_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& dir() const { return dir_; }

 private:
  struct JobSlots {
    std::string job_id;
    std::string source;              // "" for the job's own saves; else whose copies
    std::vector<std::string> paths;  // two, once made
    int64_t bytes = 0;
  };
  absl::StatusOr<std::vector<std::string>> SlotsLocked(JobSlots& job, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JobSlots& FindOrAddLocked(const std::string& job_id, const std::string& source)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t UsedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> PathsOf(const std::string& job_id, const std::string& source) const
      ABSL_LOCKS_EXCLUDED(mu_);
  CheckpointMemory(std::string dir, int64_t limit_bytes, uid_t uid, gid_t gid)
      : dir_(std::move(dir)), limit_bytes_(limit_bytes), uid_(uid), gid_(gid) {}
  void DropLocked(JobSlots& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropAllButLocked(const std::string& keep_job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  const int64_t limit_bytes_;
  const uid_t uid_;
  const gid_t gid_;
  int lock_fd_ = -1;
  mutable absl::Mutex mu_;
  std::vector<JobSlots> jobs_ ABSL_GUARDED_BY(mu_);
};

// A slot file's header (`magic_ok` false for a short or foreign file).
CheckpointSlotHeader ReadCheckpointSlotHeader(int fd);

// Writes one save into the older of a pair of slots: begun with the save's header (its commit
// sequence zeroed first), fed its payload in order, committed when the payload matches the
// checksum (the sequence, one more than either slot's, written last). A writer destroyed
// uncommitted leaves that slot uncommitted, and the other slot as it was.
class SlotWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SlotWriter>> Begin(const std::vector<std::string>& pair,
                                                           int64_t step, uint64_t payload_bytes,
                                                           uint64_t checksum);
  ~SlotWriter();
  absl::Status Append(const void* data, size_t n);
  // DATA_LOSS naming the step when the payload is short, long, or does not match.
  absl::StatusOr<HeldCheckpoint> Commit();

 private:
  SlotWriter() = default;
  int fd_ = -1;
  int slot_ = 0;
  std::string path_;
  int64_t step_ = 0;
  uint64_t payload_bytes_ = 0, checksum_ = 0, sequence_ = 0, written_ = 0;
  void* hash_ = nullptr;  // XXH3_state_t
};

// Does something with a job's newest committed save, in the background (a copy to a peer, a
// write to disk), never blocking the program: its thread watches the job's slots (their
// headers, every kPoll, or at once after Wake()), counts the saves by their commit sequences,
// and after every `every`-th acts on the newest committed save then (saves made meanwhile are
// coalesced). Its share of the time is bounded: an action starts no sooner than `interval`
// after the previous one began, nor sooner than its duration times (1/duty - 1) after it ended.
// Errors are logged (`what` names the action) and counted; the next turn tries again.
class SaveFollower {
 public:
  static constexpr absl::Duration kPoll = absl::Milliseconds(10);
  struct Options {
    int every = 1;
    absl::Duration interval = absl::ZeroDuration();
    double duty = 1.0;  // (0, 1]
  };
  struct Stats {
    int64_t done = 0, failed = 0;
    int64_t last_step = 0;
    uint64_t last_bytes = 0;
    absl::Duration last_time;
  };
  // `cancel` (may be null) is called, under no lock of the follower's, when it is destroyed
  // while acting: it ends the action early.
  SaveFollower(CheckpointMemory* memory, std::string job_id, std::string what, Options options,
               std::function<absl::Status(const HeldCheckpoint&)> act,
               std::function<void()> cancel = nullptr);
  ~SaveFollower();
  SaveFollower(const SaveFollower&) = delete;
  SaveFollower& operator=(const SaveFollower&) = delete;
  // Looks at the slots now (a save was just committed) instead of at the next poll.
  void Wake() ABSL_LOCKS_EXCLUDED(mu_);
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until a save of `step` or later was acted on, or failed (tests, benchmarks).
  bool WaitDone(int64_t step, absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const { return stopping_.load(std::memory_order_relaxed); }

 private:
  void Loop();

  CheckpointMemory* const memory_;
  const std::string job_id_, what_;
  const Options options_;
  const std::function<absl::Status(const HeldCheckpoint&)> act_;
  const std::function<void()> cancel_;
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;  // the last step acted on or given up
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Streams a verified save's payload to `sink` in chunks of at most `chunk` bytes, checking it
// against its checksum and its slot's sequence as it goes: DATA_LOSS when the slot was
// overwritten meanwhile or does not match; `sink`'s error ends it.
absl::Status ReadCheckpointPayload(const HeldCheckpoint& held, size_t chunk,
                                   const std::function<absl::Status(const void*, size_t)>& sink);
// The save's checksum, as its header states it.
absl::StatusOr<CheckpointSlotHeader> ReadCheckpointSlotHeader(const std::string& path);
// The slot at `path` when it holds a committed save whose payload matches its checksum.
// NOT_FOUND (nothing committed), DATA_LOSS (a torn or corrupted save), naming the path.
absl::StatusOr<HeldCheckpoint> VerifyCheckpointSlot(const std::string& path, int slot);

}  // namespace lockstep::worker
