// Job stores: in memory, and one file per job.
#include "coordinator/store/job_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return ErrnoStatus(errno, what, path);
}

std::string RandomClusterId() {
  std::random_device rd;
  return absl::StrFormat("%06x", rd() & 0xffffff);
}

}  // namespace

absl::Status InMemoryJobStore::Save(const v1::Job& job) {
  absl::MutexLock lock(&mu_);
  jobs_[job.job_id()] = job;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::Job>> InMemoryJobStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> jobs;
  for (const auto& [id, job] : jobs_) jobs.push_back(job);
  return jobs;
}

absl::StatusOr<std::unique_ptr<FileJobStore>> FileJobStore::Open(const std::string& dir) {
  const std::string jobs_dir = dir + "/jobs";
  std::error_code ec;
  std::filesystem::create_directories(jobs_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", jobs_dir, ": ", ec.message()));
  if (::access(jobs_dir.c_str(), W_OK) != 0) return ErrnoError("cannot write to", jobs_dir);
  return std::unique_ptr<FileJobStore>(new FileJobStore(jobs_dir));
}

absl::Status FileJobStore::Save(const v1::Job& job) {
  // Job ids are made by the core ("job-N"); anything else must not become a path.
  if (job.job_id().empty() || job.job_id().find_first_of("/\\.") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id '", job.job_id(), "' is not a file name"));
  }
  std::string bytes;
  if (!job.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("cannot serialize ", job.job_id()));
  }
  absl::MutexLock lock(&mu_);
  return WriteFileAtomically(absl::StrCat(jobs_dir_, "/", job.job_id(), ".pb"), bytes,
                             Durability::kDurable);
}

absl::StatusOr<std::vector<v1::Job>> FileJobStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> jobs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(jobs_dir_, ec)) {
    const std::string path = entry.path().string();
    if (!absl::EndsWith(path, ".pb")) continue;
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    v1::Job job;
    if (!in || !job.ParseFromString(bytes.str()) || job.job_id().empty() ||
        path != absl::StrCat(jobs_dir_, "/", job.job_id(), ".pb")) {
      LOG(WARNING) << "skipping job file " << path
                   << ": not a saved job (unreadable or corrupt); renamed to *.corrupt";
      std::filesystem::rename(path, path + ".corrupt", ec);
      continue;
    }
    jobs.push_back(std::move(job));
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list ", jobs_dir_, ": ", ec.message()));
  return jobs;
}

absl::StatusOr<std::string> ClusterId(const std::string& dir) {
  if (dir.empty()) return RandomClusterId();
  const std::string path = dir + "/cluster_id";
  std::ifstream in(path);
  std::string id;
  if (in >> id) {
    if (id.size() == 6 && std::all_of(id.begin(), id.end(), [](char c) {
          return absl::ascii_isxdigit(static_cast<unsigned char>(c));
        })) {
      return id;
    }
    return absl::DataLossError(absl::StrCat(path, ": not a cluster id (six hex digits): ", id));
  }
  id = RandomClusterId();
  LOCKSTEP_RETURN_IF_ERROR(WriteFileAtomically(path, id + "\n", Durability::kDurable));
  return id;
}

}  // namespace lockstep::coordinator
