// Device time by phase, for benchmarks: where a step's time goes, from CUDA events on one
// stream. Mark(phase) records an event; the time from it to the next mark is the phase's.
// After the stream is idle, Collect() adds each span to its phase's total and recycles the
// events. Off unless a benchmark attaches one (GpuModel::set_phase_timer): the models mark
// their phases through a null check, so training pays nothing.
//
// Not thread-safe; one stream.
#ifndef LOCKSTEP_KERNELS_PHASE_TIMER_H_
#define LOCKSTEP_KERNELS_PHASE_TIMER_H_

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace lockstep::kernels::cuda {

class PhaseTimer {
 public:
  explicit PhaseTimer(cudaStream_t stream) : stream_(stream) {}
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // The phase that starts now on the stream (null: none, the previous one ends here).
  void Mark(const char* phase);
  // Waits for the last mark's event, then adds the spans marked since the last Collect to
  // their phases; a phase still open then goes on into the next Collect's spans (idle time
  // included), so mark null when the timed work ends. The first error of any event call since
  // the last Collect, if any (those spans are then dropped).
  absl::Status Collect();
  // Milliseconds per phase, in the order the phases were first marked.
  const std::vector<std::pair<std::string, double>>& totals_ms() const { return totals_; }

 private:
  cudaStream_t stream_;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  std::vector<cudaEvent_t> free_;
  std::vector<std::pair<std::string, double>> totals_;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_PHASE_TIMER_H_
