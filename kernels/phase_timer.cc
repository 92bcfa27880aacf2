#include "kernels/phase_timer.h"

#include <cuda_runtime_api.h>

#include "kernels/gpu_check.h"

namespace lockstep::kernels::cuda {

PhaseTimer::~PhaseTimer() {
  for (auto& [phase, event] : marks_) cudaEventDestroy(event);
  for (cudaEvent_t event : free_) cudaEventDestroy(event);
}

void PhaseTimer::Mark(const char* phase) {
  cudaEvent_t event = nullptr;
  if (!free_.empty()) {
    event = free_.back();
    free_.pop_back();
  } else if (cudaError_t e = cudaEventCreate(&event); e != cudaSuccess) {
    if (error_ == cudaSuccess) error_ = e;
    return;
  }
  if (cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
    if (error_ == cudaSuccess) error_ = e;
    free_.push_back(event);
    return;
  }
  marks_.emplace_back(phase, event);
}

absl::Status PhaseTimer::Collect() {
  absl::Status status =
      error_ == cudaSuccess ? absl::OkStatus() : GpuStatus(error_, "PhaseTimer::Mark", __FILE__,
                                                           __LINE__);
  error_ = cudaSuccess;
  if (status.ok() && !marks_.empty()) {
    status = GpuStatus(cudaEventSynchronize(marks_.back().second), "cudaEventSynchronize",
                       __FILE__, __LINE__);
  }
  for (size_t i = 0; status.ok() && i + 1 < marks_.size(); ++i) {
    const char* phase = marks_[i].first;
    if (phase == nullptr) continue;
    float ms = 0;
    status = GpuStatus(cudaEventElapsedTime(&ms, marks_[i].second, marks_[i + 1].second),
                       "cudaEventElapsedTime", __FILE__, __LINE__);
    if (!status.ok()) break;
    auto it = totals_.begin();
    while (it != totals_.end() && it->first != phase) ++it;
    if (it == totals_.end()) {
      totals_.emplace_back(phase, ms);
    } else {
      it->second += ms;
    }
  }
  // The last mark starts the next spans' chain only if it opened a phase (and all went well:
  // after an error every span is dropped, never counted twice).
  const bool keep_last = status.ok() && !marks_.empty() && marks_.back().first != nullptr;
  const size_t spent = marks_.size() - (keep_last ? 1 : 0);
  for (size_t i = 0; i < spent; ++i) free_.push_back(marks_[i].second);
  marks_.erase(marks_.begin(), marks_.begin() + spent);
  return status;
}

}  // namespace lockstep::kernels::cuda
