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
  const cudaError_t error = error_;
  error_ = cudaSuccess;
  if (!marks_.empty()) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventSynchronize(marks_.back().second));
  }
  for (size_t i = 0; i + 1 < marks_.size(); ++i) {
    const char* phase = marks_[i].first;
    if (phase == nullptr) continue;
    float ms = 0;
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, marks_[i].second, marks_[i + 1].second));
    auto it = totals_.begin();
    while (it != totals_.end() && it->first != phase) ++it;
    if (it == totals_.end()) {
      totals_.emplace_back(phase, ms);
    } else {
      it->second += ms;
    }
  }
  // The last mark starts the next spans' chain only if it opened a phase.
  const bool keep_last = !marks_.empty() && marks_.back().first != nullptr;
  const size_t spent = marks_.size() - (keep_last ? 1 : 0);
  for (size_t i = 0; i < spent; ++i) free_.push_back(marks_[i].second);
  if (keep_last) {
    marks_.erase(marks_.begin(), marks_.end() - 1);
  } else {
    marks_.clear();
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(error);
  return absl::OkStatus();
}

}  // namespace lockstep::kernels::cuda
