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
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

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

  // The job's committed saves whose payload matches its checksum, newest first.
  std::vector<HeldCheckpoint> Held(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Marks every save of the job after `step` as not committed (a group that resumed from
  // `step` never restores a later state of another history).
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
    std::vector<std::string> paths;  // two, once made
    int64_t bytes = 0;
  };
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
// The slot at `path` when it holds a committed save whose payload matches its checksum.
// NOT_FOUND (nothing committed), DATA_LOSS (a torn or corrupted save), naming the path.
absl::StatusOr<HeldCheckpoint> VerifyCheckpointSlot(const std::string& path, int slot);

}  // namespace lockstep::worker
