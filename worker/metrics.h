// A worker's Prometheus metrics: every step's time and its split (forward/backward, exposed
// communication, update), throughput, training loss, bytes summed with the group, aborted
// runs, memory, and the job and rank the worker serves. Labels stay low-cardinality: the job id
// and rank are labels of one gauge, never step or generation numbers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "lockstep/v1/worker.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "worker/step/step_engine.h"

namespace lockstep::worker {

class WorkerMetrics {
 public:
  WorkerMetrics(prometheus::Registry& registry, const std::string& name,
                const std::string& device);

  // A generation starts training on this worker: it serves `job_id` as `rank` of `world`, and
  // each step hands `reduced_bytes` to the group's sum.
  void BeginRun(const std::string& job_id, int rank, int world, int64_t reduced_bytes);
  // Every step (the training thread).
  void ObserveStep(const StepResult& step);
  void ObserveProgress(const v1::ProgressReport& progress);
  // A program's report (lockstep.torch.report): `new_steps` steps since its previous one, its
  // loss when it gave one, its throughput.
  void ObserveProgramReport(const v1::ProgressReport& progress, int64_t new_steps, bool has_loss);
  // The run ended; `aborted`: the coordinator or a peer's failure stopped it.
  void EndRun(bool aborted);

  // Memory, read at scrape time (for a ScrapeCollector).
  static std::vector<prometheus::MetricFamily> MemoryFamilies();

 private:
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& exposed_comm_seconds_;
  prometheus::Family<prometheus::Counter>& phase_seconds_;
  prometheus::Counter& compute_total_;
  prometheus::Counter& exposed_comm_total_;
  prometheus::Counter& update_total_;
  prometheus::Counter& steps_;
  prometheus::Counter& reduced_bytes_total_;
  prometheus::Gauge& reduced_bytes_per_step_;
  prometheus::Gauge& loss_;
  prometheus::Gauge& samples_per_second_;
  prometheus::Gauge& tokens_per_second_;
  prometheus::Counter& runs_;
  prometheus::Counter& aborts_;
  prometheus::Family<prometheus::Gauge>& serving_;

  absl::Mutex mu_;
  prometheus::Gauge* serving_gauge_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t reduced_bytes_ = 0;  // written before the run's steps, read by them (same thread)
};

}  // namespace lockstep::worker
