// Program jobs' lockstep.torch saves on disk (ProgramSpec.persist_every_saves, docs/programs.md):
// every N saves a member's worker writes its newest save to the job's checkpoint_dir, in the
// background, as DIR/JOB.step-STEP.rank-RANK.lsckpt: the slot's own layout (the 4096-byte
// header, then the safetensors payload), checksummed, written atomically and durably, the
// job's newest keep_checkpoints steps kept. A group that cannot restore a step from memory
// restores the newest step every member can read there; a file that does not match its
// checksum is renamed *.refused and never offered again.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/program/checkpoint_memory.h"

namespace lockstep::worker {

struct DiskCheckpoint {
  int64_t step = 0;
  int rank = 0;
  std::string path;
};

std::string DiskCheckpointPath(const std::string& dir, const std::string& job_id, int64_t step,
                               int rank);

// The job's files in `dir` whose header says committed and whose size matches it (the payload
// is checked when restored), newest step first, then by rank.
std::vector<DiskCheckpoint> ListDiskCheckpoints(const std::string& dir, const std::string& job_id);

// Writes `save` as rank `rank`'s file of its step, then removes that rank's files of all but
// the job's newest `keep` steps. Returns the path. Errors name the file and the system's reason.
absl::StatusOr<std::string> PersistCheckpoint(const HeldCheckpoint& save, const std::string& dir,
                                              const std::string& job_id, int rank, int keep);

// Copies `file` into the job's own slots, checked end to end. DATA_LOSS when it does not match
// its checksum (the file is then renamed *.refused).
absl::StatusOr<HeldCheckpoint> RestoreFromDisk(CheckpointMemory* memory, const std::string& job_id,
                                               const DiskCheckpoint& file);

// Removes the job's files of steps after `step` (another history's).
void DiscardDiskAfter(const std::string& dir, const std::string& job_id, int64_t step);

}  // namespace lockstep::worker
