// Job stores: in memory, and one file per job.
#include "coordinator/store/job_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Writes `bytes` to `path` through a temporary file, so a reader sees the old or the new
// contents, never a mix, even across a crash.
absl::Status WriteAtomically(const std::string& dir, const std::string& path,
                             const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = ErrnoError("cannot write", tmp);
      ::close(fd);
      return s;
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status s = ErrnoError("cannot fsync", tmp);
    ::close(fd);
    return s;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoError("cannot rename to", path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return absl::OkStatus();
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
  return WriteAtomically(jobs_dir_, absl::StrCat(jobs_dir_, "/", job.job_id(), ".pb"), bytes);
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

}  // namespace lockstep::coordinator
