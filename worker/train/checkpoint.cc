// Checkpoint files: a fixed header, then the parameters and the optimizer state as float32.
// The header's checksum covers the header fields and the payload (FNV-1a 64).
#include "worker/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"

namespace lockstep::worker {
namespace {

constexpr char kMagic[8] = {'L', 'S', 'C', 'K', 'P', 'T', '1', '\0'};

struct Header {
  char magic[8];
  int64_t step;
  uint64_t fingerprint;
  uint64_t num_params;
  uint64_t optimizer_floats;
  uint64_t checksum;  // of the header with checksum = 0, then the payload
};

uint64_t Checksum(Header header, const std::vector<float>& a, const std::vector<float>& b) {
  header.checksum = 0;
  std::string bytes(reinterpret_cast<const char*>(&header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  bytes.append(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float));
  return kernels::Fnv1a64(bytes.data(), bytes.size());
}

// Checkpoints in `dir` by step, newest first.
std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step = 0;
    if (name.rfind("step-", 0) == 0 && name.size() > 10 &&
        name.compare(name.size() - 5, 5, ".ckpt") == 0 &&
        absl::SimpleAtoi(name.substr(5, name.size() - 10), &step)) {
      out.emplace_back(step, entry.path().string());
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", strerror(errno)));
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("fsync ", path, ": ", strerror(errno)));
  return absl::OkStatus();
}

absl::StatusOr<CheckpointData> ReadCheckpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  Header h{};
  if (!in.read(reinterpret_cast<char*>(&h), sizeof(h))) {
    return absl::DataLossError(absl::StrCat(path, ": truncated header"));
  }
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a Lockstep checkpoint"));
  }
  if (h.num_params > (uint64_t{1} << 34) || h.optimizer_floats > (uint64_t{1} << 35)) {
    return absl::DataLossError(absl::StrCat(path, ": implausible sizes in header"));
  }
  CheckpointData data;
  data.step = h.step;
  data.fingerprint = h.fingerprint;
  data.params.resize(h.num_params);
  data.optimizer_state.resize(h.optimizer_floats);
  if (!in.read(reinterpret_cast<char*>(data.params.data()), h.num_params * sizeof(float)) ||
      !in.read(reinterpret_cast<char*>(data.optimizer_state.data()),
               h.optimizer_floats * sizeof(float))) {
    return absl::DataLossError(absl::StrCat(path, ": truncated"));
  }
  if (in.peek() != std::char_traits<char>::eof()) {
    return absl::DataLossError(absl::StrCat(path, ": trailing bytes"));
  }
  if (Checksum(h, data.params, data.optimizer_state) != h.checksum) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch"));
  }
  return data;
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, const CheckpointData& data, int keep) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("checkpoint dir ", dir, ": ", ec.message()));
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.step = data.step;
  h.fingerprint = data.fingerprint;
  h.num_params = data.params.size();
  h.optimizer_floats = data.optimizer_state.size();
  h.checksum = Checksum(h, data.params, data.optimizer_state);
  const std::string path = absl::StrFormat("%s/step-%012d.ckpt", dir, data.step);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out.write(reinterpret_cast<const char*>(data.params.data()),
              static_cast<std::streamsize>(data.params.size() * sizeof(float)));
    out.write(reinterpret_cast<const char*>(data.optimizer_state.data()),
              static_cast<std::streamsize>(data.optimizer_state.size() * sizeof(float)));
    if (!out.flush()) {
      std::filesystem::remove(tmp, ec);
      return absl::InternalError(absl::StrCat("writing ", tmp, " failed"));
    }
  }
  // The data must be on disk before the name says the checkpoint exists, and the rename must
  // be on disk before older checkpoints are deleted.
  if (absl::Status s = FsyncPath(tmp, O_RDONLY); !s.ok()) return s;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("rename to ", path, ": ", ec.message()));
  if (absl::Status s = FsyncPath(dir, O_RDONLY | O_DIRECTORY); !s.ok()) return s;
  const auto all = ListCheckpoints(dir);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < all.size(); ++i) {
    std::filesystem::remove(all[i].second, ec);
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointData> LoadLatestCheckpoint(const std::string& dir, uint64_t fingerprint,
                                                    size_t num_params, size_t optimizer_floats,
                                                    int64_t after_step,
                                                    std::vector<std::string>* skipped) {
  for (const auto& [step, path] : ListCheckpoints(dir)) {
    if (step <= after_step) break;
    absl::StatusOr<CheckpointData> data = ReadCheckpoint(path);
    std::string problem;
    if (!data.ok()) {
      problem = std::string(data.status().message());
    } else if (data->fingerprint != fingerprint || data->params.size() != num_params ||
               data->optimizer_state.size() != optimizer_floats) {
      problem = absl::StrCat(path, ": belongs to another model or optimizer");
    } else if (data->step != step) {
      problem = absl::StrCat(path, ": holds step ", data->step);
    } else {
      return data;
    }
    LOG(WARNING) << "skipping checkpoint: " << problem;
    if (skipped != nullptr) skipped->push_back(problem);
  }
  return absl::NotFoundError(absl::StrCat("no usable checkpoint after step ", after_step, " in ",
                                          dir));
}

}  // namespace lockstep::worker
