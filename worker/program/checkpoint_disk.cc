#include "worker/program/checkpoint_disk.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace lockstep::worker {
namespace {

constexpr char kExtension[] = ".lsckpt";

// JOB.step-STEP.rank-RANK.lsckpt -> (step, rank); false for any other name.
bool ParseName(absl::string_view name, const std::string& job_id, int64_t* step, int* rank) {
  if (!absl::ConsumePrefix(&name, absl::StrCat(job_id, ".step-")) ||
      !absl::ConsumeSuffix(&name, kExtension)) {
    return false;
  }
  const size_t dot = name.find(".rank-");
  if (dot == absl::string_view::npos) return false;
  return absl::SimpleAtoi(name.substr(0, dot), step) &&
         absl::SimpleAtoi(name.substr(dot + 6), rank) && *step > 0 && *rank >= 0;
}

}  // namespace

std::string DiskCheckpointPath(const std::string& dir, const std::string& job_id, int64_t step,
                               int rank) {
  return absl::StrCat(absl::StripSuffix(dir, "/"), "/", job_id, ".step-", step, ".rank-", rank,
                      kExtension);
}

std::vector<DiskCheckpoint> ListDiskCheckpoints(const std::string& dir,
                                                const std::string& job_id) {
  std::vector<DiskCheckpoint> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    DiskCheckpoint file;
    if (!ParseName(entry.path().filename().string(), job_id, &file.step, &file.rank)) continue;
    file.path = entry.path().string();
    const int fd = open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st;
    const bool sized = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    const CheckpointSlotHeader h = ReadCheckpointSlotHeader(fd);
    close(fd);
    if (!sized || !h.magic_ok || h.sequence == 0 || h.step != file.step ||
        static_cast<uint64_t>(st.st_size) != kCheckpointSlotHeaderBytes + h.payload_bytes) {
      continue;
    }
    files.push_back(std::move(file));
  }
  std::sort(files.begin(), files.end(), [](const DiskCheckpoint& a, const DiskCheckpoint& b) {
    return a.step != b.step ? a.step > b.step : a.rank < b.rank;
  });
  return files;
}

absl::StatusOr<std::string> PersistCheckpoint(const HeldCheckpoint& save, const std::string& dir,
                                              const std::string& job_id, int rank, int keep) {
  const std::string path = DiskCheckpointPath(dir, job_id, save.step, rank);
  // The slot's header as a file's: committed (sequence 1), the save's step, length, checksum.
  unsigned char header[kCheckpointSlotHeaderBytes] = {};
  std::memcpy(header, kCheckpointSlotMagic, 8);
  const uint64_t fields[4] = {1, static_cast<uint64_t>(save.step), save.payload_bytes,
                              save.checksum};
  std::memcpy(header + 8, fields, sizeof fields);
  LOCKSTEP_RETURN_IF_ERROR(WriteFileAtomically(
      path,
      [&](const AtomicWrite& write) -> absl::Status {
        LOCKSTEP_RETURN_IF_ERROR(write(header, sizeof header));
        return ReadCheckpointPayload(save, 4 << 20, write);
      },
      Durability::kDurable));
  // This rank's files of older steps than the newest `keep` the job has.
  std::set<int64_t, std::greater<int64_t>> steps;
  const std::vector<DiskCheckpoint> files = ListDiskCheckpoints(dir, job_id);
  for (const DiskCheckpoint& f : files) steps.insert(f.step);
  if (static_cast<int>(steps.size()) > keep) {
    const int64_t oldest_kept = *std::next(steps.begin(), std::max(keep, 1) - 1);
    for (const DiskCheckpoint& f : files) {
      if (f.rank == rank && f.step < oldest_kept) unlink(f.path.c_str());
    }
  }
  return path;
}

absl::StatusOr<HeldCheckpoint> RestoreFromDisk(CheckpointMemory* memory, const std::string& job_id,
                                               const DiskCheckpoint& file) {
  const int fd = open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "opening", file.path);
  absl::Cleanup close_fd = [fd] { close(fd); };
  const CheckpointSlotHeader h = ReadCheckpointSlotHeader(fd);
  if (!h.magic_ok || h.sequence == 0 || h.payload_bytes == 0) {
    return absl::DataLossError(absl::StrCat(file.path, ": not a committed checkpoint"));
  }
  absl::StatusOr<std::vector<std::string>> pair =
      memory->Slots(job_id, kCheckpointSlotHeaderBytes + static_cast<int64_t>(h.payload_bytes));
  if (!pair.ok()) return pair.status();
  absl::StatusOr<std::unique_ptr<SlotWriter>> writer =
      SlotWriter::Begin(*pair, h.step, h.payload_bytes, h.checksum);
  if (!writer.ok()) return writer.status();
  HeldCheckpoint saved;
  saved.step = h.step;
  saved.sequence = h.sequence;
  saved.payload_bytes = h.payload_bytes;
  saved.checksum = h.checksum;
  saved.path = file.path;
  const absl::Status read = ReadCheckpointPayload(
      saved, 4 << 20, [&](const void* data, size_t n) { return (*writer)->Append(data, n); });
  absl::StatusOr<HeldCheckpoint> held = read.ok() ? (*writer)->Commit() : read;
  if (!held.ok() && absl::IsDataLoss(held.status())) {
    // Never offered again; kept for a person to look at.
    const std::string refused = absl::StrCat(file.path, ".refused");
    if (rename(file.path.c_str(), refused.c_str()) == 0) {
      LOG(WARNING) << file.path << " does not match its checksum: renamed " << refused;
    }
    // The read's error names the file; the commit's names the slot.
    return read.ok() ? absl::DataLossError(absl::StrCat(file.path, ": ", held.status().message()))
                     : read;
  }
  return held;
}

void DiscardDiskAfter(const std::string& dir, const std::string& job_id, int64_t step) {
  for (const DiskCheckpoint& f : ListDiskCheckpoints(dir, job_id)) {
    if (f.step > step) unlink(f.path.c_str());
  }
}

}  // namespace lockstep::worker
