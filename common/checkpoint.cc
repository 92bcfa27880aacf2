// Checkpoint files: a fixed header, then the parameters and the optimizer state as float32.
// The header's checksum covers the header fields and the payload (FNV-1a 64).
#include "common/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "common/hash.h"

namespace lockstep {
namespace {

// Version 3 adds the model manifest (tensor names, shapes, config) after the header; version 2
// files are still read (without one).
constexpr char kMagic[8] = {'L', 'S', 'C', 'K', 'P', 'T', '3', '\0'};
constexpr char kMagicV2[8] = {'L', 'S', 'C', 'K', 'P', 'T', '2', '\0'};
constexpr char kOldMagic[8] = {'L', 'S', 'C', 'K', 'P', 'T', '1', '\0'};
// Bounds on what a header may announce, far above any model this trains (2^34 floats are 64 GiB),
// so that a damaged count is named as such rather than read as a size.
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 26;
constexpr uint64_t kMaxParams = uint64_t{1} << 34;
constexpr uint64_t kMaxOptimizerFloats = uint64_t{1} << 35;
constexpr char kStepInfix[] = ".step-";
constexpr char kSuffix[] = ".ckpt";

struct Header {
  char magic[8];
  int64_t step;
  char job_id[64];
  uint64_t training_fingerprint;
  uint64_t model_fingerprint;
  uint64_t num_params;
  uint64_t optimizer_floats;
  uint64_t checksum;  // of the header with checksum = 0, then the payload
};
// Version 3: after the header, the manifest's length and bytes (a serialized ModelManifest).
struct ManifestLength {
  uint64_t bytes;
};

uint64_t Checksum(Header header, const std::string& manifest, const std::vector<float>& a,
                  const std::vector<float>& b) {
  header.checksum = 0;
  std::string bytes(reinterpret_cast<const char*>(&header), sizeof(header));
  if (std::memcmp(header.magic, kMagic, sizeof(kMagic)) == 0) {
    const ManifestLength length{manifest.size()};
    bytes.append(reinterpret_cast<const char*>(&length), sizeof(length));
    bytes += manifest;
  }
  bytes.append(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  bytes.append(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float));
  return Fnv1a64(bytes.data(), bytes.size());
}

struct Listed {
  int64_t step;
  std::string job_id;
  std::string path;
};

// Checkpoint files in `dir` ("JOB.step-N.ckpt"), of `job_id` only unless it is empty, newest
// step first.
std::vector<Listed> ListCheckpoints(const std::string& dir, const std::string& job_id) {
  std::vector<Listed> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const size_t infix = name.rfind(kStepInfix);
    if (infix == std::string::npos || infix == 0 || !absl::EndsWith(name, kSuffix)) continue;
    const std::string owner = name.substr(0, infix);
    const size_t digits = infix + sizeof(kStepInfix) - 1;
    int64_t step = 0;
    if (!absl::SimpleAtoi(name.substr(digits, name.size() - digits - (sizeof(kSuffix) - 1)),
                          &step)) {
      continue;
    }
    if (!job_id.empty() && owner != job_id) continue;
    out.push_back({step, owner, entry.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const Listed& a, const Listed& b) {
    return a.step != b.step ? a.step > b.step : a.path < b.path;
  });
  return out;
}

}  // namespace

absl::StatusOr<CheckpointData> ReadCheckpoint(const std::string& path) {
  // The file is untrusted input (lockstepctl export reads whatever it is given): every length in
  // it is checked against the bytes the file actually holds before anything is allocated, so a
  // small crafted file cannot ask for gigabytes, and no sum or product below can wrap.
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  if (!std::filesystem::is_regular_file(status)) {
    // A directory, a FIFO or a device (/dev/zero would never end) is not a checkpoint.
    return absl::DataLossError(absl::StrCat(path, ": not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  // The size of the file opened, not of whatever the name pointed at a moment ago.
  if (!in.seekg(0, std::ios::end)) return absl::DataLossError(absl::StrCat(path, ": unreadable"));
  const std::streamoff end = in.tellg();
  if (end < 0 || !in.seekg(0, std::ios::beg)) {
    return absl::DataLossError(absl::StrCat(path, ": unreadable"));
  }
  const uint64_t file_size = static_cast<uint64_t>(end);
  Header h{};
  if (file_size < sizeof(h) || !in.read(reinterpret_cast<char*>(&h), sizeof(h))) {
    return absl::DataLossError(absl::StrCat(path, ": truncated header (", file_size,
                                            " bytes, a header is ", sizeof(h), ")"));
  }
  if (std::memcmp(h.magic, kOldMagic, sizeof(kOldMagic)) == 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": written by an older Lockstep (no job identity); not loaded"));
  }
  const bool v3 = std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0;
  if (!v3 && std::memcmp(h.magic, kMagicV2, sizeof(kMagicV2)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a Lockstep checkpoint"));
  }
  if (h.job_id[sizeof(h.job_id) - 1] != '\0') {
    return absl::DataLossError(absl::StrCat(path, ": implausible header (job id not terminated)"));
  }
  uint64_t left = file_size - sizeof(h);  // bytes after what has been read so far
  std::string manifest;
  if (v3) {
    ManifestLength length{};
    if (left < sizeof(length) || !in.read(reinterpret_cast<char*>(&length), sizeof(length))) {
      return absl::DataLossError(absl::StrCat(path, ": truncated model manifest length"));
    }
    left -= sizeof(length);
    if (length.bytes > kMaxManifestBytes) {
      return absl::DataLossError(absl::StrCat(path, ": implausible model manifest of ",
                                              length.bytes, " bytes (at most ", kMaxManifestBytes,
                                              ")"));
    }
    if (length.bytes > left) {
      return absl::DataLossError(absl::StrCat(path, ": truncated model manifest (", length.bytes,
                                              " bytes announced, ", left, " left in the file)"));
    }
    manifest.resize(length.bytes);
    if (!in.read(manifest.data(), static_cast<std::streamsize>(manifest.size()))) {
      return absl::DataLossError(absl::StrCat(path, ": truncated model manifest"));
    }
    left -= length.bytes;
  }
  if (h.num_params > kMaxParams || h.optimizer_floats > kMaxOptimizerFloats) {
    return absl::DataLossError(absl::StrCat(path, ": implausible header (", h.num_params,
                                            " parameters, ", h.optimizer_floats,
                                            " optimizer values)"));
  }
  // Both counts are below 2^36 here, so neither the sum nor the byte count can overflow.
  const uint64_t payload = (h.num_params + h.optimizer_floats) * sizeof(float);
  if (payload > left) {
    return absl::DataLossError(absl::StrCat(path, ": truncated (the header announces ", payload,
                                            " bytes of values, the file holds ", left, ")"));
  }
  if (payload < left) {
    return absl::DataLossError(
        absl::StrCat(path, ": trailing bytes (", left - payload, " after the values)"));
  }
  CheckpointData data;
  data.step = h.step;
  data.job_id = h.job_id;
  data.training_fingerprint = h.training_fingerprint;
  data.model_fingerprint = h.model_fingerprint;
  data.manifest = std::move(manifest);
  data.params.resize(h.num_params);
  data.optimizer_state.resize(h.optimizer_floats);
  if (!in.read(reinterpret_cast<char*>(data.params.data()),
               static_cast<std::streamsize>(h.num_params * sizeof(float))) ||
      !in.read(reinterpret_cast<char*>(data.optimizer_state.data()),
               static_cast<std::streamsize>(h.optimizer_floats * sizeof(float)))) {
    // The file shrank while it was read.
    return absl::DataLossError(absl::StrCat(path, ": truncated"));
  }
  if (in.peek() != std::char_traits<char>::eof()) {
    // ... or grew.
    return absl::DataLossError(absl::StrCat(path, ": trailing bytes"));
  }
  if (Checksum(h, data.manifest, data.params, data.optimizer_state) != h.checksum) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch"));
  }
  return data;
}

absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const CheckpointData& data,
                                            int keep) {
  if (data.job_id.empty() || data.job_id.size() >= sizeof(Header::job_id) ||
      data.job_id.find_first_of("/\\") != std::string::npos || data.job_id[0] == '.') {
    return absl::InvalidArgumentError(
        absl::StrCat("job id \"", data.job_id, "\" cannot name a checkpoint file"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "creating checkpoint directory", dir);
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.step = data.step;
  std::memcpy(h.job_id, data.job_id.data(), data.job_id.size());
  h.training_fingerprint = data.training_fingerprint;
  h.model_fingerprint = data.model_fingerprint;
  h.num_params = data.params.size();
  h.optimizer_floats = data.optimizer_state.size();
  h.checksum = Checksum(h, data.manifest, data.params, data.optimizer_state);
  const ManifestLength length{data.manifest.size()};
  const std::string path =
      absl::StrFormat("%s/%s%s%012d%s", dir, data.job_id, kStepInfix, data.step, kSuffix);
  // Durable: the data are on disk before the name says the checkpoint exists, and the rename
  // is on disk before older checkpoints are deleted.
  LOCKSTEP_RETURN_IF_ERROR(WriteFileAtomically(
      path,
      {absl::string_view(reinterpret_cast<const char*>(&h), sizeof(h)),
       absl::string_view(reinterpret_cast<const char*>(&length), sizeof(length)), data.manifest,
       absl::string_view(reinterpret_cast<const char*>(data.params.data()),
                         data.params.size() * sizeof(float)),
       absl::string_view(reinterpret_cast<const char*>(data.optimizer_state.data()),
                         data.optimizer_state.size() * sizeof(float))},
      Durability::kDurable));
  const std::vector<Listed> mine = ListCheckpoints(dir, data.job_id);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < mine.size(); ++i) {
    std::filesystem::remove(mine[i].path, ec);
  }
  return path;
}

absl::StatusOr<CheckpointData> LoadLatestCheckpoint(const std::string& dir,
                                                    const std::string& job_id,
                                                    uint64_t training_fingerprint,
                                                    size_t num_params, size_t optimizer_floats,
                                                    int64_t after_step, int64_t max_step,
                                                    std::vector<std::string>* skipped) {
  for (const Listed& c : ListCheckpoints(dir, job_id)) {
    if (c.step <= after_step) break;
    std::string problem;
    if (c.step > max_step) {
      problem =
          absl::StrCat(c.path, ": step ", c.step, " is beyond the job's ", max_step, " steps");
    } else if (absl::StatusOr<CheckpointData> data = ReadCheckpoint(c.path); !data.ok()) {
      problem = std::string(data.status().message());
    } else if (data->job_id != job_id) {
      problem = absl::StrCat(c.path, ": written by job ", data->job_id);
    } else if (data->training_fingerprint != training_fingerprint) {
      problem = absl::StrCat(c.path, ": written for another spec of ", job_id);
    } else if (data->params.size() != num_params ||
               data->optimizer_state.size() != optimizer_floats) {
      problem = absl::StrCat(c.path, ": holds another model or optimizer");
    } else if (data->step != c.step) {
      problem = absl::StrCat(c.path, ": holds step ", data->step);
    } else {
      return *std::move(data);
    }
    LOG(WARNING) << "skipping checkpoint: " << problem;
    if (skipped != nullptr) skipped->push_back(problem);
  }
  return absl::NotFoundError(
      absl::StrCat("no usable checkpoint of ", job_id, " after step ", after_step, " in ", dir));
}

absl::StatusOr<CheckpointData> LoadCheckpointForInit(const std::string& path,
                                                     uint64_t model_fingerprint, size_t num_params,
                                                     size_t optimizer_floats) {
  auto matches = [&](const CheckpointData& data) {
    return data.model_fingerprint == model_fingerprint && data.params.size() == num_params &&
           (optimizer_floats == kAnyOptimizerState ||
            data.optimizer_state.size() == optimizer_floats);
  };
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    for (const Listed& c : ListCheckpoints(path, "")) {
      absl::StatusOr<CheckpointData> data = ReadCheckpoint(c.path);
      if (!data.ok()) {
        LOG(WARNING) << "init_from_checkpoint: skipping " << data.status().message();
      } else if (!matches(*data)) {
        LOG(WARNING) << "init_from_checkpoint: skipping " << c.path << ": another model";
      } else {
        LOG(INFO) << "init_from_checkpoint: " << c.path << " (job " << data->job_id << ", step "
                  << data->step << ")";
        return data;
      }
    }
    return absl::NotFoundError(absl::StrCat("init_from_checkpoint.path: ", path,
                                            " holds no valid checkpoint of this model"));
  }
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(
        absl::StrCat("init_from_checkpoint.path: ", path, " does not exist"));
  }
  absl::StatusOr<CheckpointData> data = ReadCheckpoint(path);
  if (!data.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("init_from_checkpoint.path: ", data.status().message()));
  }
  if (!matches(*data)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "init_from_checkpoint.path: ", path, " is a checkpoint of another model (",
        data->params.size(), " parameters, ", data->optimizer_state.size(),
        " optimizer values; this job's model has ", num_params, " and ", optimizer_floats, ")"));
  }
  return data;
}

}  // namespace lockstep
