#include "coordinator/store/log_store.h"

#include <algorithm>

namespace lockstep::coordinator {

void LogStore::Append(const std::string& job_id, int64_t generation, int32_t rank,
                      const std::string& worker, const v1::ProgramOutput& output) {
  absl::MutexLock lock(&mu_);
  auto [it, added] = jobs_.try_emplace(job_id);
  JobLog& log = it->second;
  if (added) {
    recency_.push_front(job_id);
    log.recency = recency_.begin();
  } else {
    recency_.splice(recency_.begin(), recency_, log.recency);
  }
  for (const v1::OutputLine& line : output.lines()) {
    v1::LogLine& kept = log.lines.emplace_back();
    kept.set_sequence(log.next_sequence++);
    kept.set_generation(generation);
    kept.set_rank(rank);
    kept.set_worker(worker);
    kept.set_stderr(line.stderr());
    kept.set_text(line.text());
    kept.set_unix_ms(line.unix_ms());
    log.bytes += line.text().size();
  }
  while (log.bytes > limits_.bytes_per_job && !log.lines.empty()) {
    log.bytes -= log.lines.front().text().size();
    log.lines.pop_front();
  }
  while (jobs_.size() > limits_.jobs) {
    jobs_.erase(recency_.back());
    recency_.pop_back();
  }
}

v1::JobLogs LogStore::Read(const v1::GetJobLogsRequest& request) const {
  v1::JobLogs out;
  out.set_job_id(request.job_id());
  out.set_next_sequence(request.from_sequence());
  const int limit = request.max_lines() <= 0 ? 1000 : std::min(request.max_lines(), 10000);
  absl::MutexLock lock(&mu_);
  const auto it = jobs_.find(request.job_id());
  if (it == jobs_.end()) return out;
  const JobLog& log = it->second;
  out.set_first_sequence(log.lines.empty() ? log.next_sequence : log.lines.front().sequence());
  // Sequences are consecutive: the first wanted line is found by arithmetic.
  const int64_t from = std::max(request.from_sequence(), out.first_sequence());
  out.set_next_sequence(std::max(from, request.from_sequence()));
  for (size_t i = static_cast<size_t>(from - out.first_sequence()); i < log.lines.size(); ++i) {
    const v1::LogLine& line = log.lines[i];
    out.set_next_sequence(line.sequence() + 1);
    if (request.has_rank() && line.rank() != request.rank()) continue;
    if (request.generation() != 0 && line.generation() != request.generation()) continue;
    *out.add_lines() = line;
    if (out.lines_size() >= limit) break;
  }
  return out;
}

}  // namespace lockstep::coordinator
